"""Speculative decoding: greedy runs identical to the target alone, sampled runs distributed exactly as the
target's (chi-square against distributions computed from HF transformers), caches that roll back without
leaking a block, and the interplay with chunked prefill, preemption and stop rules."""
from __future__ import annotations
import dataclasses, json
import numpy as np
import pytest
import torch
from transformers import LlamaForCausalLM
from tinyvllm import LLM, SamplingParams, sampler
from tinyvllm.engine.llm_engine import LLMEngine
from tinyvllm.config import ConfigError

# chi-square critical values at a 0.1% false-alarm rate (scipy.stats.chi2.ppf(0.999, df)), for the df we reach
CHI2_999 = {df: v for df, v in [(1, 10.83), (2, 13.82), (3, 16.27), (4, 18.47), (5, 20.52), (6, 22.46), (7, 24.32), (8, 26.12),
            (9, 27.88), (10, 29.59), (11, 31.26), (12, 32.91), (13, 34.53), (14, 36.12), (15, 37.70), (16, 39.25), (17, 40.79),
            (18, 42.31), (19, 43.82), (20, 45.31), (22, 48.27), (24, 51.18), (26, 54.05), (28, 56.89), (30, 59.70)]}


def chi_square_ok(counts: dict, expected: dict) -> tuple[bool, float, int]:
  """Pearson's test, pooling cells expected below 5 counts into one; False only at the 0.1% level."""
  n = sum(counts.values())
  big = [c for c in expected if expected[c] * n >= 5]
  small_exp = sum(expected[c] for c in expected if c not in big)
  stat = sum((counts.get(c, 0) - n * expected[c]) ** 2 / (n * expected[c]) for c in big)
  if small_exp > 0:
    small_obs = n - sum(counts.get(c, 0) for c in big)
    stat += (small_obs - n * small_exp) ** 2 / (n * small_exp)
  assert not set(counts) - set(expected), f"sampled outside the support: {set(counts) - set(expected)}"
  df = len(big) + (small_exp > 0) - 1
  crit = CHI2_999[df] if df in CHI2_999 else df + 3.09 * (2 * df) ** 0.5 + 2   # normal approximation beyond the table
  return stat < crit, stat, df


def prompts_of_lengths(lengths, seed=0):
  rng = np.random.default_rng(seed)
  return [{"prompt_token_ids": rng.integers(4, 380, n).tolist()} for n in lengths]


def spec_llm(target, draft, k=4, **kw):
  kw = {"block_size": 8, "num_kv_blocks": 128, "max_num_batched_tokens": 64, **kw}
  return LLM(str(target), draft_model=str(draft), num_speculative_tokens=k, speculation="always", **kw)


# **** the acceptance rule itself ****

def test_accept_rule_first_token_is_distributed_as_target():
  rng = np.random.default_rng(0)
  V, k, N = 6, 3, 60000
  p = rng.dirichlet(np.ones(V), size=k + 1)
  q = rng.dirichlet(np.ones(V) * 0.5, size=k)
  gen = np.random.default_rng(1)
  firsts = {}
  for _ in range(N):
    drafts = [sampler.draw(q[i], gen) for i in range(k)]
    t = sampler.speculative_accept(p, q, drafts, gen)[0]
    firsts[t] = firsts.get(t, 0) + 1
  ok, stat, df = chi_square_ok(firsts, dict(enumerate(p[0])))
  assert ok, (stat, df)


def test_accept_rule_greedy():
  assert sampler.speculative_accept_greedy([5, 6, 7, 8], [5, 6, 7]) == [5, 6, 7, 8]
  assert sampler.speculative_accept_greedy([5, 9, 7, 8], [5, 6, 7]) == [5, 9]
  assert sampler.speculative_accept_greedy([1, 2], [3]) == [1]


# **** greedy equivalence ****

@pytest.mark.parametrize("draft_kind", ["self", "other"])
def test_greedy_equals_target_alone(tiny_model_factory, draft_kind):
  target = tiny_model_factory("gqa")
  draft = target if draft_kind == "self" else tiny_model_factory("gqa", seed=1)
  prompts = prompts_of_lengths([3, 17, 40, 9, 26])
  params = SamplingParams(temperature=0, max_tokens=23, ignore_eos=True)   # 23: max_tokens lands mid-run
  want = [o.outputs[0].token_ids for o in LLM(str(target), block_size=8, num_kv_blocks=128).generate(prompts, params, use_tqdm=False)]
  llm = spec_llm(target, draft)
  outs = llm.generate(prompts, params, use_tqdm=False)
  assert [o.outputs[0].token_ids for o in outs] == want
  rates = [o.metrics.acceptance_rate for o in outs]
  if draft_kind == "self":
    assert all(r == 1.0 for r in rates) and all(o.metrics.tokens_per_target_step > 3 for o in outs)
  else:
    assert all(r < 0.9 for r in rates)                           # a different model: frequent rejections
  for free, total in llm.llm_engine.call(lambda e: [(bm.num_free, bm.num_blocks) for bm in (e.block_manager, e.spec.blocks)]):
    assert free == total


