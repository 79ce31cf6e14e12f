"""4-bit quantization: packing, quantizers, GGUF repack, every int4 matmul backend, the quantize CLI.

Every backend is compared with `int4_matmul_reference` (float64 numpy on the same packed weights). Tolerance:
an output is a float32 sum of K products (plus one scale/bias term per group); any summation order errs by at
most about K * 2^-24 times the sum of the magnitudes of the terms, so we allow
  |y - ref| <= 4 * K * 2^-24 * (|x| @ (|s*q| + |b|)^T)
elementwise, a worst-case bound with a factor 4 of slack for the per-group products. The CPU kernel (the packed
layout's, kernels/cpu.py: its GEMV and the GEMM that repeats it row by row) first rounds x to 16 bits per group: each
input moves by at most half a step, max|x| of its group / 65534, and that input is multiplied by s * (q - 8), so
those checks add sum_k |s_k (q_k - 8)| * step_k / 2 (times 1.001 for the float step itself)."""
from __future__ import annotations
import json, subprocess, sys
from pathlib import Path
import numpy as np
import pytest
from tinygrad import Tensor, TinyJit, GlobalCounters, dtypes
from tinyvllm.quant import int4, ggml

RNG = np.random.default_rng(1234)


def random_weight(n: int, k: int, rng=RNG) -> np.ndarray:
  """Gaussian rows with per-row scale and offset: groups whose range does not straddle zero occur too."""
  w = rng.standard_normal((n, k)) * rng.uniform(0.01, 2.0, (n, 1)) + rng.uniform(-0.5, 0.5, (n, 1))
  return w.astype(np.float32)


def gaussian_with_outliers(n: int, k: int, rng=RNG) -> np.ndarray:
  w = rng.standard_normal((n, k)) * 0.02
  mask = rng.random((n, k)) < 0.01
  w[mask] = rng.standard_normal(mask.sum()) * 0.3
  return w.astype(np.float32)


