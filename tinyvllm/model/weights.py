"""Checkpoints -> (ModelConfig, state dict of numpy arrays with HF Llama names).

Sources: a local HF directory (config.json + safetensors, sharded or not; fp32/fp16/bf16, or MLX 4-bit),
a GGUF file (architecture llama), or a hub id fetched with huggingface_hub. Tensors stay numpy here;
turning them into device tensors (and choosing the dtype) is the model's job.
"""
from __future__ import annotations
import ctypes, dataclasses, json, math, mmap, os, re, struct, sys, types
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
import numpy as np
from tinyvllm.config import ModelConfig
from tinyvllm import host_memory
from tinyvllm.model import families
from tinyvllm.model.gguf_file import GGUFError, GGUFTensor, read_gguf
from tinyvllm.quant import blocks, ggml, int4
from tinyvllm.quant.formats import FLOAT, FUSED_PROJECTIONS, INT8, stored_format


class ModelLoadError(ValueError):
  """The checkpoint cannot be found or read. The message names the file."""


@dataclass
class Checkpoint:
  config: ModelConfig
  tensors: Mapping[str, np.ndarray]    # HF names, e.g. "model.layers.0.self_attn.q_proj.weight"; a dict or LazyTensors
  path: Path                           # the directory or GGUF file (tokenizer files are looked up from here)
  gguf_meta: dict | None = None        # GGUF metadata (the embedded tokenizer reads it)

  @property
  def nbytes(self) -> int:
    """Bytes of the tensors as loaded (without converting any that are lazy)."""
    return self.tensors.nbytes if isinstance(self.tensors, LazyTensors) else sum(a.nbytes for a in self.tensors.values())


class LazyTensors(Mapping):
  """A checkpoint's tensors, converted from the file when first read and let go when released: a GGUF's k-quant blocks
  repacked (quant/blocks.py), say. Loading reads a layer, uploads it and releases it (model/llama.py), so a model's
  worth of converted arrays is never in memory at once. Tensors are made in groups (a linear's codes and scales come
  from the same blocks): `add(keys, make, sources, nbytes)` registers the keys `make()` returns, the file arrays it
  reads (released with it) and the bytes it will take; `rows`, for a float (or 8-bit) weight, how to read it a
  slice of rows at a time instead (FloatRows)."""
  def __init__(self):
    self.group: dict[str, int] = {}                  # key -> its group
    self.makers: list = []                           # group -> () -> {key: array}
    self.sources: list[list[np.ndarray]] = []        # group -> the file's arrays it reads
    self.sizes: list[int] = []
    self.made: dict[int, dict[str, np.ndarray]] = {}
    self.rows: dict[str, FloatRows] = {}

  def add(self, keys, make, sources: list[np.ndarray], nbytes: int, rows: FloatRows | None = None) -> None:
    g = len(self.makers)
    self.makers.append(make); self.sources.append(sources); self.sizes.append(nbytes)
    for k in keys: self.group[k] = g
    if rows is not None: self.rows[keys[0]] = rows

  def __getitem__(self, key: str) -> np.ndarray:
    g = self.group[key]
    if g not in self.made: self.made[g] = self.makers[g]()
    return self.made[g][key]

  def __iter__(self): return iter(self.group)
  def __len__(self) -> int: return len(self.group)
  def __contains__(self, key) -> bool: return key in self.group

  @property
  def nbytes(self) -> int: return sum(self.sizes[g] for g in set(self.group.values()))

  def release(self, key: str) -> None:
    """Forget the group of `key` (made again if read again) and hand its file pages back to the OS."""
    g = self.group[key]
    for a in self.sources[g]: release(a)
    self.made.pop(g, None)

  def select(self, keep) -> LazyTensors:
    """The tensors whose names `keep(name)` accepts, made the same way."""
    out = LazyTensors()
    out.makers, out.sources, out.sizes = self.makers, self.sources, self.sizes
    out.group = {k: g for k, g in self.group.items() if keep(k)}
    out.rows = {k: r for k, r in self.rows.items() if k in out.group}
    return out


@dataclass(frozen=True)
class FloatRows:
  """A float weight, or an 8-bit one, read a slice of rows at a time as floats: what quantizing to INT4 at load and
  casting to the model's dtype read, so no table is converted whole (an 8B bf16 checkpoint widened to float32 up
  front took 32 GB; a Q8_0 file's codes all copied out, 8.5 GB for a 1B). `read(i, j)`: rows i..j as float16 or
  float32. `stored`: the file's array, a row per weight row, whose pages are handed back as its rows are read."""
  shape: tuple[int, ...]
  read: Callable[[int, int], np.ndarray]
  stored: np.ndarray

  @staticmethod
  def of(arr: np.ndarray, to_float=lambda rows: rows) -> FloatRows:
    return FloatRows(arr.shape, lambda i, j: to_float(arr[i:j]), arr)


def _lazy_rows(tensors: Mapping[str, np.ndarray], name: str) -> FloatRows | None:
  """The FloatRows a lazy store registered for `name`, if any."""
  return tensors.rows.get(name) if isinstance(tensors, LazyTensors) else None


def float_rows(tensors: Mapping[str, np.ndarray], name: str) -> FloatRows | None:
  """Weight `name` as FloatRows, or None if it is stored neither as floats nor as 8-bit codes (or a lazy store
  cannot read it by rows)."""
  if isinstance(tensors, LazyTensors): return _lazy_rows(tensors, name)
  base = name.removesuffix(".weight")
  if (fmt := stored_format(tensors, base)) == FLOAT: return FloatRows.of(tensors[name])
  if fmt != INT8: return None
  codes, scales = tensors[name], tensors[f"{base}.scales"]
  return FloatRows(codes.shape, lambda i, j: int4.dequantize_8bit(codes[i:j], scales[i:j]), codes)


