"""The small version of the evaluation harness: keeps bench/eval/eval.py working end to end
(corpus from gensim's wheel, kvmemd, the worker, tables), on a few hundred tokens."""
import argparse
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench" / "eval"))
import prompts  # noqa: E402


def run(study, tmp_path, *extra):
    env = dict(os.environ, KVMEM_EVAL_OUT=str(tmp_path))
    subprocess.run([sys.executable, str(ROOT / "bench" / "eval" / "eval.py"), study, "--small", *extra],
                   check=True, env=env, capture_output=True, text=True)


def rows(path):
    out = {}
    for line in path.read_text().splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) >= 3 and cells[1].replace(".", "", 1).isdigit():
            out[cells[0]] = float(cells[1])
    return out


def test_small_perplexity_study(tmp_path):
    run("ppl", tmp_path, "--only", "full,window-64,streaming_llm-64,pyramid-64,confkv,random")
    r = rows(tmp_path / "ppl-small.md")
    assert set(r) == {"full", "window-64", "streaming_llm-64", "pyramid-64", "confkv", "random"}
    assert 5 < r["full"] < 200
    # A 64-token window loses context the full cache keeps.
    assert r["window-64"] > r["full"]


def test_small_quantization_study(tmp_path):
    run("quant", tmp_path)
    r = rows(tmp_path / "quant-small.md")
    assert set(r) == {"none", "int8", "int4", "nf4"}
    # int8 barely moves perplexity; int4 moves it more.
    assert abs(r["int8"] - r["none"]) < 0.05 * r["none"]
    assert abs(r["int4"] - r["none"]) >= abs(r["int8"] - r["none"])


