"""Quantize a Llama checkpoint to 4-bit affine groups (MLX's layout) and write it as an HF-style directory.

  python -m tinyvllm.quantize --model SRC --out DIR [--group-size 64] [--method rtn|clip] [--quantize-embeddings]
                              [--calibration TEXT_FILE [--calibration-tokens 4096]]

SRC is anything the engine loads: an HF directory, a GGUF file, a hub id, or nothing for the default SmolLM2
GGUF. DIR receives model.safetensors, config.json (HF Llama keys plus "quantization": {"group_size", "bits"})
and the tokenizer files. GGUF Q4_0/Q4_1 weights are repacked as they are when --group-size is 32 (lossless);
with another group size they are requantized from their decoded values.
"""
from __future__ import annotations
import argparse, dataclasses, json, shutil, sys
from pathlib import Path
import numpy as np
from tqdm import tqdm
from tinyvllm.config import ConfigError, ModelConfig
from tinyvllm.quant import int4

HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json",
                      "generation_config.json", "chat_template.jinja", "chat_template.json")


class QuantizeError(ValueError):
  """A user-facing failure; the message names the path or flag at fault."""


def ggml_q4_tensors(path: Path, cfg: ModelConfig) -> dict[str, tuple[np.ndarray, str, tuple[int, int]]]:
  """The Q4_0/Q4_1 linear weights of a GGUF file as raw blocks, keyed by HF name, rows in HF order."""
  from tinyvllm.model.gguf_file import read_gguf
  from tinyvllm.model.weights import hf_name, unpermute_rope_rows
  out = {}
  for t in read_gguf(path)[1]:
    qtype, name, shape, raw = t.type_name, hf_name(t.name), t.shape, t.data
    if qtype not in ("Q4_0", "Q4_1") or not int4.is_linear_weight(name): continue
    # llama.cpp permutes Q/K rows for its RoPE; rows move whole, so the raw blocks can be un-permuted too
    if name.endswith("self_attn.q_proj.weight"): raw = unpermute_rope_rows(raw, cfg.num_attention_heads)
    if name.endswith("self_attn.k_proj.weight"): raw = unpermute_rope_rows(raw, cfg.num_key_value_heads)
    out[name] = (raw, qtype, shape)
  return out


def hf_config(cfg: ModelConfig, source: dict | None, group_size: int, gguf_meta: dict | None = None) -> dict:
  """config.json for the quantized model: the source's own (HF) or one built from the GGUF's ModelConfig."""
  quant = {"group_size": group_size, "bits": int4.BITS}
  if source is not None: d = dict(source)
  else:
    d = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("source", "quantization") and v is not None}
    for k in ("rms_norm_eps", "rope_theta"): d[k] = float(f"{d[k]:.7g}")   # GGUF stores them as float32
    d.update(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu")
    for k in ("bos", "eos"):
      if (gguf_meta or {}).get(f"tokenizer.ggml.{k}_token_id") is not None: d[f"{k}_token_id"] = int(gguf_meta[f"tokenizer.ggml.{k}_token_id"])
  d.pop("quantization_config", None)
  d["quantization"], d["quantization_config"] = quant, dict(quant)   # mlx-lm writes both
  return d


def write_tokenizer(src: Path, out: Path) -> str:
  """Copy an HF directory's tokenizer files, or convert a GGUF's embedded tokenizer with transformers."""
  if src.is_dir():
    copied = [n for n in HF_TOKENIZER_FILES if (src / n).exists()]
    for n in copied: shutil.copyfile(src / n, out / n)
    return f"copied {', '.join(copied)}" if copied else f"no tokenizer files in {src}"
  try:
    from transformers import AutoTokenizer
  except ImportError:
    return (f"tokenizer NOT written: converting the GGUF's embedded tokenizer needs the transformers package; "
            f"the engine can still read it from {src}")
  try: AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name).save_pretrained(out)
  except Exception as e:  # transformers raises many kinds; the user needs one sentence
    return f"tokenizer NOT written: transformers could not convert the GGUF's tokenizer ({type(e).__name__}: {e})"
  return "converted the GGUF's embedded tokenizer with transformers (tokenizer.json, tokenizer_config.json, chat_template.jinja)"


def calibration_importance(ckpt, text_file: Path, n_tokens: int, log=print) -> dict[str, np.ndarray]:
  """Mean x^2 per input channel of every linear, from the first n_tokens of a text file (needs transformers)."""
  try: text = text_file.read_text(encoding="utf-8")
  except (OSError, UnicodeDecodeError) as e: raise QuantizeError(f"--calibration {text_file}: cannot read it ({e})") from None
  try:
    import torch, transformers  # noqa: F401
  except ImportError:
    raise QuantizeError("--calibration needs torch and transformers (pip install torch transformers)") from None
  from tinyvllm.model.tokenizer import load_tokenizer
  from tinyvllm.quant.calibrate import input_second_moments
  tokens = load_tokenizer(ckpt.path).encode(text, add_special_tokens=False)[:n_tokens]
  if len(tokens) < 2: raise QuantizeError(f"--calibration {text_file}: too little text ({len(tokens)} tokens)")
  log(f"calibrating on {len(tokens)} tokens of {text_file}")
  return input_second_moments(ckpt.config, ckpt.tensors, np.array(tokens))


