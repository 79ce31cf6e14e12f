"""Gemma 2: GeGLU (tanh GELU), RMSNorms that scale by 1 + weight, embeddings times sqrt(hidden), every attention and
MLP output normed again before its residual add (post_attention_layernorm, post_feedforward_layernorm; the MLP's input
by pre_feedforward_layernorm), scores scaled by query_pre_attn_scalar^-1/2 and soft-capped (50), logits soft-capped
(30), sliding-window (4096) and global layers alternating, the first one sliding. Defaults are those of transformers'
Gemma2Config, for configs that leave them out."""
from tinyvllm.model.families import Family, layer_types


def gemma_fields(get, d: dict, default_head_dim: int) -> dict:
  """What Gemma 2 and 3 share in config.json."""
  return {"hidden_act": d.get("hidden_activation") or d.get("hidden_act") or "gelu_pytorch_tanh", "norm_weight_offset": 1.0,
          "sandwich_norms": True, "scale_embeddings": True, "tie_word_embeddings": bool(d.get("tie_word_embeddings", True)),
          "head_dim": get("head_dim", default_head_dim), "query_pre_attn_scalar": get("query_pre_attn_scalar", 256, "number"),
          "sliding_window": get("sliding_window", 4096)}


def _hf_fields(get, d: dict) -> dict:
  n = get("num_hidden_layers")
  types = layer_types(d) if d.get("layer_types") else ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
  return gemma_fields(get, d, 256) | {"layer_types": types, "attn_logit_softcapping": d.get("attn_logit_softcapping", 50.0),
                                      "final_logit_softcapping": d.get("final_logit_softcapping", 30.0)}


# llama.cpp's names for Gemma's four norms: its ffn_norm is the MLP's input norm, as in Llama, but that norm is called
# pre_feedforward_layernorm in HF's Gemma, where post_attention_layernorm norms the attention's output
GGUF_NAMES = (("ffn_norm", "pre_feedforward_layernorm"), ("post_attention_norm", "post_attention_layernorm"),
              ("post_ffw_norm", "post_feedforward_layernorm"))


def gguf_gemma_fields(get, pattern: int, big_layers: int) -> dict:
  """What llama.cpp's Gemma 2 / 3 GGUFs say, and what it assumes: norm weights already hold 1 + weight (its
  converter adds the 1), every `pattern`-th layer global (the others slide), attention scaled by head_dim^-1/2 except
  in the 27B models (`big_layers` layers), which scale by (hidden / heads)^-1/2."""
  n, hidden, heads = get("block_count"), get("embedding_length"), get("attention.head_count")
  head_dim = get("attention.key_length", hidden // heads)
  return {"hidden_act": "gelu_pytorch_tanh", "sandwich_norms": True, "scale_embeddings": True,
          "sliding_window": get("attention.sliding_window", 4096),
          "layer_types": tuple("sliding_attention" if i % pattern < pattern - 1 else "full_attention" for i in range(n)),
          "query_pre_attn_scalar": float(hidden // heads if n == big_layers else head_dim)}


def _gguf_fields(get, meta: dict) -> dict:
  return gguf_gemma_fields(get, 2, 46) | {
    "attn_logit_softcapping": float(get("attn_logit_softcapping", 50.0, "number")),
    "final_logit_softcapping": float(get("final_logit_softcapping", 30.0, "number"))}


# Gemma2Config's defaults, for configs that leave them out
HF_DEFAULTS = (("vocab_size", 256000), ("hidden_size", 2304), ("intermediate_size", 9216), ("num_hidden_layers", 26),
               ("num_attention_heads", 8), ("num_key_value_heads", 4), ("max_position_embeddings", 8192), ("rms_norm_eps", 1e-6),
               ("rope_theta", 10000.0))

FAMILY = Family("gemma2", ("Gemma2ForCausalLM",), gguf_architecture="gemma2", hf_fields=_hf_fields, gguf_fields=_gguf_fields,
                gguf_names=GGUF_NAMES, hf_defaults=HF_DEFAULTS, float16_safe=False)
