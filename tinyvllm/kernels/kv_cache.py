"""The paged KV cache of one layer, as a type: its tensors, their storage format and their size.

Layout (every backend): K and V are `[num_blocks, block_size, n_kv_heads, head_dim]`; slot s = block * block_size
+ offset. A float cache stores the model's dtype. A quantized cache (`kv_cache_dtype="int8"`) stores int8 codes in
the same layout and one float16 scale per (slot, KV head) beside them, `[num_blocks, block_size, n_kv_heads]`:

  amax = max_i |x_i| over the head vector x (K after RoPE), s = float16(amax / 127),
  code_i = clamp(rint(x_i / s), -127, 127)  (0 when s == 0),        x_i ~ s * code_i.

One scale per head vector rather than per 32 elements (llama.cpp's q8_0): with head_dim 64 a float16 scale costs
2 bytes per 64, so the cache holds 1.94x the tokens of float16 (q8_0's grouping: 1.88x) and attention does one
multiply per row, not per group. Its error is measured in bench/perplexity.py (docs/quantization.md).
"""
from __future__ import annotations
from dataclasses import dataclass, replace
from typing import Callable
from tinygrad import Tensor, dtypes
from tinyvllm.config import KV_CACHE_DTYPES, ConfigError

INT8_MAX = 127


@dataclass(frozen=True)
class KVCacheFormat:
  """How a cache stores K and V: `storage` ("float32" | "float16" | "int8")."""
  storage: str

  @staticmethod
  def resolve(kv_cache_dtype: str, model_dtype: str) -> KVCacheFormat:
    if kv_cache_dtype not in KV_CACHE_DTYPES:
      raise ConfigError(f"kv_cache_dtype must be one of {', '.join(map(repr, KV_CACHE_DTYPES))}, got {kv_cache_dtype!r}")
    return KVCacheFormat(model_dtype if kv_cache_dtype == "auto" else kv_cache_dtype)

  @property
  def quantized(self) -> bool: return self.storage == "int8"
  @property
  def dtype(self): return {"float32": dtypes.float32, "float16": dtypes.float16, "int8": dtypes.int8}[self.storage]

  def bytes_per_head_vector(self, head_dim: int) -> int:
    """Bytes one (slot, KV head) of K (or of V) takes: the elements, plus the scale when quantized."""
    return head_dim * self.dtype.itemsize + (2 if self.quantized else 0)

  def bytes_per_block(self, num_layers: int, block_size: int, n_kv_heads: int, head_dim: int) -> int:
    """K and V of every layer for one block of tokens."""
    return 2 * num_layers * block_size * n_kv_heads * self.bytes_per_head_vector(head_dim)


@dataclass(frozen=True)
class PagedKVCache:
  """One layer's cache. `k_scale`/`v_scale` are None for a float cache. Kernels that write the cache return a new
  PagedKVCache whose tensors are ordered after the write (read the cache through it)."""
  k: Tensor
  v: Tensor
  k_scale: Tensor | None = None
  v_scale: Tensor | None = None

  @property
  def quantized(self) -> bool: return self.k_scale is not None

  def tensors(self) -> list[Tensor]:
    """Every tensor, in a fixed order (a replay's inputs); `from_tensors` rebuilds the cache from them."""
    return [self.k, self.v] + ([self.k_scale, self.v_scale] if self.quantized else [])

  @staticmethod
  def allocate(fmt: KVCacheFormat, num_blocks: int, block_size: int, n_kv_heads: int, head_dim: int,
               zeros: Callable[[tuple[int, ...], object], Tensor]) -> PagedKVCache:
    """A cache of `fmt`, its tensors made by `zeros(shape, dtype)` (a realized, zero-filled buffer)."""
    rows = (num_blocks, block_size, n_kv_heads)
    if not fmt.quantized: return PagedKVCache(zeros((*rows, head_dim), fmt.dtype), zeros((*rows, head_dim), fmt.dtype))
    return PagedKVCache(zeros((*rows, head_dim), fmt.dtype), zeros((*rows, head_dim), fmt.dtype),
                        zeros(rows, dtypes.float16), zeros(rows, dtypes.float16))

  @staticmethod
  def from_tensors(tensors: list[Tensor]) -> PagedKVCache:
    return PagedKVCache(*tensors)

  def written(self, k: Tensor, v: Tensor, k_scale: Tensor | None = None, v_scale: Tensor | None = None) -> PagedKVCache:
    return replace(self, k=k, v=v, k_scale=k_scale, v_scale=v_scale)
