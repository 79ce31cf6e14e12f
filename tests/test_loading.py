"""Loading weights onto the device: every copy-in reads a writable host view, as a GPU's copy-in needs, and the host
never holds a second copy of the model while it loads.

tinygrad's CUDA allocator copies a tensor in by taking the address of its source view (`mv_address`), which a
read-only view refuses: `LLM(path)` on DEV=CUDA failed with "underlying buffer is not writable" on the weights mapped
from the checkpoint. The CPU device copies differently, so the tests here apply CUDA's rule to every view tinygrad
reads a numpy array through (NpyAllocator._as_buffer)."""
from __future__ import annotations
import json, os, subprocess, sys
import numpy as np
import pytest
from conftest import make_tiny_llama


@pytest.fixture
def cuda_copy_in_rule(monkeypatch):
  """Every host view tinygrad copies a numpy array from must be writable, as CUDAAllocator._copyin requires; returns
  the bytes of each view checked."""
  from tinygrad.helpers import mv_address
  from tinygrad.runtime.ops_npy import NpyAllocator
  from tinyvllm.model.llama import Uploader
  monkeypatch.setattr(Uploader, "lends_host_memory", staticmethod(lambda device: False))   # copy in as a GPU does
  checked, as_buffer = [], NpyAllocator._as_buffer
  def writable_only(self, src):
    view = as_buffer(self, src)
    mv_address(view)   # TypeError: underlying buffer is not writable, as on CUDA
    checked.append(view.nbytes)
    return view
  monkeypatch.setattr(NpyAllocator, "_as_buffer", writable_only)
  return checked


def _load(path, dtype: str, quantization=None):
  from tinyvllm.kernels import make_kernels
  from tinyvllm.model.llama import Llama
  from tinyvllm.model.weights import load_checkpoint
  ckpt = load_checkpoint(path, quantization)
  return Llama(ckpt.config, ckpt.tensors, dtype, "CPU", make_kernels("portable", "CPU"), 128), ckpt


@pytest.mark.parametrize("stored,dtype", [("float32", "float32"), ("float16", "float16"), ("bfloat16", "float32")])
def test_safetensors_upload_from_writable_views(tmp_path, cuda_copy_in_rule, stored, dtype):
  """A float16 checkpoint loaded as float16 hands the map's own bytes to the device (no conversion, no copy): the
  case that failed on CUDA."""
  path = make_tiny_llama(tmp_path / "m", dtype=stored)
  model, ckpt = _load(path, dtype)
  assert sum(cuda_copy_in_rule) >= sum(t.nbytes() for layer in model.layers for t in layer.tensors())
  ref = ckpt.tensors["model.layers.1.mlp.down_proj.weight"].astype(np.float32)
  np.testing.assert_array_equal(model.layers[1].weights["mlp.down_proj.weight"].numpy().astype(np.float32), ref.astype(dtype))


def test_gguf_and_mlx_upload_from_writable_views(tmp_path, tiny_model, cuda_copy_in_rule):
  from test_quant import write_tiny_q4_gguf
  from tinyvllm.quantize import quantize_checkpoint
  _load(write_tiny_q4_gguf(tmp_path / "tiny.gguf", np.random.default_rng(3)), "float32")   # F32 tensors are views of the map
  quantize_checkpoint(str(tiny_model), tmp_path / "mlx4", 32, log=lambda m: None)
  _load(tmp_path / "mlx4", "float16")
  assert len(cuda_copy_in_rule) > 20


CHILD = r"""
import json, sys, threading, time
def rss(): return int(open("/proc/self/statm").read().split()[1]) * 4096
def rss_file(): return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("RssFile:"))
from tinygrad.helpers import GlobalCounters
from tinyvllm.kernels import make_kernels
from tinyvllm.model.llama import Llama
from tinyvllm.model.weights import load_checkpoint
base, base_file, peak, done = rss(), rss_file(), [0], []
def watch():
  while not done: peak[0] = max(peak[0], rss()); time.sleep(0.001)
watcher = threading.Thread(target=watch); watcher.start()
ckpt = load_checkpoint(sys.argv[1], sys.argv[3] if len(sys.argv) > 3 else None)
model = Llama(ckpt.config, ckpt.tensors, sys.argv[2], "CPU", make_kernels("portable", "CPU"), 128)
done.append(1); watcher.join()
# the checkpoint is still open: its map's pages still in the process are what the release missed
print(json.dumps({"peak": peak[0] - base, "device": GlobalCounters.mem_used, "file_pages": rss_file() - base_file}))
"""


