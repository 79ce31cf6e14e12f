"""Tensor parallelism (model/tensor_parallel.py): `tensor_parallel_size=2` on tinygrad's CPU:0 and CPU:1 gives the
single-device engine's results, through chunked prefill, batched decode, preemption and speculative decoding, with
the same block accounting; and bad values are errors that name the setting.

The single-device reference runs the same (portable) kernels with its prefill chunks padded, as the sharded attention
(tensor ops) reads them, where one device's paged kernels would pack them: its scheduler then makes the same choices,
so the free-block counts can be compared step by step.

Tolerance: greedy tokens must be identical; top-k logprobs within 1e-4 absolute. Both runs compute in float32, but
the sharded run adds the two devices' partial sums of the o and down projections in a different order from one
device's single sum: a few 1e-7 relative per op, measured at most ~4e-6 on these checkpoints, so 1e-4 leaves
headroom while any misplaced head, wrong shard or missing all-reduce moves logprobs by far more than 1e-2.
4-bit weights allow 1e-3 (TOL_INT4): the 4-bit kernels round x to 16 bits per quantization group
(kernels/cpu.py), and the sharded run splits o's and down's groups to fit each device's half of the inputs
(model/tensor_parallel.py `_split_groups`: the same weights, narrower groups), so x is rounded with other scales.
Each run is then within the 16-bit rounding of the float result, which moves these logprobs by at most 3.7e-4
(measured against float 4-bit linears on three seeds); the two runs differ by up to ~3e-4, so 1e-3 still sits
ten times below a misplacement's 1e-2."""
from __future__ import annotations
import argparse
import numpy as np
import pytest
from conftest import make_tiny_llama
from tinyvllm import SamplingParams
from tinyvllm.config import ConfigError, EngineConfig
from tinyvllm.engine.llm_engine import LLMEngine
from tinyvllm.entrypoints.engine_args import add_engine_args, engine_kwargs
from tinyvllm.kernels import Kernels
from tinyvllm.model import tensor_parallel

TOL, TOL_INT4 = 1e-4, 1e-3


@pytest.fixture(scope="module")
def tied_two_kv_heads(tmp_path_factory):
  """Tied embeddings with 2 KV heads (conftest's "tied" has 1, which 2 devices cannot split)."""
  return make_tiny_llama(tmp_path_factory.mktemp("tiny-tied-2kv"), 0, "float32", num_attention_heads=4, num_key_value_heads=2,
                         tie_word_embeddings=True)


def run(model, prompts, params, **kwargs) -> tuple[list, list, LLMEngine]:
  """Each request's (tokens, top-k logprobs) in request order, the free KV blocks after every step (with the draft's,
  when speculating) and the engine. Stepped in this thread so the block counts can be read between steps. Prefill
  chunks are padded, on one device too (see above)."""
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(Kernels, "packs_prefill", False)
    engine = LLMEngine.from_kwargs(str(model), **kwargs)
  assert not engine.runner.packs_prefill
  for i, p in enumerate(prompts): engine.add_request(str(i), {"prompt_token_ids": p}, params)
  outs, free = {}, []
  while engine.has_unfinished_requests():
    for o in engine.step():
      if o.finished: outs[int(o.request_id)] = o.outputs[0]
    free.append((engine.block_manager.num_free, engine.spec.blocks.num_free if engine.spec else None))
  results = [(outs[i].token_ids, [{t: lp.logprob for t, lp in d.items()} for d in outs[i].logprobs]) for i in range(len(prompts))]
  return results, free, engine


def assert_same(single, sharded, tol: float = TOL) -> None:
  for (tokens, logprobs), (tp_tokens, tp_logprobs) in zip(single, sharded, strict=True):
    assert tp_tokens == tokens
    for want, got in zip(logprobs, tp_logprobs, strict=True):
      assert set(got) == set(want)
      assert max(abs(got[t] - want[t]) for t in want) < tol


def prompts_of(lengths, seed=0) -> list[list[int]]:
  rng = np.random.default_rng(seed)
  return [rng.integers(4, 380, n).tolist() for n in lengths]


