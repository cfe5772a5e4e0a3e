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
    run("kl", tmp_path)
    table = (tmp_path / "kl-small.md").read_text()
    r = float(table.strip().splitlines()[-1].split("|")[2])
    assert -1.0 <= r <= 1.0


def test_small_speed_study(tmp_path):
    run("speed", tmp_path)
    lines = [l for l in (tmp_path / "speed-small.md").read_text().splitlines() if l.startswith("| 1") or l.startswith("| 2")]
    assert len(lines) == 6
    for line in lines:
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert float(cells[2]) > 0 and float(cells[3]) > 0 and float(cells[4]) > 0
