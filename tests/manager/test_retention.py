"""Retentions: named sets of keys kept in the pool against eviction until their TTL passes.

Contract under test (``manager/retention.py`` and the "retentions and hints" section of
``manager/core.py``): a key named by any live retention, while it is ready in the pool, is never
evicted (not by ``prepare_store``'s room-making, not by ``demote``, not by ``reset``) until the
last retention naming it ends, by ``release_retention`` or by ``expire_retentions`` on the
injected clock. Meanwhile it is out of the policy's order, and goes back into it when released.
``drop`` (corrupt blocks) removes it all the same. A key retained before it is ready is kept from
the moment it becomes ready. ``prepare_store`` stays all-or-nothing.

The unit tests pin each verb and each refusal; ``RetentionMachine`` drives every verb together
(with stores, loads, demotes, drops, resets and policy switches) against a model of which
retentions exist and until when.
"""

from __future__ import annotations

import functools
import math
import tracemalloc
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from manager import (
    MAX_KEY_BYTES,
    BlockRemoved,
    InvalidArgumentError,
    ManagerStats,
    OffloadManager,
    ReqContext,
    ResetCounts,
    RetentionInfo,
    UnknownRetentionError,
    available_policies,
    create_manager,
)
from manager.retention import MAX_NAME, RetentionTable
from tests.manager.harness import HIT, MISS, FakeClock, Pool, key, keys

BAD_TTLS: list[object] = [0, 0.0, -1, -0.5, math.nan, math.inf, -math.inf, True, False, "5", None]
BAD_NAMES: list[object] = ["", "x" * (MAX_NAME + 1), 5, None, b"s"]
BAD_KEYS: list[object] = [b"", b"x" * (MAX_KEY_BYTES + 1), "k0", 5, bytearray(b"k0"), None]

Listened = list[tuple[list[bytes], list[int]]]


def listen(m: OffloadManager) -> Listened:
    """Record every eviction listener call (victims, slots) of ``m``."""
    calls: Listened = []
    m.add_eviction_listener(lambda victims, slots: calls.append((list(victims), list(slots))))
    return calls


def observe(m: OffloadManager) -> tuple[ManagerStats, list[RetentionInfo], list[bytes]]:
    """Everything a refused call must leave as it was."""
    return m.stats(), m.retentions(), m.resident_keys()


def fill(pool: Pool, n: int) -> None:
    """Store ``key(0) .. key(n-1)`` one at a time (``key(0)`` coldest)."""
    pool.store_each(keys(0, n))


def try_store(pool: Pool, block_keys: list[bytes]) -> list[bytes] | None:
    """Offer ``block_keys`` and complete them; the evicted keys, or None if refused."""
    ctx = pool.request()
    out = pool.m.prepare_store(block_keys, ctx)
    if out is None:
        pool.m.on_request_finished(ctx)
        return None
    pool.m.complete_store(out.keys_to_store, ctx, success=True)
    pool.m.on_request_finished(ctx)
    return out.evicted_keys


# ---------------------------------------------------------------------- retain


def test_retained_blocks_are_not_evicted_by_stores() -> None:
    pool = Pool(4)
    fill(pool, 4)
    info = pool.m.retain([key(0), key(1)], 10.0, "s")
    assert (info.name, info.keys, info.in_pool, info.added, info.created) == ("s", 2, 2, 2, True)
    assert (info.ttl_s, info.expires_in_s, info.age_s) == (10.0, 10.0, 0.0)
    # Only k002 and k003 are evictable: three new blocks cannot be made room for.
    ctx = pool.request()
    assert pool.m.prepare_store(keys(10, 13), ctx) is None
    assert pool.m.stats().stores_refused == 1
    evicted = try_store(pool, keys(10, 12))
    assert evicted is not None
    assert sorted(evicted) == [key(2), key(3)]
    assert pool.states([key(0), key(1)]) == [HIT, HIT]
    pool.check_accounting()


def test_retain_adds_no_load_makes_no_room_and_evicts_nothing() -> None:
    pool = Pool(3)
    calls = listen(pool.m)
    fill(pool, 3)
    before = pool.m.stats()
    pool.m.retain(keys(0, 3), 5.0, "s")
    after = pool.m.stats()
    assert (after.free, after.ready, after.loads, after.evictions, after.pinned) == (
        before.free,
        before.ready,
        before.loads,
        before.evictions,
        before.pinned,
    )
    assert calls == []
    assert sorted(pool.m.resident_keys()) == keys(0, 3)


def test_a_key_retained_before_it_is_stored_is_kept_once_ready() -> None:
    pool = Pool(2)
    info = pool.m.retain([key(0), key(1)], 5.0, "s")
    assert (info.keys, info.in_pool, info.added) == (2, 0, 2)
    assert pool.m.stats().retained == 2
    assert pool.m.stats().retained_ready == 0
    # Neither is kept while pending; k001's store fails, k000's succeeds.
    ctx = pool.request()
    out = pool.m.prepare_store([key(0), key(1)], ctx)
    assert out is not None
    assert pool.m.stats().retained_ready == 0
    pool.m.complete_store([key(1)], ctx, success=False)
    assert pool.m.stats().retained_ready == 0
    pool.m.complete_store([key(0)], ctx, success=True)
    assert pool.m.stats().retained_ready == 1
    assert pool.m.retention("s").in_pool == 1
    # The pool has k000 (kept) and one free slot: two new blocks cannot fit.
    assert try_store(pool, [key(5), key(6)]) is None
    assert try_store(pool, [key(5)]) == []
    assert try_store(pool, [key(6)]) == [key(5)]
    assert pool.state(key(0)) is HIT
    pool.check_accounting()


