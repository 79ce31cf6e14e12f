"""ThreadedEngine: an LLMEngine on a thread of its own. Every method may be called from any thread, by several
threads at once; `LLM` and `AsyncLLM` are thin fronts on it.

    caller threads                         the engine thread (the only one that touches tinygrad)
    input processing -> submit(req, sink) ─┐
    abort(id), call(fn)  ──────────────────┴─> command queue -> LLMEngine.step() -> sink(output) per request

Requests, aborts and calls cross a queue and are applied between steps; each output goes to its own request's
sink, so no caller ever sees (or drops) another's outputs. The loop steps while any request is unfinished and
blocks on the queue when there is none: an idle engine uses no CPU.
"""
from __future__ import annotations
import concurrent.futures, contextlib, os, queue, sqlite3, threading, time
from collections.abc import Callable, Iterable
from typing import Any, Protocol
from tinyvllm.config import EngineConfig
from tinyvllm.engine.failure_log import logger as log
from tinyvllm.engine.llm_engine import LLMEngine
from tinyvllm.engine.output_processor import IterationStats
from tinyvllm.engine.request import EngineRequest, SchedulerStats
from tinyvllm.outputs import CompletionOutput, RequestMetrics, RequestOutput
from tinyvllm.sampling_params import SamplingParams

Sink = Callable[[RequestOutput], None]

# tinygrad's process-wide state is not thread-safe: its Context variables are plain globals that a thread changes
# for the duration of a call, and its compile cache is one sqlite connection usable only by the thread that opened
# it. So every engine thread in the process does its tinygrad work under this one lock, on a cache connection any
# thread may use (`_share_compile_cache`).
_TINYGRAD_LOCK = threading.Lock()


class StatLogger(Protocol):
  """Called in the engine thread after every step (e.g. the server's Prometheus metrics)."""
  def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats) -> None: ...


class OutputStream:
  """One request's outputs, handed from the engine thread to one consumer. Cumulative snapshots: a consumer slower
  than the engine needs only the newest, so `put` replaces an output not yet read. Deltas (`delta`:
  RequestOutputKind.DELTA) are merged into the one not yet read instead (`RequestOutput.add`): nothing is lost, and
  still no backlog."""
  def __init__(self, delta: bool = False):
    self._cond = threading.Condition()
    self._latest: RequestOutput | None = None
    self._delta = delta

  def put(self, out: RequestOutput) -> None:
    with self._cond:
      if self._delta and self._latest is not None: self._latest.add(out)
      else: self._latest = out
      self._cond.notify()

  def get(self) -> RequestOutput:
    with self._cond:
      self._cond.wait_for(lambda: self._latest is not None)
      out, self._latest = self._latest, None
      return out


