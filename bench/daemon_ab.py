#!/usr/bin/env python3
"""Two kvmemd builds side by side under one worker: for each, the reference worker decodes
through the daemon and the script reports the worker's wall time in daemon calls per step
and the CPU time each daemon thread spent per step while the worker decoded (from
/proc/<pid>/task/*/schedstat between the worker's 'prefill done' and 'decode done' marks).
The builds run in turn (a, b, then b, a, ...), `--repeat` times, so that a busy machine
slows them alike. A thread that ends during the decode is not counted (gRPC's handler
threads may); a build's pool prefault thread is waited for before the worker starts.

Usage: python3 bench/daemon_ab.py --a DIR --b DIR [--worker DIR] [--context 1024]
       [--policy full] [--decode 128] [--repeat 3] [-- worker flags...]
DIR holds a kvmemd; the worker (kvmem_worker) comes from --worker (default: --b's DIR).
The prompt: the first --context tokens of the Lee corpus (bench/eval's text).
"""
import argparse
import importlib.util
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def eval_module():
    spec = importlib.util.spec_from_file_location("kvmem_eval", ROOT / "bench" / "eval" / "eval.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def thread_cpu(pid):
    """{'tid:name': CPU nanoseconds} of each live thread of `pid`."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            out[f"{task.name}:{name}"] = int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            pass  # a thread that ended meanwhile
    return out


def run_once(kvmemd_dir, worker, model, text, args, extra):
    sock = f"/tmp/kvmem-ab-{os.getpid()}.sock"
    daemon = subprocess.Popen([str(Path(kvmemd_dir) / "kvmemd"), f"--listen=unix:{sock}",
                               "--metrics-listen=", "--pool-bytes=2147483648",
                               "--page-bytes=262144", "--lease-seconds=3600"],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        if not daemon.stdout.readline().startswith("READY"):
            raise RuntimeError(f"{kvmemd_dir}/kvmemd did not start")
        # A build that maps its pool ahead of use does so first (its thread then ends), so
        # that the decode is measured with the pool mapped and without that thread's CPU.
        deadline = time.monotonic() + 120
        while (any(name.endswith(":kvmem_prefault") for name in thread_cpu(daemon.pid))
               and time.monotonic() < deadline):
            time.sleep(0.05)
        cmd = [str(Path(worker) / "kvmem_worker"), "generate", f"--model={model}",
               f"--target=unix:{sock}", f"--policy={args.policy}", "--raw",
               f"--prompt_file={text}", f"--max_prompt_tokens={args.context}",
               f"--max_tokens={args.decode}", *extra]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        marks = {}
        for line in proc.stderr:
            for mark in ("prefill done", "decode done"):
                if line.rstrip("\n").endswith(mark):
                    marks[mark] = thread_cpu(daemon.pid)
            if "decode done" in marks:
                break
        out, _ = proc.communicate()
        if proc.returncode != 0 or len(marks) != 2:
            raise RuntimeError(f"{' '.join(cmd)}: exit {proc.returncode}")
    finally:
        daemon.terminate()
        daemon.wait()
    steps = int(re.search(r"(\d+) generated", out).group(1))
    calls = float(re.search(r"daemon calls: ([\d.]+) ms per decode step", out).group(1))
    decode = float(re.search(r"([\d.]+) tokens/s decode", out).group(1))
    before, after = marks["prefill done"], marks["decode done"]
    per_thread = {k.split(":", 1)[1]: 0.0 for k in after}
    for k, v in after.items():
        per_thread[k.split(":", 1)[1]] += (v - before.get(k, 0)) / 1e6 / steps
    return calls, decode, per_thread


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--a", required=True, help="directory of the first kvmemd")
    ap.add_argument("--b", required=True, help="directory of the second kvmemd")
    ap.add_argument("--worker", help="directory of kvmem_worker (default: --b)")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--policy", default="full")
    ap.add_argument("--decode", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=3)
    args, extra = ap.parse_known_args()
    extra = [e for e in extra if e != "--"]
    ev = eval_module()
    model, text = ev.model_path(), ev.corpus_path()
    worker = args.worker or args.b
    # Threads are summed by name (gRPC's handler threads, the step channel's among them, and
    # the oneTBB workers they start are all "grpcpp_sync_ser").
    print(f"| run | kvmemd | daemon calls ms/step | decode tok/s | daemon CPU ms/step (busiest thread "
          f"name) | daemon CPU ms/step (all threads) |")
    print("|---|---|---|---|---|---|")
    for r in range(1, args.repeat + 1):
        order = (("a", args.a), ("b", args.b))
        for label, d in (order if r % 2 else order[::-1]):  # a, b; then b, a; ...
            calls, decode, per_thread = run_once(d, worker, model, text, args, extra)
            busiest = max(per_thread.items(), key=lambda kv: kv[1])
            print(f"| {r} | {label} | {calls:.2f} | {decode:.1f} | {busiest[1]:.3f} ({busiest[0]}) "
                  f"| {sum(per_thread.values()):.3f} |", flush=True)


if __name__ == "__main__":
    sys.exit(main())
