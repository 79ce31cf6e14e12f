"""Compile unmodified .metal compute kernels with clang++ and run them on the CPU.

Pipeline for one source (see docs/msl-subset.md for what it accepts):
  1. preprocess with clang++ -E and `__TV_PARSE__` defined: our `metal_stdlib` is then empty, so MSL keywords
     (`kernel`, `device`, `threadgroup`) survive while the file's own macros (instantiation lists) expand;
  2. parse every `kernel void f(...)` definition and every `template [[host_name("x")]] ... f<...>` instantiation,
     classifying parameters as buffers (`[[buffer(n)]]`) or built-ins (`[[thread_position_in_grid]]`, ...);
  3. rewrite `threadgroup T x[N];` declarations into references to per-threadgroup memory, keeping line numbers;
  4. append one extern "C" descriptor per kernel and compile everything with the real shim into a shared object,
     cached on disk by a hash of all inputs; the runtime (fibers, barriers, guards) is a second shared object.
     The code is compiled with plain pointers for device/threadgroup/constant (clang's alignment sanitizer skips
     accesses through address-space pointers), while a -fsyntax-only pass with real address spaces checks them.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import re
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
INCLUDE = HERE / "include"
HARNESS_VERSION = "6"

BUILTINS = {  # attribute -> field of __tv_thread (a 3-vector, or a scalar)
  "thread_position_in_grid": "gid", "threadgroup_position_in_grid": "tgid", "thread_position_in_threadgroup": "tid",
  "threads_per_threadgroup": "tgsize", "dispatch_threads_per_threadgroup": "tgsize", "threadgroups_per_grid": "ngroups",
  "threads_per_grid": "gridsize", "thread_index_in_threadgroup": "tindex", "thread_index_in_simdgroup": "lane",
  "simdgroup_index_in_threadgroup": "sg", "simdgroups_per_threadgroup": "nsg", "threads_per_simdgroup": "32",
  "thread_execution_width": "32",
}
VECTOR_BUILTINS = {"gid", "tgid", "tid", "tgsize", "ngroups", "gridsize"}
ORDERS = {"forward": 0, "reverse": 1, "random": 2}
MAX_BUFS = 31


class EmulatorError(RuntimeError):
  """A kernel could not be compiled, or misbehaved while running (divergent barrier, out-of-bounds access, ...)."""


@dataclass(frozen=True)
class Param:
  name: str
  type: str
  buffer: int | None      # [[buffer(n)]] index, or None for a built-in
  builtin: str | None     # attribute name of a built-in
  writable: bool = False


@dataclass(frozen=True)
class Kernel:
  name: str               # host name: what a launch asks for
  func: str               # C++ function expression: `f` or `f<half, 64>`
  params: tuple[Param, ...]
  file: str

  @property
  def buffers(self) -> list[Param]: return sorted((p for p in self.params if p.buffer is not None), key=lambda p: p.buffer)


def cache_dir() -> Path:
  root = os.environ.get("TINYVLLM_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "tinyvllm")
  d = Path(root) / "emulator"
  d.mkdir(parents=True, exist_ok=True)
  return d


def _cxx() -> str: return os.environ.get("CXX_EMULATOR", "clang++")


def _flags() -> list[str]:
  f = ["-std=c++17", "-O2", "-fPIC", "-shared", "-fno-exceptions", "-fno-rtti", "-ffp-contract=off",
       "-fsigned-char",   # MSL's char is signed (int8 KV-cache codes); aarch64 Linux would make it unsigned
       "-Xclang", "-fnative-half-type", "-Xclang", "-fnative-half-arguments-and-returns",
       "-Xclang", "-cl-single-precision-constant", "-Wno-unknown-attributes", "-Wno-ignored-attributes",
       "-Wno-unused-command-line-argument",
       # a misaligned access of any type traps (SIGILL). clang does not instrument accesses through address-space
       # pointers, so kernels are compiled with device/threadgroup/constant as plain pointers (see compile_source).
       "-fsanitize=alignment", "-fsanitize-trap=alignment"]
  # x86: SSE only, no AVX (so no F16C: the runtime converts half in software). Non-VEX vector instructions fault on a
  # misaligned 16-byte access, which Metal forbids: a float4 read of memory not 16-byte aligned is then an error here
  # too, instead of working by luck as AVX's unaligned-tolerant loads would let it.
  if os.uname().machine in ("x86_64", "AMD64"): f += ["-mno-avx", "-mno-f16c"]
  if os.uname().sysname == "Darwin": f += ["-undefined", "dynamic_lookup"]
  return f


def _run(cmd: list[str], what: str, input_text: str | None = None) -> str:
  try:
    r = subprocess.run(cmd, input=input_text, capture_output=True, text=True)
  except FileNotFoundError as e:
    raise EmulatorError(f"{what} failed: {cmd[0]} not found (install clang, or set CXX_EMULATOR)") from e
  if r.returncode != 0: raise EmulatorError(f"{what} failed:\n{r.stderr.strip()}")
  return r.stdout


def _run_in_background(cmd: list[str], what: str, input_text: str):
  """Start `cmd`; the returned function waits for it and raises like _run."""
  result: list = []
  def go():
    try: result.append(subprocess.run(cmd, input=input_text, capture_output=True, text=True))
    except FileNotFoundError as e: result.append(e)
  t = threading.Thread(target=go, daemon=True)
  t.start()
  def wait():
    t.join()
    r = result[0]
    if isinstance(r, FileNotFoundError): raise EmulatorError(f"{what} failed: {cmd[0]} not found (install clang, or set CXX_EMULATOR)") from r
    if r.returncode != 0: raise EmulatorError(f"{what} failed:\n{r.stderr.strip()}")
  return wait


def _atomic_build(out: Path, build) -> Path:
  if out.exists(): return out
  with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
    tmp_out = Path(tmp) / out.name
    build(tmp_out)
    os.replace(tmp_out, out)
  return out


_runtime: ctypes.CDLL | None = None


def runtime() -> ctypes.CDLL:
  """The emulator runtime, built once per content hash and loaded RTLD_GLOBAL so kernel libraries link to it."""
  global _runtime
  if _runtime is None:
    src = (HERE / "runtime.cpp").read_text() + (HERE / "tv_abi.h").read_text()
    key = hashlib.sha256((src + " ".join(_flags()) + HARNESS_VERSION).encode()).hexdigest()[:16]
    out = cache_dir() / f"libtvemu-{key}.so"
    _atomic_build(out, lambda o: _run([_cxx(), *_flags(), "-I", str(HERE), str(HERE / "runtime.cpp"), "-o", str(o), "-lpthread"],
                                      "building the emulator runtime"))
    _runtime = ctypes.CDLL(str(out), mode=ctypes.RTLD_GLOBAL)
    _runtime.tv_launch.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int]
    _runtime.tv_launch.restype = ctypes.c_int
    _runtime.tv_take_error.argtypes = [ctypes.c_char_p, ctypes.c_int]
    _runtime.tv_take_error.restype = ctypes.c_int
  return _runtime


def take_error() -> str | None:
  """The first error of launches that ran where no exception could be raised (inside tinygrad), or None."""
  buf = ctypes.create_string_buffer(4096)
  return buf.value.decode() if runtime().tv_take_error(buf, len(buf)) else None


class LaunchDesc(ctypes.Structure):
  _fields_ = [("kern", ctypes.c_void_p), ("grid", ctypes.c_uint32 * 3), ("tg", ctypes.c_uint32 * 3),
              ("buf_sizes", ctypes.c_uint64 * MAX_BUFS), ("order", ctypes.c_int32), ("seed", ctypes.c_uint32),
              ("threads", ctypes.c_int32), ("guard", ctypes.c_int32)]


def make_desc(kernel_addr: int, grid, threads, sizes, *, order="forward", seed=0, os_threads=1, guard=True) -> LaunchDesc:
  d = LaunchDesc()
  d.kern = kernel_addr
  d.grid[:] = tuple(grid) + (1,) * (3 - len(grid))
  d.tg[:] = tuple(threads) + (1,) * (3 - len(threads))
  for i, s in enumerate(sizes): d.buf_sizes[i] = s
  d.order, d.seed, d.threads, d.guard = ORDERS[order], seed, os_threads, int(guard)
  return d


# ---------------------------------------------------------------------------------------------- parsing

def _balanced(text: str, start: int, open_c: str, close_c: str) -> int:
  """Index just past the bracket that closes text[start] (== open_c)."""
  depth = 0
  for i in range(start, len(text)):
    if text[i] == open_c: depth += 1
    elif text[i] == close_c:
      depth -= 1
      if depth == 0: return i + 1
  raise EmulatorError(f"unbalanced {open_c}{close_c} in kernel source")


def _split_params(text: str) -> list[str]:
  out, depth, cur = [], 0, ""
  for c in text:
    if c in "(<[": depth += 1
    elif c in ")>]": depth -= 1
    if c == "," and depth == 0: out.append(cur); cur = ""
    else: cur += c
  if cur.strip(): out.append(cur)
  return [" ".join(p.split()) for p in out]


IMPLICIT = -1   # a buffer parameter without [[buffer(n)]]: Metal numbers those in declaration order (tinygrad's MSL)


def _parse_param(p: str, fn: str) -> Param:
  attrs = re.findall(r"\[\[\s*(\w+)\s*(?:\(\s*(\w+)\s*\))?\s*\]\]", p)
  decl = re.sub(r"\[\[.*?\]\]", "", p).strip()
  m = re.match(r"(.*?)(\w+)$", decl)
  if not m: raise EmulatorError(f"kernel {fn}: cannot read the parameter `{p}`")
  ty, name = m.group(1).strip(), m.group(2)
  words = ty.replace("*", " * ").replace("&", " & ").split()
  attr, arg = attrs[0] if attrs else ("buffer", None)
  if attr == "buffer":
    if "*" not in words and "&" not in words:
      raise EmulatorError(f"kernel {fn}: parameter `{p}` needs a [[buffer(n)]] or built-in attribute, or a pointer or reference type")
    writable = "device" in words and "const" not in words
    return Param(name, ty, int(arg, 0) if arg is not None else IMPLICIT, None, writable)
  if attr in BUILTINS: return Param(name, ty, None, attr)
  raise EmulatorError(f"kernel {fn}: attribute [[{attr}]] on `{p}` is not supported by the emulator")


def _number_buffers(params: tuple[Param, ...], fn: str) -> tuple[Param, ...]:
  """Unnumbered buffers take indices in declaration order, as Metal assigns them; a kernel numbers all or none."""
  implicit = [p for p in params if p.buffer == IMPLICIT]
  if not implicit: return params
  if len(implicit) != sum(p.buffer is not None for p in params):
    raise EmulatorError(f"kernel {fn}: some buffers have [[buffer(n)]] and some do not; number all of them or none")
  order = {id(p): i for i, p in enumerate(implicit)}
  return tuple(Param(p.name, p.type, order[id(p)], None, p.writable) if p.buffer == IMPLICIT else p for p in params)


# Built-ins of grid and threadgroup geometry: Metal requires them to agree in vector width (all scalar, or all with
# the same number of components); Apple's compiler rejects a kernel mixing `uint3` and `uint`, clang++ would not.
GEOMETRY = ("thread_position_in_grid", "threads_per_grid", "thread_position_in_threadgroup", "threads_per_threadgroup",
            "threadgroup_position_in_grid", "threadgroups_per_grid", "dispatch_threads_per_threadgroup")


def _components(ty: str) -> int:
  m = re.search(r"(\d)\s*$", ty.replace("const", "").strip())
  return int(m.group(1)) if m and re.search(r"(int|short|uint|ushort)\d\s*$", ty) else 1


def _check_builtins(params: tuple[Param, ...], fn: str) -> None:
  geometry = [p for p in params if p.builtin in GEOMETRY]
  widths = {p.builtin: _components(p.type) for p in geometry}
  if len(set(widths.values())) > 1:
    desc = ", ".join(f"[[{p.builtin}]] `{p.type} {p.name}` ({widths[p.builtin]})" for p in geometry)
    raise EmulatorError(f"kernel {fn}: the grid and threadgroup built-ins must agree in vector width, as Apple's compiler "
                        f"requires: {desc}")
  for p in params:
    if p.builtin is not None and not re.search(r"\b(uint|ushort)\d?\s*$", p.type.replace("const", "").strip()):
      raise EmulatorError(f"kernel {fn}: built-in [[{p.builtin}]] `{p.type} {p.name}` must be uint or ushort (or a vector of them)")


_DEF = re.compile(r"(template\s*<[^;{]*?>\s*)?(?:\bkernel\b|\[\[\s*kernel\s*\]\])\s*void\s+(\w+)\s*\(")
_INST = re.compile(r"template\s*\[\[\s*host_name\s*\(\s*((?:\"[^\"]*\"\s*)+)\)\s*\]\]\s*(?:\[\[\s*kernel\s*\]\])?")


def parse_kernels(text: str, file: str) -> list[Kernel]:
  """Kernels (host name -> function and parameters) of preprocessed MSL text."""
  defs: dict[str, tuple[bool, tuple[Param, ...]]] = {}
  for m in _DEF.finditer(text):
    end = _balanced(text, m.end() - 1, "(", ")")
    after = text[end:end + 20].lstrip()
    if after.startswith(";"): continue  # a declaration or an instantiation, not a definition
    params = _number_buffers(tuple(_parse_param(p, m.group(2)) for p in _split_params(text[m.end():end - 1])), m.group(2))
    _check_builtins(params, m.group(2))
    defs[m.group(2)] = (m.group(1) is not None, params)
  kernels: list[Kernel] = []
  for m in _INST.finditer(text):
    host = "".join(re.findall(r'"([^"]*)"', m.group(1)))  # adjacent literals concatenate
    stmt_end = text.index(";", m.end())
    stmt = text[m.end():stmt_end]
    fm = None
    for cand in re.finditer(r"(\w+)\s*<", stmt):
      if cand.group(1) in defs: fm = cand
    if fm is None: continue
    close = _balanced(stmt, fm.end() - 1, "<", ">")
    kernels.append(Kernel(host, f"{fm.group(1)}{stmt[fm.end() - 1:close]}", defs[fm.group(1)][1], file))
  for name, (templated, params) in defs.items():
    if not templated: kernels.append(Kernel(name, name, params, file))
  for k in kernels:
    idx = [p.buffer for p in k.buffers]
    if len(set(idx)) != len(idx): raise EmulatorError(f"kernel {k.name}: duplicate [[buffer(n)]] indices {idx}")
    if idx != list(range(len(idx))): raise EmulatorError(f"kernel {k.name}: buffer indices must be 0..n-1, got {idx}")
    if len(idx) > MAX_BUFS: raise EmulatorError(f"kernel {k.name}: more than {MAX_BUFS} buffers")
  return kernels


# C++ that clang++ accepts in the emulator but Apple's MSL (C++14-based, no dynamic memory) rejects
_NOT_MSL = [(re.compile(r"\bif\s+constexpr\b"), "`if constexpr` (C++17; MSL is based on C++14)"),
            (re.compile(r"\bauto\s*&{0,2}\s*\["), "structured bindings (C++17)"),
            (re.compile(r"\bvirtual\b"), "virtual functions"),
            (re.compile(r"\bnew\s+[A-Za-z_(]|\bdelete\b"), "new/delete")]


def lint_msl(text: str, file: str):
  """Reject constructs the emulator would compile but Apple's Metal compiler would not."""
  for line in text.split("\n"):
    if line.startswith("#"): continue
    for pat, what in _NOT_MSL:
      if pat.search(line): raise EmulatorError(f"{file}: {what} is not valid MSL: `{line.strip()}`")


