"""Checkpoints -> (ModelConfig, state dict of numpy arrays with HF Llama names).

Sources: a local HF directory (config.json + safetensors, sharded or not; fp32/fp16/bf16, or MLX 4-bit),
a GGUF file (architecture llama), or a hub id fetched with huggingface_hub. Tensors stay numpy here;
turning them into device tensors (and choosing the dtype) is the model's job.
"""
from __future__ import annotations
import dataclasses, json, os, struct, sys
from dataclasses import dataclass
from pathlib import Path
import numpy as np
from tinyvllm.config import ModelConfig
from tinyvllm.model.gguf_file import GGUFError, read_gguf
from tinyvllm.quant import ggml, int4


class ModelLoadError(ValueError):
  """The checkpoint cannot be found or read. The message names the file."""


@dataclass
class Checkpoint:
  config: ModelConfig
  tensors: dict[str, np.ndarray]       # HF names, e.g. "model.layers.0.self_attn.q_proj.weight"
  path: Path                           # the directory or GGUF file (tokenizer files are looked up from here)
  gguf_meta: dict | None = None        # GGUF metadata (the embedded tokenizer reads it)


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
    ckpt = dataclasses.replace(ckpt, tensors=int4.dequantize_state_dict(ckpt.tensors), config=dataclasses.replace(ckpt.config, quantization=None))
  if quantization == "int4":
    # 8-bit tables (a GGUF's Q8_0 embedding) become 4-bit too: 4-bit everywhere is what "int4" asks for
    eight_bit = {k[:-len(".scales")] for k in ckpt.tensors if k.endswith(".scales") and k[:-len(".scales")] + ".biases" not in ckpt.tensors}
    tensors = {k: v for k, v in ckpt.tensors.items() if not any(k.startswith(b + ".") for b in eight_bit)}
    tensors.update({f"{b}.weight": int4.dequantize_8bit(ckpt.tensors[f"{b}.weight"], ckpt.tensors[f"{b}.scales"]) for b in eight_bit})
    group = (ckpt.config.quantization or {}).get("group_size", 64)
    for name, w in list(tensors.items()):
      base = name[:-len(".weight")]
      if w.ndim == 2 and (int4.is_linear_weight(name) or name in int4.EMBEDDING_NAMES) and f"{base}.scales" not in tensors \
         and w.shape[1] % group == 0:
        tensors[name], tensors[f"{base}.scales"], tensors[f"{base}.biases"] = int4.quantize(np.asarray(w, np.float32), group, "rtn")
    ckpt = dataclasses.replace(ckpt, tensors=tensors, config=dataclasses.replace(ckpt.config, quantization={"group_size": group, "bits": 4}))
  return ckpt


# ---- HF directories ----

def load_hf_dir(path: Path) -> Checkpoint:
  cfg_file = path / "config.json"
  if not cfg_file.exists(): raise ModelLoadError(f"{path} has no config.json")
  try: cfg_dict = json.loads(cfg_file.read_text())
  except json.JSONDecodeError as e: raise ModelLoadError(f"{cfg_file} is not valid JSON: {e}") from None
  config = ModelConfig.from_hf(cfg_dict, source=str(cfg_file))
  index = path / "model.safetensors.index.json"
  if index.exists():
    files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
  else:
    files = sorted(p.name for p in path.glob("*.safetensors"))
  if not files: raise ModelLoadError(f"{path} has no *.safetensors weights")
  tensors: dict[str, np.ndarray] = {}
  for name in files:
    if not (path / name).exists(): raise ModelLoadError(f"{path / name} is listed in {index.name} but missing")
    tensors.update(read_safetensors(path / name))
  tensors = {k: v for k, v in tensors.items() if "rotary_emb.inv_freq" not in k}
  if config.quantization is not None:
    if config.quantization.get("bits") != 4 or config.quantization.get("group_size") not in int4.GROUP_SIZES:
      raise ModelLoadError(f"{cfg_file}: unsupported quantization {config.quantization}; tinyvllm reads 4-bit affine "
                           f"groups of {', '.join(map(str, int4.GROUP_SIZES))}")
    tensors = int4.float16_params(tensors)   # mlx-lm stores scales/biases in the source dtype
  return Checkpoint(config, tensors, path)


_ST_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64, "I64": np.int64,
              "I32": np.int32, "U32": np.uint32, "I16": np.int16, "U16": np.uint16, "I8": np.int8, "U8": np.uint8}


