#!/usr/bin/env bash
# kvmem from transformers: builds kvmemd, fetches SmolLM2-135M-Instruct (the GGUF file the C++
# worker uses; transformers reads it through the gguf package), installs torch, transformers
# and the kvmem package from PyPI and client/python, starts kvmemd on the CPU backend and
# generates with the model's KV cache in kvmemd under confkv (kvmem.transformers.KvmemCache).
# Prints the answer, the memory saved against a full cache and the time per token next to
# transformers' own DynamicCache; then stops the daemon.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh
model=$(bash scripts/fetch_model.sh)
bash scripts/python_deps.sh --transformers
socket="unix:/tmp/kvmem-hf-demo-$$.sock"
log="/tmp/kvmem-hf-demo-$$.log"
./build/kvmemd --listen="$socket" --metrics-listen= --backend=cpu \
  --pool-bytes=1073741824 --page-bytes=262144 >"$log" 2>&1 &
daemon=$!
trap 'kill -TERM $daemon 2>/dev/null || true; wait $daemon 2>/dev/null || true; rm -f "$log"' EXIT
for _ in $(seq 100); do grep -q READY "$log" && break; sleep 0.1; done
python3 client/python/examples/transformers_generate.py --target="$socket" --model="$model" \
  --policy=confkv --max-new-tokens="${KVMEM_DEMO_TOKENS:-300}"
