"""Model families side by side: what a family's extra parts cost, and what freeing out-of-window KV blocks saves.

  python bench/families.py [--steps 32] [--repeats 3] [--json out.json]

decode    batch-1 and batch-8 decode tok/s (128-token prompts) of random float32 checkpoints of SmolLM2-135M's shape
          (hidden 576, 30 layers, 9 heads / 3 KV heads of 64, FFN 1536, vocabulary 49152) as a Llama, a Qwen3 (q/k
          norms), a Gemma 3 (q/k norms, post-norms, GeGLU, scaled embeddings, five 512-key windowed layers to each
          global one, two RoPE tables) and a Mistral (a 4096-key window, wider than the context: its cost is the
          window's bookkeeping), in one process, the families in turn for --repeats rounds (medians); the ratio column is
          family / Llama
window    one long chat on the Mistral-shaped model with a 256-key window: a 2048-token prompt and 64 generated tokens,
          the KV blocks it holds at most, with the blocks its window has passed handed back (the default) and kept
          (the same engine with freeing off): bytes of KV cache held, and the ratio
"""
from __future__ import annotations
import argparse, json, os, statistics, sys, time
from pathlib import Path
from real_size import write_word_tokenizer

SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
             num_key_value_heads=3, head_dim=64, max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=100000.0,
             tie_word_embeddings=True, bos_token_id=0, eos_token_id=1)
FAMILIES = {"llama": ("llama", {}), "qwen3": ("qwen3", {}), "gemma3": ("gemma3_text", {"sliding_window": 512, "query_pre_attn_scalar": 64}),
            "mistral": ("mistral", {"sliding_window": 4096}), "mistral-w256": ("mistral", {"sliding_window": 256})}


def write_checkpoint(path: Path, model_type: str, overrides: dict) -> Path:
  """A random float32 checkpoint written by transformers (its own init), once."""
  if (path / "model.safetensors").exists(): return path
  import torch
  from transformers import AutoConfig, AutoModelForCausalLM
  torch.manual_seed(0)
  AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **SHAPE, **overrides)).save_pretrained(path)
  write_word_tokenizer(path, SHAPE["vocab_size"])
  return path


def decode_rate(path: Path, batch: int, steps: int, prompt_len: int = 128) -> float:
  """Tokens per second over `steps` decode steps of `batch` sequences, after their prompts are read and a warm-up step."""
  import numpy as np
  from tinyvllm import SamplingParams
  from tinyvllm.engine.llm_engine import LLMEngine
  engine = LLMEngine.from_kwargs(str(path), max_model_len=prompt_len + steps + 8, max_num_batched_tokens=1024)
  rng = np.random.default_rng(0)
  params = SamplingParams(max_tokens=steps + 2, temperature=0, ignore_eos=True)
  for i in range(batch): engine.add_request(str(i), {"prompt_token_ids": rng.integers(2, SHAPE["vocab_size"], prompt_len).tolist()}, params)
  while any(s.is_prefilling for s in engine.core.scheduler.running) or engine.core.scheduler.waiting: engine.step()
  engine.step()   # the first decode step of this shape captures its replay
  t = time.perf_counter()
  for _ in range(steps): engine.step()
  return batch * steps / (time.perf_counter() - t)


def window_chat(path: Path, free_blocks: bool, prompt_len: int = 2048, new_tokens: int = 64) -> dict:
  import numpy as np
  from tinyvllm import SamplingParams
  from tinyvllm.engine.llm_engine import LLMEngine
  engine = LLMEngine.from_kwargs(str(path), block_size=16, max_model_len=prompt_len + new_tokens + 16)
  if not free_blocks: engine.core.scheduler.window = None   # the same engine, blocks kept
  prompt = np.random.default_rng(1).integers(2, SHAPE["vocab_size"], prompt_len).tolist()
  engine.add_request("0", {"prompt_token_ids": prompt}, SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True))
  bm, peak = engine.core.block_manager, 0
  while engine.has_unfinished_requests():
    for out in engine.step(): pass
    peak = max(peak, bm.num_blocks - bm.num_free)
  cfg = engine.model_config
  block_bytes = 2 * cfg.num_hidden_layers * 16 * cfg.num_key_value_heads * cfg.head_dim * 4
  return {"peak_blocks": peak, "peak_kv_bytes": peak * block_bytes, "tokens": out.outputs[0].token_ids}


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--steps", type=int, default=32)
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--dir", type=Path, default=Path(os.environ.get("TINYVLLM_CACHE", Path.home() / ".cache" / "tinyvllm")) / "bench")
  ap.add_argument("--json", type=Path, default=None)
  args = ap.parse_args()
  from tqdm import tqdm
  paths = {name: write_checkpoint(args.dir / f"family-{name}", *spec) for name, spec in tqdm(FAMILIES.items(), desc="checkpoints", file=sys.stderr)}
  # the families in turn, --repeats rounds, each figure the median of its rounds: drift on a shared machine hits
  # every family alike
  runs = [(r, name, b) for r in range(args.repeats) for name in ("llama", "qwen3", "gemma3", "mistral") for b in (1, 8)]
  rates: dict[tuple[str, int], list[float]] = {}
  for _, name, b in tqdm(runs, desc="decode", file=sys.stderr): rates.setdefault((name, b), []).append(decode_rate(paths[name], b, args.steps))
  rows = [{"family": name, "batch": b, "tok_s": statistics.median(r), "runs": r} for (name, b), r in rates.items()]
  base = {r["batch"]: r["tok_s"] for r in rows if r["family"] == "llama"}
  print(f"{'family':<10}{'batch':>6}{'tok/s':>10}{'vs llama':>10}")
  for r in rows:
    r["vs_llama"] = r["tok_s"] / base[r["batch"]]
    print(f"{r['family']:<10}{r['batch']:>6}{r['tok_s']:>10.1f}{r['vs_llama']:>10.3f}")
  freed, kept = (window_chat(paths["mistral-w256"], f) for f in (True, False))
  print(f"\nwindow 256, 2048-token prompt + 64 tokens: peak KV blocks held {freed['peak_blocks']} (freed) vs {kept['peak_blocks']} "
        f"(kept): {freed['peak_kv_bytes'] / 1e6:.1f} vs {kept['peak_kv_bytes'] / 1e6:.1f} MB, "
        f"{freed['peak_kv_bytes'] / kept['peak_kv_bytes']:.3f}x; same tokens: {freed['tokens'] == kept['tokens']}")
  if args.json:
    args.json.write_text(json.dumps({"decode": rows, "window": {"freed": freed, "kept": kept}}, indent=1))


if __name__ == "__main__":
  main()
