"""Checkpoint loading: GGUF tensor types (against the `gguf` package's own dequantizer), llama.cpp's Q/K row
order, sharded bf16 safetensors, both config layouts, and the errors for what we do not support."""
from __future__ import annotations
import json, math
from pathlib import Path
import gguf
import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from conftest import our_prefill_logits
from tinyvllm.config import ConfigError, ModelConfig
from tinyvllm.model.weights import ModelLoadError, load_checkpoint
from tinyvllm.quant import int4

GGUF_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output",
              "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
              "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
              "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
              "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
# one tensor type per projection, so a single file covers every type the loader supports
GGUF_TYPES = {"token_embd": "Q8_0", "output": "Q8_0", "attn_q": "Q4_0", "attn_k": "Q4_1", "attn_v": "F16", "attn_output": "BF16",
              "ffn_gate": "Q4_1", "ffn_up": "Q4_0", "ffn_down": "Q8_0", "attn_qkv": "Q4_1"}   # attn_qkv: Phi-3's fused q/k/v


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
  """What llama.cpp's converter does to Q/K rows (pairs interleaved per head), written from its description."""
  return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(hf: str, names: dict[str, str] = GGUF_NAMES) -> str:
  parts = hf.split(".")
  if parts[0] == "model" and parts[1] == "layers":
    return f"blk.{parts[2]}.{names['.'.join(parts[3:-1])]}.{parts[-1]}"
  return f"{names['.'.join(parts[:-1])]}.{parts[-1]}"


def write_gguf(hf_dir: Path, out: Path, types: dict[str, str] = GGUF_TYPES, block_count: int | None = None,
               arch: str = "llama") -> dict[str, np.ndarray]:
  """Convert a tiny HF checkpoint (any dtype, and its byte-level BPE tokenizer) to GGUF with the tensor types given
  per projection (`block_count` overrides the layer count written) as llama.cpp's converter writes architecture
  `arch`: Q/K rows permuted for "llama" only (qwen2 and qwen3 keep HF's order). Returns the weights as HF names
  expect them after the round trip (dequantized by the gguf package)."""
  from safetensors.torch import load_file
  cfg = json.loads((hf_dir / "config.json").read_text())
  tok = json.loads((hf_dir / "tokenizer.json").read_text())
  permute = llama_cpp_permute if arch == "llama" else lambda w, n: w
  unpermute = llama_cpp_permute_inverse if arch == "llama" else lambda w, n: w
  gemma = arch.startswith("gemma")
  # llama.cpp's names for Gemma's norms (its ffn_norm is the MLP's input norm, HF Gemma's pre_feedforward_layernorm)
  # and for Phi-3's fused projections (gate and up as one ffn_up)
  names = GGUF_NAMES | ({"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                         "post_feedforward_layernorm": "post_ffw_norm"} if gemma else {}) | \
          ({"self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"} if arch == "phi3" else {})
  w = gguf.GGUFWriter(out, arch)
  if arch == "phi3" and cfg["rope_parameters"].get("rope_type") == "longrope":
    # llama.cpp's converter: the divisors as tensors, the original context and its attention factor as keys
    rope, orig = cfg["rope_parameters"], cfg["rope_parameters"].get("original_max_position_embeddings") or cfg["original_max_position_embeddings"]
    w.add_rope_scaling_orig_ctx_len(orig)
    w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(cfg["max_position_embeddings"] / orig) / math.log(orig)))
    w.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], np.float32))
    w.add_tensor("rope_factors_short.weight", np.asarray(rope["short_factor"], np.float32))
  if arch == "phi3" and cfg.get("sliding_window"): w.add_sliding_window(cfg["sliding_window"])
  partial = cfg["rope_parameters"].get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
  if partial != 1.0: w.add_rope_dimension_count(int((cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]) * partial))
  if cfg.get("head_dim"): w.add_key_length(cfg["head_dim"]); w.add_value_length(cfg["head_dim"])
  if gemma:
    w.add_sliding_window(cfg["sliding_window"])
    if cfg.get("attn_logit_softcapping"): w.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
    if cfg.get("final_logit_softcapping"): w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
  rope = cfg["rope_parameters"]
  if "full_attention" in rope:   # Gemma 3: the global layers' base and scaling (the sliding ones': 10000, llama.cpp's own)
    rope = rope["full_attention"]
    if rope.get("rope_type") == "linear":
      w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR); w.add_rope_scaling_factor(rope["factor"])
  w.add_block_count(block_count or cfg["num_hidden_layers"]); w.add_context_length(cfg["max_position_embeddings"])
  w.add_embedding_length(cfg["hidden_size"]); w.add_feed_forward_length(cfg["intermediate_size"])
  w.add_head_count(cfg["num_attention_heads"]); w.add_head_count_kv(cfg["num_key_value_heads"])
  w.add_rope_freq_base(rope["rope_theta"]); w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
  w.add_vocab_size(cfg["vocab_size"])
  vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
  specials = {t["content"] for t in tok["added_tokens"]}
  w.add_tokenizer_model("gpt2"); w.add_tokenizer_pre("gpt-2")
  w.add_token_list([t for t, _ in vocab]); w.add_token_types([3 if t in specials else 1 for t, _ in vocab])
  w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
  w.add_bos_token_id(0); w.add_eos_token_id(1)
  expected = {}
  for name, t in load_file(hf_dir / "model.safetensors").items():
    arr = t.float().numpy()
    gname = gguf_name(name, names)
    if gemma and name.endswith("norm.weight"):   # llama.cpp's converter stores Gemma's norms as 1 + weight
      w.add_tensor(gname, np.float32(1) + arr, raw_dtype=gguf.GGMLQuantizationType.F32)
      expected[name] = arr
      continue
    if name.endswith("q_proj.weight"): arr_g = permute(arr, cfg["num_attention_heads"])
    elif name.endswith("k_proj.weight"): arr_g = permute(arr, cfg["num_key_value_heads"])
    else: arr_g = arr
    kind = "F32" if arr.ndim == 1 else types[gname.split(".")[-2]]
    qtype = getattr(gguf.GGMLQuantizationType, kind)
    data = gguf.quants.quantize(arr_g, qtype)
    w.add_tensor(gname, data, raw_dtype=qtype)
    back = gguf.quants.dequantize(data, qtype).reshape(arr.shape).astype(np.float32)
    if name.endswith("q_proj.weight"): back = unpermute(back, cfg["num_attention_heads"])
    if name.endswith("k_proj.weight"): back = unpermute(back, cfg["num_key_value_heads"])
    expected[name] = back
  w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
  return expected


