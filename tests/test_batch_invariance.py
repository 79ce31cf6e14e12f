"""Batch invariance: a sequence's logits are bitwise the same alone and in any batch, on the CPU device with the `cpu`
and `portable` backends, for float and 4-bit weights, an int8 KV cache and a GGUF of k-quants, Q5_0/Q5_1 and Q8_0
(the quantized GEMMs repeat their GEMV's arithmetic on every row), with chunked prefill, packed prefill and preemption.
It holds without asking (`batch_invariant=True` only makes the engine refuse what cannot promise it).
Compared: the top-5 logprobs of every generated token (float64 from the float32 logits), greedy and seeded."""
from __future__ import annotations
import numpy as np
import pytest
from tinyvllm import SamplingParams
from tinyvllm.engine.llm_engine import LLMEngine
from test_kquant_model import kquant_gguf  # noqa: F401 (a fixture)

LENGTHS = [7, 30, 55, 12, 90, 3, 41, 22]


def generate(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams, tag: str) -> list:
  for i, p in enumerate(prompts): engine.add_request(f"{tag}-{i}", p, params)
  finals = {}
  while engine.has_unfinished_requests():
    for out in engine.step():
      if out.finished: finals[out.request_id] = out.outputs[0]
  return [finals[f"{tag}-{i}"] for i in range(len(prompts))]


def fingerprint(c) -> list:
  return [c.token_ids, [{t: lp.logprob for t, lp in d.items()} for d in c.logprobs]]


@pytest.mark.parametrize("backend", ["cpu", "portable"])
@pytest.mark.parametrize("model,quantization,kv_cache_dtype", [("tiny", None, "auto"), ("tiny", "int4", "auto"), ("tiny", None, "int8"),
                                                              ("kquant", None, "auto")],
                         ids=["float32", "int4", "int8-kv", "kquant-gguf"])
def test_logits_bitwise_alone_and_in_any_batch(request, backend, model, quantization, kv_cache_dtype):
  path = request.getfixturevalue("tiny_model" if model == "tiny" else "kquant_gguf")
  rng = np.random.default_rng(0)
  prompts = [rng.integers(4, 300, n).tolist() for n in LENGTHS]   # the k-quant model's vocabulary is 300
  kw = dict(kernel_backend=backend, quantization=quantization, kv_cache_dtype=kv_cache_dtype, enable_prefix_caching=False,
            block_size=8, max_num_batched_tokens=32)                  # prompts read in chunks, several per step
  engine = LLMEngine.from_kwargs(str(path), num_kv_blocks=256, **kw)
  for params in (SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=5),
                 SamplingParams(temperature=1.0, top_p=0.9, seed=3, max_tokens=30, ignore_eos=True, logprobs=5)):
    alone = [fingerprint(generate(engine, [p], params, f"alone{i}")[0]) for i, p in enumerate(prompts[:3])]
    together = [fingerprint(c) for c in generate(engine, prompts, params, "batch")[:3]]
    assert together == alone
  # preemption: a pool too small for the batch, so sequences are dropped and recomputed in new company
  small = LLMEngine.from_kwargs(str(path), num_kv_blocks=24, **kw)
  squeezed = [fingerprint(c) for c in generate(small, prompts, params, "small")[:3]]
  assert small.scheduler.num_preemptions > 0 and squeezed == alone


def test_batch_invariant_is_refused_where_it_does_not_hold(tiny_model):
  """Accepted on the cpu and portable kernels of the CPU device in float32; the Metal shaders (here their emulator, on
  the CPU device) have a GEMV and a GEMM that round differently, and in float16 the portable backend runs tinygrad's
  own matmuls: asking for it there is an error naming the option and the cause."""
  from tinyvllm.config import ConfigError
  LLMEngine.from_kwargs(str(tiny_model), kernel_backend="cpu", batch_invariant=True, num_kv_blocks=16)
  with pytest.raises(ConfigError, match="batch_invariant=True.*kernel_backend='emulator'"):
    LLMEngine.from_kwargs(str(tiny_model), kernel_backend="emulator", batch_invariant=True, num_kv_blocks=16)
  with pytest.raises(ConfigError, match="batch_invariant=True.*dtype='float16'"):   # tinygrad's own matmuls and norms
    LLMEngine.from_kwargs(str(tiny_model), kernel_backend="portable", dtype="float16", batch_invariant=True, num_kv_blocks=16)
