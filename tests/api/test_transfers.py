"""offload / onload through the transfer worker, jobs, KV-cache registration, the pool."""

from __future__ import annotations

import pytest

from testsupport.api_harness import Harness, hexkeys, make_settings, running

pytestmark = pytest.mark.anyio


async def test_offload_then_onload_moves_the_bytes(h: Harness) -> None:
    await h.start()
    dev, cache_id = await h.device(16)
    keys = hexkeys(1, 2, 3, 4)
    written = [dev.fill(b, seed=100 + b) for b in range(4)]

    r = await h.post(
        "/v1/requests/r1/offload",
        {"cache_id": cache_id, "keys": keys, "device_blocks": [0, 1, 2, 3]},
    )
    assert r.status_code == 202, r.text
    started = r.json()
    assert started["keys_to_store"] == keys
    assert started["state"] in ("running", "done")
    job = await h.wait(started["job_id"])
    assert job["state"] == "done"
    assert job["direction"] == "store"
    assert job["bytes"] == 4 * h.settings.block_bytes
    assert job["num_keys"] == 4

    r = await h.post("/v1/requests/r1/lookup", {"keys": keys})
    assert r.json() == {"results": ["hit"] * 4, "hit_prefix": 4}

    r = await h.post(
        "/v1/requests/r1/onload",
        {"cache_id": cache_id, "keys": keys, "device_blocks": [8, 9, 10, 11]},
    )
    assert r.status_code == 202, r.text
    job = await h.wait(r.json()["job_id"])
    assert job["state"] == "done"
    assert [dev.read(b) for b in (8, 9, 10, 11)] == written
    # complete_load ran when the job ended: nothing stays pinned.
    r = await h.admin.get("/admin/v1/stats")
    assert r.json()["blocks"]["pinned"] == 0

    r = await h.client.get(f"/v1/jobs/{job['job_id']}")
    assert r.status_code == 200
    assert r.json() == job


async def test_offload_moves_only_keys_not_yet_stored(h: Harness) -> None:
    await h.start()
    _, cache_id = await h.device()
    first = await h.post(
        "/v1/requests/r1/offload",
        {"cache_id": cache_id, "keys": hexkeys(1, 2), "device_blocks": [0, 1]},
    )
    await h.wait(first.json()["job_id"])
    r = await h.post(
        "/v1/requests/r1/offload",
        {"cache_id": cache_id, "keys": hexkeys(1, 2, 3), "device_blocks": [0, 1, 2]},
    )
    assert r.json()["keys_to_store"] == hexkeys(3)
    await h.wait(r.json()["job_id"])
    r = await h.post(
        "/v1/requests/r1/offload",
        {"cache_id": cache_id, "keys": hexkeys(1, 3), "device_blocks": [0, 2]},
    )
    assert r.status_code == 202
    assert r.json() == {
        "job_id": None,
        "state": "done",
        "keys_to_store": [],
        "evicted_keys": [],
        "skipped_keys": [],
    }


async def test_onload_of_missing_key_is_409_and_pins_nothing(h: Harness) -> None:
    await h.start()
    _, cache_id = await h.device()
    r = await h.post(
        "/v1/requests/r1/onload", {"cache_id": cache_id, "keys": hexkeys(5), "device_blocks": [0]}
    )
    assert r.status_code == 409
    assert r.json()["error"]["code"] == "key_not_ready"
    r = await h.admin.get("/admin/v1/stats")
    assert r.json()["blocks"]["pinned"] == 0


@pytest.mark.parametrize("op", ["offload", "onload"])
async def test_unknown_cache_is_404(h: Harness, op: str) -> None:
    await h.start()
    r = await h.post(
        f"/v1/requests/r1/{op}", {"cache_id": "nope", "keys": hexkeys(1), "device_blocks": [0]}
    )
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "unknown_cache"


async def test_device_block_out_of_range_is_422_and_changes_nothing(h: Harness) -> None:
    await h.start()
    _, cache_id = await h.device(4)
    r = await h.post(
        "/v1/requests/r1/offload",
        {"cache_id": cache_id, "keys": hexkeys(1, 2), "device_blocks": [0, 4]},
    )
    assert r.status_code == 422
    assert "out of range" in r.json()["error"]["message"]
    stats = (await h.admin.get("/admin/v1/stats")).json()
    assert stats["blocks"]["pending"] == 0
    assert stats["blocks"]["free"] == h.settings.num_blocks


async def test_duplicate_destination_is_refused_and_reservation_undone(h: Harness) -> None:
    """A load writing one device block twice is refused by the worker at submit time."""
    await h.start()
    _, cache_id = await h.device()
    r = await h.post(
        "/v1/requests/r1/offload",
        {"cache_id": cache_id, "keys": hexkeys(1, 2), "device_blocks": [0, 1]},
    )
    await h.wait(r.json()["job_id"])
    r = await h.post(
        "/v1/requests/r1/onload",
        {"cache_id": cache_id, "keys": hexkeys(1, 2), "device_blocks": [3, 3]},
    )
    assert r.status_code == 422
    assert r.json()["error"]["code"] == "invalid_job"
    stats = (await h.admin.get("/admin/v1/stats")).json()
    assert stats["blocks"]["pinned"] == 0


