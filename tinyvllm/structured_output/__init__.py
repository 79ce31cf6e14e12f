"""Structured output: sampling constrained to a JSON schema, a regex, a list of choices or a grammar (llguidance).

  input processing  GrammarCompiler.compile(params.structured_outputs) -> Grammar, checked (ValueError naming the
                    problem) before the request is queued
  engine core       Grammar.new_state() -> a GrammarState per sequence; MaskWorker computes a step's masks (on a
                    thread while the model runs, when the step leaves a core idle: MaskPolicy); apply_bias before
                    penalties, temperature, top-k/p/min-p and logprobs; the scheduler's commit point advances each
                    state with the tokens it kept
  speculation       drafts are sampled under the masks along the drafted run (GrammarState.mask_after), the
                    target's rows masked the same way; the commit point rolls the matcher back over rejected drafts

Modules: vocabulary (our tokenizer as llguidance sees it), compiler, state, bitmask. docs/structured-output.md.
"""
from tinyvllm.structured_output.bitmask import (MaskPolicy, MaskWorker, PendingMasks, allowed_tokens, apply_bias,
                                                bias_from_bitmask, mask_words)
from tinyvllm.structured_output.compiler import Grammar, GrammarCompiler, StructuredOutputConfig, grammar_text
from tinyvllm.structured_output.state import GrammarState

__all__ = ["Grammar", "GrammarCompiler", "GrammarState", "MaskPolicy", "MaskWorker", "PendingMasks", "StructuredOutputConfig",
           "allowed_tokens", "apply_bias", "bias_from_bitmask", "grammar_text", "mask_words"]
