"""Llama 1/2/3.x (and SmolLM, TinyLlama, ...): the shared decoder as it is. Llama 3.2's tied embeddings, Llama 3.1's
RoPE scaling and HF's attention_bias / mlp_bias are shared fields (config.py)."""
from tinyvllm.model.families import Family

FAMILY = Family("llama", ("LlamaForCausalLM",), gguf_architecture="llama", gguf_rope_permuted=True)
