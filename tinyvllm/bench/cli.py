"""`python -m tinyvllm.bench`: tok/s and the fraction of the memory-bandwidth roofline, on this machine.

Measures the device's ceilings, then decode at each batch size x context length, prefill at each prompt
length and a serving scenario (Poisson arrivals, continuous batching), and the same decode and prefill
runs in installed peers (transformers, llama.cpp). Prints a table; --json writes one record per run,
--plot a roofline chart.
"""
from __future__ import annotations
import argparse, gc, logging, shlex, sys
from pathlib import Path
import numpy as np
from tqdm import tqdm
from tinyvllm.config import CAPTURE_MODES, KV_CACHE_DTYPES
from tinyvllm.entrypoints.engine_args import add_engine_args, engine_kwargs
from tinyvllm.model.weights import resolve_model

RUN_KINDS = {"decode", "prefill", "serving"}
DEFAULTS_NOTE = ("The defaults (decode at batch 1 and 8 with 128-token prompts, 32 timed steps; prefill of 128 and 512 "
                 "tokens; 8 serving requests) finish in about 5 minutes on a 2-core x86 CPU with the default model, "
                 "transformers and llama.cpp included; on a Mac in less. Larger grids take longer: decode at batch B "
                 "and context L first prefills B x L tokens.")


def _ints(s: str) -> list[int]:
  try: vals = [int(x) for x in s.split(",") if x.strip()]
  except ValueError: raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from None
  if any(v < 1 for v in vals): raise argparse.ArgumentTypeError(f"values must be positive, got {s!r}")
  if not vals: raise argparse.ArgumentTypeError("expected at least one value (leave a kind of run out with --runs)")
  return vals


def _count(least: int):
  """An integer of at least `least`."""
  def parse(s: str) -> int:
    try: v = int(s)
    except ValueError: raise argparse.ArgumentTypeError(f"expected an integer, got {s!r}") from None
    if v < least: raise argparse.ArgumentTypeError(f"must be at least {least}, got {v} (leave a kind of run out with --runs)")
    return v
  return parse


def _rate(s: str) -> float:
  try: v = float(s)
  except ValueError: raise argparse.ArgumentTypeError(f"expected a number, got {s!r}") from None
  if not v > 0 or v == float("inf"): raise argparse.ArgumentTypeError(f"must be a positive, finite rate, got {s!r}")
  return v


QUANTIZATIONS = ("stored", "int4", "none")


def _choices(allowed: tuple[str, ...]):
  """A comma-separated list of values from `allowed` (several compare in one run)."""
  def parse(s: str) -> list[str]:
    items = [x.strip() for x in s.split(",") if x.strip()]
    bad = [x for x in items if x not in allowed]
    if bad or not items: raise argparse.ArgumentTypeError(f"{s!r}: choose from {', '.join(allowed)}, comma-separated")
    return items
  return parse


def _range(s: str) -> tuple[int, int]:
  vals = _ints(s)
  if len(vals) != 2 or vals[0] > vals[1]: raise argparse.ArgumentTypeError(f"expected LO,HI with LO <= HI, got {s!r}")
  return vals[0], vals[1]


class _Help(argparse.ArgumentDefaultsHelpFormatter):
  """Shows defaults, except the None/False ones whose help already says what happens."""
  def _get_help_string(self, action):
    return action.help if action.default in (None, False) else super()._get_help_string(action)


def parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="python -m tinyvllm.bench", description=__doc__.split("\n\n")[0],
                              epilog=DEFAULTS_NOTE, formatter_class=_Help)
  m = p.add_argument_group("model and engine")
  m.add_argument("--model", default=None, help="HF directory, GGUF file or hub id (default: SmolLM2-135M-Instruct Q4_1 GGUF)")
  m.add_argument("--quantization", default="stored", type=_choices(QUANTIZATIONS),
                 help="stored (the checkpoint as it is: the default model stays 4-bit), int4 (quantize float weights at "
                      "load) or none (dequantize 4-bit checkpoints); several, comma-separated, compare them in one run")
  m.add_argument("--kv-cache-dtype", default="auto", type=_choices(KV_CACHE_DTYPES),
                 help="KV cache storage: auto (the model dtype), int8, int4 or k8v4 (docs/quantization.md); several, comma-separated, compare them in one run")
  m.add_argument("--capture-mode", default="auto", type=_choices(CAPTURE_MODES),
                 help="what one captured replay holds: pass (the whole forward pass), layer (one decoder layer) or auto (pass "
                      "on a GPU, layer on the CPU); several, comma-separated, compare them in one run")
  m.add_argument("--num-scheduler-steps", type=_ints, default="1",
                 help="multi-step decoding: greedy decode passes per step, the tokens fed back on the device (the host waits "
                      "once every N tokens); several, comma-separated, compare them in one run (the largest sizes "
                      "every run's context)")
  m.add_argument("--async-scheduling", default="off", type=_choices(("off", "on")),
                 help="pipelined decoding (the next step launched before the host reads this one's tokens; CUDA): off or "
                      "on; both, comma-separated, compare them in one run")
  # the cache is sized to the runs, and --seed seeds the prompts too; with --draft-model runs go with speculation off and on
  add_engine_args(m, exclude=BENCH_SETS)
  r = p.add_argument_group("runs")
  r.add_argument("--runs", default="decode,prefill,serving", help="which of decode, prefill, serving")
  r.add_argument("--batch-sizes", type=_ints, default="1,8", help="decode batch sizes, e.g. 1,2,4,8,16,32")
  r.add_argument("--context-lens", type=_ints, default="128", help="decode context lengths (prompt tokens), e.g. 128,1024,4096")
  r.add_argument("--steps", type=_count(1), default=32, help="timed decode steps per run")
  r.add_argument("--warmup", type=_count(0), default=3, help="decode steps before timing (the first captures the shape)")
  r.add_argument("--repeats", type=_count(1), default=1, help="time each decode/prefill run this many times in a row; "
                 "the median is reported and every repeat is kept in the JSON (a noise measure)")
  r.add_argument("--prefill-lens", type=_ints, default="128,512", help="prefill prompt lengths")
  r.add_argument("--serving-requests", type=_count(1), default=8, help="requests in the serving scenario")
  r.add_argument("--serving-rate", type=_rate, default=4.0, help="mean arrivals per second (Poisson)")
  r.add_argument("--serving-prompt-lens", type=_range, default="16,128", help="LO,HI uniform prompt lengths")
  r.add_argument("--serving-output-lens", type=_range, default="16,32", help="LO,HI uniform output lengths")
  r.add_argument("--prompts", choices=("random", "text"), default="random",
                 help="prompt tokens: random ids, or windows of a built-in English text (speculative decoding accepts "
                      "almost no drafts on random tokens)")
  r.add_argument("--seed", type=int, default=0, help="seeds the random prompts and the serving workload")
  c = p.add_argument_group("device ceilings")
  c.add_argument("--bandwidth-sizes", type=_ints, default="64,256,1024", help="MiB per buffer of the bandwidth kernel")
  c.add_argument("--bandwidth-reps", type=_count(1), default=5, help="best of this many runs")
  c.add_argument("--matmul-size", type=int, default=None, help="n of the n x n x n matmul (default: 1024 on the CPU, 4096 on a GPU)")
  q = p.add_argument_group("peers")
  q.add_argument("--peers", default=None, help="hf (transformers: float32 on the CPU, on a GPU the same GPU and tinyvllm's dtype), "
                 "hf-compile (transformers with a static cache and torch.compile, the gpt-fast recipe), llamacpp (llama-cpp-python "
                 "on the GGUF as it is), llamacpp-f32 (the GGUF dequantized to F32, written once to the cache); default: "
                 "hf,llamacpp on the CPU, hf,hf-compile on a GPU")
  q.add_argument("--no-peers", action="store_true", help="tinyvllm only")
  q.add_argument("--peer-threads", type=int, default=None, help="threads for the peers (default: every core)")
  q.add_argument("--llamacpp-gguf", type=Path, default=None, help="GGUF for llama.cpp (default: --model when it is a GGUF)")
  o = p.add_argument_group("output")
  o.add_argument("--json", type=Path, default=None, help="write one record per run")
  o.add_argument("--plot", type=Path, default=None, help="draw the roofline chart (needs matplotlib)")
  p.add_argument("--doctor", action="store_true",
                 help="check this machine's path instead: compile every .metal file, run tests/test_metal_device.py, a short "
                      "generation and a short roofline run, and print one report to paste back (--model and --json apply)")
  return p


