"""How a linear's (or an embedding's) weight is stored, decided once, in one place, and carried as a record.

Checkpoints say it by which tensors sit beside `<name>.weight` (docs/quantization.md):
  float   `.weight` `[N, K]` in a float dtype
  int4    `.weight` packed uint32 `[N, K/8]`, `.scales` and `.biases` float16 `[N, K/G]`: w = scale * q + bias
  int8    `.weight` int8 codes `[N, K]`, `.scales` float16 `[N, K/32]` (GGUF Q8_0 blocks): w = scale * code
`stored_format` reads that convention; everything after loading passes a `LinearWeights` record instead of
looking at key names again. The record holds numpy arrays or tinygrad tensors alike.
"""
from __future__ import annotations
from dataclasses import dataclass
from typing import Any, Mapping

FLOAT, INT4, INT8 = "float", "int4", "int8"
PARTS = ("weight", "scales", "biases", "bias")   # a linear's tensors, in the order `LinearWeights.tensors` lists them


def stored_format(tensors: Mapping[str, Any], name: str) -> str:
  """The format of linear `name` (without `.weight`) in a flat dict of checkpoint tensors."""
  if f"{name}.scales" not in tensors: return FLOAT
  return INT4 if f"{name}.biases" in tensors else INT8


@dataclass(frozen=True)
class LinearWeights:
  format: str                  # FLOAT | INT4 | INT8
  weight: Any
  scales: Any = None
  biases: Any = None
  bias: Any = None             # the layer's additive bias (attention_bias / mlp_bias models), any format

  @staticmethod
  def of(tensors: Mapping[str, Any], name: str, format: str | None = None) -> LinearWeights:
    """The record of linear `name` in a flat dict; `format` when already known (else read from the keys)."""
    return LinearWeights(format or stored_format(tensors, name), *(tensors.get(f"{name}.{part}") for part in PARTS))

  @property
  def quantized(self) -> bool: return self.format != FLOAT

  @property
  def in_features(self) -> int: return self.weight.shape[1] * (8 if self.format == INT4 else 1)

  @property
  def group_size(self) -> int:
    """Inputs per scale (0 for float)."""
    return self.in_features // self.scales.shape[-1] if self.quantized else 0

  def tensors(self) -> list:
    """The tensors present, in PARTS order."""
    return [t for t in (self.weight, self.scales, self.biases, self.bias) if t is not None]
