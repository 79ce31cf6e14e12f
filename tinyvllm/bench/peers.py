"""Other engines on the same model, prompt lengths, batch sizes and step counts (random-token prompts), so their
speed can be read as a ratio.

  transformers   HF transformers on torch, the model called step by step with its KV cache (eager): on the CPU in
                 float32 (a GGUF is dequantized by transformers' loader) on every core; on a GPU benchmark on
                 torch's GPU (CUDA, or MPS on a Mac) in the dtype tinyvllm runs.
  transformers compiled  the same model with a static KV cache and its decode step under
                 torch.compile(mode="reduce-overhead"), CUDA graphs underneath on NVIDIA: the gpt-fast recipe, the
                 strong GPU peer (the first steps compile; the timed ones replay).
  llama.cpp      llama-cpp-python on a GGUF file (the default model is the original Q4_1 GGUF); several
                 sequences decode together in one llama_batch; every core.
  llama.cpp F32  the same GGUF with every tensor dequantized to F32 (written once into the cache): the weights
                 tinyvllm runs in float32, so the fp32 comparison is like for like.
Each peer is optional: an import failure turns into a note, never an error.
"""
from __future__ import annotations
import inspect, os, time
from pathlib import Path
import numpy as np
from tinyvllm.bench.runs import random_ids

PEERS = ("hf", "hf-compile", "llamacpp", "llamacpp-f32")
PEER_NAMES = {"hf": "transformers", "hf-compile": "transformers compiled", "llamacpp": "llama.cpp", "llamacpp-f32": "llama.cpp F32"}
DEFAULT_PEERS = {"CPU": "hf,llamacpp", "GPU": "hf,hf-compile"}   # by where tinyvllm runs (llama-cpp-python here is a CPU build)


def torch_device(tinygrad_device: str) -> str:
  """Where a torch peer runs beside tinyvllm on `tinygrad_device`: the same GPU when torch sees it, else the CPU."""
  import torch
  kind = tinygrad_device.split(":")[0]
  if kind in ("CUDA", "NV", "AMD") and torch.cuda.is_available(): return "cuda"
  if kind == "METAL" and torch.backends.mps.is_available(): return "mps"
  return "cpu"


class PeerUnavailable(RuntimeError):
  """The peer is not installed or cannot run this model; the message says why."""


class HFPeer:
  name = "transformers"

  def __init__(self, model_path: Path, threads: int | None = None, device: str = "cpu", dtype: str = "float32"):
    try:
      import torch
      from transformers import AutoModelForCausalLM
    except ImportError as e:
      raise PeerUnavailable(f"transformers/torch not installed ({e.name}); pip install torch transformers") from None
    self.torch, self.device = torch, device
    if threads: torch.set_num_threads(threads)
    kw = dict(dtype=getattr(torch, dtype))
    if model_path.is_file(): self.model = AutoModelForCausalLM.from_pretrained(model_path.parent, gguf_file=model_path.name, **kw)
    else: self.model = AutoModelForCausalLM.from_pretrained(model_path, **kw)
    self.model.to(device).eval()
    # transformers renamed past_key_values to cache (5.24 warns, 5.40 drops the old name)
    self.cache_kw = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"
    self.vocab = self.model.config.vocab_size
    self.precision = dtype + ("" if device == "cpu" else f" on torch {device}")
    self.threads = torch.get_num_threads()

  def sync(self) -> None:
    """Wait for the GPU (its work is queued asynchronously): before reading a clock."""
    if self.device == "cuda": self.torch.cuda.synchronize()
    elif self.device == "mps": self.torch.mps.synchronize()

  def ids(self, rng, shape):
    return self.torch.tensor(random_ids(rng, self.vocab, shape), device=self.device)

  def decode(self, batch: int, context: int, steps: int, warmup: int, rng) -> dict:
    torch = self.torch
    ids = self.ids(rng, (batch, context))
    with torch.no_grad():
      out = self.model(ids, use_cache=True, logits_to_keep=1)
      past, nxt = out[self.cache_kw], out.logits[:, -1:].argmax(-1)
      for i in range(warmup + steps):
        if i == warmup: self.sync(); t = time.perf_counter()
        out = self.model(nxt, use_cache=True, **{self.cache_kw: past})
        past, nxt = out[self.cache_kw], out.logits[:, -1:].argmax(-1)
      self.sync()
    dt = time.perf_counter() - t
    return {"tokens_per_s": batch * steps / dt, "ms_per_step": 1e3 * dt / steps}

  def prefill(self, prompt_len: int, rng) -> dict:
    torch = self.torch
    with torch.no_grad():
      for _ in range(2):
        ids = self.ids(rng, (1, prompt_len))
        self.sync()
        t = time.perf_counter()
        self.model(ids, use_cache=True, logits_to_keep=1)   # as generate() does: logits of the last position only
        self.sync()
        dt = time.perf_counter() - t
    return {"tokens_per_s": prompt_len / dt, "ms_per_step": 1e3 * dt}


