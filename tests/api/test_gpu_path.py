"""The GPU path's service rules, shown on the CPU backend: ``wait_event`` refused for a CPU
cache, registration leases (renew, lapse), and a transfer backend that failed for good."""

from __future__ import annotations

import pytest

from testsupport.api_harness import Harness, hexkeys
from testsupport.polling import until_async
from testsupport.shm_device import ShmDevice
from transfer.cpu_worker import CpuTransferWorker

pytestmark = pytest.mark.anyio

EVENT = {"kind": "cuda_ipc_event", "handle": "ab" * 64}


@pytest.mark.parametrize("op", ["offload", "onload"])
async def test_wait_event_is_refused_for_a_cpu_cache(h: Harness, op: str) -> None:
    await h.start()
    _, cache_id = await h.device()
    body = {"cache_id": cache_id, "keys": hexkeys(1), "device_blocks": [0], "wait_event": EVENT}
    r = await h.post(f"/v1/requests/r1/{op}", body)
    assert r.status_code == 422, r.text
    assert "wait_event" in r.json()["error"]["message"]
    r = await h.post("/v1/requests/r1/lookup", {"keys": hexkeys(1)})
    assert r.json()["results"] == ["miss"]  # nothing was reserved


async def test_a_malformed_wait_event_is_a_422(h: Harness) -> None:
    await h.start()
    _, cache_id = await h.device()
    bad = {"kind": "cuda_ipc_event", "handle": "zz"}
    body = {"cache_id": cache_id, "keys": hexkeys(1), "device_blocks": [0], "wait_event": bad}
    r = await h.post("/v1/requests/r1/offload", body)
    assert r.status_code == 422
    assert "wait_event" in r.text


async def test_a_lease_renewed_lives_and_a_lapsed_one_is_gone(h: Harness) -> None:
    await h.start()
    dev, cache_id = await h.device()
    r = await h.post("/v1/kv-caches", {**dev.spec(), "name": "leased", "lease_s": 0.3})
    assert r.status_code == 201, r.text
    leased = r.json()["cache_id"]
    r = await h.client.post(f"/v1/kv-caches/{leased}/renew")
    assert r.status_code == 200
    assert r.json() == {"cache_id": leased, "lease_s": 0.3}

    async def gone() -> bool:
        r = await h.client.get("/v1/kv-caches")
        return leased not in [c["cache_id"] for c in r.json()["kv_caches"]]

    await until_async("gone", gone)
    r = await h.client.get("/v1/kv-caches")
    assert [c["cache_id"] for c in r.json()["kv_caches"]] == [cache_id]  # no lease: stays
    body = {"cache_id": leased, "keys": hexkeys(1), "device_blocks": [0]}
    r = await h.post("/v1/requests/r1/offload", body)
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "unknown_cache"
    r = await h.client.post(f"/v1/kv-caches/{leased}/renew")
    assert r.status_code == 404


async def test_a_backend_failed_for_good_is_not_ready_and_asks_for_a_restart(
    h: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    asked: list[str] = []
    h.service.on_fatal = asked.append
    reason = "copy failed: CUDA error: an illegal memory access was encountered"
    monkeypatch.setattr(CpuTransferWorker, "fatal", property(lambda self: reason))

    async def told() -> bool:
        return bool(asked)

    await until_async("told", told)
    assert asked == [reason]
    r = await h.client.get("/readyz")
    assert r.status_code == 503
    assert "restart needed" in r.text
    # No new registration: mapping memory in a lost context fails, and freeing what was
    # mapped would abort the process.
    dev = ShmDevice(4, h.settings.block_bytes)
    h.devices.append(dev)
    r = await h.post("/v1/kv-caches", dev.spec())
    assert r.status_code == 503, r.text
    assert "restart needed" in r.text
