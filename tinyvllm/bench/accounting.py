"""How many bytes a model step must move and how many FLOPs it must do: the roofline's numerator.

Pure functions of the model config and the list of tensors the model holds (names and real byte sizes),
so a test can check them against a hand count. The unit of work is one sequence in one step:
`(cached, new)` = tokens whose K/V are already in the cache, tokens read this step. A decode is
`(context - 1, 1)`; a prefill chunk is `(tokens before the chunk, chunk length)`.

What is counted, per step:
  weights      every tensor of every layer, the final norm and the LM head once (the batch shares one read);
               the embedding only for the rows gathered (one per token). A tied LM head reads the whole
               embedding. Quantized layers list their packed codes, scales and biases as separate tensors,
               so their real bytes are counted.
  KV read      each sequence's keys and values once per step, up to its last new token:
               layers x 2 x n_kv_heads x (bytes of one head vector: head_dim x dtype bytes, plus its scale
               in a quantized cache) x (cached + new)
               (the ideal of a flash-attention kernel; the engine's attention may read padding beyond it)
  KV written   the same row size x new tokens
  activations  an approximation: every kernel's inputs and outputs cross memory once. Per token per layer
               (14 hidden + 4 q_size + 2 kv_size + 6 intermediate) x activation bytes (norms 2 x 2h,
               qkv h + q + 2kv, attention 2q, o_proj q + h, residual adds 2 x 3h, gate_up h + 2i, SiLU*up 3i,
               down i + h), plus the embedding row written, plus per logits row the hidden state and a
               float32 vocab row. RoPE tables, masks and softmax temporaries are left out.
FLOPs: 2 per multiply-add of every linear (logical weight elements, whatever their storage) for every token,
the LM head for one row per sequence, and attention 4 x heads x head_dim per (query, visible key) pair,
causal inside a chunk.
"""
from __future__ import annotations
from dataclasses import dataclass, fields


@dataclass(frozen=True)
class TensorInfo:
  name: str                    # HF-style: "model.layers.3.mlp.down_proj.weight", "model.embed_tokens.weight", "lm_head.scales"
  shape: tuple[int, ...]
  nbytes: int                  # bytes on the device


@dataclass(frozen=True)
class Traffic:
  weight_bytes: float = 0
  kv_read_bytes: float = 0
  kv_write_bytes: float = 0
  activation_bytes: float = 0
  flops: float = 0
  tokens: int = 0              # query tokens processed

  @property
  def total_bytes(self) -> float: return self.weight_bytes + self.kv_read_bytes + self.kv_write_bytes + self.activation_bytes
  @property
  def intensity(self) -> float:
    """Arithmetic intensity, FLOP per byte."""
    return self.flops / self.total_bytes if self.total_bytes else 0.0

  def __add__(self, other: Traffic) -> Traffic:
    return Traffic(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

  def scaled(self, k: float) -> Traffic:
    return Traffic(*(getattr(self, f.name) * k for f in fields(self)))


def kv_bytes_per_token(cfg, kv_vector_bytes: int) -> int:
  """K and V of one token across all layers; `kv_vector_bytes`: one head vector of K as the cache stores it
  (KVCacheFormat.bytes_per_head_vector)."""
  return cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * kv_vector_bytes


def linear_params_per_layer(cfg) -> int:
  """Weight elements of one layer's linears (q, k, v, o, gate, up, down)."""
  h, q, kv, i = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim, cfg.intermediate_size
  return h * (q + 2 * kv) + q * h + 2 * h * i + i * h


def activation_bytes_per_token(cfg, act_dtype_bytes: int) -> int:
  h, q, kv, i = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim, cfg.intermediate_size
  return (cfg.num_hidden_layers * (14 * h + 4 * q + 2 * kv + 6 * i) + h) * act_dtype_bytes


def weight_bytes(cfg, tensors: list[TensorInfo], num_tokens: int) -> float:
  """Weight bytes one step reads when it processes `num_tokens` tokens (see the module docstring)."""
  has_head = any(t.name.startswith("lm_head.") for t in tensors)
  total = 0.0
  for t in tensors:
    if t.name.startswith("model.embed_tokens."):
      total += t.nbytes / t.shape[0] * num_tokens          # gathered rows
      if not has_head and cfg.tie_word_embeddings: total += t.nbytes   # the tied LM head reads all of it
    else:
      total += t.nbytes
  return total


def step_traffic(cfg, tensors: list[TensorInfo], work: list[tuple[int, int]], kv_vector_bytes: int,
                 act_dtype_bytes: int) -> Traffic:
  """Bytes and FLOPs of one step that reads `new` tokens of each sequence `(cached, new)` in `work`."""
  T, R = sum(n for _, n in work), len(work)
  L, H, D = cfg.num_hidden_layers, cfg.num_attention_heads, cfg.head_dim
  kvt = kv_bytes_per_token(cfg, kv_vector_bytes)
  pairs = sum(n * c + n * (n + 1) // 2 for c, n in work)       # (query, visible key) pairs, causal
  flops = 2 * T * L * linear_params_per_layer(cfg) + 2 * R * cfg.vocab_size * cfg.hidden_size + 4 * L * H * D * pairs
  act = T * activation_bytes_per_token(cfg, act_dtype_bytes) + R * (cfg.hidden_size * act_dtype_bytes + cfg.vocab_size * 4)
  return Traffic(weight_bytes=weight_bytes(cfg, tensors, T), kv_read_bytes=kvt * sum(c + n for c, n in work),
                 kv_write_bytes=kvt * T, activation_bytes=act, flops=flops, tokens=T)


def decode_traffic(cfg, tensors: list[TensorInfo], batch: int, context: float, kv_vector_bytes: int,
                   act_dtype_bytes: int) -> Traffic:
  """One decode step of `batch` sequences that each attend to `context` tokens (their new one included).
  `context` may be fractional: the mean over a timed window."""
  whole = int(context)
  t = step_traffic(cfg, tensors, [(whole - 1, 1)] * batch, kv_vector_bytes, act_dtype_bytes)
  extra = (context - whole) * batch
  kvt = kv_bytes_per_token(cfg, kv_vector_bytes)
  attn = 4 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim
  return t + Traffic(kv_read_bytes=kvt * extra, flops=attn * extra)


def prefill_traffic(cfg, tensors: list[TensorInfo], prompt_len: int, chunk_len: int, kv_vector_bytes: int,
                    act_dtype_bytes: int) -> Traffic:
  """A whole prompt read in chunks of `chunk_len` tokens (the engine's token budget), one step per chunk."""
  total = Traffic()
  for start in range(0, prompt_len, chunk_len):
    total += step_traffic(cfg, tensors, [(start, min(chunk_len, prompt_len - start))], kv_vector_bytes, act_dtype_bytes)
  return total
