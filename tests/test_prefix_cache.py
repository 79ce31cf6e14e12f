"""Automatic prefix caching end to end: outputs are those of the same engine with caching off (greedy and seeded;
under eviction pressure, preemption, speculative decoding, n > 1, a fully cached prompt), hits are counted exactly,
and the model runner reads only what the cache does not hold."""
from __future__ import annotations
import numpy as np
import pytest
from tinyvllm import LLM, SamplingParams
from tinyvllm.engine.llm_engine import LLMEngine

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, top_p=0.9, seed=11, max_tokens=16, ignore_eos=True)


def shared_prefix_prompts(n: int, prefix_len: int, seed: int = 0, suffix=(3, 20)) -> list[dict]:
  rng = np.random.default_rng(seed)
  prefix = rng.integers(4, 380, prefix_len).tolist()
  return [{"prompt_token_ids": prefix + rng.integers(4, 380, int(k)).tolist()} for k in rng.integers(*suffix, n)]


def token_ids(outs) -> list[list[int]]: return [c.token_ids for o in outs for c in o.outputs]


def run_twice(llm: LLM, prompts, params):
  """The prompts, then the same prompts again (now mostly cached)."""
  return llm.generate(prompts, params, use_tqdm=False), llm.generate(prompts, params, use_tqdm=False)


@pytest.fixture(scope="module")
def reference(tiny_model):
  llm = LLM(str(tiny_model), block_size=8, num_kv_blocks=256, max_num_batched_tokens=64, enable_prefix_caching=False)
  yield llm
  llm.shutdown()


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_outputs_equal_caching_off(tiny_model, reference, params):
  prompts = shared_prefix_prompts(6, 45)
  want = token_ids(reference.generate(prompts, params, use_tqdm=False))
  llm = LLM(str(tiny_model), block_size=8, num_kv_blocks=256, max_num_batched_tokens=64)
  first, second = run_twice(llm, prompts, params)
  assert token_ids(first) == want and token_ids(second) == want
  assert all(o.num_cached_tokens >= 40 for o in second)                 # the 45-token prefix: 5 full blocks of 8
  assert sum(o.num_cached_tokens for o in first) > 0                     # later prompts of the first batch hit too
  assert all(o.num_cached_tokens == 0 for o in reference.generate(prompts, params, use_tqdm=False))


def test_eviction_pressure_and_preemption(tiny_model, reference):
  """A pool far smaller than the distinct prompts (evictions every step) and too small for the batch (preemption):
  the same tokens as an unpressured engine without caching."""
  prompts = shared_prefix_prompts(6, 30, seed=1) + shared_prefix_prompts(6, 30, seed=2)
  params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
  want = token_ids(reference.generate(prompts, params, use_tqdm=False))
  small = LLM(str(tiny_model), block_size=8, num_kv_blocks=24, max_num_batched_tokens=64)
  first, second = run_twice(small, prompts, params)
  assert token_ids(first) == want and token_ids(second) == want
  preemptions, free, total = small.llm_engine.call(lambda e: (e.scheduler.num_preemptions, e.block_manager.num_free,
                                                               e.block_manager.num_blocks))
  assert preemptions > 0 and free == total
  small.shutdown()


def test_speculative_decoding_with_caching(tiny_model_factory, reference):
  """The draft's cache follows the target's rule: outputs unchanged, and a cached prompt is skipped by both."""
  target, draft = tiny_model_factory("gqa"), tiny_model_factory("gqa", seed=1)
  prompts = shared_prefix_prompts(5, 37, seed=3)
  want = token_ids(reference.generate(prompts, GREEDY, use_tqdm=False))
  llm = LLM(str(target), draft_model=str(draft), num_speculative_tokens=3, speculation="always", block_size=8,
            num_kv_blocks=128, max_num_batched_tokens=64)
  first, second = run_twice(llm, prompts, GREEDY)
  assert token_ids(first) == want and token_ids(second) == want and all(o.num_cached_tokens >= 32 for o in second)
  llm.shutdown()
  engine = LLMEngine.from_kwargs(str(target), draft_model=str(draft), num_speculative_tokens=3, speculation="always",
                                 block_size=8, num_kv_blocks=128)
  read = []
  for rid in ("a", "b"):
    draft_read = spy_prefill_tokens(engine, engine.spec.runner)
    engine.add_request(rid, prompts[0], GREEDY)
    while engine.has_unfinished_requests(): engine.step()
    read.append(sum(draft_read))
  n = len(prompts[0]["prompt_token_ids"]) + 1                          # the draft first reads at the first decode step
  assert read == [n, n - (n - 1) // 8 * 8]                              # the second time it reads the last block only


def test_n_completions_share_the_prompt(tiny_model, reference):
  """n = 3: completion 0 reads the prompt, completions 1 and 2 start from its cached blocks and read only the
  partial last block; their seeded tokens equal an engine without caching."""
  prompt = shared_prefix_prompts(1, 50, seed=4, suffix=(5, 6))[0]      # 55 tokens: 6 full blocks of 8, then 7
  params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=10, ignore_eos=True)
  want = token_ids(reference.generate(prompt, params, use_tqdm=False))
  engine = LLMEngine.from_kwargs(str(tiny_model_path(reference)), block_size=8, num_kv_blocks=128, max_num_batched_tokens=64)
  read = spy_prefill_tokens(engine)
  engine.add_request("r", prompt, params)
  while engine.has_unfinished_requests():
    for out in engine.step(): final = out
  assert token_ids([final]) == want
  assert sum(read) == 55 + 2 * (55 - 48)                                 # the prompt once, then 7 tokens per sibling


