"""`python -m tinyvllm.bench`: tok/s and the fraction of the memory-bandwidth roofline, with peers beside.

  accounting.py  bytes and FLOPs per step from the model config and its tensors (pure functions)
  device.py      measured bandwidth and matmul rate; Apple chips' published bandwidth
  runs.py        decode, prefill and serving runs driving LLMEngine
  peers.py       transformers and llama.cpp on the same model
  report.py      records, the terminal table, JSON, the roofline plot
  cli.py         the command line
"""
