"""`load_tokenizer`: find which kind of tokenizer a model has and load it with that kind's module."""
from __future__ import annotations
import os
from pathlib import Path

from tinyvllm.model.tokenizer.base import Tokenizer
from tinyvllm.model.tokenizer.errors import TokenizerError
from tinyvllm.model.tokenizer.gguf import load_gguf_tokenizer
from tinyvllm.model.tokenizer.hf import load_hf_tokenizer
from tinyvllm.model.tokenizer.hf_config import read_hf_meta
from tinyvllm.model.tokenizer.spm import load_sentencepiece


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
  """Load the tokenizer of a model.

  `path` is a GGUF file (embedded vocabulary), or a directory with `tokenizer.json` (HF tokenizers) or
  `tokenizer.model` (SentencePiece) plus, when present, tokenizer_config.json, chat_template.jinja,
  chat_template.json, generation_config.json and special_tokens_map.json. A directory holding only one GGUF
  file loads that file.
  """
  p = Path(path)
  if p.is_file():
    if _is_gguf(p): return load_gguf_tokenizer(p)
    if p.name in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json"): return load_tokenizer(p.parent)
    raise TokenizerError(f"{p}: not a GGUF file, and not a tokenizer file of a model directory")
  if not p.is_dir(): raise TokenizerError(f"{p}: no such file or directory")
  if (p / "tokenizer.json").is_file(): return load_hf_tokenizer(p, read_hf_meta(p))
  if (p / "tokenizer.model").is_file(): return load_sentencepiece(p, read_hf_meta(p))
  ggufs = sorted(f for f in p.glob("*.gguf") if _is_gguf(f))
  if len(ggufs) == 1: return load_tokenizer(ggufs[0])
  if ggufs: raise TokenizerError(f"{p}: several GGUF files ({', '.join(f.name for f in ggufs)}); pass one of them")
  raise TokenizerError(f"{p}: no tokenizer found (expected tokenizer.json, tokenizer.model or a .gguf file)")


def _is_gguf(path: Path) -> bool:
  with open(path, "rb") as f: return f.read(4) == b"GGUF"
