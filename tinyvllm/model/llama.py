"""Llama-family decoder on tinygrad, reading a flat batch of tokens against a paged KV cache.

A step's batch is flat: T tokens laid out group by group (see kernels.AttentionGroup). Linears see all T
tokens at once; attention runs per group; logits are computed only for the rows the sampler needs.
"""
from __future__ import annotations
import dataclasses, sys
from collections.abc import Iterator
from dataclasses import dataclass
import numpy as np
from tinygrad import Device, Tensor, dtypes
from tqdm import tqdm
from tinyvllm.config import ModelConfig
from tinyvllm import host_memory
from tinyvllm.kernels import AttentionGroup, Kernels, portable
from tinyvllm.kernels.kv_cache import PagedKVCache
from tinyvllm.quant import blocks
from tinyvllm.quant.formats import (FLOAT, FUSED_PROJECTIONS, INT4, INT8, PACKED, PARTS, WEIGHT_PARTS, LinearWeights, QuantSpec,
                                    projection_parts, spec_of, stored_format)
from tinyvllm.model import tensor_parallel
from tinyvllm.model.rope import attention_factor, cos_sin_table, head_dim_order, inverse_frequencies
from tinyvllm.model.weights import ModelLoadError, as_dtype, expected_tensors, release_tensor, shape_of


@dataclass
class ModelInputs:
  tokens: Tensor                 # int32 [T]
  positions: Tensor              # int32 [T]
  slot_mapping: Tensor           # int32 [T], -1 for padding tokens
  groups: list[AttentionGroup]   # in flat order; their token counts sum to T
  logits_index: Tensor           # int32 [R]: flat rows whose next-token logits are wanted


LAYER_LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


