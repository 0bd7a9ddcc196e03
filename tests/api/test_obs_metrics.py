"""Metrics after real API calls: values, req_id exemplars, the live-request table, /metrics
content negotiation, and the live exposition against deploy/metrics_catalogue.json."""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.openmetrics.exposition import generate_latest

from app.telemetry.request_ids import safe_req_id
from tests.app.exposition import OPENMETRICS, catalogue_mismatches, parse
from testsupport.api_harness import Harness, hexkeys, make_settings, running

pytestmark = pytest.mark.anyio
LOOKUP = "/v1/requests/{req_id}/lookup"


def sample(h: Harness, name: str, **labels: str) -> float | None:
    assert h.service.registry is not None
    return h.service.registry.get_sample_value(name, labels)


def exposition(h: Harness) -> Any:
    assert h.service.registry is not None
    return parse(generate_latest(h.service.registry).decode())


async def test_manager_ops_and_keys_by_result_with_the_request_as_exemplar(h: Harness) -> None:
    await h.start("r1")
    await h.post("/v1/requests/r1/prepare-store", {"keys": hexkeys(1, 2, 3)})
    # 1, 2, 3 are pending: reused; 4 is new.
    await h.post("/v1/requests/r1/prepare-store", {"keys": hexkeys(1, 2, 3, 4)})
    await h.post("/v1/requests/r1/complete-store", {"keys": hexkeys(1, 2, 3, 4)})
    await h.post("/v1/requests/r1/complete-store", {"keys": hexkeys(1, 2)})  # repeats: ignored
    await h.start("r2")
    r = await h.post("/v1/requests/r2/lookup", {"keys": hexkeys(1, 2, 3, 9, 4)})
    assert r.json()["hit_prefix"] == 3
    await h.post("/v1/requests/r2/prepare-load", {"keys": hexkeys(1, 2)})
    await h.post("/v1/requests/r2/complete-load", {"keys": hexkeys(1, 2)})
    await h.post("/v1/requests/r2/complete-load", {"keys": hexkeys(1)})  # not pinned: 409
    await h.post("/v1/requests/nobody/lookup", {"keys": hexkeys(1)})  # 404
    await h.post("/v1/requests/r2/touch", {"keys": hexkeys(1)})
    await h.client.delete("/v1/requests/r2")

    keys = "kvoffload_manager_keys_total"
    ops = "kvoffload_manager_ops_total"
    assert sample(h, keys, op="prepare_store", result="stored") == 4
    assert sample(h, keys, op="prepare_store", result="reused") == 3
    assert sample(h, keys, op="complete_store", result="completed") == 4
    assert sample(h, keys, op="complete_store", result="ignored") == 2
    assert sample(h, keys, op="lookup", result="hit") == 4
    assert sample(h, keys, op="lookup", result="miss") == 1
    assert sample(h, keys, op="lookup", result="pending") is None  # zero: no series
    assert sample(h, keys, op="prepare_load", result="pinned") == 2
    assert sample(h, ops, op="request_start", result="ok") == 2
    assert sample(h, ops, op="request_finish", result="ok") == 1
    assert sample(h, ops, op="lookup", result="ok") == 1
    assert sample(h, ops, op="lookup", result="error") == 1
    assert sample(h, ops, op="complete_load", result="ok") == 1
    assert sample(h, ops, op="complete_load", result="error") == 1
    assert sample(h, ops, op="touch", result="ok") == 1
    # Leading hits over keys looked up: 3 of 5.
    assert sample(h, "kvoffload_prefix_hit_ratio") == pytest.approx(3 / 5)

    ex = exposition(h)
    assert ex.exemplar_ids(keys, op="prepare_store", result="stored") == {"r1"}
    assert ex.exemplar_ids(keys, op="lookup", result="hit") == {"r2"}
    assert ex.exemplar_ids(ops, op="lookup", result="error") == {"nobody"}
    counted = ex.samples(keys, op="lookup", result="hit")[0]
    assert counted.exemplar is not None
    assert counted.exemplar.value == 4  # the increment the exemplar observation made


