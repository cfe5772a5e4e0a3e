#!/usr/bin/env python3
"""Time to first token of the reference worker (SmolLM2, cache in kvmemd, full policy) with
prefix sharing: per repetition, a fresh kvmemd, one cold run (nothing published: the whole
prompt is computed, and its blocks are published as they fill) and one warm run of the same
prompt (its published prefix is mapped at CreateSequence; only the rest is computed), side
by side. Both greedy; the answers must be identical. The first token's time includes
CreateSequence, the prefill forward pass and its Append.

Usage: python3 bench/prefix_ttft.py [--context 1024] [--repeat 5] [--decode 16] [--chunk 0]
--context N: the first N tokens of the Lee corpus (bench/eval's text) as the prompt.
--chunk 16: both runs prefill in block-sized chunks (kvmem_worker --prefill_chunk), so the
warm run's logits are the cold run's to the bit; 0 (default): one pass.
KVMEM_BIN: where kvmem_worker and kvmemd are (build/).
"""
import argparse
import importlib.util
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(os.environ.get("KVMEM_BIN", ROOT / "build"))
CHUNK = 0


def run(model, sock, prompt_args, decode):
    out = subprocess.run([str(BIN / "kvmem_worker"), "generate", f"--model={model}",
                          f"--target=unix:{sock}", "--raw", "--policy=full", "--prefix_cache",
                          f"--prefill_chunk={CHUNK}",
                          "--temperature=0", f"--max_tokens={decode}", *prompt_args],
                         check=True, capture_output=True, text=True).stdout
    m = re.search(r"prefix cache: (\d+) of (\d+) prompt tokens reused; first token after ([\d.]+) ms",
                  out)
    answer = out.split("\n---\n")[0]
    return int(m.group(1)), int(m.group(2)), float(m.group(3)), answer


def model_and_prompt(context):
    """The model file, and the worker's flags for the first `context` tokens of the Lee
    corpus (bench/eval's text) as the prompt."""
    model = subprocess.run(["bash", str(ROOT / "scripts" / "fetch_model.sh")], check=True,
                           capture_output=True, text=True).stdout.strip()
    spec = importlib.util.spec_from_file_location("kvmem_eval", ROOT / "bench" / "eval" / "eval.py")
    harness = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(ROOT / "bench" / "eval"))
    spec.loader.exec_module(harness)
    return model, (f"--prompt_file={harness.corpus_path()}", f"--max_prompt_tokens={context}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--decode", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=0)
    args = ap.parse_args()
    global CHUNK
    CHUNK = args.chunk
    model, prompt_args = model_and_prompt(args.context)
    cold, warm, ratios = [], [], []
    for r in range(args.repeat):
        sock = f"/tmp/kvmem-ttft-{os.getpid()}-{r}.sock"
        daemon = subprocess.Popen([str(BIN / "kvmemd"), f"--listen=unix:{sock}", "--metrics-listen=",
                                   "--pool-bytes=1073741824", "--page-bytes=262144"],
                                  stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        daemon.stdout.readline()  # READY
        try:
            c_reused, n, c_ms, c_answer = run(model, sock, prompt_args, args.decode)
            w_reused, _, w_ms, w_answer = run(model, sock, prompt_args, args.decode)
        finally:
            daemon.terminate()
            daemon.wait()
        if c_reused != 0 or w_answer != c_answer:
            sys.exit(f"repetition {r}: cold reused {c_reused}, answers equal: {w_answer == c_answer}")
        cold.append(c_ms)
        warm.append(w_ms)
        ratios.append(c_ms / w_ms)
        print(f"rep {r}: prompt {n} tokens, cold {c_ms:.1f} ms, warm {w_ms:.1f} ms "
              f"({w_reused} reused), {c_ms / w_ms:.1f}x", flush=True)
    print(f"median over {args.repeat}: cold {statistics.median(cold):.1f} ms, warm "
          f"{statistics.median(warm):.1f} ms, cold/warm {statistics.median(ratios):.1f}x "
          f"(range {min(ratios):.1f}-{max(ratios):.1f}); answers identical")


if __name__ == "__main__":
    main()
