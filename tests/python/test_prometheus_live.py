"""A real Prometheus (Debian's `prometheus`) scrapes kvmemd every second while the reference
worker runs real policies on SmolLM2; then every panel's PromQL in the Grafana dashboard is
evaluated through Prometheus's HTTP API and must return data, the alert and recording rules
load, and `promtool check metrics` finds nothing to say about kvmemd's /metrics."""
import json
import os
import pathlib
import shutil
import subprocess
import time
import urllib.parse
import urllib.request

import pytest

from test_dashboard_rules import (BIN, RULES, data_panels, free_port, load_dashboard, stop,
                                  substitute)


def http_json(url):
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read().decode())


def wait_for(check, seconds, what):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except OSError:
            pass
        time.sleep(0.25)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def stack(tmp_path):
    prometheus = shutil.which("prometheus")
    model = os.environ.get("KVMEM_MODEL")
    if prometheus is None:
        pytest.skip("prometheus not installed (scripts/deps.sh installs it)")
    if not model or not (BIN / "kvmem_worker").exists():
        pytest.skip("needs KVMEM_MODEL and the built worker (scripts/test.sh sets both)")
    procs = []
    sock = f"/tmp/kvmem-live-{os.getpid()}.sock"
    metrics_port, web_port = free_port(), free_port()
    # Identities by the unix peer's uid (this process and its workers: an admin, no token
    # to send), so that a tenant arena can be cut (its panel has data): 64 pages of 256 KiB.
    tokens = tmp_path / "tokens"
    tokens.write_text(f"ops uid:{os.getuid()} admin\n")
    kvmemd = subprocess.Popen([str(BIN / "kvmemd"), f"--listen=unix:{sock}",
                               f"--metrics-listen=127.0.0.1:{metrics_port}",
                               "--pool-bytes=536870912", "--page-bytes=262144",
                               f"--auth-tokens={tokens}", "--tenant-arena=guest:16777216"],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    procs.append(kvmemd)
    try:
        assert kvmemd.stdout.readline().startswith("READY")
        config = tmp_path / "prometheus.yml"
        config.write_text(
            "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
            f"rule_files: ['{RULES}']\n"
            "scrape_configs:\n"
            "  - job_name: kvmemd\n"
            f"    static_configs: [{{targets: ['127.0.0.1:{metrics_port}']}}]\n")
        prom = subprocess.Popen([prometheus, f"--config.file={config}",
                                 f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                                 f"--web.listen-address=127.0.0.1:{web_port}"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        procs.append(prom)
        api = f"http://127.0.0.1:{web_port}/api/v1"
        wait_for(lambda: any(t["health"] == "up"
                             for t in http_json(f"{api}/targets")["data"]["activeTargets"]),
                 60, "Prometheus to scrape kvmemd")
        yield {"sock": sock, "model": model, "api": api, "metrics_port": metrics_port}
    finally:
        for p in reversed(procs):
            stop(p)
        pathlib.Path(sock).unlink(missing_ok=True)


def worker(stack, *args, check=True):
    return subprocess.run([str(BIN / "kvmem_worker"), "generate", f"--model={stack['model']}",
                           f"--target=unix:{stack['sock']}", "--max_tokens=24", *args],
                          capture_output=True, text=True, timeout=300, check=check)


def query(api, expr):
    url = f"{api}/query?" + urllib.parse.urlencode({"query": expr})
    return http_json(url)


def test_every_dashboard_panel_has_data_from_a_live_daemon(stack):
    prompt = ("The lighthouse keeper climbed the stairs every evening at dusk to light the "
              "lamp, and every morning he wrote the weather in a book.")
    # confkv with int8 storage beyond the newest 16 tokens: attention rows, confidence,
    # evictions, quantization; full twice with the prompt: a prefix miss, then a hit.
    worker(stack, "--policy=confkv", "--param=c_high=32,c_low=48,protect=8",
           "--quantization=int8", "--quant_recent=16", f"--prompt={prompt}")
    worker(stack, "--policy=h2o", "--param=budget=32", f"--prompt={prompt}")
    for _ in range(2):
        worker(stack, "--policy=full", "--prefix_cache", f"--prompt={prompt}")
    # A request the daemon refuses (INVALID_ARGUMENT): the error panels have a series.
    assert worker(stack, "--policy=h2o", "--param=budget=0", check=False).returncode != 0
    time.sleep(4)  # a few scrapes after the last call

    dashboard = load_dashboard()
    empty = []
    for panel in data_panels(dashboard):
        for target in panel.get("targets", []):
            expr = substitute(target["expr"], dashboard)
            answer = query(stack["api"], expr)
            assert answer["status"] == "success", (panel["title"], expr, answer)
            if not answer["data"]["result"]:
                empty.append(f'{panel["title"]} ({target.get("refId")}): {expr}')
    checked = sum(len(p.get("targets", [])) for p in data_panels(dashboard))
    assert checked >= 30, checked
    assert not empty, "panels without data:\n" + "\n".join(empty)

    rules = http_json(f"{stack['api']}/rules")["data"]["groups"]
    assert rules and all(r["health"] == "ok" for g in rules for r in g["rules"]), rules

    # The counters Prometheus holds are the daemon's own (tokens appended: four prompts and
    # their answers; exact figures are the C++ metrics test's).
    appended = query(stack["api"], "sum(kvmem_tokens_appended_total)")["data"]["result"]
    assert float(appended[0]["value"][1]) > 4 * 20

    with urllib.request.urlopen(f"http://127.0.0.1:{stack['metrics_port']}/metrics") as r:
        text = r.read()
    lint = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True)
    assert lint.returncode == 0 and not lint.stdout.strip() and not lint.stderr.strip(), \
        lint.stdout + lint.stderr