def test_quantization_error_on_real_kv(tmp_path):
    run("quanterr", tmp_path)
    err = {}
    for line in (tmp_path / "quant-error-small.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[0] in ("int8", "int4", "nf4"):
            err[cells[0]] = float(cells[1].rstrip(" %"))
    # int8 keeps K within about half a percent; 4-bit codes are an order of magnitude coarser.
    assert 0 < err["int8"] < 1.0
    assert err["int4"] > 5 * err["int8"] and err["nf4"] > 5 * err["int8"]


def test_kl_study_measures_what_it_says(tmp_path):
    # Dropping nothing gives the same distribution: KL exactly 0.
    model = subprocess.run(["bash", str(ROOT / "scripts" / "fetch_model.sh")], check=True,
                           capture_output=True, text=True).stdout.strip()
    text = tmp_path / "t.txt"
    text.write_text("The river rose through the night, and by morning the town had moved to the hill. " * 8)
    out = subprocess.run([str(ROOT / "build" / "kvmem_worker"), "kl", f"--model={model}",
                          f"--text={text}", "--kl_warmup=40", "--kl_drop=0", "--max_eval_tokens=4"],
                         check=True, capture_output=True, text=True).stdout.split("\n")
    assert all(float(line.split()[4]) == 0.0 for line in out if line)
    # The study end to end: both rows, 64 steps each. Its Pearson r is checked against numpy on
    # known data in test_kl_study_pearson_r_matches_numpy (no model needed there).
    run("kl", tmp_path)
    table = (tmp_path / "kl-small.md").read_text()
    lines = table.strip().splitlines()[-2:]
    assert [line.split("|")[1].strip() for line in lines] == [
        "the newest 256", "the 256 before the newest 32"]
    assert [int(line.split("|")[2]) for line in lines] == [64, 64]


def load_eval():
    spec = importlib.util.spec_from_file_location("kvmem_eval", ROOT / "bench" / "eval" / "eval.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def kl_study_on(monkeypatch, worker_lines):
    """Runs eval.py's kl study with the worker replaced by `worker_lines(keep)`, rows of
    (entropy, p1, p2, kl) for --kl_keep_recent=keep; returns the module, the r the study
    returns and the two r cells of its table."""
    ev = load_eval()
    tables = {}

    def fake_run(argv, **kwargs):
        keep = int(next(a for a in argv if a.startswith("--kl_keep_recent=")).split("=")[1])
        out = "".join(f"{i} {' '.join(repr(float(x)) for x in row)}\n"
                      for i, row in enumerate(worker_lines(keep)))
        return subprocess.CompletedProcess(argv, 0, stdout=out)

    monkeypatch.setattr(ev, "corpus_path", lambda: "corpus.txt")
    monkeypatch.setattr(ev, "model_path", lambda: "model.gguf")
    monkeypatch.setattr(ev, "pyplot", lambda: None)
    monkeypatch.setattr(ev, "write_table", lambda name, lines: tables.__setitem__(name, lines))
    monkeypatch.setattr(ev.subprocess, "run", fake_run)
    r = ev.study_kl(argparse.Namespace(small=True, tokens=160))
    rows = [line for line in tables["kl-small"] if line.startswith("| the ")]
    assert len(rows) == 2
    return ev, r, [float(line.split("|")[3]) for line in rows]


def test_kl_study_pearson_r_matches_numpy(monkeypatch):
    """The kl study's Pearson r against numpy.corrcoef on the same data, and on data whose r is
    +1 or -1 by construction (a wrong formula can still land in [-1, 1])."""
    rng = np.random.default_rng(7)
    n = 200
    h = rng.uniform(0.0, 8.0, n)
    p1 = rng.uniform(0.2, 0.9, n)
    p2 = p1 * rng.uniform(0.05, 0.95, n)
    # CONF-KV's confidence c_t as ALGORITHMS.md defines it (default weights, V = 49152).
    c = 0.4 * (1 - h / math.log(49152)) + 0.3 * (1 - p2 / p1) + 0.3 * p1

    # KL exactly linear in c: r = +1 and -1 whatever the scale and offset.
    exact = {0: 3.0 * c + 0.25, 32: 7.0 - 2.0 * c}
    ev, r, cells = kl_study_on(monkeypatch, lambda keep: zip(h, p1, p2, exact[keep]))
    assert [ev.confidence(*x) for x in zip(h, p1, p2)] == pytest.approx(c, abs=1e-12)
    assert r == pytest.approx(1.0, abs=1e-12)
    assert cells == [1.0, -1.0]

    # Noisy data: the r numpy computes from the same arrays, in the return value and the table.
    noisy = {0: 0.5 - 0.8 * c + rng.normal(0.0, 0.05, n),  # clearly negative, |r| < 1
             32: rng.exponential(1.0, n)}                    # unrelated to c, r near 0
    _, r, cells = kl_study_on(monkeypatch, lambda keep: zip(h, p1, p2, noisy[keep]))
    want = [np.corrcoef(c, noisy[keep])[0, 1] for keep in (0, 32)]
    assert -0.99 < want[0] < -0.5 and abs(want[1]) < 0.3  # the data are what they are meant to be
    assert r == pytest.approx(want[0], abs=1e-9)
    assert cells == [round(w, 3) for w in want]


def test_small_speed_study(tmp_path):
    run("speed", tmp_path)
    lines = [l for l in (tmp_path / "speed-small.md").read_text().splitlines() if l.startswith("| 1") or l.startswith("| 2")]
    assert len(lines) == 8
    for line in lines:
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert float(cells[2]) > 0 and float(cells[3]) > 0
        mean, median, first = (float(x) for x in cells[4].split("/"))
        assert mean > 0 and median > 0 and first > 0


def test_prompt_builders():
    p = prompts.passkey(1000, 0.5, 3)
    key = p["answer"]
    assert p["text"].count(key) == 2 and len(key) == 5
    # The needle sits near the middle of the filler.
    at = p["text"].index(key) / len(p["text"])
    assert 0.4 < at < 0.6
    assert prompts.passkey(1000, 0.5, 3) == p  # deterministic per sample
    assert prompts.correct(p, f" {key}. It") and not prompts.correct(p, " 12345.")
    corpus = "First sentence here. " * 2000
    n = prompts.needle(2000, 0.1, 1, corpus)
    assert n["answer"] in n["text"] and n["text"].index(n["answer"]) < 0.2 * len(n["text"])
    assert prompts.rouge_l("the cat sat on the mat", "the cat sat on the mat") == 1.0
    assert prompts.rouge_l("a b c", "x y z") == 0.0
    assert 0 < prompts.rouge_l("the cat sat", "the dog sat") < 1


def test_small_retrieval_refreekv_and_infokv_studies(tmp_path):
    run("retrieval", tmp_path)
    runs = [json.loads(line) for line in (tmp_path / "retrieval-small.jsonl").read_text().splitlines()]
    assert len(runs) == 8
    for r in runs:
        assert 0.9 * r["length"] <= r["results"]["full"]["prompt_tokens"] <= r["length"] + 60
        full = r["results"]["full"]
        assert full["kv_bytes_prompt"] == full["kv_bytes_full"] and full["evicted"] == 0
        # A 20 % prefill budget keeps about a fifth (the recent window on top).
        share = r["results"]["infokv-20%"]["kv_bytes_prompt"] / full["kv_bytes_full"]
        assert 0.15 < share < 0.35
    table = (tmp_path / "retrieval-small.md").read_text()
    for name in ("full", "window-512", "h2o-512", "snapkv-512", "confkv", "refreekv", "infokv-40%"):
        assert f"| {name} |" in table
    # The full cache finds the key in short prompts: the ceiling the others are measured by.
    full_acc = sum(prompts.correct(r, r["results"]["full"]["answer"]) for r in runs) / len(runs)
    assert full_acc >= 0.5
    run("refreekv", tmp_path)
    table = (tmp_path / "refreekv-small.md").read_text()
    assert "| passkey |" in table and "| summary |" in table and "| arith |" in table
    run("infokv", tmp_path)
    kv = {}
    for line in (tmp_path / "infokv-small.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 4 and cells[3].endswith("MiB"):
            kv[cells[0]] = float(cells[3].split()[0])
    assert kv["infokv 12.5 %"] < kv["infokv 25 %"] < kv["full"]


def test_small_device_step_study(tmp_path):
    run("devicestep", tmp_path)
    table = (tmp_path / "devicestep-small.md").read_text()
    lines = [l for l in table.splitlines() if l.startswith("| conf") or l.startswith("| h2o")]
    assert len(lines) == 5
    # Every policy gives the same perplexity, bytes and evictions both ways, and evicts.
    for line in lines:
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[-1] == "yes", line
        assert int(cells[5].split("/")[0]) > 0, line


def test_small_f16_study(tmp_path):
    """Attention rows as halves (kvmem_worker --attention_f16) against f32: both runs evict
    and score, and halves (~3 significant digits) move perplexity by well under 1 %."""
    run("f16", tmp_path)
    rows = {}
    for line in (tmp_path / "f16-small.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 6 and cells[0] in ("confkv", "h2o"):
            rows[cells[0]] = cells
    assert set(rows) == {"confkv", "h2o"}
    for cells in rows.values():
        ppl32, ppl16 = (float(x) for x in cells[2].split(" / "))
        evicted32, evicted16 = (int(x) for x in cells[4].split(" / "))
        assert 5 < ppl32 < 200 and evicted32 > 0 and evicted16 > 0
        assert abs(ppl16 - ppl32) / ppl32 < 0.01
        assert float(cells[3].rstrip(" %")) == pytest.approx(100 * (ppl16 - ppl32) / ppl32, abs=1e-3)


def test_small_docshare_study(tmp_path):
    """Questions over one document: prefix sharing answers as the unshared full cache does
    and holds fewer pool bytes; a shared compressed document holds fewer than per-request
    compression, answers exactly as compressing the document per request, and later requests
    skip the prefill; shared prefix blocks are held once (1.000x one copy plus tails)."""
    run("docshare", tmp_path)
    table = (tmp_path / "docshare-small.md").read_text()
    rows = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 6 and cells[0].startswith("("):
            rows[cells[0]] = {"pool": float(cells[1].split()[0]),
                              "ttft": [float(x) for x in cells[3].split(" / ")],
                              "same": cells[4]}
    assert len(rows) == 9
    plain, prefix = rows["(a) no sharing"], rows["(b) prefix sharing"]
    assert prefix["same"] == plain["same"] == "2/2"
    assert prefix["pool"] < plain["pool"]
    assert prefix["ttft"][1] < prefix["ttft"][0] / 2
    shared, own = rows["(d) shared document, snapkv"], rows["(c) per request, snapkv"]
    assert shared["pool"] < own["pool"]
    assert shared["ttft"][1] < shared["ttft"][0] / 2
    assert "(d') and (d) snapkv answers identical: yes." in table
    assert "(1.000x)" in table


def test_small_mass_study(tmp_path):
    """kvmemd's evicted attention mass (read from /metrics) on the real model: measured on
    every step of an evicting run, never for the full cache, larger for tighter budgets of
    the same policy, and ranked like the perplexity gap it is meant to warn about."""
    run("mass", tmp_path)
    table = (tmp_path / "mass-small.md").read_text()
    rows = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 6 and cells[1].replace(".", "", 1).isdigit():
            rows[cells[0]] = {"gap": float(cells[2].rstrip(" %")), "mass": float(cells[3]),
                              "steps": float(cells[5])}
    assert rows["full"]["mass"] == 0 and rows["full"]["steps"] == 0
    for policy in ("h2o", "confkv"):
        runs = [rows[f"{policy}-{b}"] for b in (16, 32, 64)]
        assert all(r["steps"] == 160 and r["gap"] > 0 for r in runs)
        assert runs[0]["mass"] > runs[1]["mass"] > runs[2]["mass"] > 0
    rho = float(table.split("Spearman rank correlation of mean evicted mass with the perplexity "
                            "gap ")[1].split(",")[0])
    assert rho > 0.5
