"""Sampling functions against hand-computed distributions, plus parameter validation."""
from __future__ import annotations
import numpy as np
import pytest
from tinyvllm import SamplingParams
from tinyvllm import sampler


def softmax(x): e = np.exp(x - x.max()); return e / e.sum()


def test_probabilities_temperature_topk_topp_minp():
  logits = np.log(np.array([0.05, 0.4, 0.1, 0.3, 0.15]))
  np.testing.assert_allclose(sampler.probabilities(logits, SamplingParams(temperature=1.0)), [0.05, 0.4, 0.1, 0.3, 0.15])
  np.testing.assert_allclose(sampler.probabilities(logits, SamplingParams(temperature=0.5)),
                             softmax(np.log([0.05, 0.4, 0.1, 0.3, 0.15]) / 0.5))
  np.testing.assert_allclose(sampler.probabilities(logits, SamplingParams(top_k=2)), [0, 0.4 / 0.7, 0, 0.3 / 0.7, 0])
  # top_p=0.75: 0.4 + 0.3 = 0.7 < 0.75, so 0.15 (the token that crosses) is kept too
  np.testing.assert_allclose(sampler.probabilities(logits, SamplingParams(top_p=0.75)), [0, 0.4 / 0.85, 0, 0.3 / 0.85, 0.15 / 0.85])
  np.testing.assert_allclose(sampler.probabilities(logits, SamplingParams(top_p=0.7)), [0, 0.4 / 0.7, 0, 0.3 / 0.7, 0])
  # min_p=0.3: keep p >= 0.3 * 0.4 = 0.12
  np.testing.assert_allclose(sampler.probabilities(logits, SamplingParams(min_p=0.3)), [0, 0.4 / 0.85, 0, 0.3 / 0.85, 0.15 / 0.85])


def test_top_p_over_a_large_vocab_matches_full_sort():
  rng = np.random.default_rng(0)
  for top_p in (0.3, 0.9, 0.999):
    logits = rng.normal(size=50000) * 0.5     # flat: the nucleus spans more than the 1024 fast-path candidates
    p = softmax(logits)
    order = np.argsort(-p)
    keep = order[np.cumsum(p[order]) - p[order] < top_p]
    want = np.zeros_like(p); want[keep] = p[keep]; want /= want.sum()
    np.testing.assert_allclose(sampler.probabilities(logits, SamplingParams(top_p=top_p)), want, rtol=1e-9, atol=1e-15)


def test_penalties():
  logits = np.array([2.0, -2.0, 1.0, 0.5, 3.0], np.float32)
  p = SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
  # prompt [0, 1], output [2, 2, 1]: repetition on 0, 1, 2; presence/frequency on 2 (x2) and 1 (x1)
  out = sampler.apply_penalties(logits, sampler.TokenCounts(5, 2).update([0, 1, 2, 2, 1]), p)
  np.testing.assert_allclose(out, [1.0, -4.0 - 0.5 - 0.25, 0.5 - 0.5 - 0.5, 0.5, 3.0])
  # output [2, 2, 3] (3 new to the sequence), counted a step at a time, or its last two as drafts not yet appended
  want = [1.0, -4.0, 0.5 - 0.5 - 0.5, 0.25 - 0.25 - 0.5, 3.0]
  counts = sampler.TokenCounts(5, 2)
  for n in range(1, 6): counts.update([0, 1, 2, 2, 3][:n])
  np.testing.assert_allclose(sampler.apply_penalties(logits, counts, p), want)
  np.testing.assert_allclose(sampler.apply_penalties(logits, sampler.TokenCounts(5, 2).update([0, 1, 2]), p, extra=[2, 3]), want)
  assert sampler.apply_penalties(logits, None, SamplingParams(), banned=[4])[4] == -np.inf


