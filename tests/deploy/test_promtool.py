"""Prometheus configuration and rules: promtool checks and unit tests (skipped without promtool),
and coverage of every alert and recording rule by the promtool unit tests (always)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.deploy.helpers import (
    ALERTS_DOC,
    PROMETHEUS_CONFIG,
    PROMTOOL_TESTS,
    RULES,
    alert_rules,
    all_rules,
    load_yaml,
    recording_rule_names,
)

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None,
    reason="promtool not on PATH (Debian/Ubuntu: apt-get install -y prometheus; or the "
    "promtool binary from a Prometheus release tarball)",
)
SEVERITIES = {"critical", "warning", "info"}


def _promtool(*args: str | Path) -> str:
    assert PROMTOOL is not None
    proc = subprocess.run(
        [PROMTOOL, *map(str, args)], capture_output=True, text=True, timeout=60, check=False
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"promtool {' '.join(map(str, args))} failed:\n{output}"
    return output


def _test_files() -> list[Path]:
    files = sorted(PROMTOOL_TESTS.glob("*.yml"))
    assert files, "no promtool unit tests under deploy/prometheus/tests"
    return files


@needs_promtool
def test_promtool_check_config(tmp_path: Path) -> None:
    # The scrape token's file is a compose secret, there only in the container: checked on a
    # copy of the configuration (rules beside it) naming a throwaway file there instead.
    shutil.copytree(PROMETHEUS_CONFIG.parent, tmp_path / "prometheus")
    config = tmp_path / "prometheus" / PROMETHEUS_CONFIG.name
    token = tmp_path / "metrics-token"
    token.write_text("test\n")
    text = config.read_text(encoding="utf-8")
    assert "/run/secrets/kvoffload_metrics_token" in text
    config.write_text(text.replace("/run/secrets/kvoffload_metrics_token", str(token)))
    out = _promtool("check", "config", config)
    assert "SUCCESS" in out
    assert "kvoffload.rules.yml" in out


@needs_promtool
def test_promtool_check_rules() -> None:
    out = _promtool("check", "rules", RULES)
    assert f"SUCCESS: {len(all_rules())} rules found" in out


@needs_promtool
def test_promtool_test_rules() -> None:
    out = _promtool("test", "rules", *_test_files())
    assert "FAILED" not in out


# --- coverage of the unit tests (no promtool needed) ------------------------------------------


def _cases() -> list[dict[str, Any]]:
    cases = []
    for path in _test_files():
        doc = load_yaml(path)
        rule_files = [(path.parent / f).resolve() for f in doc["rule_files"]]
        assert rule_files == [RULES.resolve()], f"{path.name} must test {RULES.name}"
        cases.extend(doc["tests"])
    return cases


def test_every_alert_has_a_firing_and_a_silent_case() -> None:
    fired: dict[str, set[str]] = {}
    silent: set[str] = set()
    for case in _cases():
        for alert_test in case.get("alert_rule_test", []):
            name = alert_test["alertname"]
            if alert_test.get("exp_alerts"):
                for exp in alert_test["exp_alerts"]:
                    fired.setdefault(name, set()).add(exp["exp_labels"].get("severity", ""))
                    assert exp.get("exp_annotations"), f"{name}: check the annotations too"
            else:
                silent.add(name)
    for rule in alert_rules():
        name, severity = rule["alert"], rule["labels"]["severity"]
        assert severity in fired.get(name, set()), f"no promtool case fires {name} ({severity})"
        assert name in silent, f"no promtool case where {name} must stay silent"


def test_every_recording_rule_is_unit_tested() -> None:
    tested = " ".join(t["expr"] for case in _cases() for t in case.get("promql_expr_test", []))
    missing = sorted(name for name in recording_rule_names() if name not in tested)
    assert not missing, f"recording rules without a promql_expr_test: {missing}"


def test_alerts_have_severity_annotations_and_a_runbook_line() -> None:
    page = ALERTS_DOC.read_text(encoding="utf-8")
    for rule in alert_rules():
        name = rule["alert"]
        assert re.fullmatch(r"Kvoffload[A-Z][A-Za-z]+", name), name
        assert rule["labels"]["severity"] in SEVERITIES, name
        assert set(rule["annotations"]) >= {"summary", "description", "runbook"}, name
        assert name in page, f"docs/alerts.md has no runbook entry for {name}"
