"""`python -m tinyvllm.generate` in a subprocess: streams text, prints one stats line, and turns bad input into
a one-line error with a non-zero exit status (never a traceback)."""
from __future__ import annotations
import os, subprocess, sys
import pytest


def run(*args, stdin: str | None = None) -> subprocess.CompletedProcess:
  env = {**os.environ, "DEV": "CPU"}
  return subprocess.run([sys.executable, "-m", "tinyvllm.generate", *args], input=stdin, capture_output=True, text=True,
                        env=env, timeout=600)


def test_generates_and_prints_stats(tiny_model):
  r = run("--model", str(tiny_model), "--prompt", "Hello world", "--max-tokens", "6", "--num-kv-blocks", "32", "--block-size", "8")
  assert r.returncode == 0, r.stderr
  stats = [line for line in r.stderr.splitlines() if line.startswith("[prompt:")]
  assert len(stats) == 1 and "generated: 6 tokens" in stats[0] and "TTFT" in stats[0] and "decode" in stats[0]
  from tinyvllm import LLM, SamplingParams
  want = LLM(str(tiny_model), num_kv_blocks=32, block_size=8).generate("Hello world", SamplingParams(max_tokens=6, temperature=0),
                                                                     use_tqdm=False)[0].outputs[0].text
  assert r.stdout == want + "\n"
  assert "Traceback" not in r.stderr


def test_prompts_from_stdin_and_chat(tiny_model):
  r = run("--model", str(tiny_model), "--chat", "--max-tokens", "3", "--num-kv-blocks", "32", "--block-size", "8",
          stdin="first question\nsecond question\n")
  assert r.returncode == 0, r.stderr
  assert len([line for line in r.stderr.splitlines() if line.startswith("[prompt:")]) == 2


@pytest.mark.parametrize("args, message", [
  (["--model", "/no/such/model.gguf", "--prompt", "x"], "model path does not exist: /no/such/model.gguf"),
  (["--prompt", "x", "--temperature", "-1"], "temperature"),
  (["--prompt", "x", "--max-tokens", "0"], "max_tokens"),
  (["--prompt", "x", "--block-size", "7"], "block_size"),
])
def test_bad_input_is_one_line(tiny_model, args, message):
  if "--model" not in args: args = ["--model", str(tiny_model), *args]
  r = run(*args)
  assert r.returncode == 2
  assert "Traceback" not in r.stderr and message in r.stderr.strip().splitlines()[-1]


def test_prompt_longer_than_context(tiny_model):
  r = run("--model", str(tiny_model), "--prompt", "word " * 300, "--max-model-len", "64", "--num-kv-blocks", "16", "--block-size", "8")
  assert r.returncode == 2 and "max_model_len is 64" in r.stderr and "Traceback" not in r.stderr


def test_bad_flag_value_from_argparse():
  r = run("--max-tokens", "many")
  assert r.returncode == 2 and "invalid int value" in r.stderr


def test_tinyvllm_command_dispatches_subcommands(tiny_model):
  """`tinyvllm generate ...` is `python -m tinyvllm.generate ...` (the console script runs entrypoints/cli.py)."""
  env = {**os.environ, "DEV": "CPU"}
  cli = [sys.executable, "-m", "tinyvllm.entrypoints.cli"]
  r = subprocess.run([*cli, "generate", "--model", str(tiny_model), "--prompt", "Hello world", "--max-tokens", "4",
                      "--num-kv-blocks", "32", "--block-size", "8"], capture_output=True, text=True, env=env, timeout=600)
  direct = run("--model", str(tiny_model), "--prompt", "Hello world", "--max-tokens", "4", "--num-kv-blocks", "32", "--block-size", "8")
  assert r.returncode == 0 and r.stdout == direct.stdout
  helped = subprocess.run([*cli, "--help"], capture_output=True, text=True, timeout=60)
  assert helped.returncode == 0 and all(c in helped.stdout for c in ("serve", "generate", "bench", "quantize"))
  wrong = subprocess.run([*cli, "srve"], capture_output=True, text=True, timeout=60)
  assert wrong.returncode == 2 and "unknown command 'srve'" in wrong.stderr


def test_engine_flags_come_from_engine_config():
  """Every EngineConfig field is a flag of generate (its help written once, in config.py)."""
  from dataclasses import fields
  from tinyvllm.config import EngineConfig
  from tinyvllm.generate import parse_args
  for command in ("tinyvllm.serve", "tinyvllm.bench"):   # every command line builds its flags the same way
    assert subprocess.run([sys.executable, "-m", command, "--help"], capture_output=True, timeout=60).returncode == 0, command
  help_text = subprocess.run([sys.executable, "-m", "tinyvllm.generate", "--help"], capture_output=True, text=True, timeout=60).stdout
  for f in fields(EngineConfig):
    if f.name not in ("model", "seed"): assert "--" + f.name.replace("_", "-") in help_text
  args = parse_args(["--prompt", "x", "--max-num-seqs", "3", "--kernel-backend", "portable", "--no-enable-prefix-caching"])
  assert (args.max_num_seqs, args.kernel_backend, args.enable_prefix_caching) == (3, "portable", False)
  from tinyvllm.entrypoints.engine_args import engine_kwargs
  assert engine_kwargs(args, exclude=("seed",)) == {"max_num_seqs": 3, "kernel_backend": "portable", "enable_prefix_caching": False}


def test_a_failing_model_pass_is_printed_with_its_cause(tiny_model):
  """The engine fails every pass (as a broken GPU would): the command logs the traceback once, prints the cause in one
  line for each prompt and exits 1, instead of printing empty text."""
  code = ("import sys\nimport tinyvllm.engine.model_runner as m\n"
          "def boom(self, *a, **kw): raise RuntimeError('CUDA Error 1, invalid argument (injected)')\n"
          "m.ModelRunner.execute = boom\nfrom tinyvllm.generate import main\nsys.exit(main(sys.argv[1:]))")
  r = subprocess.run([sys.executable, "-c", code, "--model", str(tiny_model), "--prompt", "Hello", "--prompt", "World",
                      "--num-kv-blocks", "32", "--block-size", "8"], capture_output=True, text=True, env={**os.environ, "DEV": "CPU"},
                     timeout=600)
  assert r.returncode == 1
  lines = r.stderr.splitlines()
  assert lines.count("error: RuntimeError: CUDA Error 1, invalid argument (injected)") == 2, r.stderr
  assert r.stderr.count("model pass failed for") == 1 and r.stderr.count("Traceback") == 1, r.stderr   # logged once
