"""engine/replay.py against the tinygrad internals it leans on, on every device kind the suite reaches: the CPU device,
tinygrad's METAL device through our emulator (its graph batches captured kernels as a Mac's would), and the GPU named by
TINYVLLM_TEST_DEVICE (e.g. CUDA) when one is set. A tinygrad upgrade that changes what the replay reads fails here.

References are numpy; the inputs are random and the variable's values change between calls."""
from __future__ import annotations
import dataclasses, os, sys
import numpy as np
import pytest
from tinygrad import Device, Tensor
from tinygrad.uop.ops import Ops
from tinyvllm.engine.replay import BoundReplay, CountVariable, Replay, compile_symbolic_kernels_in_process


def _metal() -> str | None:
  """"METAL" when the (real or emulated) METAL device opens here."""
  if sys.platform != "darwin":
    if os.environ.get("TINYVLLM_EMULATE_METAL") == "0": return None
    from tinyvllm.kernels.emulator.metal_device import install
    install()
  try:
    Device["METAL"]
    return "METAL"
  except Exception: return None


DEVICES = ["CPU"] + [d for d in (_metal(), os.environ.get("TINYVLLM_TEST_DEVICE")) if d and d != "CPU"]
DEVICES = list(dict.fromkeys(DEVICES))


def greedy_on_metal(path, prompts: list[list[int]], max_tokens: int, **engine_kwargs) -> tuple[dict, set[str]]:
  """Greedy completions (logprobs=1) of token-id prompts on the emulated METAL device, by prompt index, and the names
  of the programs the engine's passes captured (its kernels). Skips where there is no METAL device."""
  from tinygrad.helpers import Context
  from test_cuda_compile import captured_programs
  from tinyvllm import SamplingParams
  from tinyvllm.engine.llm_engine import LLMEngine
  if "METAL" not in DEVICES: pytest.skip("no METAL device here (TINYVLLM_EMULATE_METAL=0)")
  outs = {}
  with Context(DEV="METAL"):
    engine = LLMEngine.from_kwargs(str(path), dtype="float32", max_model_len=64, **engine_kwargs)
    for i, p in enumerate(prompts):
      engine.add_request(str(i), {"prompt_token_ids": p}, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=1))
    while engine.has_unfinished_requests():
      for out in engine.step():
        if out.finished: outs[int(out.request_id)] = out.outputs[0]
    return outs, {p.arg.name for p in captured_programs(engine)}


def graph_programs(linear) -> list:
  """(PROGRAM, inside a graph batch?) for every kernel of a captured linear, graph batches opened."""
  out = []
  for call in linear.src:
    ast = call.src[0]
    if ast.op is Ops.CUSTOM_FUNCTION and ast.arg == "graph": out += [(c.src[0], True) for c in ast.src[0].src if c.src[0].op is Ops.PROGRAM]
    elif ast.op is Ops.PROGRAM: out.append((ast, False))
  return out


def symbolic_pass(a: Tensor, bound: object) -> Tensor:
  """Reads the first 4*count columns of a (count from a CountVariable), through an intermediate whose size follows
  the count: a kernel whose launch size is symbolic, as portable attention's over the KV blocks a step reads."""
  n = CountVariable.count(bound) * 4
  scaled = (a[:, :n] * 2 + 1).contiguous()
  return scaled.sum(1)


