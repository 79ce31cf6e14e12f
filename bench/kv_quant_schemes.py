"""KV cache quantization schemes simulated inside transformers' attention, to choose a format before writing kernels.

  python bench/kv_quant_schemes.py [--windows 6]

The default model (dequantized to float32) runs in transformers' LlamaForCausalLM with eager attention; each scheme
quantizes and dequantizes K (after RoPE) and V on their way into attention, per head vector: bits, optional rotation
by the normalized Hadamard matrix along head_dim, one float16 scale per head vector or per group of elements.
Reported: perplexity over KJV windows of 512 tokens and the mean KL divergence from the float run.
"""
from __future__ import annotations
import argparse, math, sys
from pathlib import Path
import numpy as np

SCHEMES = {  # name: (key bits, value bits, rotate, group; None bits = float, group 0 = the whole head vector)
  "float": (None, None, False, 0), "int8": (8, 8, False, 0), "int4": (4, 4, False, 0), "int4 rotated": (4, 4, True, 0),
  "int4 rotated, scale per 32": (4, 4, True, 32), "int4 rotated, scale per 16": (4, 4, True, 16),
  "k8v4 (int8 K, int4 V)": (8, 4, False, 0), "k8v4 rotated": (8, 4, True, 0), "k8v4 rotated, scale per 32": (8, 4, True, 32)}


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--windows", type=int, default=6)
  ap.add_argument("--window-len", type=int, default=512)
  args = ap.parse_args()
  import torch
  import transformers.models.llama.modeling_llama as llama
  sys.path.insert(0, str(Path(__file__).parent))
  from perplexity import kjv_tokens
  from tinyvllm.model.tokenizer import load_tokenizer
  from tinyvllm.model.weights import load_checkpoint
  from tinyvllm.kernels.kv_cache import hadamard
  from tinyvllm.quant.calibrate import hf_llama
  ckpt = load_checkpoint(None, "none")
  tokens = kjv_tokens(load_tokenizer(ckpt.path), args.windows * args.window_len)
  model = hf_llama(ckpt.config, ckpt.tensors)
  model.config._attn_implementation = "eager"
  D = ckpt.config.head_dim
  R = torch.tensor(hadamard(D), dtype=torch.float32)   # the engine's own rotation (kernels/kv_cache.py)

  def roundtrip(x, bits, rotate, group):
    if bits is None: return x
    levels, g = 2 ** (bits - 1) - 1, group or D
    y = x @ R if rotate else x
    y = y.reshape(*x.shape[:-1], D // g, g)
    s = (y.abs().amax(-1, keepdim=True) / levels).half().float()
    safe = torch.where(s > 0, s, torch.ones_like(s))
    y = (torch.where(s > 0, torch.clamp(torch.round(y / safe), -levels, levels), torch.zeros_like(y)) * s).reshape(x.shape)
    return y @ R if rotate else y   # R is symmetric and its own inverse

  attention, scheme = llama.eager_attention_forward, {}
  def quantized_attention(module, query, key, value, *a, **kw):
    kb, vb, rotate, group = scheme["now"]
    return attention(module, query, roundtrip(key, kb, rotate, group), roundtrip(value, vb, rotate, group), *a, **kw)
  llama.eager_attention_forward = quantized_attention
  reference = None
  print(f"| scheme | perplexity | vs float | mean KL |\n|---|---|---|---|")
  for name, spec in SCHEMES.items():
    scheme["now"], nll, count, logps = spec, 0.0, 0, []
    with torch.no_grad():
      for w in tokens.reshape(-1, args.window_len):
        ids = torch.from_numpy(np.asarray(w))[None]
        lp = torch.log_softmax(model(ids).logits[0, :-1].double(), -1)
        nll -= lp[torch.arange(len(w) - 1), ids[0, 1:]].sum().item()
        count += len(w) - 1
        logps.append(lp)
    ppl = math.exp(nll / count)
    if reference is None: reference, base = logps, ppl   # the first scheme is float
    kl = sum((r.exp() * (r - l)).sum().item() for r, l in zip(reference, logps)) / count
    print(f"| {name} | {ppl:.4f} | {(ppl / base - 1) * 100:+.1f} % | {kl:.4f} |", flush=True)


if __name__ == "__main__":
  main()
