"""Tool calls on the default model: how often and how fast a valid call comes, with and without the grammar.

  python bench/tool_calls.py [--model PATH] [--requests 8] [--max-tokens 96] [--json out.json]

Each request asks the model (SmolLM2-135M-Instruct by default, with a Hermes-style template that lists the tools,
as Qwen's does) a question one of two tools answers. Unconstrained is tool_choice "auto": the model writes what it
likes and the hermes parser reads any call out of it. Constrained is tool_choice "required": the grammar lets only
valid calls through (tinyvllm/tools.py). Per mode, one request at a time, greedy: the share of answers that parse into
a call whose arguments satisfy the schema, the time to a finished answer (median), and decode tok/s (generated
tokens over the time after the first token), all measured in this one run.
"""
from __future__ import annotations
import argparse, json, statistics, sys, time
from pathlib import Path

TEMPLATE = (
  "{% if tools %}<|im_start|>system\nYou are a helpful assistant with these functions:\n{% for t in tools %}{{ t.function | tojson }}\n"
  "{% endfor %}To call one, answer <tool_call>\n{\"name\": <name>, \"arguments\": <object>}\n</tool_call><|im_end|>\n{% endif %}"
  "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
  "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"], "additionalProperties": False}}},
         {"type": "function", "function": {"name": "convert_currency", "description": "Convert an amount between currencies",
                                           "parameters": {"type": "object", "properties": {"amount": {"type": "number"},
                                                                                           "from": {"type": "string"},
                                                                                           "to": {"type": "string"}},
                                                          "required": ["amount", "from", "to"], "additionalProperties": False}}}]
QUESTIONS = ["What is the weather in Paris?", "How much is 20 euros in dollars?", "Is it raining in Tokyo right now?",
             "Convert 150 yen to pounds.", "Weather in Lima today?", "What are 5 dollars in euros?",
             "Tell me the weather for Berlin.", "Change 80 francs into euros."]


def valid(calls) -> bool:
  import jsonschema
  by_name = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
  try:
    return bool(calls) and all(c.name in by_name and jsonschema.validate(json.loads(c.arguments), by_name[c.name]) is None for c in calls)
  except jsonschema.ValidationError: return False


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--model", default=None)
  ap.add_argument("--requests", type=int, default=8)
  ap.add_argument("--max-tokens", type=int, default=96)
  ap.add_argument("--json", type=Path, default=None)
  args = ap.parse_args()
  from tinyvllm import LLM, SamplingParams
  from tinyvllm.sampling_params import StructuredOutputsParams
  from tinyvllm.tools import FORMATS
  fmt = FORMATS["hermes"]
  llm = LLM(args.model)
  modes = {"auto (unconstrained)": None, "required (grammar)": StructuredOutputsParams(grammar=fmt.grammar(TOOLS, parallel=False))}
  stats = {mode: {"times": [], "rates": [], "tokens": [], "ok": 0} for mode in modes}
  def ask(question: str, constraint):
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, structured_outputs=constraint)
    t = time.perf_counter()
    out = llm.chat([{"role": "user", "content": question}], params, tools=TOOLS, chat_template=TEMPLATE, use_tqdm=False)[0]
    return out, time.perf_counter() - t
  try:
    for constraint in modes.values(): ask(QUESTIONS[0], constraint)   # warm-up: every shape either mode runs, compiled
    for q in (QUESTIONS * args.requests)[:args.requests]:
      for mode, constraint in modes.items():   # in turn, so drift on a shared machine hits both alike
        out, seconds = ask(q, constraint)
        c, m, st = out.outputs[0], out.metrics, stats[mode]
        st["times"].append(seconds)
        st["tokens"].append(len(c.token_ids))
        if m.first_token_time is not None and len(c.token_ids) > 1:
          st["rates"].append((len(c.token_ids) - 1) / max(1e-9, m.finished_time - m.first_token_time))
        st["ok"] += valid(fmt.parse(c.text)[1])
  finally:
    llm.shutdown()
  rows = [{"mode": mode, "valid_calls": st["ok"], "requests": args.requests, "median_seconds": statistics.median(st["times"]),
           "median_tokens": statistics.median(st["tokens"]), "decode_tok_s": statistics.median(st["rates"]) if st["rates"] else None}
          for mode, st in stats.items()]
  print(f"{'mode':<22}{'valid calls':>13}{'median s':>10}{'tokens':>8}{'decode tok/s':>14}")
  for r in rows:
    print(f"{r['mode']:<22}{r['valid_calls']:>7} / {r['requests']:<3}{r['median_seconds']:>10.2f}{r['median_tokens']:>8.0f}"
          f"{r['decode_tok_s'] or 0:>14.1f}")
  if args.json: args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
  sys.exit(main())
