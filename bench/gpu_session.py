"""bench/gpu_session.sh's model, written on the GPU machine (it has no network and this repo carries no weights):

  python bench/gpu_session.py DIR [8b]   # a Llama-3.2-1B-shaped (or 3.1-8B-shaped) float16 checkpoint, random weights"""
from __future__ import annotations
import sys
from pathlib import Path

if __name__ == "__main__":
  if len(sys.argv) not in (2, 3): sys.exit(__doc__)
  sys.path.insert(0, str(Path(__file__).resolve().parent))
  from loading import write_checkpoint
  write_checkpoint(Path(sys.argv[1]), sys.argv[2] if len(sys.argv) == 3 else "1b")
