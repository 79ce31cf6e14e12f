"""The int8 KV-cache format in float64 numpy, written from its definition (tinyvllm/kernels/kv_cache.py's docstring),
as the reference every backend's cache write and attention are tested against."""
from __future__ import annotations
import numpy as np


def quantize_int8_ref(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """Head vectors `[..., D]` -> (int8 codes `[..., D]`, float16 scales `[...]`): s = f16(max|x| / 127),
  code = clamp(rint(x / s), -127, 127), 0 where s == 0."""
  x = np.asarray(x, np.float64)
  scale = (np.abs(x).max(-1) / 127).astype(np.float16)
  s = scale.astype(np.float64)[..., None]
  codes = np.where(s > 0, np.clip(np.rint(x / np.where(s > 0, s, 1)), -127, 127), 0).astype(np.int8)
  return codes, scale


def dequantize_int8_ref(codes: np.ndarray, scale: np.ndarray) -> np.ndarray:
  return codes.astype(np.float64) * scale.astype(np.float64)[..., None]


def roundtrip_int8_ref(x: np.ndarray) -> np.ndarray:
  """What an int8 cache gives back for head vectors x."""
  return dequantize_int8_ref(*quantize_int8_ref(x))


def rotation_ref(head_dim: int) -> np.ndarray:
  """The int4 cache's R from scipy's Sylvester Hadamard matrix: block diagonal, blocks of the largest power of two
  dividing head_dim, each scaled to be orthonormal."""
  from scipy.linalg import block_diag, hadamard
  b = head_dim & -head_dim
  return block_diag(*[hadamard(b) / np.sqrt(b)] * (head_dim // b))


def quantize_int4_ref(x: np.ndarray, rotated: bool = True) -> tuple[np.ndarray, np.ndarray]:
  """Head vectors `[..., D]` -> (codes in [-7, 7] `[..., D]`, float16 scales): x rotated by R (x @ R, R symmetric),
  then s = f16(max|x| / 7), code = clamp(rint(x / s), -7, 7)."""
  x = np.asarray(x, np.float64)
  if rotated: x = x @ rotation_ref(x.shape[-1])
  scale = (np.abs(x).max(-1) / 7).astype(np.float16)
  s = scale.astype(np.float64)[..., None]
  return np.where(s > 0, np.clip(np.rint(x / np.where(s > 0, s, 1)), -7, 7), 0).astype(np.int8), scale


def unpack_int4_ref(packed: np.ndarray) -> np.ndarray:
  """uint8 `[..., D/2]` (code + 8, element 2i in the low nibble) -> codes `[..., D]`."""
  lo, hi = (packed & 15).astype(np.int8) - 8, (packed >> 4).astype(np.int8) - 8
  return np.stack([lo, hi], -1).reshape(*packed.shape[:-1], -1)


def dequantize_int4_ref(packed: np.ndarray, scale: np.ndarray, rotated: bool = True) -> np.ndarray:
  """What the cache means: codes * s, rotated back (y @ R)."""
  y = unpack_int4_ref(packed).astype(np.float64) * scale.astype(np.float64)[..., None]
  return y @ rotation_ref(y.shape[-1]) if rotated else y
