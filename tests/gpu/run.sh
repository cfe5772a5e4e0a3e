#!/usr/bin/env bash
# The GPU checks in one go, on a machine with an NVIDIA GPU, CUDA and CMake (no other
# packages): build the kernels with their parity test and benchmarks for this GPU, run the
# parity test under compute-sanitizer memcheck, then the benchmarks, and print a summary.
# Well within 10 minutes on one GPU. Output: build-gpu/ (ignored by git).
set -uo pipefail
cd "$(dirname "$0")/../.."
start=$(date +%s)
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
cmake -S tests/gpu -B build-gpu "${generator[@]}" -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_CUDA_ARCHITECTURES="${KVMEM_CUDA_ARCH:-native}" >/dev/null || exit 1
cmake --build build-gpu -j "$(nproc)" || exit 1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true

parity=fail
if command -v compute-sanitizer >/dev/null; then
  compute-sanitizer --tool memcheck --leak-check full --error-exitcode 3 build-gpu/gpu_parity \
    | tee build-gpu/parity.log
  rc=${PIPESTATUS[0]}
else
  echo "compute-sanitizer not found: parity without memcheck"
  build-gpu/gpu_parity | tee build-gpu/parity.log
  rc=${PIPESTATUS[0]}
fi
case $rc in
  0) parity=pass ;;
  77) parity=skipped ;;
  3) parity="memcheck errors" ;;
esac

build-gpu/gpu_bench | tee build-gpu/bench.log
bench_rc=${PIPESTATUS[0]}

echo
echo "== tests/gpu summary =="
echo "parity (memcheck): $parity ($(grep -h 'gpu parity:' build-gpu/parity.log | tail -1))"
echo "benchmarks: $([ "$bench_rc" = 0 ] && echo done || echo "failed ($bench_rc)")"
echo "took $(( $(date +%s) - start )) s"
[ "$parity" = pass ] && [ "$bench_rc" = 0 ]
