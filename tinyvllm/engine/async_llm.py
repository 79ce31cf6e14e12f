"""AsyncLLM: the asyncio front on a ThreadedEngine (the server's engine).

    engine = AsyncLLM("path/to/model")
    async for out in engine.generate("Hello", SamplingParams(max_tokens=32), request_id="r1"):
      print(out.outputs[0].text)

Outputs cross from the engine thread to the event loop through one `AsyncOutputStream` per request. Leaving the
loop early, or cancelling the task that iterates it (a client that hung up), aborts the request: its KV blocks
are free before the engine's next step.
"""
from __future__ import annotations
import asyncio, itertools, threading, weakref
from collections.abc import AsyncIterator, Iterable
from tinyvllm.config import EngineConfig
from tinyvllm.engine.threaded_engine import StatLogger, ThreadedEngine
from tinyvllm.outputs import GenerationError, RequestOutput
from tinyvllm.sampling_params import RequestOutputKind, SamplingParams


class LoopHandoff:
  """Calls from the engine thread into one event loop, batched. Each `call_soon_threadsafe` writes the loop's self-pipe
  (a system call on the engine thread, holding up its next step) and wakes the loop once: a step of 32 streams made 32
  of each. Calls queue here instead, and one wake-up runs every call queued by then, in order."""
  def __init__(self, loop: asyncio.AbstractEventLoop):
    # the loop weakly: AsyncLLM keeps a handoff per loop it served, which must not keep a finished loop alive
    self._loop, self._calls, self._lock, self._woken = weakref.ref(loop), [], threading.Lock(), False

  def call(self, fn, arg) -> None:   # any thread
    with self._lock:
      self._calls.append((fn, arg))
      if self._woken: return
      self._woken = True
    try:
      if (loop := self._loop()) is None: raise RuntimeError("the event loop is gone")
      loop.call_soon_threadsafe(self._run)
    except RuntimeError:   # the loop has closed: nobody waits for these, or for any after them
      with self._lock: self._calls, self._woken = [], False

  def _run(self) -> None:
    with self._lock: calls, self._calls, self._woken = self._calls, [], False
    for fn, arg in calls:
      try: fn(arg)
      except Exception as e:   # as the loop reports a callback that raised: the calls after it still run
        if (loop := self._loop()) is not None:
          loop.call_exception_handler({"message": "an output handed to the event loop raised", "exception": e})


class AsyncOutputStream:
  """One request's outputs, put by the engine thread, awaited in the event loop. Cumulative snapshots: an output not
  yet read is replaced by the newer one, so a slow client never makes a backlog; deltas (`delta`) are merged into it
  instead (`RequestOutput.add`)."""
  def __init__(self, handoff: LoopHandoff, delta: bool = False):
    self._handoff, self._latest, self._ready, self._delta = handoff, None, asyncio.Event(), delta

  def put(self, out: RequestOutput) -> None:   # engine thread
    self._handoff.call(self._set, out)

  def _set(self, out: RequestOutput) -> None:
    if self._delta and self._latest is not None: self._latest.add(out)
    else: self._latest = out
    self._ready.set()

  async def get(self) -> RequestOutput:
    await self._ready.wait()
    self._ready.clear()
    out, self._latest = self._latest, None
    return out


class RequestStream:
  """The outputs of one added request, as an async iterator. `aclose()` (or cancelling the iterating task)
  aborts the request if it has not finished."""
  def __init__(self, engine: ThreadedEngine, request_id: str, stream: AsyncOutputStream):
    self.request_id, self._engine, self._stream, self.finished = request_id, engine, stream, False

  def __aiter__(self): return self

  async def __anext__(self) -> RequestOutput:
    if self.finished: raise StopAsyncIteration
    try: out = await self._stream.get()
    except BaseException:   # cancelled: the client is gone
      await self.aclose()
      raise
    self.finished = out.finished
    return out

  async def aclose(self) -> None:
    if not self.finished:
      self.finished = True
      self._engine.abort(self.request_id, self._stream.put)


class AsyncLLM:
  def __init__(self, model: str | None = None, *, stat_loggers: Iterable[StatLogger] = (), **kwargs):
    """Load the model (blocking: build it before serving). Engine arguments as for `LLM`."""
    self._start(EngineConfig.from_kwargs(model=model, **kwargs), stat_loggers)

  @classmethod
  def from_config(cls, config: EngineConfig, stat_loggers: Iterable[StatLogger] = ()) -> AsyncLLM:
    self = cls.__new__(cls)
    self._start(config, stat_loggers)
    return self

  def _start(self, config: EngineConfig, stat_loggers: Iterable[StatLogger]) -> None:
    self.engine = ThreadedEngine(config, stat_loggers)
    self._ids = itertools.count()
    self._handoffs: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopHandoff] = weakref.WeakKeyDictionary()
    self._finalizer = weakref.finalize(self, self.engine.shutdown)   # stop the engine thread when collected

  @property
  def tokenizer(self): return self.engine.tokenizer
  def get_tokenizer(self): return self.engine.tokenizer
  @property
  def model_config(self): return self.engine.model_config
  @property
  def max_model_len(self) -> int: return self.engine.max_model_len
  @property
  def input_processor(self): return self.engine.input_processor

  def add_request(self, request_id: str | None, prompt, params: SamplingParams | None = None) -> RequestStream:
    """Check and queue a request, returning its output stream. A bad prompt or parameter raises ValueError or
    TypeError here, before anything is queued (a server answers 400 before it starts a response)."""
    request_id = request_id if request_id is not None else f"async-{next(self._ids)}"
    request = self.engine.input_processor.process(request_id, prompt, params)
    loop = asyncio.get_running_loop()
    if (handoff := self._handoffs.get(loop)) is None: handoff = self._handoffs[loop] = LoopHandoff(loop)
    stream = AsyncOutputStream(handoff, delta=request.params.output_kind is RequestOutputKind.DELTA)
    self.engine.submit(request, stream.put)
    return RequestStream(self.engine, request_id, stream)

  async def generate(self, prompt, sampling_params: SamplingParams | None = None,
                     request_id: str | None = None) -> AsyncIterator[RequestOutput]:
    """Yield snapshots of the request as it advances; the last one is finished. A request the engine fails raises
    `GenerationError` (with the failed output) instead of a last snapshot. (`add_request` streams yield that output.)"""
    stream = self.add_request(request_id, prompt, sampling_params)
    try:
      async for out in stream:
        if out.error: raise GenerationError([out], [out])
        yield out
    finally: await stream.aclose()

  async def abort(self, request_id: str) -> None: self.engine.abort(request_id)

  async def call(self, fn):
    """Run fn(LLMEngine) on the engine thread without blocking the event loop."""
    return await asyncio.get_running_loop().run_in_executor(None, self.engine.call, fn)

  @property
  def num_waiting(self) -> int: return self.engine.num_waiting

  def is_healthy(self) -> bool: return self.engine.is_alive()

  def shutdown(self) -> None: self._finalizer()
