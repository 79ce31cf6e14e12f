"""The scheduler alone (no model): chunked prefill, token budget, decodes never stalled, preemption order,
and that every request eventually finishes. Sequences are advanced by a fake model step."""
from __future__ import annotations
import numpy as np
from tinyvllm.engine.block_manager import BlockManager
from tinyvllm.engine.scheduler import Scheduler
from tinyvllm.engine.sequence import Sequence, SequenceStatus
from tinyvllm.outputs import RequestMetrics
from tinyvllm.sampling_params import SamplingParams


def make_seq(n_prompt: int, max_tokens: int = 4) -> Sequence:
  return Sequence("r", 0, list(range(n_prompt)), SamplingParams(max_tokens=max_tokens), np.random.default_rng(0),
                  RequestMetrics(arrival_time=0.0))


def make_scheduler(block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int) -> Scheduler:
  return Scheduler(block_manager, max_num_seqs, max_num_batched_tokens, max_model_len=1024, eos_token_ids=frozenset({1}))


def fake_step(sched: Scheduler) -> tuple:
  """One schedule, committed through the scheduler's own commit point with token 7 sampled every time."""
  out = sched.schedule()
  sampled = {s: [7] for s in out.decodes} | {c.seq: [7] for c in out.prefills if c.completes_prompt}
  sched.update_from_output(out, sampled)
  return out


def test_long_prompt_is_chunked_and_decodes_keep_running():
  sched = make_scheduler(BlockManager(256, 16), max_num_seqs=8, max_num_batched_tokens=64)
  short = make_seq(10, max_tokens=20)
  sched.add(short)
  fake_step(sched)                                  # short prompt read in one chunk
  long = make_seq(300)
  sched.add(long)
  chunks = []
  while long.is_prefilling or long.status is SequenceStatus.WAITING:
    out = fake_step(sched)
    assert short in out.decodes                     # the running decode gets its token every step
    assert len(out.decodes) + sum(c.num_tokens for c in out.prefills) <= 64
    chunks += [c.num_tokens for c in out.prefills if c.seq is long]
  assert sum(chunks) == 300 and len(chunks) == 5    # 63 tokens per step beside one decode


def test_padded_prefill_cost_respects_budget():
  sched = make_scheduler(BlockManager(256, 16), max_num_seqs=8, max_num_batched_tokens=64)
  for n in (40, 5, 5, 5):
    sched.add(make_seq(n))
  out = sched.schedule()
  longest = max(c.num_tokens for c in out.prefills)
  assert len(out.prefills) * longest <= 64          # the runner pads every chunk to the longest


def test_preempts_newest_and_everything_finishes():
  bm = BlockManager(num_blocks=10, block_size=4, watermark=0.0)
  sched = make_scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
  seqs = [make_seq(6, max_tokens=10) for _ in range(4)]    # 16 tokens = 4 blocks each at the end: 16 > 10 blocks
  for s in seqs: sched.add(s)
  preempted_order = []
  for _ in range(200):
    if not sched.has_unfinished(): break
    out = fake_step(sched)
    preempted_order += out.preempted
    used = sum(len(s.block_table) for s in sched.running)
    assert used + bm.num_free == 10                       # no block leaked or double-held
  assert not sched.has_unfinished()
  assert sched.num_preemptions > 0
  assert all(s.num_output_tokens == 10 and s.finish_reason == "length" for s in seqs)
  assert preempted_order[0] is seqs[-1]                   # the most recently admitted goes first
  assert bm.num_free == 10


def test_max_num_seqs_limits_admission():
  sched = make_scheduler(BlockManager(256, 16), max_num_seqs=3, max_num_batched_tokens=512)
  for _ in range(5): sched.add(make_seq(4))
  out = sched.schedule()
  assert len(out.prefills) == 3 and len(sched.waiting) == 2


def test_a_sequence_bigger_than_free_memory_waits_instead_of_crashing():
  bm = BlockManager(num_blocks=8, block_size=4)
  sched = make_scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
  a, b = make_seq(20, max_tokens=8), make_seq(20, max_tokens=8)
  sched.add(a); sched.add(b)
  for _ in range(100):
    if not sched.has_unfinished(): break
    fake_step(sched)
  assert a.finish_reason == b.finish_reason == "length" and bm.num_free == 8


def test_commit_point_applies_stop_rules_and_rolls_back_rejected_drafts():
  bm = BlockManager(num_blocks=32, block_size=4, watermark=0.0)
  sched = Scheduler(bm, 4, 64, max_model_len=40, eos_token_ids=frozenset({1}), lookahead_tokens=4)
  seq = make_seq(6, max_tokens=30)
  sched.add(seq)
  sched.update_from_output(sched.schedule(), {seq: [9]})            # prompt read, first token sampled
  assert (seq.num_computed_tokens, seq.num_tokens) == (6, 7)
  out = sched.schedule()                                           # a decode with room for 4 drafts: 7 + 4 slots
  assert out.decodes == [seq] and len(seq.block_table) == 3
  kept, _ = sched.update_from_output(out, {seq: [10, 11]})             # verified: one draft accepted, then one more token
  assert kept[seq] == [10, 11] and seq.token_ids[-3:] == [9, 10, 11]
  assert seq.num_computed_tokens == 8                              # K/V of the newest token before the step and the accepted draft
  assert len(seq.block_table) == bm.blocks_for(seq.num_tokens) == 3 and bm.num_free == 29
  out = sched.schedule()                                           # 9 tokens + 4 drafts: a fourth block
  assert len(seq.block_table) == 4
  sched.update_from_output(out, {seq: [12]})                       # every draft rejected: the fourth block goes back
  assert seq.num_computed_tokens == 9 and len(seq.block_table) == 3 and bm.num_free == 29
  out = sched.schedule()
  kept, _ = sched.update_from_output(out, {seq: [13, 1, 14]})         # EOS inside an accepted run: the rest is dropped
  assert kept[seq] == [13, 1] and seq.finish_reason == "stop" and seq.is_finished
  assert bm.num_free == 32 and not sched.has_unfinished()
  capped = make_seq(38, max_tokens=30)                             # max_model_len 40: two tokens, then "length"
  sched.add(capped)
  while sched.has_unfinished(): fake_step(sched)
  assert capped.num_output_tokens == 2 and capped.finish_reason == "length"


def test_packed_prefill_budget_counts_tokens_not_padding():
  """With a runner that packs chunks back to back, a step's prefill costs the sum of its chunks: four 40-token
  prompts fit a 128-token budget as 40 + 40 + 40 + 8 (padded to the longest, only 3 x 40 would)."""
  sched = Scheduler(BlockManager(256, 16), 8, 128, max_model_len=1024, packed_prefill=True)
  for _ in range(4): sched.add(make_seq(40))
  out = sched.schedule()
  assert [c.num_tokens for c in out.prefills] == [40, 40, 40, 8]


def test_token_bucket_wastes_at_most_a_third():
  from tinyvllm.engine.model_runner import token_bucket
  sizes = [token_bucket(n) for n in range(1, 2049)]
  assert all(b >= n and (n <= 8 or n / b > 2 / 3) for n, b in zip(range(1, 2049), sizes))
  assert sorted(set(sizes))[:8] == [8, 12, 16, 24, 32, 48, 64, 96]
