"""What the chat and completion endpoints share: admission (model name, context length, queue), adding requests,
waiting for them while watching for a client that hangs up, OpenAI's logprob layouts, usage, SSE frames and the
one log line per request."""
from __future__ import annotations
import asyncio, dataclasses, json, logging, time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from starlette.requests import Request
from tinyvllm.engine.async_llm import AsyncLLM, RequestStream
from tinyvllm.entrypoints.openai.protocol import APIError
from tinyvllm.outputs import Logprob, RequestOutput
from tinyvllm.sampling_params import RequestOutputKind, SamplingParams

log = logging.getLogger("tinyvllm.server")
LOGPROB_FLOOR = -9999.0   # JSON has no -Infinity: a banned token's logprob is reported as this (as vLLM does)


@dataclass(frozen=True)
class ServerSettings:
  served_model_name: str
  model_path: str
  api_key: str | None = None
  max_waiting_requests: int | None = None   # None: no limit
  chat_template: str | None = None           # overrides the model's
  tool_call_parser: str | None = None        # tools.FORMATS name; None: the one the chat template writes


class OpenAIServing:
  def __init__(self, engine: AsyncLLM, settings: ServerSettings):
    self.engine, self.settings = engine, settings
    self.tokenizer = engine.get_tokenizer()

  # ---- admission ----

  def render_chat(self, body, tools: list[dict] | None = None, tool_format=None) -> dict:
    """A chat body's messages (and `tools`) through the chat template (the server's --chat-template, else the
    model's), as {"prompt", "prompt_token_ids"}; a message or template the renderer refuses is a 400 on `messages`.
    Tools, and tool calls and results in the history, are never dropped: a template that does not read them is a
    400 saying so (unless --tool-call-parser json asks for the generic format, described in a system message)."""
    from tinyvllm.tools import ToolTemplateError, prepare_chat
    template = self.settings.chat_template or self.tokenizer.chat_template or ""
    try: messages, extra = prepare_chat(body.messages, tools, template, generic=self.settings.tool_call_parser == "json")
    except ToolTemplateError as e: raise APIError(400, f"{e} (--chat-template)", param=e.field) from None
    kwargs = dict(body.chat_template_kwargs or {}) | extra
    try:
      return self.engine.input_processor.render_chat(
        messages, add_generation_prompt=body.add_generation_prompt, continue_final_message=body.continue_final_message,
        chat_template=self.settings.chat_template, template_kwargs=kwargs or None)
    except ValueError as e: raise APIError(400, str(e), param="messages") from None

  def check_model(self, name: str | None) -> None:
    if name is not None and name != self.settings.served_model_name:
      raise APIError(404, f"the model '{name}' does not exist; this server serves '{self.settings.served_model_name}'",
                     param="model", code="model_not_found")

  def check_length(self, prompt_tokens: int, max_tokens: int | None, prompt_field: str, max_tokens_field: str) -> None:
    limit = self.engine.max_model_len
    if prompt_tokens >= limit:
      raise APIError(400, f"the prompt has {prompt_tokens} tokens, but this model's context length (max_model_len) is "
                          f"{limit}: it must be shorter to leave room for at least one generated token", param=prompt_field,
                     code="context_length_exceeded")
    if max_tokens is not None and prompt_tokens + max_tokens > limit:
      raise APIError(400, f"the prompt ({prompt_tokens} tokens) plus {max_tokens_field}={max_tokens} is {prompt_tokens + max_tokens} "
                          f"tokens, more than this model's context length (max_model_len) of {limit}; lower "
                          f"{max_tokens_field} or shorten the prompt", param=max_tokens_field, code="context_length_exceeded")

  async def check_constraint(self, params: SamplingParams, field: str | None) -> None:
    """Compile the request's output constraint now, so a schema, regex or grammar llguidance refuses is a 400 naming
    the field the client used. On a worker thread: a large schema takes milliseconds to compile, and the event loop
    keeps streaming meanwhile. The engine's input processing then finds it compiled (a cache hit)."""
    if params.structured_outputs is None: return
    try: await asyncio.to_thread(self.engine.input_processor.grammars.compile, params.structured_outputs)
    except ValueError as e:
      message = str(e)
      if field == "response_format": message = message.replace("structured_outputs.json", "response_format.json_schema.schema", 1)
      if field == "tools":   # the grammar of a forced call: what failed is a tool's parameters schema
        message = "tools: a function's parameters schema cannot be compiled: " + message.split(": ", 2)[-1]
      raise APIError(400, message, param=field) from None

  async def add_requests(self, request_id: str, prompts: list[dict], params: SamplingParams, prompt_field: str,
                         stream: bool) -> list[RequestStream | RunningTotals]:
    """Queue one engine request per prompt (ids `request_id`, or `request_id-i` for several). All or none: a
    refused one aborts those already added. The engine never snapshots a running request's whole text and tokens
    (CUMULATIVE outputs, which cost ~30 us a request a step at 16,000 tokens): a request that does not `stream` asks
    for its final output alone, one that streams for what is new at each step, added up here (`RunningTotals`)."""
    params = dataclasses.replace(params, output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY)
    limit = self.settings.max_waiting_requests
    if limit is not None and self.engine.num_waiting + len(prompts) > limit:
      raise APIError(503, f"the server is busy: {self.engine.num_waiting} requests are waiting (--max-waiting-requests "
                          f"{limit}); retry later", code="queue_full", type="server_error")
    streams: list[RequestStream] = []
    try:
      for i, prompt in enumerate(prompts):
        rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
        streams.append(self.engine.add_request(rid, prompt, params))
    except (ValueError, TypeError) as e:
      for s in streams: await s.aclose()
      raise APIError(400, str(e), param=prompt_field) from None
    except RuntimeError as e:   # the engine is not running
      raise APIError(503, str(e), type="server_error") from None
    return [RunningTotals(s) for s in streams] if stream else streams

  # ---- waiting ----

  async def final_outputs(self, request: Request, streams: list[RequestStream]) -> list[RequestOutput] | None:
    """The final output of every stream, or None if the client hung up first (its requests are then aborted)."""
    async def last(stream: RequestStream) -> RequestOutput:
      out = None
      async for out in stream: pass
      return out
    work = asyncio.ensure_future(asyncio.gather(*(last(s) for s in streams)))
    gone = asyncio.ensure_future(wait_for_disconnect(request))
    try:
      await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
      if work.done(): return work.result()
      work.cancel()
      return None
    finally:
      gone.cancel()
      for s in streams: await s.aclose()

  # ---- response pieces ----

  def chat_logprobs(self, token_ids: list[int], logprobs: list[dict[int, Logprob]], top_n: int) -> list[dict]:
    """Chat's layout: per token {token, logprob, bytes, top_logprobs: [{token, logprob, bytes}] of the top_n}."""
    def entry(token_id: int, lp: Logprob) -> dict:
      return {"token": lp.decoded_token, "logprob": max(lp.logprob, LOGPROB_FLOOR), "bytes": list(self.tokenizer.piece(token_id, False))}
    out = []
    for token_id, lps in zip(token_ids, logprobs):
      top = sorted(((t, lp) for t, lp in lps.items() if lp.rank <= top_n), key=lambda x: x[1].rank)[:top_n]
      out.append(entry(token_id, lps[token_id]) | {"top_logprobs": [entry(t, lp) for t, lp in top]})
    return out

  def completion_logprobs(self, token_ids: list[int], logprobs: list[dict[int, Logprob] | None], top_n: int,
                          text_offset: int) -> dict:
    """Completions' layout: parallel lists tokens / token_logprobs / top_logprobs / text_offset. An entry that is
    None (the first prompt token, which nothing predicts) has logprob None. top_logprobs holds the top_n likeliest
    and the token itself."""
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for token_id, lps in zip(token_ids, logprobs):
      text = self.tokenizer.token_to_str(token_id)
      tokens.append(text)
      offsets.append(text_offset)
      text_offset += len(text)
      if lps is None:
        token_logprobs.append(None)
        tops.append(None)
        continue
      token_logprobs.append(max(lps[token_id].logprob, LOGPROB_FLOOR))
      top = sorted((lp for lp in lps.values() if lp.rank <= top_n), key=lambda lp: lp.rank)[:top_n]
      best: dict[str, float] = {}   # two tokens may read the same (e.g. lone bytes as U+FFFD): keep the likelier
      for lp in top: best.setdefault(lp.decoded_token, max(lp.logprob, LOGPROB_FLOOR))
      if top_n:   # OpenAI (and vLLM) always list the sampled token too: up to top_n + 1 entries
        best.setdefault(lps[token_id].decoded_token, max(lps[token_id].logprob, LOGPROB_FLOOR))
      tops.append(best)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}

  @staticmethod
  def prompt_logprobs_json(out: RequestOutput) -> list | None:
    """vLLM's extra `prompt_logprobs`: per prompt token None or {token id: {logprob, rank, decoded_token}}."""
    if out.prompt_logprobs is None: return None
    return [None if lps is None else {str(t): {"logprob": max(lp.logprob, LOGPROB_FLOOR), "rank": lp.rank,
                                               "decoded_token": lp.decoded_token} for t, lp in lps.items()}
            for lps in out.prompt_logprobs]

  @staticmethod
  def usage(outputs: list[RequestOutput]) -> dict:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(o.num_cached_tokens for o in outputs)}}

  @staticmethod
  def failure(outputs: list[RequestOutput]) -> str | None:
    return next((o.error for o in outputs if o.error), None)

  def log_request(self, request_id: str, endpoint: str, started: float, outputs: list[RequestOutput | None],
                  status: str) -> None:
    """One line per request: what happened, how many tokens, how fast."""
    done = [o for o in outputs if o is not None]
    prompt = sum(len(o.prompt_token_ids) for o in done)
    generated = sum(len(c.token_ids) for o in done for c in o.outputs)
    ttfts = [o.metrics.time_to_first_token for o in done if o.metrics.time_to_first_token is not None]
    ttft = f"{min(ttfts):.3f}s" if ttfts else "-"
    log.info("%s %s %s: %d prompt + %d output tokens, TTFT %s, %.3fs", request_id, endpoint, status, prompt, generated,
             ttft, time.time() - started)