def test_pending_key_retained_then_stored_is_kept() -> None:
    pool = Pool(2)
    ctx = pool.request()
    out = pool.m.prepare_store([key(0)], ctx)
    assert out is not None
    pool.m.retain([key(0)], 5.0, "s")
    assert pool.m.retention("s").in_pool == 0
    pool.m.complete_store([key(0)], ctx, success=True)
    assert pool.m.retention("s").in_pool == 1
    assert pool.m.resident_keys() == [key(0)]
    assert try_store(pool, [key(1), key(2)]) is None
    pool.check_accounting()


def test_restored_blocks_that_are_retained_are_kept() -> None:
    pool = Pool(3)
    pool.m.retain([key(1)], 5.0, "s")
    assert pool.m.restore([(key(0), 0), (key(1), 1), (key(2), 2)]) == 3
    assert pool.m.stats().retained_ready == 1
    assert pool.m.resident_keys()[-1] == key(1)
    evicted = try_store(pool, keys(10, 12))
    assert evicted is not None
    assert sorted(evicted) == [key(0), key(2)]
    pool.check_accounting()


def test_retain_with_a_taken_name_adds_keys_and_restarts_the_ttl() -> None:
    pool = Pool(4)
    fill(pool, 3)
    pool.m.retain([key(0)], 10.0, "s")
    pool.clock.advance(8.0)
    info = pool.m.retain([key(0), key(1), key(1), key(9)], 4.0, "s")
    assert (info.added, info.created) == (2, False)
    assert (info.keys, info.in_pool, info.ttl_s, info.expires_in_s) == (3, 2, 4.0, 4.0)
    assert info.age_s == 8.0
    assert pool.m.retention_keys("s") == [key(0), key(1), key(9)]
    s = pool.m.stats()
    assert (s.retentions, s.retained, s.retained_ready, s.retentions_started) == (1, 3, 2, 1)
    # The old deadline (t+10) passes; the restarted one (t+12) has not.
    pool.clock.advance(3.0)
    assert pool.m.expire_retentions() == []
    assert pool.m.is_retained(key(0))
    pool.clock.advance(1.0)
    assert [i.name for i in pool.m.expire_retentions()] == ["s"]
    assert not pool.m.is_retained(key(0))


def test_retain_accepts_an_int_ttl_and_the_longest_name() -> None:
    pool = Pool(2)
    name = "n" * MAX_NAME
    info = pool.m.retain([key(0)], 3, name)
    assert info.name == name
    assert info.ttl_s == 3.0
    assert isinstance(info.ttl_s, float)
    assert pool.m.retain([], 1.0, "empty").keys == 0
    assert [i.name for i in pool.m.retentions()] == [name, "empty"]


# ---------------------------------------------------------------------- refusals


@pytest.mark.parametrize("ttl", BAD_TTLS, ids=repr)
def test_a_bad_ttl_is_refused_and_changes_nothing(ttl: object) -> None:
    pool = Pool(3)
    fill(pool, 2)
    pool.m.retain([key(0)], 5.0, "s")
    pool.clock.advance(1.0)
    before = observe(pool.m)
    with pytest.raises(InvalidArgumentError):
        pool.m.retain([key(1)], ttl, "s")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError):
        pool.m.retain([key(1)], ttl, "t")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError):
        pool.m.renew_retention("s", ttl)  # type: ignore[arg-type]
    assert observe(pool.m) == before
    assert pool.m.retention_keys("s") == [key(0)]


@pytest.mark.parametrize("name", BAD_NAMES, ids=repr)
def test_a_bad_name_is_refused_and_changes_nothing(name: object) -> None:
    pool = Pool(3)
    fill(pool, 2)
    before = observe(pool.m)
    with pytest.raises(InvalidArgumentError):
        pool.m.retain([key(0)], 5.0, name)  # type: ignore[arg-type]
    assert observe(pool.m) == before
    assert not pool.m.is_retained(key(0))


@pytest.mark.parametrize("bad", BAD_KEYS, ids=repr)
def test_a_bad_key_is_refused_and_changes_nothing(bad: object) -> None:
    pool = Pool(3)
    fill(pool, 2)
    pool.m.retain([key(0)], 5.0, "s")
    before = observe(pool.m)
    for name in ("s", "t"):
        with pytest.raises(InvalidArgumentError):
            pool.m.retain([key(1), bad], 9.0, name)  # type: ignore[list-item]
    with pytest.raises(InvalidArgumentError):
        pool.m.demote([key(1), bad])  # type: ignore[list-item]
    assert observe(pool.m) == before
    assert not pool.m.is_retained(key(1))
    assert pool.m.retention_keys("s") == [key(0)]


def test_unknown_names_raise_unknown_retention_error() -> None:
    pool = Pool(2)
    pool.m.retain([key(0)], 1.0, "s")
    pool.m.release_retention("s")
    for name in ("s", "never"):
        with pytest.raises(UnknownRetentionError):
            pool.m.renew_retention(name, 1.0)
        with pytest.raises(UnknownRetentionError):
            pool.m.release_retention(name)
        with pytest.raises(UnknownRetentionError):
            pool.m.retention(name)
        with pytest.raises(UnknownRetentionError):
            pool.m.retention_keys(name)
    s = pool.m.stats()
    assert (s.retentions, s.retentions_started, s.retentions_released) == (0, 1, 1)


# ---------------------------------------------------------------------- renew, release, expire


