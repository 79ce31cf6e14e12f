"""Timed runs of tinyvllm's engine (an `LLMEngine` in this thread, so each step is timed alone), driven through its
public surface (`add_request`, `step`, `abort_request`) and read through its scheduler's sequences.

Every step is timed and its work recorded as `(cached, new)` tokens per sequence, read from the sequences'
`num_computed_tokens` before and after it, so the byte and FLOP accounting follows what the engine really did
(chunked prefill, speculative verification) rather than what was asked for.
"""
from __future__ import annotations
import itertools, time
from collections import deque
from dataclasses import dataclass, field
import numpy as np
from tinyvllm.bench.accounting import TensorInfo, Traffic, step_traffic
from tinyvllm.bench.device import runs_nothing
from tinyvllm.engine.sequence import SequenceStatus
from tinyvllm.outputs import GenerationError
from tinyvllm.sampling_params import RequestOutputKind, SamplingParams


def model_tensors(model) -> list[TensorInfo]:
  """Every device tensor the model reads, with HF-style names: each layer's `weights` dict (packed codes, scales and
  biases included when quantized), then the model's own tensor attributes (embedding, norm, LM head, and whatever
  quantization adds beside them). The RoPE table is left out (a few rows are read per token); a tensor held
  twice (a tied LM head) is listed once."""
  from tinygrad import Tensor
  from tinyvllm.quant.formats import PARTS, LinearWeights
  out, seen = [], set()

  def add(name: str, t: Tensor):
    if id(t) in seen: return
    seen.add(id(t))
    out.append(TensorInfo(name, tuple(int(s) for s in t.shape), int(t.nbytes())))

  for i, layer in enumerate(model.layers):
    for name, t in layer.weights.items(): add(f"model.layers.{i}.{name}", t)
  for attr, val in vars(model).items():
    if isinstance(val, LinearWeights): items = [(part, getattr(val, part)) for part in PARTS]
    else: items = val.items() if isinstance(val, dict) else [("weight", val)]
    for suffix, t in items:
      if not isinstance(t, Tensor) or attr.startswith("cos_sin"): continue   # RoPE tables, not weights
      if attr.startswith("embed"): add(f"model.embed_tokens.{suffix}" if attr == "embed_tokens" else f"model.embed_tokens.{attr}", t)
      elif attr.startswith("lm_head"): add(f"lm_head.{suffix}" if attr == "lm_head" else f"lm_head.{attr}", t)
      else: add(f"model.{attr}.{suffix}", t)
  return out


