"""Orphaned reservations through the service: an aborted store's slot is reserved for its writer,
shown per request in ``GET /admin/v1/requests`` and in the metrics, and freed at the writer
deadline (engine-written stores) or when the service's own store job ends."""

from __future__ import annotations

import asyncio

import pytest

from tests.app.exposition import parse
from tests.manager.harness import FakeClock
from testsupport.api_harness import Harness, hexkeys, make_settings, running
from testsupport.polling import until_async

pytestmark = pytest.mark.anyio

DEADLINE_S = 30.0


async def _metrics(h: Harness) -> tuple[float | None, float | None]:
    exposition = parse((await h.client.get("/metrics", headers={"accept": _OM})).text)
    return (
        exposition.value("kvoffload_orphaned_reserved_blocks"),
        exposition.value("kvoffload_orphaned_reservations_expired_total"),
    )


_OM = "application/openmetrics-text; version=1.0.0"


async def test_an_unreported_abort_frees_its_slots_at_the_writer_deadline() -> None:
    clock = FakeClock()
    settings = make_settings(num_blocks=4, abort_writer_deadline_s=DEADLINE_S)
    async with running(settings, clock=clock) as h:
        await h.start("doomed")
        keys = hexkeys(1, 2, 3)
        r = await h.post("/v1/requests/doomed/prepare-store", {"keys": keys})
        assert r.status_code == 200, r.text
        r = await h.client.delete("/v1/requests/doomed", params={"abort": "true"})
        assert r.status_code == 200, r.text
        clock.advance(5)

        listed = (await h.admin.get("/admin/v1/requests")).json()
        [held] = listed["requests"]
        assert held["req_id"] == "doomed"
        assert held["orphaned_reservations"] == keys
        assert held["orphaned_seconds"] == 5.0
        assert held["pending_stores"] == keys
        assert await _metrics(h) == (3.0, 0.0)
        await h.start("other")
        r = await h.post("/v1/requests/other/prepare-store", {"keys": hexkeys(10, 11)})
        assert r.status_code == 507, r.text  # one slot is free; the three stay reserved

        clock.advance(DEADLINE_S)  # the sweeper runs every 50 ms of real time

        async def freed() -> bool:
            listed = (await h.admin.get("/admin/v1/requests")).json()["requests"]
            return [r["req_id"] for r in listed] == ["other"]

        await until_async("freed", freed)
        assert await _metrics(h) == (0.0, 3.0)
        stats = (await h.admin.get("/admin/v1/stats")).json()
        assert (stats["blocks"]["free"], stats["blocks"]["pending"]) == (4, 0)
        assert stats["counters"]["reservations_expired"] == 3
        assert stats["counters"]["forced_lease_releases"] == 0
        # The writer reports late: the request is gone, nothing changes.
        r = await h.post("/v1/requests/other/prepare-store", {"keys": hexkeys(10, 11)})
        assert r.status_code == 200, r.text
        r = await h.post("/v1/requests/doomed/complete-store", {"keys": keys})
        assert r.status_code == 404, r.text
        r = await h.post("/v1/requests/other/lookup", {"keys": hexkeys(1, 10, 11)})
        assert r.json()["results"] == ["miss", "pending", "pending"]


async def test_a_store_job_of_the_service_keeps_its_slots_until_it_ends() -> None:
    """A job that hangs holds its slots past the writer deadline, until its own deadline."""
    settings = make_settings(
        num_blocks=8, fault_hang_rate=1.0, job_deadline_s=1.0, abort_writer_deadline_s=0.05
    )
    async with running(settings) as h:
        await h.start()
        _, cache_id = await h.device()
        r = await h.post(
            "/v1/requests/r1/offload",
            {"cache_id": cache_id, "keys": hexkeys(1, 2), "device_blocks": [0, 1]},
        )
        assert r.status_code == 202, r.text
        job_id = r.json()["job_id"]
        r = await h.client.delete("/v1/requests/r1", params={"abort": "true"})
        assert r.status_code == 200, r.text
        await asyncio.sleep(0.3)  # well past the writer deadline, while the job still runs
        job = (await h.client.get(f"/v1/jobs/{job_id}")).json()
        if job["state"] == "running":
            [held] = (await h.admin.get("/admin/v1/requests")).json()["requests"]
            assert held["orphaned_reservations"] == hexkeys(1, 2)
        assert (await h.wait(job_id))["state"] == "failed"

        async def freed() -> bool:
            total: int = (await h.admin.get("/admin/v1/requests")).json()["total"]
            return total == 0

        await until_async("freed", freed)
        stats = (await h.admin.get("/admin/v1/stats")).json()
        assert stats["blocks"]["free"] == 8
        # Freed by the job's own report, not by the writer deadline.
        assert stats["counters"]["reservations_expired"] == 0
