"""Captured passes and their replay: the engine's one module that leans on tinygrad's internals.

The model runner captures each pass shape once with TinyJit and replays it every step after that (`Replay`, bound to
its long-lived inputs as `BoundReplay`). TinyJit's own replay checks every input on every call and resolves every
kernel argument anew, which costs more than a decode step's kernels on the CPU device; so after a capture the plan of
launches is read out of the captured graph and replayed directly. That reading relies on tinygrad 0.14 details, each
named here and checked by tests/test_replay.py on every device kind the suite reaches (CPU, the emulated METAL device,
and a GPU when TINYVLLM_TEST_DEVICE names one), so a tinygrad upgrade that changes them fails loudly there:

- `TinyJit.cnt` (set to 1 to capture on the first call) and `TinyJit.captured` (a `CapturedJit`);
- `CapturedJit.linear.src`: the calls of a capture, each `CALL(PROGRAM | COPY | graph CUSTOM_FUNCTION, *args)`;
  `CapturedJit._written_uops` and `expected_input_info`;
- `get_call_arg_uops`, `get_runtime`, `ProgramInfo.launch_dims/vals`, `Buffer._buf`, `Allocator._copyin/_copyout/_transfer`
  and `_as_buffer` (host-visible memory);
- for a pipelined decode on CUDA (`OrderedCopies`): `CUDADevice.context`, `tinygrad.runtime.ops_cuda.check` and the
  driver calls of `tinygrad.runtime.autogen.cuda`, on the legacy default stream tinygrad launches on;
- the compile worker pool of `tinygrad.engine.realize.lower_and_compile` (see `compile_symbolic_kernels_in_process`);
- a custom kernel's call built by hand with bound Variables among its arguments (`custom_kernel_binding`, which
  kernels/paged.py's attention calls: `UOp.placeholder_like`, `UOp.call`, and `create_linear_with_vars` reading a
  pass's variable values from them);
- tinygrad's in-process cache of lowered programs, `tinygrad.codegen.to_program_cache` (which `realize` imports by
  name) and its key `to_program_key` (`ProgramCache` keeps it on disk too).

Two rules of tinygrad's GPU graphs shape what a capture may contain (docs/architecture.md, "Devices"):

1. A graph is built with every symbolic launch size evaluated with its variables at 0 (tinygrad 0.14's CUDAGraph and
   MetalGraph both do `launch_dims({v: 0 ...})`), and only updated to the real values when it runs. CUDA refuses a
   kernel node with a zero grid dimension (`cuGraphAddKernelNode`: CUDA Error 1, invalid argument), so a count that
   sizes a kernel must never be 0 at the variable's 0: `CountVariable` stores count - 1.
2. Kernels are lowered in spawned worker processes and sent back pickled. A kernel with a symbolic loop carries its
   cost estimate as an unsimplified sum, one ADD per operation (about 750 deep for a 1024-token attention kernel);
   Python 3.12's pickler gives up on it (its C recursion limit is fixed), the worker dies while reporting the error,
   and the compile hangs or fails with RecursionError. Such kernels are lowered in this process instead.
3. The same estimate sits in the lowered program (its SINK's `KernelInfo.estimates`), and a GPU graph hashes every
   program it holds (`get_runtime` -> `UOp.key` -> the repr of that argument): a repr 500 deep exceeds Python's
   recursion limit, so the graph of a 512-token step of a 32-head model failed to build with RecursionError on the
   H100 (a CUDA graph; a Metal graph hashes the same way). The estimates feed only tinygrad's statistics
   (GlobalCounters, DEBUG output): they are simplified, and a term still deep after that becomes its value at the
   variables' maxima, an upper bound (`shallow_estimates`).
"""
from __future__ import annotations
import contextlib, ctypes, functools, hashlib, logging, os, pickle, platform, sys, threading, time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable
import numpy as np
from tinygrad import Tensor, TinyJit, UOp
from tinygrad.dtype import AddrSpace, _to_np_dtype
from tinygrad.renderer import Estimates
from tinygrad.uop.ops import KernelInfo, Ops, sym_infer

logger = logging.getLogger("tinyvllm")


@dataclass(frozen=True)
class CountVariable:
  """A count in [1, hi] that sizes kernels of a captured pass (the KV blocks a step reads), kept as the variable
  count - 1 in [0, hi - 1]: a graph built with the variable at 0 then sizes those kernels for a count of 1, never 0
  (rule 1 above)."""
  var: UOp

  @staticmethod
  def make(name: str, hi: int) -> CountVariable: return CountVariable(UOp.variable(f"{name}_minus_1", 0, hi - 1))

  def bind(self, count: int) -> UOp:
    """The bound variable to pass to a capture for this count."""
    return self.var.bind(count - 1)

  def var_vals(self, count: int) -> dict[str, int]:
    """The variable values of a bound replay for this count."""
    return {self.var.expr: count - 1}

  def kernel_count(self) -> UOp:
    """The count as a kernel written in UOps reads it: the Variable as a kernel parameter (a custom kernel's AST cannot
    hold the bound form; the value comes from the capture's bound variables, by name)."""
    v = self.var
    return UOp.variable(v.arg.name, *v.arg.vmin_vmax, dtype=v.dtype, param=True) + 1

  @staticmethod
  def count(bound: UOp) -> UOp:
    """Inside a captured function: the count, from the bound variable it was passed."""
    return bound + 1


