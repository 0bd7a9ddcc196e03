"""Faults in process: any mix of injected transfer failures, hangs and delays leaves the manager
consistent, plus reproducers of lease defects found while testing (strict ``xfail``: each
turns into a failure the day its defect is fixed, so the marker gets removed with the fix).
"""

from __future__ import annotations

import asyncio
from typing import Any

import anyio
import anyio.from_thread
import anyio.to_thread
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from testsupport.api_harness import Harness, hexkeys, make_settings, running

pytestmark = pytest.mark.anyio


async def settle(h: Harness, job_ids: list[int]) -> list[dict[str, Any]]:
    r = await h.post("/v1/jobs/wait", {"job_ids": job_ids, "timeout_s": 10})
    body = r.json()
    assert body["done"], body
    jobs: list[dict[str, Any]] = body["jobs"]
    return jobs


async def counts(h: Harness) -> dict[str, int]:
    blocks: dict[str, int] = (await h.admin.get("/admin/v1/stats")).json()["blocks"]
    assert blocks["free"] + blocks["pending"] + blocks["ready"] == blocks["num_blocks"], blocks
    return blocks


@pytest.mark.slow
async def test_any_fault_mix_leaves_no_lease_and_only_good_blocks() -> None:
    """Hypothesis draws fail and hang rates, a delay and a seed; under them, rounds of stores
    and loads (some aborted mid-job) end with: every job done or failed with a known reason,
    each successfully stored block a hit holding the bytes it was stored with, each failed
    store's block a miss, and once the requests end nothing pinned or pending."""

    @settings(
        max_examples=12,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow],
    )
    @given(
        fail=st.sampled_from([0.0, 0.2, 0.5, 1.0]),
        hang=st.sampled_from([0.0, 0.2, 0.5]),
        delay=st.sampled_from([0.0, 0.01]),
        seed=st.integers(0, 2**16),
        aborts=st.lists(st.booleans(), min_size=4, max_size=4),
    )
    def mix(fail: float, hang: float, delay: float, seed: int, aborts: list[bool]) -> None:
        if fail + hang > 1:
            fail = 1 - hang
        anyio.from_thread.run(scenario, fail, hang, delay, seed, aborts)

    await anyio.to_thread.run_sync(mix)


async def scenario(fail: float, hang: float, delay: float, seed: int, aborts: list[bool]) -> None:
    settings_ = make_settings(
        num_blocks=16,
        fault_fail_rate=fail,
        fault_hang_rate=hang,
        fault_delay_s=delay,
        fault_seed=seed,
        job_deadline_s=0.2,
        lease_ttl_s=5.0,
    )
    async with running(settings_) as h:
        dev, cache_id = await h.device(8)
        stored: dict[str, bytes] = {}
        failed: set[str] = set()
        for rnd, abort in enumerate(aborts):
            rid = f"r{rnd}"
            await h.start(rid)
            keys = hexkeys(*range(rnd * 4 + 1, rnd * 4 + 5))
            data = [dev.fill(b, seed=rnd * 10 + b) for b in range(4)]
            r = await h.post(
                f"/v1/requests/{rid}/offload",
                {"cache_id": cache_id, "keys": keys, "device_blocks": [0, 1, 2, 3]},
            )
            assert r.status_code == 202, r.text
            if abort:
                await h.client.delete(f"/v1/requests/{rid}", params={"abort": "true"})
            (job,) = await settle(h, [r.json()["job_id"]])
            assert job["state"] == "done" or job["reason"] in ("injected failure", "deadline")
            if job["state"] == "done" and not abort:
                stored.update(zip(keys, data, strict=True))
            else:
                failed.update(keys)
            # Load back whatever is ready (pins through a job that may fail too).
            ready = [k for k in keys if k in stored]
            if ready and not abort:
                r = await h.post(
                    f"/v1/requests/{rid}/onload",
                    {
                        "cache_id": cache_id,
                        "keys": ready,
                        "device_blocks": [4, 5, 6, 7][: len(ready)],
                    },
                )
                assert r.status_code == 202, r.text
                (job,) = await settle(h, [r.json()["job_id"]])
                if job["state"] == "done":
                    assert [dev.read(4 + i) for i in range(len(ready))] == [
                        stored[k] for k in ready
                    ]
            if not abort:
                await h.client.delete(f"/v1/requests/{rid}")
        await h.start("check")
        if stored:
            r = await h.post("/v1/requests/check/lookup", {"keys": list(stored)})
            assert r.json()["results"] == ["hit"] * len(stored)
        if failed:
            r = await h.post("/v1/requests/check/lookup", {"keys": sorted(failed)})
            assert r.json()["results"] == ["miss"] * len(failed)
        await h.client.delete("/v1/requests/check")
        blocks = await counts(h)
        assert (blocks["pinned"], blocks["pending"]) == (0, 0), blocks
        assert (await h.admin.get("/admin/v1/stats")).json()["live_requests"] == 0


async def test_an_admin_release_cannot_let_a_running_store_overwrite_another_block() -> None:
    """Offload (its job starts 0.5 s late), release the request from the admin API, store
    another key through the mapped pool into the freed slot: that key must keep its bytes."""
    async with running(make_settings(fault_delay_s=0.5, num_blocks=4)) as h:
        dev, cache_id = await h.device(4)
        dev.fill(0, seed=0xAAAA)
        await h.start("victim")
        await h.start("other")
        r = await h.post(
            "/v1/requests/victim/offload",
            {"cache_id": cache_id, "keys": hexkeys(1), "device_blocks": [0]},
        )
        assert r.json()["state"] == "running"
        assert (await h.admin.post("/admin/v1/requests/victim/release")).status_code == 200
        spec = (await h.post("/v1/requests/other/prepare-store", {"keys": hexkeys(2)})).json()
        own = bytes([0xBB]) * h.settings.block_bytes
        pool = h.service.transfers().pool
        pool.tensor[spec["slots"][0]] = pool.tensor.new_tensor(list(own))
        await h.post("/v1/requests/other/complete-store", {"keys": hexkeys(2)})
        await asyncio.sleep(0.8)  # the released request's job has run by now
        r = await h.post(
            "/v1/requests/other/onload",
            {"cache_id": cache_id, "keys": hexkeys(2), "device_blocks": [3]},
        )
        assert (await h.wait(r.json()["job_id"]))["state"] == "done"
        assert dev.read(3) == own


async def test_a_vanished_request_holding_nothing_is_forgotten() -> None:
    """A request started and looked up, then never heard of again, is gone after a few lease
    TTLs like one that held leases."""
    settings_ = make_settings(lease_ttl_s=0.3, job_deadline_s=0.1, lease_check_interval_s=0.05)
    async with running(settings_) as h:
        await h.start("ghost")
        await h.post("/v1/requests/ghost/lookup", {"keys": hexkeys(1, 2, 3)})
        await asyncio.sleep(1.5)
        stats = (await h.admin.get("/admin/v1/stats")).json()
        assert stats["live_requests"] == 0
