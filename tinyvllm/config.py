"""Configuration: what the model is (ModelConfig) and how the engine runs it (EngineConfig). Both frozen, built once."""
from __future__ import annotations
import builtins, math, reprlib
from dataclasses import dataclass, field, fields
from typing import Any
from tinyvllm.model import families

ROPE_TYPES = ("default", "linear", "llama3", "longrope")
HIDDEN_ACTS = ("silu", "gelu_pytorch_tanh")
# auto: the model dtype; int8: codes + a float16 scale per token and KV head; int4: 4-bit codes of K and V rotated along
# head_dim (Hadamard) + a float16 scale; k8v4: int8 keys, int4 values; int4-unrotated: int4 without the rotation, to
# measure what it buys
KV_CACHE_DTYPES = ("auto", "int8", "k8v4", "int4", "int4-unrotated")


class ConfigError(ValueError):
  """A model or engine setting is missing, inconsistent or unsupported. The message names it."""


@dataclass(frozen=True)
class ModelConfig:
  """A decoder of one of the families in model/families/: the shared Llama shape plus the parts a family switches on.
  Field names follow HF `config.json`."""
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
  attention_bias: bool = False           # biases on q, k, v and o (HF Llama, Qwen3)
  mlp_bias: bool = False
  qkv_bias: bool = False                 # biases on q, k and v only (Qwen2)
  qk_norm: bool = False                  # RMSNorm over each head of q and k before RoPE (Qwen3)
  sliding_window: int | None = None      # attention sees the last `sliding_window` keys (itself included)
  layer_types: tuple[str, ...] | None = None   # per layer, "full_attention" or "sliding_attention"; None: every
                                               # layer slides when sliding_window is set
  model_type: str = "llama"              # the family (model/families/)
  hidden_act: str = "silu"               # the MLP's gate: "silu" (SwiGLU) or "gelu_pytorch_tanh" (Gemma's GeGLU)
  norm_weight_offset: float = 0.0        # RMSNorms scale by (offset + weight): 1 for Gemma's HF checkpoints
  sandwich_norms: bool = False           # Gemma 2/3: outputs of attention and MLP normed too (post_attention_layernorm,
                                         # post_feedforward_layernorm); the MLP's input by pre_feedforward_layernorm
  scale_embeddings: bool = False         # embeddings times sqrt(hidden_size) (Gemma)
  query_pre_attn_scalar: float | None = None   # attention scores scaled by its -1/2 power instead of head_dim's
  attn_logit_softcapping: float | None = None  # scores become cap * tanh(scores / cap) (Gemma 2)
  final_logit_softcapping: float | None = None # logits likewise (Gemma 2)
  rope_local_theta: float | None = None  # sliding-window layers' RoPE base, unscaled (Gemma 3; None: rope_theta)
  partial_rotary_factor: float = 1.0     # the share of each head's dimensions RoPE rotates (Phi-4-mini: 0.75)
  quantization: dict | None = None        # {"group_size": G, "bits": 4} for pre-quantized checkpoints
  source: str = ""                        # where the config came from, for error messages

  def __post_init__(self):
    where = f" in {self.source}" if self.source else ""
    def fail(name: str, message: str):
      e = ConfigError(message)
      e.field = name   # from_gguf names the GGUF key that set this field
      raise e
    # Far beyond any released Llama-family model (Llama 3.1 405B: 126 layers, hidden 16384, FFN 53248, 128 heads;
    # vocabularies stop near 260k tokens, contexts near 10M): a value past these comes from a corrupt config, and
    # is refused here by name instead of failing later on memory.
    limits = {"vocab_size": 1 << 22, "hidden_size": 1 << 16, "intermediate_size": 1 << 18, "num_hidden_layers": 1024,
              "num_attention_heads": 1024, "num_key_value_heads": 1024, "head_dim": 1024, "max_position_embeddings": 1 << 24}
    for name, most in limits.items():
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        fail(name, f"{name} must be a positive integer{where}, got {value!r}")
      if value > most:
        fail(name, f"{name} = {value}{where} is implausibly large (more than {most}, far beyond any real model): "
                   f"the config is corrupt")
    if self.num_attention_heads % self.num_key_value_heads:
      fail("num_key_value_heads", f"num_attention_heads ({self.num_attention_heads}) is not a multiple of "
                                  f"num_key_value_heads ({self.num_key_value_heads}){where}")
    if self.head_dim % 2: fail("head_dim", f"head_dim must be even for RoPE{where}, got {self.head_dim}")
    def number(value) -> bool: return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not number(self.rms_norm_eps) or self.rms_norm_eps < 0:
      fail("rms_norm_eps", f"rms_norm_eps must be a finite non-negative number{where}, got {self.rms_norm_eps!r}")
    if not number(self.rope_theta) or not self.rope_theta > 0:
      fail("rope_theta", f"rope_theta must be positive{where}, got {self.rope_theta}")
    if self.rope_scaling is not None:
      if not isinstance(self.rope_scaling, dict):
        fail("rope_scaling", f"rope_scaling must be an object{where}, got {self.rope_scaling!r}")
      kind = self.rope_scaling.get("rope_type")
      if kind not in ROPE_TYPES:
        fail("rope_scaling", f"unsupported rope_scaling type {kind!r}{where}; supported: {', '.join(ROPE_TYPES)}")
      needed = {"linear": ("factor",), "llama3": ("factor",), "longrope": ("original_max_position_embeddings",)}.get(kind, ())
      optional = {"llama3": ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
                  "longrope": ("attention_factor", "factor")}.get(kind, ())
      if kind == "longrope":   # Phi-3's per-frequency divisors, one list for short contexts and one for long
        for key in ("short_factor", "long_factor"):
          value = self.rope_scaling.get(key)
          n = int(self.head_dim * self.partial_rotary_factor) // 2 if number(self.partial_rotary_factor) else self.head_dim // 2
          if not isinstance(value, list) or len(value) != n or not all(number(v) and v > 0 for v in value):
            fail("rope_scaling", f"rope_scaling longrope needs {key!r}: {n} positive numbers (one per rotated frequency){where}, "
                                 f"got {reprlib.repr(value)}")
      for key in needed + optional:
        if key not in self.rope_scaling and key in optional: continue
        value = self.rope_scaling.get(key)
        if not number(value) or not value > 0:
          fail("rope_scaling", f"rope_scaling {kind} needs a positive number for {key!r}{where}, got {value!r}")
      if kind == "llama3" and self.rope_scaling.get("low_freq_factor", 1.0) == self.rope_scaling.get("high_freq_factor", 4.0):
        fail("rope_scaling", f"rope_scaling llama3 needs low_freq_factor != high_freq_factor{where}")
    if self.sliding_window is not None and (isinstance(self.sliding_window, bool) or not isinstance(self.sliding_window, int)
                                            or self.sliding_window < 1):
      fail("sliding_window", f"sliding_window must be a positive integer or null{where}, got {self.sliding_window!r}")
    if self.layer_types is not None and (len(self.layer_types) != self.num_hidden_layers or
                                         not set(self.layer_types) <= {"full_attention", "sliding_attention"}):
      fail("layer_types", f"layer_types must name 'full_attention' or 'sliding_attention' for each of the "
                          f"{self.num_hidden_layers} layers{where}, got {reprlib.repr(self.layer_types)}")
    if not number(self.partial_rotary_factor) or not 0 < self.partial_rotary_factor <= 1 or \
       self.head_dim * self.partial_rotary_factor != int(self.head_dim * self.partial_rotary_factor) or self.rotary_dim % 2:
      fail("partial_rotary_factor", f"partial_rotary_factor must be in (0, 1] and rotate an even whole number of head_dim's "
                                    f"{self.head_dim} dimensions{where}, got {self.partial_rotary_factor!r}")
    if self.hidden_act not in HIDDEN_ACTS:
      fail("hidden_act", f"unsupported hidden_act {self.hidden_act!r}{where}; supported: {', '.join(HIDDEN_ACTS)}")
    for name in ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping", "rope_local_theta"):
      value = getattr(self, name)
      if value is not None and (not number(value) or not value > 0):
        fail(name, f"{name} must be a positive number or null{where}, got {value!r}")
    if self.quantization is not None and not isinstance(self.quantization, dict):
      fail("quantization", f"quantization must be an object{where}, got {self.quantization!r}")

  def layer_window(self, layer: int) -> int | None:
    """How many of the latest keys layer `layer` attends to (itself included), or None for all of them."""
    if self.sliding_window is None: return None
    return self.sliding_window if self.layer_types is None or self.layer_types[layer] == "sliding_attention" else None

  @property
  def rotary_dim(self) -> int:
    """The dimensions of each head RoPE rotates (the first ones, rotate-half within them); the rest pass through."""
    return int(self.head_dim * self.partial_rotary_factor)

  @property
  def attention_scale(self) -> float:
    return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

  @property
  def freeable_window(self) -> int | None:
    """The window when every layer slides (KV blocks it has passed can go back to the pool), else None."""
    if self.sliding_window is None or (self.layer_types and "full_attention" in self.layer_types): return None
    return self.sliding_window

  @property
  def q_size(self) -> int: return self.num_attention_heads * self.head_dim
  @property
  def kv_size(self) -> int: return self.num_key_value_heads * self.head_dim

  @staticmethod
  def from_hf(d: dict[str, Any], source: str = "config.json") -> ModelConfig:
    """Build from an HF `config.json` dict (transformers 4.x or 5.x layout)."""
    if not isinstance(d, dict): raise ConfigError(f"{source} must hold a JSON object, got a JSON {type(d).__name__}")
    archs = d.get("architectures") or []
    if not isinstance(archs, list): archs = [archs]
    family = families.for_hf(archs, d.get("model_type"))
    if family is None:
      raise ConfigError(f"unsupported architecture {reprlib.repr(archs or d.get('model_type'))} in {source}; "
                        f"tinyvllm runs {', '.join(families.hf_names())}")
    d = family.hf_text_config(d)   # a multimodal checkpoint: its language model's config
    d = dict(family.hf_defaults) | d   # the family's config-class defaults under what the file says
    if d.get("use_bidirectional_attention"):
      raise ConfigError(f"{source}: use_bidirectional_attention is set: an encoder (an embedding model), not a causal LM tinyvllm runs")
    def get(key: str, default: Any = KeyError, kind: str = "int") -> Any:
      if default is KeyError and key not in d: raise ConfigError(f"{source} lacks the required field {key!r}")
      value = d.get(key, default)
      ok = {"int": lambda v: isinstance(v, int) and not isinstance(v, bool),
            "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
            "object": lambda v: isinstance(v, dict)}[kind]
      if not ok(value):
        raise ConfigError(f"field {key!r} in {source} must be {'an integer' if kind == 'int' else 'a ' + kind}, "
                          f"got {reprlib.repr(value)}")
      return value
    n_heads, hidden = get("num_attention_heads"), get("hidden_size")
    if n_heads <= 0: raise ConfigError(f"num_attention_heads must be a positive integer in {source}, got {n_heads}")
    # transformers 5.x moves rope_theta (and the scaling) into `rope_parameters`; reading only the top level
    # silently falls back to 10000, which turns SmolLM2 (theta 1e5) into fluent nonsense.
    rope = dict(get("rope_parameters", None, "object") if d.get("rope_parameters") else {})
    if isinstance(rope.get("full_attention"), dict): rope = dict(rope["full_attention"])   # per layer type (Gemma 3): see its family
    theta = d.get("rope_theta", rope.get("rope_theta", 10000.0))
    scaling = get("rope_scaling", None, "object") if d.get("rope_scaling") else (rope if rope.get("rope_type", "default") != "default" else None)
    if scaling is not None:
      scaling = {k: v for k, v in scaling.items() if k not in ("rope_theta", "type")} | \
                {"rope_type": scaling.get("rope_type", scaling.get("type"))}   # transformers 4 spelled it "type"
      if scaling["rope_type"] == "default": scaling = None
    quant = d.get("quantization") or d.get("quantization_config")
    if quant and not isinstance(quant, dict):
      raise ConfigError(f"field 'quantization' in {source} must be an object, got {reprlib.repr(quant)}")
    fields = dict(
      vocab_size=get("vocab_size"), hidden_size=hidden, intermediate_size=get("intermediate_size"),
      num_hidden_layers=get("num_hidden_layers"), num_attention_heads=n_heads,
      num_key_value_heads=get("num_key_value_heads", None, "int") if d.get("num_key_value_heads") else n_heads,
      head_dim=get("head_dim", None, "int") if d.get("head_dim") else hidden // n_heads,
      rms_norm_eps=float(get("rms_norm_eps", 1e-6, "number")), rope_theta=theta, rope_scaling=scaling,
      max_position_embeddings=get("max_position_embeddings", 4096),
      tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
      attention_bias=bool(d.get("attention_bias", False)), mlp_bias=bool(d.get("mlp_bias", False)),
      hidden_act=d.get("hidden_act") or "silu",
      quantization=dict(quant) if quant else None, source=source, model_type=family.model_type)
    fields.update(family.hf_fields(get, d))   # a family's own fields, and its defaults where config.json is silent
    if fields.get("layer_types") is not None: fields["layer_types"] = tuple(fields["layer_types"])   # checked by the family
    return ModelConfig(**fields)

  @staticmethod
  def from_gguf(meta: dict[str, Any], source: str) -> ModelConfig:
    """Build from GGUF metadata (`<architecture>.*` keys: `llama.*`, `qwen2.*`, ...)."""
    arch = meta.get("general.architecture")
    family = families.for_gguf(arch) if isinstance(arch, str) else None
    if family is None:
      raise ConfigError(f"unsupported GGUF architecture {reprlib.repr(arch)} in {source}; tinyvllm runs "
                        f"{', '.join(map(repr, families.gguf_names()))}")
    def get(key: str, default: Any = KeyError, kind: str = "int") -> Any:
      key = f"{arch}.{key}"
      if default is KeyError and key not in meta: raise ConfigError(f"{source} lacks the GGUF metadata key {key!r}")
      value = meta.get(key, default)
      if kind == "int": ok = isinstance(value, int) and not isinstance(value, bool)
      else: ok = isinstance(value, (int, float)) and not isinstance(value, bool)
      if not ok:
        raise ConfigError(f"GGUF metadata key {key} in {source} must be {'an integer' if kind == 'int' else 'a number'}, "
                          f"got {reprlib.repr(value)}")
      return value
    keys = {"vocab_size": "vocab_size", "hidden_size": "embedding_length", "intermediate_size": "feed_forward_length",
            "num_hidden_layers": "block_count", "num_attention_heads": "attention.head_count",
            "num_key_value_heads": "attention.head_count_kv", "head_dim": "attention.key_length",
            "rms_norm_eps": "attention.layer_norm_rms_epsilon", "rope_theta": "rope.freq_base",
            "rope_scaling": "rope.scaling.factor", "max_position_embeddings": "context_length"}
    keys = {name: f"{arch}.{key}" for name, key in keys.items()}
    n_heads, hidden = get("attention.head_count"), get("embedding_length")
    if n_heads <= 0: raise ConfigError(f"GGUF metadata key {arch}.attention.head_count in {source} must be positive, got {n_heads}")
    present = lambda key: f"{arch}.{key}" in meta and not (isinstance(meta[f"{arch}.{key}"], int) and meta[f"{arch}.{key}"] == 0)   # 0: "not given"
    if present("vocab_size"): vocab = get("vocab_size")
    else:
      tokens = meta.get("tokenizer.ggml.tokens")
      if not isinstance(tokens, list):
        raise ConfigError(f"{source} lacks the GGUF metadata key '{arch}.vocab_size' (and has no token list to count)")
      vocab = len(tokens)
      keys["vocab_size"] = "tokenizer.ggml.tokens"
    scaling, kind = None, meta.get(f"{arch}.rope.scaling.type")
    if kind == "linear": scaling = {"rope_type": "linear", "factor": float(get("rope.scaling.factor", kind="number"))}
    elif kind not in (None, "none"):   # YaRN and others change every frequency: never run without them silently
      raise ConfigError(f"unsupported RoPE scaling {kind!r} (GGUF metadata key {arch}.rope.scaling.type) in {source}; "
                        f"tinyvllm runs linear scaling from GGUF")
    try:
      fields = dict(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=get("feed_forward_length"),
        num_hidden_layers=get("block_count"), num_attention_heads=n_heads,
        num_key_value_heads=get("attention.head_count_kv", n_heads),
        head_dim=get("attention.key_length", None, "int") if present("attention.key_length") else hidden // n_heads,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5, "number")),
        rope_theta=float(get("rope.freq_base", 10000.0, "number")), rope_scaling=scaling,
        max_position_embeddings=get("context_length", 4096), source=source, model_type=family.model_type)
      return ModelConfig(**(fields | family.gguf_fields(get, meta)))
    except ConfigError as e:
      key = keys.get(getattr(e, "field", None))
      if key is None: raise
      raise ConfigError(f"{e} (GGUF metadata key {key})") from None