def custom_kernel_binding(*tensors: Tensor, fxn: Callable, count) -> list[Tensor]:
  """`Tensor.custom_kernel` whose call also carries the bound Variables of `count` (`CountVariable.count`'s result,
  or an int: none): a kernel that reads a count as a parameter (`kernel_count`) then finds its value in the pass
  whatever else the pass holds. tinygrad takes a pass's variable values from the bound Variables among its calls'
  arguments (`create_linear_with_vars`), which a tensor op's shape puts there and `Tensor.custom_kernel` never does:
  a pass whose only readers of the count were custom kernels failed with "unbound Variable". This builds the call as
  `UOp.custom_kernel` does (a placeholder per tensor, `.call`) with the bound Variables appended, as tinygrad's own
  `Tensor.decode_hevc_frame` passes its frame position."""
  # a Variable of one value (a table one block wide) is folded to a constant inside tinygrad: nothing to bind
  binds = [u for u in count.toposort() if u.is_bound_var and u.src[0].vmin != u.src[0].vmax] if isinstance(count, UOp) else []
  srcs = [t.uop for t in tensors]
  kernel = fxn(*(UOp.placeholder_like(s, slot=i) for i, s in enumerate(srcs))).call(*srcs, *binds)
  return [Tensor(s.after(kernel)) for s in srcs]


def _has_variables(ast: UOp) -> bool:
  return any(x.op is Ops.PARAM and x.arg.addrspace is AddrSpace.ALU for x in ast.toposort())


# deeper than this, a UOp's repr (pretty_print, a few Python frames a level) nears Python's default recursion limit
MAX_ESTIMATE_DEPTH = 64


def _depth(x) -> int:
  if not isinstance(x, UOp): return 0
  depth: dict[UOp, int] = {}
  for u in x.toposort(): depth[u] = 1 + max((depth[s] for s in u.src), default=0)
  return depth[x]


def shallow_estimates(program: UOp) -> UOp:
  """`program` (a lowered PROGRAM) with cost estimates that its hash can print (rule 3 above): simplified, and a
  term still deeper than MAX_ESTIMATE_DEPTH replaced by its value at the variables' maxima. Returns `program`
  itself when its estimates are shallow already."""
  sink = program.src[0]
  est = sink.arg.estimates if isinstance(sink.arg, KernelInfo) else None
  if est is None or max(map(_depth, (est.ops, est.lds, est.mem))) <= MAX_ESTIMATE_DEPTH: return program
  top = {v.expr: v.vmax for v in program.arg.vars}
  simple = est.simplify()
  est = Estimates(*(x if _depth(x) <= MAX_ESTIMATE_DEPTH else sym_infer(x, top) for x in (simple.ops, simple.lds, simple.mem)))
  return program.replace(src=(sink.replace(arg=replace(sink.arg, estimates=est)), *program.src[1:]))


def lower_in_process(ast: UOp, renderer) -> UOp:
  """Lower and compile one kernel here (tinygrad's `to_program`, through its cache) with shallow estimates."""
  from tinygrad import codegen
  key = codegen.to_program_key(ast, renderer)
  codegen.to_program_cache[key] = program = shallow_estimates(codegen.to_program(ast, renderer))
  return program


def _call_cached_programs(linear: UOp) -> UOp:
  """`linear` with each of its calls of a kernel that tinygrad's program cache holds calling the program instead (a
  call of a compiled PROGRAM is one `lower_and_compile` leaves alone). tinygrad swaps a program in with `substitute`,
  which goes on to walk the whole lowered program: about a tenth of a second a kernel, 5 s of the capture of a
  30-layer model's passes even when every program came from the disk cache."""
  from tinygrad import codegen
  from tinygrad.engine import realize
  if linear.op is not Ops.LINEAR: return linear
  calls = []
  for call in linear.src:
    todo = realize._get_call_to_compile(call) if call.op is Ops.CALL else None
    if todo is not None and call.src[0] is todo[0] and (program := codegen.to_program_cache.get(codegen.to_program_key(*todo))) is not None:
      call = call.replace(src=(program, *call.src[1:]))
    calls.append(call)
  return linear.replace(src=tuple(calls))


def compile_symbolic_kernels_in_process() -> None:
  """Lower every kernel that reads a variable in this process, before tinygrad sends the rest to its compile workers
  (rule 2 above), with shallow estimates (rule 3), and call the programs tinygrad's program cache holds directly
  (`_call_cached_programs`). It only fills that cache and swaps its programs in ahead of `lower_and_compile`, so what
  is compiled, and how, stays tinygrad's. Idempotent."""
  from tinygrad.engine import realize
  if getattr(realize.lower_and_compile, "symbolic_in_process", False): return
  lower_and_compile = realize.lower_and_compile

  def lower_symbolic_first(linear: UOp) -> UOp:
    for call in linear.toposort():
      if call.op is Ops.CALL and (todo := realize._get_call_to_compile(call)) is not None and _has_variables(todo[0]):
        lower_in_process(*todo)
    return lower_and_compile(_call_cached_programs(linear))
  lower_symbolic_first.symbolic_in_process = True
  realize.lower_and_compile = lower_symbolic_first


