"""POST /v1/responses: OpenAI's Responses API (the subset vLLM serves), which the OpenAI Agents SDK uses by default.

A request becomes a chat request (`instructions` a system message first, input items messages, function calls
and their outputs the assistant `tool_calls` and `tool` messages chat templates know, flat function tools the chat
form) and takes the chat path (OpenAIServingChat.prepare: the template, tool formats, forced calls). The answer is
output items: a message with its text, and a function_call per call. `previous_response_id` continues a stored
response: the server keeps the conversation of its last MAX_STORED responses in memory (nothing on disk; a restart
forgets them). Streaming sends the Responses API's typed events."""
from __future__ import annotations
import json, re, time, uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any
from pydantic import BaseModel, ConfigDict
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from tinyvllm.entrypoints.openai.protocol import APIError, ChatCompletionRequest, parse_body
from tinyvllm.entrypoints.openai.serving_chat import OpenAIServingChat
from tinyvllm.outputs import RequestOutput
from tinyvllm.tools import ToolCall, ToolFormat, streamable

MAX_STORED = 256


class ResponsesRequest(BaseModel):
  model_config = ConfigDict(extra="forbid", strict=True)
  model: str | None = None
  input: str | list[dict[str, Any]]
  instructions: str | None = None
  tools: list[dict[str, Any]] | None = None
  tool_choice: str | dict[str, Any] | None = None
  parallel_tool_calls: bool | None = True
  max_output_tokens: int | None = None
  temperature: float | None = None
  top_p: float | None = None
  stream: bool | None = False
  previous_response_id: str | None = None
  store: bool | None = True
  text: dict[str, Any] | None = None          # {"format": {"type": "text" | "json_object" | "json_schema", ...}}
  metadata: dict[str, Any] | None = None
  user: str | None = None
  truncation: str | None = None              # "disabled" (the default) only
  reasoning: dict[str, Any] | None = None    # refused unless empty: no reasoning models here
  include: list[str] | None = None           # refused unless empty


