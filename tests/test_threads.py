"""The engine on its own thread: LLM and AsyncLLM work from any thread and from several at once, streams advanced in
any order each get their own request's outputs, a cancelled or closed stream frees its blocks, and an interrupted
generate leaves nothing behind."""
from __future__ import annotations
import asyncio, threading
import numpy as np
import pytest
from tinyvllm import LLM, AsyncLLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_model):
  llm = LLM(str(tiny_model), block_size=8, num_kv_blocks=128)
  yield llm
  llm.shutdown()


def free_blocks(llm) -> tuple[int, int]:
  return llm.llm_engine.call(lambda e: (e.block_manager.num_free, e.block_manager.num_blocks))


def test_tinygrad_internals_we_rely_on_exist():
  """The engine thread shares tinygrad's compile-cache connection (helpers._db_connection, CACHEDB): if tinygrad
  renames them, this fails before any engine does."""
  from tinygrad import helpers
  assert hasattr(helpers, "_db_connection") and isinstance(helpers.CACHEDB, str) and callable(helpers.db_connection)


def test_interleaved_streams_on_one_llm(llm):
  """Two live streams advanced in turn (a notebook with two cells streaming): each ends, each equals generate."""
  a = llm.generate_stream("Hello world", GREEDY)
  b = llm.generate_stream("The quick brown fox", GREEDY)
  pieces_a, pieces_b = [next(a)], [next(b)]
  pieces_a += list(a)                      # a runs to its end while b is open
  pieces_b += list(b)
  want = [o.outputs[0].text for o in llm.generate(["Hello world", "The quick brown fox"], GREEDY, use_tqdm=False)]
  assert ["".join(pieces_a), "".join(pieces_b)] == want


def test_generate_from_several_threads_at_once(llm):
  vocab = llm.llm_engine.model_config.vocab_size
  rng = np.random.default_rng(0)
  batches = [[{"prompt_token_ids": rng.integers(4, vocab, int(n)).tolist()} for n in rng.integers(2, 40, 5)] for _ in range(4)]
  want = [[o.outputs[0].token_ids for o in llm.generate(b, GREEDY, use_tqdm=False)] for b in batches]
  got: list = [None] * len(batches)
  errors: list = []
  def run(i):
    try: got[i] = [o.outputs[0].token_ids for o in llm.generate(batches[i], GREEDY, use_tqdm=False)]
    except Exception as e: errors.append(e)
  threads = [threading.Thread(target=run, args=(i,)) for i in range(len(batches))]
  for t in threads: t.start()
  for t in threads: t.join(120)
  assert not errors and got == want
  assert free_blocks(llm)[0] == free_blocks(llm)[1]


def test_llm_built_in_one_thread_used_in_another(tiny_model):
  box = {}
  builder = threading.Thread(target=lambda: box.setdefault("llm", LLM(str(tiny_model), block_size=8, num_kv_blocks=64)))
  builder.start(); builder.join(120)
  llm = box["llm"]
  # new shapes (batch sizes never seen) compile kernels on the engine thread, whoever calls
  outs = llm.generate(["a", "b", "c", "d", "e"], GREEDY, use_tqdm=False)
  assert all(o.outputs[0].finish_reason == "length" for o in outs)
  llm.shutdown()
  with pytest.raises(RuntimeError, match="not running"): llm.generate("a", GREEDY, use_tqdm=False)


