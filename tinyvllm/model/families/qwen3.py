"""Qwen3 (dense): a Llama with an RMSNorm over each head of q and k before RoPE (`self_attn.q_norm` / `k_norm`,
weights of head_dim), no biases unless attention_bias, and head_dim given apart from hidden / heads. GGUF: llama.cpp's
`qwen3` architecture, Q/K rows in HF's order, the norms as `attn_q_norm` / `attn_k_norm`."""
from tinyvllm.model.families import Family, sliding_layers


def _hf_fields(get, d: dict) -> dict:
  return {"qk_norm": True} | sliding_layers(get, d, get("num_hidden_layers"))


FAMILY = Family("qwen3", ("Qwen3ForCausalLM",), gguf_architecture="qwen3", hf_fields=_hf_fields,
                gguf_fields=lambda get, meta: {"qk_norm": True}, hf_defaults=(("head_dim", 128),))   # Qwen3Config's head_dim
