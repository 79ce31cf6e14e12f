"""The kernel layer: the operations the model needs, as one backend object (`make_kernels`).

Backends: "portable" (tinygrad tensor ops, any device: the `Kernels` base class), "cpu" (a whole layer in
hand-written C on tinygrad's CPU device), "metal" (our .metal shaders on DEV=METAL) and "emulator" (the same
shaders run on the CPU by our MSL emulator; slow, for tests and debugging). On the CPU device the norms and
linears always use the C kernels.
"""
from __future__ import annotations
import platform, re, sys
from dataclasses import dataclass
from tinygrad import Device, Tensor, dtypes
from tinyvllm.kernels import cpu, cpu_layer, gemm, gemv, metal, paged, portable
from tinyvllm.kernels.kv_cache import KVCacheFormat, PagedKVCache
from tinyvllm.quant.formats import FLOAT, INT4, INT8, PACKED, LinearWeights
from tinyvllm.kernels.threads import ThreadPool, default_threads

BACKENDS = ("portable", "cpu", "metal", "emulator")


@dataclass
class AttentionGroup:
  """Sequences that share one query length in a step: P sequences with C query slots each (C=1 for decode).

  Their P*C tokens sit contiguously in the flat batch, sequence by sequence, padding slots included. A *packed*
  group instead holds the P sequences' tokens back to back, padding only at the end: C is then the group's token
  count (q_pos is `[1, C]`), and each token finds its sequence through token_seq. Only kernels that read a token's
  sequence from token_seq take packed groups (`Kernels.packs_prefill`)."""
  num_seqs: int              # P
  query_len: int             # C
  block_tables: Tensor       # int32 [P, max_blocks]: the full table width
  used_blocks: object        # int or symbolic count (engine/replay.py CountVariable): table columns any sequence of the step uses
  q_pos: Tensor              # int32 [P, C]: absolute position of each query slot (padding: 0)
  context_lens: Tensor       # int32 [P]: keys visible to the sequence's last real query
  token_seq: Tensor | None = None   # int32 [P*C]: each slot's row p, -1 on padding slots (the Metal prefill kernel's input)
  packed: bool = False
  kernel_blocks: object = None      # used_blocks as kernels written in UOps read it (its Variable as a kernel parameter:
                                    # CountVariable.kernel_count); None when used_blocks is an int

  @property
  def num_tokens(self) -> int: return self.query_len if self.packed else self.num_seqs * self.query_len


def apple_gpu(device: str) -> tuple[str, str]:
  """(GPU family as tinygrad names it, e.g. "Apple7" or "Mac2"; macOS version, e.g. "14.5") of a METAL device.
  An emulated device (tinyvllm.kernels.emulator.metal_device) says which macOS it stands in for."""
  dev = Device[device]
  return dev.arch, getattr(dev, "macos_version", None) or platform.mac_ver()[0]


def msl2_only(macos: str | None) -> bool:
  """macOS 12 and older: tinygrad compiles Metal shaders as MSL 2.0 there, which has no simdgroup_matrix."""
  major = (macos or "").split(".")[0]
  return major.isdigit() and int(major) < 13


def metal_kernels_problem(arch: str, macos: str) -> str | None:
  """Why tinyvllm's Metal kernels cannot run on this GPU and macOS, or None when they can."""
  m = re.fullmatch(r"Apple(\d+)", arch or "")
  if m is None or int(m.group(1)) < 7:
    return f"the GPU family is {arch or 'unknown'}, and tinyvllm's Metal kernels need Apple7 or later (M1 and newer: " \
           f"32-wide SIMD groups, simdgroup_matrix)"
  if msl2_only(macos):
    return f"macOS {macos}: tinygrad compiles Metal shaders as MSL 2.0 there, which has no simdgroup_matrix; " \
           f"tinyvllm's Metal kernels need macOS 13 or later"
  return None


