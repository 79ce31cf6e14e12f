"""The paged KV cache of one layer, as a type: its tensors, their storage format and their size.

Layout (every backend): K and V are `[num_blocks, block_size, n_kv_heads, head_dim]`; slot s = block * block_size
+ offset. A float cache stores the model's dtype. A quantized cache stores codes in the same layout and one float16
scale per (slot, KV head) beside them, `[num_blocks, block_size, n_kv_heads]`.

int8 (`kv_cache_dtype="int8"`), per head vector x (K after RoPE):
  amax = max_i |x_i|, s = float16(amax / 127), code_i = clamp(rint(x_i / s), -127, 127) (0 when s == 0), x_i ~ s * code_i.

k8v4 (`"k8v4"`): keys as int8, values as int4 (rotated). Keys are the sensitive half: at 2.56x the tokens of float16
this costs a fifth of int4's perplexity (docs/quantization.md).

int4 (`"int4"`): the same with 7 for 127 after rotating x by R, the orthonormal Hadamard matrix along head_dim
(block diagonal with blocks of the largest power of two dividing head_dim: 64 -> one block, 80 -> 16, 96 -> 32).
Codes + 8 (1..15) are packed two per byte, element 2i in the low nibble: uint8 `[..., head_dim / 2]`. A rotation
spreads an outlier element over the whole vector, so the scale (set by the largest element) wastes fewer of the 15
levels (llama.cpp and vllm-metal measured several-fold lower error). R is its own inverse and orthonormal, so
attention reads the rotated cache as it is: q.k = (Rq).(Rk) for the scores, and sum_j p_j v_j = R sum_j p_j (R v_j),
one rotation of q before and of the output after, not one per key. `"int4-unrotated"` skips R (for measuring it).

One scale per head vector rather than per 32 elements (llama.cpp's q8_0): with head_dim 64 a float16 scale costs
2 bytes per 64, so an int8 cache holds 1.94x the tokens of float16 (q8_0's grouping: 1.88x), int4 3.76x, and
attention does one multiply per row, not per group. Errors are measured in bench/perplexity.py (docs/quantization.md).
"""
from __future__ import annotations
import functools
from dataclasses import dataclass, replace
from typing import Callable
import numpy as np
from tinygrad import Context, Tensor, dtypes
from tinyvllm.config import KV_CACHE_DTYPES, ConfigError

INT8_MAX = 127
INT4_MAX = 7
STORAGE_DTYPES = {"float32": dtypes.float32, "float16": dtypes.float16, "int8": dtypes.int8, "int4": dtypes.uint8}


@dataclass(frozen=True)
class KVCacheFormat:
  """How a cache stores K and V: `storage` ("float32" | "float16" | "int8" | "int4" | "k8v4": int8 keys, int4 values),
  `rotated` (int4 tensors only)."""
  storage: str
  rotated: bool = False

  @staticmethod
  def resolve(kv_cache_dtype: str, model_dtype: str) -> KVCacheFormat:
    if kv_cache_dtype not in KV_CACHE_DTYPES:
      raise ConfigError(f"kv_cache_dtype must be one of {', '.join(map(repr, KV_CACHE_DTYPES))}, got {kv_cache_dtype!r}")
    if kv_cache_dtype == "auto": return KVCacheFormat(model_dtype)
    if kv_cache_dtype in ("int4", "k8v4"): return KVCacheFormat(kv_cache_dtype, rotated=True)
    return KVCacheFormat("int4") if kv_cache_dtype == "int4-unrotated" else KVCacheFormat(kv_cache_dtype)

  @property
  def k_storage(self) -> str: return "int8" if self.storage == "k8v4" else self.storage
  @property
  def v_storage(self) -> str: return "int4" if self.storage == "k8v4" else self.storage
  @property
  def quantized(self) -> bool: return self.k_storage in ("int8", "int4")
  @property
  def dtype(self): return STORAGE_DTYPES[self.k_storage]

  @staticmethod
  def _vector_bytes(storage: str, head_dim: int) -> int:
    if storage == "int4": return head_dim // 2 + 2
    return head_dim * STORAGE_DTYPES[storage].itemsize + (2 if storage == "int8" else 0)

  def bytes_per_head_vector(self, head_dim: int) -> int:
    """Bytes one (slot, KV head) of K or of V takes on average: the elements, plus the scale when quantized."""
    return (self._vector_bytes(self.k_storage, head_dim) + self._vector_bytes(self.v_storage, head_dim)) // 2

  def bytes_per_block(self, num_layers: int, block_size: int, n_kv_heads: int, head_dim: int) -> int:
    """K and V of every layer for one block of tokens."""
    return 2 * num_layers * block_size * n_kv_heads * self.bytes_per_head_vector(head_dim)


