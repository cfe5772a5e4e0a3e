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
  devicestep  confkv / confkv_l / h2o through kvmemd --device_step=on (scores and selection
         in the backend's slot state) and =off (host policy code): identical perplexity, KV
         bytes and evictions expected.
  f16    confkv and h2o with their per-step attention rows sent as f32 and as f16
         (kvmem_worker --attention_f16): perplexity, evictions and KV bytes side by side.
  wire   bytes the worker sends and receives per decode step (strace), per policy.
  mass   the attention mass each step evicts (kvmemd's kvmem_evicted_attention_mass, read
         from /metrics) against the perplexity gap to the full cache, per policy and budget.
  kvpress  kvmem's streaming_llm, snapkv, pyramidkv and h2o through the transformers cache
         against kvpress's presses (25 % and 50 % kept): retrieval, perplexity, ms per token
         (bench/eval/kvpress_study.py; needs torch, transformers and kvpress).
  docshare  sequences per GiB at equal answer quality: questions over one document asked at
         once, with no sharing, prefix sharing, per-request compression and one shared
         compressed document (pool bytes held, time to first token, answers against full).

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

sys.path.insert(0, str(Path(__file__).resolve().parent))
import prompts  # noqa: E402  (bench/eval/prompts.py)

ROOT = Path(__file__).resolve().parents[2]
OUT = Path(os.environ.get("KVMEM_EVAL_OUT", ROOT / "bench" / "eval" / "results"))
CACHE = Path(os.environ.get("KVMEM_CACHE", Path.home() / ".cache" / "kvmem"))
# Where kvmemd and kvmem_worker are (a copy keeps a long run safe from rebuilds).
BIN = Path(os.environ.get("KVMEM_BIN", ROOT / "build"))


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
    started = 0

    def __init__(self, *flags, metrics=False):
        Daemon.started += 1
        self.sock = f"/tmp/kvmem-eval-{os.getpid()}-{Daemon.started}.sock"
        self.proc = subprocess.Popen([str(BIN / "kvmemd"), f"--listen=unix:{self.sock}",
                                      "--metrics-listen=" + ("127.0.0.1:0" if metrics else ""),
                                      "--pool-bytes=2147483648", "--page-bytes=262144",
                                      "--lease-seconds=3600", *flags],
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        ready = self.proc.stdout.readline()
        assert ready.startswith("READY")
        self.metrics_port = int(re.search(r"metrics_port=(\d+)", ready).group(1))

    def metrics(self):
        """{'name{labels}': value} of the daemon's /metrics."""
        import urllib.request
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics") as r:
            text = r.read().decode()
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, value = line.rsplit(" ", 1)
                out[key] = float(value)
        return out

    def close(self):
        self.proc.terminate()
        self.proc.wait()


PPL_RE = re.compile(r"perplexity ([\d.]+) over (\d+) tokens \(policy (\S+), KV bytes at end (\d+), "
                    r"mean (\d+), (\d+) evicted, ([\d.]+) tokens/s\)")


def perplexity(model, text, tokens, target, policy, params=(), quant="none", recent=0,
               prefill=0, extra=()):
    args = [str(BIN / "kvmem_worker"), "perplexity", f"--model={model}", f"--text={text}",
            f"--max_eval_tokens={tokens}", f"--prefill_tokens={prefill}", *extra]
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


RESULTS = ROOT / "bench" / "RESULTS.md"


def write_table(name, lines):
    """Writes a study's Markdown table under OUT, prints it, and puts it into
    bench/RESULTS.md between <!-- eval:NAME --> and <!-- /eval:NAME --> (appended at the end
    the first time). Runs with KVMEM_EVAL_OUT set (the tests) leave RESULTS.md alone."""
    table = "\n".join(lines) + "\n"
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"{name}.md").write_text(table)
    print(table)
    if "KVMEM_EVAL_OUT" not in os.environ and RESULTS.exists():
        # One heading level below the section the tables live in.
        block = "".join("#" + line if line.startswith("###") else line
                        for line in table.splitlines(keepends=True))
        text = RESULTS.read_text()
        begin, end = f"<!-- eval:{name} -->", f"<!-- /eval:{name} -->"
        if begin in text and end in text:
            text = text[:text.index(begin) + len(begin)] + "\n" + block + text[text.index(end):]
        else:
            text = text.rstrip("\n") + f"\n\n{begin}\n{block}{end}\n"
        RESULTS.write_text(text)
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


def scatter(points, xlabel, ylabel, title, path, xlog=False):
    """A labelled scatter plot of (label, x, y) points (nothing without matplotlib)."""
    plt = pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, x, y in points:
        ax.scatter(x, y)
        ax.annotate(label, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    if xlog:
        ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def study_ppl(args):
    """Streaming perplexity at matched KV bytes: every policy's budget is set so that its
    mean KV bytes come out at window-W's (W = 512: the articles' comparison point)."""
    n = args.tokens
    w = 512 if not args.small else 64
    scale = w / 512
    protect = max(4, int(32 * scale))

    def conf(c_high, *extra):
        # confkv's mean budget sits just above c_high: a confident step cuts the stream to
        # c_high and it grows back one token per step (ALGORITHMS.md), so c_low = 2 c_high
        # is rarely reached.
        return (("c_high", int(c_high)), ("c_low", int(2 * c_high)), ("protect", protect)) + extra

    # Budgets for the same bytes as W f32 tokens per stream: confkv c_high ~ W (mean about
    # 1 % above c_high); confkv_l's layer factors 0.5^(l/L) average 0.726 over 30 layers;
    # confkv+int8 keeps the newest 128 in f32 (512 B per token and stream) and the rest
    # int8 (128 B + 32 B of per-block scales), so W * 512 B hold 128 + (W - 128) * 512 / 160.
    c_conf = int(w * 0.985)
    c_l = int(c_conf / 0.7265)
    recent = int(128 * scale)
    c_int8 = int((recent + (w - recent) * 512 / 160) * 0.985)
    runs = [
        ("full", "full", (), "none"),
        (f"window-{w}", "window", (("window", w),), "none"),
        (f"streaming_llm-{w}", "streaming_llm", (("budget", w),), "none"),
        (f"h2o-{w}", "h2o", (("budget", w),), "none"),
        (f"pyramid-{w}", "h2o", (("budget", w), ("pyramid", 1)), "none"),
        ("confkv", "confkv", conf(c_conf), "none"),
        ("confkv+int8", "confkv", conf(c_int8), "int8"),
        ("confkv_l", "confkv_l",
         conf(c_l, ("layer_floor", max(protect + 1, int(96 * scale)))), "none"),
        ("random", "confkv", conf(c_conf, ("random", 1)), "none"),
        ("recency only", "confkv", conf(c_conf, ("attention_weight", 0)), "none"),
        ("attention only", "confkv", conf(c_conf, ("attention_weight", 1)), "none"),
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
                                             quant, recent=recent)))
    finally:
        daemon.close()
    duration = time.time() - start
    by = dict(results)
    tag = "small" if args.small else str(n)
    full, win = by.get("full"), by.get(f"window-{w}")

    def row(name, r):
        gap = ""
        if full and win and win["ppl"] != full["ppl"]:
            gap = f"{100 * (win['ppl'] - r['ppl']) / (win['ppl'] - full['ppl']):.0f} %"
        vs_full = f"{100 * r['kv_mean'] / full['kv_mean']:.1f} %" if full else ""
        vs_win = f"{r['kv_mean'] / win['kv_mean']:.2f}" if win else ""
        return (f"| {name} | {r['ppl']:.3f} | {r['kv_mean'] / 2**20:.2f} MiB | {vs_full} | "
                f"{vs_win} | {gap} | {r['tps']:.1f} |")

    params = {name: ", ".join(f"{k}={v}" for k, v in p) + (f", {q}" if q != "none" else "")
              for name, _, p, q in runs}
    head = ["| policy | perplexity | mean KV bytes | KV vs full | KV / window's | gap closed "
            "(window→full) | tokens/s |", "|---|---|---|---|---|---|---|"]
    ablation = {"random", "recency only", "attention only"}
    lines = [f"### Streaming perplexity at matched KV bytes, {n} tokens of the Lee corpus ({tag})",
             f"Command: `python3 bench/eval/eval.py ppl --tokens {n}{' --small' if args.small else ''}`"
             f"; one run, {duration:.0f} s on this machine ({time.strftime('%Y-%m-%d')}). Every "
             f"policy's budget is set for the KV bytes of window-{w} (column 'KV / window's'); "
             "eviction after every token.", ""] + head
    lines += [row(name, r) for name, r in results if name not in ablation]
    lines += ["", f"Ablation at equal trigger frequency (confkv's budgets and schedule, every step; "
              "only the choice of which tokens go differs):", ""] + head
    lines += [row(name, r) for name, r in results if name in ablation or name == "confkv"]
    lines += ["", "Parameters: " + "; ".join(f"{k}: {v or 'defaults'}" for k, v in params.items())]
    write_table(f"ppl-{tag}", lines)
    plot(results, OUT / f"ppl-{tag}.png", f"Streaming perplexity at matched KV bytes, {n} tokens")
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