def prepare_device(device: str) -> None:
  """Settings a device needs before anything compiles. On macOS 12 and older tinygrad compiles MSL 2.0, which has no
  simdgroup_matrix: its tensor cores would not compile there, so they are turned off."""
  if device.split(":")[0] != "METAL": return
  macos = apple_gpu(device)[1]
  if msl2_only(macos):
    from tinygrad.helpers import USE_TC
    if USE_TC.value:
      print(f"tinyvllm: tinygrad's tensor cores turned off: macOS {macos} compiles MSL 2.0, without simdgroup_matrix", file=sys.stderr)
      USE_TC.value = 0


def resolve_backend(name: str, device: str) -> str:
  if name in ("auto", "metal") and device.split(":")[0] == "METAL" and (why := metal_kernels_problem(*apple_gpu(device))):
    if name == "metal": raise ValueError(f"kernel_backend='metal': {why}; use kernel_backend='portable'")
    print(f"tinyvllm: using the portable kernels: {why}", file=sys.stderr)
    return "portable"
  if name == "auto": return {"METAL": "metal", "CPU": "cpu"}.get(device.split(":")[0], "portable")
  if name == "cpu" and device.split(":")[0] != "CPU":
    raise ValueError(f"kernel_backend='cpu' needs tinygrad's CPU device (DEV=CPU), but the device is {device}")
  if name == "metal" and device.split(":")[0] != "METAL":
    raise ValueError(f"kernel_backend='metal' needs the METAL device, but tinygrad's device is {device}; "
                     f"use 'portable', or 'emulator' to run the Metal kernels on the CPU")
  if name == "emulator" and device.split(":")[0] != "CPU":
    raise ValueError(f"kernel_backend='emulator' runs on the CPU device (DEV=CPU), but tinygrad's device is {device}")
  if name not in BACKENDS: raise ValueError(f"unknown kernel_backend {name!r}; choose auto, {', '.join(BACKENDS)}")
  return name


