#!/usr/bin/env python3
"""Evaluation harness: drives kvmemd and the reference worker (SmolLM2-135M-Instruct) and
writes result tables (Markdown) and PNG plots under bench/eval/results/.

Studies implemented so far:
  ppl    streaming perplexity, token by token with eviction after every step, per policy,
         with the mean KV bytes each held and the share of the window->full gap it closes.
  quant  int8 / int4 / nf4 storage of tokens outside the recent window: perplexity change
         against the unquantized cache at the same policy.
  speed  decode tokens/s and daemon time per step at 1k, 4k and 8k tokens of context for
         full, window-512 and confkv.
  kl     CONF-KV's confidence against KL(full || newest 256 tokens dropped), per decode step,
         and their Pearson correlation (article: -0.77 on GPT-2, -0.36..-0.41 larger models).

Text: the Lee Background Corpus (300 ABC news articles, ~60k words) that the PyPI wheel of
gensim ships as gensim/test/test_data/lee_background.cor: journalists' running English, not
lists, code or legal boilerplate; the articles are concatenated in file order.

Usage:
  python3 bench/eval/eval.py ppl --tokens 4096        # the full run (minutes per policy)
  python3 bench/eval/eval.py ppl --small              # a few hundred tokens (tests)
  python3 bench/eval/eval.py quant --tokens 2048
"""
import argparse
import math
import os
import re
import subprocess
import sys
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT = Path(os.environ.get("KVMEM_EVAL_OUT", ROOT / "bench" / "eval" / "results"))
CACHE = Path(os.environ.get("KVMEM_CACHE", Path.home() / ".cache" / "kvmem"))


def corpus_path():
    """The Lee background corpus, taken from gensim's wheel (pip download, no install)."""
    dst = CACHE / "data" / "lee_background.txt"
    if dst.exists():
        return dst
    wheels = CACHE / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    found = sorted(wheels.glob("gensim-4.4.0-*.whl"))
    if not found:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                        "gensim==4.4.0", "-d", str(wheels)], check=True)
        found = sorted(wheels.glob("gensim-4.4.0-*.whl"))
    with zipfile.ZipFile(found[0]) as z:
        text = z.read("gensim/test/test_data/lee_background.cor").decode("utf-8")
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_text("\n\n".join(line.strip() for line in text.splitlines() if line.strip()))
    return dst


def model_path():
    return subprocess.run(["bash", str(ROOT / "scripts" / "fetch_model.sh")], check=True,
                          capture_output=True, text=True).stdout.strip()


class Daemon:
    def __init__(self):
        self.sock = f"/tmp/kvmem-eval-{os.getpid()}.sock"
        self.proc = subprocess.Popen([str(ROOT / "build" / "kvmemd"), f"--listen=unix:{self.sock}",
                                      "--pool-bytes=2147483648", "--page-bytes=262144",
                                      "--lease-seconds=3600"],
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        assert self.proc.stdout.readline().startswith("READY")

    def close(self):
        self.proc.terminate()
        self.proc.wait()


PPL_RE = re.compile(r"perplexity ([\d.]+) over (\d+) tokens \(policy (\S+), KV bytes at end (\d+), "
                    r"mean (\d+), (\d+) evicted, ([\d.]+) tokens/s\)")


def perplexity(model, text, tokens, target, policy, params=(), quant="none", recent=0):
    args = [str(ROOT / "build" / "kvmem_worker"), "perplexity", f"--model={model}", f"--text={text}",
            f"--max_eval_tokens={tokens}"]
    if policy == "local":
        args.append("--cache=local")
    else:
        args += [f"--target={target}", f"--policy={policy}", f"--quantization={quant}",
                 f"--quant_recent={recent}"]
        if params:
            args.append("--param=" + ",".join(f"{k}={v}" for k, v in params))
    # The worker's progress line (tokens, running perplexity, ETA) goes straight to stderr.
    out = subprocess.run(args, check=True, stdout=subprocess.PIPE, text=True).stdout
    m = PPL_RE.search(out)
    return {"ppl": float(m.group(1)), "tokens": int(m.group(2)), "kv_end": int(m.group(4)),
            "kv_mean": float(m.group(5)), "evicted": int(m.group(6)), "tps": float(m.group(7))}


def progress(i, n, start, label):
    elapsed = time.time() - start
    eta = elapsed / max(i, 1) * (n - i)
    print(f"[{i}/{n}] {label}  elapsed {elapsed:.0f}s, ETA {eta:.0f}s", file=sys.stderr, flush=True)


def pyplot():
    """matplotlib's pyplot on the file-only backend, or None when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def write_table(name, lines):
    """Writes a study's Markdown table under OUT and prints it."""
    table = "\n".join(lines) + "\n"
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"{name}.md").write_text(table)
    print(table)
    return table


