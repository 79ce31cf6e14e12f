"""Model families beyond Llama (model/families/: Qwen2, Qwen3, Mistral, Gemma 2 and 3, Phi-3) against HF transformers on tiny random checkpoints it writes: every
prompt position's logits on every backend, greedy generation through the engine (chunked prefill, preemption,
prefix caching) against HF's generate, the same weights as GGUF files written the way llama.cpp's converter writes
each architecture, and sliding-window attention over prompts several windows long.

Tolerance: relative error 1e-4 in float32, as tests/test_model_parity.py argues for Llama (same maths in the same
precision; the families add biases, a per-head RMSNorm and masks, none of which changes the error's size). Quantized
checkpoints (GGUF, MLX) against HF on their dequantized weights: 5e-4, since our CPU kernels round x to 16 bits per
group for their integer products (tests/test_quant.py and tests/test_packed_kernels.py bound it per output; 1.1e-4
to 1.4e-4 measured on these logits)."""
from __future__ import annotations
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM
from conftest import make_tiny_model, our_prefill_logits
from test_weights import write_gguf
from tinyvllm import SamplingParams
from tinyvllm.config import ConfigError, ModelConfig
from tinyvllm.engine.llm_engine import LLMEngine
from tinyvllm.model.weights import load_checkpoint, load_config
from tinyvllm.quant.formats import FUSED_PROJECTIONS

TOL = 1e-4
TOL_QUANTIZED = 5e-4

# name -> (HF model_type, config overrides): each family with what sets it apart
FAMILY_CONFIGS = {
  "qwen2": ("qwen2", dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)),   # q/k/v biases
  "qwen3": ("qwen3", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32)),   # q/k norms, head_dim apart
  "mistral": ("mistral", dict(num_attention_heads=4, num_key_value_heads=2, sliding_window=12)),   # every layer slides
  # a window on layer 1 only (max_window_layers=1): windowed and full layers in one model
  "qwen2_window": ("qwen2", dict(num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True, sliding_window=10,
                                 max_window_layers=1)),
  # GeGLU, 1 + weight norms, scaled embeddings, post-norms, query_pre_attn_scalar, soft-capped scores and logits,
  # alternating windowed and global layers
  "gemma2": ("gemma2", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=12, query_pre_attn_scalar=24,
                            attn_logit_softcapping=2.0, final_logit_softcapping=5.0)),
  # and Gemma 3: q/k norms, no soft-capping, a local RoPE base on the windowed layers, the global one scaled; six
  # layers, the last one global (its default pattern, the one llama.cpp assumes)
  "gemma3": ("gemma3_text", dict(num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=32, sliding_window=12,
                                 query_pre_attn_scalar=32, rope_parameters={
                                   "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                   "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6}})),
  # fused qkv_proj and gate_up_proj in the checkpoint; LongRoPE past its original 32 positions (long factors, attention factor)
  "phi3": ("phi3", dict(num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, original_max_position_embeddings=32,
                        pad_token_id=0, rope_scaling={"rope_type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(8)],
                                                      "long_factor": [1.0 + 0.5 * i for i in range(8)]})),
  "phi3_window": ("phi3", dict(num_attention_heads=4, num_key_value_heads=4, sliding_window=12, pad_token_id=0)),   # Phi-3-mini-4k's
  # Phi-4-mini: RoPE on part of each head (half here, with LongRoPE on the rotated part; three quarters below)
  "phi4": ("phi3", dict(num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, original_max_position_embeddings=32,
                        pad_token_id=0, partial_rotary_factor=0.5, tie_word_embeddings=True,
                        rope_scaling={"rope_type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(4)],
                                      "long_factor": [1.0 + 0.5 * i for i in range(4)], "partial_rotary_factor": 0.5})),
  "phi4_75": ("phi3", dict(num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, partial_rotary_factor=0.75)),
  # the Metal kernels' shapes (head_dim 64), for the emulator
  "qwen2_metal": ("qwen2", dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=64)),
  "qwen3_metal": ("qwen3", dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=64)),
  "mistral_metal": ("mistral", dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=64, sliding_window=12)),
  "phi3_metal": ("phi3", dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=2, pad_token_id=0, max_position_embeddings=128,
                              original_max_position_embeddings=32, rope_scaling={
                                "rope_type": "longrope", "short_factor": [1.0 + 0.05 * i for i in range(32)],
                                "long_factor": [1.0 + 0.2 * i for i in range(32)]})),
  "gemma2_metal": ("gemma2", dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=64, sliding_window=12,
                                  query_pre_attn_scalar=64, attn_logit_softcapping=2.0, final_logit_softcapping=5.0)),
  "phi4_metal": ("phi3", dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=2, pad_token_id=0, partial_rotary_factor=0.75)),
  "gemma3_metal": ("gemma3_text", dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=64, sliding_window=12,
                                       sliding_window_pattern=2)),
}


