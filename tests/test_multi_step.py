"""Multi-step decoding (num_scheduler_steps): greedy decode passes run back to back, each reading the tokens the pass
before took on the device (ModelRunner.execute_steps). References: HF transformers' greedy continuations of the same
tiny float32 checkpoints (the tokens must be equal), numpy for the kernels that feed the tokens back, exact block
counts for the KV pool, and on the emulated METAL device its counters of copies and waits (what a Mac would pay)."""
from __future__ import annotations
import dataclasses, functools
import numpy as np
import pytest
from tinygrad import Tensor, TinyJit, dtypes
from tinygrad.helpers import Context
from tinyvllm import SamplingParams
from tinyvllm.config import ConfigError
from tinyvllm.engine.llm_engine import LLMEngine
from tinyvllm.kernels import portable
from test_replay import DEVICES

PROMPTS = [[5, 9, 13, 2, 7], [11, 3, 3, 8], [4, 20, 6, 1, 9, 12, 2], list(range(30, 50))]


@functools.lru_cache(maxsize=None)
def hf_greedy(path: str, prompt: tuple[int, ...], n: int) -> list[int]:
  import torch
  from transformers import LlamaForCausalLM
  hf = LlamaForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
  with torch.no_grad():
    return hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()


def run(engine: LLMEngine, prompts, params) -> tuple[dict, list[int]]:
  """Step the engine to the end; returns (completion by request id, each step's decode passes)."""
  for i, (ids, p) in enumerate(zip(prompts, params)): engine.add_request(str(i), {"prompt_token_ids": ids}, p)
  outs, passes = {}, []
  while engine.has_unfinished_requests():
    for o in engine.step(): outs[o.request_id] = o.outputs[0]
    passes.append(engine.last_stats[0].num_decode_passes)
  return outs, passes


def test_feedback_kernels_against_numpy():
  """portable.split with per-pass fields, a counter and the tokens fed from the history, and store_tokens, captured
  and replayed through several runs, against the same bookkeeping in numpy: each pass reads its own group of fields, a
  negative token is the history's entry -t - 1, each row's new token lands one row of P further on, and the counter
  counts passes."""
  rng = np.random.default_rng(0)
  P, S, MB = 4, 5, 3
  history = Tensor.zeros(S * P, dtype=dtypes.int32).contiguous().realize()
  counter = Tensor.zeros(1, dtype=dtypes.int32).contiguous().realize()
  sizes, per_pass = (P, P * MB, P), (True, False, True)
  def step(packed):
    tokens, tables, positions, fed = portable.split(packed, sizes, per_pass, counter, feed=(0, history))
    sampled = (fed * 7 + positions * 3 + tables.reshape(P, MB).sum(1)) % 1000   # stands in for the model's argmax
    Tensor.realize(fed, sampled, *portable.store_tokens(history, counter, tokens, sampled))
    return fed, tables, positions
  jit = TinyJit(step)
  for _ in range(4):
    steps = int(rng.integers(1, S + 1))
    tables, first = rng.integers(0, 100, P * MB), rng.integers(0, 1000, P)
    positions = rng.integers(0, 100, (S, P))
    tokens = np.stack([first] + [-1 - (i - 1) * P - np.arange(P) for i in range(1, S)])
    packed = np.concatenate([tables, np.concatenate([tokens, positions], 1).reshape(-1)]).astype(np.int32)
    counter.assign(Tensor.zeros(1, dtype=dtypes.int32)).realize()   # as the runner does when a run starts
    expect, upload = np.zeros(S * P, np.int64), Tensor(packed).realize()
    for i in range(steps):
      fed, got_tables, got_positions = (x.numpy() for x in jit(upload))
      want_fed = np.where(tokens[i] >= 0, tokens[i], expect[np.maximum(-tokens[i] - 1, 0)])
      assert (fed == want_fed).all() and (got_tables == tables).all() and (got_positions == positions[i]).all()
      expect[i * P:(i + 1) * P] = (want_fed * 7 + positions[i] * 3 + tables.reshape(P, MB).sum(1)) % 1000
      assert counter.numpy()[0] == i + 1
    assert (history.numpy()[:steps * P] == expect[:steps * P]).all()


@pytest.mark.parametrize("device", DEVICES)
def test_split_feeds_a_field_from_the_history(device):
  """portable.split's feed on a field that is neither the first nor the longest, without a counter: its entries t >= 0
  kept, t < 0 read from history[-t - 1], and an entry past the history's end (a padding row's) read as 0; every run
  still copied as it is."""
  rng = np.random.default_rng(1)
  history = rng.integers(0, 1000, 8).astype(np.int32)
  sizes = (6, 4, 3)
  fields = [rng.integers(0, 100, n).astype(np.int32) for n in sizes]
  fields[1][:] = 17, -1, -8, -9 - int(rng.integers(0, 50))   # a token, the history's first and last entries, past it
  with Context(DEV=device):
    *runs, fed = portable.split(Tensor(np.concatenate(fields)), sizes, feed=(1, Tensor(history)))
    runs, fed = [r.numpy() for r in runs], fed.numpy()
  assert all((r == f).all() for r, f in zip(runs, fields))
  assert fed.tolist() == [17, history[0], history[7], 0]


