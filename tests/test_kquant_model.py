"""A tiny Llama GGUF whose tensors are k-quants, Q5_0/Q5_1, Q8_0, Q3_K and IQ4_XS/IQ4_NL (random valid blocks written by gguf's writer,
types mixed within a layer and between layers as llama-quantize's Q4_K_M mixes them): it loads compact, and its logits
equal the same checkpoint dequantized to float32, through our portable kernels, on every backend that runs it.

Tolerance: relative error 2e-4. Both sides compute float32 on the same float32 weights (dequantizing is exact,
tests/test_blocks.py); they differ in summation order (~1e-6 per op here) and, where the CPU's C kernels run (every
backend on the CPU device), in x's rounding to 16 bits: per run of 32 inputs (7.8e-5 measured), per super-block of 256
for the k-quants on CPUs with AVX-512 VBMI (kernels/cpu.py _KQuantInt: 1.3-1.4e-4 measured). A wrong scale, code or
high bit moves the logits by whole percents."""
from __future__ import annotations
import numpy as np
import pytest
from test_blocks import random_ggml
from tinyvllm.quant import blocks
from tinyvllm.quant.formats import FLOAT, INT8, PACKED

H, F, HEADS, KV, V = 256, 512, 4, 2, 300
# per layer: gguf name -> type. Layer 0 keeps q/k and v in different types (q/k/v stay apart), layer 1 stores them
# alike (fused), layer 2 fuses q/k/v but not gate/up: three kinds of layer for the runner.
LAYER_TYPES = [
  {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q5_K", "ffn_gate": "Q5_0", "ffn_up": "Q5_1", "ffn_down": "Q6_K"},
  {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q4_K", "attn_output": "Q3_K", "ffn_gate": "Q4_K", "ffn_up": "Q4_K", "ffn_down": "Q8_0"},
  {"attn_q": "IQ4_XS", "attn_k": "IQ4_XS", "attn_v": "IQ4_XS", "attn_output": "IQ4_NL", "ffn_gate": "IQ4_XS", "ffn_up": "IQ4_NL",
   "ffn_down": "IQ4_XS"},
]
SHAPES = {"attn_q": (HEADS * 64, H), "attn_k": (KV * 64, H), "attn_v": (KV * 64, H), "attn_output": (H, HEADS * 64),
          "ffn_gate": (F, H), "ffn_up": (F, H), "ffn_down": (H, F)}


def small_blocks(qtype: str, rows: int, cols: int, rng) -> np.ndarray:
  """Random valid blocks with scales small enough that the random model's activations stay moderate."""
  import gguf
  if qtype == "Q8_0":
    return gguf.quants.quantize((rng.standard_normal((rows, cols)) * 0.05).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
  raw = random_ggml(qtype, rows, cols, rng)
  from tinyvllm.quant import blocks
  block, nbytes = blocks.GGML_TYPES[qtype]
  b = raw.reshape(rows, -1, nbytes)
  size = {"Q4_K": 3e-4, "Q5_K": 1.5e-4, "Q6_K": 4e-5, "Q3_K": 3e-3, "Q5_0": 4e-3, "Q5_1": 3e-3, "IQ4_XS": 1.5e-5, "IQ4_NL": 4e-4}[qtype]
  fields = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "Q3_K": (108,), "Q5_0": (0,), "Q5_1": (0, 2), "IQ4_XS": (0,), "IQ4_NL": (0,)}[qtype]
  for at in fields: b[..., at:at + 2] = (rng.standard_normal(b.shape[:-1]) * size).astype(np.float16)[..., None].view(np.uint8)
  return b.reshape(rows, -1)


@pytest.fixture(scope="module")
def kquant_gguf(tmp_path_factory):
  import gguf
  rng = np.random.default_rng(11)
  path = tmp_path_factory.mktemp("kquant") / "tiny-kquant.gguf"
  w = gguf.GGUFWriter(path, "llama")
  w.add_block_count(len(LAYER_TYPES)); w.add_context_length(256); w.add_embedding_length(H); w.add_feed_forward_length(F)
  w.add_head_count(HEADS); w.add_head_count_kv(KV); w.add_layer_norm_rms_eps(1e-5); w.add_rope_freq_base(10000.0)
  w.add_vocab_size(V)
  w.add_tokenizer_model("gpt2"); w.add_token_list(["t", "0"] + [f"t{i}" for i in range(V - 2)]); w.add_token_types([1] * V)
  w.add_token_merges(["t 0"])
  w.add_bos_token_id(0); w.add_eos_token_id(1)
  T = gguf.GGMLQuantizationType
  w.add_tensor("token_embd.weight", small_blocks("Q4_K", V, H, rng), raw_dtype=T.Q4_K)
  w.add_tensor("output.weight", small_blocks("Q6_K", V, H, rng), raw_dtype=T.Q6_K)
  w.add_tensor("output_norm.weight", (1 + 0.1 * rng.standard_normal(H)).astype(np.float32))
  for i, types in enumerate(LAYER_TYPES):
    w.add_tensor(f"blk.{i}.attn_norm.weight", (1 + 0.1 * rng.standard_normal(H)).astype(np.float32))
    w.add_tensor(f"blk.{i}.ffn_norm.weight", (1 + 0.1 * rng.standard_normal(H)).astype(np.float32))
    for name, qtype in types.items():
      w.add_tensor(f"blk.{i}.{name}.weight", small_blocks(qtype, *SHAPES[name], rng), raw_dtype=T[qtype])
  w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
  return path


def test_loads_compact_and_lazily(kquant_gguf):
  from tinyvllm.model.weights import LazyTensors, load_checkpoint
  ckpt = load_checkpoint(kquant_gguf)
  assert isinstance(ckpt.tensors, LazyTensors) and not ckpt.tensors.made   # nothing converted before the model reads it
  t = ckpt.tensors
  assert t["model.layers.0.self_attn.v_proj.weight"].shape == blocks.part_shapes(blocks.GGML_SPECS["Q6_K"], KV * 64, H)["weight"]   # Q6_K
  assert t["model.layers.0.self_attn.v_proj.scales"].dtype == np.int8
  assert t["model.layers.1.mlp.down_proj.weight"].dtype == np.int8        # Q8_0 linears stay 8-bit
  assert "model.embed_tokens.scale_d" in t and "lm_head.qspec" in t
  # bytes as stored: about the file's (4.5-6.6 bits a weight), not float32's 32
  params = V * H * 2 + sum(r * c for types in LAYER_TYPES for r, c in (SHAPES[n] for n in types))
  assert ckpt.nbytes < params * 0.9   # under 7.2 bits a weight


@pytest.fixture(scope="module")
def reference_logits(kquant_gguf):
  from conftest import our_prefill_logits
  ids = np.random.default_rng(3).integers(2, V, 40).tolist()
  return ids, our_prefill_logits(kquant_gguf, ids, "portable", quantization="none")


@pytest.mark.parametrize("backend", ["portable", "cpu", "emulator"])
def test_logits_equal_the_dequantized_checkpoint(kquant_gguf, reference_logits, backend):
  from tinyvllm.engine.llm_engine import LLMEngine
  from tinyvllm import SamplingParams
  ids, ref = reference_logits
  engine = LLMEngine.from_kwargs(str(kquant_gguf), kernel_backend=backend, block_size=8, num_kv_blocks=64, max_num_batched_tokens=16)
  layers = engine.runner.model.layers
  assert [sorted({lw.format for lw in layer.linears.values()}) for layer in layers] == [[PACKED], [INT8, PACKED], [PACKED]]
  assert "self_attn.v_proj" in layers[0].linears and "self_attn.qkv_proj" in layers[1].linears   # apart, fused
  assert "self_attn.qkv_proj" in layers[2].linears and "mlp.gate_proj" in layers[2].linears   # IQ4_XS q/k/v; gate XS, up NL
  assert len(engine.runner.layer_templates) == 3
  assert engine.runner.packs_prefill   # the fused C layer takes every format, q/k/v apart too; portable's paged kernels any
  assert engine.runner.model.embed_tokens.format == PACKED and engine.runner.model.lm_head.format == PACKED
  seen = []
  execute = engine.runner.execute
  def spy(decodes, prefills=(), verifies=(), **kw):
    out = execute(decodes, prefills, verifies, **kw)
    seen.extend(out[1])
    return out
  engine.runner.execute = spy
  engine.add_request("0", {"prompt_token_ids": ids}, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))
  while engine.has_unfinished_requests(): engine.step()
  # the prompt in chunks of 16 with every position's logits (prompt logprobs), against the float32 reference
  ours = np.concatenate(seen)
  assert ours.shape == ref.shape
  err = np.linalg.norm(ours - ref) / np.linalg.norm(ref)
  assert err < 2e-4, err
  assert engine.runner.model.layers[0].linears["self_attn.q_proj"].format != FLOAT


def greedy_decode_logits(engine, prompt: list[int], **params) -> tuple[list[int], np.ndarray]:
  """Greedy-decode 6 tokens after `prompt`: (the tokens, each decode step's logits `[5, V]`)."""
  from tinyvllm import SamplingParams
  seen, execute = [], engine.runner.execute
  def spy(decodes, prefills=(), verifies=(), **kw):
    out = execute(decodes, prefills, verifies, **kw)
    if len(decodes): seen.append(out[0][0])
    return out
  engine.runner.execute = spy
  engine.add_request("0", {"prompt_token_ids": prompt}, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, **params))
  done = []
  while engine.has_unfinished_requests(): done += [o for o in engine.step() if o.finished]
  return list(done[0].outputs[0].token_ids), np.stack(seen)


