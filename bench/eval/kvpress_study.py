"""Study `kvpress`: kvmem's policies through the transformers cache (kvmem.transformers)
against NVIDIA kvpress's presses on the same model (SmolLM2-135M-Instruct, loaded in
transformers from the worker's GGUF file, float32), prompts and kept fraction.

  kvmem streaming_llm  vs StreamingLLMPress      (4 sinks)
  kvmem snapkv         vs SnapKVPress            (window 32, pooling kernel 5)
  kvmem pyramidkv      vs PyramidKVPress         (window 32, kernel 5, beta 20)
  kvmem h2o            vs ObservedAttentionPress (prompt attention; eager attention)

Kept fraction f in {25 %, 50 %} of the prompt: kvpress's compression_ratio = 1 - f; kvmem's
snapkv and pyramidkv get ratio = f, streaming_llm and h2o budget = round(f * n) per prompt.
Retrieval: the passkey and needle prompts of the retrieval study (bench/eval/prompts.py),
greedy 10 tokens after the assistant prefix, correct = the first number is the key.
Perplexity: Lee corpus windows, a context compressed at prefill, then the continuation's
tokens scored one pass each (teacher forcing) over the compressed context.
Speed: ms per generated token (decode only, prompt excluded) for DynamicCache, the kvmem
cache and kvpress at 50 % with snapkv, interleaved in one run.

Needs torch, transformers (kvpress pins < 5.3) and kvpress from PyPI; run through
`python3 bench/eval/eval.py kvpress` (or with --small).
"""
import os
import statistics
import time

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TQDM_DISABLE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402
from kvpress import (ObservedAttentionPress, PyramidKVPress, SnapKVPress,  # noqa: E402
                     StreamingLLMPress)

import kvmem  # noqa: E402
from kvmem.transformers import KvmemCache  # noqa: E402

PAIRS = [  # (kvmem policy, kvpress press, its attention implementation)
    ("streaming_llm", lambda r: StreamingLLMPress(compression_ratio=r, n_sink=4), "sdpa"),
    ("snapkv", lambda r: SnapKVPress(compression_ratio=r, window_size=32, kernel_size=5), "sdpa"),
    ("pyramidkv", lambda r: PyramidKVPress(compression_ratio=r, window_size=32, kernel_size=5,
                                           beta=20), "sdpa"),
    ("h2o", lambda r: ObservedAttentionPress(compression_ratio=r), "eager"),
]
PRESS_NAMES = {"streaming_llm": "StreamingLLMPress", "snapkv": "SnapKVPress",
               "pyramidkv": "PyramidKVPress", "h2o": "ObservedAttentionPress"}
FRACTIONS = (0.25, 0.5)


def kvmem_policy(name, fraction, n):
    if name == "full":
        return kvmem.PolicySpec("full")
    if name in ("snapkv", "pyramidkv"):
        return kvmem.PolicySpec(name, {"ratio": fraction})
    params = {"budget": max(8, round(fraction * n))}
    if name == "streaming_llm":
        params["sinks"] = 4
    return kvmem.PolicySpec(name, params)


def load(gguf):
    transformers.logging.set_verbosity_error()
    where, name = os.path.dirname(gguf), os.path.basename(gguf)
    model = transformers.AutoModelForCausalLM.from_pretrained(where, gguf_file=name,
                                                              dtype=torch.float32).eval()
    return model, transformers.AutoTokenizer.from_pretrained(where, gguf_file=name)