def test_renew_restarts_the_ttl_from_now() -> None:
    pool = Pool(2)
    pool.m.retain([key(0)], 2.0, "s")
    pool.clock.advance(1.5)
    info = pool.m.renew_retention("s", 5.0)
    assert (info.ttl_s, info.expires_in_s, info.age_s, info.added) == (5.0, 5.0, 1.5, 0)
    pool.clock.advance(4.5)
    assert pool.m.expire_retentions() == []
    assert pool.m.retention("s").expires_in_s == 0.5
    pool.clock.advance(0.5)  # exactly at the deadline: due
    expired = pool.m.expire_retentions()
    assert [(i.name, i.expires_in_s) for i in expired] == [("s", 0.0)]
    assert pool.m.stats().retentions_expired == 1


def test_expiry_needs_the_call_and_takes_only_the_due() -> None:
    pool = Pool(4)
    fill(pool, 4)
    pool.m.retain([key(0)], 1.0, "a")
    pool.m.retain([key(1)], 3.0, "b")
    pool.m.retain([key(0), key(2)], 2.0, "c")
    pool.clock.advance(2.0)
    # a and c are past their deadlines, but nothing expires by itself: still kept.
    assert pool.m.stats().retained_ready == 3
    assert try_store(pool, keys(10, 13)) is None
    assert [i.name for i in pool.m.expire_retentions()] == ["a", "c"]
    assert [i.name for i in pool.m.retentions()] == ["b"]
    s = pool.m.stats()
    assert (s.retentions, s.retained, s.retained_ready, s.retentions_expired) == (1, 1, 1, 2)
    evicted = try_store(pool, keys(10, 13))
    assert evicted is not None
    assert sorted(evicted) == [key(0), key(2), key(3)]
    pool.check_accounting()


def test_release_makes_the_keys_evictable_again_in_policy_order() -> None:
    pool = Pool(4)
    fill(pool, 4)
    pool.m.retain([key(0), key(1)], 5.0, "s")
    assert set(pool.m.resident_keys()[2:]) == {key(0), key(1)}
    assert pool.m.resident_keys()[:2] == [key(2), key(3)]
    info = pool.m.release_retention("s")
    assert (info.name, info.keys, info.in_pool) == ("s", 2, 2)
    # Back into the policy as a batch, head hotter than tail.
    assert pool.m.resident_keys() == [key(2), key(3), key(1), key(0)]
    s = pool.m.stats()
    assert (s.retentions, s.retained, s.retained_ready, s.retentions_released) == (0, 0, 0, 1)
    evicted = try_store(pool, keys(10, 14))
    assert evicted is not None
    assert sorted(evicted) == keys(0, 4)
    pool.check_accounting()


def test_a_key_named_twice_stays_kept_until_the_last_retention_ends() -> None:
    pool = Pool(3)
    fill(pool, 3)
    pool.m.retain([key(0), key(1)], 5.0, "a")
    pool.m.retain([key(1)], 5.0, "b")
    pool.m.release_retention("a")
    assert pool.m.is_retained(key(1))
    assert not pool.m.is_retained(key(0))
    assert pool.m.stats().retained_ready == 1
    evicted = try_store(pool, keys(10, 12))
    assert evicted is not None
    assert sorted(evicted) == [key(0), key(2)]
    assert try_store(pool, keys(20, 23)) is None
    pool.m.release_retention("b")
    assert try_store(pool, keys(20, 23)) is not None
    assert pool.state(key(1)) is MISS
    pool.check_accounting()


def test_new_retained_counts_keys_no_retention_names() -> None:
    pool = Pool(3)
    pool.m.retain([key(0)], 5.0, "a")
    before = observe(pool.m)
    assert pool.m.new_retained("b", [key(0), key(1), key(1), key(2)]) == 2
    assert pool.m.new_retained("a", [key(0)]) == 0
    assert observe(pool.m) == before


# ---------------------------------------------------------------------- pins


def test_a_retained_pinned_block_stays_until_both_end_unpin_first() -> None:
    pool = Pool(2)
    fill(pool, 2)
    pool.m.retain([key(0)], 5.0, "s")
    loader = pool.pin([key(0)])
    assert try_store(pool, keys(10, 12)) is None
    pool.m.complete_load([key(0)], loader)
    assert try_store(pool, keys(10, 12)) is None  # unpinned, still retained
    pool.m.release_retention("s")
    evicted = try_store(pool, keys(10, 12))
    assert evicted is not None
    assert sorted(evicted) == [key(0), key(1)]
    pool.check_accounting()


def test_a_retained_pinned_block_stays_until_both_end_release_first() -> None:
    pool = Pool(2)
    fill(pool, 2)
    pool.m.retain([key(0)], 5.0, "s")
    loader = pool.pin([key(0)])
    pool.m.release_retention("s")
    assert try_store(pool, keys(10, 12)) is None  # released, still pinned
    assert pool.m.demote([key(0)]) == []
    pool.m.complete_load([key(0)], loader)
    evicted = try_store(pool, keys(10, 12))
    assert evicted is not None
    assert sorted(evicted) == [key(0), key(1)]
    pool.check_accounting()


def test_refusal_when_the_pool_is_exactly_full_of_kept_blocks_some_pinned() -> None:
    pool = Pool(4)
    fill(pool, 4)
    pool.m.retain(keys(0, 4), 5.0, "s")
    pool.pin([key(0), key(1)])
    before = observe(pool.m)
    ctx = pool.request()
    assert pool.m.prepare_store([key(9)], ctx) is None
    # An offer of kept keys alone needs no room and evicts nothing.
    out = pool.m.prepare_store([key(0), key(2)], ctx)
    assert out is not None
    assert (out.keys_to_store, out.evicted_keys) == ([], [])
    assert pool.m.prepare_store([key(2), key(0), key(9)], ctx) is None
    after = pool.m.stats()
    assert after.stores_refused == before[0].stores_refused + 2
    assert pool.m.resident_keys() == before[2]
    pool.check_accounting()


