"""The LLM API end to end on a tiny random checkpoint: vLLM's shapes, stop rules, seeds, logprobs, streaming,
batch invariance (with and without preemption) and errors that name their cause."""
from __future__ import annotations
import json
import numpy as np
import pytest
import torch
from transformers import LlamaForCausalLM
from tinyvllm import LLM, Logprob, SamplingParams
from tinyvllm.config import ConfigError
from tinyvllm.model.weights import ModelLoadError

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_model):
  return LLM(str(tiny_model), block_size=8, num_kv_blocks=128, max_num_batched_tokens=64)


def prompts_of_lengths(lengths, vocab, seed=0):
  rng = np.random.default_rng(seed)
  return [{"prompt_token_ids": rng.integers(4, vocab, n).tolist()} for n in lengths]


def test_output_shapes_and_order(llm):
  outs = llm.generate(["Hello world", "The quick brown fox", {"prompt_token_ids": [5, 6, 7]}], GREEDY, use_tqdm=False)
  assert [o.prompt for o in outs] == ["Hello world", "The quick brown fox", None]
  assert outs[2].prompt_token_ids == [5, 6, 7]
  tok = llm.get_tokenizer()
  assert outs[0].prompt_token_ids == tok.encode("Hello world")
  for o in outs:
    c = o.outputs[0]
    assert o.finished and c.finish_reason == "length" and len(c.token_ids) == 12
    assert c.text == tok.decode(c.token_ids)
    assert o.metrics.time_to_first_token > 0 and o.metrics.num_generated_tokens == 12


def test_greedy_matches_hf_and_logprobs_are_the_models(llm, tiny_model):
  ids = [9, 40, 77, 120, 3, 250]
  out = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3),
                     use_tqdm=False)[0].outputs[0]
  hf = LlamaForCausalLM.from_pretrained(tiny_model, torch_dtype=torch.float32).eval()
  with torch.no_grad():
    logits = hf(torch.tensor([ids + out.token_ids])).logits[0, len(ids) - 1:-1].double()
  ref = torch.log_softmax(logits, -1).numpy()
  assert out.token_ids == ref.argmax(-1).tolist()
  assert len(out.logprobs) == 6
  for step, (token, lp) in enumerate(zip(out.token_ids, out.logprobs)):
    assert token in lp and len(lp) == 3 and isinstance(lp[token], Logprob) and lp[token].rank == 1
    top = np.argsort(-ref[step])[:3]
    assert list(lp) == top.tolist()
    for t, entry in lp.items():
      assert abs(entry.logprob - ref[step, t]) < 1e-4 and entry.decoded_token == llm.get_tokenizer().token_to_str(t)
  assert abs(out.cumulative_logprob - sum(ref[i, t] for i, t in enumerate(out.token_ids))) < 1e-3


def test_stop_token_ids_and_stop_strings(llm):
  prompt = {"prompt_token_ids": [11, 22, 33, 44]}
  base = llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0]
  stop_tok = base.token_ids[4]
  out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_tok]), use_tqdm=False)[0].outputs[0]
  first = base.token_ids.index(stop_tok)
  assert out.token_ids == base.token_ids[:first + 1] and (out.finish_reason, out.stop_reason) == ("stop", stop_tok)
  text = base.text
  stop = text[len(text) // 2:len(text) // 2 + 2]
  out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, stop=[stop]), use_tqdm=False)[0].outputs[0]
  assert out.text == text[:text.index(stop)] and (out.finish_reason, out.stop_reason) == ("stop", stop)
  out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, stop=[stop], include_stop_str_in_output=True),
                     use_tqdm=False)[0].outputs[0]
  assert out.text == text[:text.index(stop) + len(stop)]


def test_seed_is_independent_of_batch(llm):
  vocab = llm.llm_engine.model_config.vocab_size
  seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=10, ignore_eos=True)
  target = prompts_of_lengths([7], vocab, seed=3)[0]
  alone = llm.generate(target, seeded, use_tqdm=False)[0].outputs[0].token_ids
  others = prompts_of_lengths([3, 20, 9], vocab, seed=4)
  batch = llm.generate(others[:2] + [target] + others[2:], [SamplingParams(temperature=1.0, max_tokens=10)] * 2 + [seeded] +
                       [SamplingParams(temperature=1.0, max_tokens=10)], use_tqdm=False)
  assert batch[2].outputs[0].token_ids == alone
  assert llm.generate(target, SamplingParams(temperature=1.0, seed=99, max_tokens=10, ignore_eos=True),
                      use_tqdm=False)[0].outputs[0].token_ids != alone