_TG_DECL = re.compile(r"^(\s*)threadgroup\s+(?:__attribute__\(\(aligned\((\d+)\)\)\)\s+)?([A-Za-z_][\w:<>, ]*?)\s+([A-Za-z_]\w*)\s*"
                      r"((?:\[[^\]]+\]\s*)*);\s*$")


def strip_host_names(text: str) -> str:
  """`template [[host_name("x")]] [[kernel]] ...` -> `template ...`: C++ allows no attributes after `template`."""
  return _INST.sub("template ", text)


def rewrite_threadgroup(text: str) -> str:
  """`threadgroup T x[N][M];` -> a reference to memory shared by the threadgroup (same line, so line numbers hold)."""
  out, n = [], 0
  for line in text.split("\n"):
    m = _TG_DECL.match(line)
    if m:
      ind, aligned, ty, name, dims = m.group(1), m.group(2), m.group(3).strip(), m.group(4), m.group(5).replace(" ", "")
      alias = f"__tv_tg_t{n}"  # an alias keeps `float4(` away from the vector-constructor macros
      align = f"alignof({ty})" if aligned is None else f"({aligned} > alignof({ty}) ? {aligned} : alignof({ty}))"
      line = (f"{ind}using {alias} = {ty} {dims}; auto& {name} = *(threadgroup {alias}*)"
              f"(__tv_tg_alloc({n}, sizeof({alias}), {align}));")
      n += 1
    out.append(line)
  return "\n".join(out)


