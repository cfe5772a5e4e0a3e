#!/usr/bin/env bash
# Style checks: clang-format on every C++/CUDA file, clang-tidy on the daemon's core layers,
# and clang's thread-safety analysis on the engine (its lock annotations must hold).
set -euo pipefail
cd "$(dirname "$0")/.."
files=$(git ls-files '*.cc' '*.h' '*.cu' '*.cuh')
clang-format --dry-run --Werror $files
echo "lint: clang-format clean ($(echo "$files" | wc -w) files)"
tidy_files=$(git ls-files 'server/policy/*.cc' 'server/store/*.cc' 'server/engine/*.cc' 'server/prefix/*.cc' 'server/metrics/*.cc' 'kernels/*.cc')
findings=$(echo "$tidy_files" | xargs -P "${KVMEM_JOBS:-2}" -n 4 clang-tidy -p build --quiet 2>/dev/null \
  | grep -E "(warning|error):" || true)
if [ -n "$findings" ]; then
  echo "$findings"
  echo "lint: clang-tidy found the problems above"
  exit 1
fi
echo "lint: clang-tidy clean ($(echo "$tidy_files" | wc -w) files)"
# The engine's lock annotations (ABSL_GUARDED_BY, ..._LOCKS_REQUIRED) checked by clang's
# -Wthread-safety; gcc, which builds kvmem, ignores them.
engine_files=$(git ls-files 'server/engine/*.cc')
unsafe=$(echo "$engine_files" | xargs -P "${KVMEM_JOBS:-2}" -n 4 clang++ -std=c++17 -fsyntax-only \
  -Wthread-safety -I. -Ibuild/gen -Iproto 2>&1 | grep -E "(warning|error):" || true)
if [ -n "$unsafe" ]; then
  echo "$unsafe"
  echo "lint: clang's thread-safety analysis found the problems above"
  exit 1
fi
echo "lint: thread-safety analysis clean ($(echo "$engine_files" | wc -w) engine files)"