@pytest.mark.parametrize("dtype,stored", [("float32", "safetensors"), ("float16", "safetensors"), ("float32", "gguf"),
                                          ("float32", "safetensors-int4"), ("float32", "gguf-int4"),
                                          ("float16", "bf16-safetensors"), ("float32", "bf16-safetensors-int4")])
def test_loading_holds_one_copy_of_the_weights(tmp_path_factory, dtype, stored):
  """Peak host memory while loading (the CPU device's buffers are host memory) stays within the device's bytes plus a
  layer or two in flight: the tensors go to the device a layer at a time and the checkpoint's pages are released as
  they are. Loading everything first, then copying, peaked at 2.7x the device bytes on this model. A GGUF's Q8_0
  linears stay 8-bit, so its file is as big as what goes to the device: every page of it kept (numpy's views of the
  map end in a memoryview, which the release missed) peaked at 1.8x on a 1B Q4_K_M. Quantizing to INT4 while loading
  reads every float weight once: its pages must go as it is quantized (the whole float checkpoint stayed resident
  before, 5.7x the INT4 model's bytes on a 1B), and 8-bit tables are dequantized a slice at a time (all at once,
  a 1B Q8_0 file peaked at 8.5 GB). A bf16 checkpoint (the hub's usual) is widened a slice at a time as it is read:
  widened whole up front, it sat in memory as float32 (2x a float16 model's bytes, 6x its INT4 bytes)."""
  name = "loading-mid-bf16" if stored.startswith("bf16") else "loading-mid"
  path = tmp_path_factory.getbasetemp() / name
  if not (path / "model.safetensors").exists():
    make_tiny_llama(path, hidden_size=512, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
                    dtype="bfloat16" if stored.startswith("bf16") else "float32")
  if stored.startswith("gguf"):
    from test_weights import GGUF_TYPES, write_gguf
    if not (path.parent / "loading-mid.gguf").exists():
      write_gguf(path, path.parent / "loading-mid.gguf", {k: "Q8_0" for k in GGUF_TYPES})
    path = path.parent / "loading-mid.gguf"
  args = [str(path), dtype] + (["int4"] if stored.endswith("-int4") else [])
  r = subprocess.run([sys.executable, "-c", CHILD, *args], capture_output=True, text=True, timeout=300,
                     env={**os.environ, "DEV": "CPU"})
  assert r.returncode == 0, r.stderr[-2000:]
  got = json.loads(r.stdout.splitlines()[-1])
  itemsize = 4 if dtype == "float32" else 2
  layer = itemsize * (512 * (512 + 2 * 128) + 512 * 512 + 3 * 512 * 2048)
  # one layer being converted and one on its way to the device, and 64 MiB for what Python and tinygrad allocate
  assert got["peak"] <= got["device"] + 2 * layer + (64 << 20), got
  size = sum(f.stat().st_size for f in ([path] if path.is_file() else path.glob("*.safetensors")))
  assert got["file_pages"] < size / 10, (got, size)   # the pages read were handed back (shared libraries are few)


def test_cpu_weights_are_lent_host_memory(tmp_path):
  """On the CPU device every weight's buffer is memory of our own (host_memory.py), not tinygrad's allocator's:
  loading schedules nothing and copies an array at most once. (Their values are checked by the tests above.)"""
  from tinyvllm.host_memory import HostPages
  from test_quant import write_tiny_q4_gguf
  for path in (make_tiny_llama(tmp_path / "m"), write_tiny_q4_gguf(tmp_path / "tiny.gguf", np.random.default_rng(4))):
    model, _ = _load(path, "float32")
    tensors = [t for layer in model.layers for t in layer.tensors()] + [model.norm]
    assert tensors and all(isinstance(getattr(t.uop.buffer, "host_memory", None), HostPages) for t in tensors)
