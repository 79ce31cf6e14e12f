"""Corrupt checkpoints raise ModelLoadError or ConfigError naming the file (and the key or tensor), never a raw
exception: one test per corruption reported against the loader, a seeded fuzz over a small GGUF and a small
safetensors checkpoint, and the sdist extraction's refusal of members that lead out of the cache."""
from __future__ import annotations
import io, json, math, random, resource, signal, struct, tarfile, time
from pathlib import Path
import gguf
import numpy as np
import pytest
from conftest import make_tiny_llama
from test_weights import write_gguf
from tinyvllm.config import ConfigError
from tinyvllm.model.fetch import FetchError, extract_members
from tinyvllm.model.tokenizer import TokenizerError, load_tokenizer
from tinyvllm.model.weights import ModelLoadError, load_checkpoint

# small enough that each file is a few tens of KB, with every dimension a multiple of ggml's block of 32
TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
            max_position_embeddings=64)


# ---- building files by hand (GGUF v3: magic, version, tensor count, key count, keys, tensor entries, data) ----

GGUF_U32, GGUF_F32, GGUF_STRING, GGUF_ARRAY = 4, 6, 8, 9

def gguf_str(s: str | bytes) -> bytes:
  b = s.encode() if isinstance(s, str) else s
  return struct.pack("<Q", len(b)) + b

def gguf_kv(key: str, vtype: int, payload: bytes) -> bytes: return gguf_str(key) + struct.pack("<I", vtype) + payload

def gguf_u32(key: str, v: int) -> bytes: return gguf_kv(key, GGUF_U32, struct.pack("<I", v))

def gguf_tensor(name: str, dims: list[int], ttype: int, offset: int) -> bytes:
  """A tensor entry; dims innermost first, as GGUF stores them."""
  return gguf_str(name) + struct.pack(f"<I{len(dims)}Q", len(dims), *dims) + struct.pack("<IQ", ttype, offset)

def gguf_bytes(kvs: list[bytes], tensors: list[bytes] = (), data: bytes = b"", n_kv: int | None = None,
               n_tensors: int | None = None) -> bytes:
  body = b"GGUF" + struct.pack("<IQQ", 3, len(tensors) if n_tensors is None else n_tensors, len(kvs) if n_kv is None else n_kv)
  body += b"".join(kvs) + b"".join(tensors)
  return body + b"\0" * (-len(body) % 32) + data

def llama_kvs(**overrides) -> list[bytes]:
  """The metadata of a one-layer llama of TINY's sizes, as GGUF keys."""
  vals = {"block_count": 1, "embedding_length": 32, "feed_forward_length": 64, "attention.head_count": 2,
          "attention.head_count_kv": 1, "context_length": 64, "vocab_size": 64} | overrides
  return [gguf_kv("general.architecture", GGUF_STRING, gguf_str("llama"))] + [gguf_u32(f"llama.{k}", v) for k, v in vals.items()]

def safetensors_bytes(header, data: bytes = b"", header_len: int | None = None) -> bytes:
  h = header if isinstance(header, bytes) else json.dumps(header).encode()
  return struct.pack("<Q", len(h) if header_len is None else header_len) + h + data


# ---- valid tiny checkpoints ----

# every tensor type the loader reads, so the fuzz reaches each conversion
FUZZ_TYPES = {"token_embd": "Q8_0", "output": "F16", "attn_q": "Q4_0", "attn_k": "Q4_1", "attn_v": "F16", "attn_output": "BF16",
              "ffn_gate": "Q8_0", "ffn_up": "F32", "ffn_down": "Q4_1"}


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory) -> Path:
  """A tiny Llama in HF layout (bf16 safetensors, so the reader's bf16 path is fuzzed too) with its tokenizer."""
  return make_tiny_llama(tmp_path_factory.mktemp("tiny-corrupt"), dtype="bfloat16", **TINY)


