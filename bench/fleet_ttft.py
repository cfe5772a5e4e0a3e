#!/usr/bin/env python3
"""Time to first token on a node that misses a prompt's prefix another node of the fleet
holds: pulled (PullPrefix, by gRPC and by UCX) against recomputed, side by side, for
several prompt lengths (where a pull starts to pay: the worker's --pull_min_tokens). Per
length and repetition: a fresh redis-server and four kvmemd sharing it (--cluster-index,
each named by its own socket); node A runs --ucx (UCX_TLS=tcp by default, as between
hosts; --ucx_tls=sm,self for shared memory). The
reference worker (SmolLM2, full policy, --prefix_cache, --transport=attach) runs the prompt
cold on node A, which publishes its blocks; then on node B cold (nothing there: the whole
prompt is computed, as a fleet without sharing would), on node C with --pull_prefix over
gRPC (C pulls A's prefix by ReadKv, maps it, computes the rest) and on node D with
--pull_prefix over UCX (D holds a peer token: RMA gets from A's pool). Every first-token
time includes CreateSequence, the pull where there is one, the prefill and its Append. The
answers must be A's (greedy).

Usage: python3 bench/fleet_ttft.py [--contexts 32,64,128,256,1024] [--repeat 3] [--decode 8]
                                  [--ucx_tls tcp]
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


UCX_TLS = "tcp"  # --ucx_tls


def start_node(name, redis_sock, peers=(), flags=()):
    sock = node_socket(name)
    proc = subprocess.Popen([str(BIN / "kvmemd"), f"--listen=unix:{sock}", "--metrics-listen=",
                             "--pool-bytes=1073741824", "--page-bytes=262144",
                             f"--cluster-index=unix://{redis_sock}",
                             f"--cluster-node-address=unix:{sock}",
                             "--cluster-index-timeout-ms=1000",
                             "--cluster-peers=" + ",".join(f"unix:{node_socket(p)}" for p in peers),
                             *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env=dict(os.environ, UCX_TLS=UCX_TLS, UCX_WARN_UNUSED_ENV_VARS="n"))
    if not proc.stdout.readline().startswith("READY"):
        sys.exit(f"kvmemd {name} did not start")
    return proc, sock


def claims(redis_sock):
    out = subprocess.run([shutil.which("redis-cli"), "-s", str(redis_sock), "DBSIZE"],
                         capture_output=True, text=True).stdout.strip()
    return int(out or 0)


def one_length(context, repeat, decode):
    model, prompt_args = prefix_ttft.model_and_prompt(context)
    prompt_args = (*prompt_args, "--transport=attach")
    times = {"recompute": [], "grpc": [], "ucx": [], "local": []}
    pulled_tokens = {}
    for r in range(repeat):
        with tempfile.TemporaryDirectory() as tmp:
            token = Path(tmp) / "peer-token"
            token.write_text("fleet-bench-peer-token-0123456789\n")
            redis, redis_sock = start_redis(tmp)
            tag = f"{context}x{r}"
            nodes = {
                "a": start_node(f"a{tag}", redis_sock, flags=("--ucx", "--ucx_trusted_network")),
                "b": start_node(f"b{tag}", redis_sock),
                "c": start_node(f"c{tag}", redis_sock, [f"a{tag}"]),
                "d": start_node(f"d{tag}", redis_sock, [f"a{tag}"],
                                (f"--cluster-peer-token-file={token}",)),
            }
            try:
                _, n, _, a_answer = prefix_ttft.run(model, nodes["a"][1], prompt_args, decode)
                deadline = time.monotonic() + 10
                while claims(redis_sock) < (n - 1) // 16 and time.monotonic() < deadline:
                    time.sleep(0.05)
                runs = {
                    "recompute": ("b", prompt_args),
                    "grpc": ("c", (*prompt_args, "--pull_prefix", "--pull_transport=grpc")),
                    "ucx": ("d", (*prompt_args, "--pull_prefix", "--pull_transport=ucx")),
                    "local": ("a", prompt_args),  # for scale: A's own prefix, mapped
                }
                for what, (node, flags) in runs.items():
                    reused, _, ms, answer = prefix_ttft.run(model, nodes[node][1], flags, decode)
                    if answer != a_answer or (reused == 0) != (what == "recompute"):
                        sys.exit(f"{context} tokens, repetition {r}, {what}: reused {reused}, "
                                 f"answer equal to A's: {answer == a_answer}")
                    times[what].append(ms)
                    pulled_tokens[what] = reused
            finally:
                for proc, sock in nodes.values():
                    proc.terminate()
                    proc.wait()
                redis.kill()
                redis.wait()
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"{n:>6} {pulled_tokens['grpc']:>6} {med['recompute']:>12.1f} {med['grpc']:>10.1f} "
          f"{med['ucx']:>10.1f} {med['local']:>10.1f} "
          f"{med['recompute'] / med['grpc']:>10.2f} {med['recompute'] / med['ucx']:>10.2f}",
          flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="32,64,128,256,1024")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--decode", type=int, default=8)
    ap.add_argument("--ucx_tls", default="tcp", help="the daemons' UCX_TLS (tcp: as between hosts)")
    args = ap.parse_args()
    global UCX_TLS
    UCX_TLS = args.ucx_tls
    print(f"# first-token ms, medians of {args.repeat}; UCX_TLS={UCX_TLS}; answers identical "
          "to node A's")
    print(f"{'prompt':>6} {'pulled':>6} {'recompute':>12} {'pull grpc':>10} {'pull ucx':>10} "
          f"{'local hit':>10} {'rec/grpc':>10} {'rec/ucx':>10}")
    for context in (int(c) for c in args.contexts.split(",")):
        one_length(context, args.repeat, args.decode)


if __name__ == "__main__":
    main()
