"""What structured output costs: decode step time with and without a JSON-schema constraint, and schema compile time.

  python bench/structured_output.py [--model PATH] [--batch 1,8] [--tokens 64] [--repeats 3] [--json out.json]

On one engine (the default model unless --model), for each batch size B it decodes B sequences of --tokens tokens
at temperature 1, four ways, --repeats times each in turn:
  free         no constraint (ignore_eos, so every sequence runs the whole length)
  json         a JSON schema (a list of at least 10 people: no sequence can finish early), masks where the engine
               puts them by default (MaskPolicy "auto": on the worker thread if the model step leaves a core idle
               and the step's masks cost enough; on the CPU device with every core busy, in place)
  json thread  masks always on the worker thread, while the model step runs
  json inline  masks always computed in place, before the model step
"ms/step" is the median time of the steps that decoded all B sequences (prefill steps excluded), over every repeat;
"overhead" compares it with free at the same B. Below the table, the parts of the overhead measured alone on the
same schema and tokens: llguidance's mask for one sequence, its bias row (both on the worker thread when it runs),
adding the bias to one row of logits, and advancing the matcher by one token; and compile times: the tokenizer
index llguidance builds once per engine (first constraint), and a typical schema (a cache miss: each compile on a
fresh compiler).
"""
from __future__ import annotations
import argparse, json, os, statistics, sys, time
from pathlib import Path
import numpy as np

