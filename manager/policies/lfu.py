"""LFU with dynamic aging (LFU-DA, Arlitt et al. 2000) and a frequency memory of evicted keys.

Each held block has priority ``L + f``: ``f`` counts its stores and uses, ``L`` is the cache
"age", raised to the priority of every evicted block. A block that was used often long ago
therefore decays relative to new blocks as ``L`` climbs, which plain LFU never does. The use
count of a key survives its eviction in a bounded history (``history_factor`` x capacity keys,
oldest forgotten first), so a block that keeps coming back is recognised as popular.

Victims: lowest priority first; among equals the one filed earliest. A batch is filed tail
first, so within a request the tail goes before the head. O(log n) per operation (a
``LazyHeap``: a binary heap with lazy invalidation, compacted when stale entries dominate).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence

from manager.policies.base import CanEvict, EvictionPolicy
from manager.policies.lazy_heap import LazyHeap
from manager.policies.params import ParamSpec
from manager.policies.registry import register_policy


@register_policy
class LFUPolicy(EvictionPolicy):
    """Least frequently used, with dynamic aging."""

    name = "lfu"
    params_spec = (
        # The history remembers the counts of up to ``history_factor x capacity`` evicted keys,
        # an ordered-dict entry each (~150 bytes with the key), beside one per held key. 0
        # keeps the minimum of one entry (LFU-DA with almost no memory); 16 lets a key come
        # back with its count after 16 pool sizes of other evictions, at 16 times the
        # metadata of the held keys: a ceiling on memory, not a tuning point (default 2).
        # Beyond it a factor only buys memory: 1e30 is unbounded, 1e308 overflows int().
        ParamSpec(
            name="history_factor",
            kind="float",
            default=2.0,
            low=0.0,
            high=16.0,
            doc="evicted keys whose use counts are remembered, as a multiple of the capacity",
        ),
    )

    def __init__(self, capacity: int, params: dict[str, object] | None = None) -> None:
        super().__init__(capacity, params)
        self._history_size = max(1, int(capacity * self.params["history_factor"]))
        self._age = 0.0
        self._seq = 0
        # Held keys by (priority, filing sequence); rebuilt past 4 heap entries per held key.
        self._order = LazyHeap(slack=4)
        # key -> use count, for held and recently evicted keys (bounded, LRU order).
        self._freq: OrderedDict[bytes, int] = OrderedDict()

    def _file(self, key: bytes, count: int) -> None:
        self._seq += 1
        self._order.set(key, self._age + count, self._seq)

    def _bump(self, key: bytes) -> int:
        freq = self._freq
        count = freq.pop(key, 0) + 1
        freq[key] = count
        return count

    def insert(self, keys: Sequence[bytes]) -> None:
        for key in reversed(keys):
            self._file(key, self._bump(key))
        self._trim_history()
        self._order.compact()

    def touch(self, keys: Sequence[bytes]) -> None:
        entries = self._order.entries
        for key in reversed(keys):
            if key in entries:
                self._file(key, self._bump(key))
        self._order.compact()

    def request_finished(self, keys: Sequence[bytes]) -> None:
        """Re-file the held keys tail first at their current priority (no use counted)."""
        order = self._order
        entries = order.entries
        for key in reversed(keys):
            if key in entries:
                self._seq += 1
                order.set(key, entries[key][0], self._seq)
        order.compact()

    def remove(self, keys: Sequence[bytes]) -> None:
        order = self._order
        for key in keys:
            order.discard(key)
        order.compact()

    def evict(self, n: int, can_evict: CanEvict | None = None) -> list[bytes] | None:
        victims = self._order.pop_lowest(n, can_evict)
        if victims is None:
            return None
        if victims:
            # Victims come lowest first, so the last has the highest priority: the new age.
            self._age = max(self._age, victims[-1][0])
            self._trim_history()
        return [key for _, _, key in victims]

    def _trim_history(self) -> None:
        """Forget the counts of the least recently counted evicted keys beyond the bound.

        Held keys keep their counts: one met at the old end is moved to the young end, and at
        most ``len(freq)`` keys are examined, so the loop ends.
        """
        freq, held = self._freq, self._order.entries
        limit = self._history_size + len(held)
        steps = len(freq)
        while len(freq) > limit and steps > 0:
            steps -= 1
            key, count = freq.popitem(last=False)
            if key in held:
                freq[key] = count

    def coldest_first(self) -> Iterator[bytes]:
        return iter(self._order.ordered())

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order
