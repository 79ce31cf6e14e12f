"""`python -m tinyvllm.serve`: the OpenAI-compatible server (tinyvllm/entrypoints/openai/api_server.py)."""
import sys
from tinyvllm.entrypoints.openai.api_server import main

if __name__ == "__main__":
  sys.exit(main())