class Runner:
    """One prefill under a method, then greedy or teacher-forced passes. Methods: ("full",),
    ("kvmem", policy, fraction), ("kvpress", policy, fraction)."""

    def __init__(self, model, client):
        self.model, self.client = model, client

    def _cache(self, method, n):
        if method[0] == "kvmem":
            return KvmemCache(self.model, self.client, kvmem_policy(method[1], method[2], n))
        self.model.set_attn_implementation(
            "eager" if method[0] == "kvpress" and method[1] == "h2o" else "sdpa")
        return transformers.DynamicCache(config=self.model.config)

    def _prefill(self, method, cache, ids):
        if method[0] != "kvpress":
            return self.model(ids, past_key_values=cache, use_cache=True)
        pair = next(p for p in PAIRS if p[0] == method[1])
        with pair[1](1 - method[2])(self.model):
            return self.model(ids, past_key_values=cache, use_cache=True,
                              output_attentions=pair[2] == "eager")

    @staticmethod
    def _kv_tokens(cache):
        """Mean tokens held per stream."""
        if isinstance(cache, KvmemCache):
            m = cache.memory()
            return m.kv_bytes / (2 * cache.layout.streams * cache.layout.head_dim * 4)
        return sum(layer.keys.shape[-2] for layer in cache.layers) / len(cache.layers)

    def generate(self, method, ids, steps, timed=False):
        """(new token ids, mean tokens held per stream after the prompt, decode seconds)."""
        cache = self._cache(method, ids.shape[1])
        try:
            with torch.no_grad():
                out = self._prefill(method, cache, ids)
                held = self._kv_tokens(cache)
                if method[0] != "kvmem":
                    self.model.set_attn_implementation("sdpa")
                tokens = []
                start = time.perf_counter()
                for i in range(steps):
                    tokens.append(int(out.logits[0, -1].argmax()))
                    out = self._step(cache, tokens[-1], ids.shape[1] + i)
                seconds = time.perf_counter() - start
        finally:
            if isinstance(cache, KvmemCache):
                cache.close()
        return tokens, held, seconds

    def _step(self, cache, token, position):
        """One token at its original position: a compressed DynamicCache is shorter than the
        sequence, so RoPE needs the position given (kvpress's pipeline does the same)."""
        return self.model(torch.tensor([[token]]), past_key_values=cache, use_cache=True,
                          position_ids=torch.tensor([[position]]))

    def nll(self, method, context, continuation):
        """Mean negative log-likelihood of `continuation`, token by token after the
        compressed `context` (one token a pass: PyramidKV's layers differ in length, which a
        multi-token pass over a DynamicCache cannot mask)."""
        cache = self._cache(method, context.shape[1])
        total = 0.0
        try:
            with torch.no_grad():
                out = self._prefill(method, cache, context)
                if method[0] != "kvmem":
                    self.model.set_attn_implementation("sdpa")
                for i in range(continuation.shape[1]):
                    logp = torch.log_softmax(out.logits[0, -1].float(), -1)
                    total -= float(logp[continuation[0, i]])
                    if i + 1 < continuation.shape[1]:
                        out = self._step(cache, int(continuation[0, i]), context.shape[1] + i)
        finally:
            if isinstance(cache, KvmemCache):
                cache.close()
        return total / continuation.shape[1]


def label(method):
    if method[0] == "full":
        return "full (DynamicCache)"
    name = method[1] if method[0] == "kvmem" else PRESS_NAMES[method[1]]
    return f"{method[0]} {name} {int(100 * method[2])} %"


def methods():
    out = [("full",)]
    for fraction in FRACTIONS:
        for name, _, _ in PAIRS:
            out += [("kvmem", name, fraction), ("kvpress", name, fraction)]
    return out


def chat_ids(tokenizer, prompt):
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt["text"]}],
                                         add_generation_prompt=True, tokenize=False)
    return tokenizer(text + prompt["prefix"], return_tensors="pt",
                     add_special_tokens=False).input_ids