@pytest.fixture(scope="module")
def tiny_gguf(tiny_hf, tmp_path_factory) -> Path:
  out = tmp_path_factory.mktemp("tiny-gguf") / "tiny.gguf"
  write_gguf(tiny_hf, out, FUZZ_TYPES)
  return out


def hf_dir_with(tmp_path: Path, tiny_hf: Path, weights: bytes | None = None, config: dict | None = None) -> Path:
  """A copy of the tiny HF checkpoint with its model.safetensors and/or config.json replaced."""
  d = tmp_path / "ckpt"
  d.mkdir(exist_ok=True)
  (d / "config.json").write_text(json.dumps(config) if config is not None else (tiny_hf / "config.json").read_text())
  (d / "model.safetensors").write_bytes(weights if weights is not None else (tiny_hf / "model.safetensors").read_bytes())
  return d


def raises_naming(path: Path, *names: str, kind=(ModelLoadError, ConfigError)) -> str:
  with pytest.raises(kind) as info: load_checkpoint(path)
  msg = str(info.value)
  for name in (str(path), *names): assert name in msg, f"{name!r} not in the message: {msg}"
  return msg


# ---- GGUF ----

@pytest.mark.parametrize("field", ["n_kv", "n_tensors"])
def test_gguf_huge_counts(tmp_path, field):
  path = tmp_path / "counts.gguf"
  path.write_bytes(gguf_bytes(llama_kvs(), **{field: 1 << 60}))
  raises_naming(path, str(1 << 60), kind=ModelLoadError)


def test_gguf_dims_product_overflows_int64(tmp_path):
  path = tmp_path / "dims.gguf"
  path.write_bytes(gguf_bytes(llama_kvs(), [gguf_tensor("blk.0.attn_q.weight", [32, 1 << 40, 1 << 40], 0, 0)], b"\0" * 4096))
  raises_naming(path, "blk.0.attn_q.weight", kind=ModelLoadError)
  path.write_bytes(gguf_bytes(llama_kvs(), [gguf_tensor("blk.0.attn_q.weight", [(1 << 64) - 1, 2], 0, 0)], b"\0" * 4096))
  raises_naming(path, "blk.0.attn_q.weight", kind=ModelLoadError)


def test_gguf_deeply_nested_arrays(tmp_path):
  depth = 200_000
  nested = struct.pack("<I", GGUF_ARRAY) + (struct.pack("<IQ", GGUF_ARRAY, 1)) * depth + struct.pack("<IQ", GGUF_U32, 0)
  path = tmp_path / "nested.gguf"
  path.write_bytes(gguf_bytes(llama_kvs() + [gguf_str("evil.nested") + nested]))
  raises_naming(path, "evil.nested", "nested", kind=ModelLoadError)


def test_gguf_block_count_implausible(tmp_path):
  path = tmp_path / "layers.gguf"
  path.write_bytes(gguf_bytes(llama_kvs(block_count=10 ** 6)))
  raises_naming(path, "llama.block_count", kind=ConfigError)


def test_gguf_layers_missing_for_block_count(tiny_hf, tmp_path):
  """block_count says 3, the file has the tensors of 2 layers: the message names the first missing one."""
  path = tmp_path / "three.gguf"
  write_gguf(tiny_hf, path, FUZZ_TYPES, block_count=3)
  raises_naming(path, "blk.2.", "llama.block_count", kind=ModelLoadError)


def test_gguf_implausible_sizes(tmp_path):
  for key, value in (("vocab_size", 10 ** 9), ("embedding_length", 1 << 30), ("attention.head_count", 0)):
    path = tmp_path / f"{key}.gguf"
    path.write_bytes(gguf_bytes(llama_kvs(**{key: value})))
    raises_naming(path, f"llama.{key}", kind=ConfigError)


def test_gguf_truncated_string_and_tensor(tiny_gguf, tmp_path):
  data = tiny_gguf.read_bytes()
  for cut in (30, 200, len(data) - 100):
    path = tmp_path / f"cut{cut}.gguf"
    path.write_bytes(data[:cut])
    raises_naming(path, "truncated", kind=ModelLoadError)