@pytest.mark.parametrize("backend", ["portable", "cpu"])
def test_decode_steps_equal_the_dequantized_checkpoint(kquant_gguf, backend, monkeypatch):
  """Greedy decode steps (the C backend's fused layer runs its GEMV over the packed and 8-bit parts, x rounded to 16
  bits) against the float32 checkpoint reading the same tokens. Measured 6e-5 on both backends with x rounded per run
  of 32 (the decode passes sum in another order than the reference's prefill; x's 16-bit rounding adds at most 2^-16
  of the largest input sharing its scale per product), 1.3e-4 with the k-quants' x rounded per 256; the tolerance, 1e-3, still fails a wrong group scale or high bit, which moves logits by whole percents."""
  from conftest import our_prefill_logits
  from tinyvllm.engine.llm_engine import LLMEngine
  from tinyvllm.kernels import cpu_layer
  fused = []
  layer = cpu_layer.decoder_layer
  monkeypatch.setattr(cpu_layer, "decoder_layer", lambda *a, **kw: fused.append(a[0].shape[0]) or layer(*a, **kw))
  prompt = np.random.default_rng(4).integers(2, V, 20).tolist()
  engine = LLMEngine.from_kwargs(str(kquant_gguf), kernel_backend=backend, block_size=8, num_kv_blocks=64)
  tokens, ours = greedy_decode_logits(engine, prompt)
  assert len(tokens) == 6 and len(ours) == 5   # the first token comes from the prefill, then 5 decode steps
  ref = our_prefill_logits(kquant_gguf, prompt + tokens[:-1], "portable", quantization="none")[len(prompt):]
  err = np.linalg.norm(ours - ref) / np.linalg.norm(ref)
  assert err < 1e-3, err
  assert [int(np.argmax(r)) for r in ours] == tokens[1:]
  if backend == "cpu": assert 1 in fused   # a one-token pass went through the fused C layer


