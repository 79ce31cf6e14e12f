"""Owner of the paged KV cache's blocks. Pure Python: block ids, reference counts and prefix hashes, no tensors.

A block table is a list of block ids (`BlockTable`); slot `p` of a sequence lives in block `table[p // block_size]` at
offset `p % block_size`. Tables grow on demand, shrink when speculative tokens are rolled back, and a block is
returned to the pool when the last table holding it lets it go. With sliding-window attention on every layer, the
blocks a sequence's window has passed go back early (`release_passed`): their entries become `FREED`, which the
model runner reads as any block, its keys masked out by the window.

Prefix caching (vLLM v1's design): once a block is full and its K/V are computed, it is registered under a hash
of its parent block's hash and its token ids, so a later sequence with the same prefix takes the same block
instead of recomputing it. A block whose last holder lets it go keeps its hash and stays reusable until the pool
needs it: free blocks wait in a queue in LRU order (a sequence's blocks are freed tail first, so its last block
goes first), allocation takes the head of the queue and drops its hash, and a cache hit takes its block out of
the middle of the queue in O(1).
"""
from __future__ import annotations
import hashlib, operator
from collections.abc import Iterator, Sequence
import numpy as np


def hash_block(parent: bytes | None, token_ids: Sequence[int], extra: bytes = b"") -> bytes:
  """The identity of a full block: BLAKE2b over its parent's hash, its token ids and `extra` keys (room for a
  per-tenant cache salt). Collision-resistant, so a crafted prompt cannot alias another user's cached block."""
  h = hashlib.blake2b(parent or b"", digest_size=16)
  h.update(np.asarray(token_ids, dtype="<i4").tobytes())
  h.update(extra)
  return h.digest()


FREED = -1   # a table entry whose block went back to the pool (out of every window); the table keeps its length


class BlockTable(list):
  """A sequence's block ids: a list, which also keeps them as int32 numpy (`array`), converted again only from the
  first entry changed since the last call. The model runner packs every table of a step into its input, and converting
  each whole table from Python ints every step grew with the context: about 150 us a step for 32 sequences of 4,000
  tokens on this machine's CPU. The block manager changes a table only by append, pop, clear and setting an entry;
  every other list mutator is covered too."""
  def __init__(self, ids=()):
    super().__init__(ids)
    self._array, self._valid = np.zeros(max(16, len(self)), np.int32), 0   # _array[:_valid] equals the list's first entries

  def array(self) -> np.ndarray:
    """The ids as int32 numpy: a view of the table's own array, valid until the table next changes (copy it to keep it)."""
    n = len(self)
    if n > len(self._array):
      grown = np.zeros(max(n, 2 * len(self._array)), np.int32)
      grown[:self._valid] = self._array[:self._valid]
      self._array = grown
    if self._valid < n: self._array[self._valid:n] = self[self._valid:n]
    self._valid = n
    return self._array[:n]

  def _changed_from(self, index: int) -> None: self._valid = min(self._valid, max(0, index))

  def _start(self, index) -> int:
    """The first entry a mutation at `index` (an int or a slice, of the list before it) can change."""
    if isinstance(index, slice): return index.indices(len(self))[0] if index.step in (None, 1) else 0
    index = operator.index(index)   # what a list takes as an index (TypeError for the rest, as a list raises)
    return index + len(self) if index < 0 else index

  def __copy__(self) -> BlockTable: return BlockTable(self)   # a numpy copy of its own: `copy.copy` would share it

  def __setitem__(self, index, value):
    self._changed_from(self._start(index))
    super().__setitem__(index, value)

  def __delitem__(self, index):
    self._changed_from(self._start(index))
    super().__delitem__(index)

  def pop(self, index: int = -1):
    self._changed_from(self._start(index))
    return super().pop(index)

  def insert(self, index: int, value) -> None:
    self._changed_from(self._start(min(index, len(self))))
    super().insert(index, value)

  def remove(self, value) -> None:
    self._changed_from(self.index(value))
    super().remove(value)

  def clear(self) -> None:
    self._valid = 0
    super().clear()

  def reverse(self) -> None:
    self._valid = 0
    super().reverse()

  def sort(self, *args, **kwargs) -> None:
    self._valid = 0
    super().sort(*args, **kwargs)

  def __imul__(self, n):
    if n < 1: self._valid = 0
    return super().__imul__(n)


def table_ids(table: list[int]) -> np.ndarray:
  """A block table's ids as int32 numpy: a BlockTable's kept array, any other list converted."""
  return table.array() if isinstance(table, BlockTable) else np.asarray(table, np.int32)


class Block:
  __slots__ = ("id", "ref_count", "hash", "prev", "next")

  def __init__(self, block_id: int):
    self.id, self.ref_count, self.hash = block_id, 0, None
    self.prev: Block | None = None
    self.next: Block | None = None


class FreeQueue:
  """Free blocks in eviction order, a doubly linked list: head = next to be reused, removal from anywhere in O(1)."""
  def __init__(self, blocks: list[Block]):
    self._head, self._tail = Block(-1), Block(-1)   # sentinels
    self._head.next, self._tail.prev = self._tail, self._head
    self._len = 0
    for b in blocks: self.append(b)

  def __len__(self) -> int: return self._len

  def __iter__(self) -> Iterator[Block]:
    b = self._head.next
    while b is not self._tail:
      yield b
      b = b.next

  def append(self, block: Block) -> None:
    block.prev, block.next = self._tail.prev, self._tail
    self._tail.prev.next = block
    self._tail.prev = block
    self._len += 1

  def remove(self, block: Block) -> None:
    block.prev.next, block.next.prev = block.next, block.prev
    block.prev = block.next = None
    self._len -= 1

  def popleft(self) -> Block:
    block = self._head.next
    assert block is not self._tail, "no free block"
    self.remove(block)
    return block


