"""Every kernel of the engine's passes compiles for an NVIDIA GPU and fits CUDA's launch limits, checked without one.

tinygrad lowers a kernel for CUDA with its CUDA renderer and compiles it with nvrtc, neither of which needs a GPU
(nvrtc comes from the `nvidia-cuda-nvrtc` wheel of the test extra), and its NULL device launches programs into nothing:
`DEV=NULL:CUDA:sm_90` runs the engine as an H100 would (the GPU routing, its opts, graphs), computing nothing. The
shapes a GPU user hits first, a 4096-token prefill step and a 64-sequence decode step, run there, and every program
of their captures is checked at the KV-extent variable's least and greatest values: every size positive (a CUDA
graph is built at the variables' 0: engine/replay.py, rule 1), grid y and z at most 65535, at most 1024 threads a
block, and the KV cache write's grid linear in its work, in blocks of at least a warp. A change to our kernels or a
tinygrad upgrade that breaks the CUDA path fails here, in CI."""
from __future__ import annotations
import contextlib, re
import pytest
from tinygrad.uop.ops import Ops
from conftest import NVRTC, largest_output, launch_threads


pytestmark = pytest.mark.skipif(NVRTC is None, reason="nvrtc not installed (pip install nvidia-cuda-nvrtc; Linux x86_64)")


@contextlib.contextmanager
def recording_kernels():
  """Yields a list that collects the kernel ASTs tinygrad compiles inside the block, before lowering, in order: every
  one, also those the engine's program cache holds (recorded before engine/replay.py swaps their programs in)."""
  from tinygrad.engine import realize
  from tinyvllm.engine.replay import compile_symbolic_kernels_in_process
  compile_symbolic_kernels_in_process()   # the engine's wrapper of lower_and_compile goes in first: the recorder wraps it
  asts, lower = [], realize.lower_and_compile
  def record(linear):
    asts.extend(a[0] for c in linear.toposort() if c.op is Ops.CALL and (a := realize._get_call_to_compile(c)) and a[0].op is Ops.SINK)
    return lower(linear)
  record.symbolic_in_process = True   # the engine's wrapper is inside it: a Replay made in the block must not wrap it again
  realize.lower_and_compile = record
  try: yield asts
  finally: realize.lower_and_compile = lower


def h100_renderer():
  """tinygrad's CUDA renderer for an H100 (sm_90), as its compile workers there would build it."""
  from tinygrad.helpers import Target
  from tinygrad.renderer.cstyle import CUDARenderer
  return CUDARenderer(Target(device="CUDA", arch="sm_90", interface="CUDA"))


NULL_CUDA = "NULL:CUDA:sm_90"   # tinygrad's NULL device with the H100's renderer: kernels compiled, launched into nothing


@contextlib.contextmanager
def on_null_cuda():
  """Run the block on tinygrad's NULL device lowering for the H100: the engine takes its GPU path (our GPU kernels and
  opts, nvrtc-compiled programs, captures batched into graphs) while nothing computes. Copies back read zeros."""
  from tinygrad.helpers import Context
  with pytest.MonkeyPatch.context() as mp, Context(DEV=NULL_CUDA, NULL_ALLOW_COPYOUT=1):
    mp.setenv("NVRTC_PATH", NVRTC)
    yield


def within_cuda_limits(g, l) -> bool:
  """A launch CUDA accepts: every size positive, grid x below 2^31, y and z at most 65535, a block of at most 1024
  threads and at most 64 along z."""
  return min(*g, *l) > 0 and g[0] <= 2**31 - 1 and max(g[1], g[2]) <= 65535 and l[0] * l[1] * l[2] <= 1024 and l[2] <= 64


# bytes an element of each C type the CUDA renderer declares a kernel's buffers or vector loads with
C_BYTES = {"half": 2, "__nv_bfloat16": 2, "float": 4, "uint": 4, "int": 4, "unsigned int": 4, "signed char": 1, "char": 1,
           "unsigned char": 1, "short": 2, "unsigned short": 2, "bool": 1, "long": 8, "unsigned long": 8, "double": 8}


