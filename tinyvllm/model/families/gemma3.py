"""Gemma 3: Gemma3ForCausalLM (the 1B model), or the language model of a multimodal Gemma3ForConditionalGeneration
checkpoint (4B, 12B, 27B: its text_config and `language_model.*` tensors; the vision tower is not read). Gemma 2's
layer (see gemma2.py) with RMSNorms over each head of q and k (1 + weight, like every Gemma norm) instead of
soft-capping, five sliding-window layers (window 512 in the 1B model) to each global one, and two RoPE bases: the
sliding layers rotate with 10000, unscaled; the global ones with 1e6 and the config's scaling (linear x8 above 1B)."""
from tinyvllm.model.families import Family, layer_types
from tinyvllm.model.families.gemma2 import GGUF_NAMES, gemma_fields, gguf_gemma_fields


def _hf_fields(get, d: dict) -> dict:
  n = get("num_hidden_layers")
  pattern = get("sliding_window_pattern", 6)
  types = layer_types(d) if d.get("layer_types") else ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
  rope = d.get("rope_parameters") if isinstance(d.get("rope_parameters"), dict) else {}
  nested = isinstance(rope.get("sliding_attention"), dict)   # transformers 5: one RoPE entry per layer type
  local = rope["sliding_attention"].get("rope_theta", 10000.0) if nested else get("rope_local_base_freq", 10000.0, "number")
  fields = gemma_fields(get, d, 256) | {"layer_types": types, "qk_norm": True, "rope_local_theta": float(local),
                                        "attn_logit_softcapping": d.get("attn_logit_softcapping"),
                                        "final_logit_softcapping": d.get("final_logit_softcapping")}
  if "rope_theta" not in d and not (nested and "rope_theta" in rope.get("full_attention", {})): fields["rope_theta"] = 1e6
  return fields


def _gguf_fields(get, meta: dict) -> dict:
  # llama.cpp rotates the sliding layers with base 10000 (newer files may say so in rope.freq_base_swa)
  return gguf_gemma_fields(get, 6, 62) | {"qk_norm": True,
                                          "rope_local_theta": float(get("rope.freq_base_swa", 10000.0, "number"))}


def _text_config(d: dict) -> dict:
  """config.json's text_config (a multimodal checkpoint), with what the top level says for the whole model."""
  if not isinstance(d.get("text_config"), dict): return d
  top = {k: d[k] for k in ("architectures", "quantization", "quantization_config", "tie_word_embeddings") if k in d}
  return {**d["text_config"], **top}


FAMILY = Family("gemma3_text", ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"), gguf_architecture="gemma3",
                hf_fields=_hf_fields, gguf_fields=_gguf_fields, gguf_names=GGUF_NAMES, hf_text_config=_text_config, float16_safe=False,
                # Gemma3TextConfig's defaults: Google's configs (transformers 4.50) leave out every field equal to them
                hf_defaults=(("vocab_size", 262208), ("hidden_size", 2304), ("intermediate_size", 9216), ("num_hidden_layers", 26),
                             ("num_attention_heads", 8), ("num_key_value_heads", 4), ("max_position_embeddings", 131072),
                             ("rms_norm_eps", 1e-6)),
                hf_renames=(("language_model.model.", "model."), ("model.language_model.", "model."), ("language_model.lm_head.", "lm_head.")))
