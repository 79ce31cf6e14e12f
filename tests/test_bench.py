"""tinyvllm.bench: the byte/FLOP accounting against hand counts, the chip table, and one end-to-end run on a tiny
random checkpoint (tiny sizes, no timing asserts)."""
from __future__ import annotations
import dataclasses, importlib.util, json
from pathlib import Path
import pytest
from tinyvllm.bench import accounting, device
from tinyvllm.bench.accounting import TensorInfo
from tinyvllm.config import ModelConfig
from conftest import NVRTC

# A made-up model small enough to count by hand: 2 layers, hidden 8, FFN 12, 2 heads of 4, 1 KV head, vocab 10.
CFG = ModelConfig(vocab_size=10, hidden_size=8, intermediate_size=12, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=4, rms_norm_eps=1e-5, rope_theta=1e4, tie_word_embeddings=True)


def tensors_fp32() -> list[TensorInfo]:
  out = [TensorInfo("model.embed_tokens.weight", (10, 8), 10 * 8 * 4), TensorInfo("model.norm.weight", (8,), 32)]
  for i in range(2):
    p = f"model.layers.{i}."
    out += [TensorInfo(p + "input_layernorm.weight", (8,), 32), TensorInfo(p + "post_attention_layernorm.weight", (8,), 32),
            TensorInfo(p + "self_attn.qkv_proj.weight", (16, 8), 16 * 8 * 4), TensorInfo(p + "self_attn.o_proj.weight", (8, 8), 256),
            TensorInfo(p + "mlp.gate_up_proj.weight", (24, 8), 24 * 8 * 4), TensorInfo(p + "mlp.down_proj.weight", (8, 12), 384)]
  return out


def test_decode_bytes_and_flops_by_hand():
  # batch 2, each sequence attends to 5 tokens, fp32 cache and activations
  t = accounting.decode_traffic(CFG, tensors_fp32(), batch=2, context=5, kv_vector_bytes=4 * CFG.head_dim, act_dtype_bytes=4)
  per_layer = 32 + 32 + 512 + 256 + 768 + 384                   # norms, qkv, o, gate_up, down
  weights = 2 * per_layer + 32 + 320 + 2 * 32                    # layers, final norm, tied head (whole), 2 gathered rows
  assert t.weight_bytes == weights == 4384
  kv_row = 2 * 2 * 1 * 4 * 4                                     # layers x (K,V) x kv heads x head_dim x 4 bytes = 64
  assert t.kv_read_bytes == 2 * 5 * kv_row == 640
  assert t.kv_write_bytes == 2 * kv_row == 128
  # activations: per token per layer 14*8 + 4*8 + 2*4 + 6*12 = 224 values, + the embedding row; per logits row h + vocab
  assert t.activation_bytes == 2 * (2 * 224 + 8) * 4 + 2 * (8 * 4 + 10 * 4) == 3792
  linear = 8 * 16 + 8 * 8 + 2 * 8 * 12 + 12 * 8                 # multiply-adds of one layer's linears = 480
  assert t.flops == 2 * 2 * 2 * linear + 2 * 2 * 10 * 8 + 4 * 2 * 2 * 4 * 5 * 2 == 4800
  assert t.total_bytes == 4384 + 640 + 128 + 3792
  assert t.tokens == 2


def test_prefill_in_chunks_by_hand():
  # a 6-token prompt read in chunks of 4 then 2: weights read twice, keys 4 then 6, causal attention pairs 10 + 11
  t = accounting.prefill_traffic(CFG, tensors_fp32(), prompt_len=6, chunk_len=4, kv_vector_bytes=4 * CFG.head_dim, act_dtype_bytes=4)
  head_and_layers = 2 * 1984 + 32 + 320
  assert t.weight_bytes == 2 * head_and_layers + 6 * 32
  assert t.kv_read_bytes == (4 + 6) * 64 and t.kv_write_bytes == 6 * 64
  pairs = (1 + 2 + 3 + 4) + (5 + 6)
  assert t.flops == 2 * 6 * 2 * 480 + 2 * 2 * 10 * 8 + 4 * 2 * 2 * 4 * pairs
  assert t.tokens == 6


