#!/usr/bin/env bash
# The whole test suite: installs what it needs, builds, checks style, runs every test
# (unit, integration, and the reference-implementation kernel tests), prints the summary.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh
bash scripts/lint.sh
cd build
ctest -j "${KVMEM_JOBS:-2}" --output-on-failure --timeout 600 | grep -v -E "^ *(Start|[0-9]+/[0-9]+ Test) "