def quantize_checkpoint(model: str | None, out: Path, group_size: int = 64, method: str = "rtn",
                        quantize_embeddings: bool = False, calibration: Path | None = None, calibration_tokens: int = 4096,
                        log=print) -> dict[str, np.ndarray]:
  from safetensors.numpy import save_file
  from tinyvllm.model.weights import load_checkpoint, ModelLoadError
  if out.exists() and not out.is_dir(): raise QuantizeError(f"--out {out} exists and is not a directory")
  if calibration is not None and method != "clip": raise QuantizeError("--calibration only applies to --method clip")
  # floats everywhere; a GGUF's Q4 blocks are read again raw below and repacked code for code
  try: ckpt = load_checkpoint(model, quantization="none")
  except (ModelLoadError, ConfigError) as e: raise QuantizeError(f"--model: {e}") from None
  if ckpt.path.is_dir() and json.loads((ckpt.path / "config.json").read_text()).get("quantization"):
    raise QuantizeError(f"--model {ckpt.path} is already quantized")
  gguf = ckpt.path.is_file()
  if gguf and ckpt.config.model_type != "llama":   # the HF config written below is a Llama's
    raise QuantizeError(f"--model {ckpt.path}: writing a GGUF's weights as an HF checkpoint covers the llama architecture; "
                        f"this file is {ckpt.config.model_type}: quantize its HF checkpoint instead")
  q4 = ggml_q4_tensors(ckpt.path, ckpt.config) if gguf else {}
  if q4:
    how = "repacked losslessly" if group_size == 32 else f"requantized from their decoded values (--group-size {group_size} != 32)"
    log(f"{len(q4)} GGUF Q4_0/Q4_1 weights {how}")
  if calibration is not None and ckpt.config.model_type != "llama":   # calibrate.py runs transformers' Llama
    raise QuantizeError(f"--calibration runs Llama checkpoints; this one is {ckpt.config.model_type}: quantize it without "
                        f"--calibration (--method clip still refits each group)")
  importance = calibration_importance(ckpt, calibration, calibration_tokens, log) if calibration is not None else None
  tensors = int4.quantize_state_dict(ckpt.tensors, group_size, method, quantize_embeddings, ggml_q4=q4, importance=importance,
                                     progress=lambda names: tqdm(names, desc=f"quantizing ({method}, group {group_size})", unit="tensor", file=sys.stderr))
  kept = [n for n, t in tensors.items() if t.dtype != np.uint32 and (int4.is_linear_weight(n) or (quantize_embeddings and n in int4.EMBEDDING_NAMES))]
  if kept: log(f"{len(kept)} weights kept unquantized: their input dimension is not a multiple of {group_size} (e.g. {kept[0]})")
  out.mkdir(parents=True, exist_ok=True)
  save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(out / "model.safetensors"), metadata={"format": "mlx"})
  source_cfg = None if gguf else json.loads((ckpt.path / "config.json").read_text())
  (out / "config.json").write_text(json.dumps(hf_config(ckpt.config, source_cfg, group_size, ckpt.gguf_meta), indent=2) + "\n")
  log(write_tokenizer(ckpt.path, out))
  before = sum(t.size for t in ckpt.tensors.values()) * 2
  after = int4.quantized_bytes(tensors)
  log(f"wrote {out}: {after / 1e6:.1f} MB of tensors ({after / before:.0%} of the same model in fp16)")
  return tensors


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(prog="python -m tinyvllm.quantize", description=__doc__.split("\n\n")[0])
  p.add_argument("--model", default=None, help="HF directory, GGUF file or hub id (default: SmolLM2-135M-Instruct GGUF)")
  p.add_argument("--out", required=True, type=Path, help="output directory")
  p.add_argument("--group-size", type=int, default=64, choices=int4.GROUP_SIZES, help="weights per scale/bias group")
  p.add_argument("--method", default="rtn", choices=int4.METHODS, help="rtn: round to nearest; clip: range search + least-squares refit")
  p.add_argument("--quantize-embeddings", action="store_true",
                 help="also quantize the token embedding (and lm_head) to 4 bits; with tied embeddings it is the LM head too")
  p.add_argument("--calibration", type=Path, default=None, metavar="TEXT_FILE",
                 help="with --method clip: weight each input channel's error by its mean x^2 on this text (needs transformers)")
  p.add_argument("--calibration-tokens", type=int, default=4096, help="tokens of --calibration to use")
  args = p.parse_args(argv)
  try:
    quantize_checkpoint(args.model, args.out, args.group_size, args.method, args.quantize_embeddings,
                        args.calibration, args.calibration_tokens, log=lambda m: print(m, file=sys.stderr))
  except QuantizeError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main())