def test_quantized_tensors_count_their_real_bytes():
  """Packed int4 codes, scales and biases each count; an untied head is read whole, the embedding by rows."""
  cfg = dataclasses.replace(CFG, tie_word_embeddings=False)
  tensors = [TensorInfo("model.embed_tokens.weight", (10, 1), 40), TensorInfo("model.embed_tokens.scales", (10, 1), 20),
             TensorInfo("lm_head.weight", (10, 1), 40), TensorInfo("lm_head.scales", (10, 1), 20), TensorInfo("lm_head.biases", (10, 1), 20),
             TensorInfo("model.layers.0.mlp.down_proj.weight", (8, 2), 64), TensorInfo("model.layers.0.mlp.down_proj.scales", (8, 1), 16)]
  assert accounting.weight_bytes(cfg, tensors, num_tokens=3) == 3 * 4 + 3 * 2 + 80 + 80


def test_published_bandwidth_table():
  assert device.published_bandwidth("Apple M2 Pro") == (200.0, device.APPLE_CHIPS["M2 Pro"]["source"], False)
  assert device.published_bandwidth("Apple M4 Max", 14)[0] == 410.0
  assert device.published_bandwidth("Apple M4 Max", 16)[0] == 546.0
  assert device.published_bandwidth("Apple M3 Max", 0)[0] == 400.0       # unknown bin: the highest
  assert device.published_bandwidth("Apple M5 Max")[2] is True           # marked unsure
  assert device.published_bandwidth("Intel(R) Xeon(R)") == (None, None, False)
  assert device.published_bandwidth(None) == (None, None, False)


def test_published_nvidia_bandwidth_by_nvidia_smi_name():
  """nvidia-smi's names for the common variants find their own data-sheet rows (the specific forms before the general)."""
  cases = {"NVIDIA H100 80GB HBM3": 3350, "NVIDIA H100 PCIe": 2000, "NVIDIA H100 NVL": 3900, "NVIDIA H200": 4800,
           "NVIDIA A100-SXM4-80GB": 2039, "NVIDIA A100-SXM4-40GB": 1555, "NVIDIA A100 80GB PCIe": 1935, "NVIDIA L4": 300,
           "NVIDIA L40S": 864, "NVIDIA A10G": 600, "Tesla T4": 320, "Tesla V100-SXM2-16GB": 900, "NVIDIA GeForce RTX 4090": 1008,
           "NVIDIA GeForce RTX 3090 Ti": 1008, "NVIDIA GeForce RTX 3090": 936}
  for name, gbps in cases.items(): assert device.published_nvidia_bandwidth(name)[0] == gbps, name
  assert device.published_nvidia_bandwidth("Quadro P4000") == (None, None)
  assert device.published_nvidia_bandwidth(None) == (None, None)


REQUIRED = ("device", "model", "quantization", "batch_size", "context_len", "tokens_per_s", "bytes_per_token",
            "achieved_gbps", "measured_bandwidth_gbps", "roofline_fraction", "kind", "ms_per_step")


