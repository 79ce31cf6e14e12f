"""Block-quantized weights in one general layout ("packed"), with numpy: what GGUF's k-quants (Q4_K, Q5_K, Q6_K, Q3_K),
Q5_0/Q5_1, IQ4_XS/IQ4_NL and MLX's 5-, 6- and 8-bit checkpoints become, exactly, without dequantizing.

A linear `[N, K]` (y = x @ W^T) becomes at most three arrays and a spec, w = S * q + B per group of G inputs:
  <name>.weight   uint32 [N, K/8 + H]  the codes: per row, first the low 4 bits of every code (the code of k = 8j + i in
                                       bits 4i..4i+3 of word j: INT4's layout), then for b > 4 bits their h = b - 4 high
                                       bits in blocks of 32 bytes covering R = 8/h runs of 32 inputs: bits h*j..h*j+h-1 of
                                       byte i hold the high bits of run j's input i, so one shift and mask of a block
                                       gives a run's high bits, a byte per input (H = 8 words per block, the last padded)
  <name>.scales   float16 [N, K/G]     S; or two-level, an 8-bit integer per group (int8 or uint8 [N, K/G]; with
                                       k_scales, Q4_K's and Q5_K's, uint8 [N, K/256, 12]: each super-block's 8 scales
                                       and 8 mins as 6-bit fields, packed as ggml packs them, k_scales_mins) times
  <name>.scale_d  float16 [N, K/(G*s)] a float16 per s groups (a k-quant super-block; [N, K/(G*s), 2]: d and dmin):
                                       S = d * scale, B = -dmin * min
  <name>.biases   float16 [N, K/G]     affine with float16 scales: B
  <name>.qspec    int32 [7]            the QuantSpec (bits, group, super_groups, signed_scales, symmetric, codebook, k_scales)
Symmetric layouts store no biases: w = S * (q - 2^(b-1)), or with a codebook (IQ4_XS/IQ4_NL) w = S * CODEBOOK[q]. Three arrays at most because tinygrad fuses a dequantizing
expression into the matmul that reads it only while it reads at most three buffers (schedule/rangeify.py): one more
and it would write the whole float weight out first (kernels/portable.py).

Every conversion here is exact: dequantizing our arrays gives gguf.quants.dequantize's (and mlx.core.dequantize's)
float32 values bit for bit. A two-level scale is the product of a float16 and an integer of at most 8 bits, exact in
float32, and so is S * q; each weight is then rounded once, in the same place as ggml's reference code.

Bits per weight as stored here (the GGUF file's in brackets): Q4_K 4.5 (4.5), Q5_K 5.5 (5.5), Q6_K 6.5625 (6.5625),
Q3_K 4.5625 (3.4375: 3-bit codes in 4-bit planes), Q5_0 5.5 (5.5), Q5_1 6 (6), IQ4_XS 4.3125 (4.25) and IQ4_NL 4.5
(4.5: codes that index a table of 16 values, `codebook`); MLX b-bit with group G: b + 32/G (3-bit: as INT4, 4 + 32/G).
"""
from __future__ import annotations
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
import numpy as np
from tinyvllm import host_memory
from tinyvllm.quant import int4
from tinyvllm.quant.formats import CODEBOOK, INT4, INT8, WEIGHT_PARTS, QuantSpec, spec_of

QK = 256   # a k-quant super-block
ROWS_AT_ONCE = 1 << 21   # weights converted at a time: the temporaries stay in cache (4x faster than whole 8B-sized tables)