@pytest.fixture(scope="module")
def family_model(tmp_path_factory):
  made = {}
  def make(name: str):
    if name not in made:
      model_type, overrides = FAMILY_CONFIGS[name]
      made[name] = make_tiny_model(tmp_path_factory.mktemp(f"family-{name}"), model_type, vector_noise=0.3, **overrides)
    return made[name]
  return make


def rel_err(a, b) -> float: return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


def hf_model(path, state: dict | None = None):
  model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
  if state is not None: model.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()}, strict=False)
  return model


def hf_logits(model, ids: list[int]) -> np.ndarray:
  with torch.no_grad(): return model(torch.tensor([ids])).logits[0].double().numpy()


@pytest.mark.parametrize("name,backend", [(n, b) for n in ("qwen2", "qwen3", "mistral", "qwen2_window", "gemma2", "gemma3", "phi3",
                                                        "phi3_window", "phi4", "phi4_75") for b in ("portable", "cpu")] +
                         [(f"{n}_metal", "emulator") for n in ("qwen2", "qwen3", "mistral", "gemma2", "gemma3", "phi3", "phi4")])
def test_prefill_logits_every_position(family_model, name, backend):
  """40 positions: over three windows of the windowed models, so the mask decides most of their logits."""
  path = family_model(name)
  ids = np.random.default_rng(1).integers(0, 380, 40).tolist()
  ours, ref = our_prefill_logits(path, ids, backend, block_size=8), hf_logits(hf_model(path), ids)
  assert rel_err(ours, ref) < TOL
  assert (ours.argmax(-1) == ref.argmax(-1)).mean() > 0.97


def test_gemma3_multimodal_checkpoint_runs_its_language_model(tmp_path):
  """A Gemma3ForConditionalGeneration checkpoint (Gemma 3 4B and up): its text_config and language_model tensors
  load, the vision tower is not read, and the text logits equal HF's multimodal model on text alone."""
  from transformers import Gemma3Config, Gemma3ForConditionalGeneration
  from conftest import write_tokenizer
  vocab = write_tokenizer(tmp_path)
  torch.manual_seed(0)
  cfg = Gemma3Config(text_config=dict(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=32, sliding_window=12, query_pre_attn_scalar=32),
                     vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32,
                                        patch_size=8), mm_tokens_per_image=4)
  model = Gemma3ForConditionalGeneration(cfg).eval()
  with torch.no_grad():
    for p in model.parameters(): p.mul_(8.0) if p.dim() > 1 else p.add_(torch.randn(p.shape) * 0.3)
  model.save_pretrained(tmp_path)
  ckpt = load_checkpoint(tmp_path)
  assert ckpt.config.model_type == "gemma3_text" and ckpt.config.layer_types[-1] == "full_attention"
  assert not any("vision" in n for n in ckpt.tensors)
  ids = np.random.default_rng(1).integers(0, vocab, 40).tolist()
  ref = hf_logits(Gemma3ForConditionalGeneration.from_pretrained(tmp_path, dtype=torch.float32).eval(), ids)
  assert rel_err(our_prefill_logits(tmp_path, ids, "cpu"), ref) < TOL