class BlockManager:
  def __init__(self, num_blocks: int, block_size: int, watermark: float = 0.01, enable_caching: bool = False):
    assert num_blocks > 0 and block_size > 0
    self.num_blocks, self.block_size, self.enable_caching = num_blocks, block_size, enable_caching
    # admission keeps this many blocks free, so running sequences can grow without immediately preempting
    self.watermark_blocks = int(watermark * num_blocks)
    self.blocks = [Block(i) for i in range(num_blocks)]
    self.free_queue = FreeQueue(self.blocks)
    self.cached: dict[bytes, Block] = {}   # hash -> the one block that holds it (in use or free)

  @property
  def num_free(self) -> int:
    """Blocks no table holds: truly empty ones and cached ones that can still be reused, all allocatable."""
    return len(self.free_queue)

  def ref_count(self, block_id: int) -> int: return self.blocks[block_id].ref_count

  def blocks_for(self, num_tokens: int) -> int: return -(-num_tokens // self.block_size)

  def blocks_missing(self, table: list[int], num_tokens: int) -> int:
    return max(0, self.blocks_for(num_tokens) - len(table))

  def can_grow(self, table: list[int], num_tokens: int) -> bool:
    return self.blocks_missing(table, num_tokens) <= self.num_free

  def grow(self, table: list[int], num_tokens: int) -> None:
    """Append blocks until `table` holds `num_tokens` slots, evicting the least recently used cached blocks."""
    missing = self.blocks_missing(table, num_tokens)
    if missing > self.num_free: raise RuntimeError(f"out of KV blocks: need {missing}, {self.num_free} free")
    for _ in range(missing):
      block = self.free_queue.popleft()
      assert block.ref_count == 0, f"block {block.id} is free but referenced"
      if block.hash is not None:   # evicted: its old contents are about to be overwritten
        del self.cached[block.hash]
        block.hash = None
      block.ref_count = 1
      table.append(block.id)

  def truncate(self, table: list[int], num_tokens: int) -> None:
    """Keep only the blocks needed for `num_tokens` slots (speculative rollback)."""
    keep = self.blocks_for(num_tokens)
    while len(table) > keep: self._release(table.pop())

  def free(self, table: list[int]) -> None:
    """Let go of every block of `table`, its last block first: that one is then the first of them to be evicted."""
    for block in reversed(table): self._release(block)
    table.clear()

  def release_front(self, table: list[int], num_blocks: int) -> int:
    """Let go of the table's first `num_blocks` blocks (out of the sequence's every window: nothing reads them again);
    their entries become FREED. Returns how many went back now."""
    released = 0
    for i in range(min(num_blocks, len(table))):
      if table[i] != FREED:
        self._release(table[i])
        table[i], released = FREED, released + 1
    return released

  def release_passed(self, table: list[int], next_position: int, window: int) -> int:
    """Release the blocks wholly below the window of a query at `next_position`: it sees keys above
    next_position - window, so a block whose last slot is at most that is never read again. Returns how many went
    back now."""
    return self.release_front(table, max(0, next_position - window + 1) // self.block_size)

  def _release(self, block_id: int) -> None:
    if block_id == FREED: return
    block = self.blocks[block_id]
    assert block.ref_count > 0, f"block {block_id} freed twice"
    block.ref_count -= 1
    if block.ref_count == 0: self.free_queue.append(block)

  # ---- prefix caching ----

  def extend_hashes(self, hashes: list[bytes], token_ids: Sequence[int]) -> None:
    """Append the hash of every full block of `token_ids` that `hashes` does not cover yet (the chain continues
    from the last)."""
    bs = self.block_size
    for i in range(len(hashes), len(token_ids) // bs):
      hashes.append(hash_block(hashes[-1] if hashes else None, token_ids[i * bs:(i + 1) * bs]))

  def cached_prefix(self, hashes: list[bytes], max_blocks: int) -> list[int]:
    """Ids of the cached blocks for the longest run of `hashes` from the start (at most `max_blocks`)."""
    hit: list[int] = []
    for h in hashes[:max_blocks]:
      block = self.cached.get(h)
      if block is None: break
      hit.append(block.id)
    return hit

  def num_reclaimed(self, block_ids: list[int]) -> int:
    """How many of these cached blocks are free now, i.e. would leave the free pool if taken."""
    return sum(self.blocks[b].ref_count == 0 for b in block_ids)

  def take(self, table: list[int], block_ids: list[int]) -> None:
    """Append cached blocks (a prefix hit) to an empty table."""
    assert not table, "a prefix hit starts a table"
    for b in block_ids:
      block = self.blocks[b]
      if block.ref_count == 0: self.free_queue.remove(block)
      block.ref_count += 1
      table.append(b)

  def register(self, table: list[int], hashes: list[bytes], start_block: int, num_computed_tokens: int) -> int:
    """Register the table's full blocks from `start_block` whose K/V are computed (the first `num_computed_tokens`
    slots) under their hashes. A hash already held by another block keeps that block: one block per hash.
    Returns the index of the first block not yet registered (the caller's next `start_block`)."""
    end = min(num_computed_tokens // self.block_size, len(hashes), len(table))
    for i in range(start_block, end):
      if table[i] == FREED: continue
      block = self.blocks[table[i]]
      if block.hash is None and hashes[i] not in self.cached:
        block.hash = hashes[i]
        self.cached[hashes[i]] = block
    return max(start_block, end)
