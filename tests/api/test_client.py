"""The async engine client, in process (the sync client runs against a live server in e2e)."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from kvoffload_client.client import AsyncKVOffloadClient, Batch, KVOffloadError

from testsupport.api_harness import Harness
from testsupport.polling import until_async

pytestmark = pytest.mark.anyio


async def test_async_client_covers_a_request_life(h: Harness) -> None:
    dev, _ = await h.device(8)
    async with AsyncKVOffloadClient("http://engine", transport=httpx.ASGITransport(h.app)) as c:
        assert await c.ready()
        cache = await c.register_kv_cache(dev.spec())
        assert [x.cache_id for x in await c.kv_caches()] == [cache.cache_id]
        assert (await c.pool()).num_blocks == h.settings.num_blocks
        assert await c.start_request("r1", {"x": 1}) is True
        keys = [b"\x01" * 8, b"\x02" * 8]
        assert (await c.lookup("r1", keys)).results == ["miss", "miss"]
        written = [dev.fill(b, seed=b + 7) for b in range(2)]
        started = await c.offload("r1", cache.cache_id, keys, [0, 1])
        assert started.keys_to_store == keys
        assert started.job_id is not None
        waited = await c.wait_jobs([started.job_id], timeout_s=5)
        assert waited.done
        assert waited.jobs[0].state == "done"
        assert (await c.lookup("r1", keys)).hit_prefix == 2
        loaded = await c.onload("r1", cache.cache_id, keys, [4, 5])
        assert loaded.job_id is not None
        assert (await c.job(loaded.job_id)).direction == "load"
        await c.wait_jobs([loaded.job_id])
        assert [dev.read(4), dev.read(5)] == written

        spec = await c.prepare_store("r1", [b"\x03"])
        assert spec.keys_to_store == [b"\x03"]
        done = await c.complete_store("r1", [b"\x03"])
        assert done.completed == [b"\x03"]
        assert len(await c.prepare_load("r1", [b"\x03"])) == 1
        await c.complete_load("r1", [b"\x03"])
        await c.touch("r1", keys)
        page = await c.events()
        assert [e.type for e in page.events] == ["BlockStored", "BlockStored"]
        assert page.events[0].block_hashes == keys

        results = await c.batch(
            Batch().lookup("r1", keys).lookup("ghost", keys).prepare_load("r1", [b"\x09"])
        )
        assert [r.status for r in results] == [200, 404, 409]
        assert results[1].error is not None
        assert results[1].error.code == "unknown_request"

        released = await c.finish_request("r1")
        assert released.pins_released == 0
        await c.unregister_kv_cache(cache.cache_id)
        with pytest.raises(KVOffloadError) as info:
            await c.lookup("r1", keys)
        assert (info.value.status, info.value.code) == (404, "unknown_request")
        with pytest.raises(KVOffloadError) as info:
            await c.job(999)
        assert info.value.code == "unknown_job"


async def test_async_client_renews_a_lease_until_unregistered_or_gone(h: Harness) -> None:
    await h.start()
    dev, _ = await h.device(8)
    renewals: list[str] = []

    class Counting(httpx.ASGITransport):
        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            if request.url.path.endswith("/renew"):
                renewals.append(request.url.path)
            return await super().handle_async_request(request)

    async with AsyncKVOffloadClient("http://engine", transport=Counting(h.app)) as c:
        cache = await c.register_kv_cache(dev.spec(), lease_s=0.3)
        assert c.renewing == [cache.cache_id]
        # Several leases' worth of renewals: the registration is still there.
        await until_async("len(renewals) >= 8", lambda: len(renewals) >= 8)
        assert [x.cache_id for x in await c.kv_caches()] == [cache.cache_id]
        await c.unregister_kv_cache(cache.cache_id)
        assert c.renewing == []
        # Gone behind the client's back: the renewer hears 404 and stops.
        other = await c.register_kv_cache({**dev.spec(), "name": "other"}, lease_s=0.3)
        r = await h.client.delete(f"/v1/kv-caches/{other.cache_id}")
        assert r.status_code in (200, 204), r.text
        await until_async("c.renewing == []", lambda: c.renewing == [])
        # Without renew the lease lapses; aclose stops a renewer still running.
        kept = await c.register_kv_cache({**dev.spec(), "name": "kept"}, lease_s=30.0)
        lapsing = await c.register_kv_cache({**dev.spec(), "name": "l"}, lease_s=0.2, renew=False)
        assert c.renewing == [kept.cache_id]

        async def lapsed() -> bool:
            return lapsing.cache_id not in [x.cache_id for x in await c.kv_caches()]

        for _ in range(1000):
            if await lapsed():
                break
            await asyncio.sleep(0.01)
        assert await lapsed()
    assert c.renewing == []
