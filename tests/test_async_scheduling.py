"""Async scheduling (pipelined decoding): a step of greedy decodes launches the next step's run, its first pass fed the
tokens of the run before on the device, before the host reads them (EngineCore._follow, ModelRunner.launch_decodes).
On the CPU device the passes run as they are launched, so these tests check the bookkeeping, which is the same on a
GPU: every completion equals HF transformers' greedy one for the same tiny float32 checkpoint, runs that follow
others were launched, what a follow-up run wrote for a sequence that had stopped or was aborted is dropped, arrivals
and a short KV pool end the pipeline, and every KV block is back in the pool at the end (exact counts). On CUDA,
where the overlap is real, tests/test_gpu.py runs the engine with it on."""
from __future__ import annotations
import numpy as np
import pytest
from tinygrad import Tensor, dtypes
from tinyvllm import SamplingParams
from tinyvllm.config import ConfigError
from tinyvllm.engine.llm_engine import LLMEngine
from tinyvllm.kernels import portable
from test_multi_step import PROMPTS, hf_greedy, run


def pipelined(model, monkeypatch, **kwargs) -> tuple[LLMEngine, list[int]]:
  """An engine with async scheduling, and the list of runs it launches after another (their passes, appended)."""
  engine = LLMEngine.from_kwargs(str(model), async_scheduling=True, **({"num_kv_blocks": 64, "block_size": 8} | kwargs))
  follows, launch = [], engine.runner.launch_decodes
  def counted(decodes, steps, after=None, **kw):
    if after is not None: follows.append(steps)
    return launch(decodes, steps, after, **kw)
  monkeypatch.setattr(engine.runner, "launch_decodes", counted)
  return engine, follows


def test_store_tokens_wraps_around_the_history_ring():
  """portable.store_tokens writes a row fed from history row j into row j + 1, and row 0 after the last one (a
  pipelined run's rows of a ring), against numpy; the pass counter counts the passes; a token from past the history (a
  padding row's) stores nothing."""
  P, R = 3, 4
  rng = np.random.default_rng(1)
  start = rng.integers(0, 1000, R * P).astype(np.int32)
  history, counter = Tensor(start).realize(), Tensor.zeros(1, dtype=dtypes.int32).contiguous().realize()
  for row in (R - 1, 0, 2):
    tokens = (-1 - row * P - np.arange(P)).astype(np.int32)
    sampled = rng.integers(0, 1000, P).astype(np.int32)
    Tensor.realize(*portable.store_tokens(history, counter, Tensor(tokens), Tensor(sampled)))
    nxt = (row + 1) % R
    start[nxt * P:(nxt + 1) * P] = sampled
    assert (history.numpy() == start).all(), row
  assert counter.numpy()[0] == 3
  Tensor.realize(*portable.store_tokens(history, counter, Tensor(np.full(P, -1 - R * P, np.int32)), Tensor(sampled)))
  assert (history.numpy() == start).all()   # a padding row's token, past the history: nothing stored


@pytest.mark.parametrize("steps,capture_mode", [(1, "layer"), (1, "pass"), (3, "layer")])
def test_greedy_tokens_equal_hf(tiny_model, monkeypatch, steps, capture_mode):
  """Four sequences (prompts of 4 to 20 tokens, 13 to 22 new tokens) across KV blocks of 8 tokens: each completion is
  HF's greedy one, decode runs were launched before the run before them was read (a follow-up leaves out the
  sequences that end; all but the first run and the two whose batch shrank to another pass shape, 4 -> 2 -> 1), and
  no pass runs past the longest request's max_tokens (a sequence's end by max_tokens is known when the run after it
  is launched)."""
  engine, follows = pipelined(tiny_model, monkeypatch, num_scheduler_steps=steps, capture_mode=capture_mode)
  max_tokens = [13, 14, 15, 22]
  outs, passes = run(engine, PROMPTS, [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in max_tokens])
  for i, (prompt, n) in enumerate(zip(PROMPTS, max_tokens)):
    assert outs[str(i)].token_ids == hf_greedy(str(tiny_model), tuple(prompt), n), i
    assert outs[str(i)].finish_reason == "length"
  assert len(follows) >= -(-(max(max_tokens) - 1) // steps) - 3 and max(follows) == steps
  assert engine.runner.num_passes == 1 + max(max_tokens) - 1
  bm = engine.core.block_manager
  assert engine.core.in_flight is None and bm.num_free == bm.num_blocks


def test_a_stop_token_ends_the_pipeline(tiny_model, monkeypatch):
  """A stop token found while the next run was already launched ends the completion there (HF's continuation up to
  and including the stop token); that run's token is dropped and every block is back in the pool."""
  prompt = PROMPTS[2]
  want = hf_greedy(str(tiny_model), tuple(prompt), 30)
  at = next(i for i in range(6, 30) if want[i] not in want[:i])
  engine, follows = pipelined(tiny_model, monkeypatch)
  outs, _ = run(engine, [prompt], [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop_token_ids=[want[at]])])
  assert outs["0"].token_ids == want[:at + 1]
  assert outs["0"].finish_reason == "stop" and outs["0"].stop_reason == want[at]
  assert len(follows) >= at - 2 and engine.runner.num_passes == 1 + at + 1   # the prefill, the kept passes, the dropped one
  assert engine.core.block_manager.num_free == 64


