"""quant/blocks.py, the packed layout of k-quants, Q5_0/Q5_1 and MLX's other bit widths, against the formats' own
dequantizers: `gguf.quants.dequantize` for GGUF blocks (random valid blocks, written into a GGUF file with
gguf.GGUFWriter and read back by our reader) and `mlx.core.dequantize` for MLX's. Equal bit for bit."""
from __future__ import annotations
import numpy as np
import pytest
from tinyvllm import host_memory
from tinyvllm.quant import blocks, int4
from tinyvllm.quant.formats import QuantSpec, spec_of

# where each ggml type keeps its float16 fields (offsets in a block): set to finite values, the rest is random bytes
F16_FIELDS = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "Q3_K": (108,), "Q5_0": (0,), "Q5_1": (0, 2), "IQ4_XS": (0,), "IQ4_NL": (0,)}
EXPECTED = {"Q4_K": QuantSpec(4, 32, 8, k_scales=True), "Q5_K": QuantSpec(5, 32, 8, k_scales=True),
            "Q6_K": QuantSpec(6, 16, 16, signed_scales=True, symmetric=True),
            "Q3_K": QuantSpec(4, 16, 16, signed_scales=True, symmetric=True),
            "Q5_0": QuantSpec(5, 32, symmetric=True), "Q5_1": QuantSpec(5, 32),
            "IQ4_XS": QuantSpec(4, 32, 8, signed_scales=True, symmetric=True, codebook=True),
            "IQ4_NL": QuantSpec(4, 32, symmetric=True, codebook=True)}
BITS_PER_WEIGHT = {"Q4_K": 4.5, "Q5_K": 5.5, "Q6_K": 6.5625, "Q3_K": 4.5625, "Q5_0": 5.5, "Q5_1": 6.0, "IQ4_XS": 4.3125, "IQ4_NL": 4.5}