class LlamaLayer:
  """One decoder layer. Its weights live in a flat dict (HF names relative to the layer, q/k/v and gate/up fused
  when they are stored alike), so a layer can be rebuilt around other tensors: the model runner replays one captured
  layer with the weights of every layer of the same `signature`. `linears` holds each projection's record
  (quant/formats.py): the fused ones, or q/k/v (gate/up) apart when their formats differ (a Q4_K_M GGUF keeps some
  layers' v in Q6_K)."""
  def __init__(self, cfg: ModelConfig, weights: dict[str, Tensor], kernels: Kernels, linears: dict[str, LinearWeights] | None = None,
               specs: dict[str, QuantSpec] | None = None, window: int | None = None):
    """`specs`: the layouts of packed linears (their `.qspec` arrays stay on the host), by name relative to the layer.
    `window`: the keys its attention sees, the latest `window` of them (cfg.layer_window), or None for all."""
    self.cfg, self.weights, self.kernels, self.window = cfg, weights, kernels, window
    self.local_rope = window is not None and cfg.rope_local_theta is not None   # Gemma 3's sliding layers: their own RoPE base
    if linears is None:
      names = [n for fused in LAYER_LINEARS for n in ((fused,) if f"{fused}.weight" in weights else FUSED_PROJECTIONS.get(fused, (fused,)))]
      specs = specs or {}
      self.linears = {n: LinearWeights.of(weights, n, PACKED if n in specs else None, specs.get(n)) for n in names}
    else:   # the same layout around other tensors
      self.linears = {n: LinearWeights.of(weights, n, lw.format, lw.spec) for n, lw in linears.items()}

  @property
  def mlp_norm(self) -> str:
    """The MLP input's norm: Llama's post_attention_layernorm; with Gemma's post-norms that name norms the attention's
    output, and pre_feedforward_layernorm the MLP's input."""
    return "pre_feedforward_layernorm.weight" if self.cfg.sandwich_norms else "post_attention_layernorm.weight"

  @property
  def signature(self) -> tuple:
    """What a captured layer fixes: the weights' names, its window, and each projection's format, layout and shapes."""
    return tuple(self.weights) + (("window", self.window),) + tuple((n, lw.format, lw.spec, tuple(tuple(t.shape) for t in lw.tensors())) for n, lw in self.linears.items())

  def tensors(self) -> list[Tensor]: return list(self.weights.values())

  def with_tensors(self, tensors: list[Tensor]) -> LlamaLayer:
    return LlamaLayer(self.cfg, dict(zip(self.weights, tensors, strict=True)), self.kernels, self.linears, window=self.window)

  def linear(self, name: str, x: Tensor) -> Tensor:
    """Projection `name` of x; a fused one whose parts are stored apart runs part by part, outputs side by side."""
    parts = projection_parts(self.linears, name)
    if len(parts) == 1: return self.kernels.linear(x, parts[0])
    return Tensor.cat(*(self.kernels.linear(x, part) for part in parts), dim=1)

  def residual_linear(self, name: str, x: Tensor, residual: Tensor, out: Tensor | None = None) -> Tensor:
    """residual + projection `name` of x, written into `out` when given: one kernel where the backend adds the
    residual inside its matmul."""
    parts = projection_parts(self.linears, name)
    if len(parts) == 1: return self.kernels.residual_linear(x, parts[0], residual, out)
    y = residual + self.linear(name, x)
    return y if out is None else out.assign(y)

  def normed_linear(self, name: str, h: Tensor, norm: str) -> Tensor:
    """Projection `name` of RMSNorm(h) * weights[norm]: one kernel where the backend norms x inside its matmul."""
    parts, eps = projection_parts(self.linears, name), self.cfg.rms_norm_eps
    if len(parts) == 1: return self.kernels.norm_linear(h, self.weights[norm], eps, parts[0])
    return self.linear(name, self.kernels.rms_norm(h, self.weights[norm], eps))

  def gated_linear(self, name: str, h: Tensor, norm: str) -> Tensor:
    """act(gate) * up of the fused gate/up projection `name` of RMSNorm(h) * weights[norm]: one kernel where the
    backend norms x and gates the product inside its matmul (a GPU's decode step)."""
    parts, cfg = projection_parts(self.linears, name), self.cfg
    if len(parts) == 1: return self.kernels.norm_glu(h, self.weights[norm], cfg.rms_norm_eps, parts[0], cfg.intermediate_size, cfg.hidden_act)
    if (y := self.kernels.norm_glu_apart(h, self.weights[norm], cfg.rms_norm_eps, *parts, cfg.hidden_act)) is not None: return y
    return self.kernels.glu(self.normed_linear(name, h, norm), cfg.intermediate_size, cfg.hidden_act)

  def __call__(self, h: Tensor, inp: ModelInputs, cos_sin: Tensor, cache: PagedKVCache, out: Tensor | None = None) -> Tensor:
    """h `[T, hidden]` -> the layer's output, written into `out` when given (a realized buffer)."""
    cfg, kn, w = self.cfg, self.kernels, self.weights
    norms = (w["input_layernorm.weight"], w[self.mlp_norm])
    if cfg.qk_norm: norms += (w["self_attn.q_norm.weight"], w["self_attn.k_norm.weight"])
    if cfg.sandwich_norms: norms += (w["post_attention_layernorm.weight"], w["post_feedforward_layernorm.weight"])
    if len(inp.groups) == 1 and kn.fuses(self) and (fused := kn.decoder_layer(h, self.linears, norms, cfg, inp.groups[0], inp.positions,
                                                                              inp.slot_mapping, cos_sin, cache, out, self.window)) is not None:
      return fused
    return self._compose(h, inp, cos_sin, cache, out)

  def _compose(self, h: Tensor, inp: ModelInputs, cos_sin: Tensor, cache: PagedKVCache, out: Tensor | None = None) -> Tensor:
    cfg, kn, w = self.cfg, self.kernels, self.weights
    H, KVH = cfg.num_attention_heads, cfg.num_key_value_heads
    one_group, qkv_parts, fused = len(inp.groups) == 1, projection_parts(self.linears, "self_attn.qkv_proj"), None
    if one_group and not cfg.qk_norm:   # where the projection can write q and the cache itself
      fused = kn.norm_qkv_rope_attention(h, w["input_layernorm.weight"], cfg.rms_norm_eps, qkv_parts, H, KVH, inp.positions, cos_sin,
                                         cache, inp.slot_mapping, inp.groups[0], cfg.attention_scale, self.window, cfg.attn_logit_softcapping)
    if fused is None:
      qkv = self.normed_linear("self_attn.qkv_proj", h, "input_layernorm.weight")
      qk_norms = (w["self_attn.q_norm.weight"], w["self_attn.k_norm.weight"], cfg.rms_norm_eps) if cfg.qk_norm else None
      fused = kn.rope_attention(qkv, H, KVH, inp.positions, cos_sin, cache, inp.slot_mapping, inp.groups[0], cfg.attention_scale,
                                self.window, cfg.attn_logit_softcapping, qk_norms) if one_group else None
    if fused is not None: att, cache = fused
    else:
      q, cache = kn.rope_and_cache_write(qkv, H, KVH, inp.positions, cos_sin, cache, inp.slot_mapping, qk_norms)
      outs, start = [], 0
      for g in inp.groups:
        outs.append(kn.attention(q[start:start + g.num_tokens], cache, g, cfg.attention_scale, self.window, cfg.attn_logit_softcapping))
        start += g.num_tokens
      att = outs[0] if len(outs) == 1 else outs[0].cat(*outs[1:])   # [T, H * D]
    if cfg.sandwich_norms: h = h + kn.rms_norm(self.linear("self_attn.o_proj", att), w["post_attention_layernorm.weight"], cfg.rms_norm_eps)
    else: h = self.residual_linear("self_attn.o_proj", att, h)
    # materialise the activation: fused into the down projection it is recomputed for every output row
    act = self.gated_linear("mlp.gate_up_proj", h, self.mlp_norm).contiguous()
    # into `out` straight from the sum: the last kernel writes the layer's output buffer (no copy after it)
    if cfg.sandwich_norms:
      mlp = kn.rms_norm(self.linear("mlp.down_proj", act), w["post_feedforward_layernorm.weight"], cfg.rms_norm_eps)
      y = h + mlp if out is None else out.assign(h + mlp)
    else: y = self.residual_linear("mlp.down_proj", act, h, out)
    return y.contiguous() if out is None else y