def test_penalties_with_drafts_match_counts_from_scratch():
  """A speculative verify penalizes each drafted position as if the drafts before it were appended: against the
  penalties written out over np.bincount of the whole token list (prompt + output + drafts), for random sequences
  whose drafts repeat each other, repeat the output or the prompt only, or are new; the counts are reused across a
  step's positions (their ids are found once an update) and updated between steps."""
  rng = np.random.default_rng(5)
  V = 300
  for case in range(40):
    p = SamplingParams(repetition_penalty=float(rng.uniform(1.05, 2)), presence_penalty=float(rng.uniform(0, 1)),
                       frequency_penalty=float(rng.uniform(0, 1)))
    prompt = rng.integers(0, V, int(rng.integers(1, 30))).tolist()
    tokens, counts = list(prompt), sampler.TokenCounts(V, len(prompt))
    for step in range(4):
      tokens += rng.integers(0, V, int(rng.integers(0, 6))).tolist()
      counts.update(tokens)
      pool = tokens + rng.integers(0, V, 4).tolist()
      drafts = [pool[i] for i in rng.integers(0, len(pool), 5)]
      for k in range(len(drafts) + 1):
        logits = rng.normal(size=V).astype(np.float32)
        whole = tokens + drafts[:k]
        seen, output = np.bincount(whole, minlength=V) > 0, np.bincount(whole[len(prompt):], minlength=V)
        want = logits.astype(np.float64)
        want = np.where(seen, np.where(want > 0, want / p.repetition_penalty, want * p.repetition_penalty), want)
        want -= p.frequency_penalty * output + p.presence_penalty * (output > 0)
        np.testing.assert_allclose(sampler.apply_penalties(logits, counts, p, drafts[:k]), want, rtol=1e-6, atol=1e-6, err_msg=f"{case} {step} {k}")


def test_draw_follows_the_distribution():
  p = np.array([0.1, 0.2, 0.3, 0.4])
  rng = np.random.default_rng(0)
  counts = np.bincount([sampler.draw(p, rng) for _ in range(40000)], minlength=4)
  # chi-square with 3 degrees of freedom: 16.27 is the 0.1% critical value
  assert ((counts - 40000 * p) ** 2 / (40000 * p)).sum() < 16.27


def test_greedy_and_seeded_sampling():
  logits = np.random.default_rng(1).normal(size=1000)
  assert sampler.sample(logits, SamplingParams(temperature=0), np.random.default_rng(0)) == int(np.argmax(logits))
  a = [sampler.sample(logits, SamplingParams(temperature=1.0), g) for g in [np.random.default_rng(5)] for _ in range(20)]
  b = [sampler.sample(logits, SamplingParams(temperature=1.0), g) for g in [np.random.default_rng(5)] for _ in range(20)]
  assert a == b and len(set(a)) > 1


def test_top_logprobs_ranks():
  logits = np.array([[1.0, 3.0, 2.0, 0.0]])
  lp = np.log(softmax(logits[0]))
  top = sampler.token_logprobs(logits, [3], k=2)[0]
  assert [(t, r) for t, _, r in top] == [(3, 4), (1, 1), (2, 2)]
  np.testing.assert_allclose([v for _, v, _ in top], lp[[3, 1, 2]], rtol=1e-6)
  assert sampler.token_logprobs(logits, [1], k=0) == [[(1, pytest.approx(lp[1], rel=1e-6), 1)]]


