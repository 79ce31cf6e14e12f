"""Turn timed runs into records (tok/s, GB/s, fraction of the roofline), print them, write JSON, draw the roofline."""
from __future__ import annotations
import json, sys
from pathlib import Path
from tinyvllm.bench.accounting import Traffic
from tinyvllm.bench.device import Ceilings


def finalize(run: dict, ceilings: Ceilings, common: dict) -> dict:
  """Add the roofline figures to a run from runs.py. Traffic is averaged over every timed step; the time of a
  step is the run's `ms_per_step` (the median repeat; for serving, busy time only). Bytes per token divide a step's
  traffic by the tokens a step produced (generated tokens for decode and serving, prompt tokens for prefill)."""
  rec = dict(common) | run
  tr: Traffic = rec.pop("traffic").scaled(1 / max(1, rec["steps"]))     # per step
  step_s = rec["ms_per_step"] / 1e3
  tokens_per_step = rec["tokens_per_step"]
  bw, peak = ceilings.bandwidth_gbps * 1e9, ceilings.matmul_gflops * 1e9
  ideal = max(tr.total_bytes / bw if bw else 0.0, tr.flops / peak if peak else 0.0)
  achieved = tr.total_bytes / step_s / 1e9
  rec.update({
    "bytes_per_step": tr.total_bytes, "bytes_per_token": tr.total_bytes / tokens_per_step,
    "weight_bytes_per_step": tr.weight_bytes, "kv_read_bytes_per_step": tr.kv_read_bytes,
    "kv_write_bytes_per_step": tr.kv_write_bytes, "activation_bytes_per_step": tr.activation_bytes,
    "flops_per_step": tr.flops, "arithmetic_intensity": tr.intensity,
    "achieved_gbps": achieved, "achieved_gflops": tr.flops / step_s / 1e9,
    "measured_bandwidth_gbps": ceilings.bandwidth_gbps, "published_bandwidth_gbps": ceilings.published_gbps,
    "measured_gflops": ceilings.matmul_gflops,
    "bandwidth_fraction": achieved / ceilings.bandwidth_gbps if ceilings.bandwidth_gbps else None,
    "published_bandwidth_fraction": achieved / ceilings.published_gbps if ceilings.published_gbps else None,
    # time the roofline allows (bytes at the measured bandwidth or FLOPs at the measured matmul rate, whichever is
    # longer) over the time taken: 1.0 is the ceiling
    "roofline_fraction": ideal / step_s if step_s and ideal else None,
    "roofline_tokens_per_s": tokens_per_step / ideal if ideal else None,
  })
  return rec


def attach_peers(records: list[dict], peer_results: dict[str, dict[tuple, dict]]) -> None:
  """Give each tinyvllm record its peers' speed on the same (kind, batch, context) and the ratio tinyvllm / peer."""
  for rec in records:
    key = (rec["kind"], rec["batch_size"], rec["context_len"])
    rec["peers"] = {}
    for name, results in peer_results.items():
      if key in results and results[key].get("tokens_per_s"):
        r = results[key]
        rec["peers"][name] = {"tokens_per_s": r["tokens_per_s"], "ms_per_step": r.get("ms_per_step"),
                              "precision": r.get("precision"), "threads": r.get("threads"),
                              "tinyvllm_over_peer": rec["tokens_per_s"] / r["tokens_per_s"]}


def _fmt(x, spec: str, none: str = "-") -> str: return none if x is None else format(x, spec)


def print_ceilings(c: Ceilings, file=None) -> None:
  file = file or sys.stdout   # looked up per call: sys.stdout may be replaced after import
  sizes = ", ".join(f"{m} MiB {g:.1f}" for m, g in c.bandwidth_by_size.items())
  print(f"device {c.device}" + (f", chip {c.chip}" if c.chip else ""), file=file)
  if not c.bandwidth_gbps: return   # the NULL device: no ceilings
  where = "tinygrad, one thread" if c.device.split(":")[0] == "CPU" else "tinygrad's kernel"
  print(f"  measured bandwidth (read+write, the best measured here): {c.bandwidth_gbps:.1f} GB/s  [{where}: {sizes}]" +
        (f"  [our C kernel on {c.threads} threads: {c.threaded_bandwidth_gbps:.1f}]" if c.threaded_bandwidth_gbps else ""), file=file)
  if c.numpy_copy_gbps: print(f"  numpy copy on {c.numpy_threads} threads (reference): {c.numpy_copy_gbps:.1f} GB/s", file=file)
  if c.published_gbps:
    print(f"  published bandwidth: {c.published_gbps:g} GB/s{' (unsure)' if c.published_unsure else ''} - {c.published_source}", file=file)
  if c.torch_copy_gbps: print(f"  torch's device-to-device copy (read+write, counted in the ceiling): {c.torch_copy_gbps:.1f} GB/s", file=file)
  print(f"  matmul ({c.matmul_dtype}): tinygrad {c.tinygrad_matmul_gflops:.1f} GFLOP/s, engine linear {c.engine_linear_gflops:.1f} GFLOP/s" +
        (f", torch (cuBLAS, counted in the ceiling) {c.torch_matmul_gflops:.1f} GFLOP/s" if c.torch_matmul_gflops else ""), file=file)


