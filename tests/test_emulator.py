"""The MSL emulator itself: SIMD-group functions, barriers, threadgroup memory, lane orders, and the mistakes it must
catch (deliberately broken kernels live below), plus the TinyJit route through tinygrad's CPU device."""

import numpy as np
import pytest

from tinyvllm.kernels.emulator import EmulatorError, compile_source
from tinyvllm.kernels.emulator.harness import parse_kernels, rewrite_threadgroup

ORDERS = ("forward", "reverse", "random")

# **** kernels ****

SIMD_SRC = """
#include <metal_stdlib>
using namespace metal;

// out[tg][lane][0..7]: the results of eight SIMD-group functions for one input per lane
kernel void simd_ops(device const float* x [[buffer(0)]], device float* out [[buffer(1)]],
                     uint gid [[thread_position_in_grid]], ushort lane [[thread_index_in_simdgroup]]) {
  const float v = x[gid];
  device float* o = out + gid * 8;
  o[0] = simd_sum(v);
  o[1] = simd_max(v);
  o[2] = simd_min(v);
  o[3] = simd_shuffle_xor(v, 5);
  o[4] = simd_shuffle_down(v, 3);
  o[5] = simd_prefix_exclusive_sum(v);
  o[6] = simd_broadcast(v, 7);
  o[7] = simd_shuffle(v, (lane * 3) % 32);
}

// Vector constructors, swizzles, as_type and half maths
kernel void vectors(device const half4* h [[buffer(0)]], device float4* out [[buffer(1)]],
                    device uint* bits [[buffer(2)]], uint i [[thread_position_in_grid]]) {
  const float4 f = float4(h[i]);
  const float2 ab = f.xy * 2.0f;
  out[2 * i] = float4(ab, f.zw);
  out[2 * i + 1] = float4(exp(f.x), max(f.y, 0.5f), dot(f, f), float(h[i].w * h[i].w));
  bits[i] = as_type<uint>(f.x);
}

// Block sum with SIMD-group partials in threadgroup memory (two barriers)
template <typename T, int N>
[[kernel]] void block_sum(device const T* x [[buffer(0)]], device float* out [[buffer(1)]],
                          uint3 tg [[threadgroup_position_in_grid]], uint tid [[thread_index_in_threadgroup]],
                          uint lane [[thread_index_in_simdgroup]], uint sg [[simdgroup_index_in_threadgroup]]) {
  threadgroup float part[N / 32];
  float v = simd_sum(float(x[tg.x * N + tid]));
  if (lane == 0) part[sg] = v;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (sg == 0) {
    float s = lane < N / 32 ? part[lane] : 0.0f;
    s = simd_sum(s);
    if (lane == 0) out[tg.x] = s;
  }
}
template [[host_name("block_sum_f32_256")]] [[kernel]] decltype(block_sum<float, 256>) block_sum<float, 256>;
template [[host_name("block_sum_f16_64")]] [[kernel]] decltype(block_sum<half, 64>) block_sum<half, 64>;

// 8x8 simdgroup matrices: C = A @ B for one 8x8 tile
kernel void mma8(device const float* a [[buffer(0)]], device const float* b [[buffer(1)]], device float* c [[buffer(2)]]) {
  simdgroup_float8x8 ma, mb, mc = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  simdgroup_load(ma, a, 8, 0, false);
  simdgroup_load(mb, b, 8, ulong2(0, 0), true);
  simdgroup_multiply_accumulate(mc, ma, mb, mc);
  simdgroup_store(mc, c, 8);
}
"""

# Deliberately broken kernels: the emulator must report each one.
BROKEN_SRC = """
#include <metal_stdlib>
using namespace metal;

// Reverses a row through threadgroup memory but forgot the barrier between the write and the read.
kernel void missing_barrier(device const float* x [[buffer(0)]], device float* out [[buffer(1)]],
                            uint tid [[thread_index_in_threadgroup]]) {
  threadgroup float t[64];
  t[tid] = x[tid];
  out[tid] = t[63 - tid];
}

// A barrier only half of the threads reach.
kernel void divergent_barrier(device float* out [[buffer(0)]], uint tid [[thread_index_in_threadgroup]]) {
  threadgroup float t[64];
  t[tid] = float(tid);
  if (tid < 32) threadgroup_barrier(mem_flags::mem_threadgroup);
  out[tid] = t[tid];
}

// Two different barriers on the two sides of a branch.
kernel void split_barriers(device float* out [[buffer(0)]], uint tid [[thread_index_in_threadgroup]]) {
  if (tid % 2 == 0) {
    threadgroup_barrier(mem_flags::mem_threadgroup);
  } else {
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  out[tid] = 1.0f;
}

// simd_sum in a branch taken by half of a SIMD-group while the other half waits at a barrier.
kernel void divergent_simd(device float* out [[buffer(0)]], uint tid [[thread_index_in_threadgroup]]) {
  float v = 1.0f;
  if (tid % 32 < 16) v = simd_sum(v);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[tid] = v;
}

// Reads one float4 past the end of its input.
kernel void read_past_end(device const float4* x [[buffer(0)]], device float* out [[buffer(1)]],
                          uint tid [[thread_index_in_threadgroup]]) {
  out[tid] = x[tid + 1].x;
}

// Writes 4 KB before the start of its output (into the guard page in front of it).
kernel void write_before_start(device float* out [[buffer(0)]], uint tid [[thread_index_in_threadgroup]]) {
  out[(int)tid - 1024] = 1.0f;
}

// 40 KB of threadgroup memory (Apple GPUs allow 32 KB).
kernel void too_much_tg(device float* out [[buffer(0)]], uint tid [[thread_index_in_threadgroup]]) {
  threadgroup float t[10240];
  t[tid] = 1.0f;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[tid] = t[tid];
}
"""