def test_valid_tiny_files_load(tiny_hf, tiny_gguf):
  """The fuzz starts from files that load."""
  for path in (tiny_hf, tiny_gguf):
    ckpt = load_checkpoint(path)
    assert ckpt.config.hidden_size == 32 and ckpt.config.num_hidden_layers == 2
    assert ckpt.tensors["model.layers.1.mlp.down_proj.weight"].shape[0] == 32


# ---- safetensors and config.json ----

def test_safetensors_header_length_huge(tiny_hf, tmp_path):
  d = hf_dir_with(tmp_path, tiny_hf, safetensors_bytes({}, header_len=1 << 62))
  raises_naming(d, str(d / "model.safetensors"), "header length", str(1 << 62), kind=ModelLoadError)


def test_safetensors_offsets_past_end(tiny_hf, tmp_path):
  header = {"model.embed_tokens.weight": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 64]}}
  d = hf_dir_with(tmp_path, tiny_hf, safetensors_bytes(header, b"\0" * 32))
  raises_naming(d, str(d / "model.safetensors"), "model.embed_tokens.weight", "data_offsets", kind=ModelLoadError)


def test_safetensors_shape_does_not_match_bytes(tiny_hf, tmp_path):
  header = {"model.norm.weight": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 32]}}
  d = hf_dir_with(tmp_path, tiny_hf, safetensors_bytes(header, b"\0" * 32))
  raises_naming(d, str(d / "model.safetensors"), "model.norm.weight", "[4, 4]", kind=ModelLoadError)
  header = {"model.norm.weight": {"dtype": "F32", "shape": [1 << 62, 1 << 62], "data_offsets": [0, 32]}}
  d = hf_dir_with(tmp_path, tiny_hf, safetensors_bytes(header, b"\0" * 32))
  raises_naming(d, str(d / "model.safetensors"), "model.norm.weight", kind=ModelLoadError)


def test_safetensors_entry_without_dtype(tiny_hf, tmp_path):
  header = {"model.norm.weight": {"shape": [8], "data_offsets": [0, 32]}}
  d = hf_dir_with(tmp_path, tiny_hf, safetensors_bytes(header, b"\0" * 32))
  raises_naming(d, str(d / "model.safetensors"), "model.norm.weight", "dtype", kind=ModelLoadError)


def test_safetensors_header_not_an_object(tiny_hf, tmp_path):
  for header, named in (([1, 2, 3], "JSON list"), (b"[" * 100_000 + b"]" * 100_000, "not valid JSON"),
                        ({"model.norm.weight": [0, 32]}, "model.norm.weight")):
    d = hf_dir_with(tmp_path, tiny_hf, safetensors_bytes(header))
    raises_naming(d, str(d / "model.safetensors"), named, kind=ModelLoadError)


def test_config_implausible_or_wrong_types(tiny_hf, tmp_path):
  base = json.loads((tiny_hf / "config.json").read_text())
  for key, value in (("num_hidden_layers", 10 ** 6), ("vocab_size", 10 ** 9), ("hidden_size", 1 << 30),
                     ("intermediate_size", "64"), ("num_attention_heads", 0), ("rms_norm_eps", None)):
    d = hf_dir_with(tmp_path, tiny_hf, config=base | {key: value})
    raises_naming(d, str(d / "config.json"), key, kind=ConfigError)
  d = hf_dir_with(tmp_path, tiny_hf, config=[base])
  raises_naming(d, str(d / "config.json"), kind=ConfigError)


def test_index_naming_files_elsewhere(tiny_hf, tmp_path):
  d = hf_dir_with(tmp_path, tiny_hf)
  for weight_map in ({"model.norm.weight": "../model.safetensors"}, {"model.norm.weight": 5}, ["model.safetensors"]):
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    raises_naming(d, "model.safetensors.index.json", "weight_map", kind=ModelLoadError)
  (d / "model.safetensors.index.json").write_text("[" * 100_000)
  raises_naming(d, "model.safetensors.index.json", "not valid JSON", kind=ModelLoadError)


