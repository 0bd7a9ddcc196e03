"""kvoffload's pool as the engine's only host tier (``kvoffload_client.vllm.direct``): the
scheduler side, ``KVOffloadManager``, called as vLLM 0.33's connector calls it, against a real
``kvoffload serve``. The worker's copies run in real engines (``tests/engine``).

A block's bytes are written into (and read from) the pool mapped here, where vLLM's worker
would copy them from (into) the engine's KV cache.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from kvoffload_client.attach import MappedPool, map_pool
from kvoffload_client.client import KVOffloadAdminClient, KVOffloadClient
from kvoffload_client.vllm.direct import KVOffloadManager, KVOffloadSpec, PoolSlots, Settings
from kvoffload_client.vllm.state import M_CALLS, M_FAULTS, M_STORES_DROPPED
from vllm.v1.kv_offload.base import LookupResult, OffloadKey, ReqContext, ScheduleEndContext

from tests.vllm.conftest import leases, serve, tracked
from testsupport.server import TOKEN, ServerProcess
from testsupport.vllm_sim import chunk_bytes, keys_of, offloading_config

HIT, MISS, RETRY = LookupResult.HIT, LookupResult.MISS, LookupResult.RETRY
END = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())


def spec(srv: ServerProcess, **keys: object) -> KVOffloadSpec:
    extra = {
        "spec_name": "KVOffloadSpec",
        "spec_module_path": "kvoffload_client.vllm.direct",
        "url": f"unix://{srv.uds}",
        "retry_interval_s": 0.05,
        **keys,
    }
    return KVOffloadSpec(offloading_config(f"t-direct-{id(extra)}", extra))


def mapped(srv: ServerProcess) -> MappedPool:
    with KVOffloadClient(uds=str(srv.uds)) as client:
        return map_pool(client, f"{srv.uds}.pool", timeout_s=5.0)


def ctx(req_id: str) -> ReqContext:
    return ReqContext(req_id=req_id, kv_transfer_params=None)


def store(manager: KVOffloadManager, pool: MappedPool, req_id: str, keys: list[OffloadKey]) -> None:
    """Store ``keys`` as vLLM's connector does: reserve, copy (here: write the bytes into the
    mapped pool), complete, finish, and the step's end sends the completions."""
    out = manager.prepare_store(keys, ctx(req_id))
    assert out is not None
    assert isinstance(out.store_spec, PoolSlots)
    for key, slot in zip(out.keys_to_store, out.store_spec.block_ids, strict=True):
        pool.blocks[slot] = list(chunk_bytes(bytes(key)))
    manager.complete_store(out.keys_to_store, ctx(req_id))
    manager.on_request_finished(ctx(req_id))
    manager.on_schedule_end(END)
    assert not manager.has_pending_work()


def look(manager: KVOffloadManager, req_id: str, keys: list[OffloadKey]) -> list[LookupResult]:
    """vLLM's prefix scan (RETRY scans on, MISS stops), the step's end, and the scan again."""
    for key in keys:
        if manager.lookup(key, ctx(req_id)) is MISS:
            break
    manager.on_schedule_end(END)
    answers = []
    for key in keys:
        answers.append(manager.lookup(key, ctx(req_id)))
        if answers[-1] is MISS:
            break
    return answers


def pins(srv: ServerProcess, req_id: str) -> int:
    with KVOffloadAdminClient(srv.admin_url, token=TOKEN) as admin:
        requests = admin.requests()["requests"]
    return sum(len(r["pins"]) for r in requests if r["req_id"] == req_id)


@pytest.fixture
def srv(tmp_path: Path) -> Iterator[ServerProcess]:
    with serve(tmp_path).serving() as s:
        yield s


def test_a_hit_is_answered_only_once_pinned_and_loads_the_stored_bytes(
    srv: ServerProcess,
) -> None:
    keys = keys_of(range(10, 18))
    pool = mapped(srv)
    writer, reader = spec(srv).get_manager(), spec(srv).get_manager()
    try:
        store(writer, pool, "w-1", keys)
        assert [reader.lookup(k, ctx("r-1")) for k in keys] == [RETRY] * len(keys)
        assert pins(srv, "r-1") == 0
        reader.on_schedule_end(END)
        assert pins(srv, "r-1") == len(keys)  # pinned before vLLM hears HIT
        assert [reader.lookup(k, ctx("r-1")) for k in keys] == [HIT] * len(keys)
        spec_ = reader.prepare_load(keys, ctx("r-1"))
        assert [bytes(pool.blocks[s]) for s in spec_.block_ids] == [
            chunk_bytes(bytes(k)) for k in keys
        ]
        assert spec_.pool_id == pool.pool_id
        reader.complete_load(keys, ctx("r-1"))
        reader.on_request_finished(ctx("r-1"))
        reader.on_schedule_end(END)
        assert leases(srv) == []
        assert tracked(srv) == 0
    finally:
        writer.shutdown()
        reader.shutdown()


