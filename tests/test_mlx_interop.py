"""Our 4-bit format against MLX's own: mlx-lm's quantized checkpoints read correctly here, ours read in MLX.

Needs `pip install 'mlx[cpu]' mlx-lm` (CPU build of MLX on Linux); skipped when mlx cannot be imported.
"""
from __future__ import annotations
import json
from pathlib import Path
import numpy as np
import pytest

mx = pytest.importorskip("mlx.core", reason="mlx is not installed (pip install 'mlx[cpu]' mlx-lm)")
mlx_lm = pytest.importorskip("mlx_lm", reason="mlx-lm is not installed (pip install 'mlx[cpu]' mlx-lm)")

from tinyvllm.quant import int4                     # noqa: E402
from tinyvllm.model.weights import read_safetensors  # noqa: E402


def mlx_logits(model_dir: Path, tokens: list[int]) -> np.ndarray:
  """mlx-lm's float32 logits `[len(tokens), vocab]` for one sequence, from a checkpoint directory."""
  from mlx_lm.utils import load_model
  model, _ = load_model(Path(model_dir))
  return np.array(model(mx.array([tokens]))[0].astype(mx.float32))


def hf_logits(model_dir: Path, tensors: dict[str, np.ndarray], tokens: list[int]) -> np.ndarray:
  """transformers' float32 logits for the given (float) weights, with the config of model_dir."""
  import torch
  from transformers import LlamaConfig, LlamaForCausalLM
  cfg = json.loads((Path(model_dir) / "config.json").read_text())
  cfg = {k: v for k, v in cfg.items() if k not in ("quantization", "quantization_config")}
  model = LlamaForCausalLM(LlamaConfig(**cfg)).eval()
  model.load_state_dict({k: torch.from_numpy(np.array(v, np.float32)) for k, v in tensors.items()}, strict=False)
  if cfg.get("tie_word_embeddings"): model.tie_weights()
  with torch.no_grad(): return model(torch.tensor([tokens])).logits[0].numpy()


def dequantize_all(q: dict[str, np.ndarray], G: int) -> dict[str, np.ndarray]:
  out = {}
  for name, t in q.items():
    if name.endswith((".scales", ".biases")): continue
    base = name[:-len(".weight")]
    out[name] = int4.dequantize(t, q[f"{base}.scales"], q[f"{base}.biases"], G) if f"{base}.scales" in q else t
  return out


@pytest.fixture(scope="module")
def mlx_quantized(tiny_model_factory, tmp_path_factory) -> tuple[Path, Path]:
  src = tiny_model_factory("metal")                 # hidden 128, intermediate 96: every K divides by 32
  out = tmp_path_factory.mktemp("mlx") / "q"
  mlx_lm.convert(str(src), str(out), quantize=True, q_group_size=32, q_bits=4)
  return src, out


def test_mlx_lm_checkpoint_dequantizes_identically(mlx_quantized):
  src, out = mlx_quantized
  cfg = json.loads((out / "config.json").read_text())
  assert cfg["quantization"]["group_size"] == 32 and cfg["quantization"]["bits"] == 4
  q = {}
  for f in sorted(out.glob("*.safetensors")): q.update(read_safetensors(f))
  names = [n for n in q if n.endswith(".scales")]
  assert "model.embed_tokens.scales" in names and len(names) >= 8   # every linear and the embedding
  for s_name in names:
    base = s_name[:-len(".scales")]
    w, s, b = q[f"{base}.weight"], q[s_name], q[f"{base}.biases"]
    assert w.dtype == np.uint32 and w.shape[1] * 8 == s.shape[1] * 32
    theirs = np.array(mx.dequantize(mx.array(w), mx.array(s), mx.array(b), group_size=32, bits=4).astype(mx.float32))
    ours = int4.dequantize(w, s, b, 32)   # mlx-lm keeps the source dtype (float32 here) for scales/biases
    np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-7 * np.abs(theirs).max(), err_msg=base)
    # the contract stores them as float16; the cast moves a weight by at most fp16's rounding of s and b
    c = int4.float16_params({"w.weight": w, "w.scales": s, "w.biases": b})
    assert c["w.scales"].dtype == c["w.biases"].dtype == np.float16 and c["w.weight"] is w
    ours16 = int4.dequantize(w, c["w.scales"], c["w.biases"], 32)
    assert np.abs(ours16 - theirs).max() <= 2 ** -10 * (15 * np.abs(s).max() + np.abs(b).max())


@pytest.mark.parametrize("G", [32, 64, 128])
def test_our_tensors_dequantize_identically_in_mlx(G):
  rng = np.random.default_rng(G)
  w = (rng.standard_normal((48, 256)) * 0.05).astype(np.float32)
  for method in int4.METHODS:
    p, s, b = int4.quantize(w, G, method)
    theirs = np.array(mx.dequantize(mx.array(p), mx.array(s.astype(np.float32)), mx.array(b.astype(np.float32)),
                                    group_size=G, bits=4))
    np.testing.assert_allclose(int4.dequantize(p, s, b, G), theirs, rtol=1e-6, atol=1e-9)
    # and MLX's quantized matmul on our packed weight agrees with the float64 reference
    x = rng.standard_normal((3, 256)).astype(np.float32)
    y = np.array(mx.quantized_matmul(mx.array(x), mx.array(p), mx.array(s.astype(np.float32)), mx.array(b.astype(np.float32)),
                                     transpose=True, group_size=G, bits=4))
    ref = int4.int4_matmul_reference(x, p, s, b, G)
    np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())


