"""engine/replay.py's ProgramCache: tinygrad's lowered programs kept on disk, so that a second start of the engine
lowers no kernel. Checked against tinygrad itself: a start with an empty cache lowers every kernel (counted at
tinygrad's `codegen.do_to_program`), and a later start computes bitwise the same tokens and logprobs from the loaded
programs; kernels realized directly against numpy."""
from __future__ import annotations
import json, os, pickle, subprocess, sys, time
import numpy as np
import pytest
from tinygrad import Tensor
from tinygrad.helpers import Context

# one engine start: lowerings counted where tinygrad does them (PARALLEL=0: in this process, not its compile workers)
START = r"""
import json, sys
from tinygrad import Device, codegen
Device["CPU"]   # opening it lowers its own runtime programs, outside any cache (tinygrad's ops_cpu.py): not counted
lowered = []
lower = codegen.do_to_program
codegen.do_to_program = lambda ast, renderer: lowered.append(1) or lower(ast, renderer)
from tinyvllm import LLM, SamplingParams
llm = LLM(sys.argv[1], kernel_backend=sys.argv[2], block_size=8, num_kv_blocks=32)
params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=3)
outs = llm.generate([{"prompt_token_ids": [5, 9, 13, 40]}, {"prompt_token_ids": list(range(20, 39))}], params, use_tqdm=False)
cache = codegen.to_program_cache
print(json.dumps({"lowered": len(lowered), "loaded": cache.loaded, "stored": cache.stored,
                  "outputs": [[o.outputs[0].token_ids, [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs]] for o in outs]}))
"""


def start(model, backend: str, cache: os.PathLike) -> tuple[dict, str]:
  env = {**os.environ, "TINYVLLM_CACHE": str(cache), "PARALLEL": "0", "DEV": "CPU"}
  run = subprocess.run([sys.executable, "-c", START, str(model), backend], env=env, capture_output=True, text=True, timeout=300)
  assert run.returncode == 0, run.stderr[-3000:]
  return json.loads(run.stdout.strip().splitlines()[-1]), run.stderr


@pytest.mark.parametrize("backend", ["cpu", "portable"])
def test_a_second_start_lowers_nothing(tiny_model, backend, tmp_path):
  """Start 1 lowers and stores every kernel; start 2 lowers none and gives bitwise the same tokens and logprobs; with
  every file cut short, start 3 warns, lowers the kernels again, gives the same outputs and leaves whole files."""
  first, _ = start(tiny_model, backend, tmp_path)
  files = sorted((tmp_path / "programs").glob("*.pkl"))
  assert first["lowered"] > 0 and first["loaded"] == 0 and len(files) == first["lowered"], first
  second, _ = start(tiny_model, backend, tmp_path)
  assert second["lowered"] == 0 and second["stored"] == 0 and second["loaded"] == len(files), second
  assert second["outputs"] == first["outputs"]
  for f in files: f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
  third, stderr = start(tiny_model, backend, tmp_path)
  assert "could not be read" in stderr and third["lowered"] == len(files), third
  assert third["outputs"] == first["outputs"]
  for f in files: pickle.loads(f.read_bytes())


def realize_fresh_kernel(scale: float) -> float:
  """A kernel no test lowered before (its constant is new), x * scale + 1 over fresh random x: its relative error
  against numpy's (float32: within an ulp or two, a fused multiply-add rounds once)."""
  x = np.random.default_rng().standard_normal((3, 37)).astype(np.float32)
  ours, ref = (Tensor(x) * scale + 1).numpy(), x * np.float32(scale) + 1
  return float(np.linalg.norm(ours - ref) / np.linalg.norm(ref))


def test_tinygrad_looks_programs_up_in_the_cache(empty_program_cache):
  """tinygrad's lowering (`realize.lower_and_compile`, `codegen.to_program`) goes through the cache installed here: a
  new kernel is stored as a file, and, forgotten in memory, is loaded from it rather than lowered again."""
  cache = empty_program_cache
  from tinygrad import codegen
  from tinygrad.engine import realize
  assert codegen.to_program_cache is cache and realize.to_program_cache is cache
  scale = float(np.random.default_rng().uniform(2, 3))
  assert realize_fresh_kernel(scale) < 1e-6
  files = list(cache.directory.glob("*.pkl"))
  assert len(files) >= 1 and cache.stored >= 1
  loaded, stored = cache.loaded, cache.stored
  dict.clear(cache)
  assert realize_fresh_kernel(scale) < 1e-6
  assert cache.loaded > loaded and cache.stored == stored and sorted(cache.directory.glob("*.pkl")) == sorted(files)


