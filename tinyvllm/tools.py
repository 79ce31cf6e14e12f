"""Tool calling: OpenAI's tool definitions checked, the call formats models are trained to write, parsed out of their
text, and grammars that force a valid call when one must come (tool_choice "required" or a named function).

A format (vLLM's parser names) knows three things: where a call begins in a model's text (so a stream can send the
text before it as content), how to read the calls out of a finished text, and a Lark grammar (llguidance's dialect,
with JSON schemas embedded by `%json`) whose every sentence is a list of calls to the given tools with arguments
that satisfy each tool's parameter schema.

  hermes       Qwen2.5 / Qwen3 / Hermes: <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>, one block per call
  llama3_json  Llama 3.1-3.3: {"name": ..., "parameters": {...}}, after an optional <|python_tag|>, calls joined by "; "
  mistral      Mistral: [TOOL_CALLS] followed by a JSON list of {"name": ..., "arguments": {...}}; in templates that write
               [ARGS] (Mistral Small 3.x), [TOOL_CALLS]name[ARGS]{...} per call
  json         any other template: a JSON object {"name": ..., "arguments": {...}} or a list of them

Text that does not parse as calls (a model writing prose, or a broken call under tool_choice "auto") comes back as
content: a malformed call never comes back as a tool call.
"""
from __future__ import annotations
import hashlib, json, re, uuid
from dataclasses import dataclass, field

NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


@dataclass(frozen=True)
class ToolCall:
  name: str
  arguments: str                     # JSON text of the arguments object, as OpenAI sends it
  id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

  def openai(self) -> dict:
    return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def check_tools(tools) -> list[dict]:
  """OpenAI's `tools`: a list of {"type": "function", "function": {"name", "description"?, "parameters"?, "strict"?}}.
  Returns them as given; anything else raises ValueError naming the entry (`tools[i].function.name`, ...)."""
  if not isinstance(tools, list) or not tools: raise ValueError("tools must be a non-empty list of {type: function, function: {...}}")
  names = set()
  for i, tool in enumerate(tools):
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function":
      raise ValueError(f"{where}.type must be 'function', got {tool.get('type') if isinstance(tool, dict) else tool!r}")
    if set(tool) - {"type", "function"}: raise ValueError(f"{where}: unknown field '{sorted(set(tool) - {'type', 'function'})[0]}'")
    fn = tool.get("function")
    if not isinstance(fn, dict): raise ValueError(f"{where}.function must be an object with a 'name'")
    unknown = sorted(set(fn) - {"name", "description", "parameters", "strict"})
    if unknown: raise ValueError(f"{where}.function: unknown field '{unknown[0]}'")
    name = fn.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
      raise ValueError(f"{where}.function.name must be 1-64 letters, digits, '_' or '-', got {name!r}")
    if name in names: raise ValueError(f"{where}.function.name {name!r} is given twice")
    names.add(name)
    if "description" in fn and not isinstance(fn["description"], str): raise ValueError(f"{where}.function.description must be a string")
    params = fn.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, dict): raise ValueError(f"{where}.function.parameters must be a JSON schema (an object)")
    if params.get("type", "object") != "object":
      raise ValueError(f"{where}.function.parameters must describe an object (type 'object'), got type {params.get('type')!r}")
  return tools


def tool_names(tools: list[dict]) -> list[str]: return [t["function"]["name"] for t in tools]


def parameters_schema(tool: dict) -> dict:
  """A tool's arguments schema, always of an object (a `parameters` without "type" still describes an object)."""
  return {"type": "object", **(tool["function"].get("parameters") or {"properties": {}})}


def call_schema(tools: list[dict], arguments_key: str = "arguments") -> dict:
  """The JSON schema of one call to any of `tools`: {"name": <its name>, <arguments_key>: <its parameters>}."""
  def one(tool: dict) -> dict:
    return {"type": "object", "properties": {"name": {"const": tool["function"]["name"]}, arguments_key: parameters_schema(tool)},
            "required": ["name", arguments_key], "additionalProperties": False}
  schemas = [one(t) for t in tools]
  return schemas[0] if len(schemas) == 1 else {"anyOf": schemas}


# JSON in forced calls is written as json.dumps writes it (and as models are trained to): ", " and ": ", no other
# whitespace. Free whitespace would let a model ramble in blanks before finishing a call.
_LAYOUT = {"x-guidance": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}}