# **** tests ****


@pytest.fixture(scope="module")
def simd_lib(): return compile_source(SIMD_SRC, "simd_test.metal")


@pytest.fixture(scope="module")
def broken_lib(): return compile_source(BROKEN_SRC, "broken.metal")


def simd_reference(x: np.ndarray) -> np.ndarray:
  out = np.zeros((x.size, 8), np.float32)
  for s in range(0, x.size, 32):
    v = x[s:s + 32].astype(np.float64)
    lanes = np.arange(32)
    out[s:s + 32, 0] = v.sum()
    out[s:s + 32, 1] = v.max()
    out[s:s + 32, 2] = v.min()
    out[s:s + 32, 3] = v[lanes ^ 5]
    out[s:s + 32, 4] = np.where(lanes + 3 < 32, v[np.minimum(lanes + 3, 31)], v)  # out-of-range lanes keep their own
    out[s:s + 32, 5] = np.concatenate([[0], np.cumsum(v)[:-1]])
    out[s:s + 32, 6] = v[7]
    out[s:s + 32, 7] = v[(lanes * 3) % 32]
  return out


@pytest.mark.parametrize("order", ORDERS)
def test_simd_functions(simd_lib, order):
  x = np.random.default_rng(0).standard_normal(128).astype(np.float32)
  out = np.zeros((128, 8), np.float32)
  simd_lib.run("simd_ops", [x, out], (2,), (64,), order=order, seed=3)
  np.testing.assert_allclose(out, simd_reference(x), rtol=1e-5, atol=1e-5)  # float sums in tree order vs float64


def test_vectors_and_half(simd_lib):
  h = np.random.default_rng(1).standard_normal((16, 4)).astype(np.float16)
  out, bits = np.zeros((32, 4), np.float32), np.zeros(16, np.uint32)
  simd_lib.run("vectors", [h, out, bits], (1,), (16,))
  f = h.astype(np.float32)
  np.testing.assert_array_equal(out[0::2], np.concatenate([f[:, :2] * 2, f[:, 2:]], 1))
  hw = (h[:, 3] * h[:, 3]).astype(np.float32)  # half multiply, rounded to half
  expect = np.stack([np.exp(f[:, 0]), np.maximum(f[:, 1], 0.5), (f * f).sum(1), hw], 1)
  np.testing.assert_allclose(out[1::2], expect, rtol=1e-6)
  np.testing.assert_array_equal(bits, f[:, 0].view(np.uint32))


@pytest.mark.parametrize("order", ORDERS)
def test_block_sum_templates(simd_lib, order):
  rng = np.random.default_rng(2)
  x = rng.standard_normal((8, 256)).astype(np.float32)
  out = np.zeros(8, np.float32)
  simd_lib.run("block_sum_f32_256", [x, out], (8,), (256,), order=order)
  np.testing.assert_allclose(out, x.sum(1), rtol=1e-5, atol=1e-5)
  xh = rng.standard_normal((4, 64)).astype(np.float16)
  out = np.zeros(4, np.float32)
  simd_lib.run("block_sum_f16_64", [xh, out], (4,), (64,), order=order)
  np.testing.assert_allclose(out, xh.astype(np.float32).sum(1), rtol=1e-5, atol=1e-5)


def test_os_threads(simd_lib):
  x = np.random.default_rng(8).standard_normal((64, 256)).astype(np.float32)
  out = np.zeros(64, np.float32)
  simd_lib.run("block_sum_f32_256", [x, out], (64,), (256,), os_threads=2, order="random")
  np.testing.assert_allclose(out, x.sum(1), rtol=1e-5, atol=1e-5)


def test_simdgroup_matrix(simd_lib):
  rng = np.random.default_rng(3)
  a, b = rng.standard_normal((8, 8)).astype(np.float32), rng.standard_normal((8, 8)).astype(np.float32)
  c = np.zeros((8, 8), np.float32)
  simd_lib.run("mma8", [a, b, c], (1,), (32,))
  np.testing.assert_allclose(c, a @ b.T, rtol=1e-5, atol=1e-5)  # b loaded transposed


def test_missing_barrier_is_caught(broken_lib):
  # Threadgroup memory starts as NaN: whichever order the threads run in, some read a slot not yet written.
  x = np.arange(64, dtype=np.float32)
  for order in ("forward", "reverse"):
    out = np.zeros(64, np.float32)
    broken_lib.run("missing_barrier", [x, out], (1,), (64,), order=order)
    assert np.isnan(out).sum() == 32, order


@pytest.mark.parametrize("kernel,pattern", [
    ("divergent_barrier", r"threadgroup_barrier at line \d+ reached by 32 of 64 threads"),
    ("split_barriers", r"different threadgroup barriers"),
    ("divergent_simd", r"divergent SIMD-group operation"),
])
def test_divergence_is_reported(broken_lib, kernel, pattern):
  with pytest.raises(EmulatorError, match=pattern) as e:
    broken_lib.run(kernel, [np.zeros(64, np.float32)], (1,), (64,))
  assert kernel in str(e.value) and "broken.metal" in str(e.value)


