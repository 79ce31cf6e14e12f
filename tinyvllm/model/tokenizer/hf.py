"""HF `tokenizer.json` through the `tokenizers` library: encoding is the library's, the byte table follows the
file's decoder (byte-level alphabet, or Metaspace/Replace "▁" with ByteFallback)."""
from __future__ import annotations
import re
from pathlib import Path
from typing import Any

from tinyvllm.model.tokenizer.base import Tokenizer, end_of_turn_ids
from tinyvllm.model.tokenizer.byte_level import byte_level_decoder, decode_byte_level
from tinyvllm.model.tokenizer.errors import TokenizerError
from tinyvllm.model.tokenizer.hf_config import read_json

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _decoder_types(node: Any) -> list[dict]:
  """Every decoder object in a tokenizer.json decoder tree (Sequence nests them)."""
  if not isinstance(node, dict): return []
  return [node] + [d for child in node.get("decoders") or [] for d in _decoder_types(child)]


def _hf_pieces(hf, decoders: list[dict], texts: list[str], added: dict[int, str]) -> list[bytes]:
  """The bytes of every token of a tokenizer.json, following its decoder: byte-level alphabet, or SentencePiece
  style ("▁" is a space, <0xNN> a byte). Added tokens decode to their content."""
  byte_level = any(dec.get("type") == "ByteLevel" for dec in decoders)
  metaspace = any(dec.get("type") == "Metaspace" or (dec.get("type") == "Replace" and (dec.get("pattern") or {}).get("String") == "▁")
                  for dec in decoders)
  byte_fallback = any(dec.get("type") == "ByteFallback" for dec in decoders)
  alphabet = byte_level_decoder()

  def piece(i: int) -> bytes:
    if i in added: return added[i].encode("utf-8")
    if byte_level: return decode_byte_level(texts[i], alphabet)
    if byte_fallback and (m := _BYTE_TOKEN.fullmatch(texts[i])): return bytes([int(m.group(1), 16)])
    if metaspace: return texts[i].replace("▁", " ").encode("utf-8")
    return hf.decode([i], skip_special_tokens=False).encode("utf-8")  # a decoder we do not model: token by token

  return [piece(i) for i in range(len(texts))]


def load_hf_tokenizer(d: Path, meta: dict[str, Any]) -> Tokenizer:
  from tokenizers import Tokenizer as HFTokenizer
  file = d / "tokenizer.json"
  try:
    hf = HFTokenizer.from_file(str(file))
  except Exception as e:  # the Rust side raises its own exception type
    raise TokenizerError(f"{file}: cannot load: {e}") from None
  decoders = _decoder_types(read_json(file).get("decoder"))
  added = hf.get_added_tokens_decoder()
  texts = [hf.id_to_token(i) or "" for i in range(hf.get_vocab_size(with_added_tokens=True))]
  pieces = _hf_pieces(hf, decoders, texts, {i: t.content for i, t in added.items()})
  # Metaspace drops the prefix space from the first token (unless told never to add one); older Llama files
  # spell the same thing as a Strip decoder
  strip_first = any((dec.get("type") == "Metaspace" and dec.get("prepend_scheme", "always") != "never"
                     and dec.get("add_prefix_space", True)) or (dec.get("type") == "Strip" and dec.get("start", 0) > 0)
                    for dec in decoders)
  special = {i for i, t in added.items() if t.special}
  vocab = {t: i for i, t in enumerate(texts) if t}
  bos = vocab.get(meta["bos"]) if meta["bos"] else None
  eos = vocab.get(meta["eos"]) if meta["eos"] else None
  add_bos = meta["add_bos"]
  if add_bos is None:  # not stated: does the post-processor put BOS in front of an encoding?
    add_bos = bos is not None and hf.encode("", add_special_tokens=True).ids[:1] == [bos]

  def encode(text: str, parse_special: bool) -> list[int]:
    hf.encode_special_tokens = not parse_special
    return hf.encode(text, add_special_tokens=False).ids

  return Tokenizer(name=str(d), encode_fn=encode, pieces=pieces, texts=texts,
                   special_ids=special, strip_first_space=strip_first, bos_token_id=bos, eos_token_id=eos,
                   eos_token_ids={*meta["eos_ids"], *end_of_turn_ids(vocab, special.__contains__)},
                   add_bos=bool(add_bos), add_eos=meta["add_eos"], chat_template=meta["chat_template"])
