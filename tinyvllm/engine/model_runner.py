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
from tinyvllm.engine.scheduler import SchedulerOutput
from tinyvllm.kernels import AttentionGroup
from tinyvllm.model.llama import Llama, ModelInputs

MAX_JITS = 64   # captured step shapes kept; the least recently used one is dropped beyond this


def bucket(n: int, minimum: int = 1) -> int:
  """Round up to a power of two (at least `minimum`), so a handful of shapes cover every batch."""
  return max(minimum, 1 << max(0, (n - 1).bit_length()))


@dataclass(frozen=True)
class StepShape:
  """What fixes the tensor shapes of a step (the KV extent is a bound Variable instead): one TinyJit each."""
  num_decodes: int          # D (bucketed; padding rows included)
  num_prefills: int         # P
  chunk_len: int            # C

  @property
  def num_tokens(self) -> int: return self.num_decodes + self.num_prefills * self.chunk_len
  @property
  def num_rows(self) -> int: return self.num_decodes + self.num_prefills   # logits rows


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

  def execute(self, sched: SchedulerOutput) -> np.ndarray:
    """Run the scheduled tokens; returns float32 logits, one row per decode then one per prefill chunk
    (the row of a chunk that does not complete its prompt is meaningless and ignored by the caller)."""
    shape, packed, used_blocks = self.prepare(sched)
    packed = Tensor(packed, device=self.device).realize()
    extent = (self.kv_extent.bind(used_blocks),)
    embed, layer, head = self._replays(shape)
    h = embed(packed)
    for weights, (k_cache, v_cache) in zip(self.layer_weights, self.kv_caches):
      h = layer(h, packed, k_cache, v_cache, *weights, bound=extent)
    logits = head(h, packed).numpy()
    D = shape.num_decodes
    return np.concatenate([logits[:len(sched.decodes)], logits[D:D + len(sched.prefills)]])

  def prepare(self, sched: SchedulerOutput) -> tuple[StepShape, np.ndarray, int]:
    """Pack every integer input of the step into one int32 array (one host->device copy per step).
    Returns the shape, the array and the number of KV blocks the longest block table uses."""
    bs = self.block_size
    decodes, prefills = sched.decodes, sched.prefills
    D = bucket(len(decodes)) if decodes else 0
    P = bucket(len(prefills)) if prefills else 0
    C = bucket(max(c.num_tokens for c in prefills), minimum=8) if prefills else 0
    shape = StepShape(D, P, C)
    T, R, MB = shape.num_tokens, shape.num_rows, self.max_blocks
    tokens, positions, q_pos = np.zeros(T, np.int32), np.zeros(T, np.int32), np.zeros(T, np.int32)
    token_seq = np.full(T, -1, np.int32)          # each token's row within its attention group
    slots = np.full(T, -1, np.int32)              # padding tokens write no K/V
    rows, ctx_lens = np.zeros(R, np.int32), np.zeros(R, np.int32)
    tables = np.zeros((R, MB), np.int32)

    def place(seq, start: int, n: int, row: int):
      pos = np.arange(seq.num_computed_tokens, seq.num_computed_tokens + n)
      table = np.asarray(seq.block_table, np.int32)
      tokens[start:start + n] = seq.token_ids[seq.num_computed_tokens:seq.num_computed_tokens + n]
      positions[start:start + n] = q_pos[start:start + n] = pos
      token_seq[start:start + n] = row if row < D else row - D
      slots[start:start + n] = table[pos // bs] * bs + pos % bs
      tables[row, :len(table)] = table
      ctx_lens[row] = pos[-1] + 1
      rows[row] = start + n - 1

    for i, seq in enumerate(decodes): place(seq, i, 1, i)
    for j, chunk in enumerate(prefills): place(chunk.seq, D + j * C, chunk.num_tokens, D + j)
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
    D, P, C, T, R, MB = shape.num_decodes, shape.num_prefills, shape.chunk_len, shape.num_tokens, shape.num_rows, self.max_blocks
    fields, at = {}, 0
    for name, size in (("tokens", T), ("positions", T), ("slots", T), ("q_pos", T), ("token_seq", T), ("rows", R), ("ctx", R),
                       ("tables", R * MB)):
      fields[name], at = packed[at:at + size], at + size
    tables = fields["tables"].reshape(R, MB)
    groups = []
    if D: groups.append(AttentionGroup(D, 1, tables[:D], extent, fields["q_pos"][:D].reshape(D, 1), fields["ctx"][:D]))
    if P: groups.append(AttentionGroup(P, C, tables[D:], extent, fields["q_pos"][D:].reshape(P, C), fields["ctx"][D:],
                                       fields["token_seq"][D:]))
    return ModelInputs(fields["tokens"], fields["positions"], fields["slots"], groups, fields["rows"])

