"""Tensor parallelism: one engine, each layer's weights and KV cache split over N tinygrad devices (Megatron-style).

q/k/v and gate/up are column-parallel: each device holds whole attention heads (and the KV heads they read) and a
slice of the FFN columns. o and down are row-parallel: each device multiplies its slice of the inputs, and the
partial sums are added by tinygrad's all-reduce, which its multi-device tensors insert on their own where a reduction
runs over a sharded axis (`Tensor.shard`, tinygrad/schedule/multi.py): one after the attention, one after the MLP.
The KV cache is split by KV head; block tables, positions and slots are replicated, so the scheduler, block manager
and sampler stay single. The embedding table and LM head are split by vocabulary rows (`VOCAB_SPLIT`): the lookup's
partial rows are summed by one all-reduce per pass, and each device computes the logits of its share of the vocabulary.

This module decides the placement: which devices, which tensors split on which axis, and the order of the fused
q/k/v and gate/up rows that makes each device's contiguous shard hold its own heads. The layer code is the same on
one device and on N (model/llama.py); `kernels/sharded.py` has the operations that see the per-device layout.
"""
from __future__ import annotations
import math, sys
import numpy as np
from tinygrad import Device, Tensor
from tinyvllm.config import ConfigError, ModelConfig
from tinyvllm.quant import int4
from tinyvllm.quant.blocks import dequantize_linear
from tinyvllm.quant.formats import FLOAT, FUSED_PROJECTIONS, INT4, LinearWeights, stored_format

# Split the embedding table and LM head by vocabulary rows (True) or keep a whole copy on every device (False).
# Measured on the default model's shapes (docs/architecture.md, "Tensor parallelism"): split, every device reads
# 1/N of the LM head instead of all of it.
VOCAB_SPLIT = True

COLUMN_PARALLEL = ("self_attn.qkv_proj", "mlp.gate_up_proj")   # output rows split: whole heads / FFN columns
ROW_PARALLEL = ("self_attn.o_proj", "mlp.down_proj")            # input columns split: partial sums, then all-reduce


def parallel_devices(device: str, n: int) -> str | tuple[str, ...]:
  """The device a model runs on: `device` itself for n == 1, else n devices of its type, numbered from 0 (CPU:0,
  CPU:1; NV:0..). Refuses more devices than exist."""
  if n == 1: return device
  kind = device.split(":")[0]
  available = device_count(kind)
  if n > available:
    what = "cores this process may use (tinygrad opens any number of CPU devices; more than the cores could only take turns)" \
      if kind == "CPU" else f"{kind} devices"
    raise ConfigError(f"tensor_parallel_size={n} needs {n} {kind} devices, but this machine has {available} {what}")
  return tuple(Device.canonicalize(f"{kind}:{i}") for i in range(n))


def parallel_backend(config) -> str | None:
  """The kernel backend of a tensor-parallel engine ("portable"), or None for one device (resolve_backend decides).
  Only the portable kernels take multi-device tensors: the CPU device's fused C layer is one kernel from norm to
  residual, with no place for the all-reduces, and the Metal shaders are written for one device's buffers."""
  n = config.tensor_parallel_size
  if n == 1: return None
  if config.kernel_backend not in ("auto", "portable"):
    raise ConfigError(f"tensor_parallel_size={n} runs the portable kernels (tinygrad ops on multi-device tensors); "
                      f"kernel_backend={config.kernel_backend!r} runs on one device: use kernel_backend='auto' or 'portable', "
                      f"or tensor_parallel_size=1")
  if config.batch_invariant:
    raise ConfigError(f"tensor_parallel_size={n} is not offered with batch_invariant=True: batch invariance is built and "
                      f"tested for one device (tests/test_batch_invariance.py); use tensor_parallel_size=1 or batch_invariant=False")
  return "portable"


def device_count(kind: str) -> int:
  """How many devices of a type tinygrad can open here. tinygrad opens CPU devices on demand, as many as asked: their
  count here is the cores this process may use. Elsewhere the runtime's own count (CUDA/NV/AMD/CL/HIP), 1 where it
  has none (METAL: one GPU per Mac)."""
  if kind == "CPU":
    from tinyvllm.kernels.threads import default_threads
    return default_threads()
  try: return max(1, int(Device[kind].count()))
  except Exception: return 1


def check_shardable(cfg: ModelConfig, n: int) -> None:
  """Refuse, naming tensor_parallel_size, a model whose heads or FFN do not split evenly over n devices."""
  if n == 1: return
  for name, value in (("num_key_value_heads", cfg.num_key_value_heads), ("num_attention_heads", cfg.num_attention_heads),
                      ("intermediate_size", cfg.intermediate_size)):
    if value % n:
      raise ConfigError(f"tensor_parallel_size={n} must divide the model's {name} ({value}): each device holds whole "
                        f"heads and an equal share of the FFN")


def shard_axis(name: str, cfg: ModelConfig, n: int) -> int | None:
  """The axis tensor `name` (a key of Llama._prepare's output) is split on, or None for a whole copy per device."""
  part = name.rsplit(".", 1)[-1]
  if any(f".{base}." in name for base in COLUMN_PARALLEL): return 0
  if any(f".{base}." in name for base in ROW_PARALLEL): return None if part == "bias" else 1   # bias: added once, after the sum
  if name.startswith(("model.embed_tokens.", "lm_head.")) and VOCAB_SPLIT and cfg.vocab_size % n == 0: return 0
  return None


