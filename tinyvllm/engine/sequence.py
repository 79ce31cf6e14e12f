"""A Sequence is one completion being generated: its tokens, its KV blocks and how far the model has read it.

It is the engine core's record: token ids, not text (output processing keeps the text)."""
from __future__ import annotations
import enum, itertools
from typing import TYPE_CHECKING
import numpy as np
from tinyvllm.engine.block_manager import BlockTable
from tinyvllm.sampling_params import SamplingParams
from tinyvllm.outputs import RequestMetrics

if TYPE_CHECKING:
  from tinyvllm.sampler import TokenCounts
  from tinyvllm.structured_output import GrammarState


class SequenceStatus(enum.Enum):
  WAITING = enum.auto()
  RUNNING = enum.auto()
  FINISHED = enum.auto()


class Sequence:
  _ids = itertools.count()

  def __init__(self, request_id: str, index: int, prompt_token_ids: list[int], params: SamplingParams,
               generator: np.random.Generator, metrics: RequestMetrics, grammar: GrammarState | None = None):
    self.seq_id = next(Sequence._ids)
    self.request_id, self.index, self.params = request_id, index, params
    self.prompt_token_ids = list(prompt_token_ids)
    self.token_ids = list(prompt_token_ids)    # prompt, then every generated token
    self.status = SequenceStatus.WAITING
    self.block_table = BlockTable()
    self.num_computed_tokens = 0               # tokens whose K/V are in the cache
    self.block_hashes: list[bytes] = []        # prefix caching: hash of each full block of token_ids
    self.num_registered_blocks = 0             # leading blocks of block_table already registered in the prefix cache
    self.draft_block_table = BlockTable()      # speculative decoding: the draft model's cache
    self.draft_num_computed = 0
    self.draft_num_registered = 0              # leading draft blocks registered in the draft's prefix cache
    self.generator = generator                 # this sequence's own random stream: batch composition never changes it
    self.grammar = grammar                     # structured output: where its tokens stand in the grammar (None: free)
    self.token_counts: TokenCounts | None = None   # the penalties' counts of token_ids, made at its first penalized step
    # prompt positions whose logprobs were sent (prompt_logprobs): a recompute after preemption sends none again
    self.num_prompt_logprobs_sent = 0
    self.finish_reason: str | None = None
    self.stop_reason: int | str | None = None
    self.metrics = metrics

  @property
  def num_tokens(self) -> int: return len(self.token_ids)
  @property
  def num_prompt_tokens(self) -> int: return len(self.prompt_token_ids)
  @property
  def output_token_ids(self) -> list[int]: return self.token_ids[self.num_prompt_tokens:]
  @property
  def num_output_tokens(self) -> int: return self.num_tokens - self.num_prompt_tokens
  @property
  def is_finished(self) -> bool: return self.status is SequenceStatus.FINISHED
  @property
  def is_prefilling(self) -> bool:
    """More than the newest token still lacks K/V: the next step is (a chunk of) prefill, not a decode."""
    return self.num_computed_tokens < self.num_tokens - 1

  def __repr__(self): return f"Sequence({self.seq_id}, {self.status.name}, tokens={self.num_tokens}, computed={self.num_computed_tokens})"
