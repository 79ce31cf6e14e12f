"""The `tinyvllm` command: `tinyvllm serve|generate|bench|quantize [args]`, as `vllm serve`. Each subcommand is the
module of the same name (`python -m tinyvllm.serve ...` works the same)."""
from __future__ import annotations
import importlib, sys

COMMANDS = {"serve": ("tinyvllm.entrypoints.openai.api_server", "an OpenAI-compatible HTTP server"),
            "generate": ("tinyvllm.generate", "generate text from prompts on the command line"),
            "bench": ("tinyvllm.bench.cli", "tok/s against the memory-bandwidth roofline, beside peers"),
            "quantize": ("tinyvllm.quantize", "write a 4-bit (MLX format) copy of a model")}


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
    lines = [f"  {name:<9} {doc}" for name, (_, doc) in COMMANDS.items()]
    usage = "usage: tinyvllm {serve,generate,bench,quantize} [args]\n\n" + "\n".join(lines) + "\n\n'tinyvllm COMMAND --help' for a command's flags"
    if argv and argv[0] not in ("-h", "--help"):
      print(f"tinyvllm: unknown command {argv[0]!r}\n{usage}", file=sys.stderr)
      return 2
    print(usage)
    return 0
  module = importlib.import_module(COMMANDS[argv[0]][0])
  result = module.main(argv[1:])
  return result if isinstance(result, int) else 0


if __name__ == "__main__":
  sys.exit(main())
