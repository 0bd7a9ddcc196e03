"""The batched fast paths of LRU and ARC choose exactly what the textbook per-key loops choose.

``manager/policies/lru.py`` and ``arc.py`` run their common cases as C-level passes (victims
read off the front of an ordered dict, ARC's eviction counted instead of walked, a chain moved
in one ``map``). Each test here drives the real policy and a plain reference written one key at
a time, the way the papers state the algorithms, with the same random operations, and requires
the same victims, the same lists and the same adaptive target after every step.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

from hypothesis import given, settings
from hypothesis import strategies as st

from manager.policies.arc import ARCPolicy
from manager.policies.lru import LRUPolicy

CanEvict = Callable[[bytes], bool] | None


class ReferenceARC:
    """ARC one key at a time (Megiddo and Modha), with the manager's batch conventions."""

    def __init__(self, capacity: int) -> None:
        self.c = capacity
        self.t1: OrderedDict[bytes, None] = OrderedDict()
        self.t2: OrderedDict[bytes, None] = OrderedDict()
        self.b1: OrderedDict[bytes, None] = OrderedDict()
        self.b2: OrderedDict[bytes, None] = OrderedDict()
        self.p = 0.0

    def insert(self, keys: Sequence[bytes]) -> None:
        for key in reversed(keys):
            if key in self.b1:
                self.p = min(float(self.c), self.p + max(1.0, len(self.b2) / len(self.b1)))
                del self.b1[key]
                self.t2[key] = None
            elif key in self.b2:
                self.p = max(0.0, self.p - max(1.0, len(self.b1) / len(self.b2)))
                del self.b2[key]
                self.t2[key] = None
            else:
                self.t1[key] = None
        self.trim()

    def touch(self, keys: Sequence[bytes]) -> None:
        for key in reversed(keys):
            if key in self.t1:
                del self.t1[key]
                self.t2[key] = None
            elif key in self.t2:
                self.t2.move_to_end(key)

    def request_finished(self, keys: Sequence[bytes]) -> None:
        for key in reversed(keys):
            if key in self.t1:
                self.t1.move_to_end(key)
            elif key in self.t2:
                self.t2.move_to_end(key)

    def evict(self, n: int, can_evict: CanEvict) -> list[bytes] | None:
        ok = can_evict or (lambda _: True)
        t1 = [k for k in self.t1 if ok(k)]
        t2 = [k for k in self.t2 if ok(k)]
        if n > len(t1) + len(t2):
            return None
        chosen: list[bytes] = []
        len1 = len(self.t1)
        for _ in range(n):
            if (len1 > 0 and len1 > self.p and t1) or not t2:
                key = t1.pop(0)
                len1 -= 1
                del self.t1[key]
                self.b1[key] = None
            else:
                key = t2.pop(0)
                del self.t2[key]
                self.b2[key] = None
            chosen.append(key)
        self.trim()
        return chosen

    def trim(self) -> None:
        while self.b1 and len(self.t1) + len(self.b1) > self.c:
            self.b1.popitem(last=False)
        while self.b2 and len(self.t1) + len(self.b1) + len(self.t2) + len(self.b2) > 2 * self.c:
            self.b2.popitem(last=False)

    def lists(self) -> tuple[list[bytes], list[bytes], list[bytes], list[bytes]]:
        return list(self.t1), list(self.t2), list(self.b1), list(self.b2)


class ReferenceLRU:
    def __init__(self) -> None:
        self.order: list[bytes] = []  # coldest first

    def insert(self, keys: Sequence[bytes]) -> None:
        self.order.extend(reversed(keys))

    def touch(self, keys: Sequence[bytes]) -> None:
        for key in reversed(keys):
            if key in self.order:
                self.order.remove(key)
                self.order.append(key)

    request_finished = touch

    def evict(self, n: int, can_evict: CanEvict) -> list[bytes] | None:
        ok = can_evict or (lambda _: True)
        victims = [k for k in self.order if ok(k)][:n]
        if len(victims) < n:
            return None
        for key in victims:
            self.order.remove(key)
        return victims


UNIVERSE = [bytes([i]) for i in range(16)]

# One step: (op, key indices, n, residue mod 7 of the keys that may not be evicted, or -1).
steps = st.lists(
    st.tuples(
        st.sampled_from(["insert", "touch", "finish", "evict"]),
        st.lists(st.integers(0, len(UNIVERSE) - 1), min_size=1, max_size=8),
        st.integers(1, 6),
        st.one_of(st.just(-1), st.integers(0, 6)),  # -1: nothing pinned (the counted path)
    ),
    max_size=80,
)


def _can_evict(pinned_mod: int) -> CanEvict:
    if pinned_mod < 0:
        return None
    return lambda k: k[0] % 7 != pinned_mod


Step = tuple[str, list[int], int, int]


def _replay(
    real: ARCPolicy | LRUPolicy,
    ref: ReferenceARC | ReferenceLRU,
    ops: list[Step],
    same: Callable[[], bool],
) -> None:
    """Apply each step to both policies; the victims and then ``same()`` must agree."""
    for op, idx, n, pinned in ops:
        keys = [UNIVERSE[i] for i in idx]
        if op == "insert":
            keys = [k for k in dict.fromkeys(keys) if k not in real]  # new, distinct keys
            real.insert(keys)
            ref.insert(keys)
        elif op == "touch":
            real.touch(keys)
            ref.touch(keys)
        elif op == "finish":
            real.request_finished(keys)
            ref.request_finished(keys)
        else:
            assert real.evict(n, _can_evict(pinned)) == ref.evict(n, _can_evict(pinned))
        assert same(), (op, keys)


@settings(max_examples=300, deadline=None)
@given(capacity=st.integers(2, 12), ops=steps)
def test_arc_matches_the_per_key_reference(capacity: int, ops: list[Step]) -> None:
    real, ref = ARCPolicy(capacity), ReferenceARC(capacity)
    _replay(real, ref, ops, lambda: real.lists() == ref.lists() and real.target_t1 == ref.p)


@settings(max_examples=300, deadline=None)
@given(ops=steps)
def test_lru_matches_the_per_key_reference(ops: list[Step]) -> None:
    real, ref = LRUPolicy(64), ReferenceLRU()
    _replay(real, ref, ops, lambda: list(real.coldest_first()) == ref.order)


def test_arc_takes_ceil_of_t1_minus_p_from_t1_when_p_is_fractional() -> None:
    """With |T1| - p = 1.5, T1 gives two victims (3 > 1.5 and 2 > 1.5, not 1 > 1.5), then T2."""
    real, ref = ARCPolicy(8), ReferenceARC(8)
    for policy in (real, ref):
        policy.insert(UNIVERSE[0:3])
        policy.touch(UNIVERSE[0:3])  # T2 = 2, 1, 0 (coldest first)
        policy.insert(UNIVERSE[3:6])  # T1 = 5, 4, 3
    real._p = ref.p = 1.5  # a fractional target, as ghost hits with |B2| / |B1| = 1.5 produce
    victims = real.evict(3)
    assert victims == ref.evict(3, None) == [UNIVERSE[5], UNIVERSE[4], UNIVERSE[2]]
    assert real.lists() == ref.lists()
