"""The block allocator under arbitrary operation sequences: exact free counts, no leaks, no double frees."""
from __future__ import annotations
import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from tinyvllm.engine.block_manager import BlockManager


class AllocatorMachine(RuleBasedStateMachine):
  """A model of who holds which block, checked against the allocator after every operation."""
  def __init__(self):
    super().__init__()
    self.bm = BlockManager(num_blocks=24, block_size=4, watermark=0.1)
    self.tables: list[list[int]] = []       # live tables, as the allocator's callers hold them

  def _expected_refs(self) -> dict[int, int]:
    refs: dict[int, int] = {}
    for t in self.tables:
      for b in t: refs[b] = refs.get(b, 0) + 1
    return refs

  @rule()
  def new_table(self): self.tables.append([])

  @precondition(lambda self: self.tables)
  @rule(i=st.integers(0, 1000), tokens=st.integers(0, 60))
  def grow(self, i, tokens):
    t = self.tables[i % len(self.tables)]
    if self.bm.can_grow(t, tokens):
      before = len(t)
      self.bm.grow(t, tokens)
      assert len(t) == max(before, -(-tokens // 4))
    else:
      with pytest.raises(RuntimeError): self.bm.grow(list(t), tokens)

  @precondition(lambda self: self.tables)
  @rule(i=st.integers(0, 1000), tokens=st.integers(0, 60))
  def truncate(self, i, tokens):
    t = self.tables[i % len(self.tables)]
    before = len(t)
    self.bm.truncate(t, tokens)
    assert len(t) == min(before, -(-tokens // 4))

  @precondition(lambda self: self.tables)
  @rule(i=st.integers(0, 1000))
  def fork(self, i): self.tables.append(self.bm.fork(self.tables[i % len(self.tables)]))

  @precondition(lambda self: self.tables)
  @rule(i=st.integers(0, 1000))
  def free(self, i):
    t = self.tables.pop(i % len(self.tables))
    self.bm.free(t)
    assert t == []

  @invariant()
  def counts_are_exact(self):
    refs = self._expected_refs()
    assert self.bm.num_free == 24 - len(refs)
    assert sorted(self.bm.free_blocks) == sorted(set(range(24)) - set(refs))     # no duplicates in the free list
    assert all(self.bm.ref_counts[b] == refs.get(b, 0) for b in range(24))


AllocatorMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
TestAllocator = AllocatorMachine.TestCase


def test_double_free_is_caught():
  bm = BlockManager(4, 4)
  t = []
  bm.grow(t, 8)
  stale = list(t)
  bm.free(t)
  with pytest.raises(AssertionError): bm.free(stale)


def test_admission_keeps_the_watermark():
  bm = BlockManager(num_blocks=100, block_size=16, watermark=0.05)     # 5 blocks held back from admissions
  assert bm.can_admit([], 95 * 16)
  assert not bm.can_admit([], 95 * 16 + 1)
  assert bm.can_grow([], 100 * 16) and not bm.can_grow([], 100 * 16 + 1)   # growth may use the watermark