def test_hf_layers_missing_for_num_hidden_layers(tiny_hf, tmp_path):
  d = hf_dir_with(tmp_path, tiny_hf, config=json.loads((tiny_hf / "config.json").read_text()) | {"num_hidden_layers": 3})
  raises_naming(d, "model.layers.2.", "num_hidden_layers", kind=ModelLoadError)


# ---- fuzz ----

class CaseTimeout(BaseException):
  """Raised by the alarm in a case that hangs (BaseException: no `except Exception` in the loader swallows it)."""


def interesting(old: int, bits: int, rng: random.Random) -> int:
  top = (1 << bits) - 1
  return rng.choice([0, 1, 2, top, top - 1, 1 << (bits - 1), (old + 1) & top, max(old - 1, 0), (old * 2) & top,
                     (old * 1000) & top, 10 ** 6 & top, (1 << min(bits, 60)) - 1 & top, rng.getrandbits(bits)])


def gguf_fields(data: bytes) -> list[tuple[int, str, str]]:
  """(offset, struct format, what) of every header field of a valid GGUF: counts, lengths, types, values,
  dimensions, tensor types and offsets (the first few lengths of each string array only)."""
  fmts = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<B", 10: "<Q", 11: "<q", 12: "<d"}
  fields = [(8, "<Q", "tensor count"), (16, "<Q", "key count")]
  n_tensors, n_kv = struct.unpack_from("<QQ", data, 8)
  pos = 24
  def string(pos: int, what: str, record: bool = True) -> tuple[int, str]:
    (n,) = struct.unpack_from("<Q", data, pos)
    if record: fields.append((pos, "<Q", f"length of {what}"))
    return pos + 8 + n, data[pos + 8:pos + 8 + n].decode()
  for _ in range(n_kv):
    pos, key = string(pos, "a key")
    (vtype,) = struct.unpack_from("<I", data, pos)
    fields.append((pos, "<I", f"value type of {key}"))
    pos += 4
    if vtype == GGUF_STRING: pos, _ = string(pos, f"the string {key}")
    elif vtype == GGUF_ARRAY:
      itype, count = struct.unpack_from("<IQ", data, pos)
      fields += [(pos, "<I", f"item type of {key}"), (pos + 4, "<Q", f"item count of {key}")]
      pos += 12
      if itype == GGUF_STRING:
        for j in range(count): pos, _ = string(pos, f"{key}[{j}]", record=j < 3)
      else: pos += count * struct.calcsize(fmts[itype])
    else:
      fields.append((pos, fmts[vtype], f"value of {key}"))
      pos += struct.calcsize(fmts[vtype])
  for _ in range(n_tensors):
    pos, name = string(pos, "a tensor name")
    (n_dims,) = struct.unpack_from("<I", data, pos)
    fields.append((pos, "<I", f"dimension count of {name}"))
    fields += [(pos + 4 + 8 * i, "<Q", f"dimension {i} of {name}") for i in range(n_dims)]
    pos += 4 + 8 * n_dims
    fields += [(pos, "<I", f"GGML type of {name}"), (pos + 4, "<Q", f"data offset of {name}")]
    pos += 12
  return fields


def mutate_gguf(data: bytes, fields, header_end: int, rng: random.Random) -> tuple[bytes, str]:
  kind = rng.random()
  if kind < 0.2:
    cut = rng.randrange(header_end) if rng.random() < 0.7 else rng.randrange(len(data))
    return data[:cut], f"truncated at {cut}"
  if kind < 0.4:
    buf, flips = bytearray(data), []
    for _ in range(rng.randint(1, 4)):
      at = rng.randrange(header_end) if rng.random() < 0.8 else rng.randrange(len(data))
      buf[at] ^= rng.randrange(1, 256)
      flips.append(at)
    return bytes(buf), f"bytes flipped at {flips}"
  pos, fmt, what = rng.choice(fields)
  buf = bytearray(data)
  if fmt in ("<f", "<d"):
    value = rng.choice([0.0, -1.0, math.nan, math.inf, 1e30, 1e-30])
    struct.pack_into(fmt, buf, pos, value)
  else:
    bits = 8 * struct.calcsize(fmt)
    (old,) = struct.unpack_from(fmt.upper(), buf, pos)
    value = interesting(old, bits, rng)
    struct.pack_into(fmt.upper(), buf, pos, value)
  return bytes(buf), f"{what} set to {value!r}"


