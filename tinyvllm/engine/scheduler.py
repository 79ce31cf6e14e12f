"""Iteration-level scheduling: which sequences run in the next model step, and how many tokens each.

Every step first gives each running decode one token, then spends what is left of the token budget on
prefill chunks: running sequences whose prompt is partly read, then waiting ones in arrival order. A long
prompt is cut into chunks so it never stalls the decodes. When the KV pool runs dry the most recently
admitted sequence is preempted: its blocks are freed and it goes back to the front of the queue, to be
recomputed from its tokens later. Nothing is lost and nothing crashes.

After the model step, `update_from_output` is the one place where sequences change: it advances
`num_computed_tokens`, appends the sampled tokens, applies the stop rules and gives back the blocks of
speculative tokens the target rejected.
"""
from __future__ import annotations
from collections import deque
from dataclasses import dataclass, field
from tinyvllm.engine.block_manager import BlockManager
from tinyvllm.engine.sequence import Sequence, SequenceStatus


@dataclass
class PrefillChunk:
  seq: Sequence
  num_tokens: int                 # tokens to read this step, from seq.num_computed_tokens on

  @property
  def completes_prompt(self) -> bool:
    """After this chunk every token has K/V, so the step samples this sequence's next token."""
    return self.seq.num_computed_tokens + self.num_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
  decodes: list[Sequence] = field(default_factory=list)      # one token each: their newest
  prefills: list[PrefillChunk] = field(default_factory=list)
  preempted: list[Sequence] = field(default_factory=list)

  @property
  def is_empty(self) -> bool: return not self.decodes and not self.prefills