async def test_http_calls_by_route_template_with_exemplars() -> None:
    async with running(make_settings()) as h:
        await h.start("r1")
        for _ in range(3):
            await h.post("/v1/requests/r1/lookup", {"keys": hexkeys(1)})
        await h.client.get("/nowhere", headers={"x-request-id": "lost-1"})
        await h.client.get("/livez", headers={"x-request-id": "probe-7"})
        counts = "kvoffload_http_requests_total"
        assert sample(h, counts, route=LOOKUP, method="POST", status="200") == 3
        assert sample(h, counts, route="unmatched", method="GET", status="404") == 1
        hist = "kvoffload_http_request_duration_seconds_count"
        assert sample(h, hist, route=LOOKUP, method="POST") == 3
        ex = exposition(h)
        assert ex.exemplar_ids(counts, route=LOOKUP) == {"r1"}
        assert ex.exemplar_ids(counts, route="unmatched") == {"lost-1"}
        assert ex.exemplar_ids(counts, route="/livez") == {"probe-7"}
        # Every bucket exemplar is the observation that landed in that bucket.
        buckets = ex.samples("kvoffload_http_request_duration_seconds_bucket", route=LOOKUP)
        for bucket in buckets:
            if bucket.exemplar is not None:
                assert bucket.exemplar.labels == {"req_id": "r1"}
                assert bucket.exemplar.value <= float(bucket.labels["le"])


async def test_transfer_jobs_carry_their_request_as_exemplar() -> None:
    async with running(make_settings(num_blocks=4)) as h:
        await h.start("r1")
        _, cache_id = await h.device(8)
        r = await h.post(
            "/v1/requests/r1/offload",
            {"cache_id": cache_id, "keys": hexkeys(1, 2, 3, 4), "device_blocks": [0, 1, 2, 3]},
        )
        assert (await h.wait(r.json()["job_id"]))["state"] == "done"
        await h.start("r2")
        r = await h.post(
            "/v1/requests/r2/onload",
            {"cache_id": cache_id, "keys": hexkeys(1, 2), "device_blocks": [4, 5]},
        )
        assert (await h.wait(r.json()["job_id"]))["state"] == "done"

        block = h.settings.block_bytes
        jobs = "kvoffload_transfer_jobs_total"
        assert sample(h, jobs, direction="store", result="ok") == 1
        assert sample(h, jobs, direction="load", result="ok") == 1
        assert sample(h, "kvoffload_transfer_bytes_total", direction="store") == 4 * block
        assert sample(h, "kvoffload_transfer_bytes_total", direction="load") == 2 * block
        assert sample(h, "kvoffload_transfer_duration_seconds_count", direction="load") == 1
        # A job's end is an observed manager op too (complete_store / complete_load).
        keys = "kvoffload_manager_keys_total"
        assert sample(h, keys, op="prepare_store", result="stored") == 4
        assert sample(h, keys, op="complete_store", result="completed") == 4
        assert sample(h, keys, op="prepare_load", result="pinned") == 2
        ex = exposition(h)
        assert ex.exemplar_ids(jobs, direction="store") == {"r1"}
        assert ex.exemplar_ids(jobs, direction="load") == {"r2"}
        assert ex.exemplar_ids("kvoffload_transfer_duration_seconds_bucket", direction="store") == {
            "r1"
        }
        ops = "kvoffload_manager_ops_total"
        assert ex.exemplar_ids(ops, op="complete_store", result="ok") == {"r1"}
        assert ex.exemplar_ids(ops, op="complete_load", result="ok") == {"r2"}


async def test_refused_prepare_store_is_counted_as_refused() -> None:
    async with running(make_settings(num_blocks=2)) as h:
        await h.start("r1")
        await h.post("/v1/requests/r1/prepare-store", {"keys": hexkeys(1, 2)})
        # Both slots hold pending stores: nothing is evictable.
        r = await h.post("/v1/requests/r1/prepare-store", {"keys": hexkeys(3)})
        assert r.status_code == 507
        ops = "kvoffload_manager_ops_total"
        assert sample(h, ops, op="prepare_store", result="refused") == 1
        assert sample(h, ops, op="prepare_store", result="ok") == 1
        assert sample(h, "kvoffload_store_refusals_total") == 1
        ex = exposition(h)
        assert ex.exemplar_ids(ops, op="prepare_store", result="refused") == {"r1"}