_PROLOGUE = """#include <metal_stdlib>
#include "tv_abi.h"
template <class T> struct __tv_rr { typedef T type; };
template <class T> struct __tv_rr<T&> { typedef T type; };
template <int I, class F> struct __tv_argt;
template <int I, class R, class... A> struct __tv_argt<I, R (*)(A...)> { typedef __type_pack_element<I, A...> type; };
template <class T> inline T __tv_bi(const unsigned* v) {
  if constexpr (metal::__tv_is_vec<T>) { T r; for (int i = 0; i < metal::__tv_vinfo<T>::n; i++) r[i] = v[i]; return r; }
  else return (T)v[0];
}
#pragma GCC poison double printf malloc free std
"""


def _wrapper(i: int, k: Kernel) -> str:
  args = []
  for j, p in enumerate(k.params):
    t = f"typename __tv_argt<{j}, __F>::type"
    if p.buffer is not None:
      args.append(f"*(typename __tv_rr<{t}>::type*)b[{p.buffer}]" if "&" in p.type else f"({t})b[{p.buffer}]")
    else:
      field = BUILTINS[p.builtin]
      if field == "32": args.append(f"({t})32")
      elif field in VECTOR_BUILTINS: args.append(f"__tv_bi<{t}>(t->{field})")
      else: args.append(f"({t})t->{field}")
  names = ", ".join(f'"{p.name}"' for p in k.buffers) or "0"
  writable = ", ".join(str(int(p.writable)) for p in k.buffers) or "0"
  sym = "__tv_kernel_" + re.sub(r"\W", "_", k.name)
  return (f"static void __tv_w{i}(void* const* b, const __tv_thread* t) {{\n"
          f"  typedef decltype(&{k.func}) __F; (void)t; (void)b;\n  {k.func}({', '.join(args)});\n}}\n"
          f"static const char* __tv_n{i}[] = {{{names}}};\nstatic const unsigned char __tv_m{i}[] = {{{writable}}};\n"
          f"extern \"C\" const __tv_kernel {sym} = {{\"{k.name}\", \"{k.file}\", __tv_w{i}, {len(k.buffers)}, __tv_n{i}, __tv_m{i}}};\n")