def error_bound(x: np.ndarray, packed, scales, biases, G: int, x16: bool = False) -> np.ndarray:
  q = int4.unpack(packed).astype(np.float64)
  N, K = q.shape
  x = np.asarray(x, np.float64)
  s = np.abs(scales.astype(np.float64)).repeat(G, axis=1)
  mag = s * q + np.abs(biases.astype(np.float64)).repeat(G, axis=1)
  bound = 4 * K * 2.0 ** -24 * (np.abs(x) @ mag.T) + 1e-30
  if x16:   # half a 16-bit step of each input, times |s (q - 8)|
    half_step = np.abs(x).reshape(len(x), K // G, G).max(-1).repeat(G, axis=1) / 65534 * 1.001
    bound += half_step @ (s * np.abs(q - 8)).T
  return bound


def check_matmul(y: np.ndarray, x, packed, scales, biases, G, x16: bool = False):
  ref = int4.int4_matmul_reference(x, packed, scales, biases, G)
  bound = error_bound(x, packed, scales, biases, G, x16)
  assert y.shape == ref.shape
  worst = np.max(np.abs(y - ref) / bound)
  assert worst <= 1, f"error {worst:.2f}x the float32 summation bound"


# **** packing, quantizers ****

@pytest.mark.parametrize("shape", [(1, 8), (7, 64), (33, 256)])
def test_pack_unpack_roundtrip(shape):
  q = RNG.integers(0, 16, shape, dtype=np.uint8)
  packed = int4.pack(q)
  assert packed.dtype == np.uint32 and packed.shape == (shape[0], shape[1] // 8)
  np.testing.assert_array_equal(int4.unpack(packed), q)
  # the documented bit order: code of k = 8j + i in bits 4i..4i+3 of word j
  assert int(packed[0, 0]) == sum(int(q[0, i]) << (4 * i) for i in range(8))


def test_pack_rejects_partial_words():
  with pytest.raises(ValueError, match="multiple of 8"): int4.pack(np.zeros((2, 12), np.uint8))


@pytest.mark.parametrize("G", int4.GROUP_SIZES)
def test_rtn_error_within_half_a_step(G):
  w = random_weight(37, 4 * G, np.random.default_rng(G))
  packed, scales, biases = int4.quantize(w, G, "rtn")
  assert scales.dtype == biases.dtype == np.float16 and scales.shape == (37, 4)
  deq = int4.dequantize(packed, scales, biases, G, dtype=np.float64)
  half_step = scales.astype(np.float64).repeat(G, axis=1) / 2
  assert np.all(np.abs(w - deq) <= half_step * (1 + 1e-12))
  assert np.all(scales > 0)


def test_codes_on_zero_scales_are_what_the_division_rounds_to():
  """A zero scale (a refit can give one, of either sign) makes (w - b) / s infinite or NaN: the codes are its rounding
  clipped to [0, 15], NaN (w == b) as 0, as the plain float64 division says (numpy as the reference)."""
  rng = np.random.default_rng(5)
  w = rng.standard_normal((6, 3, 16))
  w[:, :, 0] = 0.25                                                         # w == b in every group
  s = np.array([[0.0, -0.0, 0.1]] * 6, np.float16)
  b = np.full((6, 3), 0.25, np.float16)
  with np.errstate(divide="ignore", invalid="ignore"):
    want = np.rint((w - b.astype(np.float64)[..., None]) / s.astype(np.float64)[..., None])
  want = np.clip(np.where(np.isnan(want), 0, want), 0, int4.QMAX).astype(np.uint8)
  got = int4._codes(w, s, b)
  np.testing.assert_array_equal(got, want)
  assert got[:, 0].max() == int4.QMAX and got[:, 1].max() == int4.QMAX   # both signs reach the top code


def test_rtn_constant_group_is_exact():
  w = np.full((2, 32), 0.375, np.float32)
  deq = int4.dequantize(*int4.quantize(w, 32, "rtn"), 32)
  np.testing.assert_array_equal(deq, w)


@pytest.mark.parametrize("G", [32, 64])
def test_clip_beats_rtn(G):
  w = gaussian_with_outliers(64, 512, np.random.default_rng(7))
  err = {}
  for method in int4.METHODS:
    p, s, b = int4.quantize(w, G, method)
    err[method] = (int4.dequantize(p, s, b, G, dtype=np.float64) - w).reshape(64, -1, G) ** 2
  assert err["clip"].mean() < 0.95 * err["rtn"].mean()
  assert np.all(err["clip"].sum(-1) <= err["rtn"].sum(-1) * (1 + 1e-9))   # per group, never worse


def test_quantize_rejects_bad_input():
  with pytest.raises(ValueError, match="multiple of group_size"): int4.quantize(np.ones((2, 96)), 64)
  with pytest.raises(ValueError, match="group_size"): int4.quantize(np.ones((2, 96)), 48)
  with pytest.raises(ValueError, match="method"): int4.quantize(np.ones((2, 64)), 64, "gptq")
  with pytest.raises(ValueError, match="non-finite"): int4.quantize(np.full((2, 64), np.nan), 64)


# **** GGUF Q4_0 / Q4_1 ****

@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
def test_ggml_q4_repack_is_lossless(qtype):
  from gguf import GGMLQuantizationType, quants
  w = random_weight(12, 256, np.random.default_rng(3))
  t = getattr(GGMLQuantizationType, qtype)
  raw = quants.quantize(w, t)                                                 # [12, bytes per row] uint8
  expect = quants.dequantize(raw, t).astype(np.float32)                       # gguf's own decoder
  packed, scales, biases = int4.from_ggml_q4(raw, qtype, w.shape)
  assert packed.shape == (12, 32) and scales.dtype == biases.dtype == np.float16 and scales.shape == (12, 8)
  np.testing.assert_array_equal(int4.dequantize(packed, scales, biases, 32), expect)
  np.testing.assert_array_equal(int4.dequantize(packed, scales, biases, 32), ggml.dequantize(raw, qtype, w.shape))


def test_quantize_state_dict_names_and_passthrough():
  sd = {"model.embed_tokens.weight": random_weight(50, 64), "model.norm.weight": np.ones(64, np.float32),
        "model.layers.0.self_attn.q_proj.weight": random_weight(64, 64),
        "model.layers.0.mlp.down_proj.weight": random_weight(64, 96),           # K=96: not a multiple of 64
        "model.layers.0.input_layernorm.weight": np.ones(64, np.float32)}
  q = int4.quantize_state_dict(sd, 64)
  assert q["model.layers.0.self_attn.q_proj.weight"].dtype == np.uint32
  assert q["model.layers.0.self_attn.q_proj.scales"].shape == (64, 1)
  assert q["model.layers.0.mlp.down_proj.weight"] is sd["model.layers.0.mlp.down_proj.weight"]  # kept, like mlx-lm
  assert q["model.embed_tokens.weight"] is sd["model.embed_tokens.weight"] and "model.embed_tokens.scales" not in q
  qe = int4.quantize_state_dict(sd, 32, quantize_embeddings=True)
  assert qe["model.embed_tokens.weight"].shape == (50, 8) and qe["model.embed_tokens.biases"].shape == (50, 2)
  with pytest.raises(ValueError, match="already quantized"): int4.quantize_state_dict(qe)


# **** matmul backends vs the float64 reference ****

SHAPES = [(37, 64, 32), (29, 256, 64), (13, 384, 128)]   # (N odd, K, G)


def quantized(N, K, G, seed=0):
  rng = np.random.default_rng(seed)
  p, s, b = int4.quantize(random_weight(N, K, rng), G)
  return p, s, b, [Tensor(a).realize() for a in (p, s, b)]


@pytest.mark.parametrize("N,K,G,M", [(N, K, G, M) for N, K, G in SHAPES for M in (1, 3, 8, 33)] + [(37, 64, 32, 70)])
def test_cpu_kernel_matches_reference(N, K, G, M):   # M=70: several chunks of x rows, an odd last row
  from tinyvllm.kernels import cpu
  p, s, b, (tp, ts, tb) = quantized(N, K, G, seed=M)
  x = np.random.default_rng(M).standard_normal((M, K)).astype(np.float32)
  y = cpu.int4_linear(Tensor(x), tp, ts, tb, G).numpy()
  check_matmul(y, x, p, s, b, G, x16=True)
  rows = [1, M // 2, M - 1] if M > 1 else []
  for m in rows: assert np.array_equal(y[m], cpu.int4_linear(Tensor(x[m:m + 1]), tp, ts, tb, G).numpy()[0]), m   # as alone


@pytest.mark.parametrize("N,K,G", SHAPES)
@pytest.mark.parametrize("M", [1, 5])
def test_portable_matches_reference_in_one_kernel(N, K, G, M):
  from tinyvllm.kernels import portable
  p, s, b, (tp, ts, tb) = quantized(N, K, G)
  x = np.random.default_rng(M).standard_normal((M, K)).astype(np.float32)
  tx = Tensor(x).realize()
  GlobalCounters.reset()
  y = portable.int4_linear(tx, tp, ts, tb, G).realize()
  assert GlobalCounters.kernel_count == 1, "the dequantize must fuse into the matmul (no float W materialised)"
  check_matmul(y.numpy(), x, p, s, b, G)


@pytest.mark.parametrize("N,K,G", [(37, 64, 32), (13, 256, 128)])
@pytest.mark.parametrize("M", [1, 9])
def test_metal_emulator_matches_reference(N, K, G, M):
  from tinyvllm.kernels import metal
  p, s, b, (tp, ts, tb) = quantized(N, K, G)
  x = np.random.default_rng(M).standard_normal((M, K)).astype(np.float32)
  y = metal.int4_matmul(Tensor(x), tp, ts, tb, G, backend="emulator").numpy()
  check_matmul(y, x, p, s, b, G)


def test_cpu_kernel_under_tinyjit_replays_with_new_inputs():
  from tinyvllm.kernels import cpu
  N, K, G, M = 37, 128, 32, 2
  step = TinyJit(lambda x, p, s, b: cpu.int4_linear(x, p, s, b, G).realize())
  for i in range(5):   # call 0 runs, call 1 captures, calls 2.. replay: inputs (x and weights) change every call
    p, s, b, (tp, ts, tb) = quantized(N, K, G, seed=100 + i)
    x = np.random.default_rng(i).standard_normal((M, K)).astype(np.float32)
    y = step(Tensor(x).realize(), tp, ts, tb).numpy()
    check_matmul(y, x, p, s, b, G, x16=True)
  assert step.cnt >= 3


def test_cpu_kernel_rejects_mismatched_shapes():
  from tinyvllm.kernels import cpu
  _, _, _, (tp, ts, tb) = quantized(5, 64, 32)
  with pytest.raises(ValueError, match="does not match"): cpu.int4_linear(Tensor.zeros(1, 128), tp, ts, tb, 32)
  with pytest.raises(ValueError, match="group_size"): cpu.int4_linear(Tensor.zeros(1, 64), tp, ts, tb, 64)


def test_portable_fallback_c_source_compiles_and_matches():
  """The non-AVX2 branch of the C kernel (what arm64 compiles), run here by compiling with AVX2 disabled."""
  import ctypes, shutil, tempfile
  from tinyvllm.kernels import cpu
  if shutil.which("clang") is None: pytest.skip("clang not found")
  N, K, G, M = 7, 64, 32, 3
  p, s, b, _ = quantized(N, K, G)
  x = np.random.default_rng(0).standard_normal((M, K)).astype(np.float32)
  with tempfile.TemporaryDirectory() as d:
    src, so = Path(d) / "k.c", Path(d) / "k.so"
    name, code = cpu.int4_linear_kernel(M, N, K, G)
    src.write_text(code.replace(name, "k"))
    subprocess.run(["clang", "-O2", "-mno-avx2", "-mno-f16c", "-ffreestanding", "-nostdlib", "-shared", "-fPIC", str(src), "-o", str(so)], check=True)
    y = np.zeros((M, N), np.float32)
    one_thread = np.zeros(2, np.uint64)   # the thread-pool buffer of a single-threaded call (kernels/threads.py)
    ctypes.CDLL(str(so)).k(*[a.ctypes.data_as(ctypes.c_void_p) for a in (y, x, p, s.view(np.uint16), b.view(np.uint16), one_thread)])
  check_matmul(y, x, p, s, b, G)


# **** the quantize CLI ****

def run_cli(*args) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-m", "tinyvllm.quantize", *map(str, args)], capture_output=True, text=True)


@pytest.mark.parametrize("method", ["rtn", "clip"])
def test_cli_roundtrip(tiny_model_factory, tmp_path, method):
  from tinyvllm.model.weights import load_checkpoint, read_safetensors
  from tinyvllm.model.tokenizer import load_tokenizer
  src = tiny_model_factory("tied")
  out = tmp_path / "q"
  r = run_cli("--model", src, "--out", out, "--group-size", 32, "--method", method, "--quantize-embeddings")
  assert r.returncode == 0, r.stderr
  cfg = json.loads((out / "config.json").read_text())
  assert cfg["quantization"] == {"group_size": 32, "bits": 4} == cfg["quantization_config"]
  assert cfg["hidden_size"] == 64 and cfg["tie_word_embeddings"] is True
  orig, q = load_checkpoint(src).tensors, read_safetensors(out / "model.safetensors")
  quantized_names = [n for n in orig if int4.is_linear_weight(n)] + ["model.embed_tokens.weight"]
  for name in quantized_names:
    base = name[:-len(".weight")]
    assert q[name].dtype == np.uint32 and q[f"{base}.scales"].dtype == np.float16
    deq = int4.dequantize(q[name], q[f"{base}.scales"], q[f"{base}.biases"], 32, dtype=np.float64)
    step = q[f"{base}.scales"].astype(np.float64).repeat(32, axis=1)
    assert np.all(np.abs(deq - orig[name]) <= step * (0.5 if method == "rtn" else 15) + 1e-12), name
  for name in orig.keys() - set(quantized_names):
    np.testing.assert_array_equal(q[name], orig[name])
  assert (out / "tokenizer.json").exists() and (out / "tokenizer_config.json").exists()
  assert load_tokenizer(out).encode("hello world") == load_tokenizer(src).encode("hello world")


def test_cli_keeps_embeddings_by_default(tiny_model_factory, tmp_path):
  from tinyvllm.model.weights import read_safetensors
  out = tmp_path / "q"
  assert run_cli("--model", tiny_model_factory("gqa"), "--out", out).returncode == 0
  q = read_safetensors(out / "model.safetensors")
  assert q["model.embed_tokens.weight"].dtype == np.float32 and q["lm_head.weight"].dtype == np.float32
  assert q["model.layers.0.mlp.up_proj.weight"].dtype == np.uint32 and q["model.layers.0.mlp.up_proj.scales"].shape == (96, 1)


def test_cli_errors(tiny_model_factory, tmp_path):
  r = run_cli("--model", tmp_path / "nope", "--out", tmp_path / "o")
  assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "nope" in r.stderr and "Traceback" not in r.stderr
  a_file = tmp_path / "file"
  a_file.write_text("x")
  r = run_cli("--model", tiny_model_factory("gqa"), "--out", a_file)
  assert r.returncode == 2 and "--out" in r.stderr and "Traceback" not in r.stderr
  r = run_cli("--model", tiny_model_factory("gqa"), "--out", tmp_path / "o", "--group-size", 48)
  assert r.returncode == 2 and "--group-size" in r.stderr
  done = tmp_path / "done"
  assert run_cli("--model", tiny_model_factory("gqa"), "--out", done).returncode == 0
  r = run_cli("--model", done, "--out", tmp_path / "again")
  assert r.returncode == 2 and "already quantized" in r.stderr


def write_tiny_q4_gguf(path: Path, rng) -> Path:
  """A one-layer Llama GGUF: Q4_0 attention, Q4_1 MLP, F32 norms and embedding, a 3-token gpt2 vocab."""
  import gguf
  from gguf import GGMLQuantizationType as T, quants
  H, F, heads, kv, V = 64, 96, 4, 2, 40
  w = gguf.GGUFWriter(path, "llama")
  w.add_block_count(1); w.add_context_length(128); w.add_embedding_length(H); w.add_feed_forward_length(F)
  w.add_head_count(heads); w.add_head_count_kv(kv); w.add_layer_norm_rms_eps(1e-5); w.add_rope_freq_base(10000.0)
  w.add_vocab_size(V)
  w.add_tokenizer_model("gpt2"); w.add_token_list([f"t{i}" for i in range(V)]); w.add_token_types([1] * V); w.add_token_merges([])
  w.add_tensor("token_embd.weight", random_weight(V, H, rng))
  w.add_tensor("output_norm.weight", np.ones(H, np.float32))
  w.add_tensor("blk.0.attn_norm.weight", np.ones(H, np.float32))
  w.add_tensor("blk.0.ffn_norm.weight", np.ones(H, np.float32))
  for name, (n, k), t in [("attn_q", (H, H), T.Q4_0), ("attn_k", (kv * 16, H), T.Q4_0), ("attn_v", (kv * 16, H), T.Q4_0),
                          ("attn_output", (H, H), T.Q4_0), ("ffn_gate", (F, H), T.Q4_1), ("ffn_up", (F, H), T.Q4_1),
                          ("ffn_down", (H, F), T.Q4_1)]:
    w.add_tensor(f"blk.0.{name}.weight", quants.quantize(random_weight(n, k, rng), t), raw_dtype=t)
  w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
  return path


def test_cli_repacks_gguf_q4_blocks_exactly(tmp_path):
  """Q4_0/Q4_1 blocks go straight into the packed layout (Q/K rows un-permuted like the float loader does)."""
  from tinyvllm.model.weights import load_checkpoint, read_safetensors
  from tinyvllm.quantize import quantize_checkpoint
  src = write_tiny_q4_gguf(tmp_path / "tiny.gguf", np.random.default_rng(5))
  logs = []
  quantize_checkpoint(str(src), tmp_path / "q32", 32, log=logs.append)
  assert any("7 GGUF Q4_0/Q4_1 weights repacked losslessly" in m for m in logs)
  ref, q = load_checkpoint(src, quantization="none").tensors, read_safetensors(tmp_path / "q32" / "model.safetensors")
  for name in [n for n in ref if int4.is_linear_weight(n)]:
    base = name[:-len(".weight")]
    np.testing.assert_array_equal(int4.dequantize(q[name], q[f"{base}.scales"], q[f"{base}.biases"], 32), ref[name], err_msg=name)
  cfg = json.loads((tmp_path / "q32" / "config.json").read_text())
  assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["tie_word_embeddings"] and cfg["rms_norm_eps"] == 1e-5
  logs.clear()
  quantize_checkpoint(str(src), tmp_path / "q64", 64, log=logs.append)
  assert any("requantized" in m and "64" in m for m in logs)


# **** activation-aware clip ****

def test_importance_weighted_clip_lowers_the_weighted_error():
  rng = np.random.default_rng(11)
  w = gaussian_with_outliers(32, 256, rng)
  imp = np.ones(256)
  imp[rng.choice(256, 8, replace=False)] = 200.0     # a few input channels carry large activations
  def weighted_error(p, s, b):
    return (((int4.dequantize(p, s, b, 64, dtype=np.float64) - w) ** 2) * imp).sum()
  plain, aware = int4.quantize(w, 64, "clip"), int4.quantize(w, 64, "clip", importance=imp)
  assert weighted_error(*aware) < 0.9 * weighted_error(*plain)
  np.testing.assert_array_equal(int4.quantize(w, 64, "rtn", importance=imp)[0], int4.quantize(w, 64, "rtn")[0])
  with pytest.raises(ValueError, match="importance"): int4.quantize(w, 64, "clip", importance=np.ones(5))


def test_input_second_moments_of_a_tiny_model(tiny_model_factory):
  from tinyvllm.model.weights import load_checkpoint
  from tinyvllm.quant.calibrate import input_second_moments
  ck = load_checkpoint(tiny_model_factory("tied"))
  stats = input_second_moments(ck.config, ck.tensors, np.arange(40) % ck.config.vocab_size, window=16)
  p = "model.layers.0"
  assert stats[f"{p}.mlp.down_proj.weight"].shape == (ck.config.intermediate_size,)
  np.testing.assert_array_equal(stats[f"{p}.self_attn.q_proj.weight"], stats[f"{p}.self_attn.k_proj.weight"])  # same input
  np.testing.assert_array_equal(stats["model.embed_tokens.weight"], stats["lm_head.weight"])                 # tied
  assert all(np.all(v >= 0) and np.any(v > 0) for v in stats.values())


def test_cli_calibration(tiny_model_factory, tmp_path):
  text = tmp_path / "calib.txt"
  text.write_text("The quick brown fox jumps over the lazy dog. Hello world, hello tinyvllm! " * 20)
  src = tiny_model_factory("gqa")
  r = run_cli("--model", src, "--out", tmp_path / "q", "--group-size", 32, "--method", "clip", "--calibration", text)
  assert r.returncode == 0, r.stderr
  assert "calibrating on" in r.stderr and (tmp_path / "q" / "model.safetensors").exists()
  r = run_cli("--model", src, "--out", tmp_path / "q2", "--calibration", text)             # default method rtn
  assert r.returncode == 2 and "--calibration" in r.stderr
  r = run_cli("--model", src, "--out", tmp_path / "q3", "--method", "clip", "--calibration", tmp_path / "missing.txt")
  assert r.returncode == 2 and "missing.txt" in r.stderr


@pytest.mark.parametrize("M", [1, 3, 8])
def test_cpu_q8_linear_matches_numpy(M):
  """8-bit blocks (GGUF Q8_0: int8 codes, one fp16 scale per 32) through the C kernel vs float64 numpy on the
  same codes and scales: float32 accumulation over K=576 products, so 1e-5 relative is generous."""
  from tinygrad import Tensor
  from tinyvllm.kernels.cpu import q8_linear
  rng = np.random.default_rng(M)
  N, K = 100, 576
  codes = rng.integers(-127, 128, (N, K)).astype(np.int8)
  scales = (rng.random((N, K // 32)) * 0.02 + 0.001).astype(np.float16)
  x = rng.standard_normal((M, K)).astype(np.float32)
  y = q8_linear(Tensor(x), Tensor(codes), Tensor(scales)).numpy()
  w = codes.reshape(N, -1, 32).astype(np.float64) * scales.astype(np.float64)[..., None]
  ref = x.astype(np.float64) @ w.reshape(N, K).T
  assert np.linalg.norm(y - ref) / np.linalg.norm(ref) < 1e-5


def test_quantizing_a_checkpoint_in_slices_equals_one_call():
  """The loader quantizes a float weight a slice of rows at a time (model/weights.py, its pages let go as it reads):
  rows quantize independently, so the arrays equal one call's, and they sit in pages a CPU tensor takes as they are."""
  from tinyvllm import host_memory
  from tinyvllm.model.weights import _quantize_int4
  w = random_weight(45, 256, np.random.default_rng(8)).astype(np.float16)
  sliced = _quantize_int4(w, 64, slice_bytes=7 * 256 * 2)   # 7 rows a slice, the last one partial
  for a, b in zip(sliced, int4.quantize(w, 64, "rtn")): np.testing.assert_array_equal(a, b)
  assert all(host_memory.pages_of(a) is not None for a in sliced)


def test_quantizing_at_load_fuses_without_a_copy(tiny_model_factory):
  """quantization="int4" quantizes q, k and v (gate and up) into one buffer each, so the model's fused projection is
  that buffer, not a second copy; the result equals quantizing each part on its own."""
  from tinyvllm import host_memory
  from tinyvllm.kernels import make_kernels
  from tinyvllm.model.llama import Llama
  from tinyvllm.model.weights import load_checkpoint
  path = tiny_model_factory()
  ckpt, plain = load_checkpoint(path, "int4"), load_checkpoint(path)
  model = Llama(ckpt.config, ckpt.tensors, "float32", "CPU", make_kernels("portable", "CPU"), 64)
  for fused, parts in (("self_attn.qkv_proj", ("q_proj", "k_proj", "v_proj")), ("mlp.gate_up_proj", ("gate_proj", "up_proj"))):
    prefix = "model.layers.1." + fused.split(".")[0] + "."
    lw = model.layers[1].linears[fused]
    assert lw.weight.uop.buffer.host_memory is host_memory.pages_of(ckpt.tensors[prefix + parts[0] + ".weight"])
    want = [np.concatenate(a) for a in zip(*(int4.quantize(plain.tensors[prefix + p + ".weight"], 64) for p in parts))]
    for got, ref in zip((lw.weight, lw.scales, lw.biases), want): np.testing.assert_array_equal(got.numpy(), ref)


def test_quantizing_8bit_tables_at_load_equals_quantizing_their_floats(tiny_model_factory, tmp_path, monkeypatch):
  """A Q8_0 GGUF loaded with quantization="int4": each 8-bit table is dequantized a slice of rows at a time as it is
  quantized (all at once first, a 1B Q8_0 file peaked at 8.5 GB); the INT4 arrays equal quantizing the gguf package's
  own dequantization of the same tensors, at the file's group size (32, Q8_0's blocks)."""
  from test_weights import GGUF_TYPES, write_gguf
  from tinyvllm.model import weights
  ref = write_gguf(tiny_model_factory(), tmp_path / "q8.gguf", {k: "Q8_0" for k in GGUF_TYPES})
  sliced = weights._quantize_int4
  monkeypatch.setattr(weights, "_quantize_int4", lambda *a: sliced(*a, slice_bytes=5 * 64 * 4))   # 5 rows a slice
  ckpt = weights.load_checkpoint(tmp_path / "q8.gguf", "int4")
  tensors = ckpt.tensors
  assert ckpt.config.quantization["group_size"] == 32
  checked = 0
  for name, w in ref.items():
    if not name.endswith("proj.weight") and name not in int4.EMBEDDING_NAMES: continue
    base = name[:-len(".weight")]
    for got, want in zip((tensors[name], tensors[f"{base}.scales"], tensors[f"{base}.biases"]), int4.quantize(w, 32, "rtn")):
      np.testing.assert_array_equal(got, want, err_msg=name)
    checked += 1
  assert checked >= 8


def test_quantizing_8bit_linears_at_load_keeps_their_biases(tmp_path):
  """Qwen2's q/k/v carry biases: quantizing its Q8_0 linears to INT4 at load replaces their codes and scales, never
  the biases beside them (they were dropped, and the model refused to build: "lacks the tensor ...q_proj.bias")."""
  from conftest import make_tiny_model
  from test_weights import GGUF_TYPES, write_gguf
  from tinyvllm import LLM, SamplingParams
  from tinyvllm.model.weights import load_checkpoint
  make_tiny_model(tmp_path / "qwen2", "qwen2", vector_noise=0.1)
  ref = write_gguf(tmp_path / "qwen2", tmp_path / "q8.gguf", {k: "Q8_0" for k in GGUF_TYPES}, arch="qwen2")
  tensors = load_checkpoint(tmp_path / "q8.gguf", "int4").tensors
  for p in ("q_proj", "k_proj", "v_proj"):
    name = f"model.layers.0.self_attn.{p}"
    assert f"{name}.biases" in tensors   # quantized to INT4
    np.testing.assert_array_equal(np.asarray(tensors[f"{name}.bias"], np.float32), ref[f"{name}.bias"])
  out = LLM(str(tmp_path / "q8.gguf"), quantization="int4", max_model_len=64).generate(
    [[3, 4, 5]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=0))[0].outputs[0]
  assert len(out.token_ids) == 4 and all(np.isfinite(lp[t].logprob) for lp, t in zip(out.logprobs, out.token_ids))
