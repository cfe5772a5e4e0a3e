"""The small version of the evaluation harness: keeps bench/eval/eval.py working end to end
(corpus from gensim's wheel, kvmemd, the worker, tables), on a few hundred tokens."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


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
    run("ppl", tmp_path, "--only", "full,window-64,streaming_llm-64,confkv")
    r = rows(tmp_path / "ppl-small.md")
    assert set(r) == {"full", "window-64", "streaming_llm-64", "confkv"}
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