def random_ids(rng: np.random.Generator, vocab: int, shape) -> np.ndarray:
  """Random token ids, skipping the lowest ids (where tokenizers keep their special tokens)."""
  return rng.integers(min(100, vocab // 4), vocab, shape)


@dataclass
class StepLog:
  """Wall time and accounted traffic of the steps taken through `run_step`, and where the time went: in kernels,
  of which the calling thread spent `pool_wait_seconds` waiting for the thread pool's workers at the ends of
  parallel regions, and in copies between devices (tensor parallelism). The rest of a step is host time.

  On a GPU kernels run while the host goes on: `wait_seconds` is the time the host waited for the GPU at the end of
  each pass, and `device_seconds` the GPU's own time over `profiled_tokens` tokens of separate, profiled steps (each
  call waits for the GPU and is timed by it)."""
  seconds: float = 0.0
  steps: int = 0
  traffic: Traffic = field(default_factory=Traffic)
  kernels: int = 0
  kernel_seconds: float = 0.0
  copy_seconds: float = 0.0
  pool_wait_seconds: float = 0.0
  wait_seconds: float = 0.0
  device_seconds: float = 0.0
  profiled_tokens: int = 0

  def time_split(self, tokens: int, gpu: bool = False) -> dict[str, float]:
    """Milliseconds per token. CPU: compute (kernels minus the pool's waits), synchronization (those waits plus copies
    between devices) and host (Python: scheduling, inputs, sampling, output; launches). GPU: host (everything but the
    wait for the GPU; launches included), of it launches, the wait for the GPU, and the GPU's busy time (profiled)."""
    ms = lambda sec, n=tokens: 1e3 * sec / max(n, 1)
    per_step = {"kernels_per_step": self.kernels / max(self.steps, 1)}
    if gpu:
      return per_step | {"host_ms": ms(self.seconds - self.wait_seconds), "launch_ms": ms(self.kernel_seconds), "gpu_wait_ms": ms(self.wait_seconds),
              "gpu_ms": ms(self.device_seconds, self.profiled_tokens) if self.profiled_tokens else None}
    return per_step | {"compute_ms": ms(self.kernel_seconds - self.pool_wait_seconds), "sync_ms": ms(self.pool_wait_seconds + self.copy_seconds),
            "thread_pool_wait_ms": ms(self.pool_wait_seconds), "device_copies_ms": ms(self.copy_seconds),
            "host_ms": ms(self.seconds - self.kernel_seconds - self.copy_seconds)}


# Prose for `--prompts text` (written for this benchmark). Random tokens are the default: the same for every model,
# but a draft model rarely agrees with the target on them, so speculative runs also want real text.
TEXT = ("The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a can of oil and a cloth. "
        "From the lamp room he could see the harbour, the fishing boats coming home, and the long line of cliffs that "
        "ran north towards the next village. In winter the storms came from the west, and the waves broke so high "
        "against the rocks that the spray reached the windows. He kept a logbook of every ship that passed, the "
        "weather, the state of the sea and the hour the lamp was lit. Over thirty years the book grew into a shelf "
        "of volumes, and the people of the town came to read them when they wanted to know what the sea had been "
        "like on the day a grandfather was born or a boat was lost. When he retired, the light was automated, but "
        "the town asked him to keep writing, and he did, from a small house at the foot of the cliff.")


class Driver:
  """Steps an LLMEngine, timing each step and accounting its traffic. Prompts are random token ids, or with
  `text=True` windows of TEXT (tiled when longer) starting at a random token."""
  def __init__(self, engine, text: bool = False):
    self.engine = engine
    self._ids = itertools.count()
    self.text_ids = engine.tokenizer.encode(TEXT, add_special_tokens=False) if text else None
    model = engine.runner.model
    self.cfg = model.cfg
    self.tensors = model_tensors(model)
    self.dtype_bytes = model.dtype.itemsize       # activations are in the model dtype; the KV cache in its own format
    self.kv_vector_bytes = engine.runner.kv_format.bytes_per_head_vector(self.cfg.head_dim)
    self.times = engine.runner.launch_times
    self.times.enabled = True    # two clock reads per kernel launch, ~5 us a step: the time split of every record
    self.pools = model.kernels.thread_pools   # the target model's, one per device with tensor parallelism
    self.gpu = engine.runner.kind != "CPU"     # kernels run asynchronously: split into host, wait and GPU time
    self.timed_by_gpu = self.gpu and not runs_nothing(engine.runner.kind)   # profiled steps

  def live(self) -> list:
    sch = self.engine.scheduler
    return list(sch.running) + list(sch.waiting)

  def add(self, prompt: list[int], params: SamplingParams) -> str:
    rid = str(next(self._ids))
    return self.engine.add_request(rid, prompt, params)

  def unfinished(self, rid: str) -> bool: return rid in self.engine.output_processor.requests

  def run_step(self, log: StepLog | None = None) -> list:
    before = {id(s): (s, s.num_computed_tokens) for s in self.live()}
    launched, kernels, copies, wait, gpu_wait = self.times.kernels, self.times.kernel_seconds, self.times.copy_seconds, self.pool_wait(), self.times.wait_seconds
    t = time.perf_counter()
    outs = self.engine.step()
    dt = time.perf_counter() - t
    if failed := [o for o in outs if o.error]: raise GenerationError(failed, outs)   # never time a step that failed
    if log is not None:
      work = [(c, s.num_computed_tokens - c) for s, c in before.values() if s.num_computed_tokens > c]
      log.seconds += dt
      log.steps += 1
      log.kernels += self.times.kernels - launched
      log.kernel_seconds += self.times.kernel_seconds - kernels
      log.copy_seconds += self.times.copy_seconds - copies
      log.pool_wait_seconds += self.pool_wait() - wait
      log.wait_seconds += self.times.wait_seconds - gpu_wait
      # a multi-step run's passes each read the weights: one pass's traffic per token of each sequence
      passes = self.engine.last_stats[0].num_decode_passes
      for i in range(passes):
        pass_work = [(c + i, 1) for c, _ in work] if passes > 1 else work
        if pass_work: log.traffic = log.traffic + step_traffic(self.cfg, self.tensors, pass_work, self.kv_vector_bytes, self.dtype_bytes)
    return outs

  def pool_wait(self) -> float: return sum(pool.stats()[1] for pool in self.pools)

  def profiled_step(self) -> float:
    """One step whose every call waits for the GPU and is timed by it; returns the GPU's busy seconds. Not timed
    otherwise: waiting serializes host and GPU."""
    device = self.times.device_seconds
    self.times.profile = True
    try: self.run_step()
    finally: self.times.profile = False
    return self.times.device_seconds - device

  def prompt(self, rng: np.random.Generator, n: int) -> list[int]:
    if self.text_ids:
      start = int(rng.integers(len(self.text_ids)))
      return [self.text_ids[(start + i) % len(self.text_ids)] for i in range(n)]
    return random_ids(rng, self.cfg.vocab_size, n).tolist()

  def finish_all(self, request_ids) -> None:
    for rid in request_ids: self.engine.abort_request(rid)


def median_repeat(repeats: list, rate):
  """The repeat with the median `rate(repeat)` (the upper median of an even count)."""
  return sorted(repeats, key=rate)[len(repeats) // 2]


def _median_run(runs: list[tuple[float, int, int]]) -> tuple[float, int, int]:
  """The (seconds, tokens, steps) of the repeat with the median tokens/s."""
  return median_repeat(runs, lambda r: r[1] / r[0])


def decode_run(drv: Driver, batch: int, context: int, steps: int, warmup: int, rng, max_tokens: int,
               repeats: int = 1) -> dict:
  """`batch` requests with `context`-token prompts; prefill them all, warm up, then time `steps` decode steps,
  `repeats` times in a row (reported: the median repeat, and every repeat's tok/s)."""
  # FINAL_ONLY: what LLM.generate asks for (no output snapshot per step); the steps' outputs are only checked for errors
  params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)
  ids = [drv.add(drv.prompt(rng, context), params) for _ in range(batch)]
  seqs = [s for rid in ids for s in drv.engine.core.requests[rid]]
  while any(s.is_prefilling or s.status is SequenceStatus.WAITING for s in seqs): drv.run_step()
  for _ in range(warmup): drv.run_step()
  first_tokens = [s.num_tokens for s in seqs]
  log, runs = StepLog(), []
  for _ in range(repeats):
    start_tokens, start_seconds = [s.num_tokens for s in seqs], log.seconds
    for _ in range(steps): drv.run_step(log)
    runs.append((log.seconds - start_seconds, sum(s.num_tokens - n for s, n in zip(seqs, start_tokens)), steps))
  if drv.timed_by_gpu:
    for _ in range(2):
      before = sum(s.num_tokens for s in seqs)
      log.device_seconds += drv.profiled_step()
      log.profiled_tokens += sum(s.num_tokens for s in seqs) - before
  finished_early = sum(s.is_finished for s in seqs)
  drv.finish_all(ids)
  seconds, tokens, n = _median_run(runs)
  return {"kind": "decode", "batch_size": batch, "context_len": context,
          "mean_context_len": float(np.mean([(a + s.num_tokens - 1) / 2 for s, a in zip(seqs, first_tokens)])),
          "steps": log.steps, "seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds,
          "ms_per_step": 1e3 * seconds / n, "tokens_per_step": tokens / n,
          "tokens_per_s_repeats": [t / sec for sec, t, _ in runs], "finished_early": finished_early, "traffic": log.traffic,
          "time_per_token": log.time_split(sum(t for _, t, _ in runs), drv.gpu)}


def prefill_run(drv: Driver, prompt_len: int, rng, repeats: int = 1) -> dict:
  """Time prompts from admission to their first token, `repeats` times; a first prompt of the same length,
  not timed, captures the shapes."""
  params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)
  log, runs = StepLog(), []
  for i in range(1 + repeats):
    start_seconds, start_steps = log.seconds, log.steps
    rid = drv.add(drv.prompt(rng, prompt_len), params)
    while drv.unfinished(rid): drv.run_step(log if i else None)
    if i: runs.append((log.seconds - start_seconds, prompt_len, log.steps - start_steps))
  if drv.timed_by_gpu:   # one more prompt, profiled step by step
    rid = drv.add(drv.prompt(rng, prompt_len), params)
    while drv.unfinished(rid): log.device_seconds += drv.profiled_step()
    log.profiled_tokens += prompt_len
  seconds, tokens, n = _median_run(runs)
  return {"kind": "prefill", "batch_size": 1, "context_len": prompt_len, "mean_context_len": prompt_len / 2,
          "steps": log.steps, "seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds,
          "ms_per_step": 1e3 * seconds / n, "tokens_per_step": tokens / n,
          "tokens_per_s_repeats": [t / sec for sec, t, _ in runs], "traffic": log.traffic,
          "time_per_token": log.time_split(prompt_len * repeats, drv.gpu)}


@dataclass(frozen=True)
class Workload:
  """Poisson arrivals with prompt and output lengths drawn uniformly from the given ranges."""
  num_requests: int
  rate: float                      # requests per second
  prompt_lens: tuple[int, int]     # inclusive range
  output_lens: tuple[int, int]

  def draw(self, rng) -> list[tuple[float, int, int]]:
    """[(arrival seconds, prompt length, output length)] in arrival order."""
    arrivals = np.cumsum(rng.exponential(1 / self.rate, self.num_requests))
    prompts = rng.integers(self.prompt_lens[0], self.prompt_lens[1] + 1, self.num_requests)
    outputs = rng.integers(self.output_lens[0], self.output_lens[1] + 1, self.num_requests)
    return [(float(a), int(p), int(o)) for a, p, o in zip(arrivals, prompts, outputs)]


def serving_run(drv: Driver, workload: Workload, rng) -> dict:
  """Replay the workload in real time: requests join as they arrive (continuous batching). TTFT counts from the
  scheduled arrival, inter-token latency between consecutive tokens of one request."""
  requests = [(a, drv.prompt(rng, p), o) for a, p, o in workload.draw(rng)]
  pending = deque(requests)
  arrival, times, counts = {}, {}, {}
  log, peak_batch = StepLog(), 0
  shapes_before = len(drv.engine.runner.replays)
  start = time.perf_counter()
  while pending or drv.engine.has_unfinished_requests():
    now = time.perf_counter() - start
    while pending and pending[0][0] <= now:
      at, prompt, out_len = pending.popleft()
      rid = drv.add(prompt, SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True))
      arrival[rid], times[rid], counts[rid] = start + at, [], 0
    if not drv.engine.has_unfinished_requests():
      time.sleep(max(0.0, pending[0][0] - (time.perf_counter() - start)))
      continue
    peak_batch = max(peak_batch, len(drv.engine.scheduler.running) + len(drv.engine.scheduler.waiting))
    outs = drv.run_step(log)
    t = time.perf_counter()
    for out in outs:
      n = len(out.outputs[0].token_ids)
      times[out.request_id] += [t] * (n - counts[out.request_id])
      counts[out.request_id] = n
  wall = time.perf_counter() - start
  ttft = [times[r][0] - arrival[r] for r in times if times[r]]
  itl = [b - a for r in times for a, b in zip(times[r], times[r][1:])]
  generated = sum(counts.values())
  pct = lambda xs, q: float(np.percentile(xs, q)) * 1e3 if xs else None
  return {"kind": "serving", "batch_size": peak_batch,
          "context_len": int(np.mean([len(p) for _, p, _ in requests])), "mean_context_len": None,
          "num_requests": workload.num_requests, "request_rate": workload.rate,
          "prompt_lens": list(workload.prompt_lens), "output_lens": list(workload.output_lens),
          "steps": log.steps, "seconds": wall, "busy_seconds": log.seconds, "tokens": generated,
          "tokens_per_s": generated / wall, "ms_per_step": 1e3 * log.seconds / max(1, log.steps),
          "tokens_per_step": generated / max(1, log.steps),
          "ttft_p50_ms": pct(ttft, 50), "ttft_p99_ms": pct(ttft, 99), "itl_p50_ms": pct(itl, 50), "itl_p99_ms": pct(itl, 99),
          "shapes_captured_while_timed": len(drv.engine.runner.replays) - shapes_before, "traffic": log.traffic}