def plot(rows, path, title):
    plt = pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, r in rows:
        ax.scatter(r["kv_mean"] / 2**20, r["ppl"])
        ax.annotate(name, (r["kv_mean"] / 2**20, r["ppl"]), fontsize=7, xytext=(3, 3),
                    textcoords="offset points")
    ax.set_xlabel("mean KV bytes held (MiB)")
    ax.set_ylabel("perplexity")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def study_ppl(args):
    n = args.tokens
    # Budgets scale with the run so that the small version still evicts.
    w = 512 if not args.small else 64
    scale = w / 512
    c_high, c_low = int(128 * scale), int(256 * scale)
    protect = max(4, int(32 * scale))
    runs = [
        ("full", "full", (), "none"),
        (f"window-{w}", "window", (("window", w),), "none"),
        (f"streaming_llm-{w}", "streaming_llm", (("budget", w),), "none"),
        (f"h2o-{c_low}", "h2o", (("budget", c_low),), "none"),
        ("confkv", "confkv", (("c_high", c_high), ("c_low", c_low), ("protect", protect)), "none"),
        ("confkv+int8", "confkv", (("c_high", c_high), ("c_low", c_low), ("protect", protect)), "int8"),
        ("confkv_l", "confkv_l", (("c_high", c_high), ("c_low", c_low), ("protect", protect),
                                  ("layer_floor", max(protect + 1, int(96 * scale)))), "none"),
    ]
    if args.only:
        runs = [r for r in runs if r[0] in args.only.split(",")]
    text = corpus_path()
    model = model_path()
    daemon = Daemon()
    results = []
    start = time.time()
    try:
        for i, (name, policy, params, quant) in enumerate(runs):
            progress(i, len(runs), start, f"{name} over {n} tokens")
            results.append((name, perplexity(model, text, n, f"unix:{daemon.sock}", policy, params,
                                             quant, recent=int(128 * scale))))
    finally:
        daemon.close()
    duration = time.time() - start
    by = dict(results)
    tag = "small" if args.small else str(n)
    lines = [f"### Streaming perplexity, {n} tokens of the Lee corpus ({tag})",
             f"Command: `python3 bench/eval/eval.py ppl --tokens {n}{' --small' if args.small else ''}`"
             f"; took {duration:.0f} s on this machine ({time.strftime('%Y-%m-%d')}).", "",
             "| policy | perplexity | mean KV bytes | KV vs full | gap closed (window→full) | tokens/s |",
             "|---|---|---|---|---|---|"]
    full, win = by.get("full"), by.get(f"window-{w}")
    for name, r in results:
        gap = ""
        if full and win and win["ppl"] != full["ppl"]:
            gap = f"{100 * (win['ppl'] - r['ppl']) / (win['ppl'] - full['ppl']):.0f} %"
        share = f"{100 * r['kv_mean'] / full['kv_mean']:.0f} %" if full else ""
        lines.append(f"| {name} | {r['ppl']:.3f} | {r['kv_mean'] / 2**20:.2f} MiB | {share} | {gap} | {r['tps']:.1f} |")
    write_table(f"ppl-{tag}", lines)
    plot(results, OUT / f"ppl-{tag}.png", f"Streaming perplexity, {n} tokens")
    return results


def study_quant(args):
    n = args.tokens
    text, model = corpus_path(), model_path()
    daemon = Daemon()
    results = []
    start = time.time()
    recent = 16 if args.small else 128
    try:
        for i, quant in enumerate(["none", "int8", "int4", "nf4"]):
            progress(i, 4, start, f"full + {quant}")
            results.append((quant, perplexity(model, text, n, f"unix:{daemon.sock}", "full", (), quant,
                                              recent=recent)))
    finally:
        daemon.close()
    base = results[0][1]["ppl"]
    lines = [f"### Quantized storage beyond the recent {recent} tokens, {n} tokens, policy full",
             f"Command: `python3 bench/eval/eval.py quant --tokens {n}{' --small' if args.small else ''}`"
             f"; took {time.time() - start:.0f} s ({time.strftime('%Y-%m-%d')}).", "",
             "| storage | perplexity | change | mean KV bytes |", "|---|---|---|---|"]
    for q, r in results:
        lines.append(f"| {q} | {r['ppl']:.3f} | {r['ppl'] - base:+.3f} | {r['kv_mean'] / 2**20:.2f} MiB |")
    write_table(f"quant-{'small' if args.small else n}", lines)
    return results


def confidence(entropy, p1, p2, vocab=49152):
    """CONF-KV's c_t with the default weights (server/policy/scoring.cc Confidence)."""
    return 0.4 * max(0.0, min(1.0, 1 - entropy / math.log(vocab))) + 0.3 * (1 - p2 / p1) + 0.3 * p1


