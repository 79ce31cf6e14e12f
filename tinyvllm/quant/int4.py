"""4-bit affine group quantization in MLX's layout, with numpy.

A linear with weight W `[N, K]` (y = x @ W^T) becomes three tensors:
  <name>.weight  uint32  [N, K/8]   8 four-bit codes per word; the code of k = 8j + i sits in bits 4i..4i+3 of word j
  <name>.scales  float16 [N, K/G]
  <name>.biases  float16 [N, K/G]   w[n, k] = scales[n, k // G] * q[n, k] + biases[n, k // G],  q in 0..15
G (group_size) is 32, 64 or 128 consecutive k of one row. This is what `mlx.core.quantize(w, G, 4)` produces.

Methods:
  "rtn"   round to nearest on a grid spanning the group's [min, max]. The fp16 scale and bias are rounded
          outwards (bias down, scale up) so the grid still covers the group: every weight is within scale/2 of
          a grid point.
  "clip"  per group, a search over clipped ranges [min + a*r, max - c*r] (r = max - min) followed by a
          least-squares refit of scale and bias to the chosen codes; the candidate with the lowest squared
          reconstruction error (after fp16 rounding) wins. RTN's grid is one of the candidates, so a group's
          error never exceeds RTN's.
"""
from __future__ import annotations
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable
import numpy as np
from tinyvllm.quant import ggml
from tinyvllm.quant.formats import stored_format

GROUP_SIZES = (32, 64, 128)
METHODS = ("rtn", "clip")
BITS = 4
QMAX = 15
# Linear weights of a Llama state dict (HF names); embeddings and lm_head are handled by quantize_embeddings
LINEAR_SUFFIXES = tuple(f"{m}.{p}.weight" for m, ps in (("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")),
                                                         ("mlp", ("gate_proj", "up_proj", "down_proj"))) for p in ps)
EMBEDDING_NAMES = ("model.embed_tokens.weight", "lm_head.weight")
_SHIFTS = np.arange(8, dtype=np.uint32) * 4
# threads converting weights on the host (here and in blocks.py): numpy lets go of the GIL in its loops
CONVERT_THREADS = min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
_CHUNK = 1 << 18   # elements quantized at a time: 2 MB of float64 temporaries, in cache (2x faster than 1 << 21)


# **** packing ****

def pack(q: np.ndarray) -> np.ndarray:
  """Codes `[N, K]` (integers 0..15) -> uint32 `[N, K/8]`, lowest k in the lowest nibble."""
  q = np.asarray(q)
  if q.shape[-1] % 8: raise ValueError(f"the last dimension ({q.shape[-1]}) must be a multiple of 8 to pack 4-bit codes")
  b = np.asarray(q, np.uint8)
  pairs = np.ascontiguousarray(b[..., 0::2] | (b[..., 1::2] << 4))   # byte i: codes 2i (low nibble) and 2i + 1
  return pairs.view("<u4").astype(np.uint32, copy=False)             # 4 bytes a word, little-endian: k = 8j + i at bits 4i


def unpack(packed: np.ndarray) -> np.ndarray:
  """uint32 `[N, K/8]` -> codes uint8 `[N, K]`."""
  packed = np.asarray(packed, dtype=np.uint32)
  return ((packed[..., None] >> _SHIFTS) & 0xF).astype(np.uint8).reshape(*packed.shape[:-1], packed.shape[-1] * 8)


# **** quantize / dequantize ****

def _check(w: np.ndarray, group_size: int) -> None:
  if w.ndim != 2: raise ValueError(f"expected a 2-D weight [N, K], got shape {w.shape}")
  if group_size not in GROUP_SIZES: raise ValueError(f"group_size must be one of {GROUP_SIZES}, got {group_size}")
  if w.shape[1] % group_size: raise ValueError(f"K={w.shape[1]} is not a multiple of group_size {group_size}")


def _round_fp16(v: np.ndarray, direction: int) -> np.ndarray:
  """float64 -> float16, rounded down (direction -1) or up (+1) instead of to nearest."""
  h = v.astype(np.float16)
  wrong = (h.astype(np.float64) > v) if direction < 0 else (h.astype(np.float64) < v)
  return np.where(wrong, np.nextafter(h, np.float16(-np.inf if direction < 0 else np.inf)), h)