class HFCompiledPeer(HFPeer):
  """The gpt-fast recipe on HF's model: a static KV cache (fixed shapes), the prompt read eagerly, then each decode step
  through torch.compile(mode="reduce-overhead"), which on NVIDIA replays CUDA graphs. The warm-up steps compile and
  record; the timed ones replay. Prefill is HF's eager pass."""
  name = "transformers compiled"

  def __init__(self, model_path: Path, threads: int | None = None, device: str = "cpu", dtype: str = "float32",
               mode: str = "reduce-overhead"):
    super().__init__(model_path, threads, device, dtype)
    self.precision += f", torch.compile({mode}), static cache"
    model, cache_kw = self.model, self.cache_kw
    def step(ids, cache, position):
      return model(ids, cache_position=position, use_cache=True, **{cache_kw: cache}).logits[:, -1]
    self.step = self.torch.compile(step, mode=mode, fullgraph=True)

  def static_cache(self, batch: int, length: int):
    from transformers import StaticCache
    try: return StaticCache(config=self.model.config, max_cache_len=length)   # transformers 5: sized at the first update
    except TypeError:   # transformers 4.x
      return StaticCache(config=self.model.config, max_batch_size=batch, max_cache_len=length, device=self.device,
                         dtype=self.model.dtype)

  def decode(self, batch: int, context: int, steps: int, warmup: int, rng) -> dict:
    torch = self.torch
    cache = self.static_cache(batch, context + warmup + steps + 1)
    ids = self.ids(rng, (batch, context))
    with torch.no_grad():
      out = self.model(ids, cache_position=torch.arange(context, device=self.device), use_cache=True, logits_to_keep=1,
                       **{self.cache_kw: cache})
      nxt = out.logits[:, -1:].argmax(-1)
      for i in range(warmup + steps):
        if i == warmup: self.sync(); t = time.perf_counter()
        nxt = self.step(nxt, cache, torch.tensor([context + i], device=self.device)).argmax(-1, keepdim=True)
      self.sync()
    dt = time.perf_counter() - t
    return {"tokens_per_s": batch * steps / dt, "ms_per_step": 1e3 * dt / steps}


class LlamaCppPeer:
  name = "llama.cpp"

  def __init__(self, gguf: Path, max_batch: int, max_context: int, threads: int | None = None):
    try:
      import llama_cpp
    except ImportError:
      raise PeerUnavailable("llama-cpp-python not installed; pip install llama-cpp-python (compiles llama.cpp, ~12 min)") from None
    if not (gguf.is_file() and gguf.suffix == ".gguf"):
      raise PeerUnavailable(f"llama.cpp needs a GGUF file and the model is {gguf}; pass --llamacpp-gguf")
    self.lc = llama_cpp
    self.threads = threads or os.cpu_count() or 1
    self.n_batch = 512
    # the high-level object loads the model quietly; decoding goes through a context of our own that holds
    # `max_batch` sequences in one KV cache (the high-level API runs one sequence)
    self.llm = llama_cpp.Llama(str(gguf), n_ctx=64, n_threads=self.threads, verbose=False)
    params = llama_cpp.llama_context_default_params()
    params.n_ctx = max_batch * (max_context + 8)
    params.n_batch = params.n_ubatch = self.n_batch
    params.n_seq_max, params.kv_unified = max_batch, True
    params.n_threads = params.n_threads_batch = self.threads
    self.ctx = llama_cpp.llama_init_from_model(self.llm.model, params)
    if not self.ctx: raise PeerUnavailable("llama.cpp could not create a context")
    self.vocab = self.llm.n_vocab()
    self.batch = llama_cpp.llama_batch_init(max(self.n_batch, max_batch), 0, max_batch)
    types = {t.name for t in _gguf_tensor_types(gguf)}
    self.precision = "+".join(sorted(types - {"F32"})) or "F32"
    self._clear()   # one short run first: llama.cpp's thread pool is slow on its first steps
    self._prefill(np.zeros((1, 16), np.int64))

  def close(self) -> None:
    if self.batch is not None: self.lc.llama_batch_free(self.batch)
    if self.ctx: self.lc.llama_free(self.ctx)
    self.batch, self.ctx = None, None
    self.llm.close()

  def _decode(self, tokens: list[tuple[int, int, int, bool]]) -> None:
    """tokens: (token id, position, sequence id, wants logits)."""
    b = self.batch
    for i, (tok, pos, seq, logits) in enumerate(tokens):
      b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, logits
      b.seq_id[i][0] = seq
    b.n_tokens = len(tokens)
    if self.lc.llama_decode(self.ctx, b) != 0: raise RuntimeError("llama_decode failed")

  def _clear(self) -> None:
    self.lc.llama_memory_clear(self.lc.llama_get_memory(self.ctx), True)

  def _prefill(self, prompts: np.ndarray) -> None:
    flat = [(int(t), p, s, p == prompts.shape[1] - 1) for s in range(prompts.shape[0]) for p, t in enumerate(prompts[s])]
    for i in range(0, len(flat), self.n_batch): self._decode(flat[i:i + self.n_batch])

  def _argmax(self, row: int) -> int:
    ptr = self.lc.llama_get_logits_ith(self.ctx, row)
    return int(np.argmax(np.ctypeslib.as_array(ptr, shape=(self.vocab,))))

  def decode(self, batch: int, context: int, steps: int, warmup: int, rng) -> dict:
    self._clear()
    prompts = random_ids(rng, self.vocab, (batch, context))
    self._prefill(prompts)
    nxt = [int(t) for t in prompts[:, -1]]
    for i in range(warmup + steps):
      if i == warmup: t = time.perf_counter()
      self._decode([(nxt[s], context + i, s, True) for s in range(batch)])
      nxt = [self._argmax(s) for s in range(batch)]
    dt = time.perf_counter() - t
    return {"tokens_per_s": batch * steps / dt, "ms_per_step": 1e3 * dt / steps}

  def prefill(self, prompt_len: int, rng) -> dict:
    for _ in range(2):
      self._clear()
      prompts = random_ids(rng, self.vocab, (1, prompt_len))
      t = time.perf_counter()
      self._prefill(prompts)
      dt = time.perf_counter() - t
    return {"tokens_per_s": prompt_len / dt, "ms_per_step": 1e3 * dt}