def test_kept_blocks_that_are_also_pinned_or_offered_are_not_counted_twice() -> None:
    # Ready k0..k3; k0, k1 kept; k0 pinned; the offer names k1 (kept) and one new key. The
    # evictable blocks are k2 and k3: a bound that subtracts k0 and k1 twice finds none.
    pool = Pool(4)
    fill(pool, 4)
    pool.m.retain([key(0), key(1)], 5.0, "s")
    pool.pin([key(0)])
    ctx = pool.request()
    out = pool.m.prepare_store([key(1), key(9)], ctx)
    assert out is not None
    assert out.keys_to_store == [key(9)]
    assert out.evicted_keys == [key(2)]
    pool.m.complete_store(out.keys_to_store, ctx, success=True)
    # Now k3 and k9 are the evictable blocks; an offer of k1 + three new keys is short by 1.
    assert pool.m.prepare_store([key(1), *keys(20, 23)], ctx) is None
    out = pool.m.prepare_store([key(1), key(0), *keys(20, 22)], ctx)
    assert out is not None
    assert sorted(out.evicted_keys) == [key(3), key(9)]
    pool.check_accounting()


# ---------------------------------------------------------------------- policies


@pytest.mark.parametrize("start", available_policies())
def test_retentions_survive_every_policy_switch(start: str) -> None:
    pool = Pool(5, start)
    fill(pool, 5)
    pool.m.retain([key(1), key(3)], 5.0, "s")
    for name in [*available_policies(), start]:
        switch = pool.m.switch_policy(name)
        assert switch.blocks_migrated == (3 if switch.changed else 0)
        assert sorted(pool.m.resident_keys()) == keys(0, 5)
        assert set(pool.m.resident_keys()[3:]) == {key(1), key(3)}
        s = pool.m.stats()
        assert (s.retentions, s.retained, s.retained_ready, s.ready) == (1, 2, 2, 5)
        pool.check_accounting()
    pool.m.switch_policy("lru" if start != "lru" else "arc")
    evicted = try_store(pool, keys(10, 14))
    assert evicted is None  # 3 evictable, 4 needed
    evicted = try_store(pool, keys(10, 13))
    assert evicted is not None
    assert sorted(evicted) == [key(0), key(2), key(4)]
    assert pool.states([key(1), key(3)]) == [HIT, HIT]
    pool.m.release_retention("s")
    assert sorted(pool.m.resident_keys()) == sorted([key(1), key(3), *keys(10, 13)])
    assert try_store(pool, keys(20, 25)) is not None
    pool.check_accounting()


@pytest.mark.parametrize("policy", available_policies())
def test_every_policy_keeps_retained_blocks_under_pressure(policy: str) -> None:
    pool = Pool(4, policy)
    fill(pool, 4)
    loader = pool.pin([key(0), key(2)])
    pool.m.complete_load([key(0), key(2)], loader)  # a use for each, as a hit would be
    pool.m.retain([key(0), key(3)], 5.0, "s")
    for i in range(10, 20):
        assert try_store(pool, [key(i)]) is not None
        assert pool.states([key(0), key(3)]) == [HIT, HIT]
    pool.m.release_retention("s")
    assert try_store(pool, keys(30, 34)) is not None
    assert pool.states([key(0), key(3)]) == [MISS, MISS]
    pool.check_accounting()


# ---------------------------------------------------------------------- reset, drop, demote


def test_reset_keeps_retained_blocks() -> None:
    pool = Pool(5)
    fill(pool, 5)
    pool.m.retain([key(0), key(1), key(7)], 5.0, "s")
    pool.pin([key(1), key(2)])
    counts = pool.m.reset()
    assert counts == ResetCounts(dropped=2, kept_pinned=2, kept_pending=0, kept_retained=1)
    assert sorted(pool.m.resident_keys()) == keys(0, 3)
    assert pool.m.stats().retained_ready == 2
    pool.m.release_retention("s")
    assert pool.m.reset() == ResetCounts(dropped=1, kept_pinned=2, kept_pending=0)
    assert sorted(pool.m.resident_keys()) == [key(1), key(2)]
    pool.check_accounting()


def test_drop_removes_a_retained_block_and_it_is_kept_again_when_restored() -> None:
    pool = Pool(3)
    fill(pool, 3)
    pool.m.retain([key(0), key(1)], 5.0, "s")
    pool.pin([key(1)])
    assert pool.m.drop([key(0), key(1), key(2), key(0)]) == [key(0), key(2)]
    s = pool.m.stats()
    assert (s.retained, s.retained_ready, s.ready, s.free) == (2, 1, 1, 2)
    assert pool.m.retention("s").in_pool == 1
    pool.store([key(0)])
    assert pool.m.stats().retained_ready == 2
    assert try_store(pool, [key(9), key(8)]) is None
    pool.m.release_retention("s")
    assert pool.m.stats().retained_ready == 0
    assert sorted(pool.m.resident_keys()) == [key(0), key(1)]
    assert try_store(pool, [key(9), key(8)]) is not None  # k0 evicted, k1 pinned
    assert pool.state(key(0)) is MISS
    pool.check_accounting()