def test_out_of_bounds_is_reported(broken_lib):
  with pytest.raises(EmulatorError, match=r"past the end of buffer 0 `x` \(512 bytes\)"):
    broken_lib.run("read_past_end", [np.zeros((32, 4), np.float32), np.zeros(32, np.float32)], (1,), (32,))
  with pytest.raises(EmulatorError, match=r"before the start of buffer 0 `out`"):
    broken_lib.run("write_before_start", [np.zeros(32, np.float32)], (1,), (32,))
  # without guards the same launch would silently read the neighbouring memory
  out = np.zeros(32, np.float32)
  broken_lib.run("read_past_end", [np.zeros((33, 4), np.float32), out], (1,), (32,))


def test_limits_are_reported(broken_lib):
  with pytest.raises(EmulatorError, match="threadgroup memory exceeds 32768 bytes"):
    broken_lib.run("too_much_tg", [np.zeros(64, np.float32)], (1,), (64,))
  with pytest.raises(EmulatorError, match="2048 threads per threadgroup"):
    broken_lib.run("too_much_tg", [np.zeros(64, np.float32)], (1,), (2048,))


def test_compile_time_rejections():
  with pytest.raises(EmulatorError, match="duplicate"):
    compile_source("#include <metal_stdlib>\nkernel void f(device float* a [[buffer(0)]], device float* b [[buffer(0)]]) {}", "dup.metal")
  with pytest.raises(EmulatorError, match="double"):  # Metal has no double
    compile_source("#include <metal_stdlib>\nkernel void f(device float* a [[buffer(0)]]) { double d = a[0]; a[0] = d; }", "dbl.metal")
  with pytest.raises(EmulatorError, match="not supported"):
    compile_source("#include <metal_stdlib>\nkernel void f(device float* a [[buffer(0)]], float x [[stage_in]]) {}", "stage.metal")


ADDRESS_SPACE_MISTAKES = {  # each compiles as plain C++ but not as MSL; the emulator must reject it too
  "threadgroup_as_device": "METAL_FUNC void put(device float* d) { d[0] = 1.0f; }\n"
                           "kernel void f(device float* o [[buffer(0)]]) { threadgroup float t[32]; put(t); o[0] = t[0]; }",
  "constant_as_thread_ref": "struct P { int n; };\nMETAL_FUNC int get(const thread P& p) { return p.n; }\n"
                            "kernel void f(device int* o [[buffer(0)]], constant P& p [[buffer(1)]]) { o[0] = get(p); }",
  "write_to_constant": "kernel void f(constant float* x [[buffer(0)]]) { x[0] = 1.0f; }",
  "device_as_thread": "METAL_FUNC float first(const float* p) { return p[0]; }\n"
                      "kernel void f(device const float* x [[buffer(0)]], device float* y [[buffer(1)]]) { y[0] = first(x); }",
}


@pytest.mark.parametrize("name", sorted(ADDRESS_SPACE_MISTAKES))
def test_address_space_mistakes_are_compile_errors(name):
  with pytest.raises(EmulatorError, match="error"):
    compile_source("#include <metal_stdlib>\nusing namespace metal;\n" + ADDRESS_SPACE_MISTAKES[name], f"{name}.metal")


def test_cpp17_is_rejected():
  body = "kernel void f(device float* a [[buffer(0)]]) { if constexpr (sizeof(float) == 4) a[0] = 1.0f; }"
  with pytest.raises(EmulatorError, match="if constexpr"):
    compile_source("#include <metal_stdlib>\nusing namespace metal;\n" + body, "cxx17.metal")


def test_program_scope_constants():
  lib = compile_source("#include <metal_stdlib>\nusing namespace metal;\nconstant float SCALE = 0.5f;\n"
                       "kernel void f(device const float* x [[buffer(0)]], device float* y [[buffer(1)]], uint i [[thread_position_in_grid]]) {\n"
                       "  y[i] = x[i] * SCALE;\n}", "consts.metal")
  x, y = np.arange(4, dtype=np.float32), np.zeros(4, np.float32)
  lib.run("f", [x, y], (1,), (4,))
  np.testing.assert_array_equal(y, x * 0.5)


def test_parser_and_rewrite():
  text = ('template <typename T, int N>\n[[kernel]] void k(device const T* a [[buffer(0)]], constant int& n [[buffer(1)]],\n'
          '  uint3 g [[threadgroup_position_in_grid]]) {\n  threadgroup float4 t[N][2];\n}\n'
          'template [[host_name("k_" "f32")]] [[kernel]] decltype(k<float, 4>) k<float, 4>;\n')
  (k,) = parse_kernels(text, "x.metal")
  assert (k.name, k.func) == ("k_f32", "k<float, 4>")
  assert [(p.name, p.buffer, p.builtin, p.writable) for p in k.params] == \
      [("a", 0, None, False), ("n", 1, None, False), ("g", None, "threadgroup_position_in_grid", False)]
  rewritten = rewrite_threadgroup(text)
  assert "__tv_tg_alloc(0, sizeof(__tv_tg_t0), alignof(float4))" in rewritten
  assert rewritten.count("\n") == text.count("\n")  # line numbers preserved


def test_compile_cache_returns_the_loaded_library(simd_lib):
  """A second compile of the same source is the library already loaded (no rebuild), and it still runs correctly."""
  assert compile_source(SIMD_SRC, "simd_test.metal") is simd_lib
  x = np.random.default_rng(4).standard_normal((64, 256)).astype(np.float32)
  out = np.zeros(64, np.float32)
  simd_lib.run("block_sum_f32_256", [x, out], (64,), (256,))
  np.testing.assert_allclose(out, x.astype(np.float64).sum(1), rtol=1e-5, atol=1e-4)