CAPTURE_MODES = ("auto", "pass", "layer")   # what one captured replay holds (EngineConfig.capture_mode)


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
  num_kv_blocks: int | None = _flag(None, "KV cache blocks (default: sized from available memory)", int)
  max_num_seqs: int = _flag(32, "sequences decoded together at most")
  max_num_batched_tokens: int = _flag(512, "tokens per step at most (the prefill chunk length)")
  kv_cache_dtype: str = _flag("auto", "KV cache storage: auto (the model dtype), int8 (8-bit codes with a float16 scale "
                                      "per token and KV head: 1.94x the tokens of float16 in the same memory), k8v4 (int8 "
                                      "keys, values rotated along head_dim then 4-bit: 2.56x) or int4 (keys too: 3.76x); "
                                      "k8v4 and int4 on the cpu and portable backends; "
                                      "int4-unrotated only measures what the rotation buys",
                              choices=KV_CACHE_DTYPES)
  kernel_backend: str = _flag("auto", "attention/linear kernels (auto: metal on METAL, cpu on CPU)",
                              choices=("auto", "portable", "cpu", "metal", "emulator"))
  kv_cache_memory_fraction: float = _flag(0.1, "share of available memory (after the weights) the KV cache takes when "
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
  batch_invariant: bool = _flag(False, "require every sequence's logits to be bitwise identical alone and in any batch "
                                      "(the CPU device's cpu and portable kernels in float32 always are, at no cost; other "
                                      "setups are refused)")
  num_threads: int | None = _flag(None, "CPU threads for the C kernels on tinygrad's CPU device (default: every core "
                                       "this process may use; results are the same for any count)", int)
  tensor_parallel_size: int = _flag(1, "tinygrad devices each layer is sharded over (DEV's type, numbered 0..N-1: CPU:0, CPU:1, "
                                          "NV:0, ...): attention and KV heads and FFN columns split, one all-reduce after the "
                                          "attention and one after the MLP; N must divide the attention and KV heads; "
                                          "portable kernels")
  capture_mode: str = _flag("auto", "what one captured replay holds: pass (a step's whole forward pass, one graph a step on a "
                                     "GPU), layer (a decoder layer, replayed once per layer: cheaper to capture for each new "
                                     "batch shape); auto: pass on a GPU, layer on the CPU",
                            choices=CAPTURE_MODES)
  num_scheduler_steps: int = _flag(1, "multi-step decoding: greedy decode passes a step runs back to back, each reading the "
                                       "tokens the pass before took on the device, so the host waits for the GPU once "
                                       "every N tokens (vLLM's multi-step scheduling). Taken by steps of decodes alone "
                                       "whose every request is greedy without logprobs, penalties or a grammar; others "
                                       "run one pass. Tokens stream N at a time and new requests wait up to N passes")
  async_scheduling: bool = _flag(False, "pipelined decoding (vLLM's async scheduling): a step of greedy decodes launches "
                                        "the next one, fed the tokens it takes on the device, before the host reads them, "
                                        "so the host's scheduling and output work overlaps the GPU's. On CUDA (on the CPU "
                                        "device it only tests the path); refused on Metal, whose uploads are not ordered "
                                        "with the GPU's work. Taken by steps num_scheduler_steps takes. Off by default "
                                        "until timed on a GPU (docs/architecture.md)")
  enable_prefix_caching: bool = _flag(True, "reuse the KV cache of prompt prefixes seen before (shared system prompts, "
                                            "chat turns); --no-enable-prefix-caching turns it off")

  def __post_init__(self):
    if self.dtype not in ("auto", "float32", "float16"):
      raise ConfigError(f"dtype must be 'auto', 'float32' or 'float16', got {self.dtype!r}")
    if self.kv_cache_dtype not in KV_CACHE_DTYPES:
      raise ConfigError(f"kv_cache_dtype must be one of {', '.join(map(repr, KV_CACHE_DTYPES))}, got {self.kv_cache_dtype!r}")
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
    if self.capture_mode not in CAPTURE_MODES:
      raise ConfigError(f"capture_mode must be 'auto', 'pass' or 'layer', got {self.capture_mode!r}")
    if self.speculation not in ("auto", "always"):
      raise ConfigError(f"speculation must be 'auto' or 'always', got {self.speculation!r}")
    if not isinstance(self.batch_invariant, bool): raise ConfigError(f"batch_invariant must be True or False, got {self.batch_invariant!r}")
    if not isinstance(self.enable_prefix_caching, bool):
      raise ConfigError(f"enable_prefix_caching must be True or False, got {self.enable_prefix_caching!r}")
    if self.num_threads is not None and (not isinstance(self.num_threads, int) or isinstance(self.num_threads, bool)
                                         or not 1 <= self.num_threads <= 1024):
      raise ConfigError(f"num_threads must be a positive integer, got {self.num_threads!r}")
    if not isinstance(self.tensor_parallel_size, int) or isinstance(self.tensor_parallel_size, bool) or self.tensor_parallel_size < 1:
      raise ConfigError(f"tensor_parallel_size must be a positive integer, got {self.tensor_parallel_size!r}")
    if not isinstance(self.num_scheduler_steps, int) or isinstance(self.num_scheduler_steps, bool) or not 1 <= self.num_scheduler_steps <= 64:
      raise ConfigError(f"num_scheduler_steps must be an integer in [1, 64], got {self.num_scheduler_steps!r}")
    if self.num_scheduler_steps > 1 and self.draft_model is not None:
      raise ConfigError("num_scheduler_steps > 1 and draft_model: speculative decoding already takes several tokens a step; "
                        "use one of them")
    if self.num_scheduler_steps > 1 and self.tensor_parallel_size > 1:
      raise ConfigError("num_scheduler_steps > 1 runs on one device; tensor_parallel_size must be 1")
    if not isinstance(self.async_scheduling, bool):
      raise ConfigError(f"async_scheduling must be True or False, got {self.async_scheduling!r}")
    if self.async_scheduling and self.draft_model is not None:
      raise ConfigError("async_scheduling and draft_model: a speculative step reads its drafts' verdict before the next; "
                        "use one of them")
    if self.async_scheduling and self.tensor_parallel_size > 1:
      raise ConfigError("async_scheduling runs on one device; tensor_parallel_size must be 1")
    if not isinstance(self.num_speculative_tokens, int) or not 1 <= self.num_speculative_tokens <= 16:
      raise ConfigError(f"num_speculative_tokens must be an integer in [1, 16], got {self.num_speculative_tokens!r}")

  @classmethod
  def from_kwargs(cls, **kwargs) -> EngineConfig:
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(kwargs) - known)
    if unknown: raise TypeError(f"unknown engine argument(s): {', '.join(unknown)}")
    return cls(**kwargs)