def test_an_abort_and_an_arrival_while_a_run_is_in_flight(tiny_model, monkeypatch):
  """One of two pipelined sequences is aborted while a run is in flight, then a request arrives: the abort frees
  its blocks at once, the run's token for it is dropped, the arrival ends the pipeline for a step (it is admitted and
  prefilled), and the pipeline resumes over the two sequences left. Both completions are HF's greedy ones."""
  engine, follows = pipelined(tiny_model, monkeypatch)
  params = lambda n: SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
  engine.add_request("a", {"prompt_token_ids": PROMPTS[0]}, params(20))
  engine.add_request("b", {"prompt_token_ids": PROMPTS[1]}, params(20))
  outs = {}
  def step():
    for o in engine.step(): outs[o.request_id] = o.outputs[0]
  while len(follows) < 3: step()
  assert engine.core.in_flight is not None
  free = engine.core.block_manager.num_free
  final = engine.abort_request("b")
  assert final and final[0].outputs[0].finish_reason == "abort" and engine.core.block_manager.num_free > free
  step()   # reads the run in flight (b's token dropped), launches none after it: b was aborted
  assert engine.core.in_flight is None
  engine.add_request("c", {"prompt_token_ids": PROMPTS[2]}, params(12))
  before = len(follows)
  while engine.has_unfinished_requests(): step()
  assert len(follows) > before + 3   # the pipeline resumed once c was prefilled
  assert outs["a"].token_ids == hf_greedy(str(tiny_model), tuple(PROMPTS[0]), 20)
  assert outs["c"].token_ids == hf_greedy(str(tiny_model), tuple(PROMPTS[2]), 12)
  assert "b" not in outs or outs["b"].finish_reason is None   # b's last output came from abort_request
  assert engine.core.block_manager.num_free == 64


def test_requests_waiting_for_a_sequence_slot_keep_the_pipeline(tiny_model, monkeypatch):
  """Four requests with max_num_seqs=2: the two waiting could not be admitted (no sequence slot), so the two running
  keep being pipelined meanwhile; each waiting one is admitted when a slot frees. Every completion is HF's greedy one."""
  engine, follows = pipelined(tiny_model, monkeypatch, max_num_seqs=2)
  waiting_follows = []
  launch = engine.runner.launch_decodes
  def counted(decodes, steps, after=None, **kw):
    if after is not None and engine.core.scheduler.waiting: waiting_follows.append(steps)
    return launch(decodes, steps, after, **kw)
  monkeypatch.setattr(engine.runner, "launch_decodes", counted)
  n = [9, 16, 12, 7]
  outs, _ = run(engine, PROMPTS, [SamplingParams(temperature=0, max_tokens=k, ignore_eos=True) for k in n])
  for i, (prompt, k) in enumerate(zip(PROMPTS, n)): assert outs[str(i)].token_ids == hf_greedy(str(tiny_model), tuple(prompt), k), i
  assert len(waiting_follows) >= 5
  assert engine.core.block_manager.num_free == 64


