"""Command line: `python -m tinyvllm.generate --prompt "Hello"` streams a completion, then one stats line.

Flags follow vLLM's and mlx-lm's names. Prompts come from --prompt (repeatable) or, without it, stdin
(one prompt per line). Text goes to stdout, progress and stats to stderr. Bad input exits with status 2
and a one-line message, never a traceback.
"""
from __future__ import annotations
import argparse, sys


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
  p.add_argument("--seed", type=int, default=None)
  p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16"])
  p.add_argument("--max-model-len", type=int, default=None)
  p.add_argument("--num-kv-blocks", type=int, default=None)
  p.add_argument("--block-size", type=int, default=16)
  p.add_argument("--max-num-seqs", type=int, default=32)
  p.add_argument("--max-num-batched-tokens", type=int, default=512)
  p.add_argument("--kernel-backend", default="auto", choices=["auto", "portable", "cpu", "metal", "emulator"])
  p.add_argument("--quantization", default=None, choices=["int4", "none"],
                 help="int4: quantize float weights at load; none: dequantize a 4-bit checkpoint (default: as stored)")
  p.add_argument("--draft-model", default=None, help="draft model for speculative decoding")
  p.add_argument("--num-speculative-tokens", type=int, default=None)
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
    engine_args = dict(dtype=args.dtype, max_model_len=args.max_model_len, num_kv_blocks=args.num_kv_blocks,
                       block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                       max_num_batched_tokens=args.max_num_batched_tokens, kernel_backend=args.kernel_backend)
    if args.quantization: engine_args["quantization"] = args.quantization
    if args.draft_model: engine_args["draft_model"] = args.draft_model
    if args.num_speculative_tokens is not None: engine_args["num_speculative_tokens"] = args.num_speculative_tokens
    llm = LLM(args.model, **engine_args)
    for i, prompt in enumerate(prompts):
      if i: print("\n" + "-" * 40, flush=True)
      request = prompt
      if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + [{"role": "user", "content": prompt}]
        text = llm.get_tokenizer().apply_chat_template(messages, add_generation_prompt=True)
        request = {"prompt": text, "prompt_token_ids": llm.get_tokenizer().encode(text, add_special_tokens=False)}
      final, sent = None, 0
      for out in llm.stream(request, params):
        text = out.outputs[0].text
        print(text[sent:], end="", flush=True)
        sent, final = len(text), out
      print(flush=True)
      print(stats_line(final), file=sys.stderr, flush=True)
  except (ValueError, TypeError, FetchError, OSError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  except KeyboardInterrupt:
    return 130
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
