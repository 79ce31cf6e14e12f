"""The one concrete `Tokenizer` every loader builds, and the helpers the loaders share.

Every backend reduces to the same two things, so there is one class:
  - an encode function, (text, parse_special) -> ids, without BOS;
  - a table of the bytes each token id decodes to (SentencePiece's "▁" already turned into a space).
`decode` joins those bytes and decodes UTF-8 once; `IncrementalDetokenizer` feeds the same bytes through Python's
incremental UTF-8 decoder, which holds back an incomplete character. Both apply the same leading-space rule, so
the streamed text always equals `decode` of the same ids. The same table, with the special ids, is what a
grammar engine needs to know which tokens may follow (`token_bytes`, `special_token_ids`).
"""
from __future__ import annotations
import re
from typing import Any, Callable, Iterable

import jinja2

from tinyvllm.model.tokenizer.chat_template import compile_chat_template
from tinyvllm.model.tokenizer.detokenizer import IncrementalDetokenizer
from tinyvllm.model.tokenizer.errors import TokenizerError

# Texts of tokens that end a turn in common chat formats. Each one the vocabulary defines as a special token
# counts as an end-of-sequence token, as llama.cpp does for its end-of-generation set.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
                      "<|end_of_text|>", "<EOT>", "<｜end▁of▁sentence｜>", "<end_of_utterance>")

EncodeFn = Callable[[str, bool], "list[int]"]  # (text, parse_special) -> ids, without BOS/EOS


def split_special(text: str, specials: dict[str, int]) -> list[str | int]:
  """Cut `text` at every occurrence of a special-token string: raw text pieces and token ids, in order.

  At each position the longest special string wins, as in llama.cpp's partition (which tries specials longest
  first). Only the specials that occur at all go into the pattern, so megabytes of plain text cost one fast
  substring search per special token.
  """
  present = sorted((s for s in specials if s and s in text), key=len, reverse=True)
  if not present: return [text] if text else []
  out: list[str | int] = []
  pos = 0
  for m in re.finditer("|".join(map(re.escape, present)), text):
    if m.start() > pos: out.append(text[pos:m.start()])
    out.append(specials[m.group()])
    pos = m.end()
  if pos < len(text): out.append(text[pos:])
  return out


def end_of_turn_ids(spelling_to_id: dict[str, int], is_special: Callable[[int], bool]) -> set[int]:
  """Ids of the END_OF_TURN_TOKENS this vocabulary defines as special tokens."""
  return {spelling_to_id[t] for t in END_OF_TURN_TOKENS if t in spelling_to_id and is_special(spelling_to_id[t])}