def test_a_follow_up_that_fails_to_launch(tiny_model, monkeypatch, caplog):
  """The third follow-up's launch raises: it is logged and dropped, the run it followed is read and committed, the
  pipeline starts again at the next step, and the completions are HF's greedy ones, with no error."""
  engine, follows = pipelined(tiny_model, monkeypatch)
  launch = engine.runner.launch_decodes
  def flaky(decodes, steps, after=None, **kw):
    if after is not None and len(follows) == 3: follows.append(0); raise RuntimeError("injected launch failure")
    return launch(decodes, steps, after, **kw)
  monkeypatch.setattr(engine.runner, "launch_decodes", flaky)
  with caplog.at_level("ERROR", logger="tinyvllm"):
    outs, _ = run(engine, PROMPTS[:2], [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True) for _ in range(2)])
  for i in range(2):
    assert outs[str(i)].token_ids == hf_greedy(str(tiny_model), tuple(PROMPTS[i]), 12) and outs[str(i)].finish_reason == "length"
  assert "launching the next decode run" in caplog.text and "injected launch failure" in caplog.text
  assert len(follows) > 5 and engine.core.block_manager.num_free == 64


def test_a_short_pool_and_max_model_len(tiny_model, monkeypatch):
  """Over a KV pool too small for every follow-up's room (the pipeline waits, sequences are preempted and recomputed)
  and with a sequence running into max_model_len, every completion is HF's greedy one, the one at the limit ends with
  "length" at exactly max_model_len tokens, and the pool is whole at the end."""
  engine, follows = pipelined(tiny_model, monkeypatch, num_kv_blocks=7, max_model_len=48, max_num_seqs=3, enable_prefix_caching=False)
  prompts = PROMPTS + [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8] * 5]
  n = [24, 9, 17, 11, 20, 100]
  outs, _ = run(engine, prompts, [SamplingParams(temperature=0, max_tokens=k, ignore_eos=True) for k in n])
  for i, (prompt, k) in enumerate(zip(prompts, n)):
    assert outs[str(i)].token_ids == hf_greedy(str(tiny_model), tuple(prompt), min(k, 48 - len(prompt))), i
  assert len(prompts[5]) + len(outs["5"].token_ids) == 48 and outs["5"].finish_reason == "length"
  assert follows and engine.core.scheduler.num_preemptions > 0
  assert engine.core.block_manager.num_free == 7


def test_requests_that_read_logits_are_not_pipelined(tiny_model, monkeypatch):
  """A batch holding a request that samples (temperature > 0) is not pipelined; the greedy one left alone then is.
  The greedy completion is HF's; the sampled one has its length."""
  engine, follows = pipelined(tiny_model, monkeypatch)
  params = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), SamplingParams(temperature=0.8, max_tokens=6, ignore_eos=True, seed=3)]
  outs, _ = run(engine, PROMPTS[:2], params)
  assert outs["0"].token_ids == hf_greedy(str(tiny_model), tuple(PROMPTS[0]), 20) and len(outs["1"].token_ids) == 6
  assert 0 < len(follows) <= 20 - 6


def test_off_by_default_and_refused_where_copies_are_not_ordered():
  """Off by default on every device (not yet timed on a GPU); asked for, on for CUDA (CUDA:1 too), the CPU device and
  tinygrad's NULL device, refused on METAL, NV and AMD."""
  from tinyvllm.config import EngineConfig
  from tinyvllm.engine.core import pipelines
  assert not any(pipelines(d, EngineConfig()) for d in ("CUDA", "CPU", "METAL", "NV", "AMD", "NULL"))
  on = EngineConfig(async_scheduling=True)
  assert all(pipelines(d, on) for d in ("CUDA", "CUDA:1", "CPU", "NULL"))
  for d in ("METAL", "NV", "AMD"):
    with pytest.raises(ConfigError, match=f"async_scheduling=True on {d}"): pipelines(d, on)
  with pytest.raises(ConfigError, match="async_scheduling must be True or False"): EngineConfig(async_scheduling=None)