def test_quantizing_at_load_keeps_the_converted_tables(kquant_gguf, monkeypatch):
  """quantization="int4" reads the whole checkpoint into a plain dict first, its k-quant tables converted (a slice of
  rows at a time, into pages a CPU tensor then takes as they are: host_memory.py). The loader hands each layer's
  checkpoint pages back to the OS once it is on the device; that must leave those pages alone, or the device's
  weights read as zeros (every greedy token of a 1B Q4_K_M came out as token 0)."""
  from tinyvllm.kernels import make_kernels
  from tinyvllm.model.llama import Llama
  from tinyvllm.model.weights import load_checkpoint
  monkeypatch.setattr(blocks, "ROWS_AT_ONCE", 8 * H)   # every table converts in slices
  plain, int4 = (Llama(c.config, c.tensors, "float32", "CPU", make_kernels("portable", "CPU"), 128)
                 for c in (load_checkpoint(kquant_gguf, q) for q in (None, "int4")))
  pairs = [(lw, b.linears[name]) for a, b in zip(plain.layers, int4.layers) for name, lw in a.linears.items()
           if lw.format == PACKED and b.linears[name].format == PACKED] + [(plain.embed_tokens, int4.embed_tokens)]
  assert len(pairs) >= 5
  for a, b in pairs:
    for part in ("weight", "scales"):
      want = getattr(a, part).numpy()
      assert want.any()
      np.testing.assert_array_equal(getattr(b, part).numpy(), want)


