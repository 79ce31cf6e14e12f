"""Memory we allocate ourselves, lent to tinygrad's CPU device as the buffers of tensors.

tinygrad's CPU allocator maps every buffer as shared anonymous memory, which gets 4 KiB pages only (shmem has no
transparent huge pages unless the host's admin enabled them), and a copy into a fresh buffer faults page by page:
loading an 8B Q4_K_M model spent 7.5 s of its 20 s in those copies, and 3 s more in tinygrad scheduling one copy per
tensor. Memory of our own costs less: private anonymous pages, written once by numpy and handed to tinygrad as
`Tensor.from_blob` does (asking for huge pages too, MADV_HUGEPAGE, made loading no faster here: the kernel's compaction
then slowed numpy's own allocations).

The tinygrad details relied on (tests/test_host_memory.py fails if they change): `Buffer.allocate(external_ptr=)`
(what `Tensor.from_blob` does after `Tensor.empty`); a Buffer takes attributes, so the memory's owner rides on the
buffer (`host_memory`) and lives exactly as long as the buffer does, however the tensor is reshaped, captured or
dropped; and `GlobalCounters.mem_used` (and its per-device split), which skip lent memory unless we count it.
"""
from __future__ import annotations
import contextlib, contextvars, ctypes, math, mmap, weakref
import numpy as np
from tinygrad import Tensor
from tinygrad.device import Buffer
from tinygrad.dtype import DType, _from_np_dtype
from tinygrad.helpers import GlobalCounters


class HostPages(mmap.mmap):
  """Fresh anonymous memory, page-aligned: zeroed by the OS and mapped page by page as it is first written. Private,
  so pages read before they are written map the shared zero page instead of committing memory. Its own class, so
  arrays over it are known as ours (never a checkpoint's mapping, whose pages the loader hands back to the OS)."""


HUGE_PAGE = 1 << 21
_huge = contextvars.ContextVar("tinyvllm_huge_pages", default=False)


@contextlib.contextmanager
def huge_pages(enabled: bool = True):
  """Within it, fresh pages of 2 MiB and more ask for transparent huge pages (Linux's MADV_HUGEPAGE, taken when the
  host's THP setting is "always" or "madvise"; elsewhere nothing changes). A decode step streams every weight once,
  and with 4 KiB pages each 4 KiB costs a TLB miss: a 1B Q4_K_M model decoded 1.08x as fast with them, an 8B 1.02x
  (two engines alternated in one process). The price is paid as the loader first writes the pages: the kernel
  compacts memory to find 2 MiB blocks (the 1B loaded in 2.6-3.5 s instead of 2.1-2.3, the 8B in 9.4-12.4 instead
  of 6.0 on this machine's fragmented memory), so the engine asks for them for small models only."""
  token = _huge.set(enabled)
  try: yield
  finally: _huge.reset(token)


def fresh_pages(nbytes: int) -> HostPages:
  flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS if hasattr(mmap, "MAP_ANONYMOUS") else None
  pages = HostPages(-1, max(nbytes, 1), **({"flags": flags} if flags is not None else {}))
  if _huge.get() and nbytes >= HUGE_PAGE and hasattr(mmap, "MADV_HUGEPAGE"): pages.madvise(mmap.MADV_HUGEPAGE)
  return pages


def empty(shape: tuple[int, ...], dtype) -> np.ndarray:
  """An uninitialized array over fresh pages: filled by numpy, it becomes a tensor's buffer without a copy
  (host_tensor), and anywhere else it is as good as np.empty's."""
  dtype = np.dtype(dtype)
  nbytes = math.prod(shape) * dtype.itemsize
  return np.frombuffer(fresh_pages(nbytes), np.uint8, nbytes).view(dtype).reshape(shape)


def owner(arr: np.ndarray):
  """What owns `arr`'s memory: the object at the end of its chain of bases (through np.frombuffer's memoryview), e.g.
  a checkpoint's mmap or our HostPages."""
  base = arr
  while isinstance(base, np.ndarray): base = base.base
  return base.obj if isinstance(base, memoryview) else base


def _address(pages: HostPages) -> int: return ctypes.addressof(ctypes.c_char.from_buffer(pages))


def pages_of(arr: np.ndarray) -> HostPages | None:
  """The HostPages `arr` covers from its first byte, C-contiguous, if it is such a view (else None)."""
  pages = owner(arr)
  if not isinstance(pages, HostPages) or not arr.flags.c_contiguous or not arr.flags.writeable: return None
  return pages if arr.ctypes.data == _address(pages) else None


def joined(arrays: list[np.ndarray]) -> np.ndarray | None:
  """`arrays` stacked along their first axis without a copy, when they are consecutive C-contiguous row ranges of one
  HostPages, in order (the loader quantizes q, k and v into one buffer: their fusion is then free); else None."""
  first, pages = arrays[0], owner(arrays[0])
  if not isinstance(pages, HostPages) or not first.flags.c_contiguous: return None
  for a, b in zip(arrays, arrays[1:]):
    if owner(b) is not pages or not b.flags.c_contiguous or b.dtype != first.dtype or b.shape[1:] != first.shape[1:] \
       or a.ctypes.data + a.nbytes != b.ctypes.data: return None
  rows = sum(len(a) for a in arrays)
  return np.frombuffer(pages, first.dtype, rows * math.prod(first.shape[1:]),
                       first.ctypes.data - _address(pages)).reshape(rows, *first.shape[1:])


def lend_buffer(buf: Buffer, mem: HostPages, counted: bool = True) -> None:
  """Make `mem` the memory of the unallocated CPU-device Buffer `buf`, alive as long as the buffer. tinygrad counts
  the memory it allocates (GlobalCounters.mem_used, the device bytes benchmarks and tests read), not memory it is
  lent: `counted` pages count while a buffer lends them, once however many do (a draft model may share its target's
  tables)."""
  buf.allocate(external_ptr=_address(mem))
  buf.host_memory = mem
  if not counted: return
  mem.lenders = getattr(mem, "lenders", 0) + 1
  if mem.lenders == 1: _count(buf.device, len(mem))
  weakref.finalize(buf, _unlend, mem, buf.device)


def _count(device: str, nbytes: int) -> None:
  GlobalCounters.mem_used += nbytes
  GlobalCounters.mem_used_per_device[device] += nbytes


def _unlend(mem: HostPages, device: str) -> None:
  mem.lenders -= 1
  if mem.lenders == 0: _count(device, -len(mem))


def lend(mem: HostPages, shape: tuple[int, ...], dtype: DType, device: str, counted: bool = True) -> Tensor:
  """A realized tensor on `device` (the CPU device) whose buffer is `mem` (lend_buffer): what Tensor.from_blob does."""
  t = Tensor.empty(*shape, dtype=dtype, device=device)
  lend_buffer(t.uop.buffer, mem, counted)
  return t


def host_tensor(arr: np.ndarray, device: str) -> Tensor:
  """`arr`'s contents as a tensor on the CPU device `device`, with no tinygrad scheduling: an array over HostPages
  (`empty`) becomes its buffer as it is; any other is copied once into fresh pages (page-aligned: tinygrad's
  generated C assumes its vector types' alignment, up to 64 bytes)."""
  if arr.size == 0: return Tensor.empty(*arr.shape, dtype=_from_np_dtype(arr.dtype), device=device)   # no buffer to lend
  if (pages := pages_of(arr)) is None:
    np.copyto(copy := empty(arr.shape, arr.dtype), arr, casting="no")
    pages = pages_of(copy)
  return lend(pages, arr.shape, _from_np_dtype(arr.dtype), device)