class OpenAIServingResponses:
  def __init__(self, chat: OpenAIServingChat):
    self.chat = chat
    self.stored: OrderedDict[str, list[dict]] = OrderedDict()   # response id -> its whole conversation as chat messages

  async def create(self, request: Request) -> Response:
    body: ResponsesRequest = parse_body(await request.body(), ResponsesRequest)
    for name, harmless in (("truncation", (None, "disabled")), ("reasoning", (None, {})), ("include", (None, []))):
      if getattr(body, name) not in harmless: raise APIError(400, f"'{name}' is not supported by this server", param=name)
    history = []
    if body.previous_response_id is not None:
      if body.previous_response_id not in self.stored:
        raise APIError(404, f"no stored response '{body.previous_response_id}' (this server keeps its last {MAX_STORED}, "
                            f"in memory)", param="previous_response_id")
      history = self.stored[body.previous_response_id]
    turn = input_messages(body.input)
    messages = ([{"role": "system", "content": body.instructions}] if body.instructions else []) + history + turn
    chat = ChatCompletionRequest.model_validate({
      "model": body.model, "messages": messages, "max_tokens": body.max_output_tokens, "temperature": body.temperature,
      "top_p": body.top_p, **tool_fields(body), **text_format(body.text)})
    try: prompt, params, fmt = await self.chat.prepare(chat)
    except APIError as e:   # the chat path names chat's fields: name the ones this request sent
      names = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text"}
      e.message = re.sub(r"\b(max_tokens|messages|response_format)\b", lambda m: names[m.group(1)], e.message)
      e.param = names.get(e.param, e.param)
      raise
    response_id, started = f"resp_{uuid.uuid4().hex}", time.time()
    stream = (await self.chat.add_requests(response_id, [prompt], params, "input", bool(body.stream)))[0]
    remember = lambda items: self._store(response_id, body, history + turn, items)
    if body.stream:
      forced = fmt is not None and params.structured_outputs is not None and chat.constraint_field is None
      return StreamingResponse(self._stream(body, response_id, started, stream, fmt, remember, forced), media_type="text/event-stream")
    finals = await self.chat.final_outputs(request, [stream])
    if finals is None:
      self.chat.log_request(response_id, "responses", started, [], "client disconnected")
      return Response(status_code=499)
    out = finals[0]
    self.chat.log_request(response_id, "responses", started, [out], f"error: {out.error}" if out.error else "ok")
    if out.error: raise APIError(500, f"generation failed: {out.error}")
    items = output_items(out.outputs[0].text, fmt, parallel=body.parallel_tool_calls is not False)
    remember(items)
    return JSONResponse(self._response(body, response_id, started, out, items))

  def _store(self, response_id: str, body: ResponsesRequest, conversation: list[dict], items: list[dict]) -> None:
    if body.store is False: return
    self.stored[response_id] = conversation + input_messages(items)
    while len(self.stored) > MAX_STORED: self.stored.popitem(last=False)

  def _response(self, body: ResponsesRequest, response_id: str, started: float, out: RequestOutput | None,
                items: list[dict], status: str | None = None) -> dict:
    c = out.outputs[0] if out is not None else None
    if status is None: status = "incomplete" if c is not None and c.finish_reason == "length" else "completed"
    usage = None if out is None else {"input_tokens": len(out.prompt_token_ids), "output_tokens": len(c.token_ids),
                                      "total_tokens": len(out.prompt_token_ids) + len(c.token_ids),
                                      "input_tokens_details": {"cached_tokens": 0}, "output_tokens_details": {"reasoning_tokens": 0}}
    return {"id": response_id, "object": "response", "created_at": int(started), "status": status, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.instructions, "model": self.chat.settings.served_model_name, "output": items,
            "parallel_tool_calls": body.parallel_tool_calls is not False, "previous_response_id": body.previous_response_id,
            "temperature": body.temperature, "top_p": body.top_p, "max_output_tokens": body.max_output_tokens,
            "tool_choice": body.tool_choice or "auto", "tools": body.tools or [], "text": body.text or {"format": {"type": "text"}},
            "metadata": body.metadata or {}, "store": body.store is not False, "usage": usage}

  async def _stream(self, body: ResponsesRequest, response_id: str, started: float, stream, fmt: ToolFormat | None,
                    remember, forced: bool = False) -> AsyncIterator[str]:
    """The Responses API's events: response.created and .in_progress; for the text, output_item.added,
    content_part.added, output_text.delta as it comes (held back where a call may begin), output_text.done,
    content_part.done, output_item.done; for each call at the end, output_item.added (arguments ""),
    function_call_arguments.delta and .done, output_item.done; then response.completed (response.incomplete when
    max_output_tokens cut it) with the whole response. A forced call (`forced`: the grammar makes the answer valid
    calls) streams as it is written: its output_item.added once its name is complete, then its arguments' deltas."""
    seq = iter(range(1 << 62))
    def event(kind: str, **data) -> str:
      data = {"type": kind, "sequence_number": next(seq), **data}
      return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"
    yield event("response.created", response=self._response(body, response_id, started, None, [], "in_progress"))
    yield event("response.in_progress", response=self._response(body, response_id, started, None, [], "in_progress"))
    msg_id, sent, opened, final, status = f"msg_{uuid.uuid4().hex}", 0, False, None, "client disconnected"
    text, calls = "", []
    live: list[list] = []   # forced calls so far: [item, argument characters sent, done]
    def call_events(c) -> list[str]:
      frames = []
      for k, (name, args, complete) in enumerate(fmt.scan(c.text)[:1 if body.parallel_tool_calls is False else None]):
        if k == len(live):
          item = {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": f"call_{uuid.uuid4().hex[:24]}",
                  "name": name, "arguments": "", "status": "in_progress"}
          live.append([item, 0, False])
          frames.append(event("response.output_item.added", output_index=k, item=dict(item)))
        item, done_chars, closed = live[k]
        if len(args) > done_chars:
          frames.append(event("response.function_call_arguments.delta", item_id=item["id"], output_index=k, delta=args[done_chars:]))
          live[k][1] = len(args)
        if (complete or c.finish_reason is not None) and not closed:   # cut by max_output_tokens: incomplete
          item.update(arguments=args, status="completed" if complete else "incomplete")
          frames += [event("response.function_call_arguments.done", item_id=item["id"], output_index=k, arguments=args),
                     event("response.output_item.done", output_index=k, item=dict(item))]
          live[k][2] = True
      return frames
    def open_message() -> list[str]:
      item = {"type": "message", "id": msg_id, "status": "in_progress", "role": "assistant", "content": []}
      return [event("response.output_item.added", output_index=0, item=item),
              event("response.content_part.added", item_id=msg_id, output_index=0, content_index=0,
                    part={"type": "output_text", "text": "", "annotations": []})]
    try:
      async for out in stream:
        final = out
        if out.error:
          status = f"error: {out.error}"
          yield event("error", code="server_error", message=f"generation failed: {out.error}", param=None)
          failed = self._response(body, response_id, started, None, [], "failed")
          yield event("response.failed", response=failed | {"error": {"code": "server_error", "message": f"generation failed: {out.error}"}})
          return
        c = out.outputs[0]
        if forced:
          for frame in call_events(c): yield frame
          continue
        # the text so far: with tools, less what may start a call and the blanks before it; at the end, the content
        if c.finish_reason is None: text = c.text if fmt is None else c.text[:streamable(fmt, c.text)].rstrip()
        else:
          content, calls = fmt.read(c.text, body.parallel_tool_calls is not False) if fmt is not None else (c.text, [])
          text = (content or "") if calls else c.text
        if len(text) > sent:
          if not opened:
            for e in open_message(): yield e
            opened = True
          yield event("response.output_text.delta", item_id=msg_id, output_index=0, content_index=0, delta=text[sent:])
          sent = len(text)
      status = "ok"
      items = [item for item, _, _ in live]
      if forced: calls = []
      if opened:
        part = {"type": "output_text", "text": text, "annotations": []}
        item = {"type": "message", "id": msg_id, "status": "completed", "role": "assistant", "content": [part]}
        yield event("response.output_text.done", item_id=msg_id, output_index=0, content_index=0, text=text)
        yield event("response.content_part.done", item_id=msg_id, output_index=0, content_index=0, part=part)
        yield event("response.output_item.done", output_index=0, item=item)
        items.append(item)
      for call in calls:
        item = call_item(call)
        index = len(items)
        yield event("response.output_item.added", output_index=index, item={**item, "arguments": "", "status": "in_progress"})
        yield event("response.function_call_arguments.delta", item_id=item["id"], output_index=index, delta=call.arguments)
        yield event("response.function_call_arguments.done", item_id=item["id"], output_index=index, arguments=call.arguments)
        yield event("response.output_item.done", output_index=index, item=item)
        items.append(item)
      remember(items)
      done = self._response(body, response_id, started, final, items)
      yield event("response.incomplete" if done["status"] == "incomplete" else "response.completed", response=done)
    finally:
      await stream.aclose()
      self.chat.log_request(response_id, "responses stream", started, [final], status)


