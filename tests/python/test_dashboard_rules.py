"""deploy/: the Grafana dashboard, the Prometheus config and the alert/recording rules.

- The dashboard JSON parses, selects its data source through a ${datasource} variable that every
  panel and target uses, has job/instance variables, and every panel has PromQL targets.
- Every PromQL expression (dashboard targets with Grafana variables substituted, variable
  queries, rules) passes `promtool check rules` as a recording rule.
- Every metric name those expressions reference is one kvmemd exports: the test starts
  $KVMEM_BIN/kvmemd (default build/kvmemd) with --metrics_listen, drives a little traffic
  (kvmemctl, kvmem_demo) and reads /metrics.
- `promtool check rules`, `promtool test rules` (kvmem.rules.test.yml) and
  `promtool check config` pass.

Tests that need promtool skip without it; the live check skips while kvmemd has no
--metrics_listen flag.
"""
import json
import os
import pathlib
import re
import select
import shutil
import signal
import socket
import subprocess
import time
import urllib.request

import pytest

yaml = pytest.importorskip("yaml")

ROOT = pathlib.Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "kvmem.json"
PROM_DIR = DEPLOY / "prometheus"
RULES = PROM_DIR / "rules" / "kvmem.rules.yml"
RULES_TEST = PROM_DIR / "rules" / "kvmem.rules.test.yml"
BIN = pathlib.Path(os.environ.get("KVMEM_BIN", ROOT / "build"))

ALERTS = {"KvmemPoolNearlyFull", "KvmemReclaimFailing", "KvmemStepLatencyHigh",
          "KvmemEvictedAttentionMassSpike", "KvmemRpcErrorRate", "KvmemBlocksForsaken"}

# Grafana's built-in variables, replaced by values a real query could get.
GRAFANA_BUILTINS = {
    "__rate_interval": "1m", "__interval": "1m", "__interval_ms": "60000",
    "__range": "1h", "__range_s": "3600", "__range_ms": "3600000",
}
# Dashboard variables are used inside regex matchers (=~"$job"); ".+" is what "All" sends.
VARIABLE_VALUE = ".+"

# --------------------------------------------------------------------------- helpers


def promtool():
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool not installed (Debian: apt-get install prometheus)")
    return path


def load_dashboard():
    with open(DASHBOARD, encoding="utf-8") as f:
        return json.load(f)


def all_panels(dashboard):
    """Every panel, rows included, with the panels of collapsed rows."""
    out = []
    for panel in dashboard.get("panels", []):
        out.append(panel)
        out.extend(panel.get("panels", []))
    return out


def data_panels(dashboard):
    return [p for p in all_panels(dashboard) if p.get("type") != "row"]


def variables(dashboard):
    return {v["name"]: v for v in dashboard.get("templating", {}).get("list", [])}


_VAR_RE = re.compile(r"\$\{(\w+)(?::[^}]*)?\}|\[\[(\w+)(?::[^\]]*)?\]\]|\$(\w+)")


def substitute(expr, dashboard):
    """Replaces Grafana variables by concrete values; fails on a variable nobody defines."""
    defined = set(variables(dashboard))

    def repl(m):
        name = m.group(1) or m.group(2) or m.group(3)
        if name in GRAFANA_BUILTINS:
            return GRAFANA_BUILTINS[name]
        assert name in defined, f"undefined Grafana variable ${name} in: {expr}"
        return VARIABLE_VALUE

    return _VAR_RE.sub(repl, expr)


def variable_selector(query):
    """The series selector of a label_values(selector, label) variable query, or None."""
    m = re.fullmatch(r"\s*label_values\((.*),\s*\w+\s*\)\s*", query, re.S)
    return m.group(1) if m else None


def variable_query(var):
    q = var.get("query")
    return q.get("query", "") if isinstance(q, dict) else (q or "")


def dashboard_exprs(dashboard):
    """(where, expr with variables substituted) for every target and every query variable."""
    out = []
    for panel in data_panels(dashboard):
        for target in panel.get("targets", []):
            out.append((f'panel {panel.get("id")} "{panel.get("title")}" {target.get("refId")}',
                        substitute(target.get("expr", ""), dashboard)))
    for name, var in variables(dashboard).items():
        if var.get("type") == "query":
            selector = variable_selector(variable_query(var))
            assert selector, f"variable {name}: not a label_values(selector, label) query"
            out.append((f"variable {name}", substitute(selector, dashboard)))
    return out