def test_vllm_manual_surface(llm):
  """llm.llm_engine.add_request / step / abort_request / has_unfinished_requests, as vLLM's LLMEngine."""
  engine = llm.llm_engine
  engine.add_request("kept", "Hello world", GREEDY)
  engine.add_request("dropped", "The quick", SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
  engine.abort_request("dropped")
  finals = {}
  while engine.has_unfinished_requests():
    for out in engine.step():
      if out.finished: finals[out.request_id] = out
  assert finals["kept"].outputs[0].text == llm.generate("Hello world", GREEDY, use_tqdm=False)[0].outputs[0].text
  assert finals["dropped"].outputs[0].finish_reason == "abort" and len(finals["dropped"].outputs[0].token_ids) < 200
  with pytest.raises(ValueError, match="empty"): engine.add_request("bad", "")
  assert engine.step() == [] and free_blocks(llm)[0] == free_blocks(llm)[1]


def test_closing_a_stream_early_frees_its_blocks(llm):
  stream = llm.stream("Hello", SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
  next(stream)
  stream.close()
  free, total = free_blocks(llm)   # the abort is applied before this call runs: commands keep their order
  assert free == total


def test_bad_prompts_are_rejected_alone_and_queue_nothing(llm, capsys):
  outs = llm.generate(["Hello", None, 7, np.array([1, 2]), {"prompt_token_ids": [1.7]}, "World"], GREEDY, use_tqdm=False)
  assert [o.outputs[0].finish_reason for o in outs] == ["length", "error", "error", "error", "error", "length"]
  assert "integers" in outs[4].error and "NoneType" in outs[1].error
  assert capsys.readouterr().err.count("rejected") == 4
  assert llm.llm_engine.call(lambda e: e.has_unfinished_requests()) is False


def test_async_generate_and_cancellation(tiny_model):
  engine = AsyncLLM(str(tiny_model), block_size=8, num_kv_blocks=64)

  async def main():
    outs = [o async for o in engine.generate("Hello", GREEDY, request_id="a")]
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 10
    started = asyncio.Event()
    async def consume():
      async for _ in engine.generate("Hello", SamplingParams(temperature=0, max_tokens=250, ignore_eos=True), request_id="b"):
        started.set()
    task = asyncio.create_task(consume())
    await started.wait()
    task.cancel()                               # the client went away, 249 tokens early
    with pytest.raises(asyncio.CancelledError): await task
    return await engine.call(lambda e: (e.has_unfinished_requests(), e.block_manager.num_free, e.block_manager.num_blocks))

  unfinished, free, total = asyncio.run(main())
  assert not unfinished and free == total
  with pytest.raises(ValueError, match="empty"):
    asyncio.run(engine.generate("", GREEDY).__anext__())
  engine.shutdown()


def test_closing_a_merged_single_stream_aborts_it(tiny_model):
  """The server's merge of request streams, with one stream, closed between two outputs (a client gone while a
  frame was being sent): the request is aborted, not left running."""
  from tinyvllm.entrypoints.openai.serving import merge_streams
  engine = AsyncLLM(str(tiny_model), block_size=8, num_kv_blocks=64)

  async def main():
    merged = merge_streams([engine.add_request("m", "Hello", SamplingParams(temperature=0, max_tokens=250, ignore_eos=True))])
    await merged.__anext__()
    await merged.aclose()
    return await engine.call(lambda e: e.has_unfinished_requests())

  assert asyncio.run(main()) is False
  engine.shutdown()


def test_outputs_cross_into_the_loop_in_order_and_in_batches():
  """The engine thread hands outputs to the event loop through a LoopHandoff: every call runs, in the order made,
  the calls queued before the loop ran take one wake-up between them (a step's outputs, not one each), and a call
  that raises is reported while those after it still run."""
  from tinyvllm.engine.async_llm import LoopHandoff
  async def main():
    loop = asyncio.get_running_loop()
    handoff, seen, runs, errors = LoopHandoff(loop), [], [], []
    loop.set_exception_handler(lambda _, ctx: errors.append(ctx["exception"]))
    run = handoff._run
    handoff._run = lambda: (runs.append(1), run())
    def fail(_): raise ValueError("a sink that raises")
    def engine():   # 10 steps of 32 outputs each, the third output of step 4 failing
      for step in range(10):
        for i in range(32): handoff.call(fail if (step, i) == (4, 2) else seen.append, (step, i))
        threading.Event().wait(0.002)
    thread = threading.Thread(target=engine)
    thread.start()
    while thread.is_alive() or len(seen) < 319: await asyncio.sleep(0.001)
    thread.join()
    return seen, runs, errors
  seen, runs, errors = asyncio.run(main())
  assert seen == [(s, i) for s in range(10) for i in range(32) if (s, i) != (4, 2)]
  assert 10 <= len(runs) <= 160, len(runs)   # about a wake-up a step (some caught mid-step); one each made 320
  assert [str(e) for e in errors] == ["a sink that raises"]


def test_a_handoff_holds_its_loop_weakly_and_drops_calls_once_it_closed():
  """AsyncLLM keeps a LoopHandoff per event loop it served: a finished loop must be freed (each `asyncio.run` makes
  one), and outputs for a loop that closed are dropped, not kept forever."""
  import gc, weakref
  from tinyvllm.engine.async_llm import LoopHandoff
  loop = asyncio.new_event_loop()
  handoff, ref = LoopHandoff(loop), weakref.ref(loop)
  loop.close()
  for i in range(100): handoff.call(print, i)
  assert handoff._calls == [] and not handoff._woken
  del loop
  gc.collect()
  assert ref() is None
  handoff.call(print, 0)   # the loop is gone: dropped quietly
  assert handoff._calls == []
