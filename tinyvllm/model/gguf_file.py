"""Read a GGUF file (v2/v3, little-endian): its key/value metadata and its tensors, memory-mapped.

gguf.GGUFReader builds a numpy view for every element of every metadata array: 6.6 s for SmolLM2's 49k-token
vocabulary on this machine, 14 s for Llama-3's 128k tokens and 280k merges. Reading the strings directly takes
well under a second, so the loader and the GGUF tokenizer both read files here. The `gguf` package still
provides the enums (value types, tensor types and their block sizes).
"""
from __future__ import annotations
import math, mmap, struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType


class GGUFError(ValueError):
  """A file that is not GGUF, or whose header, metadata or tensor table cannot be read."""


@dataclass(frozen=True)
class GGUFTensor:
  name: str                  # as in the file: "blk.3.attn_q.weight"
  shape: tuple[int, ...]     # numpy order: rows outermost (GGUF lists dimensions innermost first)
  type_name: str             # "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q8_0", ...
  data: np.ndarray           # read-only view of the file: F32/F16 as floats in `shape`, BF16 as uint16 in
                             # `shape`, block-quantized types as raw bytes [rows, bytes_per_row]


_SCALAR_FORMATS = {GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H",
                   GGUFValueType.INT16: "<h", GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
                   GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?", GGUFValueType.UINT64: "<Q",
                   GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d"}
_PLAIN_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64,
                 "I8": np.int8, "I16": np.int16, "I32": np.int32, "I64": np.int64}


def read_gguf_metadata(path: str | Path) -> dict[str, Any]:
  """The key/value metadata only. Numeric arrays come back as numpy arrays, string arrays as lists of str."""
  return read_gguf(path, with_tensors=False)[0]


MAX_ARRAY_NESTING = 8   # arrays of arrays: real files nest at most once; a corrupt one must not exhaust the stack
MAX_DIMS = 8            # ggml's tensors have at most 4
# the least a metadata entry (key length, value type, a 1-byte value) and a tensor entry (name length, dimension
# count, type, offset) can take: counts claiming more entries than the file can hold are refused before reading
_MIN_KV_BYTES, _MIN_TENSOR_BYTES = 8 + 4 + 1, 8 + 4 + 4 + 8


def read_gguf(path: str | Path, with_tensors: bool = True) -> tuple[dict[str, Any], list[GGUFTensor]]:
  """(metadata, tensors). Tensor data are views of a private (copy-on-write) memory map that lives as long as they
  do: writable, as device copy-in needs (CUDA's takes the address of a writable buffer), though nothing writes them
  and the file never changes.
  Every count, length, dimension and offset is checked against the file's size before it is used, so a
  corrupt file raises GGUFError naming the file (and the key or tensor) instead of allocating or overflowing."""
  path = Path(path)
  with open(path, "rb") as f:
    try: buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    except ValueError: raise GGUFError(f"{path}: empty file, not GGUF") from None
  try:
    meta, infos, data_start = _read_header(path, buf, with_tensors)
  except BaseException:
    buf.close()
    raise
  if not with_tensors:
    buf.close()   # metadata values are copies
    return meta, []
  return meta, [_tensor(buf, data_start, *info) for info in infos]


def _read_header(path: Path, buf, with_tensors: bool) -> tuple[dict[str, Any], list[tuple], int]:
  size = len(buf)
  if buf[:4] != b"GGUF": raise GGUFError(f"{path}: not a GGUF file")
  if size < 24: raise GGUFError(f"{path}: truncated GGUF header ({size} bytes)")
  version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
  if version not in (2, 3): raise GGUFError(f"{path}: GGUF version {version} is not supported (only 2 and 3)")
  if n_kv * _MIN_KV_BYTES + n_tensors * _MIN_TENSOR_BYTES > size - 24:
    raise GGUFError(f"{path}: the header declares {n_kv} metadata keys and {n_tensors} tensors, more than a file of "
                    f"{size} bytes can hold (corrupt or truncated)")
  pos, meta = 24, {}
  for i in range(n_kv):
    key = f"#{i}"   # until its name is read
    try:
      key, pos = _read_string(buf, pos)
      (vtype,), pos = struct.unpack_from("<I", buf, pos), pos + 4
      value, pos = _read_value(buf, pos, vtype, 0)
    except (struct.error, OverflowError):
      raise GGUFError(f"{path}: metadata key {_show(key)} runs past the end of the file (truncated?)") from None
    except ValueError as e:   # GGUFError, or an unknown value type
      raise GGUFError(f"{path}: metadata key {_show(key)}: {e}") from None
    if key in meta: raise GGUFError(f"{path}: metadata key {_show(key)} appears twice")
    meta[key] = value
  if not with_tensors: return meta, [], 0
  align = meta.get("general.alignment", 32)
  if not isinstance(align, int) or isinstance(align, bool) or align <= 0 or align & (align - 1):
    raise GGUFError(f"{path}: metadata key general.alignment must be a power of two, got {align!r}")
  raw_infos = []
  for i in range(n_tensors):
    name = f"#{i}"
    try:
      name, pos = _read_string(buf, pos)
      (n_dims,) = struct.unpack_from("<I", buf, pos)
      if n_dims > MAX_DIMS: raise GGUFError(f"{n_dims} dimensions (at most {MAX_DIMS})")
      dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
      ttype, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
      pos += 4 + 8 * n_dims + 12
    except (struct.error, OverflowError):
      raise GGUFError(f"{path}: the entry of tensor {_show(name)} runs past the end of the file (truncated?)") from None
    except ValueError as e:   # GGUFError
      raise GGUFError(f"{path}: the entry of tensor {_show(name)}: {e}") from None
    raw_infos.append((name, dims, ttype, offset))
  data_start = (pos + align - 1) // align * align
  infos, seen = [], set()
  for name, dims, ttype, offset in raw_infos:
    where = f"{path}: tensor {_show(name)}"
    if name in seen: raise GGUFError(f"{where} appears twice")
    seen.add(name)
    try: ttype = GGMLQuantizationType(ttype)
    except ValueError: raise GGUFError(f"{where} has GGML type {ttype}, which this gguf package does not know") from None
    if ttype not in GGML_QUANT_SIZES: raise GGUFError(f"{where} has GGML type {ttype.name}, whose block size is unknown")
    shape = tuple(reversed(dims))   # numpy order; Python ints, so no product below can overflow
    if 0 in shape: raise GGUFError(f"{where} has an empty dimension: {shape}")
    block, block_bytes = GGML_QUANT_SIZES[ttype]
    row_len = shape[-1] if shape else 1
    if row_len % block: raise GGUFError(f"{where} has rows of {row_len}, not a multiple of {ttype.name}'s {block}")
    nbytes = math.prod(shape) // block * block_bytes
    if offset % align: raise GGUFError(f"{where} starts at offset {offset}, not a multiple of the alignment {align}")
    if data_start + offset + nbytes > size:
      raise GGUFError(f"{where} ({ttype.name} {shape}, {nbytes} bytes at offset {offset}) runs past the end of the "
                      f"file ({size} bytes; truncated?)")
    infos.append((name, shape, ttype, offset, nbytes))
  return meta, infos, data_start


