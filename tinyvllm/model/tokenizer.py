"""Tokenizers: GGUF-embedded vocabularies, HF `tokenizer.json`, SentencePiece `tokenizer.model`; chat templates;
incremental detokenization.

Every backend reduces to the same two things, so there is one concrete `Tokenizer` class:
  - an encode function, (text, parse_special) -> ids, without BOS;
  - a table of the bytes each token id decodes to (SentencePiece's "▁" already turned into a space).
`decode` joins those bytes and decodes UTF-8 once; `IncrementalDetokenizer` feeds the same bytes through Python's
incremental UTF-8 decoder, which holds back an incomplete character. Both apply the same leading-space rule, so
the streamed text always equals `decode` of the same ids.

    tok = load_tokenizer("SmolLM2-135M-Instruct.Q4_1.gguf")
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Hi"}]), add_special_tokens=False)
    det = tok.detokenizer()
    text = "".join(det.add(t) for t in generated_ids) + det.flush()
"""
from __future__ import annotations
import codecs, json, os, re
from pathlib import Path
from typing import Any, Callable, Iterable

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment


class TokenizerError(ValueError):
  """A tokenizer could not be loaded or used; the message names the file or model and the problem."""


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


def compile_chat_template(source: str, name: str = "model") -> jinja2.Template:
  """Compile a chat template in the environment HF transformers uses: sandboxed, trim_blocks, lstrip_blocks,
  loop controls, `raise_exception`, `strftime_now`, and a `tojson` that keeps non-ASCII text as is."""
  env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])

  def raise_exception(message: str):
    raise TokenizerError(f"chat template of {name}: {message}")

  def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

  def strftime_now(fmt: str) -> str:
    import datetime
    return datetime.datetime.now().strftime(fmt)

  env.filters["tojson"] = tojson
  env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now)
  try:
    return env.from_string(source)
  except jinja2.TemplateError as e:
    raise TokenizerError(f"chat template of {name} does not compile: {e}") from None


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
    self._parts: list[str] = []
    for token_id in prompt_ids or (): self._utf8.decode(self._bytes(token_id))

  @property
  def text(self) -> str:
    """Everything emitted so far."""
    if len(self._parts) > 1: self._parts = ["".join(self._parts)]
    return self._parts[0] if self._parts else ""

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
    if new: self._parts.append(new)
    return new


# **** loading ****

def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
  """Load the tokenizer of a model.

  `path` is a GGUF file (embedded vocabulary), or a directory with `tokenizer.json` (HF tokenizers) or
  `tokenizer.model` (SentencePiece) plus, when present, tokenizer_config.json, chat_template.jinja,
  chat_template.json, generation_config.json and special_tokens_map.json. A directory holding only one GGUF
  file loads that file.
  """
  p = Path(path)
  if p.is_file():
    if _is_gguf(p):
      from tinyvllm.model.tokenizer_gguf import load_gguf_tokenizer
      return load_gguf_tokenizer(p)
    if p.name in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json"): return load_tokenizer(p.parent)
    raise TokenizerError(f"{p}: not a GGUF file, and not a tokenizer file of a model directory")
  if not p.is_dir(): raise TokenizerError(f"{p}: no such file or directory")
  if (p / "tokenizer.json").is_file(): return _load_hf_tokenizers(p, _read_hf_meta(p))
  if (p / "tokenizer.model").is_file(): return _load_sentencepiece(p, _read_hf_meta(p))
  ggufs = sorted(f for f in p.glob("*.gguf") if _is_gguf(f))
  if len(ggufs) == 1: return load_tokenizer(ggufs[0])
  if ggufs: raise TokenizerError(f"{p}: several GGUF files ({', '.join(f.name for f in ggufs)}); pass one of them")
  raise TokenizerError(f"{p}: no tokenizer found (expected tokenizer.json, tokenizer.model or a .gguf file)")


def _is_gguf(path: Path) -> bool:
  with open(path, "rb") as f: return f.read(4) == b"GGUF"


def _read_json(path: Path) -> dict:
  if not path.is_file(): return {}
  try:
    data = json.loads(path.read_text(encoding="utf-8"))
  except (OSError, ValueError) as e:
    raise TokenizerError(f"{path}: cannot read: {e}") from None
  if not isinstance(data, dict): raise TokenizerError(f"{path}: expected a JSON object")
  return data


