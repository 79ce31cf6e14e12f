"""The records that cross the engine's three stages, in the order data flows:

  input processing --EngineRequest--> engine core --CoreOutput--> output processing --RequestOutput--> caller

Plain data: no tokenizer, no tensors. They also cross threads (a caller thread processes the input, the engine
thread runs the core), so nothing here is shared mutable state except the request's `metrics`, whose fields the
stages fill in turn (see `RequestMetrics`).
"""
from __future__ import annotations
from dataclasses import dataclass, field
from typing import TYPE_CHECKING
from tinyvllm.outputs import RequestMetrics
from tinyvllm.sampling_params import SamplingParams

if TYPE_CHECKING: from tinyvllm.structured_output import Grammar

TopLogprobs = list[tuple[int, float, int]]   # (token id, logprob, rank) for the top-k tokens and the chosen one


@dataclass
class EngineRequest:
  """A validated request: token ids known to fit the model, parameters checked against its vocabulary."""
  request_id: str
  prompt: str | None
  prompt_token_ids: list[int]
  params: SamplingParams
  metrics: RequestMetrics
  grammar: Grammar | None = None                    # params.structured_outputs, compiled and checked


@dataclass
class CoreOutput:
  """What one step did to one completion (sequence) of a request."""
  request_id: str
  index: int                                        # which of the request's n completions
  new_token_ids: list[int] = field(default_factory=list)
  new_logprobs: list[TopLogprobs] | None = None     # one entry per new token, when the request asked for logprobs
  prompt_logprobs: list[TopLogprobs] | None = None  # entries for prompt positions read this step (index 0 only)
  finish_reason: str | None = None                  # "stop" | "length" | "abort" | "error"
  stop_reason: int | str | None = None
  error: str | None = None                          # set with finish_reason "error"


@dataclass
class SchedulerStats:
  """The engine's state after a step and what the step did (for metrics)."""
  num_running: int = 0
  num_waiting: int = 0
  kv_cache_usage: float = 0.0                       # referenced blocks / all blocks
  num_preemptions: int = 0                          # in this step
  prefix_cache_queries: int = 0                     # tokens of the sequences admitted in this step
  prefix_cache_hits: int = 0                        # of those, tokens found in the prefix cache
  num_draft_tokens: int = 0                         # speculative decoding, in this step
  num_accepted_tokens: int = 0
  num_decode_passes: int = 1                        # passes of the step's decodes (multi-step decoding: several)
