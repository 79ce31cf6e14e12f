"""SchedulerOutput -> one model forward pass -> logits. The only engine module that touches tinygrad.

A step's flat batch is laid out as [decode tokens][prefill chunks, each padded to the longest], so that
attention sees a dense [sequences, query slots] block per group. Every shape is rounded up to a bucket and
each bucket gets its own TinyJit: replaying a captured step costs a fraction of scheduling it anew.
"""
from __future__ import annotations
from collections import OrderedDict
from dataclasses import dataclass
import numpy as np
from tinygrad import Tensor, TinyJit, UOp
from tinyvllm.kernels import AttentionGroup
from tinyvllm.model.llama import Llama, ModelInputs

MAX_JITS = 64   # captured step shapes kept; the least recently used one is dropped beyond this


def bucket(n: int, minimum: int = 1) -> int:
  """Round up to a power of two (at least `minimum`), so a handful of shapes cover every batch."""
  return max(minimum, 1 << max(0, (n - 1).bit_length()))


@dataclass
class WorkItem:
  """Tokens of one sequence to read in a step: their K/V are written at positions start, start+1, ..."""
  block_table: list[int]
  start: int
  tokens: list[int]


@dataclass(frozen=True)
class GroupShape:
  num_seqs: int             # bucketed; padding rows included
  query_len: int            # query slots per sequence
  all_logits: bool          # logits for every slot (speculative verification) or only each sequence's last

  @property
  def num_tokens(self) -> int: return self.num_seqs * self.query_len
  @property
  def num_rows(self) -> int: return self.num_tokens if self.all_logits else self.num_seqs


@dataclass(frozen=True)
class StepShape:
  """What fixes the tensor shapes of a step (the KV extent is a bound Variable instead): one capture each."""
  groups: tuple[GroupShape, ...]

  @property
  def num_tokens(self) -> int: return sum(g.num_tokens for g in self.groups)
  @property
  def num_rows(self) -> int: return sum(g.num_rows for g in self.groups)


class Replay:
  """A TinyJit captured on its first call and replayed directly afterwards.

  TinyJit checks every input on every call (~25 us each); a layer takes a dozen inputs and runs 30 times a
  step, so replays go straight to the captured graph. Callers pass the same kinds of buffers in the same
  order each time, which is what those checks verify."""
  def __init__(self, fn):
    self.jit = TinyJit(lambda *args: fn(*args).realize())
    self.jit.cnt = 1   # capture on the first call: weights and caches are realized, a warm-up run would only cost time

  def __call__(self, *args: Tensor, bound: tuple[UOp, ...] = ()) -> Tensor:
    if self.jit.captured is None: return self.jit(*args, *bound)
    return self.jit.captured([a.uop.base for a in args], {var.expr: val for var, val in (b.unbind() for b in bound)})


