"""A 4-bit model end to end: `quantization="int4"` at load, packed weights through every backend's kernels,
against transformers running the same dequantized weights."""
from __future__ import annotations
import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from conftest import our_prefill_logits
from tinyvllm import LLM, SamplingParams
from tinyvllm.model.weights import load_checkpoint
from tinyvllm.quant import int4


def hf_on_dequantized(path, ids) -> np.ndarray:
  ckpt = load_checkpoint(path, "int4")
  tensors = int4.dequantize_state_dict(ckpt.tensors)
  model = LlamaForCausalLM(LlamaConfig.from_pretrained(path)).eval()
  model.load_state_dict({k: torch.from_numpy(np.array(v, np.float32)) for k, v in tensors.items()})
  with torch.no_grad(): return model(torch.tensor([ids])).logits[0].double().numpy()


@pytest.mark.parametrize("backend", ["portable", "emulator"])
def test_int4_logits_match_dequantized_reference(tiny_model_factory, backend):
  """Packed weights through each backend's 4-bit kernels. The Metal shaders (emulated) do exact float maths
  (scale*sum(x*q) + bias*sum(x) per group): only summation order differs from float32 matmuls on the dequantized
  weights, so the float32 tolerance 1e-4 holds. On the CPU device the portable backend's linears are our C kernels,
  which round x to 16 bits per group for their integer products (tests/test_quant.py bounds it per output): 1.9e-4
  measured on these logits, so 5e-4."""
  path = tiny_model_factory("metal")          # hidden 128: q/k/v/o/gate/up quantized; down_proj (K=96) stays float
  ckpt = load_checkpoint(path, "int4")
  assert ckpt.tensors["model.layers.0.self_attn.q_proj.weight"].dtype == np.uint32
  assert "model.layers.0.mlp.down_proj.scales" not in ckpt.tensors and "model.embed_tokens.scales" in ckpt.tensors
  ids = np.random.default_rng(0).integers(4, 380, 40).tolist()     # 40 rows: the GEMM path; decode below: GEMV
  ours = our_prefill_logits(path, ids, kernel_backend=backend, block_size=8, quantization="int4")
  ref = hf_on_dequantized(path, ids)
  assert np.linalg.norm(ours - ref) / np.linalg.norm(ref) < (1e-4 if backend == "emulator" else 5e-4)


def test_int4_generation_same_on_every_backend(tiny_model_factory):
  path = tiny_model_factory("metal")
  prompts = [{"prompt_token_ids": np.random.default_rng(n).integers(4, 380, n).tolist()} for n in (3, 19)]
  params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
  runs = [[o.outputs[0].token_ids for o in LLM(str(path), quantization="int4", kernel_backend=b, block_size=8,
                                                num_kv_blocks=32).generate(prompts, params, use_tqdm=False)]
          for b in ("portable", "emulator")]
  assert runs[0] == runs[1]
  ref_ids = prompts[1]["prompt_token_ids"] + runs[0][1]
  ref = hf_on_dequantized(path, ref_ids)
  assert runs[0][1] == ref[18:-1].argmax(-1).tolist()     # and they are the dequantized model's greedy tokens


def test_int4_gpu_decode_matches_dequantized_reference(tiny_model_factory):
  """A GPU's INT4 decode step on the portable backend (the emulated METAL device; CUDA runs the same kernels): each
  projection one GEMV (kernels/gemv.py) that norms x itself, its squares read at a permutation of the inputs
  (`gemv._squares_read`), with no kernel of x's 1/RMS before it. Greedy tokens equal the dequantized model's in HF,
  and each token's logprob is within 1e-3 of HF's log-softmax there (float32 activations; the kernel's sums in another
  order than HF's: 1e-4 measured)."""
  from test_replay import greedy_on_metal
  path = tiny_model_factory("metal")   # hidden 128: q/k/v/o/gate/up in INT4, down_proj (K=96) float
  prompts = [np.random.default_rng(n).integers(4, 380, n).tolist() for n in (5, 12)]
  outs, names = greedy_on_metal(path, prompts, 6, kernel_backend="portable", quantization="int4", block_size=8)
  assert any(n.startswith("gemv_int4_norm") for n in names) and not any(n.startswith("inverse_rms") for n in names), sorted(names)
  for i, prompt in enumerate(prompts):
    toks = outs[i].token_ids
    logits = hf_on_dequantized(path, prompt + toks)[len(prompt) - 1:-1]
    assert toks == logits.argmax(-1).tolist()
    top = logits.max(-1, keepdims=True)
    ref = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
    got = np.array([lp[t].logprob for lp, t in zip(outs[i].logprobs, toks)])
    assert np.abs(got - ref[np.arange(len(toks)), toks]).max() < 1e-3