def test_bench_end_to_end_on_a_tiny_model(tiny_model, tmp_path, capsys):
  from tinyvllm.bench.cli import main
  out, plot = tmp_path / "bench.json", tmp_path / "roofline.png"
  has_matplotlib = importlib.util.find_spec("matplotlib") is not None
  main(["--model", str(tiny_model), "--batch-sizes", "1,2", "--context-lens", "8", "--steps", "2", "--warmup", "1",
        "--prefill-lens", "8", "--serving-requests", "3", "--serving-rate", "100", "--serving-prompt-lens", "4,8",
        "--serving-output-lens", "2,3", "--bandwidth-sizes", "1,2", "--bandwidth-reps", "1", "--matmul-size", "32",
        "--prompts", "text", "--peers", "hf,llamacpp", "--json", str(out)] + (["--plot", str(plot)] if has_matplotlib else []))
  printed = capsys.readouterr().out
  assert "measured bandwidth" in printed and "decode" in printed
  assert plot.exists() == has_matplotlib
  data = json.loads(out.read_text())
  assert data["command"].startswith("python -m tinyvllm.bench")
  ours = [r for r in data["records"] if r["engine"] == "tinyvllm"]
  assert [(r["kind"], r["batch_size"], r["context_len"]) for r in ours] == \
         [("decode", 1, 8), ("decode", 2, 8), ("prefill", 1, 8), ("serving", ours[-1]["batch_size"], ours[-1]["context_len"])]
  for r in ours:
    for key in REQUIRED: assert r[key] is not None, key
    assert r["tokens_per_s"] > 0 and r["bytes_per_token"] > 0 and r["quantization"] == "none" and r["prompts"] == "text"
  for r in ours[:3]:   # decode and prefill: where a token's time went adds up to the time measured, kernels timed
    t = r["time_per_token"]
    assert t["compute_ms"] > 0 and t["device_copies_ms"] == 0 and t["sync_ms"] == t["thread_pool_wait_ms"] >= 0
    assert t["compute_ms"] + t["sync_ms"] + t["host_ms"] == pytest.approx(1e3 * r["seconds"] / r["tokens"], rel=1e-9)
  serving = ours[-1]
  assert serving["tokens"] > 0 and serving["ttft_p50_ms"] is not None and serving["itl_p99_ms"] is not None

  # the tiny "gqa" model: vocab V, hidden 64, FFN 96, 2 layers, 4 heads / 2 KV heads of 16, untied head, float32
  V = json.loads((tiny_model / "config.json").read_text())["vocab_size"]
  layer = 4 * (64 + 64 + (64 + 2 * 32) * 64 + 64 * 64 + 2 * 96 * 64 + 96 * 64)
  for r in ours[:2]:
    B = r["batch_size"]
    assert r["weight_bytes_per_step"] == 2 * layer + 4 * 64 + 4 * V * 64 + B * 4 * 64
    assert r["kv_write_bytes_per_step"] == B * 2 * 2 * 2 * 16 * 4

  # peers: transformers ran on the same shapes; llama.cpp needs a GGUF and said so
  hf = [r for r in data["records"] if r["engine"] == "transformers"]
  assert {(r["kind"], r["batch_size"]) for r in hf} == {("decode", 1), ("decode", 2), ("prefill", 1)}
  assert ours[0]["peers"]["transformers"]["tinyvllm_over_peer"] > 0
  assert any(n.startswith("llama.cpp skipped") for n in data["notes"])


def test_bench_refuses_bad_arguments(capsys):
  """Before measuring anything, with the flag named (`--serving-requests 0` ended a run minutes in, in a NaN)."""
  from tinyvllm.bench.cli import main
  with pytest.raises(SystemExit): main(["--batch-sizes", "0"])
  with pytest.raises(SystemExit): main(["--runs", "decode,bogus"])
  for flag, value in [("--serving-requests", "0"), ("--steps", "0"), ("--repeats", "-1"), ("--warmup", "x"),
                      ("--serving-rate", "nan"), ("--serving-rate", "0"), ("--bandwidth-reps", "0"), ("--prefill-lens", ",")]:
    with pytest.raises(SystemExit): main([flag, value])
    assert f"argument {flag}:" in capsys.readouterr().err


def small_decode_bench(model, tmp_path, *flags: str, batch: int = 1, context: int = 8) -> list[dict]:
  """The records of a tiny decode-only bench run with `flags` added."""
  from tinyvllm.bench.cli import main
  out = tmp_path / "bench.json"
  main(["--model", str(model), *flags, "--runs", "decode", "--batch-sizes", str(batch), "--context-lens", str(context),
        "--steps", "2", "--warmup", "1", "--bandwidth-sizes", "1", "--bandwidth-reps", "1", "--matmul-size", "32",
        "--no-peers", "--json", str(out)])
  return json.loads(out.read_text())["records"]


def test_bench_splits_time_under_tensor_parallelism(tiny_model, tmp_path):
  """With two devices the time split reads every device's thread pool and counts the all-reduce copies: the
  split is there, copies are part of sync, and the parts still add up to the time measured."""
  (r,) = small_decode_bench(tiny_model, tmp_path, "--tensor-parallel-size", "2")
  t = r["time_per_token"]
  assert t["device_copies_ms"] > 0 and t["sync_ms"] == pytest.approx(t["thread_pool_wait_ms"] + t["device_copies_ms"])
  assert t["compute_ms"] + t["sync_ms"] + t["host_ms"] == pytest.approx(1e3 * r["seconds"] / r["tokens"], rel=1e-9)