def test_stop_token_inside_an_accepted_run(tiny_model):
  prompt = prompts_of_lengths([12], seed=5)
  base = LLM(str(tiny_model), block_size=8, num_kv_blocks=64).generate(prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                                                                      use_tqdm=False)[0].outputs[0].token_ids
  stop = base[6]
  out = spec_llm(tiny_model, tiny_model).generate(prompt, SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop]),
                                                  use_tqdm=False)[0].outputs[0]
  assert out.token_ids == base[:base.index(stop) + 1] and out.finish_reason == "stop"


def test_preemption_and_chunked_prefill_with_speculation(tiny_model_factory):
  target, draft = tiny_model_factory("gqa"), tiny_model_factory("gqa", seed=1)
  prompts = prompts_of_lengths([3, 45, 20, 9, 33, 60, 14, 28], seed=2)
  params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
  want = [o.outputs[0].token_ids for o in LLM(str(target), block_size=8, num_kv_blocks=256).generate(prompts, params, use_tqdm=False)]
  # in this thread, stepped by hand, to check the block counts after every step
  engine = LLMEngine.from_kwargs(str(target), draft_model=str(draft), num_speculative_tokens=4, speculation="always",
                                 block_size=8, num_kv_blocks=30, max_num_batched_tokens=16)  # 16-token chunks; 30 blocks for ~75 needed
  for i, p in enumerate(prompts): engine.add_request(str(i), p, params)
  outs = {}
  while engine.has_unfinished_requests():
    for o in engine.step():
      if o.finished: outs[int(o.request_id)] = o.outputs[0].token_ids
    for bm, table in ((engine.block_manager, "block_table"), (engine.spec.blocks, "draft_block_table")):
      held = [b for s in engine.scheduler.running for b in getattr(s, table)]
      assert len(held) == len(set(held)) and len(held) + bm.num_free == bm.num_blocks    # counts exact at every step
  assert engine.scheduler.num_preemptions > 0
  assert [outs[i] for i in range(len(prompts))] == want
  assert engine.block_manager.num_free == engine.spec.blocks.num_free == 30


# **** sampled equivalence: distributions ****

def hf_probs(model, prefixes: list[list[int]], params: SamplingParams) -> np.ndarray:
  """Next-token sampling distributions of HF's model after each prefix, processed as the issue defines
  (temperature, then top-k, top-p), written independently of tinyvllm.sampler."""
  with torch.no_grad():
    logits = torch.stack([model(torch.tensor([p])).logits[0, -1] for p in prefixes]).double().numpy()
  x = logits / params.temperature
  probs = np.exp(x - x.max(-1, keepdims=True)); probs /= probs.sum(-1, keepdims=True)
  for row in probs:
    if params.top_k > 0: row[np.argsort(-row)[params.top_k:]] = 0
    if params.top_p < 1:
      row /= row.sum()
      order = np.argsort(-row)
      row[order[np.cumsum(row[order]) - row[order] >= params.top_p]] = 0
    row /= row.sum()
  return probs


def sample_runs(target, draft, prompt, params, n) -> list[tuple[int, ...]]:
  llm = spec_llm(target, draft, k=3, num_kv_blocks=512, max_num_seqs=64, max_num_batched_tokens=256)
  outs = llm.generate([prompt] * n, [dataclasses.replace(params, seed=s) for s in range(n)], use_tqdm=False)
  assert sum(o.metrics.num_draft_tokens for o in outs) > 0
  return [tuple(o.outputs[0].token_ids) for o in outs]


def test_sampled_second_token_distribution_temperature_1(tiny_model_factory):
  """The first speculated position (token 2) at temperature 1 over the whole vocabulary: its marginal
  sum_t1 p(t1) p(t2 | t1) computed from HF must match the spec-decoded samples."""
  target, draft = tiny_model_factory("gqa"), tiny_model_factory("gqa", seed=1)
  prompt = [7, 81, 200, 33, 5]
  params = SamplingParams(temperature=1.0, max_tokens=2, ignore_eos=True)
  hf = LlamaForCausalLM.from_pretrained(target, torch_dtype=torch.float32).eval()
  p1 = hf_probs(hf, [prompt], params)[0]
  p2 = hf_probs(hf, [prompt + [t] for t in range(len(p1))], params)
  marginal = dict(enumerate(p1 @ p2))
  runs = sample_runs(target, draft, {"prompt_token_ids": prompt}, params, 3000)
  counts = {}
  for r in runs: counts[r[1]] = counts.get(r[1], 0) + 1
  ok, stat, df = chi_square_ok(counts, {t: v for t, v in marginal.items() if v > 0})
  assert ok, (stat, df)


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0, top_k=3, max_tokens=4, ignore_eos=True),
                                    SamplingParams(temperature=0.8, top_p=0.6, max_tokens=4, ignore_eos=True)],
                         ids=["top_k", "top_p"])