class Scheduler:
  def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
               eos_token_ids: frozenset[int] = frozenset(), lookahead_tokens: int = 0, packed_prefill: bool = False):
    self.blocks = block_manager
    self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
    self.max_model_len, self.eos_token_ids = max_model_len, eos_token_ids
    self.lookahead = lookahead_tokens     # extra slots a decode reserves (speculative tokens)
    self.packed_prefill = packed_prefill  # the runner packs chunks back to back: a step costs their sum, not n x longest
    self.waiting: deque[Sequence] = deque()
    self.running: list[Sequence] = []     # in admission order: preemption takes from the end
    self.num_preemptions = 0

  def add(self, seq: Sequence) -> None: self.waiting.append(seq)

  def has_unfinished(self) -> bool: return bool(self.waiting or self.running)

  def schedule(self) -> SchedulerOutput:
    out = SchedulerOutput()
    budget = self.max_num_batched_tokens
    # decodes, oldest first; each needs room for its next token (plus any lookahead)
    for seq in list(self.running):
      if seq.status is not SequenceStatus.RUNNING or seq.is_prefilling: continue
      if not self._make_room(seq, seq.num_tokens + self.lookahead, out): continue
      out.decodes.append(seq)
      budget -= 1
    # prefill chunks: running sequences mid-prompt first, then new ones in arrival order
    for seq in [s for s in self.running if s.status is SequenceStatus.RUNNING and s.is_prefilling]:
      chunk = self._chunk_size(seq, out, budget)
      room = self._room(seq, reserve=0)
      if 0 < room < chunk: chunk = room   # read what fits now rather than preempt someone for the rest
      if chunk == 0 or not self._make_room(seq, seq.num_computed_tokens + chunk, out): continue
      out.prefills.append(PrefillChunk(seq, chunk))
    while self.waiting and len(self.running) < self.max_num_seqs:
      seq = self.waiting[0]
      # the watermark keeps admissions from forcing immediate preemptions; with nothing running it would
      # only stall progress, so it is waived then
      room = self._room(seq, reserve=self.blocks.watermark_blocks if self.running else 0)
      chunk = min(self._chunk_size(seq, out, budget), room)
      if chunk <= 0: break
      self.waiting.popleft()
      self.blocks.grow(seq.block_table, seq.num_computed_tokens + chunk)
      seq.status = SequenceStatus.RUNNING
      self.running.append(seq)
      out.prefills.append(PrefillChunk(seq, chunk))
    return out

  def _chunk_size(self, seq: Sequence, out: SchedulerOutput, budget: int) -> int:
    """Largest chunk that keeps the step's prefill tokens (packed: their sum; padded: sequences x longest chunk)
    within the budget left after the decodes."""
    remaining = seq.num_tokens - seq.num_computed_tokens
    if self.packed_prefill: return max(0, min(remaining, budget - sum(c.num_tokens for c in out.prefills)))
    n = len(out.prefills) + 1
    longest = max((c.num_tokens for c in out.prefills), default=0)
    if n * longest > budget: return 0
    return max(0, min(remaining, budget // n))

  def _room(self, seq: Sequence, reserve: int) -> int:
    """How many more of seq's tokens fit in its blocks plus the free blocks beyond `reserve`."""
    usable = max(0, self.blocks.num_free - reserve) + len(seq.block_table)
    return max(0, usable * self.blocks.block_size - seq.num_computed_tokens)

  def _make_room(self, seq: Sequence, num_tokens: int, out: SchedulerOutput) -> bool:
    """Grow seq's table to `num_tokens` slots, preempting the newest sequences while blocks are short.
    Returns False when seq itself had to be preempted."""
    while not self.blocks.can_grow(seq.block_table, num_tokens):
      victim = next(s for s in reversed(self.running) if s.status is SequenceStatus.RUNNING)
      self.preempt(victim, out)
      if victim is seq: return False
    self.blocks.grow(seq.block_table, num_tokens)
    return True

  def preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
    """Recompute-style preemption: drop the KV cache, requeue at the front, keep every token."""
    self.running.remove(seq)
    self.blocks.free(seq.block_table)
    seq.num_computed_tokens = 0
    seq.status = SequenceStatus.WAITING
    seq.metrics.num_preemptions += 1
    self.num_preemptions += 1
    self.waiting.appendleft(seq)
    out.preempted.append(seq)
    out.decodes = [s for s in out.decodes if s is not seq]
    out.prefills = [c for c in out.prefills if c.seq is not seq]

  # ---- the commit point ----

  def update_from_output(self, out: SchedulerOutput, sampled: dict[Sequence, list[int]]) -> dict[Sequence, list[int]]:
    """Apply a finished model step. `sampled` holds the new tokens of every decode and of every prefill chunk
    that completed its prompt; a decode verified with speculative drafts has the drafts it accepted plus one.
    Returns the tokens each sequence kept (a stop rule may end a speculative run early)."""
    kept: dict[Sequence, list[int]] = {}
    for chunk in out.prefills:
      if chunk.seq.is_finished: continue      # failed or aborted during the step
      chunk.seq.num_computed_tokens += chunk.num_tokens
      if chunk.seq in sampled: kept[chunk.seq] = self._append(chunk.seq, sampled[chunk.seq])
    for seq in out.decodes:
      if seq.is_finished or seq not in sampled: continue
      # the step wrote K/V for the newest token and any drafts; those of the accepted drafts stand
      seq.num_computed_tokens += len(sampled[seq])
      kept[seq] = self._append(seq, sampled[seq])
      if not seq.is_finished: self.blocks.truncate(seq.block_table, seq.num_tokens)   # rejected drafts' blocks
    return kept

  def _append(self, seq: Sequence, tokens: list[int]) -> list[int]:
    for i, token in enumerate(tokens):
      seq.token_ids.append(token)
      reason = self._stop_reason(seq, token)
      if reason is not None:
        self.finish(seq, *reason)
        return tokens[:i + 1]
    return list(tokens)

  def _stop_reason(self, seq: Sequence, token: int) -> tuple[str, int | None] | None:
    p = seq.params
    if token in self.eos_token_ids and not p.ignore_eos: return "stop", None
    if p.stop_token_ids and token in p.stop_token_ids: return "stop", token
    if p.max_tokens is not None and seq.num_output_tokens >= p.max_tokens: return "length", None
    if seq.num_tokens >= self.max_model_len: return "length", None
    return None

  def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
    seq.status = SequenceStatus.FINISHED
    seq.finish_reason, seq.stop_reason = reason, stop_reason
    self.blocks.free(seq.block_table)
    if seq in self.running: self.running.remove(seq)
    elif seq in self.waiting: self.waiting.remove(seq)
