"""Where slots come from and how long an aborted store keeps one.

Slot order: a batch of stores on fresh slots gets one ascending run, which the transfer backends
copy as one piece; a run freed in order comes back as the same run.

Orphaned reservations: an abort drops a request's pending stores but keeps their slots reserved
for the writer, which may still be copying into them. ``expire_requests(writer_deadline=...)``
ends such a reservation once the writer has been silent for the deadline since the drop
(unless the caller says a copy of its own still writes for the request); the request is
forgotten with it, so a late report changes nothing, whatever the slot holds by then.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from manager import (
    CompleteStoreOutput,
    ReleasedLeases,
    ReqContext,
    UnknownRequestError,
    available_policies,
    create_manager,
)
from tests.manager.harness import HIT, MISS, PENDING, Pool, key, keys

DEADLINE = 30.0
LEASE_TTL = 300.0

# ---------------------------------------------------------------------- slot order


@settings(max_examples=60, deadline=None)
@given(
    capacity=st.integers(1, 256),
    data=st.data(),
    policy=st.sampled_from(available_policies()),
)
def test_a_fresh_batch_gets_one_ascending_run(
    capacity: int, data: st.DataObject, policy: str
) -> None:
    n = data.draw(st.integers(1, capacity), label="batch")
    m = create_manager(capacity, policy)
    ctx = ReqContext("r")
    m.on_new_request(ctx)
    out = m.prepare_store(keys(0, n), ctx)
    assert out is not None
    assert out.slots == list(range(n))


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(1, 16), min_size=1, max_size=8), capacity=st.integers(1, 128))
def test_fresh_batches_take_consecutive_runs_and_a_freed_run_comes_back_whole(
    sizes: list[int], capacity: int
) -> None:
    pool = Pool(max(capacity, sum(sizes)), "lru")
    ctx = pool.request()
    start = 0
    runs = []
    for size in sizes:
        out = pool.m.prepare_store(keys(start, start + size), ctx)
        assert out is not None
        assert out.slots == list(range(start, start + size))
        runs.append(out)
        start += size
    # A failed store frees its run; the next batch of that size gets the same run back.
    first = runs[0]
    pool.m.complete_store(first.keys_to_store, ctx, success=False)
    again = pool.m.prepare_store(keys(1000, 1000 + len(first.slots)), ctx)
    assert again is not None
    assert again.slots == first.slots


def test_evicting_a_batch_hands_its_run_out_again_in_order() -> None:
    pool = Pool(8, "lru")
    pool.store(keys(0, 4))
    pool.store(keys(4, 8))
    ctx = pool.request()
    out = pool.m.prepare_store(keys(10, 14), ctx)  # evicts the oldest batch, slots 0..3
    assert out is not None
    assert sorted(out.evicted_keys) == keys(0, 4)
    assert out.slots == [0, 1, 2, 3]


# ---------------------------------------------------------------------- orphaned reservations


def _aborted(pool: Pool, block_keys: list[bytes], req_id: str = "aborted") -> list[int]:
    """A request that offered ``block_keys`` and aborted before its writer reported; the slots."""
    ctx = pool.request(req_id)
    out = pool.m.prepare_store(block_keys, ctx)
    assert out is not None
    released = pool.m.on_request_finished(ctx, abort=True)
    assert released == ReleasedLeases(req_id, 0, len(block_keys))
    return out.slots


def _expire(pool: Pool, writing: frozenset[str] = frozenset()) -> list[ReleasedLeases]:
    return pool.m.expire_requests(LEASE_TTL, writing=writing, writer_deadline=DEADLINE)


def test_an_abort_without_a_report_frees_its_slots_at_the_writer_deadline() -> None:
    pool = Pool(4, "lru")
    slots = _aborted(pool, keys(0, 3))
    s = pool.m.stats()
    assert (s.free, s.pending, s.reserved, s.reservations_expired) == (1, 3, 3, 0)
    [leases] = pool.m.requests()
    assert (leases.reserved_stores, leases.reserved_seconds) == (keys(0, 3), 0.0)
    pool.clock.advance(DEADLINE)
    assert _expire(pool) == []  # at the deadline is not past it
    assert pool.m.requests()[0].reserved_seconds == DEADLINE
    pool.clock.advance(0.5)
    assert _expire(pool) == [ReleasedLeases("aborted", 0, 0, 3)]
    s = pool.m.stats()
    assert (s.free, s.pending, s.reserved, s.reservations_expired) == (4, 0, 0, 3)
    assert (s.live_requests, s.forced_lease_releases) == (0, 0)
    pool.check_accounting()
    # The slots are free again, and handed out in the order they had.
    other = pool.request()
    out = pool.m.prepare_store(keys(10, 14), other)
    assert out is not None
    assert sorted(out.slots[:3]) == sorted(slots)


def test_the_deadline_runs_from_the_abort_and_a_partial_report_does_not_extend_it() -> None:
    pool = Pool(4, "lru")
    _aborted(pool, keys(0, 2))
    pool.clock.advance(20)
    ctx = ReqContext("aborted")
    done = pool.m.complete_store([key(0)], ctx, success=True)
    assert done == CompleteStoreOutput(completed=[], dropped=[key(0)], ignored=[])
    assert pool.m.stats().reserved == 1
    pool.clock.advance(10.5)  # 30.5 s after the abort, 10.5 s after the report
    assert _expire(pool) == [ReleasedLeases("aborted", 0, 0, 1)]
    assert pool.m.stats().reserved == 0


def test_a_request_whose_copy_still_runs_here_keeps_its_reservation_until_the_copy_reports() -> (
    None
):
    pool = Pool(2, "lru")
    _aborted(pool, [key(0)], "job")
    pool.clock.advance(DEADLINE + 1)
    assert _expire(pool, writing=frozenset({"job"})) == []
    assert pool.m.stats().reserved == 1
    # The job ends (it cannot outlive its own deadline) and completes the store: slot freed.
    done = pool.m.complete_store([key(0)], ReqContext("job"), success=True)
    assert done.dropped == [key(0)]
    s = pool.m.stats()
    assert (s.free, s.reserved, s.reservations_expired, s.live_requests) == (2, 0, 0, 0)


def test_without_a_writer_deadline_only_the_lease_ttl_ends_a_reservation() -> None:
    pool = Pool(2, "lru")
    _aborted(pool, [key(0)])
    pool.clock.advance(DEADLINE + 1)
    assert pool.m.expire_requests(LEASE_TTL) == []
    assert pool.m.stats().reserved == 1
    pool.clock.advance(LEASE_TTL)
    assert pool.m.expire_requests(LEASE_TTL) == [ReleasedLeases("aborted", 0, 0, 1)]
    assert pool.m.stats().reservations_expired == 1


@pytest.mark.parametrize("same_key", [False, True], ids=["other key", "same key"])
def test_a_late_report_after_the_deadline_cannot_touch_the_slot_it_lost(same_key: bool) -> None:
    """The writer reports after its slot went to another block (pending, then ready)."""
    pool = Pool(1, "lru")
    [slot] = _aborted(pool, [key(0)])
    pool.clock.advance(DEADLINE + 1)
    assert _expire(pool) == [ReleasedLeases("aborted", 0, 0, 1)]
    newcomer = pool.request("newcomer")
    reused_key = key(0) if same_key else key(1)
    out = pool.m.prepare_store([reused_key], newcomer)
    assert out is not None
    assert out.slots == [slot]
    late = ReqContext("aborted")
    before = pool.snapshot([key(0), key(1)])
    for success in (True, False):
        with pytest.raises(UnknownRequestError):
            pool.m.complete_store([key(0)], late, success=success)
    assert pool.snapshot([key(0), key(1)]) == before
    assert pool.state(reused_key) is PENDING  # still the newcomer's store, not marked ready
    # The same id, reused by a new request, does not own the old store either.
    assert pool.m.on_new_request(late) is True
    assert pool.m.complete_store([key(0)], late).ignored == [key(0)]
    assert pool.state(reused_key) is PENDING
    assert pool.m.complete_store([reused_key], newcomer).completed == [reused_key]
    assert pool.m.slot_of(reused_key) == slot
    assert pool.state(reused_key) is HIT
    assert pool.state(key(1) if same_key else key(0)) is MISS
    pool.check_accounting()


def test_reservations_of_several_requests_end_each_at_its_own_deadline() -> None:
    pool = Pool(4, "lru")
    _aborted(pool, [key(0)], "early")
    pool.clock.advance(10)
    _aborted(pool, [key(1)], "late")
    pool.clock.advance(DEADLINE - 10 + 1)
    assert _expire(pool) == [ReleasedLeases("early", 0, 0, 1)]
    assert [r.req_id for r in pool.m.requests()] == ["late"]
    pool.clock.advance(10)
    assert _expire(pool) == [ReleasedLeases("late", 0, 0, 1)]
    assert pool.m.stats().reservations_expired == 2
