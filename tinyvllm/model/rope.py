"""Rotary position embedding tables (HF Llama rotate-half convention), computed once in float64 with numpy.

Scaling variants only change the per-frequency rates, so every kernel consumes the same `cos_sin` table:
row p holds cos(p * inv_freq) for the head_dim/2 frequencies, then sin(p * inv_freq).
"""
from __future__ import annotations
import math
import numpy as np
from tinyvllm.config import ModelConfig


def inverse_frequencies(config: ModelConfig, freq_factors: np.ndarray | None = None, max_positions: int = 0) -> np.ndarray:
  """Rotation rate of each of the head_dim/2 frequency pairs, with the config's rope scaling applied. LongRoPE
  (Phi-3) divides by its long factors when the engine's context (`max_positions`) reaches past the original one,
  else by its short factors: HF switches per forward pass by the sequence's length; one table for the engine's whole
  context is what vLLM does too."""
  dim = config.rotary_dim   # a partial rotary embedding (Phi-4-mini): the frequencies of its rotated dimensions
  inv_freq = 1.0 / config.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
  scaling = config.rope_scaling or {}
  kind = scaling.get("rope_type")
  if kind == "longrope":
    long = max_positions > scaling["original_max_position_embeddings"]
    inv_freq = inv_freq / np.asarray(scaling["long_factor" if long else "short_factor"], dtype=np.float64)
  elif kind == "linear":
    inv_freq = inv_freq / float(scaling["factor"])
  elif kind == "llama3":
    inv_freq = _llama3(inv_freq, float(scaling["factor"]), float(scaling.get("low_freq_factor", 1.0)),
                       float(scaling.get("high_freq_factor", 4.0)), float(scaling.get("original_max_position_embeddings", 8192)))
  if freq_factors is not None:  # GGUF llama3 checkpoints ship the per-frequency divisors as a tensor instead
    inv_freq = inv_freq / np.asarray(freq_factors, dtype=np.float64)
  # the dimensions that pass through rotate at rate 0 (cos 1, sin 0): see head_dim_order
  return np.concatenate([inv_freq, np.zeros(config.head_dim // 2 - len(inv_freq))])


def head_dim_order(config: ModelConfig) -> np.ndarray | None:
  """With a partial rotary embedding, where each head dimension of q and k goes so that every kernel's whole-head
  rotate-half does the partial rotation: HF pairs dimension i with i + R/2 for i < R/2 and passes R.. through;
  rotate-half pairs j with j + D/2. Rotated pairs keep their first R/2 slots, the passed-through dimensions fill the
  rest, where the table's rate is 0. q and k permuted alike leave every score q.k as it was (V is not touched), so
  the model's output is unchanged. None when every dimension rotates."""
  D, R = config.head_dim, config.rotary_dim
  if R == D: return None
  h, r = D // 2, R // 2
  order = np.empty(D, np.int64)
  order[:r], order[h:h + r] = np.arange(r), np.arange(r, R)
  order[r:h], order[h + r:] = np.arange(R, R + h - r), np.arange(R + h - r, D)
  return order


def _llama3(inv_freq: np.ndarray, factor: float, low_freq_factor: float, high_freq_factor: float,
            original_context: float) -> np.ndarray:
  """Llama 3.1 scaling: long wavelengths are slowed by `factor`, short ones kept, and the band between
  the two cut-offs blends linearly in 1/wavelength."""
  wavelength = 2 * math.pi / inv_freq
  long_cutoff = original_context / low_freq_factor     # wavelengths above this are fully scaled
  short_cutoff = original_context / high_freq_factor   # wavelengths below this are untouched
  blend = (original_context / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)
  blended = (1 - blend) * inv_freq / factor + blend * inv_freq
  return np.where(wavelength > long_cutoff, inv_freq / factor, np.where(wavelength < short_cutoff, inv_freq, blended))


def cos_sin_table(inv_freq: np.ndarray, max_positions: int, magnitude: float | np.ndarray = 1.0) -> np.ndarray:
  """float32 `[max_positions, head_dim]`: cos of every frequency, then sin, times `magnitude` (attention_factor:
  a number, or one per frequency)."""
  angles = np.arange(max_positions, dtype=np.float64)[:, None] * inv_freq[None, :]
  m = np.broadcast_to(np.asarray(magnitude, np.float64), inv_freq.shape)
  return (np.concatenate([np.cos(angles) * m, np.sin(angles) * m], axis=1)).astype(np.float32)


def attention_factor(config: ModelConfig) -> float | np.ndarray:
  """What LongRoPE multiplies cos and sin by (so q.k by its square): the config's attention_factor, else
  sqrt(1 + ln(s) / ln(original context)) with s = max_position_embeddings / original (or its `factor`); 1 otherwise."""
  scaling = config.rope_scaling or {}
  if scaling.get("rope_type") != "longrope": return 1.0
  if scaling.get("attention_factor") is not None: factor = float(scaling["attention_factor"])
  else:
    original = scaling["original_max_position_embeddings"]
    s = scaling.get("factor") or config.max_position_embeddings / original
    factor = 1.0 if s <= 1.0 else math.sqrt(1 + math.log(s) / math.log(original))
  if config.rotary_dim == config.head_dim: return factor
  # only the rotated dimensions are scaled: the ones passing through keep magnitude 1
  return np.where(np.arange(config.head_dim // 2) < config.rotary_dim // 2, factor, 1.0)


def apply_rope_reference(x: np.ndarray, positions: np.ndarray, table: np.ndarray) -> np.ndarray:
  """numpy reference: x `[T, heads, head_dim]`, positions `[T]`."""
  half = x.shape[-1] // 2
  cos, sin = table[positions, None, :half], table[positions, None, half:]
  x1, x2 = x[..., :half], x[..., half:]
  return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
