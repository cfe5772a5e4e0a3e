#!/usr/bin/env bash
# Style checks: clang-format on every C++/CUDA file, clang-tidy on the daemon's core layers.
set -euo pipefail
cd "$(dirname "$0")/.."
files=$(git ls-files '*.cc' '*.h' '*.cu' '*.cuh')
clang-format --dry-run --Werror $files
echo "lint: clang-format clean ($(echo "$files" | wc -w) files)"
tidy_files=$(git ls-files 'server/policy/*.cc' 'server/store/*.cc' 'server/engine/*.cc')
clang-tidy -p build --quiet $tidy_files 2>/dev/null | grep -E "warning|error" && exit 1
echo "lint: clang-tidy clean ($(echo "$tidy_files" | wc -w) files)"
