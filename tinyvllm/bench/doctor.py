"""`python -m tinyvllm.bench --doctor`: one command a Mac user runs and pastes back.

It checks the Mac path piece by piece, so a report shows where it breaks as well as how fast it runs:
  1. every .metal file compiled by the device's compiler (Apple's on a Mac; the MSL emulator elsewhere),
  2. tests/test_metal_device.py (our kernels on the device against numpy), when run from a git checkout,
  3. a short greedy generation (tok/s, and how many tokens agree with the CPU device's float32 run),
  4. a short roofline run (decode at batch 1 and 8, prefill of 128 tokens, no peers).
Each step records its result and goes on after a failure; the report names the chip, macOS and tinygrad.
"""
from __future__ import annotations
import importlib.metadata, importlib.resources, json, os, platform, re, subprocess, sys, tempfile, time, traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

PROMPT = "The capital of France is"
GEN_TOKENS = 32
ROOFLINE_ARGS = ["--runs", "decode,prefill", "--batch-sizes", "1,8", "--context-lens", "128", "--steps", "16", "--prefill-lens", "128"]


@dataclass
class Step:
  name: str
  ok: bool | None = None         # None: skipped
  summary: str = ""
  details: dict = field(default_factory=dict)


def environment() -> dict:
  from tinygrad import Device
  from tinyvllm.bench.device import machine_description
  from tinyvllm.kernels.emulator import metal_device
  dev = Device.DEFAULT
  env = {"machine": machine_description(), "macos": platform.mac_ver()[0] or None, "device": dev,
         "python": platform.python_version(), "tinygrad": _version("tinygrad"), "tinyvllm": _version("tinyvllm")}
  if dev.split(":")[0] == "METAL":
    from tinyvllm.kernels import apple_gpu
    env["gpu_family"], env["macos"] = apple_gpu(dev)
    env["emulated"] = metal_device.installed()
  return env


def _version(dist: str) -> str | None:
  try: return importlib.metadata.version(dist)
  except importlib.metadata.PackageNotFoundError: return None


def shader_files() -> list[Path]:
  root = importlib.resources.files("tinyvllm.shaders")
  return sorted(Path(str(p)) for p in root.iterdir() if p.name.endswith(".metal"))


def compile_shaders(paths: list[Path], device: str) -> Step:
  """Each file through the METAL device's compiler (Apple's MTLCompiler on a Mac), or the emulator's elsewhere."""
  on_metal = device.split(":")[0] == "METAL"
  if on_metal:
    from tinygrad import Device
    compile_one = Device["METAL"].compiler.compile
  else:
    from tinyvllm.kernels import emulator
    compile_one = lambda src: emulator.compile_source(src, "doctor.metal")   # noqa: E731
  results, failed = {}, []
  for path in paths:
    t0 = time.perf_counter()
    try:
      compile_one(path.read_text())
      results[path.name] = f"ok ({time.perf_counter() - t0:.1f} s)"
    except Exception as e:   # a compile error of any kind is the finding: keep its first lines
      results[path.name] = "FAILED: " + "\n".join(str(e).strip().splitlines()[:12])
      failed.append(path.name)
  compiler = "the METAL device's compiler" if on_metal else "the MSL emulator (not Apple's compiler: no METAL device here)"
  summary = f"{len(paths) - len(failed)}/{len(paths)} compiled by {compiler}"
  return Step("compile shaders", not failed, summary, results)


def device_tests(timeout_s: float = 3600) -> Step:
  """tests/test_metal_device.py in a pytest subprocess: present in a git checkout, not in an installed wheel."""
  test_file = Path(__file__).resolve().parents[2] / "tests" / "test_metal_device.py"
  if not test_file.exists():
    return Step("tests/test_metal_device.py", None, "skipped: run the doctor from a git checkout of tinyvllm to include them")
  cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(test_file)]
  try: r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, cwd=test_file.parents[1])
  except subprocess.TimeoutExpired:
    return Step("tests/test_metal_device.py", False, f"timed out after {timeout_s:.0f} s")
  if "No module named pytest" in r.stderr:
    return Step("tests/test_metal_device.py", None, "skipped: pytest is not installed (pip install -e '.[test]')")
  lines = r.stdout.strip().splitlines()
  tally = next((l.strip("= ") for l in reversed(lines) if re.search(r"\d+ (passed|failed|skipped|error)", l)), "")
  failures = [l for l in lines if l.startswith(("FAILED", "ERROR"))][:20]
  ok = None if r.returncode == 0 and "passed" not in tally else r.returncode == 0   # None: all skipped (no METAL device)
  return Step("tests/test_metal_device.py", ok,
              tally or f"pytest exited with {r.returncode}", {"failures": failures} | ({} if tally else {"stderr": r.stderr[-2000:]}))


GEN_CHILD = r"""
import json, sys, time
from tinygrad import Device
from tinyvllm import LLM, SamplingParams
llm = LLM(sys.argv[1], dtype=sys.argv[2], max_model_len=256)
greedy = SamplingParams(max_tokens=int(sys.argv[4]), temperature=0, ignore_eos=True)
llm.generate([sys.argv[3]], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)   # compiles and captures
t0 = time.perf_counter()
out = llm.generate([sys.argv[3]], greedy, use_tqdm=False)[0]
dt = time.perf_counter() - t0
eng = llm.llm_engine
print("RESULT " + json.dumps({"tokens": list(out.outputs[0].token_ids), "text": out.outputs[0].text, "seconds": dt,
                              "backend": eng.kernel_backend, "device": Device.DEFAULT}))
"""