def _gguf_tensor_types(path: Path):
  from gguf import GGUFReader
  return [t.tensor_type for t in GGUFReader(path).tensors]


def load_peer(key: str, model_path: Path, llamacpp_gguf: Path | None, max_batch: int, max_context: int,
              threads: int | None = None, device: str = "cpu", dtype: str = "float32"):
  """`device`/`dtype`: where and in what the torch peers run (torch_device(); float32 on the CPU, tinyvllm's dtype on a GPU)."""
  if key == "hf": return HFPeer(model_path, threads, device, dtype)
  if key == "hf-compile": return HFCompiledPeer(model_path, threads, device, dtype)
  if key in ("llamacpp", "llamacpp-f32"):
    gguf = llamacpp_gguf or model_path
    if key == "llamacpp-f32" and gguf.suffix == ".gguf":
      if {t.name for t in _gguf_tensor_types(gguf)} <= {"F32"}: raise PeerUnavailable(f"{gguf.name} is already F32: see llama.cpp")
      gguf = float32_gguf(gguf)
    return LlamaCppPeer(gguf, max_batch, max_context, threads)
  raise ValueError(f"unknown peer {key!r}; choose from {', '.join(PEERS)}")


def float32_gguf(src: Path) -> Path:
  """A copy of a quantized GGUF with every tensor dequantized to F32 (same metadata, llama.cpp's own row order), so
  llama.cpp can run the exact weights tinyvllm runs in float32. Written once into tinyvllm's cache."""
  from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
  from gguf.quants import dequantize
  from tinyvllm.model.fetch import cache_dir
  dest = cache_dir() / "bench" / f"{src.stem}.F32.gguf"
  if dest.exists(): return dest
  dest.parent.mkdir(parents=True, exist_ok=True)
  reader = GGUFReader(src)
  part = dest.with_name(dest.name + ".part")
  writer = GGUFWriter(part, str(reader.fields["general.architecture"].contents()))
  for key, f in reader.fields.items():
    if key.startswith("GGUF.") or key == "general.architecture": continue
    if key == "general.file_type": writer.add_file_type(0); continue        # ALL_F32
    sub = f.types[1] if f.types[0] == GGUFValueType.ARRAY else None
    writer.add_key_value(key, f.contents(), f.types[0], sub)
  for t in reader.tensors:
    arr = dequantize(t.data, t.tensor_type).astype(np.float32)
    writer.add_tensor(t.name, arr.reshape(tuple(int(x) for x in reversed(t.shape))), raw_dtype=GGMLQuantizationType.F32)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  part.replace(dest)
  return dest