def test_a_step_with_more_ops_than_one_call_takes_goes_out_in_several(
    srv: ServerProcess,
) -> None:
    keys = [keys_of(range(i * 10, i * 10 + 3)) for i in range(1, 4)]
    pool = mapped(srv)
    manager = spec(srv, max_ops_per_call=2).get_manager()
    try:
        for i, chain in enumerate(keys):
            store(manager, pool, f"w-{i}", chain)
        calls = manager.counters.snapshot()[M_CALLS, "batch"]
        for i, chain in enumerate(keys):  # three requests' lookups in one step
            assert [manager.lookup(k, ctx(f"r-{i}")) for k in chain] == [RETRY] * 3
        manager.on_schedule_end(END)
        # Starts and lookups (6 ops), then the pins (3): 3 + 2 calls of at most 2 ops.
        assert manager.counters.snapshot()[M_CALLS, "batch"] - calls == 5
        for i, chain in enumerate(keys):
            assert [manager.lookup(k, ctx(f"r-{i}")) for k in chain] == [HIT] * 3
            assert pins(srv, f"r-{i}") == 3
    finally:
        manager.shutdown()


def test_a_miss_ends_the_run_and_a_key_not_ready_holds_the_hits_after_it(
    srv: ServerProcess,
) -> None:
    keys = keys_of(range(20, 28))
    pool = mapped(srv)
    manager = spec(srv).get_manager()
    try:
        store(manager, pool, "w-2", keys[:3] + keys[4:])  # all but the fourth
        assert look(manager, "r-2", keys) == [HIT, HIT, HIT, MISS]
        assert pins(srv, "r-2") == 3  # nothing after the miss: vLLM never loads it
        manager.on_request_finished(ctx("r-2"))

        # A key being stored (reserved, not complete) holds back the hits after it.
        held = manager.prepare_store(keys[3:4], ctx("w-3"))
        assert held is not None
        assert look(manager, "r-3", keys) == [HIT, HIT, HIT, RETRY, RETRY, RETRY, RETRY, RETRY]
        assert pins(srv, "r-3") == 3
        for slot, key in zip(held.store_spec.block_ids, held.keys_to_store, strict=True):
            pool.blocks[slot] = list(chunk_bytes(bytes(key)))
        manager.complete_store(held.keys_to_store, ctx("w-3"))
        manager.on_schedule_end(END)  # the completion, then the held keys asked again
        assert [manager.lookup(k, ctx("r-3")) for k in keys] == [HIT] * len(keys)
        assert pins(srv, "r-3") == len(keys)
    finally:
        manager.shutdown()
    assert leases(srv) == []


def test_pins_vllm_does_not_load_are_given_back_at_its_load(srv: ServerProcess) -> None:
    keys = keys_of(range(30, 38))
    pool = mapped(srv)
    manager = spec(srv).get_manager()
    try:
        store(manager, pool, "w-4", keys)
        assert look(manager, "r-4", keys) == [HIT] * len(keys)
        loaded = manager.prepare_load(keys[:5], ctx("r-4"))  # vLLM wants five
        assert len(loaded.block_ids) == 5
        manager.on_schedule_end(END)
        assert pins(srv, "r-4") == 5
        manager.complete_load(keys[:5], ctx("r-4"))
        manager.on_schedule_end(END)
        assert pins(srv, "r-4") == 0
        assert manager.lookup(keys[6], ctx("r-4")) is RETRY  # given back: asked again
    finally:
        manager.shutdown()


