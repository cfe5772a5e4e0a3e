#!/usr/bin/env python3
"""Prefill and decode tokens/s of the reference worker (in-process cache, and with its cache
in kvmemd under the full policy) side by side with llama.cpp (llama-cpp-python) on the same
GGUF, the same prompt and the same number of greedy tokens, in one run.

Usage: python3 bench/worker_speed.py [--decode 64] [--repeat 3]
Needs build/kvmem_worker, build/kvmemd and llama-cpp-python (scripts/python_deps.sh).
"""
import argparse
import os
import re
import statistics
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPT = ("The history of the lighthouse is a story of human ingenuity in the face of the sea. "
          "For thousands of years, sailors relied on fires lit on hilltops to guide them home, "
          "and the ancient world built great towers such as the Pharos of Alexandria, whose light "
          "was said to be visible for many miles. In the centuries that followed, lighthouses "
          "spread along the coasts of Europe, each one a careful balance of engineering, optics and "
          "stubborn maintenance by the keepers who lived in them. The invention of the Fresnel lens "
          "in the nineteenth century changed everything: a single lamp could now throw a beam far "
          "across the water, and the keepers' work became one of precise routines, trimming wicks "
          "and winding clockwork through the long nights. Today most lighthouses are automated,")


def worker(model, cache, decode, extra=()):
    out = subprocess.run([str(ROOT / "build" / "kvmem_worker"), "generate", f"--model={model}",
                          f"--cache={cache}", "--raw", f"--prompt={PROMPT}", f"--max_tokens={decode}",
                          *extra], check=True, capture_output=True, text=True).stdout
    m = re.search(r"prompt (\d+) tokens, ([\d.]+) tokens/s prefill; (\d+) generated, ([\d.]+) tokens/s decode", out)
    return int(m.group(1)), float(m.group(2)), int(m.group(3)), float(m.group(4))


def llama_cpp_speed(model, decode, threads):
    import llama_cpp
    llm = llama_cpp.Llama(model_path=model, n_ctx=1024, n_threads=threads, n_batch=512, verbose=False)
    ids = llm.tokenize(PROMPT.encode(), add_bos=False, special=False)
    t0 = time.perf_counter()
    llm.eval(ids)
    t1 = time.perf_counter()
    n = 0
    for _ in range(decode):
        tok = int(llm.scores[llm.n_tokens - 1].argmax())
        llm.eval([tok])
        n += 1
    t2 = time.perf_counter()
    return len(ids), len(ids) / (t1 - t0), n, n / (t2 - t1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    model = subprocess.run(["bash", str(ROOT / "scripts" / "fetch_model.sh")], check=True,
                           capture_output=True, text=True).stdout.strip()
    sock = f"/tmp/kvmem-bench-{os.getpid()}.sock"
    daemon = subprocess.Popen([str(ROOT / "build" / "kvmemd"), f"--listen=unix:{sock}",
                               "--pool-bytes=1073741824", "--page-bytes=262144"],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    daemon.stdout.readline()  # READY
    rows = {}
    try:
        for _ in range(args.repeat):
            for name, fn in [
                ("kvmem_worker, in-process cache, 2 threads", lambda: worker(model, "local", args.decode)),
                ("kvmem_worker, cache in kvmemd (full), 2 threads",
                 lambda: worker(model, "kvmemd", args.decode, (f"--target=unix:{sock}", "--policy=full"))),
                ("llama.cpp (llama-cpp-python), 1 thread", lambda: llama_cpp_speed(model, args.decode, 1)),
                ("llama.cpp (llama-cpp-python), 2 threads", lambda: llama_cpp_speed(model, args.decode, 2)),
            ]:
                rows.setdefault(name, []).append(fn())
    finally:
        daemon.terminate()
        daemon.wait()
    med = {k: (v[0][0], statistics.median(r[1] for r in v), v[0][2], statistics.median(r[3] for r in v))
           for k, v in rows.items()}
    ref = med["llama.cpp (llama-cpp-python), 2 threads"]
    print(f"{'engine':<50}{'prefill tok/s':>14}{'decode tok/s':>14}{'prefill x':>11}{'decode x':>10}")
    for k, (n, pre, g, dec) in med.items():
        print(f"{k:<50}{pre:>14.1f}{dec:>14.1f}{pre / ref[1]:>11.2f}{dec / ref[3]:>10.2f}")
    print(f"(prompt {ref[0]} tokens, {args.decode} greedy tokens, median of {args.repeat}; "
          f"x = ratio to llama.cpp with 2 threads)")


if __name__ == "__main__":
    main()
