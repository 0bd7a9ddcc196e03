"""``LazyHeap`` (the ordered store of the LFU and prefix-LRFU policies) against a sorted dict.

The reference keeps the live ``(priority, seq)`` of every key in a plain dict and answers every
question by sorting it; the heap must give the same answers after any sequence of operations,
with ties in priority and sequence, keys set again to the entry they had, failed pops, and
compactions in between.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from manager.policies.lazy_heap import LazyHeap

KEYS = [bytes([i]) for i in range(12)]
Allowed = Callable[[bytes], bool] | None


class ReferenceHeap:
    """The same contract, one sort per question."""

    def __init__(self) -> None:
        self.entries: dict[bytes, tuple[float, int]] = {}

    def ordered(self) -> list[bytes]:
        return sorted(self.entries, key=lambda k: (*self.entries[k], k))

    def pop_lowest(self, n: int, allowed: Allowed) -> list[tuple[float, int, bytes]] | None:
        if n <= 0:
            return []
        keys = [k for k in self.ordered() if allowed is None or allowed(k)][:n]
        if len(keys) < n:
            return None
        items = [(*self.entries[k], k) for k in keys]
        for k in keys:
            del self.entries[k]
        return items


def _allowed(blocked: int) -> Allowed:
    if blocked < 0:
        return None
    return lambda k: k[0] % 4 != blocked


ops = st.lists(
    st.one_of(
        # small priority and sequence ranges: ties, and keys set again to the entry they had
        st.tuples(st.just("set"), st.integers(0, 11), st.integers(-2, 3), st.integers(0, 3)),
        st.tuples(st.just("discard"), st.integers(0, 11), st.just(0), st.just(0)),
        st.tuples(st.just("pop"), st.integers(0, 5), st.integers(-1, 3), st.just(0)),
        st.tuples(st.just("compact"), st.just(0), st.just(0), st.just(0)),
    ),
    max_size=120,
)


@settings(max_examples=300, deadline=None)
@given(slack=st.integers(1, 4), steps=ops)
def test_the_lazy_heap_answers_as_a_sorted_dict_does(
    slack: int, steps: list[tuple[str, int, int, int]]
) -> None:
    heap, ref = LazyHeap(slack), ReferenceHeap()
    for op, a, b, c in steps:
        if op == "set":
            heap.set(KEYS[a], float(b), c)
            ref.entries[KEYS[a]] = (float(b), c)
        elif op == "discard":
            assert heap.discard(KEYS[a]) == (ref.entries.pop(KEYS[a], None) is not None)
        elif op == "pop":
            assert heap.pop_lowest(a, _allowed(b)) == ref.pop_lowest(a, _allowed(b))
        else:
            heap.compact()
            assert heap.heap_size() <= slack * len(heap) + 64
        assert dict(heap.entries) == ref.entries
        assert heap.ordered() == ref.ordered()
        assert len(heap) == len(ref.entries)
        assert all(k in heap for k in ref.entries)


def test_a_failed_pop_keeps_every_key_and_the_order() -> None:
    heap = LazyHeap(2)
    for i, k in enumerate(KEYS[:4]):
        heap.set(k, float(i), i)
    heap.set(KEYS[0], 9.0, 9)  # a stale entry for KEYS[0] stays in the heap
    before = heap.ordered()
    assert heap.pop_lowest(3, lambda k: k != KEYS[1] and k != KEYS[2]) is None
    assert heap.ordered() == before
    everything = [(1.0, 1, KEYS[1]), (2.0, 2, KEYS[2]), (3.0, 3, KEYS[3]), (9.0, 9, KEYS[0])]
    assert heap.pop_lowest(4) == everything
    assert len(heap) == 0


def test_a_key_set_twice_to_the_same_entry_is_popped_once() -> None:
    heap = LazyHeap(2)
    heap.set(KEYS[0], 1.0, 1)
    heap.set(KEYS[0], 1.0, 1)  # two identical heap entries, both matching the live one
    heap.set(KEYS[1], 2.0, 2)
    assert heap.pop_lowest(2) == [(1.0, 1, KEYS[0]), (2.0, 2, KEYS[1])]


def test_compact_drops_stale_entries_once_they_dominate() -> None:
    heap = LazyHeap(2)
    for seq in range(1000):
        heap.set(KEYS[0], 0.0, seq)
    assert heap.heap_size() == 1000
    heap.compact()
    assert heap.heap_size() == 1
    assert heap.ordered() == [KEYS[0]]
    for seq in range(50):  # within the headroom: not worth a rebuild
        heap.set(KEYS[1], 0.0, seq)
    heap.compact()
    assert heap.heap_size() == 51


def test_slack_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="slack"):
        LazyHeap(0)
