"""Leases of vanished engines expire; readiness follows stuck transfers and shutdown."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from app.http.apps import create_app
from testsupport.api_harness import Harness, hexkeys, make_settings, running

pytestmark = pytest.mark.anyio


async def test_leases_of_a_vanished_engine_expire() -> None:
    settings = make_settings(lease_ttl_s=0.3, job_deadline_s=0.1, lease_check_interval_s=0.05)
    async with running(settings) as h:
        await h.start("crashy")
        await h.post("/v1/requests/crashy/prepare-store", {"keys": hexkeys(1, 2)})
        await h.post("/v1/requests/crashy/complete-store", {"keys": hexkeys(1)})
        await h.post("/v1/requests/crashy/prepare-load", {"keys": hexkeys(1)})
        stats = (await h.admin.get("/admin/v1/stats")).json()
        assert (stats["blocks"]["pinned"], stats["blocks"]["pending"]) == (1, 1)

        await asyncio.sleep(0.8)  # the engine says nothing any more

        stats = (await h.admin.get("/admin/v1/stats")).json()
        assert (stats["blocks"]["pinned"], stats["blocks"]["pending"]) == (0, 0)
        assert stats["counters"]["forced_lease_releases"] == 1
        assert (await h.admin.get("/admin/v1/requests")).json()["total"] == 0
        r = await h.post("/v1/requests/crashy/lookup", {"keys": hexkeys(1)})
        assert r.status_code == 404


async def test_an_engine_that_keeps_calling_keeps_its_leases() -> None:
    settings = make_settings(lease_ttl_s=0.3, job_deadline_s=0.1, lease_check_interval_s=0.05)
    async with running(settings) as h:
        await h.start()
        await h.post("/v1/requests/r1/prepare-store", {"keys": hexkeys(1)})
        for _ in range(8):
            await asyncio.sleep(0.1)
            await h.post("/v1/requests/r1/touch", {"keys": []})
        stats = (await h.admin.get("/admin/v1/stats")).json()
        assert stats["blocks"]["pending"] == 1


async def test_ready_then_not_ready_while_draining(h: Harness) -> None:
    r = await h.client.get("/readyz")
    assert (r.status_code, r.json()) == (200, {"status": "ready"})
    assert (await h.client.get("/livez")).json() == {"status": "ok"}
    h.service.begin_drain()
    r = await h.client.get("/readyz")
    assert (r.status_code, r.json()["status"]) == (503, "not_ready")
    assert r.json()["reason"] == "shutting down"


async def test_not_ready_while_a_transfer_is_past_its_deadline(
    h: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    tracker = h.service.transfers().tracker
    monkeypatch.setattr(tracker, "oldest_running_age", lambda: h.settings.job_deadline_s + 1)
    r = await h.client.get("/readyz")
    assert r.status_code == 503
    assert "past its" in r.json()["reason"]


async def test_not_ready_before_start_and_transfers_refused() -> None:
    app = create_app(make_settings())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as c:
        r = await c.get("/readyz")
        assert (r.status_code, r.json()["reason"]) == (503, "service is new")
        r = await c.get("/v1/pool")
        assert (r.status_code, r.json()["error"]["code"]) == (503, "unavailable")


async def test_stop_fails_running_jobs_and_frees_everything() -> None:
    settings = make_settings(fault_delay_s=5.0, shutdown_grace_s=0.2)
    async with running(settings) as h:
        await h.start()
        _, cache_id = await h.device()
        r = await h.post(
            "/v1/requests/r1/offload",
            {"cache_id": cache_id, "keys": hexkeys(1), "device_blocks": [0]},
        )
        assert r.json()["state"] == "running"
        service = h.service
    assert service.state == "stopped"
    stats = service.admin.stats()
    assert (stats.pending, stats.ready) == (0, 0)


async def test_a_failed_start_leaves_nothing_half_running() -> None:
    """A pool that cannot be created fails the start cleanly (refused as a setting)."""
    from app.core.service import Service
    from app.settings import ConfigError

    service = Service(make_settings(num_blocks=1 << 20, block_bytes=1 << 26))
    with pytest.raises(ConfigError, match="--num-blocks / KVOFFLOAD_NUM_BLOCKS"):
        await service.start()
    assert service.state == "new"
    assert service.readiness() == "service is new"


async def test_draining_answers_long_polls_at_once() -> None:
    async with running(make_settings(fault_delay_s=3.0)) as h:
        await h.start()
        _, cache_id = await h.device()
        r = await h.post(
            "/v1/requests/r1/offload",
            {"cache_id": cache_id, "keys": hexkeys(1), "device_blocks": [0]},
        )
        job_id = r.json()["job_id"]
        poll = asyncio.create_task(h.post("/v1/jobs/wait", {"job_ids": [job_id], "timeout_s": 20}))
        await asyncio.sleep(0.1)
        h.service.begin_drain()
        r = await asyncio.wait_for(poll, 2)
        assert r.json()["done"] is False
