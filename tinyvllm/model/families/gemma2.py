"""Gemma 2: GeGLU (tanh GELU), RMSNorms that scale by 1 + weight, embeddings times sqrt(hidden), every attention and
MLP output normed again before its residual add (post_attention_layernorm, post_feedforward_layernorm; the MLP's input
by pre_feedforward_layernorm), scores scaled by query_pre_attn_scalar^-1/2 and soft-capped (50), logits soft-capped
(30), sliding-window (4096) and global layers alternating, the first one sliding. Defaults are those of transformers'
Gemma2Config, for configs that leave them out."""
from tinyvllm.model.families import Family


def gemma_fields(get, d: dict, default_head_dim: int) -> dict:
  """What Gemma 2 and 3 share in config.json."""
  return {"hidden_act": d.get("hidden_activation") or d.get("hidden_act") or "gelu_pytorch_tanh", "norm_weight_offset": 1.0,
          "sandwich_norms": True, "scale_embeddings": True, "tie_word_embeddings": bool(d.get("tie_word_embeddings", True)),
          "head_dim": get("head_dim", default_head_dim), "query_pre_attn_scalar": get("query_pre_attn_scalar", 256, "number"),
          "sliding_window": get("sliding_window", 4096)}


def _hf_fields(get, d: dict) -> dict:
  n = get("num_hidden_layers")
  types = d.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
  return gemma_fields(get, d, 256) | {"layer_types": types, "attn_logit_softcapping": d.get("attn_logit_softcapping", 50.0),
                                      "final_logit_softcapping": d.get("final_logit_softcapping", 30.0)}


FAMILY = Family("gemma2", ("Gemma2ForCausalLM",), hf_fields=_hf_fields)