def high_blocks(K: int, bits: int) -> tuple[int, int]:
  """(runs of 32 inputs per 32-byte block of high bits, blocks per row) of a b-bit layout with K inputs."""
  R = 8 // (bits - 4)
  return R, -(-(K // 32) // R)


def pack_codes(q: np.ndarray, bits: int) -> np.ndarray:
  """Codes `[N, K]` (0 .. 2^bits - 1) -> the `weight` array: nibble words, then the high bits' blocks."""
  q = np.asarray(q, np.uint8)
  if q.shape[1] % 32: raise ValueError(f"K={q.shape[1]} must be a multiple of 32 for the packed layout")
  return join_codes(int4.pack(q & 0xF), q >> 4 if bits > 4 else None, bits)


def join_codes(nibbles: np.ndarray, high: np.ndarray | None, bits: int) -> np.ndarray:
  """The `weight` array from INT4-packed low nibbles (uint32 `[N, K/8]`) and the codes' high bits (uint8 `[N, K]`,
  0 .. 2^(bits-4) - 1; None for 4 bits)."""
  if high is None: return nibbles
  N, K = high.shape
  R, NB = high_blocks(K, bits)
  runs = np.zeros((N, NB * R, 32), np.uint8)
  runs[:, :K // 32] = high.reshape(N, K // 32, 32)                                         # padded to whole blocks
  h = bits - 4
  blocks = np.zeros((N, NB, 32), np.uint8)
  for j in range(R): blocks |= runs.reshape(N, NB, R, 32)[:, :, j] << np.uint8(h * j)
  return np.concatenate([nibbles, blocks.view("<u4").reshape(N, -1)], axis=1)


def unpack_codes(weight: np.ndarray, bits: int, K: int) -> np.ndarray:
  """The inverse of pack_codes: codes uint8 `[N, K]`."""
  weight = np.asarray(weight, np.uint32)
  N = weight.shape[0]
  q = int4.unpack(weight[:, :K // 8])
  if bits > 4:
    R, NB = high_blocks(K, bits)
    blocks = np.ascontiguousarray(weight[:, K // 8:]).astype("<u4").view(np.uint8).reshape(N, NB, 1, 32)
    h = bits - 4
    high = ((blocks >> (h * np.arange(R, dtype=np.uint8))[:, None]) & ((1 << h) - 1)).reshape(N, NB * R, 32)[:, :K // 32]
    q = q | (high.reshape(N, K) << 4)
  return q


def spec_array(spec: QuantSpec) -> np.ndarray:
  return np.array([spec.bits, spec.group, spec.super_groups, spec.signed_scales, spec.symmetric, spec.codebook, spec.k_scales], np.int32)



def layout(codes: np.ndarray, spec: QuantSpec, scales: np.ndarray, scale_d: np.ndarray | None = None,
           biases: np.ndarray | None = None) -> dict[str, np.ndarray]:
  """The arrays of a packed linear (a name's parts, without the name) from its codes `[N, K]` (or its `weight` array,
  uint32, already packed) and scales."""
  out = {"weight": codes if codes.dtype == np.uint32 else pack_codes(codes, spec.bits), "scales": scales}
  if scale_d is not None: out["scale_d"] = scale_d
  if biases is not None: out["biases"] = biases
  return out | {"qspec": spec_array(spec)}


# **** dequantization (the reference the kernels and tests compare with) ****

def group_scales(parts: dict, spec: QuantSpec) -> tuple[np.ndarray, np.ndarray | None]:
  """(S, B) float32 `[N, K/G]` of a packed linear; B None when symmetric."""
  s = np.asarray(parts["scales"])
  if spec.k_scales: s = np.stack(k_scales_mins(s), axis=-1).reshape(len(s), -1, 2)
  if not spec.super_groups: return s.astype(np.float32), None if spec.symmetric else np.asarray(parts["biases"]).astype(np.float32)
  d = np.asarray(parts["scale_d"], np.float16).astype(np.float32)
  if spec.symmetric: return np.repeat(d, spec.super_groups, axis=-1) * s.astype(np.float32), None
  S = np.repeat(d[..., 0], spec.super_groups, axis=-1) * s[..., 0].astype(np.float32)
  return S, -(np.repeat(d[..., 1], spec.super_groups, axis=-1) * s[..., 1].astype(np.float32))


def dequantize(parts: dict, spec: QuantSpec) -> np.ndarray:
  """float32 `[N, K]`: S * q + B per group (symmetric: S * (q - offset); a codebook: S * CODEBOOK[q]), each weight
  rounded once."""
  N, K = parts["scales"].shape[0], parts["scales"].shape[1] * spec.scale_inputs
  q = unpack_codes(parts["weight"], spec.bits, K)
  S, B = group_scales(parts, spec)
  qg = (np.array(CODEBOOK, np.float32)[q] if spec.codebook else q).reshape(N, K // spec.group, spec.group).astype(np.float32)
  if B is None: w = S[..., None] * (qg - np.float32(spec.offset))
  else: w = S[..., None] * qg + B[..., None]
  return w.reshape(N, K)


def dequantize_linear(tensors, name: str, fmt: str) -> np.ndarray:
  """A quantized linear `name` of a flat dict of arrays (INT8, INT4 or packed: quant/formats.py) as float32 `[N, K]`."""
  if fmt == INT8: return int4.dequantize_8bit(tensors[f"{name}.weight"], tensors[f"{name}.scales"])
  if fmt == INT4: return int4.dequantize(tensors[f"{name}.weight"], tensors[f"{name}.scales"], tensors[f"{name}.biases"])
  return dequantize({p: tensors[f"{name}.{p}"] for p in WEIGHT_PARTS if f"{name}.{p}" in tensors}, spec_of(tensors, name))


# **** from GGUF blocks ****

GGML_TYPES = {"Q4_K": (QK, 144), "Q5_K": (QK, 176), "Q6_K": (QK, 210), "Q3_K": (QK, 110), "Q5_0": (32, 22), "Q5_1": (32, 24),
              "IQ4_XS": (QK, 136), "IQ4_NL": (32, 18)}
GGML_SPECS = {"Q4_K": QuantSpec(4, 32, 8, k_scales=True), "Q5_K": QuantSpec(5, 32, 8, k_scales=True), "Q6_K": QuantSpec(6, 16, 16, signed_scales=True, symmetric=True),
              "Q3_K": QuantSpec(4, 16, 16, signed_scales=True, symmetric=True), "Q5_0": QuantSpec(5, 32, symmetric=True),
              "Q5_1": QuantSpec(5, 32), "IQ4_XS": QuantSpec(4, 32, 8, signed_scales=True, symmetric=True, codebook=True),
              "IQ4_NL": QuantSpec(4, 32, symmetric=True, codebook=True)}


def part_shapes(spec: QuantSpec, n: int, k: int) -> dict[str, tuple[int, ...]]:
  """The shape of each array a packed `[n, k]` linear stores (formats.WEIGHT_PARTS order), its spec array aside."""
  groups = k // spec.group
  pair = () if spec.symmetric or not spec.super_groups else (2,)   # a two-level affine layout pairs scale and min
  high = high_blocks(k, spec.bits)[1] * 8 if spec.bits > 4 else 0
  out = {"weight": (n, k // 8 + high), "scales": (n, k // spec.scale_inputs, 12) if spec.k_scales else (n, groups, *pair)}
  if spec.super_groups: out["scale_d"] = (n, groups // spec.super_groups, *pair)
  if not spec.symmetric and not spec.super_groups: out["biases"] = (n, groups)
  return out


def packed_nbytes(spec: QuantSpec, n: int, k: int) -> int:
  """Bytes a packed `[n, k]` linear stores, a padded last block of high bits included (its spec array aside)."""
  itemsize = {"weight": 4, "scales": 1 if spec.super_groups else 2, "scale_d": 2, "biases": 2}
  return sum(itemsize[p] * int(np.prod(shape)) for p, shape in part_shapes(spec, n, k).items())


def stored_parts(spec: QuantSpec) -> tuple[str, ...]:
  """The arrays a layout stores: its weight arrays and the spec."""
  return (*part_shapes(spec, 32, spec.group * max(spec.super_groups, 1) * 32), "qspec")


def _f16(b: np.ndarray) -> np.ndarray:
  """Two bytes per entry (last axis) -> float16 values."""
  return np.ascontiguousarray(b).view(np.float16)[..., 0]


def k_scales_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """Q4_K/Q5_K's 12 bytes of 6-bit scales and mins for 8 sub-blocks -> (scales, mins) uint8 `[..., 8]`. Bytes 0-3 hold
  scales 0-3 in their low 6 bits, bytes 4-7 mins 0-3; sub-blocks 4-7 take their low 4 bits from bytes 8-11 (scale
  in the low nibble, min in the high) and their top 2 bits from the top bits of bytes 0-3 (scales) and 4-7 (mins).
  Computed four bytes at a time: each mask is one byte's, repeated in a 32-bit word."""
  a, m, hi = (np.ascontiguousarray(packed).view("<u4")[..., i] for i in range(3))
  low6, low4, top2 = np.uint32(0x3F3F3F3F), np.uint32(0x0F0F0F0F), np.uint32(0x30303030)
  scales = np.stack([a & low6, (hi & low4) | ((a >> 2) & top2)], axis=-1).view(np.uint8)
  mins = np.stack([m & low6, ((hi >> 4) & low4) | ((m >> 2) & top2)], axis=-1).view(np.uint8)
  return scales, mins


def _nibble_runs(qs: np.ndarray, run: int) -> np.ndarray:
  """ggml's nibble layout -> INT4's words `[N, K/8]`. ggml: for each `run`-byte chunk, the low nibbles are elements
  0..run-1 and the high nibbles elements run..2run-1 of a 2*run stretch; INT4: byte i holds elements 2i (low nibble)
  and 2i + 1. Moved a byte pair at a time, read as one 16-bit word v = even | odd << 8: the first half of a chunk's
  INT4 bytes pairs the two bytes' low nibbles, the second half their high nibbles."""
  v = qs.reshape(*qs.shape[:-1], -1, run).view(np.uint16)
  t = v >> 4
  out = np.empty((*v.shape[:-1], run), np.uint8)
  np.bitwise_or(v & 0x0F, t & 0xF0, out=out[..., :run // 2], casting="unsafe")          # even & 15 | odd << 4
  np.bitwise_or(t & 0x0F, (v >> 8) & 0xF0, out=out[..., run // 2:], casting="unsafe")   # even >> 4 | odd & 0xF0
  return out.reshape(qs.shape[0], -1).view("<u4")


def _in_slices(N: int, rows: int, convert: Callable[[int, int], dict[str, np.ndarray]], sources: tuple[np.ndarray, ...],
               done: Callable[[np.ndarray], None] | None) -> dict[str, np.ndarray]:
  """The arrays of an `N`-row weight from convert(i, j), which converts rows i..j-1 of `sources`: a slice of `rows`
  at a time, on a few threads (numpy lets go of the GIL), so the temporaries stay small and in cache. Each slice is
  written into place in fresh pages, which become a CPU tensor's buffer as they are (host_memory.py); then `done`
  gets each source's rows of it (the loader hands their file pages back: a whole table's stayed until its layer was
  on the device)."""
  first = convert(0, rows)
  out = {p: a if p == "qspec" else host_memory.empty((N, *a.shape[1:]), a.dtype) for p, a in first.items()}
  def place(i: int) -> None:
    for p, a in (first if i == 0 else convert(i, min(i + rows, N))).items():
      if p != "qspec": out[p][i:i + len(a)] = a
    if done is not None:
      for src in sources: done(src[i:i + rows])
  with ThreadPoolExecutor(int4.CONVERT_THREADS) as pool: list(pool.map(place, range(0, N, rows)))
  return out


def _with_high_blocks(nibbles: np.ndarray, qh: np.ndarray) -> np.ndarray:
  """The `weight` array of Q5_K and Q6_K: ggml's high bits are already our blocks of them (join_codes), byte for
  byte. Q5_K's 32 bytes per super-block hold element 32j + t's fifth bit in bit j of byte t, Q6_K's 32 bytes per
  half-block of 128 hold element 32i + t's top two bits in bits 2i, 2i + 1: run j's (i's) bits of input t, as ours."""
  return np.concatenate([nibbles, np.ascontiguousarray(qh).reshape(len(nibbles), -1).view("<u4")], axis=1)


def from_ggml(raw: np.ndarray, qtype: str, shape: tuple[int, int],
              done: Callable[[np.ndarray], None] | None = None) -> tuple[dict[str, np.ndarray], QuantSpec]:
  """GGUF blocks of a `[N, K]` weight -> (the packed layout's arrays, its spec), exactly. Raises ValueError on data
  whose size does not match. `done`: called with the rows of `raw` a big table has converted (_in_slices)."""
  N, K = shape
  block, nbytes = GGML_TYPES[qtype]
  if K % block: raise ValueError(f"{qtype} needs rows that are a multiple of {block} (K={K})")
  if raw.size != N * (K // block) * nbytes: raise ValueError(f"{qtype} data of {raw.size} bytes does not match [{N}, {K}]")
  if N > (rows := max(1, ROWS_AT_ONCE // K)):
    raw = raw.reshape(N, -1)
    return _in_slices(N, rows, lambda i, j: from_ggml(raw[i:j], qtype, (j - i, K))[0], (raw,), done), GGML_SPECS[qtype]
  b = np.ascontiguousarray(raw, np.uint8).reshape(N, K // block, nbytes)
  if qtype in ("Q4_K", "Q5_K"):
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    if qtype == "Q4_K": q = _nibble_runs(b[..., 16:144], 32)
    else: q = _with_high_blocks(_nibble_runs(b[..., 48:176], 32), b[..., 16:48])   # bit j of byte t: element 32j + t
    scales, scale_d, biases = np.ascontiguousarray(b[..., 4:16]), np.stack([d, dmin], axis=-1), None   # 6-bit fields as stored
  elif qtype == "Q6_K":
    ql, qh, sc, d = b[..., 0:128], b[..., 128:192], b[..., 192:208], _f16(b[..., 208:210])
    q = _with_high_blocks(_nibble_runs(ql, 64), qh)   # 2 halves of 128: nibbles of 64 bytes; bits 2i, 2i + 1 of a
                                                      # half's byte t: its element 32i + t
    scales, scale_d, biases = sc.view(np.int8).reshape(N, -1), d, None
  elif qtype == "Q3_K":
    hmask, qs, packed, d = b[..., 0:32], b[..., 32:96], b[..., 96:108], _f16(b[..., 108:110])
    low4 = np.concatenate([packed[..., 0:8] & 0xF, packed[..., 0:8] >> 4], axis=-1)               # low 4 bits of 16 scales
    top2 = ((packed[..., 8:12, None] >> (2 * np.arange(4, dtype=np.uint8))) & 3).transpose(0, 1, 3, 2).reshape(N, -1, 16)
    sc = ((low4 | (top2 << 4)).astype(np.int16) - 32).astype(np.int8)
    ql = ((qs.reshape(N, -1, 2, 1, 32) >> (2 * np.arange(4, dtype=np.uint8))[:, None]) & 3).reshape(N, -1, QK)
    hbit = ((hmask[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1).reshape(N, -1, QK)
    q = ql + 4 * hbit + 4                  # ggml's ql - 4 (1 - hbit), shifted into 4..11: symmetric 4-bit (offset 8)
    scales, scale_d, biases = sc.reshape(N, -1), d, None
  elif qtype in ("IQ4_XS", "IQ4_NL"):   # w = d (scale - 32) CODEBOOK[q] (IQ4_XS: a 6-bit scale per 32), d CODEBOOK[q]
    at = 8 if qtype == "IQ4_XS" else 2
    q = _nibble_runs(b[..., at:], 16)   # a run's nibbles as Q5_0's: input t < 16 in byte t's low nibble, t + 16 its high
    d = _f16(b[..., 0:2])
    if qtype == "IQ4_NL": scales, scale_d, biases = d, None, None
    else:
      low = (b[..., 4:8, None] >> np.array([0, 4], np.uint8)) & 0xF   # sub-block 2i's low 4 bits, then 2i + 1's
      high = (np.ascontiguousarray(b[..., 2:4]).view("<u2") >> (2 * np.arange(8, dtype=np.uint16))) & 3
      scales = ((low.reshape(N, -1, 8) | (high.astype(np.uint8) << 4)).astype(np.int16) - 32).astype(np.int8).reshape(N, -1)
      scale_d, biases = d, None
  else:   # Q5_0 (w = d (q - 16)), Q5_1 (w = d q + m)
    d = _f16(b[..., 0:2])
    at = 4 if qtype == "Q5_1" else 2
    qh = np.ascontiguousarray(b[..., at:at + 4]).view(np.uint32)[..., 0]   # bit j: element j's fifth bit
    high = (((qh[..., None] >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)).reshape(N, K)
    q = join_codes(_nibble_runs(b[..., at + 4:at + 20], 16), high, 5)
    scales, scale_d, biases = d, None, (None if qtype == "Q5_0" else _f16(b[..., 2:4]))
  spec = GGML_SPECS[qtype]
  return layout(q if q.dtype == np.uint32 else q.reshape(N, K), spec, scales, scale_d, biases), spec


# **** from MLX ****

def from_mlx(packed: np.ndarray, scales: np.ndarray, biases: np.ndarray, bits: int,
             done: Callable[[np.ndarray], None] | None = None) -> tuple[dict[str, np.ndarray], QuantSpec]:
  """An MLX affine b-bit linear (uint32 words holding the codes as one little-endian bit stream per row; scales and
  biases per group) -> the packed layout (b = 5, 6, 8) or INT4's (b <= 4: the codes fit a nibble, and the arrays are
  INT4's: no spec). Scales and biases become float16, as for MLX's 4-bit checkpoints (int4.float16_params). `done`:
  as for from_ggml."""
  N, K = packed.shape[0], packed.shape[1] * 32 // bits
  G = K // scales.shape[-1]
  spec = QuantSpec(max(bits, 4), G)
  if N > (rows := max(1, ROWS_AT_ONCE // K)):
    return _in_slices(N, rows, lambda i, j: from_mlx(packed[i:j], scales[i:j], biases[i:j], bits)[0], (packed, scales, biases),
                      done), spec
  q = _mlx_codes(np.ascontiguousarray(packed).view(np.uint32), bits)
  s16, b16 = np.asarray(scales).astype(np.float16), np.asarray(biases).astype(np.float16)
  if bits <= 4: return {"weight": int4.pack(q), "scales": s16, "biases": b16}, spec   # INT4's layout
  return layout(q, spec, s16, None, b16), spec


def _mlx_codes(words: np.ndarray, bits: int) -> np.ndarray:
  """uint8 codes `[N, K]` of MLX's b-bit stream (little-endian: code i in bits b*i .. b*i + b - 1 of the row). Every 8
  codes fill b whole bytes, read as one 64-bit integer and cut with 8 shifts."""
  N, K = words.shape[0], words.shape[1] * 32 // bits
  raw = words.view(np.uint8).reshape(N, K // 8, bits)
  if bits == 8: return raw.reshape(N, K)
  v = np.zeros((N, K // 8), np.uint64)
  for i in range(bits): v |= raw[..., i].astype(np.uint64) << np.uint64(8 * i)
  q = np.empty((N, K // 8, 8), np.uint8)
  for j in range(8): q[..., j] = (v >> np.uint64(bits * j)) & np.uint64((1 << bits) - 1)
  return q.reshape(N, K)