def warp_accesses(src: str, warp: int = 32) -> list[tuple[str, str, int, list[int] | None]]:
  """Every access of a rendered CUDA kernel (`src`, from tinygrad's CUDA renderer) to one of its buffers, as the first
  warp makes it: (buffer, "load" or "store", bytes a lane moves, each lane's byte offset), for the first `warp` threads
  of block 0 (threadIdx.x fastest) at every loop's first iteration and symbolic sizes of 7. Offsets are None where the
  index reads a loaded value (a gather through a block table). A reading of the C, so it needs the renderer's shapes:
  `int aluN = ...;` definitions and `*((T4*)((dataN_S+index)))` or `*(dataN_S+index)` accesses, one line each."""
  head = re.search(r"__global__ void[^{]*\{", src)
  signature, body = head.group(0), src[head.end():]
  element = {name: C_BYTES[kind.strip()] for kind, name in re.findall(r"([\w ]+?)\*\s*(data\d+_\d+)", signature)}
  sizes = [int(s) for s in re.findall(r"int lidx\d+ = threadIdx\.\w; /\* (\d+) \*/", body)]
  lanes = []
  for lane in range(warp):
    env = {name: 7 for name in re.findall(r"int (\w+)\b[,)]", signature)}
    for i, size in enumerate(sizes): env[f"lidx{i}"], lane = lane % size, lane // size
    lanes.append(env)
  accesses = []
  for line in body.split("\n"):
    for counter in re.findall(r"int (gidx\d+) = blockIdx|for \(int (\w+) = 0", line):
      for env in lanes: env.update(dict.fromkeys(filter(None, counter), 0))
    for at in re.finditer(r"(data\d+_\d+)\+", line):
      index, close = _parenthesized(line, at.end())
      vector = re.search(r"\*\(\((\w[\w ]*?)(\d*)\*\)\(\($", line[:at.start()])
      width = C_BYTES[vector.group(1).strip()] * int(vector.group(2) or 1) if vector else element[at.group(1)]
      kind = "store" if re.match(r"\s*=[^=]", line[close + (4 if vector else 1):]) else "load"
      offsets = [_c_int(index, env) for env in lanes]
      accesses.append((at.group(1).split("_")[0], kind, width, None if None in offsets else [o * element[at.group(1)] for o in offsets]))
    if (value := re.match(r"\s*(?:int|uint|unsigned int|bool) (alu\d+|cast\d+) = (.*);\s*$", line)):
      for env in lanes:
        if (v := _c_int(value.group(2), env)) is not None: env[value.group(1)] = v
  return accesses


def _parenthesized(text: str, start: int) -> tuple[str, int]:
  """The text from `start` to the ')' closing the '(' open before it, and that ')''s position."""
  depth = 0
  for i in range(start, len(text)):
    depth += {"(": 1, ")": -1}.get(text[i], 0)
    if depth < 0: return text[start:i], i
  raise ValueError(f"unbalanced: {text[start:]}")


def _c_int(expr: str, env: dict) -> int | None:
  """A C integer expression's value under `env`, or None when it names something else (a loaded value)."""
  expr = re.sub(r"\((?:unsigned int|uint|int|long long|long|unsigned long)\)", "", expr)
  expr = re.sub(r"\b(\d+)u\b", r"\1", expr).replace("&&", " and ").replace("||", " or ").replace("/", "//")
  expr = re.sub(r"!(?!=)", " not ", expr)
  try: return int(eval(expr, {"__builtins__": {}}, env))
  except Exception: return None


def loose_accesses(src: str) -> tuple[int, list[tuple]]:
  """(how many of a rendered kernel's accesses `warp_accesses` follows, those whose warp touches more than twice the
  cache lines its bytes need: (buffer, kind, bytes a lane, lines touched, fewest))."""
  followed = [(buffer, kind, width, *cache_lines(width, offsets)) for buffer, kind, width, offsets in warp_accesses(src)
              if offsets is not None]
  return len(followed), [a for a in followed if a[3] > 2 * a[4]]


