"""Activation statistics for output-aware quantization, from a float forward pass in transformers (fp32, CPU).

`input_second_moments` runs calibration tokens through the model and returns, for every linear weight, the
mean x_k^2 of each input channel k. `int4.quantize(..., importance=...)` uses it to weight the error of each
input channel by how much the layer's output depends on it. Needs torch and transformers (test extras).
"""
from __future__ import annotations
import numpy as np
from tinyvllm.config import ModelConfig


def hf_llama(cfg: ModelConfig, tensors: dict[str, np.ndarray]):
  """transformers' LlamaForCausalLM (fp32, eval mode) holding the given float weights (HF names)."""
  import torch
  from transformers import LlamaConfig, LlamaForCausalLM
  hf = LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                   num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
                   num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps,
                   rope_theta=cfg.rope_theta, rope_scaling=cfg.rope_scaling, max_position_embeddings=cfg.max_position_embeddings,
                   tie_word_embeddings=cfg.tie_word_embeddings, attention_bias=cfg.attention_bias, mlp_bias=cfg.mlp_bias)
  model = LlamaForCausalLM(hf).eval()
  state = {k: torch.from_numpy(np.array(v, dtype=np.float32)) for k, v in tensors.items()}
  missing, unexpected = model.load_state_dict(state, strict=False)
  missing = [m for m in missing if not (cfg.tie_word_embeddings and m == "lm_head.weight")]
  if missing or unexpected: raise ValueError(f"state dict does not fit the config: missing {missing[:3]}, unexpected {unexpected[:3]}")
  if cfg.tie_word_embeddings: model.tie_weights()
  return model


def input_second_moments(cfg: ModelConfig, tensors: dict[str, np.ndarray], tokens: np.ndarray,
                         window: int = 512) -> dict[str, np.ndarray]:
  """`{"<linear>.weight": mean x^2 per input channel [K]}` over `tokens` (run in windows of `window`).

  With tied embeddings the LM head's statistics are also given under "model.embed_tokens.weight", the name
  the tied matrix is quantized under."""
  import torch
  model = hf_llama(cfg, tensors)
  sums: dict[str, torch.Tensor] = {}
  counts: dict[str, int] = {}

  def hook(name):
    def fn(_module, inputs):
      x = inputs[0].detach().reshape(-1, inputs[0].shape[-1]).double()
      sums[name] = sums.get(name, 0) + (x * x).sum(0)
      counts[name] = counts.get(name, 0) + x.shape[0]
    return fn

  handles = [m.register_forward_pre_hook(hook(f"{n}.weight")) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
  tokens = np.asarray(tokens, np.int64)
  try:
    with torch.no_grad():
      for start in range(0, len(tokens), window):
        chunk = tokens[start:start + window]
        if len(chunk) > 1: model(torch.from_numpy(chunk)[None])
  finally:
    for h in handles: h.remove()
  out = {n: (sums[n] / counts[n]).numpy() for n in sums}
  if cfg.tie_word_embeddings and "lm_head.weight" in out: out["model.embed_tokens.weight"] = out["lm_head.weight"]
  return out