def test_n_completions(llm):
  out = llm.generate("Hello", SamplingParams(n=3, temperature=1.0, seed=0, max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
  assert [c.index for c in out.outputs] == [0, 1, 2]
  assert len({tuple(c.token_ids) for c in out.outputs}) > 1


def test_stream_equals_generate(llm):
  pieces = list(llm.generate_stream("The quick brown fox", GREEDY))
  assert "".join(pieces) == llm.generate("The quick brown fox", GREEDY, use_tqdm=False)[0].outputs[0].text
  assert len(pieces) > 1


def test_chat_applies_the_template(llm):
  msgs = [{"role": "user", "content": "Hi"}]
  out = llm.chat(msgs, GREEDY, use_tqdm=False)[0]
  text = llm.get_tokenizer().apply_chat_template(msgs, add_generation_prompt=True)
  assert out.prompt == text and text.endswith("<|im_start|>assistant\n")
  assert out.prompt_token_ids == llm.get_tokenizer().encode(text, add_special_tokens=False)


def test_batch_invariance_with_and_without_preemption(tiny_model):
  big = LLM(str(tiny_model), block_size=8, num_kv_blocks=256, max_num_batched_tokens=64)
  vocab = big.llm_engine.model_config.vocab_size
  prompts = prompts_of_lengths([3, 17, 40, 9, 64, 1, 25, 33], vocab)
  params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
  alone = [big.generate(p, params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
  together = [o.outputs[0].token_ids for o in big.generate(prompts, params, use_tqdm=False)]
  assert together == alone
  # 8 sequences need up to 11 blocks each (88 tokens): 24 blocks force preemption and recomputation
  small = LLM(str(tiny_model), block_size=8, num_kv_blocks=24, max_num_batched_tokens=64)
  squeezed = [o.outputs[0].token_ids for o in small.generate(prompts, params, use_tqdm=False)]
  assert small.llm_engine.call(lambda e: e.scheduler.num_preemptions) > 0
  assert squeezed == alone
  free, total = small.llm_engine.call(lambda e: (e.block_manager.num_free, e.block_manager.num_blocks))
  assert free == total                                     # everything returned once all finished


def test_overlong_prompt_is_rejected_alone(tiny_model, capsys):
  llm = LLM(str(tiny_model), max_model_len=64, num_kv_blocks=32, block_size=8)
  outs = llm.generate([{"prompt_token_ids": [5] * 10}, {"prompt_token_ids": [5] * 80}, "Hello"],
                      SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
  assert outs[0].outputs[0].finish_reason == "length" and outs[2].outputs[0].finish_reason == "length"
  assert outs[1].outputs[0].finish_reason == "error" and "max_model_len is 64" in outs[1].error
  assert "prompt 1 rejected" in capsys.readouterr().err
  with pytest.raises(ValueError, match="80 tokens"): llm.llm_engine.add_request("a", [5] * 80)
  with pytest.raises(ValueError, match="outside the vocabulary"): llm.llm_engine.add_request("b", [10**6])
  with pytest.raises(ValueError, match="empty"): llm.llm_engine.add_request("c", [])


def test_generation_stops_at_max_model_len(tiny_model):
  llm = LLM(str(tiny_model), max_model_len=32, num_kv_blocks=8, block_size=8)
  out = llm.generate({"prompt_token_ids": [5] * 28}, SamplingParams(max_tokens=100, temperature=0, ignore_eos=True),
                     use_tqdm=False)[0].outputs[0]
  assert len(out.token_ids) == 4 and out.finish_reason == "length"


def test_bad_configuration_errors(tiny_model, tmp_path):
  with pytest.raises(ModelLoadError, match="does not exist"): LLM(str(tmp_path / "missing"))
  with pytest.raises(ModelLoadError, match="no config.json"): LLM(str(tmp_path))
  with pytest.raises(ConfigError, match="block_size"): LLM(str(tiny_model), block_size=7)
  with pytest.raises(ConfigError, match="capture_mode must be 'auto', 'pass' or 'layer', got 'graph'"): LLM(str(tiny_model), capture_mode="graph")
  with pytest.raises(ConfigError, match="max_model_len=4096 exceeds"): LLM(str(tiny_model), max_model_len=4096)
  with pytest.raises(ConfigError, match="raise num_kv_blocks"): LLM(str(tiny_model), max_model_len=256, num_kv_blocks=4, block_size=8)
  with pytest.raises(TypeError, match="gpu_memory_utilization"): LLM(str(tiny_model), gpu_memory_utilization=0.9)
  bad = tmp_path / "bad"
  bad.mkdir()
  cfg = json.loads((tiny_model / "config.json").read_text())
  (bad / "config.json").write_text(json.dumps({**cfg, "architectures": ["MambaForCausalLM"], "model_type": "mamba"}))
  with pytest.raises(ConfigError, match="MambaForCausalLM"): LLM(str(bad))


def test_prompt_logprobs_are_the_models_across_chunks(llm, tiny_model):
  """prompt_logprobs (vLLM's semantics): None for the first token, then each prompt token's logprob and the top-k,
  from a prompt read in two chunks (the step budget is 64 tokens)."""
  ids = np.random.default_rng(5).integers(4, 380, 100).tolist()
  out = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2), use_tqdm=False)[0]
  hf = LlamaForCausalLM.from_pretrained(tiny_model, torch_dtype=torch.float32).eval()
  with torch.no_grad(): ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].double(), -1).numpy()
  assert len(out.prompt_logprobs) == len(ids) and out.prompt_logprobs[0] is None
  for i in range(1, len(ids)):
    entry, row = out.prompt_logprobs[i], ref[i - 1]
    assert ids[i] in entry and abs(entry[ids[i]].logprob - row[ids[i]]) < 1e-4     # float32 logits of two implementations
    assert entry[ids[i]].rank == int((row > row[ids[i]]).sum()) + 1
    top = [t for t, lp in entry.items() if lp.rank <= 2]
    assert sorted(top, key=lambda t: entry[t].rank) == np.argsort(-row)[:2].tolist()
  assert out.outputs[0].logprobs is None


def test_chat_message_and_template_errors_are_clear(llm):
  with pytest.raises(ValueError, match=r"messages\[0\].content must be a string or a list of text parts"):
    llm.chat([{"role": "user", "content": 5}], use_tqdm=False)
  with pytest.raises(ValueError, match=r"messages\[1\]"): llm.chat([{"role": "user", "content": "hi"}, {"content": "x"}], use_tqdm=False)
  with pytest.raises(ValueError, match="only text parts"):
    llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], use_tqdm=False)
  with pytest.raises(ValueError, match="chat template of .*: nope"):
    llm.chat([{"role": "user", "content": "hi"}], chat_template="{{ raise_exception('nope') }}", use_tqdm=False)
  with pytest.raises(ValueError, match="chat template of .*"):
    llm.chat([{"role": "user", "content": "hi"}], chat_template="{% for %}", use_tqdm=False)
  parts = llm.chat([{"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]}],
                   GREEDY, use_tqdm=False)[0]
  assert parts.prompt == llm.get_tokenizer().apply_chat_template([{"role": "user", "content": "Hello\nworld"}])
  cont = llm.chat([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Once upon"}], GREEDY,
                  add_generation_prompt=False, continue_final_message=True, use_tqdm=False)[0]
  assert cont.prompt.endswith("Once upon")                    # the assistant's message is left open to continue


def test_a_small_cache_lowers_max_model_len_and_says_so(tiny_model, capsys):
  llm = LLM(str(tiny_model), num_kv_blocks=2, block_size=8)
  assert llm.llm_engine.max_model_len == 16
  assert "max_model_len lowered from 256 to 16" in capsys.readouterr().err
  llm.shutdown()


def test_kv_cache_is_sized_from_available_memory_not_free_pages(tmp_path, tiny_model, monkeypatch):
  """Linux's MemAvailable counts the page cache the OS can reclaim (a model file just read sits there); free pages
  alone refused a KV cache beside an 8B model on a 24 GB machine with 22 GB available. The cache takes
  kv_cache_memory_fraction of what is available after the weights, capped by what max_num_seqs full sequences need."""
  from tinyvllm.bench.runs import model_tensors
  from tinyvllm.engine import core
  from tinyvllm.engine.llm_engine import LLMEngine
  meminfo = tmp_path / "meminfo"
  meminfo.write_text("MemTotal:       24000000 kB\nMemFree:          100000 kB\nMemAvailable:   20000000 kB\n")
  assert core.available_memory(str(meminfo)) == 20000000 * 1024
  (tmp_path / "no-meminfo").write_text("MemTotal: 1 kB\n")
  assert core.available_memory(str(tmp_path / "no-meminfo")) > 0   # falls back to the OS's free pages
  assert core.available_memory(str(tmp_path / "missing")) > 0
  # in a container, the room under its cgroup's memory limit, its inactive page cache counted as room
  v2, v1 = tmp_path / "v2", tmp_path / "v1" / "memory"
  v2.mkdir(); v1.mkdir(parents=True)
  (v2 / "memory.max").write_text("8000000000\n"); (v2 / "memory.current").write_text("3000000000\n")
  (v2 / "memory.stat").write_text("anon 1000000000\nfile 2000000000\nactive_file 500000000\ninactive_file 1500000000\n")
  assert core.available_memory(str(meminfo), str(v2)) == 8_000_000_000 - 3_000_000_000 + 1_500_000_000
  (v1 / "memory.limit_in_bytes").write_text("4000000000\n"); (v1 / "memory.usage_in_bytes").write_text("1000000000\n")
  (v1 / "memory.stat").write_text("cache 10\ninactive_file 7\ntotal_inactive_file 250000000\n")
  assert core.available_memory(str(meminfo), str(v1.parent)) == 4_000_000_000 - 1_000_000_000 + 250_000_000
  (v1 / "memory.limit_in_bytes").write_text("9223372036854771712\n")   # v1's "no limit"
  (v2 / "memory.max").write_text("max\n")
  assert core.available_memory(str(meminfo), str(v1.parent)) == core.available_memory(str(meminfo), str(v2)) == 20000000 * 1024
  (v2 / "memory.max").write_text("64000000000\n")   # a limit above what the host has: the host's
  assert core.available_memory(str(meminfo), str(v2)) == 20000000 * 1024
  available = 600 << 20
  monkeypatch.setattr(core, "available_memory", lambda: available)
  engine = LLMEngine.from_kwargs(str(tiny_model), max_model_len=64, max_num_seqs=100000, kv_cache_memory_fraction=0.5)
  block_bytes = engine.runner.kv_bytes_per_block
  weights = sum(t.nbytes for t in model_tensors(engine.runner.model))
  want = int(0.5 * (available - weights)) // block_bytes   # the checkpoint's bytes stand for the weights: within 1 %
  blocks = engine.block_manager.num_blocks
  # rounded down to 6 binary digits (at most 1/32 fewer): the count stays put while free memory moves a little
  assert want * (1 - 1 / 32 - 1 / 100) - 1 <= blocks <= want * 1.01 + 1, (blocks, want)
  assert blocks % (1 << (blocks.bit_length() - 6)) == 0, bin(blocks)
  for moved in (-(1 << 20), 1 << 20):   # 1 MiB more or less free (away from a rounding step, as 600 MiB is here)
    monkeypatch.setattr(core, "available_memory", lambda: available + moved)
    assert LLMEngine.from_kwargs(str(tiny_model), max_model_len=64, max_num_seqs=100000, kv_cache_memory_fraction=0.5).block_manager.num_blocks == blocks
  monkeypatch.setattr(core, "available_memory", lambda: 1 << 10)   # less than the weights: a clear error
  with pytest.raises(ConfigError, match="not enough free memory"):
    LLMEngine.from_kwargs(str(tiny_model), max_model_len=64)