class Kernels:
  """The operations of one Llama layer (norm, linear, RoPE + cache write, attention; optionally the whole layer).

  This base class is the `portable` backend: tinygrad tensor ops on any device. The other backends are subclasses
  that replace what they do better (`make_kernels` picks one). On the CPU device every backend's norms and linears
  are our C kernels (kernels/cpu.py), split over a thread pool: tinygrad's generated CPU matmuls are several times
  slower on decode shapes, and it runs each kernel on one thread."""
  name = "portable"
  packs_prefill = True    # can prefill chunks go back to back (packed AttentionGroups) rather than padded to the longest?
  shards = 1              # devices a layer is split over (tensor parallelism: kernels/sharded.py)
  keeps = frozenset({INT4, INT8, PACKED})   # quantized formats these kernels run as stored (others load as floats)
  gemv_formats = frozenset({FLOAT, INT4, INT8, PACKED})   # formats whose decode projections on a GPU run as kernels/gemv.py's

  def __init__(self, device: str = "CPU", num_threads: int | None = None):
    self.device = device
    self.cpu = portable.on_cpu(device)
    self.threads = ThreadPool(num_threads or default_threads(), device) if self.cpu else None
    self.pool = self.threads.buffer if self.threads else None

  @property
  def backend(self) -> str: return self.name

  @property
  def thread_pools(self) -> tuple[ThreadPool, ...]:
    """Every thread pool these kernels run on (one per device; none off the CPU device)."""
    return (self.threads,) if self.threads else ()

  def check_model(self, head_dim: int, n_heads: int, n_kv_heads: int, block_size: int, dtype: str) -> None:
    """Refuse, with the reason, a model this backend's kernels cannot run."""

  def packs(self, layers, kv_format: KVCacheFormat) -> bool:
    """Can prefill chunks of a model with these layers, over a cache of this format, go back to back (`packs_prefill`,
    and every layer's attention takes them)? Padding every chunk to the longest costs its compute and a shape to
    capture for each pair of a chunk count and a length (tens), where packed passes vary with their token count alone.
    Here the attention kernels of kernels/paged.py find each token's sequence; the tensor-op path they fall back to
    (`paged.applies`: soft-capped scores, int4 caches) pads."""
    int4_cache = "int4" in (kv_format.k_storage, kv_format.v_storage)
    return self.packs_prefill and all(paged.applies(int4_cache, layer.cfg.attn_logit_softcapping) for layer in layers)

  def fuses(self, layer) -> bool:
    """Does `decoder_layer` run this layer (model/llama.py LlamaLayer: its window, weights and linears) whole?"""
    return False

  def check_kv_cache(self, fmt: KVCacheFormat) -> None:
    """Refuse, with the reason, a KV cache format this backend's kernels cannot read."""

  def decoder_layer(self, h: Tensor, linears: dict[str, LinearWeights], norms: tuple[Tensor, ...], cfg, group: AttentionGroup,
                    positions: Tensor, slot_mapping: Tensor, cos_sin: Tensor, cache: PagedKVCache, out: Tensor | None,
                    window: int | None = None) -> Tensor | None:
    """A whole decoder layer as one kernel, written into `out` if given, where the backend has one; None means:
    compose it from the operations below. `norms`: the RMSNorm weights of the layer's input and of the MLP's input,
    then the q and k head norms' (cfg.qk_norm), then the attention and MLP output norms' (cfg.sandwich_norms)."""
    return None

  def rms_norm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """On the CPU device (float32) our C kernel, one row at a time: tinygrad's generated reduction orders the sum
    by shape, so a row's norm would depend on how many rows a step has (batch invariance)."""
    if self.cpu and x.dtype == dtypes.float32 and x.shape[-1] % 8 == 0: return cpu.rms_norm(x, weight, eps)
    return portable.rms_norm(x, weight, eps)

  def norm_linear(self, x: Tensor, norm_weight: Tensor, eps: float, w: LinearWeights) -> Tensor:
    """RMSNorm(x) * norm_weight @ W^T (+ bias): where a backend's matmul can norm x itself, one kernel instead of three
    (the norm's reduction, its application, the matmul)."""
    if self.takes_gemv(x, w): return gemv.gemv(x, w, norm=(norm_weight, eps))
    if self.takes_tensor_cores(x, w): return gemm.matmul(x, w, norm=(norm_weight, eps))
    return self.linear(self.rms_norm(x, norm_weight, eps), w)

  def norm_logits(self, x: Tensor, norm_weight: Tensor, eps: float, w: LinearWeights) -> Tensor:
    """`norm_linear` as float32: the LM head's logits. A GPU decode step's GEMV stores them as float32 itself (summed in
    float32 and rounded once), where a cast after it was a launch of its own."""
    if self.takes_gemv(x, w): return gemv.gemv(x, w, norm=(norm_weight, eps), dtype=dtypes.float32)
    if self.takes_tensor_cores(x, w): return gemm.matmul(x, w, dtype=dtypes.float32, norm=(norm_weight, eps))
    return self.norm_linear(x, norm_weight, eps, w).float()

  def norm_glu(self, x: Tensor, norm_weight: Tensor, eps: float, w: LinearWeights, inter: int, act: str = "silu") -> Tensor:
    """act(gate) * up of the fused gate/up projection (`[2 inter, in]`) of RMSNorm(x) * norm_weight: one kernel for a
    GPU's decode step, where the norm, the projection and the gating were three."""
    if self.takes_gemv(x, w): return gemv.gemv(x, w, norm=(norm_weight, eps), act=act)
    if self.takes_tensor_cores(x, w) and w.weight.shape[0] == 2 * inter: return gemm.matmul(x, w, norm=(norm_weight, eps), act=act)
    return self.glu(self.norm_linear(x, norm_weight, eps, w), inter, act)

  def norm_glu_apart(self, x: Tensor, norm_weight: Tensor, eps: float, gate: LinearWeights, up: LinearWeights,
                     act: str = "silu") -> Tensor | None:
    """`norm_glu` of a gate and an up projection stored apart (in different formats): on a GPU's decode step two GEMVs,
    the second gating its product by the first's output. None elsewhere: the caller joins the parts."""
    if not self.takes_gemv(x, gate, up): return None
    norm = gemv.shared_norm(x, (norm_weight, eps), gate, up)   # x's 1/RMS once for both
    return gemv.gemv(x, up, norm=norm, act=act, gate=gemv.gemv(x, gate, norm=norm))

  def residual_linear(self, x: Tensor, w: LinearWeights, residual: Tensor, out: Tensor | None = None) -> Tensor:
    """residual + x @ W^T (+ bias), written into `out` when given (a realized buffer): where a backend's matmul can
    add the residual stream as it writes its output, one kernel instead of two."""
    if self.takes_gemv(x, w): return gemv.gemv(x, w, residual=residual, out=out)
    y = residual + self.linear(x, w)
    if out is None and self.takes_tensor_cores(x, w):   # the stream as one buffer: the next norm's kernels copied it else
      return y.contiguous()
    return y if out is None else out.assign(y)

  def linear(self, x: Tensor, w: LinearWeights) -> Tensor:
    """x `[T, in]` @ W^T (+ bias), W in any stored format (quant/formats.py)."""
    if self.takes_gemv(x, w): return gemv.gemv(x, w)
    if self.takes_tensor_cores(x, w): return gemm.matmul(x, w)
    if w.format == INT8: y = self.q8_linear(x, w)
    elif w.format == INT4: y = self.int4_linear(x, w)
    elif w.format == PACKED: y = self.packed_linear(x, w)
    elif self.cpu and x.dtype == w.weight.dtype == dtypes.float32: return cpu.linear_f32(x, w.weight, w.bias, self.pool)
    else: return portable.linear(x, w.weight, w.bias)
    return y if w.bias is None else y + w.bias

  def takes_gemv(self, x: Tensor, *weights: LinearWeights) -> bool:
    """Does a projection of these few rows by each of `weights` on a GPU run as our GEMV kernel (kernels/gemv.py)?
    tinygrad's matmul misses its matrix-vector schedule for float16 weights, dequantized codes and normed inputs.
    Not where the tensor cores take them (`takes_tensor_cores`: from 16 rows, a whole tile, where the GEMV's 16 and 32
    rows of a narrow weight ran every multiply on the CUDA cores)."""
    return not self.cpu and self.shards == 1 and all(w.format in self.gemv_formats and gemv.applies(x, w) and not gemm.applies(x, w)
                                                     for w in weights)

  def takes_tensor_cores(self, x: Tensor, *weights: LinearWeights) -> bool:
    """Does a projection of these rows (a decode batch beyond the GEMV's) by each of `weights` run as our tensor-core
    kernel (kernels/gemm.py): float weights of x's dtype, on a GPU with tensor cores for it?"""
    return not self.cpu and self.shards == 1 and all(gemm.applies(x, w) for w in weights)

  def q8_linear(self, x: Tensor, w: LinearWeights) -> Tensor:
    if self.cpu and x.dtype == dtypes.float32: return cpu.q8_linear(x, w.weight, w.scales, self.pool)
    return portable.q8_linear(x, w.weight, w.scales)

  def packed_linear(self, x: Tensor, w: LinearWeights) -> Tensor:
    """A packed linear (GGUF k-quants, Q5_0/Q5_1, MLX 5/6/8-bit: quant/blocks.py), compact on every backend: our C
    kernel on the CPU device, elsewhere tinygrad unpacks the codes inside the matmul."""
    if self.cpu and x.dtype == dtypes.float32: return cpu.packed_linear(x, w, self.pool)
    return portable.packed_linear(x, w)

  def int4_linear(self, x: Tensor, w: LinearWeights) -> Tensor:
    if self.cpu and x.dtype == dtypes.float32:
      return cpu.int4_linear(x, w.weight, w.scales, w.biases, w.group_size, self.pool)
    return portable.int4_linear(x, w.weight, w.scales, w.biases, w.group_size)

  def rope_and_cache_write(self, qkv: Tensor, n_heads: int, n_kv_heads: int, positions: Tensor, cos_sin: Tensor,
                           cache: PagedKVCache, slot_mapping: Tensor, qk_norms: tuple | None = None) -> tuple[Tensor, PagedKVCache]:
    """qkv `[T, (H + 2 KVH) D]`: rotate q and k, write k and v into their cache slots (quantized for an int8 cache).
    `qk_norms` (q weight, k weight, eps): RMSNorm each head of q and k before RoPE (Qwen3).

    Returns (rotated q `[T, H, D]`, the cache ordered after the write)."""
    q, k, v = self.head_norms(*portable.split_qkv(qkv, n_heads, n_kv_heads, cache.head_dim), qk_norms)
    return portable.rope_and_write_cache(q, k, v, positions, cos_sin, cache, slot_mapping)

  def rope_attention(self, qkv: Tensor, n_heads: int, n_kv_heads: int, positions: Tensor, cos_sin: Tensor, cache: PagedKVCache,
                     slot_mapping: Tensor, group: AttentionGroup, scale: float, window: int | None = None, softcap: float | None = None,
                     qk_norms: tuple | None = None) -> tuple[Tensor, PagedKVCache] | None:
    """RoPE, the cache write and the attention of a step's only group in a few kernels that read the paged cache in
    place (kernels/paged.py), where they apply: returns (attention output `[T, H * D]`, the cache after the write).
    None: compose them from `rope_and_cache_write` and `attention`, as backends with kernels of their own for those do."""
    if not paged.applies(cache.k_int4 or cache.v_int4, softcap): return None
    if qk_norms is not None:   # q and k normed head by head first (Qwen3): the kernels read the row rebuilt from them
      T = qkv.shape[0]
      qkv = Tensor.cat(*(x.reshape(T, -1) for x in self.head_norms(*portable.split_qkv(qkv, n_heads, n_kv_heads, cache.head_dim), qk_norms)), dim=1)
    return paged.rope_attention(qkv, n_heads, n_kv_heads, positions, cos_sin, cache, slot_mapping, group, scale, window)

  def norm_qkv_rope_attention(self, x: Tensor, norm_weight: Tensor, eps: float, parts: list[LinearWeights], n_heads: int,
                              n_kv_heads: int, positions: Tensor, cos_sin: Tensor, cache: PagedKVCache, slot_mapping: Tensor,
                              group: AttentionGroup, scale: float, window: int | None = None,
                              softcap: float | None = None) -> tuple[Tensor, PagedKVCache] | None:
    """`rope_attention` of the qkv projection of RMSNorm(x) * norm_weight (`parts`: the fused qkv, or q, k and v stored
    apart), where a GPU's decode step can write q and the cache from its GEMV (kernels/gemv.py `qkv_rope_write`: no
    write kernel; parts apart, a GEMV each and no kernel joining them), or from the tensor cores' partial sums (a
    fused qkv: the write adds them, where a kernel of its own did), and attend in the kernels of kernels/paged.py: a
    float cache, no head norms (the caller's). None: project, then `rope_attention`."""
    if not (paged.applies(cache.k_int4 or cache.v_int4, softcap) and not cache.quantized): return None
    if self.takes_gemv(x, *parts):
      q, cache = gemv.qkv_rope_write(x, parts, (norm_weight, eps), n_heads, n_kv_heads, positions, cos_sin, cache, slot_mapping)
    elif len(parts) == 1 and self.takes_tensor_cores(x, *parts):   # the write adds the tensor cores' partial sums itself
      partial = gemm.partial_products(x, parts[0], norm=(norm_weight, eps))
      q, cache = paged.write(partial, n_heads, n_kv_heads, positions, cos_sin, cache, slot_mapping, parts[0].bias, x.dtype)
    else: return None
    return paged.attention(q, cache, group, scale, window, x.dtype), cache

  def head_norms(self, q: Tensor, k: Tensor, v: Tensor, qk_norms: tuple | None) -> tuple[Tensor, Tensor, Tensor]:
    """q `[T, H, D]`, k and v `[T, KVH, D]`, q and k RMS-normed head by head when `qk_norms` (q weight, k weight, eps)."""
    if qk_norms is None: return q, k, v
    wq, wk, eps = qk_norms
    norm = lambda x, w: self.rms_norm(x.reshape(-1, x.shape[-1]), w, eps).reshape(x.shape)
    return norm(q, wq), norm(k, wk), v

  def argmax(self, logits: Tensor) -> Tensor:
    """int32 index of each row's largest logit `[R, V] -> [R]`, numpy's choice among ties and NaNs: the greedy token a
    decode pass takes on the device. On the CPU device one C pass over each row."""
    if self.cpu and isinstance(logits.device, str) and logits.dtype == dtypes.float32 and logits.ndim == 2: return cpu.argmax(logits)
    return portable.argmax(logits)

  def glu(self, gate_up: Tensor, inter: int, act: str = "silu") -> Tensor:
    """act(gate) * up of the fused gate/up projection's output `[T, 2 * inter]`: SwiGLU, or GeGLU with "gelu_pytorch_tanh"."""
    return portable.gated(gate_up[:, :inter], gate_up[:, inter:], act)

  def attention(self, q: Tensor, cache: PagedKVCache, group: AttentionGroup, scale: float, window: int | None = None,
                softcap: float | None = None) -> Tensor:
    """q `[P*C, H, D]` of one group -> attention output `[P*C, H * D]` (each token's heads side by side, as the o
    projection reads them); with a `window`, each query sees only the latest `window` keys up to its own position;
    with `softcap`, scores become softcap * tanh(scores / softcap)."""
    P, C = group.num_seqs, group.query_len
    assert not group.packed, "the tensor-op attention reads padded groups (Kernels.packs)"
    tables = group.block_tables[:, :group.used_blocks]   # portable attention's cost follows the columns it reads
    out = portable.paged_attention(q.reshape(P, C, *q.shape[1:]), cache, tables, group.q_pos, scale, window, softcap)
    return out.reshape(P * C, q.shape[1] * q.shape[2])


