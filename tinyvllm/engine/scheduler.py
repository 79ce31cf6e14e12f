"""Iteration-level scheduling: which sequences run in the next model step, and how many tokens each.

Every step first gives each running decode one token, then spends what is left of the token budget on
prefill chunks: running sequences whose prompt is partly read, then waiting ones in arrival order. A long
prompt is cut into chunks so it never stalls the decodes. When the KV pool runs dry the most recently
admitted sequence is preempted: its blocks are freed and it goes back to the front of the queue, to be
recomputed from its tokens later. Nothing is lost and nothing crashes.

With prefix caching, admission first looks up the longest run of the sequence's full blocks that is cached
and starts after it (at least the last token is recomputed: its logits give the next token). The n completions
of one request share their prompt this way: the others wait until the first has read it.

After the model step, `update_from_output` is the one place where sequences change: it advances
`num_computed_tokens`, appends the sampled tokens, advances a constrained sequence's grammar (rolling back drafts
the target rejected), registers blocks that became full and computed in the prefix cache, applies the stop rules
and gives back the blocks of speculative tokens the target rejected.
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
               eos_token_ids: frozenset[int] = frozenset(), lookahead_tokens: int = 0, packed_prefill: bool = False,
               window: int | None = None):
    """`window`: every layer of the model attends to at most the latest `window` keys (ModelConfig.freeable_window):
    blocks a sequence's window has passed go back to the pool before each step."""
    self.blocks, self.window = block_manager, window
    self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
    self.max_model_len, self.eos_token_ids = max_model_len, eos_token_ids
    self.lookahead = lookahead_tokens     # extra slots a decode reserves (speculative tokens)
    self.packed_prefill = packed_prefill  # the runner packs chunks back to back: a step costs their sum, not n x longest
    self.waiting: deque[Sequence] = deque()
    self.running: list[Sequence] = []     # in admission order: preemption takes from the end
    # n > 1 with prefix caching: completions 1.. wait here until completion 0 has read the prompt, then hit its blocks
    self.held: dict[str, list[Sequence]] = {}
    self.num_preemptions = 0
    self.prefix_cache_queries = self.prefix_cache_hits = 0   # tokens looked up / found at admissions
    self.num_window_freed = 0   # blocks returned early because every window had passed them

  def add(self, seq: Sequence) -> None:
    if self.blocks.enable_caching and seq.index > 0 and seq.num_prompt_tokens > self.blocks.block_size:
      self.held.setdefault(seq.request_id, []).append(seq)
    else: self.waiting.append(seq)

  def has_unfinished(self) -> bool: return bool(self.waiting or self.running or self.held)

  def schedule(self) -> SchedulerOutput:
    out = SchedulerOutput()
    budget = self.max_num_batched_tokens
    if self.window is not None:
      for seq in self.running: self._slide(seq)
    # decodes, oldest first; each needs room for its next token (plus any lookahead)
    for seq in list(self.running):
      if seq.status is not SequenceStatus.RUNNING or seq.is_prefilling: continue
      if not self._make_room(seq, min(seq.num_tokens + self.lookahead, self.max_model_len), out): continue
      out.decodes.append(seq)
      budget -= 1
    # prefill chunks: running sequences mid-prompt first, then new ones in arrival order
    for seq in [s for s in self.running if s.status is SequenceStatus.RUNNING and s.is_prefilling]:
      chunk = self._chunk_size(seq.num_tokens - seq.num_computed_tokens, out, budget)
      room = self._room(seq, reserve=0)
      if 0 < room < chunk: chunk = room   # read what fits now rather than preempt someone for the rest
      if chunk == 0 or not self._make_room(seq, seq.num_computed_tokens + chunk, out): continue
      out.prefills.append(PrefillChunk(seq, chunk))
    while self.waiting and len(self.running) < self.max_num_seqs:
      seq = self.waiting[0]
      hit = self._cached_prefix(seq)
      start = len(hit) * self.blocks.block_size
      # the watermark keeps admissions from forcing immediate preemptions (with nothing running it would only
      # stall progress, so it is waived then); a hit on a free cached block takes that block from the pool too
      reserve = (self.blocks.watermark_blocks if self.running else 0) + self.blocks.num_reclaimed(hit)
      room = max(0, self.blocks.num_free - reserve) * self.blocks.block_size
      chunk = min(self._chunk_size(seq.num_tokens - start, out, budget), room)
      if chunk <= 0: break
      self.waiting.popleft()
      self._admit(seq, hit, chunk)
      out.prefills.append(PrefillChunk(seq, chunk))
    return out

  def can_admit(self) -> bool:
    """Would `schedule` admit a waiting sequence now: one waits, fewer than max_num_seqs run, and the pool holds a
    block beyond the admission watermark (async scheduling keeps its pipeline while none could be)."""
    reserve = self.blocks.watermark_blocks if self.running else 0
    return bool(self.waiting) and len(self.running) < self.max_num_seqs and self.blocks.num_free > reserve

  def reserve_steps(self, decodes: list[Sequence], steps: int) -> int:
    """Multi-step decoding: room in each decode's table for `steps` tokens from its newest on (positions up to
    num_tokens + steps - 2), taken when the free pool holds it above the watermark, with no one preempted. Returns the
    steps the decodes may run: `steps`, or 1 (their room for one was made by `schedule`). Slots a run does not
    use (a sequence that stops early) go back at the commit, as rejected drafts' do."""
    return steps if steps > 1 and self.reserve(decodes, steps - 1) else 1

  def reserve(self, decodes: list[Sequence], extra: int) -> bool:
    """Grow each decode's table to num_tokens + `extra` slots if the free pool holds them all above the watermark,
    with no one preempted (multi-step and pipelined runs); False, and nothing taken, if it does not."""
    need = sum(self.blocks.blocks_missing(s.block_table, s.num_tokens + extra) for s in decodes)
    if need > self.blocks.num_free - self.blocks.watermark_blocks: return False
    for s in decodes: self.blocks.grow(s.block_table, s.num_tokens + extra)
    return True

  def _slide(self, seq: Sequence) -> None:
    """Release the blocks wholly below seq's window: its next query is at position num_computed_tokens."""
    self.num_window_freed += self.blocks.release_passed(seq.block_table, seq.num_computed_tokens, self.window)

  def _cached_prefix(self, seq: Sequence) -> list[int]:
    """The cached blocks a waiting sequence can start from: its longest cached run of full blocks, leaving at
    least its last token to compute. None for requests that want prompt logprobs (every position must be read)."""
    if not self.blocks.enable_caching or seq.params.prompt_logprobs is not None: return []
    self.blocks.extend_hashes(seq.block_hashes, seq.token_ids)
    return self.blocks.cached_prefix(seq.block_hashes, (seq.num_tokens - 1) // self.blocks.block_size)

  def _admit(self, seq: Sequence, hit: list[int], chunk: int) -> None:
    self.blocks.take(seq.block_table, hit)
    seq.num_computed_tokens = len(hit) * self.blocks.block_size
    seq.num_registered_blocks = len(hit)
    self.blocks.grow(seq.block_table, seq.num_computed_tokens + chunk)
    seq.status = SequenceStatus.RUNNING
    self.running.append(seq)
    if self.blocks.enable_caching:
      self.prefix_cache_queries += seq.num_tokens
      self.prefix_cache_hits += seq.num_computed_tokens
    if seq.index == 0 and seq.metrics.num_cached_tokens is None: seq.metrics.num_cached_tokens = seq.num_computed_tokens

  def _chunk_size(self, remaining: int, out: SchedulerOutput, budget: int) -> int:
    """Largest chunk of the `remaining` tokens that keeps the step's prefill tokens (packed: their sum; padded:
    sequences x longest chunk) within the budget left after the decodes."""
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
    """Recompute-style preemption: let the KV blocks go, requeue at the front, keep every token. With prefix
    caching the full blocks stay cached until the pool needs them, so the recompute mostly hits."""
    self.running.remove(seq)
    self.blocks.free(seq.block_table)
    seq.num_computed_tokens = seq.num_registered_blocks = 0
    seq.status = SequenceStatus.WAITING
    seq.metrics.num_preemptions += 1
    self.num_preemptions += 1
    self.waiting.appendleft(seq)
    out.preempted.append(seq)
    out.decodes = [s for s in out.decodes if s is not seq]
    out.prefills = [c for c in out.prefills if c.seq is not seq]

  # ---- the commit point ----

  def update_from_output(self, out: SchedulerOutput, sampled: dict[Sequence, list[int]], ahead: int = 0) \
      -> tuple[dict[Sequence, list[int]], dict[Sequence, Exception]]:
    """Apply a finished model step. `sampled` holds the new tokens of every decode and of every prefill chunk
    that completed its prompt; a decode verified with speculative drafts has the drafts it accepted plus one.
    `ahead`: slots beyond the newest token a decode keeps, for a pipelined run already launched (engine/core.py).
    Returns the tokens each sequence kept (a stop rule may end a speculative run early), and the sequences whose
    commit raised: those are finished with reason "error" (their blocks freed), the others are unaffected."""
    kept: dict[Sequence, list[int]] = {}
    failed: dict[Sequence, Exception] = {}
    for chunk in out.prefills:
      seq = chunk.seq
      if seq.is_finished: continue            # failed or aborted during the step
      try:
        kept_tokens = self._commit(seq, chunk.num_tokens, sampled.get(seq, []))
        if seq in sampled: kept[seq] = kept_tokens
        if seq.index == 0 and not seq.is_prefilling: self._release_held(seq.request_id)
      except Exception as e: failed[seq] = self._fail(seq, e)
    for seq in out.decodes:
      if seq.is_finished or seq not in sampled: continue
      try:
        # the step wrote K/V for the newest token and any drafts; those of the accepted drafts stand
        kept[seq] = self._commit(seq, len(sampled[seq]), sampled[seq])
        if not seq.is_finished: self.blocks.truncate(seq.block_table, seq.num_tokens + ahead)   # rejected drafts' blocks
      except Exception as e: failed[seq] = self._fail(seq, e)
    return kept, failed

  def _fail(self, seq: Sequence, error: Exception) -> Exception:
    if not seq.is_finished: self.finish(seq, "error")
    return error

  def _commit(self, seq: Sequence, computed: int, tokens: list[int]) -> list[int]:
    """`computed` more tokens have K/V; append `tokens` up to the first that stops the sequence; register the
    blocks that became full and computed (before a finished sequence lets its blocks go, so they stay cached)."""
    seq.num_computed_tokens += computed
    stop = None
    for i, token in enumerate(tokens):
      seq.token_ids.append(token)
      if (stop := self._stop_reason(seq, token)) is not None:
        tokens = tokens[:i + 1]
        break
    if seq.grammar is not None: seq.grammar.commit(tokens)   # structured output: the matcher follows the kept tokens
    if self.blocks.enable_caching:
      self.blocks.extend_hashes(seq.block_hashes, seq.token_ids)
      seq.num_registered_blocks = self.blocks.register(seq.block_table, seq.block_hashes, seq.num_registered_blocks,
                                                       seq.num_computed_tokens)
    if stop is not None: self.finish(seq, *stop)
    return list(tokens)

  def _release_held(self, request_id: str) -> None:
    """Completion 0 has read the prompt (or ended): its siblings go to the front of the queue, where their
    admission finds the prompt's blocks cached."""
    self.waiting.extendleft(reversed(self.held.pop(request_id, [])))

  def _stop_reason(self, seq: Sequence, token: int) -> tuple[str, int | None] | None:
    p = seq.params
    # a constrained sequence ends at EOS even with ignore_eos: the grammar allows EOS only once it is complete, and
    # nothing after it
    if token in self.eos_token_ids and (not p.ignore_eos or seq.grammar is not None): return "stop", None
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
    elif seq in self.held.get(seq.request_id, ()):
      self.held[seq.request_id].remove(seq)
      if not self.held[seq.request_id]: del self.held[seq.request_id]
    if seq.index == 0: self._release_held(seq.request_id)
