"""tinyvllm: a vLLM-class LLM inference engine for Apple Silicon, on tinygrad."""
from tinyvllm.llm import LLM
from tinyvllm.sampling_params import SamplingParams
from tinyvllm.outputs import CompletionOutput, Logprob, RequestOutput

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob"]