def _generate(model: str, device: str, dtype: str, timeout_s: float) -> dict:
  env = {**os.environ, "DEV": device}
  r = subprocess.run([sys.executable, "-c", GEN_CHILD, model, dtype, PROMPT, str(GEN_TOKENS)], capture_output=True, text=True,
                     env=env, timeout=timeout_s)
  if r.returncode != 0: raise RuntimeError(r.stderr.strip()[-1500:])
  return json.loads(next(l for l in r.stdout.splitlines() if l.startswith("RESULT "))[7:])


def generation(model: str, device: str, timeout_s: float = 1800) -> Step:
  """Greedy tokens on this device (its default dtype), and on the CPU device in float32 as the reference: the two agree
  until the first near-tie of the logits (float16 rounds them), so the leading agreement is the number to look at."""
  try: ours = _generate(model, device, "auto", timeout_s)
  except Exception as e:
    return Step("generation", False, "FAILED: " + str(e).splitlines()[-1][:300], {"error": str(e)})
  details = {"backend": ours["backend"], "text": ours["text"], "tokens_per_s": GEN_TOKENS / ours["seconds"]}
  summary = f"{details['tokens_per_s']:.1f} tok/s, {ours['backend']} kernels"
  if device.split(":")[0] != "CPU":
    try:
      ref = _generate(model, "CPU", "float32", timeout_s)
      agree = next((i for i, (a, b) in enumerate(zip(ours["tokens"], ref["tokens"])) if a != b), len(ref["tokens"]))
      details |= {"cpu_float32_text": ref["text"], "tokens_agreeing_with_cpu": agree}
      summary += f"; first {agree}/{GEN_TOKENS} greedy tokens equal to the CPU device's float32 run"
    except Exception as e:   # the CPU device needs clang; its absence should not hide the device's own result
      details["cpu_reference_error"] = str(e)[-500:]
      summary += "; CPU reference unavailable"
  return Step("generation", True, summary, details)


def roofline(model: str | None) -> Step:
  from tinyvllm.bench.cli import main
  with tempfile.TemporaryDirectory() as tmp:
    out = Path(tmp) / "bench.json"
    argv = (["--model", model] if model else []) + ROOFLINE_ARGS + ["--no-peers", "--json", str(out)]
    try: main(argv)
    except (Exception, SystemExit) as e:
      return Step("roofline", False, f"FAILED: {e!r}"[:300], {"traceback": traceback.format_exc()[-2000:]})
    data = json.loads(out.read_text())
  rows = [{k: r.get(k) for k in ("kind", "batch_size", "context_len", "tokens_per_s", "roofline_fraction", "bandwidth_fraction",
                                  "published_bandwidth_fraction", "achieved_gbps")} for r in data["records"]]
  ceil = data.get("ceilings", {})
  summary = "; ".join(f"{r['kind']} b{r['batch_size']}: {r['tokens_per_s']:.1f} tok/s, {_pct(r['roofline_fraction'])} of roofline"
                      for r in rows)
  return Step("roofline", True, summary, {"runs": rows, "measured_bandwidth_gbps": ceil.get("bandwidth_gbps"),
                                          "published_bandwidth_gbps": ceil.get("published_gbps")})


def _pct(x) -> str: return "-" if x is None else f"{100 * x:.0f}%"


def report(env: dict, steps: list[Step]) -> str:
  lines = ["tinyvllm doctor report", "======================"]
  lines += [f"{k}: {v}" for k, v in env.items()]
  if env.get("emulated"): lines.append("NOTE: the METAL device is emulated (Linux): results show correctness, not Apple's compiler or speed")
  for s in steps:
    mark = {True: "ok  ", False: "FAIL", None: "skip"}[s.ok]
    lines.append(f"[{mark}] {s.name}: {s.summary}")
    if s.name == "compile shaders":
      for name, res in s.details.items():
        first, *rest = res.splitlines()
        lines += [f"         {name}: {first}", *(f"           {l}" for l in rest)]
    for f in s.details.get("failures", []): lines.append(f"         {f}")
    if s.name == "generation" and "text" in s.details: lines.append(f"         text: {s.details['text'][:160]!r}")
  lines.append("Paste this report into an issue at the tinyvllm repository.")
  return "\n".join(lines)


def run(model: str | None, json_path: Path | None = None) -> int:
  """Run every step, print the report; the exit status is 1 when a step failed."""
  from tqdm import tqdm
  from tinyvllm.model.weights import resolve_model
  env = environment()
  steps: list[Step] = []
  with tqdm(total=4, desc="tinyvllm doctor", file=sys.stderr, unit="step") as bar:
    for name, fn in (("compiling shaders", lambda: compile_shaders(shader_files(), env["device"])),
                     ("tests/test_metal_device.py", device_tests),
                     ("generation", lambda: generation(str(resolve_model(model)), env["device"])),
                     ("roofline", lambda: roofline(model))):
      bar.set_postfix_str(name)
      steps.append(fn())
      bar.update()
  text = report(env, steps)
  print(text)
  if json_path:
    json_path.write_text(json.dumps({"environment": env, "steps": [asdict(s) for s in steps]}, indent=1, default=str))
    print(f"wrote {json_path}")
  return 1 if any(s.ok is False for s in steps) else 0