def _content(token: Any) -> str | None:
  """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
  return token.get("content") if isinstance(token, dict) else token if isinstance(token, str) else None


def _read_hf_meta(d: Path) -> dict[str, Any]:
  """What the JSON files beside an HF tokenizer say: special-token texts, add_bos, EOS ids, chat template."""
  config = _read_json(d / "tokenizer_config.json")
  special_map = _read_json(d / "special_tokens_map.json")
  generation = _read_json(d / "generation_config.json")
  template = config.get("chat_template")
  if (d / "chat_template.json").is_file(): template = _read_json(d / "chat_template.json").get("chat_template", template)
  if (d / "chat_template.jinja").is_file(): template = (d / "chat_template.jinja").read_text(encoding="utf-8")
  if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
    named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
    template = named.get("default", next(iter(named.values()), None))
  gen_eos = generation.get("eos_token_id")
  return {
    "bos": _content(config.get("bos_token")) or _content(special_map.get("bos_token")),
    "eos": _content(config.get("eos_token")) or _content(special_map.get("eos_token")),
    "add_bos": config.get("add_bos_token"), "add_eos": bool(config.get("add_eos_token", False)),
    "added": {int(k): v for k, v in (config.get("added_tokens_decoder") or {}).items()},
    "eos_ids": [gen_eos] if isinstance(gen_eos, int) else list(gen_eos or []),
    "chat_template": template if isinstance(template, str) else None,
  }


_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


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


def _end_of_turn_ids(spelling_to_id: dict[str, int], is_special: Callable[[int], bool]) -> set[int]:
  return {spelling_to_id[t] for t in END_OF_TURN_TOKENS if t in spelling_to_id and is_special(spelling_to_id[t])}


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


def _load_hf_tokenizers(d: Path, meta: dict[str, Any]) -> Tokenizer:
  from tokenizers import Tokenizer as HFTokenizer
  file = d / "tokenizer.json"
  try:
    hf = HFTokenizer.from_file(str(file))
  except Exception as e:  # the Rust side raises its own exception type
    raise TokenizerError(f"{file}: cannot load: {e}") from None
  decoders = _decoder_types(_read_json(file).get("decoder"))
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
                   eos_token_ids={*meta["eos_ids"], *_end_of_turn_ids(vocab, special.__contains__)},
                   add_bos=bool(add_bos), add_eos=meta["add_eos"], chat_template=meta["chat_template"])


def _load_sentencepiece(d: Path, meta: dict[str, Any]) -> Tokenizer:
  import sentencepiece
  file = d / "tokenizer.model"
  try:
    sp = sentencepiece.SentencePieceProcessor(model_file=str(file))
  except Exception as e:  # sentencepiece raises OSError or RuntimeError depending on the problem
    raise TokenizerError(f"{file}: cannot load: {e}") from None
  n_sp = sp.get_piece_size()
  added: dict[int, dict] = meta["added"]  # tokens tokenizer_config.json adds, possibly beyond the model's pieces
  n = max([n_sp, *(i + 1 for i in added)])
  texts, pieces, special = [""] * n, [b""] * n, set()
  for i in range(n_sp):
    texts[i] = sp.id_to_piece(i)
    if sp.is_byte(i): pieces[i] = bytes([int(texts[i][3:5], 16)])
    elif sp.is_control(i) or sp.is_unknown(i) or sp.is_unused(i):
      pieces[i] = texts[i].encode("utf-8"); special.add(i)
    else: pieces[i] = texts[i].replace("▁", " ").encode("utf-8")
  for i, tok in added.items():
    texts[i], pieces[i] = tok["content"], tok["content"].encode("utf-8")
    if tok.get("special", True): special.add(i)
    else: special.discard(i)
  # special strings in the text become their ids; added non-special tokens are matched whole always
  specials = {texts[i]: i for i in special if texts[i] and (i >= n_sp or not sp.is_unused(i))}
  always = {tok["content"]: i for i, tok in added.items() if not tok.get("special", True)}

  def encode(text: str, parse_special: bool) -> list[int]:
    ids: list[int] = []
    for part in split_special(text, {**always, **specials} if parse_special else always):
      if isinstance(part, int): ids.append(part)
      else: ids.extend(sp.encode(part))
    return ids

  vocab = {t: i for i, t in enumerate(texts) if t}
  bos = vocab.get(meta["bos"]) if meta["bos"] else (sp.bos_id() if sp.bos_id() >= 0 else None)
  eos = vocab.get(meta["eos"]) if meta["eos"] else (sp.eos_id() if sp.eos_id() >= 0 else None)
  add_bos = meta["add_bos"] if meta["add_bos"] is not None else bos is not None  # SentencePiece LLMs (Llama 1/2) do
  # the model adds a dummy-prefix space when the encoding of a bare letter starts with "▁"
  strip_first = any(p.startswith("▁") for p in sp.encode("a", out_type=str)[:1])
  return Tokenizer(name=str(d), encode_fn=encode, pieces=pieces, texts=texts, special_ids=special,
                   strip_first_space=strip_first, bos_token_id=bos, eos_token_id=eos,
                   eos_token_ids={*meta["eos_ids"], *_end_of_turn_ids(vocab, special.__contains__)},
                   add_bos=add_bos, add_eos=meta["add_eos"], chat_template=meta["chat_template"])