def test_a_dead_service_answers_miss_and_refuses_stores_without_a_call_each_step(
    tmp_path: Path,
) -> None:
    keys = keys_of(range(40, 44))
    srv = serve(tmp_path).start()
    manager = spec(srv, retry_interval_s=30.0).get_manager()
    srv.kill()
    assert manager.lookup(keys[0], ctx("r-5")) is RETRY
    manager.on_schedule_end(END)  # the call fails: a fault, and the back-off starts
    assert manager.lookup(keys[0], ctx("r-5")) is MISS
    assert manager.lookup(keys[1], ctx("r-5")) is MISS  # not asked during the back-off
    assert manager.prepare_store(keys, ctx("r-5")) is None
    counts = manager.counters.snapshot()
    assert counts[M_FAULTS, "unreachable"] == 1
    assert counts[M_STORES_DROPPED, ""] == len(keys)
    manager.shutdown()  # no call during the back-off either


def test_after_a_restart_stores_land_in_the_new_pool(srv: ServerProcess) -> None:
    keys = keys_of(range(50, 54))
    manager = spec(srv).get_manager()
    try:
        before = manager.prepare_store(keys[:2], ctx("r-6"))
        assert before is not None
        old_pool = before.store_spec.pool_id
        assert srv.stop() == 0
        srv.start()
        pool = mapped(srv)
        assert pool.pool_id != old_pool
        # The first answer names a new pool: what the old one reserved is gone with it.
        assert manager.prepare_store(keys[2:], ctx("r-6")) is None
        assert manager.counters.snapshot()[M_FAULTS, "restarted"] == 1
        manager.complete_store(before.keys_to_store, ctx("r-6"))  # dropped, not sent
        assert not manager.has_pending_work()
        store(manager, pool, "r-7", keys)
        assert look(manager, "r-8", keys) == [HIT] * len(keys)
        loaded = manager.prepare_load(keys, ctx("r-8"))
        assert loaded.pool_id == pool.pool_id
        assert [bytes(pool.blocks[s]) for s in loaded.block_ids] == [
            chunk_bytes(bytes(k)) for k in keys
        ]
    finally:
        manager.shutdown()


def test_a_restart_takes_back_the_hits_vllm_has_not_loaded(srv: ServerProcess) -> None:
    keys = keys_of(range(60, 64))
    manager = spec(srv).get_manager()
    try:
        store(manager, mapped(srv), "w-9", keys)
        assert look(manager, "r-9", keys) == [HIT] * len(keys)
        assert srv.stop() == 0
        srv.start()
        assert manager.prepare_store(keys_of([65]), ctx("w-10")) is None  # sees the new pool
        # The pins went with the old service: the waiting request asks the new one again.
        assert [manager.lookup(k, ctx("r-9")) for k in keys] == [RETRY] * len(keys)
        manager.on_schedule_end(END)
        assert [manager.lookup(k, ctx("r-9")) for k in keys] == [MISS] * len(keys)  # empty pool
    finally:
        manager.shutdown()


def test_the_pins_of_a_waiting_request_are_renewed(srv: ServerProcess) -> None:
    keys = keys_of(range(70, 74))
    manager = spec(srv, lease_renew_s=0.3).get_manager()

    def idle_s() -> float:
        with KVOffloadAdminClient(srv.admin_url, token=TOKEN) as admin:
            [req] = [r for r in admin.requests()["requests"] if r["req_id"] == "r-11"]
        return float(req["idle_seconds"])

    try:
        store(manager, mapped(srv), "w-11", keys)
        assert look(manager, "r-11", keys) == [HIT] * len(keys)
        time.sleep(0.5)
        assert idle_s() >= 0.5
        manager.on_schedule_end(END)  # a step while the request waits: its pins are touched
        assert idle_s() < 0.3
        assert pins(srv, "r-11") == len(keys)
    finally:
        manager.shutdown()


def test_a_pool_of_another_block_size_refuses_the_engine_s_start(tmp_path: Path) -> None:
    with (
        ServerProcess(tmp_path, "--block-bytes", "8192").serving() as other,
        pytest.raises(ValueError, match="start kvoffload with --block-bytes 4096"),
    ):
        spec(other).get_manager()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"urll": "unix:///x"}, r"unknown key\(s\) \['urll'\]"),
        ({"timeout_s": 0}, "timeout_s must be a number > 0"),
        ({"prefetch_deadline_s": -1}, "prefetch_deadline_s must be a number >= 0"),
        ({"max_ops_per_call": 0}, "max_ops_per_call must be an integer > 0"),
    ],
)
def test_bad_settings_are_refused_by_name(extra: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Settings.of(extra)