# environment variables tinygrad's codegen and renderers read directly (not ContextVars, so not in its program key)
RAW_KNOBS = ("THREADS", "MV", "MV_BLOCKSIZE", "MV_THREADS_PER_ROW", "MV_ROWS_PER_THREAD", "OCCUPANCY_FLOOR", "TUPLE_ORDER",
             "ALLOW_HALF8", "EXPAND_SSA", "ALIGNED", "FLOAT16")


@functools.cache
def _lowering_fingerprint() -> str:
  """What besides a program key decides how a kernel lowers: tinygrad's sources (a checkout of another commit keeps
  the version number), Python's version (the pickle) and the machine (the CPU device compiles for the host's CPU)."""
  import tinygrad
  digest = hashlib.sha256(f"{sys.version_info[:2]} {platform.machine()}".encode())
  root = Path(tinygrad.__file__).parent
  for path in sorted(root.rglob("*.py")): digest.update(str(path.relative_to(root)).encode() + path.read_bytes())
  return digest.hexdigest()


class ProgramCache(dict):
  """tinygrad's cache of lowered and compiled programs (`codegen.to_program_cache`), kept on disk as well.

  tinygrad caches a compiled binary on disk, but lowering a kernel to it (its rewrites, in Python) is the slow part and
  is cached only for the life of a process: about 0.5 s a kernel on a slow core, so a model's passes (about 80 distinct
  kernels a capture shape) took most of a minute to capture, on every start. Here a program tinygrad lowers is
  pickled under its key (tinygrad's own `to_program_key`: the kernel's AST, the renderer and its target, tinygrad's
  program config; with `_lowering_fingerprint`), and a later process loads it instead of lowering it again.

  tinygrad's codegen also reads a few environment variables directly (`RAW_KNOBS`, in the key too; a BEAM search's
  own knobs are not); `CACHELEVEL=0`, tinygrad's switch for its disk caches, turns this one off, and so does
  `DEBUG>=3` (tinygrad prints a kernel's opts and source while lowering it). A file that cannot be read is lowered
  again and rewritten; a cache that cannot be written (read-only, full) is left to memory. Programs for the CPU device
  are compiled for this machine's CPU: the directory is not for sharing between machines."""
  def __init__(self, directory: Path, programs: dict):
    super().__init__(programs)
    self.directory = directory
    self.loaded = self.stored = 0   # programs read from disk and written to it, by this process
    self._warned = False

  @staticmethod
  def enabled() -> bool:
    from tinygrad.helpers import CACHELEVEL, DEBUG
    return CACHELEVEL.value > 0 and DEBUG.value < 3

  def path(self, key: tuple) -> Path:
    ast_key, renderer, *rest = key
    # which METAL runtime compiles: our emulator's library is the MSL itself (checked against the macOS it emulates),
    # where a Mac's is a metallib
    metal = sys.modules.get("tinygrad.runtime.ops_metal")
    metal = (metal.__name__, getattr(metal, "emulated_macos", lambda: None)()) if metal is not None else None
    knobs = tuple(os.environ.get(k) for k in RAW_KNOBS)
    name = repr((_lowering_fingerprint(), ast_key.hex(), f"{renderer.__module__}.{renderer.__qualname__}", *rest, metal, knobs))
    return self.directory / f"{hashlib.sha256(name.encode()).hexdigest()}.pkl"

  def _warn(self, what: str, error: Exception) -> None:
    if not self._warned: logger.warning("lowered-program cache %s: %s: %s", self.directory, what, error)
    self._warned = True

  def _read(self, key: tuple) -> UOp | None:
    if not self.enabled(): return None
    path = self.path(key)
    try: file = open(path, "rb")
    except OSError: return None   # not there, or no directory we may read
    try:
      with file: program = pickle.load(file)
    except Exception as e:   # truncated, or written by another version: lowered again, and rewritten
      self._warn("a file could not be read, its kernel is lowered again", e)
      return None
    dict.__setitem__(self, key, program)
    self.loaded += 1
    with contextlib.suppress(OSError): os.utime(path)   # used now: `trim` removes the least recently used
    return program

  def __contains__(self, key) -> bool: return dict.__contains__(self, key) or self._read(key) is not None

  def get(self, key, default=None):
    if dict.__contains__(self, key): return dict.__getitem__(self, key)
    program = self._read(key)
    return default if program is None else program

  def __getitem__(self, key):
    if (program := self.get(key)) is None: raise KeyError(key)
    return program

  def __setitem__(self, key, program) -> None:
    if dict.get(self, key) is program: return   # read from disk, or stored already
    dict.__setitem__(self, key, program)
    if not self.enabled(): return
    try: data = pickle.dumps(program, protocol=pickle.HIGHEST_PROTOCOL)
    except RecursionError: return   # a symbolic kernel's deep estimates (rule 2): stored once `shallow_estimates` made them shallow
    except Exception as e:
      self._warn("a program could not be pickled, it stays in memory", e)
      return
    path = self.path(key)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
      self.directory.mkdir(parents=True, exist_ok=True)
      tmp.write_bytes(data)
      os.replace(tmp, path)   # readers in other processes see a whole file or none
      self.stored += 1
    except OSError as e:   # read-only, full: the program stays in memory
      self._warn("not writable, programs stay in memory", e)
      with contextlib.suppress(OSError): tmp.unlink()

  def trim(self, max_bytes: int) -> None:
    """Delete the least recently used programs (a load touches its file) while the files hold more than `max_bytes`,
    down to three quarters of it: every model and shape a machine ever ran adds its kernels."""
    files, day_ago = [], time.time() - 86400
    try:
      for entry in os.scandir(self.directory):
        with contextlib.suppress(OSError):   # gone meanwhile: another process trimmed it
          st = entry.stat()
          if entry.name.endswith(".pkl"): files.append((st.st_mtime, st.st_size, entry.path))
          elif entry.name.endswith(".tmp") and st.st_mtime < day_ago: os.unlink(entry.path)   # a writer died
    except OSError: return   # no directory yet, or none we may read
    files.sort()
    total = sum(size for _, size, _ in files)
    if total <= max_bytes: return
    for _, size, path in files:
      with contextlib.suppress(OSError): os.unlink(path)
      if (total := total - size) <= max_bytes * 3 // 4: break


