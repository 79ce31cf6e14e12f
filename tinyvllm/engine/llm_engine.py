"""LLMEngine: the whole engine in the calling thread. Input processing -> engine core -> output processing.

    engine = LLMEngine.from_kwargs("path/to/model", num_kv_blocks=256)
    engine.add_request("a", "Hello", SamplingParams(max_tokens=8))
    while engine.has_unfinished_requests():
      for out in engine.step(): print(out.request_id, out.outputs[0].text)

vLLM's surface (`add_request`, `step`, `abort_request`, `has_unfinished_requests`). tinygrad is not thread-safe:
use an LLMEngine only from the thread that built it. `LLM` and `AsyncLLM` run one on a thread of its own
(`ThreadedEngine`), which is what makes them usable from any thread.
"""
from __future__ import annotations
import dataclasses, time
from collections.abc import Iterable
from tinyvllm.config import EngineConfig
from tinyvllm.engine.core import EngineCore
from tinyvllm.engine.failure_log import FailureLog
from tinyvllm.engine.input_processor import InputProcessor
from tinyvllm.engine.output_processor import IterationStats, OutputProcessor, finished_stats
from tinyvllm.engine.request import EngineRequest, SchedulerStats
from tinyvllm.model.tokenizer import load_tokenizer
from tinyvllm.model.weights import load_checkpoint
from tinyvllm.outputs import RequestOutput
from tinyvllm.sampling_params import SamplingParams


class LLMEngine:
  def __init__(self, config: EngineConfig):
    self.config = config
    ckpt = load_checkpoint(config.model, config.quantization)
    self.tokenizer = load_tokenizer(ckpt.path)
    self.failures = FailureLog()   # every failure below is confined to its requests, and logged once (failure_log.py)
    self.core = EngineCore(config, ckpt, self.tokenizer, self.failures)
    del ckpt   # the model holds its weights on the device now: let the host copy go
    self.input_processor = InputProcessor(self.tokenizer, self.core.model_config.vocab_size, self.core.max_model_len)
    self.output_processor = OutputProcessor(self.tokenizer, self.failures)
    self.last_stats: tuple[SchedulerStats, IterationStats] = (self.core.stats(), IterationStats())

  @classmethod
  def from_kwargs(cls, model: str | None = None, **kwargs) -> LLMEngine:
    return cls(EngineConfig.from_kwargs(model=model, **kwargs))

  # ---- requests ----

  def add_request(self, request_id: str, prompt, params: SamplingParams | None = None, arrival_time: float | None = None) -> str:
    """Queue a request. Raises ValueError/TypeError naming the problem for a bad prompt or parameter; requests
    already queued are unaffected. Returns the request id."""
    self.add_processed_request(self.input_processor.process(request_id, prompt, params, arrival_time))
    return request_id

  def add_processed_request(self, req: EngineRequest) -> None:
    """Queue a request that input processing has already checked (possibly in another thread)."""
    if req.request_id in self.output_processor.requests: raise ValueError(f"request id {req.request_id!r} is already in use")
    self.core.add_request(req)
    self.output_processor.add_request(req)

  def abort_request(self, request_ids: str | Iterable[str], error: str | None = None) -> list[RequestOutput]:
    """Stop requests and free their KV blocks. Returns their final outputs (finish_reason "abort", or "error"
    when `error` says why); ids that are unknown or already finished are ignored."""
    reason = "error" if error else "abort"
    finals = []
    for rid in [request_ids] if isinstance(request_ids, str) else list(request_ids):
      self.core.abort(rid, reason=reason)
      if (out := self.output_processor.abort(rid, reason, error)) is not None: finals.append(out)
    return finals

  def warm_up(self, progress: bool = True) -> int:
    """Capture every pass shape a step can take before the first request (EngineCore.warm_up); the shapes captured."""
    return self.core.warm_up(progress)

  def has_unfinished_requests(self) -> bool: return self.output_processor.has_unfinished()

  def get_num_unfinished_requests(self) -> int: return len(self.output_processor.requests)

  # ---- the loop ----

  def step(self) -> list[RequestOutput]:
    """Run one model step; returns the outputs of the requests it advanced (a snapshot each: text so far).

    Failures are confined by the core and output processing to the requests they concern. One the core cannot
    confine (a bug in scheduling, say) fails every unfinished request with finish_reason "error" and leaves the
    engine empty and ready for new requests."""
    try:
      core_outputs, scheduler_stats = self.core.step()
    except Exception as e:
      self.failures.record("engine step", e, list(self.output_processor.requests))
      finals = self.abort_request(list(self.output_processor.requests), error=f"engine step failed: {type(e).__name__}: {e}")
      now = time.time()
      self.last_stats = (self.core.stats(), IterationStats(finished=[finished_stats(o, "error", now) for o in finals]))
      return finals
    outputs, to_abort, iteration_stats = self.output_processor.process(core_outputs)
    for rid, index, reason in to_abort: self.core.abort(rid, index, reason=reason)
    self.last_stats = (scheduler_stats if not to_abort else self._with_state(scheduler_stats), iteration_stats)
    return outputs

  def _with_state(self, stats: SchedulerStats) -> SchedulerStats:
    """The step's counts with the state after the aborts that followed it."""
    now = self.core.stats()
    return dataclasses.replace(stats, num_running=now.num_running, num_waiting=now.num_waiting, kv_cache_usage=now.kv_cache_usage)

  # ---- read-only views (benchmarks, tests) ----

  def get_tokenizer(self): return self.tokenizer
  @property
  def model_config(self): return self.core.model_config
  @property
  def max_model_len(self) -> int: return self.core.max_model_len
  @property
  def kernel_backend(self) -> str: return self.core.kernel_backend
  @property
  def scheduler(self): return self.core.scheduler
  @property
  def block_manager(self): return self.core.block_manager
  @property
  def runner(self): return self.core.runner
  @property
  def spec(self): return self.core.spec