@pytest.mark.parametrize("device", [d for d in DEVICES if d != "CPU"] or [pytest.param("METAL", marks=pytest.mark.skip("no GPU device"))])
def test_a_runs_pass_adds_one_kernel(tiny_model, device):
  """On a GPU device (the emulated METAL one here) a decode pass of a multi-step run has one kernel more than a lone
  decode pass, the store of its tokens into the history: its split feeds the tokens (docs/kernels.md, "Kernels per
  decode step"). On the CPU device a run's passes add the device argmax too (a lone step's is numpy's)."""
  from test_cuda_compile import captured_programs_of, plain_name
  names = {}
  with Context(DEV=device):
    for steps in (1, 4):
      engine = LLMEngine.from_kwargs(str(tiny_model), kernel_backend="portable", num_kv_blocks=64, block_size=8, num_scheduler_steps=steps)
      run(engine, PROMPTS[:1], [SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)])
      decode = [s for s in engine.runner.replays if s.query_len == 1]
      captures = engine.runner.captures(decode[:1])   # a whole pass (a run's first, where two are taken in turn), or its parts
      names[steps] = [plain_name(p) for r in (captures[:1] if engine.runner.whole_pass else captures) for p in captured_programs_of(r)]
  added = list(names[4])   # the run's kernels less the lone pass's, the split matched by kind (a run's is named apart)
  for name in names[1]: added.remove(name if name in added else next(n for n in added if n.startswith("split_")))
  assert added == ["store_tokens_1"], added
  assert any(n.startswith("split_") and n.endswith("_fed") for n in names[4]), names[4]


@pytest.mark.parametrize("kernel_backend,capture_mode", [("portable", "layer"), ("portable", "pass"), ("cpu", "layer"), ("cpu", "pass")])
def test_greedy_tokens_equal_hf(tiny_model, kernel_backend, capture_mode):
  """Four sequences (prompts of 4 to 20 tokens) decode in runs of 4 passes across several KV blocks of 8 tokens: each
  completion is HF's greedy one; no pass runs past the longest request's max_tokens; every block is back in the pool."""
  engine = LLMEngine.from_kwargs(str(tiny_model), num_kv_blocks=64, block_size=8, num_scheduler_steps=4,
                                 kernel_backend=kernel_backend, capture_mode=capture_mode)
  max_tokens = [13, 14, 15, 22]
  outs, passes = run(engine, PROMPTS, [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in max_tokens])
  for i, (prompt, n) in enumerate(zip(PROMPTS, max_tokens)):
    assert outs[str(i)].token_ids == hf_greedy(str(tiny_model), tuple(prompt), n)
    assert outs[str(i)].finish_reason == "length"
  assert max(passes) == 4 and engine.runner.num_passes == 1 + max(max_tokens) - 1   # one prefill pass, then decodes
  assert len(passes) < engine.runner.num_passes / 2
  bm = engine.core.block_manager
  assert bm.num_free == bm.num_blocks


def test_a_stop_token_inside_a_run(tiny_model):
  """A stop token taken by the second pass of a four-pass run ends the completion there (the passes after it are
  dropped, their blocks freed): HF's continuation up to and including the stop token."""
  prompt = PROMPTS[2]
  want = hf_greedy(str(tiny_model), tuple(prompt), 30)
  # the first pass of each run is at output index 1, 5, 9, ... (the prefill took index 0): stop at a run's second
  at = next(i for i in range(2, 30) if i % 4 == 2 and want[i] not in want[:i])
  engine = LLMEngine.from_kwargs(str(tiny_model), num_kv_blocks=64, block_size=8, num_scheduler_steps=4)
  outs, passes = run(engine, [prompt], [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop_token_ids=[want[at]])])
  assert outs["0"].token_ids == want[:at + 1]
  assert outs["0"].finish_reason == "stop" and outs["0"].stop_reason == want[at]
  assert passes[-1] == 4 and engine.core.block_manager.num_free == 64


def test_runs_end_at_max_model_len(tiny_model):
  """A sequence near max_model_len runs only the passes that fit (the last run shorter), and ends with "length" at
  exactly max_model_len tokens."""
  engine = LLMEngine.from_kwargs(str(tiny_model), num_kv_blocks=16, block_size=8, max_model_len=32, num_scheduler_steps=4)
  prompt = PROMPTS[3] + [7, 8, 9, 10, 11]   # 25 tokens
  outs, passes = run(engine, [prompt], [SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)])
  assert outs["0"].token_ids == hf_greedy(str(tiny_model), tuple(prompt), 7) and outs["0"].finish_reason == "length"
  assert passes[1:] == [4, 2]   # 25 + 1 tokens after the prefill, then 4 more, then the last 2 that fit
  assert engine.core.block_manager.num_free == 16