def test_sampled_joint_distribution_of_a_run(tiny_model_factory, params):
  """Truncated sampling keeps the support small, so the exact joint law of tokens 2-4 (which come from one
  speculative step: accepted drafts, a correction or the bonus) is computable from HF and testable."""
  target, draft = tiny_model_factory("gqa"), tiny_model_factory("gqa", seed=1)
  prompt = [7, 81, 200, 33, 5]
  hf = LlamaForCausalLM.from_pretrained(target, torch_dtype=torch.float32).eval()
  runs = sample_runs(target, draft, {"prompt_token_ids": prompt}, params, 3000)
  # condition on the most frequent first token (it comes from the non-speculative prefill step)
  first = max(set(r[0] for r in runs), key=lambda t: sum(r[0] == t for r in runs))
  tails = [r[1:] for r in runs if r[0] == first]
  expected, frontier = {}, [((), 1.0)]
  for depth in range(3):
    probs = hf_probs(hf, [prompt + [first] + list(path) for path, _ in frontier], params)
    frontier = [(path + (t,), w * row[t]) for (path, w), row in zip(frontier, probs) for t in np.nonzero(row)[0]]
  expected = {path: w for path, w in frontier}
  counts = {}
  for t in tails: counts[t] = counts.get(t, 0) + 1
  ok, stat, df = chi_square_ok(counts, expected)
  assert ok and len(tails) > 500, (stat, df, len(tails))


def test_draft_with_another_vocabulary_is_refused(tiny_model, tmp_path):
  import shutil
  other = tmp_path / "other"
  shutil.copytree(tiny_model, other)
  tok = json.loads((other / "tokenizer.json").read_text())
  vocab = tok["model"]["vocab"]
  a, b = [t for t, i in sorted(vocab.items(), key=lambda kv: kv[1])][300:302]
  vocab[a], vocab[b] = vocab[b], vocab[a]                      # same size, two token strings swapped
  (other / "tokenizer.json").write_text(json.dumps(tok))
  with pytest.raises(ConfigError, match="different vocabulary"):
    LLM(str(tiny_model), draft_model=str(other), num_kv_blocks=32)
  with pytest.raises(ConfigError, match="num_speculative_tokens"):
    LLM(str(tiny_model), draft_model=str(tiny_model), num_speculative_tokens=0)


def _simulate_policy(steps: int, t_plain: float, t_spec: float, acceptance: float, k: int = 4, batch: int = 1,
                     capture: float = 3.0):
  """Drive SpecPolicy with a simulated clock: plain steps take t_plain, speculative ones t_spec and accept
  `acceptance` of the drafts; the first step of each kind also pays a capture. Returns (seconds spent in
  speculative steps, tokens per sequence, seconds) after the two warm-up measurements of each kind."""
  from tinyvllm.engine.spec_decode import SpecPolicy
  policy, seen, spec_seconds, tokens, seconds = SpecPolicy(k), set(), 0.0, 0.0, 0.0
  for i in range(steps + 4):
    spec = policy.should_speculate(batch)
    t = (t_spec if spec else t_plain) + (capture if spec not in seen else 0.0)
    seen.add(spec)
    if spec: policy.record_spec(batch, batch * k, round(batch * k * acceptance), t)
    else: policy.record_plain(batch, t)
    if i >= 4:
      spec_seconds += t if spec else 0.0
      tokens += (1 + k * acceptance) if spec else 1   # accepted drafts plus the target's own token
      seconds += t
  return spec_seconds, tokens, seconds


@pytest.mark.parametrize("t_spec, acceptance, speculates", [
  (3.0, 1.0, True),     # cheap draft, everything accepted: 5 tokens for the price of 3 plain steps
  (8.5, 1.0, False),    # a speculative step costs more than the 5 tokens it yields (batch 8 with an INT4 draft here)
  (3.0, 0.0, False),    # nothing accepted: one token for the price of 3
])
def test_policy_picks_the_faster_path_and_probes_stay_cheap(t_spec, acceptance, speculates):
  steps, t_plain = 2000, 1.0
  spec_seconds, tokens, seconds = _simulate_policy(steps, t_plain, t_spec, acceptance)
  best = max(1 / t_plain, (1 + 4 * acceptance) / t_spec)   # tokens per second of the better path alone
  # probes of the other path take about probe_share (5 %) of the time
  if speculates: assert spec_seconds > 0.94 * seconds
  else: assert spec_seconds < 0.06 * seconds
  # and cost at most a few percent of the throughput of always taking the better path
  assert tokens / seconds > 0.95 * best, (tokens / seconds, best)


def test_policy_notices_when_acceptance_drops():
  from tinyvllm.engine.spec_decode import SpecPolicy
  policy = SpecPolicy(4, probe_share=1e-9)   # no probes: the test looks at the decision alone
  for _ in range(3):   # measured: plain 1 s, speculative 3 s with everything accepted
    policy.record_plain(1, 1.0)
    policy.record_spec(1, 4, 4, 3.0)
  assert policy.should_speculate(1)
  for _ in range(10): policy.record_spec(1, 4, 0, 3.0)   # new prompts: the draft stops agreeing
  assert not policy.should_speculate(1)
