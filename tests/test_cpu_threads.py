"""The C kernels split over a thread pool (kernels/threads.py): results bitwise equal to one thread, for every kernel
and end to end, and an idle pool sleeps.

Each row of a linear and each (token, KV head) of attention is computed by one thread the same way whatever its part,
so the comparisons are exact; the kernels themselves are checked against numpy (relative error, float32 tolerance
1e-5: float accumulation in a different order than numpy's float64 over K <= 256 terms gives ~1e-7). The 4-bit and
packed kernels round x to 16 bits per group first (kernels/cpu.py), ~3e-5 relative on these Gaussian inputs, so they
get 1e-4 (x rounded to 8 bits would be ~100x over it)."""
from __future__ import annotations
import time
import numpy as np
import pytest
from tinygrad import Tensor
from tinyvllm import LLM, SamplingParams
from tinyvllm.config import ConfigError
from tinyvllm.kernels import cpu
from tinyvllm.kernels.threads import ThreadPool
from tinyvllm.quant import blocks, int4
from tinyvllm.quant.formats import PACKED, LinearWeights
from test_blocks import random_ggml

TOL = 1e-5
TOL_X16 = 1e-4


@pytest.fixture(scope="module")
def pools():
  made = {n: ThreadPool(n) for n in (2, 3)}
  yield made
  for p in made.values(): p.close()


def rel_err(out, ref) -> float: return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


