"""JobTracker wired to the real offload manager: completions, failures, pins, records."""

from __future__ import annotations

import time

import pytest
import torch

from manager import LookupResult, OffloadManager, ReqContext, create_manager
from tests.transfer.helpers import ShmCache, mixed_block_bytes
from testsupport.kvref import host_block
from transfer import (
    FaultSpec,
    InvalidJobError,
    JobRecord,
    JobTracker,
    KVCacheRegistry,
    UnknownCacheError,
    create_worker,
)

N = 24
SLOTS = 16
HIT, MISS = LookupResult.HIT, LookupResult.MISS


@pytest.fixture
def world(make_pool, shm_cache):
    pool = make_pool(SLOTS, mixed_block_bytes(N), pin=False)
    registry = KVCacheRegistry(pool)
    cache = shm_cache(registry, N)
    manager = create_manager(num_blocks=SLOTS)
    workers = []

    def tracker(faults: FaultSpec | None = None, **kwargs) -> JobTracker:
        w = create_worker(pool, registry, "cpu", faults=faults, copy_threads=1)
        workers.append(w)
        return JobTracker(w, manager, **kwargs)

    yield pool, cache, manager, tracker
    for w in workers:
        w.shutdown(timeout=5)


def keys(*ids: int) -> list[bytes]:
    return [i.to_bytes(4, "big") for i in ids]


def settle(tracker: JobTracker, records: list[JobRecord], timeout: float = 10) -> None:
    """Poll until every record has left the running state."""
    end = time.monotonic() + timeout
    while any(r.state == "running" for r in records):
        assert time.monotonic() < end, "jobs did not finish"
        tracker.poll()
        time.sleep(0.002)


def offload(
    manager: OffloadManager,
    tracker: JobTracker,
    cache: ShmCache,
    ctx: ReqContext,
    ks: list[bytes],
    device_blocks: list[int],
    deadline_s: float = 10.0,
) -> JobRecord:
    out = manager.prepare_store(ks, ctx)
    assert out is not None
    return tracker.submit(
        "store", ctx, cache.cache.cache_id, out.keys_to_store, device_blocks, out.slots, deadline_s
    )


def test_store_and_load_complete_against_the_manager(world) -> None:
    pool, cache, manager, make_tracker = world
    tracker = make_tracker()
    ctx = ReqContext("r1")
    manager.on_new_request(ctx)
    ks = keys(1, 2, 3)
    rec = offload(manager, tracker, cache, ctx, ks, [5, 6, 7])
    assert (rec.state, rec.req_id, rec.direction, rec.keys) == ("running", "r1", "store", ks)
    assert tracker.get(rec.job_id) is rec
    assert tracker.running() == [rec]
    assert manager.lookup(ks, ctx).results == [LookupResult.PENDING] * 3
    settle(tracker, [rec])
    assert rec.state == "done"
    assert rec.reason is None
    assert rec.bytes == 3 * pool.block_bytes
    assert manager.lookup(ks, ctx).results == [HIT] * 3
    slots = manager.prepare_load(ks, ctx)
    for s, b in zip(slots, [5, 6, 7], strict=True):
        assert torch.equal(pool.tensor[s], host_block(cache.flats, cache.layout, b))
    for flat in cache.flats:
        flat.zero_()
    load = tracker.submit("load", ctx, cache.cache.cache_id, ks, [10, 11, 12], slots, 10.0)
    assert manager.stats().pinned == 3
    settle(tracker, [load])
    assert load.state == "done"
    assert manager.stats().pinned == 0
    assert torch.equal(
        host_block(cache.flats, cache.layout, 10), host_block(cache.originals, cache.layout, 5)
    )
    assert tracker.running() == []
    assert tracker.oldest_running_age() == 0.0


def test_failed_store_drops_its_blocks(world) -> None:
    _pool, cache, manager, make_tracker = world
    tracker = make_tracker(FaultSpec(fail_rate=1.0))
    ctx = ReqContext("r1")
    manager.on_new_request(ctx)
    rec = offload(manager, tracker, cache, ctx, keys(1, 2), [0, 1])
    settle(tracker, [rec])
    assert (rec.state, rec.reason, rec.bytes) == ("failed", "injected failure", 0)
    assert manager.lookup(keys(1, 2), ctx).results == [MISS, MISS]
    stats = manager.stats()
    assert (stats.free, stats.pending, stats.ready) == (SLOTS, 0, 0)


def test_hung_store_fails_at_its_deadline_and_drops_its_blocks(world) -> None:
    _pool, cache, manager, make_tracker = world
    tracker = make_tracker(FaultSpec(hang_rate=1.0))
    ctx = ReqContext("r1")
    manager.on_new_request(ctx)
    rec = offload(manager, tracker, cache, ctx, keys(1), [0], deadline_s=0.1)
    assert tracker.oldest_running_age() >= 0.0
    settle(tracker, [rec])
    assert (rec.state, rec.reason) == ("failed", "deadline")
    assert manager.stats().free == SLOTS