def shard_layout(cfg: ModelConfig, tensors: dict[str, np.ndarray], n: int, dtype) -> dict[str, np.ndarray]:
  """Llama._prepare's arrays rearranged so that splitting each on `shard_axis` gives every device its own part:
  the fused q/k/v rows ordered device by device ([q_0 k_0 v_0 | q_1 k_1 v_1 | ...], each device's q heads next to
  the KV heads they read), gate/up likewise ([gate_0 up_0 | gate_1 up_1 | ...]), and 4-bit row-parallel weights
  regrouped so that no quantization group straddles two devices."""
  out, told = dict(tensors), set()
  H, KVH, D, inter = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size
  for i in range(cfg.num_hidden_layers):
    prefix = f"model.layers.{i}."
    _fuse_apart(out, prefix, np.float32 if dtype == "float32" else np.float16, told)
    # row runs (start, length) of each fused part, per device
    parts = {"self_attn.qkv_proj": [(0, H * D), (H * D, KVH * D), ((H + KVH) * D, KVH * D)],
             "mlp.gate_up_proj": [(0, inter), (inter, inter)]}
    for base, runs in parts.items():
      order = np.concatenate([np.arange(start + s * (length // n), start + (s + 1) * (length // n))
                              for s in range(n) for start, length in runs])
      for key in [k for k in out if k.startswith(prefix + base + ".")]: out[key] = np.ascontiguousarray(out[key][order])
    for base in ROW_PARALLEL:
      name = prefix + base
      lw = LinearWeights.of(out, name)
      if lw.format != INT4: continue
      for key, arr in _split_groups(lw, name, n, dtype).items():
        if arr is None: out.pop(key)
        else: out[key] = arr
  return out


def _fuse_apart(out: dict[str, np.ndarray], prefix: str, np_dtype, told: set[str]) -> None:
  """In place: q/k/v (gate/up) that a file stores in different formats (a Q4_0 q beside an F16 v) stay apart on one
  device (model/llama.py `_fuse`), but split over devices each device must hold its own heads of all three in one run
  (the order shard_layout gives a fused weight; apart, the attention read other heads' rows). Such a set becomes one
  fused weight in the model's float dtype, said once."""
  for fused, parts in FUSED_PROJECTIONS.items():
    names = [prefix + part for part in parts]
    if f"{names[0]}.weight" not in out: continue
    weights = []
    for name in names:
      fmt = stored_format(out, name)
      weights.append(out[f"{name}.weight"] if fmt == FLOAT else dequantize_linear(out, name, fmt))
      for key in [k for k in out if k.startswith(f"{name}.") and not k.endswith(".bias")]: out.pop(key)
    out[f"{prefix}{fused}.weight"] = np.concatenate([w.astype(np_dtype, copy=False) for w in weights])
    if all(f"{name}.bias" in out for name in names):
      out[f"{prefix}{fused}.bias"] = np.concatenate([out.pop(f"{name}.bias").astype(np_dtype, copy=False) for name in names])
    if fused not in told:
      told.add(fused)
      print(f"tinyvllm: tensor parallelism runs {fused} stored in different formats per part as {np_dtype.__name__}", file=sys.stderr)


def _split_groups(lw: LinearWeights, name: str, n: int, dtype) -> dict[str, np.ndarray | None]:
  """A 4-bit weight `[N, K]` split by input columns over n devices: each device's K/n inputs must be whole packed
  words and whole groups. Groups larger than (or not aligned with) K/n become gcd(group, K/n)-wide groups with the
  same scale and bias repeated (the same weights exactly); where even that is not a whole number of 8-code words,
  the weight is dequantized to floats. Returns the arrays to replace (None: to drop)."""
  K, G = lw.in_features, lw.group_size
  share = K // n
  g = math.gcd(G, share)
  if share % 8 == 0 and g % 8 == 0:
    if g == G: return {}
    return {f"{name}.scales": np.repeat(lw.scales, G // g, axis=1), f"{name}.biases": np.repeat(lw.biases, G // g, axis=1)}
  w = int4.dequantize(lw.weight, lw.scales, lw.biases).astype(np.float32 if dtype == "float32" else np.float16)
  return {f"{name}.weight": w, f"{name}.scales": None, f"{name}.biases": None}


def place(arr: np.ndarray, devices: tuple[str, ...], axis: int | None) -> Tensor:
  """A realized tensor over the devices: split on `axis`, or a whole copy on each."""
  return Tensor(arr, device=devices[0]).shard(devices, axis).realize()


def sharded_empty(shape: tuple[int, ...], dtype, devices: tuple[str, ...], axis: int) -> Tensor:
  """An unrealized-content tensor split on `axis`, one buffer of shape[axis]/N per device (allocate before use)."""
  local = tuple(s // len(devices) if i == axis else s for i, s in enumerate(shape))
  return Tensor(Tensor.empty(*local, dtype=dtype, device=devices).uop.unshard(axis))
