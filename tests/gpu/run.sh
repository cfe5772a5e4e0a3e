#!/usr/bin/env bash
# The GPU checks in one go, on a machine with an NVIDIA GPU, CUDA and CMake (no other
# packages): build the kernels with their parity test and benchmarks for this GPU, run the
# parity test under compute-sanitizer memcheck, then the benchmarks, and print a summary.
# When gpu-bundle/ is there (tests/gpu/bundle.sh, made on a machine with the -dev packages,
# carried along), also the CUDA backend's gtests — CudaBackend and the device SlotState
# against the CPU ones, the engine's device step against the host policies, a worker process
# attaching the pool by CUDA IPC — and the engine step benchmark on the GPU.
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

bundle=absent
if [ -d gpu-bundle ]; then
  export LD_LIBRARY_PATH="$PWD/gpu-bundle/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export KVMEMD="$PWD/gpu-bundle/bin/kvmemd"
  bundle_rc=0
  for t in cuda_backend_test cuda_attach_test; do
    gpu-bundle/bin/$t --gtest_brief=1 2>&1 | tee "build-gpu/$t.log"
    [ "${PIPESTATUS[0]}" = 0 ] || bundle_rc=1
  done
  gpu-bundle/bin/policy_step_bench --benchmark_filter='cuda|b4096' 2>&1 | tee build-gpu/step.log
  bundle="$([ $bundle_rc = 0 ] && echo pass || echo FAIL):"
  for t in cuda_backend_test cuda_attach_test; do
    bundle+=" $t $(grep -h -E '^\[  (PASSED|FAILED) ' "build-gpu/$t.log" | tr -s ' ' | tr '\n' ' ')"
  done
fi

echo
echo "== tests/gpu summary =="
echo "parity (memcheck): $parity ($(grep -h 'gpu parity:' build-gpu/parity.log | tail -1))"
echo "benchmarks: $([ "$bench_rc" = 0 ] && echo done || echo "failed ($bench_rc)")"
echo "gpu-bundle gtests: $bundle"
echo "took $(( $(date +%s) - start )) s"
[ "$parity" = pass ] && [ "$bench_rc" = 0 ] && [ "${bundle_rc:-0}" = 0 ]
