"""A min-heap of keys whose priorities change, by lazy invalidation.

``heapq`` cannot move an entry, so giving a key a new priority pushes a new entry and leaves the
old one in the heap, *stale*. ``entries`` records the live ``(priority, seq)`` of every held
key; a popped entry that does not match it is stale and skipped. ``compact`` rebuilds the heap
from ``entries`` once stale entries dominate: after each ``compact`` the heap holds at most
``slack`` entries per held key, plus a constant.

Order: ascending ``(priority, seq, key)``. The caller chooses ``seq``, so it decides ties (a
policy numbers a batch tail first so that the tail goes first). ``ordered`` sorts the live
entries by the same tuple, so it is exactly the order in which repeated ``pop_lowest(1)`` calls
take the keys, even when two keys share a priority and a sequence number.

The policies whose order is a priority (``lfu``, ``prefix_lrfu``) keep their keys in one.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Mapping

Entry = tuple[float, int]
Item = tuple[float, int, bytes]

# Entries allowed beyond ``slack`` per held key: without them a small heap would be rebuilt
# after nearly every push.
_HEADROOM = 64


class LazyHeap:
    """Held keys ordered by ``(priority, seq, key)``; changing a priority is a push."""

    __slots__ = ("_entries", "_heap", "_slack", "entries")

    def __init__(self, slack: int) -> None:
        if slack < 1:
            raise ValueError(f"slack must be at least 1, got {slack}")
        self._slack = slack
        self._entries: dict[bytes, Entry] = {}
        self._heap: list[Item] = []
        #: The live ``(priority, seq)`` of every held key, to read (its writers are ``set``,
        #: ``discard`` and ``pop_lowest``, which keep it in step with the heap).
        self.entries: Mapping[bytes, Entry] = self._entries

    def set(self, key: bytes, priority: float, seq: int) -> None:
        """Hold ``key`` at ``(priority, seq)``, replacing the entry it had (which goes stale)."""
        self._entries[key] = (priority, seq)
        heapq.heappush(self._heap, (priority, seq, key))

    def discard(self, key: bytes) -> bool:
        """Stop holding ``key``; returns whether it was held. Its heap entry goes stale."""
        return self._entries.pop(key, None) is not None

    def pop_lowest(
        self, n: int, allowed: Callable[[bytes], bool] | None = None
    ) -> list[Item] | None:
        """Remove and return the ``n`` lowest held keys for which ``allowed`` is true (every key
        when ``allowed`` is None), as ``(priority, seq, key)``, lowest first.

        All or nothing: if fewer than ``n`` keys are allowed, returns ``None`` and every key
        stays held at its entry. Keys passed over stay held too. Stale entries met on the way
        are dropped, whatever the outcome.
        """
        if n <= 0:
            return []
        heap, entries = self._heap, self._entries
        chosen: list[Item] = []
        taken: set[bytes] = set()
        passed: list[Item] = []  # live entries of keys not allowed, pushed back after
        while heap and len(chosen) < n:
            item = heapq.heappop(heap)
            priority, seq, key = item
            if key in taken or entries.get(key) != (priority, seq):
                continue  # stale: set again, discarded, or a duplicate of an entry taken
            if allowed is not None and not allowed(key):
                passed.append(item)
            else:
                chosen.append(item)
                taken.add(key)
        for item in passed:
            heapq.heappush(heap, item)
        if len(chosen) < n:
            for item in chosen:
                heapq.heappush(heap, item)
            return None
        for key in taken:
            del entries[key]
        return chosen

    def compact(self) -> None:
        """Rebuild the heap from the live entries if stale ones have come to dominate.

        Call it once after each batch of ``set`` and ``discard`` calls: a check per batch, not
        per push. Afterwards the heap holds at most ``slack`` entries per held key plus 64.
        """
        entries = self._entries
        if len(self._heap) > self._slack * len(entries) + _HEADROOM:
            self._heap = [(p, s, k) for k, (p, s) in entries.items()]
            heapq.heapify(self._heap)

    def ordered(self) -> list[bytes]:
        """Every held key, lowest first: the order of repeated ``pop_lowest(1)`` calls."""
        entries = self._entries
        return sorted(entries, key=lambda k: (*entries[k], k))

    def heap_size(self) -> int:
        """Entries in the heap, live and stale (the memory it holds)."""
        return len(self._heap)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries
