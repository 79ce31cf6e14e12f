"""tinygrad's METAL device on a machine without Metal: a stand-in for `tinygrad.runtime.ops_metal` (tinygrad's only
macOS-only module) whose compiler, programs, allocator and graph run MSL through tinyvllm's emulator, while tinygrad's
real `MetalRenderer` writes the MSL of its own kernels. So `DEV=METAL` runs the product's whole Mac path here: `auto`
picks the metal backend, float16, our shaders through `MetalBackend`, tinygrad's kernels, TinyJit and the graph.

    TINYVLLM_EMULATE_METAL=1 DEV=METAL python -m tinyvllm.generate --prompt Hello

`install()` must run before anything opens a device; `import tinyvllm` calls it when TINYVLLM_EMULATE_METAL=1.
`TINYVLLM_EMULATE_METAL_ARCH` names the GPU family (default Apple7, the M1: tinygrad's tensor cores need it), and
`TINYVLLM_EMULATE_MACOS` the macOS version (default 14.0; 12 and older compile MSL 2.0: no simdgroup_matrix).

What a real Mac would pay is counted on the device (`Device["METAL"].counters`): kernel launches, command buffers,
host<->device copies (each synchronizes the device first, as tinygrad's MetalAllocator does), synchronizations, and
the waits of tinygrad's MetalGraph, which before re-encoding a graph waits for that graph's previous run to finish.
What it cannot show (Apple's compiler, real scheduling, timing) is listed in docs/msl-subset.md.
"""
from __future__ import annotations
import ctypes, hashlib, math, mmap, os, re, sys, types
from dataclasses import dataclass, fields
from tinygrad.device import Compiled, CompileError, Compiler, LRUAllocator, TinyELF
from tinygrad.engine.jit import GraphRunner
from tinygrad.renderer.cstyle import MetalRenderer

MAX_THREADS_PER_THREADGROUP = 1024   # an M-series pipeline's maxTotalThreadsPerThreadgroup for small kernels
LIBRARY_MAGIC = b"TVEMU1\n"           # the "library" is the checked MSL itself, behind this tag


@dataclass
class Counters:
  """What the device did, as a real Mac would have to do it. `reset()` between the parts a test compares."""
  launches: int = 0          # kernels dispatched (one by one or inside a graph)
  command_buffers: int = 0   # committed: one per lone kernel, one per graph run, one per copy
  copies_in: int = 0         # host -> device
  copies_out: int = 0        # device -> host
  host_views: int = 0        # device memory mapped for the host to read or write (tinygrad syncs first)
  synchronizes: int = 0      # the host waited for the device to finish everything
  graph_runs: int = 0
  graph_waits: int = 0       # a graph re-run while its previous run was still in flight: MetalGraph waits for it
  idle_waits: int = 0        # ... and that run was the last work committed: the GPU runs dry while the host waits

  def reset(self) -> None:
    for f in fields(self): setattr(self, f.name, 0)

  def snapshot(self) -> dict[str, int]: return {f.name: getattr(self, f.name) for f in fields(self)}


def uses_bfloat(src: str) -> bool: return re.search(r"\bbfloat", src) is not None


def library_name(src: str) -> str:
  """The file name a library compiles under: the compiler and every program loaded from it use the same one, so the
  emulator compiles each source once (its cache keys include the name; a library of 98 kernels compiled per kernel
  name took minutes on a cold cache)."""
  first = re.search(r"(?:kernel|\[\[kernel\]\])\s+void\s+(\w+)", src)
  return f"{first.group(1) if first else 'library'}-{hashlib.sha256(src.encode()).hexdigest()[:8]}.metal"


def compile_library(src: str):
  """The emulator's build of a library: the compiler checks it, each program loads it (built once, then cached)."""
  from tinyvllm.kernels import emulator
  return emulator.compile_source(src, library_name(src), generic_address_spaces=uses_bfloat(src))


def emulated_macos() -> str: return os.environ.get("TINYVLLM_EMULATE_MACOS", "14.0")


class MetalCompiler(Compiler):
  """Checks the MSL by compiling it with the emulator; the library it returns is the source itself."""
  def __init__(self): super().__init__("compile_metal_emulated")

  def compile(self, src: str) -> bytes:
    from tinyvllm.kernels import emulator, msl2_only
    macos = emulated_macos()
    if msl2_only(macos) and re.search(r"\bsimdgroup_\w+8x8\b", src):
      # tinygrad asks for MSL 2.0 on macOS 12 and older, whose compiler has no simdgroup_matrix
      raise CompileError(f"(emulating macOS {macos}, MSL 2.0) error: unknown type name 'simdgroup_float8x8'")
    try: compile_library(src)
    except emulator.EmulatorError as e: raise CompileError(str(e)) from None
    return LIBRARY_MAGIC + src.encode()

  def __reduce__(self): return (MetalCompiler, ())


