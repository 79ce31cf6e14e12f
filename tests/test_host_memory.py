"""host_memory.py: memory of our own lent to tinygrad's CPU device, and the tinygrad detail it leans on (a Buffer
carries the memory's owner). References are numpy; a tinygrad upgrade that changes from_blob or Buffer fails here."""
from __future__ import annotations
import ctypes, gc, mmap
import numpy as np
import pytest
from tinygrad import Tensor
from tinyvllm import host_memory


def _address(t: Tensor) -> int:
  return t.uop.buffer._buf.va_addr


def test_an_array_over_host_pages_becomes_the_tensor_itself():
  """No copy: the tensor reads the array's memory (a write after the hand-over shows), and the memory outlives
  every Python reference to the array and its pages (held by the buffer)."""
  rng = np.random.default_rng(0)
  want = rng.standard_normal((37, 64)).astype(np.float32)
  arr = host_memory.empty(want.shape, np.float32)
  arr[...] = want
  t = host_memory.host_tensor(arr, "CPU")
  assert isinstance(t.uop.buffer.host_memory, host_memory.HostPages)   # the owner rides on tinygrad's Buffer
  arr[3, 5] = 1234.5
  want[3, 5] = 1234.5
  del arr
  gc.collect()
  np.testing.assert_array_equal(t.numpy(), want)
  np.testing.assert_allclose((t * 2 + 1).numpy(), want * 2 + 1, rtol=1e-6)   # a kernel reads it too


@pytest.mark.parametrize("case", ["numpy", "offset", "transposed", "read_only_file"])
def test_other_arrays_are_copied_once_into_aligned_pages(case, tmp_path):
  """Arrays not over our pages from their first byte (numpy's own, a slice that starts inside our pages, a
  transposed view, a read-only mapping of a file, as a checkpoint's tensors are) are copied: later writes to the
  source do not show, the copy is page-aligned (tinygrad's C assumes vector alignment), and it equals the source."""
  rng = np.random.default_rng(1)
  src = rng.standard_normal((16, 48)).astype(np.float16)
  if case == "offset":
    whole = host_memory.empty((17, 48), np.float16)
    whole[1:] = src
    src = whole[1:]
  elif case == "transposed":
    whole = host_memory.empty((48, 16), np.float16)
    whole[...] = src.T
    src = whole.T
  elif case == "read_only_file":
    (tmp_path / "w.bin").write_bytes(src.tobytes())
    with open(tmp_path / "w.bin", "rb") as f: mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    src = np.frombuffer(mapped, np.float16).reshape(16, 48)
  want = np.array(src)
  assert host_memory.pages_of(src) is None
  t = host_memory.host_tensor(src, "CPU")
  assert _address(t) % mmap.PAGESIZE == 0
  if src.flags.writeable: src[0, 0] += 1
  np.testing.assert_array_equal(t.numpy(), want)


def test_pages_of_finds_ours_only():
  arr = host_memory.empty((8, 8), np.int32)
  assert host_memory.pages_of(arr) is not None
  assert host_memory.pages_of(arr.reshape(64)) is not None and host_memory.pages_of(arr.view(np.uint8)) is not None
  assert host_memory.pages_of(arr[1:]) is None and host_memory.pages_of(arr[:, :4]) is None
  assert host_memory.pages_of(np.empty((8, 8), np.int32)) is None
  plain = mmap.mmap(-1, 4096)   # anonymous memory that is not HostPages: not known as ours
  assert host_memory.pages_of(np.frombuffer(plain, np.uint8)) is None


