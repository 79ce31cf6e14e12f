"""EngineCore: scheduler + model runner + sampler. EngineRequests in, token ids out; no text.

One `step()`: the scheduler picks the work, the runner reads it (with speculation: the draft proposes first and
the target verifies), the sampler picks tokens, and `Scheduler.update_from_output` commits them. With async
scheduling a step of greedy decodes launches the next step's run before it reads its own tokens (`InFlight`). A failure is
confined to the requests it concerns: a model pass that raises fails the sequences it carried, a sampling error
fails its own request; the others go on, and the engine stays consistent for the next step.
"""
from __future__ import annotations
import dataclasses, os, sys, time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
import numpy as np
from tqdm import tqdm
from tinygrad import Device
from tinyvllm import host_memory, sampler
from tinyvllm.config import ConfigError, EngineConfig
from tinyvllm.engine.block_manager import BlockManager
from tinyvllm.engine.failure_log import FailureLog
from tinyvllm.engine.model_runner import DecodeRun, ModelRunner, WorkItem
from tinyvllm.engine.replay import OrderedCopies, cache_programs_on_disk
from tinyvllm.engine.request import CoreOutput, EngineRequest, SchedulerStats, TopLogprobs
from tinyvllm.engine.scheduler import Scheduler, SchedulerOutput
from tinyvllm.engine.sequence import Sequence
from tinyvllm.engine.spec_decode import SpeculativeDecoder
from tinyvllm.kernels import default_dtype, make_kernels, prepare_device, resolve_backend
from tinyvllm.kernels.kv_cache import KVCacheFormat
from tinyvllm.kernels.threads import default_threads
from tinyvllm.model import families
from tinyvllm.model.fetch import cache_dir
from tinyvllm.model.llama import Llama
from tinyvllm.model.tensor_parallel import parallel_backend, parallel_devices
from tinyvllm.model.tokenizer import Tokenizer, load_tokenizer
from tinyvllm.model.weights import Checkpoint, load_checkpoint, select_tensors
from tinyvllm.structured_output import MaskWorker, apply_bias

PARALLEL_SAMPLING_VOCAB = 16384   # rows of a smaller vocabulary cost less than handing them to a thread


def coarse(blocks: int, bits: int = 6) -> int:
  """`blocks` rounded down to its `bits` leading binary digits: at most 1/32 fewer. The cache's size is in the kernels
  that read and write it, and free memory moves a little from one start to the next; a coarse count keeps those
  kernels, and so their lowered programs on disk (engine/replay.py's ProgramCache), the same."""
  step = 1 << max(0, blocks.bit_length() - bits)
  return blocks - blocks % step


def available_memory(meminfo: str = "/proc/meminfo", cgroup: str = "/sys/fs/cgroup") -> int:
  """Bytes the OS can give the process now. On Linux its MemAvailable: free memory plus the page cache and whatever
  else it can reclaim. A model file just downloaded or read sits in the page cache, so free memory alone can be a
  fraction of it: beside an 8B model on a 24 GB machine with 22 GB available, 4.5 GB free left no room for a KV
  cache at all. In a container with a memory limit (a cgroup's), no more than the room left under it: MemAvailable
  is the host's. Elsewhere the free pages, and on macOS (neither) half the physical memory."""
  host = None
  try:
    with open(meminfo) as f:
      for line in f:
        if line.startswith("MemAvailable:"): host = int(line.split()[1]) * 1024   # in kB
  except (OSError, ValueError, IndexError): pass
  if host is None:
    try: host = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError): host = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2
  room = cgroup_room(cgroup)
  return host if room is None else min(host, room)