def cache_programs_on_disk(directory: Path, max_bytes: int = 1 << 30) -> ProgramCache:
  """Keep tinygrad's lowered programs in `directory` (`ProgramCache`, trimmed to `max_bytes`) from now on, for every
  kernel this process lowers: tinygrad's `codegen.to_program` and `realize.lower_and_compile` both look programs up in
  the cache put here. A second call keeps the programs in memory and moves the cache to `directory`."""
  from tinygrad import codegen
  from tinygrad.engine import realize
  cache = codegen.to_program_cache
  if not isinstance(cache, ProgramCache):
    cache = ProgramCache(directory, cache)
    codegen.to_program_cache = realize.to_program_cache = cache
  elif cache.directory == directory: return cache
  cache.directory = directory
  cache.trim(max_bytes)
  return cache


class Replay:
  """A TinyJit captured on its first call and replayed directly afterwards.

  TinyJit checks every input on every call (~25 us each), and its executor resolves every kernel argument
  anew; a layer runs 30 times a pass. So after the capture each kernel's runtime and argument buffers are
  resolved once (`_plan`), and a replay only swaps in the input buffers and calls the programs. Callers pass
  the same kinds of buffers in the same order each time, which is what TinyJit's checks verify. Inputs are
  whole buffers, never views (a view would need resolving per call), and never a buffer the graph itself
  writes (TinyJit copies those; such calls take the general path).

  A capture that tinygrad batched into a graph (CUDA graphs, Metal's indirect command buffers) has no plan: it
  replays through TinyJit's executor, which runs the graph.

  A multi-device capture (tensor parallelism) is planned the same way, one entry per device a kernel runs on, and
  its copies between devices (the all-reduces) as the executor would do them: the same calls, in the same order,
  with their buffers resolved once. TinyJit's executor instead walks each kernel's whole program once per call to
  find its device index, which cost more than the kernels themselves on the CPU devices here (docs/architecture.md,
  "Tensor parallelism")."""
  def __init__(self, fn):
    compile_symbolic_kernels_in_process()
    def run(*args):
      out = fn(*args)
      if isinstance(out, Tensor): return out.realize()
      Tensor.realize(*out)
      return out
    self.jit = TinyJit(run)
    self.jit.cnt = 1   # capture on the first call: weights and caches are realized, a warm-up run would only cost time
    self.plan: list | None = None
    self.handles: dict[UOp, tuple] = {}           # input buffer -> its device handle(s), one per device it spans

  def __call__(self, *args: Tensor, bound: tuple[UOp, ...] = ()):
    if self.jit.captured is None:
      out = self.jit(*args, *bound)
      self.plan = self._plan(self.jit.captured)
      return out
    return self.bind(*args)({var.expr: val for var, val in (b.unbind() for b in bound)})

  def bind(self, *args: Tensor, times: LaunchTimes | None = None) -> BoundReplay:
    """This replay with its inputs fixed: for the runner's passes, whose inputs are the same long-lived buffers every
    step (weights, caches, its own input and hidden buffers), so a step need not resolve them again. Call after the
    capture. `times`: where to count launch times when enabled."""
    return BoundReplay(self, args, times)

  def _handle(self, u: UOp) -> tuple:
    """The device handle(s) of an input buffer, looked up once: callers pass long-lived buffers (weights, caches,
    the runner's own input and hidden buffers), and resolving ~20 per layer replay cost ~0.2 ms each time.
    The cache keeps those buffers alive: a caller must not pass short-lived tensors."""
    self.handles[u] = tuple(b.ensure_allocated().get_buf(b.device) for b in device_buffers(u.buffer))
    return self.handles[u]

  @staticmethod
  def _plan(captured) -> list | None:
    """[(runtime, arguments, program info, device variables) per kernel and device it runs on], or None when the
    captured graph holds anything but plain kernels and copies with whole-buffer arguments. An argument is (input
    slot, None), or (None, device handle) for a buffer the graph holds itself (weights, scratch): those handles are
    looked up once, here, not per replay. A copy is (None, a call doing it, None, None). Input slots count one per
    device: a multi-device input takes as many slots as it has devices."""
    from tinygrad.device import Buffer
    from tinygrad.engine.realize import get_call_arg_uops, get_runtime
    from tinygrad.uop.ops import AxisType
    spans = [len(d) if isinstance(d := info[3], tuple) else 1 for info in captured.expected_input_info]
    first = [sum(spans[:i]) for i in range(len(spans))]   # each input's first slot in the flat list of handles
    plan = []
    for call in captured.linear.src:
      ast = call.src[0]
      args = get_call_arg_uops(call)
      if ast.op is Ops.COPY:
        if any(x.op is Ops.PARAM for a in args for x in a.toposort()): return None
        for dest, src in zip(*(device_buffers(a.buffer) for a in args[:2])):
          if (copy := _copy(dest.ensure_allocated(), src.ensure_allocated())) is None: return None
          plan.append((None, copy, None, None))
        continue
      if ast.op is not Ops.PROGRAM: return None
      devices = call.src[1].device if isinstance(call.src[1].device, tuple) else (call.src[1].device,)
      # as tinygrad's unwrap_multi: a kernel that reads its device index gets it as the _device_num variable
      numbered = len(devices) > 1 and any((x.op is Ops.RANGE and x.arg[-1] is AxisType.DEVICE) or
                                          (x.op is Ops.PARAM and x.arg.name == "_device_num") for x in ast.toposort())
      for j, device in enumerate(devices):
        specs = []
        for i in ast.arg.globals:
          u = args[i]
          if u.op is Ops.PARAM and spans[u.arg.slot] == len(devices): specs.append((first[u.arg.slot] + j, None))
          elif any(x.op is Ops.PARAM for x in u.toposort()): return None   # derived from an input: resolved per call
          elif isinstance(buf := u.buffer, Buffer) and len(devices) == 1: specs.append((None, buf.ensure_allocated().get_buf(device)))
          elif not isinstance(buf, Buffer) and len(buf.bufs) == len(devices):
            specs.append((None, buf.bufs[j].ensure_allocated().get_buf(device)))
          else: return None
        plan.append((get_runtime(device, ast), specs, ast.arg, {"_device_num": j} if numbered else {}))
    return plan


