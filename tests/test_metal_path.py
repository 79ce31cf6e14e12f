"""The Mac path end to end on Linux: DEV=METAL through the emulated METAL device (tinyvllm.kernels.emulator.metal_device).

Each configuration runs in its own process with DEV=METAL TINYVLLM_EMULATE_METAL=1, exactly as a Mac user's run
would go: `auto` picks the metal kernels, `dtype=auto` float16, tinygrad's MetalRenderer writes its own kernels, our
shaders run through MetalBackend, layers replay through TinyJit and tinygrad's graph. Against the CPU path:
  * float32 (and float32 + INT4): greedy tokens equal to the CPU path's, token for token.
  * float16 (and float16 + INT4): every token the Metal path picks is the float32 reference's argmax, or within
    NEAR_TIE of it: float16 rounds each logit by ~2^-11 relative (logits here span ~13, so a few 1e-3 absolute),
    and where the reference's top two are that close either pick is right. The CPU's own float16 path obeys the
    same rule, and the two float16 paths agree token for token until the first such near-tie.
The device counts what a Mac would pay (see `Counters`): a replayed decode step must not copy host->device beyond
its one input upload, nor wait for the GPU beyond that upload and the logits readback.
"""
import functools, json, os, subprocess, sys

import numpy as np
import pytest

from conftest import TINY_CONFIGS, make_tiny_llama, our_prefill_logits

PROMPTS = ["Hello world", "The quick brown fox", "def f(x):"]
MAX_TOKENS = 12
NEAR_TIE = 0.05

CHILD = r"""
import json, sys
from tinygrad import Device
from tinyvllm import SamplingParams
from tinyvllm.engine.llm_engine import LLMEngine
model, dtype, quant, prompts, max_tokens, kv, capture = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4]), int(sys.argv[5]), sys.argv[6], sys.argv[7]
engine = LLMEngine.from_kwargs(model, dtype=dtype, quantization=None if quant == "none" else quant, max_model_len=128, kv_cache_dtype=kv,
                               capture_mode=capture)
greedy = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
for i, p in enumerate(prompts): engine.add_request(str(i), p, greedy)
tokens = {}
while engine.has_unfinished_requests():
  for out in engine.step():
    if out.finished: tokens[int(out.request_id)] = list(out.outputs[0].token_ids)
# a lone sequence: its prefill, a first decode step (captures the layer replay for this shape), then replays
counters = Device["METAL"].counters
engine.add_request("probe", prompts[0], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
steps = []
while engine.has_unfinished_requests():
  counters.reset()
  engine.step()
  steps.append(counters.snapshot())
# the benchmark's count of the kernels a step launched (runner.launch_times), beside the device's, on a replayed step
times = engine.runner.launch_times
times.enabled = True
engine.add_request("timed", prompts[0], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
while engine.has_unfinished_requests():
  counters.reset()
  before = times.kernels
  engine.step()
  steps[-1]["timed_step"] = {"runner_kernels": times.kernels - before, "launches": counters.snapshot()["launches"]}
print("RESULT " + json.dumps({"backend": engine.kernel_backend, "dtype": str(engine.runner.model.dtype.name), "whole_pass": engine.runner.whole_pass,
                              "tokens": [tokens[i] for i in range(len(prompts))], "steps": steps}))
"""


@functools.cache   # a run is a minute of emulated Metal: tests asking for the same one share it
def run_metal(model, dtype: str, quant: str, kv_cache_dtype: str = "auto", capture_mode: str = "auto") -> dict:
  env = {**os.environ, "DEV": "METAL", "TINYVLLM_EMULATE_METAL": "1"}
  r = subprocess.run([sys.executable, "-c", CHILD, str(model), dtype, quant, json.dumps(PROMPTS), str(MAX_TOKENS), kv_cache_dtype, capture_mode], env=env,
                     capture_output=True, text=True, timeout=900)
  assert r.returncode == 0, r.stderr[-3000:]
  return json.loads(next(l for l in r.stdout.splitlines() if l.startswith("RESULT "))[7:])


