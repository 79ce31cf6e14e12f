"""Speculative decoding: a draft model proposes k tokens per sequence, the target checks them in one pass.

The draft has its own model runner, KV cache and block manager (the same allocator code); each sequence keeps
a draft block table and how many of its tokens the draft has read. The draft catches up lazily: its first
pass of a step reads every token it has not seen (1 normally, 2 after a fully accepted run, more after steps
without speculation or after preemption), the next k-1 passes read one drafted token each.

Whether a step speculates is decided per step by `SpecPolicy` from measured acceptance and step times.
"""
from __future__ import annotations
from dataclasses import dataclass, field
import numpy as np
from tinyvllm import sampler
from tinyvllm.engine.block_manager import BlockManager
from tinyvllm.engine.model_runner import ModelRunner, WorkItem, bucket
from tinyvllm.engine.sequence import Sequence


@dataclass
class Proposal:
  drafts: list[int]
  q: np.ndarray | None          # [k, V] draft sampling distributions (None when greedy)


class SpeculativeDecoder:
  def __init__(self, runner: ModelRunner, block_manager: BlockManager, num_tokens: int, always: bool = False,
               window: int | None = None):
    """`window`: every layer of the draft slides (its ModelConfig.freeable_window): draft blocks its window has
    passed go back to the draft pool, as the scheduler does for the target, so a long chat keeps speculating."""
    self.runner, self.blocks, self.k, self.window = runner, block_manager, num_tokens, window
    self.policy = SpecPolicy(num_tokens, always=always)

  def release(self, seq: Sequence) -> None:
    """Let seq's draft cache go (finished or preempted), its verified full blocks registered first: with prefix
    caching the draft's cache follows the target's rule, so a later prompt with the same prefix skips it in both."""
    self.rollback(seq, seq.num_computed_tokens)
    self.blocks.free(seq.draft_block_table)
    seq.draft_num_computed = seq.draft_num_registered = 0

  def rollback(self, seq: Sequence, num_valid: int) -> None:
    """Keep only draft K/V of the first `num_valid` tokens (verified: the target's), empty blocks back to the pool at
    once; full blocks of verified tokens are registered in the draft's prefix cache."""
    seq.draft_num_computed = min(seq.draft_num_computed, num_valid)
    self.blocks.truncate(seq.draft_block_table, seq.draft_num_computed)
    if self.blocks.enable_caching:
      seq.draft_num_registered = self.blocks.register(seq.draft_block_table, seq.block_hashes, seq.draft_num_registered,
                                                      seq.draft_num_computed)

  def _start_from_cache(self, seq: Sequence) -> None:
    """A sequence new to the draft takes the longest cached run of its prompt's blocks (leaving at least its last
    token to read: its logits give the first draft)."""
    if not self.blocks.enable_caching or seq.draft_block_table: return
    self.blocks.extend_hashes(seq.block_hashes, seq.token_ids)
    hit = self.blocks.cached_prefix(seq.block_hashes, (seq.num_tokens - 1) // self.blocks.block_size)
    if self.blocks.num_reclaimed(hit) > self.blocks.num_free: return
    self.blocks.take(seq.draft_block_table, hit)
    seq.draft_num_computed, seq.draft_num_registered = len(hit) * self.blocks.block_size, len(hit)

  def propose(self, seqs: list[Sequence], penalize) -> list[Proposal] | None:
    """k drafted tokens per sequence, sampled from the draft with each sequence's own parameters and stream.
    `penalize(seq, logits, extra_tokens)` applies the sampling penalties as the target's sampler does.
    Returns None when the draft cache has no room (the step then decodes without speculation)."""
    k = self.k
    for seq in seqs: self._start_from_cache(seq)
    if self.window is not None:   # the draft's next query reads from draft_num_computed on: keys above it - window
      for seq in seqs:
        self.blocks.release_passed(seq.draft_block_table, seq.draft_num_computed, self.window)
    for seq in seqs:
      if not self.blocks.can_grow(seq.draft_block_table, seq.num_tokens + k - 1): return None
    for seq in seqs: self.blocks.grow(seq.draft_block_table, seq.num_tokens + k - 1)
    # catch-up pass: every token the draft has not read yet, the newest last; its logits give draft 1
    items = [WorkItem(s.draft_block_table, s.draft_num_computed, s.token_ids[s.draft_num_computed:]) for s in seqs]
    singles = [i for i, w in enumerate(items) if len(w.tokens) == 1]
    chunks = [i for i, w in enumerate(items) if len(w.tokens) > 1]
    one, many, _ = self.runner.execute([items[i] for i in singles], [items[i] for i in chunks])
    logits = np.empty((len(seqs), one.shape[-1] if len(one) else many.shape[-1]), np.float32)
    logits[singles], logits[chunks] = one, many
    for s in seqs: s.draft_num_computed = s.num_tokens
    drafts: list[list[int]] = [[] for _ in seqs]
    qs: list[list[np.ndarray]] = [[] for _ in seqs]
    for step in range(k):
      for i, seq in enumerate(seqs):
        processed = penalize(seq, logits[i], drafts[i])
        if seq.params.greedy: drafts[i].append(int(np.argmax(processed)))
        else:
          q = sampler.probabilities(processed, seq.params)
          qs[i].append(q)
          drafts[i].append(sampler.draw(q, seq.generator))
      if step == k - 1: break   # the last draft is only verified, never read by the draft
      logits, _, _ = self.runner.execute([WorkItem(s.draft_block_table, s.num_tokens + step, [d[-1]]) for s, d in zip(seqs, drafts)])
      for s in seqs: s.draft_num_computed += 1
    return [Proposal(d, None if s.params.greedy else np.stack(q)) for s, d, q in zip(seqs, drafts, qs)]


@dataclass
class SpecPolicy:
  """Speculate in a step only when it is expected to beat plain decoding at this batch size.

  With acceptance rate a per drafted token, a speculative step yields E = (1 - a^(k+1)) / (1 - a) tokens per
  sequence. It pays when E / t_spec > 1 / t_plain, where t_spec (k draft passes + one verify pass) and t_plain
  (one ordinary decode step) are running averages measured at the same batch-size bucket. Until both are
  measured for a bucket, it tries each twice (the first step of a new shape includes its TinyJit capture, so the
  second measurement replaces the first). Afterwards it re-measures the option not taken (a *probe*) once
  the time spent in the bucket since the last probe reaches that option's cost / `probe_share`: a change in
  acceptance (new prompts) or in cost is noticed, and probes of a losing option take at most about
  `probe_share` of the time however expensive that option is."""
  k: int
  always: bool = False                         # speculate every step (measurements and tests)
  probe_share: float = 0.05
  smoothing: float = 0.2
  acceptance: float = 0.7                      # running acceptance rate (prior: a typical self-draft)
  t_spec: dict[int, float] = field(default_factory=dict)
  t_plain: dict[int, float] = field(default_factory=dict)
  samples: dict[tuple[int, bool], int] = field(default_factory=dict)   # steps measured per (bucket, speculated)
  elapsed: dict[int, float] = field(default_factory=dict)      # seconds of recorded steps per bucket
  last_probe: dict[int, float] = field(default_factory=dict)   # `elapsed` at the bucket's last probe

  def expected_tokens(self) -> float:
    a = min(self.acceptance, 0.999)
    return (1 - a ** (self.k + 1)) / (1 - a)

  def should_speculate(self, batch: int) -> bool:
    b = bucket(batch)
    if self.always or self.samples.get((b, True), 0) < 2: return True
    if self.samples.get((b, False), 0) < 2: return False
    choice = self.expected_tokens() / self.t_spec[b] > 1 / self.t_plain[b]
    probe_cost = self.t_plain[b] if choice else self.t_spec[b]
    if self.elapsed.get(b, 0.0) - self.last_probe.get(b, 0.0) >= probe_cost / self.probe_share:
      self.last_probe[b] = self.elapsed.get(b, 0.0)
      return not choice
    return choice

  def record_spec(self, batch: int, proposed: int, accepted: int, seconds: float) -> None:
    if proposed: self.acceptance += self.smoothing * (accepted / proposed - self.acceptance)
    self._average(self.t_spec, bucket(batch), seconds, True)

  def record_plain(self, batch: int, seconds: float) -> None: self._average(self.t_plain, bucket(batch), seconds, False)

  def _average(self, table: dict[int, float], b: int, seconds: float, speculated: bool) -> None:
    n = self.samples[b, speculated] = self.samples.get((b, speculated), 0) + 1
    table[b] = seconds if n <= 2 else table[b] + self.smoothing * (seconds - table[b])
    self.elapsed[b] = self.elapsed.get(b, 0.0) + seconds

