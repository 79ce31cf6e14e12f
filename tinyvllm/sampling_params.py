"""SamplingParams and StructuredOutputsParams: vLLM's names and defaults, validated once when built."""
from __future__ import annotations
import json as jsonlib
import enum, math, numbers
from dataclasses import dataclass, field

MAX_LOGPROBS = 20
GREEDY_BELOW = 1e-5   # temperatures this small sample as greedy (vLLM's rule): dividing by them overflows


CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object")


class RequestOutputKind(enum.Enum):
  """What each RequestOutput of a request holds (vLLM's names): CUMULATIVE, everything so far (the default); DELTA,
  only what is new since the request's last output (streams that forward pieces); FINAL_ONLY, a single output when
  the request finishes (`LLM.generate` asks for it: no snapshot is built per step)."""
  CUMULATIVE = 0
  DELTA = 1
  FINAL_ONLY = 2


@dataclass
class StructuredOutputsParams:
  """Constrain the output (vLLM's names): exactly one of `json` (a JSON schema, as a dict or its JSON text),
  `regex`, `choice` (the output is one of these strings), `grammar` (Lark, llguidance's dialect, or GBNF) and
  `json_object=True` (any JSON object). What the grammar itself says is checked when the request is added (the
  tokenizer is needed for that); here only the shape. See docs/structured-output.md."""
  json: str | dict | None = None
  regex: str | None = None
  choice: list[str] | None = None
  grammar: str | None = None
  json_object: bool | None = None
  disable_any_whitespace: bool = False     # json / json_object: no whitespace between JSON tokens (compact output)
  whitespace_pattern: str | None = None    # json / json_object: a regex every run of whitespace must match

  def __post_init__(self):
    def bad(name, why): raise ValueError(f"StructuredOutputsParams.{name} {why}, got {getattr(self, name)!r:.200}")
    given = [name for name in CONSTRAINTS if getattr(self, name) not in (None, False)]
    if len(given) != 1:
      raise ValueError(f"StructuredOutputsParams needs exactly one of {', '.join(CONSTRAINTS)}; "
                       f"got {', '.join(given) if given else 'none'}")
    if isinstance(self.json, str):
      try: schema = jsonlib.loads(self.json)
      except ValueError as e: raise ValueError(f"StructuredOutputsParams.json is not valid JSON: {e}") from None
      if not isinstance(schema, dict): bad("json", "must be a JSON object (a schema)")
    elif self.json is not None and not isinstance(self.json, dict): bad("json", "must be a JSON schema: a dict or its JSON text")
    for name in ("regex", "grammar", "whitespace_pattern"):
      if getattr(self, name) is not None and not isinstance(getattr(self, name), str): bad(name, "must be a string")
    if self.grammar is not None and not self.grammar.strip(): bad("grammar", "must not be empty")
    if self.choice is not None:
      if not isinstance(self.choice, (list, tuple)) or not self.choice or not all(isinstance(c, str) and c for c in self.choice):
        bad("choice", "must be a non-empty list of non-empty strings")
      self.choice = list(self.choice)
    if self.json_object not in (None, True, False): bad("json_object", "must be true or false")
    if not isinstance(self.disable_any_whitespace, bool): bad("disable_any_whitespace", "must be true or false")

  @property
  def kind(self) -> str:
    """Which constraint this is: "json", "regex", "choice", "grammar" or "json_object"."""
    return next(name for name in CONSTRAINTS if getattr(self, name) not in (None, False))

  @property
  def schema(self) -> dict | None:
    """The JSON schema of a json constraint (parsed when given as text); {"type": "object"} for json_object."""
    if self.json_object: return {"type": "object"}
    return jsonlib.loads(self.json) if isinstance(self.json, str) else self.json