def cpu_tokens(model, dtype: str, quant: str, backend: str, prompts=PROMPTS, max_tokens=MAX_TOKENS, kv_cache_dtype="auto") -> list[list[int]]:
  from tinyvllm import LLM, SamplingParams
  llm = LLM(str(model), dtype=dtype, quantization=None if quant == "none" else quant, kernel_backend=backend, max_model_len=128,
            kv_cache_dtype=kv_cache_dtype)
  try:
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]
  finally:
    llm.shutdown()


LAYERS = 4
OUTSIDE_LAYERS = 8   # launches of a step's input replay and LM head (5; 7 with INT4's head, 8 with it in float16: its logits cast)
# launches per layer (docs/kernels.md, "Kernels per decode step"): with float weights, the qkv projection (our GEMV,
# kernels/gemv.py, norms x inside and writes q, k and v rotated where they go: no RoPE shader), attention, o (+
# residual), gate/up (normed and gated inside: no SwiGLU kernel), down (+ residual) (5); with INT4 the same 5, the
# shaders' GEMV norming x itself, rotating and writing q, k and v (int4_gemv_rope), gating gate/up (int4_gemv_glu) and
# adding the residual stream; with float weights and an int8 KV cache the RoPE shader writes the codes and their
# scales (6)
PER_LAYER = {"none": 5, "int4": 5, "none, int8 kv": 6}


@pytest.fixture(scope="module")
def metal_model(tmp_path_factory):
  # the Metal kernels' shapes (head_dim 64, GQA 2) and four layers, so per-layer costs would show in a step's counts
  # intermediate 128 (a multiple of the INT4 group): with quantization="int4" every projection is INT4, down included
  return make_tiny_llama(tmp_path_factory.mktemp("tiny-metal-path"), 0, "float32",
                         **{**TINY_CONFIGS["metal"], "num_hidden_layers": LAYERS, "intermediate_size": 128})


@pytest.fixture(scope="module")
def tokenizer(metal_model):
  from transformers import AutoTokenizer
  return AutoTokenizer.from_pretrained(metal_model)


def check_decode_step(steps: list[dict], quant: str):
  """The last step is a replayed decode step of one sequence (prefill and the capturing step come first)."""
  assert len(steps) >= 4, steps
  step = steps[-1]
  assert step["launches"] > 0 and step["command_buffers"] > 0
  assert step["launches"] <= LAYERS * PER_LAYER[quant] + OUTSIDE_LAYERS, f"more launches per decode step than before: {step}"
  timed = step["timed_step"]   # a replayed step of another request, the same shape
  assert timed["runner_kernels"] == timed["launches"] == step["launches"], f"the benchmark's kernels per step miscount the device's: {step}"
  assert step["copies_in"] <= 1, f"host->device copies inside a replayed decode step: {step}"
  assert step["synchronizes"] <= 2, f"GPU waits beyond the input upload and the logits readback: {step}"
  # a replayed graph waits for its own previous run: a whole pass (capture_mode auto) waits for the step before, done
  # already; with layer captures, layers alternate between two graphs, so each waits only for the layer before last
  # while the last one keeps the GPU busy (one graph would wait for every previous layer: 3 idle waits here)
  assert step["idle_waits"] == 0, f"the host waited for the GPU's newest work, leaving it idle: {step}"


@pytest.mark.parametrize("quant", ["none", "int4"])
def test_float32_tokens_equal_cpu(metal_model, quant):
  res = run_metal(metal_model, "float32", quant)
  assert res["backend"] == "metal" and res["dtype"] == "float"
  assert res["tokens"] == cpu_tokens(metal_model, "float32", quant, "cpu")
  check_decode_step(res["steps"], quant)


def test_int8_kv_cache_tokens_equal_cpu(metal_model):
  """An int8 KV cache through the Metal shaders (cache write in rope.metal, decode and prefill attention reading
  codes and scales): float32 activations, greedy tokens equal to the CPU path's int8 cache token for token."""
  res = run_metal(metal_model, "float32", "none", "int8")
  assert res["backend"] == "metal"
  assert res["tokens"] == cpu_tokens(metal_model, "float32", "none", "cpu", kv_cache_dtype="int8")
  check_decode_step(res["steps"], "none, int8 kv")


