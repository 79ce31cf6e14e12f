"""Failures stay with the requests they concern: a failing model pass, sampler or detokenizer fails its own
requests, the others finish as if nothing happened, the engine serves the next call, and metrics count each
request once. Also the edges an independent review found: speculation at the end of the context, request counts
with n > 1, aborts of reused ids, a crashed engine thread, stop strings before min_tokens."""
from __future__ import annotations
import asyncio
import numpy as np
import pytest
from tinyvllm import AsyncLLM, GenerationError, LLM, SamplingParams
from tinyvllm.engine.llm_engine import LLMEngine

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def engine_for(path, **kw) -> LLMEngine:
  return LLMEngine.from_kwargs(str(path), **{"block_size": 8, "num_kv_blocks": 64, **kw})


def run(engine: LLMEngine) -> dict:
  finals = {}
  while engine.has_unfinished_requests():
    for out in engine.step():
      if out.finished: finals[out.request_id] = out
  return finals


def test_a_failing_model_pass_fails_its_requests_and_the_engine_goes_on(tiny_model):
  engine = engine_for(tiny_model)
  want = run_one(engine, "ok-0")
  execute = engine.runner.execute
  calls = {"n": 0}
  def flaky(*a, **kw):
    calls["n"] += 1
    if calls["n"] == 2: raise RuntimeError("injected model failure")
    return execute(*a, **kw)
  engine.runner.execute = flaky
  engine.add_request("a", "Hello world", GREEDY)
  engine.step()                                                       # prefill: fine
  outs = engine.step()                                                # the decode pass raises
  assert [(o.request_id, o.outputs[0].finish_reason) for o in outs] == [("a", "error")]
  assert "injected model failure" in outs[0].error
  sched, it = engine.last_stats
  assert [f.finish_reason for f in it.finished] == ["error"] and it.num_generation_tokens == 0   # counted once, as error
  assert not engine.has_unfinished_requests() and engine.block_manager.num_free == engine.block_manager.num_blocks
  assert run_one(engine, "ok-1") == want                               # the next request is served as before


def run_one(engine: LLMEngine, rid: str) -> list[int]:
  engine.add_request(rid, "Hello world", GREEDY)
  return run(engine)[rid].outputs[0].token_ids


def test_a_failing_sampler_or_detokenizer_fails_only_its_request(tiny_model):
  engine = engine_for(tiny_model)
  want = {rid: run_one(engine, rid) for rid in ("w",)}["w"]
  # sampling: a request whose penalties blow up
  penalized = engine.core._penalized
  def bad_penalty(seq, logits, extra=()):
    if seq.request_id == "bad": raise ValueError("injected sampling failure")
    return penalized(seq, logits, extra)
  engine.core._penalized = bad_penalty
  for rid in ("good", "bad"): engine.add_request(rid, "Hello world", GREEDY)
  finals = run(engine)
  assert finals["bad"].outputs[0].finish_reason == "error" and "injected sampling failure" in finals["bad"].error
  assert finals["good"].outputs[0].token_ids == want and finals["good"].error is None
  engine.core._penalized = penalized
  # detokenization: one request's detokenizer raises mid-generation
  for rid in ("good2", "bad2"): engine.add_request(rid, "Hello world", GREEDY)
  engine.step()
  state = engine.output_processor.requests["bad2"].completions[0]
  state.detokenizer.add = lambda token: (_ for _ in ()).throw(UnicodeError("injected detokenizer failure"))
  finals = run(engine)
  assert finals["bad2"].outputs[0].finish_reason == "error" and "injected detokenizer failure" in finals["bad2"].error
  assert finals["good2"].outputs[0].token_ids == want
  assert engine.block_manager.num_free == engine.block_manager.num_blocks