def test_requests_that_read_logits_run_one_pass(tiny_model):
  """A step whose batch holds a request that needs its logits (logprobs here) runs one pass; once it finished, the
  greedy request left runs multi-step again. Both completions are HF's greedy ones."""
  engine = LLMEngine.from_kwargs(str(tiny_model), num_kv_blocks=64, block_size=8, num_scheduler_steps=4)
  params = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)]
  outs, passes = run(engine, PROMPTS[:2], params)
  assert outs["0"].token_ids == hf_greedy(str(tiny_model), tuple(PROMPTS[0]), 20)
  assert outs["1"].token_ids == hf_greedy(str(tiny_model), tuple(PROMPTS[1]), 6) and len(outs["1"].logprobs) == 6
  assert passes[:6] == [1] * 6 and 4 in passes[6:]


def test_arrivals_and_a_short_pool(tiny_model, monkeypatch):
  """More requests than max_num_seqs, arriving while others run multi-step, over a KV pool too small for every run's
  room (runs fall back to one pass, sequences are preempted and recomputed): every completion is HF's greedy one and
  the pool is whole at the end."""
  engine = LLMEngine.from_kwargs(str(tiny_model), num_kv_blocks=7, block_size=8, max_model_len=48, max_num_seqs=3,
                                 num_scheduler_steps=8, enable_prefix_caching=False)
  reserved, reserve = [], engine.core.scheduler.reserve_steps
  monkeypatch.setattr(engine.core.scheduler, "reserve_steps", lambda decodes, steps: reserved.append((steps, reserve(decodes, steps))) or reserved[-1][1])
  prompts = PROMPTS + [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8]]
  n = [24, 9, 17, 11, 20, 5]
  outs, passes = run(engine, prompts, [SamplingParams(temperature=0, max_tokens=k, ignore_eos=True) for k in n])
  for i, (prompt, k) in enumerate(zip(prompts, n)): assert outs[str(i)].token_ids == hf_greedy(str(tiny_model), tuple(prompt), k), i
  assert max(passes) > 1 and engine.core.scheduler.num_preemptions > 0
  assert any(got == 1 < asked for asked, got in reserved) and any(got == asked > 1 for asked, got in reserved)
  assert engine.core.block_manager.num_free == 7


def test_bad_settings_are_refused(tiny_model):
  for bad in (0, 65, True, 2.0):
    with pytest.raises(ConfigError, match="num_scheduler_steps must be an integer in \\[1, 64\\]"):
      LLMEngine.from_kwargs(str(tiny_model), num_scheduler_steps=bad)
  with pytest.raises(ConfigError, match="speculative decoding already"):
    LLMEngine.from_kwargs(str(tiny_model), num_scheduler_steps=4, draft_model="self:1")
  with pytest.raises(ConfigError, match="tensor_parallel_size must be 1"):
    LLMEngine.from_kwargs(str(tiny_model), num_scheduler_steps=4, tensor_parallel_size=2)


@pytest.mark.parametrize("kernel_backend", ["metal", "portable"])
def test_emulated_metal_runs_wait_once(tiny_model_factory, kernel_backend):
  """On the METAL device (emulated; a Mac's GPU) a run of 8 passes replays its graphs without the GPU running dry:
  its inputs go up in two copies (the passes' fields, the pass counter), the host waits for the GPU 3 times (the
  copies and the tokens' readback; one pass alone waits twice), and no graph re-run waits for the newest work (two
  captures of the pass taken in turn). The tokens are HF's greedy ones."""
  import sys
  from tinygrad import Device
  from tinygrad.helpers import Context
  if sys.platform != "darwin":
    from tinyvllm.kernels.emulator.metal_device import install
    install()
  model = tiny_model_factory("metal")
  with Context(DEV="METAL"):
    engine = LLMEngine.from_kwargs(str(model), num_kv_blocks=64, block_size=8, num_scheduler_steps=8, kernel_backend=kernel_backend,
                                   dtype="float32")
    engine.add_request("0", {"prompt_token_ids": PROMPTS[0]}, SamplingParams(temperature=0, max_tokens=33, ignore_eos=True))
    counters, out, runs = Device["METAL"].counters, None, []
    while engine.has_unfinished_requests():
      before = dataclasses.asdict(counters)
      for o in engine.step(): out = o.outputs[0]
      runs.append((engine.last_stats[0].num_decode_passes, {k: v - before[k] for k, v in dataclasses.asdict(counters).items()}))
  assert out.token_ids == hf_greedy(str(model), tuple(PROMPTS[0]), 33)
  assert [n for n, _ in runs] == [1, 8, 8, 8, 8]
  for n, c in runs[2:]:   # the first run captured the pass
    assert c["graph_runs"] == n and c["copies_in"] == 2 and c["synchronizes"] <= 3 and c["idle_waits"] == 0, c
