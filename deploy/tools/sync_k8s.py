"""Regenerate the Kubernetes copies of the Prometheus rules and the Grafana dashboard.

Sources of truth (edit these):
    deploy/prometheus/rules/kvoffload.rules.yml    -> deploy/k8s/prometheusrule.yaml
    deploy/grafana/dashboards/kvoffload.json       -> deploy/k8s/grafana-dashboard-configmap.yaml

    python deploy/tools/sync_k8s.py            rewrite the generated files
    python deploy/tools/sync_k8s.py --check    exit 1 (and name them) if they are out of date

Needs PyYAML only (installed with the service's dependencies). tests/deploy runs ``--check``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

DEPLOY = Path(__file__).resolve().parents[1]
RULES = DEPLOY / "prometheus" / "rules" / "kvoffload.rules.yml"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "kvoffload.json"
PROMETHEUS_RULE = DEPLOY / "k8s" / "prometheusrule.yaml"
DASHBOARD_CONFIGMAP = DEPLOY / "k8s" / "grafana-dashboard-configmap.yaml"
DASHBOARD_KEY = "kvoffload.json"
LABELS = {"app.kubernetes.io/name": "kvoffload"}


class _Dumper(yaml.SafeDumper):
    """Block style throughout; multi-line strings (PromQL, the dashboard) as literal blocks."""


def _represent_str(dumper: yaml.SafeDumper, data: str) -> yaml.ScalarNode:
    style = "|" if "\n" in data else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", data, style=style)


_Dumper.add_representer(str, _represent_str)


def _header(source: Path) -> str:
    rel = source.relative_to(DEPLOY.parent)
    return (
        f"# GENERATED from {rel} by deploy/tools/sync_k8s.py - do not edit by hand.\n"
        "# Edit the source, then run: python deploy/tools/sync_k8s.py\n"
    )


def _dump(doc: dict[str, Any]) -> str:
    text: str = yaml.dump(
        doc, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=1_000_000
    )
    return text


def prometheus_rule(rules_text: str) -> dict[str, Any]:
    """A PrometheusRule whose spec.groups are the groups of the Prometheus rules file."""
    rules = yaml.safe_load(rules_text)
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": "kvoffload", "labels": dict(LABELS)},
        "spec": {"groups": rules["groups"]},
    }


def dashboard_configmap(dashboard_text: str) -> dict[str, Any]:
    """A ConfigMap carrying the dashboard JSON verbatim, labelled for the Grafana sidecar."""
    json.loads(dashboard_text)  # refuse to ship invalid JSON
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": "kvoffload-grafana-dashboard",
            "labels": {**LABELS, "grafana_dashboard": "1"},
            "annotations": {"grafana_folder": "kvoffload"},
        },
        "data": {DASHBOARD_KEY: dashboard_text},
    }


def generated() -> dict[Path, str]:
    """Every generated file and the text it must have."""
    rules_text = RULES.read_text(encoding="utf-8")
    dashboard_text = DASHBOARD.read_text(encoding="utf-8")
    return {
        PROMETHEUS_RULE: _header(RULES) + _dump(prometheus_rule(rules_text)),
        DASHBOARD_CONFIGMAP: _header(DASHBOARD) + _dump(dashboard_configmap(dashboard_text)),
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Write (or with --check, verify) the generated files; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only check, write nothing")
    args = parser.parse_args(argv)
    stale = []
    for path, text in generated().items():
        current = path.read_text(encoding="utf-8") if path.exists() else None
        if current == text:
            continue
        stale.append(path)
        if not args.check:
            path.write_text(text, encoding="utf-8")
            print(f"wrote {path.relative_to(DEPLOY.parent)}")
    if args.check and stale:
        names = ", ".join(str(p.relative_to(DEPLOY.parent)) for p in stale)
        print(f"out of date: {names}; run python deploy/tools/sync_k8s.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