def study_quanterr(args):
    """int8 / int4 / nf4 relative error ||x - x_hat|| / ||x|| on the model's real K and V
    (every full 16-token block of every stream, kernels' reference quantizer)."""
    n = args.tokens
    text, model = corpus_path(), model_path()
    start = time.time()
    out = subprocess.run([str(BIN / "kvmem_worker"), "quanterr", f"--model={model}",
                          f"--text={text}", f"--max_eval_tokens={n}"], check=True,
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True).stdout
    tag = "small" if args.small else str(n)
    lines = [f"### Quantization error on real K/V, {n} tokens of the Lee corpus",
             f"Command: `python3 bench/eval/eval.py quanterr --tokens {n}"
             f"{' --small' if args.small else ''}`; {time.time() - start:.0f} s "
             f"({time.strftime('%Y-%m-%d')}). Error = ||x - x_hat|| / ||x|| over every full "
             "16-token block of all 90 streams (K after RoPE).", "",
             "| storage | K relative error | V relative error | article |", "|---|---|---|---|"]
    article = {"int8": "0.38 %", "int4": "", "nf4": ""}
    for line in out.splitlines():
        name, k, v = line.split()
        lines.append(f"| {name} | {100 * float(k):.2f} % | {100 * float(v):.2f} % | {article[name]} |")
    write_table(f"quant-error-{tag}", lines)


def confidence(entropy, p1, p2, vocab=49152):
    """CONF-KV's c_t with the default weights (server/policy/scoring.cc Confidence)."""
    return 0.4 * max(0.0, min(1.0, 1 - entropy / math.log(vocab))) + 0.3 * (1 - p2 / p1) + 0.3 * p1


def study_kl(args):
    """Pearson r between confidence and KL(full || dropped), dropping the newest 256 tokens
    (the article's wording) and, as a second reading, the 256 before the newest 32."""
    steps = 64 if args.small else max(args.tokens, 1000)
    warmup = 300 if args.small else 512
    text, model = corpus_path(), model_path()
    start = time.time()
    rows = []
    for keep in (0, 32):
        out = subprocess.run([str(BIN / "kvmem_worker"), "kl", f"--model={model}",
                              f"--text={text}", f"--kl_warmup={warmup}", "--kl_drop=256",
                              f"--kl_keep_recent={keep}", f"--max_eval_tokens={steps}"],
                             check=True, stdout=subprocess.PIPE, text=True).stdout
        c, kl = [], []
        for line in out.splitlines():
            _, h, p1, p2, k = line.split()
            c.append(confidence(float(h), float(p1), float(p2)))
            kl.append(float(k))
        n = len(c)
        mc, mk = sum(c) / n, sum(kl) / n
        cov = sum((a - mc) * (b - mk) for a, b in zip(c, kl))
        r = cov / math.sqrt(sum((a - mc) ** 2 for a in c) * sum((b - mk) ** 2 for b in kl))
        rows.append((keep, n, r, mc, mk, c, kl))
    tag = "small" if args.small else str(steps)
    lines = [f"### Confidence vs KL(full || 256 tokens dropped), {steps} decode steps",
             f"Command: `python3 bench/eval/eval.py kl{' --small' if args.small else f' --tokens {steps}'}`"
             f"; took {time.time() - start:.0f} s ({time.strftime('%Y-%m-%d')}). Teacher-forced over the "
             f"Lee corpus after {warmup} tokens of context, in-process cache.", "",
             "| tokens dropped | steps | Pearson r | mean confidence | mean KL (nats) |",
             "|---|---|---|---|---|"]
    for keep, n, r, mc, mk, _, _ in rows:
        what = "the newest 256" if keep == 0 else f"the 256 before the newest {keep}"
        lines.append(f"| {what} | {n} | {r:.3f} | {mc:.3f} | {mk:.3f} |")
    write_table(f"kl-{tag}", lines)
    plt = pyplot()
    if plt is not None:
        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        for ax, (keep, n, r, _, _, c, kl) in zip(axes, rows):
            ax.scatter(c, kl, s=4, alpha=0.5)
            ax.set_xlabel("confidence c_t")
            ax.set_ylabel("KL, nats")
            what = "newest 256 dropped" if keep == 0 else f"256 before the newest {keep} dropped"
            ax.set_title(f"{what}: r = {r:.3f}")
        fig.tight_layout()
        fig.savefig(OUT / f"kl-{tag}.png", dpi=120)
    return rows[0][2]