def test_several_quantizations_run_in_one_bench(tiny_model, tmp_path):
  """`--quantization stored,int4` loads the model twice and labels each record with what was loaded."""
  from tinyvllm.bench.cli import main
  records = small_decode_bench(tiny_model, tmp_path, "--quantization", "stored,int4")
  assert [r["quantization"] for r in records] == ["none", "int4"]
  assert records[1]["weight_bytes_per_step"] < 0.5 * records[0]["weight_bytes_per_step"]   # packed: ~1/6 of float32
  with pytest.raises(SystemExit):
    main(["--quantization", "int8"])


def test_kv_cache_dtypes_compared_in_one_bench(tiny_model, tmp_path):
  """`--kv-cache-dtype auto,int8`: two engines, each record labelled with its cache format, and the int8 cache's
  bytes read per step counted from its real size (head_dim + 2 bytes per head vector against 4 * head_dim)."""
  from tinyvllm.bench.cli import main
  records = small_decode_bench(tiny_model, tmp_path, "--kv-cache-dtype", "auto,int8", batch=2, context=40)
  assert [r["kv_cache_dtype"] for r in records] == ["float32", "int8"]
  D = json.loads((tiny_model / "config.json").read_text())
  D = D.get("head_dim") or D["hidden_size"] // D["num_attention_heads"]
  ratio = records[1]["kv_read_bytes_per_step"] / records[0]["kv_read_bytes_per_step"]
  assert ratio == pytest.approx((D + 2) / (4 * D))
  with pytest.raises(SystemExit): main(["--kv-cache-dtype", "fp8"])


def test_multi_step_compared_in_one_bench(tiny_model, tmp_path, capsys):
  """`--num-scheduler-steps 1,4`: two engines, each record labelled; a run of 4 passes takes 4 tokens a step and
  reads the weights once per pass, so the weight bytes per token are the same as one pass a step's (counted by hand
  from the model's parameters in test_decode_bytes_and_flops_by_hand)."""
  records = small_decode_bench(tiny_model, tmp_path, "--num-scheduler-steps", "1,4", batch=2)
  assert [r["num_scheduler_steps"] for r in records] == [1, 4]
  assert [r["tokens_per_step"] for r in records] == [2, 8]
  per_token = [r["weight_bytes_per_step"] / r["tokens_per_step"] for r in records]
  assert per_token[1] == pytest.approx(per_token[0])
  assert "(4 passes a step)" in capsys.readouterr().out


def test_bench_sizes_runs_to_the_model_before_measuring(tiny_model, tmp_path, monkeypatch):
  """The tiny model's context is 256: a 1024-token decode context and a 512-token prefill are skipped with a note
  (not a failure after the ceilings), what fits still runs; a bad --model fails before anything is measured."""
  from tinyvllm.bench import cli, device
  measured = []
  real = device.measure
  monkeypatch.setattr(device, "measure", lambda *a, **kw: measured.append(1) or real(*a, **kw))
  out = tmp_path / "bench.json"
  cli.main(["--model", str(tiny_model), "--runs", "decode,prefill", "--batch-sizes", "1", "--context-lens", "8,1024",
            "--prefill-lens", "8,512", "--steps", "2", "--warmup", "1", "--bandwidth-sizes", "1", "--bandwidth-reps", "1",
            "--matmul-size", "32", "--no-peers", "--json", str(out)])
  data = json.loads(out.read_text())
  assert [(r["kind"], r["context_len"]) for r in data["records"]] == [("decode", 8), ("prefill", 8)]
  assert any("1024 skipped" in n for n in data["notes"]) and any("512 tokens skipped" in n for n in data["notes"])
  measured.clear()
  with pytest.raises(SystemExit, match="--model"): cli.main(["--model", str(tmp_path / "missing")])
  assert not measured


