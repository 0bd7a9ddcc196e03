"""ARC: adaptive replacement cache (Megiddo and Modha, FAST 2003).

Two resident lists: T1 holds blocks used once since they were stored (recency), T2 blocks used
at least twice (frequency). Two ghost lists remember keys recently evicted from each: B1 from
T1, B2 from T2. A store of a key found in B1 means T1 was too small, so the target size ``p`` of
T1 grows; a store of a key found in B2 shrinks it. Victims come from T1 while T1 is larger than
``p``, else from T2. Ghosts are bounded as in the paper: ``|T1| + |B1| <= c`` and the four lists
together hold at most ``2c`` keys. The algorithm has no parameter to tune.

Mapping to the manager's calls: ``insert`` is the miss path (a ghost hit adapts ``p`` and goes
straight to T2), ``touch`` the hit path (T1 -> T2, or MRU of T2). ``coldest_first`` yields the
keys in the order ``evict`` would take them if all were evictable: the least recent of T1 while
T1 is above ``p``, then T2, then the rest of T1, each least recent first.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import islice

from manager.policies.base import CanEvict, EvictionPolicy
from manager.policies.registry import register_policy

# Drains an iterator in C (a deque that keeps nothing): runs a ``map`` of a method for its effect.
_consume: Callable[[Iterable[object]], None] = deque[object](maxlen=0).extend


@register_policy
class ARCPolicy(EvictionPolicy):
    """Adaptive replacement cache with ghost lists."""

    name = "arc"

    def __init__(self, capacity: int, params: dict[str, object] | None = None) -> None:
        super().__init__(capacity, params)
        self._t1: OrderedDict[bytes, None] = OrderedDict()
        self._t2: OrderedDict[bytes, None] = OrderedDict()
        self._b1: OrderedDict[bytes, None] = OrderedDict()
        self._b2: OrderedDict[bytes, None] = OrderedDict()
        self._p = 0.0

    @property
    def target_t1(self) -> float:
        """The adaptive target size of T1."""
        return self._p

    def lists(self) -> tuple[list[bytes], list[bytes], list[bytes], list[bytes]]:
        """Snapshot of (T1, T2, B1, B2), each least recent first (for tests and debugging)."""
        return list(self._t1), list(self._t2), list(self._b1), list(self._b2)

    def insert(self, keys: Sequence[bytes]) -> None:
        t1, t2, b1, b2 = self._t1, self._t2, self._b1, self._b2
        if b1.keys().isdisjoint(keys) and b2.keys().isdisjoint(keys):
            # No ghost hit (the common case): every key is a plain miss and joins T1.
            for key in reversed(keys):  # a loop: OrderedDict.update is slower
                t1[key] = None
            self._trim_ghosts()
            return
        cap = float(self.capacity)
        for key in reversed(keys):
            if key in b1:
                self._p = min(cap, self._p + max(1.0, len(b2) / len(b1)))
                del b1[key]
                t2[key] = None
            elif key in b2:
                self._p = max(0.0, self._p - max(1.0, len(b1) / len(b2)))
                del b2[key]
                t2[key] = None
            else:
                t1[key] = None
        self._trim_ghosts()

    def touch(self, keys: Sequence[bytes]) -> None:
        t1, t2 = self._t1, self._t2
        if keys and keys[-1] in t2:
            try:
                # Every key already in T2 (a block in steady use): each just moves to MRU.
                _consume(map(t2.move_to_end, reversed(keys)))
                return
            except KeyError:
                # Redoing the moves made so far, in the same order, gives the same final order.
                pass
        for key in reversed(keys):
            if key in t1:
                del t1[key]
                t2[key] = None
            elif key in t2:
                t2.move_to_end(key)

    def request_finished(self, keys: Sequence[bytes]) -> None:
        t1, t2 = self._t1, self._t2
        if keys:
            same_list = t2 if keys[-1] in t2 else t1
            try:
                # The whole chain in one list: move each key to MRU in C. Moves already made
                # when a key is not there are redone, in the same order, by the loop below.
                _consume(map(same_list.move_to_end, reversed(keys)))
                return
            except KeyError:
                pass
        for key in reversed(keys):
            if key in t1:
                t1.move_to_end(key)
            elif key in t2:
                t2.move_to_end(key)

    def remove(self, keys: Sequence[bytes]) -> None:
        t1, t2 = self._t1, self._t2
        for key in keys:
            if key in t1:
                del t1[key]
            else:
                t2.pop(key, None)

    def evict(self, n: int, can_evict: CanEvict | None = None) -> list[bytes] | None:
        if n <= 0:
            return []
        if can_evict is None:
            return self._evict_any(n)
        it1 = (k for k in self._t1 if can_evict(k))
        it2 = (k for k in self._t2 if can_evict(k))
        from1: list[bytes] = []
        from2: list[bytes] = []
        chosen: list[bytes] = []
        len1 = len(self._t1)
        p = self._p
        while len(from1) + len(from2) < n:
            first, second = (it1, it2) if len1 > 0 and len1 > p else (it2, it1)
            key = next(first, None)
            if key is None:
                first = second
                key = next(second, None)
                if key is None:
                    return None
            chosen.append(key)
            if first is it1:
                from1.append(key)
                len1 -= 1
            else:
                from2.append(key)
        t1, t2, b1, b2 = self._t1, self._t2, self._b1, self._b2
        for key in from1:
            del t1[key]
            b1[key] = None
        for key in from2:
            del t2[key]
            b2[key] = None
        self._trim_ghosts()
        return chosen

    def _evict_any(self, n: int) -> list[bytes] | None:
        """``evict`` when every held key may go: the same choice, counted instead of walked.

        T1 gives its least recent keys while it is above ``p`` (``ceil(|T1| - p)`` of them at
        most), then T2, then T1 again if T2 runs out; the keys come back in that order.
        """
        t1, t2 = self._t1, self._t2
        if n > len(t1) + len(t2):
            return None
        above = min(n, max(0, math.ceil(len(t1) - self._p)))
        from2 = min(n - above, len(t2))
        # Read the victims off the fronts (popitem builds a tuple per key and is slower).
        head = list(islice(t1, above))
        middle = list(islice(t2, from2))
        rest = list(islice(t1, above, n - from2))
        b1, b2 = self._b1, self._b2
        for key in head:
            del t1[key]
            b1[key] = None
        for key in rest:
            del t1[key]
            b1[key] = None
        for key in middle:
            del t2[key]
            b2[key] = None
        self._trim_ghosts()
        return head + middle + rest

    def _trim_ghosts(self) -> None:
        cap = self.capacity
        b1, b2 = self._b1, self._b2
        over1 = min(len(b1), len(self._t1) + len(b1) - cap)
        if over1 > 0:
            for key in list(islice(b1, over1)):
                del b1[key]
        over2 = min(len(b2), len(self._t1) + len(b1) + len(self._t2) + len(b2) - 2 * cap)
        if over2 > 0:
            for key in list(islice(b2, over2)):
                del b2[key]

    def coldest_first(self) -> Iterator[bytes]:
        t1 = list(self._t1)
        above = 0  # how many T1 keys evict takes before it turns to T2
        while above < len(t1) and len(t1) - above > self._p:
            above += 1
        return iter([*t1[:above], *self._t2, *t1[above:]])

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    def __contains__(self, key: object) -> bool:
        return key in self._t1 or key in self._t2
