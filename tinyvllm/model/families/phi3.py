"""Phi-3 / Phi-3.5 (mini, medium): a Llama whose checkpoint stores q/k/v fused as `self_attn.qkv_proj` and gate/up as
`mlp.gate_up_proj` (the loader splits their rows; the model fuses them again; GGUF: `attn_qkv` and a fused `ffn_up`), with LongRoPE scaling in the 128k
models (per-frequency short and long divisors and an attention factor on cos and sin: model/rope.py) and a sliding
window when the config sets one (Phi-3-mini-4k: 2047). Phi-4-mini rotates only part of each head
(`partial_rotary_factor`, 0.75): ModelConfig.rotary_dim."""
from tinyvllm.model.families import Family


def _hf_fields(get, d: dict) -> dict:
  fields = {"sliding_window": get("sliding_window")} if d.get("sliding_window") is not None else {}
  rope = d.get("rope_scaling") or d.get("rope_parameters") or {}
  partial = rope.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0)) if isinstance(rope, dict) else 1.0
  if partial != 1.0: fields["partial_rotary_factor"] = partial
  kind = rope.get("rope_type", rope.get("type")) if isinstance(rope, dict) else None
  if kind in ("longrope", "su"):   # "su": the 2024 configs' name for it
    fields["rope_scaling"] = {k: v for k, v in rope.items() if k not in ("rope_theta", "type", "partial_rotary_factor")} | {
      "rope_type": "longrope",
      "original_max_position_embeddings": rope.get("original_max_position_embeddings") or get("original_max_position_embeddings", 4096)}
  return fields


def _gguf_fields(get, meta: dict) -> dict:
  # LongRoPE's divisors are tensors in a GGUF (rope_factors_long/short): the loader adds them (model/weights.py)
  window, fields = get("attention.sliding_window", 0), {}
  if window: fields["sliding_window"] = window
  head_dim = get("attention.key_length", get("embedding_length") // get("attention.head_count"))
  rotated = get("rope.dimension_count", head_dim)
  if rotated != head_dim: fields["partial_rotary_factor"] = rotated / head_dim
  return fields


# llama.cpp's phi3 stores q/k/v as attn_qkv and gate/up as one ffn_up of twice the rows (no ffn_gate)
FAMILY = Family("phi3", ("Phi3ForCausalLM",), gguf_architecture="phi3", hf_fields=_hf_fields, gguf_fields=_gguf_fields,
                gguf_names=(("ffn_up", "mlp.gate_up_proj"),), hf_fused=True)