def mutate_hf(weights: bytes, config: dict, rng: random.Random) -> tuple[bytes, bytes, str]:
  """(model.safetensors, config.json, what was done)."""
  (header_len,) = struct.unpack_from("<Q", weights, 0)
  header, data = json.loads(weights[8:8 + header_len]), weights[8 + header_len:]
  cfg_bytes = json.dumps(config).encode()
  kind = rng.random()
  if kind < 0.12:
    cut = rng.randrange(8 + header_len + 64) if rng.random() < 0.7 else rng.randrange(len(weights))
    return weights[:cut], cfg_bytes, f"model.safetensors truncated at {cut}"
  if kind < 0.24:
    buf, flips = bytearray(weights), []
    for _ in range(rng.randint(1, 4)):
      at = rng.randrange(8 + header_len) if rng.random() < 0.8 else rng.randrange(len(weights))
      buf[at] ^= rng.randrange(1, 256)
      flips.append(at)
    return bytes(buf), cfg_bytes, f"model.safetensors bytes flipped at {flips}"
  if kind < 0.32:
    value = interesting(header_len, 64, rng)
    return struct.pack("<Q", value) + weights[8:], cfg_bytes, f"header length set to {value}"
  if kind < 0.75:
    names = [n for n in header if n != "__metadata__"]
    name = rng.choice(names)
    entry = dict(header[name])
    bad_numbers = [0, -1, 1, 2 ** 31, 2 ** 62, 2 ** 64, 10 ** 30, 1.5, True, None, "8", [], {}]
    what = rng.choice(["dtype", "shape", "shape", "offsets", "offsets", "drop key", "entry", "rename", "drop tensor",
                       "header", "metadata"])
    if what == "dtype": entry["dtype"] = value = rng.choice(["F32", "F16", "BF16", "F64", "I8", "U8", "I64", "Q4", "", None, 3, ["F32"]])
    elif what == "shape":
      shape = list(entry["shape"])
      choice = rng.randrange(5)
      if choice == 0 and shape: shape.pop(rng.randrange(len(shape)))
      elif choice == 1: shape.insert(rng.randrange(len(shape) + 1), rng.choice([1, 2, 0]))
      elif choice == 2 and shape: shape[rng.randrange(len(shape))] = rng.choice(bad_numbers)
      elif choice == 3: shape = shape[::-1]
      else: shape = rng.choice([None, "32", 5, [[32]], [2 ** 32, 2 ** 32]])
      entry["shape"] = value = shape
    elif what == "offsets":
      start, end = entry["data_offsets"]
      choice = rng.randrange(5)
      if choice == 0: value = [end, start]
      elif choice == 1: value = [start + 2, end + 2]
      elif choice == 2: value = [start, rng.choice(bad_numbers)]
      elif choice == 3: value = [rng.choice(bad_numbers), end]
      else: value = rng.choice([None, [start], [start, end, end], "0-32", {}])
      entry["data_offsets"] = value
    elif what == "drop key": entry.pop(value := rng.choice(["dtype", "shape", "data_offsets"]))
    elif what == "entry": entry = value = rng.choice([[], 5, "F32", None, {}])
    if what == "rename": header[name + "_x"] = header.pop(name); value = name + "_x"
    elif what == "drop tensor": del header[name]; value = name
    elif what == "header": header = value = rng.choice([[], [header], "x", 5, None])
    elif what == "metadata": header["__metadata__"] = value = rng.choice([[], 5, {"format": "pt"}, None])
    else: header[name] = entry
    h = json.dumps(header).encode()
    return struct.pack("<Q", len(h)) + h + data, cfg_bytes, f"tensor {name}: {what} -> {value!r}"
  cfg = dict(config)
  choice = rng.random()
  if choice < 0.1: return weights, cfg_bytes[:rng.randrange(len(cfg_bytes))], "config.json truncated"
  if choice < 0.15:
    value = rng.choice([[], "x", 5, None, [cfg]])
    return weights, json.dumps(value).encode(), f"config.json replaced by {value!r}"
  key = rng.choice(["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings", "rope_theta",
                    "rope_scaling", "rope_parameters", "tie_word_embeddings", "attention_bias", "mlp_bias",
                    "quantization", "architectures", "model_type"])
  if rng.random() < 0.15:
    cfg.pop(key, None)
    return weights, json.dumps(cfg).encode(), f"config.json: {key} removed"
  old = cfg.get(key)
  pool = [0, -1, 1, 3, 10 ** 6, 10 ** 9, 2 ** 63, 1e400, -0.5, "32", None, [], {}, True, {"rope_type": "linear"},
          {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 1.0},
          {"rope_type": "linear", "factor": "x"}, {"bits": 4, "group_size": 48}, ["LlamaForCausalLM"], "llama"]
  if isinstance(old, int) and not isinstance(old, bool): pool += [old * 2, old + 1, old // 2]
  cfg[key] = value = rng.choice(pool)
  return weights, json.dumps(cfg).encode(), f"config.json: {key} set to {value!r}"


def run_cases(cases, outcomes: dict, failures: list, slowest: list, tokenizer_outcomes: dict | None = None):
  """cases: iterable of (path to load, description). Loads each checkpoint (and, given `tokenizer_outcomes`, its
  embedded tokenizer) under an alarm and counts the outcomes; anything but success or our own errors is a failure."""
  def alarm(signum, frame): raise CaseTimeout()
  def attempt(load, ours: tuple, path: Path, what: str, prefix: str, outcomes: dict):
    t0 = time.perf_counter()
    try:
      signal.setitimer(signal.ITIMER_REAL, 20)
      try: load(path)
      finally: signal.setitimer(signal.ITIMER_REAL, 0)
      outcome = "loaded"
    except ours as e:
      outcome = type(e).__name__
      if str(path) not in str(e): failures.append(f"{what}: {prefix}{outcome} does not name {path}: {e}")
    except CaseTimeout:
      outcome = "timeout"
      failures.append(f"{what}: {prefix}still loading after 20 s")
    except Exception as e:   # what the fuzz is for: anything else is a bug
      outcome = "other"
      failures.append(f"{what}: {prefix}{type(e).__name__}: {str(e)[:300]}")
    slowest.append((time.perf_counter() - t0, f"{prefix}{what}"))
    outcomes[outcome] = outcomes.get(outcome, 0) + 1
  previous = signal.signal(signal.SIGALRM, alarm)
  try:
    for path, what in cases:
      attempt(load_checkpoint, (ModelLoadError, ConfigError), path, what, "", outcomes)
      if tokenizer_outcomes is not None: attempt(load_tokenizer, (TokenizerError,), path, what, "tokenizer: ", tokenizer_outcomes)
  finally:
    signal.signal(signal.SIGALRM, previous)


# flipped bytes in quantized blocks make NaN or infinite scales, which numpy warns about while decoding: such a
# file is still a checkpoint that loads
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_fuzz_corrupt_checkpoints(tiny_hf, tiny_gguf, tmp_path):
  rng = random.Random(20240611)
  peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss   # KiB on Linux
  gguf_data = tiny_gguf.read_bytes()
  fields = gguf_fields(gguf_data)
  header_end = max(pos for pos, _, _ in fields) + 16
  weights, config = (tiny_hf / "model.safetensors").read_bytes(), json.loads((tiny_hf / "config.json").read_text())

  def gguf_cases(n: int):
    for i in range(n):
      data, what = mutate_gguf(gguf_data, fields, header_end, rng)
      path = tmp_path / f"g{i}.gguf"   # a fresh file each time: earlier cases' memory maps stay valid
      path.write_bytes(data)
      yield path, f"GGUF case {i}: {what}"
      path.unlink()

  def hf_cases(n: int):
    for i in range(n):
      st, cfg, what = mutate_hf(weights, config, rng)
      d = tmp_path / f"h{i}"
      d.mkdir()
      (d / "model.safetensors").write_bytes(st); (d / "config.json").write_bytes(cfg)
      yield d, f"HF case {i}: {what}"

  results = {"GGUF checkpoint": {}, "GGUF tokenizer": {}, "safetensors checkpoint": {}}
  failures, slowest = [], []
  run_cases(gguf_cases(500), results["GGUF checkpoint"], failures, slowest, results["GGUF tokenizer"])
  run_cases(hf_cases(500), results["safetensors checkpoint"], failures, slowest)
  slowest.sort(reverse=True)
  growth_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_before) / 1024
  for label, outcomes in results.items():
    print(f"fuzz, {label} loads: {sum(outcomes.values())} cases: " + ", ".join(f"{k} {v}" for k, v in sorted(outcomes.items())))
  print(f"fuzz: slowest case {slowest[0][0] * 1000:.0f} ms ({slowest[0][1]}); peak RSS growth {growth_mib:.0f} MiB")
  assert not failures, f"{len(failures)} case(s) failed:\n" + "\n".join(failures[:30])
  # a guard against a header that makes loading loop or allocate without end, not a speed target: a case that loads
  # takes about a second, two with the suite's other worker on the same cores
  assert slowest[0][0] < 10.0, f"a case took {slowest[0][0]:.1f} s: {slowest[0][1]}"
  assert growth_mib < 1024, f"peak RSS grew by {growth_mib:.0f} MiB"
  for label in ("GGUF checkpoint", "safetensors checkpoint"):   # the mutations reach both sides
    assert results[label].get("loaded", 0) > 0 and results[label].get("ModelLoadError", 0) > 0 and results[label].get("ConfigError", 0) > 0


