"""Tokenizers embedded in GGUF files, implemented as llama.cpp does (llm_tokenizer_spm / llm_tokenizer_bpe).

- `tokenizer.ggml.model == "llama"`: SentencePiece-style BPE driven by token scores. The text gets a leading
  space (add_space_prefix), spaces become "▁", adjacent symbols merge best score first (leftmost on ties) as long
  as the merged text is a token, and a character with no token falls back to its <0xNN> byte tokens.
- `tokenizer.ggml.model == "gpt2"`: byte-level BPE. The pre-tokenizer named by `tokenizer.ggml.pre` cuts the text
  into words, each word's UTF-8 bytes are spelled in GPT-2's byte alphabet, and merges apply lowest rank first.

Both run on words, so results are cached per word: a 4 MB text has only some tens of thousands of distinct words.
Special tokens are cut out of the text first (control ones only when parse_special, user-defined ones always).
"""
from __future__ import annotations
import heapq
from pathlib import Path
from typing import Any, Callable

import regex

from tinyvllm.model.gguf_file import GGUFError, read_gguf_metadata
from tinyvllm.model.tokenizer.base import END_OF_TURN_TOKENS, Tokenizer, split_special
from tinyvllm.model.tokenizer.byte_level import byte_level_decoder, decode_byte_level
from tinyvllm.model.tokenizer.errors import TokenizerError

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

_CACHE_LIMIT = 1 << 18  # words kept per tokenizer; the cache is simply emptied when full


# **** merging ****

def merge_symbols(symbols: list[str], priority: Callable[[str, str], float | None]) -> list[str]:
  """Repeatedly merge the adjacent pair with the lowest `priority` (leftmost on ties) until no pair has one.

  This is llama.cpp's work queue: a heap of candidate pairs over a linked list of symbols. An entry is stale
  once either side has changed, which we see by comparing the texts it was pushed with.
  """
  n = len(symbols)
  if n < 2: return symbols
  symbols = list(symbols)
  nxt, prv = list(range(1, n + 1)), list(range(-1, n - 1))
  nxt[-1] = -1
  heap = []
  for i in range(n - 1):
    if (p := priority(symbols[i], symbols[i + 1])) is not None: heap.append((p, i, symbols[i], symbols[i + 1]))
  heapq.heapify(heap)
  while heap:
    _, left, ltext, rtext = heapq.heappop(heap)
    right = nxt[left]
    if right < 0 or symbols[left] != ltext or symbols[right] != rtext: continue
    symbols[left], symbols[right] = ltext + rtext, ""
    nxt[left] = nxt[right]
    if nxt[right] >= 0: prv[nxt[right]] = left
    for a, b in ((prv[left], left), (left, nxt[left])):
      if a >= 0 and b >= 0 and (p := priority(symbols[a], symbols[b])) is not None:
        heapq.heappush(heap, (p, a, symbols[a], symbols[b]))
  return [s for s in symbols if s]


# **** SentencePiece-style ("llama") ****

class SpmVocab:
  """llama.cpp's llm_tokenizer_spm over a GGUF vocabulary with scores."""

  def __init__(self, tokens: list[str], scores: list[float], types: list[int], unk_id: int | None, add_space_prefix: bool):
    self.token_to_id = {t: i for i, t in enumerate(tokens)}  # later duplicates win, as in llama.cpp
    self.scores = scores
    self.add_space_prefix = add_space_prefix
    fallback = unk_id if unk_id is not None else 0
    self.byte_ids = [self.token_to_id.get(f"<0x{b:02X}>", self.token_to_id.get(chr(b), fallback)) for b in range(256)]
    self.specials = {t: i for i, t in enumerate(tokens) if types[i] in (CONTROL, UNKNOWN, USER_DEFINED) and t}
    self.user_defined = {t: i for i, t in enumerate(tokens) if types[i] == USER_DEFINED and t}
    # Words are cut before a "▁" that follows another character, except after characters some token has right
    # before a "▁": no token can then span a cut, so merging each piece alone gives the same result.
    joined = {t[k - 1] for t in tokens for k in range(1, len(t)) if t[k] == "▁" and t[k - 1] != "▁"}
    self.word_start = regex.compile(f"(?<=[^▁{regex.escape(''.join(sorted(joined)))}])(?=▁)")
    self.cache: dict[str, list[int]] = {}

  def encode(self, text: str, parse_special: bool) -> list[int]:
    ids: list[int] = []
    after_special = True  # llama.cpp adds the space prefix at the start and after every special token
    for part in split_special(text, self.specials if parse_special else self.user_defined):
      if isinstance(part, int):
        ids.append(part)
        after_special = True
        continue
      if self.add_space_prefix and after_special: part = " " + part
      for word in self.word_start.split(part.replace(" ", "▁")): ids.extend(self._word(word))
      after_special = False
    return ids

  def _priority(self, a: str, b: str) -> float | None:
    token = self.token_to_id.get(a + b)
    return None if token is None else -self.scores[token]  # best score first

  def _word(self, word: str) -> list[int]:
    if (hit := self.cache.get(word)) is not None: return hit
    ids: list[int] = []
    for sym in merge_symbols(list(word), self._priority):
      token = self.token_to_id.get(sym)
      if token is not None: ids.append(token)
      else: ids.extend(self.byte_ids[b] for b in sym.encode("utf-8", errors="surrogatepass"))
    if len(self.cache) >= _CACHE_LIMIT: self.cache.clear()
    self.cache[word] = ids
    return ids


