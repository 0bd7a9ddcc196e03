"""Scenario tests of ``prefix_lrfu``: each test states one sentence of its behaviour."""

from __future__ import annotations

import copy

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from manager import InvalidPolicyParamsError, create_policy
from manager.policies import PrefixLRFUPolicy
from tests.manager.harness import HIT, Pool, key, keys


def policy(capacity: int = 8, **params: float) -> PrefixLRFUPolicy:
    p = create_policy("prefix_lrfu", capacity, params)
    assert isinstance(p, PrefixLRFUPolicy)
    return p


def request(p: PrefixLRFUPolicy, chain: list[bytes], hit: int = 0) -> None:
    """What the manager does for one request: touch the hit prefix, store the rest, finish."""
    if hit:
        p.touch(chain[:hit])
    new = [k for k in chain[hit:] if k not in p]
    if new:
        p.insert(new)
    p.request_finished(chain)


def drain(p: PrefixLRFUPolicy) -> list[bytes]:
    """Every key in the order repeated ``evict(1)`` calls take them (on a copy)."""
    twin = copy.deepcopy(p)
    out: list[bytes] = []
    while len(twin):
        victim = twin.evict(1)
        assert victim is not None
        out += victim
    return out


def test_the_descendants_of_an_evicted_block_are_the_next_victims_deepest_first() -> None:
    p = policy()
    request(p, keys(0, 3))  # chain k0 -> k1 -> k2
    request(p, [key(9)])  # a newer, unrelated block
    # k1 and k2 are pinned, so only their parent k0 may go.
    assert p.evict(1, lambda k: k == key(0)) == [key(0)]
    assert list(p.coldest_first())[:2] == [key(2), key(1)]
    assert p.evict(2) == [key(2), key(1)]


def test_a_block_is_never_hotter_than_its_parent_even_when_used_alone() -> None:
    p = policy()
    request(p, keys(0, 2))
    for _ in range(5):
        p.touch([key(1)])
    order = list(p.coldest_first())
    assert order.index(key(1)) < order.index(key(0))


def test_request_finished_links_a_chain_stored_in_several_calls_tail_first() -> None:
    p = policy()
    p.insert([key(2)])  # the tail was stored first (an older block)...
    p.insert([key(1)])
    p.insert([key(0)])  # ...and the head last
    p.request_finished(keys(0, 3))
    assert drain(p) == [key(2), key(1), key(0)]


def test_a_block_used_often_outlives_newer_blocks_used_once() -> None:
    p = policy()
    request(p, [key(0)])
    for _ in range(3):
        p.touch([key(0)])
    for i in range(1, 5):
        request(p, [key(i)])
    assert drain(p)[-1] == key(0)


def test_a_block_used_often_long_ago_ages_below_recent_blocks() -> None:
    p = policy(capacity=4)
    request(p, [key(0)])
    for _ in range(3):
        p.touch([key(0)])
    request(p, [key(1)])
    p.touch([key(1)])
    assert drain(p).index(key(0)) > drain(p).index(key(1))  # frequent beats recent, for now
    for i in range(2, 60):  # 120 references: many half-lives of a 4-block pool
        request(p, [key(i)])
        p.touch([key(i)])
    order = drain(p)
    assert all(order.index(key(0)) < order.index(key(i)) for i in range(10, 60))


def test_a_block_stored_again_resumes_its_score_from_the_ghost() -> None:
    p = policy()
    request(p, [key(0)])
    for _ in range(3):
        p.touch([key(0)])
    assert p.evict(1, lambda k: k == key(0)) == [key(0)]
    p.insert([key(0)])  # stored again: remembered as popular
    p.insert([key(1)])  # stored later, but new
    assert drain(p) == [key(1), key(0)]