GEN_RE = re.compile(r"prompt (\d+) tokens, ([\d.]+) tokens/s prefill; (\d+) generated, ([\d.]+) tokens/s decode")
DAEMON_RE = re.compile(r"daemon calls: ([\d.]+) ms per decode step(?:, median ([\d.]+), first ([\d.]+))?")


def cpu_seconds(pid):
    """CPU time of every live thread of process `pid` (scheduler statistics, nanoseconds)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            pass  # a thread that ended meanwhile
    return total / 1e9


def generate_profiled(cmd, daemon):
    """Runs `kvmem_worker generate`; returns its stdout and the daemon's CPU seconds between
    the worker's 'prefill done' and 'decode done' marks (stderr)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    marks = {}
    for line in proc.stderr:
        for mark in ("prefill done", "decode done"):
            if line.rstrip("\n").endswith(mark):
                marks[mark] = cpu_seconds(daemon.proc.pid)
        if "decode done" in marks:
            break
    out, _ = proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: exit {proc.returncode}")
    if len(marks) != 2:  # a worker from before the marks
        return out, None
    return out, marks["decode done"] - marks["prefill done"]


def study_speed(args):
    contexts = [128, 256] if args.small else [1024, 4096, 8000]
    if args.contexts:
        contexts = [int(c) for c in args.contexts.split(",")]
    decode = 8 if args.small else 32
    # confkv's attention rows travel as f16 (the f16 study: no change in perplexity beyond
    # 0.005 %), and once more as f32 for comparison.
    runs = [("full", "full", "", ()), ("window-512", "window", "window=512", ()),
            ("confkv", "confkv", "", ("--attention_f16",)),
            ("confkv, f32 rows", "confkv", "", ())]
    text, model = corpus_path(), model_path()
    daemon = Daemon()
    rows = []
    start = time.time()
    try:
        total = len(contexts) * len(runs)
        for ctx in contexts:
            for name, policy, params, extra in runs:
                progress(len(rows), total, start, f"{name} at {ctx} tokens")
                cmd = [str(BIN / "kvmem_worker"), "generate", f"--model={model}",
                       f"--target=unix:{daemon.sock}", f"--policy={policy}", "--raw",
                       f"--prompt_file={text}", f"--max_prompt_tokens={ctx}", f"--max_tokens={decode}"]
                if params:
                    cmd.append(f"--param={params}")
                out, daemon_cpu = generate_profiled(cmd + list(extra), daemon)
                g, d = GEN_RE.search(out), DAEMON_RE.search(out)
                cpu = 1e3 * daemon_cpu / int(g.group(3)) if daemon_cpu is not None else None
                calls = "/".join(f"{float(x):.2f}" for x in d.groups() if x is not None)
                rows.append((ctx, name, float(g.group(2)), float(g.group(4)), calls, cpu))
    finally:
        daemon.close()
    lines = [f"### Speed at long context, {decode} greedy tokens after the prompt",
             f"Command: `python3 bench/eval/eval.py speed{' --small' if args.small else ''}"
             f"{f' --contexts {args.contexts}' if args.contexts else ''}`; took "
             f"{time.time() - start:.0f} s ({time.strftime('%Y-%m-%d')}). Prompt: the first N tokens of "
             "the Lee corpus; cache in kvmemd (f32), read in place; one StepBatch per token, confkv's "
             "attention rows as f16 unless the row says f32. Daemon "
             "calls: the worker's wall time in them per step, mean / median / the first step (the "
             "step channel's first batch); daemon CPU: kvmemd's threads' CPU time while the worker "
             "decoded.", "",
             "| context | policy | prefill tok/s | decode tok/s | daemon calls per step, mean / median / first (ms) "
             "| daemon CPU per step (ms) |",
             "|---|---|---|---|---|---|"]
    for ctx, name, pre, dec, dms, cpu in rows:
        cpu = f"{cpu:.2f}" if cpu is not None else "n/a"
        lines.append(f"| {ctx} | {name} | {pre:.1f} | {dec:.1f} | {dms} | {cpu} |")
    tag = "small" if args.small else "long" if not args.contexts else args.contexts.replace(",", "-")
    write_table(f"speed-{tag}", lines)
    return rows


