"""Shared fixtures: tiny random checkpoints (Llama and the other families) in HF layout, written by transformers, with a tokenizer."""
from __future__ import annotations
import contextlib, glob, json, math, os
from pathlib import Path
import pytest

os.environ.setdefault("DEV", "CPU")   # the whole suite runs on tinygrad's CPU device unless told otherwise

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TRAIN_TEXT = ["The quick brown fox jumps over the lazy dog.", "Hello world, hello tinyvllm!", "def f(x): return x * 2",
              "Paged attention reads keys and values block by block.", "12345 67890 3.14159", "Ünïcödé ëñçödïng 日本語"] * 20

# name -> LlamaConfig overrides. Each covers a feature the model must get right.
TINY_CONFIGS = {
  "gqa": dict(num_attention_heads=4, num_key_value_heads=2),
  "mha": dict(num_attention_heads=4, num_key_value_heads=4),
  "tied": dict(num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True),
  "llama3": dict(num_attention_heads=4, num_key_value_heads=2, rope_theta=500000.0, max_position_embeddings=512,
                 rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 64}),
  "linear_rope": dict(num_attention_heads=4, num_key_value_heads=2, rope_scaling={"rope_type": "linear", "factor": 4.0}),
  "head_dim": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=24),   # head_dim != hidden / heads
  "odd_ffn": dict(num_attention_heads=4, num_key_value_heads=2, intermediate_size=18),   # not whole runs of 4 (cpu_layer)
  "metal": dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=64),  # shapes the Metal kernels take
  # one layer, so the KV cache a backend writes is the same bits whatever its attention computes; long contexts
  "long": dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=2, head_dim=64, num_hidden_layers=1,
               max_position_embeddings=2048),
}


def write_tokenizer(path: Path) -> int:
  """A small byte-level BPE trained here, with chat special tokens; returns its vocabulary size."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  specials = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]
  tok.train_from_iterator(TRAIN_TEXT, trainers.BpeTrainer(vocab_size=384, special_tokens=specials,
                                                          initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  tok.save(str(path / "tokenizer.json"))
  (path / "tokenizer_config.json").write_text(json.dumps({
    "bos_token": "<s>", "eos_token": "</s>", "chat_template": CHAT_TEMPLATE, "add_bos_token": False}))
  return tok.get_vocab_size()


def _nvrtc() -> str | None:
  """nvrtc's library from the `nvidia-cuda-nvrtc` wheel of the test extra (Linux x86_64): tinygrad compiles CUDA with it."""
  try: import nvidia
  except ImportError: return None
  found = sorted(p for base in nvidia.__path__ for p in glob.glob(os.path.join(base, "*", "lib", "libnvrtc.so*")) if "builtins" not in p)
  return found[-1] if found else None


NVRTC = os.environ.get("NVRTC_PATH") or _nvrtc()


@pytest.fixture(scope="session", autouse=True)
def lowered_programs():
  """The engine's disk cache of lowered kernels (engine/replay.py's ProgramCache) for every test, not only those that
  build an engine: a kernel one worker or subprocess lowers, the others load. Lowering is most of the suite's time."""
  from tinyvllm.engine.replay import cache_programs_on_disk
  from tinyvllm.model.fetch import cache_dir
  return cache_programs_on_disk(cache_dir() / "programs")


@pytest.fixture
def empty_program_cache(tmp_path, lowered_programs):
  """The program cache emptied and pointed at a new directory for a test that needs tinygrad to lower its kernels
  (the suite's cache would hold them from an earlier run); restored after it."""
  cache = lowered_programs
  before, memory, warned = cache.directory, dict(cache), cache._warned
  dict.clear(cache)
  cache.directory, cache._warned = tmp_path / "programs", False   # its one warning is the test's to see
  yield cache
  dict.clear(cache)
  dict.update(cache, memory)
  cache.directory, cache._warned = before, warned


def make_tiny_llama(path: Path, seed: int = 0, dtype: str = "float32", **overrides) -> Path:
  return make_tiny_model(path, "llama", seed, dtype, **overrides)


