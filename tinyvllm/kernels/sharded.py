"""The kernels of a tensor-parallel model (model/tensor_parallel.py): the portable backend on multi-device tensors.

Every operation is written once for the whole tensor; tinygrad runs it on each device's shard and inserts the
all-reduce where a sum runs over a split axis. What differs from the single-device `Kernels`:
- the fused q/k/v output is laid out device by device (q_0 k_0 v_0 | q_1 k_1 v_1 ...), and gate/up likewise, so
  they are split with a reshape over the devices, not with slices across the split axis (which tinygrad's
  multi-device tensors do not take);
- on CPU devices the linears and norms are the C kernels of kernels/cpu.py as on one device, compiled for each
  device's shard (`Tensor.custom_kernel` hands a kernel each device's buffers with the shard's shape and runs it
  once per device). A row-parallel linear (o, down) writes each device's partial sums as one row of an
  `[N devices, T, out]` tensor split over the devices, and summing that axis is tinygrad's all-reduce;
- each device has its own thread pool (kernels/threads.py; a pool serves one caller at a time), with an equal share
  of the threads;
- the KV cache write (`portable.write_kv`, a custom kernel) and attention (tensor ops) run as they are, on each
  device's KV heads.
"""
from __future__ import annotations
import numpy as np
from tinygrad import Context, Tensor, dtypes
from tinyvllm.kernels import Kernels, cpu, portable
from tinyvllm.kernels.kv_cache import PagedKVCache
from tinyvllm.kernels.threads import ThreadPool, default_threads
from tinyvllm.quant.formats import INT4, INT8, LinearWeights


class ShardedKernels(Kernels):
  name = "portable"
  packs_prefill = False   # the tensor-op attention (heads split over devices) reads padded groups

  def __init__(self, devices: tuple[str, ...], num_threads: int | None = None):
    self.device, self.devices = devices, devices
    self.shards = len(devices)
    self.cpu = portable.on_cpu(devices)
    self.threads, self.pool = None, None
    if self.cpu:
      share = max(1, (num_threads or default_threads()) // self.shards)
      self.threads = [ThreadPool(share, d) for d in devices]
      with Context(CAPTURING=0):   # [devices, 2]: row i is device i's pool buffer (kernels/threads.py)
        rows = np.stack([pool.buffer.numpy() for pool in self.threads])
        self.pool = Tensor(rows, dtype=dtypes.uint64, device=devices[0]).shard(devices, 0).realize()

  @property
  def thread_pools(self) -> tuple[ThreadPool, ...]: return tuple(self.threads or ())

  # 4-bit only: 8-bit and packed weights load as floats (their C kernels read whole tables; splitting a packed
  # layout's groups over devices is not written)
  keeps = frozenset({INT4})

  def rms_norm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
    # x and weight are whole on every device: the C kernel runs on each as on one device
    if self.cpu and x.dtype == dtypes.float32 and x.shape[-1] % 8 == 0 and x.uop.axis is None: return cpu.rms_norm(x, weight, eps)
    return portable.rms_norm(x, weight, eps)

  def linear(self, x: Tensor, w: LinearWeights) -> Tensor:
    if w.format == INT8: raise ValueError("8-bit weights load as floats with tensor parallelism")
    y = self._c_linear(x, w) if self.cpu and x.dtype == dtypes.float32 else None
    if y is None:
      y = portable.int4_linear(x, w.weight, w.scales, w.biases, w.group_size) if w.format == INT4 else portable.linear(x, w.weight)
    return y if w.bias is None else y + w.bias

  def _c_linear(self, x: Tensor, w: LinearWeights) -> Tensor | None:
    """kernels/cpu.py's linear on each device's shard: column-parallel (W split by output rows, x whole: the output
    split by columns), row-parallel (W and x split by inputs: partial sums, added by the all-reduce) or whole.
    None for a float weight that is not float32."""
    (M, K), N, n = x.shape, w.weight.shape[0], self.shards
    x_axis, w_axis = x.uop.axis, w.weight.uop.axis
    if w.format != INT4 and w.weight.dtype != dtypes.float32: return None
    if w_axis == 0 and x_axis is None: out_shape, local, out_axis = (M, N), (M, N // n, K), 1
    elif w_axis == 1 and x_axis == 1: out_shape, local, out_axis = (n, M, N), (M, N, K // n), 0
    elif w_axis is None and x_axis is None: out_shape, local, out_axis = (M, N), (M, N, K), None
    else: return None
    m, nl, kl = local
    if w.format == INT4 and kl % 32: return None   # the C kernels take runs of 32 inputs (a row-parallel half of 96: 48)
    if w.format == INT4:
      kernel = cpu.int4_linear_kernel(m, nl, kl, w.group_size)
      args = [w.weight.contiguous(), w.scales.cast(dtypes.float16).contiguous(), w.biases.cast(dtypes.float16).contiguous()]
    else:
      kernel, args = cpu.linear_f32_kernel(m, nl, kl, False), [w.weight]
    y = cpu.run_kernel(kernel, self._empty(out_shape, out_axis), x.contiguous(), *args, self.pool)
    return y.sum(0) if out_axis == 0 else y   # row-parallel: the all-reduce

  def _empty(self, shape: tuple[int, ...], axis: int | None) -> Tensor:
    """A kernel's output over the devices: split on `axis`, or whole on each."""
    local = tuple(s // self.shards if i == axis else s for i, s in enumerate(shape))
    t = Tensor.invalids(*local, dtype=dtypes.float32, device=self.devices)
    return t if axis is None else Tensor(t.uop.unshard(axis))

  def rope_attention(self, *args, **kwargs) -> None: return None   # heads split over devices: the tensor-op path

  def rope_and_cache_write(self, qkv: Tensor, n_heads: int, n_kv_heads: int, positions: Tensor, cos_sin: Tensor,
                           cache: PagedKVCache, slot_mapping: Tensor, qk_norms: tuple | None = None) -> tuple[Tensor, PagedKVCache]:
    T, D, n = qkv.shape[0], cache.head_dim, self.shards
    hq, hk = n_heads // n, n_kv_heads // n
    per_device = qkv.reshape(T, n, hq + 2 * hk, D)   # the device axis is the split one: each row of it is one shard
    q, k, v = self.head_norms(per_device[:, :, :hq].reshape(T, n_heads, D), per_device[:, :, hq:hq + hk].reshape(T, n_kv_heads, D),
                              per_device[:, :, hq + hk:].reshape(T, n_kv_heads, D), qk_norms)
    return portable.rope_and_write_cache(q, k, v, positions, cos_sin, cache, slot_mapping)

  def head_norms(self, q: Tensor, k: Tensor, v: Tensor, qk_norms: tuple | None) -> tuple[Tensor, Tensor, Tensor]:
    """q and k's heads are split over the devices: each head normed where it is (flattening the heads would move
    rows between shards)."""
    if qk_norms is None: return q, k, v
    wq, wk, eps = qk_norms
    return portable.rms_norm(q, wq, eps), portable.rms_norm(k, wk, eps), v

  def glu(self, gate_up: Tensor, inter: int, act: str = "silu") -> Tensor:
    """act(gate) * up of the fused gate/up output, laid out device by device (gate_0 up_0 | gate_1 up_1 ...)."""
    T, n = gate_up.shape[0], self.shards
    per_device = gate_up.reshape(T, n, 2, inter // n)
    return portable.gated(per_device[:, :, 0], per_device[:, :, 1], act).reshape(T, inter)
