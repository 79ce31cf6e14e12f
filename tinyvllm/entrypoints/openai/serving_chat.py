"""POST /v1/chat/completions: messages -> the chat template -> one engine request with n completions."""
from __future__ import annotations
import time, uuid
from collections.abc import AsyncIterator
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from tinyvllm.engine.async_llm import RequestStream
from tinyvllm.entrypoints.openai.protocol import APIError, ChatCompletionRequest, parse_body
from tinyvllm.entrypoints.openai.serving import OpenAIServing, sse
from tinyvllm.outputs import RequestOutput


class OpenAIServingChat(OpenAIServing):
  async def create(self, request: Request) -> Response:
    body: ChatCompletionRequest = parse_body(await request.body(), ChatCompletionRequest)
    body.check_fields()
    self.check_model(body.model)
    if body.top_logprobs is not None and not body.logprobs:
      raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
    if body.top_logprobs is not None and not 0 <= body.top_logprobs <= 20:
      raise APIError(400, f"top_logprobs must be in [0, 20], got {body.top_logprobs}", param="top_logprobs")
    prompt = self.render_chat(body)
    max_tokens_field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    self.check_length(len(prompt["prompt_token_ids"]), max_tokens, "messages", max_tokens_field)
    params = body.sampling_params(max_tokens, (body.top_logprobs or 0) if body.logprobs else None, body.prompt_logprobs)
    await self.check_constraint(params, body.constraint_field)
    request_id, started = f"chatcmpl-{uuid.uuid4().hex}", time.time()
    stream = (await self.add_requests(request_id, [prompt], params, "messages"))[0]
    if body.stream:
      return StreamingResponse(self._stream(body, request_id, started, stream), media_type="text/event-stream")
    finals = await self.final_outputs(request, [stream])
    if finals is None:
      self.log_request(request_id, "chat", started, [], "client disconnected")
      return Response(status_code=499)
    out = finals[0]
    self.log_request(request_id, "chat", started, [out], f"error: {out.error}" if out.error else "ok")
    if out.error: raise APIError(500, f"generation failed: {out.error}")
    return JSONResponse(self._response(body, request_id, started, out))

  def _response(self, body: ChatCompletionRequest, request_id: str, started: float, out: RequestOutput) -> dict:
    choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                "logprobs": {"content": self.chat_logprobs(c.token_ids, c.logprobs, body.top_logprobs or 0)} if body.logprobs else None,
                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason} for c in out.outputs]
    response = {"id": request_id, "object": "chat.completion", "created": int(started), "model": self.settings.served_model_name,
                "choices": choices, "usage": self.usage([out]), "system_fingerprint": None}
    if body.prompt_logprobs is not None: response["prompt_logprobs"] = self.prompt_logprobs_json(out)
    return response

  async def _stream(self, body: ChatCompletionRequest, request_id: str, started: float,
                    stream: RequestStream) -> AsyncIterator[str]:
    """SSE frames: each choice's role first, then text deltas, a last chunk with its finish_reason, the usage
    chunk when asked for, and [DONE]. Cancelled (client gone): the finally clause closes the stream (abort)."""
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    continuous = bool(body.stream_options and body.stream_options.continuous_usage_stats)
    def chunk(choices: list[dict], usage: dict | None = None) -> str:
      data = {"id": request_id, "object": "chat.completion.chunk", "created": int(started),
              "model": self.settings.served_model_name, "choices": choices}
      if include_usage: data["usage"] = usage
      return sse(data)
    n, final, status = body.n, None, "client disconnected"
    sent_text, sent_tokens, done = [0] * n, [0] * n, [False] * n
    try:
      for i in range(n):
        yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}])
      async for out in stream:
        final = out
        if out.error:
          status = f"error: {out.error}"
          yield sse(APIError(500, f"generation failed: {out.error}").body())
          break
        for c in out.outputs:
          i = c.index
          if done[i]: continue
          delta, new_tokens = c.text[sent_text[i]:], c.token_ids[sent_tokens[i]:]
          if not delta and not new_tokens and c.finish_reason is None: continue
          choice = {"index": i, "delta": {"content": delta} if delta else {},
                    "logprobs": {"content": self.chat_logprobs(new_tokens, c.logprobs[sent_tokens[i]:], body.top_logprobs or 0)}
                    if body.logprobs else None, "finish_reason": c.finish_reason}
          if c.finish_reason is not None: choice["stop_reason"] = c.stop_reason
          sent_text[i], sent_tokens[i], done[i] = len(c.text), len(c.token_ids), c.finish_reason is not None
          yield chunk([choice], self.usage([out]) if continuous else None)
      else:
        status = "ok"
        if include_usage and final is not None: yield chunk([], self.usage([final]))
      yield sse("[DONE]")
    finally:
      await stream.aclose()
      self.log_request(request_id, "chat stream", started, [final], status)