class ThreadedEngine:
  def __init__(self, config: EngineConfig, stat_loggers: Iterable[StatLogger] = ()):
    """Start the engine thread and wait until it has loaded the model (errors re-raise here, unchanged)."""
    self.config = config
    self.stat_loggers = list(stat_loggers)
    self._commands: queue.SimpleQueue = queue.SimpleQueue()
    self._sinks: dict[str, Sink] = {}                 # engine thread only
    self._ready = threading.Event()
    self._failure: BaseException | None = None        # why the thread stopped, if it did
    self._stopped = False
    self._pending_adds = 0                             # submitted, not yet taken by the engine thread
    self._count_lock = threading.Lock()
    self.scheduler_stats = SchedulerStats()           # the newest, replaced (never mutated) after each step
    # vLLM's manual surface (add_request / step): outputs of those requests wait here for step()
    self._manual = threading.Condition()
    self._manual_outputs: dict[str, RequestOutput] = {}
    self._manual_unfinished: set[str] = set()
    self._thread = threading.Thread(target=self._run, name="tinyvllm-engine", daemon=True)
    self._thread.start()
    self._ready.wait()
    if self._failure is not None: raise self._failure
    engine = self._engine
    self.tokenizer, self.input_processor = engine.tokenizer, engine.input_processor
    self.model_config, self.max_model_len, self.kernel_backend = engine.model_config, engine.max_model_len, engine.kernel_backend

  # ---- requests with their own sink (LLM, AsyncLLM) ----

  def submit(self, request: EngineRequest, sink: Sink) -> None:
    """Queue a processed request; every output of it goes to `sink`, called in the engine thread (keep it short)."""
    self._check_alive()
    with self._count_lock: self._pending_adds += 1
    self._commands.put(("add", request, sink))
    if self._stopped: self._fail_queued("the engine was shut down")   # it stopped just now: nobody will take this

  def abort(self, request_id: str, sink: Sink | None = None) -> None:
    """Stop a request before the next step; its sink gets a final output with finish_reason "abort". With `sink`,
    only if the request under that id is still the one submitted with it (ids can be reused once a request ends,
    and a refused duplicate must not abort the original)."""
    self._commands.put(("abort", request_id, sink))

  def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
    """Run fn(engine) in the engine thread between two steps and return its result (or raise its exception):
    the way to look inside the engine from another thread."""
    if threading.current_thread() is self._thread: return fn(self._engine)
    self._check_alive()
    future: concurrent.futures.Future = concurrent.futures.Future()
    self._commands.put(("call", fn, future))
    if self._stopped: self._fail_queued("the engine was shut down")
    return future.result()

  @property
  def num_waiting(self) -> int:
    """Requests not yet running: waiting in the scheduler after the last step, or not yet taken from the queue."""
    return self.scheduler_stats.num_waiting + self._pending_adds

  def is_alive(self) -> bool: return self._thread.is_alive() and not self._stopped

  def shutdown(self, timeout: float = 60.0) -> None:
    """Abort whatever runs, stop the thread and free the model. Safe to call twice."""
    if self._thread.is_alive():
      self._commands.put(("stop",))
      if threading.current_thread() is not self._thread: self._thread.join(timeout)

  # ---- vLLM's LLMEngine surface: requests whose outputs step() returns ----

  def add_request(self, request_id: str, prompt, params: SamplingParams | None = None, arrival_time: float | None = None) -> str:
    req = self.input_processor.process(request_id, prompt, params, arrival_time)
    with self._manual:
      if request_id in self._manual_unfinished: raise ValueError(f"request id {request_id!r} is already in use")
      self._manual_unfinished.add(request_id)
    try: self.submit(req, self._manual_put)
    except RuntimeError:
      with self._manual: self._manual_unfinished.discard(request_id)
      raise
    return request_id

  def step(self) -> list[RequestOutput]:
    """The newest output of every request added through `add_request` that advanced since the last call, waiting
    for the engine's next step if there is none yet. The engine runs on its own: step() only collects."""
    with self._manual:
      self._manual.wait_for(lambda: self._manual_outputs or not self._manual_unfinished)
      outs = list(self._manual_outputs.values())
      self._manual_outputs.clear()
      self._manual_unfinished.difference_update(o.request_id for o in outs if o.finished)
      return outs

  def abort_request(self, request_ids: str | Iterable[str]) -> None:
    for rid in [request_ids] if isinstance(request_ids, str) else list(request_ids): self.abort(rid)

  def has_unfinished_requests(self) -> bool:
    with self._manual: return bool(self._manual_unfinished or self._manual_outputs)

  def get_tokenizer(self): return self.tokenizer

  def _manual_put(self, out: RequestOutput) -> None:
    with self._manual:
      self._manual_outputs.pop(out.request_id, None)   # keep arrival order: re-insert at the end
      self._manual_outputs[out.request_id] = out
      self._manual.notify_all()

  # ---- the engine thread ----

  def _run(self) -> None:
    try:
      with _TINYGRAD_LOCK:
        _share_compile_cache()
        self._engine = LLMEngine(self.config)
    except BaseException as e:
      self._failure = e
      self._ready.set()
      return
    self._ready.set()
    try: self._loop(self._engine)
    except BaseException as e:   # a bug in this loop: every waiting caller must hear of it rather than hang
      log.critical("the engine thread stopped: %s: %s", type(e).__name__, e, exc_info=e)
      self._failure = e.with_traceback(None)   # the traceback's frames would keep the engine alive
      self._stopped = True                      # first: a submit from now on drains the queue itself
      self._fail_sinks(f"the engine thread stopped: {type(e).__name__}: {e}")
    finally:
      self._stopped = True
      with _TINYGRAD_LOCK: self._engine = None   # free the model and its KV cache (tinygrad frees the buffers)

  def _loop(self, engine: LLMEngine) -> None:
    while True:
      commands = [] if engine.has_unfinished_requests() else [self._commands.get()]   # idle: block
      with contextlib.suppress(queue.Empty):
        while True: commands.append(self._commands.get_nowait())
      if any(cmd[0] == "stop" for cmd in commands):
        self._stopped = True
        self._deliver(engine.abort_request(list(engine.output_processor.requests)))
        return self._fail_sinks("the engine was shut down", [cmd for cmd in commands if cmd[0] != "stop"])
      for cmd in commands: self._apply(engine, cmd)
      if engine.has_unfinished_requests():
        with _TINYGRAD_LOCK: outputs = engine.step()
        self._deliver(outputs)
        self.scheduler_stats = engine.last_stats[0]
        for logger in self.stat_loggers: self._guarded(logger.record, *engine.last_stats)
      else: self.scheduler_stats = engine.core.stats()

  def _apply(self, engine: LLMEngine, cmd: tuple) -> None:
    kind = cmd[0]
    if kind == "add":
      _, req, sink = cmd
      with self._count_lock: self._pending_adds -= 1
      try:
        engine.add_processed_request(req)
        self._sinks[req.request_id] = sink
      except Exception as e:   # e.g. a request id already in use: this request fails, nothing else
        log.warning("request %s refused: %s", req.request_id, e)
        self._guarded(sink, error_output(req.request_id, req.prompt, req.prompt_token_ids, str(e), req.metrics))
    elif kind == "abort":
      _, rid, sink = cmd
      if sink is None or self._sinks.get(rid) == sink: self._deliver(engine.abort_request(rid))   # == : bound methods
    elif kind == "call":
      _, fn, future = cmd
      try:
        with _TINYGRAD_LOCK: future.set_result(fn(engine))
      except Exception as e: future.set_exception(e)

  def _deliver(self, outputs: list[RequestOutput]) -> None:
    for out in outputs:
      sink = self._sinks.pop(out.request_id) if out.finished else self._sinks.get(out.request_id)
      if sink is not None: self._guarded(sink, out)

  def _fail_sinks(self, message: str, commands: list[tuple] = ()) -> None:
    """Tell every waiting caller that nothing more will come: open requests fail, queued ones too, calls raise."""
    sinks, self._sinks = self._sinks, {}
    for rid, sink in sinks.items(): self._guarded(sink, error_output(rid, None, [], message))
    self._fail_queued(message, commands)

  def _fail_queued(self, message: str, commands: list[tuple] = ()) -> None:
    """Commands nobody will apply (taken from the queue here; any thread may call this once the loop stopped)."""
    commands = list(commands)
    with contextlib.suppress(queue.Empty):
      while True: commands.append(self._commands.get_nowait())
    for cmd in commands:
      if cmd[0] == "add": self._guarded(cmd[2], error_output(cmd[1].request_id, cmd[1].prompt, cmd[1].prompt_token_ids, message))
      elif cmd[0] == "call": cmd[2].set_exception(RuntimeError(message))

  def _check_alive(self) -> None:
    if not self.is_alive():
      why = f": {type(self._failure).__name__}: {self._failure}" if self._failure else ""
      raise RuntimeError(f"the engine is not running (it was shut down or its thread stopped{why})")

  @staticmethod
  def _guarded(fn, *args) -> None:
    """Sinks and stat loggers are the callers' code: one that raises (an event loop already closed, say) must not
    stop the engine for everyone else."""
    try: fn(*args)
    except Exception: log.exception("an output sink or stat logger raised (the engine goes on)")