def call_item(call: ToolCall) -> dict:
  return {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call.id, "name": call.name,
          "arguments": call.arguments, "status": "completed"}


def output_items(text: str, fmt: ToolFormat | None, parallel: bool = True) -> list[dict]:
  """A finished answer as output items: its text (before any calls) as a message, then a function_call per call
  (the first only, without `parallel`)."""
  content, calls = fmt.read(text, parallel) if fmt is not None else (text, [])
  items = []
  if content or not calls:
    items.append({"type": "message", "id": f"msg_{uuid.uuid4().hex}", "status": "completed", "role": "assistant",
                  "content": [{"type": "output_text", "text": content or "", "annotations": []}]})
  return items + [call_item(c) for c in calls]


def _text(content, where: str) -> str:
  if isinstance(content, str): return content
  if not isinstance(content, list): raise APIError(400, f"{where} must be a string or a list of text parts", param="input")
  parts = []
  for j, part in enumerate(content):
    if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
      kind = part.get("type") if isinstance(part, dict) else type(part).__name__
      raise APIError(400, f"{where}[{j}]: only text parts are supported, got type {kind!r}", param="input")
    parts.append(part["text"])
  return "\n".join(parts)   # as chat joins text parts (engine/input_processor.py)


def input_messages(items) -> list[dict]:
  """Input (a string, or a list of items: messages, function_call and function_call_output) -> chat messages.
  Consecutive function calls become one assistant message's tool_calls, as chat templates expect."""
  if isinstance(items, str): return [{"role": "user", "content": items}]
  messages: list[dict] = []
  for i, item in enumerate(items):
    kind = item.get("type", "message")
    if kind == "message":
      role = item.get("role")
      if role not in ("user", "system", "developer", "assistant"):
        raise APIError(400, f"input[{i}].role must be user, system, developer or assistant, got {role!r}", param="input")
      messages.append({"role": "system" if role == "developer" else role, "content": _text(item.get("content"), f"input[{i}].content")})
    elif kind == "function_call":
      if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
        raise APIError(400, f"input[{i}]: a function_call needs call_id, name and arguments (strings)", param="input")
      call = {"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": item["arguments"]}}
      # the calls of one answer belong to its assistant message (text and calls are one turn, as the model wrote them)
      if messages and messages[-1]["role"] == "assistant": messages[-1].setdefault("tool_calls", []).append(call)
      else: messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
    elif kind == "function_call_output":
      if not isinstance(item.get("call_id"), str): raise APIError(400, f"input[{i}]: a function_call_output needs its call_id", param="input")
      output = item.get("output")
      text = _text(output, f"input[{i}].output") if isinstance(output, (str, list)) else json.dumps(output)
      messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": text})
    else:
      raise APIError(400, f"input[{i}].type {kind!r} is not supported (message, function_call, function_call_output)", param="input")
  return messages