async def test_batch_ops_are_observed_one_by_one(h: Harness) -> None:
    await h.start("a")
    await h.start("b")
    r = await h.post(
        "/v1/batch",
        {
            "ops": [
                {"op": "prepare_store", "req_id": "a", "keys": hexkeys(1, 2)},
                {"op": "lookup", "req_id": "b", "keys": hexkeys(1, 2, 3)},
                {"op": "lookup", "req_id": "ghost", "keys": hexkeys(1)},
            ]
        },
    )
    assert r.status_code == 200
    ex = exposition(h)
    keys = "kvoffload_manager_keys_total"
    assert ex.value(keys, op="prepare_store", result="stored") == 2
    assert ex.value(keys, op="lookup", result="pending") == 2
    assert ex.exemplar_ids(keys, op="prepare_store") == {"a"}
    assert ex.exemplar_ids(keys, op="lookup") == {"b"}
    assert ex.exemplar_ids("kvoffload_manager_ops_total", op="lookup", result="error") == {"ghost"}
    assert h.calls[-1].keys == 2 + 3  # the ops that ran; the failed one handled no key


async def test_policy_switches_are_counted(h: Harness) -> None:
    await h.admin.put("/admin/v1/policy", json={"name": "arc"})
    await h.admin.put("/admin/v1/policy", json={"name": "arc"})  # no change
    switches = "kvoffload_policy_switches_total"
    assert sample(h, switches, from_policy="lru", to_policy="arc") == 1
    assert sample(h, "kvoffload_policy_info", policy="arc") == 1
    assert sample(h, "kvoffload_policy_generation") == 2


async def test_unsafe_req_id_is_served_and_exemplared_in_its_safe_form(h: Harness) -> None:
    raw = 'bad id "quoted" ' + "x" * 150
    path = f"/v1/requests/{quote(raw, safe='')}"
    r = await h.client.put(path)
    assert r.status_code == 201
    r = await h.post(f"{path}/lookup", {"keys": hexkeys(1)})
    assert r.status_code == 200
    safe = safe_req_id(raw)
    assert safe != raw
    assert len(safe) <= 120
    ex = exposition(h)
    assert ex.exemplar_ids("kvoffload_manager_keys_total", op="lookup") == {safe}
    assert ex.exemplar_ids("kvoffload_http_requests_total", route=LOOKUP) == {safe}


async def test_live_request_series_appear_and_disappear() -> None:
    settings = make_settings(metrics_live_requests=True, metrics_live_requests_max=2)
    async with running(settings) as h:

        def blocks(req_id: str, kind: str) -> float | None:
            return sample(h, "kvoffload_request_blocks", req_id=req_id, kind=kind)

        await h.start("r1")
        await h.post("/v1/requests/r1/prepare-store", {"keys": hexkeys(1, 2, 3)})
        assert blocks("r1", "pending") == 3
        assert blocks("r1", "stored") == 0
        await h.post("/v1/requests/r1/complete-store", {"keys": hexkeys(1, 2, 3)})
        assert (blocks("r1", "pending"), blocks("r1", "stored")) == (0, 3)
        await h.post("/v1/requests/r1/prepare-load", {"keys": hexkeys(1, 2)})
        assert (blocks("r1", "pinned"), blocks("r1", "loaded")) == (2, 0)
        await h.post("/v1/requests/r1/complete-load", {"keys": hexkeys(1, 2)})
        assert (blocks("r1", "pinned"), blocks("r1", "loaded")) == (0, 2)

        await h.start("r2")
        await h.start("r3")  # over the cap of 2: not listed
        assert blocks("r2", "pinned") == 0
        assert blocks("r3", "pinned") is None
        await h.client.delete("/v1/requests/r1")
        for kind in ("pinned", "pending", "loaded", "stored"):
            assert blocks("r1", kind) is None, kind
        assert blocks("r3", "pinned") == 0  # r1 gone: r3 fits under the cap


