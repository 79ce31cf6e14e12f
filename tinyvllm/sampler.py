"""Sampling as pure numpy functions of (logits, parameters, random stream).

Order of processing: penalties -> (greedy argmax) -> temperature -> top-k -> top-p -> min-p -> one draw by
inverse CDF. Each sampled token consumes exactly one uniform from the sequence's own generator, so a seeded
request gives the same tokens whatever else shares its batch. Speculative decoding uses the same
`probabilities` function on target and draft, which keeps its output distribution exact.
"""
from __future__ import annotations
import numpy as np
from tinyvllm.sampling_params import SamplingParams

_TOP_P_CANDIDATES = 1024   # try the top-p cut inside the 1024 most likely tokens before sorting the whole vocab


def penalizes(params: SamplingParams) -> bool:
  """Do these parameters change logits before sampling (a penalty or a logit bias)?"""
  return params.repetition_penalty != 1 or params.presence_penalty != 0 or params.frequency_penalty != 0 or bool(params.logit_bias)


def apply_penalties(logits: np.ndarray, token_ids: list[int], num_prompt_tokens: int, params: SamplingParams,
                    banned: list[int] | None = None) -> np.ndarray:
  """Repetition penalty over prompt + output (HF/vLLM rule: divide positive logits, multiply negative ones);
  presence and frequency penalties over the output; then `logit_bias` is added; `banned` ids (EOS before
  min_tokens) get -inf."""
  if not penalizes(params) and not banned: return logits
  logits = logits.astype(np.float32, copy=True)
  if params.repetition_penalty != 1 and token_ids:
    seen = np.unique(np.asarray(token_ids))
    vals = logits[seen]
    logits[seen] = np.where(vals > 0, vals / params.repetition_penalty, vals * params.repetition_penalty)
  if (params.presence_penalty or params.frequency_penalty) and len(token_ids) > num_prompt_tokens:
    ids, counts = np.unique(np.asarray(token_ids[num_prompt_tokens:]), return_counts=True)
    logits[ids] -= params.frequency_penalty * counts + params.presence_penalty
  if params.logit_bias:
    ids = np.fromiter(params.logit_bias, np.int64, len(params.logit_bias))
    logits[ids] += np.fromiter(params.logit_bias.values(), np.float32, len(ids))
  if banned: logits[np.asarray(banned)] = -np.inf
  return logits


def probabilities(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
  """The distribution sampling draws from (float64, sums to 1), after temperature, top-k, top-p and min-p."""
  x = logits.astype(np.float64) / params.temperature
  x -= x.max()
  p = np.exp(x)
  p /= p.sum()
  k = params.top_k if params.top_k > 0 else 0
  if k and k < p.size:
    cut = np.argpartition(-p, k - 1)[:k]
    kept = np.zeros_like(p)
    kept[cut] = p[cut]
    p = kept / kept.sum()
  if params.top_p < 1:
    p = _top_p(p, params.top_p)
  if params.min_p > 0:
    p = np.where(p >= params.min_p * p.max(), p, 0.0)
    p /= p.sum()
  return p


def _top_p(p: np.ndarray, top_p: float) -> np.ndarray:
  """Keep the most likely tokens until their mass reaches top_p (the token that crosses it included)."""
  n = min(_TOP_P_CANDIDATES, p.size)
  cand = np.argpartition(-p, n - 1)[:n] if n < p.size else np.arange(p.size)
  if p[cand].sum() < top_p: cand = np.arange(p.size)   # the nucleus reaches beyond the candidates
  order = cand[np.argsort(-p[cand], kind="stable")]
  mass_before = np.cumsum(p[order]) - p[order]
  keep = order[mass_before < top_p]
  out = np.zeros_like(p)
  out[keep] = p[keep]
  return out / out.sum()


def draw(p: np.ndarray, generator: np.random.Generator) -> int:
  """One token from distribution p by inverse CDF: exactly one uniform per call."""
  cdf = np.cumsum(p)
  return int(min(np.searchsorted(cdf, generator.random() * cdf[-1], side="right"), p.size - 1))


def sample(logits: np.ndarray, params: SamplingParams, generator: np.random.Generator) -> int:
  """logits already penalized. Greedy (temperature 0) takes the argmax and leaves the generator untouched."""
  if params.greedy: return int(np.argmax(logits))
  return draw(probabilities(logits, params), generator)


def log_softmax(logits: np.ndarray) -> np.ndarray:
  x = logits.astype(np.float64)
  x = x - x.max()
  return x - np.log(np.exp(x).sum())


def top_logprobs(logprobs: np.ndarray, token: int, k: int) -> list[tuple[int, float, int]]:
  """[(token_id, logprob, rank)] for the k most likely tokens and the sampled one (ranks start at 1)."""
  top = np.argpartition(-logprobs, k - 1)[:k] if 0 < k < logprobs.size else np.arange(logprobs.size if k else 0)
  top = top[np.argsort(-logprobs[top], kind="stable")]
  out = [(int(t), float(logprobs[t]), i + 1) for i, t in enumerate(top)]
  if token not in top:
    out.insert(0, (token, float(logprobs[token]), int((logprobs > logprobs[token]).sum()) + 1))
  return out


def speculative_accept(p: np.ndarray, q: np.ndarray, drafts: list[int], generator: np.random.Generator) -> list[int]:
  """Exact speculative sampling (Leviathan et al. 2023; Chen et al. 2023).

  p `[k+1, V]`: the target's sampling distributions at each drafted position and one past them; q `[k, V]`:
  the draft's distributions the drafts were drawn from. Accept draft i with probability min(1, p_i/q_i); at
  the first rejection draw from max(0, p_i - q_i) normalised and stop; if all k pass, draw a bonus from p_k.
  Returns the tokens to append (accepted drafts, then one more), distributed exactly as sampling from p."""
  for i, d in enumerate(drafts):
    if generator.random() * q[i, d] < p[i, d]: continue      # u < p/q without dividing by q
    residual = np.maximum(p[i] - q[i], 0.0)
    # a rejection is only possible where p < q somewhere, so the residual has mass; guard float round-off anyway
    return drafts[:i] + [draw(residual if residual.sum() > 0 else p[i], generator)]
  return list(drafts) + [draw(p[len(drafts)], generator)]


def speculative_accept_greedy(target_argmax: list[int], drafts: list[int]) -> list[int]:
  """Greedy: keep drafts while they equal the target's argmax, then the target's own token."""
  for i, d in enumerate(drafts):
    if d != target_argmax[i]: return list(drafts[:i]) + [target_argmax[i]]
  return list(drafts) + [target_argmax[len(drafts)]]
