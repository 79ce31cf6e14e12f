"""Block-quantized weights in one general layout ("packed"), with numpy: what GGUF's k-quants (Q4_K, Q5_K, Q6_K, Q3_K),
Q5_0/Q5_1 and MLX's 6- and 8-bit checkpoints become, exactly, without dequantizing.

A linear `[N, K]` (y = x @ W^T) is stored as codes in bit planes and a scale per group of G inputs:
  <name>.weight   uint32 [N, K/8]            the low 4 bits of every code: the code of k = 8j + i in bits 4i..4i+3 of
                                             word j (INT4's layout, so the nibble kernels unpack it unchanged)
  <name>.qhigh    uint32 [N, K/32 * (b-4)]   b > 4: for each run of 32 inputs, b - 4 words; bit t of word p holds bit
                                             4 + p of the code of input 2t (t < 16) or 2(t - 16) + 1 (t >= 16) of the
                                             run: even inputs first, the order nibbles unpack in
  <name>.scales   float16 [N, K/G]           the group scale S, or two-level: int8/uint8 [N, K/G] times
  <name>.scale_d  float16 [N, K/(G*s)]       one float16 per s groups (a k-quant super-block): S = scale_d * scales
  <name>.biases   float16 [N, K/G]           affine: the bias B; or two-level uint8 [N, K/G] mins times
  <name>.bias_d   float16 [N, K/(G*s)]       B = -bias_d * biases (a k-quant's dmin * m)
                  (no biases: symmetric, w = S * (q - 2^(b-1)))
and w[n, k] = S * q + B per group, q the b-bit code (0 .. 2^b - 1). `QuantSpec` names such a layout; `spec_of` reads
it back from the tensors beside a weight. With b = 4 and float16 scales and biases it is INT4 (quant/int4.py), which
the loaders keep spelling as INT4.

Every conversion here is exact: dequantizing our arrays gives gguf.quants.dequantize's (and mlx.core.dequantize's)
float32 values bit for bit. A two-level scale is the product of a float16 and an integer of at most 8 bits, exact in
float32, and so is S * q; each weight is then rounded once, in the same place as ggml's reference code.

Bytes per weight as stored here (the GGUF file's in brackets): Q4_K 4.625 (4.5: its 6-bit scales and mins take a byte
each here), Q5_K 5.625 (5.5), Q6_K 6.5625 (6.5625), Q3_K 4.5625 (3.4375: 3-bit codes in 4-bit planes), Q5_0 5.5 (5.5),
Q5_1 6 (6); MLX b-bit with group G: b + 32/G (3-bit: as INT4, 4 + 32/G).
"""
from __future__ import annotations
from dataclasses import dataclass
import numpy as np
from tinyvllm.quant import int4

QK = 256   # a k-quant super-block


@dataclass(frozen=True)
class QuantSpec:
  bits: int                  # 4, 5, 6 or 8: code bits as stored
  group: int                 # inputs per scale
  super_groups: int = 0      # 0: float16 scale (and bias) per group; s: two-level, a float16 per s groups
  signed_scales: bool = False  # two-level scales are int8 (else uint8)
  symmetric: bool = False    # w = S (q - 2^(bits-1)), no biases stored

  @property
  def offset(self) -> int: return 1 << (self.bits - 1) if self.symmetric else 0

  def bytes_per_weight(self) -> float:
    per_group = 1 if self.super_groups else 2   # an integer, or a float16
    scale = per_group / self.group + (2 / (self.group * self.super_groups) if self.super_groups else 0)
    return self.bits / 8 + scale * (1 if self.symmetric else 2)