def read_safetensors(file: Path) -> dict[str, np.ndarray]:
  """Memory-map a safetensors file. bf16 tensors come back as float32 (numpy has no bfloat16)."""
  try:
    with open(file, "rb") as f:
      header_len = struct.unpack("<Q", f.read(8))[0]
      header = json.loads(f.read(header_len))
  except (OSError, struct.error, json.JSONDecodeError, UnicodeDecodeError) as e:
    raise ModelLoadError(f"{file} is not a readable safetensors file: {e}") from None
  data = np.memmap(file, dtype=np.uint8, mode="r", offset=8 + header_len)
  out = {}
  for name, info in header.items():
    if name == "__metadata__": continue
    if info["dtype"] not in _ST_DTYPES: raise ModelLoadError(f"{file}: tensor {name} has unsupported dtype {info['dtype']}")
    start, end = info["data_offsets"]
    arr = data[start:end].view(_ST_DTYPES[info["dtype"]]).reshape(info["shape"])
    if info["dtype"] == "BF16": arr = (arr.astype(np.uint32) << 16).view(np.float32)
    out[name] = arr
  return out


# ---- GGUF ----

_GGUF_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head",
               "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
               "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
               "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
               "ffn_down": "mlp.down_proj"}
GGUF_TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")


def _is_gguf(path: Path) -> bool:
  with open(path, "rb") as f: return f.read(4) == b"GGUF"


def hf_name(gguf_name: str) -> str:
  """'blk.3.attn_q.weight' -> 'model.layers.3.self_attn.q_proj.weight'."""
  parts = gguf_name.split(".")
  if parts[0] == "blk":
    return f"model.layers.{parts[1]}.{_GGUF_NAMES.get(parts[2], parts[2])}.{'.'.join(parts[3:])}"
  return f"{_GGUF_NAMES.get(parts[0], parts[0])}.{'.'.join(parts[1:])}"


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
  """llama.cpp's converter reorders Q/K rows so each head's rotary pairs are interleaved; undo it to get HF's
  rotate-half layout. Rows only move as whole rows, so this works on packed quantized rows too."""
  rows = w.shape[0]
  return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def load_gguf(path: Path, keep_q4: bool = True) -> Checkpoint:
  """keep_q4: Q4_0/Q4_1 linear weights become packed 4-bit groups of 32 (exactly, code for code), and a Q8_0
  embedding / LM head stays 8-bit (int8 codes + float16 scales per 32), instead of floats."""
  try: meta, gguf_tensors = read_gguf(path)
  except GGUFError as e: raise ModelLoadError(f"{path} is not a readable GGUF file: {e}") from None
  config = ModelConfig.from_gguf(meta, source=str(path))
  tensors = {}
  for t in gguf_tensors:
    qtype, shape = t.type_name, t.shape
    if qtype not in GGUF_TENSOR_TYPES:
      raise ModelLoadError(f"{path}: tensor {t.name} has GGUF type {qtype}; supported: {', '.join(GGUF_TENSOR_TYPES)}")
    name = hf_name(t.name)
    packed = keep_q4 and qtype in ("Q4_0", "Q4_1") and int4.is_linear_weight(name)
    eight_bit = keep_q4 and qtype == "Q8_0" and name in int4.EMBEDDING_NAMES
    if eight_bit:
      codes, d = ggml.q8_0_parts(t.data)
      tensors[name], tensors[name[:-len(".weight")] + ".scales"] = codes.reshape(shape), d.astype(np.float16)  # d is fp16 in the file
      continue
    if packed: arr = t.data
    elif qtype in ggml.BLOCK_BYTES: arr = ggml.dequantize(t.data, qtype, shape)
    elif qtype == "BF16": arr = (t.data.astype(np.uint32) << 16).view(np.float32)
    else: arr = np.array(t.data)   # a copy: the file's memory map is read-only
    # rows move as whole rows, so raw quantized blocks are un-permuted just like floats
    if name.endswith("self_attn.q_proj.weight"): arr = unpermute_rope_rows(arr, config.num_attention_heads)
    if name.endswith("self_attn.k_proj.weight"): arr = unpermute_rope_rows(arr, config.num_key_value_heads)
    if packed:
      base = name[:-len(".weight")]
      tensors[name], tensors[f"{base}.scales"], tensors[f"{base}.biases"] = int4.from_ggml_q4(arr, qtype, shape)
    else:
      tensors[name] = arr
  if "lm_head.weight" not in tensors: config = dataclasses.replace(config, tie_word_embeddings=True)
  if any(k.endswith(".scales") for k in tensors): config = dataclasses.replace(config, quantization={"group_size": ggml.BLOCK, "bits": 4})
  return Checkpoint(config, tensors, path, gguf_meta=meta)
