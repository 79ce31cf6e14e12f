"""bench/gpu_session.sh's model, written on the GPU machine (it has no network and this repo carries no weights):

  python bench/gpu_session.py DIR    # a Llama-3.2-1B-shaped float16 checkpoint with random weights in DIR"""
from __future__ import annotations
import sys
from pathlib import Path

if __name__ == "__main__":
  if len(sys.argv) != 2: sys.exit(__doc__)
  sys.path.insert(0, str(Path(__file__).resolve().parent))
  from loading import write_checkpoint
  write_checkpoint(Path(sys.argv[1]), "1b")
