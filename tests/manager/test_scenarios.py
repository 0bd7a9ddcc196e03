"""Scenario tests: each test states one sentence of the manager's behaviour in its name."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from manager import (
    MAX_KEY_BYTES,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    CompleteStoreOutput,
    InvalidArgumentError,
    InvalidPolicyParamsError,
    KeyNotReadyError,
    NotPinnedError,
    OffloadManager,
    ReleasedLeases,
    ReqContext,
    ResetCounts,
    UnknownPolicyError,
    UnknownRequestError,
    available_policies,
    create_manager,
)
from manager.policies import ARCPolicy
from tests.manager.harness import HIT, MISS, PENDING, Pool, arc_of, key, keys

# ---------------------------------------------------------------------- eviction order


def test_lru_evicts_the_least_recently_used_blocks_in_exact_order() -> None:
    pool = Pool(4, "lru")
    pool.store_each(keys(0, 4))
    assert pool.m.resident_keys() == keys(0, 4)
    reader = pool.request()
    pool.m.touch([key(1)], reader)
    pool.m.touch([key(0)], reader)
    assert pool.m.resident_keys() == [key(2), key(3), key(1), key(0)]
    assert pool.store([key(10), key(11)]) == [key(2), key(3)]
    assert pool.store([key(12)]) == [key(1)]
    assert pool.store([key(13)]) == [key(0)]
    assert pool.store([key(14)]) == [key(11)]  # one call: its tail went first


def test_lru_touch_of_an_unknown_or_pending_key_changes_no_order() -> None:
    pool = Pool(4, "lru")
    pool.store_each(keys(0, 2))
    writer = pool.request()
    assert pool.offer([key(2)], writer) is not None
    reader = pool.request()
    pool.m.touch([key(2), key(77)], reader)
    assert pool.m.resident_keys() == [key(0), key(1)]
    pool.m.complete_store([key(2)], writer)
    assert pool.m.resident_keys() == [key(0), key(1), key(2)]


@pytest.mark.parametrize("policy", available_policies())
def test_one_store_call_evicts_its_tail_before_its_head(policy: str) -> None:
    pool = Pool(3, policy)
    pool.store([key(0), key(1), key(2)])
    evicted = pool.store_each([key(10), key(11), key(12)])
    assert evicted == [key(2), key(1), key(0)]


def test_arc_evicts_once_used_blocks_before_twice_used_blocks() -> None:
    pool = Pool(4, "arc")
    pool.store([key(0), key(1)])
    reader = pool.request()
    pool.m.touch([key(0), key(1)], reader)  # used twice: T2
    pool.store_each([key(2), key(3)])  # newer, but used once: T1
    t1, t2, _, _ = arc_of(pool.m).lists()
    assert (sorted(t1), sorted(t2)) == ([key(2), key(3)], [key(0), key(1)])
    assert pool.store([key(10), key(11)]) == [key(2), key(3)]
    assert pool.states([key(0), key(1)]) == [HIT, HIT]


def test_lru_would_evict_the_older_twice_used_blocks_instead() -> None:
    pool = Pool(4, "lru")
    pool.store([key(0), key(1)])
    reader = pool.request()
    pool.m.touch([key(0), key(1)], reader)
    pool.store_each([key(2), key(3)])
    assert pool.store([key(10), key(11)]) == [key(1), key(0)]


# ---------------------------------------------------------------------- ARC internals


def test_arc_touch_promotes_a_block_from_t1_to_t2() -> None:
    pool = Pool(4, "arc")
    pool.store_each(keys(0, 3))
    arc = arc_of(pool.m)
    assert arc.lists() == (keys(0, 3), [], [], [])
    reader = pool.request()
    pool.m.touch([key(1)], reader)
    assert arc.lists() == ([key(0), key(2)], [key(1)], [], [])
    pool.m.touch([key(2), key(1)], reader)  # a T2 hit moves to T2's most recent end
    assert arc.lists() == ([key(0)], [key(1), key(2)], [], [])


def test_arc_block_stored_again_after_eviction_goes_straight_to_t2() -> None:
    pool = Pool(3, "arc")
    pool.store([key(0)])
    reader = pool.request()
    pool.m.touch([key(0)], reader)
    pool.store_each(keys(1, 3))
    assert pool.store([key(3)]) == [key(1)]
    arc = arc_of(pool.m)
    assert arc.lists() == ([key(2), key(3)], [key(0)], [key(1)], [])
    assert pool.store([key(1)]) == [key(2)]
    assert arc.lists() == ([key(3)], [key(0), key(1)], [key(2)], [])
    assert arc.target_t1 == 1.0


def test_arc_ghost_hit_in_b1_raises_target_t1() -> None:
    arc = ARCPolicy(4)
    for k in keys(0, 4):
        arc.insert([k])
    assert arc.evict(1, lambda _k: True) == [key(0)]
    assert arc.lists() == (keys(1, 4), [], [key(0)], [])
    assert arc.target_t1 == 0.0
    arc.insert([key(0)])
    assert arc.target_t1 == 1.0
    assert arc.lists() == (keys(1, 4), [key(0)], [], [])


def test_arc_ghost_hit_in_b1_raises_target_t1_by_the_ghost_ratio() -> None:
    arc = ARCPolicy(8)
    arc.insert(keys(0, 8))
    arc.touch(keys(4, 8))  # T2 = k4..k7 (tail first: k7 is least recent)
    # T1 is above its target (0) but fully pinned, so the victims come from T2.
    assert arc.evict(3, lambda k: k in keys(5, 8)) == [key(7), key(6), key(5)]
    _, _, b1, b2 = arc.lists()
    assert (b1, b2) == ([], [key(7), key(6), key(5)])
    assert arc.evict(1, lambda _k: True) == [key(3)]
    arc.insert([key(3)])  # B1 hit with |B2| / |B1| = 3
    assert arc.target_t1 == 3.0


def test_arc_ghost_hit_in_b2_lowers_target_t1() -> None:
    arc = ARCPolicy(4)
    for k in keys(0, 4):
        arc.insert([k])
    arc.evict(1, lambda _k: True)
    arc.insert([key(0)])  # B1 hit: p = 1
    arc.touch([key(1)])  # T1 = [k2, k3], T2 = [k0, k1]
    assert arc.evict(1, lambda _k: True) == [key(2)]  # |T1| = 2 > p: from T1
    assert arc.evict(1, lambda _k: True) == [key(0)]  # |T1| = 1 = p: from T2
    assert arc.lists() == ([key(3)], [key(1)], [key(2)], [key(0)])
    assert arc.target_t1 == 1.0
    arc.insert([key(0)])  # B2 hit
    assert arc.target_t1 == 0.0
    assert arc.lists() == ([key(3)], [key(1), key(0)], [key(2)], [])


def test_arc_ghost_lists_stay_bounded() -> None:
    capacity = 6
    arc = ARCPolicy(capacity)
    rng = random.Random(1234)
    largest_ghosts = 0
    for _ in range(600):
        k = key(rng.randrange(24))
        if k in arc:
            arc.touch([k])
        else:
            if len(arc) == capacity:
                assert arc.evict(1, lambda _k: True) is not None
            arc.insert([k])
        t1, t2, b1, b2 = arc.lists()
        assert len(t1) + len(b1) <= capacity
        assert len(t1) + len(t2) + len(b1) + len(b2) <= 2 * capacity
        assert not (set(t1) | set(t2)) & (set(b1) | set(b2))
        assert 0.0 <= arc.target_t1 <= capacity
        largest_ghosts = max(largest_ghosts, len(b1) + len(b2))
    assert largest_ghosts == capacity  # the bound is reached, so it is what holds them


# ---------------------------------------------------------------------- stores


def test_an_offer_never_evicts_its_own_resident_blocks() -> None:
    pool = Pool(3, "lru")
    pool.store_each(keys(0, 3))  # k0 is the least recent
    ctx = pool.request()
    out = pool.m.prepare_store([key(0), key(10)], ctx)
    assert out is not None
    assert out.keys_to_store == [key(10)]
    assert out.evicted_keys == [key(1)]
    assert pool.states([key(0), key(1), key(2)]) == [HIT, MISS, HIT]


def test_store_is_refused_while_every_evictable_block_is_pinned_then_succeeds_after_load() -> None:
    pool = Pool(2, "lru")
    pool.store(keys(0, 2))
    loader = pool.pin(keys(0, 2))
    writer = pool.request()
    assert pool.m.prepare_store([key(5)], writer) is None
    assert pool.m.stats().stores_refused == 1
    pool.m.complete_load([key(1)], loader)
    out = pool.m.prepare_store([key(5)], writer)
    assert out is not None
    assert out.evicted_keys == [key(1)]
    assert pool.states([key(0), key(1), key(5)]) == [HIT, MISS, PENDING]


def test_failed_store_drops_only_its_own_new_blocks() -> None:
    pool = Pool(4, "lru")
    pool.store(keys(0, 2))
    slots = [pool.m.slot_of(k) for k in keys(0, 2)]
    ctx = pool.request()
    out = pool.m.prepare_store([key(0), key(1), key(2)], ctx)
    assert out is not None
    assert out.keys_to_store == [key(2)]
    done = pool.m.complete_store([key(0), key(1), key(2)], ctx, success=False)
    assert done == CompleteStoreOutput(completed=[], dropped=[key(2)], ignored=[key(0), key(1)])
    assert pool.states(keys(0, 3)) == [HIT, HIT, MISS]
    assert [pool.m.slot_of(k) for k in keys(0, 2)] == slots
    s = pool.m.stats()
    assert (s.ready, s.pending, s.free, s.stores_failed) == (2, 0, 2, 1)
    assert pool.m.take_events() == [BlockStored(1, keys(0, 2))]


def test_second_complete_store_is_a_no_op_that_reports_keys_as_ignored() -> None:
    pool = Pool(4, "lru")
    ctx = pool.request()
    out = pool.m.prepare_store(keys(0, 2), ctx)
    assert out is not None
    first = pool.m.complete_store(keys(0, 2), ctx, success=True)
    assert first == CompleteStoreOutput(keys(0, 2), [], [])
    before = pool.snapshot(keys(0, 2))
    events = pool.m.take_events()
    for success in (True, False):
        again = pool.m.complete_store(keys(0, 2), ctx, success=success)
        assert again == CompleteStoreOutput([], [], keys(0, 2))
    assert pool.snapshot(keys(0, 2)) == before
    assert len(events) == 1
    assert pool.m.take_events() == []


def test_complete_store_of_another_requests_pending_key_is_ignored() -> None:
    pool = Pool(4, "lru")
    owner = pool.request()
    assert pool.m.prepare_store([key(0)], owner) is not None
    other = pool.request()
    assert pool.m.complete_store([key(0)], other, success=False).ignored == [key(0)]
    assert pool.state(key(0)) is PENDING
    assert pool.m.complete_store([key(0)], owner).completed == [key(0)]


# ---------------------------------------------------------------------- complete_load


def test_complete_load_of_a_key_not_pinned_by_this_request_raises_and_changes_nothing() -> None:
    pool = Pool(4, "lru")
    pool.store(keys(0, 3))
    holder = pool.pin([key(0)])
    ctx = pool.request()
    pool.m.prepare_load([key(1)], ctx)
    watched = keys(0, 3)
    before = pool.snapshot(watched)
    with pytest.raises(NotPinnedError) as info:
        pool.m.complete_load([key(1), key(0), key(2)], ctx)
    assert info.value.keys == [key(0), key(2)]
    assert info.value.req_id == ctx.req_id
    assert pool.snapshot(watched) == before
    assert pool.m.ref_count(key(0)) == 1
    pool.m.complete_load([key(0)], holder)
    assert pool.m.stats().pinned == 1


def test_complete_load_unpinning_more_times_than_pinned_raises_and_changes_nothing() -> None:
    pool = Pool(4, "lru")
    pool.store(keys(0, 2))
    ctx = pool.request()
    pool.m.prepare_load([key(0), key(0), key(1)], ctx)
    assert pool.m.ref_count(key(0)) == 2
    assert pool.m.stats().pinned == 2
    before = pool.snapshot(keys(0, 2))
    with pytest.raises(NotPinnedError) as info:
        pool.m.complete_load([key(0), key(1), key(0), key(0)], ctx)
    assert info.value.keys == [key(0)]
    assert pool.snapshot(keys(0, 2)) == before
    pool.m.complete_load([key(0), key(0)], ctx)
    assert pool.m.ref_count(key(0)) == 0
    with pytest.raises(NotPinnedError):
        pool.m.complete_load([key(0)], ctx)
    assert pool.m.requests()[0].pins == {key(1): 1}


def test_complete_load_listing_twice_a_key_pinned_once_raises_and_changes_nothing() -> None:
    pool = Pool(4, "lru")
    pool.store(keys(0, 3))
    ctx = pool.request()
    pool.m.prepare_load(keys(0, 3), ctx)
    before = pool.snapshot(keys(0, 3))
    with pytest.raises(NotPinnedError) as info:
        pool.m.complete_load([key(0), key(1), key(0)], ctx)
    assert info.value.keys == [key(0)]
    assert pool.snapshot(keys(0, 3)) == before
    assert pool.m.requests()[0].pins == dict.fromkeys(keys(0, 3), 1)
    pool.m.complete_load(keys(0, 3), ctx)
    assert pool.m.stats().pinned == 0


def test_pins_are_counted_per_request() -> None:
    pool = Pool(4, "lru")
    pool.store([key(0)])
    a, b = pool.pin([key(0)]), pool.pin([key(0)])
    assert pool.m.ref_count(key(0)) == 2
    pool.m.complete_load([key(0)], a)
    with pytest.raises(NotPinnedError):
        pool.m.complete_load([key(0)], a)  # a retry cannot release b's pin
    assert pool.m.ref_count(key(0)) == 1
    pool.m.complete_load([key(0)], b)
    assert pool.m.stats().pinned == 0


# ---------------------------------------------------------------------- request lifecycle


def test_abort_releases_every_pin_of_the_request() -> None:
    pool = Pool(3, "lru")
    pool.store(keys(0, 3))
    ctx = pool.pin([key(0), key(1), key(1)])
    other = pool.pin([key(1)])
    released = pool.m.on_request_finished(ctx, abort=True)
    assert released == ReleasedLeases(ctx.req_id, pins_released=3, stores_dropped=0)
    assert [pool.m.ref_count(k) for k in keys(0, 3)] == [0, 1, 0]
    assert pool.m.stats().pinned == 1
    assert [r.req_id for r in pool.m.requests()] == [other.req_id]
    assert sorted(pool.store(keys(10, 12))) == [key(0), key(2)]


def test_abort_drops_pending_stores_but_keeps_their_slots_until_the_writer_reports() -> None:
    pool = Pool(3, "lru")
    writer = pool.request("writer")
    out = pool.m.prepare_store([key(0)], writer)
    assert out is not None
    reserved_slot = out.slots[0]
    assert pool.m.on_request_finished(writer, abort=True) == ReleasedLeases("writer", 0, 1)
    assert pool.state(key(0)) is MISS
    s = pool.m.stats()
    assert (s.free, s.pending, s.ready, s.live_requests) == (2, 1, 0, 1)
    assert pool.m.requests()[0].pending_stores == [key(0)]
    # The reserved slot is not handed out: three new blocks do not fit.
    other = pool.request()
    assert pool.m.prepare_store(keys(10, 13), other) is None
    out2 = pool.m.prepare_store([key(0), key(10)], other)
    assert out2 is not None
    assert reserved_slot not in out2.slots
    assert pool.m.stats().free == 0
    late = pool.m.complete_store([key(0)], writer, success=True)
    assert late == CompleteStoreOutput(completed=[], dropped=[key(0)], ignored=[])
    s = pool.m.stats()
    assert (s.free, s.pending, s.live_requests) == (1, 2, 1)
    assert pool.state(key(0)) is PENDING  # the other request's store of the same key
    assert pool.m.complete_store([key(0), key(10)], other).completed == [key(0), key(10)]
    assert pool.m.slot_of(key(0)) == out2.slots[0]
    out3 = pool.m.prepare_store([key(20)], other)
    assert out3 is not None
    assert out3.slots == [reserved_slot]


def test_abort_twice_is_harmless() -> None:
    pool = Pool(2, "lru")
    writer = pool.request()
    assert pool.m.prepare_store([key(0)], writer) is not None
    pool.m.on_request_finished(writer, abort=True)
    assert pool.m.on_request_finished(writer, abort=True) == ReleasedLeases(writer.req_id, 0, 0)
    assert pool.m.stats().pending == 1
    assert pool.m.complete_store([key(0)], writer, success=False).dropped == [key(0)]
    assert pool.m.stats().pending == 0
    with pytest.raises(UnknownRequestError):
        pool.m.on_request_finished(writer)


def test_normal_finish_keeps_leases_until_their_complete_calls_then_forgets_the_request() -> None:
    pool = Pool(4, "lru")
    pool.store([key(0)])
    ctx = pool.pin([key(0)])
    assert pool.m.prepare_store([key(1)], ctx) is not None
    assert pool.m.on_request_finished(ctx, abort=False) == ReleasedLeases(ctx.req_id, 0, 0)
    [leases] = pool.m.requests()
    assert (leases.pins, leases.pending_stores) == ({key(0): 1}, [key(1)])
    assert pool.m.ref_count(key(0)) == 1
    assert pool.state(key(1)) is PENDING
    with pytest.raises(UnknownRequestError):
        pool.m.prepare_load([key(0)], ctx)
    with pytest.raises(UnknownRequestError):
        pool.m.prepare_store([key(2)], ctx)
    with pytest.raises(InvalidArgumentError):
        pool.m.on_new_request(ctx)  # a finished request that holds leases cannot restart
    assert pool.m.complete_store([key(1)], ctx).completed == [key(1)]
    assert [r.req_id for r in pool.m.requests()] == [ctx.req_id]
    pool.m.complete_load([key(0)], ctx)
    assert pool.m.requests() == []
    assert pool.m.stats().live_requests == 0
    assert pool.states([key(0), key(1)]) == [HIT, HIT]
    with pytest.raises(UnknownRequestError):
        pool.m.complete_load([key(0)], ctx)
    assert pool.m.on_new_request(ctx) is True  # the id is free again


def test_finish_without_leases_forgets_the_request_at_once() -> None:
    pool = Pool(4, "lru")
    ctx = pool.request()
    assert pool.m.on_new_request(ctx) is False  # announcing again only renews it
    assert pool.m.stats().live_requests == 1
    pool.m.on_request_finished(ctx)
    assert pool.m.stats().live_requests == 0
    with pytest.raises(UnknownRequestError):
        pool.m.lookup([key(0)], ctx)


def test_expire_releases_the_leases_of_silent_requests_only() -> None:
    pool = Pool(6, "lru")
    pool.store(keys(0, 3))
    silent = pool.pin([key(0)], pool.request("silent"))
    assert pool.m.prepare_store([key(3)], silent) is not None
    talker = pool.pin([key(1)], pool.request("talker"))
    pool.request("idle")
    pool.clock.advance(5)
    pool.m.lookup([key(1)], talker)
    pool.clock.advance(5)
    assert pool.m.expire_requests(lease_ttl=5) == [ReleasedLeases("silent", 1, 1)]
    assert pool.m.ref_count(key(0)) == 0
    assert pool.state(key(3)) is MISS
    s = pool.m.stats()
    assert (s.pending, s.pinned, s.free, s.forced_lease_releases) == (0, 1, 3, 1)
    assert [(r.req_id, r.idle_seconds) for r in pool.m.requests()] == [
        ("talker", 5.0),
        ("idle", 10.0),
    ]
    with pytest.raises(UnknownRequestError):
        pool.m.complete_store([key(3)], silent)
    # Exactly at the TTL is not past it; a request without leases needs idle_ttl.
    assert pool.m.expire_requests(lease_ttl=5, idle_ttl=10) == []
    assert [r.req_id for r in pool.m.requests()] == ["talker", "idle"]
    assert pool.m.expire_requests(lease_ttl=5, idle_ttl=9.5) == []
    assert [r.req_id for r in pool.m.requests()] == ["talker"]
    pool.m.lookup([key(1)], talker)
    assert pool.m.ref_count(key(1)) == 1


def _renewals() -> dict[str, Callable[[OffloadManager, ReqContext], object]]:
    return {
        "lookup": lambda m, ctx: m.lookup([key(0)], ctx),
        "touch": lambda m, ctx: m.touch([key(0)], ctx),
        "prepare_load": lambda m, ctx: m.prepare_load([key(0)], ctx),
        "complete_load": lambda m, ctx: m.complete_load([key(0)], ctx),
        "prepare_store": lambda m, ctx: m.prepare_store([key(9)], ctx),
        "complete_store": lambda m, ctx: m.complete_store([key(8)], ctx),
        "on_new_request": lambda m, ctx: m.on_new_request(ctx),
        "on_request_finished": lambda m, ctx: m.on_request_finished(ctx),
    }


@pytest.mark.parametrize("call", sorted(_renewals()))
def test_every_call_of_a_request_renews_its_leases(call: str) -> None:
    pool = Pool(6, "lru")
    pool.store([key(0)])
    ctx = pool.request()
    pool.m.prepare_load([key(0), key(0)], ctx)
    pool.clock.advance(10)
    _renewals()[call](pool.m, ctx)
    pool.clock.advance(5)
    assert pool.m.expire_requests(lease_ttl=8) == []
    assert pool.m.ref_count(key(0)) >= 1
    pool.clock.advance(4)
    [released] = pool.m.expire_requests(lease_ttl=8)
    assert released.req_id == ctx.req_id
    assert pool.m.ref_count(key(0)) == 0


def test_expire_frees_the_reserved_slots_of_an_aborted_request() -> None:
    pool = Pool(2, "lru")
    writer = pool.request()
    assert pool.m.prepare_store(keys(0, 2), writer) is not None
    pool.m.on_request_finished(writer, abort=True)
    assert pool.m.stats().free == 0
    pool.clock.advance(31)
    assert pool.m.expire_requests(lease_ttl=30) == [ReleasedLeases(writer.req_id, 0, 0, 2)]
    s = pool.m.stats()
    assert (s.free, s.pending, s.live_requests, s.reservations_expired) == (2, 0, 0, 2)


def test_release_request_frees_every_lease_at_once() -> None:
    pool = Pool(4, "lru")
    pool.store(keys(0, 2))
    ctx = pool.pin(keys(0, 2))
    assert pool.m.prepare_store([key(2)], ctx) is not None
    assert pool.m.release_request(ctx.req_id) == ReleasedLeases(ctx.req_id, 2, 1)
    s = pool.m.stats()
    assert (s.pinned, s.pending, s.free, s.live_requests, s.forced_lease_releases) == (
        0,
        0,
        2,
        0,
        1,
    )
    assert pool.state(key(2)) is MISS
    with pytest.raises(UnknownRequestError):
        pool.m.release_request(ctx.req_id)
    aborted = pool.request()
    assert pool.m.prepare_store([key(3)], aborted) is not None
    pool.m.on_request_finished(aborted, abort=True)
    assert pool.m.stats().free == 1
    assert pool.m.release_request(aborted.req_id) == ReleasedLeases(aborted.req_id, 0, 0, 1)
    assert pool.m.stats().free == 2


# ---------------------------------------------------------------------- tail before head


@pytest.mark.parametrize("policy", available_policies())
def test_finished_request_of_several_calls_has_its_tail_evicted_before_its_head(
    policy: str,
) -> None:
    pool = Pool(4, policy)
    ctx = pool.request()
    pool.store([key(0), key(1)], ctx)  # head of the prefix
    pool.store([key(2), key(3)], ctx)  # tail, stored later
    pool.m.on_request_finished(ctx)
    assert pool.store_each(keys(10, 14)) == [key(3), key(2), key(1), key(0)]


def test_lru_request_is_reordered_only_once_it_holds_nothing() -> None:
    pool = Pool(6, "lru")
    ctx = pool.request()
    pool.store([key(0), key(1)], ctx)
    pool.store([key(2), key(3)], ctx)
    pool.store([key(9)])
    pool.m.prepare_load([key(0)], ctx)
    pool.m.on_request_finished(ctx)
    order = [key(3), key(2), key(1), key(0)]
    assert pool.m.resident_keys() == [key(1), key(0), key(3), key(2), key(9)]
    pool.m.complete_load([key(0)], ctx)
    assert pool.m.resident_keys() == [key(9), *order]


def test_lru_request_of_one_call_is_not_reordered_at_finish() -> None:
    pool = Pool(6, "lru")
    ctx = pool.request()
    pool.store([key(0), key(1)], ctx)
    pool.store([key(9)])
    pool.m.on_request_finished(ctx)
    assert pool.m.resident_keys() == [key(1), key(0), key(9)]


def test_lru_an_empty_touch_is_not_an_ordering_call() -> None:
    pool = Pool(6, "lru")
    ctx = pool.request()
    pool.store([key(0), key(1)], ctx)
    pool.m.touch([], ctx)
    pool.store([key(9)])
    pool.m.on_request_finished(ctx)
    assert pool.m.resident_keys() == [key(1), key(0), key(9)]


def test_lru_touch_and_store_of_one_request_count_as_two_ordering_calls() -> None:
    pool = Pool(6, "lru")
    pool.store([key(0)])
    ctx = pool.request()
    pool.m.touch([key(0)], ctx)
    pool.store([key(1)], ctx)
    pool.store([key(9)])
    assert pool.m.resident_keys() == [key(0), key(1), key(9)]
    pool.m.on_request_finished(ctx)
    assert pool.m.resident_keys() == [key(9), key(1), key(0)]


# ---------------------------------------------------------------------- reuse filter


@pytest.mark.parametrize("threshold", [2, 3])
def test_reuse_filter_admits_a_new_key_on_its_nth_offer(threshold: int) -> None:
    pool = Pool(4, "lru", threshold)
    ctx = pool.request()
    for offer_no in range(1, threshold):
        out = pool.m.prepare_store([key(0), key(1)], ctx)
        assert out is not None
        assert (out.keys_to_store, out.skipped_keys) == ([], [key(0), key(1)]), offer_no
        assert pool.states([key(0), key(1)]) == [MISS, MISS]
    out = pool.m.prepare_store([key(0), key(1), key(2)], ctx)
    assert out is not None
    assert (out.keys_to_store, out.skipped_keys) == ([key(0), key(1)], [key(2)])
    s = pool.m.stats()
    assert (s.stores_skipped, s.stores_prepared) == (2 * (threshold - 1) + 1, 2)


def test_resident_keys_bypass_the_reuse_filter() -> None:
    pool = Pool(4, "lru", 3)
    pool.store([key(0)])
    ctx = pool.request()
    out = pool.m.prepare_store([key(0), key(1)], ctx)
    assert out is not None
    assert (out.keys_to_store, out.skipped_keys) == ([], [key(1)])
    assert pool.m.stats().stores_reused == 1
    writer = pool.request()
    pool.prime([key(5)], writer)
    assert pool.m.prepare_store([key(5)], writer) is not None
    assert pool.m.prepare_store([key(5)], ctx) == type(out)([], [], [], [])  # pending: resident


def test_key_evicted_after_admission_is_admitted_again_at_once() -> None:
    pool = Pool(1, "lru", 2)
    pool.store([key(0)])
    assert pool.store([key(1)]) == [key(0)]
    ctx = pool.request()
    out = pool.m.prepare_store([key(0)], ctx)
    assert out is not None
    assert (out.keys_to_store, out.evicted_keys) == ([key(0)], [key(1)])


def test_reuse_tracker_is_bounded_and_a_forgotten_key_starts_over() -> None:
    pool = Pool(8, "lru", 2, reuse_tracker_size=2)
    ctx = pool.request()
    for k in (key(0), key(1), key(2)):  # the third offer pushes k0 out of the tracker
        out = pool.m.prepare_store([k], ctx)
        assert out is not None
        assert out.skipped_keys == [k]
    out = pool.m.prepare_store([key(0)], ctx)
    assert out is not None
    assert out.skipped_keys == [key(0)]  # counted as a first offer again
    out = pool.m.prepare_store([key(0), key(2)], ctx)
    assert out is not None
    assert out.keys_to_store == [key(0), key(2)]
    out = pool.m.prepare_store([key(1)], ctx)  # pushed out by k0's re-offer
    assert out is not None
    assert out.skipped_keys == [key(1)]


def test_reuse_tracker_defaults_to_four_times_the_pool() -> None:
    pool = Pool(2, "lru", 2)
    ctx = pool.request()
    for i in range(9):
        out = pool.m.prepare_store([key(i)], ctx)
        assert out is not None
        assert out.skipped_keys == [key(i)]
    out = pool.m.prepare_store([key(0), key(1)], ctx)
    assert out is not None
    assert (out.keys_to_store, out.skipped_keys) == ([key(1)], [key(0)])


def test_refused_offer_counts_no_offers() -> None:
    pool = Pool(1, "lru", 2)
    pool.store([key(0)])
    loader = pool.pin([key(0)])
    ctx = pool.request()
    out = pool.m.prepare_store([key(1)], ctx)
    assert out is not None
    assert out.skipped_keys == [key(1)]
    skipped = pool.m.stats().stores_skipped
    assert pool.m.prepare_store([key(1), key(2)], ctx) is None  # k1 admitted, no room
    assert pool.m.stats().stores_skipped == skipped
    pool.m.complete_load([key(0)], loader)
    out = pool.m.prepare_store([key(2)], ctx)
    assert out is not None
    assert out.skipped_keys == [key(2)]  # the refused offer did not count for k2
    out = pool.m.prepare_store([key(1)], ctx)
    assert out is not None
    assert out.keys_to_store == [key(1)]  # k1 kept the offer counted before the refusal


def test_reuse_filter_settings_are_validated() -> None:
    assert create_manager(4, store_threshold=1).store_threshold == 1  # 0 and 1 admit at once
    m = create_manager(4, store_threshold=1)
    ctx = ReqContext("r")
    m.on_new_request(ctx)
    out = m.prepare_store([key(0)], ctx)
    assert out is not None
    assert out.keys_to_store == [key(0)]
    with pytest.raises(InvalidArgumentError):
        create_manager(4, store_threshold=2, reuse_tracker_size=0)
    with pytest.raises(InvalidArgumentError):
        create_manager(4, store_threshold=-1)


# ---------------------------------------------------------------------- events


def test_removed_event_of_evicted_keys_comes_before_the_stored_event_of_their_replacements() -> (
    None
):
    pool = Pool(2, "lru")
    pool.store(keys(0, 2))
    assert pool.m.take_events() == [BlockStored(1, keys(0, 2))]
    ctx = pool.request()
    out = pool.m.prepare_store([key(2)], ctx)
    assert out is not None
    assert out.evicted_keys == [key(1)]
    assert pool.m.take_events() == [BlockRemoved(2, [key(1)])]
    pool.m.complete_store([key(2)], ctx)
    out = pool.m.prepare_store([key(3)], ctx)
    assert out is not None
    pool.m.complete_store([key(3)], ctx)
    assert pool.m.take_events() == [
        BlockStored(3, [key(2)]),
        BlockRemoved(4, [key(0)]),
        BlockStored(5, [key(3)]),
    ]


def test_events_carry_increasing_seq_numbers_and_medium_cpu() -> None:
    pool = Pool(2, "arc")
    for i in range(6):
        pool.store([key(i)])
    pool.m.reset()
    events = pool.m.take_events()
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    assert {e.medium for e in events} == {"CPU"}
    assert [type(e) for e in events][-1] is AllBlocksCleared
    assert len(events) == 6 + 4 + 1


def test_take_events_returns_each_event_once() -> None:
    pool = Pool(2, "lru")
    pool.store([key(0)])
    assert pool.m.take_events() == [BlockStored(1, [key(0)])]
    assert pool.m.take_events() == []
    pool.store([key(1)])
    assert pool.m.take_events() == [BlockStored(2, [key(1)])]


def test_no_events_when_events_are_disabled() -> None:
    pool = Pool(1, "lru", enable_events=False)
    pool.store([key(0)])
    pool.store([key(1)])
    pool.m.reset()
    assert pool.m.take_events() == []
    assert pool.m.stats().events_dropped == 0


def test_bounded_event_buffer_keeps_the_newest_and_counts_the_dropped() -> None:
    pool = Pool(8, "lru", max_events=2)
    pool.store_each(keys(0, 5))
    assert pool.m.take_events() == [BlockStored(4, [key(3)]), BlockStored(5, [key(4)])]
    assert pool.m.stats().events_dropped == 3
    pool.store([key(5)])
    assert pool.m.take_events() == [BlockStored(6, [key(5)])]
    assert pool.m.stats().events_dropped == 3


def test_failed_and_aborted_stores_emit_no_event() -> None:
    pool = Pool(4, "lru")
    ctx = pool.request()
    assert pool.m.prepare_store(keys(0, 2), ctx) is not None
    pool.m.complete_store([key(0)], ctx, success=False)
    pool.m.on_request_finished(ctx, abort=True)
    pool.m.complete_store([key(1)], ctx, success=True)
    assert pool.m.take_events() == []


# ---------------------------------------------------------------------- reset


def test_reset_keeps_pinned_blocks_and_reports_the_others_as_removed() -> None:
    pool = Pool(4, "lru")
    pool.store(keys(0, 4))
    pool.m.take_events()
    slot = pool.m.slot_of(key(1))
    pool.pin([key(1)])
    assert pool.m.reset() == ResetCounts(dropped=3, kept_pinned=1, kept_pending=0)
    [event] = pool.m.take_events()
    assert isinstance(event, BlockRemoved)
    assert sorted(event.block_hashes) == [key(0), key(2), key(3)]
    assert pool.states(keys(0, 4)) == [MISS, HIT, MISS, MISS]
    assert pool.m.slot_of(key(1)) == slot
    assert pool.m.resident_keys() == [key(1)]
    s = pool.m.stats()
    assert (s.ready, s.pinned, s.free, s.evictions) == (1, 1, 3, 0)


def test_reset_with_nothing_pinned_clears_everything() -> None:
    pool = Pool(4, "arc")
    pool.store(keys(0, 4))
    pool.m.take_events()
    assert pool.m.reset() == ResetCounts(dropped=4, kept_pinned=0, kept_pending=0)
    assert pool.m.take_events() == [AllBlocksCleared(2)]
    assert pool.m.stats().free == 4
    assert arc_of(pool.m).lists() == ([], [], [], [])


def test_reset_keeps_pending_stores_and_their_reserved_slots() -> None:
    pool = Pool(4, "lru")
    pool.store(keys(0, 2))
    writer = pool.request()
    assert pool.m.prepare_store([key(2)], writer) is not None
    aborted = pool.request()
    assert pool.m.prepare_store([key(3)], aborted) is not None
    pool.m.on_request_finished(aborted, abort=True)
    pool.m.take_events()
    assert pool.m.reset() == ResetCounts(dropped=2, kept_pinned=0, kept_pending=2)
    assert pool.m.take_events() == [AllBlocksCleared(2)]
    assert pool.state(key(2)) is PENDING
    s = pool.m.stats()
    assert (s.free, s.pending, s.ready) == (2, 2, 0)
    assert pool.m.complete_store([key(2)], writer).completed == [key(2)]
    assert pool.m.take_events() == [BlockStored(3, [key(2)])]
    assert pool.m.resident_keys() == [key(2)]


# ---------------------------------------------------------------------- switch_policy


@pytest.mark.parametrize(("source", "target"), [("lru", "arc"), ("arc", "lru")])
def test_switch_policy_keeps_pins_pending_stores_and_slots(source: str, target: str) -> None:
    pool = Pool(4, source)
    pool.store_each(keys(0, 3))
    loader = pool.pin([key(0), key(0)])
    writer = pool.request()
    assert pool.m.prepare_store([key(3)], writer) is not None
    slots = [pool.m.slot_of(k) for k in keys(0, 4)]
    switch = pool.m.switch_policy(target)
    assert switch.changed
    assert (switch.previous.name, switch.current.name) == (source, target)
    assert (switch.previous.generation, switch.current.generation) == (1, 2)
    assert switch.blocks_migrated == 3
    assert [pool.m.slot_of(k) for k in keys(0, 4)] == slots
    assert pool.m.ref_count(key(0)) == 2
    assert pool.states(keys(0, 4)) == [HIT, HIT, HIT, PENDING]
    s = pool.m.stats()
    assert (s.policy, s.pinned, s.pending, s.ready, s.policy_switches) == (target, 1, 1, 3, 1)
    assert pool.m.complete_store([key(3)], writer).completed == [key(3)]
    assert key(3) in pool.m.resident_keys()
    evicted = pool.store(keys(10, 13))
    assert sorted(evicted) == keys(1, 4)  # the pinned block stays
    assert pool.states([key(0)]) == [HIT]
    pool.m.complete_load([key(0), key(0)], loader)
    assert pool.store([key(20)]) == [key(0)]  # unpinned, it is the only block not just stored


def test_switch_from_arc_to_lru_keeps_arcs_eviction_order() -> None:
    pool = Pool(6, "arc")
    pool.store_each(keys(0, 4))
    reader = pool.request()
    pool.m.touch([key(1)], reader)
    order = pool.m.resident_keys()
    assert order == [key(0), key(2), key(3), key(1)]
    pool.m.switch_policy("lru")
    assert pool.m.resident_keys() == order
    pool.m.switch_policy("arc")
    assert pool.m.resident_keys() == order
    assert arc_of(pool.m).lists() == (order, [], [], [])


def test_switch_to_an_unknown_policy_raises_and_changes_nothing() -> None:
    pool = Pool(4, "lru")
    pool.store(keys(0, 2))
    before = pool.snapshot(keys(0, 2))
    with pytest.raises(UnknownPolicyError) as info:
        pool.m.switch_policy("belady")
    assert set(info.value.available) == set(available_policies())
    assert pool.snapshot(keys(0, 2)) == before
    assert pool.m.policy.generation == 1


@pytest.mark.parametrize("name", available_policies())
def test_switch_with_bad_params_raises_and_changes_nothing(name: str) -> None:
    pool = Pool(4, "lru")
    pool.store(keys(0, 2))
    before = pool.snapshot(keys(0, 2))
    with pytest.raises(InvalidPolicyParamsError):
        pool.m.switch_policy(name, {"no_such_parameter": 1})
    assert pool.snapshot(keys(0, 2)) == before
    assert pool.m.policy.generation == 1


@pytest.mark.parametrize("name", available_policies())
def test_switch_to_the_same_policy_and_params_is_a_no_op(name: str) -> None:
    pool = Pool(4, name)
    pool.store(keys(0, 2))
    params = dict(pool.m.policy.params)
    before = pool.snapshot(keys(0, 2))
    for same in (None, params):
        switch = pool.m.switch_policy(name, same)
        assert not switch.changed
        assert switch.previous == switch.current == pool.m.policy
        assert switch.blocks_migrated == 0
    assert pool.snapshot(keys(0, 2)) == before
    assert pool.m.stats().policy_switches == 0


# ---------------------------------------------------------------------- invalid input


@pytest.mark.parametrize("threshold", [0, 2])
@pytest.mark.parametrize(
    "bad",
    [b"", b"x" * 65, "k000", 7, None, bytearray(b"k000")],
    ids=["empty", "too-long", "str", "int", "none", "bytearray"],
)
def test_bad_keys_to_prepare_store_raise_and_change_nothing(bad: object, threshold: int) -> None:
    pool = Pool(2, "lru", threshold)
    pool.store([key(0)])
    ctx = pool.request()
    watched = [key(0), key(1)]
    before = pool.snapshot(watched)
    with pytest.raises(InvalidArgumentError):
        pool.m.prepare_store([key(1), bad], ctx)  # type: ignore[list-item]
    assert pool.snapshot(watched) == before
    out = pool.m.prepare_store([key(1)], ctx)
    assert out is not None
    assert out.skipped_keys == ([key(1)] if threshold else [])  # the failed offer did not count


@pytest.mark.parametrize(
    "call",
    ["lookup", "prepare_load", "touch", "complete_load", "complete_store"],
)
def test_unhashable_keys_to_any_call_raise_invalid_argument_and_change_nothing(call: str) -> None:
    pool = Pool(4, "lru", 0)
    pool.store([key(0), key(1)])
    ctx = pool.pin([key(0)])
    watched = [key(0), key(1)]
    before = pool.snapshot(watched)
    order = pool.m.resident_keys()
    with pytest.raises(InvalidArgumentError, match="bytearray"):
        getattr(pool.m, call)([key(0), bytearray(b"k001")], ctx)
    assert pool.snapshot(watched) == before
    assert pool.m.resident_keys() == order


NOT_KEYS = [7, "k000", None, b"", b"x" * (MAX_KEY_BYTES + 1), memoryview(b"k999")]
NOT_KEY_IDS = ["int", "str", "none", "empty", "too-long", "memoryview"]
KEY_CALLS = ["lookup", "touch", "prepare_load", "complete_load", "prepare_store", "complete_store"]


@pytest.mark.parametrize("call", KEY_CALLS)
@pytest.mark.parametrize("alone", [True, False], ids=["alone", "after-a-held-key"])
@pytest.mark.parametrize("bad", NOT_KEYS, ids=NOT_KEY_IDS)
def test_a_non_key_raises_invalid_argument_in_every_call_and_changes_nothing(
    call: str, alone: bool, bad: object
) -> None:
    pool = Pool(4, "lru")
    chains: list[list[bytes]] = []
    pool.m.add_chain_listener(chains.append)
    pool.store([key(0), key(1)])
    ctx = pool.request()
    pool.m.prepare_load([key(0)], ctx)  # pinned by ctx: complete_load's fast path has it
    assert pool.offer([key(2)], ctx) is not None  # pending for ctx: complete_store's has it
    pool.m.take_events()
    chains.clear()
    stats, order, leases = pool.m.stats(), pool.m.resident_keys(), pool.m.requests()
    batch = [bad] if alone else [key(0), bad]
    with pytest.raises(InvalidArgumentError, match="keys must be"):
        getattr(pool.m, call)(batch, ctx)
    assert pool.m.stats() == stats  # the lookup counters too
    assert pool.m.resident_keys() == order
    assert pool.m.requests() == leases
    assert pool.m.take_events() == []
    # The request's chain (what its end reorders and reports) holds no trace of the call.
    pool.m.complete_load([key(0)], ctx)
    pool.m.complete_store([key(2)], ctx)
    pool.m.on_request_finished(ctx)
    assert chains == [[key(0), key(2)]]


def test_valid_keys_the_manager_does_not_hold_pass_the_key_check_in_every_call() -> None:
    pool = Pool(4, "lru")
    ctx = pool.request()
    edge = [b"\x00", b"\xff" * MAX_KEY_BYTES]  # the shortest and the longest key
    assert pool.m.lookup(edge, ctx).results == [MISS, MISS]
    pool.m.touch(edge, ctx)
    with pytest.raises(KeyNotReadyError) as not_ready:
        pool.m.prepare_load(edge, ctx)
    assert not_ready.value.missing == edge
    with pytest.raises(NotPinnedError) as not_pinned:
        pool.m.complete_load(edge, ctx)
    assert not_pinned.value.keys == edge
    assert pool.m.complete_store(edge, ctx).ignored == edge
    out = pool.m.prepare_store(edge, ctx)
    assert out is not None
    assert out.keys_to_store == edge


def test_an_empty_touch_is_not_an_ordering_call() -> None:
    pool = Pool(4, "lru", 0)
    ctx = pool.request()
    pool.store([key(0), key(1)], ctx)  # one ordering call: its batch is already tail first
    pool.m.touch([], ctx)
    pool.store([key(2)])  # another request's block, more recent than the chain
    order = pool.m.resident_keys()
    pool.m.on_request_finished(ctx)  # one real ordering call only: nothing to reorder
    assert pool.m.resident_keys() == order


def test_keys_of_one_and_of_sixty_four_bytes_are_accepted() -> None:
    pool = Pool(2, "lru")
    edge = [b"\x00", b"\xff" * 64]
    assert pool.store(edge) == []
    assert pool.states(edge) == [HIT, HIT]


def test_every_call_on_an_unknown_request_raises_and_changes_nothing() -> None:
    pool = Pool(4, "lru")
    pool.store(keys(0, 2))
    ghost = ReqContext("ghost")
    before = pool.snapshot(keys(0, 2))
    calls: list[Callable[[], object]] = [
        lambda: pool.m.lookup(keys(0, 2), ghost),
        lambda: pool.m.prepare_load(keys(0, 2), ghost),
        lambda: pool.m.touch(keys(0, 2), ghost),
        lambda: pool.m.complete_load(keys(0, 2), ghost),
        lambda: pool.m.prepare_store([key(5)], ghost),
        lambda: pool.m.complete_store(keys(0, 2), ghost),
        lambda: pool.m.on_request_finished(ghost),
        lambda: pool.m.on_request_finished(ghost, abort=True),
        lambda: pool.m.release_request("ghost"),
    ]
    for call in calls:
        with pytest.raises(UnknownRequestError) as info:
            call()
        assert info.value.req_id == "ghost"
    assert pool.snapshot(keys(0, 2)) == before


@pytest.mark.parametrize("abort", [False, True])
def test_prepare_calls_after_finish_raise_unknown_request(abort: bool) -> None:
    pool = Pool(4, "lru")
    pool.store([key(0)])
    ctx = pool.request()
    pool.m.on_request_finished(ctx, abort=abort)
    before = pool.snapshot([key(0)])
    for call in (pool.m.prepare_load, pool.m.prepare_store, pool.m.lookup, pool.m.touch):
        with pytest.raises(UnknownRequestError):
            call([key(0)], ctx)
    assert pool.snapshot([key(0)]) == before


def test_prepare_load_of_missing_or_pending_keys_names_them_and_pins_nothing() -> None:
    pool = Pool(4, "lru")
    pool.store([key(0)])
    writer = pool.request()
    assert pool.m.prepare_store([key(1)], writer) is not None
    ctx = pool.request()
    watched = keys(0, 3)
    before = pool.snapshot(watched)
    with pytest.raises(KeyNotReadyError) as info:
        pool.m.prepare_load([key(0), key(1), key(2), key(0)], ctx)
    err = info.value
    assert (err.missing, err.pending, err.keys) == ([key(2)], [key(1)], [key(2), key(1)])
    assert "not stored" in str(err)
    assert "pending" in str(err)
    assert pool.snapshot(watched) == before
    assert pool.m.ref_count(key(0)) == 0
    assert pool.m.stats().loads == 0


@pytest.mark.parametrize("num_blocks", [0, -1, True, 2.0, "8", None])
def test_num_blocks_must_be_a_positive_integer(num_blocks: object) -> None:
    with pytest.raises(InvalidArgumentError, match="num_blocks"):
        create_manager(num_blocks)  # type: ignore[arg-type]


def test_other_constructor_arguments_are_validated() -> None:
    with pytest.raises(InvalidArgumentError, match="max_events"):
        create_manager(4, max_events=0)
    with pytest.raises(UnknownPolicyError):
        create_manager(4, "belady")
    with pytest.raises(InvalidPolicyParamsError):
        create_manager(4, "lru", policy_params={"x": 1})


@pytest.mark.parametrize("req_id", ["", None, 7])
def test_a_request_needs_a_non_empty_string_id(req_id: object) -> None:
    m = create_manager(4)
    with pytest.raises(InvalidArgumentError):
        m.on_new_request(ReqContext(req_id))  # type: ignore[arg-type]
    assert m.stats().live_requests == 0


def test_a_release_with_writers_alive_keeps_the_store_slot_until_the_writer_reports() -> None:
    pool = Pool(2, "lru", 0)
    ctx = pool.request("writer")
    out = pool.m.prepare_store([key(0)], ctx)
    assert out is not None
    (slot,) = out.slots
    released = pool.m.release_request("writer", writers_alive=True)
    assert (released.pins_released, released.stores_dropped) == (0, 1)
    assert pool.state(key(0)) is MISS
    assert pool.m.stats().pending == 1  # the slot stays reserved under the running copy
    other = pool.request("other")
    taken = pool.m.prepare_store([key(1), key(2)], other)
    assert taken is None  # one free slot only: the reserved one is not handed out
    done = pool.m.complete_store([key(0)], ctx, success=True)
    assert done.dropped == [key(0)]
    assert pool.m.stats().free == 2
    assert [r.req_id for r in pool.m.requests()] == ["other"]
    again = pool.m.prepare_store([key(1), key(2)], other)
    assert again is not None
    assert slot in again.slots


def test_expiry_keeps_the_slots_of_a_request_whose_copy_is_still_writing() -> None:
    pool = Pool(2, "lru", 0)
    ctx = pool.request("slow")
    assert pool.m.prepare_store([key(0)], ctx) is not None
    pool.clock.advance(100)
    released = pool.m.expire_requests(10, writing={"slow"})
    assert [(r.req_id, r.stores_dropped) for r in released] == [("slow", 1)]
    assert pool.state(key(0)) is MISS
    assert pool.m.stats().pending == 1  # the slot stays reserved under the running copy
    assert pool.m.expire_requests(10, writing={"slow"}) == []  # nothing more to release
    pool.m.complete_store([key(0)], ctx, success=True)  # the copy reports: slot freed
    stats = pool.m.stats()
    assert (stats.free, stats.pending, stats.live_requests) == (2, 0, 0)


def test_peek_answers_what_lookup_answers_and_counts_nothing() -> None:
    m = create_manager(8)
    ctx = ReqContext("r")
    m.on_new_request(ctx)
    m.prepare_store(keys(0, 4), ctx)
    m.complete_store(keys(0, 2), ctx)
    probe = [key(3), key(0), key(9), key(1), key(2)]
    before = m.stats()
    assert m.peek(probe) == [PENDING, HIT, MISS, HIT, PENDING]
    assert m.peek(keys(0, 2)) == [HIT, HIT]  # no store in flight among them: mapped in C
    assert m.stats() == before
    assert m.peek(probe) == m.lookup(probe, ctx).results
    with pytest.raises(InvalidArgumentError):
        m.peek([b""])
