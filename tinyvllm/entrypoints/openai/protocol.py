"""The OpenAI API's request bodies (plus vLLM's extra fields), checked and turned into SamplingParams.

A field we do not implement is refused with a 400 naming it, never silently ignored; so is a field nobody
defines (a typo). Fields that only describe the caller (`user`, `metadata`, `store`, `service_tier`) are accepted.
"""
from __future__ import annotations
import json, re
from typing import Any, ClassVar
from pydantic import BaseModel, ConfigDict, ValidationError, model_validator
from tinyvllm.sampling_params import SamplingParams, StructuredOutputsParams


class APIError(Exception):
  """An error answered with OpenAI's body: {"error": {"message", "type", "param", "code"}}."""
  def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
               type: str | None = None):
    super().__init__(message)
    self.status, self.message, self.param, self.code = status, message, param, code
    self.type = type or ("invalid_request_error" if status < 500 else "server_error")

  def body(self) -> dict:
    return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _defaults_for_nulls(model: BaseModel) -> BaseModel:
  for name, f in type(model).model_fields.items():
    if getattr(model, name) is None and f.default is not None: object.__setattr__(model, name, f.default)
  return model


class StreamOptions(BaseModel):
  model_config = ConfigDict(extra="forbid", strict=True)
  _null_means_default = model_validator(mode="after")(_defaults_for_nulls)
  include_usage: bool | None = False
  continuous_usage_stats: bool | None = False   # vLLM's: usage in every chunk


class _Request(BaseModel):
  # strict: JSON types as written (no "1.5" for a number, no true for an integer); unknown fields are collected and
  # refused by name in `check_fields`
  model_config = ConfigDict(extra="allow", strict=True)
  # fields other servers implement and we do not yet: (name, None | the value meaning "not used" | a predicate that
  # accepts harmless values)
  UNSUPPORTED: ClassVar[tuple] = ()

  model: str | None = None
  # OpenAI sampling
  frequency_penalty: float | None = 0.0
  presence_penalty: float | None = 0.0
  logit_bias: dict[str, float] | None = None
  n: int | None = 1
  seed: int | None = None
  stop: str | list[str] | None = None
  stream: bool | None = False
  stream_options: StreamOptions | None = None
  temperature: float | None = None
  top_p: float | None = None
  # describe the caller; no effect on generation
  user: str | None = None
  metadata: dict[str, Any] | None = None
  store: bool | None = None
  service_tier: str | None = None
  # vLLM's extras
  top_k: int | None = None
  min_p: float | None = None
  repetition_penalty: float | None = None
  stop_token_ids: list[int] | None = None
  ignore_eos: bool | None = False
  min_tokens: int | None = 0
  include_stop_str_in_output: bool | None = False
  skip_special_tokens: bool | None = True
  prompt_logprobs: int | None = None
  # output constraints: OpenAI's response_format, or vLLM's structured_outputs (StructuredOutputsParams' fields)
  response_format: dict[str, Any] | None = None
  structured_outputs: dict[str, Any] | None = None

  @model_validator(mode="after")
  def _null_means_default(self):
    """OpenAI lets clients send null for most fields: it means the default."""
    return _defaults_for_nulls(self)

  def check_fields(self) -> None:
    for name, unused in self.UNSUPPORTED:
      value = getattr(self, name, None) if name in type(self).model_fields else (self.model_extra or {}).get(name)
      if value is not None and value != unused and not (callable(unused) and unused(value)):
        raise APIError(400, f"'{name}' is not supported by this server yet", param=name, code="unsupported_field")
    for name, key in GUIDED.items():
      if (self.model_extra or {}).get(name) is not None:
        raise APIError(400, f"'{name}' is vLLM's old name and is not supported: send structured_outputs={{\"{key}\": ...}}",
                       param=name, code="unsupported_field")
    extra = sorted(set(self.model_extra or {}) - {n for n, _ in self.UNSUPPORTED} - set(GUIDED))
    if extra: raise APIError(400, f"unknown field '{extra[0]}'", param=extra[0], code="unknown_field")
    if self.stream_options is not None and not self.stream:
      raise APIError(400, "stream_options is only allowed with stream=true", param="stream_options")

  @property
  def constraint_field(self) -> str | None:
    """The field the output constraint came from (for errors): response_format, structured_outputs or None."""
    if self.response_format is not None and self.response_format.get("type") != "text": return "response_format"
    return "structured_outputs" if self.structured_outputs is not None else None

  def constraint(self) -> StructuredOutputsParams | None:
    """The output constraint of `response_format` ({"type": "json_object"} or {"type": "json_schema", "json_schema":
    {"name", "schema", "strict"}}; "text" is none) or of vLLM's `structured_outputs`; a malformed one is a 400."""
    field = self.constraint_field
    if field is None: return None
    if field == "response_format" and self.structured_outputs is not None:
      raise APIError(400, "give response_format or structured_outputs, not both", param="structured_outputs")
    if field == "response_format": kw = _response_format(self.response_format)
    else:
      unknown = sorted(set(self.structured_outputs) - STRUCTURED_OUTPUTS_FIELDS - {"disable_fallback"})
      if unknown: raise APIError(400, f"structured_outputs.{unknown[0]} is not supported by this server", param=field,
                                 code="unsupported_field")
      kw = {k: v for k, v in self.structured_outputs.items() if k != "disable_fallback"}   # we never fall back anyway
    try:
      return StructuredOutputsParams(**kw)
    except ValueError as e:
      message = str(e).replace("StructuredOutputsParams", "structured_outputs")
      if field == "response_format": message = message.replace("structured_outputs.json", "response_format.json_schema.schema")
      raise APIError(400, message, param=field) from None

  def sampling_params(self, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None) -> SamplingParams:
    """SamplingParams from the body; an invalid value is a 400 naming its field."""
    kw = dict(n=self.n, presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
              logit_bias=self.logit_bias, seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids,
              ignore_eos=self.ignore_eos, max_tokens=max_tokens, min_tokens=self.min_tokens, logprobs=logprobs,
              prompt_logprobs=prompt_logprobs, skip_special_tokens=self.skip_special_tokens,
              include_stop_str_in_output=self.include_stop_str_in_output, structured_outputs=self.constraint())
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
      if getattr(self, name) is not None: kw[name] = getattr(self, name)
    try:
      return SamplingParams(**kw)
    except ValueError as e:
      m = re.match(r"SamplingParams\.(\w+)", str(e))
      raise APIError(400, str(e).replace("SamplingParams.", "", 1), param=m.group(1) if m else None) from None


