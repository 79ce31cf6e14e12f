"""Mistral: a Llama whose attention may see only the last `sliding_window` keys (Mistral 7B v0.1: 4096; v0.2 and
later: null, full attention). llama.cpp converts Mistral checkpoints to the `llama` GGUF architecture (and keeps no
window), so a Mistral GGUF loads as a Llama."""
from tinyvllm.model.families import Family


def _hf_fields(get, d: dict) -> dict:
  if "sliding_window" not in d: return {"sliding_window": 4096}   # MistralConfig's default when the key is absent
  return {"sliding_window": get("sliding_window")} if d["sliding_window"] is not None else {}


FAMILY = Family("mistral", ("MistralForCausalLM",), hf_fields=_hf_fields)
