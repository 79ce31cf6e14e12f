"""Model families: what each checkpoint family adds to the shared decoder (model/llama.py), one module per family.

A family is a description, not a model class: the HF architectures and GGUF architecture it answers to, the
ModelConfig fields its config.json and GGUF metadata set beyond the shared ones, and how llama.cpp's converter stored
its tensors. The decoder's parts (q/k/v biases, per-head q/k norms, sliding-window attention, ...) are switched on by
those ModelConfig fields, so the runner, the kernels and the loaders never branch on a family's name. Adding a family
is one module here, listed in FAMILIES, and one test config (tests/test_families.py)."""
from __future__ import annotations
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# get(key, default, kind) reads and checks one field of config.json ("int", "number", "object", "bool"); for GGUF
# metadata, the key without the "<architecture>." prefix
Getter = Callable[..., Any]


@dataclass(frozen=True)
class Family:
  model_type: str                          # HF config.json "model_type"
  architectures: tuple[str, ...]           # HF config.json "architectures"
  gguf_architecture: str | None = None     # GGUF general.architecture
  # ModelConfig fields read from config.json (`get`, the raw dict) / GGUF metadata beyond the shared Llama ones
  hf_fields: Callable[[Getter, dict], dict] = lambda get, d: {}
  gguf_fields: Callable[[Getter, dict], dict] = lambda get, meta: {}
  # llama.cpp's converter reorders the rows of Q and K of this architecture (LlamaModel.permute) so each head's rotary
  # pairs interleave; the loader undoes it. Architectures llama.cpp runs with "NEOX" RoPE keep HF's order.
  gguf_rope_permuted: bool = False
  # GGUF tensor names (llama.cpp's, inside a block) that mean something else in this family than in Llama's, with
  # the HF name (relative to the layer) they stand for
  gguf_names: tuple[tuple[str, str], ...] = ()
  # the checkpoint (HF or GGUF) stores q/k/v as self_attn.qkv_proj and gate/up as mlp.gate_up_proj (Phi-3): the
  # loader splits their rows into the parts (model/weights.py split_fused)
  hf_fused: bool = False
  # a multimodal checkpoint's language model: its text config out of config.json, and its tensors' prefixes (HF's
  # saved names) renamed to the decoder's; vision weights are not read
  hf_text_config: Callable[[dict], dict] = lambda d: d
  hf_renames: tuple[tuple[str, str], ...] = ()
  # transformers' config-class defaults for keys a config.json may leave out (files written by transformers 4 list only
  # the fields that differ from them: Google's Gemma 3 configs give no vocab_size or head counts)
  hf_defaults: tuple[tuple[str, Any], ...] = ()
  # float16 activations overflow in these models (Gemma 2/3: transformers issue 36822; vLLM refuses float16 for them):
  # dtype "auto" runs them in float32 on a GPU too
  float16_safe: bool = True


def sliding_layers(get: Getter, d: dict, num_layers: int) -> dict:
  """The sliding-window fields of a Qwen2/Qwen3-style config.json: `layer_types` when given, else the window applies
  to layers from `max_window_layers` on, and only with `use_sliding_window`. Every released Qwen2.5/Qwen3 checkpoint
  has use_sliding_window false (full attention everywhere)."""
  if not d.get("use_sliding_window", False) or d.get("sliding_window") is None: return {}
  window = get("sliding_window")
  if d.get("layer_types") is not None: return {"sliding_window": window, "layer_types": layer_types(d)}
  first = get("max_window_layers", 28)   # transformers' default
  return {"sliding_window": window, "layer_types": tuple("sliding_attention" if i >= first else "full_attention"
                                                           for i in range(num_layers))}


def layer_types(d: dict) -> tuple[str, ...]:
  """config.json's `layer_types`, checked to be a list of strings (ModelConfig checks their values and count)."""
  value = d["layer_types"]
  if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
    from tinyvllm.config import ConfigError
    raise ConfigError(f"field 'layer_types' must be a list of 'full_attention' / 'sliding_attention', got {value!r:.100}")
  return tuple(value)


from tinyvllm.model.families import gemma2, gemma3, llama, mistral, phi3, qwen2, qwen3   # noqa: E402  (they import Family)

FAMILIES: tuple[Family, ...] = (llama.FAMILY, mistral.FAMILY, qwen2.FAMILY, qwen3.FAMILY, gemma2.FAMILY, gemma3.FAMILY, phi3.FAMILY)


def for_hf(architectures: list, model_type: Any) -> Family | None:
  """The family of a config.json: by its architectures, or by its model_type when it names none (a config naming
  another head on the same model type, Qwen2ForRewardModel or Gemma3TextModel, is not a causal LM we run)."""
  if architectures: return next((f for f in FAMILIES if any(a in f.architectures for a in architectures)), None)
  return next((f for f in FAMILIES if f.model_type == model_type), None)


def for_model_type(model_type: str) -> Family:
  return next(f for f in FAMILIES if f.model_type == model_type)


def for_gguf(architecture: Any) -> Family | None:
  return next((f for f in FAMILIES if f.gguf_architecture == architecture), None)


def hf_names() -> list[str]: return [a for f in FAMILIES for a in f.architectures]
def gguf_names() -> list[str]: return [f.gguf_architecture for f in FAMILIES if f.gguf_architecture]