def _text_only(value) -> bool: return value == ["text"]
# vLLM's older request fields -> the structured_outputs key that replaced each
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
STRUCTURED_OUTPUTS_FIELDS = frozenset(f for f in StructuredOutputsParams.__dataclass_fields__)


def _response_format(rf: dict) -> dict:
  """StructuredOutputsParams keywords from OpenAI's response_format (json_object or json_schema)."""
  def refuse(message: str): raise APIError(400, f"response_format{message}", param="response_format")
  kind = rf.get("type")
  allowed = {"json_object": {"type"}, "json_schema": {"type", "json_schema"}}
  if kind not in allowed: refuse(f".type must be 'text', 'json_object' or 'json_schema', got {kind!r}")
  if set(rf) - allowed[kind]: refuse(f": unknown field '{sorted(set(rf) - allowed[kind])[0]}' for type {kind}")
  if kind == "json_object": return {"json_object": True}
  spec = rf.get("json_schema")
  if not isinstance(spec, dict): refuse(".json_schema must be an object with 'name' and 'schema'")
  if set(spec) - {"name", "description", "schema", "strict"}:
    refuse(f".json_schema: unknown field '{sorted(set(spec) - {'name', 'description', 'schema', 'strict'})[0]}'")
  if not isinstance(spec.get("schema"), dict): refuse(".json_schema.schema must be a JSON schema (an object)")
  return {"json": spec["schema"]}   # strict or not, the schema is enforced: every token is masked by it
def _no_tools(value) -> bool: return value in ("none", [], None)


