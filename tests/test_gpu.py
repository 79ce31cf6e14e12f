"""The engine on a GPU, against HF transformers on the same GPU: the paths a CPU run never takes (tinygrad's graph
replay, host-to-device copies, tinygrad's generated GPU kernels).

    TINYVLLM_TEST_DEVICE=CUDA python -m pytest -q tests/test_gpu.py      # or NV, AMD, METAL (a Mac's GPU)

Skipped without TINYVLLM_TEST_DEVICE (CI has no GPU). On Linux, TINYVLLM_TEST_DEVICE=METAL runs it on the emulated
METAL device (slow; HF then runs on the CPU). Models are the suite's tiny random checkpoints in float32 (so HF's and
ours are the same maths), written by transformers; HF runs on torch's CUDA device when there is one.

Tolerances: float32 on both sides, differing in summation order only: sampled tokens' logprobs within 1e-4 absolute
(measured 5.7e-6 on an H100 with graphs off), greedy tokens equal. Quantized paths say theirs where they are."""
from __future__ import annotations
import json, os
import numpy as np
import pytest

DEVICE = os.environ.get("TINYVLLM_TEST_DEVICE", "")
pytestmark = pytest.mark.skipif(DEVICE in ("", "CPU"), reason="no GPU named: set TINYVLLM_TEST_DEVICE=CUDA (or NV, AMD, METAL) to run "
                                                              "the engine on it against HF transformers")
LOGPROB_TOL = 1e-4


@pytest.fixture(scope="module", autouse=True)
def on_device():
  """Every engine of this module runs on DEVICE (tinygrad's DEV, which the engine threads read too)."""
  if DEVICE == "METAL":
    from tinyvllm.kernels.emulator.metal_device import install
    import sys
    if sys.platform != "darwin": install()
  from tinygrad.helpers import Context
  with Context(DEV=DEVICE): yield


@pytest.fixture(scope="module")
def torch_device() -> str:
  import torch
  return "cuda" if DEVICE in ("CUDA", "NV") and torch.cuda.is_available() else "cpu"


class HF:
  """A checkpoint in transformers on torch_device: greedy continuations and every position's log-softmax."""
  def __init__(self, path, device: str, state_dict: dict | None = None):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    self.torch, self.device = torch, device
    if state_dict is None: model = LlamaForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    else:
      model = LlamaForCausalLM(LlamaConfig.from_pretrained(path))
      model.load_state_dict({k: torch.from_numpy(np.array(v, np.float32)) for k, v in state_dict.items()})
    self.model = model.to(device).eval()

  def logprobs(self, ids: list[int]) -> np.ndarray:
    """[len(ids), V]: row i is the log-distribution of the token after ids[:i+1]."""
    with self.torch.no_grad():
      logits = self.model(self.torch.tensor([ids], device=self.device)).logits[0].double()
      return self.torch.log_softmax(logits, -1).cpu().numpy()

  def greedy(self, prompt: list[int], n: int) -> list[int]:
    lp = None
    ids = list(prompt)
    for _ in range(n):   # one full pass per token: exact, and tiny models make it cheap
      lp = self.logprobs(ids)
      ids.append(int(lp[-1].argmax()))
    return ids[len(prompt):]


def check_against_hf(hf: HF, prompt: list[int], out, tol: float = LOGPROB_TOL, tokens: bool = True) -> float:
  """Our completion's tokens equal HF's greedy ones (when `tokens`), and each sampled token's logprob is HF's at its
  position within `tol`. Returns the largest logprob difference."""
  c = out.outputs[0]
  ref = hf.logprobs(prompt + c.token_ids[:-1])[len(prompt) - 1:]
  if tokens: assert c.token_ids == ref.argmax(-1).tolist(), f"tokens differ from HF's greedy ones: {c.token_ids} vs {ref.argmax(-1).tolist()}"
  diff = max(abs(lps[t].logprob - ref[i, t]) for i, (t, lps) in enumerate(zip(c.token_ids, c.logprobs)))
  assert diff < tol, diff
  return diff


