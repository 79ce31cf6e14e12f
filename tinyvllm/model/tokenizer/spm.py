"""SentencePiece `tokenizer.model` (Llama 1/2-style HF directories) through the `sentencepiece` library; special
strings are cut out by us first, because sentencepiece would split them."""
from __future__ import annotations
from pathlib import Path
from typing import Any

from tinyvllm.model.tokenizer.base import Tokenizer, end_of_turn_ids, split_special
from tinyvllm.model.tokenizer.errors import TokenizerError


def load_sentencepiece(d: Path, meta: dict[str, Any]) -> Tokenizer:
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
                   eos_token_ids={*meta["eos_ids"], *end_of_turn_ids(vocab, special.__contains__)},
                   add_bos=add_bos, add_eos=meta["add_eos"], chat_template=meta["chat_template"])