def test_fully_cached_prompt_recomputes_its_last_block(tiny_model, reference):
  prompt = shared_prefix_prompts(1, 40, seed=6, suffix=(8, 9))[0]       # 48 tokens: exactly 6 blocks of 8
  want = token_ids(reference.generate(prompt, GREEDY, use_tqdm=False))
  engine = LLMEngine.from_kwargs(str(tiny_model_path(reference)), block_size=8, num_kv_blocks=128)
  outs = []
  for rid in ("a", "b"):
    read = spy_prefill_tokens(engine)
    engine.add_request(rid, prompt, GREEDY)
    while engine.has_unfinished_requests():
      for out in engine.step(): final = out
    outs.append((final, sum(read)))
  (first, read_first), (second, read_second) = outs
  assert token_ids([first]) == token_ids([second]) == want
  assert (first.num_cached_tokens, read_first) == (0, 48)
  assert (second.num_cached_tokens, read_second) == (40, 8)             # the last block is read again: its logits


def test_exact_counts_for_a_300_token_prefix(tiny_model_factory):
  """A 300-token shared prefix served again: the largest block multiple <= 300 is reused (288 with blocks of 16),
  and the runner is given only the rest of the prompt."""
  engine = LLMEngine.from_kwargs(str(tiny_model_factory("llama3")), block_size=16, num_kv_blocks=128,   # a 512-token context
                                 max_num_batched_tokens=128)
  rng = np.random.default_rng(7)
  prefix = rng.integers(4, 380, 300).tolist()
  results = []
  for rid, suffix in (("first", [11, 12, 13]), ("second", [21, 22, 23, 24, 25])):
    read = spy_prefill_tokens(engine)
    engine.add_request(rid, {"prompt_token_ids": prefix + suffix}, GREEDY)
    while engine.has_unfinished_requests():
      for out in engine.step(): final = out
    results.append((final.num_cached_tokens, sum(read)))
  assert results == [(0, 303), (288, 305 - 288)]
  sched = engine.scheduler
  assert (sched.prefix_cache_queries, sched.prefix_cache_hits) == (303 + 305, 288)


def test_chat_turn_two_reuses_turn_one(tiny_model):
  llm = LLM(str(tiny_model), block_size=8, num_kv_blocks=128)
  turn1 = [{"role": "system", "content": "You answer in one sentence. " * 4}, {"role": "user", "content": "The quick brown fox"}]
  first = llm.chat(turn1, GREEDY, use_tqdm=False)[0]
  turn2 = turn1 + [{"role": "assistant", "content": first.outputs[0].text}, {"role": "user", "content": "Hello world"}]
  second = llm.chat(turn2, GREEDY, use_tqdm=False)[0]
  assert second.num_cached_tokens >= len(first.prompt_token_ids) // 8 * 8
  llm.shutdown()


def test_prompt_logprobs_requests_read_the_whole_prompt(tiny_model, reference):
  prompt = shared_prefix_prompts(1, 40, seed=8)[0]
  params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1)
  want = reference.generate(prompt, params, use_tqdm=False)[0]
  llm = LLM(str(tiny_model), block_size=8, num_kv_blocks=64)
  _, again = run_twice(llm, prompt, params)
  assert again[0].num_cached_tokens == 0 and len(again[0].prompt_logprobs) == len(want.prompt_logprobs)
  assert [sorted(d) if d else d for d in again[0].prompt_logprobs] == [sorted(d) if d else d for d in want.prompt_logprobs]
  llm.shutdown()


def tiny_model_path(llm: LLM):
  return llm.llm_engine.config.model


def spy_prefill_tokens(engine: LLMEngine, runner=None) -> list[int]:
  """Record how many prefill tokens each pass gives the runner (the target's, or `runner`)."""
  runner = runner or engine.runner
  read: list[int] = []
  execute = runner.__class__.execute
  def spy(decodes, prefills=(), verifies=(), **kw):
    read.append(sum(len(w.tokens) for w in prefills))
    return execute(runner, decodes, prefills, verifies, **kw)
  runner.execute = spy
  return read