def prompts(lengths, vocab: int = 380, seed: int = 0) -> list[list[int]]:
  rng = np.random.default_rng(seed)
  return [rng.integers(4, vocab, n).tolist() for n in lengths]


GREEDY = dict(temperature=0, ignore_eos=True, logprobs=1)


def engine(path, **kw):
  """An engine on DEVICE in float32. On METAL a model whose head_dim our shaders do not take runs the portable kernels
  (on CUDA and NV they are the only ones)."""
  from tinyvllm.engine.llm_engine import LLMEngine
  from tinyvllm.kernels import metal
  from tinyvllm.model.weights import load_config
  if DEVICE == "METAL" and load_config(str(path)).head_dim not in metal.HEAD_DIMS: kw.setdefault("kernel_backend", "portable")
  return LLMEngine.from_kwargs(str(path), **{"dtype": "float32", "block_size": 8, "num_kv_blocks": 256, **kw})


def run(eng, requests: list[tuple[list[int], object]]) -> list:
  """Add (prompt ids, SamplingParams) requests and step until all finish; final outputs in request order."""
  for i, (ids, params) in enumerate(requests): eng.add_request(str(i), {"prompt_token_ids": ids}, params)
  finals = {}
  while eng.has_unfinished_requests():
    for out in eng.step():
      if out.finished: finals[out.request_id] = out
  outs = [finals[str(i)] for i in range(len(requests))]
  assert all(o.error is None for o in outs), [o.error for o in outs if o.error]
  return outs


def graphed(eng) -> bool:
  """Did any captured pass replay as a tinygrad graph (CUDA graph, Metal indirect command buffer)?"""
  from tinygrad.uop.ops import Ops
  return any(call.src[0].op is Ops.CUSTOM_FUNCTION and call.src[0].arg == "graph"
             for r in eng.runner.captures() for call in r.jit.captured.linear.src)


@pytest.mark.parametrize("name", ["gqa", "tied", "llama3"])
def test_graph_replay_and_chunked_prefill_match_hf(tiny_model_factory, torch_device, name):
  from tinyvllm import SamplingParams
  path = tiny_model_factory(name)
  hf = HF(path, torch_device)
  eng = engine(path, max_num_batched_tokens=16)   # prompts of 37 and 70 tokens prefill in chunks
  ps = prompts([37, 5, 70], seed=1)
  outs = run(eng, [(p, SamplingParams(max_tokens=12, **GREEDY)) for p in ps])
  for p, out in zip(ps, outs): check_against_hf(hf, p, out)
  assert graphed(eng), f"no pass replayed as a graph on {DEVICE}"


def test_preemption_and_prefix_caching_match_hf(tiny_model, torch_device):
  from tinyvllm import SamplingParams
  hf = HF(tiny_model, torch_device)
  shared = prompts([48], seed=2)[0]
  ps = [shared + tail for tail in prompts([3, 9, 17, 5], seed=3)]
  eng = engine(tiny_model, num_kv_blocks=24, max_num_seqs=4)   # 4 x ~80 tokens do not fit 24 blocks of 8: preemption
  outs = run(eng, [(p, SamplingParams(max_tokens=24, **GREEDY)) for p in ps])
  assert eng.scheduler.num_preemptions > 0 and eng.scheduler.prefix_cache_hits > 0
  for p, out in zip(ps, outs): check_against_hf(hf, p, out)


def test_int8_kv_cache_matches_hf_within_its_noise(tiny_model, torch_device):
  """int8 codes with a float16 scale per head vector: logprobs move by the quantization noise (about 1e-2 here),
  so tokens are compared only where HF's top two are further apart than that."""
  from tinyvllm import SamplingParams
  hf = HF(tiny_model, torch_device)
  ps = prompts([30, 11], seed=4)
  outs = run(engine(tiny_model, kv_cache_dtype="int8"), [(p, SamplingParams(max_tokens=10, **GREEDY)) for p in ps])
  for p, out in zip(ps, outs):
    c = out.outputs[0]
    ref = hf.logprobs(p + c.token_ids[:-1])[len(p) - 1:]
    top2 = np.sort(ref, -1)[:, -2:]
    first_close = next((i for i, (a, b) in enumerate(top2) if b - a < 0.1), len(c.token_ids))
    assert c.token_ids[:first_close] == ref.argmax(-1).tolist()[:first_close]
    assert max(abs(lps[t].logprob - ref[i, t]) for i, (t, lps) in enumerate(zip(c.token_ids[:first_close], c.logprobs))) < 0.05