def llama_cpp_permute_inverse(w: np.ndarray, n_heads: int) -> np.ndarray:
  return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_gguf_tensor_types_and_row_order(tiny_model, tmp_path):
  expected = write_gguf(tiny_model, tmp_path / "tiny.gguf")
  ckpt = load_checkpoint(tmp_path / "tiny.gguf", quantization="none")     # everything dequantized to float
  assert ckpt.config.num_key_value_heads == 2 and ckpt.config.rope_theta == 10000.0 and not ckpt.config.tie_word_embeddings
  assert set(ckpt.tensors) == set(expected) and ckpt.config.quantization is None
  for name, want in expected.items():
    np.testing.assert_array_equal(np.asarray(ckpt.tensors[name], np.float32), want, err_msg=name)
  packed = load_checkpoint(tmp_path / "tiny.gguf")                        # default: Q4_0/Q4_1 linears stay 4-bit
  assert packed.config.quantization == {"group_size": 32, "bits": 4, "gguf_types": ["Q4_0", "Q4_1", "Q8_0"]}   # the kept types
  q4 = [n for n in expected if n.endswith(("q_proj.weight", "k_proj.weight", "gate_proj.weight", "up_proj.weight"))]
  assert q4 and all(packed.tensors[n].dtype == np.uint32 for n in q4)
  for name in q4:   # code for code: the packed form dequantizes to exactly what gguf's own dequantizer gives
    base = name[:-len(".weight")]
    np.testing.assert_array_equal(int4.dequantize(packed.tensors[name], packed.tensors[f"{base}.scales"], packed.tensors[f"{base}.biases"]),
                                  expected[name], err_msg=name)


