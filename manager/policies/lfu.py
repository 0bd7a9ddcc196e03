"""LFU with dynamic aging (LFU-DA, Arlitt et al. 2000) and a frequency memory of evicted keys.

Each held block has priority ``L + f``: ``f`` counts its stores and uses, ``L`` is the cache
"age", raised to the priority of every evicted block. A block that was used often long ago
therefore decays relative to new blocks as ``L`` climbs, which plain LFU never does. The use
count of a key survives its eviction in a bounded history (``history_factor`` x capacity keys,
oldest forgotten first), so a block that keeps coming back is recognised as popular.

Victims: lowest priority first; among equals the one filed earliest. A batch is filed tail
first, so within a request the tail goes before the head. O(log n) per operation (a binary heap
with lazy invalidation, compacted when stale entries dominate).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Any

from manager.errors import InvalidPolicyParamsError
from manager.policies.base import CanEvict, EvictionPolicy
from manager.policies.registry import register_policy


@register_policy
class LFUPolicy(EvictionPolicy):
    """Least frequently used, with dynamic aging."""

    name = "lfu"

    def __init__(self, capacity: int, params: dict[str, object] | None = None) -> None:
        super().__init__(capacity, params)
        self._history_size = max(1, int(capacity * self.params["history_factor"]))
        self._age = 0.0
        self._seq = 0
        # key -> (priority, seq) of its live heap entry; only held keys are here.
        self._entry: dict[bytes, tuple[float, int]] = {}
        self._heap: list[tuple[float, int, bytes]] = []
        # key -> use count, for held and recently evicted keys (bounded, LRU order).
        self._freq: OrderedDict[bytes, int] = OrderedDict()

    @classmethod
    def parse_params(cls, params: dict[str, Any]) -> dict[str, Any]:
        factor = params.pop("history_factor", 2.0)
        if params:
            raise InvalidPolicyParamsError(f"lfu: unknown parameters {sorted(params)}")
        if isinstance(factor, bool) or not isinstance(factor, int | float) or factor < 0:
            raise InvalidPolicyParamsError(f"lfu: history_factor must be >= 0, got {factor!r}")
        return {"history_factor": float(factor)}

    def _file(self, key: bytes, count: int) -> None:
        self._seq += 1
        prio = self._age + count
        self._entry[key] = (prio, self._seq)
        heapq.heappush(self._heap, (prio, self._seq, key))

    def _bump(self, key: bytes) -> int:
        freq = self._freq
        count = freq.pop(key, 0) + 1
        freq[key] = count
        return count

    def insert(self, keys: Sequence[bytes]) -> None:
        for key in reversed(keys):
            self._file(key, self._bump(key))
        self._trim_history()

    def touch(self, keys: Sequence[bytes]) -> None:
        entry = self._entry
        for key in reversed(keys):
            if key in entry:
                self._file(key, self._bump(key))

    def request_finished(self, keys: Sequence[bytes]) -> None:
        """Re-file the held keys tail first at their current priority (no use counted)."""
        entry = self._entry
        for key in reversed(keys):
            if key in entry:
                prio = entry[key][0]
                self._seq += 1
                entry[key] = (prio, self._seq)
                heapq.heappush(self._heap, (prio, self._seq, key))
        self._compact()

    def remove(self, keys: Sequence[bytes]) -> None:
        entry = self._entry
        for key in keys:
            entry.pop(key, None)
        self._compact()

    def evict(self, n: int, can_evict: CanEvict | None = None) -> list[bytes] | None:
        if n <= 0:
            return []
        heap, entry = self._heap, self._entry
        victims: list[tuple[float, int, bytes]] = []
        passed: list[tuple[float, int, bytes]] = []  # unevictable entries, filed back after
        while heap and len(victims) < n:
            item = heapq.heappop(heap)
            prio, seq, key = item
            if entry.get(key) != (prio, seq):
                continue  # stale: the key was re-filed or dropped
            if can_evict is not None and not can_evict(key):
                passed.append(item)
            else:
                victims.append(item)
        for item in passed:
            heapq.heappush(heap, item)
        if len(victims) < n:
            for item in victims:
                heapq.heappush(heap, item)
            return None
        keys = [key for _, _, key in victims]
        for key in keys:
            prio, _ = entry.pop(key)
            if prio > self._age:
                self._age = prio
        self._trim_history()
        return keys

    def _trim_history(self) -> None:
        """Forget the counts of the least recently counted evicted keys beyond the bound.

        Held keys keep their counts: one met at the old end is moved to the young end, and at
        most ``len(freq)`` keys are examined, so the loop ends.
        """
        freq, entry = self._freq, self._entry
        limit = self._history_size + len(entry)
        steps = len(freq)
        while len(freq) > limit and steps > 0:
            steps -= 1
            key, count = freq.popitem(last=False)
            if key in entry:
                freq[key] = count

    def _compact(self) -> None:
        if len(self._heap) > 4 * len(self._entry) + 64:
            self._heap = [(p, s, k) for k, (p, s) in self._entry.items()]
            heapq.heapify(self._heap)

    def coldest_first(self) -> Iterator[bytes]:
        return iter(sorted(self._entry, key=self._entry.__getitem__))

    def __len__(self) -> int:
        return len(self._entry)

    def __contains__(self, key: object) -> bool:
        return key in self._entry