def test_lent_memory_counts_as_device_bytes_while_it_lives():
  """GlobalCounters.mem_used (benchmarks' and tests' device bytes) counts lent buffers as tinygrad counts its own,
  and lets go of them when the buffer goes."""
  from tinygrad.helpers import GlobalCounters
  before = GlobalCounters.mem_used
  t = host_memory.host_tensor(np.ones((1000, 3), np.float32), "CPU")
  assert GlobalCounters.mem_used - before == 12000
  shared = host_memory.empty((500, 2), np.float32)   # one array lent twice (a draft model sharing its target's table)
  a, b = host_memory.host_tensor(shared, "CPU"), host_memory.host_tensor(shared, "CPU")
  assert GlobalCounters.mem_used - before == 16000
  del t, a
  gc.collect()
  assert GlobalCounters.mem_used - before == 4000
  host_memory.lend(host_memory.fresh_pages(800), (200,), b.dtype, "CPU", counted=False)   # the KV cache's way
  assert GlobalCounters.mem_used - before == 4000
  del b
  gc.collect()
  assert GlobalCounters.mem_used == before


def test_joined_rows_are_one_array_without_a_copy():
  """Consecutive row ranges of one array over our pages, in order, join into a view of that memory; anything else
  (out of order, a gap, other memory, another dtype) gets None, and the loader concatenates."""
  buf = host_memory.empty((10, 4), np.float32)
  buf[...] = np.random.default_rng(2).standard_normal((10, 4))
  q, k, v = buf[0:6], buf[6:8], buf[8:10]
  whole = host_memory.joined([q, k, v])
  assert whole is not None and host_memory.pages_of(whole) is not None
  whole[0, 0] = 7.0   # the same memory
  np.testing.assert_array_equal(whole, buf)
  assert host_memory.joined([k, q]) is None and host_memory.joined([q, v]) is None
  assert host_memory.joined([np.array(q), k]) is None and host_memory.joined([q, host_memory.empty((2, 4), np.float32)]) is None
  assert host_memory.joined([buf[2:4], buf[4:6]]) is not None   # rows from inside the pages join too
  assert host_memory.joined([q, k.view(np.int32)]) is None


def test_empty_arrays_and_zero_sizes():
  arr = host_memory.empty((0, 4), np.float32)
  assert arr.shape == (0, 4)
  assert host_memory.host_tensor(np.zeros((0, 4), np.float32), "CPU").shape == (0, 4)


def test_fresh_pages_are_zero_and_page_aligned():
  pages = host_memory.fresh_pages(3 * mmap.PAGESIZE + 5)
  assert ctypes.addressof(ctypes.c_char.from_buffer(pages)) % mmap.PAGESIZE == 0
  assert not np.frombuffer(pages, np.uint8).any()


def _thp_eligible(address: int) -> bool | None:
  """The kernel's THPeligible flag of the mapping holding `address` (/proc/self/smaps), None where there is none."""
  try: smaps = open("/proc/self/smaps").read()
  except OSError: return None
  lines, hit = smaps.splitlines(), False
  for line in lines:
    head = line.split()[0] if line else ""
    if "-" in head and all(c in "0123456789abcdef-" for c in head):
      lo, hi = (int(v, 16) for v in head.split("-"))
      hit = lo <= address < hi
    elif hit and line.startswith("THPeligible:"): return line.split()[1] == "1"
  return None


def test_huge_pages_are_asked_for_inside_the_context_only():
  """Inside huge_pages(), fresh pages of 2 MiB and more are madvised for transparent huge pages (the kernel's own
  smaps says the mapping is THP-eligible); outside it, and for smaller ones, they are not."""
  try: mode = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
  except OSError: pytest.skip("no transparent huge pages on this OS")
  if "[madvise]" not in mode: pytest.skip(f"THP mode is not madvise ({mode.strip()}): the advice changes nothing to see")
  address = lambda p: ctypes.addressof(ctypes.c_char.from_buffer(p))
  plain = host_memory.fresh_pages(4 << 20)
  with host_memory.huge_pages():
    huge, small = host_memory.fresh_pages(4 << 20), host_memory.fresh_pages(1 << 20)
    with host_memory.huge_pages(False): off = host_memory.fresh_pages(4 << 20)
  after = host_memory.fresh_pages(4 << 20)
  assert _thp_eligible(address(huge)) is True
  assert [_thp_eligible(address(p)) for p in (plain, small, off, after)] == [False] * 4
