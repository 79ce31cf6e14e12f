"""GPT-2's byte-level alphabet: how byte-level BPE vocabularies (HF tokenizer.json, GGUF "gpt2") spell raw bytes."""
from __future__ import annotations


def byte_level_decoder() -> dict[str, int]:
  """GPT-2's byte-level alphabet, inverted: printable Latin-1 bytes stand for themselves, the other 68 byte
  values were moved to U+0100 upwards so every byte has a visible, non-space character."""
  kept = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
  moved = [b for b in range(256) if b not in kept]
  return {**{chr(b): b for b in kept}, **{chr(0x100 + k): b for k, b in enumerate(moved)}}


def decode_byte_level(token: str, alphabet: dict[str, int]) -> bytes:
  """Bytes of a byte-level BPE token; characters outside the alphabet (added tokens) stand for their UTF-8."""
  if all(c in alphabet for c in token): return bytes(alphabet[c] for c in token)
  return token.encode("utf-8")
