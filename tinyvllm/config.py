"""Configuration: what the model is (ModelConfig) and how the engine runs it (EngineConfig). Both frozen, built once."""
from __future__ import annotations
import builtins
from dataclasses import dataclass, field, fields
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM",)
ROPE_TYPES = ("default", "linear", "llama3")


class ConfigError(ValueError):
  """A model or engine setting is missing, inconsistent or unsupported. The message names it."""


@dataclass(frozen=True)
class ModelConfig:
  """A Llama-family decoder. Field names follow HF `config.json`."""
  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_hidden_layers: int
  num_attention_heads: int
  num_key_value_heads: int
  head_dim: int
  rms_norm_eps: float
  rope_theta: float
  rope_scaling: dict | None = None        # {"rope_type": "linear"|"llama3", "factor": ..., ...}; None for plain RoPE
  max_position_embeddings: int = 4096
  tie_word_embeddings: bool = False
  attention_bias: bool = False
  mlp_bias: bool = False
  quantization: dict | None = None        # {"group_size": G, "bits": 4} for pre-quantized checkpoints
  source: str = ""                        # where the config came from, for error messages

  def __post_init__(self):
    where = f" in {self.source}" if self.source else ""
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim"):
      if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
        raise ConfigError(f"{name} must be a positive integer{where}, got {getattr(self, name)!r}")
    if self.num_attention_heads % self.num_key_value_heads:
      raise ConfigError(f"num_attention_heads ({self.num_attention_heads}) is not a multiple of "
                        f"num_key_value_heads ({self.num_key_value_heads}){where}")
    if self.head_dim % 2: raise ConfigError(f"head_dim must be even for RoPE{where}, got {self.head_dim}")
    if not self.rope_theta > 0: raise ConfigError(f"rope_theta must be positive{where}, got {self.rope_theta}")
    if self.rope_scaling is not None and self.rope_scaling.get("rope_type") not in ROPE_TYPES:
      raise ConfigError(f"unsupported rope_scaling type {self.rope_scaling.get('rope_type')!r}{where}; "
                        f"supported: {', '.join(ROPE_TYPES)}")

  @property
  def q_size(self) -> int: return self.num_attention_heads * self.head_dim
  @property
  def kv_size(self) -> int: return self.num_key_value_heads * self.head_dim

  @staticmethod
  def from_hf(d: dict[str, Any], source: str = "config.json") -> ModelConfig:
    """Build from an HF `config.json` dict (transformers 4.x or 5.x layout)."""
    archs = d.get("architectures") or []
    if d.get("model_type") != "llama" and not any(a in SUPPORTED_ARCHITECTURES for a in archs):
      raise ConfigError(f"unsupported architecture {archs or d.get('model_type')!r} in {source}; "
                        f"tinyvllm runs {', '.join(SUPPORTED_ARCHITECTURES)}")
    try:
      n_heads = d["num_attention_heads"]
      # transformers 5.x moves rope_theta (and the scaling) into `rope_parameters`; reading only the top level
      # silently falls back to 10000, which turns SmolLM2 (theta 1e5) into fluent nonsense.
      rope = dict(d.get("rope_parameters") or {})
      theta = d.get("rope_theta", rope.get("rope_theta", 10000.0))
      scaling = d.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
      if scaling is not None:
        scaling = {k: v for k, v in scaling.items() if k not in ("rope_theta", "type")} | \
                  {"rope_type": scaling.get("rope_type", scaling.get("type"))}   # transformers 4 spelled it "type"
        if scaling["rope_type"] == "default": scaling = None
      quant = d.get("quantization") or d.get("quantization_config")
      return ModelConfig(
        vocab_size=d["vocab_size"], hidden_size=d["hidden_size"], intermediate_size=d["intermediate_size"],
        num_hidden_layers=d["num_hidden_layers"], num_attention_heads=n_heads,
        num_key_value_heads=d.get("num_key_value_heads") or n_heads,
        head_dim=d.get("head_dim") or d["hidden_size"] // n_heads,
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)), rope_theta=float(theta), rope_scaling=scaling,
        max_position_embeddings=d.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        attention_bias=bool(d.get("attention_bias", False)), mlp_bias=bool(d.get("mlp_bias", False)),
        quantization=dict(quant) if quant else None, source=source)
    except KeyError as e:
      raise ConfigError(f"{source} lacks the required field {e.args[0]!r}") from None

  @staticmethod
  def from_gguf(meta: dict[str, Any], source: str) -> ModelConfig:
    """Build from GGUF metadata (`llama.*` keys)."""
    arch = meta.get("general.architecture")
    if arch != "llama": raise ConfigError(f"unsupported GGUF architecture {arch!r} in {source}; tinyvllm runs 'llama'")
    try:
      n_heads = int(meta["llama.attention.head_count"])
      hidden = int(meta["llama.embedding_length"])
      scaling = None
      if meta.get("llama.rope.scaling.type") == "linear":
        scaling = {"rope_type": "linear", "factor": float(meta["llama.rope.scaling.factor"])}
      return ModelConfig(
        vocab_size=int(meta.get("llama.vocab_size") or len(meta["tokenizer.ggml.tokens"])), hidden_size=hidden,
        intermediate_size=int(meta["llama.feed_forward_length"]), num_hidden_layers=int(meta["llama.block_count"]),
        num_attention_heads=n_heads, num_key_value_heads=int(meta.get("llama.attention.head_count_kv", n_heads)),
        head_dim=int(meta.get("llama.attention.key_length") or hidden // n_heads),
        rms_norm_eps=float(meta.get("llama.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(meta.get("llama.rope.freq_base", 10000.0)), rope_scaling=scaling,
        max_position_embeddings=int(meta.get("llama.context_length", 4096)), source=source)
    except KeyError as e:
      raise ConfigError(f"{source} lacks the GGUF metadata key {e.args[0]!r}") from None


def _flag(default, help: str, type=None, choices: tuple | None = None):
  """An engine argument with what its command-line flag needs (entrypoints/engine_args.py builds the flags)."""
  return field(default=default, metadata={"help": help, "type": type or builtins.type(default), "choices": choices})


@dataclass(frozen=True)
class EngineConfig:
  """How the engine runs. Argument names follow vLLM's `LLM(...)`; each is also a flag (`--max-model-len`) of
  every command line, with the help written here."""
  model: str | None = None                  # local HF dir, GGUF file, hub id, or None for the default model
  dtype: str = _flag("auto", "weight and KV cache dtype (auto: float32 on CPU, float16 on Metal)",
                     choices=("auto", "float32", "float16"))
  max_model_len: int | None = _flag(None, "context length (default: the model's own, capped by the KV cache)", int)
  block_size: int = _flag(16, "tokens per KV cache block: 8, 16 or 32")
  num_kv_blocks: int | None = _flag(None, "KV cache blocks (default: sized from free memory)", int)
  max_num_seqs: int = _flag(32, "sequences decoded together at most")
  max_num_batched_tokens: int = _flag(512, "tokens per step at most (the prefill chunk length)")
  kernel_backend: str = _flag("auto", "attention/linear kernels (auto: metal on METAL, cpu on CPU)",
                              choices=("auto", "portable", "cpu", "metal", "emulator"))
  kv_cache_memory_fraction: float = _flag(0.1, "share of free memory (after the weights) the KV cache takes when "
                                               "num_kv_blocks is not given")
  watermark: float = _flag(0.01, "share of KV blocks kept free when admitting new sequences")
  seed: int = _flag(0, "seeds the random streams of requests that give no seed of their own")
  quantization: str | None = _flag(None, "int4: quantize float weights at load; none: dequantize a 4-bit checkpoint "
                                         "(default: as stored)", str, choices=("int4", "none"))
  draft_model: str | None = _flag(None, "speculative decoding: a draft checkpoint with the same vocabulary, or self:N "
                                        "(the model's first N layers)", str)
  num_speculative_tokens: int = _flag(4, "tokens the draft proposes per step")
  speculation: str = _flag("auto", "auto: speculate when measured to pay (docs/speculative.md); always",
                           choices=("auto", "always"))
  enable_prefix_caching: bool = _flag(True, "reuse the KV cache of prompt prefixes seen before (shared system prompts, "
                                            "chat turns); --no-enable-prefix-caching turns it off")

  def __post_init__(self):
    if self.dtype not in ("auto", "float32", "float16"):
      raise ConfigError(f"dtype must be 'auto', 'float32' or 'float16', got {self.dtype!r}")
    if self.block_size not in (8, 16, 32): raise ConfigError(f"block_size must be 8, 16 or 32, got {self.block_size}")
    for name in ("max_num_seqs", "max_num_batched_tokens"):
      if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
        raise ConfigError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
    if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 1):
      raise ConfigError(f"max_model_len must be a positive integer, got {self.max_model_len!r}")
    if self.num_kv_blocks is not None and (not isinstance(self.num_kv_blocks, int) or self.num_kv_blocks < 2):
      raise ConfigError(f"num_kv_blocks must be an integer >= 2, got {self.num_kv_blocks!r}")
    if self.kernel_backend not in ("auto", "portable", "cpu", "metal", "emulator"):
      raise ConfigError(f"kernel_backend must be 'auto', 'portable', 'cpu', 'metal' or 'emulator', got {self.kernel_backend!r}")
    if not 0 < self.kv_cache_memory_fraction <= 1:
      raise ConfigError(f"kv_cache_memory_fraction must be in (0, 1], got {self.kv_cache_memory_fraction}")
    if not 0 <= self.watermark < 1: raise ConfigError(f"watermark must be in [0, 1), got {self.watermark}")
    if self.quantization not in (None, "int4", "none"):
      raise ConfigError(f"quantization must be None, 'int4' or 'none', got {self.quantization!r}")
    if self.speculation not in ("auto", "always"):
      raise ConfigError(f"speculation must be 'auto' or 'always', got {self.speculation!r}")
    if not isinstance(self.enable_prefix_caching, bool):
      raise ConfigError(f"enable_prefix_caching must be True or False, got {self.enable_prefix_caching!r}")
    if not isinstance(self.num_speculative_tokens, int) or not 1 <= self.num_speculative_tokens <= 16:
      raise ConfigError(f"num_speculative_tokens must be an integer in [1, 16], got {self.num_speculative_tokens!r}")

  @classmethod
  def from_kwargs(cls, **kwargs) -> EngineConfig:
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(kwargs) - known)
    if unknown: raise TypeError(f"unknown engine argument(s): {', '.join(unknown)}")
    return cls(**kwargs)
