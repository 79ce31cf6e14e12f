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
  out = sampler.apply_penalties(logits, [0, 1, 2, 2, 1], 2, p)
  np.testing.assert_allclose(out, [1.0, -4.0 - 0.5 - 0.25, 0.5 - 0.5 - 0.5, 0.5, 3.0])
  assert sampler.apply_penalties(logits, [0], 1, SamplingParams(), banned=[4])[4] == -np.inf


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
  lp = sampler.log_softmax(np.array([1.0, 3.0, 2.0, 0.0]))
  top = sampler.top_logprobs(lp, token=3, k=2)
  assert [(t, r) for t, _, r in top] == [(3, 4), (1, 1), (2, 2)]
  np.testing.assert_allclose(np.exp(lp).sum(), 1.0)
  assert sampler.top_logprobs(lp, token=1, k=0) == [(1, float(lp[1]), 1)]


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
  out = sampler.apply_penalties(logits, [0, 2], 1, SamplingParams(repetition_penalty=2.0, logit_bias={0: 10.0, 1: -1.0}))
  np.testing.assert_allclose(out, [1.0 / 2.0 + 10.0, 2.0 - 1.0, 3.0 / 2.0])   # tokens 0 and 2 seen: penalized, then biased
