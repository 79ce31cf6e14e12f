#!/usr/bin/env bash
# One lent-GPU session in one call (the `device` tool; ../shared/notes/gpu.md): the GPU tests against HF transformers,
# then the benchmark on a Llama-3.2-1B-shaped float16 model (whole-pass captures, or CAPTURE_MODES=pass,layer to compare;
# async scheduling off and on, ASYNC=off,on, once tests/test_gpu.py's async test passed, else off alone; multi-step runs
# with SCHEDULER_STEPS=1,8; then HF eager and torch.compile on the same GPU). Each phase has its own time limit and every test and run prints its result as it
# finishes, so a phase that hangs or crashes still leaves what came before; logs and the bench JSON go under $OUT.
# A device call's start counts against the session's 15 minutes and took from 30 s to 7 minutes here: keep
# TEST_SECONDS + BENCH_SECONDS near 7 minutes (150 270), so that a slow start still leaves the run its time; then, if
# KERNEL_SECONDS (45) > 0, the device time of a batch-1 decode step kernel by kernel (0 skips it; KERNEL_BATCHES=1,32
# adds batch 32); then, if
# GEMV_SECONDS (60) > 0, the decode projections' GEMV kernel against the tinygrad ops it replaced (bench/gemv.py; then
# 2/3 of that again for the k-quants Q4_K and Q6_K); then,
# if PACKED_SECONDS (30) > 0, the GGUF k-quants' portable kernel with the file's 6-bit scales against byte scales.
#
#   bash bench/gpu_wheels.sh               # here, once: the wheels the GPU machine lacks, into .whl/
#   device run (carry .whl):  bash bench/gpu_session.sh [TEST_SECONDS] [BENCH_SECONDS] [KERNEL_SECONDS] [PACKED_SECONDS] [GEMV_SECONDS]
#   (env: CAPTURE_MODES=pass,layer compares captures; SCHEDULER_STEPS=1,8 adds multi-step runs; ASYNC=off,on; BENCH_BEAM=2 searches
#   the bench's kernels; INT4_SECONDS=90 adds batch-1 decode with INT4 weights, quantized at load, against the float16
#   run's figures; GEMV_SCHEDULES=32x2,64x2,32x2x16 times our GEMV's schedules side by side (GEMV_FORMATS, default
#   float16; GEMV_ROWS, default 1,32) and skips the k-quant table; LONG_SECONDS=60 adds decode at a 2048-token context,
#   batch 1 and 8, no peers (attention's share grows with the context); EIGHT_B_SECONDS=150 writes a Llama-3.1-8B-shaped
#   float16 model (torch on the GPU) and decodes it at batch 1, no peers)
set -uo pipefail
source .whl/preamble.sh || exit 1
OUT=${OUT:-/tmp/gpu-out}; mkdir -p "$OUT"
TEST_S=${1:-150} BENCH_S=${2:-270} KERNEL_S=${3:-45} PACKED_S=${4:-30} GEMV_S=${5:-60}
MODEL=/tmp/llama-1b-f16
# numpy's weights (2.5 GB), off the GPU: the tests run on it meanwhile; not written when no phase reads it (0 seconds
# skips a phase: `bash bench/gpu_session.sh 0 0 0 0 0` with EIGHT_B_SECONDS runs the 8B phase alone)
writer=
if [ "$BENCH_S" -gt 0 ] || [ "$KERNEL_S" -gt 0 ] || [ "${INT4_SECONDS:-0}" -gt 0 ] || [ "${LONG_SECONDS:-0}" -gt 0 ]; then
  CUDA_VISIBLE_DEVICES= python3 bench/gpu_session.py "$MODEL" > "$OUT/model.log" 2>&1 &
  writer=$!
fi

if [ "$TEST_S" -gt 0 ]; then
  echo "== tests/test_gpu.py and tests/test_gemm.py (the tensor-core kernel against numpy) on $DEV"
  # -v: each test's name and result as it finishes (a time limit otherwise cuts the summary away); --timeout: a stuck
  # test dumps its stack and fails instead of holding a worker to the end (2/3 of the phase: a worker's first test
  # lowers its kernels, which took over 27 s on the H200)
  TINYVLLM_EMULATE_METAL=0 TINYVLLM_TEST_DEVICE=$DEV timeout -k 5 "$TEST_S" python3 -m pytest -v -n 6 -rfE --tb=short -p no:cacheprovider -p no:benchmark \
    --timeout "$((TEST_S * 2 / 3 + 1))" --junitxml "$OUT/test_gpu.xml" tests/test_gpu.py tests/test_gemm.py 2>&1 | tee "$OUT/test_gpu.log" \
    | grep -E 'PASSED|FAILED|ERROR|Error|passed|failed|Timeout' | tail -40
  # async scheduling (off by default until timed here): compared off and on, and on in the phases after, once its test
  # passed here; else off everywhere
  if ! grep -q 'test_async_scheduling_matches_hf PASSED' "$OUT/test_gpu.log"; then
    echo "== the async scheduling test did not pass: everything after runs with it off"; ASYNC=off
  fi
fi
DEFAULT_ASYNC=on; [ "${ASYNC:-}" = off ] && DEFAULT_ASYNC=off