class Library:
  """One compiled .metal source: run its kernels on numpy arrays, or hand their descriptors to a trampoline."""

  def __init__(self, path: Path, kernels: list[Kernel]):
    runtime()
    self.path, self.kernels = path, {k.name: k for k in kernels}
    self.dll = ctypes.CDLL(str(path))

  def kernel_addr(self, name: str) -> int:
    if name not in self.kernels: raise EmulatorError(f"no kernel named {name!r} (have: {', '.join(sorted(self.kernels))})")
    sym = "__tv_kernel_" + re.sub(r"\W", "_", name)
    return ctypes.addressof(ctypes.c_char.in_dll(self.dll, sym))

  def run(self, name: str, buffers: list[np.ndarray], grid, threads, *, order="forward", seed=0, os_threads=1, guard=True):
    """Launch `name` over `grid` threadgroups of `threads` threads; buffers in [[buffer(n)]] order, written in place."""
    k = self.kernels.get(name)
    addr = self.kernel_addr(name)
    if len(buffers) != len(k.buffers): raise EmulatorError(f"kernel {name} takes {len(k.buffers)} buffers, got {len(buffers)}")
    for b, p in zip(buffers, k.buffers):
      if not (isinstance(b, np.ndarray) and b.flags.c_contiguous): raise EmulatorError(f"buffer `{p.name}` must be a contiguous numpy array")
    d = make_desc(addr, grid, threads, [b.nbytes for b in buffers], order=order, seed=seed, os_threads=os_threads, guard=guard)
    ptrs = (ctypes.c_void_p * MAX_BUFS)(*[b.ctypes.data for b in buffers])
    err = ctypes.create_string_buffer(4096)
    if runtime().tv_launch(ctypes.byref(d), ptrs, err, len(err)): raise EmulatorError(err.value.decode())