def _compared(records: list[dict]) -> list[str]:
  """The settings a run compares (capture_mode, num_scheduler_steps, async_scheduling): each gets a column when it takes
  several values."""
  return [k for k in ("capture_mode", "num_scheduler_steps", "async_scheduling") if len({r.get(k) for r in records}) > 1]


def _setting(record: dict, compared: list[str]) -> str:
  """The compared settings of a record, for its time split line."""
  words = {"capture_mode": lambda v: f"{v} captures", "num_scheduler_steps": lambda v: f"{v} pass{'es' if v != 1 else ''} a step",
           "async_scheduling": lambda v: "async" if v else "sync"}
  return f" ({', '.join(words[k](record.get(k)) for k in compared)})" if compared else ""


def print_table(records: list[dict], file=None) -> None:
  file = file or sys.stdout   # looked up per call: sys.stdout may be replaced after import
  peers = sorted({p for r in records for p in r.get("peers", {})})
  qw = max([6] + [len(r["quantization"]) + 1 for r in records])   # a GGUF's block types may be long
  compared = _compared(records)   # a column only when the run compares several values
  captures, steps, pipelined = "capture_mode" in compared, "num_scheduler_steps" in compared, "async_scheduling" in compared
  head = (f"{'kind':<8}{'quant':>{qw}}{'kv':>8}" + (f"{'capture':>8}" if captures else "") + (f"{'steps':>6}" if steps else "") + (f"{'async':>6}" if pipelined else "") + f"{'spec':>5}{'B':>4}{'ctx':>6}{'tok/s':>9}{'ms/step':>9}{'MB/tok':>8}{'GB/s':>7}"
          f"{'%meas':>7}{'%pub':>6}{'%roof':>7}" + "".join(f"{'vs ' + p:>16}" for p in peers))
  print(head, file=file)
  for r in records:
    pct = lambda x: _fmt(None if x is None else 100 * x, ".0f")
    row = (f"{r['kind']:<8}{r['quantization']:>{qw}}{r.get('kv_cache_dtype', '-'):>8}" + (f"{r.get('capture_mode', '-'):>8}" if captures else "") +
           (f"{r.get('num_scheduler_steps', 1):>6}" if steps else "") + (f"{'on' if r.get('async_scheduling') else 'off':>6}" if pipelined else "") +
           f"{'on' if r.get('speculative') else 'off':>5}{r['batch_size']:>4}{r['context_len']:>6}"
           f"{r['tokens_per_s']:>9.1f}{r['ms_per_step']:>9.1f}{r['bytes_per_token'] / 1e6:>8.1f}{r['achieved_gbps']:>7.2f}"
           f"{pct(r['bandwidth_fraction']):>7}{pct(r['published_bandwidth_fraction']):>6}{pct(r['roofline_fraction']):>7}")
    for p in peers:
      info = r.get("peers", {}).get(p)
      cell = f"{info['tokens_per_s']:.1f} ({info['tinyvllm_over_peer']:.2f}x)" if info else "-"
      row += f"{cell:>16}"
    print(row, file=file)
  split = [r for r in records if r.get("time_per_token")]
  cpu, gpu = [r for r in split if "compute_ms" in r["time_per_token"]], [r for r in split if "gpu_ms" in r["time_per_token"]]
  if cpu: print("time per token (ms): compute (kernels), sync (the thread pool's waits + copies between devices), "
                "host (Python between kernels)", file=file)
  for r in cpu:
    t = r["time_per_token"]
    print(f"  {r['kind']} B={r['batch_size']} ctx={r['context_len']}{_setting(r, compared)}: compute {t['compute_ms']:.2f}, sync {t['sync_ms']:.2f} "
          f"(pool {t['thread_pool_wait_ms']:.2f}, copies {t['device_copies_ms']:.2f}), host {t['host_ms']:.2f}; "
          f"{t['kernels_per_step']:.0f} kernels per step", file=file)
  if gpu: print("time per token (ms): host (Python: scheduling, inputs, launches, sampling; the GPU runs meanwhile), of it "
                "launches, waiting for the GPU, and the GPU's busy time (profiled steps, timed by the GPU)", file=file)
  for r in gpu:
    t = r["time_per_token"]
    print(f"  {r['kind']} B={r['batch_size']} ctx={r['context_len']}{_setting(r, compared)}: host {t['host_ms']:.3f} (launches {t['launch_ms']:.3f}), "
          f"waiting {t['gpu_wait_ms']:.3f}, GPU {_fmt(t['gpu_ms'], '.3f')}; {t['kernels_per_step']:.0f} kernels per step", file=file)
  serving = [r for r in records if r["kind"] == "serving"]
  for r in serving:
    print(f"serving: {r['num_requests']} requests at {r['request_rate']:g}/s, prompts {r['prompt_lens'][0]}-{r['prompt_lens'][1]}, "
          f"outputs {r['output_lens'][0]}-{r['output_lens'][1]} tokens: {r['tokens_per_s']:.1f} output tok/s, "
          f"TTFT p50 {_fmt(r['ttft_p50_ms'], '.0f')} / p99 {_fmt(r['ttft_p99_ms'], '.0f')} ms, "
          f"ITL p50 {_fmt(r['itl_p50_ms'], '.0f')} / p99 {_fmt(r['itl_p99_ms'], '.0f')} ms, peak batch {r['batch_size']}", file=file)
  print("ratios are tinyvllm / peer (above 1: tinyvllm is faster); %meas and %pub: achieved GB/s over the measured and "
        "the published bandwidth; %roof: the roofline's time over the time taken", file=file)