@pytest.mark.parametrize("device", DEVICES)
def test_replay_matches_numpy_as_the_count_changes(device):
  rng = np.random.default_rng(0)
  a_np = rng.standard_normal((8, 64)).astype(np.float32)
  a = Tensor(a_np, device=device).realize()
  count = CountVariable.make("cols", 16)
  replay = Replay(symbolic_pass)
  for c in (3, 16, 1, 7):   # the first call captures, the others replay
    out = replay(a, bound=(count.bind(c),)).numpy()
    np.testing.assert_allclose(out, (a_np[:, :4 * c] * 2 + 1).sum(1), rtol=1e-5)
  # what the replay reads of the capture: tinygrad's CapturedJit and its linear of calls
  captured = replay.jit.captured
  assert captured is not None and len(captured.linear.src) > 0
  programs = graph_programs(captured.linear)
  assert programs, "no kernels found in the capture's linear"
  graphed = any(in_graph for _, in_graph in programs)
  assert graphed == (Device[device].graph is not None and device != "CPU"), "graph batching changed on this device"
  # a graph capture replays through TinyJit's executor (no plan); plain kernels are planned and launched directly
  assert (replay.plan is None) == graphed
  bound = replay.bind(a)
  assert isinstance(bound, BoundReplay) and (bound.steps is None) == graphed
  a_np[:] = rng.standard_normal(a_np.shape)   # new values in the same buffer: a bound replay reads them
  buf = a.uop.buffer
  buf.allocator._copyin(buf._buf, memoryview(a_np).cast("B"))
  for c in (5, 2):
    out = bound(count.var_vals(c)).numpy()
    np.testing.assert_allclose(out, (a_np[:, :4 * c] * 2 + 1).sum(1), rtol=1e-5)


def _prefix_sums_kernel(count, out, a):
  """out[r] = the sum of a's row r over its first 4 * `count` columns (a kernel parameter: CountVariable.kernel_count)."""
  from tinygrad import UOp
  from tinygrad.uop.ops import AxisType, KernelInfo
  R, W = a.shape
  r, c, e = UOp.range(R, 0), UOp.range(count, 1, AxisType.REDUCE), UOp.range(4, 2, AxisType.REDUCE)
  total = a.flatten()[r * W + c * 4 + e].reduce(c, e, arg=Ops.ADD)
  return UOp.sink(out.flatten()[r].store(total).end(r), arg=KernelInfo(name="prefix_sums"))