BENCH_SETS = ("quantization", "kv_cache_dtype", "capture_mode", "num_scheduler_steps", "async_scheduling", "seed", "max_model_len", "num_kv_blocks", "max_num_seqs")
SPECULATION_ARGS = ("draft_model", "num_speculative_tokens", "speculation")


def _engine_kwargs(args, quantization: str, kv_cache_dtype: str, speculative: bool, max_len: int, num_blocks: int,
                   max_seqs: int, capture_mode: str = "auto", num_scheduler_steps: int = 1, async_scheduling: str = "off") -> dict:
  kw = engine_kwargs(args, exclude=BENCH_SETS + SPECULATION_ARGS)
  kw |= dict(max_model_len=max_len, num_kv_blocks=num_blocks, max_num_seqs=max_seqs, seed=args.seed, kv_cache_dtype=kv_cache_dtype,
             capture_mode=capture_mode, num_scheduler_steps=num_scheduler_steps)
  if async_scheduling == "on": kw["async_scheduling"] = True
  if quantization != "stored": kw["quantization"] = quantization
  if speculative: kw |= {name: getattr(args, name) for name in SPECULATION_ARGS}
  return kw


def _tokens_per_step(args) -> int:
  """The most tokens a sequence may take in one step: a speculative run's drafts plus one, or a multi-step run's passes."""
  return max((args.num_speculative_tokens or 4) + 1 if args.draft_model else 1, max(args.num_scheduler_steps))


