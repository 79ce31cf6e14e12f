"""Kernel backends end to end: the Metal shaders (run by the emulator, through the same launch code a Mac uses)
give the same greedy tokens as the portable tinygrad path, and logits within tolerance."""
from __future__ import annotations
import re
import numpy as np
import pytest
from conftest import our_prefill_logits
from tinyvllm import LLM, SamplingParams
from tinyvllm import kernels
from tinyvllm.kernels import resolve_backend


@pytest.mark.parametrize("backend", ["emulator", "cpu"])
def test_prefill_logits_match_portable(tiny_model_factory, backend):
  """float32 storage and accumulation on both paths; only the order of additions differs (online softmax in
  chunks vs one softmax), so 1e-5 relative is ample while any indexing mistake is O(1)."""
  path = tiny_model_factory("metal")
  ids = np.random.default_rng(0).integers(4, 380, 45).tolist()
  ours = our_prefill_logits(path, ids, kernel_backend=backend, block_size=8)
  ref = our_prefill_logits(path, ids, kernel_backend="portable", block_size=8)
  assert np.linalg.norm(ours - ref) / np.linalg.norm(ref) < 1e-5


@pytest.mark.parametrize("backend,kv_cache_dtype", [("emulator", "auto"), ("cpu", "auto"), ("emulator", "int8")])
def test_generation_matches_portable(tiny_model_factory, backend, kv_cache_dtype):
  path = tiny_model_factory("metal")
  rng = np.random.default_rng(1)
  prompts = [{"prompt_token_ids": rng.integers(4, 380, n).tolist()} for n in (5, 23, 11)]
  params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5)
  runs = {}
  for b in ("portable", backend):
    llm = LLM(str(path), kernel_backend=b, block_size=8, num_kv_blocks=32, max_num_batched_tokens=32, kv_cache_dtype=kv_cache_dtype)
    runs[b] = llm.generate(prompts, params, use_tqdm=False)
  for a, b in zip(runs["portable"], runs[backend]):
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    for lp_a, lp_b in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
      assert list(lp_a) == list(lp_b)
      assert max(abs(lp_a[t].logprob - lp_b[t].logprob) for t in lp_a) < 1e-4


def test_backend_selection(monkeypatch):
  monkeypatch.setattr(kernels, "apple_gpu", lambda device: ("Apple8", "14.5"))
  assert resolve_backend("auto", "CPU") == "cpu"
  assert resolve_backend("auto", "AMD") == "portable"
  with pytest.raises(ValueError, match="CPU device"): resolve_backend("cpu", "METAL")
  assert resolve_backend("auto", "METAL") == resolve_backend("metal", "METAL") == "metal"
  with pytest.raises(ValueError, match="needs the METAL device"): resolve_backend("metal", "CPU")
  with pytest.raises(ValueError, match="unknown kernel_backend"): resolve_backend("cuda", "CPU")


def test_emulator_refuses_unsupported_head_dim(tiny_model_factory):
  with pytest.raises(ValueError, match="head_dim"): LLM(str(tiny_model_factory("head_dim")), kernel_backend="emulator", num_kv_blocks=16)


@pytest.mark.parametrize("arch,macos,problem", [
    ("Apple7", "13.0", None), ("Apple9", "15.1", None), ("Apple7", "", None),
    ("Apple6", "14.0", "GPU family is Apple6"), ("Mac2", "14.0", "GPU family is Mac2"),   # A13; Intel/AMD Macs
    ("Apple8", "12.6", "macOS 12.6"), ("Apple7", "11.7.10", "macOS 11.7.10")])
def test_metal_needs_apple7_and_macos13(monkeypatch, capsys, arch, macos, problem):
  monkeypatch.setattr(kernels, "apple_gpu", lambda device: (arch, macos))
  if problem is None:
    assert resolve_backend("auto", "METAL") == "metal"
    return
  assert resolve_backend("auto", "METAL") == "portable"   # with a one-line note saying why
  note = capsys.readouterr().err
  assert note.count("\n") == 1 and problem in note and "portable" in note
  with pytest.raises(ValueError, match=f"kernel_backend='metal': .*{re.escape(problem)}.*use kernel_backend='portable'"):
    resolve_backend("metal", "METAL")


@pytest.mark.parametrize("kv_cache_dtype,per_layer", [("auto", 16), ("int8", 22)])
def test_portable_decode_layer_kernels(tiny_model_factory, kv_cache_dtype, per_layer):
  """Kernels of one replayed portable decode layer on the CPU device (docs/kernels.md, "Kernels per decode step"): a
  fusion lost (a copy back between two kernels, the cache written by one kernel per cache) shows here as more."""
  from tinyvllm.engine.llm_engine import LLMEngine
  engine = LLMEngine.from_kwargs(str(tiny_model_factory("metal")), kernel_backend="portable", block_size=8, num_kv_blocks=32,
                                 kv_cache_dtype=kv_cache_dtype)
  engine.add_request("0", {"prompt_token_ids": list(range(4, 20))}, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
  while engine.has_unfinished_requests(): engine.step()
  runner = engine.core.runner
  (decode,) = [bound for (shape, _), bound in runner.bound_passes.items() if shape.query_len == 1]
  layer, _ = decode[1]   # after the input replay: the first layer's
  assert sum(rt is not None for rt, *_ in layer.steps) == per_layer