@pytest.mark.parametrize("quant", ["none", "int4"])
def test_float16_tokens_match_reference(metal_model, tokenizer, quant):
  res = run_metal(metal_model, "auto", quant)
  assert res["backend"] == "metal" and res["dtype"] == "half"   # auto on METAL is float16
  cpu16 = cpu_tokens(metal_model, "float16", quant, "portable")
  for prompt, metal_toks, cpu_toks in zip(PROMPTS, res["tokens"], cpu16):
    ids = tokenizer(prompt)["input_ids"]
    gaps = {}
    for name, toks in (("metal", metal_toks), ("cpu", cpu_toks)):
      ref = our_prefill_logits(metal_model, ids + toks, quantization=None if quant == "none" else quant)[len(ids) - 1:-1]
      chosen = ref[np.arange(len(toks)), toks]
      assert (ref.max(1) - chosen <= NEAR_TIE).all(), (name, prompt, ref.max(1) - chosen)
      top2 = np.sort(ref, 1)
      gaps[name] = top2[:, -1] - top2[:, -2]
    # identical until the first near-tie of the float32 reference along the shared prefix
    first_tie = next((i for i, g in enumerate(gaps["metal"]) if g <= NEAR_TIE), len(metal_toks))
    assert metal_toks[:first_tie] == cpu_toks[:first_tie], (prompt, first_tie)
  check_decode_step(res["steps"], quant)


OLD_MAC_CHILD = r"""
import json, sys
from tinyvllm import LLM, SamplingParams
llm = LLM(sys.argv[1], dtype="float32", max_model_len=128)
outs = llm.generate(json.loads(sys.argv[2]), SamplingParams(max_tokens=int(sys.argv[3]), temperature=0, ignore_eos=True), use_tqdm=False)
try:
  LLM(sys.argv[1], dtype="float32", kernel_backend="metal", max_model_len=128)
  error = None
except ValueError as e: error = str(e)
print("RESULT " + json.dumps({"backend": llm.llm_engine.kernel_backend, "error": error,
                              "tokens": [list(o.outputs[0].token_ids) for o in outs]}))
"""


@pytest.mark.parametrize("env,why", [({"TINYVLLM_EMULATE_METAL_ARCH": "Mac2"}, "Apple7 or later"),      # an Intel/AMD Mac's GPU
                                     ({"TINYVLLM_EMULATE_MACOS": "12.6"}, "macOS 13 or later")])  # MSL 2.0: no simdgroup_matrix
def test_older_macs_fall_back_to_portable(metal_model, env, why):
  r = subprocess.run([sys.executable, "-c", OLD_MAC_CHILD, str(metal_model), json.dumps(PROMPTS[:2]), "6"], capture_output=True,
                     text=True, timeout=900, env={**os.environ, "DEV": "METAL", "TINYVLLM_EMULATE_METAL": "1", **env})
  assert r.returncode == 0, r.stderr[-3000:]
  res = json.loads(next(l for l in r.stdout.splitlines() if l.startswith("RESULT "))[7:])
  assert res["backend"] == "portable"
  notes = [l for l in r.stderr.splitlines() if l.startswith("tinyvllm: using the portable kernels")]
  assert len(notes) == 1 and why in notes[0], r.stderr[-2000:]
  assert res["error"] is not None and why in res["error"] and "kernel_backend='portable'" in res["error"]
  assert res["tokens"] == cpu_tokens(metal_model, "float32", "none", "cpu", PROMPTS[:2], 6)


def test_a_whole_pass_replays_in_a_few_command_buffers(metal_model):
  """capture_mode="pass" (METAL's default) replays a decode step as tinygrad's graphs of the whole pass: the same
  kernels and tokens as layer captures, in a handful of command buffers instead of one per layer, and no graph run
  waiting for an earlier one inside the step."""
  layer, whole = run_metal(metal_model, "float32", "none", capture_mode="layer"), run_metal(metal_model, "float32", "none")
  assert whole["whole_pass"] and not layer["whole_pass"]
  assert whole["tokens"] == layer["tokens"]
  a, b = layer["steps"][-1], whole["steps"][-1]
  assert b["launches"] == a["launches"] > 0
  assert a["command_buffers"] >= LAYERS + 2 and a["graph_waits"] >= LAYERS - 2, a   # the subject: one per layer before
  assert b["command_buffers"] <= 3 and b["graph_waits"] == 0 and b["idle_waits"] == 0, b

