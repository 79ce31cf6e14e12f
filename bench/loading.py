"""Loading at real size: load time and peak host memory of Llama-3.2-1B- and Llama-3.1-8B-shaped checkpoints.

  python bench/loading.py [--shapes 1b,8b] [--formats f16,int4,bf16,bf16-int4,mlx8,mlx6,mlx4] [--dir DIR] [--json out.json]

Each checkpoint is written once into DIR (random float16 weights, one safetensors file streamed tensor by tensor, with a
word-level tokenizer of the model's vocabulary; 2.5 and 16 GB), then loaded in a fresh process by the engine as a user
would (`LLMEngine`, a small KV cache) on the device tinygrad picks (DEV). A thread samples the process's resident
memory every millisecond while it loads. Formats:
  f16       the float16 checkpoint as float16, on the portable kernels
  int4      the same, quantized to 4 bits while loading (quantization="int4")
  bf16      the same weights written as bfloat16 (the hub's usual dtype), loaded as float16 (a GPU's dtype)
  bf16-int4 the bfloat16 checkpoint quantized to 4 bits while loading
  mlxN      mlx-lm's own `convert -q --q-bits N --q-group-size 64` of it (written once; needs the mlx-lm package)
Columns:
  device    tinygrad's count of the device memory: the weights and buffers (on the CPU device not the KV cache,
            mapped by the engine and committed as it fills; lent weights counted: host_memory.py)
  peak RSS  the highest resident memory seen while loading, above the process's before it (on the CPU device the
            device's memory is host memory, so it is in here; on a GPU it is not)
  peak/dev  peak RSS over device bytes: 1.0 means no host copy beyond the device's own (target on the CPU: <= 1.1)
On a 24 GB machine the 8B row is the issue-23 check: its 16 GB must load without a second host copy.
"""
from __future__ import annotations
import argparse, json, os, shutil, struct, subprocess, sys, time
from pathlib import Path
import numpy as np
from real_size import SHAPES, measure_load, write_word_tokenizer

def _normal_rows():
  """A seeded source of normal rows (`normal(shape, std, dtype)`, drawn in float32 and rounded to `dtype`): torch on an
  NVIDIA GPU where there is one (numpy's generator on one core took minutes for the 8B's 8 billion weights; rounded to
  float16 there too, so half the bytes cross to the host and numpy converts none), else numpy's."""
  try:
    import torch
    if torch.cuda.is_available():
      gen = torch.Generator(device="cuda").manual_seed(0)
      to_torch = {np.float16: torch.float16, np.float32: torch.float32}
      return lambda shape, std, dtype: (torch.randn(shape, generator=gen, device="cuda", dtype=torch.float32) * std).to(to_torch[dtype]).cpu().numpy()
  except Exception: pass   # no torch, or a CUDA that does not start: numpy's
  rng = np.random.default_rng(0)
  return lambda shape, std, dtype: (rng.standard_normal(shape, np.float32) * std).astype(dtype, copy=False)


def write_checkpoint(path: Path, shape: str, dtype: str = "F16") -> Path:
  """A random Llama of `shape` in HF layout, float16 or bfloat16 (`dtype`: "F16" or "BF16"), written tensor by tensor
  (never the whole model in memory)."""
  h, L, H, KVH, inter, V, tied = SHAPES[shape]
  if (path / "model.safetensors").exists(): return path
  path.mkdir(parents=True, exist_ok=True)
  D = h // H
  shapes = {"model.embed_tokens.weight": (V, h), "model.norm.weight": (h,)}
  if not tied: shapes["lm_head.weight"] = (V, h)
  for i in range(L):
    p = f"model.layers.{i}."
    shapes |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
               p + "self_attn.q_proj.weight": (H * D, h), p + "self_attn.k_proj.weight": (KVH * D, h),
               p + "self_attn.v_proj.weight": (KVH * D, h), p + "self_attn.o_proj.weight": (h, H * D),
               p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h), p + "mlp.down_proj.weight": (h, inter)}
  header, offset = {}, 0
  for name, s in shapes.items():
    n = int(np.prod(s)) * 2
    header[name] = {"dtype": dtype, "shape": list(s), "data_offsets": [offset, offset + n]}
    offset += n
  raw = json.dumps(header).encode()
  raw += b" " * (-len(raw) % 8)
  normal = _normal_rows()
  part = path / "model.safetensors.part"
  with open(part, "wb") as f:
    f.write(struct.pack("<Q", len(raw)) + raw)
    for name, s in shapes.items():
      for start in range(0, s[0] if len(s) == 2 else 1, 4096):   # 4096 rows at a time: a few tens of MB
        kind = np.float16 if dtype == "F16" else np.float32   # bfloat16's bits are cut from float32 below
        rows = np.ones(s, kind) if len(s) == 1 else normal((min(4096, s[0] - start), s[1]), 0.02, kind)
        f.write((rows if dtype == "F16" else bfloat16_bits(rows)).tobytes())
  part.rename(path / "model.safetensors")
  (path / "config.json").write_text(json.dumps({
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": h, "num_hidden_layers": L,
    "num_attention_heads": H, "num_key_value_heads": KVH, "intermediate_size": inter, "vocab_size": V,
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": tied,
    "torch_dtype": {"F16": "float16", "BF16": "bfloat16"}[dtype], "bos_token_id": 0, "eos_token_id": 1}))
  write_word_tokenizer(path, V)
  return path


