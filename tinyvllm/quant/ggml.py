"""ggml's block-quantized tensor formats (as stored in GGUF files), decoded with numpy.

Every format here quantizes rows in blocks of 32 consecutive weights along the input dimension:
  Q8_0: fp16 scale d, 32 x int8 q                          w = d * q                 (34 bytes / block)
  Q4_0: fp16 scale d, 16 bytes of nibbles                  w = d * (q - 8)           (18 bytes / block)
  Q4_1: fp16 scale d, fp16 min m, 16 bytes of nibbles      w = d * q + m             (20 bytes / block)
In the 4-bit formats byte j of a block holds element j in its low nibble and element j+16 in its high nibble.
"""
from __future__ import annotations
import numpy as np

BLOCK = 32
BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}


def _blocks(raw: np.ndarray, qtype: str) -> np.ndarray:
  """View raw bytes `[rows, bytes_per_row]` as `[rows, n_blocks, block_bytes]`."""
  raw = np.ascontiguousarray(raw, dtype=np.uint8)
  rows = raw.shape[0] if raw.ndim > 1 else 1
  return raw.reshape(rows, -1, BLOCK_BYTES[qtype])


def unpack_q4_codes(blocks: np.ndarray, offset: int) -> np.ndarray:
  """The 32 four-bit codes of every block, in element order: `[rows, n_blocks, 32]` uint8."""
  nib = blocks[..., offset:offset + 16]
  return np.concatenate([nib & 0xF, nib >> 4], axis=-1)


def q4_0_parts(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Q4_0 as (codes [rows, nb, 32] uint8, scale [rows, nb] f32, bias [rows, nb] f32) with w = scale*code + bias."""
  b = _blocks(raw, "Q4_0")
  d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
  return unpack_q4_codes(b, 2), d, -8.0 * d


def q4_1_parts(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Q4_1 as (codes [rows, nb, 32] uint8, scale [rows, nb] f32, bias [rows, nb] f32) with w = scale*code + bias."""
  b = _blocks(raw, "Q4_1")
  d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
  m = b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
  return unpack_q4_codes(b, 4), d, m


def q8_0_parts(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """Q8_0 as (codes [rows, nb, 32] int8, scale [rows, nb] f32) with w = scale*code."""
  b = _blocks(raw, "Q8_0")
  d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
  return b[..., 2:].copy().view(np.int8), d


def dequantize(raw: np.ndarray, qtype: str, shape: tuple[int, ...]) -> np.ndarray:
  """Decode a ggml tensor to float32 of the given numpy shape (rows outermost, input dimension last)."""
  if qtype == "Q8_0":
    q, d = q8_0_parts(raw)
    w = q.astype(np.float32) * d[..., None]
  elif qtype in ("Q4_0", "Q4_1"):
    q, d, m = (q4_0_parts if qtype == "Q4_0" else q4_1_parts)(raw)
    w = q.astype(np.float32) * d[..., None] + m[..., None]
  else:
    raise ValueError(f"unsupported ggml quantization type {qtype}")
  return w.reshape(shape)