class Tokenizer:
  """Text <-> token ids for one model. Build it with `load_tokenizer`."""

  def __init__(self, *, name: str, encode_fn: EncodeFn, pieces: list[bytes], texts: list[str],
               special_ids: Iterable[int], strip_first_space: bool, bos_token_id: int | None,
               eos_token_id: int | None, eos_token_ids: Iterable[int], add_bos: bool, add_eos: bool = False,
               chat_template: str | None = None):
    """
    Args:
      pieces: bytes each id decodes to (special tokens: their text); `texts`: each token's spelling in the vocab.
      special_ids: ids that `skip_special_tokens` hides (control/unknown tokens, HF special added tokens).
      strip_first_space: SentencePiece-style vocabularies prepend a space when encoding; decoding drops it again
        from the first piece of the text.
      eos_token_id: the model's own EOS (appended when `add_eos`, `eos_token` in templates); `eos_token_ids`
        adds end-of-turn tokens.
    """
    assert len(pieces) == len(texts)
    self.name = name
    self._encode_fn = encode_fn
    self._pieces = pieces
    self._texts = texts
    self._special = frozenset(special_ids)
    self.strip_first_space = strip_first_space
    self.bos_token_id = bos_token_id
    self.eos_token_id = eos_token_id
    self.eos_token_ids = frozenset(eos_token_ids) | ({eos_token_id} if eos_token_id is not None else frozenset())
    self.vocab_size = len(pieces)
    self.add_bos, self.add_eos = add_bos, add_eos
    self.chat_template = chat_template
    self.bos_token = self._text_of(bos_token_id)
    self.eos_token = self._text_of(eos_token_id)
    self._templates: dict[str, jinja2.Template] = {}  # compiled once per template source

  def __repr__(self) -> str:
    return f"Tokenizer({self.name!r}, vocab_size={self.vocab_size}, bos={self.bos_token_id}, eos={sorted(self.eos_token_ids)})"

  # **** encode / decode ****

  def encode(self, text: str, add_special_tokens: bool = True, *, parse_special: bool = True) -> list[int]:
    """Token ids of `text`. `add_special_tokens` prepends BOS when the model wants it (`add_bos`);
    `parse_special` turns special-token strings in the text (e.g. "<|im_start|>") into their single ids."""
    ids = self._encode_fn(text, parse_special)
    if add_special_tokens:
      if self.add_bos and self.bos_token_id is not None: ids = [self.bos_token_id] + ids
      if self.add_eos and self.eos_token_id is not None: ids = ids + [self.eos_token_id]
    return ids

  def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
    pieces = [self.piece(i, skip_special_tokens) for i in ids]
    if self.strip_first_space:
      first = next((k for k, p in enumerate(pieces) if p), None)
      if first is not None and pieces[first][:1] == b" ": pieces[first] = pieces[first][1:]
    return b"".join(pieces).decode("utf-8", errors="replace")

  def piece(self, token_id: int, skip_special_tokens: bool = True) -> bytes:
    """The bytes `token_id` contributes to decoded text (before the first-space rule). Ids outside the
    vocabulary (a model's padded embedding rows) decode to nothing."""
    if not 0 <= token_id < self.vocab_size or (skip_special_tokens and token_id in self._special): return b""
    return self._pieces[token_id]

  def token_to_str(self, token_id: int) -> str:
    """Readable text of one token, e.g. for logprobs: special tokens as spelled, a lone byte of a multi-byte
    character as U+FFFD, SentencePiece's word-initial "▁" as a space."""
    if token_id in self._special: return self._texts[token_id]
    return self.piece(token_id, False).decode("utf-8", errors="replace")

  def is_special(self, token_id: int) -> bool: return token_id in self._special

  def detokenizer(self, prompt_ids: list[int] | None = None, *, skip_special_tokens: bool = True) -> IncrementalDetokenizer:
    """A streaming decoder for generated ids; `prompt_ids` gives the text they continue (it is not re-emitted)."""
    return IncrementalDetokenizer(self, prompt_ids, skip_special_tokens)

  def _text_of(self, token_id: int | None) -> str | None:
    return self._texts[token_id] if token_id is not None and 0 <= token_id < self.vocab_size else None

  # **** the vocabulary as bytes (grammar engines) ****

  def token_bytes(self) -> list[bytes]:
    """Every token's bytes, indexed by id: what it adds to generated text, special tokens as spelled. A grammar
    engine matches these against the grammar (special ids excepted: see `special_token_ids`)."""
    return [self.piece(i, False) for i in range(self.vocab_size)]

  @property
  def special_token_ids(self) -> frozenset[int]:
    """Ids that are control tokens rather than text (BOS, EOS, chat markers): `skip_special_tokens` hides them,
    and no grammar matches them as text."""
    return self._special

  # **** chat ****

  def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, *,
                          chat_template: str | None = None, **template_vars: Any) -> str:
    """Render `messages` with the model's chat template (or `chat_template`), as HF transformers does.
    Extra keyword arguments (tools=..., documents=...) are passed to the template."""
    source = chat_template if chat_template is not None else self.chat_template
    if source is None:
      raise TokenizerError(f"{self.name} has no chat template; pass one with chat_template=... "
                           "(a Jinja string) or send a plain prompt instead of chat messages")
    if source not in self._templates: self._templates[source] = compile_chat_template(source, self.name)
    try:
      return self._templates[source].render(messages=messages, add_generation_prompt=add_generation_prompt,
                                             bos_token=self.bos_token or "", eos_token=self.eos_token or "",
                                             **template_vars)
    except jinja2.TemplateError as e:
      raise TokenizerError(f"chat template of {self.name}: {e}") from None
