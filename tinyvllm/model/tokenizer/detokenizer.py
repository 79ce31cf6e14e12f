"""Streaming detokenization: generated ids -> text as they arrive, equal to `Tokenizer.decode` of the same ids."""
from __future__ import annotations
import codecs
from typing import TYPE_CHECKING

if TYPE_CHECKING: from tinyvllm.model.tokenizer.base import Tokenizer


class IncrementalDetokenizer:
  """Turns generated ids into text as they arrive.

  `add` returns only text that is final: bytes of an unfinished UTF-8 character are held back until the rest
  arrives. The concatenation of every `add` plus `flush` equals `tokenizer.decode(ids)` (or, with `prompt_ids`,
  `decode(prompt_ids + ids)` minus `decode(prompt_ids)`).
  """

  def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int] | None = None, skip_special_tokens: bool = True):
    self._tok = tokenizer
    self._skip = skip_special_tokens
    self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
    self._at_start = tokenizer.strip_first_space  # the first non-empty piece of the text loses its leading space
    # the pieces emitted, kept apart: a string grown by `+=` is copied whole each time (19 us an append at 128K
    # characters here), and a stream's next delta, read back with `since`, costs only its own pieces
    self._parts: list[str] = []
    self._length = 0
    for token_id in prompt_ids or (): self._utf8.decode(self._bytes(token_id))

  @property
  def num_chars(self) -> int:
    """How many characters it has emitted."""
    return self._length

  @property
  def text(self) -> str:
    """Everything emitted so far."""
    if len(self._parts) > 1: self._parts = ["".join(self._parts)]
    return self._parts[0] if self._parts else ""

  def since(self, start: int) -> str:
    """The text emitted from character `start` on, joined from the newest pieces back to it: a stream's delta costs
    its own pieces. From 0 it is `text`, which stays joined for the next read."""
    if start <= 0: return self.text
    i, at = len(self._parts), self._length
    while i > 0 and at > start:
      i -= 1
      at -= len(self._parts[i])
    if i == len(self._parts): return ""
    return self._parts[i][start - at:] + "".join(self._parts[i + 1:])   # the piece `start` falls in: only its tail

  def add(self, token_id: int) -> str:
    return self._emit(self._utf8.decode(self._bytes(token_id)))

  def flush(self) -> str:
    """Whatever is still held back (an unfinished character becomes U+FFFD, as `decode` renders it)."""
    return self._emit(self._utf8.decode(b"", final=True))

  def _bytes(self, token_id: int) -> bytes:
    piece = self._tok.piece(token_id, self._skip)
    if self._at_start and piece:
      self._at_start = False
      if piece[:1] == b" ": piece = piece[1:]
    return piece

  def _emit(self, new: str) -> str:
    if new:
      self._parts.append(new)
      self._length += len(new)
    return new
