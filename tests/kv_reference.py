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