def cgroup_room(root: str = "/sys/fs/cgroup") -> int | None:
  """Bytes left under this process's cgroup memory limit (v2: memory.max; v1: memory/memory.limit_in_bytes), counting
  its reclaimable page cache (inactive file pages) as room, as the kernel does before it kills; None without a limit."""
  for limit_file, usage_file, stat_file, inactive in (
      ("memory.max", "memory.current", "memory.stat", "inactive_file"),
      ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes", "memory/memory.stat", "total_inactive_file")):
    try: limit, usage = (Path(root, limit_file).read_text().strip(), int(Path(root, usage_file).read_text()))
    except (OSError, ValueError): continue
    if not limit.isdigit() or int(limit) >= 1 << 60: return None   # unlimited: "max" (v2), a page-rounded 2^63 (v1)
    try: stat = dict(line.split() for line in Path(root, stat_file).read_text().splitlines() if len(line.split()) == 2)
    except OSError: stat = {}
    return max(0, int(limit) - usage + int(stat.get(inactive, "0")))
  return None


@dataclasses.dataclass
class InFlight:
  """A pipelined decode run (async scheduling) launched by one step and read by the next: the decodes of the step it
  stands for, item for item, and the runner's handle. Launched before the run before it was read, it assumes that no
  sequence stopped there; the tokens of one that did are dropped when it is read."""
  sched: SchedulerOutput
  run: DecodeRun


def pipelines(device: str, config: EngineConfig) -> bool:
  """Whether greedy decode steps on `device` are pipelined (config.async_scheduling): as asked, wherever the runner's
  copies are ordered with the device's work (replay.OrderedCopies: CUDA, and the CPU device for the tests). Off by
  default: its CUDA copies have not yet run on a GPU (the one GPU call after it landed ran with it off)."""
  if config.async_scheduling and not OrderedCopies.ordered(device):
    raise ConfigError(f"async_scheduling=True on {device}: its host-to-device copies are not ordered with the work "
                      f"launched before them, so a pipelined step would overwrite the inputs of the pass still running; "
                      f"it runs on CUDA and the CPU device")
  return config.async_scheduling


# weights (bytes as stored) up to which the model's host pages ask for transparent huge pages (host_memory.huge_pages):
# a 1B decodes 1.08x as fast for about half a second of load; an 8B 1.02x for 3-6 s more
HUGE_PAGES_UP_TO = 2 << 30


class EngineCore:
  def __init__(self, config: EngineConfig, ckpt: Checkpoint, tokenizer: Tokenizer, failures: FailureLog | None = None):
    """Build the model, its KV cache and (with `draft_model`) the draft from a loaded checkpoint. `tokenizer`
    gives the end-of-sequence ids and checks that a draft model shares the vocabulary. `failures` logs what fails."""
    self.config = config
    self.failures = failures or FailureLog()
    try: cache_programs_on_disk(cache_dir() / "programs")   # a later start loads the kernels this one lowers
    except OSError as e: print(f"tinyvllm: lowered kernels are not kept on disk: {e}", file=sys.stderr)   # no cache directory
    self.device = Device.DEFAULT
    # the device the model runs on, or with tensor parallelism the devices each layer is split over (model/tensor_parallel.py)
    self.devices = parallel_devices(self.device, config.tensor_parallel_size)
    self.pipelined = pipelines(self.device, config)   # before the model loads: a refusal costs nothing
    self.model_config = ckpt.config
    dtype = default_dtype(self.device) if config.dtype == "auto" else config.dtype
    if dtype == "float16" and not families.for_model_type(ckpt.config.model_type).float16_safe:
      if config.dtype == "auto": dtype = "float32"
      print(f"tinyvllm: {ckpt.config.model_type} activations overflow float16 (as in transformers and vLLM): "
            f"{'running in float32' if config.dtype == 'auto' else 'dtype=float16 was asked for; expect inf/NaN logits'}",
            file=sys.stderr)
    model_max = ckpt.config.max_position_embeddings
    if config.max_model_len is not None and config.max_model_len > model_max:
      raise ConfigError(f"max_model_len={config.max_model_len} exceeds the model's context length {model_max}")
    max_model_len = config.max_model_len or model_max
    self.kv_format = KVCacheFormat.resolve(config.kv_cache_dtype, dtype)
    cfg = ckpt.config
    block_bytes = self.kv_format.bytes_per_block(cfg.num_hidden_layers, config.block_size, cfg.num_key_value_heads, cfg.head_dim)
    weight_bytes = ckpt.nbytes
    num_blocks = config.num_kv_blocks or self._blocks_from_memory(block_bytes, weight_bytes, max_model_len)
    capacity = num_blocks * config.block_size
    if max_model_len > capacity:
      if config.max_model_len is not None:
        raise ConfigError(f"max_model_len={max_model_len} needs {-(-max_model_len // config.block_size)} KV blocks of "
                          f"{config.block_size} tokens but the cache has num_kv_blocks={num_blocks}; "
                          f"raise num_kv_blocks or lower max_model_len")
      # one sequence must always fit alone, or preemption could not make progress
      print(f"tinyvllm: max_model_len lowered from {max_model_len} to {capacity}: the KV cache holds {num_blocks} blocks "
            f"of {config.block_size} tokens (raise num_kv_blocks or kv_cache_memory_fraction for more)", file=sys.stderr)
      max_model_len = capacity
    self.max_model_len = max_model_len
    prepare_device(self.device)
    self.kernel_backend = parallel_backend(config) or resolve_backend(config.kernel_backend, self.device)
    if config.batch_invariant: self._check_batch_invariant(dtype, cfg.hidden_size)
    self.kernels = make_kernels(self.kernel_backend, self.devices, config.num_threads)
    with host_memory.huge_pages(weight_bytes <= HUGE_PAGES_UP_TO):
      model = self._build_model(ckpt.config, ckpt.tensors, dtype)
    self.runner = ModelRunner(model, num_blocks, config.block_size, max_model_len, self.devices, config.max_num_seqs, self.kv_format,
                              config.capture_mode, config.num_scheduler_steps, pipelined=self.pipelined)
    self.in_flight: InFlight | None = None
    self.block_manager = BlockManager(num_blocks, config.block_size, config.watermark, config.enable_prefix_caching)
    self.spec: SpeculativeDecoder | None = None
    if config.draft_model is not None:
      draft = self._load_draft(config.draft_model, ckpt, tokenizer, dtype)
      # as many draft blocks as target blocks: a draft table never outgrows its target table, so the draft pool
      # cannot run dry while the target's has room
      self.spec = SpeculativeDecoder(ModelRunner(draft, num_blocks, config.block_size, max_model_len, self.devices, config.max_num_seqs,
                                                 self.kv_format, config.capture_mode),
                                     BlockManager(num_blocks, config.block_size, 0.0, config.enable_prefix_caching), config.num_speculative_tokens,
                                     always=config.speculation == "always", window=draft.cfg.freeable_window)
    self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens, max_model_len,
                               frozenset(tokenizer.eos_token_ids),
                               lookahead_tokens=config.num_speculative_tokens if self.spec else 0,
                               packed_prefill=self.runner.packs_prefill, window=ckpt.config.freeable_window)
    self.requests: dict[str, list[Sequence]] = {}
    self.served = False   # a request was added (warm_up's dummy passes would overwrite what it left in the cache)
    self._seed_stream = np.random.default_rng(config.seed)
    # structured output: a step's token masks, on a worker thread while the model runs if the step leaves a core idle
    cores = default_threads()
    self.masks = MaskWorker(spare_core=self.device.split(":")[0] != "CPU" or (config.num_threads or cores) < cores)
    # a step's sampled rows of a large vocabulary, drawn on every core (numpy releases the GIL in its passes over a row)
    self.sampling_threads = ThreadPoolExecutor(min(cores, 8), thread_name_prefix="tinyvllm-sample") if cores > 1 else None

  def _build_model(self, cfg, tensors, dtype: str) -> Llama:
    self.kernels.check_model(cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads, self.config.block_size, dtype)
    return Llama(cfg, tensors, dtype, self.devices, self.kernels, self.max_model_len)

  def _load_draft(self, name: str, target: Checkpoint, tokenizer: Tokenizer, dtype: str) -> Llama:
    """The draft model: any checkpoint LLM loads with the same vocabulary, or "self:N", the target's first N layers
    (with its final norm and LM head): a cheap draft that needs no second checkpoint."""
    if name.startswith("self:"):
      n = int(name[5:]) if name[5:].isdigit() else 0
      if not 0 < n < target.config.num_hidden_layers:
        raise ConfigError(f"draft_model={name!r}: N must be between 1 and {target.config.num_hidden_layers - 1}")
      keep = select_tensors(target.tensors, lambda k: not k.startswith("model.layers.") or int(k.split(".")[2]) < n)
      layer_types = target.config.layer_types[:n] if target.config.layer_types else None
      return self._build_model(dataclasses.replace(target.config, num_hidden_layers=n, layer_types=layer_types), keep, dtype)
    draft = load_checkpoint(name)
    draft_tok = load_tokenizer(draft.path)
    same = draft.config.vocab_size == target.config.vocab_size and draft_tok.vocab_size == tokenizer.vocab_size and \
      all(draft_tok.piece(i) == tokenizer.piece(i) for i in range(tokenizer.vocab_size))
    if not same:
      raise ConfigError(f"draft model {name} has a different vocabulary from the target "
                        f"({draft.config.vocab_size} vs {target.config.vocab_size} tokens or different token strings); "
                        f"speculative decoding needs the same tokenizer")
    return self._build_model(draft.config, draft.tensors, dtype)

  def _check_batch_invariant(self, dtype: str, hidden: int) -> None:
    """batch_invariant=True is a promise only the CPU device's cpu and portable kernels keep, in float32 (our C
    kernels compute each row as alone; tinygrad's own matmuls and reductions, used for other dtypes and on other
    devices, pick their summation order by shape, and the Metal shaders' GEMV and GEMM round differently)."""
    if self.device.split(":")[0] != "CPU" or self.kernel_backend not in ("cpu", "portable"):
      why = f"{self.device} with kernel_backend={self.kernel_backend!r}"
    elif dtype != "float32": why = f"dtype={dtype!r}"
    elif hidden % 8: why = f"hidden_size={hidden} (not a multiple of 8)"
    else: return
    raise ConfigError(f"batch_invariant=True is built and tested on the CPU device's cpu and portable kernels in float32, which "
                      f"compute each row as alone; {why} has kernels for one row and for many that round differently: "
                      f"use batch_invariant=False")

  def _blocks_from_memory(self, block_bytes: int, weight_bytes: int, max_model_len: int) -> int:
    """A share of the memory left after the weights (`coarse`), but no more than max_num_seqs full-length sequences."""
    available = available_memory()
    by_memory = coarse(int(self.config.kv_cache_memory_fraction * max(0, available - weight_bytes)) // block_bytes)
    by_need = self.config.max_num_seqs * -(-max_model_len // self.config.block_size)
    blocks = min(by_memory, by_need)
    if blocks < 2: raise ConfigError(f"not enough free memory for a KV cache ({available >> 20} MiB available); "
                                     f"set num_kv_blocks explicitly")
    return blocks

  # ---- requests ----

  def warm_up(self, progress: bool = True) -> int:
    """Capture every decode and prefill pass shape this engine's limits allow (`ModelRunner.warm_up_shapes`; with a
    draft model its own, whose catch-up passes beyond the budget are captured when met, and the verification's) before
    any request: a server's first request of each new batch size or prompt length otherwise waits while it is
    captured, and every running request with it. Returns how many shapes were captured. Only before the first request:
    its dummy passes write KV block 0, which a finished request may have left in the prefix cache."""
    if self.served: raise RuntimeError("warm_up runs before the first request (its dummy passes write KV block 0)")
    limits = (self.config.max_num_seqs, self.config.max_num_batched_tokens, self.max_model_len)
    runners = [(self.runner, self.runner.warm_up_shapes(*limits, verify_tokens=self.spec.k + 1 if self.spec else 0))]
    if self.spec: runners.append((self.spec.runner, self.spec.runner.warm_up_shapes(*limits)))
    before = [set(runner.replays) for runner, _ in runners]
    for run in tqdm([run for _, work in runners for run in work], desc="capturing pass shapes", disable=not progress, leave=False): run()
    return sum(len(set(runner.replays) - kept) for (runner, _), kept in zip(runners, before))

  def add_request(self, req: EngineRequest) -> None:
    """Queue a validated request: one sequence per completion, each with its own random stream."""
    if req.request_id in self.requests: raise ValueError(f"request id {req.request_id!r} is already in use")
    self.served = True
    params, seqs = req.params, []
    for i in range(params.n):
      seed = [params.seed, i] if params.seed is not None else self._seed_stream.integers(2**63)
      seqs.append(Sequence(req.request_id, i, req.prompt_token_ids, params, np.random.default_rng(seed), req.metrics,
                           req.grammar.new_state() if req.grammar is not None else None))
    self.requests[req.request_id] = seqs
    for seq in seqs: self.scheduler.add(seq)

  def abort(self, request_id: str, index: int | None = None, reason: str = "abort") -> None:
    """Finish a request's sequences (or only completion `index`) and free their blocks; unknown ids are ignored."""
    for seq in self.requests.get(request_id, ()):
      if index is None or seq.index == index: self._finish(seq, reason)
    self._forget_if_done(request_id)

  def has_unfinished(self) -> bool: return self.scheduler.has_unfinished()

  def stats(self) -> SchedulerStats:
    """Counts are of requests (a request with n completions is one): running if any of its sequences runs."""
    bm, sch = self.block_manager, self.scheduler
    running = {s.request_id for s in sch.running}
    waiting = ({s.request_id for s in sch.waiting} | set(sch.held)) - running
    return SchedulerStats(num_running=len(running), num_waiting=len(waiting), kv_cache_usage=(bm.num_blocks - bm.num_free) / bm.num_blocks)

  # ---- the step ----

  def step(self) -> tuple[list[CoreOutput], SchedulerStats]:
    """One target forward pass over the scheduled batch (with speculation: preceded by the draft's passes).
    Returns what happened to every sequence it advanced, and the scheduler's state afterwards."""
    counters_before = self._counters()
    run, self.in_flight = self.in_flight, None   # a pipelined run the last step launched: this step reads it
    if run is not None and all(s.is_finished for s in run.sched.decodes): run = None   # all ended or aborted: nothing to read
    if run is not None: sched, steps = run.sched, run.run.steps
    else:
      sched = self.scheduler.schedule()
      if self.spec:
        for seq in sched.preempted: self.spec.release(seq)   # a preempted sequence recomputes both caches
      if sched.is_empty:
        if self.scheduler.has_unfinished(): raise RuntimeError("scheduler made no progress with requests waiting")
        return [], self.stats()
      steps = self._decode_steps(sched)
    started = time.perf_counter()
    for seq in sched.decodes + [c.seq for c in sched.prefills]:
      if seq.metrics.first_scheduled_time is None: seq.metrics.first_scheduled_time = time.time()
    outputs: dict[Sequence, CoreOutput] = {}
    try:
      if run is not None: sampled, drafted, accepted = self._read_run(run), 0, 0
      else: sampled, drafted, accepted = self._run_and_sample(sched, outputs, steps)
    except Exception as e:   # the model pass itself failed: every sequence it carried fails, the rest go on
      self.in_flight = None   # a run launched after it carries the same sequences
      carried = [s for s in sched.decodes + [c.seq for c in sched.prefills] if not s.is_finished]
      self.failures.record("model pass", e, [seq.request_id for seq in carried])
      for seq in carried: self._fail(seq, e, outputs)
      return self._collect(outputs), dataclasses.replace(self.stats(), num_decode_passes=steps)
    # slots a decode keeps beyond its newest token: those of the pipelined run just launched
    ahead = self.in_flight.run.steps - 1 if self.in_flight is not None else 0
    kept, failed = self.scheduler.update_from_output(sched, sampled, ahead)
    for seq, error in failed.items():
      self.failures.record("committing sampled tokens", error, [seq.request_id])
      self._fail(seq, error, outputs)
    for seq, tokens in kept.items():
      if seq.finish_reason == "error": continue   # a sibling's commit failed: the request failed with it
      out = outputs.setdefault(seq, CoreOutput(seq.request_id, seq.index))
      out.new_token_ids = tokens
      if out.new_logprobs is not None: out.new_logprobs = out.new_logprobs[:len(tokens)]
      out.finish_reason, out.stop_reason = seq.finish_reason, seq.stop_reason
      if seq.is_finished: self._forget_if_done(seq.request_id)
      if self.spec:
        if seq.is_finished: self.spec.release(seq)
        else: self.spec.rollback(seq, seq.num_computed_tokens)
    if self.spec and sched.decodes and not sched.prefills:   # a step that also prefilled says nothing about either cost
      seconds, n = time.perf_counter() - started, len(sched.decodes)
      if drafted: self.spec.policy.record_spec(n, drafted, accepted, seconds)
      else: self.spec.policy.record_plain(n, seconds)
    stats = self.stats()
    stats.num_preemptions, stats.prefix_cache_queries, stats.prefix_cache_hits = \
      (now - before for now, before in zip(self._counters(), counters_before))
    stats.num_draft_tokens, stats.num_accepted_tokens, stats.num_decode_passes = drafted, accepted, steps
    return self._collect(outputs), stats

  def _counters(self) -> tuple[int, int, int]:
    s = self.scheduler
    return s.num_preemptions, s.prefix_cache_queries, s.prefix_cache_hits

  def _run_and_sample(self, sched: SchedulerOutput, outputs: dict[Sequence, CoreOutput], steps: int = 1):
    """The model passes, then a token (or a verified run) per sequence. A sequence whose sampling raises fails
    alone. `steps` > 1: the decodes' passes of a multi-step run (`_decode_steps`). Returns (new tokens per sequence,
    drafts proposed, drafts accepted)."""
    if steps > 1 or self._pipelines(sched):   # multi-step: passes back to back, the tokens fed back on the device
      run = InFlight(SchedulerOutput(decodes=list(sched.decodes)), self.runner.launch_decodes([self._decode_item(s) for s in sched.decodes], steps))
      return self._read_run(run), 0, 0
    decodes, speculated, proposals = sched.decodes, [], []
    if self.spec and decodes and self.spec.policy.should_speculate(len(decodes)):
      # a run of k drafts must fit the context: sequences near max_model_len decode plainly in the same step
      fits = [s for s in decodes if s.num_tokens + self.spec.k <= self.max_model_len]
      proposals = self.spec.propose(fits, self._processed) or [] if fits else []
      if proposals: decodes, speculated = [s for s in decodes if s not in fits], fits
    want_prompt_logprobs = any(self._wants_prompt_logprobs(c.seq) for c in sched.prefills)
    # structured output: the masks of the tokens sampled this step, computed while the model runs when it pays (MaskPolicy)
    pending = self.masks.start([s.grammar for s in decodes if s.grammar] +
                               [c.seq.grammar for c in sched.prefills if c.completes_prompt and c.seq.grammar])
    # on a GPU, decodes that only need their argmax get it from the device instead of their logits (ModelRunner.argmax_on_device)
    argmax = bool(decodes) and self.runner.argmax_on_device and all(self._argmax_only(s) for s in decodes)
    try:
      decode_out, prefill_logits, verify_logits = self.runner.execute(
        [self._decode_item(s) for s in decodes],
        [WorkItem(c.seq.block_table, c.seq.num_computed_tokens, c.seq.token_ids[c.seq.num_computed_tokens:c.seq.num_computed_tokens + c.num_tokens])
         for c in sched.prefills],
        [WorkItem(s.block_table, s.num_computed_tokens, s.token_ids[-1:] + p.drafts) for s, p in zip(speculated, proposals)],
        prefill_all_logits=want_prompt_logprobs, decode_argmax=argmax)
    finally: pending.wait()   # even when the pass failed: the worker must be done with the matchers
    sampled: dict[Sequence, list[int]] = {}
    drafted = accepted = 0
    if argmax:
      for seq, out in zip(decodes, decode_out):
        seq.metrics.num_target_steps += 1
        sampled[seq] = [int(out)]
    else: self._sample_rows(decodes, decode_out, pending, outputs, sampled)
    for chunk, logits in zip(sched.prefills, prefill_logits):
      rows = logits if want_prompt_logprobs else logits[None]     # every slot of the chunk, or its last
      def sample_chunk(chunk=chunk, rows=rows):
        if self._wants_prompt_logprobs(chunk.seq): self._prompt_logprobs(chunk.seq, chunk.seq.num_computed_tokens, rows, outputs)
        if chunk.completes_prompt:
          self._sample(chunk.seq, rows[-1:], outputs, sampled, chunk.seq.grammar and pending.bias(chunk.seq.grammar))
      self._guarded(chunk.seq, outputs, sample_chunk)
    for seq, proposal, logits in zip(speculated, proposals, verify_logits):
      drafted += len(proposal.drafts)
      self._guarded(seq, outputs, lambda: self._verify(seq, proposal, logits, outputs, sampled))
      accepted += max(0, len(sampled.get(seq, ())) - 1)
    return sampled, drafted, accepted

  def _pipelines(self, sched: SchedulerOutput) -> bool:
    """Does this step's run start a pipeline: decodes alone, each taking the argmax of its raw logits?"""
    return self.pipelined and bool(sched.decodes) and not sched.prefills and all(self._argmax_only(s) for s in sched.decodes)

  def _read_run(self, run: InFlight) -> dict[Sequence, list[int]]:
    """Launch the run after `run` (`_follow`), then wait for `run`'s tokens: the new tokens of each of its sequences
    still running. A follow-up that fails to launch is logged and dropped: `run` is read as if there were none."""
    try: self.in_flight = self._follow(run)
    except Exception as e:
      self.in_flight = None   # the commit gives its reserved slots back (no slots ahead)
      self.failures.record("launching the next decode run (its requests go on)", e, [s.request_id for s in run.sched.decodes])
    tokens = self.runner.read_decodes(run.run)
    sampled = {}
    for seq, row in zip(run.sched.decodes, tokens):
      if seq.is_finished: continue   # aborted while its run was in flight
      seq.metrics.num_target_steps += run.run.steps
      sampled[seq] = row.tolist()
    return sampled

  def _follow(self, run: InFlight) -> InFlight | None:
    """With async scheduling, the run after `run`, launched before `run` is read: its first pass reads the sequences'
    tokens from the device. Over `run`'s sequences still running, less those `run` ends (their max_tokens or
    max_model_len reached), while that leaves the pass its shape (the token history is the shape's), nothing could
    be admitted (`Scheduler.can_admit`), no other sequence runs and the pool has room without preempting anyone;
    else None, and the next step schedules afresh once `run` is committed. Passes as `_decode_steps` gives them,
    counting `run`'s tokens as taken."""
    seqs, sch, ahead = run.sched.decodes, self.scheduler, run.run.steps
    if not self.pipelined or sch.can_admit(): return None
    live = [s for s in seqs if not s.is_finished]   # an abort while it ran
    if len(sch.running) != len(live) or any(not self._argmax_only(s) for s in live): return None
    keep = [s for s in live if self._tokens_left(s, ahead) > 0 and self._room_left(s, ahead) > 0]
    if not keep: return None
    steps = min(self.config.num_scheduler_steps, max(self._tokens_left(s, ahead) for s in keep),
                min(self._room_left(s, ahead) for s in keep))
    items = [WorkItem(s.block_table, s.num_computed_tokens + ahead, [0]) for s in keep]   # the token: from the device
    if self.runner.decode_shape(items) != run.run.shape or not sch.reserve(keep, ahead + steps - 1): return None
    rows = [seqs.index(s) for s in keep]   # each one's row in `run`
    return InFlight(SchedulerOutput(decodes=keep), self.runner.launch_decodes(items, steps, after=run.run, rows=rows))

  @staticmethod
  def _decode_item(seq: Sequence) -> WorkItem:
    """A decode's work: its newest token, at the first position without K/V."""
    return WorkItem(seq.block_table, seq.num_computed_tokens, seq.token_ids[-1:])

  def _decode_steps(self, sched: SchedulerOutput) -> int:
    """The passes this step runs back to back (num_scheduler_steps): more than one only for a step of decodes alone
    whose every sequence takes the argmax of its raw logits, no more than the longest of them may still take before
    max_tokens, none taking a token past max_model_len, and with room in the KV pool for them all."""
    steps = self.config.num_scheduler_steps
    if steps == 1 or sched.prefills or not all(self._argmax_only(s) for s in sched.decodes): return 1
    steps = min(steps, max(self._tokens_left(s) for s in sched.decodes), min(self._room_left(s) for s in sched.decodes))
    return self.scheduler.reserve_steps(sched.decodes, steps) if steps > 1 else 1

  def _tokens_left(self, seq: Sequence, ahead: int = 0) -> int:
    """Tokens seq may still take before max_tokens once `ahead` more are taken (without one: num_scheduler_steps)."""
    return seq.params.max_tokens - seq.num_output_tokens - ahead if seq.params.max_tokens is not None else self.config.num_scheduler_steps

  def _room_left(self, seq: Sequence, ahead: int = 0) -> int:
    """Tokens seq may still take before max_model_len once `ahead` more are taken."""
    return self.max_model_len - seq.num_tokens - ahead

  @staticmethod
  def _argmax_only(seq: Sequence) -> bool:
    """Is seq's next token the argmax of its raw logits, nothing else read from them: greedy, no penalty, bias, grammar
    or min_tokens ban (`_penalized`'s), no logprobs?"""
    p = seq.params
    return p.greedy and p.logprobs is None and seq.grammar is None and not sampler.penalizes(p) and seq.num_output_tokens >= p.min_tokens

  def _guarded(self, seq: Sequence, outputs: dict[Sequence, CoreOutput], fn) -> None:
    try: fn()
    except Exception as e: self._sampling_failed(seq, e, outputs)

  def _sampling_failed(self, seq: Sequence, error: Exception, outputs) -> None:
    self.failures.record("sampling", error, [seq.request_id])
    self._fail(seq, error, outputs)

  def _sample(self, seq: Sequence, logits: np.ndarray, outputs, sampled, mask: np.ndarray | None = None) -> None:
    """One token from logits `[1, V]` at the sequence's newest token; `mask`: the grammar's bias row (structured
    output: -inf for the tokens it does not allow there), applied first, so penalties, sampling and logprobs all
    see it."""
    seq.metrics.num_target_steps += 1
    token, logprobs = self._draw(seq, logits, mask)
    self._record(seq, [token], logprobs, outputs, sampled)

  def _draw(self, seq: Sequence, logits: np.ndarray, mask: np.ndarray | None) -> tuple[int, list | None]:
    """`_sample`'s token and its logprobs entry (when asked for), without touching anything shared: rows of one step
    are drawn on several threads, each with its own sequence's generator."""
    if mask is not None: logits = apply_bias(logits, mask)
    token = sampler.sample(self._penalized(seq, logits[0]), seq.params, seq.generator)
    return token, self._logprobs(seq, logits, [token])

  def _sample_rows(self, seqs: list[Sequence], rows: np.ndarray, pending, outputs, sampled) -> None:
    """`_sample` for each decode of a step (`pending`: the step's grammar masks, computed by now): rows of a large
    vocabulary on the sampling threads (a 128k-token row costs 0.3-1.5 ms), the tokens and logprobs those of drawing one
    row after another. A row whose draw raises fails its own request."""
    def draw(i: int):
      seq = seqs[i]
      try: return self._draw(seq, rows[i][None], seq.grammar and pending.bias(seq.grammar)), None
      except Exception as e: return None, e
    parallel = self.sampling_threads is not None and len(seqs) > 1 and rows.shape[-1] >= PARALLEL_SAMPLING_VOCAB
    drawn = list(self.sampling_threads.map(draw, range(len(seqs))) if parallel else map(draw, range(len(seqs))))
    for seq, (result, error) in zip(seqs, drawn):
      seq.metrics.num_target_steps += 1
      if error is not None: self._sampling_failed(seq, error, outputs)
      else: self._record(seq, [result[0]], result[1], outputs, sampled)

  def _verify(self, seq: Sequence, proposal, logits: np.ndarray, outputs, sampled) -> None:
    """Check one speculated run: logits `[k+1, V]` are the target's at the last token and at each draft."""
    drafts, k = proposal.drafts, len(proposal.drafts)
    if seq.grammar is not None:   # row i under the mask after drafts[:i]: the ones the draft sampled under, plus the last
      logits = np.stack([apply_bias(logits[i], seq.grammar.mask_after(drafts[:i])) for i in range(k + 1)])
    processed = [self._penalized(seq, logits[i], drafts[:i]) for i in range(k + 1)]
    if seq.params.greedy:
      tokens = sampler.speculative_accept_greedy([int(np.argmax(x)) for x in processed], drafts)
    else:
      p = np.stack([sampler.probabilities(x, seq.params) for x in processed])
      tokens = sampler.speculative_accept(p, proposal.q, drafts, seq.generator)
    m = seq.metrics
    m.num_draft_tokens, m.num_accepted_tokens, m.num_target_steps = m.num_draft_tokens + k, m.num_accepted_tokens + len(tokens) - 1, m.num_target_steps + 1
    self._record(seq, tokens, self._logprobs(seq, logits, tokens), outputs, sampled)

  @staticmethod
  def _logprobs(seq: Sequence, logits: np.ndarray, tokens: list[int]) -> list | None:
    """The logprobs entries of the sampled tokens (row i of `logits` produced token i), when the request asks for them."""
    return sampler.token_logprobs(logits[:len(tokens)], tokens, seq.params.logprobs) if seq.params.logprobs is not None else None

  def _record(self, seq: Sequence, tokens: list[int], logprobs: list | None, outputs, sampled) -> None:
    """The sampled tokens and, when asked for, their logprobs entries (`sampler.token_logprobs`)."""
    sampled[seq] = tokens
    if logprobs is not None: outputs.setdefault(seq, CoreOutput(seq.request_id, seq.index)).new_logprobs = logprobs

  @staticmethod
  def _wants_prompt_logprobs(seq: Sequence) -> bool:
    return seq.params.prompt_logprobs is not None and seq.index == 0 and seq.num_prompt_logprobs_sent < seq.num_prompt_tokens - 1

  def _prompt_logprobs(self, seq: Sequence, start: int, logits: np.ndarray, outputs) -> None:
    """Logprobs of prompt tokens start+1 .. from the logits at positions start ..: row i predicts token start+i+1."""
    first = max(start + 1, seq.num_prompt_logprobs_sent + 1)   # the first position not sent yet
    last = min(start + len(logits), seq.num_prompt_tokens - 1)
    if first > last: return
    entries: list[TopLogprobs] = sampler.token_logprobs(logits[first - start - 1:last - start], seq.token_ids[first:last + 1], seq.params.prompt_logprobs)
    seq.num_prompt_logprobs_sent = last
    outputs.setdefault(seq, CoreOutput(seq.request_id, seq.index)).prompt_logprobs = entries

  def _penalized(self, seq: Sequence, logits: np.ndarray, extra: list[int] = ()) -> np.ndarray:
    """Logits after penalties and logit bias, as if `extra` tokens had already been appended to seq."""
    p = seq.params
    banned = sorted(self.scheduler.eos_token_ids | set(p.stop_token_ids or [])) \
      if seq.num_output_tokens + len(extra) < p.min_tokens else None
    counts = None
    if sampler.counts_tokens(p):
      if seq.token_counts is None: seq.token_counts = sampler.TokenCounts(logits.shape[-1], seq.num_prompt_tokens)
      counts = seq.token_counts.update(seq.token_ids)
    out = sampler.apply_penalties(logits, counts, p, extra, banned)
    if banned and seq.grammar is not None and not np.isfinite(out).any():
      # a complete grammar allows only EOS: the grammar wins over min_tokens (all -inf would sample nothing)
      out = sampler.apply_penalties(logits, counts, p, extra)
    return out

  def _processed(self, seq: Sequence, logits: np.ndarray, extra: list[int] = ()) -> np.ndarray:
    """What the draft model samples from: its logits under the grammar's mask after `extra` (the drafts so far),
    then penalized as the target's will be."""
    if seq.grammar is not None: logits = apply_bias(logits, seq.grammar.mask_after(list(extra)))
    return self._penalized(seq, logits, extra)

  # ---- finishing ----

  def _fail(self, seq: Sequence, error: Exception, outputs: dict[Sequence, CoreOutput]) -> None:
    """Fail seq's whole request: a request is one unit for its caller, whatever failed in it."""
    message = f"{type(error).__name__}: {error}"
    for s in self.requests.get(seq.request_id, [seq]):
      if s.is_finished and s is not seq: continue   # failed already, or finished in an earlier step
      self._finish(s, "error")
      outputs[s] = CoreOutput(s.request_id, s.index, finish_reason="error", error=message)
    self._forget_if_done(seq.request_id)

  def _finish(self, seq: Sequence, reason: str) -> None:
    """Finish a sequence (the commit point may have finished it already) and let its draft cache go."""
    if not seq.is_finished: self.scheduler.finish(seq, reason)
    if self.spec: self.spec.release(seq)

  def _forget_if_done(self, request_id: str) -> None:
    if all(s.is_finished for s in self.requests.get(request_id, ())): self.requests.pop(request_id, None)

  @staticmethod
  def _collect(outputs: dict[Sequence, CoreOutput]) -> list[CoreOutput]: return list(outputs.values())
