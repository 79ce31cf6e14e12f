"""Greedy decode steps take their argmax on the device (ModelRunner.argmax_on_device, on by default off the CPU device):
the same tokens as numpy's argmax of the logits on the host, and no logits copied back for such a step. Forced on here
on the CPU device; tests/test_gpu.py and the emulated METAL runs take it by default."""
from __future__ import annotations
import numpy as np
import pytest
from tinygrad import Tensor, dtypes
from tinyvllm import SamplingParams
from tinyvllm.engine.llm_engine import LLMEngine
from test_replay import DEVICES

PROMPTS = [[5, 9, 13, 2, 7], [11, 3, 3, 8], [4, 20, 6, 1, 9, 12, 2]]


def generate(model, on_device: bool, params: list[SamplingParams], **kwargs):
  """Run PROMPTS with `params`; returns (outputs by request, logits copies to the host, passes run)."""
  engine = LLMEngine.from_kwargs(str(model), num_kv_blocks=64, block_size=8, **kwargs)
  runner = engine.runner
  runner.argmax_on_device = on_device   # before the first capture: decode captures take the argmax with it
  copies, passes = [0], [0]
  host_logits, forward = runner._host_logits, runner._forward
  runner._host_logits = lambda result: (copies.__setitem__(0, copies[0] + 1), host_logits(result))[1]
  runner._forward = lambda *a: (passes.__setitem__(0, passes[0] + 1), forward(*a))[1]
  for i, (ids, p) in enumerate(zip(PROMPTS, params)): engine.add_request(str(i), {"prompt_token_ids": ids}, p)
  outs = {}
  while engine.has_unfinished_requests():
    for o in engine.step(): outs[o.request_id] = o
  return outs, copies[0], passes[0]


@pytest.mark.parametrize("kernel_backend", ["portable", "cpu"])
def test_greedy_steps_copy_tokens_not_logits(tiny_model, kernel_backend):
  greedy = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)] * 3
  on, copies_on, passes_on = generate(tiny_model, True, greedy, kernel_backend=kernel_backend)
  off, copies_off, passes_off = generate(tiny_model, False, greedy, kernel_backend=kernel_backend)
  assert {r: o.outputs[0].token_ids for r, o in on.items()} == {r: o.outputs[0].token_ids for r, o in off.items()}
  assert passes_on == passes_off == copies_off                 # the host path copies every pass's logits
  assert copies_on < passes_on and copies_on >= 1              # only the prefills' here: every decode step took the argmax


def test_a_step_with_any_other_request_reads_logits(tiny_model):
  """A request that needs its logits (logprobs, penalties, sampling) puts its step on the host path, for every row."""
  params = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2),
            SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, repetition_penalty=1.3)]
  on, copies_on, passes_on = generate(tiny_model, True, params)
  off, _, _ = generate(tiny_model, False, params)
  assert copies_on == passes_on
  for r in on:
    assert on[r].outputs[0].token_ids == off[r].outputs[0].token_ids
  assert len(on["1"].outputs[0].logprobs) == 6


@pytest.mark.parametrize("kernel,device", [("portable", d) for d in DEVICES] + [("cpu", "CPU")])
@pytest.mark.parametrize("V", [1000, 5000])
def test_device_argmax_is_numpys(kernel, device, V):
  """portable.argmax (every device: here the CPU device and the emulated METAL one) and cpu.argmax (the C pass the CPU
  device's kernels take) pick the first of equal maxima (ties do happen in float16 logits; -0.0 equals 0.0) and a
  row's first NaN, as numpy's argmax (the host path) does; tinygrad's own argmax skips NaN on the CPU device. Random
  rows, with ties, NaN, infinities, a row of -inf; checked captured and replayed, as the runner's decode passes run it.
  portable.argmax is one kernel for a short row and two for a long one (runs of ARGMAX_RUN keys, then the runs: V=5000
  pads to 8192), whose ties and NaN here sit in different runs, the padding's keys beside a row of -inf."""
  from tinygrad import TinyJit
  from tinygrad.helpers import Context, GlobalCounters
  from tinyvllm.kernels import cpu, portable
  rng = np.random.default_rng(V)
  argmax = (portable if kernel == "portable" else cpu).argmax
  with Context(DEV=device):
    step = TinyJit(lambda x: argmax(x).realize())
    for _ in range(3):
      logits = rng.standard_normal((10, V)).astype(np.float32)
      for row, cols in enumerate([(5, V - 300), (0, V - 1), (V - 2, V - 1)]): logits[row, list(cols)] = 9.0
      logits[3, [17, V - 600]], logits[4, V - 100], logits[5, [2, 3]] = np.nan, np.nan, (np.inf, np.inf)
      logits[6] = -np.inf
      logits[7, rng.integers(0, V)] = np.nan
      logits[8] = -np.inf
      logits[8, [10, V - 20]] = -0.0, 0.0
      assert (step(Tensor(logits).realize()).numpy() == np.argmax(logits, -1)).all()
    if kernel == "portable":
      x = Tensor(logits).realize()
      GlobalCounters.reset()
      argmax(x).realize()
      assert GlobalCounters.kernel_count == (1 if V <= portable.ARGMAX_RUN * portable.ARGMAX_RUNS_PAD else 2)
  assert Tensor(logits[3:4]).argmax(-1).item() != 17   # the reason for our own
