#!/usr/bin/env bash
# Configures and builds kvmem into build/ (Release with debug info, two jobs).
# Extra arguments go to cmake's configure step.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/deps.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo "$@" >/dev/null
cmake --build build -j "${KVMEM_JOBS:-2}"