def test_rows_drawn_on_threads_are_the_rows_drawn_in_turn(tiny_model, monkeypatch):
  """A step's sampled rows of a large vocabulary are drawn on the sampling threads (core.PARALLEL_SAMPLING_VOCAB, set
  to 0 here to take the tiny model's): seeded requests with top-p, top-k and logprobs get the tokens and logprobs of
  rows drawn one after another, and a row whose draw raises fails only its request."""
  import threading
  from tinyvllm.engine import core
  params = [SamplingParams(temperature=1.0, top_p=0.9, seed=s, max_tokens=12, ignore_eos=True, logprobs=3) for s in range(3)] + \
           [SamplingParams(temperature=0.7, top_k=5, seed=9, max_tokens=12, ignore_eos=True)]
  def generate(on_threads: bool) -> tuple[dict, set]:
    monkeypatch.setattr(core, "PARALLEL_SAMPLING_VOCAB", 0 if on_threads else 1 << 30)
    engine = engine_for(tiny_model)
    threads, draw, penalized = set(), engine.core._draw, engine.core._penalized
    def recorded(seq, logits, mask):
      threads.add(threading.current_thread().name)
      return draw(seq, logits, mask)
    def bad_penalty(seq, logits, extra=()):
      if seq.request_id == "bad" and seq.num_output_tokens == 4: raise ValueError("injected sampling failure")
      return penalized(seq, logits, extra)
    engine.core._draw, engine.core._penalized = recorded, bad_penalty
    for i, p in enumerate(params): engine.add_request(str(i), "Hello world", p)
    engine.add_request("bad", "Hello there", params[0])
    finals = run(engine)
    return {rid: (o.error is not None, o.outputs[0].token_ids, o.outputs[0].logprobs) for rid, o in finals.items()}, threads
  (on_threads, used), (in_turn, main) = generate(True), generate(False)
  assert on_threads == in_turn
  assert on_threads["bad"][0] and len(on_threads["bad"][1]) == 4 and not any(on_threads[str(i)][0] for i in range(4))
  assert all(len(on_threads[str(i)][1]) == 12 for i in range(4)) and on_threads["0"][2] is not None
  assert not any(name.startswith("tinyvllm-sample") for name in main)
  if core.default_threads() > 1: assert any(name.startswith("tinyvllm-sample") for name in used)   # one core: no threads


