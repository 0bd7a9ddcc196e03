"""One contract suite for every registered eviction policy, with the reuse filter off and on.

The manager-level tests drive ``OffloadManager`` through its public API and must hold for any
policy registered now or later (the parameters come from ``available_policies()``). The
policy-level tests call ``EvictionPolicy`` directly.
"""

from __future__ import annotations

import pytest

from manager import (
    BlockRemoved,
    BlockStored,
    EvictionPolicy,
    InvalidPolicyParamsError,
    available_policies,
    create_policy,
)
from tests.manager.harness import HIT, MISS, PENDING, Pool, key, keys

POLICIES = available_policies()
CAPACITY = 8


@pytest.fixture(params=POLICIES)
def policy(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    return name


@pytest.fixture(params=[0, 2], ids=["filter-off", "filter-on"])
def threshold(request: pytest.FixtureRequest) -> int:
    value: int = request.param
    return value


@pytest.fixture
def pool(policy: str, threshold: int) -> Pool:
    return Pool(CAPACITY, policy, threshold)


def test_registry_has_the_required_policies() -> None:
    assert {"lru", "arc"} <= set(POLICIES)
    assert sorted(POLICIES) == POLICIES


# ---------------------------------------------------------------------- through the manager


class TestManagerContract:
    def test_stored_blocks_become_hits_and_load_from_their_slots(self, pool: Pool) -> None:
        ctx = pool.request()
        batch = keys(0, 5)
        out = pool.offer(batch, ctx)
        assert out is not None
        assert out.keys_to_store == batch
        assert out.evicted_keys == []
        assert len(set(out.slots)) == 5
        assert all(0 <= s < CAPACITY for s in out.slots)
        assert pool.states(batch) == [PENDING] * 5
        done = pool.m.complete_store(batch, ctx, success=True)
        assert done.completed == batch
        assert pool.m.lookup([*batch, key(99)], ctx).hit_prefix == 5
        assert pool.m.prepare_load(batch, ctx) == out.slots
        assert [pool.m.ref_count(k) for k in batch] == [1] * 5
        pool.m.complete_load(batch, ctx)
        assert [pool.m.ref_count(k) for k in batch] == [0] * 5
        assert pool.m.stats().ready == 5
        pool.check_accounting()

    def test_resident_keys_offered_again_are_not_stored_again(self, pool: Pool) -> None:
        pool.store(keys(0, 3))
        before = pool.m.stats()
        ctx = pool.request()
        out = pool.m.prepare_store(keys(0, 3), ctx)
        assert out is not None
        assert (out.keys_to_store, out.slots, out.evicted_keys, out.skipped_keys) == (
            [],
            [],
            [],
            [],
        )
        after = pool.m.stats()
        assert after.stores_reused == before.stores_reused + 3
        assert after.stores_prepared == before.stores_prepared

    def test_capacity_is_never_exceeded(self, pool: Pool) -> None:
        for batch_no in range(6):
            batch = keys(3 * batch_no, 3 * batch_no + 3)
            free_before = pool.m.stats().free
            evicted = pool.store(batch)
            assert len(evicted) == max(0, 3 - free_before)
            s = pool.m.stats()
            assert s.ready == min(CAPACITY, 3 * batch_no + 3)
            assert s.ready <= CAPACITY
            pool.check_accounting()
        assert pool.m.stats().evictions == 18 - CAPACITY

    def test_pinned_blocks_are_never_evicted(self, pool: Pool) -> None:
        pool.store_each(keys(0, CAPACITY))
        pinned = [key(0), key(1), key(5)]  # the first two stored are the likeliest victims
        slots = [pool.m.slot_of(k) for k in pinned]
        pool.pin(pinned)
        evicted: list[bytes] = []
        for i in range(10):
            evicted += pool.store(keys(100 + 2 * i, 102 + 2 * i))
            pool.check_accounting()
        assert not set(evicted) & set(pinned)
        assert pool.states(pinned) == [HIT] * 3
        assert [pool.m.slot_of(k) for k in pinned] == slots
        assert [pool.m.ref_count(k) for k in pinned] == [1, 1, 1]
        assert pool.m.stats().pinned == 3

    def test_pending_blocks_are_never_evicted(self, pool: Pool) -> None:
        pool.store_each(keys(0, 4))
        writer = pool.request()
        in_flight = keys(50, 52)
        out = pool.offer(in_flight, writer)
        assert out is not None
        assert out.keys_to_store == in_flight
        evicted: list[bytes] = []
        for i in range(10):
            evicted += pool.store(keys(100 + 3 * i, 103 + 3 * i))
            pool.check_accounting()
            assert pool.m.stats().pending == 2
        assert not set(evicted) & set(in_flight)
        assert pool.states(in_flight) == [PENDING, PENDING]
        assert [pool.m.slot_of(k) for k in in_flight] == out.slots
        assert pool.m.complete_store(in_flight, writer).completed == in_flight
        assert pool.states(in_flight) == [HIT, HIT]

    def test_pool_full_of_pins_refuses_a_store_and_changes_nothing(self, pool: Pool) -> None:
        resident = keys(0, CAPACITY)
        pool.store(resident)
        pool.pin(resident)
        ctx = pool.request()
        offered = [key(100), key(101)]
        pool.prime(offered, ctx)
        watched = [*resident, *offered]
        before = pool.snapshot(watched)

        assert pool.m.prepare_store(offered, ctx) is None

        assert pool.snapshot(watched) == before.bumped(stores_refused=1)

    def test_pool_full_of_pending_stores_refuses_a_store_and_changes_nothing(
        self, pool: Pool
    ) -> None:
        writer = pool.request()
        in_flight = keys(0, CAPACITY)
        out = pool.offer(in_flight, writer)
        assert out is not None
        assert pool.m.stats().free == 0
        ctx = pool.request()
        pool.prime([key(100)], ctx)
        watched = [*in_flight, key(100)]
        before = pool.snapshot(watched)

        assert pool.m.prepare_store([key(100)], ctx) is None

        assert pool.snapshot(watched) == before.bumped(stores_refused=1)

    def test_refusal_needs_only_one_missing_slot(self, pool: Pool) -> None:
        resident = keys(0, CAPACITY)
        pool.store(resident)
        loader = pool.pin(resident[1:])  # exactly one evictable block left
        ctx = pool.request()
        assert pool.offer([key(100), key(101)], ctx) is None
        out = pool.m.prepare_store([key(100)], ctx)
        assert out is not None
        assert out.evicted_keys == [resident[0]]
        pool.m.complete_load(resident[1:], loader)
        pool.check_accounting()

    def test_eviction_frees_exactly_the_shortfall(self, pool: Pool) -> None:
        pool.store_each(keys(0, 6))
        assert pool.m.stats().free == 2
        ctx = pool.request()
        out = pool.offer(keys(100, 105), ctx)
        assert out is not None
        assert out.keys_to_store == keys(100, 105)
        assert len(out.evicted_keys) == 3
        assert len(set(out.evicted_keys)) == 3
        assert set(out.evicted_keys) <= set(keys(0, 6))
        assert pool.states(out.evicted_keys) == [MISS] * 3
        s = pool.m.stats()
        assert (s.free, s.pending, s.ready, s.evictions) == (0, 5, 3, 3)
        pool.check_accounting()

    def test_whole_offer_is_protected_from_its_own_eviction(self, pool: Pool) -> None:
        resident = keys(0, CAPACITY)
        pool.store_each(resident)
        ctx = pool.request()
        # Offer every resident block but two, plus two new ones: only those two may go.
        offered = [*resident[:6], key(100), key(101)]
        out = pool.offer(offered, ctx)
        assert out is not None
        assert out.keys_to_store == [key(100), key(101)]
        assert sorted(out.evicted_keys) == resident[6:]
        assert pool.states(resident[:6]) == [HIT] * 6

    def test_offer_is_refused_when_only_its_own_blocks_are_evictable(self, pool: Pool) -> None:
        resident = keys(0, CAPACITY)
        pool.store(resident)
        pool.pin(resident[6:])
        ctx = pool.request()
        offered = [*resident[:6], key(100)]
        pool.prime(offered, ctx)
        before = pool.snapshot(offered)
        assert pool.m.prepare_store(offered, ctx) is None
        assert pool.snapshot(offered) == before.bumped(stores_refused=1)

    def test_switch_to_every_other_policy_keeps_every_block(self, pool: Pool, policy: str) -> None:
        # History with evictions, touches and re-stores, so that policies hold real state.
        pool.store_each(keys(0, CAPACITY))
        pool.store(keys(20, 23))
        toucher = pool.request()
        pool.m.touch(pool.m.resident_keys()[:3], toucher)
        pool.store(keys(0, 2))
        loader = pool.pin(pool.m.resident_keys()[-2:])
        writer = pool.request()
        out = pool.offer([key(40)], writer)
        assert out is not None
        ready = pool.m.resident_keys()
        assert len(ready) == CAPACITY - 1
        slots = {k: pool.m.slot_of(k) for k in [*ready, key(40)]}
        refs = {k: pool.m.ref_count(k) for k in ready}
        for other in [*(p for p in POLICIES if p != policy), policy]:
            switch = pool.m.switch_policy(other)
            assert switch.changed
            assert switch.blocks_migrated == len(ready)
            assert pool.m.policy.name == other
            assert sorted(pool.m.resident_keys()) == sorted(ready)
            assert pool.states(ready) == [HIT] * len(ready)
            assert pool.state(key(40)) is PENDING
            assert {k: pool.m.slot_of(k) for k in slots} == slots
            assert {k: pool.m.ref_count(k) for k in ready} == refs
            probe = pool.request()
            assert pool.m.prepare_load(ready, probe) == [slots[k] for k in ready]
            pool.m.complete_load(ready, probe)
            pool.m.on_request_finished(probe)
            pool.check_accounting()
        assert pool.m.policy.generation == 1 + len(POLICIES)
        assert pool.m.complete_store([key(40)], writer).completed == [key(40)]
        pool.m.complete_load(ready[-2:], loader)
        assert pool.m.stats().pinned == 0

    def test_evictions_are_reported_as_removed_events(self, pool: Pool) -> None:
        pool.store(keys(0, CAPACITY))
        pool.m.take_events()
        evicted = pool.store(keys(100, 103))
        events = pool.m.take_events()
        removed = [e for e in events if isinstance(e, BlockRemoved)]
        assert len(removed) == 1
        assert removed[0].block_hashes == evicted
        assert [type(e) for e in events] == [BlockRemoved, BlockStored]
        assert len(evicted) == 3


# ---------------------------------------------------------------------- the policy itself


def always(_key: bytes) -> bool:
    return True


def history(p: EvictionPolicy) -> None:
    """Insert, touch, evict and re-insert, so that every policy has non-trivial state."""
    p.insert(keys(0, 4))
    p.insert(keys(4, 6))
    p.touch([key(1), key(4), key(99)])
    victims = p.evict(2, always)
    assert victims is not None
    p.insert(victims)  # ghost hits for policies that keep ghosts
    p.insert([key(10)])
    p.touch([key(10), key(3)])
    assert len(p) == 7


class TestEvictionPolicy:
    @pytest.fixture
    def p(self, policy: str) -> EvictionPolicy:
        return create_policy(policy, CAPACITY)

    def test_insert_holds_every_key(self, p: EvictionPolicy) -> None:
        p.insert(keys(0, 3))
        p.insert([key(3)])
        assert len(p) == 4
        assert all(k in p for k in keys(0, 4))
        assert key(4) not in p
        assert sorted(p.coldest_first()) == keys(0, 4)

    def test_touch_ignores_keys_it_does_not_hold(self, p: EvictionPolicy) -> None:
        p.insert(keys(0, 2))
        p.touch([key(7), key(0)])
        assert len(p) == 2
        assert key(7) not in p
        assert sorted(p.coldest_first()) == keys(0, 2)

    def test_touch_makes_a_key_hotter(self, p: EvictionPolicy) -> None:
        p.insert([key(0)])
        p.insert([key(1)])
        assert next(iter(p.coldest_first())) == key(0)
        p.touch([key(0)])
        assert p.evict(1, always) == [key(1)]

    def test_remove_forgets_keys_and_ignores_unknown_ones(self, p: EvictionPolicy) -> None:
        history(p)
        held = list(p.coldest_first())
        p.remove([held[0], held[3], key(77)])
        assert len(p) == len(held) - 2
        assert held[0] not in p
        assert held[3] not in p
        assert list(p.coldest_first()) == [k for k in held if k not in (held[0], held[3])]

    def test_evict_returns_n_distinct_held_keys_and_drops_them(self, p: EvictionPolicy) -> None:
        history(p)
        held = set(p.coldest_first())
        victims = p.evict(3, always)
        assert victims is not None
        assert len(victims) == 3
        assert len(set(victims)) == 3
        assert set(victims) <= held
        assert len(p) == len(held) - 3
        assert not any(k in p for k in victims)
        assert set(p.coldest_first()) == held - set(victims)

    def test_evict_without_a_filter_treats_every_key_as_evictable(
        self, p: EvictionPolicy, policy: str
    ) -> None:
        history(p)
        twin = create_policy(policy, CAPACITY)
        history(twin)
        assert p.evict(3, None) == twin.evict(3, always)
        assert list(p.coldest_first()) == list(twin.coldest_first())
        assert p.evict(len(p) + 1, None) is None
        assert len(p) == len(twin)

    def test_evict_zero_returns_nothing(self, p: EvictionPolicy) -> None:
        history(p)
        before = list(p.coldest_first())
        assert p.evict(0, always) == []
        assert list(p.coldest_first()) == before

    def test_evict_takes_only_keys_that_can_be_evicted(self, p: EvictionPolicy) -> None:
        history(p)
        held = list(p.coldest_first())
        allowed = set(held[3:5])
        victims = p.evict(2, lambda k: k in allowed)
        assert victims is not None
        assert set(victims) == allowed
        assert all(k in p for k in held[:3] + held[5:])

    @pytest.mark.parametrize("evictable", [0, 1, 2])
    def test_evict_returns_none_and_changes_nothing_when_too_few_evictable(
        self, p: EvictionPolicy, evictable: int
    ) -> None:
        history(p)
        before = list(p.coldest_first())
        allowed = set(before[:evictable])
        assert p.evict(evictable + 1, lambda k: k in allowed) is None
        assert list(p.coldest_first()) == before
        assert len(p) == len(before)
        # The refused call left no trace: the same request now behaves as on a fresh copy.
        twin = create_policy(p.name, CAPACITY)
        history(twin)
        assert p.evict(len(p), always) == twin.evict(len(twin), always)

    def test_evict_from_an_empty_policy_is_refused(self, p: EvictionPolicy) -> None:
        assert p.evict(1, always) is None
        assert len(p) == 0

    def test_coldest_first_lists_each_key_once_next_victim_first(self, p: EvictionPolicy) -> None:
        history(p)
        order = list(p.coldest_first())
        assert len(order) == len(set(order)) == len(p)
        assert p.evict(len(order), always) == order

    def test_evicting_one_at_a_time_follows_coldest_first(self, p: EvictionPolicy) -> None:
        history(p)
        order = list(p.coldest_first())
        one_by_one: list[bytes] = []
        for _ in order:
            assert next(iter(p.coldest_first())) == order[len(one_by_one)]
            victim = p.evict(1, always)
            assert victim is not None
            one_by_one += victim
        assert one_by_one == order
        assert len(p) == 0

    def test_one_batch_puts_its_tail_before_its_head(self, p: EvictionPolicy) -> None:
        p.insert([key(0), key(1), key(2)])
        assert p.evict(3, always) == [key(2), key(1), key(0)]

    def test_one_touch_puts_its_tail_before_its_head(self, p: EvictionPolicy) -> None:
        if not p.reorders_on_touch:
            pytest.skip(f"{p.name} counts a use without reordering (FIFO family)")
        p.insert([key(0)])
        p.insert([key(1)])
        p.insert([key(2)])
        p.touch([key(0), key(1), key(2)])
        assert p.evict(3, always) == [key(2), key(1), key(0)]

    def test_request_finished_puts_the_tail_before_the_head(self, p: EvictionPolicy) -> None:
        p.insert([key(0)])  # head, stored first: coldest so far
        p.insert([key(1)])
        p.insert([key(9)])  # another request's block
        p.request_finished([key(0), key(1), key(55)])
        order = list(p.coldest_first())
        assert order.index(key(1)) < order.index(key(0))
        assert len(p) == 3

    def test_rebuild_takes_every_key_and_keeps_the_coldest_first(
        self, p: EvictionPolicy, policy: str
    ) -> None:
        history(p)
        order = list(p.coldest_first())
        for target in POLICIES:
            fresh = create_policy(target, CAPACITY)
            assert fresh.rebuild(p.coldest_first()) == len(order)
            assert len(fresh) == len(order)
            assert sorted(fresh.coldest_first()) == sorted(order)
        assert list(p.coldest_first()) == order

    def test_rebuild_from_nothing_is_empty(self, p: EvictionPolicy) -> None:
        assert p.rebuild(iter([])) == 0
        assert len(p) == 0

    def test_parameters_are_validated(self, p: EvictionPolicy, policy: str) -> None:
        assert type(p).parse_params(dict(p.params)) == p.params
        with pytest.raises(InvalidPolicyParamsError):
            type(p).parse_params({"no_such_parameter_surely": 1})
        with pytest.raises(InvalidPolicyParamsError, match="capacity"):
            create_policy(policy, 0)