class CpuKernels(Kernels):
  """`cpu`: a whole decoder layer as one C kernel (kernels/cpu_layer.py) on tinygrad's CPU device, float32.

  It finds each token's sequence from token_seq, so prefill chunks are packed back to back: padding to the longest
  chunk cost up to half of a prefill pass."""
  name = "cpu"
  packs_prefill = True

  def check_model(self, head_dim: int, n_heads: int, n_kv_heads: int, block_size: int, dtype: str) -> None:
    if dtype != "float32" or head_dim % 8:
      raise ValueError(f"kernel_backend='cpu' runs float32 models with head_dim divisible by 8 (got {dtype}, head_dim "
                       f"{head_dim}): use dtype='float32' or kernel_backend='portable'")

  def packs(self, layers, kv_format: KVCacheFormat) -> bool:
    """Packed prefill groups are read by the fused layer only: a model with a layer it does not take (stored in a
    format it does not read) pads prefill chunks instead, for the composed layer's attention."""
    return all(self.fuses(layer) for layer in layers)

  def fuses(self, layer) -> bool:
    """Layers whose projections' parts start at multiples of a row tile (cpu_layer.takes); every family's parts (q/k
    norms, windows, Gemma's post-norms, GeGLU and soft-capping) are the fused layer's own."""
    return cpu_layer.takes(layer.linears)

  def decoder_layer(self, h, linears, norms, cfg, group, positions, slot_mapping, cos_sin, cache, out, window=None):
    return cpu_layer.decoder_layer(h, linears, norms, cfg, positions, slot_mapping, group.block_tables, group.token_seq,
                                   group.q_pos.reshape(group.num_tokens), cos_sin, cache, out, self.pool, window)