@pytest.mark.parametrize("device", DEVICES)
def test_a_custom_kernel_binds_its_count(device):
  """A pass whose only reader of a count is a custom kernel (paged attention's kernels, the softmax's max now among
  them): `custom_kernel_binding` puts the count's bound Variable in the kernel's call, so the pass runs as it is
  traced (TinyJit's first, eager call) as well as captured and replayed at other counts. tinygrad's own
  `Tensor.custom_kernel` leaves it out, and the eager call fails as unbound: if that changes, the helper can go."""
  import functools
  from tinygrad import TinyJit
  from tinyvllm.engine.replay import custom_kernel_binding
  rng = np.random.default_rng(2)
  a_np = rng.standard_normal((8, 64)).astype(np.float32)
  a = Tensor(a_np, device=device).realize()
  count = CountVariable.make("cols_custom", 16)
  fxn = functools.partial(_prefix_sums_kernel, count.kernel_count())
  def summed(a, bound):
    return custom_kernel_binding(Tensor.empty(8, device=a.device), a, fxn=fxn, count=CountVariable.count(bound))[0]
  replay, eager = Replay(summed), TinyJit(summed)
  for c in (5, 16, 1, 7):   # Replay: the first call captures, the others replay; TinyJit: eager, capture, replays
    np.testing.assert_allclose(replay(a, bound=(count.bind(c),)).numpy(), a_np[:, :4 * c].sum(1), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(eager(a, count.bind(c)).numpy(), a_np[:, :4 * c].sum(1), rtol=1e-5, atol=1e-5)
  # a count of one value (a block table one block wide: a prefill's extent bucket of 1) is a constant to tinygrad,
  # which folds its bound Variable to one: none is bound, and the kernel reads the constant
  one = CountVariable.make("cols_one", 1)
  def first(a, bound):
    return custom_kernel_binding(Tensor.empty(8, device=a.device), a, fxn=functools.partial(_prefix_sums_kernel, one.kernel_count()),
                                 count=CountVariable.count(bound))[0]
  single = Replay(first)
  for _ in range(3): np.testing.assert_allclose(single(a, bound=(one.bind(1),)).numpy(), a_np[:, :4].sum(1), rtol=1e-5, atol=1e-5)
  plain = TinyJit(lambda a, bound: Tensor.custom_kernel(Tensor.empty(8, device=a.device), a, fxn=fxn)[0])
  with pytest.raises(RuntimeError, match="unbound Variable"): plain(a, count.bind(3)).numpy()


@pytest.mark.parametrize("device", [d for d in DEVICES if d != "CPU"])
def test_graph_launch_sizes_are_never_zero_at_zero(device):
  """tinygrad 0.14's GPU graphs (CUDAGraph, MetalGraph) build every node with the variables at 0 and CUDA refuses a zero
  grid: a CountVariable keeps every symbolic launch size positive there, where a plain variable for the count does not."""
  a = Tensor(np.random.default_rng(1).standard_normal((8, 64)).astype(np.float32), device=device).realize()
  def sizes_at_zero(replay) -> list[tuple]:
    return [p.arg.launch_dims({v.expr: 0 for v in p.arg.vars}) for p, _ in graph_programs(replay.jit.captured.linear)]

  counted = Replay(symbolic_pass)
  counted(a, bound=(CountVariable.make("cols", 16).bind(5),))
  dims = sizes_at_zero(counted)
  assert all(0 not in g and 0 not in l for g, l in dims), dims

  from tinygrad import UOp
  plain = Replay(lambda a, n: (a[:, :n * 4] * 2 + 1).contiguous().sum(1))
  plain(a, bound=(UOp.variable("cols_plain", 1, 16).bind(5),))
  assert any(0 in g for g, _ in sizes_at_zero(plain)), "a plain variable's launch size is no longer 0 at 0: rule 1 of replay.py changed"


def test_symbolic_kernels_never_go_to_the_compile_workers(monkeypatch, empty_program_cache):
  """Kernels reading a variable are lowered in this process: tinygrad's workers send programs back pickled, and a symbolic
  kernel's unsimplified cost estimate is too deep for Python 3.12's pickler (replay.py, rule 2). The pool here records
  what it is sent and compiles it in this process (the program cache emptied: it would hold them from an earlier run)."""
  from tinygrad.engine import realize
  compile_symbolic_kernels_in_process()
  sent = []
  class RecordingPool:
    def imap_unordered(self, fn, tasks):
      for task in tasks:
        sent.append(task[1][0])
        yield fn(task)
  monkeypatch.setattr(realize, "get_worker_pool", lambda: RecordingPool())
  rng = np.random.default_rng(2)
  rows, cols = 8 + int(rng.integers(1, 50)), 64 + 4 * int(rng.integers(1, 50))   # shapes no other test of this run compiled
  a = Tensor(rng.standard_normal((rows, cols)).astype(np.float32)).realize()
  b = Tensor(rng.standard_normal((rows, cols)).astype(np.float32)).realize()
  def f(a, b, bound):
    n = CountVariable.count(bound) * 4
    return ((a[:, :n] * 2).contiguous().sum(1) + (a * b).sum(1).exp(), (a - b).contiguous().max(1))
  out = Replay(f)(a, b, bound=(CountVariable.make("cols_pool", cols // 4).bind(3),))
  np.testing.assert_allclose(out[0].numpy(), (a.numpy()[:, :12] * 2).sum(1) + np.exp((a.numpy() * b.numpy()).sum(1)), rtol=1e-4)
  assert sent, "the compile pool was not used: this test no longer checks anything"
  from tinyvllm.engine.replay import _has_variables
  assert not any(_has_variables(ast) for ast in sent), "a kernel reading a variable was sent to the compile workers"


@pytest.mark.parametrize("device", [d for d in DEVICES if d != "CPU"])
def test_model_passes_graph_with_positive_launch_sizes(device, tiny_model):
  """The engine's own captures (the portable kernels, whose attention reads the KV extent as a symbolic size) on a graph
  device: every kernel a graph holds has positive launch sizes with the variables at 0, where CUDA refused the pass
  (`cuGraphAddKernelNode`: invalid argument), and greedy tokens equal the CPU device's."""
  from tinygrad.helpers import Context
  from tinyvllm import SamplingParams
  from tinyvllm.engine.llm_engine import LLMEngine
  prompt, params = list(range(5, 45)), SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
  def run(dev):
    with Context(DEV=dev):
      engine = LLMEngine.from_kwargs(str(tiny_model), kernel_backend="portable", dtype="float32", num_kv_blocks=64, block_size=8,
                                     max_num_batched_tokens=16)
      engine.add_request("0", {"prompt_token_ids": prompt}, params)
      outs = []
      while engine.has_unfinished_requests(): outs += engine.step()
      return engine, outs[-1].outputs[0].token_ids
  engine, tokens = run(device)
  assert tokens == run("CPU")[1]
  programs = [p for r in engine.runner.captures() for p, in_graph in graph_programs(r.jit.captured.linear) if in_graph]
  assert any(p.arg.vars for p in programs), "no symbolic kernel in the captured graphs: the test lost its subject"
  for p in programs:
    g, l = p.arg.launch_dims({v.expr: 0 for v in p.arg.vars})
    assert 0 not in g and 0 not in l, (p.arg.name, g, l)


@pytest.mark.parametrize("device", [d for d in DEVICES if d != "CPU"])
@pytest.mark.parametrize("backend", ["auto", "portable"])
def test_a_gpu_run_builds_nothing_for_the_cpu_device(device, backend, tiny_model_factory, monkeypatch):
  """GPU hosts often have no clang (the lent H100 has none): loading and generating on a GPU device must neither compile
  a kernel for tinygrad's CPU device nor load a CPU program."""
  from tinygrad.helpers import Context
  from tinygrad.runtime import ops_cpu
  from tinygrad.runtime.support import compiler_cpu
  from tinyvllm import SamplingParams
  from tinyvllm.engine.llm_engine import LLMEngine
  built = []
  def refuse(what):
    def fail(*a, **kw):
      built.append(what)
      raise RuntimeError(f"a GPU run built {what}")
    return fail
  monkeypatch.setattr(compiler_cpu.ClangCompiler, "compile", refuse("a CPU kernel"))
  monkeypatch.setattr(ops_cpu.CPUProgram, "__init__", refuse("a CPU program"))
  monkeypatch.setattr(ops_cpu.CPUProgram, "__call__", refuse("a CPU kernel launch"))   # programs cached by earlier tests too
  with Context(DEV=device):
    engine = LLMEngine.from_kwargs(str(tiny_model_factory("metal")), kernel_backend=backend, num_kv_blocks=64, block_size=16)
    engine.add_request("0", "Hello world", SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=2))
    outs = []
    while engine.has_unfinished_requests(): outs += engine.step()
  assert outs[-1].error is None and len(outs[-1].outputs[0].token_ids) == 4 and not built


@pytest.mark.parametrize("device", DEVICES)
def test_profiled_replays_are_correct_and_timed(device):
  """LaunchTimes.profile (the benchmark's GPU-time split): every call waits for the device and adds the device's time,
  through tinygrad's executor with wait=True for a graph capture, the launches' own timing for a planned one."""
  from tinyvllm.engine.replay import LaunchTimes
  rng = np.random.default_rng(4)
  a_np = rng.standard_normal((8, 64)).astype(np.float32)
  a = Tensor(a_np, device=device).realize()
  count = CountVariable.make("cols_profiled", 16)
  replay = Replay(symbolic_pass)
  replay(a, bound=(count.bind(2),))
  times = LaunchTimes(enabled=True, profile=True)
  bound = replay.bind(a, times=times)
  for c in (6, 3):
    np.testing.assert_allclose(bound(count.var_vals(c)).numpy(), (a_np[:, :4 * c] * 2 + 1).sum(1), rtol=1e-5)
  assert times.kernel_seconds > 0 and times.device_seconds >= 0
  if device == "CPU": assert times.device_seconds > 0   # synchronous launches: their time is the device's


@pytest.mark.parametrize("backend", ["cpu", "portable"])
def test_whole_pass_captures_compute_what_layer_captures_do(tiny_model, backend):
  """capture_mode="pass" (one capture of the whole pass, the GPU default) against "layer" (the CPU default) on the CPU
  device, through chunked prefill, decode batches of several sizes and preemption-free reuse of the shapes: the same
  kernels, so the same tokens and bitwise the same logprobs; and a pass mode shape holds one capture, not three."""
  from tinyvllm import SamplingParams
  from tinyvllm.engine.llm_engine import LLMEngine
  params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=3)
  def run(mode):
    engine = LLMEngine.from_kwargs(str(tiny_model), kernel_backend=backend, dtype="float32", num_kv_blocks=64, block_size=8,
                                   max_num_batched_tokens=16, capture_mode=mode)
    for i, n in enumerate([37, 5, 20]): engine.add_request(str(i), {"prompt_token_ids": list(range(7 + i, 7 + i + n))}, params)
    done = {}
    while engine.has_unfinished_requests():
      done |= {o.request_id: o.outputs[0] for o in engine.step() if o.finished}
    return engine, [(done[str(i)].token_ids, [{t: lp.logprob for t, lp in d.items()} for d in done[str(i)].logprobs]) for i in range(3)]
  layer_engine, layer = run("layer")
  pass_engine, whole = run("pass")
  assert whole == layer
  assert not layer_engine.runner.whole_pass and pass_engine.runner.whole_pass
  assert len(pass_engine.runner.captures()) == len(pass_engine.runner.replays) > 1
  assert len(layer_engine.runner.captures()) == 3 * len(layer_engine.runner.replays)


@pytest.mark.parametrize("device", [d for d in DEVICES if d != "CPU"])
@pytest.mark.parametrize("kv_cache_dtype,writer", [("auto", "kv_write_rope_64"), ("int8", "kv_cache_write_64")])
def test_graphed_kernels_launch_threads_in_proportion_to_their_outputs(device, kv_cache_dtype, writer, tiny_model):
  """On a GPU every range of a kernel is a grid axis, so a custom kernel whose stores have ranges of their own launches
  their product: the portable cache write launched T^2 (KVH D)^2 threads (T^4 more with int8 scales), minutes for a
  long prefill on the H100 and 30+ minutes for tests/test_gpu.py's int8 test on this device. Every graphed kernel of a
  64-token step launches at most 64 threads per element of the largest buffer it writes (tinygrad's reductions share
  up to 16 threads an output): the paged attention's kernels (kernels/paged.py) and the cache write of a float cache
  (RoPE inside) and of an int8 one (portable.write_kv, after the fix; before it the int8 step ran too long to fail, and
  the CUDA compile test bounds it without running it)."""
  from conftest import largest_output, launch_threads
  from tinygrad.helpers import Context
  from tinyvllm import SamplingParams
  from tinyvllm.engine.llm_engine import LLMEngine
  with Context(DEV=device):
    engine = LLMEngine.from_kwargs(str(tiny_model), kernel_backend="portable", dtype="float32", num_kv_blocks=64, block_size=8,
                                   max_num_batched_tokens=64, kv_cache_dtype=kv_cache_dtype)
    engine.add_request("0", {"prompt_token_ids": list(range(5, 65))}, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    while engine.has_unfinished_requests(): engine.step()
  programs = [p for r in engine.runner.captures() for p, in_graph in graph_programs(r.jit.captured.linear) if in_graph]
  names = {p.arg.name for p in programs}
  assert any(n.startswith(writer) for n in names) and any(n.startswith("paged_scores") for n in names), \
    f"no 64-token cache write or paged attention: the test lost its subject ({sorted(names)})"
  for p in programs:
    g, l = p.arg.launch_dims({v.expr: v.vmax for v in p.arg.vars})
    assert launch_threads(g, l) <= 64 * largest_output(p, p.src[0]), (p.arg.name, g, l)


@pytest.mark.parametrize("device", [d for d in DEVICES if d != "CPU"])
def test_graphs_skip_their_updates_when_nothing_changed(device, tiny_model, monkeypatch):
  """A whole-pass capture replays as GPU graphs that tinygrad rewrites node by node on every run (every node reading an
  input or the KV extent). Bound to the same inputs with the same extent as its last run, a graph is launched as it
  stands (`BoundReplay._run_graphs`): the extent changes every block_size tokens, and only those steps update. The
  tokens and logprobs are those of a run that updates every time."""
  from tinygrad.helpers import Context
  from tinyvllm import SamplingParams
  from tinyvllm.engine import replay
  from tinyvllm.engine.llm_engine import LLMEngine
  def generate(skip: bool):
    runs = {"skipped": 0, "updated": 0}
    no_updates = replay._no_updates
    def counted(runner, inputs):
      runs["skipped"] += 1
      return no_updates(runner, inputs)
    monkeypatch.setattr(replay, "_no_updates", counted)
    if not skip: monkeypatch.setattr(replay, "_skips_updates", lambda runner: False)
    with Context(DEV=device):
      engine = LLMEngine.from_kwargs(str(tiny_model), kernel_backend="portable", dtype="float32", num_kv_blocks=64, block_size=8,
                                     capture_mode="pass")
      engine.add_request("0", {"prompt_token_ids": list(range(5, 14))}, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, logprobs=1))
      out = {}
      while engine.has_unfinished_requests():
        for o in engine.step(): out = o
    (decode,) = [b for (shape, _), b in engine.runner.bound_passes.items() if shape.query_len == 1]
    assert decode[0][0].graphs, "the decode pass was not captured as graphs only: the test lost its subject"
    return out.outputs[0], runs["skipped"], len(decode[0][0].graphs)
  fast, skipped, graphs = generate(True)
  slow, none, _ = generate(False)
  assert fast.token_ids == slow.token_ids and fast.logprobs == slow.logprobs
  # 29 decode steps: the first captures; the others read 10..38 tokens, 2..5 blocks of 8: each graph updates on the
  # first bound run and when the extent grows to 3, 4 and 5 blocks, and skips its updates on the other 24
  assert none == 0 and skipped == graphs * 24


def test_tinygrad_graphs_update_from_the_lists_the_skip_empties():
  """`BoundReplay._run_graphs` skips a graph's updates by emptying the lists tinygrad 0.14's CUDA and Metal graph
  runners update from on every run (`replay.UPDATES`). Read from their source, as neither imports without its GPU
  library: if a tinygrad upgrade updates from anything else, a skipped run could launch stale nodes."""
  import importlib.util, re
  from tinyvllm.engine.replay import UPDATES
  for module in ("tinygrad.runtime.graph.cuda", "tinygrad.runtime.graph.metal"):
    source = open(importlib.util.find_spec(module).origin).read()
    call = source[source.index("def __call__"):]
    call = call[:call.index("\n  def ", 1)]
    assert "self.updatable" in call and "self.updated_launch_dims(var_vals)" in call, module
    assert set(re.findall(r"self\.(updatable|uop_replace|updated_vars|updated_launch_dims|var_vals_replace|launch_dims_replace)", call)) <= \
      {"updatable", "uop_replace", "updated_vars", "updated_launch_dims"}, module
    assert "self.updatable = sorted(" in source and all(name in source for name in UPDATES[:1])
  jit = open(importlib.util.find_spec("tinygrad.engine.jit").origin).read()
  assert "for j, vidxs in self.var_vals_replace.items()" in jit and "for j, (gl, lc) in self.launch_dims_replace.items()" in jit


@pytest.mark.parametrize("device", [d for d in DEVICES if d != "CPU"])
def test_prefill_scratch_follows_the_context_not_the_model(device, tiny_model):
  """tinygrad sizes a buffer of symbolic length at its maximum, so a prefill's attention scores took query slots x the
  whole block table whatever the prompt (17 GB for a 1024-slot step of a 131072-token, 32-head model). On a GPU a
  prefill shape also bounds the extent by a power of two of blocks, and keeps one capture whose extent only grows. A
  40-token prompt read in chunks of 16, 16 and 8 tokens (2, 4 and 5 blocks of 8): the 16-slot shape's capture grows
  from 2 to 4 blocks of the table's 32, the 8-slot one's takes 8; a later 14-token prompt runs in the 16-slot capture
  kept. The scores' buffers are that wide (a packed pass's one row of slots), and the tokens and logprobs are those of
  passes sized for the whole table."""
  from conftest import largest_output
  from tinygrad.helpers import Context
  from tinyvllm import SamplingParams
  from tinyvllm.engine.llm_engine import LLMEngine
  def generate(buckets: bool):
    outs, kept = [], []
    with Context(DEV=device):
      engine = LLMEngine.from_kwargs(str(tiny_model), kernel_backend="portable", dtype="float32", num_kv_blocks=64, block_size=8,
                                     max_model_len=256, max_num_batched_tokens=16)
      engine.runner.extent_buckets = buckets
      for i, n in enumerate((40, 14)):
        engine.add_request(str(i), {"prompt_token_ids": [5 + (i + j) % 50 for j in range(n)]},
                           SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=1))
        while engine.has_unfinished_requests():
          for o in engine.step(): out = o
        outs.append(out.outputs[0])
        kept.append({(s.query_len, s.extent) for s in engine.runner.replays if s.query_len > 1})
    return engine.runner, outs, kept
  runner, bucketed, kept = generate(True)
  _, whole, _ = generate(False)
  assert [(o.token_ids, o.logprobs) for o in bucketed] == [(o.token_ids, o.logprobs) for o in whole]
  assert runner.max_blocks == 32 and kept == [{(16, 4), (8, 8)}, {(16, 4), (8, 8)}]
  assert all(s.extent == 0 for s in runner.replays if s.query_len == 1)
  assert all(s.packed for s in runner.replays if s.query_len > 1)   # one row of slots, each finding its sequence
  for shape, (capture,) in ((s, r) for s, r in runner.replays.items() if s.query_len > 1):
    scores = [p for p, _ in graph_programs(capture.jit.captured.linear) if p.arg.name.startswith("paged_scores")]
    assert scores and all(largest_output(p, p.src[0]) == 2 * 2 * shape.query_len * shape.extent * 8 for p in scores)


@pytest.mark.parametrize("device", DEVICES + ["PYTHON"])
@pytest.mark.parametrize("host_visible", [True, False])
def test_to_host_reads_a_buffer_and_its_views(device, host_visible, monkeypatch):
  """`to_host` reads a device's memory in place where the host sees it (CPU, Metal) and through the allocator's copy
  out where it does not (CUDA, NV): the second branch is taken here by hiding `_as_buffer` from a device that has one.
  Both read whole buffers and views at an offset, of int32 and float32, as numpy wrote them."""
  from tinyvllm.engine.replay import to_host
  rng = np.random.default_rng(1)
  ints, floats = rng.integers(-2**31, 2**31 - 1, 300, dtype=np.int32), rng.standard_normal(300).astype(np.float32)
  tensors = [Tensor(ints, device=device).realize(), Tensor(floats, device=device).realize()]
  allocator = tensors[0].uop.buffer.allocator
  if not host_visible:
    if not hasattr(allocator, "_as_buffer"): pytest.skip(f"{device} has no host-visible memory to hide")
    monkeypatch.delattr(type(allocator), "_as_buffer")
  for t, ref in zip(tensors, (ints, floats)):
    np.testing.assert_array_equal(to_host(t.uop.buffer), ref)
    view = t.uop.buffer.view(100, t.uop.buffer.dtype, 37 * ref.itemsize).ensure_allocated()
    np.testing.assert_array_equal(to_host(view), ref[37:137])


@pytest.mark.parametrize("device,backend,packed,extra", [
    ("CPU", "cpu", True, {}), ("CPU", "portable", True, {}), ("CPU", "portable", False, {}),
    ("CPU", "cpu", True, {"num_scheduler_steps": 9}),                          # a run past a block from position 0
    ("CPU", "cpu", True, {"max_model_len": 20}),                               # a budget of several sequences' chunks
    ("CPU", "cpu", True, {"draft_model": "self:1", "speculation": "always"}),  # the draft's shapes, and verification's
    ("METAL", "portable", True, {"num_scheduler_steps": 4})])
def test_warm_up_captures_every_shape_the_requests_then_take(tiny_model, monkeypatch, device, backend, packed, extra):
  """`LLMEngine.warm_up` (a GPU server's, before serving) runs a pass of every decode batch size and prefill shape the
  limits allow (packed: each token count; padded: each pair of chunk count and length; multi-step: whole runs; with a
  draft model its shapes and verification's): then requests of every size, arriving while others decode, chunked and
  preempted, capture nothing more, and the dummy passes (block 0 written with junk) change no token: each is HF's
  greedy continuation. On a GPU kind (the emulated METAL device) a multi-step run turns through two graphs, which a
  warm-up of one pass left to the first request. After a request, warm_up refuses (it would write cached blocks)."""
  from tinygrad.helpers import Context
  from tinyvllm.kernels import Kernels
  monkeypatch.setattr(Kernels, "packs_prefill", packed)
  with Context(DEV=device): run_warmed_up(tiny_model, backend, packed, extra)


def run_warmed_up(tiny_model, backend: str, packed: bool, extra: dict) -> None:
  from test_multi_step import hf_greedy
  from tinyvllm import SamplingParams
  from tinyvllm.engine.llm_engine import LLMEngine
  engine = LLMEngine.from_kwargs(str(tiny_model), kernel_backend=backend, block_size=8, num_kv_blocks=12, max_num_seqs=4,
                                 max_num_batched_tokens=32, enable_prefix_caching=False, **extra)
  assert engine.runner.packs_prefill == packed
  runners = [engine.runner] + ([engine.spec.runner] if engine.spec else [])
  captured = engine.warm_up(progress=False)
  assert captured == sum(len(r.replays) for r in runners) > 0
  # each shape's captured graphs (a multi-step run's turns through two on a GPU); a GPU bounds a prefill shape's extent
  # by the context its first pass read, and a longer one captures it again, here ignored (docs/serving.md)
  # the draft's: its decode shapes (its catch-up passes read all a sequence's unread tokens, beyond any budget)
  kept = lambda: [{(dataclasses.replace(s, extent=0), turn) for s, turn in r.bound_passes if r is engine.runner or s.is_decode}
                  for r in runners]
  warmed = kept()
  assert {s.num_seqs for s, _ in warmed[0] if s.is_decode} == {1, 2, 4}
  assert len({turn for _, turn in warmed[0]}) == engine.runner.run_graphs
  if engine.spec: assert {s.num_seqs for s, _ in warmed[0] if s.all_logits} == {1, 2, 4}   # verifying 5 tokens a sequence
  rng = np.random.default_rng(4)
  longest = engine.max_model_len - 6
  prompts = [rng.integers(4, 380, n).tolist() for n in (1, 3, 9, 17, 30, 33, 8, 2, 40, 12, 14, 11, 13) if n <= longest]
  params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
  outs, waiting = {}, list(enumerate(prompts))
  while waiting or engine.has_unfinished_requests():
    for _ in range(int(rng.integers(0, 4))):   # 0 to 3 arrive between steps
      if waiting:
        i, p = waiting.pop(0)
        engine.add_request(str(i), {"prompt_token_ids": p}, params)
    if engine.has_unfinished_requests():
      for o in engine.step():
        if o.finished: outs[int(o.request_id)] = o.outputs[0].token_ids
  assert engine.scheduler.num_preemptions > 0 or engine.max_model_len < 32
  assert kept() == warmed, [k - w for k, w in zip(kept(), warmed)]
  for i, p in enumerate(prompts): assert outs[i] == hf_greedy(str(tiny_model), tuple(p), 6), i
  with pytest.raises(RuntimeError, match="before the first request"): engine.warm_up(progress=False)
