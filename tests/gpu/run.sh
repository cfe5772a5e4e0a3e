#!/usr/bin/env bash
# The GPU checks in one go, on a machine with an NVIDIA GPU, CUDA and CMake (no other
# packages). Kernel parity against the C++ twins under compute-sanitizer memcheck (all
# kernels) and racecheck (selection and compaction, the kernels with shared memory), then
# the kernel benchmarks. When gpu-bundle/ is there (tests/gpu/bundle.sh, made on a machine
# with the -dev packages, carried along), its prebuilt gpu_parity/gpu_bench are used instead
# of building here, and also the CUDA backend's gtests run — CudaBackend and the device
# SlotState against the CPU ones, the engine's device step against the host policies, a
# worker process attaching the pool by CUDA IPC — once plainly and once under memcheck,
# then the engine step benchmark on the GPU and the in-place decode loop (CPU backend).
#
# The most telling checks come first. The whole run keeps to one deadline (KVMEM_GPU_SECONDS,
# default 540: the device tool allows 600 s a call); each step gets the time it may take or
# what is left, whichever is less; a step that runs out, or finds no time left, is named in
# the summary. The summary grows after every step, so a run cut short still says what it
# did. Where nvidia-smi finds a GPU, a skipped check (no device seen, a kvmemd that did not
# start) fails the run. Logs:
# build-gpu/logs/ (ignored by git), or $OUT when that is set (the device tool's output
# folder, which takes at most 8 files: there are 8).
set -uo pipefail
cd "$(dirname "$0")/../.."
start=$(date +%s)
deadline=$((start + ${KVMEM_GPU_SECONDS:-540}))
logs=${OUT:-build-gpu/logs}
mkdir -p "$logs"
summary="$logs/summary.txt"
: >"$summary"
ok=1

# mark TEXT: where a step begins, with the seconds since the start.
mark() { echo "== [$(($(date +%s) - start)) s] $*"; }
# note TEXT: a line of the summary (printed too).
note() { echo "$*" | tee -a "$summary"; }
# limit SECONDS: the seconds a step may take: SECONDS, or what is left before the deadline
# less the 10 s a killed step may take to go (0: no time left).
limit() {
  local left=$((deadline - $(date +%s) - 15))
  [ "$left" -lt 1 ] && left=0
  echo $(($1 < left ? $1 : left))
}
# verdict RC [TOOL]: a step's exit code in words.
verdict() {
  case $1 in
    0) echo pass ;;
    77) echo skipped ;;
    3) echo "${2:-sanitizer} errors" ;;
    124) echo "out of time" ;;
    137) echo "killed (out of time, or memory)" ;;
    *) echo "FAIL ($1)" ;;
  esac
}

gpu=$(nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv,noheader)
note "gpu: ${gpu:-none found}"
skip_ok=1  # without a GPU a skip is the expected answer
[ -n "$gpu" ] && skip_ok=0
sanitizer=1
command -v compute-sanitizer >/dev/null || sanitizer=0
[ $sanitizer = 1 ] || note "compute-sanitizer not found: the sanitized steps run without it"

if [ -x gpu-bundle/bin/gpu_parity ] && [ -x gpu-bundle/bin/gpu_bench ]; then
  export LD_LIBRARY_PATH="$PWD/gpu-bundle/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  bin=gpu-bundle/bin
else
  mark "building the kernels for this GPU"
  generator=()
  command -v ninja >/dev/null && generator=(-G Ninja)
  if ! cmake -S tests/gpu -B build-gpu "${generator[@]}" -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_CUDA_ARCHITECTURES="${KVMEM_CUDA_ARCH:-native}" >/dev/null ||
    ! cmake --build build-gpu -j "$(nproc)" --target gpu_parity gpu_bench; then
    note "build: FAIL"
    exit 1
  fi
  bin=build-gpu
fi

# run NAME CAP LOG TOOL PROGRAM ARGS...: PROGRAM under compute-sanitizer TOOL (plainly where
# there is none, or TOOL is -), output into LOG (a file, not a pipe: a daemon a test leaves
# behind would hold a pipe open), the verdict into the summary.
# expected=REGEX run ...: the sanitizer's reports whose first line matches REGEX (after the
# "========= " prefix) are the program's own doing, not errors — a test that provokes a
# failing CUDA call on purpose, which memcheck reports as an API error. Then the sanitizer
# runs without --error-exitcode (its exit code is the program's) and the step fails for
# sanitizer errors only when the log's ERROR SUMMARY counts more errors than reports that
# match. A report worded otherwise does not match, so it counts: the filter fails safe.
run() {
  local name=$1 cap=$2 log=$3 tool=$4
  shift 4
  mark "$name"
  local seconds
  seconds=$(limit "$cap")
  if [ "$seconds" = 0 ]; then
    note "$name: not run (no time left)"
    ok=0
    return
  fi
  local wrap=() filter=${expected:-}
  if [ "$tool" != - ] && [ $sanitizer = 1 ]; then
    wrap=(compute-sanitizer --tool "$tool")
    [ -z "$filter" ] && wrap+=(--error-exitcode 3)
    [ "$tool" = memcheck ] && wrap+=(--leak-check full)
  else
    filter=""
  fi
  timeout -k 10 "$seconds" "${wrap[@]}" "$@" >"$log" 2>&1
  local rc=$?
  if [ "$(wc -l <"$log")" -le 40 ]; then cat "$log"; else tail -4 "$log"; fi
  local forgiven=""
  if [ -n "$filter" ]; then
    local errors matched
    errors=$(sed -n -E 's/^========= ERROR SUMMARY: ([0-9]+) errors?.*/\1/p' "$log" | tail -1)
    matched=$(grep -c -E "^========= $filter" "$log")
    # No summary: the run was cut short, and its exit code says so.
    if [ -n "$errors" ] && [ "$errors" -gt "$matched" ] && [ "$rc" != 124 ] && [ "$rc" != 137 ]
    then
      rc=3
    fi
    [ "$matched" != 0 ] && forgiven="($matched expected, provoked by the tests)"
  fi
  local skipped
  skipped=$(grep -c -E '^\[  SKIPPED \] [0-9]' "$log")
  [ "$rc" = 0 ] && [ "$skipped" != 0 ] && rc=77
  local result
  result=$(verdict $rc "${tool#-}")
  [ "$rc" = 0 ] || { [ "$rc" = 77 ] && [ $skip_ok = 1 ]; } || ok=0
  note "$name: $result $(grep -h -E 'gpu parity:|SUMMARY|^\[  (PASSED|FAILED|SKIPPED) ' "$log" |
    tr -s ' ' | tr '\n' ' ')$forgiven"
}

run "kernel parity (memcheck)" 150 "$logs/parity_memcheck.log" memcheck "$bin/gpu_parity"
if [ -x gpu-bundle/bin/cuda_backend_test ]; then
  export KVMEMD="$PWD/gpu-bundle/bin/kvmemd"
  for t in cuda_backend_test cuda_attach_test; do
    run "$t" 120 "$logs/$t.log" - "gpu-bundle/bin/$t" --gtest_brief=1
  done
fi
run "kernel benchmarks" 90 "$logs/gpu_bench.log" - "$bin/gpu_bench"
if [ -x gpu-bundle/bin/policy_step_bench ]; then
  # The CUDA rows (device step, and host policy code on the CUDA backend) and the CPU rows
  # of the Llama-8B shape on this machine's cores; its Llama-8B CUDA row took over a minute
  # on the H200 run.
  run "engine step benchmark" 240 "$logs/policy_step_bench.log" - \
    gpu-bundle/bin/policy_step_bench --benchmark_filter='cuda|b4096'
  grep -h '^BM_' "$logs/policy_step_bench.log"
fi
if [ -x gpu-bundle/bin/in_place_bench ]; then
  # The decode loop in place against message bytes, on this machine's cores (CPU backend)
  # and on the GPU (CUDA backend: K/V copied from device buffers through the IPC mapping).
  # The logs stay out of $OUT (eight files at most there); the tables go in the summary.
  mkdir -p build-gpu
  run "in-place decode loop, CPU backend" 90 build-gpu/in_place_bench.log - \
    gpu-bundle/bin/in_place_bench --sequences=64 --steps=50 --rounds=1
  grep -h '^|' build-gpu/in_place_bench.log | while read -r line; do note "$line"; done
  run "in-place decode loop, CUDA backend" 120 build-gpu/in_place_bench_cuda.log - \
    gpu-bundle/bin/in_place_bench --backend=cuda --sequences=64 --steps=50 --rounds=1
  grep -h '^|' build-gpu/in_place_bench_cuda.log | while read -r line; do note "$line"; done
fi
run "selection and compaction (racecheck)" 120 "$logs/parity_racecheck.log" racecheck \
  "$bin/gpu_parity" select compact segments
if [ -x gpu-bundle/bin/cuda_backend_test ]; then
  # The backend's tests ask for pools no GPU holds (--pool-bytes of 1 and 4 PiB) to see
  # RESOURCE_EXHAUSTED, and memcheck reports each failed cudaMalloc as an API error: those,
  # and only those (not cudaMallocHost, not the scratch pool's cudaMallocFromPoolAsync), are
  # expected. Every other failing call is the tests' own business: they check each status.
  expected='Program hit cudaErrorMemoryAllocation .* on CUDA API call to cudaMalloc\.' \
    run "cuda_backend_test (memcheck)" 150 "$logs/cuda_backend_memcheck.log" memcheck \
    gpu-bundle/bin/cuda_backend_test --gtest_brief=1
fi

note "took $(($(date +%s) - start)) s"
echo
echo "== tests/gpu summary =="
cat "$summary"
[ $ok = 1 ]
