#!/usr/bin/env python3
"""The reference worker's decode through kvmemd by each K/V transport (kvmem_worker
--transport): attach (the pool mapped, same host), ucx (every forward's K/V read by RMA gets,
the prompt's sent as a message) and grpc (ReadKv, K/V in the Append). One kvmemd with --ucx;
UCX_TLS for both ends (tcp, as from another host; sm,self for shared memory). Per transport:
the worker's own figure, daemon calls per decode step (StepBatch and the K/V reads; median
of --repeat runs), and the answer, which must be the same for all (full policy, greedy).

Usage: python3 bench/worker_transports.py [--ucx_tls tcp] [--tokens 32] [--repeat 3]
"""
import argparse
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(os.environ.get("KVMEM_BIN", ROOT / "build"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ucx_tls", default="tcp")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    model = subprocess.run(["bash", str(ROOT / "scripts" / "fetch_model.sh")], check=True,
                           capture_output=True, text=True).stdout.strip()
    env = dict(os.environ, UCX_TLS=args.ucx_tls, UCX_WARN_UNUSED_ENV_VARS="n",
               UCX_LOG_LEVEL="fatal")  # its connect tries (peer error handling) log to stdout
    sock = f"/tmp/kvmem-worker-transports-{os.getpid()}.sock"
    daemon = subprocess.Popen([str(BIN / "kvmemd"), f"--listen=unix:{sock}", "--metrics-listen=",
                               "--pool-bytes=536870912", "--ucx", "--ucx_trusted_network"],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    if not daemon.stdout.readline().startswith("READY"):
        sys.exit("kvmemd did not start")
    answers = {}
    try:
        print(f"# UCX_TLS={args.ucx_tls}; {args.tokens} tokens decoded; medians of {args.repeat}")
        print(f"{'transport':<10} {'ms/step':>8} {'tokens/s':>9}")
        for transport in ("attach", "ucx", "grpc"):
            per_step, rate = [], []
            for _ in range(args.repeat):
                run = subprocess.run(
                    [str(BIN / "kvmem_worker"), "generate", f"--model={model}",
                     "--prompt=Write a short story about a lighthouse keeper.",
                     f"--target=unix:{sock}", f"--transport={transport}", "--policy=full",
                     f"--max_tokens={args.tokens}", "--temperature=0"],
                    check=True, capture_output=True, text=True, env=env)
                per_step.append(float(re.search(r"daemon calls: ([\d.]+) ms per decode step",
                                                run.stdout).group(1)))
                rate.append(float(re.search(r"([\d.]+) tokens/s decode", run.stdout).group(1)))
                answers.setdefault(transport, run.stdout.split("\n---\n")[0])
            print(f"{transport:<10} {statistics.median(per_step):>8.2f} "
                  f"{statistics.median(rate):>9.1f}", flush=True)
    finally:
        daemon.terminate()
        daemon.wait()
    if len(set(answers.values())) != 1:
        sys.exit(f"answers differ: {answers}")
    print("answers identical")


if __name__ == "__main__":
    main()
