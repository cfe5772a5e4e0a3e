#!/usr/bin/env bash
# The engine and the daemon under ThreadSanitizer: the block pool's and the engine's unit
# tests, the 60 s epoch-protocol stress test, the in-process daemon's integration tests
# (gRPC on loopback) and the process tests against a kvmemd built with TSan (signals, drain,
# shared segments), built into build-tsan/ with -fsanitize=thread. Every process writes its
# reports under build-tsan/tsan-logs/; any report fails the run. Debian's abseil, spdlog,
# gRPC and protobuf are not instrumented: server/common/mutex.h shows TSan how our
# absl::Mutex locks order threads, ignore_noninstrumented_modules skips those libraries' own
# accesses, and tests/tsan.supp names the few gRPC header functions (message buffers handed
# between threads inside libgrpc) whose ordering TSan cannot see. Built without UCX (its
# libraries are not instrumented either; the UCX tests run in the regular build).
set -euo pipefail
cd "$(dirname "$0")/.."
cmake -S . -B build-tsan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DSANITIZE=thread \
  -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1 -DNDEBUG -Wno-maybe-uninitialized" \
  -DWITH_UCX=OFF >/dev/null
cmake --build build-tsan -j "${KVMEM_JOBS:-2}" --target block_pool_test engine_test \
  engine_stress_test daemon_test kvmemd_process_test transport_test common_test cluster_index_test
source scripts/sanitizer_reports.sh
sanitizer_reports build-tsan tsan
export TSAN_OPTIONS="suppressions=$PWD/tests/tsan.supp halt_on_error=1 ignore_noninstrumented_modules=1 log_path=$logs/report"
# The stress test runs for a fixed time: beside the others, niced (it takes what they
# leave; many of them wait on sockets and processes).
nice -n 10 build-tsan/tests/engine_stress_test --gtest_brief=1 >build-tsan/stress.log 2>&1 &
stress=$!
build-tsan/tests/block_pool_test --gtest_brief=1 | tail -1
build-tsan/tests/common_test --gtest_brief=1 | tail -1
build-tsan/tests/transport_test --gtest_brief=1 | tail -1
build-tsan/tests/cluster_index_test --gtest_brief=1 | tail -1
build-tsan/tests/engine_test --gtest_brief=1 | tail -1
build-tsan/tests/daemon_test --gtest_brief=1 | tail -1
build-tsan/tests/kvmemd_process_test --gtest_brief=1 | tail -1
wait $stress || { cat build-tsan/stress.log; exit 1; }
grep -E "^stress|PASSED|FAILED" build-tsan/stress.log
show_reports
trap - EXIT
echo "tsan: block_pool_test, common_test, transport_test, cluster_index_test, engine_test," \
  "engine_stress_test, daemon_test and kvmemd_process_test clean"
