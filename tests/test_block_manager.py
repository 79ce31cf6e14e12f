"""The block allocator under arbitrary operation sequences, with prefix caching on: exact reference counts, no leak,
no double free, free blocks reused in LRU order, a cached block evicted only when it is free and needed, one block
per hash, and a cache hit always hands out the blocks of the same content."""
from __future__ import annotations
import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from tinyvllm.engine.block_manager import FREED, BlockManager, BlockTable, hash_block

BS, N = 4, 16


class AllocatorMachine(RuleBasedStateMachine):
  """A model of who holds which block and of the free queue's order, checked against the allocator after every
  operation. Tokens come from a two-letter alphabet, so different sequences share prefixes and hits are common."""
  def __init__(self):
    super().__init__()
    self.bm = BlockManager(num_blocks=N, block_size=BS, watermark=0.0, enable_caching=True)
    self.seqs: list[dict] = []             # live sequences: table, tokens, block hashes, blocks registered
    self.free_order = list(range(N))       # the model of the free queue: head first

  def _refs(self) -> dict[int, int]:
    refs: dict[int, int] = {}
    for s in self.seqs:
      for b in s["table"]:
        if b != FREED: refs[b] = refs.get(b, 0) + 1
    return refs

  def _release(self, blocks: list[int]) -> None:
    """What letting go of `blocks`, in this order, does to the model."""
    refs = self._refs()
    for b in blocks:
      if b == FREED: continue
      refs[b] -= 1
      if refs[b] == 0: self.free_order.append(b)

  @rule(tokens=st.lists(st.integers(0, 1), min_size=1, max_size=4 * BS + 2))
  def admit(self, tokens):
    """A new sequence: take its cached prefix (leaving its last token to compute), then grow for the rest."""
    hashes: list[bytes] = []
    self.bm.extend_hashes(hashes, tokens)
    hit = self.bm.cached_prefix(hashes, (len(tokens) - 1) // BS)
    for i, b in enumerate(hit): assert self.bm.blocks[b].hash == hashes[i]       # a hit is the same content
    need = self.bm.blocks_for(len(tokens)) - len(hit)
    if need + self.bm.num_reclaimed(hit) > self.bm.num_free:
      with pytest.raises(RuntimeError): self.bm.grow([], (self.bm.num_free + 1) * BS)
      return
    refs = self._refs()
    table = BlockTable()   # as a Sequence's: its ids' numpy copy follows every change the allocator makes (invariant)
    self.bm.take(table, hit)
    for b in hit:
      if refs.get(b, 0) == 0: self.free_order.remove(b)                         # a hit leaves the free queue
    evicted, self.free_order = self.free_order[:need], self.free_order[need:]    # allocation takes the LRU head
    lost = {self.bm.blocks[b].hash for b in evicted} - {None}
    self.bm.grow(table, len(tokens))
    assert table == hit + evicted
    assert not lost & set(self.bm.cached)                                          # evicted blocks drop their hashes
    self.seqs.append({"table": table, "tokens": tokens, "hashes": hashes, "registered": len(hit)})

  @precondition(lambda self: self.seqs)
  @rule(i=st.integers(0, 1000), computed=st.integers(0, 4 * BS + 2))
  def register(self, i, computed):
    s = self.seqs[i % len(self.seqs)]
    s["registered"] = self.bm.register(s["table"], s["hashes"], s["registered"], min(computed, len(s["tokens"])))

  @precondition(lambda self: self.seqs)
  @rule(i=st.integers(0, 1000), tokens=st.integers(0, 4 * BS + 2))
  def truncate(self, i, tokens):
    s = self.seqs[i % len(self.seqs)]
    keep = -(-tokens // BS)
    dropped = s["table"][keep:]
    self._release(list(reversed(dropped)))
    self.bm.truncate(s["table"], tokens)
    s["registered"] = min(s["registered"], len(s["table"]))
    assert len(s["table"]) == min(keep, len(s["table"]) + len(dropped))

  @precondition(lambda self: self.seqs)
  @rule(i=st.integers(0, 1000), n=st.integers(0, 5))
  def slide(self, i, n):
    """A window passes the first n blocks: they go back (first block first), their entries become FREED."""
    s = self.seqs[i % len(self.seqs)]
    front = s["table"][:n]
    self._release(front)
    assert self.bm.release_front(s["table"], n) == sum(b != FREED for b in front)
    assert s["table"][:n] == [FREED] * len(front)

  @precondition(lambda self: self.seqs)
  @rule(i=st.integers(0, 1000))
  def free(self, i):
    s = self.seqs[i % len(self.seqs)]
    self._release(list(reversed(s["table"])))                                    # tail first: last block evicted first
    self.seqs.pop(i % len(self.seqs))                                            # by position: two sequences can be equal
    self.bm.free(s["table"])
    assert s["table"] == []

  @invariant()
  def counts_are_exact(self):
    refs = self._refs()
    assert self.bm.num_free == N - len(refs)
    assert all(self.bm.ref_count(b) == refs.get(b, 0) for b in range(N))
    assert [b.id for b in self.bm.free_queue] == self.free_order                  # LRU order, no duplicates

  @invariant()
  def tables_as_numpy(self):
    for s in self.seqs: assert s["table"].array().tolist() == list(s["table"])

  @invariant()
  def one_block_per_hash(self):
    hashed = [b for b in self.bm.blocks if b.hash is not None]
    assert len({b.hash for b in hashed}) == len(hashed) == len(self.bm.cached)
    assert all(self.bm.cached[b.hash] is b for b in hashed)

  @invariant()
  def registered_blocks_hold_their_content(self):
    for s in self.seqs:
      for i in range(min(s["registered"], len(s["table"]))):
        if s["table"][i] != FREED: assert self.bm.blocks[s["table"][i]].hash in (None, s["hashes"][i])


AllocatorMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
TestAllocator = AllocatorMachine.TestCase


def test_double_free_is_caught():
  bm = BlockManager(4, 4)
  t = []
  bm.grow(t, 8)
  stale = list(t)
  bm.free(t)
  with pytest.raises(AssertionError): bm.free(stale)


def test_hash_chains_over_parent_and_tokens():
  a = hash_block(None, [1, 2, 3, 4])
  assert a == hash_block(None, [1, 2, 3, 4]) and a != hash_block(None, [1, 2, 3, 5])
  assert hash_block(a, [5, 6, 7, 8]) != hash_block(None, [5, 6, 7, 8])             # the same tokens after another prefix
  assert hash_block(a, [5, 6, 7, 8], b"salt") != hash_block(a, [5, 6, 7, 8])       # room for a cache salt


def test_a_finished_sequences_last_block_is_evicted_first():
  bm = BlockManager(num_blocks=6, block_size=2, enable_caching=True)
  table, hashes, tokens = [], [], [1, 2, 3, 4, 5, 6]
  bm.grow(table, 6)
  bm.extend_hashes(hashes, tokens)
  bm.register(table, hashes, 0, 6)
  bm.free(table)
  order = [b.id for b in bm.free_queue]
  assert order[-3:] == [2, 1, 0]                                                  # freed tail first
  new = []
  bm.grow(new, 2 * 4)                                                             # the 3 never-used blocks, then the last one
  assert bm.cached_prefix(hashes, 3) == [0, 1]                                    # the first two blocks are still cached


def test_block_table_numpy_follows_every_list_mutation():
  """BlockTable.array() against the list itself after random mutations by every list mutator (slices, negative
  indices, in place operators), read at random points; and between reads only the entries changed are converted
  again (an entry below them planted in the kept array stays)."""
  import random
  rng = random.Random(0)
  for _ in range(1500):
    table, ref = BlockTable(), []
    for _ in range(30):
      i, j = sorted(rng.randrange(-len(ref) - 2, len(ref) + 3) for _ in range(2))
      values, times = [rng.randrange(100) for _ in range(rng.randrange(4))], rng.randrange(3)
      for mutate in rng.sample([
          lambda x: x.append(values[0] if values else 5), lambda x: x.extend(values), lambda x: x.insert(i, 7),
          lambda x: x.pop(i), lambda x: x.pop(), lambda x: x.__setitem__(i, FREED), lambda x: x.__setitem__(slice(i, j), values),
          lambda x: x.__setitem__(slice(None, None, -1), list(reversed(x))), lambda x: x.__delitem__(slice(i, j)),
          lambda x: x.__delitem__(i), lambda x: x.remove(x[i]), lambda x: x.clear(), lambda x: x.reverse(), lambda x: x.sort(),
          lambda x: x.__iadd__(values), lambda x: x.__imul__(times)], 1):
        try: mutate(ref)
        except (IndexError, ValueError): continue
        mutate(table)
      assert list(table) == ref
      if rng.random() < 0.5: assert table.array().tolist() == ref
    assert table.array().tolist() == ref
  import copy
  table = BlockTable([3, 4, 5])
  table.array()
  other = copy.copy(table)       # a numpy copy of its own
  other[0] = 9
  assert other.array().tolist() == [9, 4, 5] and table.array().tolist() == [3, 4, 5] and type(other) is BlockTable
  with pytest.raises(TypeError): table[1.0] = 5   # as a list refuses it, and the table still reads
  assert table.array().tolist() == [3, 4, 5]
  table.array()[0] = 99          # planted: a later read converts only from the first entry changed
  table.append(6)
  assert table.array().tolist() == [99, 4, 5, 6]
  table[1] = FREED
  assert table.array().tolist() == [99, FREED, 5, 6]
  table.pop(0)
  assert table.array().tolist() == [FREED, 5, 6]


@pytest.mark.parametrize("short_table", [0, 10**6])
def test_step_inputs_from_the_tables_numpy_and_from_their_lists(tiny_model, monkeypatch, short_table):
  """A step packs its block tables from each BlockTable's numpy (long tables) or from the lists (short ones,
  `model_runner.SHORT_TABLE`): forced each way, three sequences growing over blocks of 8 tokens, preempted and
  readmitted (their tables freed and rebuilt, the pool reused): every step's packed tables are the lists' (FREED read
  as block 0) and zero past them, and the tokens are HF's greedy ones."""
  import numpy as np
  from test_multi_step import PROMPTS, hf_greedy, run
  from tinyvllm import SamplingParams
  from tinyvllm.engine import model_runner
  from tinyvllm.engine.llm_engine import LLMEngine
  monkeypatch.setattr(model_runner, "SHORT_TABLE", short_table)
  prepare, checked = model_runner.ModelRunner.prepare, []
  def checked_prepare(self, shape, items, layout=None):
    packed, used = prepare(self, shape, items, layout)
    offsets = layout[0] if layout else np.cumsum((0,) + shape.sizes(self.max_blocks)[:-1])
    tables = packed[offsets[model_runner.FIELDS.index("tables")]:][:shape.num_seqs * self.max_blocks].reshape(shape.num_seqs, -1)
    expected = np.zeros_like(tables)   # past a table's blocks, and in padding rows: block 0 (never read, but a block)
    for row, item in zip(expected, items): row[:len(item.block_table)] = [max(b, 0) for b in item.block_table]
    np.testing.assert_array_equal(tables, expected)
    checked.append(len(items))
    return packed, used
  monkeypatch.setattr(model_runner.ModelRunner, "prepare", checked_prepare)
  engine = LLMEngine.from_kwargs(str(tiny_model), num_kv_blocks=9, block_size=8, watermark=0.0)
  outs, _ = run(engine, PROMPTS[:3], [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)] * 3)
  for i, prompt in enumerate(PROMPTS[:3]): assert outs[str(i)].token_ids == hf_greedy(str(tiny_model), tuple(prompt), 24), i
  assert engine.core.scheduler.num_preemptions > 0 and len(checked) > 24


def test_a_bounded_extent_packs_its_tables_that_wide():
  """A prefill shape whose extent is bounded (a GPU's: model_runner._prefill_extent) packs its block tables that many
  columns wide, not the whole table's (a packed prefill has max_num_seqs' rows: 1 MB a pass at a 131072-token limit).
  A table longer than that keeps the entries the pass reads; the slots are those of the tables' lists."""
  import numpy as np
  from types import SimpleNamespace
  from tinyvllm.engine.model_runner import FIELDS, ModelRunner, PassShape, WorkItem
  runner = SimpleNamespace(block_size=8, max_blocks=64)
  shape = PassShape(num_seqs=4, query_len=24, all_logits=False, packed=True, extent=4)
  items = [WorkItem([5, 9, 2], 10, [1] * 6), WorkItem([7, 3, 11, 12, 13, 14], 20, [2] * 7)]   # positions 10-15, 20-26
  packed, used = ModelRunner.prepare(runner, shape, items)
  sizes = shape.sizes(runner.max_blocks)
  assert sizes[FIELDS.index("tables")] == 4 * 4 and len(packed) == sum(sizes)
  fields = dict(zip(FIELDS, np.split(packed, np.cumsum(sizes)[:-1])))
  assert fields["tables"].reshape(4, 4).tolist() == [[5, 9, 2, 0], [7, 3, 11, 12], [0] * 4, [0] * 4]
  assert fields["slots"][:13].tolist() == [9 * 8 + 2 + i for i in range(6)] + [11 * 8 + 4 + i for i in range(4)] + [12 * 8 + i for i in range(3)]
  assert (fields["slots"][13:] == -1).all() and fields["token_seq"][:13].tolist() == [0] * 6 + [1] * 7 and used == 4