@pytest.mark.parametrize("vocab", [50, 128256])
def test_token_logprobs_against_a_float64_log_softmax(vocab, monkeypatch):
  """Each row's entry against numpy's float64 log-softmax of the whole row: the k most likely tokens in order with
  ranks 1..k, the token first with its rank when it is not among them, every logprob within 1e-6 (the log-sum-exp sums
  float32 exps: ~1e-7 off). 9 rows in blocks of 4 (the exps are formed a block of rows at a time)."""
  monkeypatch.setattr(sampler, "_LOGPROB_ELEMENTS", 4 * vocab)
  rng = np.random.default_rng(vocab)
  rows = (rng.standard_normal((9, vocab)) * 4).astype(np.float32)
  rows[2, rng.choice(vocab, vocab // 5, replace=False)] = -np.inf   # masked tokens (a grammar's), logprob -inf
  for k in (0, 1, 5, 20):
    tokens = [int(rng.integers(vocab)) for _ in range(9)]
    tokens[0] = int(np.argmax(rows[0]))   # a token inside the top
    for row, token, entry in zip(rows, tokens, sampler.token_logprobs(rows, tokens, k)):
      ref = row.astype(np.float64) - row.max() - np.log(np.exp(row.astype(np.float64) - row.max()).sum())
      order = np.argsort(-ref, kind="stable")[:k]
      want = [(int(t), i + 1) for i, t in enumerate(order)]
      if token not in order: want.insert(0, (token, int((ref > ref[token]).sum()) + 1))
      assert [(t, r) for t, _, r in entry] == want
      got = np.array([v for _, v, _ in entry])
      np.testing.assert_allclose(got, ref[[t for t, _, _ in entry]], rtol=0, atol=1e-6)


@pytest.mark.parametrize("kwargs, name", [
  (dict(temperature=-0.1), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(top_k=-2), "top_k"),
  (dict(min_p=1.5), "min_p"), (dict(repetition_penalty=0.0), "repetition_penalty"), (dict(presence_penalty=3.0), "presence_penalty"),
  (dict(frequency_penalty=-2.5), "frequency_penalty"), (dict(max_tokens=0), "max_tokens"), (dict(n=0), "n"),
  (dict(logprobs=21), "logprobs"), (dict(stop=[""]), "stop"), (dict(stop_token_ids=[-1]), "stop_token_ids"),
  (dict(seed=1.5), "seed"), (dict(min_tokens=5, max_tokens=2), "min_tokens"), (dict(temperature=float("nan")), "temperature"),
  (dict(temperature=True), "temperature"), (dict(max_tokens=True), "max_tokens"), (dict(seed=-1), "seed"),
  (dict(stop=123), "stop"), (dict(temperature=float("inf")), "temperature"), (dict(logit_bias={"x": 1.0}), "logit_bias"),
  (dict(logit_bias={5: float("inf")}), "logit_bias"), (dict(prompt_logprobs=-1), "prompt_logprobs"),
])
def test_invalid_sampling_params_name_the_parameter(kwargs, name):
  with pytest.raises(ValueError, match=name): SamplingParams(**kwargs)


def test_vllm_defaults():
  p = SamplingParams()
  assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p, p.max_tokens, p.repetition_penalty) == (1, 1.0, 1.0, 0, 0.0, 16, 1.0)
  assert SamplingParams(stop="x").stop_strings == ("x",)


def test_numpy_scalars_are_numbers_and_tiny_temperatures_are_greedy():
  p = SamplingParams(temperature=np.float32(0.5), top_p=np.float64(0.9), top_k=np.int64(5), seed=np.int32(3), max_tokens=np.int64(7))
  assert (p.temperature, p.top_k, p.seed, p.max_tokens) == (0.5, 5, 3, 7) and type(p.top_p) is float and type(p.top_k) is int
  tiny = SamplingParams(temperature=1e-310)                      # 1 / 1e-310 overflows: sampled greedily, as vLLM does
  assert tiny.greedy and sampler.sample(np.array([0.1, 3.0, 0.2]), tiny, np.random.default_rng(0)) == 1
  assert SamplingParams(logit_bias={"7": 2.5}).logit_bias == {7: 2.5}   # JSON keys arrive as strings


def test_logit_bias_is_added_after_penalties():
  logits = np.array([1.0, 2.0, 3.0], np.float32)
  out = sampler.apply_penalties(logits, sampler.TokenCounts(3, 1).update([0, 2]), SamplingParams(repetition_penalty=2.0, logit_bias={0: 10.0, 1: -1.0}))
  np.testing.assert_allclose(out, [1.0 / 2.0 + 10.0, 2.0 - 1.0, 3.0 / 2.0])   # tokens 0 and 2 seen: penalized, then biased


def reference_distribution(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
  """The sampling distribution written out over the whole vocabulary in float64, independent of tinyvllm.sampler:
  softmax at the temperature, the k most likely tokens, the most likely tokens until their mass reaches top_p (the one
  crossing it kept), tokens at least min_p times the most likely."""
  p = softmax(logits.astype(np.float64) / params.temperature)
  if 0 < params.top_k < p.size: p[np.argsort(-p, kind="stable")[params.top_k:]] = 0
  p /= p.sum()
  if params.top_p < 1:
    order = np.argsort(-p, kind="stable")
    p[order[np.cumsum(p[order]) - p[order] >= params.top_p]] = 0
  if params.min_p > 0: p[p < params.min_p * p.max()] = 0
  return p / p.sum()


def reference_token(logits: np.ndarray, params: SamplingParams, u: float) -> int:
  """Inverse CDF: the first token (in id order) whose cumulative probability exceeds u."""
  cdf = np.cumsum(reference_distribution(logits, params))
  return int(np.searchsorted(cdf, u * cdf[-1], side="right"))


@pytest.mark.parametrize("vocab", [7, 5000, 128256])
def test_sampling_takes_the_reference_token(vocab):
  """`sample` avoids the float64 distribution over the whole vocabulary (float32 weights, top-k by partition, top-p by
  binned weights, a blocked inverse CDF); for the same uniform it must take the token the written-out rule takes.
  Peaked and flat logits, banned tokens (-inf), top-p near 1 and every filter combined. The tokens kept are the
  reference's support, their weights its probabilities; the generator's seeds are fixed, and a token could differ only
  where float32 rounding moves a boundary onto the uniform (about 1e-7 of them)."""
  rng = np.random.default_rng(vocab)
  combos = [dict(temperature=1.0), dict(temperature=0.7, top_p=0.9), dict(temperature=1.3, top_k=40), dict(temperature=0.8, min_p=0.05),
            dict(temperature=0.6, top_k=20, top_p=0.8, min_p=0.02), dict(temperature=1.0, top_p=0.9999), dict(temperature=2.0, top_p=0.3)]
  draws = 0
  for spread in (0.3, 3.0, 12.0):   # flat to peaked
    logits = (rng.standard_normal(vocab) * spread).astype(np.float32)
    logits[rng.choice(vocab, vocab // 10, replace=False)] = -np.inf
    for kwargs in combos:
      params = SamplingParams(**kwargs)
      want = reference_distribution(logits, params)
      tokens, weights = sampler._kept(logits, logits.max(), params)   # the tokens kept and their unnormalised weights
      tokens = np.arange(vocab) if tokens is None else tokens
      # the same support, but for tokens under float32's smallest weight (probability below 1e-38 of the top's)
      kept = tokens[weights > 0]
      assert (want[kept] > 0).all() and np.isin(np.flatnonzero(want > 1e-30), kept).all(), (spread, kwargs)
      np.testing.assert_allclose(weights / weights.sum(dtype=np.float64), want[tokens], rtol=1e-5, atol=1e-12)   # float32 weights
      for seed in range(12):
        u = np.random.default_rng(seed).random()
        assert sampler.sample(logits, params, np.random.default_rng(seed)) == reference_token(logits, params, u), (spread, kwargs, seed)
        draws += 1
  assert draws == 3 * len(combos) * 12


def test_sampling_follows_the_distribution_and_uses_one_uniform():
  """Frequencies over 20000 draws against the written-out distribution (chi-square), with each draw consuming exactly
  one uniform of the request's generator (a seeded request's tokens do not depend on its batch)."""
  rng = np.random.default_rng(3)
  logits = (rng.standard_normal(20000) * 4).astype(np.float32)
  params = SamplingParams(temperature=0.9, top_p=0.95)
  p = softmax(logits.astype(np.float64) / 0.9)
  order = np.argsort(-p, kind="stable")
  p[order[np.cumsum(p[order]) - p[order] >= 0.95]] = 0
  p /= p.sum()
  g, twin = np.random.default_rng(7), np.random.default_rng(7)
  tokens = []
  for _ in range(20000):
    tokens.append(sampler.sample(logits, params, g))
    twin.random()
  assert g.random() == twin.random()
  likely = np.argsort(-p)[:30]   # the 30 most likely tokens and the rest pooled: expected counts well above 5
  counts = np.bincount(tokens, minlength=p.size)
  observed, expected = np.append(counts[likely], counts.sum() - counts[likely].sum()), 20000 * np.append(p[likely], 1 - p[likely].sum())
  assert expected.min() > 5
  # chi-square with 30 degrees of freedom: 59.7 is the 0.1% critical value
  assert ((observed - expected) ** 2 / expected).sum() < 59.7


def test_sampling_edge_cases_match_the_reference_path():
  """One token allowed (every other banned), NaN logits and top_k beyond the vocabulary take what `draw(probabilities(...))` takes."""
  logits = np.full(3000, -np.inf, np.float32)
  logits[1234] = 0.5
  assert sampler.sample(logits, SamplingParams(temperature=0.8, top_p=0.5), np.random.default_rng(0)) == 1234
  assert sampler.sample(logits, SamplingParams(temperature=0.8, top_k=5, min_p=0.5), np.random.default_rng(0)) == 1234
  nan = np.random.default_rng(1).standard_normal(100).astype(np.float32)
  nan[17] = np.nan
  params = SamplingParams(temperature=1.0)
  assert sampler.sample(nan, params, np.random.default_rng(2)) == sampler.draw(sampler.probabilities(nan, params), np.random.default_rng(2))
  small = np.random.default_rng(4).standard_normal(10).astype(np.float32)
  params = SamplingParams(temperature=1.0, top_k=50)
  assert sampler.sample(small, params, np.random.default_rng(5)) == reference_token(small, params, np.random.default_rng(5).random())


def test_largest_finds_the_k_largest_entries():
  """`largest` (the k largest entries by widening thresholds) against a full sort, on flat, peaked and stepped rows."""
  rng = np.random.default_rng(11)
  rows = [rng.standard_normal(128256).astype(np.float32) * s for s in (0.1, 3.0, 40.0)] + [np.repeat(np.arange(300, dtype=np.float32), 7)]
  for row in rows:
    for k in (1, 7, 50, 700, 5000, row.size - 1, row.size, row.size + 3):
      got = sampler.largest(row, k)
      assert got.size == min(k, row.size) and np.unique(got).size == got.size
      want = np.sort(row)[::-1][:k]   # the values of the k largest (ties may pick either index)
      np.testing.assert_array_equal(np.sort(row[got])[::-1], want)


# **** penalties in the engine ****

def _hf_penalized_greedy(path, prompt: list[int], n: int, repetition=1.0, presence=0.0, frequency=0.0) -> list[int]:
  """Greedy decoding under the penalties from HF's logits: repetition by HF's own processor (generate's
  repetition_penalty), presence and frequency written out here by vLLM's rule (logit -= frequency x count +
  presence, over the output's tokens)."""
  import torch
  from transformers import LlamaForCausalLM
  hf = LlamaForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
  ids = list(prompt)
  with torch.no_grad():
    if presence == frequency == 0:
      return hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, repetition_penalty=repetition, eos_token_id=None,
                         pad_token_id=0)[0, len(ids):].tolist()
    for _ in range(n):
      logits = hf(torch.tensor([ids])).logits[0, -1].double()
      for token, count in zip(*np.unique(ids[len(prompt):], return_counts=True)): logits[int(token)] -= frequency * count + presence
      ids.append(int(logits.argmax()))
  return ids[len(prompt):]


@pytest.mark.parametrize("penalties", [dict(repetition=1.6), dict(presence=1.5, frequency=0.7)])
def test_penalized_greedy_decoding_matches_hf(tiny_model, penalties):
  """Greedy decoding under penalties, against HF (above), the engine alone and with a draft model (the target itself:
  every draft is accepted): its verify pass penalizes each drafted position as if the drafts before it were in the
  output. 40 tokens of a prompt of 30: the penalties change the greedy tokens (checked)."""
  from test_spec_decode import prompts_of_lengths
  from tinyvllm import LLM
  prompt = prompts_of_lengths([30], seed=3)[0]["prompt_token_ids"]
  params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, repetition_penalty=penalties.get("repetition", 1.0),
                          presence_penalty=penalties.get("presence", 0.0), frequency_penalty=penalties.get("frequency", 0.0))
  want = _hf_penalized_greedy(str(tiny_model), prompt, 40, **penalties)
  assert want != _hf_penalized_greedy(str(tiny_model), prompt, 40)
  for kw in ({}, dict(draft_model=str(tiny_model), num_speculative_tokens=3, speculation="always")):
    llm = LLM(str(tiny_model), block_size=8, num_kv_blocks=64, **kw)
    assert llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0].token_ids == want, kw
    llm.shutdown()
