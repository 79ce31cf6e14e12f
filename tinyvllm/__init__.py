"""tinyvllm: a vLLM-class LLM inference engine for Apple Silicon, on tinygrad."""
import importlib, os

if os.environ.get("TINYVLLM_EMULATE_METAL") == "1":   # tinygrad's METAL device through our MSL emulator (no Mac needed)
  from tinyvllm.kernels.emulator.metal_device import install
  install()

__version__ = "0.1.0"
__all__ = ["LLM", "AsyncLLM", "SamplingParams", "StructuredOutputsParams", "RequestOutputKind", "RequestOutput", "CompletionOutput",
           "Logprob", "GenerationError"]
_HOMES = {"LLM": "tinyvllm.llm", "AsyncLLM": "tinyvllm.engine.async_llm", "SamplingParams": "tinyvllm.sampling_params",
          "StructuredOutputsParams": "tinyvllm.sampling_params", "RequestOutputKind": "tinyvllm.sampling_params", "RequestOutput": "tinyvllm.outputs",
          "CompletionOutput": "tinyvllm.outputs", "Logprob": "tinyvllm.outputs", "GenerationError": "tinyvllm.outputs"}


def __getattr__(name: str):
  """Import on first use: command lines answer --help and argument errors without loading tinygrad."""
  if name in _HOMES: return getattr(importlib.import_module(_HOMES[name]), name)
  raise AttributeError(f"module 'tinyvllm' has no attribute {name!r}")