def test_tinyjit_route_and_deferred_errors(tmp_path):
  # The emulator backend runs kernels as tinygrad CPU kernels; errors inside them surface through check().
  from tinygrad import Tensor, TinyJit, dtypes
  from tinyvllm.kernels.metal import EmulatorBackend, Launch
  src = tmp_path / "jit_test.metal"
  src.write_text(SIMD_SRC.replace("simd_ops", "simd_ops_jit") + BROKEN_SRC.split("using namespace metal;")[1])
  be = EmulatorBackend(order="random", seed=5)
  launch = Launch(str(src), "block_sum_f32_256", ("x", "out"), (0,), (4, 1, 1), (256, 1, 1))

  @TinyJit
  def f(x):
    out = Tensor.empty(4, dtype=dtypes.float32)
    return (be.run(launch, x, out)[1] * 2).realize()

  rng = np.random.default_rng(6)
  for _ in range(4):  # call 0 eager, 1 captures, 2-3 replay with new data
    x = rng.standard_normal((4, 256)).astype(np.float32)
    np.testing.assert_allclose(f(Tensor(x).realize()).numpy(), 2 * x.sum(1), rtol=1e-5, atol=1e-5)
  be.check()

  bad = Launch(str(src), "divergent_barrier", ("out",), (0,), (1, 1, 1), (64, 1, 1))
  be.run(bad, Tensor.zeros(64, dtype=dtypes.float32).contiguous())[0].realize()
  with pytest.raises(EmulatorError, match="divergent_barrier"):
    be.check()


# **** what tinygrad's MSL and Apple's compiler need from the emulator ****

# tinygrad writes kernels like this one: no [[buffer(n)]] (Metal numbers buffers in declaration order), aligned
# threadgroup arrays, and simdgroup matrices filled and read element by element through thread_elements().
TINYGRAD_STYLE_SRC = """
#include <metal_stdlib>
using namespace metal;
kernel void tc(device float* c, device const float* a, device const float* b, device float* own,
               uint3 gid [[threadgroup_position_in_grid]], uint3 lid [[thread_position_in_threadgroup]]) {
  threadgroup __attribute__((aligned(16))) float stage[64];
  const uint lane = lid.x;
  // b staged through threadgroup memory and read back as float4: legal only because `stage` is declared aligned
  stage[lane] = b[lane]; stage[lane + 32] = b[lane + 32];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  simdgroup_float8x8 ma, mb, mc = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  simdgroup_load(ma, a, 8);
  const uint row = (lane / 16) * 4 + (lane / 2) % 4, col = ((lane / 8) % 2) * 4 + (lane % 2) * 2;
  const float4 quad = *(threadgroup const float4*)(stage + row * 8 + (col / 4) * 4);
  mb.thread_elements()[0] = quad[col % 4];
  mb.thread_elements()[1] = quad[col % 4 + 1];
  simdgroup_multiply_accumulate(mc, ma, mb, mc);
  own[2 * lane] = mc.thread_elements()[0];
  own[2 * lane + 1] = mc.thread_elements()[1];
  simdgroup_store(mc, c, 8);
}
"""


