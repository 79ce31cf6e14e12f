"""Work items -> model forward passes -> logits. The only engine module that touches tinygrad.

A pass reads one kind of work: decodes (one token per sequence), prefill chunks (padded to the longest) or
speculative runs (every token's logits wanted). Its tokens form a dense [sequences, query slots] block, so
attention sees one AttentionGroup. Shapes are rounded up to buckets; each shape is captured once and
replayed after that (engine/replay.py).
"""
from __future__ import annotations
import dataclasses, functools, itertools, math, time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable
import numpy as np
from tinygrad import Device, Tensor, dtypes
from tinyvllm.config import CAPTURE_MODES
from tinyvllm.host_memory import fresh_pages, lend, lend_buffer
from tinyvllm.engine.block_manager import table_ids
from tinyvllm.engine.replay import BoundReplay, CountVariable, LaunchTimes, OrderedCopies, Replay, to_host
from tinyvllm.kernels import AttentionGroup, portable
from tinyvllm.kernels.kv_cache import KVCacheFormat, PagedKVCache
from tinyvllm.model.llama import Llama, ModelInputs
from tinyvllm.model.tensor_parallel import sharded_empty

MAX_SHAPES = 64   # captured pass shapes kept; the least recently used one is dropped beyond this
SHORT_TABLE = 32   # entries a table, on average, up to which `prepare` converts the tables' lists (cheaper there)
FIELDS = ("tokens", "positions", "slots", "q_pos", "token_seq", "rows", "ctx", "tables")
PASS_FIELDS = ("tokens", "positions", "slots", "q_pos", "ctx")   # those that change between the passes of a multi-step run
KV_HEAD_AXIS = 2  # of every cache tensor ([blocks, block_size, KV heads, ...]): split over the devices with tensor parallelism


def bucket(n: int, minimum: int = 1) -> int:
  """Round up to a power of two (at least `minimum`), so a handful of shapes cover every batch."""
  return max(minimum, 1 << max(0, (n - 1).bit_length()))


def token_bucket(n: int, minimum: int = 8) -> int:
  """Round up to 2^k or 1.5 * 2^k: at most a third of a packed pass is padding (a power of two wastes up to half,
  and prefill costs follow the padded count), for twice the shapes of `bucket`."""
  b = bucket(n, minimum)
  return b * 3 // 4 if b >= 2 * minimum and b * 3 // 4 >= n else b


@dataclass
class WorkItem:
  """Tokens of one sequence to read: their K/V are written at positions start, start+1, ..."""
  block_table: list[int]
  start: int
  tokens: list[int]


@dataclass
class DecodeRun:
  """Greedy decode passes launched and not read yet (`ModelRunner.launch_decodes`): pass i of the run stores item r's
  token at entries[r] of row (first_row + i) of its shape's token history."""
  shape: PassShape
  entries: np.ndarray
  first_row: int
  steps: int
  read: Callable[[], np.ndarray]   # waits for the run's passes (only those, where the device allows) -> the history


@dataclass(frozen=True)
class PassShape:
  """What fixes a pass's tensor shapes (the KV extent read is a bound Variable instead): one capture each."""
  num_seqs: int             # bucketed; padding rows included
  query_len: int            # query slots per sequence; packed: token slots of the whole pass
  all_logits: bool          # logits for every slot (speculative verification) or only each sequence's last
  packed: bool = False      # sequences' tokens back to back (kernels.AttentionGroup)
  extent: int = 0           # KV blocks the pass reads at most (its extent Variable's maximum); 0: the whole table

  @property
  def num_tokens(self) -> int: return self.query_len if self.packed else self.num_seqs * self.query_len
  @property
  def num_rows(self) -> int: return self.num_tokens if self.all_logits else self.num_seqs
  @property
  def is_decode(self) -> bool: return self.query_len == 1 and not self.all_logits and not self.packed   # a token a sequence

  def table_width(self, max_blocks: int) -> int:
    """The columns of its block tables: a bounded extent's (no pass of the shape reads further), else the whole table.
    A packed prefill's rows are max_num_seqs' bucket: at a 131072-token limit whole tables were 1 MB a pass."""
    return self.extent or max_blocks

  def sizes(self, max_blocks: int) -> tuple[int, ...]:
    T, P = self.num_tokens, self.num_seqs
    return (T, T, T, T, T, self.num_rows, P, P * self.table_width(max_blocks))   # in FIELDS order