@dataclass
class MetalBuffer:
  addr: int                  # start of the buffer's memory
  size: int
  offset: int = 0
  memory: object = None      # what owns the memory (an mmap), kept alive with every view


class MetalAllocator(LRUAllocator):
  """Host memory standing in for shared-storage MTLBuffers (zero-filled, as fresh pages are)."""
  def _alloc(self, size: int, options) -> MetalBuffer:
    if options.external_ptr: return MetalBuffer(options.external_ptr, size)
    mem = mmap.mmap(-1, max(size, 1))
    return MetalBuffer(ctypes.addressof(ctypes.c_char.from_buffer(mem)), size, 0, mem)

  def _free(self, opaque: MetalBuffer, options): pass   # the mmap goes with the last reference

  def _as_buffer(self, src: MetalBuffer) -> memoryview:
    self.dev.counters.host_views += 1
    return self._view(src)

  @staticmethod
  def _view(src: MetalBuffer) -> memoryview:
    return memoryview((ctypes.c_char * (src.size + src.offset)).from_address(src.addr)).cast("B")[src.offset:]

  def _copyin(self, dest: MetalBuffer, src: memoryview) -> None:
    self.dev.synchronize()                     # as MetalAllocator: the GPU may still be using the buffer
    self.dev.counters.copies_in += 1
    self._view(dest)[:] = src

  def _copyout(self, dest: memoryview, src: MetalBuffer) -> None:
    self.dev.synchronize()
    self.dev.counters.copies_out += 1
    dest[:] = self._view(src)

  def _offset(self, buf: MetalBuffer, size: int, offset: int) -> MetalBuffer:
    return MetalBuffer(buf.addr, size, buf.offset + offset, buf.memory)

  def _transfer(self, dest: MetalBuffer, src: MetalBuffer, sz: int, src_dev, dest_dev) -> None:
    dest_dev.synchronize(); src_dev.synchronize()
    self._view(dest)[:sz] = self._view(src)[:sz]


class MetalProgram:
  """One kernel of a library: launches it with the emulator, as a compute command encoder would dispatch it."""
  def __init__(self, dev: MetalDevice, obj: TinyELF):
    from tinyvllm.kernels.emulator.harness import make_desc
    if not obj.lib.startswith(LIBRARY_MAGIC): raise RuntimeError(f"{obj.name}: not a library of the emulated Metal compiler")
    self.dev, self.name, self.signature, self._make_desc = dev, obj.name, obj.signature, make_desc
    src = obj.lib[len(LIBRARY_MAGIC):].decode()
    self.library = compile_library(src)
    if obj.name not in self.library.kernels:   # what newFunctionWithName returning nil means on a Mac
      raise RuntimeError(f"the Metal library has no function named {obj.name!r} (it has {', '.join(sorted(self.library.kernels))})")
    self.kernel_addr = self.library.kernel_addr(obj.name)
    dev.sources[obj.name] = src   # what ran, for tests (e.g. that tinygrad's tensor cores were used)
    self.max_total_threads = MAX_THREADS_PER_THREADGROUP

  def __call__(self, *bufs: MetalBuffer, global_size=(1, 1, 1), local_size=(1, 1, 1), vals=(), wait=False, in_graph=False, **kw):
    from tinyvllm.kernels.emulator import EmulatorError, runtime
    from tinyvllm.kernels.emulator.harness import MAX_BUFS
    local_size = tuple(local_size or (1, 1, 1))
    if math.prod(local_size) > self.max_total_threads:
      raise RuntimeError(f"local size {local_size} bigger than {self.max_total_threads}")
    # integers travel as setBytes does: a few bytes bound at the next buffer index
    ints = [(getattr(ctypes, f"c_int{dt.bitsize}"))(v) for v, (_, _, dt, _) in zip(vals, self.signature[len(bufs):])]
    ptrs = [b.addr + b.offset for b in bufs] + [ctypes.addressof(v) for v in ints]
    sizes = [b.size for b in bufs] + [ctypes.sizeof(v) for v in ints]
    desc = self._make_desc(self.kernel_addr, global_size, local_size, sizes, guard=self.dev.guard)
    err = ctypes.create_string_buffer(4096)
    if runtime().tv_launch(ctypes.byref(desc), (ctypes.c_void_p * MAX_BUFS)(*ptrs), err, len(err)):
      raise EmulatorError(f"emulated Metal: {err.value.decode()}")
    self.dev.counters.launches += 1
    if not in_graph:   # a lone dispatch commits its own command buffer
      self.dev.counters.command_buffers += 1
      self.dev.last_committed = self
    return 0.0 if wait else None