def _tensor(buf, data_start: int, name: str, shape: tuple[int, ...], ttype, offset: int, nbytes: int) -> GGUFTensor:
  raw = np.frombuffer(buf, np.uint8, nbytes, data_start + offset)
  dtype = _PLAIN_DTYPES.get(ttype.name)
  rows = math.prod(shape[:-1]) if shape else 1
  data = raw.view(dtype).reshape(shape) if dtype is not None else raw.reshape(rows, -1)
  return GGUFTensor(name, shape, ttype.name, data)


def _show(s: str) -> str:
  """A name from the file, for a message: quoted, and cut short if a corrupt length made it huge."""
  return repr(s) if len(s) <= 120 else repr(s[:120]) + f"... ({len(s)} characters)"


def _read_string(buf, pos: int) -> tuple[str, int]:
  (n,) = struct.unpack_from("<Q", buf, pos)
  end = pos + 8 + n
  if end > len(buf): raise GGUFError(f"a string of {n} bytes at offset {pos} runs past the end of the file (truncated?)")
  return buf[pos + 8:end].decode("utf-8", errors="replace"), end


def _read_value(buf, pos: int, vtype: int, depth: int) -> tuple[Any, int]:
  try: vtype = GGUFValueType(vtype)
  except ValueError: raise GGUFError(f"unknown value type {vtype}") from None
  if vtype == GGUFValueType.STRING: return _read_string(buf, pos)
  if vtype != GGUFValueType.ARRAY:
    fmt = _SCALAR_FORMATS[vtype]
    return struct.unpack_from(fmt, buf, pos)[0], pos + struct.calcsize(fmt)
  if depth >= MAX_ARRAY_NESTING: raise GGUFError(f"arrays nested more than {MAX_ARRAY_NESTING} deep")
  itype, count = struct.unpack_from("<IQ", buf, pos)
  pos += 12
  try: itype = GGUFValueType(itype)
  except ValueError: raise GGUFError(f"array of unknown value type {itype}") from None
  # the least room each element takes: refuse counts the rest of the file cannot hold before looping or allocating
  least = np.dtype(_SCALAR_FORMATS[itype]).itemsize if itype in _SCALAR_FORMATS else 8 if itype == GGUFValueType.STRING else 12
  if count * least > len(buf) - pos:
    raise GGUFError(f"array of {count} {itype.name} values runs past the end of the file (truncated?)")
  if itype in _SCALAR_FORMATS:
    dtype = np.dtype(_SCALAR_FORMATS[itype])
    return np.frombuffer(buf, dtype, count, pos).copy(), pos + count * dtype.itemsize
  items = []
  if itype == GGUFValueType.STRING:  # the hot loop: one iteration per token / merge
    length, append = struct.Struct("<Q").unpack_from, items.append
    for _ in range(count):
      (n,) = length(buf, pos)
      append(buf[pos + 8:pos + 8 + n].decode("utf-8", errors="replace"))
      pos += 8 + n
    # checked once after the loop (lengths only grow `pos`): a string past the end leaves pos past the end
    if pos > len(buf): raise GGUFError(f"array of {count} strings runs past the end of the file (truncated?)")
    return items, pos
  for _ in range(count):
    item, pos = _read_value(buf, pos, itype, depth + 1)
    items.append(item)
  return items, pos