def socket_bytes(cmd, steps):
    """Bytes the worker sends and receives on its sockets per decode step: `cmd` (a
    `kvmem_worker generate`) under strace, sendmsg/recvmsg between the 'prefill done' and
    'decode done' marks (a worker from before the marks: its first progress line and its
    last newline). Returns (KiB sent, KiB received, sendmsg calls, recvmsg calls) per step."""
    log = Path(f"/tmp/kvmem-eval-strace-{os.getpid()}.txt")
    subprocess.run(["strace", "-f", "-e", "trace=sendmsg,recvmsg,write", "-s", "16", "-o",
                    str(log)] + cmd, check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    sent = received = sends = receives = 0
    phase = "prefill"
    for line in log.read_text().splitlines():
        if "write(2," in line:
            if phase == "prefill" and ("prefill done" in line or " tokens\"" in line):
                phase = "decode"
            elif phase == "decode" and ("decode done" in line or '"\\n", 1)' in line):
                phase = "end"
            continue
        m = re.search(r"(sendmsg|recvmsg)\(.*\)\s+=\s+(\d+)", line)
        if phase == "decode" and m:
            if m.group(1) == "sendmsg":
                sent, sends = sent + int(m.group(2)), sends + 1
            else:
                received, receives = received + int(m.group(2)), receives + 1
    log.unlink()
    return sent / 1024 / steps, received / 1024 / steps, sends / steps, receives / steps


def study_wire(args):
    """What one decode step puts on the daemon's socket, per policy: the worker's
    sendmsg/recvmsg bytes (strace) while it decodes 16 tokens after a prompt of each
    --contexts length (default 1024)."""
    contexts = [int(c) for c in args.contexts.split(",")] if args.contexts else [1024]
    if args.small:
        contexts = [128]
    steps = 16
    runs = [("full", ("--policy=full",)), ("window-512", ("--policy=window", "--param=window=512")),
            ("confkv", ("--policy=confkv",)),
            ("confkv, --attention_f16", ("--policy=confkv", "--attention_f16"))]
    worker = str(BIN / "kvmem_worker")
    known = subprocess.run([worker, "--helpfull"], capture_output=True, text=True).stdout
    runs = [r for r in runs if all(f.split("=")[0].lstrip("-") in known for f in r[1])]
    text, model = corpus_path(), model_path()
    daemon = Daemon()
    rows = []
    start = time.time()
    try:
        for ctx in contexts:
            for name, flags in runs:
                progress(len(rows), len(contexts) * len(runs), start, f"{name} at {ctx} tokens")
                cmd = [worker, "generate", f"--model={model}", f"--target=unix:{daemon.sock}",
                       "--raw", f"--prompt_file={text}", f"--max_prompt_tokens={ctx}",
                       f"--max_tokens={steps}", *flags,
                       # gRPC's bytes: the step channel would keep them off the socket
                       *(["--step_channel=false"] if "step_channel" in known else [])]
                rows.append((ctx, name) + socket_bytes(cmd, steps))
    finally:
        daemon.close()
    tag = "small" if args.small else "-".join(str(c) for c in contexts)
    lines = [f"### Bytes on the daemon's socket per decode step, {steps} greedy tokens",
             f"Command: `python3 bench/eval/eval.py wire"
             f"{' --small' if args.small else f' --contexts {args.contexts}' if args.contexts else ''}`"
             f"; took {time.time() - start:.0f} s ({time.strftime('%Y-%m-%d')}). The worker under "
             "strace: its sendmsg/recvmsg bytes while decoding, per step.", "",
             "| context | policy | KiB sent | KiB received | sendmsg / recvmsg calls |",
             "|---|---|---|---|---|"]
    for ctx, name, sent, received, sends, receives in rows:
        lines.append(f"| {ctx} | {name} | {sent:.1f} | {received:.1f} | {sends:.1f} / {receives:.1f} |")
    write_table(f"wire-{tag}", lines)
    return rows


# ---- retrieval (study 2), with the prefill halves of studies 3 and 4 on the same prompts ----

# Fixed-budget policies at 512 tokens per stream; confkv at twice its defaults with the
# long-context protected window (64); refreekv chooses its own share; infokv at its two
# prefill ratios, against attention-only scoring (infokv with alpha = 1) at the same ratios.
RETRIEVAL_POLICIES = [
    ("full", "full"),
    ("window-512", "window,window=512"),
    ("h2o-512", "h2o,budget=512"),
    ("snapkv-512", "snapkv,budget=512"),
    ("confkv", "confkv,c_high=256,c_low=512,protect=64"),
    ("refreekv", "refreekv"),
    ("infokv-40%", "infokv,prefill_ratio=0.4"),
    ("infokv-20%", "infokv,prefill_ratio=0.2"),
    ("attention-40%", "infokv,prefill_ratio=0.4,alpha=1"),
    ("attention-20%", "infokv,prefill_ratio=0.2,alpha=1"),
]


def token_counter(model):
    def count(text):
        path = Path(f"/tmp/kvmem-eval-count-{os.getpid()}.txt")
        path.write_text(text)
        out = subprocess.run([str(BIN / "kvmem_worker"), "dump", f"--model={model}", "--ids_only",
                              f"--prompt_file={path}"], check=True, capture_output=True,
                             text=True).stdout
        return out.count(",") + 1
    return count


def run_multi(model, daemon, prompt, policies, max_tokens, stop_at_number=True):
    """One prompt through `kvmem_worker multi`: {label: record} for every policy."""
    import json
    path = Path(f"/tmp/kvmem-eval-prompt-{os.getpid()}.txt")
    path.write_text(prompt["text"])
    spec = ";".join(p for _, p in policies)
    out = subprocess.run([str(BIN / "kvmem_worker"), "multi", f"--model={model}",
                          f"--target=unix:{daemon.sock}", f"--prompt_file={path}",
                          f"--answer_prefix={prompt['prefix']}", f"--max_tokens={max_tokens}",
                          f"--policies={spec}"] + (["--stop_at_number"] if stop_at_number else []),
                         check=True, stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL, text=True).stdout
    by_spec = {json.loads(line)["policy"]: json.loads(line) for line in out.splitlines() if line}
    return {label: by_spec[p] for label, p in policies}


def run_prompts(prompts, policies, log, max_tokens, label):
    """Runs every prompt not yet in `log` (JSON lines; a rerun resumes), with progress and
    an ETA weighted by prompt length^1.5 (prefill dominates and grows faster than linear)."""
    import json
    done = {}
    if log.exists():
        for line in log.read_text().splitlines():
            r = json.loads(line)
            done[r["key"]] = r
    log.parent.mkdir(parents=True, exist_ok=True)
    pending = [p for p in prompts if p["key"] not in done]
    weight = lambda p: p["length"] ** 1.5
    total, spent, already = sum(weight(p) for p in pending), 0.0, len(done)
    start = time.time()
    model, daemon = model_path(), Daemon()
    try:
        for i, p in enumerate(pending):
            elapsed = time.time() - start
            eta = elapsed / spent * (total - spent) if spent else 0
            print(f"[{already + i}/{len(prompts)}] {label}: {p['key']}  elapsed {elapsed:.0f}s,"
                  f" ETA {eta:.0f}s", file=sys.stderr, flush=True)
            results = run_multi(model, daemon, p, policies, max_tokens,
                                stop_at_number=p["kind"] != "summary")
            record = {k: v for k, v in p.items() if k != "text"}
            record["results"] = results
            with log.open("a") as f:
                f.write(json.dumps(record) + "\n")
            done[p["key"]] = record
            spent += weight(p)
    finally:
        daemon.close()
    return [done[p["key"]] for p in prompts]


def retrieval_prompts(args):
    lengths = [256, 512] if args.small else [1000, 2000, 4000, 7800]
    depths = [0.1, 0.9] if args.small else [0.1, 0.5, 0.9]
    samples = 2 if args.small else 5
    corpus = corpus_path().read_text()
    grid = prompts.retrieval_grid(lengths, depths, samples, corpus, token_counter(model_path()))
    for p in grid:
        p["key"] = f"{p['kind']}-{p['length']}-{p['depth']}-{p['sample']}"
    return grid, lengths, depths, samples


def study_retrieval(args):
    grid, lengths, depths, samples = retrieval_prompts(args)
    tag = "small" if args.small else "full"
    start = time.time()
    runs = run_prompts(grid, RETRIEVAL_POLICIES, OUT / f"retrieval-{tag}.jsonl", 10, "retrieval")
    for r in runs:
        for res in r["results"].values():
            res["correct"] = prompts.correct(r, res["answer"])
    names = [n for n, _ in RETRIEVAL_POLICIES]
    mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")
    acc = {n: mean([r["results"][n]["correct"] for r in runs]) for n in names}
    lines = [f"### Retrieval: passkey and needle, {len(runs)} prompts ({tag})",
             f"Command: `python3 bench/eval/eval.py retrieval{' --small' if args.small else ''}`; "
             f"lengths {lengths} tokens, depths {depths}, {samples} samples per cell (passkey and "
             f"needle alternate); {time.strftime('%Y-%m-%d')}, this run {time.time() - start:.0f} s"
             " (prompts already in the log are not rerun). Greedy answer after the assistant "
             "prefix; correct = its first number is the key.", "",
             "| policy | accuracy | relative to full | passkey | needle | "
             + " | ".join(f"{n} tok" for n in lengths) + " | mean KV bytes | KV vs full |",
             "|---|---|---|---|---|" + "---|" * len(lengths) + "---|---|"]
    full_kv = mean([r["results"]["full"]["kv_bytes_mean"] for r in runs])
    for n in names:
        by_kind = {k: mean([r["results"][n]["correct"] for r in runs if r["kind"] == k])
                   for k in ("passkey", "needle")}
        by_len = [mean([r["results"][n]["correct"] for r in runs if r["length"] == L])
                  for L in lengths]
        kv = mean([r["results"][n]["kv_bytes_mean"] for r in runs])
        rel = f"{100 * acc[n] / acc['full']:.0f} %" if acc["full"] > 0 else "n/a"
        lines.append(f"| {n} | {100 * acc[n]:.0f} % | {rel} | {100 * by_kind['passkey']:.0f} % | "
                     f"{100 * by_kind['needle']:.0f} % | "
                     + " | ".join(f"{100 * a:.0f} %" for a in by_len)
                     + f" | {kv / 2**20:.1f} MiB | {100 * kv / full_kv:.0f} % |")
    write_table(f"retrieval-{tag}", lines)
    plt = pyplot()
    if plt is not None:
        for n in names:
            grid_acc = [[mean([r["results"][n]["correct"] for r in runs
                               if r["length"] == L and r["depth"] == d]) for L in lengths]
                        for d in depths]
            fig, ax = plt.subplots(figsize=(5, 4))
            im = ax.imshow(grid_acc, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
            ax.set_xticks(range(len(lengths)), [str(L) for L in lengths])
            ax.set_yticks(range(len(depths)), [f"{int(100 * d)} %" for d in depths])
            for i in range(len(depths)):
                for j in range(len(lengths)):
                    ax.text(j, i, f"{100 * grid_acc[i][j]:.0f}", ha="center", va="center",
                            fontsize=8)
            ax.set_xlabel("prompt tokens")
            ax.set_ylabel("needle depth")
            ax.set_title(f"{n}: {100 * acc[n]:.0f} % ({samples} per cell)")
            fig.colorbar(im, ax=ax)
            fig.tight_layout()
            fig.savefig(OUT / f"retrieval-{tag}-{n.replace('%', 'pct')}.png", dpi=100)
            plt.close(fig)
    return runs


# ---- ReFreeKV on prompt kinds (study 3) -------------------------------------------------

def study_refreekv(args):
    """The cache share refreekv chooses per prompt kind and its answers against full's:
    retrieval (the retrieval study's prompts), summary-like and arithmetic prompts."""
    import json
    samples = 2 if args.small else 5
    tag = "small" if args.small else "full"
    corpus = corpus_path().read_text()
    extra = [prompts.summary(i, corpus) for i in range(samples)]
    extra += [prompts.arith(i, corpus) for i in range(samples)]
    for p in extra:
        p["key"], p["length"] = f"{p['kind']}-{p['sample']}", 0
    start = time.time()
    policies = [("full", "full"), ("refreekv", "refreekv")]
    runs = run_prompts(extra, policies, OUT / f"refreekv-{tag}.jsonl", 48, "refreekv")
    log = OUT / f"retrieval-{tag}.jsonl"
    retrieval = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    lines = [f"### ReFreeKV: the cache share it chooses per prompt kind ({tag})",
             f"Command: `python3 bench/eval/eval.py refreekv{' --small' if args.small else ''}` "
             f"(retrieval rows from `eval.py retrieval`'s log); {time.strftime('%Y-%m-%d')}, "
             f"{time.time() - start:.0f} s. Share = KV bytes kept after the prompt's compression "
             "/ full. Retrieval and arithmetic: correct = the expected number; summary: ROUGE-L "
             "F1 of refreekv's summary against full's (1 = identical). Same answer: the same first "
             "number (the same text for summaries).", "",
             "| prompt kind | prompts | mean prompt tokens | refreekv share (mean, min–max) | "
             "full | refreekv | same answer as full |", "|---|---|---|---|---|---|---|"]
    for kind in ("passkey", "needle", "arith", "summary"):
        rows = [r for r in (retrieval if kind in ("passkey", "needle") else runs)
                if r["kind"] == kind]
        if not rows:
            continue
        share = [r["results"]["refreekv"]["kv_bytes_prompt"] / r["results"]["refreekv"]["kv_bytes_full"]
                 for r in rows]
        tokens = sum(r["results"]["full"]["prompt_tokens"] for r in rows) / len(rows)
        def same_answer(r):
            a, b = r["results"]["refreekv"]["answer"], r["results"]["full"]["answer"]
            if kind == "summary":
                return a.strip() == b.strip()
            return prompts.numbers_in(a)[:1] == prompts.numbers_in(b)[:1]
        same = sum(same_answer(r) for r in rows) / len(rows)
        if kind == "summary":
            score = sum(prompts.rouge_l(r["results"]["refreekv"]["answer"], r["results"]["full"]["answer"])
                        for r in rows) / len(rows)
            full_cell, ref_cell = "reference", f"ROUGE-L {score:.2f}"
        else:
            acc = {n: sum(prompts.correct(r, r["results"][n]["answer"]) for r in rows) / len(rows)
                   for n in ("full", "refreekv")}
            full_cell, ref_cell = f"{100 * acc['full']:.0f} %", f"{100 * acc['refreekv']:.0f} %"
        lines.append(f"| {kind} | {len(rows)} | {tokens:.0f} | {100 * sum(share) / len(share):.0f} % "
                     f"({100 * min(share):.0f}–{100 * max(share):.0f} %) | {full_cell} | {ref_cell} | "
                     f"{100 * same:.0f} % |")
    write_table(f"refreekv-{tag}", lines)
    return runs


# ---- InfoKV against attention-only scoring (study 4) --------------------------------------

def study_infokv(args):
    """Prefill budgets 40 % / 20 % on the retrieval prompts (from the retrieval study's log)
    and decode budgets 25 % / 12.5 %: teacher-forced perplexity of the text that follows a
    prompt, the generated region compressed every 1,024 tokens (every 64 in --small)."""
    import json
    tag = "small" if args.small else "full"
    prompt_tokens, scored = (128, 192) if args.small else (1024, 2048)
    interval = 64 if args.small else 1024
    log = OUT / f"retrieval-{tag}.jsonl"
    retrieval = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    lines = [f"### InfoKV against attention-only scoring ({tag})",
             f"Command: `python3 bench/eval/eval.py infokv{' --small' if args.small else ''}` "
             f"(prefill rows from `eval.py retrieval`'s log); {time.strftime('%Y-%m-%d')}. "
             "Attention only = infokv with alpha = 1 (pooled window scores, the recent window "
             "kept: SnapKV at the same ratio).", "",
             "Prefill budgets, retrieval accuracy over the retrieval prompts:", "",
             "| budget | infokv | attention only | mean KV bytes | prompts |", "|---|---|---|---|---|"]
    for ratio in ("40%", "20%"):
        rows = [r for r in retrieval if f"infokv-{ratio}" in r["results"]]
        if not rows:
            continue
        acc = {n: sum(prompts.correct(r, r["results"][f"{n}-{ratio}"]["answer"]) for r in rows)
               / len(rows) for n in ("infokv", "attention")}
        kv = sum(r["results"][f"infokv-{ratio}"]["kv_bytes_mean"] for r in rows) / len(rows)
        lines.append(f"| {ratio} | {100 * acc['infokv']:.0f} % | {100 * acc['attention']:.0f} % | "
                     f"{kv / 2**20:.1f} MiB | {len(rows)} |")
    text, model = corpus_path(), model_path()
    daemon = Daemon()
    start = time.time()
    runs = [("full", "full", ())]
    for ratio in (0.25, 0.125):
        for name, alpha in (("infokv", 0.9), ("attention only", 1.0)):
            runs.append((f"{name} {100 * ratio:g} %", "infokv",
                         (("prefill_ratio", 1), ("decode_ratio", ratio), ("alpha", alpha),
                          ("decode_interval", interval), ("window", 4 if args.small else 32))))
    results = []
    try:
        for i, (name, policy, params) in enumerate(runs):
            progress(i, len(runs), start, f"{name}, {scored} tokens after a {prompt_tokens}-token prompt")
            results.append((name, perplexity(model, text, prompt_tokens + scored,
                                             f"unix:{daemon.sock}", policy, params,
                                             prefill=prompt_tokens)))
    finally:
        daemon.close()
    base = results[0][1]
    lines += ["", f"Decode budgets: perplexity of {scored} teacher-forced tokens after a "
              f"{prompt_tokens}-token prompt (kept whole), the generated region compressed to "
              f"the ratio every {interval} tokens; {time.time() - start:.0f} s:", "",
              "| policy | perplexity | change vs full | mean KV bytes while decoding |",
              "|---|---|---|---|"]
    for name, r in results:
        lines.append(f"| {name} | {r['ppl']:.3f} | {r['ppl'] - base['ppl']:+.3f} | "
                     f"{r['kv_mean'] / 2**20:.2f} MiB |")
    write_table(f"infokv-{tag}", lines)
    return results


def study_devicestep(args):
    """The device step on the real model: confkv, confkv_l and h2o (with and without int8)
    through one kvmemd whose steps run in the backend's slot state (--device_step=on) and one
    whose steps run the policies' host code (off). Same perplexity, KV bytes and evictions
    are expected to the last digit."""
    n = args.tokens
    text, model = corpus_path(), model_path()
    on, off = Daemon("--device_step=on"), Daemon("--device_step=off")
    budget = 64 if args.small else 256
    runs = [("confkv", (("c_high", budget // 2), ("c_low", budget), ("protect", 16)), "none"),
            ("confkv_l", (("c_high", budget // 2), ("c_low", budget), ("layer_floor", budget // 4),
                          ("protect", 8)), "none"),
            ("confkv", (("c_high", budget // 2), ("c_low", budget), ("protect", 16)), "int8"),
            ("h2o", (("budget", budget),), "none"),
            ("h2o", (("budget", budget), ("pyramid", 1)), "none")]
    results = []
    start = time.time()
    try:
        for i, (policy, params, quant) in enumerate(runs):
            progress(i, len(runs), start, policy)
            a = perplexity(model, text, n, f"unix:{on.sock}", policy, params, quant, recent=32)
            b = perplexity(model, text, n, f"unix:{off.sock}", policy, params, quant, recent=32)
            results.append((policy, params, quant, a, b))
    finally:
        on.close()
        off.close()
    lines = [f"### Device step vs host policy code, {n} tokens",
             f"Command: `python3 bench/eval/eval.py devicestep --tokens {n}"
             f"{' --small' if args.small else ''}`; took {time.time() - start:.0f} s "
             f"({time.strftime('%Y-%m-%d')}).", "",
             "| policy | params | storage | perplexity on / off | mean KV bytes on / off "
             "| evicted on / off | identical |", "|---|---|---|---|---|---|---|"]
    for policy, params, quant, a, b in results:
        same = all(a[k] == b[k] for k in ("ppl", "kv_mean", "kv_end", "evicted"))
        p = ", ".join(f"{k}={v}" for k, v in params)
        lines.append(f"| {policy} | {p} | {quant} | {a['ppl']:.4f} / {b['ppl']:.4f} "
                     f"| {a['kv_mean']:.0f} / {b['kv_mean']:.0f} | {a['evicted']} / {b['evicted']} "
                     f"| {'yes' if same else 'NO'} |")
    write_table(f"devicestep-{'small' if args.small else n}", lines)
    return results


def study_f16(args):
    """What sending attention rows as IEEE halves (--attention_f16) costs in accuracy: the
    policies that read rows every step (confkv, h2o) over the same tokens with f32 and with
    f16 rows, one daemon. Perplexity, evictions and mean KV bytes side by side."""
    n = args.tokens
    text, model = corpus_path(), model_path()
    budget = 64 if args.small else 256
    runs = [("confkv", (("c_high", budget // 2), ("c_low", budget), ("protect", 16))),
            ("h2o", (("budget", budget),))]
    daemon = Daemon()
    results = []
    start = time.time()
    try:
        for i, (policy, params) in enumerate(runs):
            progress(i, len(runs), start, policy)
            a = perplexity(model, text, n, f"unix:{daemon.sock}", policy, params)
            b = perplexity(model, text, n, f"unix:{daemon.sock}", policy, params,
                           extra=("--attention_f16",))
            results.append((policy, params, a, b))
    finally:
        daemon.close()
    lines = [f"### Attention rows as f16 against f32, {n} tokens of the Lee corpus",
             f"Command: `python3 bench/eval/eval.py f16 --tokens {n}"
             f"{' --small' if args.small else ''}`; took {time.time() - start:.0f} s "
             f"({time.strftime('%Y-%m-%d')}). Streaming perplexity, a Step with the newest "
             "query's attention rows after every token.", "",
             "| policy | params | perplexity f32 / f16 | change | evicted f32 / f16 "
             "| mean KV bytes f32 / f16 |", "|---|---|---|---|---|---|"]
    for policy, params, a, b in results:
        p = ", ".join(f"{k}={v}" for k, v in params)
        lines.append(f"| {policy} | {p} | {a['ppl']:.4f} / {b['ppl']:.4f} "
                     f"| {100 * (b['ppl'] - a['ppl']) / a['ppl']:+.3f} % "
                     f"| {a['evicted']} / {b['evicted']} | {a['kv_mean']:.0f} / {b['kv_mean']:.0f} |")
    write_table(f"f16-{'small' if args.small else n}", lines)
    return results


def study_mass(args):
    """kvmemd's live quality signal on the real model: the attention mass each step evicts
    (kvmem_evicted_attention_mass, the newest query's weight on the slots the step drops,
    mean over streams), read from /metrics after streaming perplexity runs of policies and
    budgets, against each run's perplexity gap to the full cache. One fresh daemon per run."""
    n = args.tokens
    small = args.small
    budgets = (16, 32, 64) if small else (32, 64, 128, 256)
    runs = [("full", "full", ())]
    runs += [(f"h2o-{b}", "h2o", (("budget", b),)) for b in budgets]
    runs += [(f"confkv-{b}", "confkv", (("c_high", b), ("c_low", 2 * b),
                                        ("protect", max(4, b // 8)))) for b in budgets]
    text, model = corpus_path(), model_path()
    start = time.time()
    results = []
    for i, (name, policy, params) in enumerate(runs):
        progress(i, len(runs), start, f"{name} over {n} tokens")
        daemon = Daemon(metrics=True)
        try:
            r = perplexity(model, text, n, f"unix:{daemon.sock}", policy, params)
            m = daemon.metrics()
        finally:
            daemon.close()
        count = m.get(f'kvmem_evicted_attention_mass_count{{policy="{policy}"}}', 0)
        total = m.get(f'kvmem_evicted_attention_mass_sum{{policy="{policy}"}}', 0)
        r["mass_mean"] = total / count if count else 0.0
        r["mass_total"] = total
        r["steps_measured"] = count
        results.append((name, r))
    full = results[0][1]["ppl"]

    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        out = [0.0] * len(v)
        for rank, i in enumerate(order):
            out[i] = float(rank)
        return out

    def pearson(x, y):
        mx, my = sum(x) / len(x), sum(y) / len(y)
        sxy = sum((a - mx) * (b - my) for a, b in zip(x, y))
        sx = math.sqrt(sum((a - mx) ** 2 for a in x))
        sy = math.sqrt(sum((b - my) ** 2 for b in y))
        return sxy / (sx * sy) if sx and sy else float("nan")

    evicting = [(name, r) for name, r in results if name != "full"]
    gaps = [100 * (r["ppl"] - full) / full for _, r in evicting]
    masses = [r["mass_mean"] for _, r in evicting]
    rho = pearson(ranks(masses), ranks(gaps))
    r_lin = pearson(masses, gaps)
    tag = "small" if small else str(n)
    lines = [f"#### Evicted attention mass against the perplexity gap, {n} tokens ({tag})",
             f"Command: `python3 bench/eval/eval.py mass --tokens {n}{' --small' if small else ''}`"
             f"; took {time.time() - start:.0f} s ({time.strftime('%Y-%m-%d')}). Streaming "
             "perplexity of the Lee corpus, a Step with the newest query's attention rows after "
             "every token; the mass is kvmemd's histogram kvmem_evicted_attention_mass "
             "(_sum / _count from /metrics), nothing computed outside the daemon.", "",
             "| run | perplexity | gap to full | mean evicted mass per step | total mass evicted "
             "| steps measured |", "|---|---|---|---|---|---|"]
    for name, r in results:
        gap = 100 * (r["ppl"] - full) / full
        lines.append(f"| {name} | {r['ppl']:.3f} | {gap:+.2f} % | {r['mass_mean']:.5f} "
                     f"| {r['mass_total']:.2f} | {r['steps_measured']:.0f} |")
    lines += ["", f"Across the {len(evicting)} evicting runs: Spearman rank correlation of mean "
              f"evicted mass with the perplexity gap {rho:+.2f}, Pearson {r_lin:+.2f}."]
    write_table(f"mass-{tag}", lines)
    scatter([(name, r["mass_mean"], g) for (name, r), g in zip(evicting, gaps)],
            "mean attention mass evicted per step (kvmemd /metrics)", "perplexity gap to full (%)",
            f"Evicted attention mass vs perplexity gap, {n} tokens", OUT / f"mass-{tag}.png")
    return results, rho


DOC_QUESTIONS = [
    "How many residents left their homes near Hill Top?",
    "Where did the shootout in Kashmir take place?",
    "How much money did the Murray River Marathon raise for the Red Cross?",
    "How many midwives were suspended at Wollongong Hospital?",
    "How many people were killed in the fire in Lima?",
    "Who is the President of Pakistan?",
    "Where did the Hopman Cup match take place?",
    "How many Palestinian militants did the Israeli army kill in the Gaza Strip?",
]


def docqa(model, daemon, mode, questions, doc_tokens, max_tokens, policy="full", params=()):
    """`kvmem_worker docqa`: (per-question records, totals record)."""
    import json
    qfile = Path(f"/tmp/kvmem-eval-questions-{os.getpid()}.txt")
    qfile.write_text("\n".join(questions) + "\n")
    args = [str(BIN / "kvmem_worker"), "docqa", f"--model={model}", f"--target=unix:{daemon.sock}",
            f"--text={corpus_path()}", f"--questions_file={qfile}", f"--doc_mode={mode}",
            f"--document_tokens={doc_tokens}", f"--max_tokens={max_tokens}", f"--policy={policy}"]
    if params:
        args.append("--param=" + ",".join(f"{k}={v}" for k, v in params))
    out = subprocess.run(args, check=True, stdout=subprocess.PIPE, text=True).stdout
    records = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return records[:-1], records[-1]


def word_f1(a, b):
    """SQuAD-style word-overlap F1 of two answers (lower case, punctuation dropped)."""
    norm = lambda s: re.sub(r"[^a-z0-9 ]", " ", s.lower()).split()
    x, y = norm(a), norm(b)
    if not x or not y:
        return float(x == y)
    common = sum(min(x.count(w), y.count(w)) for w in set(x))
    if common == 0:
        return 0.0
    p, r = common / len(x), common / len(y)
    return 2 * p * r / (p + r)


def sharers_table(model, small):
    """16 requests sharing a 2,048-token prompt (the questions twice over): the blocks they
    hold together against one copy of the shared blocks plus every request's private tail,
    that is the blocks of 16 unshared requests less 15 copies of the shared ones."""
    n, doc = (4, 300) if small else (16, 2048)
    questions = [q if i < len(DOC_QUESTIONS) else "Briefly: " + q
                 for i, q in enumerate((DOC_QUESTIONS * 2)[:n])]
    totals = {}
    for mode in ("plain", "prefix"):
        daemon = Daemon()
        try:
            recs, totals[mode] = docqa(model, daemon, mode, questions, doc, 8)
        finally:
            daemon.close()
        if mode == "prefix":
            shared_blocks = recs[1]["reused"] // 16 * 90  # 30 layers x 3 KV heads
    ideal = totals["plain"]["blocks_used"] - (n - 1) * shared_blocks
    held = totals["prefix"]["blocks_used"]
    return ["", f"{n} requests sharing a {recs[0]['document_tokens']}-token prompt prefix "
            f"({recs[1]['reused']} tokens mapped per request), all held: {held} blocks against "
            f"{ideal} for one copy plus the private tails ({held / ideal:.3f}x); pool pages "
            f"{totals['prefix']['pool_used_bytes'] / 2**20:.1f} MiB against "
            f"{totals['plain']['pool_used_bytes'] / 2**20:.1f} MiB unshared."]


def study_docshare(args):
    """The product's headline figure: questions over one ~4k-token document asked at once
    (every sequence held until all have answered), under (a) no sharing, full cache; (b)
    prefix sharing, full cache; (c) per-request compression; (d) one shared compressed
    document and uncompressed questions; plus (d') each request compressing the document
    itself, whose answers must be (d)'s to the token. Pool bytes held with every sequence
    alive (the daemon's own count), sequences per GiB at that size, time to first token, and
    the answers against the full cache's (exact, word F1). One fresh daemon per row."""
    small = args.small
    doc_tokens = 300 if small else 4000
    questions = DOC_QUESTIONS[:2] if small else DOC_QUESTIONS
    max_tokens = 8 if small else 24
    snap = (("budget", 64 if small else 1024),)
    conf = (("c_high", 48 if small else 512), ("c_low", 96 if small else 1024))
    runs = [("(a) no sharing", "plain", "full", ()),
            ("(b) prefix sharing", "prefix", "full", ())]
    for policy, params in (("snapkv", snap), ("confkv", conf), ("refreekv", ())):
        runs.append((f"(c) per request, {policy}", "compress", policy, params))
    for policy, params in (("snapkv", snap), ("confkv", conf), ("refreekv", ())):
        runs.append((f"(d) shared document, {policy}", "document", policy, params))
    runs.append(("(d') document per request, snapkv", "private_document", "snapkv", snap))
    model = model_path()
    start = time.time()
    results = []
    for i, (label, mode, policy, params) in enumerate(runs):
        progress(i, len(runs), start, label)
        daemon = Daemon()
        try:
            results.append((label, mode, policy, params,
                            *docqa(model, daemon, mode, questions, doc_tokens, max_tokens, policy,
                                   params)))
        finally:
            daemon.close()
    full = [r["answer"] for r in results[0][4]]
    by_label = {label: recs for label, _, _, _, recs, _ in results}
    same_as_shared = [a["answer"] for a in by_label["(d') document per request, snapkv"]] == \
        [a["answer"] for a in by_label["(d) shared document, snapkv"]]
    tag = "small" if small else "full"
    n = len(questions)
    lines = [f"#### Sequences per GiB at equal answer quality: {n} questions over one "
             f"{results[0][4][0]['document_tokens']}-token document ({tag})",
             f"Command: `python3 bench/eval/eval.py docshare{' --small' if small else ''}`; took "
             f"{time.time() - start:.0f} s ({time.strftime('%Y-%m-%d')}), this machine, one fresh "
             f"kvmemd per row. Lee corpus, its first {doc_tokens} tokens in the user turn, then "
             f"`Question: ...`; greedy answers of up to {max_tokens} tokens. Pool bytes: the "
             "daemon's pages in use with every request's sequence held (after all answered). "
             "Time to first token: request 1 (cold) and the median of the others. Accuracy: "
             "answers identical to the full cache's, and mean word F1 against them. "
             "snapkv budget " + str(snap[0][1]) + f", confkv C_high/C_low {conf[0][1]}/"
             f"{conf[1][1]}, refreekv its own share.", "",
             "| configuration | pool bytes held | sequences per GiB | TTFT first / others (ms) "
             "| same answer as full | word F1 |", "|---|---|---|---|---|---|"]
    for label, mode, policy, params, recs, total in results:
        pool = total["pool_used_bytes"]
        ttft = sorted(r["ttft_ms"] for r in recs[1:]) or [recs[0]["ttft_ms"]]
        same = sum(r["answer"] == f for r, f in zip(recs, full))
        f1 = sum(word_f1(r["answer"], f) for r, f in zip(recs, full)) / n
        lines.append(f"| {label} | {pool / 2**20:.1f} MiB | {n * 2**30 / pool:.0f} "
                     f"| {recs[0]['ttft_ms']:.0f} / {ttft[len(ttft) // 2]:.0f} | {same}/{n} "
                     f"| {f1:.2f} |")
    lines += ["", f"(d') and (d) snapkv answers identical: {'yes' if same_as_shared else 'NO'}.",
              "", "| question | full cache's answer |", "|---|---|"]
    for q, a in zip(questions, full):
        lines.append(f"| {q} | {a.strip().replace('|', '/')} |")
    lines += sharers_table(model, small)
    write_table(f"docshare-{tag}", lines)
    points = []
    for label, mode, policy, params, recs, total in results:
        f1 = sum(word_f1(r["answer"], f) for r, f in zip(recs, full)) / n
        points.append((label, n * 2**30 / total["pool_used_bytes"], f1))
    scatter(points, "sequences per GiB of pool", "word F1 against the full cache's answers",
            f"{n} questions over one document", OUT / f"docshare-{tag}.png", xlog=True)
    return results, same_as_shared


def study_kvpress(args):
    import kvpress_study  # torch, transformers and kvpress: only this study needs them
    return kvpress_study.study_kvpress(
        args, model_path=model_path, daemon_class=Daemon, retrieval_prompts=retrieval_prompts,
        corpus_path=corpus_path, prompts=prompts, write_table=write_table, progress=progress)


def study_all(args):
    """Every study in turn, each at the size its table in RESULTS.md was run at."""
    for name, tokens in (("quanterr", 2048), ("quant", 2048), ("kl", 1000), ("ppl", 4096),
                         ("speed", 0), ("retrieval", 0), ("refreekv", 0), ("infokv", 0),
                         ("devicestep", 1024), ("f16", 1024), ("docshare", 0), ("mass", 1024)):
        sub = argparse.Namespace(**vars(args))
        if tokens and not args.small:
            sub.tokens = tokens
        print(f"== {name}", file=sys.stderr, flush=True)
        STUDIES[name](sub)


STUDIES = {"ppl": study_ppl, "quant": study_quant, "quanterr": study_quanterr, "kl": study_kl,
           "speed": study_speed, "retrieval": study_retrieval, "refreekv": study_refreekv,
           "infokv": study_infokv, "devicestep": study_devicestep, "f16": study_f16,
           "wire": study_wire, "docshare": study_docshare, "mass": study_mass,
           "kvpress": study_kvpress, "all": study_all}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("study", choices=sorted(STUDIES))
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--small", action="store_true", help="a short run that keeps the harness working")
    ap.add_argument("--only", default="", help="comma-separated run names (ppl)")
    ap.add_argument("--contexts", default="", help="comma-separated prompt lengths (speed, wire)")
    args = ap.parse_args()
    if args.small:
        args.tokens = min(args.tokens, 160)
    STUDIES[args.study](args)


if __name__ == "__main__":
    main()