# ---- the sdist extraction ----

def make_tar(path: Path, members: dict[str, bytes]) -> Path:
  with tarfile.open(path, "w:gz") as tf:
    for name, data in members.items():
      info = tarfile.TarInfo(name)
      info.size = len(data)
      tf.addfile(info, io.BytesIO(data))
  return path


def test_tar_member_outside_the_cache_is_refused(tmp_path):
  root = tmp_path / "cache" / "pkg-1.0-sdist"
  archive = make_tar(tmp_path / "pkg-1.0.tar.gz", {"pkg-1.0/src/ok.txt": b"fine", "pkg-1.0/../../evil": b"escaped"})
  with pytest.raises(FetchError, match=r"pkg-1\.0/\.\./\.\./evil"): extract_members(archive, root, r".")
  files = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file())
  assert files == ["pkg-1.0.tar.gz"], files   # nothing written at all: every member is checked first
  archive = make_tar(tmp_path / "abs.tar.gz", {"pkg-1.0/sub/../../../evil2": b"x"})
  with pytest.raises(FetchError): extract_members(archive, root, r"evil")
  assert not (tmp_path / "evil2").exists() and not (tmp_path / "cache" / "evil2").exists()
  # a safe archive extracts as before, without its top-level folder
  archive = make_tar(tmp_path / "good.tar.gz", {"pkg-1.0/src/ok.txt": b"fine", "pkg-1.0/README": b"r"})
  assert extract_members(archive, root, r"^src/") == [(root / "src" / "ok.txt").resolve()]
  assert (root / "src" / "ok.txt").read_bytes() == b"fine" and not (root / "README").exists()