def test_doctor_reports_every_step(tiny_model, tmp_path, monkeypatch, capsys):
  """The doctor on this machine's CPU device: shaders through the emulator, the Metal tests skipped (TINYVLLM_EMULATE_METAL=0),
  a generation and a (shortened) roofline run; one report and a JSON with every step."""
  from tinyvllm.bench import cli, doctor
  monkeypatch.setenv("TINYVLLM_EMULATE_METAL", "0")
  monkeypatch.setattr(doctor, "ROOFLINE_ARGS", ["--runs", "decode", "--batch-sizes", "1", "--context-lens", "8", "--steps", "2",
                                                "--warmup", "1", "--bandwidth-sizes", "1", "--bandwidth-reps", "1", "--matmul-size", "32"])
  out = tmp_path / "doctor.json"
  with pytest.raises(SystemExit) as exit_info: cli.main(["--doctor", "--model", str(tiny_model), "--json", str(out)])
  assert exit_info.value.code == 0
  printed = capsys.readouterr().out
  assert "tinyvllm doctor report" in printed and "tinygrad: 0.14.0" in printed
  data = json.loads(out.read_text())
  steps = {s["name"]: s for s in data["steps"]}
  assert steps["compile shaders"]["ok"] and len(steps["compile shaders"]["details"]) == len(doctor.shader_files()) == 4
  assert steps["tests/test_metal_device.py"]["ok"] is None and "skipped" in steps["tests/test_metal_device.py"]["summary"]
  assert steps["generation"]["ok"] and steps["generation"]["details"]["tokens_per_s"] > 0
  runs = steps["roofline"]["details"]["runs"]
  assert steps["roofline"]["ok"] and [(r["kind"], r["batch_size"]) for r in runs] == [("decode", 1)] and runs[0]["tokens_per_s"] > 0


def test_doctor_names_a_shader_that_does_not_compile(tmp_path):
  from tinyvllm.bench import doctor
  good, bad = tmp_path / "good.metal", tmp_path / "bad.metal"
  good.write_text("#include <metal_stdlib>\nusing namespace metal;\nkernel void k(device float* x [[buffer(0)]], uint i [[thread_position_in_grid]]) { x[i] = 1.0f; }\n")
  bad.write_text(good.read_text().replace("x[i] = 1.0f;", "x[i] = undeclared_name;"))
  step = doctor.compile_shaders([good, bad], "CPU")
  assert step.ok is False and step.details["good.metal"].startswith("ok")
  assert step.details["bad.metal"].startswith("FAILED") and "undeclared_name" in step.details["bad.metal"]
  assert "1/2 compiled" in step.summary


def test_bench_on_a_gpu_device_splits_host_wait_and_gpu_time(tiny_model, tmp_path):
  """The bench on a GPU-kind device (the emulated METAL device here; CUDA on an NVIDIA GPU): each decode and prefill
  record splits a token's time into host time (launches included), the wait for the GPU and the GPU's own busy time
  from profiled steps, and the table prints that split."""
  import os, subprocess, sys
  out = tmp_path / "bench.json"
  r = subprocess.run([sys.executable, "-m", "tinyvllm.bench", "--model", str(tiny_model), "--kernel-backend", "portable", "--runs", "decode,prefill",
                      "--batch-sizes", "2", "--context-lens", "8", "--steps", "2", "--warmup", "1", "--prefill-lens", "16",
                      "--bandwidth-sizes", "1", "--bandwidth-reps", "1", "--matmul-size", "32", "--no-peers", "--json", str(out)],
                     capture_output=True, text=True, timeout=600, env={**os.environ, "DEV": "METAL", "TINYVLLM_EMULATE_METAL": "1"})
  assert r.returncode == 0, r.stderr[-3000:]
  assert "waiting for the GPU" in r.stdout and "GPU " in r.stdout
  records = [x for x in json.loads(out.read_text())["records"] if x["engine"] == "tinyvllm"]
  assert [x["kind"] for x in records] == ["decode", "prefill"] and all(x["device"] == "METAL" for x in records)
  for x in records:
    t = x["time_per_token"]
    assert t["host_ms"] > 0 and t["gpu_wait_ms"] >= 0 and t["gpu_ms"] is not None and t["gpu_ms"] >= 0
    assert t["host_ms"] + t["gpu_wait_ms"] == pytest.approx(1e3 * x["seconds"] / x["tokens"], rel=1e-9)
    assert t["launch_ms"] <= t["host_ms"]