def tool_fields(body: ResponsesRequest) -> dict:
  """The Responses API's flat function tools and tool_choice in chat's shapes."""
  if not body.tools: return {"tool_choice": body.tool_choice} if body.tool_choice is not None else {}
  tools = []
  for i, t in enumerate(body.tools):
    if t.get("type") != "function":
      raise APIError(400, f"tools[{i}].type {t.get('type')!r} is not supported: this server runs function tools", param="tools")
    unknown = sorted(set(t) - {"type", "name", "description", "parameters", "strict"})
    if unknown: raise APIError(400, f"tools[{i}]: unknown field '{unknown[0]}'", param="tools")
    tools.append({"type": "function", "function": {k: v for k, v in t.items() if k != "type"}})
  choice = body.tool_choice
  if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
    choice = {"type": "function", "function": {"name": choice["name"]}}
  return {"tools": tools, "parallel_tool_calls": body.parallel_tool_calls, **({"tool_choice": choice} if choice is not None else {})}


def text_format(text: dict | None) -> dict:
  """`text.format` (text, json_object, json_schema with name/schema/strict) as chat's response_format."""
  fmt = (text or {}).get("format")
  if fmt is not None and not isinstance(fmt, dict):
    raise APIError(400, f"text.format must be an object such as {{\"type\": \"json_schema\", ...}}, got {fmt!r:.100}", param="text")
  if not fmt or fmt.get("type") == "text": return {}
  if fmt.get("type") == "json_object": return {"response_format": {"type": "json_object"}}
  if fmt.get("type") == "json_schema":
    return {"response_format": {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k in ("name", "schema", "strict", "description")}}}
  raise APIError(400, f"text.format.type must be text, json_object or json_schema, got {fmt.get('type')!r}", param="text")
