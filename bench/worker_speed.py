#!/usr/bin/env python3
"""Prefill and decode tokens/s of the reference worker (in-process cache, and with its cache
in kvmemd under the full policy) side by side with llama.cpp (llama-cpp-python) on the same
GGUF, the same prompt and the same number of greedy tokens, in one run. The engines run in
turn within each repetition, so that a busy machine slows them alike.

The cache in kvmemd is measured twice: StepBatch through the same-host step channel (the
worker's default) and over gRPC (--step_channel=false).

Usage: python3 bench/worker_speed.py [--decode 64] [--repeat 3] [--context 1024] [--no-llama]
--context N: the first N tokens of the Lee corpus as the prompt (bench/eval's text) instead
of the 156-token paragraph below. KVMEM_BIN: where kvmem_worker and kvmemd are (build/).
Needs build/kvmem_worker, build/kvmemd and llama-cpp-python (scripts/python_deps.sh).
"""
import argparse
import importlib.util
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(os.environ.get("KVMEM_BIN", ROOT / "build"))
PROMPT = ("The history of the lighthouse is a story of human ingenuity in the face of the sea. "
          "For thousands of years, sailors relied on fires lit on hilltops to guide them home, "
          "and the ancient world built great towers such as the Pharos of Alexandria, whose light "
          "was said to be visible for many miles. In the centuries that followed, lighthouses "
          "spread along the coasts of Europe, each one a careful balance of engineering, optics and "
          "stubborn maintenance by the keepers who lived in them. The invention of the Fresnel lens "
          "in the nineteenth century changed everything: a single lamp could now throw a beam far "
          "across the water, and the keepers' work became one of precise routines, trimming wicks "
          "and winding clockwork through the long nights. Today most lighthouses are automated,")


def worker(model, cache, decode, prompt_args, extra=()):
    out = subprocess.run([str(BIN / "kvmem_worker"), "generate", f"--model={model}",
                          f"--cache={cache}", "--raw", *prompt_args, f"--max_tokens={decode}",
                          *extra], check=True, capture_output=True, text=True).stdout
    m = re.search(r"prompt (\d+) tokens, ([\d.]+) tokens/s prefill; (\d+) generated, ([\d.]+) tokens/s decode", out)
    d = re.search(r"daemon calls: ([\d.]+) ms per decode step", out)
    return (int(m.group(1)), float(m.group(2)), int(m.group(3)), float(m.group(4)),
            float(d.group(1)) if d else None)


def llama_cpp_speed(model, decode, threads, text, context):
    import llama_cpp
    llm = llama_cpp.Llama(model_path=model, n_ctx=max(1024, context + decode + 16),
                          n_threads=threads, n_batch=512, verbose=False)
    ids = llm.tokenize(text.encode(), add_bos=False, special=False)
    if context:
        ids = ids[:context]
    t0 = time.perf_counter()
    llm.eval(ids)
    t1 = time.perf_counter()
    n = 0
    for _ in range(decode):
        tok = int(llm.scores[llm.n_tokens - 1].argmax())
        llm.eval([tok])
        n += 1
    t2 = time.perf_counter()
    return len(ids), len(ids) / (t1 - t0), n, n / (t2 - t1), None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--context", type=int, default=0,
                    help="prompt: the first N tokens of the Lee corpus (0: the 156-token paragraph)")
    ap.add_argument("--no-llama", action="store_true", help="the worker's two rows only")
    args = ap.parse_args()
    model = subprocess.run(["bash", str(ROOT / "scripts" / "fetch_model.sh")], check=True,
                           capture_output=True, text=True).stdout.strip()
    if args.context:
        # bench/eval/eval.py's corpus_path(): the text the long-context studies use.
        sys.path.insert(0, str(ROOT / "bench" / "eval"))
        spec = importlib.util.spec_from_file_location("kvmem_eval", ROOT / "bench" / "eval" / "eval.py")
        harness = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(harness)
        corpus = harness.corpus_path()
        text = corpus.read_text()
        prompt_args = (f"--prompt_file={corpus}", f"--max_prompt_tokens={args.context}")
    else:
        text = PROMPT
        prompt_args = (f"--prompt={PROMPT}",)
    sock = f"/tmp/kvmem-bench-{os.getpid()}.sock"
    daemon = subprocess.Popen([str(BIN / "kvmemd"), f"--listen=unix:{sock}", "--metrics-listen=",
                               "--pool-bytes=1073741824", "--page-bytes=262144"],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    daemon.stdout.readline()  # READY
    local, through, grpc = ("kvmem_worker, in-process cache, 2 threads",
                            "kvmem_worker, cache in kvmemd (full), step channel",
                            "kvmem_worker, cache in kvmemd (full), gRPC")
    engines = [
        (local, lambda: worker(model, "local", args.decode, prompt_args)),
        (through, lambda: worker(model, "kvmemd", args.decode, prompt_args,
                                 (f"--target=unix:{sock}", "--policy=full"))),
        (grpc, lambda: worker(model, "kvmemd", args.decode, prompt_args,
                              (f"--target=unix:{sock}", "--policy=full",
                               "--step_channel=false"))),
    ]
    if not args.no_llama:
        engines += [
            ("llama.cpp (llama-cpp-python), 1 thread",
             lambda: llama_cpp_speed(model, args.decode, 1, text, args.context)),
            ("llama.cpp (llama-cpp-python), 2 threads",
             lambda: llama_cpp_speed(model, args.decode, 2, text, args.context)),
        ]
    rows = {}
    try:
        for _ in range(args.repeat):
            for name, fn in engines:
                rows.setdefault(name, []).append(fn())
    finally:
        daemon.terminate()
        daemon.wait()
    med = {k: (v[0][0], statistics.median(r[1] for r in v), v[0][2], statistics.median(r[3] for r in v))
           for k, v in rows.items()}
    ref_name = "llama.cpp (llama-cpp-python), 2 threads" if not args.no_llama else local
    ref = med[ref_name]
    print(f"{'engine':<50}{'prefill tok/s':>14}{'decode tok/s':>14}{'prefill x':>11}{'decode x':>10}")
    for k, (n, pre, g, dec) in med.items():
        print(f"{k:<50}{pre:>14.1f}{dec:>14.1f}{pre / ref[1]:>11.2f}{dec / ref[3]:>10.2f}")
    # Each repetition's kvmemd runs against the in-process run just before them.
    for name in (through, grpc):
        pairs = [t[3] / l[3] for l, t in zip(rows[local], rows[name])]
        daemon_ms = statistics.median(t[4] for t in rows[name])
        print(f"decode through kvmemd ({name.rsplit(', ', 1)[1]}) / in process: "
              f"{statistics.median(pairs):.3f} (median of the per-repetition ratios "
              f"{', '.join(f'{x:.3f}' for x in pairs)}); daemon calls {daemon_ms:.2f} ms per "
              f"decode step")
    print(f"(prompt {ref[0]} tokens, {args.decode} greedy tokens, median of {args.repeat}; "
          f"x = ratio to {ref_name})")


if __name__ == "__main__":
    main()
