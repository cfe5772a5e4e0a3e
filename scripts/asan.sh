#!/usr/bin/env bash
# The engine and the daemon under AddressSanitizer (with LeakSanitizer) and
# UndefinedBehaviorSanitizer: the block pool's, the engine's and the request cache's unit
# tests, 20 s of the epoch-protocol stress test, the in-process daemon's integration tests
# (gRPC on loopback, step channels, tokens and TLS), the process tests against a kvmemd
# built with both (signals, drain, shared segments) and the fuzz harnesses' corpora
# (fuzz/corpus/), built into build-asan/ with
# -fsanitize=address,undefined (a UBSan finding stops the program). Every process writes its
# reports under build-asan/asan-logs/; any report fails the run. Built without UCX (its
# memory hooks and ASan's interceptors both claim malloc and mmap; the UCX tests run in the
# regular build).
set -euo pipefail
cd "$(dirname "$0")/.."
cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1 -DNDEBUG -Wno-maybe-uninitialized" \
  -DSANITIZE=address,undefined -DWITH_UCX=OFF >/dev/null
cmake --build build-asan -j "${KVMEM_JOBS:-2}" --target block_pool_test engine_test \
  request_cache_test engine_stress_test daemon_test kvmemd_process_test transport_test \
  common_test cluster_index_test gguf_fuzz tokenizer_fuzz step_channel_fuzz service_fuzz attach_fuzz
source scripts/sanitizer_reports.sh
sanitizer_reports build-asan asan
export ASAN_OPTIONS="detect_leaks=1 halt_on_error=1 log_path=$logs/report"
export UBSAN_OPTIONS="print_stacktrace=1 halt_on_error=1 log_path=$logs/report"
export LSAN_OPTIONS="suppressions=$PWD/tests/lsan.supp"
# The stress test runs for a fixed time: beside the others, niced (it takes what they
# leave; many of them wait on sockets and processes).
KVMEM_STRESS_SECONDS=20 nice -n 10 build-asan/tests/engine_stress_test --gtest_brief=1 \
  >build-asan/stress.log 2>&1 &
stress=$!
build-asan/tests/block_pool_test --gtest_brief=1 | tail -1
build-asan/tests/engine_test --gtest_brief=1 | tail -1
build-asan/tests/request_cache_test --gtest_brief=1 | tail -1
build-asan/tests/transport_test --gtest_brief=1 | tail -1
build-asan/tests/common_test --gtest_brief=1 | tail -1
build-asan/tests/cluster_index_test --gtest_brief=1 | tail -1
build-asan/tests/daemon_test --gtest_brief=1 | tail -1
build-asan/tests/kvmemd_process_test --gtest_brief=1 | tail -1
wait $stress || { cat build-asan/stress.log; exit 1; }
grep -E "^stress|PASSED|FAILED" build-asan/stress.log
for h in gguf tokenizer step_channel service attach; do
  build-asan/fuzz/${h}_fuzz "fuzz/corpus/$h" | sed "s/^/$h: /"
done
show_reports
trap - EXIT
echo "asan+ubsan: block_pool_test, engine_test, request_cache_test, transport_test," \
  "common_test, cluster_index_test, engine_stress_test, daemon_test, kvmemd_process_test and the fuzz corpora clean"