# **** byte-level BPE ("gpt2") ****

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = _LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}")

# tokenizer.ggml.pre -> (regexes applied one after another, each splitting the pieces of the previous one and
# keeping the text between matches; ignore_merges: a word that is a token is taken whole; BOS added by default).
# Taken from llama.cpp's llm_tokenizer_bpe; llama.cpp's hand-written GPT-2 splitter includes the final "\s+".
PRE_TOKENIZERS: dict[str, tuple[tuple[str, ...], bool, bool]] = {
  "default": ((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"), False, False),
  **{name: ((_GPT2,), False, False) for name in ("gpt-2", "phi-2", "mpt", "olmo", "jais")},
  **{name: ((_LLAMA3,), True, True) for name in ("llama3", "llama-v3", "llama-bpe", "falcon3")},
  **{name: ((_LLAMA3,), False, False) for name in ("dbrx", "smaug-bpe")},
  # StarCoder-style: every digit on its own, then GPT-2's regex (SmolLM's tokenizer.json: Digits + ByteLevel)
  **{name: ((r"\p{N}", _GPT2), False, False) for name in ("starcoder", "smollm", "refact", "command-r", "codeshell")},
  **{name: ((_QWEN2,), False, False) for name in ("qwen2", "stablelm2", "deepseek-r1-qwen")},
}


class BpeVocab:
  """llama.cpp's llm_tokenizer_bpe over a GGUF vocabulary with merges."""

  def __init__(self, tokens: list[str], merges: list[str], types: list[int], pre: str, path: Path):
    if pre not in PRE_TOKENIZERS:
      raise TokenizerError(f"{path}: unsupported pre-tokenizer tokenizer.ggml.pre = {pre!r} "
                           f"(supported: {', '.join(sorted(PRE_TOKENIZERS))})")
    patterns, self.ignore_merges, self.default_add_bos = PRE_TOKENIZERS[pre]
    self.patterns = [regex.compile(p) for p in patterns]
    self.token_to_id = {t: i for i, t in enumerate(tokens)}
    self.ranks: dict[tuple[str, str], int] = {}
    for rank, merge in enumerate(merges):
      cut = merge.find(" ", 1)  # from 1: a merge's left side may itself start with a space
      if cut > 0: self.ranks.setdefault((merge[:cut], merge[cut + 1:]), rank)
    self.specials = {t: i for i, t in enumerate(tokens) if types[i] in (CONTROL, UNKNOWN, USER_DEFINED) and t}
    self.user_defined = {t: i for i, t in enumerate(tokens) if types[i] == USER_DEFINED and t}
    # Latin-1 decoding maps byte b to chr(b); this table then respells it in the byte-level alphabet
    self.spell = {b: c for c, b in byte_level_decoder().items()}
    self.cache: dict[str, list[int]] = {}

  def encode(self, text: str, parse_special: bool) -> list[int]:
    ids: list[int] = []
    for part in split_special(text, self.specials if parse_special else self.user_defined):
      if isinstance(part, int): ids.append(part)
      else:
        for word in self.pre_tokenize(part):
          hit = self.cache.get(word)
          ids.extend(hit if hit is not None else self._word(word))
    return ids

  def pre_tokenize(self, text: str) -> list[str]:
    pieces = [text]
    for pattern in self.patterns:
      out: list[str] = []
      for piece in pieces:
        pos = 0
        for m in pattern.finditer(piece):
          if m.start() > pos: out.append(piece[pos:m.start()])
          if m.end() > m.start(): out.append(m.group())
          pos = m.end()
        if pos < len(piece): out.append(piece[pos:])
      pieces = out
    return pieces

  def _word(self, word: str) -> list[int]:
    spelled = word.encode("utf-8", errors="surrogatepass").decode("latin-1").translate(self.spell)
    if self.ignore_merges and spelled in self.token_to_id: ids = [self.token_to_id[spelled]]
    else:
      ids = []
      for sym in merge_symbols(list(spelled), lambda a, b: self.ranks.get((a, b))):
        token = self.token_to_id.get(sym)
        if token is not None: ids.append(token)
        else: ids.extend(self.token_to_id[c] for c in sym if c in self.token_to_id)
    if len(self.cache) >= _CACHE_LIMIT: self.cache.clear()
    self.cache[word] = ids
    return ids


# **** loading ****

def load_gguf_tokenizer(path: str | Path) -> Tokenizer:
  path = Path(path)
  try: meta = read_gguf_metadata(path)
  except GGUFError as e: raise TokenizerError(str(e)) from None
  model = meta.get("tokenizer.ggml.model")
  if model is None: raise TokenizerError(f"{path}: the GGUF file has no embedded tokenizer (no tokenizer.ggml.model)")
  tokens: list[str] = meta.get("tokenizer.ggml.tokens") or []
  if not tokens: raise TokenizerError(f"{path}: the GGUF file has no tokenizer.ggml.tokens")
  types = [int(t) for t in meta.get("tokenizer.ggml.token_type", [NORMAL] * len(tokens))]
  unk_id = _opt_int(meta.get("tokenizer.ggml.unknown_token_id"))

  if model == "llama":
    scores = [float(s) for s in meta.get("tokenizer.ggml.scores", [0.0] * len(tokens))]
    vocab: SpmVocab | BpeVocab = SpmVocab(tokens, scores, types, unk_id, bool(meta.get("tokenizer.ggml.add_space_prefix", True)))
    pieces = [_spm_piece(t, ty) for t, ty in zip(tokens, types)]
    strip_first, default_add_bos = vocab.add_space_prefix, True
  elif model == "gpt2":
    if "tokenizer.ggml.merges" not in meta: raise TokenizerError(f"{path}: byte-level BPE vocabulary without tokenizer.ggml.merges")
    vocab = BpeVocab(tokens, meta["tokenizer.ggml.merges"], types, meta.get("tokenizer.ggml.pre") or "default", path)
    alphabet = byte_level_decoder()
    pieces = [b"" if ty == UNUSED else t.encode("utf-8") if ty in (CONTROL, UNKNOWN) else decode_byte_level(t, alphabet)
              for t, ty in zip(tokens, types)]
    strip_first, default_add_bos = False, vocab.default_add_bos
  else:
    raise TokenizerError(f"{path}: unsupported tokenizer.ggml.model = {model!r} (supported: 'llama', 'gpt2')")

  special = [i for i, ty in enumerate(types) if ty in (CONTROL, UNKNOWN, UNUSED)]
  eos = _opt_int(meta.get("tokenizer.ggml.eos_token_id"))
  end_of_turn = {_opt_int(meta.get(f"tokenizer.ggml.{k}_token_id")) for k in ("eot", "eom")} - {None}
  end_of_turn |= {vocab.specials[t] for t in END_OF_TURN_TOKENS if t in vocab.specials}
  add_bos = meta.get("tokenizer.ggml.add_bos_token")
  return Tokenizer(name=str(meta.get("general.name") or path.name), encode_fn=vocab.encode, pieces=pieces,
                   texts=list(tokens), special_ids=special, strip_first_space=strip_first,
                   bos_token_id=_opt_int(meta.get("tokenizer.ggml.bos_token_id")), eos_token_id=eos,
                   eos_token_ids=end_of_turn, add_bos=bool(default_add_bos if add_bos is None else add_bos),
                   add_eos=bool(meta.get("tokenizer.ggml.add_eos_token", False)),
                   chat_template=meta.get("tokenizer.chat_template"))


def _spm_piece(token: str, token_type: int) -> bytes:
  """What a SentencePiece-style token decodes to, per llama.cpp's token_to_piece."""
  if token_type == BYTE: return bytes([int(token[3:5], 16)])
  if token_type == UNUSED: return b""
  if token_type == NORMAL: return token.replace("▁", " ").encode("utf-8")
  return token.encode("utf-8")  # control / unknown (hidden unless asked for) and user-defined: as spelled


def _opt_int(value: Any) -> int | None:
  return None if value is None else int(value)