def test_tinygrad_config_is_in_the_key_and_cachelevel_0_turns_it_off(empty_program_cache):
  """A kernel lowered under another tinygrad program setting (NOOPT) is another file; CACHELEVEL=0, tinygrad's switch
  for its disk caches, writes none and reads none."""
  cache = empty_program_cache
  scale = float(np.random.default_rng().uniform(3, 4))
  realize_fresh_kernel(scale)
  count = len(list(cache.directory.glob("*.pkl")))
  with Context(NOOPT=1): realize_fresh_kernel(scale)
  assert len(list(cache.directory.glob("*.pkl"))) > count
  dict.clear(cache)
  with Context(CACHELEVEL=0):
    loaded, stored = cache.loaded, cache.stored
    assert realize_fresh_kernel(float(np.random.default_rng().uniform(4, 5))) < 1e-6
    assert realize_fresh_kernel(scale) < 1e-6
    assert (cache.loaded, cache.stored) == (loaded, stored)


def test_the_least_recently_used_programs_are_trimmed(empty_program_cache):
  """Over its byte limit the cache deletes the files used longest ago, down to 3/4 of the limit; loading a program
  counts as a use (its file is touched), so an old program still loaded outlives newer ones that are not."""
  cache, now = empty_program_cache, time.time()
  scale = float(np.random.default_rng().uniform(5, 6))
  assert realize_fresh_kernel(scale) < 1e-6
  real = {p: p.stat().st_size for p in cache.directory.glob("*.pkl")}
  for p in real: os.utime(p, (now - 10_000, now - 10_000))   # lowered long ago...
  dict.clear(cache)
  assert realize_fresh_kernel(scale) < 1e-6                   # ...and loaded now
  size = sum(real.values())
  fillers = []
  for i in range(8):   # programs as big as the real ones together, the oldest first
    fillers.append(cache.directory / f"{i:064x}.pkl")
    fillers[-1].write_bytes(bytes(size))
    os.utime(fillers[-1], (now - 5000 + i, now - 5000 + i))
  cache.trim(9 * size)   # everything fits: nothing goes
  assert all(p.exists() for p in [*real, *fillers])
  cache.trim(6 * size)   # down to 4.5 x: the five oldest fillers go, the real programs (used last) stay
  assert all(p.exists() for p in real) and [p.exists() for p in fillers] == [False] * 5 + [True] * 3


def test_a_cache_that_cannot_be_written_stays_in_memory(empty_program_cache, tmp_path, caplog):
  """A cache directory that cannot exist (under a plain file): programs still lower, run and stay in memory, with one
  warning; a writer that died leaves a .tmp file, which a later trim removes once it is a day old."""
  cache = empty_program_cache
  blocker = tmp_path / "file"
  blocker.write_text("not a directory")
  cache.directory = blocker / "programs"
  cache.trim(1)   # nothing to read there: no error
  stored = cache.stored
  with caplog.at_level("WARNING", logger="tinyvllm"):
    assert realize_fresh_kernel(float(np.random.default_rng().uniform(6, 7))) < 1e-6
    assert realize_fresh_kernel(float(np.random.default_rng().uniform(7, 8))) < 1e-6
  assert cache.stored == stored and sum("not writable" in r.getMessage() for r in caplog.records) == 1
  cache.directory = tmp_path / "programs"
  cache.directory.mkdir()
  stale, fresh = cache.directory / "x.pkl.1.2.tmp", cache.directory / "y.pkl.1.2.tmp"
  for f in (stale, fresh): f.write_bytes(b"partial")
  os.utime(stale, (time.time() - 2 * 86400,) * 2)
  cache.trim(1 << 30)
  assert not stale.exists() and fresh.exists()
