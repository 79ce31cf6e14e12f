"""Rotary position embedding tables (HF Llama rotate-half convention), computed once in float64 with numpy.

Scaling variants only change the per-frequency rates, so every kernel consumes the same `cos_sin` table:
row p holds cos(p * inv_freq) for the head_dim/2 frequencies, then sin(p * inv_freq).
"""
from __future__ import annotations
import math
import numpy as np
from tinyvllm.config import ModelConfig


def inverse_frequencies(config: ModelConfig, freq_factors: np.ndarray | None = None) -> np.ndarray:
  """Rotation rate of each of the head_dim/2 frequency pairs, with the config's rope scaling applied."""
  dim = config.head_dim
  inv_freq = 1.0 / config.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
  scaling = config.rope_scaling or {}
  kind = scaling.get("rope_type")
  if kind == "linear":
    inv_freq = inv_freq / float(scaling["factor"])
  elif kind == "llama3":
    inv_freq = _llama3(inv_freq, float(scaling["factor"]), float(scaling.get("low_freq_factor", 1.0)),
                       float(scaling.get("high_freq_factor", 4.0)), float(scaling.get("original_max_position_embeddings", 8192)))
  if freq_factors is not None:  # GGUF llama3 checkpoints ship the per-frequency divisors as a tensor instead
    inv_freq = inv_freq / np.asarray(freq_factors, dtype=np.float64)
  return inv_freq


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


def cos_sin_table(inv_freq: np.ndarray, max_positions: int) -> np.ndarray:
  """float32 `[max_positions, head_dim]`: cos of every frequency, then sin."""
  angles = np.arange(max_positions, dtype=np.float64)[:, None] * inv_freq[None, :]
  return np.concatenate([np.cos(angles), np.sin(angles)], axis=1).astype(np.float32)


def apply_rope_reference(x: np.ndarray, positions: np.ndarray, table: np.ndarray) -> np.ndarray:
  """numpy reference: x `[T, heads, head_dim]`, positions `[T]`."""
  half = x.shape[-1] // 2
  cos, sin = table[positions, None, :half], table[positions, None, half:]
  x1, x2 = x[..., :half], x[..., half:]
  return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
