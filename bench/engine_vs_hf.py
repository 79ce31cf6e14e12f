"""SmolLM2-135M: tinyvllm vs HF transformers, now a preset of `python -m tinyvllm.bench` (see docs/benchmarks.md).

  python bench/engine_vs_hf.py [more tinyvllm.bench flags]

runs decode at batch 1 and 8 (32-token prompts) and a 512-token prefill, in tinyvllm and transformers, and
writes bench/results/engine_vs_hf.json. Flags given here are appended and win over the preset.
"""
from __future__ import annotations
import sys
from tinyvllm.bench.cli import main

PRESET = ["--runs", "decode,prefill", "--batch-sizes", "1,8", "--context-lens", "32", "--steps", "64",
          "--prefill-lens", "512", "--peers", "hf", "--json", "bench/results/engine_vs_hf.json"]

if __name__ == "__main__":
  main(PRESET + sys.argv[1:])
