#!/usr/bin/env python3
"""PullPrefix by mapping, by UCX and by gRPC, repeated on one host: a holder A (--ucx)
publishes four 1,024-token prompts of a SmolLM2-shape layout (30x3x64 f32: 1,008 pulled
tokens are 46 MB of K/V); node M (A as a peer, with a peer token: A's pool mapped, the
mapping kept from its first pull), node D (the same, asked for UCX: RMA gets from A's pool,
the connection kept) and node G (A as a peer, no token: ReadKv) each pull every prompt, in
turn; the time of each PullPrefix call as the client sees it. UCX_TLS for every daemon.

Usage: python3 bench/pull_transports.py [--ucx_tls tcp]
"""
import argparse
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "python"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ucx_tls", default="tcp")
    args = ap.parse_args()
    os.environ.update(UCX_TLS=args.ucx_tls, UCX_WARN_UNUSED_ENV_VARS="n", UCX_LOG_LEVEL="fatal")
    import numpy as np
    from kvmem_testing import kvmem, start_daemon, stop_daemon
    tmp = tempfile.mkdtemp()
    redis_sock = pathlib.Path(tmp) / "redis.sock"
    redis = subprocess.Popen([shutil.which("redis-server"), "--port", "0", "--unixsocket",
                              str(redis_sock), "--save", ""], stdout=subprocess.DEVNULL)
    while not redis_sock.exists():
        time.sleep(0.01)
    token = pathlib.Path(tmp) / "peer-token"
    token.write_text("fleet-bench-peer-token-0123456789\n")

    def node(tag, *flags):
        sock = f"/tmp/kvmem-py-pull{tag}-{os.getpid()}.sock"
        return start_daemon(f"pull{tag}", f"--cluster_index=unix://{redis_sock}",
                            f"--cluster_node_address=unix:{sock}", "--pool_bytes=536870912",
                            *flags)

    a = node("a", "--ucx", "--ucx_trusted_network")
    m = node("m", f"--cluster_peers={a[1]}", f"--cluster_peer_token_file={token}")
    d = node("d", f"--cluster_peers={a[1]}", f"--cluster_peer_token_file={token}")
    g = node("g", f"--cluster_peers={a[1]}")
    try:
        on_a, on_m = kvmem.Client(a[1]), kvmem.Client(m[1])
        on_d, on_g = kvmem.Client(d[1]), kvmem.Client(g[1])
        layout = kvmem.Layout(30, 3, 64, kvmem.DType.F32, 16, vocab_size=50000)
        prompts = []
        for seed in range(1, 5):
            tokens = list(range(seed * 10000, seed * 10000 + 1024))
            prompt = kvmem.Prompt(tokens, model="m")
            k = np.random.default_rng(seed).standard_normal(layout.kv_shape(1024))
            k = k.astype(np.float32)
            seq = on_a.create_sequence(layout, prompt=prompt)
            for i in range(0, 1024, 64):
                seq.append(range(i, i + 64), k[:, :, i:i + 64], k[:, :, i:i + 64],
                           token_ids=tokens[i:i + 64])
            seq.publish()
            prompts.append(prompt)
        time.sleep(1.0)  # the claims reach Redis
        print(f"# UCX_TLS={args.ucx_tls}; PullPrefix ms per prompt (1,008 tokens, 46 MB)")
        print(f"{'prompt':>6} {'attach':>8} {'ucx':>8} {'grpc':>8}")
        for i, prompt in enumerate(prompts):
            row = []
            for client, want in ((on_m, "attach"), (on_d, "ucx"), (on_g, "grpc")):
                start = time.monotonic()
                pulled = client.pull_prefix(layout, prompt, transport=want)
                row.append((time.monotonic() - start) * 1e3)
                if pulled.transport != want or pulled.pulled_tokens != 1008:
                    sys.exit(f"prompt {i}: {pulled}")
            print(f"{i:>6} {row[0]:>8.1f} {row[1]:>8.1f} {row[2]:>8.1f}", flush=True)
    finally:
        for proc, _, sock in (a, m, d, g):
            stop_daemon(proc, sock)
        redis.kill()
        redis.wait()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