class ModelRunner:
  """Runs passes of one model over its paged KV cache.

  On the CPU each pass shape gets three captures: an input pass (unpacks the step's integers into separate buffers
  and looks up the embeddings), one decoder *layer*, replayed once per layer with that layer's weights and
  cache, and the LM head. Capturing a whole 30-layer model instead costs seconds of tinygrad scheduling for
  every new shape; one layer costs a thirtieth of that, and a direct replay about 50 us. On a GPU the whole pass
  is one capture (`capture_mode`, below): a graph replay per layer costs far more than a direct one.

  With tensor parallelism `device` is a tuple of devices (model/tensor_parallel.py): the KV cache is split by KV head,
  the hidden state and the step's integers are copied to every device, and the logits come back on the first."""
  def __init__(self, model: Llama, num_blocks: int, block_size: int, max_model_len: int, device: str | tuple[str, ...],
               max_num_seqs: int = 32, kv_format: KVCacheFormat | None = None, capture_mode: str = "auto", decode_steps: int = 1,
               pipelined: bool = False):
    self.model, self.device, self.block_size, self.num_blocks = model, device, block_size, num_blocks
    self.devices = device if isinstance(device, tuple) else (device,)
    self.kind = self.devices[0].split(":")[0]
    if capture_mode not in CAPTURE_MODES: raise ValueError(f"capture_mode must be one of {', '.join(CAPTURE_MODES)}, got {capture_mode!r}")
    # "pass": a shape's whole pass is one capture, which a GPU replays as a few graphs per step (tinygrad batches the
    # kernels); "layer": three captures, the layer one replayed per layer. On a GPU each layer replay goes through
    # tinygrad's graph executor, which rewrites every node's arguments on every run (the weights are the layer's
    # inputs) and is one command buffer on Metal; a 1B decode step took 12 ms on the H100, 14 % of its bandwidth floor.
    # A whole pass holds its weights and caches itself, so a replay rewrites only the nodes that read the step's inputs
    # or the KV extent (emulated METAL, 16 layers: 18 command buffers a decode step -> 4). The CPU device has no graphs
    # and its direct replays cost ~50 us a layer, so it keeps the layer captures, which are cheaper to capture.
    self.whole_pass = capture_mode == "pass" or (capture_mode == "auto" and self.kind != "CPU" and len(self.devices) == 1)
    self.kv_format = kv_format or KVCacheFormat("float32" if model.dtype == dtypes.float32 else "float16")
    model.kernels.check_kv_cache(self.kv_format)
    self.packs_prefill = model.kernels.packs(model.layers, self.kv_format)   # prefill chunks back to back (kernels.AttentionGroup)
    self.max_num_seqs = max_num_seqs
    self.max_blocks = -(-max_model_len // block_size)   # block-table width; the used extent is a Variable
    self.kv_extent = CountVariable.make("kv_blocks", self.max_blocks)
    # tinygrad sizes a buffer of symbolic length at its maximum: the portable attention's scratch in a pass takes query
    # slots x the extent Variable's maximum. A prefill step has many query slots, so on a GPU its shapes also bound the
    # extent, by a power of two of blocks (a 1024-slot step of a 32-head model with a 131072-token context would take
    # 17 GB with the whole table's extent). Our Metal shaders read the whole table whatever the extent: not for them.
    self.extent_buckets = self.kind != "CPU" and model.kernels.name == "portable"
    self._extents: dict[int, CountVariable] = {}
    self.prefill_extents: dict[PassShape, int] = {}   # a prefill shape (extent 0) -> the extent of its capture kept
    cfg = model.cfg
    self.kv_caches = [PagedKVCache.allocate(self.kv_format, num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim, self._zeroed)
                      for _ in range(cfg.num_hidden_layers)]
    self.layer_weights = [layer.tensors() for layer in model.layers]
    self.replays: OrderedDict[PassShape, tuple] = OrderedDict()   # shape -> _replays(shape)
    # On Metal a layer replay is one MetalGraph command buffer, and re-running a graph first waits for its previous
    # run: with one capture, every layer would wait for the layer before it and the GPU would idle while Python
    # encodes the next. Two captures taken in turn wait only for the layer before last, while the last one runs.
    self.layer_graphs = 2 if self.kind == "METAL" else 1
    # The same holds for the passes of a multi-step run: with one capture of the decode pass, each pass would wait for
    # the one before it to finish before the host could encode it, so a decode shape that runs them has two whole-pass
    # captures, taken in turn (pass i in capture i % 2), on Metal and on tinygrad's own drivers (NV, AMD: HCQGraph too
    # waits for a graph's previous run). CUDA's graphs do not wait.
    self.run_graphs = 2 if self.kind in ("METAL", "NV", "AMD") and decode_steps > 1 else 1
    # Layers stored alike share their captures; a checkpoint that stores some layers differently (a Q4_K_M GGUF's v
    # and down projections in Q6_K in half the layers) needs one capture per kind of layer. layer_slot[i]: the replay
    # layer i runs in a shape's tuple of layer replays (kind-major, the captures of a kind taken in turn).
    kinds = list(dict.fromkeys(layer.signature for layer in model.layers))
    self.layer_templates = [next(layer for layer in model.layers if layer.signature == k) for k in kinds]
    seen = [0] * len(kinds)
    self.layer_slot = []
    for layer in model.layers:
      k = kinds.index(layer.signature)
      self.layer_slot.append(k * self.layer_graphs + seen[k] % self.layer_graphs)
      seen[k] += 1
    # On a GPU a greedy decode step needs only each row's argmax (`execute(decode_argmax=True)`): taken on the device, 4
    # bytes a row come back instead of the vocabulary's logits (Llama 3: 0.5 MB a row, 16 MB a step at batch 32) and the
    # host skips an argmax over them. On the CPU device logits are read in place and numpy's argmax is as fast.
    self.argmax_on_device = self.kind != "CPU" or decode_steps > 1 or pipelined
    # Multi-step decoding (`execute_steps`): up to `decode_steps` greedy decode passes back to back, each reading the
    # argmax tokens of the pass before from the device, so the host launches them all before it waits once and reads
    # them all. A decode shape's capture then holds a history of the run's tokens and a pass counter
    # (portable.split's fed tokens, store_tokens), and its input holds every pass's fields, uploaded once a run (portable.split).
    self.decode_steps = decode_steps
    # Pipelined decoding (async scheduling, engine/core.py): a run is launched before the one before it is read, its
    # first pass reading that run's last tokens from the device. Runs take rows of the history in turn, as a ring of
    # twice a run's passes: a run never writes the rows of the run before it, which the host may still be reading.
    # Uploads and reads go through copies ordered with the passes (replay.OrderedCopies: CUDA, and the CPU device).
    self.pipelined = pipelined
    self.history_rows = decode_steps * (2 if pipelined else 1)
    self.copies = OrderedCopies.for_device(self.devices[0]) if pipelined else OrderedCopies()
    self.run_state: dict[PassShape, tuple[Tensor, Tensor]] = {}   # a decode shape's (token history, pass counter)
    self.num_passes = 0   # passes run (the benchmark's traffic accounting counts a multi-step run's passes)
    self.input_buffers: dict[PassShape, Tensor] = {}
    self.hidden_buffers: dict[PassShape, tuple[Tensor, Tensor]] = {}
    # (a captured shape, which of its whole-pass captures) -> its calls, inputs bound
    self.bound_passes: dict[tuple[PassShape, int], list[tuple[BoundReplay, bool]]] = {}
    self.launch_times = LaunchTimes()   # the benchmark enables it

  def _zeroed(self, shape: tuple[int, ...], dtype) -> Tensor:
    """A zero-filled cache tensor (attention multiplies masked-out entries by 0, and 0 * NaN garbage is NaN).
    On the CPU device it is fresh anonymous memory, which the OS hands out zeroed and maps page by page as
    blocks are first written: writing zeros instead took 6.5 s for the default 2 GB cache on this machine. Not
    counted as tinygrad's device memory (GlobalCounters.mem_used): most of it is never committed, and benchmarks
    report the cache's size apart. With tensor parallelism the tensor is split by KV head, one such buffer per device."""
    if len(self.devices) > 1: return self._sharded_zeroed(shape, dtype)
    if self.kind != "CPU": return self._buffer(shape, dtype)
    return lend(fresh_pages(math.prod(shape) * dtype.itemsize), shape, dtype, self.device, counted=False)

  def _sharded_zeroed(self, shape: tuple[int, ...], dtype) -> Tensor:
    if self.kind != "CPU":
      return Tensor.zeros(*shape, dtype=dtype).shard(self.devices, KV_HEAD_AXIS).contiguous().realize()
    t = sharded_empty(shape, dtype, self.devices, KV_HEAD_AXIS)
    for buf in t.uop.buffer.bufs:
      lend_buffer(buf, fresh_pages(buf.nbytes), counted=False)
    return t

  def _buffer(self, shape: tuple[int, ...], dtype, device: str | tuple[str, ...] | None = None) -> Tensor:
    """A realized, zero-filled device buffer (a whole buffer, so it can be a replay's input); on a tuple of devices,
    a copy on each."""
    return Tensor.zeros(*shape, dtype=dtype, device=device or self.device).contiguous().realize()

  @property
  def kv_bytes_per_block(self) -> int:
    cfg = self.model.cfg
    return self.kv_format.bytes_per_block(cfg.num_hidden_layers, self.block_size, cfg.num_key_value_heads, cfg.head_dim)

  def execute(self, decodes: list[WorkItem], prefills: list[WorkItem] = (), verifies: list[WorkItem] = (),
              prefill_all_logits: bool = False, decode_argmax: bool = False) -> tuple[np.ndarray, np.ndarray | list[np.ndarray], np.ndarray]:
    """Read the given tokens. Returns float32 logits: `[len(decodes), V]` (one token each), `[len(prefills), V]`
    (each chunk's last token; with `prefill_all_logits`, one `[chunk length, V]` array per chunk instead, as
    prompt logprobs need) and `[len(verifies), K, V]` (every token of each verified run; all runs have K tokens).
    With `decode_argmax`, each decode's argmax token id instead of its logits (int64 `[len(decodes)]`: greedy
    sampling without penalties), taken on the device where `argmax_on_device`.

    Each kind runs as its own pass. One pass over all three would read the weights once instead of up to
    three times, but every combination of bucket sizes would be a shape to capture; separate passes keep the
    shapes to the sum of the kinds' buckets, not their product."""
    vocab = self.model.cfg.vocab_size
    out = [np.zeros((0, vocab), np.float32), np.zeros((0, vocab), np.float32), np.zeros((0, 0, vocab), np.float32)]
    for i, items in enumerate((decodes, prefills, verifies)):
      if not items: continue
      shape = self._shape(i, items, prefill_all_logits)
      result = self._forward(shape, *(self._prepare_run(shape, items, 1) if self._feeds_back(shape) else self.prepare(shape, items)))
      self._timed_wait()
      if i == 0 and decode_argmax:
        out[0] = self._argmax(result)[:len(items)]
        continue
      logits = self._host_logits(result)
      if i == 1 and prefill_all_logits:   # rows are token slots: each chunk's own, in its place
        starts = np.cumsum([0] + [len(w.tokens) for w in items]) if shape.packed else np.arange(len(items)) * shape.query_len
        out[i] = [logits[start:start + len(w.tokens)] for start, w in zip(starts, items)]
      elif shape.all_logits: out[i] = logits.reshape(-1, shape.query_len, vocab)[:len(items)]
      else: out[i] = logits[:len(items)]
    return out[0], out[1], out[2]

  def warm_up_shapes(self, max_num_seqs: int, max_prefill_tokens: int, max_model_len: int,
                     verify_tokens: int = 0) -> list[Callable[[], object]]:
    """One pass each for every shape a prefill pass of up to `max_prefill_tokens` tokens (packed: each token bucket;
    padded: each pair of a chunk count and a length) and a decode step of up to `max_num_seqs` sequences takes, and
    with `verify_tokens` a speculative verification of that many tokens a sequence, to run before serving: a shape's
    first pass captures it (a second or more for a deep model on a GPU, in which every running request waits). Each
    runs dummy work: token 0, every table entry block 0, which the caller must hold no live or cached data
    (`EngineCore.warm_up`: before the first request). A decode shape of multi-step runs takes a run (every graph it
    turns through). A GPU bounds a prefill shape's extent by the context its first pass read: each is captured here at
    the end of a budget's context (at most `max_model_len`), and a longer context captures it again (`_prefill_extent`),
    as prompt logprobs' shapes are captured when first met. The decodes come last: the most used, so the last
    evicted where the passes outnumber the captures kept (MAX_SHAPES)."""
    def item(tokens: int, start: int, positions: int) -> WorkItem:   # tokens from `start`, a table for `positions`, all block 0
      return WorkItem([0] * -(-positions // self.block_size), start, [0] * tokens)
    context = min(max_prefill_tokens, max_model_len)
    passes: dict = {}   # a shape's key -> the chunk lengths of a pass that takes it, within the scheduler's budget
    if self.packs_prefill:   # a token count's bucket: the count in as few chunks as max_model_len allows
      for total in range(1, max_prefill_tokens + 1):
        pieces = -(-total // context)
        if pieces <= max_num_seqs: passes.setdefault(token_bucket(total), [total // pieces + (i < total % pieces) for i in range(pieces)])
    else:   # a pair of a chunk count and a length bucket: the count x the longest within the budget
      for p in range(1, max_num_seqs + 1):
        for c in range(1, min(max_prefill_tokens // p, max_model_len) + 1): passes.setdefault((bucket(p), bucket(c, minimum=8)), [c] * p)
    work = [lambda chunks=chunks: self.execute([], [item(c, context - c, context) for c in chunks]) for chunks in passes.values()]
    sizes = sorted({bucket(n) for n in range(1, max_num_seqs + 1)})
    if verify_tokens:
      work += [lambda n=min(b, max_num_seqs): self.execute([], [], [item(verify_tokens, 0, verify_tokens) for _ in range(n)]) for b in sizes]
    def decode(n: int) -> Callable[[], object]:
      if self._feeds_back(self.decode_shape([item(1, 0, 1)] * n)):   # a run's passes from position 0, each in its graph turn
        return lambda: self.execute_steps([item(1, 0, self.decode_steps) for _ in range(n)], self.decode_steps)
      return lambda: self.execute([item(1, 0, 1) for _ in range(n)])
    return work + [decode(min(b, max_num_seqs)) for b in sizes]

  def execute_steps(self, decodes: list[WorkItem], steps: int) -> np.ndarray:
    """`steps` greedy decode passes over `decodes` back to back (multi-step decoding): pass i reads each sequence's
    token at position start + i, which pass i - 1 took as the argmax of its logits on the device. The inputs of every
    pass go to the device at once, the host launches the passes without waiting for any, and reads the tokens of all
    of them at the end. Each table must hold slots up to start + steps - 1. Returns int64 `[len(decodes), steps]`:
    row r is the tokens sequence r took, in order."""
    return self.read_decodes(self.launch_decodes(decodes, steps))

  def launch_decodes(self, decodes: list[WorkItem], steps: int, after: DecodeRun | None = None,
                     rows: list[int] | None = None) -> DecodeRun:
    """Launch `execute_steps`'s passes without waiting for them. With `after` (a pipelined runner), each sequence's
    first token is the last one run `after` takes, on the device: item r here is item rows[r] there (default r), its
    start that run's start + its steps (its `tokens` are not read), and nothing of `after` need have finished. The
    two runs must have one shape (their history is the shape's)."""
    assert 1 <= steps <= self.decode_steps, f"{steps} steps, but decode shapes keep a history of {self.decode_steps}"
    shape = self._shape(0, decodes, False)
    assert after is None or (self.pipelined and after.shape == shape), "a run follows another of its shape, pipelined"
    first_row = (after.first_row + after.steps) % self.history_rows if after is not None else 0
    # a row's entry follows its token from pass to pass and run to run (store_tokens stores where the token was read)
    entries = np.arange(len(decodes)) if after is None else after.entries[np.arange(len(decodes)) if rows is None else rows]
    self._forward(shape, *self._prepare_run(shape, decodes, steps, first_row, entries, fed=after is not None))
    return DecodeRun(shape, entries, first_row, steps, self.copies.read_later(self.run_state[shape][0].uop.buffer))

  def read_decodes(self, run: DecodeRun) -> np.ndarray:
    """Wait for a launched run and return its tokens: int64 `[items, steps]`, row r the tokens item r took, in order."""
    t = time.perf_counter()
    history = run.read().reshape(self.history_rows, run.shape.num_seqs)
    if self.launch_times.enabled: self.launch_times.wait_seconds += time.perf_counter() - t
    rows = (run.first_row + np.arange(run.steps)) % self.history_rows
    return history[rows][:, run.entries].T.astype(np.int64)

  def _run_layout(self, shape: PassShape) -> tuple[list[int], int]:
    """A multi-step run's input layout (portable.split's): the fields that stay the same (rows, block tables), then
    each pass's PASS_FIELDS, for `decode_steps` passes. Returns each field's offset for the first pass (FIELDS order)
    and the length; pass i's field is i * len(PASS_FIELDS) * P further on (a decode's PASS_FIELDS have P entries)."""
    sizes = dict(zip(FIELDS, shape.sizes(self.max_blocks)))
    run = [n for n in FIELDS if n not in PASS_FIELDS]
    at = dict(zip(run, itertools.accumulate([0] + [sizes[n] for n in run[:-1]])))
    first = sum(sizes[n] for n in run)
    at |= {n: first + j * shape.num_seqs for j, n in enumerate(PASS_FIELDS)}
    return [at[n] for n in FIELDS], first + self.decode_steps * len(PASS_FIELDS) * shape.num_seqs

  def _prepare_run(self, shape: PassShape, decodes: list[WorkItem], steps: int, first_row: int = 0,
                   entries: np.ndarray | None = None, fed: bool = False) -> tuple[np.ndarray, list[int]]:
    """The inputs of a multi-step run's `steps` passes over `decodes` as one array (`_run_layout`; the unused passes'
    fields zero). Pass i reads position start + i of each sequence and writes its tokens to history row first_row + i
    (of `history_rows`, in a ring); it reads as its token the negative entry -1 - j P - r: the one history[j P + r]
    holds, sampled in the row j before its own, at item r's entry (`entries`, default r: store_tokens stores a token
    where it read the one before); `fed`: the first pass's too, else the first reads the items' tokens and `first_row`
    is 0. Padding rows read no history and store nothing. Returns it and the KV blocks each pass reads."""
    assert fed or first_row == 0, "a run whose first pass reads its tokens from the host starts at history row 0"
    layout = self._run_layout(shape)
    packed, used = self.prepare(shape, decodes, layout)
    P, k, bs = shape.num_seqs, len(decodes), self.block_size
    offsets, sizes = layout[0], shape.sizes(self.max_blocks)
    def field(name: str, i: int = 0) -> np.ndarray:   # a view of the field (a PASS_FIELDS one: pass i's)
      at, n = offsets[FIELDS.index(name)] + i * len(PASS_FIELDS) * P, sizes[FIELDS.index(name)]
      return packed[at:at + n]
    entries = np.arange(k) if entries is None else entries
    no_token = -1 - self.history_rows * P   # past the history: read as 0, stored nowhere (portable.store_tokens)
    def feed(i: int) -> None:   # pass i's tokens: item r's from its entry of the row before pass i's own
      tokens = field("tokens", i)
      tokens[:k], tokens[k:] = -1 - ((first_row + i - 1) % self.history_rows) * P - entries, no_token
    if fed: feed(0)
    used_blocks, positions = [used], field("positions")[:k]
    if steps == 1: return packed, used_blocks
    tables = field("tables").reshape(P, shape.table_width(self.max_blocks))
    if ((positions + steps - 1) // bs >= np.fromiter((len(w.block_table) for w in decodes), np.int64, k)).any():
      raise IndexError(f"a block table holds fewer than the {steps} positions of a multi-step run")
    for i in range(1, steps):
      pos = positions + i
      feed(i)
      field("positions", i)[:k], field("q_pos", i)[:k], field("ctx", i)[:k] = pos, pos, pos + 1
      slots = field("slots", i)
      slots[:k], slots[k:] = tables[np.arange(k), pos // bs] * bs + pos % bs, -1   # padding rows write no K/V
      used_blocks.append(-(-int(pos.max() + 1) // bs))
    return packed, used_blocks

  def _feeds_back(self, shape: PassShape) -> bool:
    """Does this shape's capture take part in multi-step or pipelined runs: a decode shape of a runner that runs them."""
    return (self.decode_steps > 1 or self.pipelined) and shape.is_decode

  def decode_shape(self, decodes: list[WorkItem]) -> PassShape:
    """The pass shape a step of these decodes runs in."""
    return self._shape(0, decodes, False)

  def _shape(self, kind: int, items: list[WorkItem], prefill_all_logits: bool) -> PassShape:
    """The pass shape of decodes (kind 0), prefill chunks (1) or verified runs (2). Packed prefill passes fix their
    sequence rows at `max_num_seqs`: their shapes then vary only with the token count (about 13 sizes), not with
    its product with the sequence count, which would outgrow the captures kept."""
    if kind == 0: return PassShape(bucket(len(items)), 1, False)
    if kind == 2: return PassShape(bucket(len(items)), max(len(w.tokens) for w in items), True)
    if self.packs_prefill:
      shape = PassShape(bucket(self.max_num_seqs), token_bucket(sum(len(w.tokens) for w in items)), prefill_all_logits, packed=True)
    else: shape = PassShape(bucket(len(items)), bucket(max(len(w.tokens) for w in items), minimum=8), prefill_all_logits)
    return dataclasses.replace(shape, extent=self._prefill_extent(shape, items)) if self.extent_buckets else shape

  def _prefill_extent(self, shape: PassShape, items: list[WorkItem]) -> int:
    """The extent a prefill pass of `shape` runs with: the blocks its longest chunk reaches, a power of two (0: the
    whole table). A shape keeps one capture, whose extent only grows: a smaller need runs in the capture kept, a larger
    one replaces it, so a shape's scratch never exceeds what one capture at the whole table's extent took."""
    need = bucket(max(-(-(w.start + len(w.tokens)) // self.block_size) for w in items))
    held = self.prefill_extents.get(shape)
    if held is not None and (held == 0 or held >= need): return held
    extent = need if need < self.max_blocks else 0
    if held is not None: self._drop(dataclasses.replace(shape, extent=held))
    self.prefill_extents[shape] = extent
    return extent

  def extent_variable(self, shape: PassShape) -> CountVariable:
    """The Variable counting the KV blocks a pass of this shape reads: at most the shape's extent, or the table's width."""
    if not shape.extent: return self.kv_extent
    if shape.extent not in self._extents: self._extents[shape.extent] = CountVariable.make("kv_blocks", shape.extent)
    return self._extents[shape.extent]

  def prepare(self, shape: PassShape, items: list[WorkItem], layout: tuple[list[int], int] | None = None) -> tuple[np.ndarray, int]:
    """Pack every integer input of a pass into one int32 array (one host->device copy), fields in FIELDS
    order, or in a multi-step run's `layout` (`_run_layout`: its first pass's fields, the later passes' zero).
    Returns it and the number of KV blocks the longest block table uses. Vectorized over the items, in a
    fixed number of numpy calls (a few microseconds each here): a loop of them per item cost 0.7 ms at batch 32."""
    bs, P, MB, k = self.block_size, shape.num_seqs, shape.table_width(self.max_blocks), len(items)
    sizes = shape.sizes(MB)
    offsets, total = layout or (list(itertools.accumulate((0,) + sizes[:-1])), sum(sizes))
    packed = np.zeros(total, np.int32)
    tokens, positions, slots, q_pos, token_seq, rows, ctx, tables = (packed[at:at + n] for at, n in zip(offsets, sizes))
    slots[:], token_seq[:] = -1, -1                  # padding tokens write no K/V and read nothing
    lengths, widths, starts = np.array([(len(w.tokens), len(w.block_table), w.start) for w in items], np.int64).T
    # row-major order of a mask's True entries is the order of the items' lists chained: one assignment fills them all
    tables = tables.reshape(P, MB)
    # the ids from the lists while the tables are short (19 ns an entry), else from each table's kept numpy (about
    # 0.45 us a table, whatever its length: a whole conversion each step grew with the context)
    n = int(widths.sum())
    ids = np.fromiter(itertools.chain.from_iterable(w.block_table for w in items), np.int32, n) if n <= SHORT_TABLE * k \
      else np.concatenate([table_ids(w.block_table) for w in items])
    if int(widths.max()) > MB:   # entries past a bounded extent's width (none the pass reads): dropped
      columns = np.concatenate([np.arange(w) for w in widths])
      ids, widths = ids[columns < MB], np.minimum(widths, MB)
    # only the columns some table reaches: the rest stay zero (block 0, never read), and a whole-width mask cost
    # 0.15 ms a step at 32 sequences with a 131072-token context (8192 columns)
    used = tables[:k, :int(widths.max())]
    used[np.arange(used.shape[1]) < widths[:, None]] = ids
    np.maximum(used, 0, out=used)                    # FREED entries (out of the window) read block 0, masked
    if shape.packed or shape.query_len > 1:
      if shape.packed: at = np.arange(lengths.sum())   # each real token's slot in the pass
      else: at = np.flatnonzero(np.arange(shape.query_len) < lengths[:, None])
      item = np.repeat(np.arange(k), lengths)          # ... and its item
      first = np.cumsum(lengths) - lengths if shape.packed else np.arange(k) * shape.query_len   # each item's first slot
      pos = starts[item] + at - first[item]
    else: at = item = first = np.arange(k); pos = starts   # decodes: a token each, in slot i
    block = pos // bs
    if (block >= widths[item]).any(): raise IndexError("a block table holds fewer than the positions its work item reads")
    tokens[at] = np.fromiter(itertools.chain.from_iterable(w.tokens for w in items), np.int32, len(at))
    positions[at] = q_pos[at] = pos
    token_seq[at] = item
    slots[at] = tables[item, block] * bs + pos % bs
    ctx[:k] = starts + lengths
    if shape.all_logits: rows[at] = at
    else: rows[:k] = first + lengths - 1
    return packed, max(-(-int(ctx.max()) // bs), 1)

  def _forward(self, shape: PassShape, packed: np.ndarray, used_blocks: int | list[int]) -> Tensor | tuple[Tensor, Tensor]:
    """Run a pass, or a multi-step run's passes (`used_blocks` for each; `packed` holds them all); returns the last
    one's capture's outputs on the device: the logits, with each row's argmax where `head` takes it."""
    replays = self._replays(shape)
    upload = self._upload(shape, packed)
    if shape in self.run_state: self._copy_in(self.run_state[shape][1], np.zeros(1, np.int32))   # the run's first pass reads the first inputs
    for i, used in enumerate(used_blocks if isinstance(used_blocks, list) else [used_blocks]):
      out = self._pass(shape, replays, upload, used, i % len(replays) if self.whole_pass else 0)
    return out

  def _pass(self, shape: PassShape, replays: tuple, upload: Tensor, used_blocks: int, turn: int) -> Tensor | tuple[Tensor, Tensor]:
    """One pass of `shape` through its capture `turn` (whole-pass captures; layer mode has one set)."""
    variable = self.extent_variable(shape)
    extent = lambda: (variable.bind(used_blocks),)   # a capture's bound Variable (9 us to make: first passes only)
    if (bound := self.bound_passes.get((shape, turn))) is None and self.whole_pass:   # the capture's first pass: captured, then bound
      out = replays[turn](upload, bound=extent())
      bound = self.bound_passes[shape, turn] = [(replays[turn].bind(upload, times=self.launch_times), True)]
    elif bound is None:
      inputs = replays[0]
      calls = self._pass_calls(shape, inputs(upload))   # a replay returns its capture's own output tensors
      for replay, args, reads_extent in calls: out = replay(*args, bound=extent() if reads_extent else ())
      bound = self.bound_passes[shape, turn] = [(inputs.bind(upload, times=self.launch_times), False)] + [
        (replay.bind(*args, times=self.launch_times), reads_extent) for replay, args, reads_extent in calls]
    else:
      var_vals = variable.var_vals(used_blocks)
      for call, reads_extent in bound: out = call(var_vals if reads_extent else {})
    self.num_passes += 1
    return out

  def _timed_wait(self) -> None:
    """The benchmark: how long the host waits for the device's work of the passes it launched."""
    if not self.launch_times.enabled: return
    t = time.perf_counter()
    Device[self.devices[0]].synchronize()
    self.launch_times.wait_seconds += time.perf_counter() - t

  def _host_logits(self, result: Tensor | tuple[Tensor, Tensor]) -> np.ndarray:
    """A pass's float32 logits `[rows, V]`, copied to the host."""
    logits = (result[0] if isinstance(result, tuple) else result).uop.buffer
    return to_host(logits).reshape(-1, self.model.cfg.vocab_size)

  def _argmax(self, result: Tensor | tuple[Tensor, Tensor]) -> np.ndarray:
    """Each row's argmax token: the device's where the pass took one (numpy's rule: portable.argmax), else numpy's."""
    if not isinstance(result, tuple): return np.argmax(self._host_logits(result), axis=-1)
    return to_host(result[1].uop.buffer).astype(np.int64)

  def _pass_calls(self, shape: PassShape, fields: tuple[Tensor, ...]) -> list[tuple[Replay, tuple[Tensor, ...], bool]]:
    """The pass after its input replay, whose outputs are `fields`: (replay, its inputs, whether it reads the KV
    extent) per call, in order. Layers write into two buffers in turn (a replay whose output buffer is also its
    input would copy it first); a layer's output is read from the buffer passed, as a replay returns the tensor of
    its capture."""
    _, layers, head = self.replays[shape]
    h, positions, slots, q_pos, token_seq, rows, ctx, tables, tokens = fields
    hidden, calls = self._hidden_buffers(shape), []
    for i, (weights, cache) in enumerate(zip(self.layer_weights, self.kv_caches)):
      calls.append((layers[self.layer_slot[i]], (h, hidden[i % 2], positions, slots, q_pos, token_seq, ctx, tables, *cache.tensors(), *weights), True))
      h = hidden[i % 2]
    return calls + [(head, (h, rows, tokens) if self._feeds_back(shape) else (h, rows), False)]

  def _hidden_buffers(self, shape: PassShape) -> tuple[Tensor, Tensor]:
    if shape not in self.hidden_buffers:
      self.hidden_buffers[shape] = tuple(self._buffer((shape.num_tokens, self.model.cfg.hidden_size), self.model.dtype)
                                         for _ in range(2))
    return self.hidden_buffers[shape]

  def _upload(self, shape: PassShape, packed: np.ndarray) -> Tensor:
    """Copy the step's integers into this shape's input buffer directly. Realizing a new Tensor each step would
    cost milliseconds: tinygrad's scheduler walks every live tensor (the weights included) on each realize."""
    if shape not in self.input_buffers:
      self.input_buffers[shape] = self._buffer((len(packed),), dtypes.int32, self.devices[0])
    return self._copy_in(self.input_buffers[shape], packed)

  def _copy_in(self, t: Tensor, values: np.ndarray) -> Tensor:
    """Overwrite a realized int32 tensor's buffer with `values`, on the device's queue (after the work launched)."""
    self.copies.upload(t.uop.buffer, np.asarray(values, np.int32))
    return t

  def captures(self, shapes: list[PassShape] | None = None) -> list[Replay]:
    """Every capture of every shape kept, or of `shapes` (a decode shape's second capture for multi-step runs once a
    run took it)."""
    return [r for shape, replays in self.replays.items() if shapes is None or shape in shapes
            for r in (replays if self.whole_pass else (replays[0], *replays[1], replays[2])) if r.jit.captured is not None]

  def _replays(self, shape: PassShape) -> tuple[Replay] | tuple[Replay, tuple[Replay, ...], Replay]:
    """A whole pass's capture, or the input, layer and head captures of layer mode."""
    if shape in self.replays:
      self.replays.move_to_end(shape)
      return self.replays[shape]
    P, C, MB = shape.num_seqs, shape.query_len, shape.table_width(self.max_blocks)
    history = counter = None   # multi-step runs: the tokens a decode pass took, read by the next; which pass runs
    if self._feeds_back(shape):
      history, counter = self.run_state[shape] = (self._buffer((self.history_rows * P,), dtypes.int32), self._buffer((1,), dtypes.int32))

    def unpack(packed: Tensor):
      """The step's integers -> the embedded tokens, the other fields (FIELDS order), and the token field as sent."""
      sizes = shape.sizes(MB)
      if history is not None:   # the tokens also fed from the history (the pass before's), by the same kernel
        *runs, tokens = portable.split(packed, sizes, [n in PASS_FIELDS for n in FIELDS], counter, feed=(FIELDS.index("tokens"), history))
        fields = dict(zip(FIELDS, runs))
      elif len(self.devices) == 1: fields = dict(zip(FIELDS, portable.split(packed, sizes)))   # one kernel, not one per field
      else:
        packed, fields, at = packed.shard(self.devices), {}, 0   # every device reads the step's integers
        for name, size in zip(FIELDS, sizes):
          fields[name], at = packed[at:at + size].clone(), at + size   # clone: a real buffer, not a view of packed
      if history is None: tokens = fields["tokens"]
      return (self.model.embed(tokens).contiguous(), *(fields[n] for n in FIELDS[1:]), fields["tokens"])

    def model_inputs(positions, slots, q_pos, token_seq, ctx, tables, bound_extent) -> ModelInputs:
      group = AttentionGroup(P, C, tables.reshape(P, MB), CountVariable.count(bound_extent), q_pos.reshape(1 if shape.packed else P, C),
                             ctx, token_seq, packed=shape.packed, kernel_blocks=self.extent_variable(shape).kernel_count())
      return ModelInputs(None, positions, slots, [group], None)

    def head(h: Tensor, rows: Tensor, tokens: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
      logits = self.model.logits(h, None if shape.is_decode else rows)   # decode: row i is sequence i's token
      if not (self.argmax_on_device and shape.is_decode): return logits
      argmax = self.model.kernels.argmax(logits)   # decode: greedy steps read only this
      if history is not None: Tensor.realize(logits, argmax, *portable.store_tokens(history, counter, tokens, argmax))
      return logits, argmax

    def whole(packed: Tensor, bound_extent):
      h, positions, slots, q_pos, token_seq, rows, ctx, tables, tokens = fields = unpack(packed)
      Tensor.realize(*fields)
      inputs = model_inputs(positions, slots, q_pos, token_seq, ctx, tables, bound_extent)
      for layer, cache in zip(self.model.layers, self.kv_caches):   # realized a layer at a time: small schedules
        h = layer(h, inputs, self.model.rope_table(layer), cache).realize()
      return head(h, rows, tokens)

    n_cache = len(self.kv_caches[0].tensors())
    def layer(template, h, out, positions, slots, q_pos, token_seq, ctx, tables, *cache_weights_and_extent):
      *cache_and_weights, bound_extent = cache_weights_and_extent
      cache, weights = self.kv_caches[0].with_tensors(cache_and_weights[:n_cache]), cache_and_weights[n_cache:]
      inputs = model_inputs(positions, slots, q_pos, token_seq, ctx, tables, bound_extent)
      return template.with_tensors(weights)(h, inputs, self.model.rope_table(template), cache, out)

    if self.whole_pass: replays = tuple(Replay(whole) for _ in range(self.run_graphs if history is not None else 1))
    else:
      layers = tuple(Replay(functools.partial(layer, template)) for template in self.layer_templates for _ in range(self.layer_graphs))
      replays = (Replay(unpack), layers, Replay(head))
    self.replays[shape] = replays
    if len(self.replays) > MAX_SHAPES: self._drop(next(iter(self.replays)))   # the least recently used shape
    return replays

  def _drop(self, shape: PassShape) -> None:
    """Forget a shape's captures and buffers together."""
    for kept in (self.replays, self.input_buffers, self.hidden_buffers, self.run_state): kept.pop(shape, None)
    for turn in range(self.run_graphs): self.bound_passes.pop((shape, turn), None)