def test_int4_weights_match_hf_on_the_dequantized_weights(tiny_model_factory, torch_device):
  """quantization="int4": packed weights through tinygrad's GPU kernels, against HF running the same weights
  dequantized to float32 (exact maths on both sides: the float32 tolerance holds)."""
  from tinyvllm import SamplingParams
  from tinyvllm.model.weights import load_checkpoint
  from tinyvllm.quant import int4
  path = tiny_model_factory("metal")
  hf = HF(path, torch_device, int4.dequantize_state_dict(load_checkpoint(path, "int4").tensors))
  ps = prompts([19, 40], seed=5)
  outs = run(engine(path, quantization="int4"), [(p, SamplingParams(max_tokens=10, **GREEDY)) for p in ps])
  for p, out in zip(ps, outs): check_against_hf(hf, p, out)


def test_structured_output_is_valid_and_matches_hf_under_the_grammar(tiny_model, torch_device):
  """A JSON schema constrains decoding on the GPU: each token is HF's greedy choice among the tokens the grammar
  allows at that point (llguidance's mask through our grammar state, which the CPU suite checks on its own), the
  text parses and satisfies the schema. HF is the reference rather than the CPU device: a GPU host may have no C
  compiler for tinygrad's CPU device (the lent H100 has none)."""
  import jsonschema
  from tinyvllm import SamplingParams, StructuredOutputsParams
  schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}, "ok": {"type": "boolean"}},
            "required": ["name", "ok"], "additionalProperties": False}   # bounded: the answer ends well within max_tokens
  constraint = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
  params = SamplingParams(max_tokens=64, temperature=0, logprobs=1, structured_outputs=constraint)
  hf = HF(tiny_model, torch_device)
  eng = engine(tiny_model)
  ps = prompts([12, 25], seed=6)
  for p, out in zip(ps, run(eng, [(p, params) for p in ps])):
    state, want = eng.input_processor.grammars.compile(constraint).new_state(), []
    while len(want) < params.max_tokens and (not want or want[-1] not in state.eos_ids):
      lp = hf.logprobs(p + want)[-1] + state.bias()
      want.append(int(lp.argmax()))
      state.commit([want[-1]])
    c = out.outputs[0]
    assert c.token_ids == want and c.finish_reason == "stop", (c.token_ids, want)
    jsonschema.validate(json.loads(c.text), schema)


def test_speculative_decoding_matches_hf(tiny_model, torch_device):
  """A self-draft (the target's first layer) proposes 4 tokens a step; exact rejection sampling keeps greedy tokens HF's."""
  from tinyvllm import SamplingParams
  hf = HF(tiny_model, torch_device)
  ps = prompts([21, 8], seed=7)
  eng = engine(tiny_model, draft_model="self:1", num_speculative_tokens=4, speculation="always")
  outs = run(eng, [(p, SamplingParams(max_tokens=16, **GREEDY)) for p in ps])
  assert sum(o.metrics.num_draft_tokens for o in outs) > 0
  for p, out in zip(ps, outs): check_against_hf(hf, p, out)


def test_batch_of_64_matches_hf(tiny_model, torch_device):
  from tinyvllm import SamplingParams
  hf = HF(tiny_model, torch_device)
  ps = prompts(np.random.default_rng(8).integers(2, 40, 64).tolist(), seed=8)
  eng = engine(tiny_model, max_num_seqs=64, num_kv_blocks=1024, max_num_batched_tokens=4096)
  outs = run(eng, [(p, SamplingParams(max_tokens=6, **GREEDY)) for p in ps])
  assert any(shape.num_seqs == 64 for shape in eng.runner.replays), "no 64-sequence pass ran"
  for p, out in zip(ps, outs): check_against_hf(hf, p, out)