def _covering_grid(lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """fp16 (scale, bias) per group with bias <= lo and bias + 15*scale >= hi (exactly, in real arithmetic)."""
  b = _round_fp16(lo, -1)
  s = _round_fp16((hi - b.astype(np.float64)) / QMAX, +1)
  return s, b


def _codes(w: np.ndarray, s: np.ndarray, b: np.ndarray) -> np.ndarray:
  """Nearest codes of w `[R, NG, G]` on the grids (s, b) `[R, NG]` (float16); where a scale is zero, what (w - b) / s
  rounds to, clipped: QMAX for +inf, 0 for -inf and NaN (w == b), the infinity's sign that of d times s's (-0.0)."""
  s64, b64 = s.astype(np.float64)[..., None], b.astype(np.float64)[..., None]
  d = w - b64
  q = np.divide(d, s64, out=np.zeros_like(d), where=s64 != 0)
  if not s.all(): q[np.broadcast_to(s64 == 0, d.shape) & (d != 0) & ((d > 0) != np.signbit(s64))] = QMAX
  np.rint(q, out=q)
  np.clip(q, 0, QMAX, out=q)
  return q.astype(np.uint8)


def _sq_error(w: np.ndarray, q: np.ndarray, s: np.ndarray, b: np.ndarray, imp: np.ndarray | None = None) -> np.ndarray:
  """Per-group squared reconstruction error, each k weighted by imp (None: all 1)."""
  d = s.astype(np.float64)[..., None] * q + b.astype(np.float64)[..., None] - w
  return np.einsum("...i,...i->...", d, d if imp is None else d * imp)


def _rtn(wg: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Round to nearest on the grid covering each group's [lo, hi] (its min and max)."""
  s, b = _covering_grid(lo, hi)
  return _codes(wg, s, b), s, b


_CLIP_GRID = ((0.0, 0.0), (0.0, 0.04), (0.04, 0.0), (0.04, 0.04), (0.0, 0.08), (0.08, 0.0), (0.08, 0.08),
              (0.04, 0.12), (0.12, 0.04), (0.12, 0.12), (0.0, 0.16), (0.16, 0.0), (0.16, 0.16), (0.24, 0.24))


def _clip(wg: np.ndarray, lo: np.ndarray, hi: np.ndarray, imp: np.ndarray | None = None,
          refits: int = 2) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  r = hi - lo
  best_q, best_s, best_b = _rtn(wg, lo, hi)
  best_e = _sq_error(wg, best_q, best_s, best_b, imp)
  u = np.ones_like(wg) if imp is None else np.broadcast_to(imp, wg.shape)

  def consider(q, s, b):
    nonlocal best_e
    e = _sq_error(wg, q, s, b, imp)
    better = e < best_e
    best_e = np.where(better, e, best_e)
    best_q[better], best_s[better], best_b[better] = q[better], s[better], b[better]

  for a, c in _CLIP_GRID[1:]:
    s, b = _covering_grid(lo + a * r, hi - c * r)
    consider(_codes(wg, s, b), s, b)
  # (weighted) least squares: for fixed codes q the best (s, b) solves a 2x2 system; re-round codes, repeat
  n = u.sum(-1)
  for _ in range(refits):
    q = best_q.astype(np.float64)
    uq = u * q
    sq, sw = uq.sum(-1), np.einsum("...i,...i->...", u, wg)
    sqq, sqw = np.einsum("...i,...i->...", uq, q), np.einsum("...i,...i->...", uq, wg)
    det = n * sqq - sq * sq
    ok = det > 0
    s = np.where(ok, (n * sqw - sq * sw) / np.where(ok, det, 1), 0.0)
    b = (sw - s * sq) / n
    s16, b16 = s.astype(np.float16), b.astype(np.float16)
    consider(_codes(wg, s16, b16), s16, b16)
  return best_q, best_s, best_b


def quantize(w: np.ndarray, group_size: int = 64, method: str = "rtn",
             importance: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Quantize W `[N, K]` to (packed uint32 `[N, K/8]`, scales float16 `[N, K/G]`, biases float16 `[N, K/G]`).

  importance: optional `[K]` non-negative weights of the input channels, typically the mean x^2 each channel
  sees on calibration text (`tinyvllm.quant.calibrate`). "clip" then minimises the error of the layer's output
  sum_k x_k (w_k - w'_k) on average over x, instead of the plain weight error; "rtn" ignores it."""
  w = np.asarray(w)
  _check(w, group_size)
  if method not in METHODS: raise ValueError(f"method must be one of {METHODS}, got {method!r}")
  N, K = w.shape
  imp = None
  if importance is not None:
    imp = np.asarray(importance, np.float64)
    if imp.shape != (K,) or not np.all(np.isfinite(imp)) or np.any(imp < 0):
      raise ValueError(f"importance must be {K} finite non-negative values, got shape {imp.shape}")
    imp = (imp / (imp.mean() or 1.0) + 1e-6).reshape(K // group_size, group_size)   # never exactly 0: keeps the LS solvable
  fn = _rtn if method == "rtn" else (lambda wg, lo, hi: _clip(wg, lo, hi, imp))
  packed = np.empty((N, K // 8), np.uint32)
  scales, biases = np.empty((N, K // group_size), np.float16), np.empty((N, K // group_size), np.float16)
  rows = max(1, _CHUNK // K)
  def chunk(r0: int) -> None:   # a few rows at a time: the float64 temporaries stay in cache
    wg = w[r0:r0 + rows].astype(np.float64).reshape(-1, K // group_size, group_size)
    lo, hi = wg.min(-1), wg.max(-1)   # NaN and infinities reach these too
    if not (np.isfinite(lo).all() and np.isfinite(hi).all()): raise ValueError("the weight has non-finite values")
    if max(-lo.min(initial=0), hi.max(initial=0)) > 60000: raise ValueError("the weight has values beyond float16 range (|w| > 60000)")
    q, s, b = fn(wg, lo, hi)
    packed[r0:r0 + rows], scales[r0:r0 + rows], biases[r0:r0 + rows] = pack(q.reshape(-1, K)), s, b
  with ThreadPoolExecutor(CONVERT_THREADS) as pool: list(pool.map(chunk, range(0, N, rows)))   # numpy lets go of the GIL
  return packed, scales, biases


def dequantize(packed: np.ndarray, scales: np.ndarray, biases: np.ndarray, group_size: int | None = None,
               dtype=np.float32) -> np.ndarray:
  """(packed `[N, K/8]`, scales, biases `[N, K/G]`) -> W `[N, K]`. G defaults to K / scales.shape[1]."""
  q = unpack(packed)
  N, K = q.shape
  G = group_size or K // scales.shape[1]
  if scales.shape != (N, K // G) or biases.shape != (N, K // G):
    raise ValueError(f"scales {scales.shape} / biases {biases.shape} do not match packed {packed.shape} with group_size {G}")
  s, b = scales.astype(dtype)[..., None], biases.astype(dtype)[..., None]
  return (s * q.reshape(N, K // G, G).astype(dtype) + b).reshape(N, K)


def int4_matmul_reference(x: np.ndarray, packed: np.ndarray, scales: np.ndarray, biases: np.ndarray, group_size: int) -> np.ndarray:
  """y = x @ W^T in float64, W dequantized from the packed form: the reference every backend is tested against."""
  return np.asarray(x, np.float64) @ dequantize(packed, scales, biases, group_size, dtype=np.float64).T


# **** GGUF Q4_0 / Q4_1 ****

def from_ggml_q4(raw: np.ndarray, qtype: str, shape: tuple[int, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """GGUF Q4_0/Q4_1 blocks of a `[N, K]` weight -> (packed, scales, biases) with group size 32, losslessly.

  The 4-bit codes move as they are (ggml stores element j and j+16 of a block in one byte; they are re-spelled
  in MLX's order). Q4_1's fp16 d and m become the scale and bias; Q4_0's w = d*(q-8) gives scale d and bias -8d,
  exact in fp16 (a multiplication by a power of two)."""
  if qtype not in ("Q4_0", "Q4_1"): raise ValueError(f"from_ggml_q4 takes Q4_0 or Q4_1 blocks, got {qtype}")
  N, K = shape
  if K % ggml.BLOCK: raise ValueError(f"K={K} is not a multiple of the ggml block size {ggml.BLOCK}")
  raw = np.ascontiguousarray(raw, dtype=np.uint8).reshape(N, -1)
  if raw.shape[1] != K // ggml.BLOCK * ggml.BLOCK_BYTES[qtype]:
    raise ValueError(f"{qtype} data of {raw.shape[1]} bytes per row does not match K={K}")
  blocks = raw.reshape(N, K // ggml.BLOCK, ggml.BLOCK_BYTES[qtype])
  d = blocks[..., 0:2].copy().view(np.float16)[..., 0]
  if qtype == "Q4_0":
    codes, bias = ggml.unpack_q4_codes(blocks, 2), (d.astype(np.float32) * -8).astype(np.float16)
  else:
    codes, bias = ggml.unpack_q4_codes(blocks, 4), blocks[..., 2:4].copy().view(np.float16)[..., 0]
  return pack(codes.reshape(N, K)), d.copy(), bias


# **** state dicts ****

def is_linear_weight(name: str) -> bool:
  return name.endswith(LINEAR_SUFFIXES)


def quantize_state_dict(tensors: dict[str, np.ndarray], group_size: int = 64, method: str = "rtn",
                        quantize_embeddings: bool = False, *,
                        ggml_q4: dict[str, tuple[np.ndarray, str, tuple[int, int]]] | None = None,
                        importance: dict[str, np.ndarray] | None = None,
                        progress: Callable[[Iterable], Iterable] | None = None) -> dict[str, np.ndarray]:
  """Quantize the Linear weights of a Llama state dict (HF names) to the 4-bit layout above.

  Every q/k/v/o/gate/up/down `.weight` becomes `.weight` (uint32), `.scales` and `.biases` (float16). A weight
  whose K is not a multiple of group_size stays as it is (as mlx-lm does), so a checkpoint may mix quantized
  and float linears: the presence of `<name>.scales` marks a quantized one.
  quantize_embeddings: also quantize `model.embed_tokens.weight` and `lm_head.weight` to 4 bits in the same
  layout (mlx-lm does the same). With tied embeddings the quantized embedding is the LM head too.
  ggml_q4: name -> (raw blocks, "Q4_0"|"Q4_1", shape) for weights that arrive as GGUF Q4 blocks; with
  group_size 32 they are repacked losslessly instead of requantized from `tensors[name]`.
  importance: weight name -> `[K]` input-channel importance for "clip" (see `quantize`); with tied embeddings
  give the LM head's under `model.embed_tokens.weight`.
  Everything else (norms, biases, unquantized embeddings) is passed through unchanged.
  """
  if group_size not in GROUP_SIZES: raise ValueError(f"group_size must be one of {GROUP_SIZES}, got {group_size}")
  if method not in METHODS: raise ValueError(f"method must be one of {METHODS}, got {method!r}")
  already = [n for n in tensors if n.endswith(".scales")]
  if already: raise ValueError(f"the state dict is already quantized ({already[0]})")
  ggml_q4 = ggml_q4 or {}
  names = [n for n in tensors if tensors[n].ndim == 2 and (is_linear_weight(n) or (quantize_embeddings and n in EMBEDDING_NAMES))]
  todo = set(names)
  out = {n: t for n, t in tensors.items() if n not in todo}
  for name in (progress(names) if progress else names):
    w, base = tensors[name], name[:-len(".weight")]
    if w.shape[1] % group_size:
      out[name] = w
      continue
    if group_size == ggml.BLOCK and name in ggml_q4: p, s, b = from_ggml_q4(*ggml_q4[name])
    else: p, s, b = quantize(w, group_size, method, (importance or {}).get(name))
    out[f"{base}.weight"], out[f"{base}.scales"], out[f"{base}.biases"] = p, s, b
  return out


def quantized_bytes(tensors: dict[str, np.ndarray]) -> int:
  """Bytes the tensors of a (possibly quantized) state dict take."""
  return sum(t.nbytes for t in tensors.values())


def float16_params(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """The contract's dtypes for a loaded quantized state dict: mlx-lm writes `.scales`/`.biases` in the source
  model's dtype (float32, or bf16 which our safetensors reader returns as float32); cast them to float16."""
  return {k: v.astype(np.float16) if k.endswith((".scales", ".biases")) and v.dtype != np.float16 else v for k, v in tensors.items()}


def dequantize_state_dict(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """Every quantized weight back to one float32 `<name>.weight`: 4-bit `.weight/.scales/.biases` triples, 8-bit
  `.weight` (int8 codes) / `.scales` pairs (GGUF Q8_0 blocks of 32, w = scale * code) and packed layouts
  (quant/blocks.py)."""
  from tinyvllm.quant.blocks import dequantize_linear   # blocks builds on this module
  out = {k: v for k, v in tensors.items() if not k.endswith((".scales", ".biases", ".scale_d", ".qspec"))}
  for k in tensors:
    if k.endswith(".scales"):
      base = k[:-len(".scales")]
      out[f"{base}.weight"] = dequantize_linear(tensors, base, stored_format(tensors, base))
  return out


def dequantize_8bit(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
  """8-bit weight (int8 codes `[N, K]`, one scale per block of K / scales.shape[1]) -> float32 `[N, K]`, w = scale * code."""
  return (codes.reshape(*scales.shape, -1).astype(np.float32) * scales.astype(np.float32)[..., None]).reshape(codes.shape)
