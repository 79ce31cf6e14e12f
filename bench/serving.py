"""Serving benchmark: tinyvllm's server beside llama.cpp's `llama-server` and `mlx_lm.server`, on the same model and
machine, measured by the same OpenAI-protocol client (`python -m tinyvllm.bench.serve`, vLLM's definitions).

    python bench/serving.py                      # default model, concurrency 1 and 8, 32 requests each
    python bench/serving.py --concurrency 8 --peers llamacpp --json serving.json

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
  if name == "tinyvllm":
    return Server(name, [sys.executable, "-m", "tinyvllm.serve", str(gguf), "--port", str(port), "--log-level", "warning",
                         *args.tinyvllm_args.split()], port, logdir)
  if name == "llamacpp":
    ctx = slots * (args.input_len + args.output_len + 64)   # llama-server splits its context evenly over the slots
    return Server(name, [str(llama_server_binary(args.llama_server)), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
                         "--parallel", str(slots), "--cont-batching", "-c", str(ctx), "--threads", str(os.cpu_count() or 2),
                         "--threads-batch", str(os.cpu_count() or 2)], port, logdir, ready_path="/health")
  if name == "mlx":
    return Server(name, [sys.executable, "-m", "mlx_lm", "server", "--model", str(mlx_model(gguf)), "--port", str(port),
                         "--decode-concurrency", str(slots), "--prompt-concurrency", str(slots), "--log-level", "WARNING"], port, logdir,
                  ready_path="/health", model="default_model")   # its /v1/models lists the hub cache, not the served model
  raise ValueError(name)


def measure(server: Server, args, concurrency: int, seed: int, tokenizer) -> dict:
  from tqdm import tqdm
  from tinyvllm.bench.serve import random_prompts, run_load, summarize
  import httpx
  model = server.model or httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0]["id"]
  rng = np.random.default_rng(seed)
  warm = random_prompts(tokenizer, concurrency, args.input_len, rng)
  asyncio.run(run_load(server.url, model, warm, 8, concurrency, None, seed))
  prompts = random_prompts(tokenizer, args.num_prompts, args.input_len, rng)
  with tqdm(total=len(prompts), desc=f"{server.name} at concurrency {concurrency}", file=sys.stderr) as bar:
    results, duration = asyncio.run(run_load(server.url, model, prompts, args.output_len, concurrency, None, seed, bar))
  return {"server": server.name, "model": model, "num_prompts": args.num_prompts, "input_len": args.input_len,
          "output_len": args.output_len, "max_concurrency": concurrency, "request_rate": None} | summarize(results, duration)


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--model", default=None, help="a GGUF file (default: SmolLM2-135M-Instruct Q4_1)")
  ap.add_argument("--peers", default="llamacpp,mlx", help="comma-separated: llamacpp, mlx (empty: tinyvllm only)")
  ap.add_argument("--concurrency", default="1,8", help="comma-separated max concurrency levels")
  ap.add_argument("--num-prompts", type=int, default=32)
  ap.add_argument("--input-len", type=int, default=128)
  ap.add_argument("--output-len", type=int, default=64)
  ap.add_argument("--tinyvllm-args", default="", help="extra flags for python -m tinyvllm.serve")
  ap.add_argument("--llama-server", type=Path, default=None, help="a llama-server binary (default: build one, once)")
  ap.add_argument("--json", type=Path, default=None)
  args = ap.parse_args()
  args.concurrency = [int(x) for x in args.concurrency.split(",")]
  from tinyvllm.bench.serve import print_table
  from tinyvllm.model.tokenizer import load_tokenizer
  from tinyvllm.model.weights import resolve_model
  gguf = resolve_model(args.model)
  tokenizer = load_tokenizer(gguf)
  seed = time.time_ns() % 2**32   # fresh prompts every run
  rows, notes = [], []
  with tempfile.TemporaryDirectory() as tmp:
    for name in ["tinyvllm"] + [p for p in args.peers.split(",") if p]:
      try: server = start(name, gguf, args, Path(tmp))
      except (RuntimeError, subprocess.CalledProcessError, FileNotFoundError) as e:
        notes.append(f"{name} skipped: {str(e).splitlines()[0]}")
        continue
      try:
        for c in args.concurrency: rows.append(measure(server, args, c, seed + c, tokenizer))
      finally: server.stop()
  print(f"\n{args.num_prompts} requests per row, {args.input_len}-token random prompts, {args.output_len} output tokens, "
        f"{os.cpu_count()} cores, model {gguf.name}")
  print_table(rows)
  for n in notes: print(f"note: {n}")
  for c in args.concurrency:
    ours = next((r for r in rows if r["server"] == "tinyvllm" and r["max_concurrency"] == c), None)
    peers = [r for r in rows if r["server"] != "tinyvllm" and r["max_concurrency"] == c and r["completed"]]
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