class ModelRunner:
  """Runs steps of one model over its paged KV cache.

  Each step shape gets one captured *layer*, replayed once per layer with that layer's weights and cache,
  between a captured embedding and a captured LM head. Capturing a whole 30-layer model instead costs
  seconds of tinygrad scheduling for every new shape; one layer costs a thirtieth of that, and a direct
  replay about 50 us."""
  def __init__(self, model: Llama, num_blocks: int, block_size: int, max_model_len: int, device: str):
    self.model, self.device, self.block_size, self.num_blocks = model, device, block_size, num_blocks
    self.max_blocks = -(-max_model_len // block_size)   # block-table width; the used extent is a Variable
    self.kv_extent = UOp.variable("kv_blocks", 1, self.max_blocks)
    cfg = model.cfg
    shape = (num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
    # zero-filled: attention multiplies masked-out cache entries by 0, and 0 * NaN garbage would be NaN
    self.kv_caches = [(Tensor.zeros(*shape, dtype=model.dtype, device=device).contiguous().realize(),
                       Tensor.zeros(*shape, dtype=model.dtype, device=device).contiguous().realize())
                      for _ in range(cfg.num_hidden_layers)]
    self.layer_weights = [layer.tensors() for layer in model.layers]
    self.jits: OrderedDict[StepShape, tuple[Replay, Replay, Replay]] = OrderedDict()

  @staticmethod
  def kv_bytes_per_block(cfg, block_size: int, dtype_size: int) -> int:
    return 2 * cfg.num_hidden_layers * block_size * cfg.num_key_value_heads * cfg.head_dim * dtype_size

  def execute(self, decodes: list[WorkItem], prefills: list[WorkItem] = (), verifies: list[WorkItem] = ()) \
      -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Read the given tokens. Returns float32 logits: `[len(decodes), V]` (one token each), `[len(prefills), V]`
    (each chunk's last token) and `[len(verifies), K, V]` (every token of each verified run; all runs have K tokens).

    Each kind runs as its own forward pass. One pass over all three would read the weights once instead of
    up to three times, but every combination of bucket sizes would be a shape to capture; separate passes
    keep the shapes to the sum of the kinds' buckets, not their product."""
    vocab = self.model.cfg.vocab_size
    out = [np.zeros((0, vocab), np.float32), np.zeros((0, vocab), np.float32), np.zeros((0, 0, vocab), np.float32)]
    for i, (items, query_len, all_logits) in enumerate((
        (decodes, 1, False),
        (prefills, bucket(max((len(w.tokens) for w in prefills), default=1), minimum=8), False),
        (verifies, max((len(w.tokens) for w in verifies), default=1), True))):
      if not items: continue
      shape, packed, used_blocks = self.prepare([(items, query_len, all_logits)])
      logits = self._forward(shape, packed, used_blocks)
      out[i] = logits.reshape(-1, query_len, vocab)[:len(items)] if all_logits else logits[:len(items)]
    return out[0], out[1], out[2]

  def _forward(self, shape: StepShape, packed: np.ndarray, used_blocks: int) -> np.ndarray:
    packed = Tensor(packed, device=self.device).realize()
    extent = (self.kv_extent.bind(used_blocks),)
    embed, layer, head = self._replays(shape)
    h = embed(packed)
    for weights, (k_cache, v_cache) in zip(self.layer_weights, self.kv_caches):
      h = layer(h, packed, k_cache, v_cache, *weights, bound=extent)
    return head(h, packed).numpy()

  def prepare(self, groups: list[tuple[list[WorkItem], int, bool]]) -> tuple[StepShape, np.ndarray, int]:
    """Pack every integer input of the step into one int32 array (one host->device copy per step).
    Returns the shape, the array and the number of KV blocks the longest block table uses."""
    bs, MB = self.block_size, self.max_blocks
    shape = StepShape(tuple(GroupShape(bucket(len(items)), query_len, all_logits) for items, query_len, all_logits in groups))
    T, R = shape.num_tokens, shape.num_rows
    tokens, positions, q_pos = np.zeros(T, np.int32), np.zeros(T, np.int32), np.zeros(T, np.int32)
    token_seq = np.full(T, -1, np.int32)          # each token's row within its attention group
    slots = np.full(T, -1, np.int32)              # padding tokens write no K/V
    rows = np.zeros(R, np.int32)                  # flat index of the token whose logits each row wants
    ctx_lens = np.zeros(sum(g.num_seqs for g in shape.groups), np.int32)
    tables = np.zeros((len(ctx_lens), MB), np.int32)
    tok_at = row_at = seq_at = 0
    for (items, _, _), g in zip(groups, shape.groups):
      for i, w in enumerate(items):
        n, start = len(w.tokens), tok_at + i * g.query_len
        pos = np.arange(w.start, w.start + n)
        table = np.asarray(w.block_table, np.int32)
        tokens[start:start + n] = w.tokens
        positions[start:start + n] = q_pos[start:start + n] = pos
        token_seq[start:start + n] = i
        slots[start:start + n] = table[pos // bs] * bs + pos % bs
        tables[seq_at + i, :len(table)] = table
        ctx_lens[seq_at + i] = pos[-1] + 1
        if g.all_logits: rows[row_at + i * g.query_len:row_at + i * g.query_len + n] = np.arange(start, start + n)
        else: rows[row_at + i] = start + n - 1
      tok_at, row_at, seq_at = tok_at + g.num_tokens, row_at + g.num_rows, seq_at + g.num_seqs
    used = max(-(-int(ctx_lens.max()) // bs), 1)
    return shape, np.concatenate([tokens, positions, slots, q_pos, token_seq, rows, ctx_lens, tables.reshape(-1)]), used

  def _replays(self, shape: StepShape) -> tuple[Replay, Replay, Replay]:
    if shape in self.jits:
      self.jits.move_to_end(shape)
      return self.jits[shape]
    template = self.model.layers[0]
    def layer(h, packed, k_cache, v_cache, *weights_and_extent):
      *weights, extent = weights_and_extent
      return template.with_tensors(weights)(h, self._inputs(shape, packed, extent), self.model.cos_sin, k_cache, v_cache)
    replays = (Replay(lambda packed: self.model.embed(self._inputs(shape, packed, None).tokens).contiguous()),
               Replay(layer),
               Replay(lambda h, packed: self.model.logits(h, self._inputs(shape, packed, None).logits_index)))
    self.jits[shape] = replays
    if len(self.jits) > MAX_JITS: self.jits.popitem(last=False)
    return replays

  def _inputs(self, shape: StepShape, packed: Tensor, extent) -> ModelInputs:
    T, R, S, MB = shape.num_tokens, shape.num_rows, sum(g.num_seqs for g in shape.groups), self.max_blocks
    fields, at = {}, 0
    for name, size in (("tokens", T), ("positions", T), ("slots", T), ("q_pos", T), ("token_seq", T), ("rows", R), ("ctx", S),
                       ("tables", S * MB)):
      fields[name], at = packed[at:at + size], at + size
    tables = fields["tables"].reshape(S, MB)
    groups, tok_at, seq_at = [], 0, 0
    for g in shape.groups:
      P, C = g.num_seqs, g.query_len
      groups.append(AttentionGroup(P, C, tables[seq_at:seq_at + P], extent, fields["q_pos"][tok_at:tok_at + P * C].reshape(P, C),
                                   fields["ctx"][seq_at:seq_at + P], fields["token_seq"][tok_at:tok_at + P * C]))
      tok_at, seq_at = tok_at + P * C, seq_at + P
    return ModelInputs(fields["tokens"], fields["positions"], fields["slots"], groups, fields["rows"])