@pytest.mark.skipif(NVRTC is None, reason="nvrtc not installed (pip install nvidia-cuda-nvrtc; Linux x86_64)")
def test_bench_on_the_null_device_times_the_hosts_work_alone(tiny_model, tmp_path):
  """On tinygrad's NULL device lowering for the H100 (kernels compiled by nvrtc, launched into nothing) the bench times
  the GPU path's host work alone: no ceilings to measure, no roofline, no peers, no GPU time, and it says so."""
  import os, subprocess, sys
  out = tmp_path / "bench.json"
  r = subprocess.run([sys.executable, "-m", "tinyvllm.bench", "--model", str(tiny_model), "--runs", "decode", "--batch-sizes", "2",
                      "--context-lens", "8", "--steps", "3", "--warmup", "1", "--json", str(out)], capture_output=True, text=True,
                     timeout=600, env={**os.environ, "DEV": "NULL:CUDA:sm_90", "NULL_ALLOW_COPYOUT": "1", "NVRTC_PATH": NVRTC})
  assert r.returncode == 0, r.stderr[-3000:]
  assert "runs none: times are the host's work alone" in r.stdout and "measured bandwidth" not in r.stdout
  (record,) = json.loads(out.read_text())["records"]
  assert record["engine"] == "tinyvllm" and record["device"] == "NULL" and record["tokens_per_s"] > 0
  assert record["roofline_fraction"] is None and record["bandwidth_fraction"] is None
  t = record["time_per_token"]
  assert t["gpu_ms"] is None and t["host_ms"] > 0 and t["kernels_per_step"] > 0


def test_compiled_transformers_peer_runs(tiny_model):
  """The gpt-fast recipe (static cache, decode step under torch.compile) runs on the CPU too: a GPU run's strong peer."""
  import numpy as np
  from pathlib import Path
  from tinyvllm.bench.peers import load_peer
  peer = load_peer("hf-compile", Path(tiny_model), None, 2, 64, device="cpu", dtype="float32")
  rng = np.random.default_rng(0)
  assert peer.decode(2, 8, 3, 3, rng)["tokens_per_s"] > 0 and peer.prefill(8, rng)["tokens_per_s"] > 0
  assert "torch.compile" in peer.precision


def test_a_failing_step_ends_the_bench_with_its_cause(tiny_model):
  """A pass that raises (a broken GPU, say) is never timed as if it ran: the bench stops with the cause in one line,
  the traceback logged once above it."""
  import os, subprocess, sys
  code = ("import sys\nimport tinyvllm.engine.model_runner as m\n"
          "def boom(self, *a, **kw): raise RuntimeError('CUDA Error 1, invalid argument (injected)')\n"
          "m.ModelRunner.execute = boom\nfrom tinyvllm.bench.cli import main\nmain(sys.argv[1:])")
  r = subprocess.run([sys.executable, "-c", code, "--model", str(tiny_model), "--runs", "decode", "--batch-sizes", "1",
                      "--context-lens", "8", "--steps", "2", "--warmup", "1", "--bandwidth-sizes", "1", "--bandwidth-reps", "1",
                      "--matmul-size", "32", "--no-peers"], capture_output=True, text=True, timeout=600, env={**os.environ, "DEV": "CPU"})
  assert r.returncode == 1
  last = r.stderr.strip().splitlines()[-1]
  assert last.startswith("tinyvllm.bench: the engine failed a step") and "CUDA Error 1, invalid argument (injected)" in last
  assert r.stderr.count("Traceback") == 1 and "model pass failed for" in r.stderr