class ChatCompletionRequest(_Request):
  UNSUPPORTED: ClassVar[tuple] = (("functions", _no_tools), ("function_call", _no_tools), ("modalities", _text_only),
                 ("audio", None), ("prediction", None), ("reasoning_effort", None), ("web_search_options", None))
  messages: list[dict[str, Any]]
  tools: list[Any] | None = None
  tool_choice: str | dict[str, Any] | None = None   # "none" | "auto" | "required" | {"type": "function", "function": {"name"}}
  parallel_tool_calls: bool | None = True
  logprobs: bool | None = False
  top_logprobs: int | None = None
  max_tokens: int | None = None             # deprecated by OpenAI, still what most clients send
  max_completion_tokens: int | None = None
  add_generation_prompt: bool | None = True
  continue_final_message: bool | None = False
  chat_template_kwargs: dict[str, Any] | None = None

  def tool_request(self) -> tuple[list[dict] | None, str | None]:
    """(tools, the choice: "none" | "auto" | "required" | a tool's name), checked: a malformed definition, a choice
    naming no given tool or a choice without tools is a 400 naming the field."""
    from tinyvllm.tools import check_tools, tool_names
    if not self.tools:
      if self.tool_choice not in (None, "none"):
        raise APIError(400, "tool_choice needs tools: give the functions it may call in 'tools'", param="tool_choice")
      return None, None
    try: tools = check_tools(self.tools)
    except ValueError as e: raise APIError(400, str(e), param="tools") from None
    choice = self.tool_choice if self.tool_choice is not None else "auto"
    if isinstance(choice, dict):
      fn = choice.get("function")
      if choice.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise APIError(400, "tool_choice must be 'none', 'auto', 'required' or {\"type\": \"function\", \"function\": {\"name\": ...}}",
                       param="tool_choice")
      if fn["name"] not in tool_names(tools):
        raise APIError(400, f"tool_choice names the function {fn['name']!r}, which is not among the tools "
                            f"({', '.join(tool_names(tools))})", param="tool_choice")
      return tools, fn["name"]
    if choice not in ("none", "auto", "required"):
      raise APIError(400, f"tool_choice must be 'none', 'auto', 'required' or a named function, got {choice!r}", param="tool_choice")
    return tools, choice


class CompletionRequest(_Request):
  UNSUPPORTED: ClassVar[tuple] = (("suffix", None),)
  prompt: str | list[str] | list[int] | list[list[int]]
  max_tokens: int | None = 16               # OpenAI's default for completions
  logprobs: int | None = None
  echo: bool | None = False
  best_of: int | None = None
  add_special_tokens: bool | None = True           # vLLM's: BOS before a text prompt


class TokenizeRequest(BaseModel):
  model_config = ConfigDict(extra="forbid", strict=True)
  model: str | None = None
  prompt: str | None = None
  messages: list[dict[str, Any]] | None = None
  add_special_tokens: bool | None = None
  add_generation_prompt: bool | None = True
  continue_final_message: bool | None = False
  chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(BaseModel):
  model_config = ConfigDict(extra="forbid", strict=True)
  model: str | None = None
  tokens: list[int]


def parse_body(raw: bytes, model: type[BaseModel]) -> BaseModel:
  """JSON bytes -> a request model; malformed JSON or a field of the wrong type is a 400 naming the field."""
  try: data = json.loads(raw)
  except (ValueError, UnicodeDecodeError) as e: raise APIError(400, f"the request body is not valid JSON: {e}") from None
  if not isinstance(data, dict): raise APIError(400, "the request body must be a JSON object")
  try:
    return model.model_validate_json(raw)
  except ValidationError as e:
    err = e.errors()[0]
    param = str(err["loc"][0]) if err["loc"] else None
    if err["type"] == "missing": raise APIError(400, f"'{param}' is required", param=param) from None
    if err["type"] == "extra_forbidden": raise APIError(400, f"unknown field '{param}'", param=param, code="unknown_field") from None
    if param in UNION_FIELDS: raise APIError(400, f"'{param}' must be {UNION_FIELDS[param]}", param=param) from None
    where = ".".join(str(x) for x in err["loc"])
    raise APIError(400, f"'{where}': {err['msg']}" if where else err["msg"], param=param) from None


# fields of several accepted types: pydantic would report each alternative's failure, we say what is accepted
UNION_FIELDS = {"prompt": "a string, a list of strings, a list of token ids or a list of token-id lists",
                "stop": "a string or a list of strings"}