def prepare_ready(
    manager: OffloadManager, tracker: JobTracker, cache: ShmCache, ctx: ReqContext, ks: list[bytes]
) -> list[int]:
    rec = offload(manager, tracker, cache, ctx, ks, list(range(len(ks))))
    settle(tracker, [rec])
    assert rec.state == "done"
    return manager.prepare_load(ks, ctx)


@pytest.mark.parametrize("faults", [FaultSpec(fail_rate=1.0), FaultSpec(hang_rate=1.0)])
def test_failed_load_leaves_no_pin(world, faults) -> None:
    _pool, cache, manager, make_tracker = world
    good = make_tracker()
    bad = make_tracker(faults)
    ctx = ReqContext("r1")
    manager.on_new_request(ctx)
    ks = keys(1, 2, 3)
    slots = prepare_ready(manager, good, cache, ctx, ks)
    assert manager.stats().pinned == 3
    rec = bad.submit("load", ctx, cache.cache.cache_id, ks, [4, 5, 6], slots, 0.1)
    settle(bad, [rec])
    assert rec.state == "failed"
    assert manager.stats().pinned == 0
    assert all(not r.pins for r in manager.requests())
    assert manager.lookup(ks, ctx).results == [HIT] * 3  # the blocks themselves survive


def test_refused_submit_completes_against_the_manager(world) -> None:
    _pool, cache, manager, make_tracker = world
    tracker = make_tracker()
    ctx = ReqContext("r1")
    manager.on_new_request(ctx)
    out = manager.prepare_store(keys(1, 2), ctx)
    assert out is not None
    with pytest.raises(InvalidJobError, match="out of range"):
        tracker.submit("store", ctx, cache.cache.cache_id, out.keys_to_store, [0, N], out.slots, 5)
    assert manager.stats().free == SLOTS  # the pending store was dropped
    ks = keys(3)
    slots = prepare_ready(manager, tracker, cache, ctx, ks)
    with pytest.raises(UnknownCacheError):
        tracker.submit("load", ctx, "kvc-gone", ks, [0], slots, 5)
    assert manager.stats().pinned == 0  # the pin was released
    with pytest.raises(InvalidJobError, match="keys and host_slots differ"):
        tracker.submit("store", ctx, cache.cache.cache_id, keys(9), [0, 1], [0, 1], 5)
    assert tracker.running() == []


def test_shutdown_with_jobs_in_flight_completes_them_all(world) -> None:
    _pool, cache, manager, make_tracker = world
    tracker = make_tracker(FaultSpec(hang_rate=1.0))
    ctx = ReqContext("r1")
    manager.on_new_request(ctx)
    recs = [offload(manager, tracker, cache, ctx, keys(i), [i], deadline_s=60) for i in range(4)]
    tracker.worker.shutdown(timeout=1)
    done = tracker.poll()
    assert sorted(r.job_id for r in done) == sorted(r.job_id for r in recs)
    assert {(r.state, r.reason) for r in recs} == {("failed", "shutdown")}
    assert manager.stats().free == SLOTS


def test_sink_errors_are_counted_not_raised_and_logged_without_the_req_id(
    world, caplog: pytest.LogCaptureFixture
) -> None:
    _pool, cache, manager, make_tracker = world
    tracker = make_tracker()
    ctx = ReqContext("r1\n<engine-secret>")
    manager.on_new_request(ctx)
    ks = keys(1)
    slots = prepare_ready(manager, tracker, cache, ctx, ks)
    rec = tracker.submit("load", ctx, cache.cache.cache_id, ks, [3], slots, 10.0)
    manager.on_request_finished(ctx, abort=True)  # releases the pin under the running load
    settle(tracker, [rec])
    assert rec.state == "done"
    assert tracker.sink_errors == 1
    assert manager.stats().pinned == 0
    logged = [r.getMessage() for r in caplog.records if "completing" in r.getMessage()]
    assert logged == [f"completing load job {rec.job_id} failed: UnknownRequestError"]


def test_finished_records_are_bounded_lru(world) -> None:
    _pool, cache, manager, make_tracker = world
    tracker = make_tracker(max_finished=3)
    ctx = ReqContext("r1")
    manager.on_new_request(ctx)
    recs = []
    for i in range(5):
        rec = offload(manager, tracker, cache, ctx, keys(i), [i])
        settle(tracker, [rec])
        recs.append(rec)
    assert [tracker.get(r.job_id) for r in recs[:2]] == [None, None]
    assert tracker.get(recs[2].job_id) is recs[2]  # touched: now the most recent
    rec = offload(manager, tracker, cache, ctx, keys(9), [9])
    settle(tracker, [rec])
    assert tracker.get(recs[2].job_id) is recs[2]
    assert tracker.get(recs[3].job_id) is None
    with pytest.raises(ValueError, match="max_finished must be positive"):
        JobTracker(tracker.worker, manager, max_finished=0)