def cache_lines(width: int, offsets: list[int], line: int = 128) -> tuple[int, int]:
  """(the 128-byte lines a warp's access touches, the fewest its distinct bytes need): each line is a pass through
  the L1 for the one instruction, so a warp whose lanes stride a line apart costs 32 where 2 would do."""
  touched = {(o + b) // line for o in offsets for b in range(0, width, min(width, 4))}
  return len(touched), max(1, -(-len(set(offsets)) * width // line))


def plain_name(program) -> str:
  """A lowered program's name without the terminal colors tinygrad gives it."""
  return re.sub(r"\x1b\[\d+m", "", program.arg.name)


def captured_programs_of(replay) -> list:
  """The programs one capture runs, in order, those inside graph batches included."""
  programs = []
  for call in replay.jit.captured.linear.src:
    ast = call.src[0]
    inner = [c.src[0] for c in ast.src[0].src] if ast.op is Ops.CUSTOM_FUNCTION and ast.arg == "graph" else [ast]
    programs += [u for u in inner if u.op is Ops.PROGRAM]
  return programs


def captured_programs(engine) -> list:
  """Every program of the engine's captures, those inside graph batches included."""
  return list(dict.fromkeys(p for replay in engine.runner.captures() for p in captured_programs_of(replay)))


def run_and_record_kernels(engine_kwargs: dict, requests: list[tuple[list[int], int]]):
  """Run an engine (portable backend, float16: what a CUDA run uses) on the CPU device through `requests` (prompt ids,
  max_tokens) and record the kernel ASTs tinygrad compiles for its captures, before lowering. Returns (engine, ASTs)."""
  from tinyvllm import SamplingParams
  from tinyvllm.engine.llm_engine import LLMEngine
  with recording_kernels() as asts:
    engine = LLMEngine.from_kwargs(**{"kernel_backend": "portable", "dtype": "float16", **engine_kwargs})
    for i, (ids, n) in enumerate(requests): engine.add_request(str(i), {"prompt_token_ids": ids}, SamplingParams(max_tokens=n, temperature=0))
    while engine.has_unfinished_requests(): engine.step()
  return engine, list(dict.fromkeys(asts))


@pytest.fixture(scope="module")
def gpu_programs(tmp_path_factory):
  """The programs of a 4096-token prefill and a 64-sequence decode on a tiny model (portable backend, float16: what a
  CUDA run uses), as the engine captures them on the H100's lowering."""
  from conftest import make_tiny_llama
  from tinyvllm import SamplingParams
  from tinyvllm.engine.llm_engine import LLMEngine
  path = make_tiny_llama(tmp_path_factory.mktemp("tiny-cuda"), hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=64, max_position_embeddings=4608)
  with on_null_cuda():
    engine = LLMEngine.from_kwargs(str(path), kernel_backend="portable", dtype="float16", max_num_batched_tokens=4096, max_model_len=4608,
                                   num_kv_blocks=700, max_num_seqs=64)
    for i, (ids, n) in enumerate([([7] * 4095, 2)] + [([5 + i] * 9, 3) for i in range(64)]):
      engine.add_request(str(i), {"prompt_token_ids": ids}, SamplingParams(max_tokens=n, temperature=0))
    while engine.has_unfinished_requests(): engine.step()
  shapes = {(s.num_seqs, s.query_len, s.packed) for s in engine.runner.replays}
  assert (64, 4096, True) in shapes and (64, 1, False) in shapes, shapes   # a packed prefill's rows: max_num_seqs
  return captured_programs(engine)


def test_every_kernel_compiles_for_sm90_within_cuda_launch_limits(gpu_programs):
  symbolic, problems, cache_writes, names = 0, [], 0, set()
  for program in gpu_programs:
    name = program.arg.name
    names.add(name.rsplit("_", 3)[0] if name.startswith("paged_") else name.split("_")[0])
    assert program.src[-1].op is Ops.BINARY and len(program.src[-1].arg) > 0, name   # nvrtc's cubin
    variables = program.arg.vars
    symbolic += bool(variables)
    for values in ({v.expr: v.vmin for v in variables}, {v.expr: 0 for v in variables}, {v.expr: v.vmax for v in variables}):
      g, l = program.arg.launch_dims(values)
      if not within_cuda_limits(g, l): problems.append((name, values, g, l))
      # a grid is its kernel's outputs (a few threads each where they share a reduction), never a product of loops: a
      # custom kernel's separate ranges all become grid axes on a GPU (the cache write below launched 2.7e11 threads)
      if launch_threads(g, l) > 64 * largest_output(program, program.src[0]):
        problems.append((name, "threads beyond its outputs", g, l))
      if name.startswith(("kv_cache_write_", "kv_write_rope_")):   # T tokens' rows into caches of the given row sizes
        cache_writes += 1
        T, *rows = map(int, re.findall(r"_(\d+)", name))
        if launch_threads(g, l) > 2 * T * sum(rows):   # a grid per cache, multiplied (T^2 (KVH D)^2: minutes on the H100)
          problems.append((name, "threads", g, l))
        if l[0] * l[1] * l[2] < 32:   # without opts tinygrad launches one thread a block (portable.block_opts)
          problems.append((name, "threads a block", g, l))
  assert not problems, problems
  # the decode projections at batch 1: kernels/gemv.py; at 64 sequences (and the prefill's last chunks of the 4096
  # tokens, up to 256 rows) on the tensor cores: kernels/gemm.py
  assert {"paged_scores", "paged_values", "gemv", "gemm"} <= names, names
  # at 64 sequences the cache write adds the qkv projection's partial sums: no kernel of their own between them
  written = [plain_name(p) for p in gpu_programs if "kv_write_rope_64_" in p.arg.name]
  assert written and all(re.fullmatch(r"kv_write_rope_64_\d+_\d+_sum\d+", n) for n in written), written
  assert cache_writes > 0
  assert symbolic > 0 and len(gpu_programs) > 50   # the attention kernels over the KV extent were among them


def test_a_32_head_prefill_lowers_to_programs_a_gpu_graph_can_hash(tmp_path, monkeypatch):
  """A GPU graph hashes each program it holds (`UOp.key`, which prints the program's arguments). The tensor-op
  attention's QK^T kernel of a 512-token step of a 32-head model (four 128-token prompts, as the bench's batch-32 decode
  prefills) carries a cost estimate ~500 deep, whose repr exceeds Python's recursion limit: on the H100 that step failed with
  RecursionError while its CUDA graph was built. Lowered as the engine lowers kernels that read a variable
  (`replay.lower_in_process`), every program hashes, and its estimates still bound the kernel's work."""
  from conftest import make_tiny_llama
  from tinygrad import codegen
  from tinygrad.codegen import do_to_program
  from tinygrad.uop.ops import sym_infer
  from tinyvllm.engine.replay import MAX_ESTIMATE_DEPTH, _depth, _has_variables, lower_in_process
  monkeypatch.setenv("NVRTC_PATH", NVRTC)
  path = make_tiny_llama(tmp_path, hidden_size=128, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                         intermediate_size=256, num_hidden_layers=1, max_position_embeddings=1024)
  # the attention composed of tensor ops (kernels/portable.py), which soft-capped scores (Gemma 2) and tensor parallelism
  # still take: its QK^T kernel is the deep one (kernels/paged.py's own kernels, which float caches take, stay shallow)
  from tinyvllm.kernels import Kernels, paged
  monkeypatch.setattr(paged, "applies", lambda *args: False)
  monkeypatch.setattr(Kernels, "packs_prefill", False)   # those pad their prefill chunks
  _, asts = run_and_record_kernels(dict(model=str(path), max_num_batched_tokens=512, max_model_len=1024, num_kv_blocks=64),
                                   [([5 + i] * 128, 1) for i in range(4)])
  renderer = h100_renderer()
  symbolic = [ast for ast in asts if _has_variables(ast)]
  deep = 0
  for ast in symbolic:
    bare = do_to_program(ast, renderer)   # tinygrad's own lowering, without the cache
    try: bare.key
    except RecursionError: deep += 1
    # lowered once (14 s for the deep one): the engine's lowering finds tinygrad's program in tinygrad's cache
    codegen.to_program_cache[codegen.to_program_key(ast, renderer)] = bare
    program = lower_in_process(ast, renderer)
    program.key   # what the graph computes; raised RecursionError before
    est, bare_est = program.src[0].arg.estimates, bare.src[0].arg.estimates
    assert max(map(_depth, (est.ops, est.lds, est.mem))) <= MAX_ESTIMATE_DEPTH
    for values in ({v.expr: v.vmin for v in program.arg.vars}, {v.expr: v.vmax for v in program.arg.vars}):
      assert sym_infer(est.ops, values) == sym_infer(bare_est.ops, values)   # simplified, not changed
      assert sym_infer(est.mem, values) >= sym_infer(bare_est.mem, values) > 0   # at most rounded up to its bound
  assert deep > 0, "no kernel's estimates are too deep to print any more: rule 3 of engine/replay.py may be obsolete"


@pytest.mark.parametrize("KVH,D", [(2, 64), (8, 128)])
def test_a_sharded_cache_write_lowers_for_each_gpu(KVH, D, monkeypatch):
  """Tensor parallelism over 2 GPUs: each device's cache write sees its share of the KV heads, and the block of
  threads it asks for (`portable.block_opts`) must divide that share's rows, not the whole cache's (KVH 2, D 64 on 2
  GPUs: 64 elements a device, where 128 would not divide). The kernel is recorded for CPU shards with the GPUs'
  names and lowered for sm_90."""
  import functools
  from tinygrad import Tensor, dtypes
  from tinygrad.codegen import to_program
  from tinyvllm.kernels import portable
  monkeypatch.setenv("NVRTC_PATH", NVRTC)
  devs = ("CPU:0", "CPU:1")
  k, v = (Tensor.zeros(4, 16, KVH, D).contiguous().shard(devs, 2).realize() for _ in range(2))
  rows = Tensor.randn(3, 2, KVH, D).shard(devs, 2).realize()
  slots = Tensor([0, 1, 5], dtype=dtypes.int32).shard(devs).realize()
  write = functools.partial(portable._cache_write_kernel, 2, ("CUDA:0", "CUDA:1"))   # the opts a GPU pair's kernel takes
  with recording_kernels() as asts, pytest.raises(Exception):   # the CPU cannot run GPU opts
    Tensor.custom_kernel(k, v, rows, slots, fxn=write)[0].realize()
  writes = [ast for ast in asts if ast.arg.name.startswith("kv_cache_write")]
  assert writes and all(ast.arg.opts_to_apply for ast in writes)
  for ast in writes:
    g, l = to_program(ast, h100_renderer()).arg.launch_dims({})
    assert l[0] * l[1] * l[2] >= 32 and launch_threads(g, l) == 3 * KVH * D // 2


def _requests(engine, tag: str, n: int, prompt_len: int, max_tokens: int) -> None:
  from tinyvllm import SamplingParams
  for i in range(n):
    engine.add_request(f"{tag}{i}", {"prompt_token_ids": [5 + i] * prompt_len}, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_engine_runs_its_gpu_path_lowered_for_the_h100(tiny_model_factory, async_scheduling):
  """The whole engine on the H100's lowering: chunked prefill, single and multi-step decode (pipelined too:
  async scheduling) and a sampled request run to their lengths, every graphed program
  fits CUDA's launch limits at the KV extent's least and greatest values, and the decode projections are our GEMV
  (kernels/gemv.py, the GPU routing the CPU device never takes)."""
  from tinyvllm import SamplingParams
  from tinyvllm.engine.llm_engine import LLMEngine
  with on_null_cuda():
    engine = LLMEngine.from_kwargs(str(tiny_model_factory("gqa", dtype="float16")), num_kv_blocks=64, block_size=16,
                                   max_num_batched_tokens=32, num_scheduler_steps=4, async_scheduling=async_scheduling)
    assert engine.core.pipelined == async_scheduling
    _requests(engine, "g", 3, 40, 9)
    engine.add_request("s", {"prompt_token_ids": [9] * 20}, SamplingParams(max_tokens=5, temperature=0.8, seed=1, ignore_eos=True))
    finished = {}
    while engine.has_unfinished_requests():
      for out in engine.step():
        if out.finished: finished[out.request_id] = out
  assert {r: (o.error, len(o.outputs[0].token_ids)) for r, o in finished.items()} == {"g0": (None, 9), "g1": (None, 9), "g2": (None, 9), "s": (None, 5)}
  programs = captured_programs(engine)
  assert any(p.arg.name.startswith("gemv") for p in programs), sorted({p.arg.name for p in programs})
  # a decode pass's qkv projection writes q and the cache itself (gemv.qkv_rope_write): no write kernel of its own
  layers = engine.model_config.num_hidden_layers
  for shape, replays in engine.runner.replays.items():
    if shape.query_len == 1:
      names = [p.arg.name for r in replays if r.jit.captured is not None for p in captured_programs_of(r)]
      assert sum(n.startswith("gemv_norm_rope") for n in names) == layers and not any(n.startswith("kv_write") for n in names), names
  for p in programs:
    for values in ({v.expr: v.vmin for v in p.arg.vars}, {v.expr: v.vmax for v in p.arg.vars}):
      g, l = p.arg.launch_dims(values)
      assert within_cuda_limits(g, l), (p.arg.name, g, l)


def test_a_gpu_step_schedules_nothing_once_its_shapes_are_captured(tiny_model_factory, monkeypatch):
  """After its shapes are captured, a step on a GPU asks tinygrad to schedule nothing: inputs go in and tokens or
  logits come back through the device's allocator (engine/replay.py `to_host`). tinygrad's own copy back from a
  device without host-visible memory (CUDA, NV) schedules a COPY call: about 0.5 ms of Python on every step, more than
  the H100 takes for a batch-1 decode pass of a 1B model at half its bandwidth."""
  from tinygrad import tensor
  from tinygrad.engine import realize
  from tinyvllm import SamplingParams
  from tinyvllm.engine.llm_engine import LLMEngine
  with on_null_cuda():
    engine = LLMEngine.from_kwargs(str(tiny_model_factory("gqa", dtype="float16")), num_kv_blocks=64, block_size=16, num_scheduler_steps=4)
    def run(tag):
      _requests(engine, tag, 2, 24, 9)
      engine.add_request(f"{tag}-logprobs", {"prompt_token_ids": [7] * 24}, SamplingParams(max_tokens=3, temperature=0, logprobs=2))
      steps = 0
      while engine.has_unfinished_requests(): engine.step(); steps += 1
      return steps
    run("first"), run("second")   # the second's prompts hit the prefix cache: a shorter prefill; the third takes no new shape
    scheduled = []
    for module in (realize, tensor):
      original = module.run_linear
      monkeypatch.setattr(module, "run_linear", lambda *a, _run=original, **kw: scheduled.append(a) or _run(*a, **kw))
    steps = run("third")
  assert steps >= 4 and not scheduled, f"{len(scheduled)} tinygrad schedules in {steps} steps"


@pytest.mark.parametrize("rows", [1, 32])
def test_a_vocabulary_argmax_lowers_to_thousands_of_threads(rows, monkeypatch):
  """A greedy GPU step's argmax over Llama 3's 128,256 logits (portable.argmax): left to itself tinygrad lowered the
  one reduction for sm_90 as 256 threads of 501 keys each (2 x 32 threads), 157 us of a 1.4 ms decode step on an H200.
  Run by run it is two kernels: the first with thousands of threads, the second a group of threads a row. Recorded
  on the CPU device (the AST is the device's own only once lowered), lowered for sm_90 with tinygrad's heuristics."""
  from tinygrad import Tensor
  from tinygrad.codegen import to_program
  from tinyvllm.kernels import portable
  monkeypatch.setenv("NVRTC_PATH", NVRTC)
  logits = Tensor.randn(rows, 128256).realize()
  with recording_kernels() as asts:
    portable.argmax(logits).realize()
  dims = [to_program(ast, h100_renderer()).arg.launch_dims({}) for ast in asts if ast.op is Ops.SINK]
  assert len(dims) == 2
  assert launch_threads(*dims[0]) >= 4096 and launch_threads(*dims[1]) >= 16 * rows


@pytest.mark.parametrize("quantization", [None, "int4"])
def test_a_decode_steps_own_kernels_coalesce_on_the_h100(tmp_path, quantization):
  """Every load and store of our kernels in decode steps of 1 and 3 sequences (float16 and INT4 weights; lowered for
  the H100 as the engine captures them) touches at most twice the 128-byte lines its bytes fill, where `warp_accesses`
  can follow its index: a gather through the block table it cannot. tinygrad's own kernels (`r_`, `E_`) are its
  heuristic's, and a prefill's attention keeps that heuristic too: not held here. A hidden size of 512 gives the
  GEMVs whole warps a row (INT4: 8 groups of 64). No kernel of x's 1/RMS: the GEMVs norm x themselves."""
  from conftest import make_tiny_llama
  from tinyvllm import SamplingParams
  from tinyvllm.engine.llm_engine import LLMEngine
  path = make_tiny_llama(tmp_path, dtype="float16", hidden_size=512, intermediate_size=1024, num_attention_heads=8,
                         num_key_value_heads=2, head_dim=64, num_hidden_layers=1, max_position_embeddings=1024)
  with on_null_cuda():
    engine = LLMEngine.from_kwargs(str(path), kernel_backend="portable", dtype="float16", max_model_len=1024, num_kv_blocks=64,
                                   max_num_seqs=3, **({"quantization": quantization} if quantization else {}))
    for batch in (1, 3):
      for i in range(batch): engine.add_request(f"{batch}-{i}", {"prompt_token_ids": [5 + i] * 40}, SamplingParams(max_tokens=3, temperature=0))
      while engine.has_unfinished_requests(): engine.step()
  decode = engine.runner.captures([shape for shape in engine.runner.replays if shape.query_len == 1])
  ours = {plain_name(p): p for replay in decode for p in captured_programs_of(replay)
          if not plain_name(p).startswith(("r_", "E_"))}
  assert any(n.startswith("gemv") for n in ours) and any(n.startswith("paged_values") for n in ours), sorted(ours)
  # the normed GEMVs sum x's squares themselves, INT4's too (gemv._squares_read): no kernel of x's 1/RMS before them
  assert not any(n.startswith("inverse_rms") for n in ours), sorted(ours)
  followed = 0
  for name, program in ours.items():
    count, loose = loose_accesses(next(u.arg for u in program.src if u.op is Ops.SOURCE))
    assert not loose, (name, loose)
    followed += count
  assert followed > 20


def test_decode_step_kernel_counts(tmp_path):
  """The kernels of a decode step as the engine captures it for the H100, a 2-layer float16 model (hidden 512, 8 heads
  over 2, intermediate 1024): at 1 sequence 7 a layer (the GEMVs: qkv with RoPE and the cache write, scores, max,
  values, o, gate/up, down), at 32 14 a layer on the tensor cores (x's 1/RMS before each normed projection; the write
  adding qkv's partial sums; scores, max, exp, values; the sums of o, gate/up and down with what follows them), and 4
  more a step around the layers (the inputs' split, the embedding; the LM head, the argmax) with 1/RMS and the LM
  head's sums at 32. A fusion lost shows here as more (docs/kernels.md)."""
  from conftest import make_tiny_llama
  from tinyvllm import SamplingParams
  from tinyvllm.engine.llm_engine import LLMEngine
  path = make_tiny_llama(tmp_path, dtype="float16", hidden_size=512, intermediate_size=1024, num_attention_heads=8,
                         num_key_value_heads=2, head_dim=64, num_hidden_layers=2, max_position_embeddings=512)
  with on_null_cuda():
    engine = LLMEngine.from_kwargs(str(path), kernel_backend="portable", dtype="float16", max_model_len=256, num_kv_blocks=512, max_num_seqs=32)
    for batch in (1, 32):
      for i in range(batch): engine.add_request(f"{batch}-{i}", {"prompt_token_ids": [5 + i] * 20}, SamplingParams(max_tokens=3, temperature=0))
      while engine.has_unfinished_requests(): engine.step()
  counts = {}
  for shape in engine.runner.replays:
    if shape.query_len == 1:
      counts[shape.num_seqs] = [plain_name(p) for replay in engine.runner.captures([shape]) for p in captured_programs_of(replay)]
  assert len(counts[1]) == 4 + 2 * 7, counts[1]
  assert len(counts[32]) == 6 + 2 * 14, counts[32]
  assert sum(n.startswith("kv_write_rope_32_") and "_sum" in n for n in counts[32]) == 2, counts[32]