def test_kernel_times_sum_a_decode_step_kernel_by_kernel(tiny_model, tmp_path):
  """bench/gpu_kernel_times.py (the GPU session's per-kernel phase) on the CPU device with the portable kernels a GPU
  runs: every kernel of one decode step timed once, grouped by name, the paged attention's among them."""
  import os, subprocess, sys
  out = tmp_path / "kernels.json"
  r = subprocess.run([sys.executable, "bench/gpu_kernel_times.py", str(tiny_model), "--batch-size", "2", "--prompt-len", "20",
                      "--kernel-backend", "portable", "--dtype", "float16", "--json", str(out)],
                     capture_output=True, text=True, timeout=600, env={**os.environ, "DEV": "CPU"}, cwd=Path(__file__).parent.parent)
  assert r.returncode == 0, r.stderr[-3000:]
  report = json.loads(out.read_text())
  names = {k["name"] for k in report["by_kernel"]}
  assert report["rows"] == 2 and sum(k["count"] for k in report["by_kernel"]) == report["kernels"] > 20
  assert any(n.startswith("paged_scores") for n in names) and any(n.startswith("paged_values") for n in names)
  assert report["device_ms"] == pytest.approx(sum(k["us"] for k in report["by_kernel"]) / 1e3) and report["device_ms"] > 0
  assert "us/step" in r.stdout


def test_packed_portable_times_both_scale_layouts(tmp_path):
  """bench/packed_portable.py (the GPU session's k-quant phase) on the CPU device: Q4_K with the file's 6-bit scales and
  with byte scales (checked equal inside: the same weights), Q6_K alone, each timed."""
  import os, subprocess, sys
  out = tmp_path / "packed.json"
  r = subprocess.run([sys.executable, "bench/packed_portable.py", "--types", "Q4_K,Q6_K", "--shapes", "64x512", "--rows", "1,3",
                      "--rounds", "2", "--json", str(out)],
                     capture_output=True, text=True, timeout=600, env={**os.environ, "DEV": "CPU"}, cwd=Path(__file__).parent.parent)
  assert r.returncode == 0, r.stderr[-3000:]
  rows = json.loads(out.read_text())
  assert sorted((x["type"], x["M"], x["layout"]) for x in rows) == sorted(
    [("Q4_K", m, lay) for m in (1, 3) for lay in ("file's scales", "byte scales")] + [("Q6_K", m, "file's scales") for m in (1, 3)])
  assert all(x["ms"] > 0 and x["device"] == "CPU" for x in rows)
  assert all(x["speed_vs_file_scales"] == 1.0 for x in rows if x["layout"] == "file's scales")
  assert "speed vs file scales" in r.stdout


def test_gemv_bench_times_both_variants(tmp_path):
  """bench/gemv.py (the GPU session's projection phase) on the CPU device: each fusion's GEMV and the tinygrad ops it
  replaced, for float16, INT4 and Q4_K weights, checked to agree inside, each timed, with their kernel counts (the norm
  and the gating apart in tinygrad's; ours one kernel, x's 1/RMS inside: gemv.norms_inside)."""
  import os, subprocess, sys
  out = tmp_path / "gemv.json"
  r = subprocess.run([sys.executable, "bench/gemv.py", "--shapes", "96x256:norm,64x256:glu,32x256:residual", "--rows", "1,2",
                      "--formats", "float16,int4,q4_k", "--rounds", "2", "--json", str(out)],
                     capture_output=True, text=True, timeout=600, env={**os.environ, "DEV": "CPU"}, cwd=Path(__file__).parent.parent)
  assert r.returncode == 0, r.stderr[-3000:]
  rows = json.loads(out.read_text())
  assert sorted((x["format"], x["fusion"], x["rows"]) for x in rows) == sorted(
    (fmt, f, t) for fmt in ("float16", "int4", "q4_k") for f in ("norm", "glu", "residual") for t in (1, 2))
  assert all(x["us_ours"] > 0 and x["us_tinygrad"] > 0 and x["rel_err"] < (2e-3 if x["format"] != "q4_k" else 1e-2) for x in rows)
  assert {(x["format"], x["fusion"]): (x["kernels_ours"], x["kernels_tinygrad"]) for x in rows} == {
    **{(q, "norm"): (1, 2) for q in ("float16", "int4", "q4_k")}, **{(q, "glu"): (1, 3) for q in ("float16", "int4", "q4_k")},
    ("float16", "residual"): (1, 1),
    **{(q, "residual"): (1, 1) for q in ("int4", "q4_k")}}
  assert "speedup" in r.stdout