def _json(schema: dict) -> str:
  """A schema embedded in a grammar (`%json`), with the call layout above."""
  return json.dumps(schema | _LAYOUT)


def _marker(text: str, token_of) -> str:
  """A marker in a grammar: its token (`<[id]>`) when it is one in the vocabulary, else the literal text."""
  token = token_of(text)
  return f"<[{token}]>" if token is not None else json.dumps(text)


def _past_blanks(text: str, pos: int) -> int:
  while pos < len(text) and text[pos].isspace(): pos += 1
  return pos


def _object_at(text: str, start: int) -> tuple[object, int] | None:
  """The JSON value starting at text[start] (after whitespace) and where it ends, or None."""
  start = _past_blanks(text, start)
  try: return json.JSONDecoder().raw_decode(text, start)
  except ValueError: return None


def _calls(values: list, arguments_key: str) -> list[ToolCall] | None:
  """Calls from decoded JSON values, or None when any is not {"name": str, arguments_key: object}."""
  out = []
  for v in values:
    if not isinstance(v, dict) or not isinstance(v.get("name"), str): return None
    args = v.get(arguments_key, v.get("arguments", v.get("parameters", {})))
    if not isinstance(args, dict): return None
    out.append(ToolCall(v["name"], json.dumps(args, ensure_ascii=False)))
  return out


def _object_end(text: str, start: int) -> int:
  """The index just past the JSON object that opens at text[start] ("{"), or -1 while it is still open: braces
  counted outside strings (escapes skipped)."""
  depth, in_string, escaped = 0, False, False
  for i in range(start, len(text)):
    ch = text[i]
    if in_string:
      if escaped: escaped = False
      elif ch == "\\": escaped = True
      elif ch == '"': in_string = False
    elif ch == '"': in_string = True
    elif ch == "{": depth += 1
    elif ch == "}":
      depth -= 1
      if depth == 0: return i + 1
  return -1


def scan_calls(text: str, arguments_key: str = "arguments") -> list[tuple[str, str, bool]]:
  """The calls of a completion as far as it goes, for text written under a call grammar (its layout: {"name": "N",
  "<arguments_key>": {...}}): (name, the arguments' JSON text so far, whether it is complete), for every call whose
  name is complete. What a stream sends while a forced call is being written."""
  out, pos, key = [], 0, f', "{arguments_key}": '
  while (i := text.find('{"name": "', pos)) >= 0:
    j = text.find('"', i + 10)
    if j < 0: break                          # the name is still being written
    name, a = text[i + 10:j], j + 1 + len(key)
    if not text.startswith(key, j + 1):
      if key.startswith(text[j + 1:]): out.append((name, "", False))   # its arguments' key still being written
      break                                  # not the layout of a call grammar
    end = _object_end(text, a) if a < len(text) else -1
    out.append((name, text[a:end if end >= 0 else len(text)], end >= 0))
    if end < 0: break
    pos = end
  return out