def test_demote_never_takes_retained_pinned_or_pending_blocks() -> None:
    pool = Pool(6)
    calls = listen(pool.m)
    fill(pool, 4)
    ctx = pool.request()
    assert pool.m.prepare_store([key(5)], ctx) is not None
    pool.m.retain([key(0), key(9)], 5.0, "s")
    pool.pin([key(1)])
    slots = {k: pool.m.slot_of(k) for k in keys(0, 6)}
    pool.m.take_events()
    demoted = pool.m.demote([key(3), key(0), key(1), key(5), key(2), key(3), key(9)])
    assert demoted == [key(3), key(2)]
    assert calls == [([key(3), key(2)], [slots[key(3)], slots[key(2)]])]
    events = pool.m.take_events()
    assert len(events) == 1
    assert isinstance(events[0], BlockRemoved)
    assert events[0].block_hashes == [key(3), key(2)]
    s = pool.m.stats()
    assert (s.demoted, s.evictions, s.ready, s.pending) == (2, 0, 2, 1)
    assert pool.m.demote([key(0)]) == []
    pool.m.release_retention("s")
    assert pool.m.demote([key(0)]) == [key(0)]
    assert calls[-1] == ([key(0)], [slots[key(0)]])
    assert pool.m.stats().demoted == 3
    assert pool.m.demote([]) == []
    pool.check_accounting()


def test_stats_fields_follow_the_retentions() -> None:
    pool = Pool(4)
    fill(pool, 2)
    s = pool.m.stats()
    assert (s.retentions, s.retained, s.retained_ready) == (0, 0, 0)
    pool.m.retain([key(0), key(5)], 1.0, "a")
    pool.m.retain([key(0), key(1)], 2.0, "b")
    pool.m.retain([key(6)], 2.0, "a")
    s = pool.m.stats()
    assert (s.retentions, s.retained, s.retained_ready, s.retentions_started) == (2, 4, 2, 2)
    pool.clock.advance(1.0)
    pool.m.expire_retentions()
    s = pool.m.stats()
    # ``a`` was extended with a 2 s TTL: not due at t+1.
    assert (s.retentions, s.retained, s.retained_ready, s.retentions_expired) == (2, 4, 2, 0)
    pool.m.release_retention("b")
    pool.clock.advance(1.0)
    assert [i.name for i in pool.m.expire_retentions()] == ["a"]
    s = pool.m.stats()
    assert (s.retentions, s.retained, s.retained_ready) == (0, 0, 0)
    assert (s.retentions_started, s.retentions_released, s.retentions_expired) == (2, 1, 1)
    pool.check_accounting()


# ---------------------------------------------------------------------- state machine

SM_KEYS = [f"k{i}".encode() for i in range(6)]
NAMES = ["s0", "s1", "s2"]
REQS = ["r0", "r1"]
TTLS = [0.5, 1.0, 2.0, 3.5, 8.0]
STEPS = [0.0, 0.5, 1.0, 2.0, 4.0]


@functools.cache
def lists_of(
    pool: tuple[bytes, ...], min_size: int, max_size: int
) -> st.SearchStrategy[list[bytes]]:
    """Lists of keys from ``pool`` (strategies built once: building one costs more than a draw)."""
    return st.lists(st.sampled_from(pool), min_size=min_size, max_size=max_size)


@dataclass
class ModelRetention:
    keys: dict[bytes, None] = field(default_factory=dict)
    deadline: float = 0.0