def bfloat16_bits(x: np.ndarray) -> np.ndarray:
  """float32 -> bfloat16 bits (uint16), rounded to nearest even."""
  bits = x.astype(np.float32).view(np.uint32)
  return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


FORMATS = {"f16": 'dtype="float16", kernel_backend="portable"', "int4": 'quantization="int4"',
           "bf16": 'dtype="float16", kernel_backend="portable"', "bf16-int4": 'quantization="int4"',
           **{f"mlx{bits}": "" for bits in (8, 6, 5, 4, 3)}}   # the engine's arguments besides a small KV cache


def mlx_checkpoint(f16: Path, bits: int) -> Path:
  """mlx-lm's own quantization of the float16 checkpoint (written once, beside it)."""
  dest = f16.with_name(f16.name.replace("-f16", f"-mlx{bits}"))
  if (dest / "config.json").exists(): return dest
  part = dest.with_name(dest.name + ".part")
  shutil.rmtree(part, ignore_errors=True)
  r = subprocess.run([sys.executable, "-m", "mlx_lm", "convert", "--hf-path", str(f16), "--mlx-path", str(part),
                      "-q", "--q-bits", str(bits), "--q-group-size", "64"], capture_output=True, text=True)
  if r.returncode != 0: sys.exit(f"bench/loading.py: mlx-lm's convert failed (pip install mlx-lm):\n{r.stderr[-2000:]}")
  part.rename(dest)
  return dest


def measure(path: Path, fmt: str = "f16") -> dict:
  return measure_load(path, imports="""
from tinygrad import Device
from tinygrad.helpers import GlobalCounters
from tinyvllm.engine.llm_engine import LLMEngine""", load=f"""
engine = LLMEngine.from_kwargs(sys.argv[1], num_kv_blocks=16, max_model_len=256, {FORMATS[fmt]})
Device[engine.runner.device if isinstance(engine.runner.device, str) else engine.runner.device[0]].synchronize()""",
                      extras='{"device": Device.DEFAULT, "device_bytes": GlobalCounters.mem_used}')


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--shapes", default="1b,8b", help=f"comma-separated: {', '.join(SHAPES)}")
  ap.add_argument("--formats", default="f16", help=f"comma-separated: {', '.join(FORMATS)}")
  ap.add_argument("--dir", type=Path, default=Path(os.environ.get("TINYVLLM_CACHE", Path.home() / ".cache" / "tinyvllm")) / "bench")
  ap.add_argument("--json", type=Path, default=None)
  args = ap.parse_args()
  formats = args.formats.split(",")
  if unknown := [f for f in formats if f not in FORMATS]: ap.error(f"--formats: unknown {', '.join(unknown)} (known: {', '.join(FORMATS)})")
  from tqdm import tqdm
  rows = []
  for shape, fmt in tqdm([(s, f) for s in args.shapes.split(",") for f in formats], desc="loads", file=sys.stderr):
    t = time.perf_counter()
    bf16 = fmt.startswith("bf16")
    path = write_checkpoint(args.dir / f"llama-{shape}-{'bf16' if bf16 else 'f16'}", shape, "BF16" if bf16 else "F16")
    if fmt.startswith("mlx"): path = mlx_checkpoint(path, int(fmt[3:]))
    written = time.perf_counter() - t
    file_bytes = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    rows.append({"shape": shape, "format": fmt, "file_bytes": file_bytes, "write_seconds": written} | measure(path, fmt))
  gb = lambda b: f"{b / 1e9:.2f} GB"
  print(f"{'shape':<6}{'format':>7}{'device':>8}{'file':>10}{'device':>10}{'peak RSS':>10}{'peak/dev':>9}{'load s':>8}")
  for r in rows:
    print(f"{r['shape']:<6}{r['format']:>7}{r['device']:>8}{gb(r['file_bytes']):>10}{gb(r['device_bytes']):>10}"
          f"{gb(r['peak_rss_bytes']):>10}{r['peak_rss_bytes'] / r['device_bytes']:>9.3f}{r['load_seconds']:>8.1f}")
  if args.json: args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
  main()