def write_json(path: Path, records: list[dict], ceilings: Ceilings, notes: list[str], command: str) -> None:
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps({"command": command, "ceilings": ceilings.as_dict(), "notes": notes, "records": records},
                             indent=2, default=str))


def require_matplotlib():
  try:
    import matplotlib
  except ImportError:
    raise SystemExit("--plot needs matplotlib: pip install 'tinyvllm[bench]' (or pip install matplotlib)") from None
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  return plt


def plot_roofline(path: Path, records: list[dict], ceilings: Ceilings) -> None:
  plt = require_matplotlib()
  xs = [r["arithmetic_intensity"] for r in records if r["arithmetic_intensity"] > 0]
  lo, hi = min(xs + [0.1]) / 3, max(xs + [ceilings.matmul_gflops / max(ceilings.bandwidth_gbps, 1e-9)]) * 10
  grid = [lo * (hi / lo) ** (i / 200) for i in range(201)]
  fig, ax = plt.subplots(figsize=(8, 5.5))
  roof = [min(ceilings.bandwidth_gbps * x, ceilings.matmul_gflops) for x in grid]
  ax.plot(grid, roof, "k-", label=f"measured: {ceilings.bandwidth_gbps:.1f} GB/s, {ceilings.matmul_gflops:.1f} GFLOP/s")
  if ceilings.published_gbps:
    ax.plot(grid, [ceilings.published_gbps * x for x in grid], "k--", lw=0.8,
            label=f"published bandwidth {ceilings.published_gbps:g} GB/s ({ceilings.chip})")
  if ceilings.numpy_copy_gbps:
    ax.plot(grid, [ceilings.numpy_copy_gbps * x for x in grid], "k:", lw=0.8,
            label=f"numpy copy, {ceilings.numpy_threads} threads: {ceilings.numpy_copy_gbps:.1f} GB/s")
  markers = {"decode": "o", "prefill": "s", "serving": "^"}
  quants = list(dict.fromkeys(r["quantization"] for r in records))
  for kind, marker in markers.items():
    pts = [r for r in records if r["kind"] == kind and r["arithmetic_intensity"] > 0]
    if not pts: continue
    ax.scatter([r["arithmetic_intensity"] for r in pts], [r["achieved_gflops"] for r in pts], marker=marker, s=40, label=kind, zorder=3)
    for r in pts:
      label = f"B{r['batch_size']} L{r['context_len']}" + (f" {r['quantization']}" if len(quants) > 1 else "") + \
        (f" kv {r['kv_cache_dtype']}" if len({x.get('kv_cache_dtype') for x in records}) > 1 else "") + \
        (" spec" if r.get("speculative") else "")
      ax.annotate(label, (r["arithmetic_intensity"], r["achieved_gflops"]), fontsize=7, xytext=(4, 3), textcoords="offset points")
  ax.set_xscale("log"); ax.set_yscale("log")
  ax.set_xlabel("arithmetic intensity (FLOP / byte)"); ax.set_ylabel("achieved GFLOP/s")
  what = f"{records[0]['model']} ({'/'.join(quants)}, {records[0]['dtype']})" if records else ""
  ax.set_title(f"tinyvllm roofline: {what} on {ceilings.chip or ceilings.device}", fontsize=10)
  ax.grid(True, which="both", lw=0.3)
  ax.legend(fontsize=8, loc="lower right")
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
