#!/usr/bin/env bash
# Fuzzes every harness in fuzz/ with libFuzzer (clang, ASan+UBSan, into build-fuzz/): each
# runs for FUZZ_RUNS executions (default 10 million) or FUZZ_SECONDS (default 0: no time
# limit), starting from its committed corpus; then what it found that adds coverage is
# merged, minimized, into fuzz/corpus/<harness>/ (commit it: CI replays that corpus). A
# crash or a failed check leaves its input as build-fuzz/findings/<harness>-crash-*, stops
# that harness and fails the run. FUZZ_HARNESSES picks harnesses (default: all).
# FUZZ_TIMEOUT: libFuzzer's per-input limit in seconds (default 1,200); it counts wall time,
# so a campaign paused (SIGSTOP) for longer than it ends on a false "timeout".
set -euo pipefail
cd "$(dirname "$0")/.."
harnesses=${FUZZ_HARNESSES:-gguf tokenizer step_channel service attach}
CC=clang-14 CXX=clang++-14 cmake -S . -B build-fuzz -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DFUZZ=ON -DSANITIZE=address,undefined -DWITH_CUDA=OFF -DBUILD_TESTS=OFF -DBUILD_BENCH=OFF \
  ${KVMEM_CMAKE_ARGS:-} >/dev/null
targets=()
for h in $harnesses; do targets+=("${h}_fuzz"); done
cmake --build build-fuzz -j "${KVMEM_JOBS:-2}" --target "${targets[@]}"
mkdir -p build-fuzz/findings
export ASAN_OPTIONS="detect_leaks=1"
export LSAN_OPTIONS="suppressions=$PWD/tests/lsan.supp"
failed=0
for h in $harnesses; do
  found=build-fuzz/found/$h
  mkdir -p "$found"
  log=build-fuzz/$h.log
  echo "fuzz: $h, ${FUZZ_RUNS:-10000000} runs or ${FUZZ_SECONDS:-0} s (log $log)"
  if ! build-fuzz/fuzz/${h}_fuzz -runs="${FUZZ_RUNS:-10000000}" \
      -max_total_time="${FUZZ_SECONDS:-0}" -timeout="${FUZZ_TIMEOUT:-1200}" -print_final_stats=1 \
      -artifact_prefix="build-fuzz/findings/$h-" "$found" "fuzz/corpus/$h" >"$log" 2>&1; then
    echo "fuzz: $h FOUND SOMETHING:"
    grep -E "ERROR|FUZZ_CHECK|SUMMARY|Test unit written" "$log" | head -20
    failed=1
    continue
  fi
  grep -E "^stat::number_of_executed_units|^stat::peak_rss_mb|^#[0-9]+ *DONE" "$log" || true
  before=$(ls "fuzz/corpus/$h" | wc -l)
  if ! build-fuzz/fuzz/${h}_fuzz -merge=1 "fuzz/corpus/$h" "$found" >>"$log" 2>&1; then
    echo "fuzz: $h: merging into fuzz/corpus/$h failed (see $log)"
    failed=1
    continue
  fi
  echo "fuzz: $h corpus $before -> $(ls "fuzz/corpus/$h" | wc -l) inputs"
done
exit $failed
