#!/usr/bin/env python3
"""Time to first token on a node that misses a prompt's prefix another node of the fleet
holds: pulled (PullPrefix) against recomputed, side by side. Per repetition: a fresh
redis-server and three kvmemd sharing it (--cluster-index, each named by its own socket);
the reference worker (SmolLM2, full policy, --prefix_cache) runs the prompt cold on node A,
which publishes its blocks; then on node B cold (nothing there: the whole prompt is
computed, as a fleet without sharing would), and on node C with --pull_prefix (C pulls A's
prefix, maps it, computes the rest). Both first-token times include CreateSequence, the
pull where there is one, the prefill and its Append. The answers must be A's (greedy).

Usage: python3 bench/fleet_ttft.py [--context 1024] [--repeat 3] [--decode 8]
KVMEM_BIN: where kvmem_worker and kvmemd are (build/).
"""
import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(os.environ.get("KVMEM_BIN", ROOT / "build"))
sys.path.insert(0, str(ROOT / "bench"))
import prefix_ttft  # noqa: E402  (its worker runner)


def start_redis(directory):
    sock = Path(directory) / "redis.sock"
    proc = subprocess.Popen([shutil.which("redis-server"), "--port", "0", "--unixsocket",
                             str(sock), "--save", "", "--appendonly", "no"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(500):
        if sock.exists():
            return proc, sock
        time.sleep(0.01)
    sys.exit("redis-server did not start")


def node_socket(name):
    return f"/tmp/kvmem-fleet-{name}-{os.getpid()}.sock"


def start_node(name, redis_sock, peers=()):
    sock = node_socket(name)
    proc = subprocess.Popen([str(BIN / "kvmemd"), f"--listen=unix:{sock}", "--metrics-listen=",
                             "--pool-bytes=1073741824", "--page-bytes=262144",
                             f"--cluster-index=unix://{redis_sock}",
                             f"--cluster-node-address=unix:{sock}",
                             "--cluster-index-timeout-ms=1000",
                             "--cluster-peers=" + ",".join(f"unix:{node_socket(p)}" for p in peers)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    proc.stdout.readline()  # READY
    return proc, sock


def claims(redis_sock):
    out = subprocess.run([shutil.which("redis-cli"), "-s", str(redis_sock), "DBSIZE"],
                         capture_output=True, text=True).stdout.strip()
    return int(out or 0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--decode", type=int, default=8)
    args = ap.parse_args()
    model, prompt_args = prefix_ttft.model_and_prompt(args.context)
    recomputed, pulled, local, ratios = [], [], [], []
    for r in range(args.repeat):
        with tempfile.TemporaryDirectory() as tmp:
            redis, redis_sock = start_redis(tmp)
            nodes = {n: start_node(f"{n}{r}", redis_sock, [f"a{r}", f"b{r}"] if n == "c" else [])
                     for n in "abc"}
            try:
                _, n, a_ms, a_answer = prefix_ttft.run(model, nodes["a"][1], prompt_args,
                                                       args.decode)
                deadline = time.monotonic() + 10
                while claims(redis_sock) < (n - 1) // 16 and time.monotonic() < deadline:
                    time.sleep(0.05)
                b_reused, _, b_ms, b_answer = prefix_ttft.run(model, nodes["b"][1], prompt_args,
                                                              args.decode)
                c_reused, _, c_ms, c_answer = prefix_ttft.run(
                    model, nodes["c"][1], (*prompt_args, "--pull_prefix"), args.decode)
                # For scale: node A again, whose own prefix is mapped without a pull.
                _, _, local_ms, local_answer = prefix_ttft.run(model, nodes["a"][1], prompt_args,
                                                               args.decode)
            finally:
                for proc, sock in nodes.values():
                    proc.terminate()
                    proc.wait()
                redis.kill()
                redis.wait()
        if (b_reused != 0 or c_reused == 0 or b_answer != a_answer or c_answer != a_answer
                or local_answer != a_answer):
            sys.exit(f"repetition {r}: recomputed reused {b_reused}, pulled reused {c_reused}, "
                     f"answers equal: {b_answer == a_answer} / {c_answer == a_answer}")
        recomputed.append(b_ms)
        pulled.append(c_ms)
        local.append(local_ms)
        ratios.append(b_ms / c_ms)
        print(f"rep {r}: prompt {n} tokens; node A cold {a_ms:.1f} ms; node B recomputes "
              f"{b_ms:.1f} ms; node C pulls {c_reused} tokens from A then computes the rest: "
              f"{c_ms:.1f} ms ({b_ms / c_ms:.1f}x); node A again, its own prefix: "
              f"{local_ms:.1f} ms", flush=True)
    print(f"median over {args.repeat}: recompute {statistics.median(recomputed):.1f} ms, pull "
          f"{statistics.median(pulled):.1f} ms, local hit {statistics.median(local):.1f} ms, "
          f"recompute/pull {statistics.median(ratios):.1f}x (range {min(ratios):.1f}-"
          f"{max(ratios):.1f}); answers identical to node A's")


if __name__ == "__main__":
    main()
