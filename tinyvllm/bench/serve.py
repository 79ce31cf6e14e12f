"""`python -m tinyvllm.bench.serve --base-url URL`: load any OpenAI-compatible server and measure it as
`vllm bench serve` does.

Streamed completions (`stream_options.include_usage`, `ignore_eos`) sent at a fixed concurrency or with Poisson
arrivals at a given rate. Prompts are random token ids of the model's tokenizer, decoded, fresh for every run
(`--seed` to repeat them), in one of three datasets:
  random  independent prompts of --input-len tokens: no server's prompt cache can help;
  prefix  vLLM's prefix_repetition: --num-prefixes shared prefixes of --prefix-len tokens, each request one of them
          plus its own --input-len tokens (a shared system prompt or few-shot template);
  chat    multi-turn: --num-prompts conversations of --num-turns turns; each turn resends the whole conversation
          (earlier turns and the server's answers) plus --input-len new tokens, as a chat client does.
Reports request and token throughput, and per request TTFT (send to first token), TPOT ((latency - TTFT) / (output
tokens - 1)), ITL (gaps between streamed chunks, over all requests) and end-to-end latency: mean, median, p99
(chat: TTFT of first and later turns apart). Prints a table; --json writes the record.
"""
from __future__ import annotations
import argparse, asyncio, json, sys, time
from dataclasses import dataclass, field
from pathlib import Path
import numpy as np


@dataclass
class RequestResult:
  ok: bool = False
  error: str | None = None
  prompt_tokens: int = 0
  output_tokens: int = 0
  start: float = 0.0
  ttft: float | None = None          # seconds from sending to the first streamed token
  latency: float = 0.0               # seconds from sending to the end of the stream
  chunk_times: list[float] = field(default_factory=list)   # arrival of every chunk that carried text
  text: str = ""                     # the streamed completion
  turn: int = 0                      # chat dataset: which turn of its conversation


async def stream_completion(client, url: str, model: str, prompt: str, max_tokens: int) -> RequestResult:
  """One streamed /v1/completions request; token counts from the usage chunk."""
  body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
          "stream_options": {"include_usage": True}, "ignore_eos": True}
  res = RequestResult(start=time.perf_counter())
  try:
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
      if r.status_code != 200:
        res.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:200]}"
        return res
      async for line in r.aiter_lines():
        if not line.startswith("data:"): continue      # blank lines and ":" keep-alive comments
        data = line[5:].strip()
        if data == "[DONE]": break
        chunk = json.loads(data)
        now = time.perf_counter()
        if chunk.get("error"): res.error = str(chunk["error"]); return res
        if chunk.get("usage"): res.prompt_tokens, res.output_tokens = chunk["usage"]["prompt_tokens"], chunk["usage"]["completion_tokens"]
        if text := "".join(c.get("text") or "" for c in chunk.get("choices") or []):
          if res.ttft is None: res.ttft = now - res.start
          res.chunk_times.append(now)
          res.text += text
    res.latency = time.perf_counter() - res.start
    res.ok = res.ttft is not None
    if not res.ok: res.error = "no tokens streamed"
  except Exception as e:   # a connection refused or reset counts as a failed request, not a crashed benchmark
    res.error = f"{type(e).__name__}: {e}"
  return res


async def run_load(url: str, model: str, prompts: list[str], max_tokens: int, concurrency: int | None,
                   rate: float | None, seed: int, progress=None) -> tuple[list[RequestResult], float]:
  """Send every prompt: at most `concurrency` in flight, arrivals Poisson at `rate` per second (None: all at once).
  Returns the results in prompt order and the wall time from the first send to the last response."""
  import httpx
  rng = np.random.default_rng(seed)
  gaps = rng.exponential(1 / rate, len(prompts)) if rate else np.zeros(len(prompts))
  limit = asyncio.Semaphore(concurrency or len(prompts))
  async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=httpx.Limits(max_connections=None)) as client:
    async def one(prompt: str) -> RequestResult:
      async with limit:
        res = await stream_completion(client, url, model, prompt, max_tokens)
      if progress: progress.update(1)
      return res
    start, tasks = time.perf_counter(), []
    for prompt, gap in zip(prompts, gaps):
      if gap: await asyncio.sleep(gap)
      tasks.append(asyncio.ensure_future(one(prompt)))
    results = await asyncio.gather(*tasks)
  return list(results), time.perf_counter() - start