def hadamard_block(head_dim: int) -> int:
  """The rotation's block: the largest power of two dividing head_dim."""
  return head_dim & -head_dim


def hadamard(head_dim: int) -> np.ndarray:
  """R: block-diagonal normalized Sylvester Hadamard matrices (symmetric, R @ R = I), float64 `[head_dim, head_dim]`."""
  b, h = hadamard_block(head_dim), np.ones((1, 1))
  while h.shape[0] < b: h = np.block([[h, h], [h, -h]])
  return np.kron(np.eye(head_dim // b), h / np.sqrt(b))


@functools.cache
def hadamard_tensor(head_dim: int, device: str) -> Tensor:
  """R on a device, made once and outside any TinyJit capture (inside one its upload would be replayed every call)."""
  with Context(CAPTURING=0): return Tensor(hadamard(head_dim).astype(np.float32), device=device).realize()


@dataclass(frozen=True)
class PagedKVCache:
  """One layer's cache. `k_scale`/`v_scale` are None for a float cache. Kernels that write the cache return a new
  PagedKVCache whose tensors are ordered after the write (read the cache through it)."""
  k: Tensor
  v: Tensor
  k_scale: Tensor | None = None
  v_scale: Tensor | None = None
  rotated: bool = False     # its int4 tensors are stored rotated by R (see the module docstring)

  @property
  def quantized(self) -> bool: return self.k_scale is not None
  @property
  def k_int4(self) -> bool: return self.k.dtype == dtypes.uint8
  @property
  def v_int4(self) -> bool: return self.v.dtype == dtypes.uint8
  @property
  def k_rotated(self) -> bool: return self.rotated and self.k_int4
  @property
  def v_rotated(self) -> bool: return self.rotated and self.v_int4
  @property
  def head_dim(self) -> int: return self.k.shape[-1] * (2 if self.k_int4 else 1)

  def tensors(self) -> list[Tensor]:
    """Every tensor, in a fixed order (a replay's inputs); `with_tensors` rebuilds the cache from them."""
    return [self.k, self.v] + ([self.k_scale, self.v_scale] if self.quantized else [])

  @staticmethod
  def allocate(fmt: KVCacheFormat, num_blocks: int, block_size: int, n_kv_heads: int, head_dim: int,
               zeros: Callable[[tuple[int, ...], object], Tensor]) -> PagedKVCache:
    """A cache of `fmt`, its tensors made by `zeros(shape, dtype)` (a realized, zero-filled buffer)."""
    rows = (num_blocks, block_size, n_kv_heads)
    k, v = (zeros((*rows, head_dim // 2 if s == "int4" else head_dim), STORAGE_DTYPES[s]) for s in (fmt.k_storage, fmt.v_storage))
    if not fmt.quantized: return PagedKVCache(k, v)
    return PagedKVCache(k, v, zeros(rows, dtypes.float16), zeros(rows, dtypes.float16), fmt.rotated)

  def with_tensors(self, tensors: list[Tensor]) -> PagedKVCache:
    """This cache's format around other tensors (in `tensors()` order): a replayed layer rebuilds its cache so."""
    return PagedKVCache(*tensors, rotated=self.rotated) if len(tensors) == 4 else PagedKVCache(*tensors)

  def written(self, k: Tensor, v: Tensor, k_scale: Tensor | None = None, v_scale: Tensor | None = None) -> PagedKVCache:
    return replace(self, k=k, v=v, k_scale=k_scale, v_scale=v_scale)