def shape_of(tensors: Mapping[str, np.ndarray], name: str) -> tuple[int, ...]:
  """Tensor `name`'s shape, without converting it where a lazy store can say without."""
  rows = _lazy_rows(tensors, name)
  return tuple(rows.shape if rows is not None else tensors[name].shape)


def as_dtype(tensors: Mapping[str, np.ndarray], name: str, dtype, slice_bytes: int = 64 << 20) -> np.ndarray:
  """Float tensor `name` as a contiguous `dtype` array. One a lazy store converts (a bf16 one) is converted a slice of
  rows at a time, into pages a CPU tensor takes as they are: never a float32 copy of a whole table first."""
  rows = _lazy_rows(tensors, name)
  if rows is None or rows.stored.dtype == dtype: return np.ascontiguousarray(tensors[name], dtype=dtype)
  out = host_memory.empty(rows.shape, dtype)
  step = max(1, slice_bytes // max(1, 4 * math.prod(rows.shape[1:])))
  for i in range(0, rows.shape[0], step): out[i:i + step] = rows.read(i, i + step)
  return out


def bf16_to_float32(bits: np.ndarray) -> np.ndarray:
  """bfloat16 stored as uint16 -> float32 (exact: bf16 is float32's top half)."""
  return (bits.astype(np.uint32) << 16).view(np.float32)


def release_tensor(tensors: Mapping[str, np.ndarray], name: str) -> None:
  """Once tensor `name` is on the device: let its checkpoint pages (and a lazy store's conversion) go."""
  if isinstance(tensors, LazyTensors): tensors.release(name)
  else: release(tensors[name])


def select_tensors(tensors: Mapping[str, np.ndarray], keep) -> Mapping[str, np.ndarray]:
  """The tensors whose names `keep(name)` accepts, without converting lazy ones."""
  if isinstance(tensors, LazyTensors): return tensors.select(keep)
  return {k: v for k, v in tensors.items() if keep(k)}


def resolve_model(model: str | os.PathLike | None) -> Path:
  """Turn the user's `model` argument into a local path: None -> the default model, a hub id -> a download."""
  if model is None:
    from tinyvllm.model.fetch import default_model_path
    return default_model_path()
  path = Path(model).expanduser()
  if path.exists(): return path
  name = str(model)
  looks_like_hub_id = name.count("/") == 1 and not name.startswith((".", "/", "~")) and not name.endswith(".gguf")
  if not looks_like_hub_id: raise ModelLoadError(f"model path does not exist: {name}")
  try:
    from huggingface_hub import snapshot_download
    print(f"tinyvllm: fetching {name} from the Hugging Face hub", file=sys.stderr)
    return Path(snapshot_download(name, allow_patterns=["*.json", "*.safetensors", "tokenizer.model", "*.jinja"]))
  except Exception as e:  # the hub client raises many kinds; the user needs one sentence
    raise ModelLoadError(f"{name} is neither a local path nor a model that could be fetched from the hub "
                         f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None


QUANTIZATION = (None, "int4", "none")


def load_checkpoint(model: str | os.PathLike | None, quantization: str | None = None) -> Checkpoint:
  """quantization: None keeps the checkpoint as it is (4-bit weights stay packed: MLX 4-bit, GGUF Q4_0/Q4_1);
  "int4" also quantizes every float linear and the embedding table (MLX-style, round-to-nearest at the checkpoint's
  group size, 64 for float checkpoints: fast enough to do at load; `python -m tinyvllm.quantize --method clip`
  writes better ones ahead of time);
  "none" dequantizes everything to float."""
  if quantization not in QUANTIZATION: raise ValueError(f"quantization must be None, 'int4' or 'none', got {quantization!r}")
  path = resolve_model(model)
  if path.is_file():
    if path.suffix != ".gguf" and not _is_gguf(path): raise ModelLoadError(f"{path} is neither a GGUF file nor a model directory")
    ckpt = load_gguf(path, keep_q4=quantization != "none")
  else:
    ckpt = load_hf_dir(path)
  if quantization == "none" and any(k.endswith(".scales") for k in ckpt.tensors):
    ckpt = dataclasses.replace(ckpt, tensors=int4.dequantize_state_dict(dict(ckpt.tensors)), config=dataclasses.replace(ckpt.config, quantization=None))
  if quantization == "int4": ckpt = _quantized_at_load(ckpt)
  return ckpt


# ---- HF directories ----

def load_config(model: str | os.PathLike | None) -> ModelConfig:
  """The model's config alone (config.json, or a GGUF's metadata), without reading any weights: what a command
  checks its arguments against before it spends time."""
  path = resolve_model(model)
  if path.is_dir():
    cfg_file = path / "config.json"
    if not cfg_file.exists(): raise ModelLoadError(f"{path} has no config.json")
    return ModelConfig.from_hf(_read_json(cfg_file), source=str(cfg_file))
  try: meta = read_gguf(path, with_tensors=False)[0]
  except OSError as e: raise ModelLoadError(f"{path} cannot be read: {e}") from None
  except GGUFError as e: raise ModelLoadError(f"{path} is not a readable GGUF file: {str(e).removeprefix(f'{path}: ')}") from None
  return ModelConfig.from_gguf(meta, source=str(path))


def load_hf_dir(path: Path) -> Checkpoint:
  cfg_file = path / "config.json"
  if not cfg_file.exists(): raise ModelLoadError(f"{path} has no config.json")
  config = ModelConfig.from_hf(_read_json(cfg_file), source=str(cfg_file))
  if config.quantization is not None:
    if config.quantization.get("bits") not in MLX_BITS or config.quantization.get("group_size") not in int4.GROUP_SIZES:
      raise ModelLoadError(f"{cfg_file}: unsupported quantization {config.quantization}; tinyvllm reads MLX's affine "
                           f"{', '.join(map(str, MLX_BITS))}-bit groups of {', '.join(map(str, int4.GROUP_SIZES))}")
  index = path / "model.safetensors.index.json"
  if index.exists():
    index_dict = _read_json(index)
    weight_map = index_dict.get("weight_map") if isinstance(index_dict, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
      raise ModelLoadError(f"{index}: 'weight_map' must be an object of tensor name -> file name")
    files = sorted(set(weight_map.values()))
    for name in files:   # names of files beside the index, never paths that lead elsewhere
      if not name or Path(name).name != name or name in (".", ".."):
        raise ModelLoadError(f"{index}: 'weight_map' names {name!r}, which is not a file name in {path}")
  else:
    files = sorted(p.name for p in path.glob("*.safetensors"))
  if not files: raise ModelLoadError(f"{path} has no *.safetensors weights")
  tensors: dict[str, np.ndarray] = {}
  origin: dict[str, str] = {}   # tensor -> the file it came from, for messages
  bf16: set[str] = set()        # float checkpoints: bf16 tensors stay uint16 until read (the store below widens them)
  for name in files:
    if not (path / name).is_file(): raise ModelLoadError(f"{path / name} is listed in {index.name} but missing")
    shard = map_safetensors(path / name)
    for key, (arr, dtype) in shard.items():
      if dtype == "BF16" and config.quantization is not None: arr = bf16_to_float32(arr)   # MLX's scales and biases: now
      elif dtype == "BF16": bf16.add(key)
      tensors[key] = arr
    origin.update(dict.fromkeys(shard, name))
  family = families.for_model_type(config.model_type)
  for old_prefix, new_prefix in family.hf_renames:   # a multimodal checkpoint's language model
    for name in [n for n in tensors if n.startswith(old_prefix)]:
      new = new_prefix + name[len(old_prefix):]
      tensors[new], origin[new] = tensors.pop(name), origin.pop(name, name)
      if name in bf16: bf16.add(new)
  if family.hf_fused:
    parts = split_fused(config, tensors, origin, str(path), show=lambda n: f"{n} (in {origin[n]})" if n in origin else n)
    bf16.update(part for part, fused in parts.items() if fused in bf16)
  bits = (config.quantization or {}).get("bits", 4)
  if bits != 4: return _mlx_bits(config, tensors, origin, path, bits)
  keep = check_tensors(config, tensors, str(path), "num_hidden_layers in config.json",
                       lambda n: f"{n} (in {origin[n]})" if n in origin else n)
  if config.quantization is not None:   # mlx-lm stores scales/biases in the source dtype
    return Checkpoint(config, int4.float16_params({k: tensors[k] for k in keep}), path)
  store = LazyTensors()   # bf16 widened as the model reads each tensor: widened up front, an 8B took 32 GB
  for name in keep:
    arr, to_float = tensors[name], bf16_to_float32 if name in bf16 else (lambda a: a)
    store.add([name], lambda name=name, arr=arr, to_float=to_float: {name: to_float(arr)}, [arr],
              arr.size * (4 if name in bf16 else arr.itemsize), FloatRows.of(arr, to_float))
  return Checkpoint(config, store, path)


def split_fused(config: ModelConfig, tensors: dict, origin: dict[str, str], where: str,
                cut=lambda arr, start, end: arr[start:end], show=lambda name: name) -> dict[str, str]:
  """In place: a checkpoint's fused q/k/v (`self_attn.qkv_proj`) and gate/up (`mlp.gate_up_proj`) tensors become
  their parts, rows split as views (no copy; `cut` takes rows start..end of one): weights, the scales and biases of
  quantized ones and a GGUF's raw blocks all have a row per output. The model fuses them again where they are stored
  alike. Returns part name -> the fused tensor's name."""
  made = {}
  rows = {"self_attn.qkv_proj": (config.q_size, config.kv_size, config.kv_size),
          "mlp.gate_up_proj": (config.intermediate_size, config.intermediate_size)}
  for name in [n for n in tensors if _LAYER.match(n)]:
    layer = _LAYER.match(name).group(0)
    fused, _, part = name[len(layer):].rpartition(".")
    if fused not in FUSED_PROJECTIONS: continue
    arr, sizes = tensors.pop(name), rows[fused]
    n_rows = arr.shape[0] if len(arr.shape) else 0
    if n_rows != sum(sizes):
      raise ModelLoadError(f"{where}: tensor {show(name)} has {n_rows} rows; the config implies {sum(sizes)} "
                           f"({' + '.join(map(str, sizes))})")
    start = 0
    for piece, n in zip(FUSED_PROJECTIONS[fused], sizes):
      tensors[f"{layer}{piece}.{part}"], start = cut(arr, start, start + n), start + n
      origin[f"{layer}{piece}.{part}"] = origin.get(name, name)
      made[f"{layer}{piece}.{part}"] = name
  return made


MLX_BITS = (2, 3, 4, 5, 6, 8)


def _mlx_bits(config: ModelConfig, tensors: dict[str, np.ndarray], origin: dict[str, str], path: Path, bits: int) -> Checkpoint:
  """An MLX checkpoint of `bits`-bit linears (mlx-lm's `convert -q --q-bits N`): each quantized weight (codes as a bit
  stream in uint32 words) becomes the packed layout, or INT4's for 2 and 3 bits (quant/blocks.py), when it is read."""
  show = lambda n: f"{n} (in {origin[n]})" if n in origin else n
  logical, quantized = dict(tensors), {}   # a quantized weight by the shape it stands for, for the checks
  for name in [k for k in tensors if k.endswith(".scales")]:
    base = name[:-len(".scales")]
    w, s, b = (tensors.get(f"{base}.{p}") for p in ("weight", "scales", "biases"))
    if w is None or b is None or w.ndim != 2 or s.ndim != 2 or s.shape != b.shape or s.shape[0] != w.shape[0] or \
       w.dtype.itemsize != 4 or (w.shape[1] * 32) % bits or (w.shape[1] * 32 // bits) % s.shape[1]:
      raise ModelLoadError(f"{path}: tensor {show(f'{base}.weight')} and its scales and biases are not {bits}-bit MLX groups")
    K = w.shape[1] * 32 // bits
    logical[f"{base}.weight"] = types.SimpleNamespace(shape=(w.shape[0], K))
    quantized[base] = (w, s, b, blocks.QuantSpec(max(bits, 4), K // s.shape[1]))
  store = LazyTensors()
  for name in check_tensors(config, logical, str(path), "num_hidden_layers in config.json", show, stored=False):
    base = name[:-len(".weight")]
    if base in quantized and name.endswith(".weight"):
      w, s, b, spec = quantized[base]
      make = lambda w=w, s=s, b=b, base=base: {f"{base}.{p}": a for p, a in blocks.from_mlx(w, s, b, bits, done=release)[0].items()}
      keys = blocks.stored_parts(spec) if bits > 4 else ("weight", "scales", "biases")   # 2 and 3 bits: INT4's layout
      store.add([f"{base}.{p}" for p in keys], make, [w, s, b], blocks.packed_nbytes(spec, w.shape[0], w.shape[1] * 32 // bits))
    else: store.add([name], lambda name=name: {name: tensors[name]}, [tensors[name]], tensors[name].nbytes, FloatRows.of(tensors[name]))
  return Checkpoint(config, store, path)


def _quantized_at_load(ckpt: Checkpoint) -> Checkpoint:
  """quantization="int4": every float linear and embedding table, and every 8-bit one (a GGUF's Q8_0: 4-bit everywhere
  is what "int4" asks for), quantized to INT4 round-to-nearest at the checkpoint's group size (64 for float ones). Each
  is read a slice of rows at a time (FloatRows: a bf16 table is never widened whole, nor an 8-bit one dequantized
  whole) and its file pages handed back as read. The rest (norms, tables already 4-bit or packed, and any whose
  inputs the group does not divide) stays as loaded."""
  stored = ckpt.tensors
  group = (ckpt.config.quantization or {}).get("group_size", 64)
  readers = {}
  for name in stored:
    if name.endswith(".weight") and (int4.is_linear_weight(name) or name in int4.EMBEDDING_NAMES) and \
       (rows := float_rows(stored, name)) is not None and len(rows.shape) == 2 and rows.shape[1] % group == 0:
      readers[name] = rows
  into = _fused_int4_buffers({name: rows.shape for name, rows in readers.items()}, group)
  replaced = set(readers) | {name.removesuffix(".weight") + ".scales" for name in readers}   # (an 8-bit linear's bias stays)
  tensors = {}
  for name in stored:
    if name in readers:
      base = name.removesuffix(".weight")
      try: tensors[name], tensors[f"{base}.scales"], tensors[f"{base}.biases"] = _quantize_int4(readers[name], group, into.get(name))
      except ValueError as e: raise ModelLoadError(f"{ckpt.path}: tensor {name} cannot be quantized to 4 bits: {e}") from None
      release_tensor(stored, name)   # (a lazy store's conversion of it, if something made it)
    elif name not in replaced: tensors[name] = stored[name]
  return dataclasses.replace(ckpt, tensors=tensors, config=dataclasses.replace(ckpt.config, quantization={"group_size": group, "bits": 4}))


def _fused_int4_buffers(shapes: Mapping[str, tuple[int, int]], group: int) -> dict[str, tuple[np.ndarray, ...]]:
  """For every q/k/v (gate/up) set whose weights (`shapes`: the ones to be quantized) will be quantized to INT4 and
  then fused, one buffer per INT4 array with each part's rows in it: part weight name -> its (packed, scales, biases)
  rows. The model's fusion of those parts is then the buffer itself (host_memory.joined), where a concatenation would
  hold each weight twice until loading ends."""
  into = {}
  for name in shapes:
    for parts in FUSED_PROJECTIONS.values():
      if not name.endswith(f"{parts[0]}.weight"): continue
      names = [name[:-len(f"{parts[0]}.weight")] + f"{p}.weight" for p in parts]
      if not all(n in shapes for n in names) or len({shapes[n][1] for n in names}) > 1: continue
      rows, K = [shapes[n][0] for n in names], shapes[name][1]
      bufs = (host_memory.empty((sum(rows), K // 8), np.uint32), host_memory.empty((sum(rows), K // group), np.float16),
              host_memory.empty((sum(rows), K // group), np.float16))
      for n, r0, r in zip(names, np.cumsum([0] + rows), rows): into[n] = tuple(b[r0:r0 + r] for b in bufs)
  return into


def _quantize_int4(w: FloatRows | np.ndarray, group: int, out: tuple[np.ndarray, ...] | None = None,
                   slice_bytes: int = 64 << 20) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """int4.quantize (round to nearest) of a checkpoint's weight (FloatRows, or a float array), a slice of rows at a
  time, each slice's file pages handed back once read (quantizing whole tables kept the float checkpoint resident:
  4 GB peak for a 1B model whose INT4 weights are 0.7 GB), into pages a CPU tensor takes as they are (else the dict
  of them, alive until the model is built, doubled the device's bytes), or into `out` (_fused_int4_buffers). Rows
  quantize independently: the same arrays as one call."""
  if isinstance(w, np.ndarray): w = FloatRows.of(w)
  (N, K), rows = w.shape, max(1, slice_bytes // max(1, w.shape[1] * 4))
  for i in range(0, N, rows):
    parts = int4.quantize(w.read(i, i + rows), group, "rtn")
    if out is None: out = tuple(host_memory.empty((N, *p.shape[1:]), p.dtype) for p in parts)   # lent as they are
    for o, p in zip(out, parts): o[i:i + len(p)] = p
    release(w.stored[i:i + rows])
  return out


def _read_json(file: Path):
  try: return json.loads(file.read_bytes())
  except OSError as e: raise ModelLoadError(f"{file} cannot be read: {e}") from None
  except (ValueError, RecursionError) as e:   # JSONDecodeError, bad UTF-8, or nesting too deep for the parser
    raise ModelLoadError(f"{file} is not valid JSON: {type(e).__name__}: {e}") from None


_ST_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64, "I64": np.int64,
              "I32": np.int32, "U32": np.uint32, "I16": np.int16, "U16": np.uint16, "I8": np.int8, "U8": np.uint8}
ST_MAX_HEADER = 100_000_000   # the safetensors library's own limit on the JSON header


def read_safetensors(file: Path) -> dict[str, np.ndarray]:
  """A safetensors file's tensors as arrays over its memory map (map_safetensors), bf16 ones widened to float32."""
  return {name: bf16_to_float32(arr) if dtype == "BF16" else arr for name, (arr, dtype) in map_safetensors(file).items()}


def map_safetensors(file: Path) -> dict[str, tuple[np.ndarray, str]]:
  """Memory-map a safetensors file (privately, copy-on-write: the arrays are writable, as device copy-in needs, and
  the file never changes): name -> (array over the map, the file's dtype name). bf16 arrays are uint16 (numpy has no
  bfloat16): bf16_to_float32 widens them.
  The header is checked against the file before anything is read or mapped: its length, that it is an object
  of tensor entries, and each entry's dtype, shape and data_offsets (inside the data, and as many bytes as
  the shape needs); a corrupt file raises ModelLoadError naming the file and the tensor."""
  try:
    size = file.stat().st_size
    with open(file, "rb") as f:
      head = f.read(8)
      header_len = struct.unpack("<Q", head)[0] if len(head) == 8 else None
      if header_len is not None and header_len <= min(size - 8, ST_MAX_HEADER): raw = f.read(header_len)
  except OSError as e:
    raise ModelLoadError(f"{file} cannot be read: {e}") from None
  if header_len is None: raise ModelLoadError(f"{file} is not a safetensors file: {size} bytes, too short for a header")
  if header_len > size - 8:
    raise ModelLoadError(f"{file}: the safetensors header length {header_len} is larger than the file ({size} bytes): "
                         f"truncated, or not a safetensors file")
  if header_len > ST_MAX_HEADER:
    raise ModelLoadError(f"{file}: the safetensors header length {header_len} is over the limit of {ST_MAX_HEADER} bytes")
  try: header = json.loads(raw)
  except (ValueError, RecursionError) as e:
    raise ModelLoadError(f"{file} is not a readable safetensors file: its header is not valid JSON ({type(e).__name__}: {e})") from None
  if not isinstance(header, dict):
    raise ModelLoadError(f"{file}: the safetensors header is a JSON {type(header).__name__}, not an object of tensors")
  data_len = size - 8 - header_len
  data = np.memmap(file, dtype=np.uint8, mode="c", offset=8 + header_len, shape=(data_len,)) if data_len else np.empty(0, np.uint8)
  out = {}
  for name, info in header.items():
    if name == "__metadata__": continue
    where = f"{file}: tensor {name!r}"
    if not isinstance(info, dict): raise ModelLoadError(f"{where}: its entry is a JSON {type(info).__name__}, not an object")
    for key in ("dtype", "shape", "data_offsets"):
      if key not in info: raise ModelLoadError(f"{where} has no {key!r}")
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(dtype, str) or dtype not in _ST_DTYPES:
      raise ModelLoadError(f"{where} has unsupported dtype {dtype!r}; supported: {', '.join(_ST_DTYPES)}")
    if not isinstance(shape, list) or len(shape) > 8 or not all(_is_count(d) for d in shape):
      raise ModelLoadError(f"{where} has shape {shape!r}; a shape is a list of at most 8 non-negative integers")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_count(o) for o in offsets):
      raise ModelLoadError(f"{where} has data_offsets {offsets!r}; they are two non-negative integers")
    start, end = offsets
    if not start <= end <= data_len:
      raise ModelLoadError(f"{where} has data_offsets [{start}, {end}] outside the {data_len} bytes of data (truncated?)")
    itemsize = np.dtype(_ST_DTYPES[dtype]).itemsize
    if end - start != math.prod(shape) * itemsize:   # Python ints: no product overflows
      raise ModelLoadError(f"{where}: shape {shape} of {dtype} needs {math.prod(shape) * itemsize} bytes, "
                           f"its data_offsets hold {end - start}")
    out[name] = data[start:end].view(_ST_DTYPES[dtype]).reshape(shape), dtype
  return out


def _is_count(v) -> bool: return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def release(arr: np.ndarray) -> None:
  """Let the OS take back the pages of a checkpoint's memory map under `arr` once its data is on the device: without
  this, every page read while loading stays in the process (a second copy of the weights in RSS until the map
  closes). The map is private and never written, so a later read of the same bytes reads the file again. Arrays not
  backed by a checkpoint's map (conversions, copies) are left alone: above all those over host_memory's pages, which
  may be a CPU tensor's memory now (MADV_DONTNEED would zero them)."""
  base = host_memory.owner(arr)   # through views, and np.frombuffer's memoryview
  if not isinstance(base, mmap.mmap) or isinstance(base, host_memory.HostPages) or not hasattr(base, "madvise") or arr.nbytes == 0:
    return
  try: start = arr.__array_interface__["data"][0] - ctypes.addressof(ctypes.c_char.from_buffer(base))
  except TypeError: return   # a read-only map: not one of ours
  page = mmap.PAGESIZE
  first, end = -(-start // page) * page, (start + arr.nbytes) // page * page   # whole pages inside arr only
  if end > first: base.madvise(mmap.MADV_DONTNEED, first, end - first)


# ---- what the model reads ----

def expected_tensors(config: ModelConfig) -> tuple[dict[str, int], dict[str, tuple[int, int]], list[str]]:
  """The tensors a Llama of this config reads, the one inventory the loaders check and the model prepares:
  vectors name -> length, linears base name -> (rows, inputs), and the linears that carry a bias."""
  c = config
  linears = {"model.embed_tokens": (c.vocab_size, c.hidden_size)}
  if not c.tie_word_embeddings: linears["lm_head"] = (c.vocab_size, c.hidden_size)
  vectors = {"model.norm.weight": c.hidden_size}
  biased = []
  for i in range(c.num_hidden_layers):
    p = f"model.layers.{i}"
    vectors.update({f"{p}.input_layernorm.weight": c.hidden_size, f"{p}.post_attention_layernorm.weight": c.hidden_size})
    if c.sandwich_norms: vectors.update({f"{p}.pre_feedforward_layernorm.weight": c.hidden_size,
                                         f"{p}.post_feedforward_layernorm.weight": c.hidden_size})
    linears.update({f"{p}.self_attn.q_proj": (c.q_size, c.hidden_size), f"{p}.self_attn.k_proj": (c.kv_size, c.hidden_size),
                    f"{p}.self_attn.v_proj": (c.kv_size, c.hidden_size), f"{p}.self_attn.o_proj": (c.hidden_size, c.q_size),
                    f"{p}.mlp.gate_proj": (c.intermediate_size, c.hidden_size), f"{p}.mlp.up_proj": (c.intermediate_size, c.hidden_size),
                    f"{p}.mlp.down_proj": (c.hidden_size, c.intermediate_size)})
    if c.qk_norm: vectors.update({f"{p}.self_attn.q_norm.weight": c.head_dim, f"{p}.self_attn.k_norm.weight": c.head_dim})
    biased += [f"{p}.self_attn.{n}" for n in ("q_proj", "k_proj", "v_proj") if c.attention_bias or c.qkv_bias]
    biased += [f"{p}.self_attn.o_proj"] if c.attention_bias else []
    biased += [f"{p}.mlp.{n}" for n in ("gate_proj", "up_proj", "down_proj") if c.mlp_bias]
  return vectors, linears, biased


_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def check_tensors(config: ModelConfig, tensors: dict, where: str, layers_key: str, show=lambda name: name,
                  stored: bool = True) -> list[str]:
  """Check that every tensor the model reads is there with the shape the config implies, before anything is
  converted or allocated for it. Returns the names the model reads; others are not kept.
  tensors: name -> anything with `.shape` (and, when `stored`, `.ndim` and `.dtype`: 4-bit and 8-bit linears
  are recognised by their `.scales`). `show` turns a name into the file's spelling for messages."""
  vectors, linears, biased = expected_tensors(config)
  keep = []
  def need(name: str, shape: tuple[int, ...]):
    if name not in tensors:
      m = _LAYER.match(name)
      declared = f", though {layers_key} declares {config.num_hidden_layers} layers" if m else ""
      raise ModelLoadError(f"{where}: tensor {show(name)} is missing{declared}")
    if tuple(tensors[name].shape) != shape:
      raise ModelLoadError(f"{where}: tensor {show(name)} has shape {tuple(tensors[name].shape)}, the config implies {shape}")
    keep.append(name)
  for name, n in vectors.items(): need(name, (n,))
  for base, (n, k) in linears.items():
    weight, scales, biases = f"{base}.weight", f"{base}.scales", f"{base}.biases"
    if not stored or scales not in tensors:
      need(weight, (n, k))
    elif biases not in tensors:   # 8-bit: int8 codes and a scale per 32
      if k % 32: raise ModelLoadError(f"{where}: tensor {show(scales)}: 8-bit blocks of 32 do not divide {k} inputs")
      need(weight, (n, k)); need(scales, (n, k // 32))
    else:                         # 4-bit: uint32 words of 8 codes, a scale and bias per group
      groups = tensors[scales].shape[-1] if tensors[scales].ndim == 2 else 0
      if k % 8 or not groups or k % groups:
        raise ModelLoadError(f"{where}: tensor {show(scales)} has shape {tuple(tensors[scales].shape)}, which does not "
                             f"split {k} inputs into 4-bit groups")
      need(weight, (n, k // 8)); need(scales, (n, groups)); need(biases, (n, groups))
      if tensors[weight].dtype.itemsize != 4:
        raise ModelLoadError(f"{where}: tensor {show(weight)} is {tensors[weight].dtype}; packed 4-bit weights are 32-bit words")
    if base in biased or f"{base}.bias" in tensors: need(f"{base}.bias", (n,))
  if "rope_freqs.weight" in tensors: need("rope_freqs.weight", (config.head_dim // 2,))
  return keep


# ---- GGUF ----

_GGUF_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head",
               "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
               "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
               "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
               "ffn_down": "mlp.down_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
               "attn_qkv": "self_attn.qkv_proj"}
GGUF_TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "IQ4_NL")


def _is_gguf(path: Path) -> bool:
  with open(path, "rb") as f: return f.read(4) == b"GGUF"


def hf_name(gguf_name: str, family_names: Mapping[str, str] = {}) -> str:
  """'blk.3.attn_q.weight' -> 'model.layers.3.self_attn.q_proj.weight'; `family_names`: a family's own meanings of
  names inside a block (families.Family.gguf_names)."""
  parts = gguf_name.split(".")
  if parts[0] == "blk" and len(parts) >= 4:
    inner = family_names.get(parts[2]) or _GGUF_NAMES.get(parts[2], parts[2])
    return f"model.layers.{parts[1]}.{inner}.{'.'.join(parts[3:])}"
  if len(parts) < 2: return gguf_name
  return f"{_GGUF_NAMES.get(parts[0], parts[0])}.{'.'.join(parts[1:])}"


_HF_NAMES = {hf: g for g, hf in _GGUF_NAMES.items()}


def gguf_name(name: str, family_names: Mapping[str, str] = {}) -> str:
  """The inverse of hf_name: 'model.layers.3.self_attn.q_proj.weight' -> 'blk.3.attn_q.weight'."""
  base, _, part = name.rpartition(".")
  if m := _LAYER.match(base + "."):
    inner = base[m.end():]
    own = {hf: g for g, hf in family_names.items()}
    return f"blk.{m.group(1)}.{own.get(inner) or _HF_NAMES.get(inner, inner)}.{part}"
  return f"{_HF_NAMES.get(base, base)}.{part}"


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
  """llama.cpp's converter reorders Q/K rows so each head's rotary pairs are interleaved; undo it to get HF's
  rotate-half layout. Rows only move as whole rows, so this works on packed quantized rows too."""
  rows = w.shape[0]
  return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def load_gguf(path: Path, keep_q4: bool = True) -> Checkpoint:
  """keep_q4: quantized linear weights and embedding tables stay as compact as the file has them, exactly: Q4_0/Q4_1
  become INT4 groups of 32 (code for code), Q8_0 int8 codes with float16 scales, the k-quants and Q5_0/Q5_1 the packed
  layout (quant/blocks.py); otherwise everything is dequantized to float32. Tensors are converted when the model
  reads them (LazyTensors), one layer at a time."""
  try: meta, gguf_tensors = read_gguf(path)
  except OSError as e: raise ModelLoadError(f"{path} cannot be read: {e}") from None
  except GGUFError as e:
    msg = str(e).removeprefix(f"{path}: ")
    raise ModelLoadError(f"{path} is not a readable GGUF file: {msg}") from None
  config = ModelConfig.from_gguf(meta, source=str(path))
  arch = meta["general.architecture"]
  family = families.for_gguf(arch)
  permuted, names = family.gguf_rope_permuted, dict(family.gguf_names)
  by_name: dict[str, GGUFTensor] = {}
  for t in gguf_tensors:
    if t.type_name not in GGUF_TENSOR_TYPES:
      raise ModelLoadError(f"{path}: tensor {t.name} has GGUF type {t.type_name}; supported: {', '.join(GGUF_TENSOR_TYPES)}")
    name = hf_name(t.name, names)
    if (m := _LAYER.match(name)) and int(m.group(1)) >= config.num_hidden_layers:
      raise ModelLoadError(f"{path}: tensor {t.name} belongs to layer {int(m.group(1))}, but {arch}.block_count declares "
                           f"{config.num_hidden_layers} layers")
    if name in by_name: raise ModelLoadError(f"{path}: tensors {by_name[name].name} and {t.name} are both {name}")
    by_name[name] = t
  if family.hf_fused:   # Phi-3: attn_qkv and the fused ffn_up, their rows (whole ggml blocks) cut into the parts
    gguf_names = {n: t.name for n, t in by_name.items()}
    split_fused(config, by_name, gguf_names, str(path),
                lambda t, a, b: dataclasses.replace(t, name=f"{t.name}[{a}:{b}]", shape=(b - a, *t.shape[1:]), data=t.data[a:b]),
                show=lambda n: gguf_names.get(n, n))
  if "rope_factors_long.weight" in by_name:   # LongRoPE's divisors travel as tensors (Phi-3.5, Phi-3-128k)
    config = dataclasses.replace(config, rope_scaling={
      "rope_type": "longrope", "short_factor": [float(x) for x in by_name["rope_factors_short.weight"].data],
      "long_factor": [float(x) for x in by_name["rope_factors_long.weight"].data],
      "original_max_position_embeddings": int(meta.get(f"{arch}.rope.scaling.original_context_length", 4096)),
      **({"attention_factor": float(meta[f"{arch}.rope.scaling.attn_factor"])} if f"{arch}.rope.scaling.attn_factor" in meta else {})})
  if "lm_head.weight" not in by_name: config = dataclasses.replace(config, tie_word_embeddings=True)
  # shapes checked before any conversion; tensors the model does not read are not converted (nor kept)
  keep = check_tensors(config, by_name, str(path), f"{arch}.block_count", lambda n: by_name[n].name if n in by_name else gguf_name(n, names),
                       stored=False)
  store, kept_types = LazyTensors(), set()
  for name in keep:
    t = by_name[name]
    compact = keep_q4 and t.type_name in COMPACT_GGUF_TYPES and (int4.is_linear_weight(name) or name in int4.EMBEDDING_NAMES)
    if compact: kept_types.add(t.type_name)
    store.add(_gguf_keys(name, t.type_name if compact else None),
              lambda name=name, t=t, compact=compact: _gguf_arrays(name, t, compact, config, permuted),
              [t.data], _gguf_nbytes(t, compact), _gguf_float_rows(name, t, config, permuted))
  if kept_types:
    smallest = min(int(re.search(r"\d", q).group()) for q in kept_types)
    config = dataclasses.replace(config, quantization={"group_size": ggml.BLOCK, "bits": smallest, "gguf_types": sorted(kept_types)})
  return Checkpoint(config, store, path, gguf_meta=meta)


COMPACT_GGUF_TYPES = ("Q8_0", "Q4_0", "Q4_1", *blocks.GGML_TYPES)


def _gguf_keys(name: str, compact_type: str | None) -> list[str]:
  """The arrays a GGUF tensor becomes: the weight alone (floats), or its quantized parts."""
  base = name[:-len(".weight")]
  if compact_type is None: return [name]
  if compact_type == "Q8_0": return [name, f"{base}.scales"]
  if compact_type in ("Q4_0", "Q4_1"): return [name, f"{base}.scales", f"{base}.biases"]
  return [f"{base}.{p}" for p in blocks.stored_parts(blocks.GGML_SPECS[compact_type])]


def _gguf_nbytes(t: GGUFTensor, compact: bool) -> int:
  n = math.prod(t.shape)
  if not compact: return 4 * n if t.type_name not in ("F32", "F16") else t.data.nbytes
  if t.type_name == "Q8_0": return n + n // 16
  if t.type_name in ("Q4_0", "Q4_1"): return n // 2 + n // 8
  return blocks.packed_nbytes(blocks.GGML_SPECS[t.type_name], math.prod(t.shape[:-1]), t.shape[-1])


def _gguf_float_rows(name: str, t: GGUFTensor, config: ModelConfig, permuted: bool) -> FloatRows | None:
  """A float or Q8_0 weight's rows as floats, a slice at a time (FloatRows), in the order _gguf_arrays gives them."""
  if t.type_name not in ("F32", "F16", "BF16", "Q8_0") or len(t.shape) != 2: return None
  to_float = {"BF16": bf16_to_float32, "Q8_0": lambda raw: ggml.dequantize(raw, "Q8_0", (len(raw), t.shape[1]))}.get(t.type_name, lambda a: a)
  order = None   # llama.cpp's order of Q/K rows, undone row by row (unpermute_rope_rows)
  if permuted and name.endswith(("self_attn.q_proj.weight", "self_attn.k_proj.weight")):
    order = unpermute_rope_rows(np.arange(t.shape[0]), config.num_attention_heads if "q_proj" in name else config.num_key_value_heads)
  rows = (lambda i, j: t.data[i:j]) if order is None else (lambda i, j: t.data[order[i:j]])
  return FloatRows(tuple(t.shape), lambda i, j: to_float(rows(i, j)), t.data)


def _gguf_arrays(name: str, t: GGUFTensor, compact: bool, config: ModelConfig, permuted: bool) -> dict[str, np.ndarray]:
  """One GGUF tensor as the model reads it (see load_gguf). `permuted`: the architecture's Q/K rows are in llama.cpp's
  order (families.Family.gguf_rope_permuted); rows move as whole rows, so that order is undone on raw quantized blocks
  just like on floats."""
  qtype, shape, data, base = t.type_name, t.shape, t.data, name[:-len(".weight")]
  if permuted and name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
    data = unpermute_rope_rows(data, config.num_attention_heads)
  if permuted and name.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias")):
    data = unpermute_rope_rows(data, config.num_key_value_heads)
  if compact and qtype == "Q8_0":
    codes, d = ggml.q8_0_parts(data)
    out = host_memory.empty(shape, np.int8)   # the one copy out of the 34-byte blocks, into pages the CPU tensor takes
    out.reshape(codes.shape)[...] = codes
    return {name: out, f"{base}.scales": d.astype(np.float16)}   # d is float16 in the file
  if compact and qtype in ("Q4_0", "Q4_1"):
    return dict(zip((name, f"{base}.scales", f"{base}.biases"), int4.from_ggml_q4(data, qtype, shape)))
  if compact: return {f"{base}.{p}": a for p, a in blocks.from_ggml(data, qtype, shape, done=release)[0].items()}
  if qtype in ggml.BLOCK_BYTES: return {name: ggml.dequantize(data, qtype, shape)}
  if qtype in blocks.GGML_TYPES: return {name: blocks.dequantize(*blocks.from_ggml(data, qtype, shape))}
  if qtype == "BF16": return {name: bf16_to_float32(data)}
  return {name: data}
