"""Qwen2 / Qwen2.5: a Llama with biases on q, k and v (not on o), and an optional sliding window on the upper layers
(off in every released checkpoint). GGUF: llama.cpp's `qwen2` architecture, Q/K rows in HF's order."""
from tinyvllm.model.families import Family, sliding_layers


def _hf_fields(get, d: dict) -> dict:
  return {"qkv_bias": True} | sliding_layers(get, d, get("num_hidden_layers"))


FAMILY = Family("qwen2", ("Qwen2ForCausalLM",), gguf_architecture="qwen2", hf_fields=_hf_fields,
                gguf_fields=lambda get, meta: {"qkv_bias": True})