def random_ggml(qtype: str, rows: int, cols: int, rng) -> np.ndarray:
  """Raw blocks `[rows, bytes per row]` of a valid tensor: random bytes, finite float16 scales of either sign."""
  block, nbytes = blocks.GGML_TYPES[qtype]
  raw = rng.integers(0, 256, (rows, cols // block, nbytes), dtype=np.uint8)
  for at in F16_FIELDS[qtype]:
    raw[..., at:at + 2] = (rng.standard_normal(raw.shape[:-1]) * 0.02).astype(np.float16)[..., None].view(np.uint8)
  return raw.reshape(rows, -1)


@pytest.mark.parametrize("qtype", list(blocks.GGML_TYPES))
def test_ggml_blocks_repack_exactly(qtype, tmp_path):
  import gguf
  from gguf.quants import dequantize as gguf_dequantize
  from tinyvllm.model.gguf_file import read_gguf
  rng = np.random.default_rng(list(blocks.GGML_TYPES).index(qtype))
  shapes = {"a": (12, 512), "b": (8, 256)}
  raws = {n: random_ggml(qtype, *s, rng) for n, s in shapes.items()}
  writer = gguf.GGUFWriter(tmp_path / "t.gguf", "llama")
  for name, raw in raws.items(): writer.add_tensor(name, raw, raw_dtype=gguf.GGMLQuantizationType[qtype])
  writer.write_header_to_file(); writer.write_kv_data_to_file(); writer.write_tensors_to_file(); writer.close()
  _, tensors = read_gguf(tmp_path / "t.gguf")
  for t in tensors:
    assert t.type_name == qtype and t.shape == shapes[t.name]
    parts, spec = blocks.from_ggml(t.data, qtype, t.shape)
    assert spec == EXPECTED[qtype] and spec.bytes_per_weight() * 8 == BITS_PER_WEIGHT[qtype]
    assert spec_of({f"x.{p}": a for p, a in parts.items()}, "x") == spec   # the spec travels in its array
    assert tuple(parts) == blocks.stored_parts(spec) and len(parts) <= 4   # at most three arrays and the spec
    assert {p: a.shape for p, a in parts.items() if p != "qspec"} == blocks.part_shapes(spec, *t.shape)
    assert sum(a.nbytes for p, a in parts.items() if p != "qspec") == blocks.packed_nbytes(spec, *t.shape) == spec.bytes_per_weight() * np.prod(t.shape)
    ref = gguf_dequantize(raws[t.name], gguf.GGMLQuantizationType[qtype]).reshape(shapes[t.name])
    ours = blocks.dequantize(parts, spec)
    assert ours.dtype == np.float32 and np.array_equal(ours, ref), np.abs(ours - ref).max()


def test_ggml_sizes_are_checked():
  rng = np.random.default_rng(9)
  with pytest.raises(ValueError, match="multiple of 256"): blocks.from_ggml(random_ggml("Q4_K", 2, 256, rng), "Q4_K", (2, 384))
  with pytest.raises(ValueError, match="does not match"): blocks.from_ggml(random_ggml("Q6_K", 2, 256, rng)[:, :-1], "Q6_K", (2, 256))


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("G", [32, 64, 128])
def test_mlx_bit_widths_repack_exactly(bits, G):
  """MLX's b-bit affine weights (codes as one bit stream per row): equal to mlx.core.dequantize of the same codes
  with our float16 scales and biases (the contract's dtype for them, as for 4-bit MLX checkpoints)."""
  mx = pytest.importorskip("mlx.core", reason="mlx is not installed")
  rng = np.random.default_rng(bits * 1000 + G)
  q, s, b = mx.quantize(mx.array(rng.standard_normal((16, 512)).astype(np.float16)), group_size=G, bits=bits)
  parts, spec = blocks.from_mlx(np.array(q), np.array(s), np.array(b), bits)
  assert spec == QuantSpec(max(bits, 4), G) and parts["scales"].dtype == np.float16
  assert ("qspec" in parts) == (bits > 4)   # 3-bit codes fit INT4's layout, which needs no spec
  theirs = np.array(mx.dequantize(q, mx.array(parts["scales"].astype(np.float32)), mx.array(parts["biases"].astype(np.float32)),
                                  group_size=G, bits=bits))
  assert np.array_equal(blocks.dequantize(parts, spec), theirs)


@pytest.mark.parametrize("bits", [4, 5, 6, 8])
@pytest.mark.parametrize("K", [96, 512])   # 3 runs (a partial block of high bits for 5 and 6 bits) and 16
def test_bit_planes_round_trip(bits, K):
  q = np.random.default_rng(bits).integers(0, 1 << bits, (5, K)).astype(np.uint8)
  weight = blocks.pack_codes(q, bits)
  R, NB = blocks.high_blocks(K, bits) if bits > 4 else (0, 0)
  assert weight.dtype == np.uint32 and weight.shape == (5, K // 8 + 8 * NB)
  np.testing.assert_array_equal(blocks.unpack_codes(weight, bits, K), q)
  np.testing.assert_array_equal(weight[:, :K // 8], int4.pack(q & 15))   # the nibble plane is INT4's layout
  if bits > 4:   # the documented order: byte i of a block, bits h*j: run j's input i
    h, block = bits - 4, weight[0, K // 8:K // 8 + 8].astype("<u4").view(np.uint8)
    for j in range(min(R, K // 32)):
      want = [int(q[0, 32 * j + i]) >> 4 for i in range(32)]
      assert [(int(b) >> (h * j)) & ((1 << h) - 1) for b in block] == want


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q5_0"])
def test_big_tables_convert_in_slices(qtype, monkeypatch):
  """A table of more than ROWS_AT_ONCE weights converts a slice of rows at a time, on a few threads, into
  preallocated arrays: the same arrays as converting it whole (which the tests above compare with gguf's
  dequantizer), over pages a CPU tensor takes as they are (host_memory.py)."""
  rng = np.random.default_rng(7)
  raw = random_ggml(qtype, 40, 512, rng)
  whole, spec = blocks.from_ggml(raw, qtype, (40, 512))
  monkeypatch.setattr(blocks, "ROWS_AT_ONCE", 512 * 7)   # 7 rows a slice: 6 slices, the last one partial
  handed = []   # the loader releases each slice's source rows as they are converted
  sliced, spec2 = blocks.from_ggml(raw, qtype, (40, 512), done=handed.append)
  assert sorted(len(r) for r in handed) == [5] + [7] * 5
  np.testing.assert_array_equal(np.concatenate(sorted(handed, key=lambda r: r.ctypes.data)), raw.reshape(40, -1))
  assert spec2 == spec and sliced.keys() == whole.keys()
  for p in whole:
    assert sliced[p].dtype == whole[p].dtype
    np.testing.assert_array_equal(sliced[p], whole[p], err_msg=p)
    if p != "qspec": assert host_memory.pages_of(sliced[p]) is not None, p


@pytest.mark.parametrize("bits", [3, 6, 8])
def test_big_mlx_tables_convert_in_slices(bits, monkeypatch):
  """As for GGUF blocks: an MLX table converted a slice of rows at a time equals converting it whole (which the test
  above compares with mlx.core.dequantize), and lands in pages a CPU tensor takes as they are."""
  mx = pytest.importorskip("mlx.core", reason="mlx is not installed")
  rng = np.random.default_rng(bits)
  q, s, b = (np.array(a) for a in mx.quantize(mx.array(rng.standard_normal((40, 256)).astype(np.float16)), group_size=64, bits=bits))
  whole, spec = blocks.from_mlx(q, s, b, bits)
  monkeypatch.setattr(blocks, "ROWS_AT_ONCE", 256 * 7)   # 7 rows a slice: 6 slices, the last one partial
  sliced, spec2 = blocks.from_mlx(q, s, b, bits)
  assert spec2 == spec and sliced.keys() == whole.keys()
  for p in whole:
    assert sliced[p].dtype == whole[p].dtype
    np.testing.assert_array_equal(sliced[p], whole[p], err_msg=p)
    if p != "qspec": assert host_memory.pages_of(sliced[p]) is not None, p


def test_byte_counts_include_a_padded_block():
  """Q5_0 rows of 896 inputs (28 runs; blocks of 8 runs) store 4 blocks of high bits, 128 bytes, not 112: the loader's
  byte counts (what the cache plan and progress bar read) come from the arrays' real shapes."""
  rng = np.random.default_rng(9)
  parts, spec = blocks.from_ggml(random_ggml("Q5_0", 8, 896, rng), "Q5_0", (8, 896))
  assert parts["weight"].shape == (8, 896 // 8 + 4 * 8)
  assert sum(a.nbytes for p, a in parts.items() if p != "qspec") == blocks.packed_nbytes(spec, 8, 896) > spec.bytes_per_weight() * 8 * 896


def test_k_scales_only_for_the_layout_the_kernels_unpack():
  """k_scales means 8 unsigned 6-bit scales and mins per super-block of 8 affine groups of 32 (Q4_K, Q5_K): the
  kernels unpack exactly that, so any other spec with it is refused where it is made."""
  assert blocks.GGML_SPECS["Q4_K"].k_scales and blocks.GGML_SPECS["Q4_K"].bytes_per_weight() == 4.5 / 8
  for bad in (dict(bits=6, group=16, super_groups=16, signed_scales=True, symmetric=True), dict(bits=5, group=32)):
    with pytest.raises(ValueError, match="k_scales"): QuantSpec(**bad, k_scales=True)