class MetalGraph(GraphRunner):
  """Runs a captured batch of kernels in order. A Mac encodes them into one indirect command buffer; tinygrad's
  MetalGraph waits for the graph's previous run to finish before re-encoding it, which `graph_waits` counts.

  Like that buffer, each command keeps what was encoded into it: its buffers (the capture's inputs at first) and its
  launch sizes with the variables at 0. A run re-encodes only the commands tinygrad's MetalGraph updates (`updatable`:
  those reading an input, whose buffers are set again, or sized by a variable, whose sizes are); variables' values are
  written for every run, as tinygrad writes them into one buffer. So a command not updated runs as last encoded."""
  def __init__(self, linear, input_uops=()):
    super().__init__(linear, input_uops)
    if any(r is None for r in self.runtimes): raise RuntimeError("the emulated MetalGraph takes kernels only")
    from tinygrad import Device
    self.dev = Device[self.device]
    self.in_flight = False
    self.encoded = [[list(bufs), ast.arg.launch_dims({v: 0 for v in self.vars})] for _, ast, bufs, _ in self.calls]
    self.updatable = sorted({j for j, r in enumerate(self.uop_replace) if r} | self.var_vals_replace.keys() | self.launch_dims_replace.keys())

  def __call__(self, input_uops, var_vals: dict[str, int], wait=False):
    if self.in_flight and self in self.dev.graphs_in_flight:
      self.dev.counters.graph_waits += 1
      # waiting for the newest command buffer leaves the GPU nothing queued until this graph is encoded again;
      # waiting for an older one (another graph committed since) overlaps with the GPU running the newer work
      if self.dev.last_committed is self: self.dev.counters.idle_waits += 1
    for j in self.updatable:
      for pos, iidx in self.uop_replace[j]: self.encoded[j][0][pos] = input_uops[iidx].buffer
    for j, global_size, local_size in self.updated_launch_dims(var_vals): self.encoded[j][1] = (global_size, local_size)
    for (_, ast, _, device_vars), runtime, (bufs, (global_size, local_size)) in zip(self.calls, self.runtimes, self.encoded):
      vv = {**var_vals, **device_vars}
      runtime(*[b.ensure_allocated()._buf for b in bufs], global_size=global_size, local_size=local_size, vals=ast.arg.vals(vv),
              in_graph=True)
    self.dev.counters.graph_runs += 1
    self.dev.counters.command_buffers += 1
    self.in_flight = True
    self.dev.graphs_in_flight.add(self)
    self.dev.last_committed = self
    return 0.0 if wait else None


class MetalDevice(Compiled):
  def __init__(self, device: str):
    self.counters = Counters()
    self.graphs_in_flight: set = set()
    self.last_committed: object | None = None   # the graph or program whose command buffer was committed last
    self.sources: dict[str, str] = {}   # kernel name -> its MSL, for every program loaded
    self.guard = os.environ.get("TINYVLLM_EMULATE_METAL_GUARD", "1") != "0"   # bounds-checked copies of every buffer
    self.macos_version = emulated_macos()   # what platform.mac_ver() would say on the Mac this stands in for
    super().__init__(device, MetalAllocator(self), [MetalRenderer], MetalProgram, MetalGraph,
                     arch=os.environ.get("TINYVLLM_EMULATE_METAL_ARCH", "Apple7"))

  def synchronize(self) -> None:
    self.counters.synchronizes += 1
    self.graphs_in_flight.clear()


def install() -> None:
  """Put this module in place of tinygrad's `ops_metal` (before any device opens) and compile in this process:
  tinygrad's compile workers would import the real module, which needs macOS."""
  import tinygrad.runtime
  from tinygrad.helpers import PARALLEL
  module = sys.modules[__name__]
  sys.modules["tinygrad.runtime.ops_metal"] = module
  tinygrad.runtime.ops_metal = module
  PARALLEL.value = 0


def installed() -> bool: return sys.modules.get("tinygrad.runtime.ops_metal") is sys.modules[__name__]
