"""One sequence's place in its grammar: an llguidance matcher over the tokens committed so far, plus the drafted
tokens speculative decoding has run it through.

Speculation checks each drafted token against the matcher: the draft samples draft i under the mask after drafts
0..i-1 (so every draft is a token the grammar allows), the target's rows are masked the same way, and the commit
point keeps the drafts the target accepted and rolls the matcher back over the rest.

End-of-sequence tokens never reach the matcher: the sequence ends at one, so nothing after it is ever committed,
and llguidance does not record an EOS given to a matcher that had already stopped (a later rollback would then
undo one token too many)."""
from __future__ import annotations
import llguidance
import numpy as np
from tinyvllm.structured_output.bitmask import bias_from_bitmask, mask_words


class GrammarState:
  def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, eos_ids: frozenset[int]):
    self.matcher = matcher
    self.vocab_size, self.mask_words = vocab_size, mask_words(vocab_size)
    self.eos_ids = eos_ids
    self.drafts: list[int] = []                    # tokens past the committed ones (speculation)
    self._masks: dict[int, np.ndarray] = {}        # n -> the bias row after drafts[:n]

  def fill_mask(self, row: np.ndarray) -> None:
    """Write the bitmask of the tokens allowed next into `row` (int32, `mask_words` long, contiguous). Releases
    the GIL while llguidance computes, so it can run beside the model step."""
    self.matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)

  def bias(self) -> np.ndarray:
    """The tokens allowed after the committed ones as a bias row (float32[V]: 0 allowed, -inf not)."""
    row = np.empty(self.mask_words, np.int32)
    self.fill_mask(row)
    return bias_from_bitmask(row, self.vocab_size)

  def mask_after(self, drafts: list[int]) -> np.ndarray:
    """The bias row after the committed tokens followed by `drafts`. The matcher consumes the drafts it has not seen
    (rolling back any it consumed that differ); masks along one run of drafts are computed once each, as the draft
    model asks for them one by one and the target's verification asks for them all again."""
    n = len(drafts)
    if n in self._masks and self.drafts[:n] == list(drafts): return self._masks[n]
    self._truncate(_common_prefix(self.drafts, drafts))
    for token in drafts[len(self.drafts):]:
      if _first_eos(self.drafts, self.eos_ids) == len(self.drafts): self._consume(token)   # nothing after an EOS
      self.drafts.append(token)
    if _first_eos(self.drafts, self.eos_ids) < n:   # past the end (a draft was EOS, so eos_ids has one): any row that
      row = np.full(self.vocab_size, -np.inf, np.float32)   # samples something does; the commit drops it
      row[sorted(self.eos_ids)] = 0
      self._masks[n] = row
    else: self._masks[n] = self.bias()
    return self._masks[n]

  def reset_drafts(self) -> None:
    """Back to the committed tokens (a step that does not speculate for this sequence)."""
    self._truncate(0)

  def commit(self, tokens: list[int]) -> None:
    """The commit point: `tokens` follow the committed ones. Drafts already consumed stand as far as they agree
    with `tokens`; the matcher rolls back over the rest and consumes what is new. A token the grammar refuses
    raises ValueError (the mask never lets one be sampled, so this is a bug; it fails only this request)."""
    self._truncate(_common_prefix(self.drafts, tokens))
    for token in tokens[len(self.drafts):_first_eos(tokens, self.eos_ids)]: self._consume(token)
    self.drafts, self._masks = [], {}

  @property
  def is_accepting(self) -> bool:
    """The committed tokens form a complete output: end-of-sequence is allowed."""
    return self.matcher.is_accepting()

  def _consume(self, token: int) -> None:
    if token in self.eos_ids:
      if not self.matcher.is_accepting(): raise ValueError(f"structured output: end of sequence before the grammar is complete")
    elif not self.matcher.consume_token(token):
      raise ValueError(f"structured output: the grammar refused token {token}: {self.matcher.get_error()}")

  def _truncate(self, keep: int) -> None:
    """Keep drafts[:keep]: roll the matcher back over the drafts after them that it consumed."""
    if keep >= len(self.drafts): return
    held = _first_eos(self.drafts, self.eos_ids)      # drafts the matcher consumed: those before the first EOS
    if held > keep and not self.matcher.rollback(held - keep):
      raise ValueError(f"structured output: rollback failed: {self.matcher.get_error()}")
    self.drafts = self.drafts[:keep]
    self._masks = {n: m for n, m in self._masks.items() if n <= keep}


def _common_prefix(a: list[int], b: list[int]) -> int:
  n = 0
  for x, y in zip(a, b):
    if x != y: break
    n += 1
  return n


def _first_eos(tokens: list[int], eos_ids: frozenset[int]) -> int:
  """Index of the first end-of-sequence token in `tokens` (len(tokens) if none)."""
  return next((i for i, t in enumerate(tokens) if t in eos_ids), len(tokens))