if [ -n "$writer" ]; then wait "$writer" || { echo "writing the 1B model failed:"; tail -5 "$OUT/model.log"; }; fi
if [ "$BENCH_S" -gt 0 ]; then
  echo "== bench on $DEV"
  # BENCH_BEAM=N: tinygrad's BEAM search (width N) for the bench's kernels only (minutes of search per new kernel on a
  # first run; tinygrad caches the result on disk)
  BEAM=${BENCH_BEAM:-0} timeout -k 5 "$BENCH_S" python3 -m tinyvllm.bench --model "$MODEL" --runs decode,prefill --batch-sizes 1,32 \
    --prefill-lens 128 --steps 32 --capture-mode "${CAPTURE_MODES:-pass}" --num-scheduler-steps "${SCHEDULER_STEPS:-1}" --async-scheduling "${ASYNC:-off,on}" --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log" | tr '\r' '\n' | grep -v '| *[0-9]*/[0-9]* \[\|^\s*$' | tail -45
fi

# a short bench run beside the main one: its table's rows and ceilings printed, its log and JSON as bench-NAME.*
short_bench() {
  local name=$1 seconds=$2; shift 2
  timeout -k 5 "$seconds" python3 -m tinyvllm.bench "$@" --runs decode --steps 32 --num-scheduler-steps 1 --no-peers --async-scheduling "$DEFAULT_ASYNC" \
    --json "$OUT/bench-$name.json" 2>&1 | tee "$OUT/bench-$name.log" | tr '\r' '\n' \
    | grep -E '^(decode|tinyvllm|  decode|  measured|  torch)' | tail -8
}

if [ "${INT4_SECONDS:-0}" -gt 0 ]; then
  echo "== bench on $DEV, INT4 weights (quantized at load), batch 1"
  short_bench int4 "$INT4_SECONDS" --model "$MODEL" --quantization int4 --batch-sizes 1
fi

# the 8B before the long context: a target of issue 27's where the long context is a diagnosis
if [ "${EIGHT_B_SECONDS:-0}" -gt 0 ]; then
  echo "== bench on $DEV, a Llama-3.1-8B-shaped float16 model, batch 1"
  OUT=$OUT timeout -k 5 "$EIGHT_B_SECONDS" bash -c 'python3 bench/gpu_session.py /tmp/llama-8b-f16 8b && python3 -m tinyvllm.bench \
    --model /tmp/llama-8b-f16 --runs decode --batch-sizes 1 --steps 32 --num-scheduler-steps 1 --no-peers --async-scheduling '"$DEFAULT_ASYNC"' --json "$OUT/bench-8b.json"' 2>&1 \
    | tee "$OUT/bench-8b.log" | tr '\r' '\n' | grep -E '^(decode|  decode|  measured|wrote|Traceback|[A-Za-z]*Error)' | tail -8
fi

if [ "${LONG_SECONDS:-0}" -gt 0 ]; then
  echo "== bench on $DEV, a 2048-token context, batch 1 and 8"
  short_bench long "$LONG_SECONDS" --model "$MODEL" --batch-sizes 1,8 --context-lens 2048
fi

if [ "$KERNEL_S" -gt 0 ]; then
  # KERNEL_BATCHES=1,32: a batch-32 step's kernels too (the tensor cores' projections, their sums, attention), each
  # batch size with KERNEL_S seconds of its own
  for B in $(echo "${KERNEL_BATCHES:-1}" | tr ',' ' '); do
    echo "== device time per kernel, batch-$B decode step (bench/gpu_kernel_times.py)"
    timeout -k 5 "$KERNEL_S" python3 bench/gpu_kernel_times.py "$MODEL" --batch-size "$B" --async-scheduling "$DEFAULT_ASYNC" --json "$OUT/kernels-b$B.json" 2>&1 \
      | tee "$OUT/kernels-b$B.log" | tail -30
  done
fi

if [ "$GEMV_S" -gt 0 ] && [ -n "${GEMV_SCHEDULES:-}" ]; then
  echo "== our GEMV's schedules (threads a weight row x rows a thread [x x rows a thread]), ${GEMV_FORMATS:-float16} 1B projections (bench/gemv.py)"
  timeout -k 5 "$GEMV_S" python3 bench/gemv.py --models 1b --formats "${GEMV_FORMATS:-float16}" --rows "${GEMV_ROWS:-1,32}" --rounds 5 --schedules "$GEMV_SCHEDULES" \
    --json "$OUT/gemv.json" 2>&1 | tee "$OUT/gemv.log" | grep -v 'projections:' | tail -50
elif [ "$GEMV_S" -gt 0 ]; then
  echo "== decode projections: our GEMV (norm, gating, residual inside) against tinygrad's ops (bench/gemv.py)"
  timeout -k 5 "$GEMV_S" python3 bench/gemv.py --rows 1,8,32 --rounds 5 --json "$OUT/gemv.json" 2>&1 | tee "$OUT/gemv.log" | grep -v 'projections:' | tail -60
  echo "== the same for a Q4_K_M file's k-quants (Q4_K, Q6_K), 1B shapes"
  timeout -k 5 "$((GEMV_S * 2 / 3))" python3 bench/gemv.py --models 1b --formats q4_k,q6_k --rows 1,8 --rounds 5 --json "$OUT/gemv-kquant.json" 2>&1 \
    | tee "$OUT/gemv-kquant.log" | grep -v 'projections:' | tail -24
fi

if [ "$PACKED_S" -gt 0 ]; then
  echo "== GGUF k-quant linears, portable kernel: the file's 6-bit scales against byte scales (bench/packed_portable.py)"
  timeout -k 5 "$PACKED_S" python3 bench/packed_portable.py --rounds 7 --json "$OUT/packed.json" 2>&1 | tee "$OUT/packed.log" \
    | grep -v 'kernels:' | tail -16
fi
