"""Command line: `python -m tinyvllm.generate --prompt "Hello"` streams a completion, then one stats line.

Flags follow vLLM's and mlx-lm's names. Prompts come from --prompt (repeatable) or, without it, stdin
(one prompt per line). Text goes to stdout, progress and stats to stderr. Bad input exits with status 2
and a one-line message, never a traceback.
"""
from __future__ import annotations
import argparse, sys
from tinyvllm.entrypoints.engine_args import add_engine_args, engine_kwargs


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
  p = argparse.ArgumentParser(prog="python -m tinyvllm.generate", description=__doc__.splitlines()[0])
  p.add_argument("--model", default=None, help="HF directory, GGUF file or hub id (default: SmolLM2-135M-Instruct Q4_1)")
  p.add_argument("--prompt", action="append", help="prompt text; repeat for several (default: read stdin)")
  p.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the model's chat template")
  p.add_argument("--system", default=None, help="system message for --chat")
  p.add_argument("--max-tokens", type=int, default=256)
  p.add_argument("--temperature", "--temp", type=float, default=0.0)
  p.add_argument("--top-p", type=float, default=1.0)
  p.add_argument("--top-k", type=int, default=0)
  p.add_argument("--min-p", type=float, default=0.0)
  p.add_argument("--repetition-penalty", type=float, default=1.0)
  p.add_argument("--seed", type=int, default=None, help="sampling seed: the same seed gives the same text")
  add_engine_args(p.add_argument_group("engine"), exclude=("seed",))
  return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
  args = parse_args(argv)
  prompts = args.prompt if args.prompt else [line for line in sys.stdin.read().splitlines() if line.strip()]
  if not prompts:
    print("error: no prompt: pass --prompt TEXT or pipe prompts on stdin", file=sys.stderr)
    return 2
  # imports after argument parsing: --help and argument errors stay instant
  from tinyvllm import LLM, SamplingParams
  from tinyvllm.model.fetch import FetchError
  try:
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            min_p=args.min_p, repetition_penalty=args.repetition_penalty, seed=args.seed)
    llm = LLM(args.model, **engine_kwargs(args, exclude=("seed",)))
  except (ValueError, TypeError, FetchError, OSError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  status = 0
  try:
    for i, prompt in enumerate(prompts):
      if i: print("\n" + "-" * 40, flush=True)
      try:   # a rejected prompt is reported and the others still run; the exit status says one failed
        status = max(status, run_prompt(llm, prompt, params, args))
      except (ValueError, TypeError) as e:
        print(f"error: prompt {i + 1}: {e}", file=sys.stderr)
        status = 2
  except KeyboardInterrupt:
    return 130
  return status


def run_prompt(llm, prompt: str, params, args) -> int:
  """Stream one completion to stdout and its stats line to stderr; 1 if the engine failed it."""
  request = prompt
  if args.chat:
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + [{"role": "user", "content": prompt}]
    request = llm.llm_engine.input_processor.render_chat(messages)
  from tinyvllm import GenerationError
  final, sent = None, 0
  try:
    for out in llm.stream(request, params):
      text = out.outputs[0].text
      print(text[sent:], end="", flush=True)
      sent, final = len(text), out
  except GenerationError as e:   # the engine logged the traceback; the user gets the cause in one line
    print(flush=True)
    print(f"error: {e.failed[0].error}", file=sys.stderr)
    return 1
  print(flush=True)
  print(stats_line(final), file=sys.stderr, flush=True)
  return 0


def stats_line(out) -> str:
  m = out.metrics
  parts = [f"prompt: {m.num_prompt_tokens} tokens", f"generated: {m.num_generated_tokens} tokens"]
  if m.time_to_first_token is not None: parts.append(f"TTFT: {m.time_to_first_token:.2f} s")
  if m.decode_tokens_per_s is not None: parts.append(f"decode: {m.decode_tokens_per_s:.1f} tok/s")
  if m.num_draft_tokens:
    parts.append(f"acceptance: {m.acceptance_rate:.0%}, {m.tokens_per_target_step:.2f} tokens/target step")
  parts.append(f"finish: {out.outputs[0].finish_reason}")
  return "[" + " | ".join(parts) + "]"


if __name__ == "__main__":
  sys.exit(main())