class Llama:
  def __init__(self, cfg: ModelConfig, tensors: dict[str, np.ndarray], dtype: str, device: str | tuple[str, ...], kernels: Kernels,
               max_positions: int):
    """`device`: one device, or a tuple of devices to split every layer over (tensor parallelism, model/tensor_parallel.py).

    The weights go to the device a layer at a time (`_prepare`), each layer's source pages handed back to the OS once
    its tensors are there: loading holds the device's copy plus one layer on the host, never a second copy of the
    model (docs/architecture.md, "Loading")."""
    self.cfg, self.kernels, self.device = cfg, kernels, device
    self.dtype = dtypes.float32 if dtype == "float32" else dtypes.float16
    groups = tqdm(self._prepare(cfg, tensors, dtype, kernels.keeps), desc="loading weights", total=cfg.num_hidden_layers + 1,
                  unit=" layers", file=sys.stderr, disable=None, leave=False)   # the layers, and what sits outside them
    specs: dict[str, QuantSpec] = {}   # packed layouts: the spec stays on the host, with the records (quant/formats.py)
    if isinstance(device, tuple):
      n = len(device)
      tensor_parallel.check_shardable(cfg, n)
      arrays = tensor_parallel.shard_layout(cfg, {name: arr for group in groups for name, arr in group.items()}, n, dtype)
      w = {name: tensor_parallel.place(arr, device, tensor_parallel.shard_axis(name, cfg, n)) for name, arr in arrays.items()}
    else:
      upload, w = Uploader(device), {}
      for group in groups:
        for name, arr in group.items():
          if name.endswith(".qspec"): specs[name[:-len(".qspec")]] = spec_of(group, name[:-len(".qspec")])
          else: w[name] = upload(arr)
      upload.finish()
    record = lambda name: LinearWeights.of(w, name, PACKED if name in specs else None, specs.get(name))
    self.embed_tokens = record("model.embed_tokens")   # quantized in MLX checkpoints and most GGUFs
    self.norm = w["model.norm.weight"]
    self.lm_head = self.embed_tokens if cfg.tie_word_embeddings else record("lm_head")
    self.layers = []
    for i in range(cfg.num_hidden_layers):
      prefix = f"model.layers.{i}."
      self.layers.append(LlamaLayer(cfg, {k[len(prefix):]: t for k, t in w.items() if k.startswith(prefix)}, kernels,
                                    specs={k[len(prefix):]: v for k, v in specs.items() if k.startswith(prefix)},
                                    window=cfg.layer_window(i)))
    place = lambda table: tensor_parallel.place(table, device, None) if isinstance(device, tuple) else Tensor(table, device=device).realize()
    self.cos_sin = place(cos_sin_table(inverse_frequencies(cfg, tensors.get("rope_freqs.weight"), max_positions), max_positions,
                                       attention_factor(cfg)))
    self.cos_sin_local = None   # the sliding layers' table when they rotate with a base of their own (Gemma 3)
    if cfg.rope_local_theta is not None:
      local = dataclasses.replace(cfg, rope_theta=cfg.rope_local_theta, rope_scaling=None)
      self.cos_sin_local = place(cos_sin_table(inverse_frequencies(local), max_positions))

  @staticmethod
  def _prepare(cfg: ModelConfig, tensors: dict[str, np.ndarray], dtype: str, keeps: frozenset[str]) -> Iterator[dict[str, np.ndarray]]:
    """{name: array} of every tensor the model reads, the embeddings and head first, then one layer at a time: shapes
    checked, q/k/v and gate/up fused (when stored alike), floats cast to the model dtype. Quantized linears stay as
    they are stored (quant/formats.py) where the kernels take that format (`keeps`); any other is dequantized, and
    said so once. After a layer's arrays have been taken, the checkpoint pages they came from are released
    (weights.release)."""
    np_dtype = np.float32 if dtype == "float32" else np.float16
    vectors, linears, biased = expected_tensors(cfg)
    vectors = vectors | {f"{base}.bias": linears[base][0] for base in biased}
    told: set[str] = set()

    def as_float(name: str, fmt: str) -> np.ndarray:
      if fmt not in told:
        told.add(fmt)
        print(f"tinyvllm: {fmt} weights run as {dtype} on these kernels (they keep {', '.join(sorted(keeps))} compact)", file=sys.stderr)
      return blocks.dequantize_linear(tensors, name, fmt).astype(np_dtype)

    order = head_dim_order(cfg)   # a partial rotary embedding: q and k's head dimensions reordered (rope.head_dim_order)
    def heads_reordered(arrays: dict[str, np.ndarray], n_heads: int) -> dict[str, np.ndarray]:
      rows = (np.arange(n_heads)[:, None] * cfg.head_dim + order[None, :]).reshape(-1)
      return {k: v if k.endswith(".qspec") else np.ascontiguousarray(v[rows]) for k, v in arrays.items()}

    def vector(name: str) -> np.ndarray:
      _check(tensors, name, (vectors[name],), cfg)
      if order is not None and name.endswith(("self_attn.q_norm.weight", "self_attn.k_norm.weight")):
        return np.ascontiguousarray(np.asarray(tensors[name], np_dtype)[order])
      if order is not None and name.endswith(("self_attn.q_proj.bias", "self_attn.k_proj.bias")):
        n_heads = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
        return heads_reordered({name: np.asarray(tensors[name], np_dtype)}, n_heads)[name]
      if cfg.norm_weight_offset and name.endswith("norm.weight"):   # Gemma's norms scale by 1 + weight: fold the 1 in
        return (np.float32(cfg.norm_weight_offset) + np.asarray(tensors[name], np.float32)).astype(np_dtype)
      return np.ascontiguousarray(tensors[name], dtype=np_dtype)

    def linear(name: str) -> dict[str, np.ndarray]:
      n, k = linears[name]
      fmt, out = stored_format(tensors, name), {}
      if fmt == INT8:
        _check(tensors, f"{name}.weight", (n, k), cfg)
        _check(tensors, f"{name}.scales", (n, k // 32), cfg)
        if fmt in keeps:
          out[f"{name}.weight"] = np.ascontiguousarray(tensors[f"{name}.weight"], dtype=np.int8)
          out[f"{name}.scales"] = np.ascontiguousarray(tensors[f"{name}.scales"], dtype=np.float16)
        else: out[f"{name}.weight"] = as_float(name, fmt)
      elif fmt == PACKED:
        for part, shape in blocks.part_shapes(spec_of(tensors, name), n, k).items(): _check(tensors, f"{name}.{part}", shape, cfg)
        if fmt in keeps: out.update({f"{name}.{p}": np.ascontiguousarray(tensors[f"{name}.{p}"]) for p in (*WEIGHT_PARTS, "qspec")
                                     if f"{name}.{p}" in tensors})
        else: out[f"{name}.weight"] = as_float(name, fmt)
      elif fmt == INT4:
        groups = tensors[f"{name}.scales"].shape[-1]
        _check(tensors, f"{name}.weight", (n, k // 8), cfg)
        for part in ("scales", "biases"): _check(tensors, f"{name}.{part}", (n, groups), cfg)
        if k % groups: raise ModelLoadError(f"{name}: {groups} quantization groups do not divide its {k} inputs")
        out[f"{name}.weight"] = np.ascontiguousarray(tensors[f"{name}.weight"]).view(np.uint32)
        out.update({f"{name}.{part}": np.ascontiguousarray(tensors[f"{name}.{part}"], dtype=np.float16) for part in ("scales", "biases")})
      else:
        _check(tensors, f"{name}.weight", (n, k), cfg)
        out[f"{name}.weight"] = as_dtype(tensors, f"{name}.weight", np_dtype)
      if order is not None and name.endswith(("self_attn.q_proj", "self_attn.k_proj")):
        out = heads_reordered(out, cfg.num_attention_heads if name.endswith("q_proj") else cfg.num_key_value_heads)
      return out

    def group(prefix: str) -> Iterator[dict[str, np.ndarray]]:
      """The tensors named under `prefix` (a layer's, or the model's outside the layers when prefix is "")."""
      inside = lambda name: name.startswith(prefix) if prefix else not name.startswith("model.layers.")
      out = {name: vector(name) for name in vectors if inside(name)}
      for name in linears:
        if inside(name): out.update(linear(name))
      if prefix: _fuse(out, prefix, np_dtype)
      yield out
      for name in tensors:   # the device has them now: the pages they were read from (and lazy conversions) can go
        if inside(name): release_tensor(tensors, name)

    yield from group("")
    for i in range(cfg.num_hidden_layers): yield from group(f"model.layers.{i}.")

  def __call__(self, inp: ModelInputs, kv_caches: list[PagedKVCache]) -> Tensor:
    """Returns float32 logits `[R, vocab]` for the rows in inp.logits_index."""
    h = self.embed(inp.tokens)
    for layer, cache in zip(self.layers, kv_caches):
      # realizing layer by layer keeps each graph tinygrad schedules small (scheduling cost grows faster
      # than linearly with graph size); under TinyJit every realize is captured into the one replay
      h = layer(h, inp, self.rope_table(layer), cache).realize()
    return self.logits(h, inp.logits_index)

  def rope_table(self, layer: LlamaLayer) -> Tensor:
    """The cos/sin table `layer` rotates q and k with."""
    return self.cos_sin_local if layer.local_rope else self.cos_sin

  def embed(self, tokens: Tensor) -> Tensor:
    """(T, hidden): table rows, dequantized on the fly when the table is quantized (times sqrt(hidden) for Gemma,
    the factor rounded to the model dtype first, as HF does)."""
    e = self.embed_tokens
    factor = self.cfg.hidden_size ** 0.5 if self.cfg.scale_embeddings else None
    # one kernel of ours (tinygrad's gather split a decode step's into two on a GPU, and an INT4 table's three parts
    # were three); a table of another dtype or format or split over devices takes tinygrad's
    if isinstance(e.weight.device, str):
      if e.format == FLOAT and e.weight.dtype == self.dtype: return portable.rows(e.weight, tokens, factor)
      if e.format == INT4: return portable.int4_table_rows(e.weight, e.scales, e.biases, tokens, self.dtype, factor)
    if e.format == FLOAT: rows = e.weight[tokens]
    elif e.format == INT8: rows = portable.q8_rows(e.weight[tokens], e.scales[tokens]).cast(self.dtype)
    elif e.format == PACKED:
      rows = portable.packed_rows(LinearWeights(PACKED, **{p: t[tokens] for p, t in e.parts().items()}, spec=e.spec), self.dtype)
    else: rows = portable.int4_rows(e.weight[tokens], e.scales[tokens], e.biases[tokens]).cast(self.dtype)
    return rows if factor is None else rows * Tensor(factor, dtype=self.dtype, device=rows.device)

  def logits(self, h: Tensor, rows: Tensor | None) -> Tensor:
    """float32 logits of h's `rows` (None: every row, as in a decode pass, where each row is its sequence's last token
    and gathering them would be a copy of h: a launch a step)."""
    h = h if rows is None else h[rows]
    logits = self.kernels.norm_logits(h, self.norm, self.cfg.rms_norm_eps, self.lm_head)   # (R, vocab), float32
    if (cap := self.cfg.final_logit_softcapping) is not None: logits = (logits / cap).tanh() * cap
    # tensor parallel: each device's share of the vocabulary (or a whole copy), gathered on the first device
    return logits if isinstance(logits.device, str) else logits.to(logits.device[0])


def _fuse(out: dict[str, np.ndarray], prefix: str, np_dtype) -> None:
  """Fuse one layer's q/k/v and gate/up linears in place (`prefix`: "model.layers.{i}."), when their parts are stored
  alike (one format, one layout): a fused projection is one matmul. Parts stored differently stay apart (the layer
  runs them one by one): dequantizing them to fuse would undo what the file saved."""
  for fused, parts in FUSED_PROJECTIONS.items():
    names = [prefix + part for part in parts]
    stored = [LinearWeights.of(out, n) for n in names]
    if len({(p.format, p.spec, p.group_size) for p in stored}) > 1: continue
    for part in PARTS:
      if f"{names[0]}.{part}" not in out: continue
      arrays = [out.pop(f"{n}.{part}") for n in names]
      if (whole := host_memory.joined(arrays)) is None:   # written apart: one copy, into pages host_tensor takes as they are
        whole = np.concatenate(arrays, axis=0, out=host_memory.empty((sum(len(a) for a in arrays), *arrays[0].shape[1:]),
                                                                     np.result_type(*arrays)))
      out[prefix + fused + "." + part] = whole
    if f"{names[0]}.qspec" in out:   # one layout: one spec
      out[prefix + fused + ".qspec"] = out[f"{names[0]}.qspec"]
      for n in names: out.pop(f"{n}.qspec")


class Uploader:
  """Copies host arrays to a device. On the CPU device an array becomes a tensor in memory of our own, as it is when
  the loader built it there (host_memory.py: no tinygrad scheduling, no second copy). On a GPU each copy-in is
  staged through host memory the driver frees only when the device synchronizes (tinygrad's CUDA allocator pins a
  buffer per copy): without a synchronize every so often, loading an 8B model would pin all 16 GB of it on the host
  at once. `finish` synchronizes and drops the staging buffers tinygrad's allocator keeps for reuse."""
  SYNC_BYTES = 256 << 20

  def __init__(self, device: str):
    self.device, self.pending = device, 0
    self.host = self.lends_host_memory(device)

  @staticmethod
  def lends_host_memory(device: str) -> bool:
    """The CPU device's buffers are host memory: ours, filled once and lent (nothing staged, nothing scheduled)."""
    return device.split(":")[0] == "CPU"

  def __call__(self, arr: np.ndarray) -> Tensor:
    if self.host: return host_memory.host_tensor(arr, self.device)
    t = Tensor(arr, device=self.device).realize()
    self.pending += arr.nbytes
    if self.pending >= self.SYNC_BYTES: self.finish(free=False)
    return t

  def finish(self, free: bool = True) -> None:
    if self.host: return
    Device[self.device].synchronize()
    self.pending = 0
    if free and hasattr(allocator := Device[self.device].allocator, "free_cache"): allocator.free_cache()


def _check(tensors: dict[str, np.ndarray], name: str, shape: tuple[int, ...], cfg: ModelConfig) -> None:
  if name not in tensors: raise ModelLoadError(f"checkpoint {cfg.source or ''} lacks the tensor {name}")
  if (got := shape_of(tensors, name)) != shape: raise ModelLoadError(f"tensor {name} has shape {got}, the config implies {shape}")
