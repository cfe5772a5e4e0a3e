#!/usr/bin/env bash
# The engine under ThreadSanitizer: its unit tests and the 60 s epoch-protocol stress test,
# built into build-tsan/ with -fsanitize=thread. Debian's abseil, spdlog and gRPC are not
# instrumented: server/common/mutex.h shows TSan our absl::Mutex locks, tests/tsan.supp
# names what stays invisible inside those libraries. The gRPC integration tests are not run
# here: with an uninstrumented gRPC, TSan reports its internal buffers.
set -euo pipefail
cd "$(dirname "$0")/.."
cmake -S . -B build-tsan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DSANITIZE=thread >/dev/null
cmake --build build-tsan -j "${KVMEM_JOBS:-2}" --target engine_test engine_stress_test
export TSAN_OPTIONS="suppressions=$PWD/tests/tsan.supp halt_on_error=1 second_deadlock_stack=1"
build-tsan/tests/engine_test --gtest_brief=1
build-tsan/tests/engine_stress_test --gtest_brief=1 | grep -E "^stress|PASSED|FAILED"
echo "tsan: engine_test and engine_stress_test clean"
