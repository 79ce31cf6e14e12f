"""Our Llama against HF transformers on tiny random checkpoints: every prompt position's logits, then every
decode step of a greedy run through the full engine (scheduler, paged cache, JIT'd runner).

Tolerance: relative error 1e-4 in float32. Both sides compute the same float32 maths; the differences are
summation order (our C matmul vs torch's BLAS) and float64 vs float32 RoPE tables, each ~1e-6 relative per op,
compounding over a few layers to ~1e-6..1e-5, so 1e-4 leaves headroom while catching any real mistake
(a wrong RoPE pairing or theta is > 1e-1)."""
from __future__ import annotations
import numpy as np
import pytest
import torch
from transformers import LlamaForCausalLM
from conftest import our_prefill_logits
from tinyvllm import SamplingParams
from tinyvllm.engine.llm_engine import LLMEngine

TOL = 1e-4


def rel_err(a, b) -> float: return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


def hf_logits(path, ids: list[int]) -> np.ndarray:
  model = LlamaForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
  with torch.no_grad(): return model(torch.tensor([ids])).logits[0].double().numpy()


@pytest.mark.parametrize("name", ["gqa", "mha", "tied", "llama3", "linear_rope", "head_dim"])
def test_prefill_logits_every_position(tiny_model_factory, name):
  path = tiny_model_factory(name)
  T = 150 if name == "llama3" else 40   # llama3: run past original_max_position_embeddings (64) so scaling matters
  ids = np.random.default_rng(1).integers(0, 380, T).tolist()
  ours, ref = our_prefill_logits(path, ids), hf_logits(path, ids)
  assert rel_err(ours, ref) < TOL
  assert (ours.argmax(-1) == ref.argmax(-1)).mean() > 0.97


@pytest.mark.parametrize("name", ["gqa", "tied", "llama3", "head_dim", "odd_ffn"])
def test_engine_decode_steps_match_hf(tiny_model_factory, name):
  """Greedy generation through the engine: the same tokens as HF's greedy generate, and each step's logits (seen by
  the sampler) within tolerance of HF's logits for the same prefix."""
  path = tiny_model_factory(name)
  # an engine in this thread, to watch its model runner: chunked, 37 prompt tokens in 3 chunks
  engine = LLMEngine.from_kwargs(str(path), block_size=8, num_kv_blocks=64, max_num_batched_tokens=16)
  seen = []
  execute = engine.runner.execute
  def spy(decodes, prefills=(), verifies=(), **kw):
    out = execute(decodes, prefills, verifies, **kw)
    if decodes: seen.append((decodes[0].start, out[0][0]))   # position of the token read, its next-token logits
    return out
  engine.runner.execute = spy
  prompt = np.random.default_rng(2).integers(0, engine.model_config.vocab_size, 37).tolist()
  engine.add_request("0", {"prompt_token_ids": prompt}, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
  while engine.has_unfinished_requests():
    for out in engine.step(): pass
  hf = LlamaForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
  with torch.no_grad():
    want = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)[0, 37:].tolist()
  assert out.outputs[0].token_ids == want
  full = prompt + want
  ref = hf_logits(path, full)
  assert [pos for pos, _ in seen] == list(range(37, 48))
  for pos, logits in seen: assert rel_err(logits, ref[pos]) < TOL