@pytest.mark.parametrize("name,quantization,kv_cache_dtype", [("gqa", None, "auto"), ("mha", "int4", "auto"), ("tied", None, "int8")])
def test_two_devices_match_one(tiny_model_factory, tied_two_kv_heads, name, quantization, kv_cache_dtype):
  """Chunked prefill (16-token chunks) and batched decode, greedy with top-3 logprobs: the same tokens and logprobs
  as on one device, the same free blocks after every step, and every tensor really split over the two devices."""
  model = tied_two_kv_heads if name == "tied" else tiny_model_factory(name)
  prompts, params = prompts_of((5, 40, 17)), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)
  kw = dict(quantization=quantization, kv_cache_dtype=kv_cache_dtype, block_size=8, num_kv_blocks=64, max_num_batched_tokens=16)
  single, free, _ = run(model, prompts, params, kernel_backend="portable", **kw)
  sharded, tp_free, engine = run(model, prompts, params, tensor_parallel_size=2, **kw)
  assert_same(single, sharded, TOL_INT4 if quantization == "int4" else TOL)
  assert tp_free == free and tp_free[-1][0] == 64

  # the placement: whole heads and FFN columns per device, row-parallel o/down, the KV cache by KV head, the vocabulary split
  runner, cfg = engine.runner, engine.model_config
  assert runner.devices == ("CPU", "CPU:1") and engine.kernel_backend == "portable"
  axes = {name: t.uop.axis for name, t in runner.model.layers[0].weights.items()}
  assert axes["self_attn.qkv_proj.weight"] == axes["mlp.gate_up_proj.weight"] == 0
  assert axes["self_attn.o_proj.weight"] == 1 and axes["input_layernorm.weight"] is None
  assert runner.model.lm_head.weight.uop.axis == 0
  for t in runner.kv_caches[0].tensors():
    assert t.uop.axis == 2 and t.shape[2] == cfg.num_key_value_heads
    assert [b.size for b in t.uop.buffer.bufs] == [t.numel() // 2] * 2


def test_int4_shards_narrower_than_a_run_of_32(tiny_model_factory, tmp_path):
  """4-bit groups of 32 over a down projection of 96 inputs: each device holds 48, which the C kernels' runs of 32 do
  not divide. Such shards run on the portable kernels; the C kernel read 32 of the 48 and every token came out 0."""
  from tinyvllm.quantize import quantize_checkpoint
  quantize_checkpoint(str(tiny_model_factory("gqa")), tmp_path / "q32", 32, log=lambda m: None)
  prompts, params = prompts_of((5, 21)), SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)
  kw = dict(block_size=8, num_kv_blocks=64, max_num_batched_tokens=16)
  single, _, _ = run(tmp_path / "q32", prompts, params, kernel_backend="portable", **kw)
  sharded, _, engine = run(tmp_path / "q32", prompts, params, tensor_parallel_size=2, **kw)
  down = engine.runner.model.layers[0].linears["mlp.down_proj"]
  assert down.format == "int4" and down.in_features == 96 and down.weight.uop.axis == 1
  assert_same(single, sharded, TOL_INT4)


def test_projections_stored_in_different_formats(tiny_model_factory, tmp_path):
  """A GGUF whose q, k and v are Q4_0, Q4_1 and F16 (one device runs them apart): split over two devices they become
  one float projection in the device-by-device order, so each device attends with its own heads' q, k and v (apart,
  each device read other heads' rows, and every token differed from the single device's)."""
  from test_weights import GGUF_TYPES, write_gguf
  path = tmp_path / "mixed.gguf"
  write_gguf(tiny_model_factory("gqa"), path, GGUF_TYPES)
  prompts, params = prompts_of((5, 21), seed=1), SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)
  kw = dict(block_size=8, num_kv_blocks=64, max_num_batched_tokens=16)
  single, _, one = run(path, prompts, params, kernel_backend="portable", **kw)
  sharded, _, engine = run(path, prompts, params, tensor_parallel_size=2, **kw)
  assert "self_attn.q_proj" in one.runner.model.layers[0].linears   # apart on one device
  assert engine.runner.model.layers[0].linears["self_attn.qkv_proj"].weight.uop.axis == 0
  assert_same(single, sharded, TOL_INT4)


def test_two_devices_through_preemption_and_speculation(tiny_model_factory):
  """A KV pool too small for the batch (sequences preempted and recomputed) while a draft of the model's first layer
  speculates every step: the same tokens, preemptions and free-block counts after every step as on one device."""
  model = tiny_model_factory("gqa")
  prompts, params = prompts_of((30, 50, 40), seed=2), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
  kw = dict(block_size=8, num_kv_blocks=16, max_num_batched_tokens=32, enable_prefix_caching=False, draft_model="self:1",
            speculation="always")
  single, free, engine = run(model, prompts, params, kernel_backend="portable", **kw)
  sharded, tp_free, tp_engine = run(model, prompts, params, tensor_parallel_size=2, **kw)
  assert_same(single, sharded)
  assert tp_engine.scheduler.num_preemptions == engine.scheduler.num_preemptions > 0
  assert tp_engine.spec.runner.devices == ("CPU", "CPU:1")
  assert tp_free == free and tp_free[-1] == (16, 16)