def test_multi_step_runs_match_hf(tiny_model, torch_device):
  """num_scheduler_steps=8: greedy passes back to back on the GPU, each reading the tokens the pass before took there;
  the tokens are HF's greedy ones (multi-step requests take no logprobs) and most passes ran in runs of 8."""
  from tinyvllm import SamplingParams
  hf = HF(tiny_model, torch_device)
  ps = prompts([5, 19, 33, 12], seed=9)
  eng = engine(tiny_model, num_scheduler_steps=8)
  for i, p in enumerate(ps): eng.add_request(str(i), {"prompt_token_ids": p}, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
  outs, passes = {}, []
  while eng.has_unfinished_requests():
    for o in eng.step(): outs[o.request_id] = o
    passes.append(eng.last_stats[0].num_decode_passes)
  for i, p in enumerate(ps): assert outs[str(i)].outputs[0].token_ids == hf.greedy(p, 30), i
  assert passes.count(8) >= 3, passes


def test_async_scheduling_matches_hf(tiny_model, torch_device):
  """Pipelined decoding (async_scheduling=True): each decode run is launched before the host reads the one before it
  (replay.OrderedCopies: its uploads queued behind the work in flight, its reads waiting for their own run only). Four
  greedy requests of different lengths, one stopping at a stop token and one aborted midway: the others' tokens
  are HF's greedy ones, most runs followed another, and every KV block is back in the pool."""
  from tinyvllm import SamplingParams
  from tinyvllm.engine.replay import OrderedCopies
  if not OrderedCopies.ordered(DEVICE): pytest.skip(f"async scheduling is refused on {DEVICE} (its copies are not ordered with the work in flight)")
  hf = HF(tiny_model, torch_device)
  ps = prompts([5, 19, 33, 12], seed=10)
  eng = engine(tiny_model, async_scheduling=True)
  assert eng.core.pipelined
  follows, launch = [], eng.runner.launch_decodes
  eng.runner.launch_decodes = lambda d, steps, after=None, **kw: (follows.append(after is not None), launch(d, steps, after, **kw))[1]
  want = [hf.greedy(p, n) for p, n in zip(ps, (30, 21, 30, 30))]
  stop = want[2][9]
  params = [SamplingParams(max_tokens=30, temperature=0, ignore_eos=True), SamplingParams(max_tokens=21, temperature=0, ignore_eos=True),
            SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop_token_ids=[stop]), SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)]
  for i, (p, sp) in enumerate(zip(ps, params)): eng.add_request(str(i), {"prompt_token_ids": p}, sp)
  outs, steps = {}, 0
  while eng.has_unfinished_requests():
    for o in eng.step(): outs[o.request_id] = o
    steps += 1
    if steps == 8: outs |= {o.request_id: o for o in eng.abort_request("3")}
  assert outs["0"].outputs[0].token_ids == want[0] and outs["1"].outputs[0].token_ids == want[1]
  cut = want[2].index(stop) + 1
  assert outs["2"].outputs[0].token_ids == want[2][:cut] and outs["2"].outputs[0].finish_reason == "stop"
  assert outs["3"].outputs[0].finish_reason == "abort"
  assert sum(follows) > len(follows) / 2, follows
  bm = eng.core.block_manager
  assert bm.num_free == bm.num_blocks


