#!/usr/bin/env bash
# The whole test suite: installs what it needs, builds, checks style, runs every test
# (unit, integration, the reference-implementation kernel tests, the worker on the real
# model, the engine under ThreadSanitizer, then under AddressSanitizer and
# UndefinedBehaviorSanitizer, and the parity tests against llama.cpp), and
# prints the summaries, and the time each stage ended at.
set -euo pipefail
cd "$(dirname "$0")/.."
stage() { echo "test: $1 done at $SECONDS s"; }
bash scripts/build.sh
stage build
bash scripts/lint.sh
stage lint
KVMEM_MODEL=$(bash scripts/fetch_model.sh)
export KVMEM_MODEL
(
  cd build
  ctest -j "${KVMEM_JOBS:-2}" --output-on-failure --timeout 900 |
    grep -v -E "^ *(Start|[0-9]+/[0-9]+ Test) "
)
stage ctest
bash scripts/tsan.sh
stage tsan
bash scripts/asan.sh
stage asan+ubsan
bash scripts/python_deps.sh
# KVMEM_CI: a test that cannot find the kvmem package or kvmemd fails instead of skipping.
KVMEM_CI=1 python3 -m pytest -q tests/python
stage pytest