def test_gemma_in_float16_is_warned_about(family_model, capsys):
  """Gemma's activations overflow float16: asked for explicitly, the engine says so (dtype auto runs float32 on GPUs)."""
  LLMEngine.from_kwargs(str(family_model("gemma2")), dtype="float16", kernel_backend="portable", num_kv_blocks=16)
  assert "overflow float16" in capsys.readouterr().err


def test_the_window_matters(family_model):
  """The windowed model's logits beyond its window differ from the same weights attending to everything (so the
  test above checks the mask, not a window too wide to act)."""
  path = family_model("mistral")
  ids = np.random.default_rng(1).integers(0, 380, 40).tolist()
  windowed = hf_model(path)
  full = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, sliding_window=None).eval()
  a, b = hf_logits(windowed, ids), hf_logits(full, ids)
  assert rel_err(a[:12], b[:12]) < 1e-6 and rel_err(a[12:], b[12:]) > 1e-2


@pytest.mark.parametrize("name,backend", [("qwen2", "cpu"), ("qwen3", "cpu"), ("mistral", "cpu"), ("qwen2_window", "portable"),
                                          ("gemma2", "cpu"), ("gemma3", "cpu"), ("phi3_window", "cpu"), ("phi4_75", "cpu"),
                                          ("gemma2_metal", "emulator")])
def test_engine_greedy_matches_hf_generate(family_model, name, backend):
  """Three prompts sharing a 16-token prefix through the engine, chunked (16 tokens a step) in a pool too small for
  them all (preempted and recomputed), then a fourth with the same prefix (found in the prefix cache): each
  continuation equals HF's greedy generate."""
  path = family_model(name)
  # the pool: too small for three sequences at once (a windowed model needs fewer blocks: its passed ones go back)
  blocks = 6 if load_config(path).freeable_window else 9
  engine = LLMEngine.from_kwargs(str(path), block_size=8, num_kv_blocks=blocks, max_num_batched_tokens=16, kernel_backend=backend)
  rng = np.random.default_rng(3)
  prefix = rng.integers(0, 380, 16).tolist()
  prompts = [prefix + rng.integers(0, 380, 14).tolist() for _ in range(4)]
  params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
  outputs = {}
  def run(ids: list[int]):
    for i in ids: engine.add_request(str(i), {"prompt_token_ids": prompts[i]}, params)
    while engine.has_unfinished_requests():
      for out in engine.step():
        if out.finished: outputs[int(out.request_id)] = out.outputs[0].token_ids
  # prefill chunks go back to back (packed) on every backend here: the fused C layer runs every family's layers, the
  # shaders find each token's sequence, and so do portable's paged kernels (soft-capped scores pad there: none here)
  assert engine.core.runner.packs_prefill
  run([0, 1, 2])
  assert engine.core.scheduler.num_preemptions > 0
  hits = engine.core.scheduler.prefix_cache_hits
  run([3])
  assert engine.core.scheduler.prefix_cache_hits >= hits + 16
  model = hf_model(path)
  for i, prompt in enumerate(prompts):
    with torch.no_grad():
      # an explicit mask: without one, HF takes every pad_token_id in the prompt for padding
      want = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long), max_new_tokens=16,
                            do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(prompt):]
    assert outputs[i] == want.tolist(), f"prompt {i}"


@pytest.mark.parametrize("name", ["qwen2_metal", "phi4_metal"])
def test_gpu_decode_path_matches_hf(family_model, name):
  """A GPU's decode step for the families (here the emulated METAL device, metal backend, float32): the qkv
  projection is our GEMV, which writes q and the cache rotated (kernels/gemv.py `qkv_rope_write`), with q/k/v biases
  (Qwen2) or RoPE on 0.75 of each head (Phi-4's partial rotary). Greedy tokens equal HF's generate; each token's
  logprob within TOL of HF's log-softmax at its position."""
  from test_replay import greedy_on_metal
  path = family_model(name)
  prompts = [np.random.default_rng(i).integers(0, 380, n).tolist() for i, n in enumerate((9, 14))]
  outs, names = greedy_on_metal(path, prompts, 10, kernel_backend="metal", block_size=16)
  assert any(n.startswith("gemv_norm_rope") for n in names), sorted(names)
  model = hf_model(path)
  for i, prompt in enumerate(prompts):
    c = outs[i]
    with torch.no_grad():
      want = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long), max_new_tokens=10,
                            do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert c.token_ids == want
    logits = hf_logits(model, prompt + want)[len(prompt) - 1:-1]
    ref = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - logits.max(-1, keepdims=True)
    got = np.array([lp[t].logprob for lp, t in zip(c.logprobs, want)])
    assert np.abs(got - ref[np.arange(len(want)), want]).max() < TOL