async def test_live_request_series_are_off_by_default(h: Harness) -> None:
    await h.start("r1")
    text = (await h.client.get("/metrics")).text
    assert "kvoffload_request_blocks" not in text


async def test_metrics_content_negotiation(h: Harness) -> None:
    await h.start("r1")
    await h.post("/v1/requests/r1/lookup", {"keys": hexkeys(1)})
    plain = await h.client.get("/metrics", follow_redirects=False)
    assert plain.status_code == 200
    assert plain.headers["content-type"].startswith("text/plain; version=0.0.4")
    assert "kvoffload_http_requests_total{" in plain.text
    assert "# {" not in plain.text  # the classic format carries no exemplar
    om = await h.client.get("/metrics", headers={"accept": OPENMETRICS})
    assert om.headers["content-type"].startswith("application/openmetrics-text")
    assert om.text.endswith("# EOF\n")
    assert '# {req_id="r1"}' in om.text
    # Prometheus's own Accept header (several types, with q values).
    prom = await h.client.get(
        "/metrics",
        headers={
            "accept": "application/openmetrics-text;version=1.0.0;q=0.5,"
            "text/plain;version=0.0.4;q=0.4,*/*;q=0.1"
        },
    )
    assert prom.headers["content-type"].startswith("application/openmetrics-text")
    assert (await h.client.get("/metrics/", follow_redirects=False)).status_code != 200


async def test_metrics_off_serves_no_metrics_and_still_serves_calls() -> None:
    async with running(make_settings(metrics_enabled=False)) as h:
        assert h.service.registry is None
        await h.start("r1")
        r = await h.post("/v1/requests/r1/lookup", {"keys": hexkeys(1)})
        assert r.status_code == 200
        assert h.calls[-1].keys == 1  # the log line still counts keys
        assert (await h.client.get("/metrics")).status_code == 404
        spec = (await h.client.get("/openapi.json")).json()
        assert "/metrics" not in spec["paths"]


async def test_injected_registry_is_the_one_served() -> None:
    registry = CollectorRegistry()
    async with running(make_settings(), registry=registry) as h:
        assert h.service.registry is registry
        await h.start("r1")
        assert registry.get_sample_value(
            "kvoffload_manager_ops_total", {"op": "request_start", "result": "ok"}
        )


async def test_live_metrics_match_the_catalogue() -> None:
    """Every family a live /metrics exports is in the catalogue with the same type, labels,
    closed label values and exemplars, and every catalogue entry is exported."""
    settings = make_settings(
        num_blocks=8,
        metrics_live_requests=True,
        shadow_sample_rate=1.0,
        shadow_window=1,  # one sampled request is enough data for a projection
        fault_fail_rate=0.5,
        fault_seed=7,
    )
    async with running(settings) as h:
        await h.start("r1")
        _, cache_id = await h.device(8)
        states: set[str] = set()
        for i in range(64):  # evictions, and (seeded faults) both a done and a failed job
            r = await h.post(
                "/v1/requests/r1/offload",
                {"cache_id": cache_id, "keys": hexkeys(100 + i), "device_blocks": [i % 8]},
            )
            assert r.status_code == 202, r.text
            states.add((await h.wait(r.json()["job_id"]))["state"])
            if len(states) == 2 and sample(h, "kvoffload_evictions_total", policy="lru"):
                break
        assert states == {"done", "failed"}
        await h.post("/v1/requests/r1/lookup", {"keys": hexkeys(100, 101)})
        await h.admin.put("/admin/v1/policy", json={"name": "arc"})
        await h.start("r2")
        await h.post("/v1/requests/r2/prepare-store", {"keys": hexkeys(1)})
        await h.post("/v1/requests/r2/complete-store", {"keys": hexkeys(1)})
        await h.client.delete("/v1/requests/r2")  # its chain goes to the shadow evaluation
        assert h.service.shadow is not None
        h.service.shadow.drain()
        await h.start("r3")  # a live request for the opt-in table
        r = await h.client.get("/metrics", headers={"accept": OPENMETRICS})
        ex = parse(r.text)
        assert catalogue_mismatches(ex) == []
        assert ex.value("kvoffload_evictions_total", policy="lru")