def _programs(u: UOp) -> int:
  """Kernels in a capture's calls (`CapturedJit.linear`): a PROGRAM is one, a GPU graph (CUSTOM_FUNCTION) holds its own
  linear of them."""
  if u.op is Ops.PROGRAM: return 1
  return sum(_programs(x) for x in u.src)


@dataclass
class LaunchTimes:
  """Seconds spent in kernels and in copies between devices (tensor parallelism's all-reduces) by the runner's
  bound passes, counted while `enabled`: the benchmark's split of a step into compute, synchronization and host
  time. Off, a pass pays one attribute check.

  On a GPU a launch only queues work, so `kernel_seconds` is the host's time to launch; `wait_seconds` is the time the
  host then waited for the GPU (the runner times its synchronize before reading the logits), and with `profile` set
  every call waits for the GPU and adds the GPU's own time for it (tinygrad's event timing) to `device_seconds`:
  that serializes host and GPU, so only a separate, profiled step sets it. `kernels` counts the kernels launched
  (inside a GPU graph too: each is a launch the device pays for)."""
  enabled: bool = False
  kernels: int = 0
  kernel_seconds: float = 0.0
  copy_seconds: float = 0.0
  wait_seconds: float = 0.0
  profile: bool = False
  device_seconds: float = 0.0