class RetentionMachine(RuleBasedStateMachine):
    """Retentions among stores, loads, demotes, drops, resets and policy switches."""

    m: OffloadManager

    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.capacity = 0
        self.policy = ""
        self.ready: set[bytes] = set()
        self.pending: dict[bytes, str] = {}
        self.pins: dict[str, Counter[bytes]] = {rid: Counter() for rid in REQS}
        self.retentions: dict[str, ModelRetention] = {}
        self.counters: Counter[str] = Counter()
        # Ready keys some retention named after the previous step: still ready now, or dropped.
        self.guarded: set[bytes] = set()
        self.listened: Listened = []
        self.fills = 0

    @initialize(capacity=st.integers(2, 5), policy=st.sampled_from(available_policies()))
    def start(self, capacity: int, policy: str) -> None:
        self.capacity, self.policy = capacity, policy
        self.m = create_manager(capacity, policy, clock=self.clock)
        self.listened = listen(self.m)
        for rid in REQS:
            assert self.m.on_new_request(ReqContext(rid))

    # ------------------------------------------------------------ model

    def retained(self) -> set[bytes]:
        return {k for r in self.retentions.values() for k in r.keys}

    def kept(self) -> set[bytes]:
        return self.ready & self.retained()

    def pinned(self) -> set[bytes]:
        return {k for c in self.pins.values() for k in c}

    def free(self) -> int:
        return self.capacity - len(self.ready) - len(self.pending)

    def evictable(self, offered: set[bytes]) -> set[bytes]:
        return self.ready - self.pinned() - self.kept() - offered

    def slots(self) -> dict[bytes, int | None]:
        return {k: self.m.slot_of(k) for k in self.ready}

    def unchanged(self, action: Callable[[], object], error: type[Exception]) -> None:
        before = observe(self.m)
        with pytest.raises(error):
            action()
        assert observe(self.m) == before

    def check_info(self, info: RetentionInfo, name: str) -> None:
        rec = self.retentions[name]
        assert info.name == name
        assert info.keys == len(rec.keys)
        assert info.in_pool == len(self.ready & rec.keys.keys())
        assert info.expires_in_s == max(0.0, rec.deadline - self.clock.now)

    def pick_keys(
        self, data: st.DataObject, preferred: set[bytes], min_size: int = 0, max_size: int = 4
    ) -> list[bytes]:
        """Mostly keys from ``preferred`` (when there are any), sometimes any keys."""
        pool = tuple(SM_KEYS)
        if preferred and data.draw(st.integers(0, 3), label="preferred keys?") > 0:
            pool = tuple(sorted(preferred))
        return data.draw(lists_of(pool, min_size, max_size))

    # ------------------------------------------------------------ retentions

    @rule(data=st.data())
    def retain(self, data: st.DataObject) -> None:
        block_keys: list[object] = list(self.pick_keys(data, self.ready))
        name: object = data.draw(st.sampled_from(NAMES), label="name")
        ttl: object = data.draw(st.sampled_from(TTLS), label="ttl")
        bad = data.draw(st.sampled_from(["", "", "", "", "", "", "", "", "ttl", "name", "key"]))
        if bad:
            if bad == "ttl":
                ttl = data.draw(st.sampled_from(BAD_TTLS), label="bad ttl")
            elif bad == "name":
                name = data.draw(st.sampled_from(BAD_NAMES), label="bad name")
            else:
                block_keys.append(data.draw(st.sampled_from(BAD_KEYS), label="bad key"))
            self.unchanged(
                lambda: self.m.retain(block_keys, ttl, name),  # type: ignore[arg-type]
                InvalidArgumentError,
            )
            return
        assert isinstance(name, str)
        assert isinstance(ttl, float)
        good = [k for k in block_keys if isinstance(k, bytes)]
        resident = sorted(self.m.resident_keys())
        info = self.m.retain(good, ttl, name)
        assert sorted(self.m.resident_keys()) == resident, "retain changed the pool"
        known = set(self.retentions)
        rec = self.retentions.get(name)
        if rec is None:
            rec = self.retentions[name] = ModelRetention()
            self.counters["started"] += 1
        added = [k for k in dict.fromkeys(good) if k not in rec.keys]
        rec.keys.update(dict.fromkeys(added))
        rec.deadline = self.clock.now + ttl
        self.check_info(info, name)
        assert (info.ttl_s, info.expires_in_s, info.added) == (ttl, ttl, len(added))
        assert info.created is (name not in known)

    @rule(data=st.data())
    def retain_more(self, data: st.DataObject) -> None:
        """The same as ``retain``: a second rule gives it twice the share of steps."""
        self.retain(data)

    @rule(
        name=st.sampled_from(NAMES),
        ttl=st.sampled_from(TTLS),
        how=st.sampled_from(["renew", "renew", "release"]),
    )
    def renew_or_release(self, name: str, ttl: float, how: str) -> None:
        """Renew or end a retention (one rule: retentions should live a while)."""
        if how == "renew":
            self.renew(name, ttl)
        else:
            self.release(name)

    def renew(self, name: str, ttl: float) -> None:
        if name not in self.retentions:
            self.unchanged(lambda: self.m.renew_retention(name, ttl), UnknownRetentionError)
            return
        info = self.m.renew_retention(name, ttl)
        self.retentions[name].deadline = self.clock.now + ttl
        self.check_info(info, name)
        assert info.ttl_s == ttl

    def release(self, name: str) -> None:
        if name not in self.retentions:
            self.unchanged(lambda: self.m.release_retention(name), UnknownRetentionError)
            return
        info = self.m.release_retention(name)
        self.check_info(info, name)
        del self.retentions[name]
        self.counters["released"] += 1

    @rule(dt=st.sampled_from(STEPS), expire=st.booleans())
    def advance(self, dt: float, expire: bool) -> None:
        """Move the clock; then maybe expire (nothing expires without the call)."""
        self.clock.advance(dt)
        if not expire:
            return
        now = self.clock.now
        due = [n for n, r in self.retentions.items() if r.deadline <= now]
        out = self.m.expire_retentions()
        assert [i.name for i in out] == due
        for info in out:
            self.check_info(info, info.name)
            assert info.expires_in_s == 0.0
            del self.retentions[info.name]
        self.counters["expired"] += len(due)

    # ------------------------------------------------------------ stores and loads

    finishes = st.sampled_from(["success", "success", "success", "failure", "later"])

    @rule(data=st.data(), rid=st.sampled_from(REQS), finish=finishes)
    def store(self, data: st.DataObject, rid: str, finish: str) -> None:
        # Mostly new keys, and kept ones: those test the room count at its edges.
        absent = set(SM_KEYS) - self.ready - self.pending.keys()
        offer = self.pick_keys(data, absent | self.kept(), min_size=1)
        ctx = ReqContext(rid)
        new = [k for k in dict.fromkeys(offer) if k not in self.ready and k not in self.pending]
        offered = set(offer) & (self.ready - self.pinned())
        evictable = self.evictable(offered)
        shortfall = len(new) - self.free()
        slots = self.slots()
        calls = len(self.listened)
        out = self.m.prepare_store(offer, ctx)
        if shortfall > len(evictable):
            assert out is None, f"store refused: short {shortfall}, evictable {evictable}"
            self.counters["refused"] += 1
            assert len(self.listened) == calls
            return
        assert out is not None, f"refused though {len(evictable)} evictable >= {shortfall}"
        assert out.keys_to_store == new
        victims = out.evicted_keys
        assert len(victims) == max(0, shortfall)
        assert set(victims) <= evictable, "evicted a pinned, retained or offered block"
        if victims:
            assert self.listened[calls:] == [(victims, [slots[k] for k in victims])]
        self.ready -= set(victims)
        for k in new:
            self.pending[k] = rid
        if finish != "later":
            self.complete(rid, new, finish == "success")

    @rule(data=st.data(), rid=st.sampled_from(REQS), finish=finishes)
    def store_more(self, data: st.DataObject, rid: str, finish: str) -> None:
        """The same as ``store``: a second rule gives stores twice the share of steps."""
        self.store(data, rid, finish)

    def complete(self, rid: str, block_keys: list[bytes], success: bool) -> None:
        done = self.m.complete_store(block_keys, ReqContext(rid), success)
        mine = [k for k in dict.fromkeys(block_keys) if self.pending.get(k) == rid]
        assert (done.completed if success else done.dropped) == mine
        assert len(done.ignored) == len(block_keys) - len(mine)
        for k in mine:
            del self.pending[k]
        if success:
            self.ready |= set(mine)

    @rule(data=st.data(), success=st.booleans())
    def complete_pending(self, data: st.DataObject, success: bool) -> None:
        writers = sorted(set(self.pending.values())) or REQS
        rid = data.draw(st.sampled_from(writers), label="rid")
        mine = sorted(k for k, owner in self.pending.items() if owner == rid)
        every: bool = data.draw(st.booleans(), label="all?")
        block_keys = mine if mine and every else self.pick_keys(data, set(mine))
        self.complete(rid, block_keys, success)

    @rule(data=st.data(), rid=st.sampled_from(REQS))
    def load(self, data: st.DataObject, rid: str) -> None:
        if not self.ready:
            return
        block_keys = data.draw(lists_of(tuple(sorted(self.ready)), 0, 3))
        slots = self.m.prepare_load(block_keys, ReqContext(rid))
        assert slots == [self.m.slot_of(k) for k in block_keys]
        self.pins[rid].update(block_keys)

    @rule(data=st.data(), rid=st.sampled_from(REQS))
    def unload(self, data: st.DataObject, rid: str) -> None:
        held = sorted(self.pins[rid].elements())
        if not held:
            return
        count = data.draw(st.integers(1, len(held)), label="how many")
        block_keys = data.draw(st.permutations(held))[:count]
        self.m.complete_load(block_keys, ReqContext(rid))
        self.pins[rid].subtract(block_keys)
        self.pins[rid] = +self.pins[rid]

    def fill_pool(self) -> None:
        """Store as many fresh keys as the pool has slots (then fail them): possible exactly
        when every ready block outside retentions and pins can be evicted."""
        self.fills += 1
        ctx = ReqContext(f"fill-{self.fills}")
        self.m.on_new_request(ctx)
        fresh = [f"fill-{self.fills}-{i}".encode() for i in range(self.capacity)]
        evictable = self.evictable(set())
        shortfall = self.capacity - self.free()
        out = self.m.prepare_store(fresh, ctx)
        if shortfall > len(evictable):
            assert out is None
            self.counters["refused"] += 1
        else:
            assert out is not None
            assert len(out.evicted_keys) == shortfall
            assert set(out.evicted_keys) <= evictable
            self.ready -= set(out.evicted_keys)
            self.m.complete_store(fresh, ctx, success=False)
        self.m.on_request_finished(ctx)

    def end_everything(self) -> None:
        """Release every retention, pin and pending store: then nothing leaks, and the whole
        pool can be stored over."""
        for name in list(self.retentions):
            self.m.release_retention(name)
            del self.retentions[name]
            self.counters["released"] += 1
        self.guarded.clear()  # nothing retained: the fill below may evict any ready block
        for rid, pins in self.pins.items():
            self.m.complete_load(sorted(pins.elements()), ReqContext(rid))
            pins.clear()
        for rid in REQS:
            self.complete(rid, sorted(k for k, o in self.pending.items() if o == rid), False)
        s = self.m.stats()
        assert (s.retentions, s.retained, s.retained_ready, s.pinned, s.pending) == (0,) * 5
        assert sorted(self.m.resident_keys()) == sorted(self.ready)
        self.fill_pool()
        assert self.ready == set()
        assert self.m.stats().free == self.capacity

    # ------------------------------------------------------------ admin

    @rule(data=st.data(), how=st.sampled_from(["demote", "drop"]))
    def remove(self, data: st.DataObject, how: str) -> None:
        """Take blocks out of the pool: ``demote`` (to a lower tier) or ``drop`` (corrupt)."""
        block_keys = self.pick_keys(data, self.ready, max_size=2)
        if how == "demote":
            self.demote(block_keys)
        else:
            self.drop(block_keys)

    @rule(data=st.data())
    def admin(self, data: st.DataObject) -> None:
        """An operator action (these empty the pool, so they share one rule's share of steps)."""
        action = data.draw(st.sampled_from(["switch_policy", "reset", "fill", "end"]))
        if action == "switch_policy":
            self.switch_policy(data.draw(st.sampled_from(available_policies()), label="to"))
        elif action == "reset":
            self.reset()
        elif action == "fill":
            self.fill_pool()
        else:
            self.end_everything()

    def demote(self, block_keys: list[bytes]) -> None:
        pinned, kept = self.pinned(), self.kept()
        expected = [
            k for k in dict.fromkeys(block_keys) if k in self.ready and k not in pinned | kept
        ]
        slots = self.slots()
        calls = len(self.listened)
        assert self.m.demote(block_keys) == expected
        if expected:
            assert self.listened[calls:] == [(expected, [slots[k] for k in expected])]
        else:
            assert len(self.listened) == calls
        self.ready -= set(expected)
        self.counters["demoted"] += len(expected)

    def drop(self, block_keys: list[bytes]) -> None:
        pinned = self.pinned()
        expected = [k for k in dict.fromkeys(block_keys) if k in self.ready and k not in pinned]
        assert self.m.drop(block_keys) == expected
        self.ready -= set(expected)
        self.guarded -= set(expected)

    def reset(self) -> None:
        pinned, kept = self.pinned(), self.kept()
        dropped = self.ready - pinned - kept
        counts = self.m.reset()
        assert counts == ResetCounts(
            dropped=len(dropped),
            kept_pinned=len(pinned),
            kept_pending=len(self.pending),
            kept_retained=len(kept - pinned),
        )
        self.ready -= dropped

    def switch_policy(self, name: str) -> None:
        switch = self.m.switch_policy(name)
        assert switch.changed is (name != self.policy)
        assert switch.blocks_migrated == (len(self.ready - self.kept()) if switch.changed else 0)
        self.policy = name

    # ------------------------------------------------------------ invariants

    @invariant()
    def retained_blocks_never_leave(self) -> None:
        """(a): a ready block some retention named after the last step is still ready
        (``drop`` aside); no retention with time left was ended by expiry."""
        resident = set(self.m.resident_keys())
        lost = self.guarded - resident
        assert not lost, f"retained blocks evicted: {sorted(lost)}"
        now = self.clock.now
        live = {n for n, r in self.retentions.items() if r.deadline > now}
        assert live <= {i.name for i in self.m.retentions()}
        self.guarded = self.kept()

    @invariant()
    def counts_add_up(self) -> None:
        """(c) and the block counts the model predicts."""
        s = self.m.stats()
        assert s.free + s.pending + s.ready == s.num_blocks == self.capacity
        assert (s.free, s.pending, s.ready, s.pinned) == (
            self.free(),
            len(self.pending),
            len(self.ready),
            len(self.pinned()),
        )
        assert s.policy == self.policy
        assert s.stores_refused == self.counters["refused"]
        assert s.evictions_by_policy.keys() <= set(available_policies())

    @invariant()
    def retentions_match_the_model(self) -> None:
        """(b): the retained gauges never leak, kept blocks sit out of the policy's order and
        every other ready block is in it."""
        s = self.m.stats()
        kept = self.kept()
        assert s.retentions == len(self.retentions)
        assert s.retained == len(self.retained())
        assert s.retained_ready == len(kept)
        assert (
            s.retentions_started,
            s.retentions_released,
            s.retentions_expired,
            s.demoted,
        ) == (
            self.counters["started"],
            self.counters["released"],
            self.counters["expired"],
            self.counters["demoted"],
        )
        resident = self.m.resident_keys()
        assert len(resident) == len(set(resident)) == len(self.ready)
        in_policy = len(self.ready) - len(kept)
        assert set(resident[:in_policy]) == self.ready - kept
        assert set(resident[in_policy:]) == kept
        assert [self.m.is_retained(k) for k in SM_KEYS] == [k in self.retained() for k in SM_KEYS]
        assert [i.name for i in self.m.retentions()] == list(self.retentions)
        for info in self.m.retentions():
            self.check_info(info, info.name)
            assert self.m.retention_keys(info.name) == list(self.retentions[info.name].keys)
        slots = [self.m.slot_of(k) for k in [*self.ready, *self.pending]]
        assert None not in slots
        assert len(set(slots)) == len(slots)


RetentionMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None
)
TestRetentionMachine = RetentionMachine.TestCase


# --------------------------------------------------------------------------- memory


def _retained_bytes(table: RetentionTable, prefix: str, names: int, ks: list[bytes]) -> int:
    """Bytes ``names`` retentions of ``ks`` (each call with its own copies of the keys, as
    decoded from a request's body) leave allocated in ``table``."""
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for n in range(names):
            table.add(f"{prefix}{n}", [bytes(bytearray(k)) for k in ks], 60.0, 0.0)
        return tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()


def test_retentions_naming_the_same_keys_share_them_at_a_few_bytes_a_key() -> None:
    ks = [i.to_bytes(8, "big") for i in range(2000)]
    table = RetentionTable()
    first = _retained_bytes(table, "a", 1, ks)
    more = _retained_bytes(table, "b", 20, ks)
    # One table of the keys, then an array of 4-byte ids per retention (a dict of its own
    # keys and their copies was ~100 bytes a key).
    assert more / (20 * len(ks)) < 8, more
    assert first > 20 * len(ks)  # the first one holds the keys themselves
    assert len(table.ids) == len(ks)
    assert table.references == 21 * len(ks)
    assert table.new_references("a0", [*ks[:10], b"new"]) == 1
    assert table.new_references("fresh", ks[:10]) == 10


