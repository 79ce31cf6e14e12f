"""SamplingParams: vLLM's names and defaults, validated once when built."""
from __future__ import annotations
from dataclasses import dataclass, field

MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
  n: int = 1
  temperature: float = 1.0             # 0 means greedy
  top_p: float = 1.0
  top_k: int = 0                       # 0 or -1: no top-k
  min_p: float = 0.0
  repetition_penalty: float = 1.0      # over prompt and output tokens
  presence_penalty: float = 0.0        # over output tokens
  frequency_penalty: float = 0.0       # over output tokens
  seed: int | None = None              # per request; the same seed gives the same tokens whatever the batch
  stop: str | list[str] | None = None  # stop strings, not included in the returned text
  stop_token_ids: list[int] | None = None
  ignore_eos: bool = False
  max_tokens: int | None = 16          # None: until the context is full
  min_tokens: int = 0
  logprobs: int | None = None          # top-k logprobs per generated token, plus the sampled token's own
  prompt_logprobs: int | None = None   # accepted for compatibility; not computed
  skip_special_tokens: bool = True
  include_stop_str_in_output: bool = False
  stop_strings: tuple[str, ...] = field(init=False, repr=False)

  def __post_init__(self):
    def bad(name, why): raise ValueError(f"SamplingParams.{name} {why}, got {getattr(self, name)!r}")
    if not isinstance(self.n, int) or self.n < 1: bad("n", "must be an integer >= 1")
    if not _is_number(self.temperature) or self.temperature < 0: bad("temperature", "must be a number >= 0")
    if not _is_number(self.top_p) or not 0 < self.top_p <= 1: bad("top_p", "must be in (0, 1]")
    if not isinstance(self.top_k, int) or self.top_k < -1: bad("top_k", "must be -1, 0 (disabled) or a positive integer")
    if not _is_number(self.min_p) or not 0 <= self.min_p <= 1: bad("min_p", "must be in [0, 1]")
    if not _is_number(self.repetition_penalty) or self.repetition_penalty <= 0: bad("repetition_penalty", "must be > 0")
    for name in ("presence_penalty", "frequency_penalty"):
      if not _is_number(getattr(self, name)) or not -2 <= getattr(self, name) <= 2: bad(name, "must be in [-2, 2]")
    if self.seed is not None and not isinstance(self.seed, int): bad("seed", "must be an integer or None")
    if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
      bad("max_tokens", "must be an integer >= 1 or None")
    if not isinstance(self.min_tokens, int) or self.min_tokens < 0: bad("min_tokens", "must be an integer >= 0")
    if self.max_tokens is not None and self.min_tokens > self.max_tokens: bad("min_tokens", "must not exceed max_tokens")
    if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= MAX_LOGPROBS):
      bad("logprobs", f"must be an integer in [0, {MAX_LOGPROBS}] or None")
    stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
    if not all(isinstance(s, str) and s for s in stops): bad("stop", "must be a non-empty string or a list of them")
    self.stop_strings = tuple(stops)
    ids = self.stop_token_ids or []
    if not all(isinstance(t, int) and t >= 0 for t in ids): bad("stop_token_ids", "must be a list of token ids")

  @property
  def greedy(self) -> bool: return self.temperature == 0


def _is_number(x) -> bool: return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x