def test_launch_times_count_the_all_reduce_copies(tiny_model_factory):
  """The runner's launch timing (the benchmark's compute / synchronization split) sees the copies between devices
  that the sharded passes make, and none on one device."""
  copies = {}
  for size in (1, 2):
    engine = LLMEngine.from_kwargs(str(tiny_model_factory("gqa")), tensor_parallel_size=size, kernel_backend="portable")
    engine.add_request("0", {"prompt_token_ids": prompts_of([9])[0]}, SamplingParams(max_tokens=4, temperature=0))
    engine.step()   # the first pass of each shape captures; later ones run bound, and are timed
    engine.runner.launch_times.enabled = True
    while engine.has_unfinished_requests(): engine.step()
    assert engine.runner.launch_times.kernel_seconds > 0
    copies[size] = engine.runner.launch_times.copy_seconds
  assert copies[1] == 0 and copies[2] > 0


@pytest.mark.parametrize("bad", [0, -2, 1.5, True, "2"])
def test_bad_tensor_parallel_size(bad):
  with pytest.raises(ConfigError, match="tensor_parallel_size"): EngineConfig(tensor_parallel_size=bad)


def test_sizes_the_model_or_machine_cannot_take(tiny_model_factory, monkeypatch):
  with pytest.raises(ConfigError, match=r"tensor_parallel_size=2 must divide the model's num_key_value_heads \(1\)"):
    LLMEngine.from_kwargs(str(tiny_model_factory("tied")), tensor_parallel_size=2)
  with pytest.raises(ConfigError, match="tensor_parallel_size=2 runs the portable kernels.*kernel_backend='cpu'"):
    LLMEngine.from_kwargs(str(tiny_model_factory("gqa")), tensor_parallel_size=2, kernel_backend="cpu")
  with pytest.raises(ConfigError, match="tensor_parallel_size=2.*batch_invariant"):
    LLMEngine.from_kwargs(str(tiny_model_factory("gqa")), tensor_parallel_size=2, batch_invariant=True)
  # more devices than exist: CPU devices count the cores this process may use
  cores = tensor_parallel.device_count("CPU")
  with pytest.raises(ConfigError, match=f"tensor_parallel_size={cores + 1} needs {cores + 1} CPU devices"):
    tensor_parallel.parallel_devices("CPU", cores + 1)
  monkeypatch.setattr(tensor_parallel, "device_count", lambda kind: 1)
  with pytest.raises(ConfigError, match="tensor_parallel_size=2 needs 2 CPU devices, but this machine has 1"):
    LLMEngine.from_kwargs(str(tiny_model_factory("gqa")), tensor_parallel_size=2)


def test_command_line_flag():
  parser = argparse.ArgumentParser()
  add_engine_args(parser)
  assert engine_kwargs(parser.parse_args(["--tensor-parallel-size", "2"])) == {"tensor_parallel_size": 2}
  assert engine_kwargs(parser.parse_args([])) == {}


def test_row_parallel_int4_groups_split_exactly():
  """A 4-bit row-parallel weight split by inputs: groups wider than a device's share are narrowed (scale and bias
  repeated), shares that are not whole 8-code words fall back to floats; either way the same weights exactly."""
  from tinyvllm.quant import int4
  from tinyvllm.quant.formats import LinearWeights
  rng = np.random.default_rng(0)
  for K, G, n in ((64, 64, 2), (128, 32, 2), (96, 32, 4), (96, 32, 8)):
    packed, scales, biases = int4.quantize(rng.standard_normal((6, K)).astype(np.float32), G)
    want = int4.dequantize(packed, scales, biases)
    lw = LinearWeights("int4", packed, scales=scales, biases=biases)
    new = tensor_parallel._split_groups(lw, "w", n, "float32")
    if K // n % 8:   # 96 / 8 = 12 inputs per device: not whole words
      assert new["w.scales"] is None and np.array_equal(new["w.weight"], want)
      continue
    s, b = new.get("w.scales", scales), new.get("w.biases", biases)
    assert np.array_equal(int4.dequantize(packed, s, b), want)
    assert (K // n) % (K // s.shape[1]) == 0   # every device's share is whole groups
