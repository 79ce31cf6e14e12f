"""Serving benchmark: tinyvllm's server beside llama.cpp's `llama-server` and `mlx_lm.server`, on the same model and
machine, measured by the same OpenAI-protocol client (`python -m tinyvllm.bench.serve`, vLLM's definitions).

    python bench/serving.py                      # default model, concurrency 1 and 8, 32 requests each
    python bench/serving.py --concurrency 8 --servers tinyvllm,llamacpp --json serving.json
    python bench/serving.py --dataset prefix --servers tinyvllm,tinyvllm-nocache --concurrency 1
    python bench/serving.py --dataset chat --num-prompts 4 --num-turns 6 --concurrency 4

Each server runs alone (one at a time, so they never share the cores), gets a short warm-up at the measured
concurrency (first requests capture kernels and shapes in every engine), then the timed requests: fresh random
prompts every run, so no prompt cache helps. The model is the default SmolLM2-135M-Instruct Q4_1 GGUF; llama-server
reads it as it is, tinyvllm too (4-bit kept), mlx-lm reads the same 4-bit weights repacked into MLX's format by
`python -m tinyvllm.quantize --group-size 32` (lossless for Q4_1). llama-server is built once from the llama.cpp
sources in the llama-cpp-python sdist (about 10 minutes on 2 cores) and cached outside the repository.
"""
from __future__ import annotations
import argparse, asyncio, json, os, re, shutil, signal, socket, subprocess, sys, tempfile, time
from pathlib import Path
import numpy as np

LLAMA_CPP_PYTHON = ("llama-cpp-python", "0.3.36")


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