def apple_lane_layout():
  """(row, column) of the two elements lane l holds of an 8x8 simdgroup matrix (Apple's layout, as MLX documents it)."""
  lanes = np.arange(32)
  rows = (lanes // 16) * 4 + (lanes // 2) % 4
  cols = ((lanes // 8) % 2) * 4 + (lanes % 2) * 2
  return rows, cols


def test_tinygrad_style_kernel():
  lib = compile_source(TINYGRAD_STYLE_SRC, "tinygrad_style.metal")
  assert [p.buffer for p in lib.kernels["tc"].buffers] == [0, 1, 2, 3]   # declaration order
  rng = np.random.default_rng(11)
  a, b = rng.standard_normal((8, 8)).astype(np.float32), rng.standard_normal((8, 8)).astype(np.float32)
  c, own = np.zeros((8, 8), np.float32), np.zeros((32, 2), np.float32)
  lib.run("tc", [c, a, b, own], (1,), (32,), order="random", seed=2)
  ref = a.astype(np.float64) @ b
  np.testing.assert_allclose(c, ref, rtol=1e-5, atol=1e-5)
  rows, cols = apple_lane_layout()
  np.testing.assert_allclose(own, np.stack([ref[rows, cols], ref[rows, cols + 1]], 1), rtol=1e-5, atol=1e-5)


def test_lane_layout_covers_the_tile():
  rows, cols = apple_lane_layout()
  cells = {(r, c + j) for r, c in zip(rows, cols) for j in (0, 1)}
  assert len(cells) == 64 and all(0 <= r < 8 and 0 <= c < 8 for r, c in cells)


UNALIGNED_TG = """
#include <metal_stdlib>
using namespace metal;
kernel void tg_vec(device const float* x [[buffer(0)]], device float4* out [[buffer(1)]], uint tid [[thread_index_in_threadgroup]]) {
  threadgroup DECL float t[64];
  t[tid] = x[tid];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (tid < 16) out[tid] = *(threadgroup const float4*)(t + 4 * tid);
}
kernel void device_vec(device const float* x [[buffer(0)]], device float4* out [[buffer(1)]], uint tid [[thread_index_in_threadgroup]]) {
  out[tid] = *(device const float4*)(x + 4 * tid + OFFSET);
}
"""


@pytest.mark.parametrize("aligned", [False, True])
def test_misaligned_vector_access_is_reported(aligned):
  src = UNALIGNED_TG.replace("DECL", "__attribute__((aligned(16)))" if aligned else "").replace("OFFSET", "0" if aligned else "1")
  lib = compile_source(src, f"align_{aligned}.metal")
  x = np.random.default_rng(12).standard_normal(68).astype(np.float32)
  for kernel, threads in (("tg_vec", 64), ("device_vec", 16)):
    out = np.zeros((16, 4), np.float32)
    if aligned:
      lib.run(kernel, [x, out], (1,), (threads,))
      np.testing.assert_array_equal(out.reshape(-1), x[:64])
    else:   # on a Mac: undefined (wrong data or a fault); here always an error
      with pytest.raises(EmulatorError, match="misaligned"):
        lib.run(kernel, [x, out], (1,), (threads,))


def test_geometry_builtins_must_agree_in_width():
  body = ("kernel void f(device float* o [[buffer(0)]], uint3 tg [[threadgroup_position_in_grid]], "
          "{} n [[threads_per_threadgroup]]) {{ o[tg.x] = 1.0f; }}")
  compile_source("#include <metal_stdlib>\nusing namespace metal;\n" + body.format("uint3"), "widths_ok.metal")
  with pytest.raises(EmulatorError, match="agree in vector width"):
    compile_source("#include <metal_stdlib>\nusing namespace metal;\n" + body.format("uint"), "widths_bad.metal")
  with pytest.raises(EmulatorError, match="must be uint or ushort"):
    compile_source("#include <metal_stdlib>\nusing namespace metal;\nkernel void f(device float* o [[buffer(0)]], "
                   "int i [[thread_position_in_grid]]) { o[i] = 1.0f; }", "signed_builtin.metal")


def test_buffers_numbered_all_or_none():
  with pytest.raises(EmulatorError, match="number all of them or none"):
    compile_source("#include <metal_stdlib>\nusing namespace metal;\nkernel void f(device float* a [[buffer(0)]], device float* b, "
                   "uint i [[thread_position_in_grid]]) { b[i] = a[i]; }", "mixed_numbering.metal")


HALF_SRC = """
#include <metal_stdlib>
using namespace metal;
kernel void to_float(device const half* h [[buffer(0)]], device float* f [[buffer(1)]], uint i [[thread_position_in_grid]]) { f[i] = float(h[i]); }
kernel void to_half(device const float* f [[buffer(0)]], device half* h [[buffer(1)]], uint i [[thread_position_in_grid]]) { h[i] = half(f[i]); }
"""


def test_half_conversions_match_ieee():
  # The emulator converts half in software (no F16C): every half exactly to float, and floats to the nearest half
  # with ties to even, subnormals, overflow to inf and NaN, as numpy (IEEE 754) does.
  lib = compile_source(HALF_SRC, "half_conv.metal")
  h = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16)
  f = np.zeros(65536, np.float32)
  lib.run("to_float", [h, f], (256,), (256,))
  ref = h.astype(np.float32)
  nan = np.isnan(ref)
  assert np.array_equal(np.isnan(f), nan) and np.array_equal(f[~nan].view(np.uint32), ref[~nan].view(np.uint32))

  rng = np.random.default_rng(13)
  finite = ref[~nan & np.isfinite(ref)].astype(np.float64)
  srt = np.unique(finite)
  ties = ((srt[1:] + srt[:-1]) / 2).astype(np.float32)            # exactly halfway between neighbouring halves
  near = np.nextafter(ties, np.float32(np.inf))                     # just above a tie
  rand = rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
  xs = np.concatenate([ties, near, rand, np.float32([65504, 65520, 65519.99, 1e-8, -0.0, np.inf, -np.inf])]).astype(np.float32)
  xs = np.ascontiguousarray(xs[: len(xs) // 256 * 256])
  out = np.zeros(len(xs), np.float16)
  lib.run("to_half", [xs, out], (len(xs) // 256,), (256,))
  with np.errstate(over="ignore"): ref = xs.astype(np.float16)
  nan = np.isnan(ref)
  assert np.array_equal(np.isnan(out), nan)
  bad = np.flatnonzero(out[~nan].view(np.uint16) != ref[~nan].view(np.uint16))
  assert bad.size == 0, f"{bad.size} conversions differ, e.g. {xs[~nan][bad[:3]]}"


# **** integer SIMD-group reductions ****

INT_SIMD_SRC = """
#include <metal_stdlib>
using namespace metal;
// out[gid][0..6]: sum, product, max, min, and, or, xor over the SIMD-group, for int and uint, scalar and vector
template <typename T>
kernel void int_reduce(device const T* x [[buffer(0)]], device T* out [[buffer(1)]], uint gid [[thread_position_in_grid]]) {
  const T v = x[gid];
  device T* o = out + gid * 9;
  o[0] = simd_sum(v);
  o[1] = simd_product(v);
  o[2] = simd_max(v);
  o[3] = simd_min(v);
  o[4] = simd_and(v);
  o[5] = simd_or(v);
  o[6] = simd_xor(v);
  o[7] = simd_prefix_exclusive_sum(v);
  o[8] = simd_prefix_inclusive_product(v);
}
template [[host_name("int_reduce_i32")]] [[kernel]] decltype(int_reduce<int>) int_reduce<int>;
template [[host_name("int_reduce_u32")]] [[kernel]] decltype(int_reduce<uint>) int_reduce<uint>;
template [[host_name("int_reduce_i16")]] [[kernel]] decltype(int_reduce<short>) int_reduce<short>;
template [[host_name("int_reduce_u16")]] [[kernel]] decltype(int_reduce<ushort>) int_reduce<ushort>;

kernel void int4_reduce(device const int4* x [[buffer(0)]], device int4* out [[buffer(1)]], uint gid [[thread_position_in_grid]]) {
  const int4 v = x[gid];
  out[gid * 4] = simd_max(v);
  out[gid * 4 + 1] = simd_min(v);
  out[gid * 4 + 2] = simd_sum(v);
  out[gid * 4 + 3] = simd_xor(v);
}
kernel void uint2_reduce(device const uint2* x [[buffer(0)]], device uint2* out [[buffer(1)]], uint gid [[thread_position_in_grid]]) {
  const uint2 v = x[gid];
  out[gid * 2] = simd_max(v);
  out[gid * 2 + 1] = simd_min(v);
}
kernel void float4_reduce(device const float4* x [[buffer(0)]], device float4* out [[buffer(1)]], uint gid [[thread_position_in_grid]]) {
  out[gid * 2] = simd_max(x[gid]);
  out[gid * 2 + 1] = simd_min(x[gid]);
}
"""


def _wrapping_reduce(v: np.ndarray, op) -> np.ndarray:
  acc = v[0]
  for e in v[1:]: acc = op(acc, e)
  return acc


@pytest.mark.parametrize("dtype,name", [(np.int32, "int_reduce_i32"), (np.uint32, "int_reduce_u32"),
                                        (np.int16, "int_reduce_i16"), (np.uint16, "int_reduce_u16")])
def test_integer_simd_reductions(dtype, name):
  # Metal defines simd_sum/product/max/min/and/or/xor for integer types: exact, wrapping integer results, compared
  # as signed or unsigned by the type (a uint above 2^31 is the largest, an int with that bit the smallest).
  lib = compile_source(INT_SIMD_SRC, "int_simd.metal")
  info = np.iinfo(dtype)
  rng = np.random.default_rng(21)
  x = rng.integers(info.min, info.max, 64, dtype=dtype, endpoint=True)
  x[5], x[40] = info.max, info.min                        # extremes decide max/min; the sums overflow and wrap
  x[32:64:3] = x[32:64:3] | dtype(1)                      # odd factors: the product of the second group is not 0
  out = np.zeros((64, 9), dtype)
  lib.run(name, [x, out], (1,), (64,), order="random", seed=1)
  with np.errstate(over="ignore"):
    for s in (0, 32):
      v = x[s:s + 32]
      expect = [v.sum(dtype=dtype), _wrapping_reduce(v, lambda a, b: dtype(a * b)), v.max(), v.min(),
                _wrapping_reduce(v, np.bitwise_and), _wrapping_reduce(v, np.bitwise_or), _wrapping_reduce(v, np.bitwise_xor)]
      np.testing.assert_array_equal(out[s:s + 32, :7], np.broadcast_to(np.array(expect, dtype), (32, 7)))
      np.testing.assert_array_equal(out[s:s + 32, 7], np.concatenate([[0], np.cumsum(v, dtype=dtype)[:-1]]).astype(dtype))
      np.testing.assert_array_equal(out[s:s + 32, 8], np.cumprod(v, dtype=dtype))


def test_integer_and_float_vector_simd_reductions():
  lib = compile_source(INT_SIMD_SRC, "int_simd.metal")
  rng = np.random.default_rng(22)
  x = rng.integers(-2**31, 2**31 - 1, (32, 4), dtype=np.int32)
  out = np.zeros((32 * 4, 4), np.int32)
  lib.run("int4_reduce", [x, out], (1,), (32,))
  with np.errstate(over="ignore"):
    expect = np.stack([x.max(0), x.min(0), x.sum(0, dtype=np.int32), np.bitwise_xor.reduce(x, 0)])
  np.testing.assert_array_equal(out.reshape(32, 4, 4), np.broadcast_to(expect, (32, 4, 4)))
  u = rng.integers(0, 2**32 - 1, (32, 2), dtype=np.uint32)
  out = np.zeros((64, 2), np.uint32)
  lib.run("uint2_reduce", [u, out], (1,), (32,))
  np.testing.assert_array_equal(out.reshape(32, 2, 2), np.broadcast_to(np.stack([u.max(0), u.min(0)]), (32, 2, 2)))
  f = rng.standard_normal((32, 4)).astype(np.float32)
  f[3, 1] = np.nan                                        # fmax/fmin semantics: a NaN lane is ignored
  out = np.zeros((64, 4), np.float32)
  lib.run("float4_reduce", [f, out], (1,), (32,))
  np.testing.assert_array_equal(out.reshape(32, 2, 4), np.broadcast_to(np.stack([np.nanmax(f, 0), np.nanmin(f, 0)]), (32, 2, 4)))


# **** simdgroup_matrix: computed once per SIMD-group, same results as every lane computing the tile ****

MMA_SRC = """
#include <metal_stdlib>
using namespace metal;
// n chained products per SIMD-group: C = A_k @ B_k + C, A/B half (loaded, A transposed on odd k), C float;
// then D = C (as half) @ E built lane by lane through thread_elements() (as tinygrad does), stored and read back.
kernel void mma_chain(device const half* a [[buffer(0)]], device const half* b [[buffer(1)]], device float* c [[buffer(2)]],
                      device float* own [[buffer(3)]], device float* d [[buffer(4)]], constant uint& n [[buffer(5)]],
                      uint lane [[thread_index_in_simdgroup]], uint sg [[simdgroup_index_in_threadgroup]]) {
  simdgroup_float8x8 acc = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  for (uint k = 0; k < n; k++) {
    simdgroup_half8x8 ma, mb;
    simdgroup_load(ma, a + (sg * n + k) * 64, 8, 0, k % 2 == 1);
    simdgroup_load(mb, b + (sg * n + k) * 64, 8);
    simdgroup_multiply_accumulate(acc, ma, mb, acc);
  }
  simdgroup_store(acc, c + sg * 64, 8);
  own[(sg * 32 + lane) * 2] = acc.thread_elements()[0];
  own[(sg * 32 + lane) * 2 + 1] = acc.thread_elements()[1];
  simdgroup_half8x8 ch, e;
  ch.thread_elements()[0] = half(acc.thread_elements()[0]);
  ch.thread_elements()[1] = half(acc.thread_elements()[1]);
  e.thread_elements()[0] = half(float(lane) / 32.0f);
  e.thread_elements()[1] = half(-float(lane) / 64.0f);
  simdgroup_float8x8 md;
  simdgroup_multiply(md, ch, e);
  simdgroup_store(md, d + sg * 64, 8);
}
// Half of each SIMD-group multiplies, the other half stores: divergent, must be reported.
kernel void mma_divergent(device float* c [[buffer(0)]], uint lane [[thread_index_in_simdgroup]]) {
  simdgroup_float8x8 m = make_filled_simdgroup_matrix<float, 8, 8>(1.0f);
  if (lane < 16) simdgroup_multiply_accumulate(m, m, m, m);
  else simdgroup_store(m, c, 8);
}
// Lanes 16..31 return first: the multiply then sees their elements as NaN (inactive lanes), as before.
kernel void mma_inactive(device float* c [[buffer(0)]], uint lane [[thread_index_in_simdgroup]]) {
  if (lane >= 16) return;
  simdgroup_float8x8 m = make_filled_simdgroup_matrix<float, 8, 8>(1.0f), r;
  simdgroup_multiply(r, m, m);
  simdgroup_store(r, c, 8);
}
"""


def _mma_reference(a, b, n, nsg):
  """Float32 accumulation in the emulator's order: c_ij = c_ij + a_i0 b_0j + ... + a_i7 b_7j, product by product."""
  c = np.zeros((nsg, 8, 8), np.float32)
  for s in range(nsg):
    for k in range(n):
      ma = a[s, k].astype(np.float32)
      ma = ma.T if k % 2 == 1 else ma
      mb = b[s, k].astype(np.float32)
      for kk in range(8): c[s] = c[s] + ma[:, kk:kk + 1] * mb[kk:kk + 1, :]
  return c


def test_simdgroup_matrix_exact_and_once_per_simdgroup():
  lib = compile_source(MMA_SRC, "mma_chain.metal")
  rng = np.random.default_rng(23)
  n, nsg = 6, 4
  a = rng.standard_normal((nsg, n, 8, 8)).astype(np.float16)
  b = rng.standard_normal((nsg, n, 8, 8)).astype(np.float16)
  ref = _mma_reference(a, b, n, nsg)
  rows, cols = apple_lane_layout()
  lanes = np.arange(32)
  e = np.zeros((8, 8), np.float32)
  e[rows, cols], e[rows, cols + 1] = (lanes / 32).astype(np.float16), (-lanes / 64).astype(np.float16)
  for order in ORDERS:
    c, own, d = np.zeros((nsg, 8, 8), np.float32), np.zeros((nsg, 32, 2), np.float32), np.zeros((nsg, 8, 8), np.float32)
    lib.run("mma_chain", [a, b, c, own, d, np.array([n], np.uint32)], (1,), (32 * nsg,), order=order, seed=4)
    np.testing.assert_array_equal(c, ref)                           # bit-exact: same float order as before
    np.testing.assert_array_equal(own, np.stack([ref[:, rows, cols], ref[:, rows, cols + 1]], -1))
    np.testing.assert_allclose(d, ref.astype(np.float16).astype(np.float32) @ e, rtol=1e-5, atol=1e-5)
  with pytest.raises(EmulatorError, match="divergent SIMD-group operation"):
    lib.run("mma_divergent", [np.zeros(64, np.float32)], (1,), (32,))
  # lanes 16..31 own rows 4..7: NaN there in A and B makes every c_ij = sum_k a_ik b_kj NaN
  out = np.zeros((8, 8), np.float32)
  lib.run("mma_inactive", [out], (1,), (32,))
  assert np.isnan(out).all()


def test_simdgroup_store_uses_every_lanes_elements():
  # A tile written lane by lane through thread_elements() and stored without a multiply: each lane's copy holds only
  # its own elements, the store must assemble them (it used to write the first lane's copy, NaN elsewhere).
  lib = compile_source("#include <metal_stdlib>\nusing namespace metal;\n"
                       "kernel void f(device float* c [[buffer(0)]], uint lane [[thread_index_in_simdgroup]]) {\n"
                       "  simdgroup_float8x8 m;\n  m.thread_elements()[0] = float(2 * lane);\n"
                       "  m.thread_elements()[1] = float(2 * lane + 1);\n  simdgroup_store(m, c, 8);\n}", "store_lanes.metal")
  out = np.zeros((8, 8), np.float32)
  lib.run("f", [out], (1,), (32,), order="reverse")
  rows, cols = apple_lane_layout()
  expect = np.zeros((8, 8), np.float32)
  expect[rows, cols], expect[rows, cols + 1] = 2 * np.arange(32), 2 * np.arange(32) + 1
  np.testing.assert_array_equal(out, expect)


# **** 8-byte vectors (float2, half4) misaligned in threadgroup and device memory ****

def test_address_space_overloads_still_compile():
  # Kernels are compiled with plain pointers (so the alignment sanitizer sees device/threadgroup accesses); helpers
  # overloaded on address space alone collide there, and are then compiled with real address spaces instead.
  lib = compile_source("#include <metal_stdlib>\nusing namespace metal;\n"
                       "METAL_FUNC float get(device const float* p) { return p[0] + 1.0f; }\n"
                       "METAL_FUNC float get(threadgroup const float* p) { return p[0] + 2.0f; }\n"
                       "kernel void f(device const float* x [[buffer(0)]], device float* y [[buffer(1)]], uint i [[thread_index_in_threadgroup]]) {\n"
                       "  threadgroup float t[32];\n  t[i] = x[i];\n  threadgroup_barrier(mem_flags::mem_threadgroup);\n"
                       "  y[i] = get(x + i) * 10.0f + get(t + i);\n}", "overloads.metal")
  x, y = np.arange(32, dtype=np.float32), np.zeros(32, np.float32)
  lib.run("f", [x, y], (1,), (32,))
  np.testing.assert_array_equal(y, (x + 1) * 10 + x + 2)


MISALIGNED_8_SRC = """
#include <metal_stdlib>
using namespace metal;
kernel void tg_float2(device const float* x [[buffer(0)]], device float2* out [[buffer(1)]], uint tid [[thread_index_in_threadgroup]]) {
  threadgroup ALIGN float a[64];
  a[tid] = x[tid];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (tid < 16) out[tid] = *(threadgroup const float2*)(a + OFF + 2 * tid);
}
kernel void tg_half4(device const half* x [[buffer(0)]], device float4* out [[buffer(1)]], uint tid [[thread_index_in_threadgroup]]) {
  threadgroup ALIGN half a[64];
  a[tid] = x[tid];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (tid < 8) out[tid] = float4(*(threadgroup const half4*)(a + 2 * OFF + 4 * tid));
}
kernel void device_float2(device const float* x [[buffer(0)]], device float2* out [[buffer(1)]], uint tid [[thread_index_in_threadgroup]]) {
  out[tid] = *(device const float2*)(x + OFF + 2 * tid);
}
kernel void device_half4(device const half* x [[buffer(0)]], device float4* out [[buffer(1)]], uint tid [[thread_index_in_threadgroup]]) {
  out[tid] = float4(*(device const half4*)(x + 2 * OFF + 4 * tid));
}
kernel void device_store_float2(device float* y [[buffer(0)]], uint tid [[thread_index_in_threadgroup]]) {
  *(device float2*)(y + OFF + 2 * tid) = float2(float(tid), 1.0f);
}
"""


@pytest.mark.parametrize("misaligned", [True, False])
def test_misaligned_8_byte_vectors_are_reported(misaligned):
  # `*(float2*)(a + 1)` is 4 bytes off an 8-byte boundary: a fault or garbage on a GPU, an error here too, in
  # threadgroup and device memory, for reads and writes (clang's alignment sanitizer skips address-space pointers).
  off = int(misaligned)
  src = MISALIGNED_8_SRC.replace("OFF", str(off)).replace("ALIGN", "" if misaligned else "__attribute__((aligned(8)))")
  lib = compile_source(src, f"align8_{misaligned}.metal")
  x = np.arange(66, dtype=np.float32)
  h = np.arange(66).astype(np.float16)
  cases = [("tg_float2", [x[:64].copy(), np.zeros((16, 2), np.float32)], 64, lambda o: x[off:off + 32].reshape(16, 2)),
           ("tg_half4", [h[:64].copy(), np.zeros((8, 4), np.float32)], 64, lambda o: h[2 * off:2 * off + 32].astype(np.float32).reshape(8, 4)),
           ("device_float2", [x, np.zeros((16, 2), np.float32)], 16, lambda o: x[off:off + 32].reshape(16, 2)),
           ("device_half4", [h, np.zeros((8, 4), np.float32)], 8, lambda o: h[2 * off:2 * off + 32].astype(np.float32).reshape(8, 4))]
  for kernel, bufs, threads, expect in cases:
    if misaligned:
      with pytest.raises(EmulatorError, match="misaligned"):
        lib.run(kernel, bufs, (1,), (threads,))
    else:
      lib.run(kernel, bufs, (1,), (threads,))
      np.testing.assert_array_equal(bufs[1], expect(off), err_msg=kernel)
  y = np.zeros(66, np.float32)
  if misaligned:
    with pytest.raises(EmulatorError, match="misaligned"):
      lib.run("device_store_float2", [y], (1,), (16,))
  else:
    lib.run("device_store_float2", [y], (1,), (16,))
    np.testing.assert_array_equal(y[:32].reshape(16, 2), np.stack([np.arange(16), np.ones(16)], 1))


def test_undeclared_alignment_vector_reads_are_reported():
  # `threadgroup float a[64]` read as float2 at even indices works on a GPU only if the compiler happens to place `a`
  # 8-byte aligned: odd threadgroups place such arrays at exactly their declared alignment, so it is reported there.
  src = MISALIGNED_8_SRC.replace("OFF", "0").replace("ALIGN", "")
  lib = compile_source(src, "align8_luck.metal")
  x = np.arange(64, dtype=np.float32)
  out = np.zeros((16, 2), np.float32)
  lib.run("tg_float2", [x, out], (1,), (64,))                      # threadgroup 0: 8-byte aligned placement
  np.testing.assert_array_equal(out.reshape(-1), x[:32])
  with pytest.raises(EmulatorError, match=r"misaligned.*threadgroup \(1,0,0\)"):
    lib.run("tg_float2", [x, out], (2,), (64,))