def spec_of(tensors, base: str) -> QuantSpec:
  """The layout of linear `base` from the tensors beside its weight (shapes and dtypes)."""
  w, s = tensors[f"{base}.weight"], tensors[f"{base}.scales"]
  K = w.shape[-1] * 8
  high = tensors.get(f"{base}.qhigh")
  bits = 4 + (high.shape[-1] * 32 // K if high is not None else 0)
  group = K // s.shape[-1]
  d = tensors.get(f"{base}.scale_d")
  super_groups = s.shape[-1] // d.shape[-1] if d is not None else 0
  return QuantSpec(bits, group, super_groups, bool(d is not None and _dtype_name(s) == "int8"), f"{base}.biases" not in tensors)


def _dtype_name(t) -> str: return t.dtype.name if hasattr(t.dtype, "name") else str(t.dtype)


# **** bit planes ****

def _interleave_order() -> np.ndarray:
  """Position in a run of 32 inputs of bit t of a high-plane word: even inputs first, then odd."""
  return np.concatenate([np.arange(0, 32, 2), np.arange(1, 32, 2)])


_ORDER = _interleave_order()


def pack_codes(q: np.ndarray, bits: int) -> dict[str, np.ndarray]:
  """Codes `[N, K]` (0 .. 2^bits - 1) -> {"weight": nibble plane, "qhigh": high planes (bits > 4)}."""
  q = np.asarray(q, np.uint8)
  N, K = q.shape
  if K % 32: raise ValueError(f"K={K} must be a multiple of 32 for the packed layout")
  out = {"weight": int4.pack(q & 0xF)}
  if bits > 4:
    runs = q.reshape(N, K // 32, 32)[..., _ORDER]                                   # [N, runs, 32] in bit order
    planes = (runs[..., None, :] >> (4 + np.arange(bits - 4, dtype=np.uint8))[:, None]) & 1   # [N, runs, bits-4, 32]
    words = (planes.astype(np.uint32) << np.arange(32, dtype=np.uint32)).sum(-1, dtype=np.uint64).astype(np.uint32)
    out["qhigh"] = words.reshape(N, -1)
  return out


def unpack_codes(weight: np.ndarray, qhigh: np.ndarray | None, bits: int) -> np.ndarray:
  """The inverse of pack_codes: codes uint8 `[N, K]`."""
  q = int4.unpack(weight)
  if bits > 4:
    N, K = q.shape
    words = np.asarray(qhigh, np.uint32).reshape(N, K // 32, bits - 4)
    planes = ((words[..., None] >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)   # [N, runs, bits-4, 32]
    high = (planes << (4 + np.arange(bits - 4, dtype=np.uint8))[:, None]).sum(2, dtype=np.uint8)   # [N, runs, 32] bit order
    runs = np.empty_like(high)
    runs[..., _ORDER] = high
    q = q | runs.reshape(N, K)
  return q


# **** dequantization (the reference the kernels and tests compare with) ****

def group_scales(parts: dict, spec: QuantSpec) -> tuple[np.ndarray, np.ndarray | None]:
  """(S, B) float32 `[N, K/G]` of a packed linear; B None when symmetric."""
  s = np.asarray(parts["scales"])
  if spec.super_groups:
    d = np.asarray(parts["scale_d"], np.float16).astype(np.float32)
    S = np.repeat(d, spec.super_groups, axis=-1) * s.astype(np.float32)
  else: S = s.astype(np.float32)
  if spec.symmetric: return S, None
  b = np.asarray(parts["biases"])
  if spec.super_groups:
    dm = np.asarray(parts["bias_d"], np.float16).astype(np.float32)
    return S, -(np.repeat(dm, spec.super_groups, axis=-1) * b.astype(np.float32))
  return S, b.astype(np.float32)


def dequantize(parts: dict, spec: QuantSpec) -> np.ndarray:
  """float32 `[N, K]`: S * q + B per group (symmetric: S * (q - offset)), each weight rounded once."""
  q = unpack_codes(parts["weight"], parts.get("qhigh"), spec.bits)
  N, K = q.shape
  S, B = group_scales(parts, spec)
  qg = q.reshape(N, K // spec.group, spec.group).astype(np.float32)
  if B is None: w = S[..., None] * (qg - np.float32(spec.offset))
  else: w = S[..., None] * qg + B[..., None]
  return w.reshape(N, K)


def parts_of(tensors, base: str) -> dict:
  """{"weight", "qhigh", "scales", "scale_d", "biases", "bias_d"} present for linear `base`."""
  return {p: tensors[f"{base}.{p}"] for p in PARTS if f"{base}.{p}" in tensors}


PARTS = ("weight", "qhigh", "scales", "scale_d", "biases", "bias_d")


# **** from GGUF blocks ****

GGML_TYPES = {"Q4_K": (QK, 144), "Q5_K": (QK, 176), "Q6_K": (QK, 210), "Q3_K": (QK, 110), "Q5_0": (32, 22), "Q5_1": (32, 24)}


def _f16(b: np.ndarray) -> np.ndarray:
  """Two bytes per entry (last axis) -> float16 values."""
  return np.ascontiguousarray(b).view(np.float16)[..., 0]


def _k_scales_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """Q4_K/Q5_K's 12 bytes of 6-bit scales and mins for 8 sub-blocks -> (scales, mins) uint8 `[..., 8]`. Bytes 0-3 hold
  scales 0-3 in their low 6 bits, bytes 4-7 mins 0-3; sub-blocks 4-7 take their low 4 bits from bytes 8-11 (scale
  in the low nibble, min in the high) and their top 2 bits from the top bits of bytes 0-3 (scales) and 4-7 (mins)."""
  a, m, hi = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
  scales = np.concatenate([a & 0x3F, (hi & 0x0F) | ((a >> 6) << 4)], axis=-1)
  mins = np.concatenate([m & 0x3F, (hi >> 4) | ((m >> 6) << 4)], axis=-1)
  return scales, mins


def _nibble_runs(qs: np.ndarray, run: int) -> np.ndarray:
  """ggml's nibble layout: for each `run`-byte chunk, the low nibbles are elements 0..run-1 and the high nibbles
  elements run..2run-1 of a 2*run stretch. `[..., n]` bytes -> `[..., 2n]` codes in element order."""
  c = qs.reshape(*qs.shape[:-1], -1, run)
  return np.stack([c & 0xF, c >> 4], axis=-2).reshape(*qs.shape[:-1], -1)


def from_ggml(raw: np.ndarray, qtype: str, shape: tuple[int, int]) -> tuple[dict[str, np.ndarray], QuantSpec]:
  """GGUF blocks of a `[N, K]` weight -> (the packed layout's arrays, its spec), exactly. Raises ValueError on data
  whose size does not match."""
  N, K = shape
  block, nbytes = GGML_TYPES[qtype]
  if K % block: raise ValueError(f"{qtype} needs rows that are a multiple of {block} (K={K})")
  raw = np.ascontiguousarray(raw, np.uint8)
  if raw.size != N * (K // block) * nbytes: raise ValueError(f"{qtype} data of {raw.size} bytes does not match [{N}, {K}]")
  b = raw.reshape(N, K // block, nbytes)
  if qtype in ("Q4_K", "Q5_K"):
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    sc, mn = _k_scales_mins(b[..., 4:16])
    if qtype == "Q4_K": q = _nibble_runs(b[..., 16:144], 32)
    else:
      low = _nibble_runs(b[..., 48:176], 32)                                  # [N, sb, 256]
      qh = b[..., 16:48]                                                      # bit j of byte t: element 32j + t
      high = ((qh[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1).reshape(N, -1, QK)
      q = low | (high << 4)
    spec = QuantSpec(4 if qtype == "Q4_K" else 5, 32, 8)
    parts = {"scales": sc.reshape(N, -1), "scale_d": d, "biases": mn.reshape(N, -1), "bias_d": dmin}
  elif qtype == "Q6_K":
    ql, qh, sc, d = b[..., 0:128], b[..., 128:192], b[..., 192:208], _f16(b[..., 208:210])
    low = _nibble_runs(ql, 64)                                                # 2 halves of 128: nibbles of 64 bytes
    high = ((qh.reshape(N, -1, 2, 1, 32) >> (2 * np.arange(4, dtype=np.uint8))[:, None]) & 3).reshape(N, -1, QK)
    q = low | (high << 4)
    spec = QuantSpec(6, 16, 16, signed_scales=True, symmetric=True)
    parts = {"scales": sc.view(np.int8).reshape(N, -1), "scale_d": d}
  elif qtype == "Q3_K":
    hmask, qs, packed, d = b[..., 0:32], b[..., 32:96], b[..., 96:108], _f16(b[..., 108:110])
    low4 = np.concatenate([packed[..., 0:8] & 0xF, packed[..., 0:8] >> 4], axis=-1)               # low 4 bits of 16 scales
    top2 = ((packed[..., 8:12, None] >> (2 * np.arange(4, dtype=np.uint8))) & 3).transpose(0, 1, 3, 2).reshape(N, -1, 16)
    sc = ((low4 | (top2 << 4)).astype(np.int16) - 32).astype(np.int8)
    ql = ((qs.reshape(N, -1, 2, 1, 32) >> (2 * np.arange(4, dtype=np.uint8))[:, None]) & 3).reshape(N, -1, QK)
    hbit = ((hmask[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1).reshape(N, -1, QK)
    q = ql + 4 * hbit + 4                  # ggml's ql - 4 (1 - hbit), shifted into 4..11: symmetric 4-bit (offset 8)
    spec = QuantSpec(4, 16, 16, signed_scales=True, symmetric=True)
    parts = {"scales": sc.reshape(N, -1), "scale_d": d}
  else:   # Q5_0 (w = d (q - 16)), Q5_1 (w = d q + m)
    d = _f16(b[..., 0:2])
    at = 4 if qtype == "Q5_1" else 2
    qh = np.ascontiguousarray(b[..., at:at + 4]).view(np.uint32)[..., 0]   # bit j: element j's fifth bit
    low = _nibble_runs(b[..., at + 4:at + 20], 16)
    q = low | ((((qh[..., None] >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)) << 4)
    if qtype == "Q5_0": spec, parts = QuantSpec(5, 32, symmetric=True), {"scales": d}
    else: spec, parts = QuantSpec(5, 32), {"scales": d, "biases": _f16(b[..., 2:4])}
  return pack_codes(q.reshape(N, K), spec.bits) | parts, spec


# **** from MLX ****

def from_mlx(packed: np.ndarray, scales: np.ndarray, biases: np.ndarray, bits: int) -> tuple[dict[str, np.ndarray], QuantSpec]:
  """An MLX affine b-bit linear (uint32 words holding the codes as one little-endian bit stream per row; scales and
  biases per group) -> the packed layout (b = 5, 6, 8) or INT4's (b <= 4: the codes fit a nibble). Scales and biases
  become float16, as for MLX's 4-bit checkpoints (int4.float16_params)."""
  words = np.ascontiguousarray(packed).view(np.uint32)
  N = words.shape[0]
  K = words.shape[1] * 32 // bits
  stream = np.unpackbits(words.view(np.uint8).reshape(N, -1), axis=-1, bitorder="little")
  q = (stream.reshape(N, K, bits).astype(np.uint16) << np.arange(bits, dtype=np.uint16)).sum(-1).astype(np.uint8)
  G = K // scales.shape[-1]
  half = {"scales": np.asarray(scales).astype(np.float16), "biases": np.asarray(biases).astype(np.float16)}
  if bits <= 4: return {"weight": int4.pack(q)} | half, QuantSpec(4, G)
  return pack_codes(q, bits) | half, QuantSpec(bits, G)
