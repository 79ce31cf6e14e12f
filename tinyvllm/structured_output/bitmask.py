"""Token masks: llguidance's bitmasks (bit t % 32 of int32 word t // 32 set when token t is allowed), turned into an
additive bias (0 where allowed, -inf elsewhere) that the sampler adds to the logits, and a step's worth of them
computed beside the model step.

Why a bias row: on the critical path, after the model step, `logits + bias` costs ~10 us for 49k tokens where
selecting with the bitmask (`np.where`) costs ~50 us; the conversion itself (~50 us) happens with the mask, on the
worker thread."""
from __future__ import annotations
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING
import numpy as np

if TYPE_CHECKING: from tinyvllm.structured_output.state import GrammarState


def mask_words(vocab_size: int) -> int: return (vocab_size + 31) // 32


def allowed_tokens(bitmask: np.ndarray, vocab_size: int) -> np.ndarray:
  """bool[vocab_size] from one bitmask row."""
  return np.unpackbits(np.ascontiguousarray(bitmask).view(np.uint8), count=vocab_size, bitorder="little").view(bool)


def bias_from_bitmask(bitmask: np.ndarray, vocab_size: int) -> np.ndarray:
  """float32[vocab_size]: 0 for allowed tokens, -inf for the others. Raises ValueError when nothing is allowed
  (sampling from all -inf would give NaN, never a token)."""
  allowed = allowed_tokens(bitmask, vocab_size)
  if not allowed.any(): raise ValueError("structured output: the grammar allows no token here")
  bias = np.zeros(vocab_size, np.float32)
  np.copyto(bias, np.float32(-np.inf), where=~allowed)
  return bias


def apply_bias(logits: np.ndarray, bias: np.ndarray) -> np.ndarray:
  """Logits `[..., V]` with the disallowed tokens at -inf (a new float32 array)."""
  return np.add(logits, bias, dtype=np.float32)


@dataclass(frozen=True)
class MaskPolicy:
  """Where a step's masks are computed. "thread": on the worker thread while the model step runs (llguidance and
  the model's kernels both release the GIL); "inline": in place, before the step; "auto": on the thread when the
  model step leaves a core idle and the measured cost of the step's masks exceeds `thread_above_seconds` (handing
  work to the thread and back costs ~25 us here, so a lone cheap mask is faster in place).

  Why the idle core: on the CPU device the kernels keep every core busy, so a mask computed beside them takes its
  core from them, and the step is no shorter (bench/structured_output.py: 1-3% overhead either way on 2 cores, the
  thread no better); on a GPU, or with fewer kernel threads than cores, the CPU has room while the step runs."""
  mode: str = "auto"
  thread_above_seconds: float = 100e-6


class PendingMasks:
  """The bias rows of one step's constrained sequences, being computed (or computed already)."""
  def __init__(self, results: dict[GrammarState, np.ndarray | Exception], future: Future | None):
    self._results, self._future = results, future

  def wait(self) -> None:
    """Return once the worker is done with these states' matchers (the caller may touch them again after)."""
    if self._future is not None: self._future.result()
    self._future = None

  def bias(self, state: GrammarState) -> np.ndarray:
    """The state's bias row; raises what computing it raised, so the failure stays with that sequence."""
    self.wait()
    result = self._results[state]
    if isinstance(result, Exception): raise result
    return result


class MaskWorker:
  """Computes the masks of a step's constrained sequences at their committed tokens. The thread starts with the
  first step that needs it: engines that never see a constraint have none."""
  def __init__(self, policy: MaskPolicy = MaskPolicy(), spare_core: bool = True):
    self.policy = policy
    self.spare_core = spare_core         # does the model step leave a core idle (see MaskPolicy)?
    self.seconds_per_mask = 0.0          # running average of one mask's cost (bitmask and bias row)
    self._pool: ThreadPoolExecutor | None = None

  def start(self, states: list[GrammarState]) -> PendingMasks:
    """Begin computing. The caller must not touch these states until `PendingMasks.wait()` (or `bias`) returned:
    llguidance refuses a matcher another thread is using."""
    results: dict[GrammarState, np.ndarray | Exception] = {}
    mode = self.policy.mode
    if mode == "auto":
      mode = "thread" if self.spare_core and len(states) * self.seconds_per_mask > self.policy.thread_above_seconds else "inline"
    if not states or mode == "inline":
      self._fill(states, results)
      return PendingMasks(results, None)
    if self._pool is None: self._pool = ThreadPoolExecutor(1, thread_name_prefix="tinyvllm-masks")
    return PendingMasks(results, self._pool.submit(self._fill, states, results))

  def _fill(self, states: list[GrammarState], results: dict) -> None:
    start = time.perf_counter()
    for s in states:
      try:
        s.reset_drafts()
        results[s] = s.bias()
      except Exception as e: results[s] = e   # handed to that sequence's sampling, which fails it alone
    if states: self.seconds_per_mask += 0.2 * ((time.perf_counter() - start) / len(states) - self.seconds_per_mask)
