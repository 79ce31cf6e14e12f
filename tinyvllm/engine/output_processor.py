"""Output processing: the core's token ids -> text, stop strings, logprobs -> one RequestOutput per request.

Keeps each request's text state (incremental detokenizer, released text, logprobs) by request id, so every
output reaches its own request whatever else ran in the step. A stop string is found here, not in the core:
the completion finishes here and is reported back to be aborted in the core (its blocks freed).
"""
from __future__ import annotations
import dataclasses, time
from dataclasses import dataclass, field
from tinyvllm.engine.failure_log import FailureLog
from tinyvllm.engine.request import CoreOutput, EngineRequest, TopLogprobs
from tinyvllm.model.tokenizer import IncrementalDetokenizer, Tokenizer
from tinyvllm.outputs import CompletionOutput, Logprob, RequestOutput
from tinyvllm.sampling_params import RequestOutputKind


@dataclass
class FinishedRequestStats:
  finish_reason: str
  e2e_latency: float
  num_prompt_tokens: int
  num_generation_tokens: int


@dataclass
class IterationStats:
  """What one step produced, for metrics (vLLM's IterationStats, small)."""
  num_prompt_tokens: int = 0          # prompts of requests that got their first token in this step
  num_generation_tokens: int = 0
  time_to_first_tokens: list[float] = field(default_factory=list)
  inter_token_latencies: list[float] = field(default_factory=list)
  finished: list[FinishedRequestStats] = field(default_factory=list)


@dataclass
class CompletionState:
  """One completion's progress. Its text is what the detokenizer emitted, up to a stop string's cut (`stop_at`):
  kept there in pieces, never copied whole while it grows."""
  index: int
  detokenizer: IncrementalDetokenizer
  token_ids: list[int] = field(default_factory=list)
  logprobs: list[dict[int, Logprob]] | None = None
  cumulative_logprob: float = 0.0
  finish_reason: str | None = None
  stop_reason: int | str | None = None
  sent_tokens: int = 0   # DELTA outputs: the tokens and characters of visible text already handed out
  sent_chars: int = 0
  stop_at: int | None = None   # the text's end once a stop string cut it

  @property
  def num_chars(self) -> int: return self.detokenizer.num_chars if self.stop_at is None else self.stop_at

  def text_since(self, start: int = 0) -> str:
    """The text from character `start` on."""
    new = self.detokenizer.since(start)
    return new if self.stop_at is None else new[:max(0, self.stop_at - start)]


@dataclass
class RequestState:
  request: EngineRequest
  completions: list[CompletionState]
  prompt_logprobs: list[dict[int, Logprob] | None] | None = None
  error: str | None = None
  last_token_time: float | None = None
  sent_prompt_logprobs: int = 0   # DELTA outputs: prompt logprob entries already handed out

  @property
  def finished(self) -> bool: return all(c.finish_reason is not None for c in self.completions)