class BoundReplay:
  """A `Replay` bound to one list of inputs, called with the variables' values only.

  Each kernel's arguments are gathered once, and its launch (sizes, variable arguments) once per distinct set of
  variable values (the KV extent changes every block_size tokens). The runner binds each pass once and a decode
  step makes one call per layer: resolving a layer's 24 inputs and launch sizes on every call cost about 40 us of
  Python (1.2 ms a step on the default model, 13 % of a batch-1 decode step). `Replay.__call__` binds per call.
  Inputs the capture writes, or a capture without a plan, take TinyJit's own path on every call."""
  def __init__(self, replay: Replay, args: tuple[Tensor, ...], times: LaunchTimes | None = None):
    self.times = times or LaunchTimes()
    self.captured = captured = replay.jit.captured
    self.inputs = inputs = [input_uop(a) for a in args]
    self.steps = None
    if replay.plan is not None and not any(u in captured._written_uops for u in inputs):
      raw = [h for u in inputs for h in (replay.handles[u] if u in replay.handles else replay._handle(u))]
      self.steps = [(rt, specs if rt is None else [raw[slot] if slot is not None else handle for slot, handle in specs], info, device_vars)
                    for rt, specs, info, device_vars in replay.plan]
    self.launches: dict[tuple, list[Callable[[], None]]] = {}   # variable values -> each step's launch
    self.ret = captured.ret
    self.kernel_count = sum(rt is not None for rt, *_ in self.steps) if self.steps is not None else _programs(captured.linear)
    # a capture tinygrad batched into GPU graphs only, none of whose inputs it writes: its graphs, run here (`_run_graphs`)
    self.token = object()
    calls = [c.src[0] for c in captured.linear.src]
    self.graphs = calls if self.steps is None and calls and not any(u in captured._written_uops for u in inputs) and \
      all(c.op is Ops.CUSTOM_FUNCTION and c.arg == "graph" for c in calls) else None

  def __call__(self, var_vals: dict[str, int]) -> Tensor | tuple[Tensor, ...]:
    """Run with `var_vals` (variable name -> value)."""
    if self.times.enabled: return self._timed(var_vals)
    if self.graphs is not None: return self._run_graphs(var_vals)
    if self.steps is None:
      _forget_graph_runs(self.captured)   # tinygrad's executor updates any graphs it runs: no later skip may trust them
      return self.captured(self.inputs, var_vals)
    for launch in self._launches(var_vals): launch()
    return self.ret

  def _run_graphs(self, var_vals: dict[str, int]) -> Tensor | tuple[Tensor, ...]:
    """Run each graph as TinyJit's executor would, but skip its updates when nothing changed. A CUDA or Metal graph
    runner rewrites every node that reads an input or a variable on every run (CUDA: a cuGraphExecKernelNodeSetParams
    each, after Python works out its arguments and sizes): the attention kernels of every layer, each step. Run with
    the same inputs and variable values as its last run, none of that changes: the graph is launched as it stands.
    The KV extent changes every block_size tokens, so 15 steps of 16 skip the updates. A graph shared by other bound
    replays (layer captures) updates whenever the caller changes."""
    from tinygrad.engine.realize import get_graph_runtime
    # this replay's own token (a graph holds the last one it ran for, so no later replay can be mistaken for that one)
    inputs, key = tuple(self.inputs), (self.token, tuple(sorted(var_vals.items())))
    for ast in self.graphs:
      runner = get_graph_runtime(ast, inputs)
      if getattr(runner, "_tinyvllm_last", None) == key and _skips_updates(runner):
        with _no_updates(runner, inputs): runner(inputs, var_vals)
      else:
        runner(inputs, var_vals)
        runner._tinyvllm_last = key
    return self.ret

  def _launches(self, var_vals: dict[str, int]) -> list[Callable[[], None]]:
    key = tuple(var_vals.values())
    if (launches := self.launches.get(key)) is None:
      if len(self.launches) > 256: self.launches.clear()
      launches = self.launches[key] = [args if rt is None else _launch(rt, args, info, {**var_vals, **device_vars} if device_vars else var_vals)
                                       for rt, args, info, device_vars in self.steps]
    return launches

  def _timed(self, var_vals: dict[str, int]) -> Tensor | tuple[Tensor, ...]:
    """__call__ with each launch timed into self.times (kernels and copies apart); TinyJit's path counts as kernels.
    Profiling, each call waits for the device and its device time is added to device_seconds."""
    times = self.times
    times.kernels += self.kernel_count
    if self.steps is None:
      t = time.perf_counter()
      if times.profile: times.device_seconds += self._run_waiting(var_vals)
      elif self.graphs is not None: self._run_graphs(var_vals)
      else:
        _forget_graph_runs(self.captured)
        self.captured(self.inputs, var_vals)
      times.kernel_seconds += time.perf_counter() - t
      return self.ret
    for launch, (rt, *_) in zip(self._launches(var_vals), self.steps):
      t = time.perf_counter()
      waits = times.profile and isinstance(launch, functools.partial) and launch.func is rt   # a tinygrad program: it can wait
      took = launch(wait=True) if waits else launch()
      dt = time.perf_counter() - t
      if rt is None: times.copy_seconds += dt
      else:
        times.kernel_seconds += dt
        if times.profile: times.device_seconds += took if waits and took is not None else dt   # our C programs run synchronously
    return self.ret

  def _run_waiting(self, var_vals: dict[str, int]) -> float:
    """Run the capture through tinygrad's executor, waiting for each call (graph or kernel) to finish; returns the
    device seconds tinygrad measured for them (GPU events on CUDA). Inputs the capture writes are copied first, as
    CapturedJit.__call__ does."""
    from tinygrad.engine.jit import _copy_input
    from tinygrad.engine.realize import run_linear
    from tinygrad.helpers import GlobalCounters
    captured = self.captured
    inputs = tuple(_copy_input(u) if u in captured._written_uops else u for u in self.inputs)
    _forget_graph_runs(captured)   # the graphs are updated here: a later `_run_graphs` must not skip its update
    before = GlobalCounters.time_sum_s
    run_linear(captured.linear, var_vals, input_uops=inputs, jit=True, wait=True)
    return GlobalCounters.time_sum_s - before


UPDATES = ("updatable", "var_vals_replace", "launch_dims_replace")   # what CUDAGraph and MetalGraph update on every run


def _skips_updates(runner) -> bool:
  """Does this graph runner keep its update lists where `_no_updates` can empty them (CUDA's and Metal's do; the HCQ
  graph of NV/AMD updates otherwise and runs as it is)?"""
  return all(hasattr(runner, name) for name in UPDATES)


