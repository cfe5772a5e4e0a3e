#!/usr/bin/env bash
# The GPU checks in one go, on a machine with an NVIDIA GPU, CUDA and CMake (no other
# packages). Kernel parity against the C++ twins under compute-sanitizer memcheck (all
# kernels) and racecheck (selection and compaction, the kernels with shared memory), then
# the kernel benchmarks. When gpu-bundle/ is there (tests/gpu/bundle.sh, made on a machine
# with the -dev packages, carried along), its prebuilt gpu_parity/gpu_bench are used instead
# of building here, and also the CUDA backend's gtests run — CudaBackend and the device
# SlotState against the CPU ones, the engine's device step against the host policies, a
# worker process attaching the pool by CUDA IPC — once plainly and once under memcheck,
# then the engine step benchmark on the GPU. The most telling checks come first and every
# step has a time limit, so a run cut short still leaves the logs of what it did. Logs:
# build-gpu/logs/ (ignored by git), or $OUT when that is set (the device tool's output
# folder, which takes at most 8 files: there are 8).
set -uo pipefail
cd "$(dirname "$0")/../.."
start=$(date +%s)
# Marks where each step begins, with the seconds since the start (a run cut short shows
# which step took the time).
mark() { echo "== [$(($(date +%s) - start)) s] $*"; }
logs=${OUT:-build-gpu/logs}
mkdir -p "$logs"
gpu=$(nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv,noheader)
echo "$gpu"

if [ -x gpu-bundle/bin/gpu_parity ] && [ -x gpu-bundle/bin/gpu_bench ]; then
  export LD_LIBRARY_PATH="$PWD/gpu-bundle/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  bin=gpu-bundle/bin
else
  generator=()
  command -v ninja >/dev/null && generator=(-G Ninja)
  cmake -S tests/gpu -B build-gpu "${generator[@]}" -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_CUDA_ARCHITECTURES="${KVMEM_CUDA_ARCH:-native}" >/dev/null || exit 1
  cmake --build build-gpu -j "$(nproc)" --target gpu_parity gpu_bench || exit 1
  bin=build-gpu
fi

# sanitize TOOL LOG [groups...]: gpu_parity under compute-sanitizer TOOL (plain without it);
# the verdict in $result.
sanitize() {
  local tool=$1 log=$2
  shift 2
  if command -v compute-sanitizer >/dev/null; then
    timeout 150 compute-sanitizer --tool "$tool" --error-exitcode 3 \
      $([ "$tool" = memcheck ] && echo --leak-check full) "$bin/gpu_parity" "$@" 2>&1 | tee "$log"
  else
    echo "compute-sanitizer not found: parity without $tool" | tee "$log"
    timeout 150 "$bin/gpu_parity" "$@" 2>&1 | tee -a "$log"
  fi
  case ${PIPESTATUS[0]} in
    0) result=pass ;;
    77) result=skipped ;;
    3) result="$tool errors" ;;
    124) result="timed out" ;;
    *) result=FAIL ;;
  esac
}
mark "kernel parity under memcheck"
sanitize memcheck "$logs/parity_memcheck.log"
parity=$result

bundle=absent bundle_rc=0
if [ -x gpu-bundle/bin/cuda_backend_test ]; then
  export KVMEMD="$PWD/gpu-bundle/bin/kvmemd"
  mark "gtests of the bundle"
  for t in cuda_backend_test cuda_attach_test; do
    # Into a file, not through a pipe: a daemon a test leaves behind would hold a pipe open.
    timeout 120 gpu-bundle/bin/$t --gtest_brief=1 >"$logs/$t.log" 2>&1 || bundle_rc=1
    cat "$logs/$t.log"
  done
fi

mark "kernel benchmarks"
timeout 90 stdbuf -oL "$bin/gpu_bench" | tee "$logs/gpu_bench.log"
bench_rc=${PIPESTATUS[0]}
if [ -x gpu-bundle/bin/policy_step_bench ]; then
  mark "engine step benchmark (its Llama-8B CUDA row took over a minute on the H200 run)"
  timeout 240 gpu-bundle/bin/policy_step_bench --benchmark_filter='cuda|b4096' 2>&1 |
    tee "$logs/policy_step_bench.log"
fi

mark "selection and compaction under racecheck"
sanitize racecheck "$logs/parity_racecheck.log" select compact
race=$result

if [ -x gpu-bundle/bin/cuda_backend_test ]; then
  memcheck_gtest="no compute-sanitizer"
  if command -v compute-sanitizer >/dev/null; then
    mark "cuda_backend_test under memcheck"
    timeout 150 compute-sanitizer --tool memcheck --error-exitcode 3 \
      gpu-bundle/bin/cuda_backend_test --gtest_brief=1 >"$logs/cuda_backend_memcheck.log" 2>&1
    case $? in 0) memcheck_gtest=pass ;; 3) memcheck_gtest="memcheck errors" ;;
      124) memcheck_gtest="timed out" ;; *) memcheck_gtest=FAIL ;; esac
    tail -5 "$logs/cuda_backend_memcheck.log"
  fi
  bundle="$([ $bundle_rc = 0 ] && echo pass || echo FAIL):"
  for t in cuda_backend_test cuda_attach_test; do
    bundle+=" $t $(grep -h -E '^\[  (PASSED|FAILED) ' "$logs/$t.log" | tr -s ' ' | tr '\n' ' ')"
  done
  bundle+="; cuda_backend_test under memcheck: $memcheck_gtest"
fi

{
  echo
  echo "== tests/gpu summary =="
  echo "gpu: $gpu"
  echo "parity (memcheck): $parity ($(grep -h 'gpu parity:' "$logs/parity_memcheck.log" | tail -1))"
  echo "selection and compaction (racecheck): $race" \
    "($(grep -h -E 'gpu parity:|RACECHECK SUMMARY' "$logs/parity_racecheck.log" | tr '\n' ' '))"
  echo "benchmarks: $([ "$bench_rc" = 0 ] && echo done || echo "failed ($bench_rc)")"
  echo "gpu-bundle gtests: $bundle"
  echo "took $(( $(date +%s) - start )) s"
} | tee "$logs/summary.txt"
[ "$parity" = pass ] && [ "$race" = pass ] && [ "$bench_rc" = 0 ] && [ "$bundle_rc" = 0 ] &&
  [ "${memcheck_gtest:-pass}" = pass ]