def test_references_and_the_shared_table_come_back_as_retentions_end() -> None:
    ks = [i.to_bytes(8, "big") for i in range(5000)]
    table = RetentionTable()
    table.add("a", ks, 60.0, 0.0)
    table.add("b", ks[:100], 60.0, 0.0)
    assert table.references == 5100
    assert table.remove("a") == ks[100:]
    # Under a quarter of its peak: rebuilt, and retention "b" still names its keys.
    assert table.keys_of("b") == ks[:100]
    assert sorted(table.ids.values()) == list(range(100))
    assert table.remove("b") == ks[:100]
    assert (table.references, len(table.ids)) == (0, 0)
    table.add("c", ks[:3], 60.0, 0.0)
    assert table.keys_of("c") == ks[:3]


def test_the_table_ended_in_steps_is_the_table_ended_whole() -> None:
    """Ending a retention a few ids a step, its table rebuilt too (it held under a quarter
    of its peak), leaves the table ``remove`` leaves: the same ids, keys and counts, and the
    next retention gets the same ids."""
    big = [f"k{i}".encode() for i in range(3000)]
    tables = (RetentionTable(), RetentionTable())
    for t in tables:
        t.add("a", big, 60.0, 0.0)
        t.add("b", [*big[2900:], b"x", b"y"], 60.0, 0.0)
    whole, stepped = tables
    freed = whole.remove("a")
    assert freed == big[:2900]
    assert len([*stepped.remove_steps("a", 7)]) > 400  # a step per 7 ids, and the rebuild's
    for t in tables:
        t.add("c", [b"z", *big[:5]], 60.0, 0.0)
    assert whole.ids == stepped.ids
    assert len(whole.ids) == 108
    for name in ("b", "c"):
        assert whole.keys_of(name) == stepped.keys_of(name)
    assert (whole.references, len(whole)) == (stepped.references, len(stepped)) == (108, 2)
