#!/usr/bin/env python3
"""Rewrites deploy/k8s/prometheusrule.yaml from deploy/prometheus/rules/kvmem.rules.yml: the
rules file's groups, comments included, indented under the PrometheusRule's spec. Run it after
editing the rules; tests/python/test_deploy.py fails while the two differ."""
from pathlib import Path

DEPLOY = Path(__file__).resolve().parents[1]
HEADER = """\
# Prometheus Operator: the rule groups of deploy/prometheus/rules/kvmem.rules.yml (recording
# rules and alerts) under spec, written by deploy/k8s/prometheusrule.py: edit the rules file and
# rerun it. The Helm chart links the rules file instead of copying it.
apiVersion: monitoring.coreos.com/v1
kind: PrometheusRule
metadata:
  name: kvmem
  labels: {app.kubernetes.io/name: kvmemd, app.kubernetes.io/part-of: kvmem}
spec:
"""

lines = (DEPLOY / "prometheus" / "rules" / "kvmem.rules.yml").read_text().splitlines()
start = next(i for i, line in enumerate(lines) if line.startswith("groups:"))
body = "".join(f"  {line}\n" if line.strip() else "\n" for line in lines[start:])
(DEPLOY / "k8s" / "prometheusrule.yaml").write_text(HEADER + body)