def test_gguf_model_logits_match_hf_on_the_same_weights(tiny_model, tmp_path):
  expected = write_gguf(tiny_model, tmp_path / "tiny.gguf")
  hf = LlamaForCausalLM(LlamaConfig.from_pretrained(tiny_model)).eval()
  hf.load_state_dict({k: torch.from_numpy(v) for k, v in expected.items()})
  ids = list(range(5, 40))
  with torch.no_grad(): ref = hf(torch.tensor([ids])).logits[0].double().numpy()
  ours = our_prefill_logits(tmp_path / "tiny.gguf", ids)
  assert np.linalg.norm(ours - ref) / np.linalg.norm(ref) < 1e-4   # same weights, float32 maths: see test_model_parity


def test_sharded_bf16_safetensors(tiny_model_factory, tmp_path):
  src = tiny_model_factory("gqa")
  model = LlamaForCausalLM.from_pretrained(src, torch_dtype=torch.bfloat16)
  model.save_pretrained(tmp_path, max_shard_size="40KB")
  assert (tmp_path / "model.safetensors.index.json").exists() and len(list(tmp_path.glob("*.safetensors"))) > 2
  ckpt = load_checkpoint(tmp_path)
  for name, param in model.state_dict().items():
    np.testing.assert_array_equal(ckpt.tensors[name], param.float().numpy(), err_msg=name)


def test_bf16_safetensors_are_widened_as_read(tiny_model_factory, tmp_path, monkeypatch):
  """A bf16 checkpoint stays bf16 in its memory map until the model reads it: cast to float16 (a GPU's dtype) it
  equals torch's own bf16 -> float16 cast, and quantized to INT4 at load (a slice of rows at a time: 3 rows a slice
  here) each linear equals quantizing torch's bf16 -> float32 widening of it."""
  from tinyvllm.kernels import make_kernels
  from tinyvllm.model import weights
  from tinyvllm.model.llama import Llama
  from tinyvllm.quant import int4
  src = tiny_model_factory("gqa")
  model = LlamaForCausalLM.from_pretrained(src, torch_dtype=torch.bfloat16)
  model.save_pretrained(tmp_path, max_shard_size="40KB")
  params = model.state_dict()
  ckpt = load_checkpoint(tmp_path)
  assert not ckpt.tensors.made   # nothing widened before the model reads it
  ours = Llama(ckpt.config, ckpt.tensors, "float16", "CPU", make_kernels("portable", "CPU"), 64)
  for i, layer in enumerate(ours.layers):
    for name in ("self_attn.o_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight"):
      np.testing.assert_array_equal(layer.weights[name].numpy(), params[f"model.layers.{i}.{name}"].half().numpy(), err_msg=name)
  sliced = weights._quantize_int4
  monkeypatch.setattr(weights, "_quantize_int4", lambda *a: sliced(*a, slice_bytes=3 * 64 * 4))
  q = load_checkpoint(tmp_path, "int4").tensors
  linears = [n for n in params if n.endswith("proj.weight")]
  assert len(linears) == 14
  for name in linears:
    base = name[:-len(".weight")]
    if name.endswith("down_proj.weight"):   # 96 inputs: no groups of 64, stays float
      np.testing.assert_array_equal(q[name], params[name].float().numpy()); continue
    for got, want in zip((q[name], q[f"{base}.scales"], q[f"{base}.biases"]), int4.quantize(params[name].float().numpy(), 64, "rtn")):
      np.testing.assert_array_equal(got, want, err_msg=name)