def _cache_plan(args, runs: set[str]) -> tuple[int, int, int]:
  """(max_model_len, KV blocks, max sequences) that hold the largest run at once, with room for the tokens
  decoded while warming up and timing (speculation may run several ahead)."""
  spec = _tokens_per_step(args)
  extra = (args.warmup + args.steps * args.repeats + 2) * spec + 16
  need, max_len, max_seqs = [], 64, 1
  if "decode" in runs:
    need += [b * (c + extra) for b in args.batch_sizes for c in args.context_lens]
    max_len = max(max_len, max(args.context_lens) + extra)
    max_seqs = max(max_seqs, max(args.batch_sizes))
  if "prefill" in runs:
    need.append(max(args.prefill_lens) + 16)
    max_len = max(max_len, max(args.prefill_lens) + 16)
  if "serving" in runs:
    per = args.serving_prompt_lens[1] + args.serving_output_lens[1] + 16 * spec
    need.append(args.serving_requests * per)
    max_len, max_seqs = max(max_len, per), max(max_seqs, min(args.serving_requests, 32))
  return max_len, -(-max(need) // 16) + 2 * max_seqs + 8, max_seqs


def _fit_to_model(args, runs: set[str], context: int, notes: list[str]) -> None:
  """Drop what cannot fit the model's context (`context` tokens), each with a note, so a model with a short context
  measures what it can instead of failing after the ceilings were measured."""
  spec = _tokens_per_step(args)
  extra = (args.warmup + args.steps * args.repeats + 2) * spec + 16
  if "decode" in runs:
    fit = [c for c in args.context_lens if c + extra <= context]
    if fit != args.context_lens: notes.append(f"decode at context {', '.join(str(c) for c in args.context_lens if c not in fit)} "
                                              f"skipped: with {extra} decoded tokens it exceeds the model's context of {context}")
    args.context_lens = fit
    if not fit: runs.discard("decode")
  if "prefill" in runs:
    fit = [n for n in args.prefill_lens if n + 16 <= context]
    if fit != args.prefill_lens: notes.append(f"prefill of {', '.join(str(n) for n in args.prefill_lens if n not in fit)} "
                                              f"tokens skipped: the model's context is {context}")
    args.prefill_lens = fit
    if not fit: runs.discard("prefill")
  if "serving" in runs and args.serving_prompt_lens[1] + args.serving_output_lens[1] + 16 * spec > context:
    room = context - 16 * spec
    prompt_hi = max(1, min(args.serving_prompt_lens[1], room // 2))
    output_hi = max(1, min(args.serving_output_lens[1], room - prompt_hi))
    args.serving_prompt_lens = (min(args.serving_prompt_lens[0], prompt_hi), prompt_hi)
    args.serving_output_lens = (min(args.serving_output_lens[0], output_hi), output_hi)
    notes.append(f"serving lengths clipped to prompts {args.serving_prompt_lens} and outputs {args.serving_output_lens} "
                 f"to fit the model's context of {context}")


def _median(results: list[dict]) -> dict:
  """The repeat with the median tok/s, with every repeat's tok/s beside it."""
  from tinyvllm.bench.runs import median_repeat
  return median_repeat(results, lambda r: r["tokens_per_s"]) | {"tokens_per_s_repeats": [r["tokens_per_s"] for r in results]}


def _model_name(path: Path) -> str: return path.name if path.name else str(path)


def _progress_line(bar, who: str, kind: str, batch: int, length: int, rec: dict) -> None:
  """One line per finished run, above the bar: a run cut short (a time limit, a crash later on) still shows what it
  measured before the table at the end."""
  what = f"decode B={batch} ctx={length}" if kind == "decode" else f"{kind} {length}"
  roof = f", {rec['roofline_fraction']:.1%} of the roofline" if rec.get("roofline_fraction") else ""
  bar.write(f"{who} {what}: {rec['tokens_per_s']:.1f} tok/s, {rec['ms_per_step']:.2f} ms/step{roof}")


def run_tinyvllm(args, runs: set[str], model_path: Path, ceilings, rng, bar) -> list[dict]:
  """Every requested run on tinyvllm, once per configuration: each --quantization and --kv-cache-dtype, with
  speculation off (and on when a draft is given)."""
  from tinyvllm.bench import device, report, runs as runs_mod
  from tinyvllm.engine.llm_engine import LLMEngine
  max_len, num_blocks, max_seqs = _cache_plan(args, runs)
  records = []
  configs = [(q, kv, capture, steps, pipelined, spec) for q in args.quantization for kv in args.kv_cache_dtype for capture in args.capture_mode
             for steps in args.num_scheduler_steps for pipelined in args.async_scheduling
             for spec in [False] + ([True] if args.draft_model and steps == 1 and pipelined != "on" else [])]
  for quantization, kv_cache_dtype, capture_mode, steps, pipelined, speculative in configs:
    bar.set_postfix_str(f"loading the model ({quantization}, KV {kv_cache_dtype}, capture {capture_mode}, {steps} passes a step)" +
                        (" with its draft" if speculative else ""))
    try:   # in this thread: each step is timed alone, not overlapped with the engine's next one
      engine = LLMEngine.from_kwargs(args.model, **_engine_kwargs(args, quantization, kv_cache_dtype, speculative, max_len,
                                                                  num_blocks, max_seqs, capture_mode, steps,
                                                                  "off" if speculative else pipelined))
    except (TypeError, ValueError) as e:   # e.g. an engine argument this version of tinyvllm does not know, a backend refusing the model
      sys.exit(f"tinyvllm's engine refused the arguments: {e}")
    bar.update()
    drv = runs_mod.Driver(engine, text=args.prompts == "text")
    stored = engine.model_config.quantization or {}   # a GGUF names its kept block types (Q4_K+Q6_K)
    label = "+".join(stored["gguf_types"]) if stored.get("gguf_types") else f"int{stored['bits']}" if stored.get("bits") else "none"
    common = {"engine": "tinyvllm", "device": ceilings.device, "machine": device.machine_description(),
              "model": _model_name(model_path), "quantization": label, "quantization_setting": quantization,
              "dtype": "float32" if engine.runner.model.dtype.itemsize == 4 else "float16",
              "kv_cache_dtype": engine.runner.kv_format.storage,
              "kernel_backend": engine.kernel_backend, "capture_mode": "pass" if engine.runner.whole_pass else "layer",
              "num_scheduler_steps": steps, "async_scheduling": engine.core.pipelined,
              "speculative": speculative,
              "draft_model": args.draft_model if speculative else None,
              "num_speculative_tokens": args.num_speculative_tokens if speculative else None, "prompts": args.prompts}
    who = f"tinyvllm ({common['capture_mode']} captures{f', {steps} passes a step' if steps > 1 else ''}{', async' if engine.core.pipelined else ''})"
    for b in args.batch_sizes if "decode" in runs else []:
      for ctx in args.context_lens:
        bar.set_postfix_str(f"decode B={b} ctx={ctx}")
        # the requests are aborted after timing: they must not finish before, so they may run to max_model_len
        rec = runs_mod.decode_run(drv, b, ctx, args.steps, args.warmup, rng, max_len - ctx - 1, args.repeats)
        records.append(report.finalize(rec, ceilings, common))
        _progress_line(bar, who, "decode", b, ctx, records[-1])
        bar.update()
    for n in args.prefill_lens if "prefill" in runs else []:
      bar.set_postfix_str(f"prefill {n}")
      records.append(report.finalize(runs_mod.prefill_run(drv, n, rng, args.repeats), ceilings, common))
      _progress_line(bar, who, "prefill", 1, n, records[-1])
      bar.update()
    if "serving" in runs:
      bar.set_postfix_str("serving (a warm-up pass, then the timed pass)")
      workload = runs_mod.Workload(args.serving_requests, args.serving_rate, args.serving_prompt_lens, args.serving_output_lens)
      runs_mod.serving_run(drv, workload, np.random.default_rng(args.seed + 1))
      records.append(report.finalize(runs_mod.serving_run(drv, workload, np.random.default_rng(args.seed + 1)), ceilings, common))
      bar.update()
    del engine, drv
    gc.collect()
  return records


def run_peers(args, runs: set[str], peer_keys: list[str], model_path: Path, rng, bar, notes: list[str], device: str,
              dtype: str) -> dict[str, dict[tuple, dict]]:
  """The decode and prefill runs in each peer: {peer name: {(kind, batch, context): result}}. `device`: tinygrad's
  device (a torch peer runs on the same GPU when there is one); `dtype`: tinyvllm's, which a GPU peer runs too."""
  from tinyvllm.bench import peers as peers_mod
  max_len = _cache_plan(args, runs)[0]
  decodes = [(b, c) for b in args.batch_sizes for c in args.context_lens] if "decode" in runs else []
  prefills = args.prefill_lens if "prefill" in runs else []
  out = {}
  for key in peer_keys:
    name = peers_mod.PEER_NAMES[key]
    bar.set_postfix_str(f"loading {name}")
    torch_kw = {}
    if key.startswith("hf"):
      torch_kw = {"device": peers_mod.torch_device(device)}
      torch_kw["dtype"] = "float32" if torch_kw["device"] == "cpu" else dtype
    try:
      peer = peers_mod.load_peer(key, model_path, args.llamacpp_gguf, max(args.batch_sizes), max_len, args.peer_threads, **torch_kw)
    except peers_mod.PeerUnavailable as e:
      notes.append(f"{name} skipped: {e}")
      bar.update(1 + len(decodes) + len(prefills))
      continue
    bar.update()
    results, extra = {}, {"precision": peer.precision, "threads": peer.threads}
    try:
      for b, ctx in decodes:
        bar.set_postfix_str(f"{name} decode B={b} ctx={ctx}")
        results[("decode", b, ctx)] = _median([peer.decode(b, ctx, args.steps, args.warmup, rng) for _ in range(args.repeats)]) | extra
        _progress_line(bar, name, "decode", b, ctx, results[("decode", b, ctx)])
        bar.update()
      for n in prefills:
        bar.set_postfix_str(f"{name} prefill {n}")
        results[("prefill", 1, n)] = _median([peer.prefill(n, rng) for _ in range(args.repeats)]) | extra
        _progress_line(bar, name, "prefill", 1, n, results[("prefill", 1, n)])
        bar.update()
    except Exception as e:   # a peer that breaks (torch.compile on an unusual setup, say) is a note, not the end of the run
      logging.getLogger("tinyvllm").warning("%s failed", name, exc_info=e)
      notes.append(f"{name} failed after {len(results)} runs: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    out[name] = results
    notes.append(f"{name}: {peer.precision} weights, {peer.threads} threads")
    if hasattr(peer, "close"): peer.close()
    del peer
    gc.collect()
  return out


def main(argv: list[str] | None = None) -> list[dict]:
  """Run the benchmark; returns tinyvllm's records (peer runs are in the JSON too)."""
  args = parser().parse_args(argv)
  if args.doctor:
    from tinyvllm.bench import doctor
    sys.exit(doctor.run(args.model, args.json))
  runs = {x.strip() for x in args.runs.split(",") if x.strip()}
  if runs - RUN_KINDS: sys.exit(f"--runs: unknown run kind(s) {', '.join(sorted(runs - RUN_KINDS))}; choose from {', '.join(RUN_KINDS)}")
  from tinyvllm.bench import device, peers as peers_mod, report
  from tinygrad import Device
  if args.peers is None:
    args.peers = "" if device.runs_nothing(Device.DEFAULT) else peers_mod.DEFAULT_PEERS["CPU" if Device.DEFAULT.split(":")[0] == "CPU" else "GPU"]
  peer_keys = [] if args.no_peers else [x.strip() for x in args.peers.split(",") if x.strip()]
  bad = [k for k in peer_keys if k not in peers_mod.PEERS]
  if bad: sys.exit(f"--peers: unknown peer(s) {', '.join(bad)}; choose from {', '.join(peers_mod.PEERS)}")
  if args.plot: report.require_matplotlib()   # fail now, not after minutes of measuring

  rng, notes = np.random.default_rng(args.seed), []
  from tinyvllm.model.weights import load_config
  try: context = load_config(args.model).max_position_embeddings   # before any measuring: a bad model fails now
  except (ValueError, OSError) as e: sys.exit(f"--model: {e}")
  _fit_to_model(args, runs, context, notes)
  if not runs: sys.exit(f"nothing to measure: every run exceeds the model's context of {context} tokens ({'; '.join(notes)})")
  speculative = sum(p != "on" for p in args.async_scheduling) if args.draft_model and 1 in args.num_scheduler_steps else 0
  n_configs = len(args.quantization) * len(args.kv_cache_dtype) * len(args.capture_mode) * \
    (len(args.num_scheduler_steps) * len(args.async_scheduling) + speculative)   # run_tinyvllm's configs
  n_decode = len(args.batch_sizes) * len(args.context_lens) if "decode" in runs else 0
  n_prefill = len(args.prefill_lens) if "prefill" in runs else 0
  n_tasks = 1 + n_configs * (1 + n_decode + n_prefill + ("serving" in runs)) + len(peer_keys) * (1 + n_decode + n_prefill)
  bar = tqdm(total=n_tasks, desc="tinyvllm.bench", file=sys.stderr, unit="run")
  bar.set_postfix_str("device ceilings")
  ceilings = device.measure(args.bandwidth_sizes, args.bandwidth_reps, args.matmul_size, threads=args.num_threads)
  bar.update()
  model_path = resolve_model(args.model)
  from tinyvllm.outputs import GenerationError
  try: records = run_tinyvllm(args, runs, model_path, ceilings, rng, bar)
  except GenerationError as e:   # the engine logged the traceback; the run has nothing to report
    bar.close()
    sys.exit(f"tinyvllm.bench: the engine failed a step, so nothing was timed: {e}")
  peer_results = run_peers(args, runs, peer_keys, model_path, rng, bar, notes, ceilings.device,
                           records[0]["dtype"] if records else "float32")
  bar.close()

  report.attach_peers(records, peer_results)
  peer_records = [{"engine": name, "device": ceilings.device, "machine": device.machine_description(),
                   "model": _model_name(model_path), "kind": k, "batch_size": b, "context_len": ctx} | r
                  for name, results in peer_results.items() for (k, b, ctx), r in results.items()]
  if ceilings.device.split(":")[0] == "CPU":
    notes.append(f"tinygrad's CPU device runs each kernel on one thread; the engine's C kernels and the measured bandwidth "
                 f"ceiling use {ceilings.threads} (--num-threads)")
  if device.runs_nothing(ceilings.device):
    notes.append("tinygrad's NULL device compiles every kernel (for the GPU DEV names after it: NULL:CUDA:sm_90, an H100) "
                 "and runs none: times are the host's work alone (scheduling, inputs, graph launches, reading back, outputs)")
  if args.draft_model:
    notes.append("speculative runs: bytes count the target model's steps only (the draft's reads are not counted)")
  print()
  report.print_ceilings(ceilings)
  report.print_table(records)
  for n in notes: print(f"note: {n}")
  if args.json:
    command = "python -m tinyvllm.bench " + shlex.join(argv if argv is not None else sys.argv[1:])
    report.write_json(args.json, records + peer_records, ceilings, notes, command)
    print(f"wrote {args.json}")
  if args.plot:
    report.plot_roofline(args.plot, records, ceilings)
    print(f"wrote {args.plot}")
  return records
