"""Sampling as numpy functions of (logits, parameters, random stream), and the counts of a sequence's tokens its
penalties read (`TokenCounts`, kept on the sequence).

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
  return counts_tokens(params) or bool(params.logit_bias)


def counts_tokens(params: SamplingParams) -> bool:
  """Do the penalties read the tokens so far (repetition, presence or frequency)?"""
  return params.repetition_penalty != 1 or params.presence_penalty != 0 or params.frequency_penalty != 0


class TokenCounts:
  """A sequence's tokens as the penalties read them: which ids its prompt and output hold (repetition) and how often
  each appears in its output (presence, frequency), over the whole vocabulary. `update` counts the tokens added
  since, so a step costs its new tokens and a pass over the vocabulary. Rebuilt from the token list at every step
  (np.unique), the penalties of a 128K vocabulary took 1.6 ms a sequence a step at 9,000 tokens and 5.3 at 32,000;
  this way 0.16 and 0.22."""
  def __init__(self, vocab_size: int, num_prompt_tokens: int):
    self.seen = np.zeros(vocab_size, np.bool_)
    self.output = np.zeros(vocab_size, np.int32)
    self.num_prompt_tokens, self.num_counted = num_prompt_tokens, 0
    # the ids each holds, found once per update (a pass over the vocabulary): a speculative verify penalizes each of
    # its k + 1 positions with the same counts and a few drafted tokens more
    self._seen_ids: np.ndarray | None = None
    self._output_ids: np.ndarray | None = None

  def update(self, token_ids: list[int]) -> TokenCounts:
    """Count the tokens of `token_ids` (the sequence's prompt and output: a list that only grows) not counted yet."""
    if self.num_counted == len(token_ids): return self   # a verify pass reads them once per draft, a step adds none
    new = np.asarray(token_ids[self.num_counted:], np.int64)
    self.seen[new] = True
    np.add.at(self.output, new[max(0, self.num_prompt_tokens - self.num_counted):], 1)
    self.num_counted = len(token_ids)
    self._seen_ids = self._output_ids = None
    return self

  def seen_ids(self, extra: list[int] = ()) -> np.ndarray:
    """The ids seen, each once (ascending, then those only `extra` adds), `extra` tokens included."""
    if self._seen_ids is None: self._seen_ids = np.flatnonzero(self.seen)
    if not len(extra): return self._seen_ids
    ex = np.unique(np.asarray(extra, np.int64))   # (np.union1d with the ids sorted all of them again: 0.8 ms at 9,000)
    return np.concatenate([self._seen_ids, ex[~self.seen[ex]]])

  def output_counts(self, extra: list[int] = ()) -> tuple[np.ndarray, np.ndarray]:
    """The ids in the output, each once (ascending, then those only `extra` adds), and how often each appears,
    `extra` tokens included."""
    if self._output_ids is None: self._output_ids = np.flatnonzero(self.output > 0)   # (of an int32 array directly: 12x slower)
    ids = self._output_ids
    counts = self.output[ids].astype(np.int64)
    if not len(extra): return ids, counts
    ex, times = np.unique(np.asarray(extra, np.int64), return_counts=True)
    fresh = self.output[ex] == 0
    at = np.where(fresh, len(ids) + np.cumsum(fresh) - 1, np.searchsorted(ids, ex))   # each extra id's place in the result
    ids, counts = np.concatenate([ids, ex[fresh]]), np.concatenate([counts, np.zeros(int(fresh.sum()), np.int64)])
    counts[at] += times
    return ids, counts


def apply_penalties(logits: np.ndarray, counts: TokenCounts | None, params: SamplingParams, extra: list[int] = (),
                    banned: list[int] | None = None) -> np.ndarray:
  """Repetition penalty over prompt + output (HF/vLLM rule: divide positive logits, multiply negative ones);
  presence and frequency penalties over the output; then `logit_bias` is added; `banned` ids (EOS before
  min_tokens) get -inf. `counts`: the sequence's (None when no penalty reads them), as if `extra` tokens had been
  appended to its output."""
  if not penalizes(params) and not banned: return logits
  logits = logits.astype(np.float32, copy=True)
  if params.repetition_penalty != 1:
    seen = counts.seen_ids(extra)
    vals = logits[seen]
    logits[seen] = np.where(vals > 0, vals / params.repetition_penalty, vals * params.repetition_penalty)
  if params.presence_penalty or params.frequency_penalty:
    ids, n = counts.output_counts(extra)
    logits[ids] -= params.frequency_penalty * n + params.presence_penalty
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
  """logits already penalized. Greedy (temperature 0) takes the argmax and leaves the generator untouched.

  The token `draw(probabilities(logits, params), generator)` takes, without building the distribution over the whole
  vocabulary in float64: with Llama 3's 128256 tokens that cost 2-30 ms a row on one core (two exps, sorts and
  cumulative sums over all of it; top-p over a flat distribution the most), more than the model's pass on a GPU for a
  batch of 32. Here the weights are float32 exps (one pass, or none under top-k), the filters are thresholds on them,
  and the draw walks blocks of the vocabulary: the same tokens in the same order and one uniform, so the same token
  but where float rounding moves a boundary."""
  if params.greedy: return int(np.argmax(logits))
  x = np.asarray(logits, np.float32).reshape(-1)
  top = x.max()
  if not np.isfinite(top): return draw(probabilities(logits, params), generator)   # every token banned, or NaN
  tokens, weights = _kept(x, top, params)
  at = _inverse_cdf(weights, generator.random())
  return int(at if tokens is None else tokens[at])


def _kept(x: np.ndarray, top: float, params: SamplingParams) -> tuple[np.ndarray | None, np.ndarray]:
  """The tokens top-k, top-p and min-p keep (ascending ids; None: every token) and their weights exp((x - top) / T),
  proportional to `probabilities`' (the most likely token weighs 1)."""
  V, inv_t = x.size, np.float32(1 / params.temperature)
  if 0 < params.top_k < V:   # only the k largest logits matter: their weights alone normalise the distribution
    tokens = np.sort(largest(x, params.top_k))
    weights = np.exp((x[tokens] - top) * inv_t)
  else:
    tokens, weights = None, np.exp((x - top) * inv_t)
  if params.top_p < 1:
    tokens, weights = _nucleus(tokens, weights, params.top_p)
  if params.min_p > 0:   # p >= min_p * max p, and the most likely token weighs 1
    keep = np.flatnonzero(weights >= params.min_p)
    tokens, weights = (keep if tokens is None else tokens[keep]), weights[keep]
  return tokens, weights


def _nucleus(tokens: np.ndarray | None, weights: np.ndarray, top_p: float) -> tuple[np.ndarray, np.ndarray]:
  """Top-p over (tokens, weights): the most likely tokens until their mass reaches top_p, the one that crosses it
  included (`_top_p`'s cut), without sorting them all (a flat distribution's nucleus is tens of thousands of tokens:
  milliseconds). Weights are counted into bins by their float32 bits (a bin spans a factor of 1 + 1/64); the bins'
  bounds bracket the cut, every token of a heavier bin is kept, and only the bracket's tokens are sorted. A wide
  bracket (top_p near 1, a flat distribution) is first narrowed to one bin by its bins' exact masses."""
  target = top_p * weights.sum(dtype=np.float64)
  bins = weights.view(np.int32) >> _BIN_SHIFT   # nonnegative floats order as their bits
  counts = np.bincount(bins, minlength=_BINS)[::-1]   # heaviest bin first
  # the mass down to each bin lies between these bounds: the cut is in a bin no heavier than the first whose upper
  # bound reaches the target, and no lighter than the first whose lower bound does
  heaviest = _BINS - 1 - int(np.searchsorted(np.cumsum(counts * _EDGES[:0:-1]), target))
  lightest = max(_BINS - 1 - int(np.searchsorted(np.cumsum(counts * _EDGES[-2::-1]), target)), 0)
  kept = bins > heaviest
  bracket = np.flatnonzero((bins >= lightest) & ~kept)
  before = np.multiply(weights, kept, dtype=np.float64).sum()   # the mass of every token heavier than the bracket's
  if bracket.size > _SORTED_AT_MOST:
    down = heaviest - bins[bracket]   # 0: the bracket's heaviest bin
    mass = before + np.cumsum(np.bincount(down, weights=weights[bracket]))
    cut = min(int(np.searchsorted(mass, target)), mass.size - 1)
    kept, before, bracket = bins > heaviest - cut, (mass[cut - 1] if cut else before), bracket[down == cut]
  bracket = bracket[np.argsort(-weights[bracket], kind="stable")]
  w = weights[bracket].astype(np.float64)
  kept[bracket[before + np.cumsum(w) - w < target]] = True
  keep = np.flatnonzero(kept)
  return (keep if tokens is None else tokens[keep]), weights[keep]


_SORTED_AT_MOST = 4096
_BIN_SHIFT = 17   # a float32's sign, exponent and top 6 mantissa bits: bins of weights within a factor 1 + 1/64
_BINS = (int(np.float32(1).view(np.int32)) >> _BIN_SHIFT) + 1   # weights are at most 1
_EDGES = (np.arange(_BINS + 1, dtype=np.int32) << _BIN_SHIFT).view(np.float32).astype(np.float64)   # bin b: [E[b], E[b+1])


_DRAW_BLOCK = 1024


def _inverse_cdf(weights: np.ndarray, u: float) -> int:
  """The index inverse-CDF sampling picks with uniform u over unnormalised `weights` (`draw`'s rule: the first index
  whose cumulative weight exceeds u times the total), found through the sums of blocks of `_DRAW_BLOCK`."""
  n = weights.size
  if n <= 4 * _DRAW_BLOCK:
    cdf = np.cumsum(weights, dtype=np.float64)
    return int(min(np.searchsorted(cdf, u * cdf[-1], side="right"), n - 1))
  whole = n // _DRAW_BLOCK * _DRAW_BLOCK
  sums = weights[:whole].reshape(-1, _DRAW_BLOCK).sum(1, dtype=np.float64)
  if whole < n: sums = np.append(sums, weights[whole:].sum(dtype=np.float64))
  cdf = np.cumsum(sums)
  target = u * cdf[-1]
  block = int(min(np.searchsorted(cdf, target, side="right"), sums.size - 1))
  start = block * _DRAW_BLOCK
  inner = np.cumsum(weights[start:start + _DRAW_BLOCK], dtype=np.float64) + (cdf[block - 1] if block else 0.0)
  at = int(np.searchsorted(inner, target, side="right"))
  if at == inner.size: at = int(np.flatnonzero(weights[start:start + _DRAW_BLOCK])[-1])   # rounding past the block's end
  return start + at


def largest(x: np.ndarray, k: int) -> np.ndarray:
  """The indices of the k largest entries of x (in no order; at most x's size). A partition of a whole 128k-token row
  costs 0.6 ms, counting the entries above a threshold 0.03: the k are looked for among the entries within a widening
  gap of the maximum, while that holds few more than k."""
  if k <= 0: return np.arange(0)
  if k >= x.size: return np.arange(x.size)
  top = x.max()
  for gap in (0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0):
    near = x >= top - gap
    if (count := np.count_nonzero(near)) >= k:
      if count > max(64 * k, 4096): break   # a flat row: as many as the whole
      near = np.flatnonzero(near)
      return near if near.size == k else near[np.argpartition(-x[near], k - 1)[:k]]
  return np.argpartition(-x, k - 1)[:k]


_LOGPROB_ELEMENTS = 1 << 23   # 32 MB of float32 exps at once: 64 rows of a 128k vocabulary


def token_logprobs(rows: np.ndarray, tokens: list[int], k: int) -> list[list[tuple[int, float, int]]]:
  """Per row of raw logits `[n, V]`, its token's entry: [(token_id, logprob, rank)] for the k most likely tokens (in
  order; ties in id order) and, first, the token itself when it is not among them (its rank: 1 + the tokens more
  likely). Only the k + 1 logprobs are formed, each logit minus the row's log-sum-exp (float32 exps summed in float64:
  within 1e-6 of the float64 softmax), instead of a float64 log-softmax over the vocabulary (4 ms a row for Llama 3's
  128256 tokens: a 4096-token prompt's prompt_logprobs took 18 s)."""
  out = []
  rows = np.asarray(rows, np.float32).reshape(len(tokens), -1)
  block = max(1, _LOGPROB_ELEMENTS // rows.shape[1])   # the exps of a block of rows at once, a bounded temporary
  for start in range(0, len(tokens), block):
    x = rows[start:start + block]
    top = x.max(axis=1, keepdims=True)
    lse = top[:, 0].astype(np.float64) + np.log(np.exp(x - top).sum(axis=1, dtype=np.float64))
    for row, norm, token in zip(x, lse, tokens[start:start + block]):
      best = largest(row, k)
      best = best[np.lexsort((best, -row[best]))]
      entry = [(int(t), float(row[t]) - norm, i + 1) for i, t in enumerate(best)]
      if token not in best: entry.insert(0, (token, float(row[token]) - norm, int(np.count_nonzero(row > row[token])) + 1))
      out.append(entry)
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