def test_a_new_block_of_a_kind_never_reused_is_filed_below_older_blocks() -> None:
    p = policy(capacity=16)
    long_chains = [keys(1000 + 100 * i, 1000 + 100 * i + 8) for i in range(3)]
    for i in range(40):
        request(p, [key(i)])  # one-block prompts: never seen again
        if i % 2 == 0:  # long prompts: each comes back soon
            chain = long_chains[i // 2 % len(long_chains)]
            request(p, chain, hit=len([k for k in chain if k in p]))
    old = keys(5000, 5008)
    request(p, old)  # a long prompt, the kind that came back
    request(p, [key(6000)])  # newer, but the kind that never did
    order = list(p.coldest_first())
    # The old prompt's last block is of the never-reused kind too (a prompt's own tail).
    assert order.index(key(6000)) < min(order.index(k) for k in old[:-1])


def test_the_last_block_of_a_chain_goes_before_the_rest_of_its_chain() -> None:
    p = policy()
    request(p, keys(0, 4))
    assert drain(p)[0] == key(3)


def test_loops_in_request_chains_do_not_hang_and_keep_one_order() -> None:
    p = policy()
    request(p, keys(0, 2))
    p.request_finished([key(1), key(0)])  # a loop: k0 -> k1 -> k0
    p.request_finished([key(0), key(0), key(1)])
    assert sorted(drain(p)) == keys(0, 2)
    assert drain(p) == list(p.coldest_first())


def test_memory_stays_bounded_by_multiples_of_the_capacity() -> None:
    capacity = 16
    p = policy(capacity)
    for i in range(3000):
        chain = [key(i % 97), *keys(200 + 7 * i, 200 + 7 * i + i % 5)]
        request(p, chain, hit=1 if chain[0] in p else 0)
        while len(p) > capacity:
            assert p.evict(1) is not None
    assert len(p._ghost) <= 2 * capacity
    assert len(p._watch) <= 2 * capacity
    assert p._order.heap_size() <= 2 * len(p) + 64
    assert set(p._stat) == set(p._order.entries)
    assert set(p._parent) <= set(p._order.entries)
    assert set(p._children) <= set(p._order.entries)


def test_the_prefix_shared_by_many_requests_survives_a_flood_of_one_off_prompts() -> None:
    shared = keys(0, 6)

    def run(policy_name: str) -> int:
        pool = Pool(24, policy_name)
        hits = 0
        for i in range(120):
            ctx = pool.request()
            chain = [*shared, key(100 + i)] if i % 8 == 0 else keys(1000 + 3 * i, 1003 + 3 * i)
            hit = pool.m.lookup(chain, ctx).hit_prefix
            hits += min(hit, len(shared))
            if hit:
                pool.m.prepare_load(chain[:hit], ctx)
                pool.m.touch(chain[:hit], ctx)
                pool.m.complete_load(chain[:hit], ctx)
            out = pool.m.prepare_store(chain[hit:], ctx)
            assert out is not None
            pool.m.complete_store(out.keys_to_store, ctx)
            pool.m.on_request_finished(ctx)
        assert pool.states(shared) == [HIT] * len(shared) or policy_name == "lru"
        return hits

    assert run("prefix_lrfu") > run("lru")


def test_parameters_are_validated_with_defaults_filled_in() -> None:
    assert PrefixLRFUPolicy.parse_params({}) == {
        "half_life": 1.0,
        "ghost_factor": 2.0,
        "watch_factor": 2.0,
    }
    assert PrefixLRFUPolicy.parse_params({"half_life": 2})["half_life"] == 2.0
    for bad in ({"half_life": 0}, {"ghost_factor": -1.0}, {"watch_factor": True}, {"x": 1}):
        with pytest.raises(InvalidPolicyParamsError):
            PrefixLRFUPolicy.parse_params(dict(bad))


# ---------------------------------------------------------------------- random histories

OPS = st.lists(
    st.tuples(
        st.sampled_from(["request", "touch", "evict", "evict_some", "remove"]),
        st.lists(st.integers(0, 15), min_size=1, max_size=6),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(OPS)
def test_random_histories_keep_children_before_parents_and_evict_in_listed_order(
    ops: list[tuple[str, list[int]]],
) -> None:
    p = policy(capacity=6)
    for op, ids in ops:
        ks = [key(i) for i in ids]
        if op == "request":
            request(p, list(dict.fromkeys(ks)), hit=sum(1 for _ in ks[:1] if ks[0] in p))
        elif op == "touch":
            p.touch(ks)
        elif op == "remove":
            p.remove(ks)
        else:
            allowed = set(ks) if op == "evict_some" else None
            before = list(p.coldest_first())
            n = len(ids) % 3 + 1
            out = p.evict(n, None if allowed is None else allowed.__contains__)
            if out is None:
                assert list(p.coldest_first()) == before
            else:
                assert len(out) == len(set(out)) == n
                assert allowed is None or set(out) <= allowed
                if allowed is None:
                    assert out == before[:n]
        order = list(p.coldest_first())
        assert len(order) == len(set(order)) == len(p)
        rank = {k: i for i, k in enumerate(order)}
        for child, parent in p._parent.items():
            assert rank[child] < rank[parent]
        assert drain(p) == order