def test_cpu_layer_equal_for_any_thread_count(kquant_gguf):
  """The fused C layer over mixed layouts (layer 0: q/k beside a Q6_K v, split by cost; gate in Q5_0 beside up in Q5_1,
  whose products each thread takes for the units it computed) gives bitwise the same tokens and logprobs on 1, 2 and 3
  threads: a row that no thread computes would not be (each thread count leaves out different rows)."""
  from tinyvllm import LLM, SamplingParams
  rng = np.random.default_rng(3)
  prompts = [{"prompt_token_ids": rng.integers(2, V, n).tolist()} for n in (3, 40, 17)]
  params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
  results = {}
  for threads in (1, 2, 3):
    llm = LLM(str(kquant_gguf), kernel_backend="cpu", num_threads=threads, block_size=8, num_kv_blocks=64)
    try:
      outs = llm.generate(prompts, params, use_tqdm=False)
      results[threads] = [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs]) for o in outs]
    finally:
      llm.shutdown()
  assert all(len(r[0]) == 8 for r in results[1])
  assert results[2] == results[1] and results[3] == results[1]


@pytest.mark.parametrize("backend", ["portable", "metal"])
def test_gpu_decode_steps_equal_the_dequantized_checkpoint(kquant_gguf, backend):
  """A GPU's decode steps (the emulated METAL device; portable is what CUDA runs): every projection is our GEMV reading
  the packed codes (kernels/gemv.py), q/k/v stored apart (layer 0: Q4_K, Q4_K, Q6_K) a RoPE-writing GEMV each, gate and
  up apart (Q5_0, Q5_1) the up GEMV gated by the gate's. Greedy tokens equal the float32 checkpoint's argmax, each
  decode step's logits within 1e-4 of its logits at that position (measured 2-3e-6: float32 sums in another order)."""
  from tinygrad.helpers import Context
  from conftest import our_prefill_logits
  from test_cuda_compile import captured_programs
  from test_replay import DEVICES
  from tinyvllm.engine.llm_engine import LLMEngine
  if "METAL" not in DEVICES: pytest.skip("no METAL device here (TINYVLLM_EMULATE_METAL=0)")
  prompt = np.random.default_rng(4).integers(2, V, 20).tolist()
  with Context(DEV="METAL"):
    engine = LLMEngine.from_kwargs(str(kquant_gguf), kernel_backend=backend, dtype="float32", block_size=8, num_kv_blocks=64)
    tokens, ours = greedy_decode_logits(engine, prompt, logprobs=1)   # logprobs: the step hands its logits back
    names = {p.arg.name for p in captured_programs(engine)}
  for kernel in ("gemv_packed_norm_ropeq", "gemv_packed_norm_ropev", "gemv_packed_norm_rope_", "gemv_packed_norm_glu_gate", "gemv_packed_res"):
    assert any(n.startswith(kernel) for n in names), (kernel, sorted(names))
  ref = our_prefill_logits(kquant_gguf, prompt + tokens[:-1], "portable", quantization="none")[len(prompt):]
  assert ours.shape == ref.shape and [int(np.argmax(r)) for r in ours] == tokens[1:]
  err = np.linalg.norm(ours - ref) / np.linalg.norm(ref)
  assert err < 1e-4, err