async def run_conversations(url: str, model: str, conversations: list[list[str]], max_tokens: int,
                            concurrency: int | None, progress=None) -> tuple[list[RequestResult], float]:
  """Multi-turn chat over /v1/completions: each turn's prompt is the conversation so far (every earlier user
  text and answer) plus the turn's user text. At most `concurrency` conversations run at once; the turns of one
  conversation follow each other."""
  import httpx
  limit = asyncio.Semaphore(concurrency or len(conversations))
  async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=httpx.Limits(max_connections=None)) as client:
    async def converse(turns: list[str]) -> list[RequestResult]:
      history, results = "", []
      async with limit:
        for i, user in enumerate(turns):
          res = await stream_completion(client, url, model, history + user, max_tokens)
          res.turn = i
          results.append(res)
          history += user + res.text
          if progress: progress.update(1)
      return results
    start = time.perf_counter()
    per_conversation = await asyncio.gather(*(converse(t) for t in conversations))
  return [r for rs in per_conversation for r in rs], time.perf_counter() - start


def summarize(results: list[RequestResult], duration: float) -> dict:
  """vLLM's serving metrics over the completed requests (times in ms)."""
  done = [r for r in results if r.ok]
  out_tokens = sum(r.output_tokens for r in done)
  in_tokens = sum(r.prompt_tokens for r in done)
  ttft = [r.ttft * 1e3 for r in done]
  tpot = [(r.latency - r.ttft) * 1e3 / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
  itl = [(b - a) * 1e3 for r in done for a, b in zip(r.chunk_times, r.chunk_times[1:])]
  e2e = [r.latency * 1e3 for r in done]
  rec = {"completed": len(done), "failed": len(results) - len(done), "duration_s": duration,
         "errors": sorted({r.error for r in results if not r.ok})[:5],
         "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
         "request_throughput": len(done) / duration, "output_throughput": out_tokens / duration,
         "total_token_throughput": (in_tokens + out_tokens) / duration}
  later = [r.ttft * 1e3 for r in done if r.turn > 0]
  if later:   # chat: the first turn has nothing to reuse, later turns resend the conversation
    rec |= {"median_ttft_first_turn_ms": float(np.median([r.ttft * 1e3 for r in done if r.turn == 0])),
            "median_ttft_later_turns_ms": float(np.median(later))}
  for name, xs in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2el", e2e)):
    rec |= {f"mean_{name}_ms": float(np.mean(xs)) if xs else None, f"median_{name}_ms": float(np.median(xs)) if xs else None,
            f"p99_{name}_ms": float(np.percentile(xs, 99)) if xs else None}
  return rec


def random_prompts(tokenizer, n: int, length: int, rng: np.random.Generator) -> list[str]:
  """`n` prompts of about `length` tokens: random ids of the tokenizer's ordinary vocabulary, decoded."""
  ordinary = [i for i in range(tokenizer.vocab_size) if not tokenizer.is_special(i)]
  ordinary = ordinary[min(100, len(ordinary) // 4):]   # the lowest ids are often control and byte tokens
  return [tokenizer.decode(rng.choice(ordinary, length).tolist()) for _ in range(n)]


def prefix_prompts(tokenizer, n: int, num_prefixes: int, prefix_len: int, suffix_len: int, rng: np.random.Generator) -> list[str]:
  """`n` prompts, request i starting with shared prefix i mod `num_prefixes` and ending with its own suffix."""
  prefixes = random_prompts(tokenizer, num_prefixes, prefix_len, rng)
  return [prefixes[i % num_prefixes] + s for i, s in enumerate(random_prompts(tokenizer, n, suffix_len, rng))]


def chat_turns(tokenizer, conversations: int, turns: int, turn_len: int, rng: np.random.Generator) -> list[list[str]]:
  """The user texts of each conversation's turns (the answers come from the server)."""
  return [random_prompts(tokenizer, turns, turn_len, rng) for _ in range(conversations)]


def run_dataset(url: str, model: str, tokenizer, args, seed: int, progress=None) -> tuple[list[RequestResult], float]:
  """One run of `args.dataset` (the fields of `parser()`), with prompts drawn from `seed`."""
  rng = np.random.default_rng(seed)
  if args.dataset == "chat":
    conversations = chat_turns(tokenizer, args.num_prompts, args.num_turns, args.input_len, rng)
    return asyncio.run(run_conversations(url, model, conversations, args.output_len, args.max_concurrency, progress))
  prompts = prefix_prompts(tokenizer, args.num_prompts, args.num_prefixes, args.prefix_len, args.input_len, rng) \
    if args.dataset == "prefix" else random_prompts(tokenizer, args.num_prompts, args.input_len, rng)
  return asyncio.run(run_load(url, model, prompts, args.output_len, args.max_concurrency, args.request_rate, seed, progress))


def num_requests(args) -> int: return args.num_prompts * (args.num_turns if args.dataset == "chat" else 1)


def print_table(rows: list[dict], file=sys.stdout) -> None:
  cols = [("server", "{}", 14), ("concurrency", "{}", 11), ("rate", "{}", 6), ("ok", "{}", 4), ("req/s", "{:.2f}", 7),
          ("out tok/s", "{:.1f}", 9), ("TTFT p50", "{:.0f}", 9), ("TTFT p99", "{:.0f}", 9), ("TPOT p50", "{:.1f}", 9),
          ("TPOT p99", "{:.1f}", 9), ("ITL p50", "{:.1f}", 8), ("ITL p99", "{:.1f}", 8)]
  keys = {"server": "server", "concurrency": "max_concurrency", "rate": "request_rate", "ok": "completed", "req/s": "request_throughput",
          "out tok/s": "output_throughput", "TTFT p50": "median_ttft_ms", "TTFT p99": "p99_ttft_ms", "TPOT p50": "median_tpot_ms",
          "TPOT p99": "p99_tpot_ms", "ITL p50": "median_itl_ms", "ITL p99": "p99_itl_ms"}
  print("  ".join(f"{name:>{w}}" for name, _, w in cols) + "   (times in ms)", file=file)
  for row in rows:
    cells = []
    for name, fmt, w in cols:
      v = row.get(keys[name])
      cells.append(f"{'-' if v is None else fmt.format(v) if not isinstance(v, str) else v:>{w}}")
    print("  ".join(cells), file=file)


def parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="python -m tinyvllm.bench.serve", description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--base-url", required=True, help="the server, e.g. http://127.0.0.1:8000")
  p.add_argument("--model", default=None, help="the model name to send (default: the first of the server's /v1/models)")
  p.add_argument("--tokenizer", default=None, help="model whose tokenizer makes the prompts (default: tinyvllm's default model)")
  p.add_argument("--dataset", choices=("random", "prefix", "chat"), default="random", help="see above")
  p.add_argument("--num-prompts", type=int, default=32, help="requests (chat: conversations)")
  p.add_argument("--input-len", type=int, default=128, help="prompt tokens (prefix: after the prefix; chat: new tokens per turn)")
  p.add_argument("--num-prefixes", type=int, default=4, help="prefix dataset: distinct shared prefixes")
  p.add_argument("--prefix-len", type=int, default=1000, help="prefix dataset: tokens of each shared prefix")
  p.add_argument("--num-turns", type=int, default=4, help="chat dataset: turns per conversation")
  p.add_argument("--output-len", type=int, default=64, help="tokens generated per request (ignore_eos)")
  p.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most (default: no limit)")
  p.add_argument("--request-rate", type=float, default=None, help="Poisson arrivals per second (default: all at once)")
  p.add_argument("--seed", type=int, default=None, help="prompt seed (default: a fresh one, so no prompt cache helps)")
  p.add_argument("--label", default=None, help="name of the server in the table (default: the base URL)")
  p.add_argument("--json", type=Path, default=None, help="write the record here")
  return p


def main(argv: list[str] | None = None) -> dict:
  args = parser().parse_args(argv)
  import httpx
  from tqdm import tqdm
  from tinyvllm.model.tokenizer import load_tokenizer
  from tinyvllm.model.weights import resolve_model
  url = args.base_url.rstrip("/")
  model = args.model or httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
  seed = args.seed if args.seed is not None else time.time_ns() % 2**32
  tokenizer = load_tokenizer(resolve_model(args.tokenizer))
  with tqdm(total=num_requests(args), desc=f"requests to {args.label or url}", file=sys.stderr) as bar:
    results, duration = run_dataset(url, model, tokenizer, args, seed, bar)
  rec = {"server": args.label or url, "model": model} | workload(args) | {"seed": seed} | summarize(results, duration)
  print_table([rec])
  if rec["errors"]: print(f"errors: {rec['errors']}", file=sys.stderr)
  if args.json: args.json.write_text(json.dumps(rec, indent=1) + "\n")
  return rec


def workload(args) -> dict:
  """The fields of a record that describe the load."""
  rec = {"dataset": args.dataset, "num_prompts": args.num_prompts, "input_len": args.input_len, "output_len": args.output_len,
         "max_concurrency": args.max_concurrency, "request_rate": args.request_rate}
  if args.dataset == "prefix": rec |= {"num_prefixes": args.num_prefixes, "prefix_len": args.prefix_len}
  if args.dataset == "chat": rec |= {"num_turns": args.num_turns}
  return rec


if __name__ == "__main__":
  main()