class ShaderKernels(Kernels):
  """`metal` (DEV=METAL) and `emulator` (the same .metal shaders run on the CPU device by our MSL emulator; slow, for
  tests and debugging): RoPE + cache write, attention and 4-bit linears are our shaders (kernels/metal.py)."""
  gemv_formats = frozenset({FLOAT, INT8, PACKED})   # INT4: the shaders' own GEMV
  def __init__(self, name: str, device: str = "CPU", num_threads: int | None = None):
    super().__init__(device, num_threads)
    self.name = name
    self.shaders = metal.MetalBackend() if name == "metal" else metal.EmulatorBackend()

  def packs(self, layers, kv_format: KVCacheFormat) -> bool:
    """The prefill shader finds each token's sequence and position itself (token_seq, token_pos), soft caps too; int4
    caches are refused (`check_kv_cache`)."""
    return self.packs_prefill

  def check_model(self, head_dim: int, n_heads: int, n_kv_heads: int, block_size: int, dtype: str) -> None:
    if head_dim not in metal.HEAD_DIMS or block_size not in metal.BLOCK_SIZES or n_heads // n_kv_heads > 8:
      raise ValueError(f"kernel_backend={self.name!r} supports head_dim {metal.HEAD_DIMS}, block_size {metal.BLOCK_SIZES} "
                       f"and up to 8 query heads per KV head; this model has head_dim {head_dim}, "
                       f"{n_heads // n_kv_heads} query heads per KV head (block_size {block_size}): use kernel_backend='portable'")

  def check_kv_cache(self, fmt: KVCacheFormat) -> None:
    if "int4" in (fmt.k_storage, fmt.v_storage):
      raise ValueError(f"kernel_backend={self.name!r} reads float and int8 KV caches; kv_cache_dtype='int4' and 'k8v4' run on the cpu and "
                       f"portable backends: use kv_cache_dtype='int8' (or kernel_backend='portable')")

  def int4_linear(self, x: Tensor, w: LinearWeights) -> Tensor:
    return metal.int4_matmul(x, w.weight, w.scales, w.biases, w.group_size, backend=self.shaders)

  def _int4_gemv(self, x: Tensor, w: LinearWeights, bias_allowed: bool = False) -> bool:
    """Whether the shaders' INT4 GEMV takes x @ W^T: INT4 weights, a decode step's few rows, no bias unless the
    caller adds it after."""
    return w.format == INT4 and x.shape[0] <= metal.GEMV_MAX_M and (bias_allowed or w.bias is None)

  def norm_linear(self, x: Tensor, norm_weight: Tensor, eps: float, w: LinearWeights) -> Tensor:
    if not self._int4_gemv(x, w, bias_allowed=True): return super().norm_linear(x, norm_weight, eps, w)
    y = metal.int4_matmul(x, w.weight, w.scales, w.biases, w.group_size, backend=self.shaders, norm=(norm_weight, eps))
    return y if w.bias is None else y + w.bias

  def norm_glu(self, x: Tensor, norm_weight: Tensor, eps: float, w: LinearWeights, inter: int, act: str = "silu") -> Tensor:
    """An INT4 gate/up of a decode step's few rows: the shaders' GEMV norms x, and gates its product as it writes it
    (int4_gemv_glu): one launch where the norm's GEMV and the gating's kernel were two."""
    if not self._int4_gemv(x, w) or act not in metal.GATES or w.weight.shape[0] != 2 * inter:
      return super().norm_glu(x, norm_weight, eps, w, inter, act)
    return metal.int4_matmul(x, w.weight, w.scales, w.biases, w.group_size, backend=self.shaders, norm=(norm_weight, eps), gate=act)

  def residual_linear(self, x: Tensor, w: LinearWeights, residual: Tensor, out: Tensor | None = None) -> Tensor:
    if not self._int4_gemv(x, w): return super().residual_linear(x, w, residual, out)
    return metal.int4_matmul(x, w.weight, w.scales, w.biases, w.group_size, backend=self.shaders, residual=residual, out=out)

  def rope_attention(self, *args, **kwargs) -> None: return None   # our shaders below

  def norm_qkv_rope_attention(self, x, norm_weight, eps, parts, n_heads, n_kv_heads, positions, cos_sin, cache, slot_mapping, group,
                              scale, window=None, softcap=None):
    """Where the qkv projection is a decode step's GEMV (a few rows) and the cache is float, the GEMV writes q (in the
    model's dtype, as the attention shaders read it) and the cache, and the RoPE shader's launch goes: ours for float
    or INT8 weights (kernels/gemv.py), the shaders' own for a fused INT4 qkv without a bias (int4_gemv_rope). The
    attention is the shaders'. An int8 cache's scales stay the RoPE shader's to write."""
    if cache.quantized: return None
    if self.takes_gemv(x, *parts):
      q, cache = gemv.qkv_rope_write(x, parts, (norm_weight, eps), n_heads, n_kv_heads, positions, cos_sin, cache, slot_mapping, q_dtype=x.dtype)
    elif len(parts) == 1 and self._int4_gemv(x, w := parts[0]):
      q, cache = metal.int4_qkv_rope(x, w.weight, w.scales, w.biases, w.group_size, (norm_weight, eps), n_heads, n_kv_heads,
                                     positions, cos_sin, cache, slot_mapping, backend=self.shaders)
    else: return None
    return self.attention(q, cache, group, scale, window, softcap), cache

  def rope_and_cache_write(self, qkv, n_heads, n_kv_heads, positions, cos_sin, cache, slot_mapping, qk_norms=None):
    if qk_norms is not None:   # q and k normed head by head first (Qwen3): the shader reads the row rebuilt from them
      q, k, v = self.head_norms(*portable.split_qkv(qkv, n_heads, n_kv_heads, cache.head_dim), qk_norms)
      qkv = Tensor.cat(*(x.reshape(x.shape[0], -1) for x in (q, k, v)), dim=1)
    return metal.rope_and_cache_write(qkv, n_heads, n_kv_heads, positions, cos_sin, cache, slot_mapping, backend=self.shaders)

  def attention(self, q, cache, group, scale, window=None, softcap=None):
    if group.query_len == 1:
      return metal.paged_attention_decode(q, cache, group.block_tables, group.context_lens, scale, backend=self.shaders,
                                          window=window, softcap=softcap, flat=True)
    return metal.paged_attention_prefill(q, cache, group.block_tables, group.token_seq, group.q_pos.reshape(group.num_tokens),
                                         scale, backend=self.shaders, window=window, softcap=softcap, flat=True)


def make_kernels(backend: str = "portable", device: str | tuple[str, ...] = "CPU", num_threads: int | None = None) -> Kernels:
  """The kernels of a resolved backend name (`resolve_backend`); on a tuple of devices (tensor parallelism), the
  portable kernels over multi-device tensors (kernels/sharded.py)."""
  if isinstance(device, tuple):
    if backend != "portable": raise ValueError(f"kernel_backend={backend!r} runs on one device; tensor parallelism runs 'portable'")
    from tinyvllm.kernels.sharded import ShardedKernels
    return ShardedKernels(device, num_threads)
  if backend in ("metal", "emulator"): return ShaderKernels(backend, device, num_threads)
  if backend not in BACKENDS: raise ValueError(f"unknown kernel_backend {backend!r}; choose {', '.join(BACKENDS)}")
  return (CpuKernels if backend == "cpu" else Kernels)(device, num_threads)


def default_dtype(device: str) -> str:
  """float32 on the CPU (half is conversion-bound there, not faster); float16 on the GPU."""
  return "float32" if device.split(":")[0] in ("CPU", "PYTHON") else "float16"
