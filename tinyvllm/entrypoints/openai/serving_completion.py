"""POST /v1/completions: one engine request per prompt (a string, token ids, or a list of either), n completions
each; choice `index` is prompt_index * n + completion_index, as OpenAI numbers them."""
from __future__ import annotations
import time, uuid
from collections.abc import AsyncIterator
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from tinyvllm.engine.input_processor import token_ids
from tinyvllm.entrypoints.openai.protocol import APIError, CompletionRequest, parse_body
from tinyvllm.entrypoints.openai.serving import OpenAIServing, RunningTotals, merge_streams, sse
from tinyvllm.outputs import CompletionOutput, RequestOutput


class OpenAIServingCompletion(OpenAIServing):
  async def create(self, request: Request) -> Response:
    body: CompletionRequest = parse_body(await request.body(), CompletionRequest)
    body.check_fields()
    self.check_model(body.model)
    if body.best_of is not None and body.best_of != body.n:
      raise APIError(400, "best_of other than n is not supported by this server yet", param="best_of", code="unsupported_field")
    if body.logprobs is not None and not 0 <= body.logprobs <= 20:
      raise APIError(400, f"logprobs must be in [0, 20], got {body.logprobs}", param="logprobs")
    prompts = self._prompts(body)
    for p in prompts: self.check_length(len(p["prompt_token_ids"]), body.max_tokens, "prompt", "max_tokens")
    prompt_logprobs = body.logprobs if body.echo and body.logprobs is not None else body.prompt_logprobs
    params = body.sampling_params(body.max_tokens, body.logprobs, prompt_logprobs)
    await self.check_constraint(params, body.constraint_field)
    request_id, started = f"cmpl-{uuid.uuid4().hex}", time.time()
    streams = await self.add_requests(request_id, prompts, params, "prompt", bool(body.stream))
    if body.stream:
      return StreamingResponse(self._stream(body, request_id, started, streams), media_type="text/event-stream")
    finals = await self.final_outputs(request, streams)
    if finals is None:
      self.log_request(request_id, "completion", started, [], "client disconnected")
      return Response(status_code=499)
    error = self.failure(finals)
    self.log_request(request_id, "completion", started, finals, f"error: {error}" if error else "ok")
    if error: raise APIError(500, f"generation failed: {error}")
    choices = [self._choice(body, i, out, c, prefix_done=False) for i, out in enumerate(finals) for c in out.outputs]
    response = {"id": request_id, "object": "text_completion", "created": int(started), "model": self.settings.served_model_name,
                "choices": choices, "usage": self.usage(finals), "system_fingerprint": None}
    if body.prompt_logprobs is not None: response["prompt_logprobs"] = [self.prompt_logprobs_json(o) for o in finals]
    return JSONResponse(response)

  def _prompts(self, body: CompletionRequest) -> list[dict]:
    """Each prompt as {"prompt", "prompt_token_ids"}: text is tokenized here (with BOS when add_special_tokens)."""
    raw = body.prompt
    items = [raw] if isinstance(raw, str) or (raw and isinstance(raw[0], int)) else list(raw)
    if not items: raise APIError(400, "prompt must not be empty", param="prompt")
    prompts = []
    for item in items:
      if isinstance(item, str):
        prompts.append({"prompt": item, "prompt_token_ids": self.tokenizer.encode(item, add_special_tokens=body.add_special_tokens)})
      else:
        ids = token_ids(item)
        prompts.append({"prompt": self.tokenizer.decode(ids, skip_special_tokens=False), "prompt_token_ids": ids})
      if not prompts[-1]["prompt_token_ids"]: raise APIError(400, "a prompt is empty: it has no tokens", param="prompt")
    return prompts

  def _choice(self, body: CompletionRequest, prompt_index: int, out: RequestOutput, c: CompletionOutput, *,
              prefix_done: bool, text_from: int = 0, tokens_from: int = 0) -> dict:
    """One choice: the whole completion, or (streaming) what is new since `text_from`/`tokens_from`. With echo the
    prompt (text and logprobs) leads the first piece (`prefix_done` False)."""
    echo = body.echo and not prefix_done
    text = (out.prompt or "" if echo else "") + c.text[text_from:]
    logprobs = None
    if body.logprobs is not None:
      ids, lps = c.token_ids[tokens_from:], (c.logprobs or [])[tokens_from:]
      if echo: ids, lps = out.prompt_token_ids + ids, (out.prompt_logprobs or [None] * len(out.prompt_token_ids)) + lps
      offset = 0 if echo else (len(out.prompt or "") if body.echo else 0) + text_from   # characters before these tokens
      logprobs = self.completion_logprobs(ids, lps, body.logprobs, offset)
    return {"index": prompt_index * body.n + c.index, "text": text, "logprobs": logprobs, "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason}

  async def _stream(self, body: CompletionRequest, request_id: str, started: float,
                    streams: list[RunningTotals]) -> AsyncIterator[str]:
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    continuous = bool(body.stream_options and body.stream_options.continuous_usage_stats)
    def chunk(choices: list[dict], usage: dict | None = None) -> str:
      data = {"id": request_id, "object": "text_completion", "created": int(started), "model": self.settings.served_model_name,
              "choices": choices}
      if include_usage: data["usage"] = usage
      return sse(data)
    finals: list[RequestOutput | None] = [None] * len(streams)
    sent: dict[tuple[int, int], tuple[int, int]] = {}   # (prompt, completion) -> (characters, tokens) sent
    status = "client disconnected"
    merged = merge_streams(streams)
    try:
      async for i, out in merged:
        finals[i] = out
        if out.error:
          status = f"error: {out.error}"
          yield sse(APIError(500, f"generation failed: {out.error}").body())
          break
        for c in out.outputs:
          key = (i, c.index)
          if key in sent and sent[key] is None: continue            # finished already
          text_from, tokens_from = sent.get(key, (0, 0))
          if key in sent and len(c.text) == text_from and len(c.token_ids) == tokens_from and c.finish_reason is None: continue
          usage = self.usage([o for o in finals if o is not None]) if continuous else None
          yield chunk([self._choice(body, i, out, c, prefix_done=key in sent, text_from=text_from, tokens_from=tokens_from)], usage)
          sent[key] = None if c.finish_reason is not None else (len(c.text), len(c.token_ids))
      else:
        status = "ok"
        if include_usage: yield chunk([], self.usage([o for o in finals if o is not None]))
      yield sse("[DONE]")
    finally:
      await merged.aclose()
      self.log_request(request_id, "completion stream", started, finals, status)
