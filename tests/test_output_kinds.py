"""SamplingParams.output_kind (vLLM's RequestOutputKind): CUMULATIVE outputs hold everything so far, DELTA only what
is new since the request's last output, FINAL_ONLY one output when the request finishes. References: HF transformers'
greedy tokens for the cumulative completion; the deltas must add up to it exactly (tokens, text, logprobs, prompt
logprobs arriving over several prefill chunks), across a stop string that holds text back."""
from __future__ import annotations
import dataclasses
import pytest
import torch
from transformers import LlamaForCausalLM
from tinyvllm import LLM, RequestOutputKind, SamplingParams
from tinyvllm.engine.llm_engine import LLMEngine

PROMPT = [5, 9, 13, 2, 7, 11, 3, 3, 8, 4, 20, 6, 1, 9, 12, 2, 30, 31, 32]   # 19 tokens: 3 chunks of 8


def engine(model) -> LLMEngine:
  return LLMEngine.from_kwargs(str(model), num_kv_blocks=64, block_size=8, max_num_batched_tokens=8)


def outputs(model, params: SamplingParams) -> list:
  """Every output of one request, step by step."""
  eng = engine(model)
  eng.add_request("0", {"prompt_token_ids": PROMPT}, params)
  outs = []
  while eng.has_unfinished_requests(): outs += eng.step()
  return outs


def params(kind: RequestOutputKind, **kw) -> SamplingParams:
  return SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2, prompt_logprobs=1, output_kind=kind, **kw)


@pytest.fixture(scope="module")
def hf_tokens(tiny_model) -> list[int]:
  hf = LlamaForCausalLM.from_pretrained(tiny_model, torch_dtype=torch.float32).eval()
  with torch.no_grad():
    return hf.generate(torch.tensor([PROMPT]), max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(PROMPT):].tolist()