# --------------------------------------------------------------------------- deferred loads


def test_a_deferred_load_copies_part_by_part_and_ends_with_its_last_part(world) -> None:
    pool, cache, manager, make_tracker = world
    tracker = make_tracker()
    ctx = ReqContext("r1")
    manager.on_new_request(ctx)
    ks = keys(1, 2, 3, 4)
    slots = prepare_ready(manager, tracker, cache, ctx, ks)
    manager.complete_load(ks, ctx)
    for flat in cache.flats:
        flat.zero_()
    rec = tracker.defer(ctx, cache.cache.cache_id, ks)
    assert tracker.running() == [rec]
    # First part: keys 1 and 2. Its copy ends, yet the load runs on: a part is still to come.
    manager.prepare_load(ks[:2], ctx)
    assert tracker.launch(rec, ks[:2], [10, 11], slots[:2], 10.0, last=False)
    end = time.monotonic() + 10
    while manager.stats().pinned:
        assert time.monotonic() < end
        assert tracker.poll() == []
        time.sleep(0.002)
    assert rec.state == "running"
    assert torch.equal(pool.tensor[slots[0]], host_block(cache.flats, cache.layout, 10))
    # The last part: keys 3 and 4; the load is done with both parts' bytes.
    manager.prepare_load(ks[2:], ctx)
    assert tracker.launch(rec, ks[2:], [12, 13], slots[2:], 10.0, last=True)
    settle(tracker, [rec])
    assert (rec.state, rec.reason, rec.bytes) == ("done", None, 4 * pool.block_bytes)
    assert manager.stats().pinned == 0
    for s, b in zip(slots, [10, 11, 12, 13], strict=True):
        assert torch.equal(pool.tensor[s], host_block(cache.flats, cache.layout, b))
    assert tracker.get(rec.job_id) is rec
    assert tracker.running() == []


def test_a_failed_part_fails_the_deferred_load_and_later_parts_are_unpinned(world) -> None:
    _pool, cache, manager, make_tracker = world
    good = make_tracker()
    bad = make_tracker(FaultSpec(fail_rate=1.0))
    ctx = ReqContext("r1")
    manager.on_new_request(ctx)
    ks = keys(1, 2, 3)
    slots = prepare_ready(manager, good, cache, ctx, ks)
    manager.complete_load(ks[1:], ctx)  # key 1 stays pinned: the first part's
    rec = bad.defer(ctx, cache.cache.cache_id, ks)
    assert bad.launch(rec, ks[:1], [10], slots[:1], 10.0, last=False)
    settle(bad, [rec])
    assert rec.state == "failed"
    assert rec.reason
    assert manager.stats().pinned == 0
    # A part launched after the failure is not copied: its pins go back at once.
    manager.prepare_load(ks[1:], ctx)
    assert not bad.launch(rec, ks[1:], [11, 12], slots[1:], 10.0, last=True)
    assert manager.stats().pinned == 0
    assert bad.failed(rec)
    assert bad.poll() == []


def test_fail_waits_for_the_part_still_copying(world) -> None:
    _pool, cache, manager, make_tracker = world
    slow = make_tracker(FaultSpec(delay_s=0.3))
    ctx = ReqContext("r1")
    manager.on_new_request(ctx)
    ks = keys(1, 2)
    slots = prepare_ready(manager, slow, cache, ctx, ks)
    manager.complete_load(ks[1:], ctx)
    rec = slow.defer(ctx, cache.cache.cache_id, ks)
    assert slow.launch(rec, ks[:1], [10], slots[:1], 10.0, last=False)
    slow.fail(rec, "key 2 could not be brought in")
    # The copy of key 1 may still write into the engine's block: the load is still running.
    assert rec.state == "running"
    assert slow.poll() == []
    settle(slow, [rec])
    assert (rec.state, rec.reason) == ("failed", "key 2 could not be brought in")
    assert manager.stats().pinned == 0


def test_a_deferred_load_failed_before_any_copy_ends_at_the_next_poll(world) -> None:
    _pool, cache, manager, make_tracker = world
    tracker = make_tracker()
    ctx = ReqContext("r1")
    manager.on_new_request(ctx)
    rec = tracker.defer(ctx, cache.cache.cache_id, keys(1))
    tracker.fail(rec, "not loadable after promotion")
    assert rec.state == "failed"
    assert tracker.poll() == [rec]
    assert tracker.running() == []