@pytest.mark.parametrize("M", [1, 5, 70])
def test_linears_split_over_threads(pools, M):
  rng = np.random.default_rng(M)
  N, K, G = 75, 256, 64                      # 75 rows: parts of 4-row runs that do not divide evenly
  x, w = rng.standard_normal((M, K)).astype(np.float32), rng.standard_normal((N, K)).astype(np.float32)
  p, s, b = int4.quantize(w, G)
  codes, sc = rng.integers(-127, 128, (N, K)).astype(np.int8), (rng.random((N, K // 32)) * 0.1 + 0.01).astype(np.float16)
  k_parts, k_spec = blocks.from_ggml(random_ggml("Q6_K", N, K, rng), "Q6_K", (N, K))
  q6k = LinearWeights(PACKED, **{k: Tensor(v) for k, v in k_parts.items() if k != "qspec"}, spec=k_spec)
  refs = {"f32": x.astype(np.float64) @ w.T.astype(np.float64),
          "int4": x.astype(np.float64) @ int4.dequantize(p, s, b, G, dtype=np.float64).T,
          "q8": x.astype(np.float64) @ (codes.astype(np.float64) * np.repeat(sc.astype(np.float64), 32, 1)).T,
          "q6_k": x.astype(np.float64) @ blocks.dequantize(k_parts, k_spec).T.astype(np.float64)}
  runs = {"f32": lambda pool: cpu.linear_f32(Tensor(x), Tensor(w), pool=pool),
          "int4": lambda pool: cpu.int4_linear(Tensor(x), Tensor(p), Tensor(s), Tensor(b), G, pool=pool),
          "q8": lambda pool: cpu.q8_linear(Tensor(x), Tensor(codes), Tensor(sc), pool=pool),
          "q6_k": lambda pool: cpu.packed_linear(Tensor(x), q6k, pool=pool)}
  for name, run in runs.items():
    one = run(None).numpy()
    assert rel_err(one, refs[name]) < (TOL_X16 if name in ("int4", "q6_k") else TOL), name
    for n, pool in pools.items(): assert np.array_equal(run(pool.buffer).numpy(), one), (name, n)


GEN = dict(max_tokens=24, ignore_eos=True, logprobs=3)


def fingerprints(llm: LLM, prompts, params) -> list:
  outs = llm.generate(prompts, params, use_tqdm=False)
  return [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs]) for o in outs]


@pytest.mark.parametrize("name,quantization,kv_cache_dtype", [("gqa", None, "auto"), ("mha", None, "auto"), ("gqa", "int4", "auto"),
                                                             ("tied", "int4", "auto"), ("gqa", None, "int8")])
def test_generation_equal_for_any_thread_count(tiny_model_factory, name, quantization, kv_cache_dtype):
  """Greedy and seeded sampling, several prompts (chunked prefill, batched decode), with 1, 2 and 3 threads."""
  model = str(tiny_model_factory(name))
  rng = np.random.default_rng(1)
  prompts = [{"prompt_token_ids": rng.integers(4, 380, n).tolist()} for n in (5, 40, 90, 17)]
  params = [SamplingParams(temperature=0, **GEN), SamplingParams(temperature=0.9, top_p=0.9, seed=5, **GEN)]
  results = {}
  for threads in (1, 2, 3):
    llm = LLM(model, quantization=quantization, kv_cache_dtype=kv_cache_dtype, kernel_backend="cpu", num_threads=threads,
              max_num_batched_tokens=64)
    try:
      assert llm.llm_engine.call(lambda e: e.core.kernels.threads.threads) == threads
      results[threads] = [fingerprints(llm, prompts, p) for p in params]
    finally:
      llm.shutdown()
  assert results[2] == results[1] and results[3] == results[1]


def test_threads_through_preemption_and_speculation(tiny_model):
  rng = np.random.default_rng(2)
  prompts = [{"prompt_token_ids": rng.integers(4, 380, n).tolist()} for n in (30, 60, 45, 80)]
  params = SamplingParams(temperature=0, **GEN)
  results = {}
  for threads in (1, 2):
    # a pool too small for the batch (sequences preempted and recomputed), and a draft of the model's first layer
    for kw in (dict(num_kv_blocks=20, block_size=8), dict(draft_model="self:1", speculation="always")):
      llm = LLM(str(tiny_model), kernel_backend="cpu", num_threads=threads, enable_prefix_caching=False, **kw)
      try:
        results[threads, "draft" in str(kw)] = fingerprints(llm, prompts, params)
        if "num_kv_blocks" in kw: assert llm.llm_engine.call(lambda e: e.scheduler.num_preemptions) > 0
      finally:
        llm.shutdown()
  assert results[2, False] == results[1, False] and results[2, True] == results[1, True]


def test_idle_pool_sleeps(pools):
  """Workers spin only briefly after a region, then sleep: an idle engine costs no CPU."""
  pool = pools[3]
  x, w = Tensor(np.ones((1, 64), np.float32)), Tensor(np.ones((40, 64), np.float32))
  for _ in range(20): cpu.linear_f32(x, w, pool=pool.buffer).numpy()
  time.sleep(0.1)                            # far past the spin window (0.2 ms)
  cpu0, wall0 = time.process_time(), time.perf_counter()
  time.sleep(0.5)
  busy = (time.process_time() - cpu0) / (time.perf_counter() - wall0)
  assert busy < 0.2, f"an idle pool of 3 threads kept {busy:.0%} of a core busy"


def test_pool_counts_its_regions_and_waits(pools):
  """Each parallel kernel call is one region of the pool; the time its caller waited for the workers is counted
  (the benchmark's synchronization figure) and stays below the wall time of the calls."""
  pool = pools[2]
  x, w = Tensor(np.ones((1, 64), np.float32)).realize(), Tensor(np.ones((40, 64), np.float32)).realize()
  regions, waited = pool.stats()
  start = time.perf_counter()
  for _ in range(7): cpu.linear_f32(x, w, pool=pool.buffer).realize()
  wall = time.perf_counter() - start
  r, wt = pool.stats()
  assert r - regions == 7 and 0 <= wt - waited < wall
  assert ThreadPool(1).stats() == (0, 0.0)


@pytest.mark.parametrize("bad", [0, -2, 2.5, True, "4"])
def test_bad_num_threads(tiny_model, bad):
  with pytest.raises(ConfigError, match="num_threads"): LLM(str(tiny_model), num_threads=bad)


def test_pool_after_close_and_in_a_forked_child(pools):
  """A closed pool's buffer runs kernels on one thread; a forked child (no workers there) computes on its own thread
  and exits cleanly. Both give the multi-threaded result bitwise."""
  import os, signal
  rng = np.random.default_rng(9)
  x, w = Tensor(rng.standard_normal((3, 64)).astype(np.float32)), Tensor(rng.standard_normal((75, 64)).astype(np.float32))
  pool = ThreadPool(3)
  want = cpu.linear_f32(x, w, pool=pool.buffer).numpy()
  pid = os.fork()
  if pid == 0:   # the child: exit status 0 when the result matches, 1 when not; killed by the alarm if it hangs
    signal.alarm(60)
    try: os._exit(0 if np.array_equal(cpu.linear_f32(x, w, pool=pool.buffer).numpy(), want) else 1)
    except BaseException: os._exit(2)
  _, status = os.waitpid(pid, 0)
  assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, f"child status {status:#x}"
  pool.close()
  assert np.array_equal(cpu.linear_f32(x, w, pool=pool.buffer).numpy(), want)


def test_rows_shared_by_cost_when_parts_are_stored_differently(tmp_path):
  """A projection whose parts are stored differently (a Q4_K_M layer's q and k in Q4_K, its v in Q6_K) splits its rows
  by their cost, not their count: every row in exactly one part, runs of 4, and each part's cost within one 4-row run
  of an even share. Called through the generated C (cpu_layer.LinearSpec.share_fn) for 1-5 threads."""
  import ctypes, shutil, subprocess
  from tinyvllm.kernels import cpu_layer
  from tinyvllm.kernels.threads import C_PARALLEL, C_PARALLEL_DECLS
  if shutil.which("clang") is None: pytest.skip("clang not found")
  P, q4, q6 = cpu_layer.Part, blocks.GGML_SPECS["Q4_K"], blocks.GGML_SPECS["Q6_K"]
  parts = (P(2048, 2048, PACKED, 0, q4), P(512, 2048, PACKED, 0, q4), P(512, 2048, PACKED, 0, q6))
  spec = cpu_layer.LinearSpec(parts)
  src = tmp_path / "share.c"
  src.write_text(C_PARALLEL_DECLS + spec.share_fn("qkv") + C_PARALLEL +
                 "void share(int part, int nparts, int *out) { qkv_share(part, nparts, out, out + 1); }\n")
  so = tmp_path / "share.so"
  subprocess.run(["clang", "-O2", "-shared", "-fPIC", str(src), "-o", str(so)], check=True)
  share = ctypes.CDLL(str(so)).share
  cost = np.concatenate([np.full(p.n, cpu_layer._row_cost(p)) for p in parts])
  assert cost[-1] / cost[0] > 1.4                       # v's rows cost more: an even split by rows is not even
  for nparts in range(1, 6):
    out, spans = np.zeros(2, np.int32), []
    for part in range(nparts):
      share(part, nparts, out.ctypes.data_as(ctypes.c_void_p))
      spans.append(tuple(out))
    assert spans[0][0] == 0 and spans[-1][1] == spec.n
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:])) and all(b <= e and b % 4 == 0 for b, e in spans)
    shares = np.array([cost[b:e].sum() for b, e in spans])
    assert np.abs(shares - cost.sum() / nparts).max() <= 4 * cost.max(), (nparts, spans)
    if nparts == 2: assert spans[0][1] > spec.n // 2     # the first thread takes more of the cheaper rows
