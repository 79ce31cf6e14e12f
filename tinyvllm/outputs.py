"""What `LLM.generate` returns, in vLLM's shapes."""
from __future__ import annotations
from dataclasses import dataclass


@dataclass
class Logprob:
  logprob: float
  rank: int | None = None             # 1 = the most likely token
  decoded_token: str | None = None


@dataclass
class CompletionOutput:
  index: int
  text: str
  token_ids: list[int]
  cumulative_logprob: float | None = None
  logprobs: list[dict[int, Logprob]] | None = None   # one dict per generated token
  finish_reason: str | None = None    # "stop" | "length" | "abort" | "error" | None while running
  stop_reason: int | str | None = None  # the stop string or stop token id that ended it

  def finished(self) -> bool: return self.finish_reason is not None


@dataclass
class RequestMetrics:
  """Timings and counts of one request. Input processing sets arrival and the prompt length, the engine core the
  scheduling fields (first scheduled, preemptions, speculation), output processing the token fields."""
  arrival_time: float
  first_scheduled_time: float | None = None
  first_token_time: float | None = None
  finished_time: float | None = None
  num_prompt_tokens: int = 0
  num_generated_tokens: int = 0
  num_preemptions: int = 0
  num_cached_tokens: int | None = None   # prompt tokens found in the prefix cache at first admission
  # speculative decoding (zero when off)
  num_draft_tokens: int = 0
  num_accepted_tokens: int = 0
  num_target_steps: int = 0

  @property
  def time_to_first_token(self) -> float | None:
    return None if self.first_token_time is None else self.first_token_time - self.arrival_time

  @property
  def decode_tokens_per_s(self) -> float | None:
    if self.finished_time is None or self.first_token_time is None or self.num_generated_tokens < 2: return None
    dt = self.finished_time - self.first_token_time
    return (self.num_generated_tokens - 1) / dt if dt > 0 else None

  @property
  def acceptance_rate(self) -> float | None:
    return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

  @property
  def tokens_per_target_step(self) -> float | None:
    return self.num_generated_tokens / self.num_target_steps if self.num_target_steps else None


@dataclass
class RequestOutput:
  request_id: str
  prompt: str | None
  prompt_token_ids: list[int]
  outputs: list[CompletionOutput]
  finished: bool
  metrics: RequestMetrics
  error: str | None = None            # set with finish_reason "error": why the request was rejected or failed
  prompt_logprobs: list[dict[int, Logprob] | None] | None = None   # per prompt token (the first is None)
  num_cached_tokens: int = 0          # prompt tokens whose KV cache was reused

  def add(self, next_output: RequestOutput, aggregate: bool = True) -> None:
    """Take in the request's next output, in place (vLLM's method): with `aggregate`, `next_output` is a delta
    (RequestOutputKind.DELTA) whose tokens, text and logprobs are appended (to this output's own lists, which grow:
    a step costs its new tokens, not all of them); without, it replaces what this one holds."""
    if not aggregate:
      self.__dict__.update(next_output.__dict__)
      return
    mine = {c.index: c for c in self.outputs}
    for c in next_output.outputs:
      if (old := mine.get(c.index)) is None:
        self.outputs.append(c)
        continue
      old.text += c.text
      old.token_ids.extend(c.token_ids)
      if c.logprobs is not None:
        if old.logprobs is None: old.logprobs = []
        old.logprobs.extend(c.logprobs)
      old.cumulative_logprob, old.finish_reason, old.stop_reason = c.cumulative_logprob, c.finish_reason, c.stop_reason
    if next_output.prompt_logprobs:
      if self.prompt_logprobs is None: self.prompt_logprobs = []
      self.prompt_logprobs.extend(next_output.prompt_logprobs)
    self.finished, self.metrics, self.num_cached_tokens = next_output.finished, next_output.metrics, next_output.num_cached_tokens
    self.error = next_output.error or self.error


class GenerationError(RuntimeError):
  """Raised by `LLM.generate`/`chat`/`stream` and `AsyncLLM.generate` when the engine failed requests (a model pass
  that raised on the device, say), where vLLM would raise too, instead of handing back empty text as if nothing had
  happened. The message names the cause (the engine also logged it once, with its traceback, on the `tinyvllm`
  logger). Nothing is lost: `outputs` holds every output of the call in input order, the ones that finished among
  them; a failed one has finish_reason "error" and its cause in `error`."""
  def __init__(self, failed: list[RequestOutput], outputs: list[RequestOutput]):
    self.failed, self.outputs = failed, outputs
    first = failed[0]
    many = f"{len(failed)} of {len(outputs)} requests failed; the first, {first.request_id!r}" if len(outputs) > 1 else \
      f"request {first.request_id!r} failed"
    super().__init__(f"{many}: {first.error}")
