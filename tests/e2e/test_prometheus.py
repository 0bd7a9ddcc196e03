"""End to end with a real Prometheus: it scrapes a live ``kvoffload serve`` every second (with
exemplar storage on, so it asks for OpenMetrics), and the values and the ``req_id`` exemplars
of known calls come back through its HTTP API.

Skipped when no ``prometheus`` binary is installed (Debian's ``prometheus`` package; ``.ci/run``
installs it). Both processes are bounded: Prometheus must be ready and have the data within
``DEADLINE_S``, and it is stopped (then killed) by its PID.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.app.exposition import OPENMETRICS, parse
from tests.e2e.prometheus import PROMETHEUS, running_prometheus
from testsupport.polling import until
from testsupport.server import ServerProcess

DEADLINE_S = 20.0

pytestmark = pytest.mark.skipif(
    PROMETHEUS is None, reason="no prometheus binary (apt-get install prometheus)"
)


@pytest.fixture
def prometheus(server: ServerProcess, tmp_path: Path) -> Iterator[str]:
    """A Prometheus scraping ``server`` every second; its base URL."""
    config = (
        "global:\n"
        "  scrape_interval: 1s\n"
        "  scrape_timeout: 1s\n"
        "scrape_configs:\n"
        "  - job_name: kvoffload\n"
        "    static_configs:\n"
        f"      - targets: ['127.0.0.1:{server.port}']\n"
    )
    with running_prometheus(tmp_path, config, DEADLINE_S) as url:
        yield url


def _query(url: str, promql: str) -> list[dict[str, Any]]:
    r = httpx.get(f"{url}/api/v1/query", params={"query": promql}, timeout=5)
    r.raise_for_status()
    result: list[dict[str, Any]] = r.json()["data"]["result"]
    return result


def _exemplar_ids(url: str, promql: str, start: float) -> set[str]:
    r = httpx.get(
        f"{url}/api/v1/query_exemplars",
        params={"query": promql, "start": start, "end": time.time() + 60},
        timeout=5,
    )
    r.raise_for_status()
    return {
        exemplar["labels"].get("req_id", "")
        for series in r.json()["data"]
        for exemplar in series["exemplars"]
    }


def test_prometheus_scrapes_values_and_req_id_exemplars(
    server: ServerProcess, prometheus: str
) -> None:
    started = time.time() - 60
    deadline = time.monotonic() + DEADLINE_S
    req_id = f"prom-{uuid.uuid4().hex[:12]}"
    keys = [uuid.uuid4().hex for _ in range(3)]
    with httpx.Client(base_url=server.url, timeout=10) as c:
        assert c.put(f"/v1/requests/{req_id}").status_code == 201
        c.post(f"/v1/requests/{req_id}/prepare-store", json={"keys": keys[:2]})
        c.post(f"/v1/requests/{req_id}/complete-store", json={"keys": keys[:2]})
        r = c.post(f"/v1/requests/{req_id}/lookup", json={"keys": keys})
        assert r.json()["hit_prefix"] == 2
        own = parse(c.get("/metrics", headers={"accept": OPENMETRICS}).text)
    hits = own.value("kvoffload_manager_keys_total", op="lookup", result="hit")
    assert hits is not None

    selector = 'kvoffload_manager_keys_total{op="lookup",result="hit",job="kvoffload"}'

    def scraped_value() -> float | None:
        result = _query(prometheus, selector)
        if result and float(result[0]["value"][1]) == hits:
            return hits
        return None

    until("Prometheus to scrape the lookup", scraped_value, deadline - time.monotonic())
    assert _query(prometheus, 'up{job="kvoffload"}')[0]["value"][1] == "1"

    for promql in (
        'kvoffload_manager_keys_total{op="lookup"}',
        'kvoffload_http_request_duration_seconds_bucket{route="/v1/requests/{req_id}/lookup"}',
    ):

        def exemplar_seen(promql: str = promql) -> bool | None:
            return True if req_id in _exemplar_ids(prometheus, promql, started) else None

        until(f"the exemplar of {req_id} on {promql}", exemplar_seen, deadline - time.monotonic())