@pytest.mark.parametrize("embeddings", [False, True])
def test_our_checkpoint_runs_in_mlx_lm(tiny_model_factory, tmp_path, embeddings):
  """The quantize CLI's output loads in mlx-lm, whose logits match transformers on our dequantized weights."""
  from tinyvllm.quantize import quantize_checkpoint
  src = tiny_model_factory("metal")
  out = tmp_path / "q"
  q = quantize_checkpoint(str(src), out, 32, "clip", quantize_embeddings=embeddings, log=lambda m: None)
  tokens = [0, 5, 17, 42, 99, 7, 3, 250]
  ours = hf_logits(out, dequantize_all(q, 32), tokens)
  theirs = mlx_logits(out, tokens)
  assert theirs.shape == ours.shape == (len(tokens), json.loads((out / "config.json").read_text())["vocab_size"])
  # mlx's quantized embedding returns the scales' dtype, so with our float16 scales its hidden states start in
  # float16 (about 0.5 % off); with the same values stored as float32 it computes in float32 throughout
  np.testing.assert_allclose(theirs, ours, rtol=0, atol=(2e-2 if embeddings else 2e-4) * np.abs(ours).max())
  if embeddings:
    from safetensors.numpy import save_file
    out32 = tmp_path / "q32"
    out32.mkdir()
    for f in out.iterdir():
      if f.name != "model.safetensors": (out32 / f.name).write_bytes(f.read_bytes())
    save_file({k: v.astype(np.float32) if k.endswith((".scales", ".biases")) else np.ascontiguousarray(v) for k, v in q.items()},
              str(out32 / "model.safetensors"))
    np.testing.assert_allclose(mlx_logits(out32, tokens), ours, rtol=0, atol=2e-4 * np.abs(ours).max())


def test_mlx_checkpoint_runs_in_tinyvllm(mlx_quantized):
  """An mlx_lm.convert -q checkpoint through our loader and kernels: logits vs mlx-lm's own, and vs transformers
  on the same dequantized weights."""
  from conftest import our_prefill_logits
  src, out = mlx_quantized
  tokens = np.random.default_rng(3).integers(4, 380, 24).tolist()
  ours = our_prefill_logits(out, tokens)
  ref = mlx_logits(out, tokens)
  # mlx keeps scales/biases in the source dtype (float32 here); our layout stores them in float16, which moves a
  # weight by up to 2^-11 of its scale: about 1e-3 relative on the logits of this tiny model, hence 1e-2
  assert np.linalg.norm(ours - ref) / np.linalg.norm(ref) < 1e-2
  q = {}
  for f in sorted(out.glob("*.safetensors")): q.update(read_safetensors(f))
  exact = hf_logits(out, dequantize_all(int4.float16_params(q), 32), tokens)   # the same float16 scales as ours
  # our C kernels round x to 16 bits per group for their integer products (tests/test_quant.py bounds it per
  # output): 1.2e-4 measured on these logits, so 5e-4 (float16 scales alone move them by 1e-3, above)
  assert np.linalg.norm(ours - exact) / np.linalg.norm(exact) < 5e-4


@pytest.mark.parametrize("bits", [3, 6, 8])
def test_mlx_bit_widths_run_in_tinyvllm(tiny_model_factory, tmp_path, bits):
  """mlx-lm's `convert -q --q-bits N` checkpoints: they load compact (3-bit codes in INT4's layout, 6- and 8-bit in the
  packed one, never float), and their logits on the portable and cpu kernels equal transformers' on the same weights
  dequantized with our float16 scales (5e-4: our kernels round x, below), and mlx-lm's own within float16's rounding
  of the scales (1e-2)."""
  from conftest import our_prefill_logits
  from tinyvllm.model.weights import load_checkpoint
  from tinyvllm.quant.formats import INT4, PACKED, stored_format
  out = tmp_path / f"q{bits}"
  mlx_lm.convert(str(tiny_model_factory("metal")), str(out), quantize=True, q_group_size=32, q_bits=bits)
  ckpt = load_checkpoint(out)
  fmt = INT4 if bits <= 4 else PACKED
  assert all(stored_format(ckpt.tensors, base) == fmt for base in ("model.embed_tokens", "model.layers.0.mlp.down_proj"))
  tokens = np.random.default_rng(bits).integers(4, 380, 24).tolist()
  exact = hf_logits(out, {k: v for k, v in load_checkpoint(out, "none").tensors.items()}, tokens)
  # our C kernels round x to 16 bits per group (or run of 32 inputs) for their integer products, in prefill as in
  # decode (tests/test_packed_kernels.py bounds it per output): 1.3e-4 and 1.4e-4 measured on these logits for 6 and
  # 8 bits, so 5e-4 (float16 scales alone move them by 1e-3)
  for backend in ("portable", "cpu"):
    ours = our_prefill_logits(out, tokens, kernel_backend=backend)
    assert np.linalg.norm(ours - exact) / np.linalg.norm(exact) < 5e-4, backend
  ref = mlx_logits(out, tokens)
  assert np.linalg.norm(ours - ref) / np.linalg.norm(ref) < 1e-2