def make_tiny_model(path: Path, model_type: str, seed: int = 0, dtype: str = "float32", vector_noise: float = 0.0, **overrides) -> Path:
  """A tiny random checkpoint of any family transformers knows (`model_type`: "llama", "qwen3", ...), written by it.
  `vector_noise`: add N(0, vector_noise) to every 1-D parameter (norm weights, biases), which HF initialises to ones
  or zeros: a test of biases or of Gemma's 1 + weight norms must not read zeros."""
  import torch
  from transformers import AutoConfig, AutoModelForCausalLM
  path.mkdir(parents=True, exist_ok=True)
  vocab = write_tokenizer(path)
  cfg = dict(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, rope_theta=10000.0, rms_norm_eps=1e-5,
             bos_token_id=0, eos_token_id=1)
  cfg.update(overrides)
  torch.manual_seed(seed)
  model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **cfg)).eval()
  with torch.no_grad():   # HF initialises with std 0.02: widen it so logits are far from uniform and argmax is robust
    for p in model.parameters(): p.mul_(8.0 if p.dim() > 1 else 1.0)
    for p in model.parameters():
      if p.dim() == 1 and vector_noise: p.add_(torch.randn(p.shape) * vector_noise)
  model.to(getattr(torch, dtype)).save_pretrained(path, safe_serialization=True)
  return path


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory):
  made: dict[tuple, Path] = {}
  def make(name: str = "gqa", seed: int = 0, dtype: str = "float32") -> Path:
    key = (name, seed, dtype)
    if key not in made:
      made[key] = make_tiny_llama(tmp_path_factory.mktemp(f"tiny-{name}-{seed}-{dtype}"), seed, dtype, **TINY_CONFIGS[name])
    return made[key]
  return make


@pytest.fixture(scope="session")
def tiny_model(tiny_model_factory) -> Path: return tiny_model_factory("gqa")


def our_prefill_logits(path: Path, ids: list[int], kernel_backend: str = "portable", block_size: int = 16,
                       quantization: str | None = None, kv_cache_dtype: str = "auto", return_cache: bool = False):
  """Our model's logits at every position of `ids`, read through a scattered block table (no engine). With
  `return_cache`: (logits, each layer's K/V/scales as numpy arrays in token order)."""
  import numpy as np
  from tinygrad import Device, Tensor
  from tinyvllm.kernels import AttentionGroup, make_kernels
  from tinyvllm.kernels.kv_cache import KVCacheFormat, PagedKVCache
  from tinyvllm.model.llama import Llama, ModelInputs
  from tinyvllm.model.weights import load_checkpoint
  ckpt = load_checkpoint(path, quantization)
  cfg, dev, T = ckpt.config, Device.DEFAULT, len(ids)
  model = Llama(cfg, ckpt.tensors, "float32", dev, make_kernels(kernel_backend, dev), cfg.max_position_embeddings)
  n_blocks = -(-T // block_size)
  table = np.random.default_rng(7).permutation(max(64, 2 * n_blocks))[:n_blocks].astype(np.int32)   # out of order
  fmt = KVCacheFormat.resolve(kv_cache_dtype, "float32")
  zeros = lambda shape, dtype: Tensor.zeros(*shape, dtype=dtype).contiguous().realize()
  kv = [PagedKVCache.allocate(fmt, len(table) * 2 + 64, block_size, cfg.num_key_value_heads, cfg.head_dim, zeros)
        for _ in range(cfg.num_hidden_layers)]
  pos = np.arange(T)
  i32 = lambda a: Tensor(np.asarray(a, np.int32))
  group = AttentionGroup(1, T, i32(table[None]), n_blocks, i32(pos[None]), i32([T]), i32(np.zeros(T)))
  inp = ModelInputs(i32(ids), i32(pos), i32(table[pos // block_size] * block_size + pos % block_size), [group], i32(pos))
  logits = model(inp, kv).numpy()
  if not return_cache: return logits
  slots = table[pos // block_size] * block_size + pos % block_size
  rows = lambda t: t.numpy().reshape(-1, *t.shape[2:])[slots]
  return logits, [[rows(t) for t in cache.tensors()] for cache in kv]


def launch_threads(global_size, local_size) -> int: return math.prod(global_size) * math.prod(local_size)


def largest_output(program, sink) -> int:
  """Elements of the largest buffer a lowered `program` writes (`sink`: its kernel's SINK, lowered or not): on a GPU
  a kernel's threads should follow its outputs, never a product of its loops."""
  from tinygrad.dtype import AddrSpace
  from tinygrad.uop.ops import Ops
  params = {u.arg.slot: u for u in sink.toposort() if u.op is Ops.PARAM and u.arg.addrspace is not AddrSpace.ALU}
  return max((params[s].max_numel() for s in program.arg.outs if s in params), default=1)


@contextlib.contextmanager
def serve_in_thread(app):
  """Run a FastAPI app with uvicorn on 127.0.0.1, on a free port, in a background thread; yields its base URL.
  The server (and with it the app's engine) stops when the block exits."""
  import threading, time, uvicorn
  from tinyvllm.entrypoints.openai.api_server import bind
  sock = bind("127.0.0.1", 0)
  server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
  thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
  thread.start()
  deadline = time.time() + 30
  while not server.started:
    assert thread.is_alive() and time.time() < deadline, "the server did not start"
    time.sleep(0.02)
  try:
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
  finally:
    server.should_exit = True
    thread.join(30)
