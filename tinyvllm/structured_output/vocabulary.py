"""Our tokenizer as llguidance sees it: every token id's bytes, the special ids and the EOS ids.

Any kind of tokenizer we load (HF tokenizer.json, SentencePiece, GGUF SPM or byte-level BPE) gives the same byte
table (`Tokenizer.token_bytes`), the bytes each token adds to generated text, so one adapter serves them all."""
from __future__ import annotations
import llguidance
from tinyvllm.model.tokenizer import Tokenizer


class _Vocabulary:
  """The attributes and the call llguidance's LLTokenizer reads from a tokenizer object (its TokenizerWrapper's
  interface): `tokens` (bytes per id), `special_token_ids`, `eos_token_id`, `bos_token_id`, and text -> ids."""
  is_tokenizer_wrapper = True

  def __init__(self, tokenizer: Tokenizer, vocab_size: int):
    tokens = tokenizer.token_bytes()[:vocab_size]
    # rows of the model's embedding past the tokenizer's vocabulary: empty, and llguidance never allows an empty token
    self.tokens = tokens + [b""] * (vocab_size - len(tokens))
    self.special_token_ids = sorted(t for t in tokenizer.special_token_ids if t < vocab_size)
    self.eos_token_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else min(tokenizer.eos_token_ids)
    self.bos_token_id = tokenizer.bos_token_id
    self._tokenizer = tokenizer

  def __call__(self, text: str) -> list[int]:
    # llguidance tokenizes text it forces (fast-forward tokens); special-token spellings in it stay text
    return self._tokenizer.encode(text, add_special_tokens=False, parse_special=False)


def llguidance_tokenizer(tokenizer: Tokenizer, vocab_size: int) -> llguidance.LLTokenizer:
  """llguidance's tokenizer over the model's `vocab_size` logits. Every end-of-sequence id of ours (the model's EOS
  and the end-of-turn tokens) is one of its EOS tokens, so a grammar that is complete allows each of them.
  Building it indexes the vocabulary (~0.1 s for 49k tokens): build it once per engine."""
  if not tokenizer.eos_token_ids:
    raise ValueError(f"structured output needs an end-of-sequence token, and the tokenizer of {tokenizer.name} has none")
  eos = sorted(t for t in tokenizer.eos_token_ids if t < vocab_size)
  return llguidance.LLTokenizer(_Vocabulary(tokenizer, vocab_size), n_vocab=vocab_size, eos_token=eos)