def _forget_graph_runs(captured) -> None:
  """Clear what the capture's graphs remember of their last `_run_graphs`, before anything else runs them."""
  from tinygrad.engine.realize import graph_cache
  for call in captured.linear.src:
    if hasattr(runner := graph_cache.get(call.src[0]), "_tinyvllm_last"): del runner._tinyvllm_last


@contextlib.contextmanager
def _no_updates(runner, inputs: tuple[UOp, ...]):
  """The runner with nothing to update for one run: its nodes keep the buffers, values and sizes of its last run. A
  Metal graph declares the buffers a run uses from its own list plus the inputs its updates set: those inputs are
  added to the list for the run."""
  saved = tuple(getattr(runner, name) for name in UPDATES) + (getattr(runner, "all_resources", None),)
  if saved[-1] is not None:
    used = [inputs[i].buffer._buf.buf for j in runner.updatable for _, i in runner.uop_replace[j]]
    runner.all_resources = list(dict.fromkeys(saved[-1] + used))
  runner.updatable, runner.var_vals_replace, runner.launch_dims_replace = [], {}, {}
  try: yield
  finally:
    for name, value in zip(UPDATES, saved): setattr(runner, name, value)
    if saved[-1] is not None: runner.all_resources = saved[-1]


def _launch(rt, args: list, info, var_vals: dict[str, int]) -> Callable[[], None]:
  """One kernel launch with its arguments and sizes resolved. A plain one-thread CPU program (all of ours) is called
  through its C function with the ctypes arguments built here once: tinygrad's CPUProgram.__call__ builds them anew
  on each call (about 10 us for a layer's 25 arguments)."""
  global_size, local_size = info.launch_dims(var_vals)
  vals = info.vals(var_vals)
  from tinygrad.runtime.ops_cpu import CPUProgram
  if isinstance(rt, CPUProgram) and not rt.lvp and not rt.runtimevars and tuple(global_size) == (1, 1, 1):
    return functools.partial(rt.fxn, *(ctypes.c_uint64(x) for x in [*(b.va_addr for b in args), *vals]))
  return functools.partial(rt, *args, global_size=global_size, local_size=local_size, vals=vals)


def device_buffers(buf) -> list:
  """A Buffer's per-device buffers: itself, or a MultiBuffer's one per device."""
  return buf.bufs if hasattr(buf, "bufs") else [buf]


def _copy(dest, src):
  """A call copying src to dest as tinygrad's executor does (engine/realize.py exec_copy), or None for a kind it
  leaves to the executor (disk)."""
  if hasattr(dest.allocator, "_transfer") and dest.allocator.supports_transfer and dest.device.split(":")[0] == src.device.split(":")[0]:
    return functools.partial(dest.allocator._transfer, dest._buf, src._buf, dest.nbytes, src_dev=src.allocator.dev, dest_dev=dest.allocator.dev)
  if src.device.startswith("DISK"): return None
  if hasattr(dest.allocator, "_as_buffer"):
    return functools.partial(src.allocator._copyout, dest.as_memoryview(force_zero_copy=True), src._buf)
  return functools.partial(dest.allocator._copyin, dest._buf, src.as_memoryview(allow_zero_copy=True))


def to_host(buf) -> np.ndarray:
  """A realized Buffer's contents, copied into a new numpy array once the device's queued work is done. tinygrad's
  `Buffer.as_memoryview` copies from a device without host-visible memory (CUDA, NV) by scheduling a COPY call: about
  0.5 ms of Python on every step that reads tokens or logits back. The allocator's own copy-out waits for the device
  and costs microseconds; host-visible memory (CPU, Metal) is read in place after a synchronize, as tinygrad does."""
  out, allocator = np.zeros(buf.size, _to_np_dtype(buf.dtype)), buf.allocator
  if hasattr(allocator, "_as_buffer"):
    allocator.dev.synchronize()
    out[:] = np.frombuffer(allocator._as_buffer(buf._buf), out.dtype, buf.size)
  else: allocator._copyout(memoryview(out).cast("B"), buf._buf)
  return out


class OrderedCopies:
  """Host <-> device copies for a pipelined decode (async scheduling, engine/core.py): an upload lands after the work
  launched before it, and a read waits only for the work launched before it, not for the pass launched since, which
  keeps the device busy while the host reads, commits and schedules. The base class serves the CPU device (tinygrad
  0.14 runs its kernels on a worker thread, and its allocator's copies wait for them first) and tinygrad's NULL device:
  an upload is tinygrad's allocator copy, a read waits for the device. `for_device` picks the CUDA one for a CUDA
  device; `ordered(device)` says whether a device has one.

  Not Metal: tinygrad's Metal copy-in writes the shared buffer from the CPU at once, under a pass still reading it."""
  def upload(self, buf, values: np.ndarray) -> None:
    """Overwrite a realized device buffer with `values` (their bytes)."""
    buf = buf.ensure_allocated()
    buf.allocator._copyin(buf._buf, memoryview(np.ascontiguousarray(values)).cast("B"))

  def read_later(self, buf, dtype=np.int32) -> Callable[[], np.ndarray]:
    """A read of `buf`'s contents as they will be once the work launched so far is done; call it to wait for them."""
    return lambda: to_host(buf).view(dtype)

  def close(self) -> None:
    """Free what the copies hold (CUDA's pinned buffers); nothing here."""

  @staticmethod
  def ordered(device: str) -> bool: return device.split(":")[0] in ("CPU", "NULL", "CUDA")

  @staticmethod
  def for_device(device: str) -> OrderedCopies:
    if device.split(":")[0] != "CUDA": return OrderedCopies()
    from tinygrad import Device
    from tinygrad.runtime import ops_cuda   # its `cuda`: the driver's bindings, or tinygrad's mock GPU's
    return _CudaCopies(Device[device], ops_cuda.cuda, ops_cuda.check)