def test_int4_metal_decode_with_partial_rotary_equals_cpu(family_model):
  """The shaders' INT4 qkv GEMV rotates q and k and writes q and the cache itself (int4_gemv_rope), here with RoPE on
  0.75 of each head (Phi-4's partial rotary), and gates gate/up (int4_gemv_glu): greedy tokens on the emulated METAL
  device equal the CPU backend's on the same INT4 weights (its C kernels, checked against HF in tests/test_quant.py
  and tests/test_int4_model.py)."""
  from test_replay import greedy_on_metal
  path = family_model("phi4_metal")
  prompts = [np.random.default_rng(i).integers(0, 380, n).tolist() for i, n in enumerate((9, 14))]
  outs, names = greedy_on_metal(path, prompts, 8, kernel_backend="metal", quantization="int4", block_size=16)
  assert any(n.startswith("int4_gemv_rope") for n in names) and any(n.startswith("int4_gemv_glu") for n in names), sorted(names)
  cpu = LLMEngine.from_kwargs(str(path), dtype="float32", kernel_backend="cpu", quantization="int4", max_model_len=64)
  for i, p in enumerate(prompts):
    cpu.add_request(str(i), {"prompt_token_ids": p}, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
  want = {}
  while cpu.has_unfinished_requests():
    for out in cpu.step():
      if out.finished: want[int(out.request_id)] = out.outputs[0].token_ids
  assert {i: c.token_ids for i, c in outs.items()} == want


def test_a_fused_tensor_of_the_wrong_size_is_named(family_model, tmp_path):
  import shutil
  from safetensors.numpy import load_file, save_file
  from tinyvllm.model.weights import ModelLoadError
  src = family_model("phi3_window")
  shutil.copytree(src, tmp_path / "m")
  tensors = load_file(tmp_path / "m" / "model.safetensors")
  tensors["model.layers.1.mlp.gate_up_proj.weight"] = tensors["model.layers.1.mlp.gate_up_proj.weight"][:-2]
  save_file(tensors, tmp_path / "m" / "model.safetensors")
  with pytest.raises(ModelLoadError, match=r"model.layers.1.mlp.gate_up_proj.weight \(in model.safetensors\) has 190 rows; "
                                           r"the config implies 192 \(96 \+ 96\)"):
    load_checkpoint(tmp_path / "m")


@pytest.mark.parametrize("name,engine_args", [("qwen3", {"tensor_parallel_size": 2}), ("gemma3", {"tensor_parallel_size": 2}),
                                              ("phi3_window", {"tensor_parallel_size": 2}),
                                              ("gemma3", {"draft_model": "self:2", "speculation": "always"}),
                                              ("mistral", {"draft_model": "self:1", "speculation": "always"})])   # draft blocks slide too
def test_tensor_parallel_and_speculation(family_model, name, engine_args):
  """Two CPU devices, heads and FFN split (q/k norms head by head where each head lives), and speculative decoding
  with the model's first layers as its draft (their layer types cut to match): HF's greedy tokens."""
  path = family_model(name)
  engine = LLMEngine.from_kwargs(str(path), block_size=8, num_kv_blocks=64, **engine_args)
  prompt = np.random.default_rng(3).integers(4, 380, 30).tolist()
  engine.add_request("0", {"prompt_token_ids": prompt}, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
  while engine.has_unfinished_requests():
    for out in engine.step(): pass
  want = hf_model(path).generate(torch.tensor([prompt]), attention_mask=torch.ones(1, 30, dtype=torch.long), max_new_tokens=12,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)[0, 30:].tolist()
  assert out.outputs[0].token_ids == want


@pytest.mark.parametrize("name,freed", [("mistral", True), ("qwen2_window", False)])
def test_blocks_out_of_every_window_go_back(family_model, name, freed):
  """A 70-token prompt and 20 more tokens (block 8, window 12 on every layer, chunks of 16): the blocks the window has
  passed go back to the pool as the sequence advances, so it never holds more than the window and a chunk need
  (5 blocks, against 11 for the 88 positions the last step reads), and its tokens still equal HF's. A model with a
  full-attention layer keeps every block."""
  path = family_model(name)
  engine = LLMEngine.from_kwargs(str(path), block_size=8, num_kv_blocks=32, max_num_batched_tokens=16, kernel_backend="portable")
  prompt = np.random.default_rng(4).integers(4, 380, 70).tolist()
  engine.add_request("0", {"prompt_token_ids": prompt}, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
  bm, held = engine.core.block_manager, []
  while engine.has_unfinished_requests():
    for out in engine.step(): pass
    held.append(bm.num_blocks - bm.num_free)
  want = hf_model(path).generate(torch.tensor([prompt]), attention_mask=torch.ones(1, 70, dtype=torch.long), max_new_tokens=20,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)[0, 70:].tolist()
  assert out.outputs[0].token_ids == want
  if freed: assert max(held) <= 5 and engine.core.scheduler.num_window_freed >= 11 - 5
  else: assert max(held) == 11 and engine.core.scheduler.num_window_freed == 0


@pytest.mark.parametrize("name,arch", [("qwen2", "qwen2"), ("qwen3", "qwen3"), ("gemma3", "gemma3"), ("phi3", "phi3"),
                                       ("phi3_window", "phi3"), ("phi4", "phi3")])
def test_gguf_of_each_architecture(family_model, tmp_path, name, arch):
  """The same weights as llama.cpp's converter writes them (Q/K rows in HF's order for these architectures, biases
  and q/k norms as F32 vectors, Gemma's norms as 1 + weight under llama.cpp's names, linears in
  Q8_0/Q4_0/Q4_1/F16/BF16): the config read from `<arch>.*` keys, and logits equal HF's on the weights the gguf
  package dequantizes."""
  path = family_model(name)
  expected = write_gguf(path, tmp_path / "m.gguf", arch=arch)
  ckpt = load_checkpoint(tmp_path / "m.gguf")
  assert ckpt.config.model_type.startswith(arch) and ckpt.config.qkv_bias == (arch == "qwen2")
  assert ckpt.config.qk_norm == (arch in ("qwen3", "gemma3"))
  if name == "phi3": assert ckpt.config.rope_scaling["rope_type"] == "longrope"   # the divisors read from their tensors
  if name == "phi3_window": assert ckpt.config.sliding_window == 12
  for fused, parts in FUSED_PROJECTIONS.items() if arch == "phi3" else ():   # Phi-3's HF model reads them fused
    for n in [n for n in expected if n.endswith(f"{parts[0]}.weight")]:
      p = n[:-len(f"{parts[0]}.weight")]
      expected[f"{p}{fused}.weight"] = np.concatenate([expected.pop(f"{p}{part}.weight") for part in parts])
  ids = list(range(5, 40))
  ours, ref = our_prefill_logits(tmp_path / "m.gguf", ids, "cpu"), hf_logits(hf_model(path, expected), ids)
  assert rel_err(ours, ref) < TOL_QUANTIZED


def test_family_configs_and_their_errors():
  base = dict(vocab_size=10, hidden_size=16, intermediate_size=32, num_hidden_layers=4, num_attention_heads=2)
  qwen2 = ModelConfig.from_hf({**base, "architectures": ["Qwen2ForCausalLM"], "use_sliding_window": False, "sliding_window": 64})
  assert qwen2.qkv_bias and not qwen2.attention_bias and qwen2.sliding_window is None and qwen2.model_type == "qwen2"
  windowed = ModelConfig.from_hf({**base, "architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True, "sliding_window": 64,
                                  "max_window_layers": 2})
  assert [windowed.layer_window(i) for i in range(4)] == [None, None, 64, 64]
  mistral = ModelConfig.from_hf({**base, "architectures": ["MistralForCausalLM"], "sliding_window": 4096})
  assert [mistral.layer_window(i) for i in range(4)] == [4096] * 4
  assert ModelConfig.from_hf({**base, "architectures": ["MistralForCausalLM"], "sliding_window": None}).sliding_window is None
  assert ModelConfig.from_hf({**base, "model_type": "qwen3"}).qk_norm
  # a Gemma 2 GGUF's metadata: llama.cpp's layer pattern (even layers slide) and its attention scale rule (head_dim,
  # but hidden / heads in the 46-layer 27B model)
  meta = {"general.architecture": "gemma2", "gemma2.block_count": 4, "gemma2.embedding_length": 64, "gemma2.feed_forward_length": 96,
          "gemma2.attention.head_count": 2, "gemma2.attention.key_length": 16, "gemma2.attention.sliding_window": 8,
          "gemma2.attn_logit_softcapping": 50.0, "gemma2.final_logit_softcapping": 30.0, "gemma2.vocab_size": 10}
  g2 = ModelConfig.from_gguf(meta, "g.gguf")
  assert g2.layer_types == ("sliding_attention", "full_attention") * 2 and g2.query_pre_attn_scalar == 16
  assert g2.norm_weight_offset == 0 and g2.sandwich_norms and g2.attn_logit_softcapping == 50.0
  big = ModelConfig.from_gguf({**meta, "gemma2.block_count": 46}, "g.gguf")
  assert big.query_pre_attn_scalar == 32   # 64 / 2
  phi = {**base, "architectures": ["Phi3ForCausalLM"], "original_max_position_embeddings": 64, "max_position_embeddings": 256}
  assert ModelConfig.from_hf({**phi, "partial_rotary_factor": 0.75}).rotary_dim == 6   # head_dim 8
  with pytest.raises(ConfigError, match="partial_rotary_factor"): ModelConfig.from_hf({**phi, "partial_rotary_factor": 0.3})
  with pytest.raises(ConfigError, match="short_factor.*4 positive numbers"):   # head_dim 8: 4 frequencies
    ModelConfig.from_hf({**phi, "rope_scaling": {"type": "su", "short_factor": [1.0] * 3, "long_factor": [1.0] * 4}})
  su = ModelConfig.from_hf({**phi, "rope_scaling": {"type": "su", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4}})
  assert su.rope_scaling["rope_type"] == "longrope" and su.rope_scaling["original_max_position_embeddings"] == 64
  # Google's Gemma 3 4B config.json (written by transformers 4.50: only what differs from Gemma3TextConfig's defaults)
  g3 = ModelConfig.from_hf({"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "text_config": {
    "hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text", "num_hidden_layers": 34,
    "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024}, "vision_config": {}})
  assert (g3.vocab_size, g3.num_attention_heads, g3.num_key_value_heads, g3.head_dim, g3.max_position_embeddings) == \
    (262208, 8, 4, 256, 131072)
  assert g3.rope_scaling == {"rope_type": "linear", "factor": 8.0} and g3.rope_theta == 1e6 and g3.rope_local_theta == 10000.0
  assert g3.layer_types[:6] == ("sliding_attention",) * 5 + ("full_attention",) and g3.tie_word_embeddings
  assert ModelConfig.from_hf({**base, "architectures": ["MistralForCausalLM"]}).sliding_window == 4096   # MistralConfig's default
  for bad, words in [({"architectures": ["Qwen2ForRewardModel"], "model_type": "qwen2"}, "unsupported architecture"),
                     ({"architectures": ["Gemma3ForCausalLM"], "use_bidirectional_attention": True}, "encoder"),
                     ({"architectures": ["Gemma2ForCausalLM"], "layer_types": 3}, "layer_types")]:
    with pytest.raises(ConfigError, match=words): ModelConfig.from_hf({**base, **bad})
  with pytest.raises(ConfigError, match="yarn"):   # a GGUF's YaRN scaling is refused, never dropped
    ModelConfig.from_gguf({**{k.replace("gemma2", "qwen2"): v for k, v in meta.items() if "softcap" not in k},
                           "general.architecture": "qwen2", "qwen2.rope.scaling.type": "yarn"}, "q.gguf")
  with pytest.raises(ConfigError, match="unsupported architecture.*GPTNeoXForCausalLM.*Qwen3ForCausalLM"):
    ModelConfig.from_hf({**base, "architectures": ["GPTNeoXForCausalLM"]})
  with pytest.raises(ConfigError, match="sliding_window"):
    ModelConfig.from_hf({**base, "architectures": ["MistralForCausalLM"], "sliding_window": 0})
  with pytest.raises(ConfigError, match="layer_types"):
    ModelConfig.from_hf({**base, "architectures": ["Qwen3ForCausalLM"], "use_sliding_window": True, "sliding_window": 8,
                         "layer_types": ["full_attention"] * 3})


@pytest.mark.parametrize("name,bits", [(n, 4) for n in ("qwen2", "qwen3", "mistral", "gemma2", "gemma3", "phi3_window")] +
                         [("qwen3", 8), ("phi3_window", 6)])
def test_mlx_checkpoint_of_each_family(family_model, tmp_path, name, bits):
  """mlx-lm's own `convert -q` (4 bits for each family, 8 and 6 for two; groups of 32; the embeddings quantized too,
  Phi-3's fused projections as they are): logits equal HF's on the same weights dequantized with our float16
  scales (TOL_QUANTIZED), and mlx-lm's own within float16's rounding of the scales (1e-2, see
  tests/test_mlx_interop.py)."""
  mx = pytest.importorskip("mlx.core", reason="mlx is not installed (pip install 'mlx[cpu]' mlx-lm)")
  mlx_lm = pytest.importorskip("mlx_lm", reason="mlx-lm is not installed")
  from mlx_lm.utils import load_model
  out = tmp_path / f"q{bits}"
  mlx_lm.convert(str(family_model(name)), str(out), quantize=True, q_group_size=32, q_bits=bits)
  assert load_checkpoint(out).config.quantization["bits"] == bits
  tokens = np.random.default_rng(5).integers(4, 380, 30).tolist()
  ours = our_prefill_logits(out, tokens, "cpu")
  state = dict(load_checkpoint(out, "none").tensors)
  for fused, parts in FUSED_PROJECTIONS.items():   # Phi-3's HF model reads them fused, as its checkpoint stores them
    for i in range(load_config(out).num_hidden_layers):
      p = f"model.layers.{i}."
      if f"{p}{parts[0]}.weight" in state and name.startswith("phi3"):
        state[f"{p}{fused}.weight"] = np.concatenate([state.pop(f"{p}{part}.weight") for part in parts])
  exact = hf_logits(hf_model(family_model(name), state), tokens)
  assert rel_err(ours, exact) < TOL_QUANTIZED
  # mlx-lm reads RoPE from transformers 4's top-level keys (rope_theta, rope_scaling, Gemma 3's rope_local_base_freq),
  # with its own defaults where they are missing; transformers 5 wrote them into rope_parameters: spell them out
  import json
  cfg = json.loads((out / "config.json").read_text())
  rope = cfg.get("rope_parameters") or {}
  if "full_attention" in rope:
    cfg |= {"rope_theta": rope["full_attention"]["rope_theta"], "rope_local_base_freq": rope["sliding_attention"]["rope_theta"]}
    if rope["full_attention"].get("rope_type") == "linear": cfg["rope_scaling"] = {"rope_type": "linear", "factor": rope["full_attention"]["factor"]}
  else: cfg["rope_theta"] = rope["rope_theta"]
  (out / "config.json").write_text(json.dumps(cfg))
  model, _ = load_model(out)
  # mlx-lm applies no window to Mistral, Gemma 2 or Phi-3 configs: compare the positions every window covers
  n = cfg.get("sliding_window") or len(tokens)
  theirs = np.array(model(mx.array([tokens[:n]]))[0].astype(mx.float32))
  assert rel_err(ours[:n], theirs) < 1e-2
  assert rel_err(our_prefill_logits(out, tokens, "cpu"), ours) == 0   # the same config read either way