def test_settings(tiny_model):
  """Off by default; refused with a draft model, tensor parallelism and (emulated) Metal, whose uploads are not
  ordered with the work in flight."""
  import sys
  from tinygrad.helpers import Context
  assert not LLMEngine.from_kwargs(str(tiny_model), num_kv_blocks=16).core.pipelined
  with pytest.raises(ConfigError, match="async_scheduling and draft_model"):
    LLMEngine.from_kwargs(str(tiny_model), async_scheduling=True, draft_model="self:1")
  with pytest.raises(ConfigError, match="tensor_parallel_size must be 1"):
    LLMEngine.from_kwargs(str(tiny_model), async_scheduling=True, tensor_parallel_size=2)
  if sys.platform != "darwin":
    from tinyvllm.kernels.emulator.metal_device import install
    install()
  with Context(DEV="METAL"), pytest.raises(ConfigError, match="async_scheduling=True on METAL"):
    LLMEngine.from_kwargs(str(tiny_model), async_scheduling=True, num_kv_blocks=16, dtype="float32")


def test_cuda_copies_through_a_recording_driver():
  """replay._CudaCopies (CUDA's ordered copies; no GPU here) through a stand-in for tinygrad's CUDA driver bindings that
  executes each queued copy at once, as a stream that is never behind, and records every call: an upload lands its
  bytes through a pinned staging buffer and records an event; a read queues its copy and an event, and waits on that
  event, not the device, when taken, returning the bytes as of its copy; a staging buffer is reused after SLOTS copies
  of its kind, once its event is done, and pinned anew when a copy outgrows it; a read taken too late raises; closing
  frees every pinned buffer and event."""
  import ctypes
  from types import SimpleNamespace
  from tinyvllm.engine.replay import _CudaCopies
  calls, pinned = [], []
  def alloc(ptr, size, flags):
    pinned.append(ctypes.create_string_buffer(size))
    ptr._obj.value = ctypes.addressof(pinned[-1])
    calls.append(("pin", size)); return 0
  def copy(kind):
    def run(dst, src, n, stream):
      assert stream is None   # tinygrad's launches go to the legacy default stream: so must the copies
      ctypes.memmove(dst.value if hasattr(dst, "value") else dst, src.value if hasattr(src, "value") else src, n)
      calls.append((kind, n)); return 0
    return run
  events = iter(range(1000))
  def create(ev, flags):
    assert flags == 2; ev._obj.id = next(events); return 0
  class Event(ctypes.Structure): _fields_ = [("id", ctypes.c_int)]
  cuda = SimpleNamespace(
    cuCtxSetCurrent=lambda ctx: 0, cuMemHostAlloc=alloc, cuMemFreeHost=lambda p: calls.append(("free",)) or 0,
    cuMemcpyHtoDAsync_v2=copy("htod"), cuMemcpyDtoHAsync_v2=copy("dtoh"), CUevent=Event,
    cuEventCreate=create, cuEventRecord=lambda ev, stream: calls.append(("record", ev.id)) or 0,
    cuEventSynchronize=lambda ev: calls.append(("sync", ev.id)) or 0, cuEventDestroy_v2=lambda ev: calls.append(("destroy",)) or 0)
  copies = _CudaCopies(SimpleNamespace(context=None), cuda, lambda status: None)
  memory = ctypes.create_string_buffer(64)   # the "device" buffer
  buf = SimpleNamespace(_buf=ctypes.addressof(memory), nbytes=64, ensure_allocated=lambda: buf)
  values = np.arange(16, dtype=np.int32)
  copies.upload(buf, values)
  assert np.frombuffer(memory.raw, np.int32).tolist() == values.tolist()
  assert calls[-3:] == [("pin", 4096), ("htod", 64), ("record", 0)]
  read = copies.read_later(buf)
  memory[:4] = b"\x07\x00\x00\x00"   # the device moves on after the read's copy was queued
  assert read().tolist() == values.tolist() and calls[-1] == ("sync", 1)
  for i in range(copies.SLOTS): copies.upload(buf, values + i)
  assert ("sync", 0) in calls[-3:]   # the first staging buffer's reuse waited for its last copy
  big_memory = ctypes.create_string_buffer(8192)
  big = SimpleNamespace(_buf=ctypes.addressof(big_memory), nbytes=8192)
  big.ensure_allocated = lambda: big
  late = copies.read_later(big)
  for _ in range(copies.SLOTS): copies.read_later(big)
  assert ("pin", 8192) in calls   # outgrown: pinned anew
  with pytest.raises(RuntimeError, match="staging buffer was reused"): late()
  copies.close()
  assert calls.count(("free",)) == sum(c[0] == "pin" for c in calls) and calls.count(("destroy",)) == 2 * copies.SLOTS
