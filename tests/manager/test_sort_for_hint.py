"""``sort_for_hint``: the keys a cache hint (drop, demote) may move and why the others stay.

It classifies with set operations; the contract is the per-key rule, checked here against the
public accessors for every mix of states: a key not resident is ``not_in_pool``; resident but
its store in flight, ``pending``; ready and named by a live retention, ``retained``; ready and
pinned, ``pinned``; else movable. Each distinct key counts once, movable keys keep the order
of their first appearance.
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from manager import BlockKey, OffloadManager, ReqContext, create_manager

STATES = ("absent", "pending", "ready", "pinned", "retained", "pending_retained", "both")


def key(i: int) -> BlockKey:
    return i.to_bytes(4, "big")


def build(states: list[str]) -> OffloadManager:
    m = create_manager(len(states) + 4)
    writer, reader = ReqContext("w"), ReqContext("r")
    m.on_new_request(writer)
    m.on_new_request(reader)
    stored = [key(i) for i, s in enumerate(states) if s != "absent"]
    assert m.prepare_store(stored, writer) is not None
    ready = [
        key(i) for i, s in enumerate(states) if s not in ("absent", "pending", "pending_retained")
    ]
    m.complete_store(ready, writer, True)
    pinned = [key(i) for i, s in enumerate(states) if s in ("pinned", "both")]
    if pinned:
        m.prepare_load(pinned, reader)
    retained = [
        key(i) for i, s in enumerate(states) if s in ("retained", "pending_retained", "both")
    ]
    if retained:
        m.retain(retained, 60.0, "keep")
    return m


def by_accessors(m: OffloadManager, keys: list[BlockKey]) -> tuple[list[BlockKey], dict[str, int]]:
    movable: list[BlockKey] = []
    kept = dict.fromkeys(("pinned", "retained", "pending", "not_in_pool"), 0)
    for k in dict.fromkeys(keys):
        if m.slot_of(k) is None:
            kept["not_in_pool"] += 1
        elif not m.is_ready(k):
            kept["pending"] += 1
        elif m.is_retained(k):
            kept["retained"] += 1
        elif m.ref_count(k):
            kept["pinned"] += 1
        else:
            movable.append(k)
    return movable, kept


@given(
    st.lists(st.sampled_from(STATES), min_size=1, max_size=12),
    st.lists(st.integers(0, 15), max_size=30),
)
def test_sort_for_hint_follows_the_per_key_rule(states: list[str], picks: list[int]) -> None:
    m = build(states)
    keys = [key(i) for i in picks]
    assert m.sort_for_hint(keys) == by_accessors(m, keys)


def test_every_reason_is_counted_once_per_distinct_key() -> None:
    m = build(["ready", "pending", "pinned", "retained", "both", "absent"])
    keys = [key(i) for i in (0, 0, 1, 2, 3, 4, 5, 9, 1)]
    movable, kept = m.sort_for_hint(keys)
    assert movable == [key(0)]
    assert kept == {"pinned": 1, "retained": 2, "pending": 1, "not_in_pool": 2}