_loaded: dict[str, Library] = {}


def compile_source(src: str, name: str = "inline.metal", include_dirs: tuple[str, ...] = (), generic_address_spaces: bool = False) -> Library:
  """Compile MSL source text (cached in memory by content and on disk by hash).

  generic_address_spaces: compile device/threadgroup/constant as plain pointers, without the address-space checks
  (for machine-written MSL using bfloat, which the emulator can only represent as a class type)."""
  mem_key = hashlib.sha256((src + name + "|".join(include_dirs) + str(generic_address_spaces)).encode()).hexdigest()
  if mem_key in _loaded: return _loaded[mem_key]
  inc = [a for d in include_dirs for a in ("-I", d)]
  pre = _run([_cxx(), "-x", "c++", "-std=c++17", "-E", "-D__TV_PARSE__", "-I", str(INCLUDE), *inc, "-"], f"preprocessing {name}",
             input_text=f'# 1 "{name}"\n{src}')
  lint_msl(pre, name)
  kernels = parse_kernels(pre, name)
  if not kernels: raise EmulatorError(f"{name}: no kernels found")
  wrappers = "".join(_wrapper(i, k) for i, k in enumerate(kernels))
  code = _PROLOGUE + rewrite_threadgroup(strip_host_names(pre)) + '\n# 1 "<emulator wrappers>"\n' + wrappers
  generic = "#define __TV_GENERIC_ADDRESS_SPACES 1\n" + code
  shim = (INCLUDE / "metal_stdlib").read_text() + (HERE / "tv_abi.h").read_text()
  key = hashlib.sha256((code + str(generic_address_spaces) + shim + " ".join(_flags()) + HARNESS_VERSION).encode()).hexdigest()[:16]
  out = cache_dir() / f"{Path(name).stem}-{key}.so"
  cc = [_cxx(), *_flags(), "-x", "c++", "-I", str(INCLUDE), "-I", str(HERE), "-"]

  def build(o: Path):
    # The object code uses plain pointers, so that the alignment sanitizer checks device and threadgroup accesses
    # too (clang skips every access through an address-space pointer: a misaligned float2 read would pass).
    # Alongside, a syntax-only compile with real address spaces keeps mixing them up a compile error, as in MSL.
    if generic_address_spaces:
      _run([*cc, "-o", str(o)], f"compiling {name} for the emulator", input_text=generic)
      return
    check = _run_in_background([*cc, "-fsyntax-only"], f"compiling {name} for the emulator", code)
    try:
      _run([*cc, "-o", str(o)], f"compiling {name} for the emulator", input_text=generic)
    except EmulatorError:
      check()   # an address-space error is the one to report
      # Valid with address spaces, not without: overloads that differ only in address space. Compile as MSL has
      # it; accesses to device and threadgroup memory are then not checked for alignment.
      _run([*cc, "-o", str(o)], f"compiling {name} for the emulator", input_text=code)
      return
    check()

  _atomic_build(out, build)
  lib = _loaded[mem_key] = Library(out, kernels)
  return lib


def compile_file(path: str | os.PathLike) -> Library:
  """Compile a .metal file (headers next to it are found)."""
  p = Path(path)
  return compile_source(p.read_text(), p.name, (str(p.parent),))