def test_deltas_add_up_to_the_cumulative_output(tiny_model, hf_tokens):
  cumulative = outputs(tiny_model, params(RequestOutputKind.CUMULATIVE))
  final = cumulative[-1].outputs[0]
  assert final.token_ids == hf_tokens and cumulative[-1].finished
  text = final.text
  stop = text[len(text) // 2:len(text) // 2 + 3]   # a stop string inside the answer: streams hold its prefixes back
  for stop_strings in ([], [stop]):
    want = outputs(tiny_model, params(RequestOutputKind.CUMULATIVE, stop=stop_strings))
    got = outputs(tiny_model, params(RequestOutputKind.DELTA, stop=stop_strings))
    assert len(got) == len(want) > 3
    pieces = [o.outputs[0] for o in got]
    assert [t for p in pieces for t in p.token_ids] == want[-1].outputs[0].token_ids
    assert "".join(p.text for p in pieces) == want[-1].outputs[0].text
    assert [lp for p in pieces for lp in p.logprobs] == want[-1].outputs[0].logprobs
    assert [e for o in got for e in o.prompt_logprobs] == want[-1].prompt_logprobs and len(want[-1].prompt_logprobs) == len(PROMPT)
    assert sum(bool(o.prompt_logprobs) for o in got) >= 2   # prompt logprobs arrived with more than one chunk
    assert pieces[-1].cumulative_logprob == pytest.approx(want[-1].outputs[0].cumulative_logprob)
    assert [o.finished for o in got] == [o.finished for o in want]
    if stop_strings: assert want[-1].outputs[0].finish_reason == "stop" and stop not in want[-1].outputs[0].text


def test_final_only_hands_out_one_output(tiny_model, hf_tokens):
  (only,) = outputs(tiny_model, params(RequestOutputKind.FINAL_ONLY))
  want = outputs(tiny_model, params(RequestOutputKind.CUMULATIVE))[-1]
  assert only.finished and only.outputs[0].token_ids == hf_tokens
  assert only.outputs[0] == want.outputs[0] and only.prompt_logprobs == want.prompt_logprobs


def test_generate_asks_for_final_outputs_only(tiny_model, hf_tokens, monkeypatch):
  """LLM.generate reads only final outputs, so it builds no snapshot per step, and leaves the caller's params as they were."""
  from tinyvllm.engine.output_processor import OutputProcessor
  built = []
  output = OutputProcessor._output
  monkeypatch.setattr(OutputProcessor, "_output", lambda self, state: built.append(state) or output(self, state))
  llm = LLM(str(tiny_model), num_kv_blocks=64, block_size=8)
  p = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
  outs = llm.generate([PROMPT, PROMPT[:7]], p, use_tqdm=False)
  assert outs[0].outputs[0].token_ids == hf_tokens and len(outs[1].outputs[0].token_ids) == 24
  assert len(built) == 2 and p.output_kind is RequestOutputKind.CUMULATIVE


def test_bad_output_kind_is_named():
  with pytest.raises(ValueError, match="SamplingParams.output_kind must be a RequestOutputKind"): SamplingParams(output_kind="delta")
  assert dataclasses.replace(SamplingParams(), output_kind=RequestOutputKind.DELTA).output_kind is RequestOutputKind.DELTA


def test_streams_merge_deltas_a_slow_reader_missed(tiny_model, hf_tokens):
  """LLM.stream with DELTA outputs: a reader slower than the engine gets the deltas it missed merged into one
  (RequestOutput.add), never dropped; the pieces add up to generate's completion. generate_stream still yields text
  pieces whatever output_kind it is given."""
  import time
  llm = LLM(str(tiny_model), num_kv_blocks=64, block_size=8)
  p = params(RequestOutputKind.DELTA)
  pieces = []
  for out in llm.stream(PROMPT, p):
    pieces.append(out)
    time.sleep(0.05)   # the engine steps on meanwhile: several deltas wait, merged
  assert [t for o in pieces for t in o.outputs[0].token_ids] == hf_tokens and pieces[-1].finished
  want = llm.generate(PROMPT, params(RequestOutputKind.CUMULATIVE), use_tqdm=False)[0]
  assert "".join(o.outputs[0].text for o in pieces) == want.outputs[0].text
  assert [lp for o in pieces for lp in o.outputs[0].logprobs] == want.outputs[0].logprobs
  assert [e for o in pieces for e in (o.prompt_logprobs or [])] == want.prompt_logprobs
  assert len(pieces) < len(hf_tokens)   # some arrived merged
  assert "".join(llm.generate_stream(PROMPT, p)) == want.outputs[0].text


def test_async_streams_merge_deltas(tiny_model, hf_tokens):
  import asyncio
  from tinyvllm import AsyncLLM
  async def main():
    engine = AsyncLLM(str(tiny_model), num_kv_blocks=64, block_size=8)
    try:
      pieces = []
      async for out in engine.generate(PROMPT, params(RequestOutputKind.DELTA), request_id="r"):
        pieces.append(out)
        await asyncio.sleep(0.05)
      return pieces
    finally: engine.shutdown()
  pieces = asyncio.run(main())
  assert [t for o in pieces for t in o.outputs[0].token_ids] == hf_tokens and pieces[-1].finished and len(pieces) < len(hf_tokens)


def test_a_failed_delta_request_repeats_nothing(tiny_model, hf_tokens, monkeypatch):
  """Output processing that raises fails the request (finish_reason "error"); its last DELTA output holds only what
  the earlier ones did not, so the pieces still add up to the tokens it had."""
  eng = engine(tiny_model)
  eng.add_request("0", {"prompt_token_ids": PROMPT}, params(RequestOutputKind.DELTA))
  outs = []
  for _ in range(6): outs += eng.step()
  def fail_after_one(state, c, out):
    c.token_ids.append(out.new_token_ids[0])   # a token taken in before the failure
    raise RuntimeError("detokenizer broke")
  monkeypatch.setattr(eng.output_processor, "_add_tokens", fail_after_one)
  outs += eng.step()
  assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "error" and "detokenizer broke" in outs[-1].error
  tokens = [t for o in outs for t in o.outputs[0].token_ids]
  assert tokens == hf_tokens[:len(tokens)] and len(outs[-1].outputs[0].token_ids) == 1
  assert not eng.has_unfinished_requests()