def rules_groups():
    with open(RULES, encoding="utf-8") as f:
        return yaml.safe_load(f)["groups"]


def rule_exprs():
    out = []
    for group in rules_groups():
        for rule in group["rules"]:
            out.append((rule.get("alert") or rule.get("record"), rule["expr"]))
    return out


_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or",
             "unless", "offset", "bool", "inf", "nan", "atan2", "start", "end"}


def metric_names(expr):
    """Metric names a PromQL expression selects: identifiers left once strings, label matchers,
    ranges, grouping clauses, function calls and keywords are taken out."""
    s = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`', '""', expr)
    s = re.sub(r"\{[^}]*\}", " ", s)
    s = re.sub(r"\[[^\]]*\]", " ", s)
    # "sum by (a, b) (x)" -> "sum (x)": the aggregation then reads as a call.
    s = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", s)
    names = set()
    for m in re.finditer(r"(?<![\w.])([a-zA-Z_:][\w:]*)(\s*\()?", s):
        ident, call = m.group(1), m.group(2)
        if call or ident.lower() in _KEYWORDS:
            continue
        names.add(ident)
    return names


def check_as_recording_rules(tmp_path, exprs):
    """Runs `promtool check rules` on the expressions as recording rules of one group."""
    rules = [{"record": f"kvmem_dashboard_check:expr_{i}", "expr": expr}
             for i, (_, expr) in enumerate(exprs)]
    path = tmp_path / "exprs.rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "exprs", "rules": rules}]}))
    result = subprocess.run([promtool(), "check", "rules", str(path)], capture_output=True,
                            text=True, timeout=60)
    index = "\n".join(f"  rule {i}: {where}: {expr}" for i, (where, expr) in enumerate(exprs))
    assert result.returncode == 0, (
        f"promtool rejects an expression:\n{result.stdout}{result.stderr}\nrules:\n{index}")


# --------------------------------------------------------------------------- dashboard


def test_dashboard_structure():
    dashboard = load_dashboard()
    assert dashboard.get("uid") and dashboard.get("title")
    assert dashboard.get("schemaVersion", 0) >= 36

    vars_ = variables(dashboard)
    ds = vars_.get("datasource")
    assert ds is not None, "no datasource variable"
    assert ds["type"] == "datasource" and ds["query"] == "prometheus"
    assert "job" in vars_ or "instance" in vars_, "no job or instance variable"
    for name, var in vars_.items():
        if var.get("type") == "query":
            assert var["datasource"]["uid"] in ("${datasource}", "$datasource"), name

    panels = data_panels(dashboard)
    assert len(panels) >= 20
    ids = [p["id"] for p in all_panels(dashboard)]
    assert len(ids) == len(set(ids)), "duplicate panel ids"
    for panel in all_panels(dashboard):
        g = panel["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0, panel["title"]
        if panel.get("type") == "row":
            assert not panel.get("targets"), f'row "{panel["title"]}" has targets'

    uses_job = False
    for panel in panels:
        where = f'panel {panel["id"]} "{panel["title"]}"'
        assert panel["type"] in ("timeseries", "stat", "heatmap", "gauge", "bargauge", "table"), where
        assert panel.get("datasource", {}).get("uid") in ("${datasource}", "$datasource"), (
            f"{where} does not use the ${{datasource}} variable")
        assert panel.get("datasource", {}).get("type") == "prometheus", where
        targets = panel.get("targets", [])
        assert targets, f"{where} has no targets"
        assert len({t["refId"] for t in targets}) == len(targets), f"{where}: duplicate refIds"
        for t in targets:
            assert t.get("expr", "").strip(), f"{where} target {t.get('refId')} has no expr"
            if "datasource" in t:
                assert t["datasource"].get("uid") in ("${datasource}", "$datasource"), where
            uses_job |= "$job" in t["expr"] or "$instance" in t["expr"]
            if panel["type"] == "heatmap":
                assert t.get("format") == "heatmap" and "_bucket" in t["expr"], where
                assert "by (le)" in t["expr"], where
    assert uses_job, "no target filters on $job/$instance"


def test_dashboard_covers_the_brief():
    """The metrics the dashboard promised to show are on it."""
    text = " ".join(expr for _, expr in dashboard_exprs(load_dashboard()))
    for needle in ["kvmem_pool_bytes", "kvmem_kv_full_cache_bytes", "kvmem_kv_block_bytes",
                   "kvmem_tokens_evicted_total", "kvmem_tokens_quantized_total",
                   "kvmem_step_duration_seconds_bucket", "kvmem_confidence_bucket",
                   "kvmem_budget_tokens_bucket", "kvmem_evicted_attention_mass_bucket",
                   "kvmem_evicted_attention_mass_sum", "kvmem_quantized_attention_mass_sum",
                   "kvmem_prefix_hits_total", "kvmem_prefix_queries_total",
                   "kvmem_prefix_reused_tokens_total", "kvmem_rpc_requests_total",
                   "kvmem_leases_expired_total", "kvmem_sequences",
                   "kvmem_host_metadata_bytes", "kvmem_host_metadata_budget_bytes"]:
        assert needle in text, f"no panel shows {needle}"


def test_dashboard_exprs_are_valid_promql(tmp_path):
    check_as_recording_rules(tmp_path, dashboard_exprs(load_dashboard()))


def test_substitution_and_name_extraction():
    dashboard = {"templating": {"list": [{"name": "job"}]}}
    assert substitute('rate(x{job=~"$job"}[$__rate_interval])', dashboard) == \
        'rate(x{job=~".+"}[1m])'
    assert substitute('x{job=~"${job:regex}"}', dashboard) == 'x{job=~".+"}'
    with pytest.raises(AssertionError):
        substitute('x{pod=~"$pod"}', dashboard)
    assert metric_names(
        'histogram_quantile(0.99, sum by (policy, le) (rate(a_bucket{le="1", x=~"b|c"}[5m]))) '
        '> 2 * (rate(b_sum[6h] offset 10m) / ignoring (state) c) or vector(0) and on (job) '
        'instance:d:ratio') == {"a_bucket", "b_sum", "c", "instance:d:ratio"}


# --------------------------------------------------------------------------- rules


def test_rules_have_the_alerts():
    alerts = {}
    for group in rules_groups():
        for rule in group["rules"]:
            if "alert" in rule:
                alerts[rule["alert"]] = rule
            else:
                assert re.fullmatch(r"[a-z_]+:[a-z_]+:[a-z0-9_]+", rule["record"]), (
                    f'{rule["record"]}: not level:metric:operations')
    assert set(alerts) == ALERTS
    for name, rule in alerts.items():
        assert rule["labels"]["severity"] in ("warning", "critical", "info"), name
        assert rule["annotations"].get("summary") and rule["annotations"].get("description"), name
        assert rule.get("for"), name


def test_rules_check():
    result = subprocess.run([promtool(), "check", "rules", str(RULES)], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_rules_unit_tests():
    result = subprocess.run([promtool(), "test", "rules", RULES_TEST.name], cwd=RULES_TEST.parent,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr


def test_rules_unit_tests_cover_every_alert_both_ways():
    with open(RULES_TEST, encoding="utf-8") as f:
        tests = yaml.safe_load(f)["tests"]
    fires, silent = set(), set()
    for test in tests:
        for case in test.get("alert_rule_test", []):
            (fires if case.get("exp_alerts") else silent).add(case["alertname"])
    assert fires >= ALERTS, f"no firing test for {ALERTS - fires}"
    assert silent >= ALERTS, f"no not-firing test for {ALERTS - silent}"


def test_prometheus_config_check():
    result = subprocess.run([promtool(), "check", "config", str(PROM_DIR / "prometheus.yml")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    with open(PROM_DIR / "prometheus.yml", encoding="utf-8") as f:
        config = yaml.safe_load(f)
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "kvmemd"]
    assert job["static_configs"][0]["targets"] == ["kvmemd:9464"]
    assert "rules/kvmem.rules.yml" in config["rule_files"]


def test_grafana_provisioning():
    prov = DEPLOY / "grafana" / "provisioning"
    with open(prov / "datasources" / "prometheus.yaml", encoding="utf-8") as f:
        (ds,) = yaml.safe_load(f)["datasources"]
    assert ds["type"] == "prometheus" and ds["url"].startswith("http")
    with open(prov / "dashboards" / "kvmem.yaml", encoding="utf-8") as f:
        (provider,) = yaml.safe_load(f)["providers"]
    assert provider["type"] == "file" and provider["options"]["path"].startswith("/")


# --------------------------------------------------------------------------- live daemon


def stop(proc, seconds=20):
    """SIGTERM (kvmemd drains), then SIGKILL if it is still running after `seconds`."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def exposed_names(text):
    """Sample names a Prometheus text exposition can carry, from its # TYPE lines and samples."""
    names = set()
    for line in text.splitlines():
        m = re.match(r"#\s*TYPE\s+(\S+)\s+(\S+)", line)
        if m:
            name, kind = m.groups()
            names.add(name)
            if kind == "histogram":
                names |= {name + "_bucket", name + "_sum", name + "_count"}
            elif kind == "summary":
                names |= {name + "_sum", name + "_count"}
            elif kind == "counter" and not name.endswith("_total"):
                names.add(name + "_total")
            continue
        m = re.match(r"([a-zA-Z_:][\w:]*)[{\s]", line)
        if m and not line.startswith("#"):
            names.add(m.group(1))
    return names


@pytest.fixture
def kvmemd_metrics(tmp_path):
    kvmemd = BIN / "kvmemd"
    if not kvmemd.exists():
        pytest.skip(f"{kvmemd} not built (set KVMEM_BIN to the build folder)")
    helpfull = subprocess.run([str(kvmemd), "--helpfull"], capture_output=True, text=True,
                              timeout=30)
    if "metrics_listen" not in helpfull.stdout + helpfull.stderr:
        pytest.skip(f"{kvmemd} has no --metrics_listen flag yet: metric names not checked live")
    sock = pathlib.Path(f"/tmp/kvmem-dash-{os.getpid()}.sock")
    sock.unlink(missing_ok=True)
    port = free_port()
    log = open(tmp_path / "kvmemd.log", "w")
    proc = subprocess.Popen([str(kvmemd), f"--listen=unix:{sock}",
                             f"--metrics_listen=127.0.0.1:{port}", "--pool_bytes=67108864"],
                            stdout=subprocess.PIPE, stderr=log, text=True)
    try:
        deadline = time.monotonic() + 30
        ready = False
        while time.monotonic() < deadline and not ready:
            r, _, _ = select.select([proc.stdout], [], [], 0.5)
            if r:
                line = proc.stdout.readline()
                if not line:
                    break
                ready = line.startswith("READY")
        assert ready, f"kvmemd did not print READY: {(tmp_path / 'kvmemd.log').read_text()}"

        # Traffic, so that labeled families have children: GetInfo/Stats RPCs, then a window
        # sequence through prefill, decode steps, reads and release.
        target = f"--target=unix:{sock}"
        for cmd in ([BIN / "kvmemctl", target, "info"], [BIN / "kvmemctl", target, "stats"],
                    [BIN / "kvmem_demo", target, "--prompt_tokens=64", "--decode_steps=20"]):
            if pathlib.Path(cmd[0]).exists():
                subprocess.run([str(c) for c in cmd], capture_output=True, timeout=60)

        text, error = None, None
        for _ in range(50):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                    text = r.read().decode()
                break
            except OSError as e:
                error = e
                time.sleep(0.2)
        assert text is not None, f"GET /metrics on port {port} failed: {error}"
        yield text
    finally:
        stop(proc)
        log.close()
        sock.unlink(missing_ok=True)


def test_metric_names_exist_in_kvmemd(kvmemd_metrics):
    exposed = exposed_names(kvmemd_metrics)
    assert any(n.startswith("kvmem_") for n in exposed), "kvmemd exposes no kvmem_ metric"
    recorded = {rule["record"] for g in rules_groups() for rule in g["rules"] if "record" in rule}

    used = {}
    for where, expr in dashboard_exprs(load_dashboard()):
        for name in metric_names(expr):
            assert ":" not in name, f"{where}: dashboard uses recording rule {name}"
            used.setdefault(name, where)
    for where, expr in rule_exprs():
        for name in metric_names(expr):
            if ":" in name:
                assert name in recorded, f"rule {where}: {name} is recorded by no rule"
            else:
                used.setdefault(name, f"rule {where}")

    missing = {n: w for n, w in used.items() if n not in exposed}
    assert not missing, (
        "metric names kvmemd does not export (no # TYPE line or sample in /metrics after "
        "traffic):\n" + "\n".join(f"  {n}  (used by {w})" for n, w in sorted(missing.items())))