class Server:
  """A server process with its log in a file; `url` once it answers."""
  def __init__(self, name: str, cmd: list[str], port: int, logdir: Path, ready_path: str = "/v1/models", model: str | None = None):
    self.name, self.url, self.log, self.model = name, f"http://127.0.0.1:{port}", logdir / f"{name}.log", model
    self.proc = subprocess.Popen(cmd, stdout=open(self.log, "w"), stderr=subprocess.STDOUT, env=os.environ | {"DEV": "CPU"})
    import httpx
    deadline = time.time() + 600
    while time.time() < deadline:
      if self.proc.poll() is not None: raise RuntimeError(f"{name} exited with {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
      try:
        if httpx.get(self.url + ready_path, timeout=2).status_code == 200: return
      except httpx.HTTPError: pass
      time.sleep(0.5)
    raise RuntimeError(f"{name} did not answer within 600 s:\n{self.log.read_text()[-3000:]}")

  def stop(self) -> None:
    self.proc.send_signal(signal.SIGINT)
    try: self.proc.wait(30)
    except subprocess.TimeoutExpired: self.proc.kill(); self.proc.wait()


def llama_server_binary(given: Path | None) -> Path:
  """llama.cpp's server: `given`, or built once (statically) from the sources vendored in the llama-cpp-python sdist."""
  from tinyvllm.model.fetch import cache_dir, fetch_sdist_members
  if given is not None:
    if not given.exists(): raise RuntimeError(f"--llama-server {given} does not exist")
    return given
  binary = cache_dir() / f"llama-server-{LLAMA_CPP_PYTHON[1]}" / "llama-server"
  if binary.exists(): return binary
  if not shutil.which("cmake"): raise RuntimeError("building llama-server needs cmake")
  src = fetch_sdist_members(*LLAMA_CPP_PYTHON, r"^vendor/llama\.cpp/") / "vendor" / "llama.cpp"
  build = src / "build"
  print(f"building llama-server in {build} (about 10 minutes on 2 cores, once)", file=sys.stderr)
  flags = ["-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
           "-DLLAMA_BUILD_SERVER=ON", "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF"]   # one self-contained binary
  subprocess.run(["cmake", "-B", str(build), *flags], cwd=src, check=True, stdout=subprocess.DEVNULL)
  subprocess.run(["cmake", "--build", str(build), "--target", "llama-server", "-j", str(os.cpu_count() or 2)], cwd=src, check=True,
                 stdout=subprocess.DEVNULL)
  binary.parent.mkdir(parents=True, exist_ok=True)
  shutil.copy2(build / "bin" / "llama-server", binary)
  return binary


def mlx_model(gguf: Path) -> Path:
  """The GGUF's 4-bit weights in MLX's format (what mlx_lm.server loads), written once."""
  from tinyvllm.model.fetch import cache_dir
  out = cache_dir() / f"mlx-{gguf.stem}-g32"
  if not (out / "config.json").exists():
    subprocess.run([sys.executable, "-m", "tinyvllm.quantize", "--model", str(gguf), "--out", str(out), "--group-size", "32"],
                   check=True, env=os.environ | {"DEV": "CPU"})
  return out


def start(name: str, gguf: Path, args, logdir: Path) -> Server:
  port = free_port()
  slots = max(args.concurrency)
  if name.startswith("tinyvllm"):   # tinyvllm-nocache: with prefix caching off, to measure what it brings
    extra = args.tinyvllm_args.split() + (["--no-enable-prefix-caching"] if name == "tinyvllm-nocache" else [])
    return Server(name, [sys.executable, "-m", "tinyvllm.serve", str(gguf), "--port", str(port), "--log-level", "warning",
                         *extra], port, logdir)
  if name == "llamacpp":
    ctx = slots * (args.context + 64)   # llama-server splits its context evenly over the slots
    return Server(name, [str(llama_server_binary(args.llama_server)), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
                         "--parallel", str(slots), "--cont-batching", "-c", str(ctx), "--threads", str(os.cpu_count() or 2),
                         "--threads-batch", str(os.cpu_count() or 2)], port, logdir, ready_path="/health")
  if name == "mlx":
    return Server(name, [sys.executable, "-m", "mlx_lm", "server", "--model", str(mlx_model(gguf)), "--port", str(port),
                         "--decode-concurrency", str(slots), "--prompt-concurrency", str(slots), "--log-level", "WARNING"], port, logdir,
                  ready_path="/health", model="default_model")   # its /v1/models lists the hub cache, not the served model
  raise ValueError(name)


def measure(server: Server, args, concurrency: int, seed: int, tokenizer) -> dict:
  """A warm-up (shapes and kernels; different prompts), then the timed run of the dataset at this concurrency."""
  from tqdm import tqdm
  from tinyvllm.bench.serve import num_requests, run_dataset, summarize, workload
  import httpx
  model = server.model or httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0]["id"]
  run = argparse.Namespace(**{**vars(args), "max_concurrency": concurrency, "request_rate": None})
  warm = argparse.Namespace(**{**vars(run), "num_prompts": concurrency, "output_len": 8, "num_turns": 1, "dataset": "random"})
  run_dataset(server.url, model, tokenizer, warm, seed + 1)
  with tqdm(total=num_requests(run), desc=f"{server.name} at concurrency {concurrency}", file=sys.stderr) as bar:
    results, duration = run_dataset(server.url, model, tokenizer, run, seed, bar)
  return {"server": server.name, "model": model} | workload(run) | summarize(results, duration)


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--model", default=None, help="a GGUF file (default: SmolLM2-135M-Instruct Q4_1)")
  ap.add_argument("--servers", default="tinyvllm,llamacpp,mlx",
                  help="comma-separated: tinyvllm, tinyvllm-nocache (prefix caching off), llamacpp, mlx")
  ap.add_argument("--concurrency", default="1,8", help="comma-separated max concurrency levels")
  ap.add_argument("--dataset", choices=("random", "prefix", "chat"), default="random",
                  help="random prompts, shared prefixes, or multi-turn chat (python -m tinyvllm.bench.serve --help)")
  ap.add_argument("--num-prompts", type=int, default=32, help="requests (chat: conversations)")
  ap.add_argument("--input-len", type=int, default=128, help="prompt tokens (prefix: after the prefix; chat: per turn)")
  ap.add_argument("--output-len", type=int, default=64)
  ap.add_argument("--num-prefixes", type=int, default=4)
  ap.add_argument("--prefix-len", type=int, default=1000)
  ap.add_argument("--num-turns", type=int, default=4)
  ap.add_argument("--tinyvllm-args", default="", help="extra flags for python -m tinyvllm.serve")
  ap.add_argument("--llama-server", type=Path, default=None, help="a llama-server binary (default: build one, once)")
  ap.add_argument("--json", type=Path, default=None)
  args = ap.parse_args()
  args.concurrency = [int(x) for x in args.concurrency.split(",")]
  # the longest prompt plus output (llama-server gives each slot an equal share of its context)
  args.context = (args.num_turns * (args.input_len + args.output_len) if args.dataset == "chat" else
                  args.input_len + (args.prefix_len if args.dataset == "prefix" else 0) + args.output_len)
  from tinyvllm.bench.serve import print_table
  from tinyvllm.model.tokenizer import load_tokenizer
  from tinyvllm.model.weights import resolve_model
  gguf = resolve_model(args.model)
  tokenizer = load_tokenizer(gguf)
  seed = time.time_ns() % 2**32   # fresh prompts every run
  rows, notes = [], []
  with tempfile.TemporaryDirectory() as tmp:
    for name in [x for x in args.servers.split(",") if x]:
      try: server = start(name, gguf, args, Path(tmp))
      except (RuntimeError, subprocess.CalledProcessError, FileNotFoundError) as e:
        notes.append(f"{name} skipped: {str(e).splitlines()[0]}")
        continue
      try:
        for c in args.concurrency: rows.append(measure(server, args, c, seed + c, tokenizer))
      finally: server.stop()
  print(f"\ndataset {args.dataset}: {args.num_prompts} {'conversations' if args.dataset == 'chat' else 'requests'} per row, "
        f"{args.input_len}-token prompts" + (f" after one of {args.num_prefixes} {args.prefix_len}-token prefixes" if args.dataset == "prefix" else "")
        + (f", {args.num_turns} turns" if args.dataset == "chat" else "") + f", {args.output_len} output tokens, {os.cpu_count()} cores, "
        f"model {gguf.name}")
  print_table(rows)
  if args.dataset == "chat":
    for r in rows: print(f"{r['server']} at {r['max_concurrency']}: TTFT p50 first turn {r['median_ttft_first_turn_ms']:.0f} ms, "
                         f"later turns {r['median_ttft_later_turns_ms']:.0f} ms")
  for n in notes: print(f"note: {n}")
  for c in args.concurrency:
    ours = next((r for r in rows if r["server"] == "tinyvllm" and r["max_concurrency"] == c), None)
    peers = [r for r in rows if not r["server"].startswith("tinyvllm") and r["max_concurrency"] == c and r["completed"]]
    off = next((r for r in rows if r["server"] == "tinyvllm-nocache" and r["max_concurrency"] == c), None)
    if ours and off:
      print(f"concurrency {c}: prefix caching on vs off: TTFT p50 {off['median_ttft_ms'] / ours['median_ttft_ms']:.1f}x lower, "
            f"duration {off['duration_s'] / ours['duration_s']:.1f}x shorter")
    if ours and peers:
      best = max(peers, key=lambda r: r["output_throughput"])
      fastest = min(peers, key=lambda r: r["median_ttft_ms"])
      print(f"concurrency {c}: output tok/s {ours['output_throughput'] / best['output_throughput']:.2f}x the best peer "
            f"({best['server']}); TTFT p50 {ours['median_ttft_ms'] / fastest['median_ttft_ms']:.2f}x the best peer's ({fastest['server']})")
  if args.json:
    args.json.write_text(json.dumps({"rows": rows, "notes": notes, "command": " ".join(sys.argv)}, indent=1) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
  main()