class RunningTotals:
  """A streamed request's outputs as running totals: the engine's deltas added to one RequestOutput, in place, which
  the stream writers read as they would cumulative snapshots (whole text, tokens and logprobs so far). The total
  changes only when the next delta is taken, so whoever reads it takes them (`merge_streams` queues the deltas, not
  the total). Closing it aborts the request, as closing its stream does."""
  def __init__(self, stream: RequestStream):
    self.stream, self.total = stream, None

  def __aiter__(self): return self

  async def __anext__(self) -> RequestOutput: return self.take(await self.stream.__anext__())

  def take(self, delta: RequestOutput) -> RequestOutput:
    """Add the request's next delta; returns the total."""
    if self.total is None: self.total = delta
    else: self.total.add(delta)
    return self.total

  async def aclose(self) -> None: await self.stream.aclose()


async def wait_for_disconnect(request: Request) -> None:
  """Returns when the client has gone (the body is read by then, so the next message is the disconnect)."""
  while (await request.receive())["type"] != "http.disconnect": pass


async def merge_streams(streams: list[RunningTotals]) -> AsyncIterator[tuple[int, RequestOutput]]:
  """(stream index, output) from several streams as they arrive. Closing the merged iterator (a client gone)
  closes every stream, which aborts their requests."""
  if len(streams) == 1:
    try:
      async for out in streams[0]: yield 0, out
    finally: await streams[0].aclose()   # closed at a yield (a client gone while we sent): abort
    return
  queue: asyncio.Queue = asyncio.Queue()
  # the pumps queue each stream's deltas; a total is added to only here, between the caller's reads of it (a total
  # the pumps advanced while the caller was sending would change under it: text sent twice or never)
  async def pump(i: int, stream: RunningTotals) -> None:
    try:
      async for delta in stream.stream: await queue.put((i, delta))
    finally: await queue.put((i, None))
  tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
  try:
    open_streams = len(streams)
    while open_streams:
      i, delta = await queue.get()
      if delta is None: open_streams -= 1
      else: yield i, streams[i].take(delta)
  finally:
    for t in tasks: t.cancel()
    for s in streams: await s.aclose()


def sse(data: dict | str) -> str:
  """One server-sent event frame."""
  return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"