def test_speculation_near_the_end_of_the_context(tiny_model):
  """A sequence a few tokens from max_model_len decodes plainly while its neighbours speculate; both finish
  with the tokens of an engine without a draft."""
  prompts = [[7] * 20, [9] * 5]
  params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
  want = [o.outputs[0].token_ids for o in LLM(str(tiny_model), max_model_len=32, block_size=8, num_kv_blocks=32)
          .generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
  spec = LLM(str(tiny_model), max_model_len=32, block_size=8, num_kv_blocks=32, draft_model="self:1", speculation="always")
  outs = spec.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
  assert [o.outputs[0].token_ids for o in outs] == want and [o.error for o in outs] == [None, None]
  assert [o.outputs[0].finish_reason for o in outs] == ["length", "length"] and len(want[0]) == 12
  spec.shutdown()


def test_requests_are_counted_once_whatever_n(tiny_model):
  engine = engine_for(tiny_model, max_num_seqs=1, enable_prefix_caching=False)
  engine.add_request("n4", "Hello", SamplingParams(n=4, max_tokens=3, temperature=1.0, seed=1))
  engine.step()
  stats = engine.core.stats()
  assert (stats.num_running, stats.num_waiting) == (1, 0)             # one request, partly running: not waiting
  engine.add_request("other", "World", GREEDY)
  assert engine.core.stats().num_waiting == 1
  run(engine)


def test_aborting_a_refused_duplicate_leaves_the_original_alone(tiny_model):
  engine = AsyncLLM(str(tiny_model), block_size=8, num_kv_blocks=64)

  async def main():
    original = engine.add_request("same", "Hello", SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    duplicate = engine.add_request("same", "Hello", GREEDY)
    refused = await duplicate.__anext__()
    assert refused.finished and "already in use" in refused.error
    await duplicate.aclose()
    last = None
    async for last in original: pass
    return last

  last = asyncio.run(main())
  assert last.outputs[0].finish_reason == "length" and len(last.outputs[0].token_ids) == 30
  engine.shutdown()


def test_a_dead_engine_thread_fails_callers_instead_of_hanging(tiny_model):
  llm = LLM(str(tiny_model), block_size=8, num_kv_blocks=64)
  class Boom(BaseException): pass   # escapes LLMEngine.step's handling, as a bug in the loop would
  def explode(): raise Boom("injected crash")
  llm.llm_engine.call(lambda e: setattr(e, "step", explode))
  with pytest.raises(GenerationError, match="engine thread stopped: Boom: injected crash") as failed:
    llm.generate("Hello", GREEDY, use_tqdm=False)
  out = failed.value.outputs[0]
  assert out.outputs[0].finish_reason == "error" and "engine thread stopped" in out.error
  with pytest.raises(RuntimeError, match="not running"): llm.generate("Hello", GREEDY, use_tqdm=False)
  with pytest.raises(RuntimeError, match="not running"): llm.llm_engine.call(lambda e: None)


def test_stop_strings_count_from_min_tokens(tiny_model):
  llm = LLM(str(tiny_model), block_size=8, num_kv_blocks=64)
  base = llm.generate({"prompt_token_ids": [11, 22, 33]}, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                      use_tqdm=False)[0].outputs[0]
  stop = llm.get_tokenizer().decode(base.token_ids[:1])                # the very first token's text
  out = llm.generate({"prompt_token_ids": [11, 22, 33]}, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                                         stop=[stop], min_tokens=12), use_tqdm=False)[0].outputs[0]
  assert out.token_ids == base.token_ids and out.finish_reason == "length"
  llm.shutdown()


@pytest.mark.parametrize("stage", ["scheduling", "stop checks"])
def test_failures_in_scheduling_and_stop_checks(tiny_model, stage):
  """The two stages the core cannot pin on one sequence before the fact: a scheduling failure fails every request
  (nothing ran), a stop check that raises fails only the sequence whose token it was checking."""
  engine = engine_for(tiny_model)
  want = run_one(engine, "w")
  for rid in ("good", "bad"): engine.add_request(rid, "Hello world" if rid == "good" else "The quick", GREEDY)
  engine.step()
  sched = engine.scheduler
  if stage == "scheduling":
    schedule = sched.schedule
    sched.schedule = lambda: (_ for _ in ()).throw(RuntimeError("injected scheduling failure"))
    outs = engine.step()
    assert sorted(o.request_id for o in outs) == ["bad", "good"] and all("injected scheduling" in o.error for o in outs)
    sched.schedule = schedule
  else:
    stop_reason = sched._stop_reason
    def flaky(seq, token):
      if seq.request_id == "bad": raise RuntimeError("injected stop-check failure")
      return stop_reason(seq, token)
    sched._stop_reason = flaky
    finals = run(engine)
    assert finals["bad"].outputs[0].finish_reason == "error" and "injected stop-check" in finals["bad"].error
    assert finals["good"].outputs[0].token_ids == want and finals["good"].error is None
    sched._stop_reason = stop_reason
  assert not engine.has_unfinished_requests() and engine.block_manager.num_free == engine.block_manager.num_blocks
  assert run_one(engine, "after") == want


def test_an_interrupted_generate_leaves_nothing_behind(tiny_model, capsys):
  """Ctrl-C during LLM.generate: its requests are aborted, and the next generate neither runs nor counts them."""
  import concurrent.futures, os, signal, threading
  llm = LLM(str(tiny_model), block_size=8, num_kv_blocks=128)
  gate = threading.Event()
  with concurrent.futures.ThreadPoolExecutor(1) as pool:
    held = pool.submit(llm.llm_engine.call, lambda e: gate.wait(60))   # the engine thread waits: generate surely blocks
    threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()   # a real Ctrl-C
    with pytest.raises(KeyboardInterrupt): llm.generate(["Hello"] * 4, GREEDY, use_tqdm=False)
    gate.set()
    held.result(60)
  assert llm.llm_engine.call(lambda e: e.has_unfinished_requests()) is False
  outs = llm.generate(["Hello", "World"], GREEDY)
  assert [len(o.outputs[0].token_ids) for o in outs] == [8, 8]
  assert "2/2" in capsys.readouterr().err                               # its progress bar counts its own requests
  free, total = llm.llm_engine.call(lambda e: (e.block_manager.num_free, e.block_manager.num_blocks))
  assert free == total
  llm.shutdown()


# **** never silent: a failure is logged once with its traceback, and the Python API raises ****

class FailingPass:
  """The runner's execute, failing from the `after`-th call on with the same error (a broken GPU fails every step)."""
  def __init__(self, execute, after: int = 2):
    self.execute, self.after, self.calls = execute, after, 0
  def __call__(self, *a, **kw):
    self.calls += 1
    if self.calls >= self.after: raise RuntimeError("CUDA Error 1, invalid argument (injected)")
    return self.execute(*a, **kw)


def test_a_failing_pass_is_logged_once_with_its_traceback(tiny_model, caplog):
  engine = engine_for(tiny_model)
  engine.runner.execute = FailingPass(engine.runner.execute, after=1)
  with caplog.at_level("DEBUG", logger="tinyvllm"):
    for i in range(3):   # three requests, each failing in its own step with the same error
      engine.add_request(f"r{i}", "Hello world", GREEDY)
      assert run(engine)[f"r{i}"].error == "RuntimeError: CUDA Error 1, invalid argument (injected)"
  errors = [r for r in caplog.records if r.levelname == "ERROR"]
  assert len(errors) == 1, [r.getMessage() for r in errors]
  assert errors[0].name == "tinyvllm" and "model pass failed for r0" in errors[0].getMessage()
  assert "CUDA Error 1" in errors[0].getMessage() and errors[0].exc_info and "test_failures.py\", line" in caplog.text   # the traceback
  assert sum("failed again" in r.getMessage() for r in caplog.records if r.levelname == "DEBUG") == 2
  # a different failure is logged in its turn
  engine.runner.execute = FailingPass(engine.runner.execute.execute, after=1)
  engine.runner.execute.execute = lambda *a, **kw: (_ for _ in ()).throw(MemoryError("out of device memory"))
  engine.runner.execute.after = 99
  with caplog.at_level("ERROR", logger="tinyvllm"):
    engine.add_request("m", "Hello world", GREEDY)
    run(engine)
  assert sum("MemoryError: out of device memory" in r.getMessage() for r in caplog.records) == 1


def test_the_python_api_raises_instead_of_returning_empty_text(tiny_model):
  """LLM.generate, LLM.stream and AsyncLLM.generate: a request the engine failed raises GenerationError naming the
  cause; generate's error keeps the other requests' finished outputs (nothing lost)."""
  llm = LLM(str(tiny_model), block_size=8, num_kv_blocks=64)
  want = llm.generate("The quick brown fox", GREEDY, use_tqdm=False)[0].outputs[0].token_ids
  original = llm.llm_engine.call(lambda e: e.core._penalized)
  def fail_one(seq, logits, extra=()):
    if seq.request_id.endswith("-1"): raise ValueError("injected NaN logits")
    return original(seq, logits, extra)
  llm.llm_engine.call(lambda e: setattr(e.core, "_penalized", fail_one))
  import itertools
  llm._ids = itertools.count()   # ids llm-0, llm-1: the second fails
  with pytest.raises(GenerationError, match="1 of 2 requests failed; the first, 'llm-1': ValueError: injected NaN logits") as e:
    llm.generate(["The quick brown fox", "Hello world"], GREEDY, use_tqdm=False)
  good, bad = e.value.outputs
  assert good.error is None and good.outputs[0].token_ids == want and good.outputs[0].text
  assert bad.outputs[0].finish_reason == "error" and e.value.failed == [bad]
  llm._ids = itertools.count(1)
  with pytest.raises(GenerationError, match="injected NaN logits"): list(llm.stream("Hello", GREEDY))
  llm.shutdown()
  engine = AsyncLLM(str(tiny_model), block_size=8, num_kv_blocks=64)
  engine.engine.call(lambda e: setattr(e.core, "_penalized", lambda *a, **kw: (_ for _ in ()).throw(ValueError("injected"))))
  async def main():
    return [out async for out in engine.generate("Hello", GREEDY, request_id="a-1")]
  with pytest.raises(GenerationError, match="request 'a-1' failed: ValueError: injected"): asyncio.run(main())
  engine.shutdown()