def study_kvpress(args, *, model_path, daemon_class, retrieval_prompts, corpus_path, prompts,
                  write_table, progress):
    """The study (eval.py hands in its helpers)."""
    start = time.time()
    tag = "small" if args.small else "full"
    model, tokenizer = load(model_path())
    daemon = daemon_class()
    try:
        with kvmem.Client(f"unix:{daemon.sock}") as client:
            runner = Runner(model, client)
            grid, lengths, _, _ = retrieval_prompts(args)
            if not args.small:
                grid = [p for p in grid if p["length"] <= 2000 and p["sample"] < 2]
            lengths = sorted({p["length"] for p in grid})
            if args.only == "speed":
                return _speed_only(args, runner, tokenizer, grid, write_table, start)
            all_methods = methods()
            correct = {label(m): [] for m in all_methods}
            held = {label(m): [] for m in all_methods}
            runs, done = len(grid) * len(all_methods), 0
            t0 = time.time()
            for p in grid:
                ids = chat_ids(tokenizer, p)
                for m in all_methods:
                    tokens, kv, _ = runner.generate(m, ids, 10)
                    answer = tokenizer.decode(tokens, skip_special_tokens=True)
                    correct[label(m)].append(prompts.correct(p, answer))
                    held[label(m)].append(kv / ids.shape[1])
                    done += 1
                    progress(done, runs, t0, "kvpress retrieval")
            # Perplexity over Lee corpus windows.
            corpus = corpus_path().read_text()
            all_ids = tokenizer(corpus, return_tensors="pt").input_ids
            ctx, cont = (256, 32) if args.small else (1024, 128)
            windows = 1 if args.small else 2
            nll = {label(m): [] for m in all_methods}
            for w in range(windows):
                at = w * (ctx + cont)
                context = all_ids[:, at:at + ctx]
                continuation = all_ids[:, at + ctx:at + ctx + cont]
                for m in all_methods:
                    nll[label(m)].append(runner.nll(m, context, continuation))
            speed_ids, steps, seconds = _speed(args, runner, tokenizer, grid)
    finally:
        daemon.close()

    mean = statistics.fmean
    lines = [f"### kvmem's transformers cache against kvpress ({tag})",
             f"Command: `python3 bench/eval/eval.py kvpress{' --small' if args.small else ''}`; "
             f"SmolLM2-135M-Instruct in transformers {transformers.__version__} (float32, from "
             f"the worker's GGUF file), kvpress {_version('kvpress')}, CPU (2 vCPU); "
             f"{time.strftime('%Y-%m-%d')}, this run {time.time() - start:.0f} s. Retrieval: "
             f"{len(grid)} passkey/needle prompts of {lengths} tokens, greedy 10 tokens. "
             f"Perplexity: {windows} Lee-corpus windows, {ctx} context tokens compressed at "
             f"prefill, then {cont} continuation tokens scored one pass each (kvmem's "
             "streaming_llm and h2o keep evicting to their budget; snapkv, pyramidkv and "
             "every press compress the prompt only). Held: mean tokens "
             "per stream after the prompt over its length.", "",
             "| method | retrieval | held | perplexity |", "|---|---|---|---|"]
    for m in all_methods:
        k = label(m)
        lines.append(f"| {k} | {100 * mean(correct[k]):.0f} % | {100 * mean(held[k]):.0f} % "
                     f"| {2.718281828 ** mean(nll[k]):.2f} |")
    lines += [""] + _speed_lines(speed_ids, steps, seconds)
    return write_table(f"kvpress-{tag}", lines)


TIMED = {"DynamicCache": ("full",), "kvmem cache, full": ("kvmem", "full", 1.0),
         "kvmem cache, snapkv 50 %": ("kvmem", "snapkv", 0.5),
         "kvpress SnapKVPress 50 %": ("kvpress", "snapkv", 0.5)}


def _speed(args, runner, tokenizer, grid):
    """Decode-only seconds per token of each TIMED cache, interleaved, 3 runs each."""
    speed_ids = chat_ids(tokenizer, max(grid, key=lambda p: p["length"]))
    steps = 8 if args.small else 32
    seconds = {k: [] for k in TIMED}
    for _ in range(3):
        for k, m in TIMED.items():
            seconds[k].append(runner.generate(m, speed_ids, steps)[2] / steps)
    return speed_ids, steps, seconds


def _speed_lines(speed_ids, steps, seconds):
    lines = [f"Time per generated token (decode only, {speed_ids.shape[1]}-token prompt, "
             f"{steps} tokens, median of 3 interleaved runs):", "",
             "| cache | ms per token | vs DynamicCache |", "|---|---|---|"]
    base = statistics.median(seconds["DynamicCache"])
    for k, runs in seconds.items():
        ms = statistics.median(runs)
        lines.append(f"| {k} | {1e3 * ms:.1f} | {ms / base:.2f}x |")
    return lines


def _speed_only(args, runner, tokenizer, grid, write_table, start):
    speed_ids, steps, seconds = _speed(args, runner, tokenizer, grid)
    tag = "small" if args.small else "full"
    lines = [f"### kvmem's transformers cache: time per token ({tag})",
             f"Command: `python3 bench/eval/eval.py kvpress --only speed"
             f"{' --small' if args.small else ''}`; SmolLM2-135M-Instruct in transformers "
             f"{transformers.__version__} (float32), kvpress {_version('kvpress')}, CPU (2 vCPU); "
             f"{time.strftime('%Y-%m-%d')}, this run {time.time() - start:.0f} s.", ""]
    return write_table(f"kvpress-speed-{tag}", lines + _speed_lines(speed_ids, steps, seconds))


def _version(package):
    from importlib.metadata import version
    return version(package)
