"""tinyvllm: a vLLM-class LLM inference engine for Apple Silicon, on tinygrad."""
from tinyvllm.llm import LLM
from tinyvllm.engine.async_llm import AsyncLLM
from tinyvllm.sampling_params import SamplingParams
from tinyvllm.outputs import CompletionOutput, Logprob, RequestOutput

__all__ = ["LLM", "AsyncLLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob"]