async def test_offload_without_room_is_507(h: Harness) -> None:
    await h.start()
    _, cache_id = await h.device(64)
    n = h.settings.num_blocks
    await h.post("/v1/requests/r1/prepare-store", {"keys": hexkeys(*range(n))})
    r = await h.post(
        "/v1/requests/r1/offload",
        {"cache_id": cache_id, "keys": hexkeys(999), "device_blocks": [0]},
    )
    assert r.status_code == 507


async def test_failed_transfer_fails_the_job_and_drops_the_blocks() -> None:
    async with running(make_settings(fault_fail_rate=1.0, fault_seed=1)) as h:
        await h.start()
        _, cache_id = await h.device()
        r = await h.post(
            "/v1/requests/r1/offload",
            {"cache_id": cache_id, "keys": hexkeys(1, 2), "device_blocks": [0, 1]},
        )
        job = await h.wait(r.json()["job_id"])
        assert job["state"] == "failed"
        assert job["reason"]
        assert job["bytes"] == 0
        r = await h.post("/v1/requests/r1/lookup", {"keys": hexkeys(1, 2)})
        assert r.json()["results"] == ["miss", "miss"]
        stats = (await h.admin.get("/admin/v1/stats")).json()
        assert stats["blocks"]["free"] == h.settings.num_blocks


async def test_jobs_wait_is_bounded_and_reports_running() -> None:
    settings = make_settings(fault_delay_s=1.0, job_deadline_s=5.0)
    async with running(settings) as h:
        await h.start()
        _, cache_id = await h.device()
        r = await h.post(
            "/v1/requests/r1/offload",
            {"cache_id": cache_id, "keys": hexkeys(1), "device_blocks": [0]},
        )
        job_id = r.json()["job_id"]
        r = await h.post("/v1/jobs/wait", {"job_ids": [job_id], "timeout_s": 0.05})
        assert r.status_code == 200
        assert r.json()["done"] is False
        assert r.json()["jobs"][0]["state"] == "running"
        r = await h.post("/v1/requests/r1/lookup", {"keys": hexkeys(1)})
        assert r.json()["results"] == ["pending"]
        job = await h.wait(job_id)
        assert job["state"] == "done"


async def test_unknown_job_is_404(h: Harness) -> None:
    r = await h.client.get("/v1/jobs/12345")
    assert (r.status_code, r.json()["error"]["code"]) == (404, "unknown_job")
    r = await h.post("/v1/jobs/wait", {"job_ids": [12345], "timeout_s": 0})
    assert r.status_code == 404
    r = await h.client.get("/v1/jobs/abc")
    assert r.status_code == 422
    r = await h.post("/v1/jobs/wait", {"job_ids": [], "timeout_s": 0})
    assert r.status_code == 422


async def test_registration_errors_are_422(h: Harness) -> None:
    dev, _ = await h.device(4)
    wrong_size = dev.spec()
    wrong_size["tensors"][0]["shape"] = [4, 100]
    r = await h.post("/v1/kv-caches", wrong_size)
    assert r.status_code == 422
    err = r.json()["error"]
    assert err["code"] == "invalid_registration"
    assert "200" in err["message"]
    assert str(h.settings.block_bytes) in err["message"]

    outside = dev.spec()
    outside["tensors"][0]["handle"]["path"] = "/etc/passwd"
    r = await h.post("/v1/kv-caches", outside)
    assert (r.status_code, r.json()["error"]["code"]) == (422, "invalid_registration")

    bad_kind = dev.spec()
    bad_kind["tensors"][0]["handle"] = {"kind": "floppy"}
    r = await h.post("/v1/kv-caches", bad_kind)
    assert (r.status_code, r.json()["error"]["code"]) == (422, "invalid_field")

    r = await h.post("/v1/kv-caches", {"name": "x", "device": "cpu", "tensors": []})
    assert r.status_code == 422


async def test_kv_caches_list_and_unregister(h: Harness) -> None:
    dev, cache_id = await h.device(4)
    r = await h.client.get("/v1/kv-caches")
    assert r.json() == {
        "kv_caches": [
            {
                "cache_id": cache_id,
                "name": dev.name,
                "block_bytes": h.settings.block_bytes,
                "num_blocks": 4,
                "device": "cpu",
            }
        ]
    }
    r = await h.client.delete(f"/v1/kv-caches/{cache_id}")
    assert r.status_code == 204
    r = await h.client.delete(f"/v1/kv-caches/{cache_id}")
    assert (r.status_code, r.json()["error"]["code"]) == (404, "unknown_cache")


async def test_pool_layout(h: Harness) -> None:
    r = await h.client.get("/v1/pool")
    assert r.status_code == 200
    pool = r.json()
    assert pool["num_blocks"] == h.settings.num_blocks
    assert pool["block_bytes"] == h.settings.block_bytes
    assert pool["pinned"] is False
    assert pool["path"].startswith("/proc/")
    assert pool["max_keys_per_call"] == h.settings.max_keys_per_call
