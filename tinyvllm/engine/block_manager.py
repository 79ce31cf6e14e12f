"""Owner of the paged KV cache's blocks. Pure Python: block ids and reference counts, no tensors.

A block table is a plain list of block ids; slot `p` of a sequence lives in block `table[p // block_size]`
at offset `p % block_size`. Tables grow on demand, shrink when speculative tokens are rolled back, and a
block is returned to the pool when the last table holding it lets it go.
"""
from __future__ import annotations
from collections import deque


class BlockManager:
  def __init__(self, num_blocks: int, block_size: int, watermark: float = 0.01):
    assert num_blocks > 0 and block_size > 0
    self.num_blocks, self.block_size = num_blocks, block_size
    # admission keeps this many blocks free, so running sequences can grow without immediately preempting
    self.watermark_blocks = int(watermark * num_blocks)
    self.free_blocks: deque[int] = deque(range(num_blocks))
    self.ref_counts = [0] * num_blocks

  @property
  def num_free(self) -> int: return len(self.free_blocks)

  def blocks_for(self, num_tokens: int) -> int: return -(-num_tokens // self.block_size)

  def blocks_missing(self, table: list[int], num_tokens: int) -> int:
    return max(0, self.blocks_for(num_tokens) - len(table))

  def can_admit(self, table: list[int], num_tokens: int) -> bool:
    """May a sequence not yet running take the blocks for `num_tokens` and leave the watermark free?"""
    return self.num_free - self.blocks_missing(table, num_tokens) >= self.watermark_blocks

  def can_grow(self, table: list[int], num_tokens: int) -> bool:
    return self.blocks_missing(table, num_tokens) <= self.num_free

  def grow(self, table: list[int], num_tokens: int) -> None:
    """Append blocks until `table` holds `num_tokens` slots."""
    missing = self.blocks_missing(table, num_tokens)
    if missing > self.num_free: raise RuntimeError(f"out of KV blocks: need {missing}, {self.num_free} free")
    for _ in range(missing):
      block = self.free_blocks.popleft()
      assert self.ref_counts[block] == 0, f"block {block} is free but referenced"
      self.ref_counts[block] = 1
      table.append(block)

  def truncate(self, table: list[int], num_tokens: int) -> None:
    """Keep only the blocks needed for `num_tokens` slots (speculative rollback)."""
    keep = self.blocks_for(num_tokens)
    while len(table) > keep: self._release(table.pop())

  def free(self, table: list[int]) -> None:
    for block in reversed(table): self._release(block)
    table.clear()

  def fork(self, table: list[int]) -> list[int]:
    """A new table sharing every block of `table` (copy-on-write is the caller's business)."""
    for block in table: self.ref_counts[block] += 1
    return list(table)

  def _release(self, block: int) -> None:
    assert self.ref_counts[block] > 0, f"block {block} freed twice"
    self.ref_counts[block] -= 1
    if self.ref_counts[block] == 0: self.free_blocks.append(block)