def test_gguf_float_and_8bit_tables_quantized_at_load(tiny_model_factory, tmp_path, monkeypatch):
  """quantization="int4" on a GGUF of mixed types: its F16, BF16 and Q8_0 tables (Q/K rows in llama.cpp's order,
  undone slice by slice) become INT4 groups of 32 equal to quantizing the gguf package's dequantization of them;
  its Q4_0/Q4_1 tables stay as the file has them."""
  from tinyvllm.model import weights
  from tinyvllm.quant import int4
  types = {**GGUF_TYPES, "attn_k": "F16", "attn_q": "BF16"}
  ref = write_gguf(tiny_model_factory(), tmp_path / "mixed.gguf", types)
  sliced = weights._quantize_int4
  monkeypatch.setattr(weights, "_quantize_int4", lambda *a: sliced(*a, slice_bytes=5 * 64 * 4))   # 5 rows a slice
  ckpt, plain = load_checkpoint(tmp_path / "mixed.gguf", "int4"), load_checkpoint(tmp_path / "mixed.gguf")
  quantized = 0
  for name, w in ref.items():
    if name.endswith((".q_proj.weight", ".k_proj.weight", ".v_proj.weight", ".o_proj.weight", ".down_proj.weight")) or \
       name in int4.EMBEDDING_NAMES:
      base = name[:-len(".weight")]
      for got, want in zip((ckpt.tensors[name], ckpt.tensors[f"{base}.scales"], ckpt.tensors[f"{base}.biases"]), int4.quantize(w, 32, "rtn")):
        np.testing.assert_array_equal(got, want, err_msg=name)
      quantized += 1
    elif name.endswith((".gate_proj.weight", ".up_proj.weight")):   # Q4_1 / Q4_0: as loaded
      np.testing.assert_array_equal(ckpt.tensors[name], plain.tensors[name], err_msg=name)
  assert quantized == 2 + 5 * 2


def test_config_layouts_both_read_rope():
  base = dict(architectures=["LlamaForCausalLM"], vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
              num_attention_heads=2)
  v4 = ModelConfig.from_hf({**base, "rope_theta": 100000.0, "rope_scaling": {"type": "linear", "factor": 2.0}})
  v5 = ModelConfig.from_hf({**base, "rope_parameters": {"rope_theta": 100000.0, "rope_type": "linear", "factor": 2.0}})
  assert v4.rope_theta == v5.rope_theta == 100000.0
  assert v4.rope_scaling == v5.rope_scaling == {"rope_type": "linear", "factor": 2.0}
  assert ModelConfig.from_hf({**base, "rope_parameters": {"rope_theta": 5e5, "rope_type": "default"}}).rope_scaling is None
  with pytest.raises(ConfigError, match="yarn"):
    ModelConfig.from_hf({**base, "rope_parameters": {"rope_theta": 1e4, "rope_type": "yarn", "factor": 4.0}})
  with pytest.raises(ConfigError, match="num_attention_heads"): ModelConfig.from_hf({**base, "num_key_value_heads": 3})
  with pytest.raises(ConfigError, match="lacks the required field 'hidden_size'"):
    ModelConfig.from_hf({k: v for k, v in base.items() if k != "hidden_size"})


def test_unsupported_gguf_contents(tmp_path):
  w = gguf.GGUFWriter(tmp_path / "k.gguf", "llama")
  for k, v in dict(block_count=1, context_length=64, embedding_length=256, feed_forward_length=256, head_count=2, vocab_size=64).items():
    getattr(w, f"add_{k}")(v)
  q2k = gguf.GGMLQuantizationType.Q2_K   # any bytes of the right size: the loader must refuse the type, not decode it
  raw = np.random.default_rng(0).integers(0, 255, gguf.quants.quant_shape_to_byte_shape((256, 256), q2k), dtype=np.uint8)
  w.add_tensor("blk.0.attn_q.weight", raw, raw_dtype=q2k)
  w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
  with pytest.raises(ModelLoadError, match="blk.0.attn_q.weight has GGUF type Q2_K"): load_checkpoint(tmp_path / "k.gguf")
  w = gguf.GGUFWriter(tmp_path / "g.gguf", "gemma")
  w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
  with pytest.raises(ConfigError, match="unsupported GGUF architecture 'gemma'"): load_checkpoint(tmp_path / "g.gguf")
  (tmp_path / "junk.gguf").write_bytes(b"not a gguf at all")
  with pytest.raises(ModelLoadError, match="junk.gguf"): load_checkpoint(tmp_path / "junk.gguf")