class OutputProcessor:
  def __init__(self, tokenizer: Tokenizer, failures: FailureLog | None = None):
    self.tokenizer, self.failures = tokenizer, failures or FailureLog()
    self.requests: dict[str, RequestState] = {}

  def add_request(self, req: EngineRequest) -> None:
    p = req.params
    completions = [CompletionState(i, self.tokenizer.detokenizer(req.prompt_token_ids, skip_special_tokens=p.skip_special_tokens),
                                   logprobs=[] if p.logprobs is not None else None) for i in range(p.n)]
    self.requests[req.request_id] = RequestState(req, completions, [None] if p.prompt_logprobs is not None else None)

  def has_unfinished(self) -> bool: return bool(self.requests)

  def process(self, core_outputs: list[CoreOutput]) -> tuple[list[RequestOutput], list[tuple[str, int | None, str]], IterationStats]:
    """Apply one step's core outputs. Returns the RequestOutputs of the requests it advanced, what to abort in the
    core as (request id, completion index or None for all, reason: "stop" after a stop string, "error" after a
    failure here) and the step's stats. A request whose processing raises fails alone."""
    now, stats = time.time(), IterationStats()
    by_request: dict[str, list[CoreOutput]] = {}
    for out in core_outputs: by_request.setdefault(out.request_id, []).append(out)
    results: list[RequestOutput] = []
    to_abort: list[tuple[str, int | None, str]] = []
    for rid, outs in by_request.items():
      state = self.requests.get(rid)
      if state is None: continue     # aborted by the caller while the step ran
      try:
        for out in outs:
          if self._apply(state, out, stats): to_abort.append((rid, out.index, "stop"))
        self._step_stats(state, now, stats)
        if state.finished or state.request.params.output_kind is not RequestOutputKind.FINAL_ONLY: results.append(self._output(state))
      except Exception as e:
        self.failures.record("output processing", e, [rid])
        results.append(self._fail(state, f"output processing failed: {type(e).__name__}: {e}"))
        to_abort.append((rid, None, "error"))
    for out in results:
      if out.finished:
        state = self.requests.pop(out.request_id)
        stats.finished.append(finished_stats(out, self._finish_reason(state), now))
    return results, to_abort, stats

  def _apply(self, state: RequestState, out: CoreOutput, stats: IterationStats) -> bool:
    """One completion's step; True when a stop string ended it (the core has yet to hear of it)."""
    c = state.completions[out.index]
    if c.finish_reason is not None: return False   # a stop string ended it; its abort reached the core after this step
    if out.prompt_logprobs: state.prompt_logprobs += [self._logprob_dict(e) for e in out.prompt_logprobs]
    if out.finish_reason == "error":
      state.error = state.error or out.error
      c.detokenizer.flush()
      c.finish_reason = "error"
      return False
    before = len(c.token_ids)
    stopped = self._add_tokens(state, c, out)
    stats.num_generation_tokens += len(c.token_ids) - before
    if c.finish_reason is None and out.finish_reason is not None:
      c.detokenizer.flush()
      c.finish_reason, c.stop_reason = out.finish_reason, out.stop_reason
    return stopped and out.finish_reason is None

  def _fail(self, state: RequestState, error: str) -> RequestOutput:
    """Finish every completion of a request with an error, without flushing the detokenizer (it may be what failed):
    the text is what it emitted before."""
    for c in state.completions:
      if c.finish_reason is None: c.finish_reason = "error"
    state.error = state.error or error
    state.request.metrics.finished_time = time.time()
    req, delta = state.request, state.request.params.output_kind is RequestOutputKind.DELTA
    return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids,
                         [CompletionOutput(c.index, c.text_since(c.sent_chars if delta else 0), c.token_ids[c.sent_tokens if delta else 0:],
                                           finish_reason=c.finish_reason) for c in state.completions],
                         True, dataclasses.replace(req.metrics), error=state.error)

  def abort(self, request_id: str, reason: str = "abort", error: str | None = None) -> RequestOutput | None:
    """Finish every running completion of a request; returns its final output (None if unknown)."""
    state = self.requests.pop(request_id, None)
    if state is None: return None
    for c in state.completions:
      if c.finish_reason is None:
        c.detokenizer.flush()
        c.finish_reason = reason
    state.error = state.error or error
    state.request.metrics.finished_time = time.time()
    return self._output(state)

  def _add_tokens(self, state: RequestState, c: CompletionState, out: CoreOutput) -> bool:
    """Append new tokens, text and logprobs; True when a stop string ended the completion."""
    p, m = state.request.params, state.request.metrics
    for i, token in enumerate(out.new_token_ids):
      c.token_ids.append(token)
      m.num_generated_tokens += 1
      if c.logprobs is not None and out.new_logprobs is not None:
        entry = out.new_logprobs[i]
        c.logprobs.append(self._logprob_dict(entry))
        c.cumulative_logprob += next(lp for t, lp, _ in entry if t == token)
      # the EOS or stop token that ended the completion is not part of its text (vLLM's rule): with special tokens
      # kept (skip_special_tokens=False), "</s>" would end every answer; include_stop_str_in_output keeps it
      if i == len(out.new_token_ids) - 1 and out.finish_reason == "stop" and not isinstance(out.stop_reason, str) \
         and not p.include_stop_str_in_output: continue
      delta = c.detokenizer.add(token)
      # like stop tokens (banned until then), stop strings count only from min_tokens on
      if p.stop_strings and len(c.token_ids) >= p.min_tokens and self._hit_stop_string(c, p, len(delta)): return True
    return False

  @staticmethod
  def _hit_stop_string(c: CompletionState, p, new_chars: int) -> bool:
    for stop in p.stop_strings:   # only a match that overlaps the new text can be new
      start = max(0, c.num_chars - new_chars - len(stop) + 1)
      at = c.text_since(start).find(stop)
      if at >= 0:
        c.stop_at = start + at + (len(stop) if p.include_stop_str_in_output else 0)
        c.finish_reason, c.stop_reason = "stop", stop
        return True
    return False

  def _logprob_dict(self, entry: TopLogprobs) -> dict[int, Logprob]:
    return {t: Logprob(lp, rank, self.tokenizer.token_to_str(t)) for t, lp, rank in entry}

  @staticmethod
  def _finish_reason(state: RequestState) -> str:
    reasons = [c.finish_reason for c in state.completions]
    return "error" if "error" in reasons else reasons[0]

  @staticmethod
  def _step_stats(state: RequestState, now: float, stats: IterationStats) -> None:
    m = state.request.metrics
    if m.num_generated_tokens == 0: return
    if m.first_token_time is None:
      m.first_token_time = now
      stats.time_to_first_tokens.append(now - m.arrival_time)
      stats.num_prompt_tokens += m.num_prompt_tokens
    elif state.last_token_time is not None and state.last_token_time != now:
      stats.inter_token_latencies.append(now - state.last_token_time)
    state.last_token_time = now
    if state.finished: m.finished_time = now

  def _output(self, state: RequestState) -> RequestOutput:
    """A snapshot: later steps never change an output already handed out (it may be read in another thread). With
    output_kind DELTA, only what this request's earlier outputs did not hold (cumulative_logprob stays the running
    total, as in vLLM)."""
    req, delta = state.request, state.request.params.output_kind is RequestOutputKind.DELTA
    outs = []
    for c in state.completions:
      tokens, chars = (c.sent_tokens, c.sent_chars) if delta else (0, 0)
      text = _visible_text(c, req.params.stop_strings, chars)
      outs.append(CompletionOutput(c.index, text, c.token_ids[tokens:], c.cumulative_logprob if c.logprobs is not None else None,
                                   c.logprobs[tokens:] if c.logprobs is not None else None, c.finish_reason, c.stop_reason))
      if delta: c.sent_tokens, c.sent_chars = len(c.token_ids), chars + len(text)
    prompt_logprobs = state.prompt_logprobs[state.sent_prompt_logprobs if delta else 0:] if state.prompt_logprobs is not None else None
    if delta and prompt_logprobs is not None: state.sent_prompt_logprobs = len(state.prompt_logprobs)
    return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, outs, state.finished,
                         dataclasses.replace(req.metrics), error=state.error, prompt_logprobs=prompt_logprobs,
                         num_cached_tokens=req.metrics.num_cached_tokens or 0)


def finished_stats(out: RequestOutput, reason: str, now: float) -> FinishedRequestStats:
  """(The tokens from the request's metrics: a DELTA output holds only its last ones.)"""
  return FinishedRequestStats(reason, now - out.metrics.arrival_time, len(out.prompt_token_ids), out.metrics.num_generated_tokens)


def _visible_text(c: CompletionState, stop_strings: tuple[str, ...], start: int) -> str:
  """The text from character `start` on; while running, less a tail that could still turn into a stop string, so
  streams never show it."""
  end = c.num_chars
  if c.finish_reason is None and stop_strings:
    first = min(start, max(0, end - max(len(stop) for stop in stop_strings) + 1))   # the tail a stop could begin in
    text = c.text_since(first)
    hold = 0
    for stop in stop_strings:
      for k in range(min(len(stop) - 1, len(text)), 0, -1):
        if text.endswith(stop[:k]): hold = max(hold, k); break
    return text[start - first:max(0, end - hold - first)]
  return c.text_since(start)[:max(0, end - start)]