@dataclass
class SamplingParams:
  n: int = 1
  temperature: float = 1.0             # 0 (or below 1e-5) means greedy
  top_p: float = 1.0
  top_k: int = 0                       # 0 or -1: no top-k
  min_p: float = 0.0
  repetition_penalty: float = 1.0      # over prompt and output tokens
  presence_penalty: float = 0.0        # over output tokens
  frequency_penalty: float = 0.0       # over output tokens
  logit_bias: dict[int, float] | None = None   # token id -> added to its logit (OpenAI's range: [-100, 100])
  seed: int | None = None              # per request; the same seed gives the same tokens whatever the batch
  stop: str | list[str] | None = None  # stop strings, not included in the returned text
  stop_token_ids: list[int] | None = None
  ignore_eos: bool = False
  max_tokens: int | None = 16          # None: until the context is full
  min_tokens: int = 0
  logprobs: int | None = None          # top-k logprobs per generated token, plus the sampled token's own
  prompt_logprobs: int | None = None   # top-k logprobs per prompt token, plus the prompt token's own
  skip_special_tokens: bool = True
  include_stop_str_in_output: bool = False
  structured_outputs: StructuredOutputsParams | None = None   # a JSON schema, regex, choice or grammar the output obeys
  output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE   # what each RequestOutput holds
  stop_strings: tuple[str, ...] = field(init=False, repr=False)

  def __post_init__(self):
    def bad(name, why): raise ValueError(f"SamplingParams.{name} {why}, got {getattr(self, name)!r}")
    def number(name, ok, why):
      value = getattr(self, name)
      if not _is_number(value) or not ok(float(value)): bad(name, why)
      setattr(self, name, float(value))       # numpy scalars become plain floats
    def integer(name, ok, why, optional=False):
      value = getattr(self, name)
      if optional and value is None: return
      if not _is_int(value) or not ok(int(value)): bad(name, why)
      setattr(self, name, int(value))
    integer("n", lambda v: v >= 1, "must be an integer >= 1")
    number("temperature", lambda v: 0 <= v < math.inf, "must be a finite number >= 0")
    number("top_p", lambda v: 0 < v <= 1, "must be in (0, 1]")
    integer("top_k", lambda v: v >= -1, "must be -1, 0 (disabled) or a positive integer")
    number("min_p", lambda v: 0 <= v <= 1, "must be in [0, 1]")
    number("repetition_penalty", lambda v: 0 < v < math.inf, "must be a finite number > 0")
    for name in ("presence_penalty", "frequency_penalty"): number(name, lambda v: -2 <= v <= 2, "must be in [-2, 2]")
    integer("seed", lambda v: 0 <= v < 2**63, "must be an integer in [0, 2**63) or None", optional=True)
    integer("max_tokens", lambda v: v >= 1, "must be an integer >= 1 or None", optional=True)
    integer("min_tokens", lambda v: v >= 0, "must be an integer >= 0")
    if self.max_tokens is not None and self.min_tokens > self.max_tokens: bad("min_tokens", "must not exceed max_tokens")
    for name in ("logprobs", "prompt_logprobs"):
      integer(name, lambda v: 0 <= v <= MAX_LOGPROBS, f"must be an integer in [0, {MAX_LOGPROBS}] or None", optional=True)
    if isinstance(self.stop, str): stops = [self.stop]
    elif isinstance(self.stop, (list, tuple)) or self.stop is None: stops = list(self.stop or [])
    else: bad("stop", "must be a string or a list of strings")
    if not all(isinstance(s, str) and s for s in stops): bad("stop", "must be a non-empty string or a list of them")
    self.stop_strings = tuple(stops)
    if self.stop_token_ids is not None:
      if not isinstance(self.stop_token_ids, (list, tuple)) or not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
        bad("stop_token_ids", "must be a list of token ids")
      self.stop_token_ids = [int(t) for t in self.stop_token_ids]
    if self.logit_bias is not None:
      if not isinstance(self.logit_bias, dict): bad("logit_bias", "must map token ids to numbers")
      bias = {}
      for k, v in self.logit_bias.items():
        key = int(k) if isinstance(k, str) and k.strip().isdigit() else k   # JSON object keys arrive as strings
        if not _is_int(key) or key < 0 or not _is_number(v) or not math.isfinite(float(v)):
          bad("logit_bias", "must map token ids (integers >= 0) to finite numbers")
        bias[int(key)] = float(v)
      self.logit_bias = bias or None
    if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
      bad("structured_outputs", "must be a StructuredOutputsParams")
    if not isinstance(self.output_kind, RequestOutputKind): bad("output_kind", "must be a RequestOutputKind")

  @property
  def greedy(self) -> bool: return self.temperature < GREEDY_BELOW


def _is_number(x) -> bool: return isinstance(x, numbers.Real) and not isinstance(x, bool) and x == x
def _is_int(x) -> bool: return isinstance(x, numbers.Integral) and not isinstance(x, bool)