def test_async_scheduling_equals_sync_on_random_mixes(tiny_model):
  """Async scheduling against the same engine without it on random mixes, where the GPU's ordering could break what
  the CPU device cannot: requests arriving over the first steps, greedy, n=2, stop ids, EOS, max_tokens, aborts
  between steps, small KV pools (preemption), 1 to 3 passes a run, prefix caching on and off. Every request not
  aborted gets the same tokens and finish reason, an aborted one a prefix of the other's, and both pools end whole."""
  import random
  from tinyvllm import SamplingParams
  from tinyvllm.engine.replay import OrderedCopies
  if not OrderedCopies.ordered(DEVICE): pytest.skip(f"async scheduling is refused on {DEVICE}")
  for seed in range(3):
    r = random.Random(seed)
    kw = dict(num_kv_blocks=r.choice([8, 12, 64]), block_size=8, max_model_len=64, max_num_seqs=r.choice([2, 4, 8]),
              enable_prefix_caching=r.random() < 0.5, num_scheduler_steps=r.choice([1, 1, 3]))
    events = []
    for i in range(r.randint(3, 7)):
      params = dict(temperature=0, max_tokens=r.choice([2, 5, 9, 17, 30]), ignore_eos=r.random() < 0.7, n=r.choice([1, 1, 2]))
      if r.random() < 0.4: params["stop_token_ids"] = r.sample(range(4, 380), 20)
      events.append((r.randint(0, 8), "add", (str(i), prompts([r.randint(2, 20)], seed=100 * seed + i)[0], params)))
      if r.random() < 0.3: events.append((r.randint(1, 15), "abort", str(i)))
    events.sort(key=lambda e: (e[0], e[1] == "abort"))
    results = []
    for pipelined in (True, False):
      eng, todo, outs, aborted, step = engine(tiny_model, async_scheduling=pipelined, **kw), list(events), {}, set(), 0
      while todo or eng.has_unfinished_requests():
        while todo and todo[0][0] <= step:
          _, kind, x = todo.pop(0)
          if kind == "add": eng.add_request(x[0], {"prompt_token_ids": x[1]}, SamplingParams(**x[2]))
          else:
            aborted.add(x)
            outs |= {o.request_id: o for o in eng.abort_request(x)}
        outs |= {o.request_id: o for o in eng.step()}
        step += 1
        assert step < 500
      bm = eng.core.block_manager
      assert bm.num_free == bm.num_blocks, (seed, pipelined)
      results.append(({rid: [(c.token_ids, c.finish_reason) for c in o.outputs] for rid, o in outs.items()}, aborted))
    (a, aborted), (b, _) = results
    for rid in set(a) | set(b):
      if rid in aborted:
        for (ta, _), (tb, _) in zip(a.get(rid, []), b.get(rid, [])): assert ta[:len(tb)] == tb[:len(ta)], (seed, rid)
      else: assert a.get(rid) == b.get(rid), (seed, rid, a.get(rid), b.get(rid))


def test_a_4096_token_prompt_in_one_step_matches_hf(tmp_path_factory, torch_device):
  from conftest import make_tiny_llama
  from tinyvllm import SamplingParams
  path = make_tiny_llama(tmp_path_factory.mktemp("tiny-4k"), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=4608)
  hf = HF(path, torch_device)
  p = prompts([4095], seed=9)[0]
  eng = engine(path, max_num_batched_tokens=4096, num_kv_blocks=600, max_model_len=4608)
  out = run(eng, [(p, SamplingParams(max_tokens=4, **GREEDY))])[0]
  assert any(shape.num_tokens >= 4095 and shape.query_len > 1 for shape in eng.runner.replays), "the prompt was not read in one step"
  check_against_hf(hf, p, out)


def test_openai_server_matches_hf(tiny_model, torch_device):
  import openai
  from conftest import serve_in_thread
  from tinyvllm.config import EngineConfig
  from tinyvllm.entrypoints.openai.api_server import create_app
  hf = HF(tiny_model, torch_device)
  app = create_app(EngineConfig(model=str(tiny_model), dtype="float32", block_size=8, num_kv_blocks=256,
                                kernel_backend="portable" if DEVICE == "METAL" else "auto"))
  with serve_in_thread(app) as url:
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", timeout=120, max_retries=0)
    p = prompts([15], seed=10)[0]
    r = client.completions.create(model=client.models.list().data[0].id, prompt=p, max_tokens=8, temperature=0, logprobs=1,
                                  extra_body={"ignore_eos": True})
  want = hf.greedy(p, 8)
  tokenizer = app.state.engine.get_tokenizer()
  assert r.choices[0].logprobs.tokens == [tokenizer.token_to_str(t) for t in want] and r.usage.completion_tokens == 8
  ref = hf.logprobs(p + want[:-1])[len(p) - 1:]
  assert np.allclose(r.choices[0].logprobs.token_logprobs, [ref[i, t] for i, t in enumerate(want)], atol=LOGPROB_TOL)
