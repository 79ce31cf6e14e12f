"""StructuredOutputsParams -> a validated, compiled grammar, in input processing (the caller's thread).

A schema, regex or grammar that llguidance refuses raises ValueError naming the field and the problem here, when
the request is added, so a bad request never reaches the engine core and never fails mid-batch. Compiled grammars
are kept by their text: clients send the same schema request after request."""
from __future__ import annotations
import json, threading
from collections import OrderedDict
from dataclasses import dataclass
import llguidance
from tinyvllm.model.tokenizer import Tokenizer
from tinyvllm.sampling_params import StructuredOutputsParams
from tinyvllm.structured_output.state import GrammarState
from tinyvllm.structured_output.vocabulary import llguidance_tokenizer


@dataclass(frozen=True)
class StructuredOutputConfig:
  cache_size: int = 64                 # compiled grammars kept, least recently used dropped first
  log_level: int = 0                   # llguidance's own logging (0: silent; errors come back as ValueError anyway)


class Grammar:
  """A compiled constraint. It holds a matcher at the grammar's start, never advanced; each sequence that uses the
  grammar gets a copy of it (`new_state`), so n completions and repeated requests share one compilation."""
  def __init__(self, kind: str, matcher: llguidance.LLMatcher, vocab_size: int, eos_ids: frozenset[int]):
    self.kind, self._start, self._vocab_size, self._eos_ids = kind, matcher, vocab_size, eos_ids

  def new_state(self) -> GrammarState: return GrammarState(self._start.deep_copy(), self._vocab_size, self._eos_ids)


class GrammarCompiler:
  """Compiles constraints for one model: its tokenizer, over its `vocab_size` logits. Safe to use from several
  threads (input processing runs in each caller's)."""
  def __init__(self, tokenizer: Tokenizer, vocab_size: int, config: StructuredOutputConfig = StructuredOutputConfig()):
    self.tokenizer, self.vocab_size, self.config = tokenizer, vocab_size, config
    self._llg_tokenizer: llguidance.LLTokenizer | None = None    # built with the first constraint (~0.1 s)
    self._cache: OrderedDict[tuple, Grammar] = OrderedDict()
    self._lock = threading.Lock()

  def compile(self, params: StructuredOutputsParams) -> Grammar:
    """The grammar of `params`, compiled and checked against this tokenizer. Raises ValueError naming the
    field (structured_outputs.json, .regex, .choice, .grammar) and what llguidance found wrong."""
    key = _cache_key(params)
    with self._lock:
      if key in self._cache:
        self._cache.move_to_end(key)
        return self._cache[key]
      if self._llg_tokenizer is None: self._llg_tokenizer = llguidance_tokenizer(self.tokenizer, self.vocab_size)
    # compiled outside the lock: llguidance releases the GIL while it builds, so other callers go on meanwhile
    matcher = llguidance.LLMatcher(self._llg_tokenizer, grammar_text(params), log_level=self.config.log_level)
    if matcher.is_error():
      raise ValueError(f"structured_outputs.{params.kind}: {_WHAT[params.kind]}: {matcher.get_error().strip()}")
    grammar = Grammar(params.kind, matcher, self.vocab_size, frozenset(t for t in self.tokenizer.eos_token_ids if t < self.vocab_size))
    with self._lock:
      self._cache[key] = grammar
      while len(self._cache) > self.config.cache_size: self._cache.popitem(last=False)
    return grammar


_WHAT = {"json": "invalid JSON schema", "json_object": "invalid JSON object grammar", "regex": "invalid regular expression",
         "choice": "invalid choices", "grammar": "invalid grammar"}


def grammar_text(params: StructuredOutputsParams) -> str:
  """llguidance's grammar text for one constraint (not yet checked: building the matcher checks it).

  JSON follows vLLM's guidance backend: whitespace between tokens is free unless `disable_any_whitespace`, and a
  schema may carry llguidance's own options under "x-guidance" (they override these)."""
  kind = params.kind
  try:
    if kind in ("json", "json_object"):
      options: dict = {"whitespace_flexible": not params.disable_any_whitespace}
      if params.whitespace_pattern is not None: options["whitespace_pattern"] = params.whitespace_pattern
      return llguidance.LLMatcher.grammar_from_json_schema(params.schema, defaults=options)
    if kind == "regex": return llguidance.LLMatcher.grammar_from_regex(params.regex)
    if kind == "choice": return llguidance.grammar_from("choice", params.choice)
    return llguidance.grammar_from("grammar", params.grammar)   # Lark, or GBNF (converted to Lark)
  except ValueError as e:
    raise ValueError(f"structured_outputs.{kind}: {_WHAT[kind]}: {e}") from None


def _cache_key(params: StructuredOutputsParams) -> tuple:
  kind = params.kind
  spec = json.dumps(params.schema, sort_keys=True) if kind in ("json", "json_object") else \
    json.dumps(params.choice) if kind == "choice" else getattr(params, kind)
  return kind, spec, params.disable_any_whitespace, params.whitespace_pattern