def study_kl(args):
    steps = 64 if args.small else max(args.tokens, 1000)
    warmup = 300 if args.small else 512
    text, model = corpus_path(), model_path()
    start = time.time()
    out = subprocess.run([str(ROOT / "build" / "kvmem_worker"), "kl", f"--model={model}",
                          f"--text={text}", f"--kl_warmup={warmup}", "--kl_drop=256",
                          f"--max_eval_tokens={steps}"], check=True, stdout=subprocess.PIPE,
                         text=True).stdout
    c, kl = [], []
    for line in out.splitlines():
        _, h, p1, p2, k = line.split()
        c.append(confidence(float(h), float(p1), float(p2)))
        kl.append(float(k))
    n = len(c)
    mc, mk = sum(c) / n, sum(kl) / n
    cov = sum((a - mc) * (b - mk) for a, b in zip(c, kl))
    r = cov / math.sqrt(sum((a - mc) ** 2 for a in c) * sum((b - mk) ** 2 for b in kl))
    lines = [f"### Confidence vs KL(full || newest 256 dropped), {n} decode steps",
             f"Command: `python3 bench/eval/eval.py kl{' --small' if args.small else f' --tokens {steps}'}`"
             f"; took {time.time() - start:.0f} s ({time.strftime('%Y-%m-%d')}). Teacher-forced over the "
             f"Lee corpus after {warmup} tokens of context, in-process cache.", "",
             "| steps | Pearson r | mean confidence | mean KL (nats) |", "|---|---|---|---|",
             f"| {n} | {r:.3f} | {mc:.3f} | {mk:.3f} |"]
    write_table(f"kl-{'small' if args.small else steps}", lines)
    plt = pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.scatter(c, kl, s=4, alpha=0.5)
        ax.set_xlabel("confidence c_t")
        ax.set_ylabel("KL(full || newest 256 dropped), nats")
        ax.set_title(f"Pearson r = {r:.3f} over {n} steps")
        fig.tight_layout()
        fig.savefig(OUT / f"kl-{'small' if args.small else steps}.png", dpi=120)
    return r


GEN_RE = re.compile(r"prompt (\d+) tokens, ([\d.]+) tokens/s prefill; (\d+) generated, ([\d.]+) tokens/s decode")
DAEMON_RE = re.compile(r"daemon calls: ([\d.]+) ms per decode step")


def study_speed(args):
    contexts = [128, 256] if args.small else [1024, 4096, 8000]
    decode = 8 if args.small else 32
    runs = [("full", "full", ""), ("window-512", "window", "window=512"),
            ("confkv", "confkv", "")]
    text, model = corpus_path(), model_path()
    daemon = Daemon()
    rows = []
    start = time.time()
    try:
        total = len(contexts) * len(runs)
        for ctx in contexts:
            for name, policy, params in runs:
                progress(len(rows), total, start, f"{name} at {ctx} tokens")
                cmd = [str(ROOT / "build" / "kvmem_worker"), "generate", f"--model={model}",
                       f"--target=unix:{daemon.sock}", f"--policy={policy}", "--raw",
                       f"--prompt_file={text}", f"--max_prompt_tokens={ctx}", f"--max_tokens={decode}"]
                if params:
                    cmd.append(f"--param={params}")
                out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout
                g, d = GEN_RE.search(out), DAEMON_RE.search(out)
                rows.append((ctx, name, float(g.group(2)), float(g.group(4)), float(d.group(1))))
    finally:
        daemon.close()
    lines = [f"### Speed at long context, {decode} greedy tokens after the prompt",
             f"Command: `python3 bench/eval/eval.py speed{' --small' if args.small else ''}`; took "
             f"{time.time() - start:.0f} s ({time.strftime('%Y-%m-%d')}). Prompt: the first N tokens of "
             "the Lee corpus; cache in kvmemd (f32), read in place.", "",
             "| context | policy | prefill tok/s | decode tok/s | daemon calls per step (ms) |",
             "|---|---|---|---|---|"]
    for ctx, name, pre, dec, dms in rows:
        lines.append(f"| {ctx} | {name} | {pre:.1f} | {dec:.1f} | {dms:.2f} |")
    write_table(f"speed-{'small' if args.small else 'long'}", lines)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("study", choices=["ppl", "quant", "kl", "speed"])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--small", action="store_true", help="a short run that keeps the harness working")
    ap.add_argument("--only", default="", help="comma-separated run names (ppl)")
    args = ap.parse_args()
    if args.small:
        args.tokens = min(args.tokens, 160)
    {"ppl": study_ppl, "quant": study_quant, "kl": study_kl, "speed": study_speed}[args.study](args)


if __name__ == "__main__":
    main()
