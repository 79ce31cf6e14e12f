"""What the real-size benches share: Llama-3.2-1B and Llama-3.1-8B dimensions, and timing a load in a fresh process
while a thread samples its resident memory (bench/loading.py, bench/kquant.py)."""
from __future__ import annotations
import json, os, subprocess, sys
from pathlib import Path

SHAPES = {   # hidden, layers, heads, kv heads, intermediate, vocab, tied embeddings
  "1b": (2048, 16, 32, 8, 8192, 128256, True),
  "8b": (4096, 32, 32, 8, 14336, 128256, False),
  "tiny": (256, 2, 4, 2, 512, 4096, False),   # for counts that need a model but not its size (bench/prefill_packing.py)
}

# `IMPORTS` run before the baseline is read (a library's own memory is not the model's); `LOAD` is timed while a thread
# samples RSS every millisecond; `EXTRAS` is a dict expression added to the JSON line the child prints
_CHILD = r"""
import json, sys, threading, time
def rss(): return int(open("/proc/self/statm").read().split()[1]) * 4096
IMPORTS
base, peak, done = rss(), [0], []
def watch():
  while not done: peak[0] = max(peak[0], rss()); time.sleep(0.001)
watcher = threading.Thread(target=watch, daemon=True); watcher.start()
t = time.perf_counter()
LOAD
seconds = time.perf_counter() - t
done.append(1); watcher.join()
print(json.dumps({"load_seconds": seconds, "peak_rss_bytes": peak[0] - base, "rss_after_bytes": rss() - base, **(EXTRAS)}))
"""


def write_word_tokenizer(path: Path, vocab_size: int) -> None:
  """A word-level tokenizer of `vocab_size` tokens "<t0>" .. (BOS <t0>, EOS <t1>) beside a random checkpoint: the
  benches feed token ids, the engine only needs a tokenizer to load."""
  from tokenizers import Tokenizer, models, pre_tokenizers
  tok = Tokenizer(models.WordLevel({f"<t{i}>": i for i in range(vocab_size)}, unk_token="<t0>"))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  tok.save(str(path / "tokenizer.json"))
  (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<t0>", "eos_token": "<t1>"}))


def measure_load(path: Path, imports: str, load: str, extras: str = "{}", env: dict | None = None) -> dict:
  """Seconds and peak RSS (above the process's before loading) of running `load` on `path` (`sys.argv[1]` in the child)
  in a fresh Python process."""
  script = _CHILD.replace("IMPORTS", imports.strip()).replace("LOAD", load.strip()).replace("EXTRAS", extras)
  r = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, text=True, env=os.environ | (env or {}))
  if r.returncode != 0: sys.exit(f"{sys.argv[0]}: loading {path} failed:\n{r.stderr[-3000:]}")
  return json.loads(r.stdout.strip().splitlines()[-1])