class ToolFormat:
  name = "json"
  markers: tuple[str, ...] = ("{", "[")   # what a call starts with; text before it is content
  arguments_key = "arguments"

  def start(self, text: str) -> int:
    """Where the first call begins in `text` (-1: none yet). For the JSON formats a call is the whole answer, so it
    begins only at the first non-blank character."""
    stripped = text.lstrip()
    return len(text) - len(stripped) if stripped[:1] in self.markers else -1

  def may_start(self, tail: str) -> bool:
    """Could more text make `tail` (the end of a completion so far) the start of a call? A stream holds it back."""
    return not tail.strip()

  def scan(self, text: str) -> list[tuple[str, str, bool]]:
    """The calls of a completion written under this format's grammar, as far as it goes (see scan_calls)."""
    return scan_calls(text, self.arguments_key)

  def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls): the calls the text holds and the text before them; no calls -> (text, [])."""
    at = self.start(text)
    if at < 0: return text, []
    decoded = _object_at(text, at)
    if decoded is None or text[decoded[1]:].strip(): return text, []
    return self._answer(text, at, decoded[0] if isinstance(decoded[0], list) else [decoded[0]])

  def read(self, text: str, parallel: bool = True) -> tuple[str | None, list[ToolCall]]:
    """parse(), keeping only the first call when the request asked for no parallel calls (as OpenAI promises)."""
    content, calls = self.parse(text)
    return content, calls if parallel else calls[:1]

  def _answer(self, text: str, at: int, values: list, after: str = "") -> tuple[str | None, list[ToolCall]]:
    """(content, the calls) when every decoded value is a call, else (text, []). Content is the text before the
    calls at `at` (trailing blanks dropped; a stream sends exactly that), with `after`, text the model wrote around
    or after them, joined on: no text is lost. Where the calls are laid out as a call grammar writes them, their
    arguments are the text the model wrote (as OpenAI returns them, and as a stream sent them); else the decoded
    arguments written again."""
    calls = _calls(values, self.arguments_key)
    if not calls: return text, []
    raw = self.scan(text[at:])
    if len(raw) == len(calls) and all(done and name == c.name for (name, _, done), c in zip(raw, calls)):
      calls = [ToolCall(c.name, args, c.id) for c, (_, args, _) in zip(calls, raw)]
    content = text[:at].rstrip()
    if after.strip(): content = f"{content}\n{after.strip()}" if content.strip() else after.strip()
    return (content if content.strip() else None), calls

  def grammar(self, tools: list[dict], parallel: bool, token_of=lambda text: None) -> str:
    """A Lark grammar of calls to `tools` (one, or with `parallel` one or more). `token_of(marker)`: the token id a
    marker is in the model's vocabulary (Mistral's [TOOL_CALLS] is one special token), written `<[id]>` so the
    grammar asks for the token the model was trained to emit; None: the marker as text."""
    schema = call_schema(tools, self.arguments_key)
    if parallel: schema = {"anyOf": [schema, {"type": "array", "items": schema, "minItems": 1}]}   # one call, or a list
    return f"start: %json {_json(schema)}\n"


class HermesFormat(ToolFormat):
  name, markers = "hermes", ("<tool_call>",)
  OPEN, CLOSE = "<tool_call>", "</tool_call>"

  def may_start(self, tail: str) -> bool: return self.OPEN.startswith(tail)

  def start(self, text: str) -> int:
    # a reasoning model may mention the tag while thinking: calls come after its </think>
    think = text.find("</think>")
    return text.find(self.OPEN, think + len("</think>") if think >= 0 else 0)

  def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
    """Every <tool_call> block after the first (each one JSON object, then the closing tag; a string in it may hold
    the tag), the text between and after them kept as content. One malformed block: no calls, the text as content."""
    at = self.start(text)
    if at < 0: return text, []
    values, others, pos = [], [], at
    while (k := text.find(self.OPEN, pos)) >= 0:
      others.append(text[pos:k])
      decoded = _object_at(text, k + len(self.OPEN))
      if decoded is None: return text, []
      end = _past_blanks(text, decoded[1])
      if not text.startswith(self.CLOSE, end): return text, []
      values.append(decoded[0])
      pos = end + len(self.CLOSE)
    others.append(text[pos:])
    return self._answer(text, at, values, after=" ".join(o.strip() for o in others if o.strip()))

  def grammar(self, tools: list[dict], parallel: bool, token_of=lambda text: None) -> str:
    block = f'block: {_marker(self.OPEN, token_of)} "\\n" call "\\n" {_marker(self.CLOSE, token_of)}\ncall: %json {_json(call_schema(tools))}\n'
    return ('start: block ("\\n" block)*\n' if parallel else "start: block\n") + block


class Llama3JsonFormat(ToolFormat):
  name, markers, arguments_key = "llama3_json", ("{", "<|python_tag|>"), "parameters"
  TAG = "<|python_tag|>"

  def start(self, text: str) -> int:
    stripped = text.lstrip()
    at = len(text) - len(stripped)
    return at if stripped.startswith(self.TAG) or stripped[:1] == "{" else -1

  def may_start(self, tail: str) -> bool: return self.TAG.startswith(tail.strip())

  def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
    at = self.start(text)
    if at < 0: return text, []
    body, values, pos = text[at:].strip().removeprefix(self.TAG), [], 0
    while True:
      decoded = _object_at(body, pos)
      if decoded is None: return text, []
      values.append(decoded[0])
      rest = body[decoded[1]:].lstrip()
      if not rest: break
      if not rest.startswith(";"): return text, []
      pos = len(body) - len(rest) + 1
    return self._answer(text, at, values)

  def grammar(self, tools: list[dict], parallel: bool, token_of=lambda text: None) -> str:
    call = f"call: %json {_json(call_schema(tools, self.arguments_key))}\n"
    return ('start: call ("; " call)*\n' if parallel else "start: call\n") + call


class MistralFormat(ToolFormat):
  name, markers = "mistral", ("[TOOL_CALLS]",)
  TAG = "[TOOL_CALLS]"

  def start(self, text: str) -> int: return text.find(self.TAG)

  def may_start(self, tail: str) -> bool: return self.TAG.startswith(tail)

  def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
    at = self.start(text)
    if at < 0: return text, []
    decoded = _object_at(text, at + len(self.TAG))
    if decoded is None or text[decoded[1]:].strip(): return text, []
    return self._answer(text, at, decoded[0] if isinstance(decoded[0], list) else [decoded[0]])

  def grammar(self, tools: list[dict], parallel: bool, token_of=lambda text: None) -> str:
    items = {"type": "array", "items": call_schema(tools), "minItems": 1, **({} if parallel else {"maxItems": 1})}
    return f'start: {_marker(self.TAG, token_of)} calls\ncalls: %json {_json(items)}\n'


class MistralArgsFormat(MistralFormat):
  """Mistral's later spelling (Mistral Small 3.x, Devstral, Ministral: templates that write [ARGS]): each call is
  [TOOL_CALLS]name[ARGS]{arguments}, a history call with [CALL_ID]id before [ARGS]. Parsed as either spelling."""
  ARGS, CALL_ID = "[ARGS]", "[CALL_ID]"
  _CALL = re.compile(r"\[TOOL_CALLS\]([A-Za-z0-9_-]{1,64})(?:\[CALL_ID\][A-Za-z0-9]*)?\[ARGS\]")

  def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
    at = self.start(text)
    if at < 0: return text, []
    if not self._CALL.match(text, at): return super().parse(text)   # the JSON-list spelling
    values, pos = [], at
    while pos < len(text) and (m := self._CALL.match(text, pos)):
      decoded = _object_at(text, m.end())
      if decoded is None: return text, []
      values.append({"name": m.group(1), "arguments": decoded[0]})
      pos = _past_blanks(text, decoded[1])
    if pos < len(text): return text, []
    return self._answer(text, at, values)   # content and the arguments as written, as every format gives them

  def scan(self, text: str) -> list[tuple[str, str, bool]]:
    out = []
    for m in self._CALL.finditer(text):
      end = _object_end(text, m.end()) if m.end() < len(text) else -1
      out.append((m.group(1), text[m.end():end if end >= 0 else len(text)], end >= 0))
      if end < 0: break
    return out

  def grammar(self, tools: list[dict], parallel: bool, token_of=lambda text: None) -> str:
    rules = [f'c{i}: {_marker(self.TAG, token_of)} {json.dumps(t["function"]["name"])} {_marker(self.ARGS, token_of)} '
             f'%json {_json(parameters_schema(t))}' for i, t in enumerate(tools)]
    return (f"start: call{'+' if parallel else ''}\ncall: " + " | ".join(f"c{i}" for i in range(len(tools))) + "\n" +
            "\n".join(rules) + "\n")


FORMATS: dict[str, ToolFormat] = {f.name: f for f in (HermesFormat(), Llama3JsonFormat(), MistralFormat(), ToolFormat())}
MISTRAL_ARGS = MistralArgsFormat()


def streamable(fmt: ToolFormat, text: str) -> int:
  """How much of a growing completion can go out as content now: the text before a call's start, less the tail
  that more text could turn into one (markers are short: only the last 32 characters are held)."""
  at = fmt.start(text)
  if at >= 0: return at
  for cut in range(max(0, len(text) - 32), len(text)):
    if fmt.may_start(text[cut:]): return cut
  return len(text)


def generic_instructions(tools: list[dict]) -> str:
  """A system message describing `tools` and the generic JSON call format, for a chat template that has no tool
  support of its own (used only when asked for: --tool-call-parser json)."""
  specs = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
  return ("You can call these functions:\n" + specs + "\nTo call one, answer with only a JSON object "
          '{"name": <function name>, "arguments": <arguments object>} (or a JSON list of such objects); otherwise answer normally.')


class ToolTemplateError(ValueError):
  """Tools or tool history a chat template cannot write; `field` is what the caller sent them in."""
  def __init__(self, message: str, field: str):
    super().__init__(message)
    self.field = field


def prepare_chat(messages: list[dict], tools: list[dict] | None, template: str, generic: bool = False) -> tuple[list[dict], dict]:
  """(messages, template variables) for rendering `messages` and `tools` with `template` (its source): tool calls
  in the history get their arguments as objects; tools go to the template's `tools` variable. What the template
  cannot write is refused, never dropped: history with tool calls or results needs a template that reads
  `tool_calls`, tools one that reads `tools` (or `generic`: a system message describing them in the JSON format)."""
  extra: dict = {}
  if isinstance(messages, list) and any(isinstance(m, dict) and (m.get("tool_calls") or m.get("role") == "tool") for m in messages):
    if "tool_calls" in template:
      # Mistral's templates refuse call ids that are not 9 letters or digits; OpenAI's (call_...) are longer
      messages = template_messages(messages, short_ids=detect_format(template).name == "mistral")
    elif generic: messages = generic_history(messages)
    else:
      raise ToolTemplateError("the messages hold tool calls or tool results, and this model's chat template does not write them "
                              "(it never reads 'tool_calls'); use a chat template that does", "messages")
  if tools:
    if re.search(r"\btools\b", template): extra["tools"] = tools
    elif generic: messages = [{"role": "system", "content": generic_instructions(tools)}, *messages]
    else:
      raise ToolTemplateError("this model's chat template has no tool support (it never reads 'tools'); use a chat template "
                              "that does, or the generic JSON call format (--tool-call-parser json)", "tools")
  return messages, extra


def short_id(call_id) -> str:
  """A call id as 9 letters and digits (Mistral's templates require them), the same for the same id: a call and
  its result stay paired."""
  if isinstance(call_id, str) and re.fullmatch(r"[A-Za-z0-9]{9}", call_id): return call_id
  digest = int.from_bytes(hashlib.sha256(str(call_id).encode()).digest()[:8], "big")
  alphabet = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
  return "".join(alphabet[(digest // 62 ** i) % 62] for i in range(9))


def _decoded(arguments):
  """A call's `arguments` as an object when they are JSON text (OpenAI sends text), else as given."""
  if not isinstance(arguments, str): return arguments
  try: return json.loads(arguments)
  except ValueError: return arguments   # left as text: written as the client sent it


def generic_history(messages: list[dict]) -> list[dict]:
  """Tool calls and results written as plain turns, for a template without tool support in the generic format: an
  assistant's calls as the JSON it would answer with, a result as a user turn naming its call."""
  out = []
  for m in messages:
    if isinstance(m, dict) and m.get("tool_calls"):
      calls = []
      for c in m["tool_calls"]:
        fn = (c or {}).get("function") or {}
        calls.append({"name": fn.get("name"), "arguments": _decoded(fn.get("arguments") or "{}")})
      written = json.dumps(calls[0] if len(calls) == 1 else calls, ensure_ascii=False)
      out.append({"role": "assistant", "content": f"{m['content'].strip()}\n{written}" if isinstance(m.get("content"), str) and m["content"].strip()
                  else written})
    elif isinstance(m, dict) and m.get("role") == "tool":
      out.append({"role": "user", "content": f"Result of call {m.get('tool_call_id', '')}: {m.get('content', '')}"})
    else: out.append(m)
  return out


def template_messages(messages: list[dict], short_ids: bool = False) -> list[dict]:
  """Messages as chat templates expect them: an assistant's tool_calls with their `arguments` as objects (OpenAI
  sends JSON text; Qwen's, Llama's and Mistral's templates write them with tojson), call ids as 9 letters and digits
  with `short_ids` (in the calls and in the tool results that answer them), the rest as given."""
  out = []
  for m in messages:
    calls = m.get("tool_calls") if isinstance(m, dict) else None
    if isinstance(calls, list):
      fixed = []
      for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("arguments"), str): call = {**call, "function": {**fn, "arguments": _decoded(fn["arguments"])}}
        if short_ids and isinstance(call, dict) and "id" in call: call = {**call, "id": short_id(call["id"])}
        fixed.append(call)
      m = {**m, "tool_calls": fixed}
    if short_ids and isinstance(m, dict) and m.get("role") == "tool" and "tool_call_id" in m:
      m = {**m, "tool_call_id": short_id(m["tool_call_id"])}
    out.append(m)
  return out


def detect_format(template: str | None) -> ToolFormat:
  """The format a chat template asks for, by the markers it writes (vLLM's parser names); the generic JSON one
  when it names none."""
  t = template or ""
  if "<tool_call>" in t: return FORMATS["hermes"]
  if "[TOOL_CALLS]" in t: return MISTRAL_ARGS if "[ARGS]" in t else FORMATS["mistral"]
  if "<|python_tag|>" in t or "ipython" in t: return FORMATS["llama3_json"]
  return FORMATS["json"]
