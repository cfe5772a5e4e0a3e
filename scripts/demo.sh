#!/usr/bin/env bash
# The main job: builds kvmem, starts kvmemd on the CPU backend, runs the client demo
# (append a prompt, decode with a sliding window, print the block table and the memory
# held), shows what kvmemctl sees, and stops the daemon with SIGTERM.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh
socket="unix:/tmp/kvmem-demo-$$.sock"
./build/kvmemd --listen="$socket" --backend=cpu --pool-bytes=268435456 --lease-seconds=60 \
  >/tmp/kvmem-demo-$$.log 2>&1 &
daemon=$!
trap 'kill -TERM $daemon 2>/dev/null || true; wait $daemon 2>/dev/null || true; rm -f /tmp/kvmem-demo-$$.sock' EXIT
for _ in $(seq 100); do grep -q READY /tmp/kvmem-demo-$$.log && break; sleep 0.1; done
echo "== kvmemd started (pid $daemon, $socket)"
./build/kvmem_demo --target="$socket"
echo "== kvmemctl stats"
./build/kvmemctl --target="$socket" stats
kill -TERM $daemon
wait $daemon && echo "== kvmemd drained and exited with code 0"
trap - EXIT
rm -f /tmp/kvmem-demo-$$.sock /tmp/kvmem-demo-$$.log
