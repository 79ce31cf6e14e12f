"""Read a GGUF file (v2/v3, little-endian): its key/value metadata and its tensors, memory-mapped.

gguf.GGUFReader builds a numpy view for every element of every metadata array: 6.6 s for SmolLM2's 49k-token
vocabulary on this machine, 14 s for Llama-3's 128k tokens and 280k merges. Reading the strings directly takes
well under a second, so the loader and the GGUF tokenizer both read files here. The `gguf` package still
provides the enums (value types, tensor types and their block sizes).
"""
from __future__ import annotations
import mmap, struct
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


def read_gguf(path: str | Path, with_tensors: bool = True) -> tuple[dict[str, Any], list[GGUFTensor]]:
  """(metadata, tensors). Tensor data are views of a read-only memory map that lives as long as they do."""
  path = Path(path)
  with open(path, "rb") as f:
    try: buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except ValueError: raise GGUFError(f"{path}: empty file, not GGUF") from None
  if buf[:4] != b"GGUF": raise GGUFError(f"{path}: not a GGUF file")
  try:
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
    if version not in (2, 3): raise GGUFError(f"{path}: GGUF version {version} is not supported (only 2 and 3)")
    pos, meta = 24, {}
    for _ in range(n_kv):
      key, pos = _read_string(buf, pos)
      (vtype,), pos = struct.unpack_from("<I", buf, pos), pos + 4
      meta[key], pos = _read_value(buf, pos, vtype)
    if not with_tensors:
      buf.close()   # metadata values are copies
      return meta, []
    infos = []
    for _ in range(n_tensors):
      name, pos = _read_string(buf, pos)
      (n_dims,) = struct.unpack_from("<I", buf, pos)
      dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
      ttype, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
      pos += 4 + 8 * n_dims + 12
      try: ttype = GGMLQuantizationType(ttype)
      except ValueError: raise GGUFError(f"{path}: tensor {name} has GGML type {ttype}, which this gguf package does not know") from None
      infos.append((name, tuple(int(d) for d in reversed(dims)), ttype, offset))
  except (struct.error, ValueError, KeyError) as e:
    if isinstance(e, GGUFError): raise
    raise GGUFError(f"{path}: corrupt GGUF header or metadata: {e}") from None
  align = meta.get("general.alignment", 32)
  if not isinstance(align, int) or isinstance(align, bool) or align <= 0:
    raise GGUFError(f"{path}: general.alignment must be a positive integer, got {align!r}")
  data_start = (pos + align - 1) // align * align
  return meta, [_tensor(path, buf, data_start, *info) for info in infos]


def _tensor(path: Path, buf, data_start: int, name: str, shape: tuple[int, ...], ttype, offset: int) -> GGUFTensor:
  block, block_bytes = GGML_QUANT_SIZES[ttype]
  n = int(np.prod(shape)) if shape else 1
  if shape and shape[-1] == 0: raise GGUFError(f"{path}: tensor {name} has an empty innermost dimension")
  rows, row_len = (n // shape[-1], shape[-1]) if shape else (1, 1)
  if row_len % block: raise GGUFError(f"{path}: tensor {name} has rows of {row_len}, not a multiple of {ttype.name}'s {block}")
  nbytes = rows * row_len // block * block_bytes
  start = data_start + offset
  if start + nbytes > len(buf): raise GGUFError(f"{path}: tensor {name} runs past the end of the file (truncated?)")
  raw = np.frombuffer(buf, np.uint8, nbytes, start)
  dtype = _PLAIN_DTYPES.get(ttype.name)
  data = raw.view(dtype).reshape(shape) if dtype is not None else raw.reshape(rows, -1)
  return GGUFTensor(name, shape, ttype.name, data)


def _read_string(buf, pos: int) -> tuple[str, int]:
  (n,) = struct.unpack_from("<Q", buf, pos)
  return buf[pos + 8:pos + 8 + n].decode("utf-8", errors="replace"), pos + 8 + n


def _read_value(buf, pos: int, vtype: int) -> tuple[Any, int]:
  vtype = GGUFValueType(vtype)
  if vtype == GGUFValueType.STRING: return _read_string(buf, pos)
  if vtype != GGUFValueType.ARRAY:
    fmt = _SCALAR_FORMATS[vtype]
    return struct.unpack_from(fmt, buf, pos)[0], pos + struct.calcsize(fmt)
  itype, count = struct.unpack_from("<IQ", buf, pos)
  pos += 12
  itype = GGUFValueType(itype)
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
    return items, pos
  for _ in range(count):
    item, pos = _read_value(buf, pos, itype)
    items.append(item)
  return items, pos
