"""How a linear's (or an embedding's) weight is stored, decided once, in one place, and carried as a record.

Checkpoints say it by which tensors sit beside `<name>.weight` (docs/quantization.md):
  float   `.weight` `[N, K]` in a float dtype
  int4    `.weight` packed uint32 `[N, K/8]`, `.scales` and `.biases` float16 `[N, K/G]`: w = scale * q + bias
  int8    `.weight` int8 codes `[N, K]`, `.scales` float16 `[N, K/32]` (GGUF Q8_0 blocks): w = scale * code
  packed  `.weight` codes uint32 `[N, K/8 + high bits]`, `.scales` (and `.scale_d` or `.biases`), described by the `QuantSpec` in
          `.qspec` (GGUF k-quants, Q5_0/Q5_1, MLX 5/6/8-bit; quant/blocks.py)
`stored_format` reads that convention; everything after loading passes a `LinearWeights` record instead of
looking at key names again. The record holds numpy arrays or tinygrad tensors alike.
"""
from __future__ import annotations
from dataclasses import dataclass
from typing import Any, Mapping

FLOAT, INT4, INT8, PACKED = "float", "int4", "int8", "packed"
# a linear's tensors, in the order `LinearWeights.tensors` lists them: its stored weight's, then the additive bias
WEIGHT_PARTS = ("weight", "scales", "scale_d", "biases")
PARTS = WEIGHT_PARTS + ("bias",)


def stored_format(tensors: Mapping[str, Any], name: str) -> str:
  """The format of linear `name` (without `.weight`) in a flat dict of checkpoint tensors."""
  if f"{name}.qspec" in tensors: return PACKED
  if f"{name}.scales" not in tensors: return FLOAT
  return INT4 if f"{name}.biases" in tensors else INT8


@dataclass(frozen=True)
class QuantSpec:
  """How a packed linear is stored (quant/blocks.py): w = S * q + B per group of `group` inputs, q a `bits`-bit code."""
  bits: int                    # 4, 5, 6 or 8: code bits as stored (a nibble plane, plus bits - 4 high bits per code)
  group: int                   # inputs per scale
  super_groups: int = 0        # 0: a float16 scale (and bias) per group; s: two-level, a float16 per s groups times an integer
  signed_scales: bool = False  # two-level scales are int8 (else uint8)
  symmetric: bool = False      # w = S (q - 2^(bits-1)), no biases; else affine
  codebook: bool = False       # symmetric, w = S CODEBOOK[q]: a 4-bit code picks one of 16 int8 values (GGUF IQ4_XS/IQ4_NL)
  k_scales: bool = False       # two-level affine, 8 groups: the 8 scales and 8 mins as 6-bit fields in 12 bytes per super-block,
                               # ggml's own packing (Q4_K, Q5_K), instead of a byte each (quant/blocks.py k_scales_mins)

  def __post_init__(self):
    if self.k_scales and (self.group, self.super_groups, self.symmetric, self.signed_scales) != (32, 8, False, False):
      raise ValueError(f"k_scales packs 8 unsigned 6-bit scales and mins per super-block of 8 affine groups of 32: {self}")

  @property
  def offset(self) -> int: return 1 << (self.bits - 1) if self.symmetric and not self.codebook else 0

  @property
  def scale_inputs(self) -> int:
    """Inputs per entry of the `scales` array's second axis: a group's, or a super-block's with k_scales."""
    return self.group * (self.super_groups if self.k_scales else 1)

  def bytes_per_weight(self) -> float:
    """Of rows whose 32-input runs fill whole blocks of high bits (quant/blocks.packed_nbytes counts a padded one)."""
    if self.k_scales: return self.bits / 8 + (12 + 4) / (self.group * self.super_groups)   # 6-bit fields; d and dmin
    per_group = 1 if self.super_groups else 2   # an integer, or a float16
    scale = per_group / self.group + (2 / (self.group * self.super_groups) if self.super_groups else 0)
    return self.bits / 8 + scale * (1 if self.symmetric else 2)


# a codebook layout's values (ggml's kvalues_iq4nl): not evenly spaced, so no affine 4-bit group holds them
CODEBOOK = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)

# a decoder layer's fused projections and the parts they are made of: one matmul when the parts are stored alike, the
# parts one by one (outputs side by side) when a file stores them in different formats (model/llama.py _fuse)
FUSED_PROJECTIONS = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                     "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}


def projection_parts(linears: Mapping[str, Any], name: str) -> list | None:
  """The records projection `name` is made of: itself when stored fused (or not a fused kind), else its parts; None
  when `linears` has neither."""
  if name in linears: return [linears[name]]
  parts = FUSED_PROJECTIONS.get(name, ())
  return [linears[p] for p in parts] if parts and all(p in linears for p in parts) else None


def spec_of(tensors: Mapping[str, Any], name: str) -> QuantSpec:
  """The QuantSpec of packed linear `name`, from its `.qspec` array (bits, group, super_groups, signed, symmetric,
  codebook, k_scales)."""
  bits, group, super_groups, signed, symmetric, codebook, k_scales = (int(v) for v in list(tensors[f"{name}.qspec"]))
  return QuantSpec(bits, group, super_groups, bool(signed), bool(symmetric), bool(codebook), bool(k_scales))


@dataclass(frozen=True)
class LinearWeights:
  format: str                  # FLOAT | INT4 | INT8 | PACKED
  weight: Any
  scales: Any = None
  scale_d: Any = None          # PACKED, two-level: a float16 (and a dmin) per super-block of groups
  biases: Any = None
  bias: Any = None             # the layer's additive bias (attention_bias / mlp_bias models), any format
  spec: QuantSpec | None = None   # PACKED: the layout (read from `.qspec`; device tensors carry it here)

  @staticmethod
  def of(tensors: Mapping[str, Any], name: str, format: str | None = None, spec: QuantSpec | None = None) -> LinearWeights:
    """The record of linear `name` in a flat dict; `format` (and a packed `spec`) when already known (else read from
    the keys)."""
    fmt = format or stored_format(tensors, name)
    if fmt == PACKED and spec is None: spec = spec_of(tensors, name)
    return LinearWeights(fmt, *(tensors.get(f"{name}.{part}") for part in PARTS), spec=spec)

  @property
  def quantized(self) -> bool: return self.format != FLOAT

  @property
  def in_features(self) -> int:
    if self.format == PACKED: return self.scales.shape[1] * self.spec.scale_inputs
    return self.weight.shape[1] * (8 if self.format == INT4 else 1)

  @property
  def group_size(self) -> int:
    """Inputs per scale (0 for float)."""
    if self.format == PACKED: return self.spec.group
    return self.in_features // self.scales.shape[-1] if self.quantized else 0

  def tensors(self) -> list:
    """The tensors present, in PARTS order."""
    return [t for t in (getattr(self, part) for part in PARTS) if t is not None]

  def parts(self) -> dict[str, Any]:
    """{part name: tensor} of the tensors present."""
    return {part: t for part in PARTS if (t := getattr(self, part)) is not None}
