"""POST /v1/chat/completions: messages (and tools) -> the chat template -> one engine request with n completions;
with tools, each completion's text is read for calls in the model's format (tinyvllm/tools.py)."""
from __future__ import annotations
import dataclasses, time, uuid
from collections.abc import AsyncIterator
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from tinyvllm.entrypoints.openai.protocol import APIError, ChatCompletionRequest, parse_body
from tinyvllm.entrypoints.openai.serving import OpenAIServing, RunningTotals, sse
from tinyvllm.outputs import RequestOutput
from tinyvllm.sampling_params import SamplingParams, StructuredOutputsParams
from tinyvllm.tools import FORMATS, ToolFormat, detect_format, streamable


class OpenAIServingChat(OpenAIServing):
  async def create(self, request: Request) -> Response:
    body: ChatCompletionRequest = parse_body(await request.body(), ChatCompletionRequest)
    prompt, params, fmt = await self.prepare(body)
    request_id, started = f"chatcmpl-{uuid.uuid4().hex}", time.time()
    stream = (await self.add_requests(request_id, [prompt], params, "messages", bool(body.stream)))[0]
    if body.stream:
      forced = fmt is not None and params.structured_outputs is not None and body.constraint_field is None
      return StreamingResponse(self._stream(body, request_id, started, stream, fmt, forced), media_type="text/event-stream")
    finals = await self.final_outputs(request, [stream])
    if finals is None:
      self.log_request(request_id, "chat", started, [], "client disconnected")
      return Response(status_code=499)
    out = finals[0]
    self.log_request(request_id, "chat", started, [out], f"error: {out.error}" if out.error else "ok")
    if out.error: raise APIError(500, f"generation failed: {out.error}")
    return JSONResponse(self._response(body, request_id, started, out, fmt))

  async def prepare(self, body: ChatCompletionRequest) -> tuple[dict, SamplingParams, ToolFormat | None]:
    """A checked chat body -> (the rendered prompt, its sampling params, the tool-call format when calls are to be
    read). Every problem is a 400 naming its field. The Responses API (serving_responses.py) comes through here too."""
    body.check_fields()
    self.check_model(body.model)
    if body.top_logprobs is not None and not body.logprobs:
      raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
    if body.top_logprobs is not None and not 0 <= body.top_logprobs <= 20:
      raise APIError(400, f"top_logprobs must be in [0, 20], got {body.top_logprobs}", param="top_logprobs")
    tools, choice = body.tool_request()
    fmt = self.tool_format() if tools and choice != "none" else None
    prompt = self.render_chat(body, tools=tools if fmt else None, tool_format=fmt)
    max_tokens_field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    self.check_length(len(prompt["prompt_token_ids"]), max_tokens, "messages", max_tokens_field)
    params = body.sampling_params(max_tokens, (body.top_logprobs or 0) if body.logprobs else None, body.prompt_logprobs)
    constraint_field = body.constraint_field
    if fmt is not None and choice != "auto":   # "required" or a named function: every completion is a valid call
      if constraint_field is not None:
        raise APIError(400, f"tool_choice={choice!r} forces a tool call, which {constraint_field} would constrain too: give one",
                       param=constraint_field)
      forced = tools if choice == "required" else [t for t in tools if t["function"]["name"] == choice]
      grammar = fmt.grammar(forced, parallel=choice == "required" and body.parallel_tool_calls is not False, token_of=self.marker_token)
      params, constraint_field = dataclasses.replace(params, structured_outputs=StructuredOutputsParams(grammar=grammar)), "tools"
    if fmt is not None and any(self.tokenizer.is_special(t) for t in map(self.marker_token, fmt.markers) if t is not None):
      # the format's marker is a special token (Mistral's [TOOL_CALLS], Llama's <|python_tag|>): keep it in the text
      params = dataclasses.replace(params, skip_special_tokens=False)
    await self.check_constraint(params, constraint_field)
    return prompt, params, fmt

  def marker_token(self, text: str) -> int | None:
    """The token id `text` is in this model's vocabulary, if it is one token."""
    ids = self.tokenizer.encode(text, add_special_tokens=False)
    return ids[0] if len(ids) == 1 else None

  def _forced_deltas(self, body: ChatCompletionRequest, fmt: ToolFormat):
    """Per output, the chunks' choices of a forced call's stream (see _stream): a new call's id and name, its new
    argument text, the finish; this step's tokens' logprobs ride on its first chunk."""
    n = body.n
    ids, sent, sent_tokens = [[] for _ in range(n)], [[] for _ in range(n)], [0] * n   # per choice: call ids, characters sent
    def deltas(c) -> list[dict]:
      i, choices = c.index, []
      calls = fmt.scan(c.text)
      if body.parallel_tool_calls is False: calls = calls[:1]
      for k, (name, args, _) in enumerate(calls):
        if k == len(ids[i]):   # a new call: its id and name, arguments to come
          ids[i].append(f"call_{uuid.uuid4().hex[:24]}")
          sent[i].append(0)
          choices.append({"index": i, "delta": {"tool_calls": [{"index": k, "id": ids[i][k], "type": "function",
                                                                "function": {"name": name, "arguments": ""}}]},
                          "logprobs": None, "finish_reason": None})
        if len(args) > sent[i][k]:
          choices.append({"index": i, "delta": {"tool_calls": [{"index": k, "function": {"arguments": args[sent[i][k]:]}}]},
                          "logprobs": None, "finish_reason": None})
          sent[i][k] = len(args)
      if c.finish_reason is not None:
        finish = "tool_calls" if c.finish_reason == "stop" else c.finish_reason
        choices.append({"index": i, "delta": {}, "logprobs": None, "finish_reason": finish, "stop_reason": c.stop_reason})
      new_tokens = c.token_ids[sent_tokens[i]:]
      if body.logprobs and new_tokens:
        if not choices: choices.append({"index": i, "delta": {}, "logprobs": None, "finish_reason": None})
        choices[0]["logprobs"] = {"content": self.chat_logprobs(new_tokens, c.logprobs[sent_tokens[i]:], body.top_logprobs or 0)}
      sent_tokens[i] = len(c.token_ids)
      return choices
    return deltas

  def tool_format(self) -> ToolFormat:
    """The call format: --tool-call-parser, else the one the chat template writes (tools.detect_format)."""
    detected = detect_format(self.settings.chat_template or self.tokenizer.chat_template)
    if self.settings.tool_call_parser and self.settings.tool_call_parser != detected.name: return FORMATS[self.settings.tool_call_parser]
    return detected   # (the flag naming the template's own format keeps its spelling: Mistral's [ARGS] one)

  def _response(self, body: ChatCompletionRequest, request_id: str, started: float, out: RequestOutput,
                fmt: ToolFormat | None) -> dict:
    choices = []
    for c in out.outputs:
      message, finish = {"role": "assistant", "content": c.text}, c.finish_reason
      if fmt is not None:
        content, calls = fmt.read(c.text, parallel=body.parallel_tool_calls is not False)
        if calls:
          message = {"role": "assistant", "content": content, "tool_calls": [call.openai() for call in calls]}
          if finish == "stop": finish = "tool_calls"
      choices.append({"index": c.index, "message": message,
                      "logprobs": {"content": self.chat_logprobs(c.token_ids, c.logprobs, body.top_logprobs or 0)} if body.logprobs else None,
                      "finish_reason": finish, "stop_reason": c.stop_reason})
    response = {"id": request_id, "object": "chat.completion", "created": int(started), "model": self.settings.served_model_name,
                "choices": choices, "usage": self.usage([out]), "system_fingerprint": None}
    if body.prompt_logprobs is not None: response["prompt_logprobs"] = self.prompt_logprobs_json(out)
    return response

  async def _stream(self, body: ChatCompletionRequest, request_id: str, started: float,
                    stream: RunningTotals, fmt: ToolFormat | None = None, forced: bool = False) -> AsyncIterator[str]:
    """SSE frames: each choice's role first, then its deltas, a last chunk with its finish_reason, the usage chunk
    when asked for, and [DONE]. Cancelled (client gone): the finally clause closes the stream (abort).
    With tools, text that is or may become a call is held back; when the completion ends its calls are sent as
    OpenAI streams them (each call's id and name with empty arguments, then its arguments), or the held text as
    content when it holds no valid call. A forced call (`forced`: the grammar makes every completion valid calls)
    streams as it is written: each call's id and name once its name is complete, then its arguments fragment by
    fragment."""
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    continuous = bool(body.stream_options and body.stream_options.continuous_usage_stats)
    def chunk(choices: list[dict], usage: dict | None = None) -> str:
      data = {"id": request_id, "object": "chat.completion.chunk", "created": int(started),
              "model": self.settings.served_model_name, "choices": choices}
      if include_usage: data["usage"] = usage
      return sse(data)
    deltas = self._forced_deltas(body, fmt) if forced else self._text_deltas(body, fmt)
    n, final, status, done = body.n, None, "client disconnected", [False] * body.n
    try:
      for i in range(n):
        yield chunk([{"index": i, "delta": {"role": "assistant", "content": None if forced else ""}, "logprobs": None,
                      "finish_reason": None}])
      async for out in stream:
        final = out
        if out.error:
          status = f"error: {out.error}"
          yield sse(APIError(500, f"generation failed: {out.error}").body())
          break
        for c in out.outputs:
          if done[c.index]: continue
          done[c.index] = c.finish_reason is not None
          for choice in deltas(c): yield chunk([choice], self.usage([out]) if continuous else None)
      else:
        status = "ok"
        if include_usage and final is not None: yield chunk([], self.usage([final]))
      yield sse("[DONE]")
    finally:
      await stream.aclose()
      self.log_request(request_id, "chat stream", started, [final], status)

  def _text_deltas(self, body: ChatCompletionRequest, fmt: ToolFormat | None):
    """Per output, the chunks' choices of a text answer (see _stream): its new text and tokens' logprobs, and when
    it ends, its finish, or with tools the rest of its content, then its calls and a finish "tool_calls"."""
    n = body.n
    sent_text, sent_tokens = [0] * n, [0] * n
    def deltas(c) -> list[dict]:
      i, finish = c.index, c.finish_reason
      # with tools, blanks are held too (a call may follow them; the answer's content ends before them)
      visible = len(c.text) if fmt is None or finish is not None else len(c.text[:streamable(fmt, c.text)].rstrip())
      delta, new_tokens = c.text[sent_text[i]:visible], c.token_ids[sent_tokens[i]:]
      if not delta and not new_tokens and finish is None: return []
      calls = []
      if fmt is not None and finish is not None:
        content, calls = fmt.read(c.text, parallel=body.parallel_tool_calls is not False)
        if calls:   # the held text was calls: the rest of the content (it begins with what was sent), then the calls
          delta = (content or "")[sent_text[i]:]
          if finish == "stop": finish = "tool_calls"
      choice = {"index": i, "delta": {"content": delta} if delta else {},
                "logprobs": {"content": self.chat_logprobs(new_tokens, c.logprobs[sent_tokens[i]:], body.top_logprobs or 0)}
                if body.logprobs else None, "finish_reason": None if calls else finish}
      if finish is not None and not calls: choice["stop_reason"] = c.stop_reason
      sent_text[i], sent_tokens[i] = max(visible, sent_text[i]), len(c.token_ids)
      choices = [choice] if delta or new_tokens or not calls else []
      for k, call in enumerate(calls):
        choices += [{"index": i, "delta": {"tool_calls": [{"index": k, "id": call.id, "type": "function",
                                                           "function": {"name": call.name, "arguments": ""}}]},
                     "logprobs": None, "finish_reason": None},
                    {"index": i, "delta": {"tool_calls": [{"index": k, "function": {"arguments": call.arguments}}]},
                     "logprobs": None, "finish_reason": None}]
      if calls: choices.append({"index": i, "delta": {}, "logprobs": None, "finish_reason": finish, "stop_reason": c.stop_reason})
      return choices
    return deltas