def error_output(request_id: str, prompt: str | None, prompt_token_ids: list[int], error: str,
                 metrics: RequestMetrics | None = None) -> RequestOutput:
  """The final output of a request that failed or was refused: finish_reason "error" and the reason."""
  return RequestOutput(request_id, prompt, list(prompt_token_ids), [CompletionOutput(0, "", [], finish_reason="error")], True,
                       metrics or RequestMetrics(arrival_time=time.time()), error=error)


def _share_compile_cache() -> None:
  """Give tinygrad a compile-cache connection that any thread may use (tinygrad serializes nothing; we call it
  under `_TINYGRAD_LOCK`). Without it, a kernel compiled on an engine thread after another thread opened the cache
  fails with sqlite3.ProgrammingError. Uses tinygrad 0.14's `helpers._db_connection` and `CACHEDB`
  (tests/test_threads.py checks they exist)."""
  from tinygrad import helpers
  if isinstance(helpers._db_connection, _SharedConnection): return
  try:
    os.makedirs(os.path.dirname(helpers.CACHEDB), exist_ok=True)
    conn = sqlite3.connect(helpers.CACHEDB, timeout=60, isolation_level="IMMEDIATE", check_same_thread=False,
                           factory=_SharedConnection)
    with contextlib.suppress(sqlite3.OperationalError): conn.execute("PRAGMA journal_mode=WAL").fetchone()
    conn.execute("PRAGMA synchronous=NORMAL")
  except (OSError, sqlite3.Error): return   # no usable cache file: tinygrad opens (or skips) its own
  helpers._db_connection = conn


class _SharedConnection(sqlite3.Connection):
  """Marks the connection `_share_compile_cache` made."""
