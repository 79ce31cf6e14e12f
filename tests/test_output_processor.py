"""engine/output_processor.py on its own: a completion's token ids handed over step by step, as the core hands them,
against HF `tokenizers`' decode of the same ids, cut where a stop string first appears (vLLM's rule: the text ends
before the stop string, or after it with include_stop_str_in_output; the tokens end with the one that completed it).
Every output kind must agree with that: CUMULATIVE outputs are prefixes of the final text and end at it, DELTA
pieces add up to it, FINAL_ONLY hands out it alone. Random ids over the test tokenizer's whole byte-level
vocabulary (so UTF-8 characters split over tokens too), random step sizes, stop strings cut from the text itself."""
from __future__ import annotations
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings, strategies as st
from conftest import write_tokenizer
from tinyvllm import RequestOutputKind, SamplingParams
from tinyvllm.engine.output_processor import OutputProcessor
from tinyvllm.engine.request import CoreOutput, EngineRequest
from tinyvllm.model.tokenizer import load_tokenizer
from tinyvllm.outputs import RequestMetrics

SPECIALS = 4   # the test tokenizer's first ids: <s>, </s>, <|im_start|>, <|im_end|>


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
  from tokenizers import Tokenizer
  path = tmp_path_factory.mktemp("tokenizer")
  write_tokenizer(path)
  return load_tokenizer(path), Tokenizer.from_file(str(path / "tokenizer.json"))


def feed(tokenizer, ids: list[int], steps: list[int], params: SamplingParams) -> list:
  """The outputs of one request whose completion is `ids`, handed over `steps[i]` tokens at a step (the last step
  finishes it by length), until the processor reports a stop string. The finished request's stats count the tokens
  of the last output's completion (of all of them, for DELTA)."""
  processor = OutputProcessor(tokenizer)
  processor.add_request(EngineRequest("r", None, [5, 6], params, RequestMetrics(arrival_time=0.0)))
  outputs, at = [], 0
  for n in steps:
    new, at = ids[at:at + n], at + n
    results, to_abort, stats = processor.process([CoreOutput("r", 0, new, finish_reason="length" if at >= len(ids) else None)])
    outputs += results
    if to_abort or at >= len(ids):
      assert to_abort in ([], [("r", 0, "stop")])
      break
  assert not processor.has_unfinished()
  generated = sum(len(o.outputs[0].token_ids) for o in outputs) if params.output_kind is RequestOutputKind.DELTA else len(outputs[-1].outputs[0].token_ids)
  assert [s.num_generation_tokens for s in stats.finished] == [generated]
  return outputs


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_every_output_kind_against_the_decoded_text(tokenizers, data):
  ours, hf = tokenizers
  words = [i for i in range(SPECIALS, hf.get_vocab_size()) if hf.decode([i]).isascii()]   # whole characters
  token = st.integers(SPECIALS, hf.get_vocab_size() - 1) | st.sampled_from(words)
  ids = data.draw(st.lists(token, min_size=1, max_size=40), label="ids")
  steps = data.draw(st.lists(st.integers(1, 3), min_size=len(ids), max_size=len(ids)), label="steps")
  full = hf.decode(ids)
  stop = None
  if data.draw(st.booleans(), label="with a stop string") and full:
    # anywhere, or across two tokens' text, where the first one's step must hold its part back
    cut = len(hf.decode(ids[:data.draw(st.integers(1, len(ids)), label="token before the straddle")]))
    start = data.draw(st.integers(max(0, cut - 2), max(0, cut - 1)) | st.integers(0, len(full) - 1), label="stop's start")
    stop = full[start:start + data.draw(st.integers(1, 4), label="stop's length")]
    assume(stop.isascii())   # a U+FFFD of a character cut short would not be the emitted text's until the flush
  include = data.draw(st.booleans(), label="include_stop_str_in_output")
  if stop is None: want_text, want_ids, reason = full, ids, "length"
  else:
    end = next(i for i in range(len(ids)) if stop in hf.decode(ids[:i + 1]))   # the token that completed it
    at = full.index(stop)
    want_text, want_ids, reason = full[:at + (len(stop) if include else 0)], ids[:end + 1], "stop"
  for kind in RequestOutputKind:
    params = SamplingParams(max_tokens=len(ids), stop=[stop] if stop else None, include_stop_str_in_output=include, output_kind=kind)
    outs = [o.outputs[0] for o in feed(ours, ids, steps, params)]
    if kind is RequestOutputKind.DELTA:
      text, token_ids = "".join(o.text for o in outs), [t for o in outs for t in o.token_ids]
    else:
      assert all(want_text.startswith(o.text) and want_ids[:len(o.token_ids)] == o.token_ids for o in outs)
      assert len(outs) == 1 or kind is RequestOutputKind.CUMULATIVE
      text, token_ids = outs[-1].text, outs[-1].token_ids
    assert (text, token_ids, outs[-1].finish_reason) == (want_text, want_ids, reason), kind
    assert outs[-1].stop_reason == stop


def test_a_long_stream_holds_back_only_what_may_be_a_stop_string(tokenizers):
  """A 3000-token DELTA stream, a token a step, whose stop string straddles two tokens past the 2500th (6 characters,
  first seen there): the pieces add up to the text before it, the text held back at any step is shorter than the
  stop string, and the step of the first token holds back the stop's first half."""
  ours, hf = tokenizers
  words = [i for i in range(SPECIALS, hf.get_vocab_size()) if hf.decode([i]).isascii() and len(hf.decode([i])) >= 3]
  ids = [int(i) for i in np.random.default_rng(0).choice(words, 3000)]
  full = hf.decode(ids)
  for before in range(2500, 3000):   # the first token boundary from 2500 on where such a stop string is new
    cut = len(hf.decode(ids[:before]))
    stop = full[cut - 3:cut + 3]
    if full.index(stop) == cut - 3: break
  outs = [o.outputs[0] for o in feed(ours, ids, [1] * len(ids), SamplingParams(max_tokens=3000, stop=[stop],
                                                                                output_kind=RequestOutputKind.DELTA))]
  assert full.index(stop) == cut - 3 and len(outs) == before + 1 and outs[-1].finish_reason == "stop"
  assert "".join(o.text for o in outs) == full[:cut - 3]
  shown = 0
  for i, o in enumerate(outs[:-1]):
    shown += len(o.text)
    assert 0 <= len(hf.decode(ids[:i + 1])) - shown < len(stop)
  assert shown == cut - 3   # the step of the token before the boundary showed nothing of the stop
