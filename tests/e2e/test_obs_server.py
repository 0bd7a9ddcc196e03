"""Observability of a real ``kvoffload serve``: its stdout (JSON lines, ids on every call and job
line, uvicorn's records in the same form) and its live ``/metrics`` against the catalogue and
every PromQL expression the Grafana dashboard and the Prometheus rules use.

One server runs a scripted session (a request with its own X-Request-ID, transfer jobs that
succeed and fail, evictions, a policy switch, a finished request for the shadow evaluation, a
live request), then stops; the tests read what it wrote and served.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from tests.app.exposition import OPENMETRICS, Exposition, catalogue_mismatches, parse
from tests.deploy.helpers import (
    DASHBOARD,
    TARGET_LABELS,
    all_rules,
    catalogue,
    dashboard_expressions,
    load_json,
    recording_rule_names,
    tenant_labels,
)
from tests.deploy.promql import Analysis, analyse
from testsupport.server import TOKEN, ServerProcess
from testsupport.shm_device import ShmDevice

BLOCK = 4096
JOB_REQ = "e2e-jobs"


@dataclass(frozen=True)
class Session:
    log: list[dict[str, Any]]
    raw_log: str
    metrics: Exposition
    job_ids: list[int]


def _hex(i: int) -> str:
    return i.to_bytes(8, "big").hex()


@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory) -> Session:
    srv = ServerProcess(
        tmp_path_factory.mktemp("obs"),
        *("--log-level", "debug", "--num-blocks", "8", "--metrics-live-requests", "true"),
        *("--fault-fail-rate", "0.5", "--fault-seed", "7"),
        *("--shadow-sample-rate", "1.0", "--shadow-drain-interval-s", "0.05"),
        *("--shadow-window", "1"),  # one sampled request is enough data for a projection
    ).start()
    dev = ShmDevice(8, BLOCK)
    admin_headers = {"authorization": f"Bearer {TOKEN}"}
    try:
        with (
            httpx.Client(base_url=srv.url, timeout=10) as c,
            httpx.Client(base_url=srv.admin_url, headers=admin_headers, timeout=10) as a,
        ):
            r = c.put(f"/v1/requests/{JOB_REQ}", headers={"x-request-id": "hdr-e2e-1"})
            assert r.headers["x-request-id"] == "hdr-e2e-1"
            cache_id = c.post("/v1/kv-caches", json=dev.spec()).json()["cache_id"]
            stored: list[str] = []
            failed, job_ids = 0, []
            for i in range(64):  # seeded faults: both outcomes; 8 blocks: evictions
                key = _hex(100 + i)
                r = c.post(
                    f"/v1/requests/{JOB_REQ}/offload",
                    json={"cache_id": cache_id, "keys": [key], "device_blocks": [i % 8]},
                )
                job_id = r.json()["job_id"]
                job_ids.append(job_id)
                waited = c.post("/v1/jobs/wait", json={"job_ids": [job_id], "timeout_s": 5})
                if waited.json()["jobs"][0]["state"] == "done":
                    stored.append(key)
                else:
                    failed += 1
                if failed and len(stored) > 8:
                    break
            assert failed
            assert len(stored) > 8
            c.post(f"/v1/requests/{JOB_REQ}/lookup", json={"keys": [stored[-1], _hex(999)]})
            a.put("/admin/v1/policy", json={"name": "arc"})
            c.put("/v1/requests/e2e-life")
            c.post("/v1/requests/e2e-life/prepare-store", json={"keys": [_hex(1)]})
            c.post("/v1/requests/e2e-life/complete-store", json={"keys": [_hex(1)]})
            c.delete("/v1/requests/e2e-life")
            for _ in range(100):  # bounded wait for the shadow drain task
                if a.get("/admin/v1/policy/shadow").json()["sampled"]:
                    break
                time.sleep(0.05)
            c.put("/v1/requests/e2e-live")
            text = c.get("/metrics", headers={"accept": OPENMETRICS}).text
    finally:
        status = srv.stop()
        dev.close()
    assert status == 0, srv.log()
    raw = srv.log()
    lines = [json.loads(line) for line in raw.splitlines() if line.strip()]
    return Session(lines, raw, parse(text), job_ids)


def test_every_line_is_one_json_object(session: Session) -> None:
    for line in session.log:
        assert {"ts", "level", "logger", "event"} <= set(line), line
    loggers = {line["logger"] for line in session.log}
    assert {"uvicorn.error", "kvoffload.server", "kvoffload.access"} <= loggers
    assert "Traceback" not in session.raw_log
    assert TOKEN not in session.raw_log


def test_each_call_has_one_line_with_its_ids(session: Session) -> None:
    calls = [line for line in session.log if line["event"] == "http_call"]
    scoped = [c for c in calls if c["route"].startswith("/v1/requests/{req_id}")]
    assert scoped
    by_req = {c["req_id"] for c in scoped}
    assert by_req == {JOB_REQ, "e2e-life", "e2e-live"}
    (first,) = [c for c in calls if c["request_id"] == "hdr-e2e-1"]
    assert (first["req_id"], first["status"], first["op"]) == (JOB_REQ, 201, "start_request")
    assert len({c["request_id"] for c in calls}) == len(calls)  # one line per call
    offloads = [c for c in scoped if c["op"] == "offload"]
    assert len(offloads) == len(session.job_ids)


def test_job_lines_carry_the_jobs_request(session: Session) -> None:
    jobs = [line for line in session.log if line["logger"] == "kvoffload.transfer"]
    assert {line["job_id"] for line in jobs} == set(session.job_ids)
    assert {line["req_id"] for line in jobs} == {JOB_REQ}
    assert {line["event"] for line in jobs} == {"transfer job finished", "transfer job failed"}


def test_live_metrics_match_the_catalogue(session: Session) -> None:
    assert catalogue_mismatches(session.metrics) == []
    assert session.metrics.exemplar_ids("kvoffload_transfer_jobs_total") == {JOB_REQ}


def _live_series(ex: Exposition) -> dict[str, list[dict[str, str]]]:
    """Every sample name of the exposition and the label sets it was seen with."""
    out: dict[str, list[dict[str, str]]] = {}
    for _, samples in ex.families.values():
        for sample in samples:
            out.setdefault(sample.name, []).append(dict(sample.labels))
    return out


def _problems(where: str, analysis: Analysis, live: dict[str, list[dict[str, str]]]) -> list[str]:
    problems = []
    records = recording_rule_names()
    tenants = tenant_labels()
    opt_in = {n for m in catalogue().values() if m.opt_in for n in m.series_names()}
    for selector in analysis.selectors:
        name = selector.name
        if name is None or name in records or not name.startswith("kvoffload_"):
            continue
        if name not in live:
            if name in opt_in:
                continue  # exported only when a setting turns it on (remote tier, tenants)
            problems.append(f"{where}: {name} is not exported")
            continue
        labels = {k for labelset in live[name] for k in labelset}
        for m in selector.matchers:
            if m.label in TARGET_LABELS or m.label == "__name__":
                continue
            if m.label in tenants and m.op == "=~" and "$" in m.value:
                continue  # only with tenants; the dashboard's "All" also matches its absence
            if m.label not in labels:
                problems.append(f"{where}: {name} has no label {m.label}")
            elif (
                m.op == "="
                and "$" not in m.value
                and not any(ls.get(m.label) == m.value for ls in live[name])
            ):
                problems.append(f"{where}: no live {name}{{{m.label}={m.value!r}}}")
    return problems


def test_dashboard_and_rules_query_what_the_service_exports(session: Session) -> None:
    """Every kvoffload series a rule or panel selects exists on the live /metrics, with the
    labels it matches on and, for equality matchers, a series with that value."""
    live = _live_series(session.metrics)
    problems: list[str] = []
    for rule in all_rules():
        where = f"rule {rule.get('record') or rule.get('alert')}"
        problems += _problems(where, analyse(rule["expr"]), live)
    for where, analysis in dashboard_expressions(load_json(DASHBOARD)):
        problems += _problems(where, analysis, live)
    assert problems == []