os.environ.setdefault("DEV", "CPU")

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "email", "address"], "properties": {
  "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
  "email": {"type": "string", "format": "email"}, "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
  "role": {"enum": ["admin", "user", "guest"]},
  "address": {"type": "object", "required": ["street", "city", "zip"], "properties": {
    "street": {"type": "string"}, "city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}}}
TYPICAL = {"type": "object", "required": ["people"], "properties": {"people": {"type": "array", "items": PERSON}}}
LONG = {**TYPICAL, "properties": {"people": {"type": "array", "items": PERSON, "minItems": 10}}}
QUESTION = "List ten people as JSON: name, age, email, tags, role and address for each."


def decode_steps(engine, prompt: list[int], params, batch: int, tag: str) -> tuple[list[float], int]:
  """Run `batch` copies of one request to the end; (seconds of each step that decoded all of them, tokens)."""
  for i in range(batch): engine.add_request(f"{tag}-{i}", {"prompt_token_ids": prompt}, params)
  times, tokens = [], 0
  while engine.has_unfinished_requests():
    sch = engine.scheduler
    decoding = not sch.waiting and sum(not s.is_prefilling for s in sch.running) == batch
    start = time.perf_counter()
    outs = engine.step()
    if decoding: times.append(time.perf_counter() - start)
    tokens += sum(len(c.token_ids) for o in outs if o.finished for c in o.outputs)
  return times, tokens


def parts(engine, prompt: list[int], params) -> dict:
  """The overhead's parts timed alone: mask, apply, advance, per sequence-token, along one real constrained output."""
  from tinyvllm.structured_output import apply_bias, bias_from_bitmask
  engine.add_request("trace", {"prompt_token_ids": prompt}, params)
  tokens = []
  while engine.has_unfinished_requests():
    for o in engine.step(): tokens = o.outputs[0].token_ids
  grammar = engine.input_processor.grammars.compile(params.structured_outputs)
  state, vocab = grammar.new_state(), engine.model_config.vocab_size
  logits = np.random.default_rng(0).standard_normal((1, vocab)).astype(np.float32)
  row = np.empty(state.mask_words, np.int32)
  mask_s, bias_s, apply_s, advance_s = [], [], [], []
  for t in tokens:
    a = time.perf_counter(); state.fill_mask(row)
    b = time.perf_counter(); bias = bias_from_bitmask(row, vocab)
    c = time.perf_counter(); apply_bias(logits, bias)
    d = time.perf_counter(); state.commit([t])
    mask_s.append(b - a); bias_s.append(c - b); apply_s.append(d - c); advance_s.append(time.perf_counter() - d)
  us = lambda xs: 1e6 * statistics.median(xs)
  return {"trace_tokens": len(tokens), "mask_us": us(mask_s), "bias_us": us(bias_s), "apply_us": us(apply_s),
          "advance_us": us(advance_s)}


def compile_times(tokenizer, vocab_size: int, repeats: int = 5) -> dict:
  from tinyvllm.sampling_params import StructuredOutputsParams
  from tinyvllm.structured_output import GrammarCompiler
  params = StructuredOutputsParams(json=TYPICAL)
  first, typical = [], []
  for _ in range(repeats):
    compiler = GrammarCompiler(tokenizer, vocab_size)
    a = time.perf_counter(); compiler.compile(StructuredOutputsParams(regex="x"))   # builds llguidance's tokenizer index
    b = time.perf_counter(); compiler.compile(params)
    first.append(b - a); typical.append(time.perf_counter() - b)
  return {"tokenizer_index_ms": 1e3 * statistics.median(first), "typical_schema_ms": 1e3 * statistics.median(typical)}


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--model", default=None, help="HF directory, GGUF file or hub id (default: SmolLM2-135M-Instruct Q4_1 GGUF)")
  ap.add_argument("--batch", default="1,8", help="comma-separated batch sizes")
  ap.add_argument("--tokens", type=int, default=64, help="tokens per sequence")
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--num-threads", type=int, default=None, help="CPU threads of the model's kernels (default: every core)")
  ap.add_argument("--json", type=Path, default=Path("bench/results/structured_output.json"), help="write the results here")
  args = ap.parse_args()
  from tinyvllm import SamplingParams, StructuredOutputsParams
  from tinyvllm.engine.llm_engine import LLMEngine
  from tinyvllm.structured_output import MaskPolicy
  batches = [int(b) for b in args.batch.split(",")]
  engine = LLMEngine.from_kwargs(args.model, num_kv_blocks=max(batches) * (args.tokens + 64) // 16 + 64, num_threads=args.num_threads)
  tok = engine.tokenizer
  prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": QUESTION}]), add_special_tokens=False)
  free = SamplingParams(temperature=1.0, max_tokens=args.tokens, ignore_eos=True, seed=1)
  constrained = SamplingParams(temperature=1.0, max_tokens=args.tokens, seed=1, structured_outputs=StructuredOutputsParams(json=LONG))
  configs = {"free": (free, MaskPolicy()), "json": (constrained, MaskPolicy()),
             "json thread": (constrained, MaskPolicy(mode="thread")), "json inline": (constrained, MaskPolicy(mode="inline"))}
  rows = []
  for b in batches:
    for name, (params, policy) in configs.items():   # warm-up: capture every pass shape this batch uses
      engine.core.masks.policy = policy
      decode_steps(engine, prompt, params, b, f"warm-{name}-{b}")
    samples: dict[str, list[float]] = {name: [] for name in configs}
    tokens: dict[str, int] = {}
    for r in range(args.repeats):
      for name, (params, policy) in configs.items():
        engine.core.masks.policy = policy
        seconds, tokens[name] = decode_steps(engine, prompt, params, b, f"{name}-{b}-{r}")
        samples[name] += seconds
    engine.core.masks.policy = MaskPolicy()
    base = statistics.median(samples["free"])
    for name in configs:
      ms = statistics.median(samples[name])
      rows.append({"batch": b, "config": name, "ms_per_step": 1e3 * ms, "tokens_per_s": b / ms, "overhead": ms / base - 1,
                   "tokens": tokens[name], "steps": len(samples[name]), "step_ms_mean": 1e3 * statistics.fmean(samples[name])})
  extra = {**parts(engine, prompt, configs["json"][0]), **compile_times(tok, engine.model_config.vocab_size)}
  print(f"{'batch':>5}  {'config':<12}{'ms/step':>9}{'tok/s':>8}{'overhead':>10}")
  for r in rows:
    print(f"{r['batch']:>5}  {r['config']:<12}{r['ms_per_step']:>9.2f}{r['tokens_per_s']:>8.1f}{r['overhead']:>+10.1%}")
  print(f"per sequence-token, along a {extra['trace_tokens']}-token output: mask {extra['mask_us']:.0f} us, bias row "
        f"{extra['bias_us']:.0f} us, add to logits {extra['apply_us']:.0f} us, advance the matcher {extra['advance_us']:.0f} us")
  print(f"compile: llguidance's tokenizer index {extra['tokenizer_index_ms']:.0f} ms (once per engine), "
        f"a typical schema {extra['typical_schema_ms']:.2f} ms (cache miss)")
  args.json.parent.mkdir(parents=True, exist_ok=True)
  extra["spare_core"] = engine.core.masks.spare_core
  args.json.write_text(json.dumps({"rows": rows, "parts": extra, "model": str(engine.config.model or "default (SmolLM2-135M-Instruct Q4_1)"),
                                   "command": " ".join(sys.argv)}, indent=1) + "\n")
  print(f"wrote {args.json}")


if __name__ == "__main__":
  main()