class _CudaCopies(OrderedCopies):
  """CUDA: each copy is queued on the stream tinygrad launches on (the legacy default stream) from pinned host memory
  of ours, and an event after it says when it is done. tinygrad's allocator would pin a fresh staging buffer for
  every upload, freed only at a device synchronize (which a pipelined decode never reaches), and its copy-out
  synchronizes the whole context: a read would wait for the pass launched after it."""
  SLOTS = 8   # staging buffers a kind; a slot is reused 8 copies later, after its event (long done by then)

  def __init__(self, dev, cuda, check):
    """`dev`: tinygrad's CUDADevice; `cuda`, `check`: its driver bindings and status check (a test's stand-ins)."""
    self.cuda, self.check, self.dev = cuda, check, dev
    self.slots = {"up": [None] * self.SLOTS, "down": [None] * self.SLOTS}   # (pinned pointer, bytes, event)
    self.turn = {"up": 0, "down": 0}
    self.copies = 0        # copies queued: a read checks that its slot still holds its own
    self.retired: list = []   # pinned buffers a larger copy outgrew, freed with the rest (freeing may synchronize)

  def _slot(self, kind: str, nbytes: int):
    cuda, check = self.cuda, self.check
    check(cuda.cuCtxSetCurrent(self.dev.context))
    i = self.turn[kind]
    self.turn[kind] = (i + 1) % self.SLOTS
    slot = self.slots[kind][i]
    if slot is not None: check(cuda.cuEventSynchronize(slot[2]))   # its last copy is done
    if slot is None or slot[1] < nbytes:
      if slot is not None: self.retired.append(slot[0])
      event = slot[2] if slot is not None else cuda.CUevent()
      if slot is None: check(cuda.cuEventCreate(ctypes.byref(event), 2))   # CU_EVENT_DISABLE_TIMING
      host = ctypes.c_void_p()
      check(cuda.cuMemHostAlloc(ctypes.byref(host), max(nbytes, 4096), 0))
      slot = (host, max(nbytes, 4096), event)
    self.copies += 1
    slot = self.slots[kind][i] = slot[:3] + (self.copies,)
    return slot

  def close(self) -> None:
    """Free the pinned buffers and events (the runner's end); safe to call twice."""
    cuda, check = self.cuda, self.check
    slots = [s for kind in self.slots.values() for s in kind if s is not None]
    if not slots and not self.retired: return
    check(cuda.cuCtxSetCurrent(self.dev.context))
    for host, _, event, _ in slots:
      check(cuda.cuEventSynchronize(event))
      check(cuda.cuMemFreeHost(host))
      check(cuda.cuEventDestroy_v2(event))
    for host in self.retired: check(cuda.cuMemFreeHost(host))
    self.slots, self.retired = {"up": [None] * self.SLOTS, "down": [None] * self.SLOTS}, []

  def __del__(self):
    try: self.close()
    except Exception: pass   # at interpreter exit the driver may be gone

  def upload(self, buf, values: np.ndarray) -> None:
    buf = buf.ensure_allocated()
    data = np.ascontiguousarray(values)
    host, _, event, _ = self._slot("up", data.nbytes)
    ctypes.memmove(host, data.ctypes.data, data.nbytes)
    self.check(self.cuda.cuMemcpyHtoDAsync_v2(buf._buf, host, data.nbytes, None))
    self.check(self.cuda.cuEventRecord(event, None))

  def read_later(self, buf, dtype=np.int32) -> Callable[[], np.ndarray]:
    buf = buf.ensure_allocated()
    slot = self._slot("down", buf.nbytes)
    host, _, event, _ = slot
    self.check(self.cuda.cuMemcpyDtoHAsync_v2(host, buf._buf, buf.nbytes, None))
    self.check(self.cuda.cuEventRecord(event, None))
    def read() -> np.ndarray:
      if slot not in self.slots["down"]: raise RuntimeError(f"a read taken after {self.SLOTS} more reads were queued: its staging buffer was reused")
      self.check(self.cuda.cuCtxSetCurrent(self.dev.context))
      self.check(self.cuda.cuEventSynchronize(event))
      out = np.empty(buf.nbytes, np.uint8)
      ctypes.memmove(out.ctypes.data, host, buf.nbytes)
      return out.view(dtype)
    return read


def input_uop(t: Tensor) -> UOp:
  """The buffer TinyJit takes for an input tensor: a multi-device tensor's (split or copied over devices) included."""
  return (t.uop.src[0] if t.uop.op is Ops.UNSHARD else t.uop).base
