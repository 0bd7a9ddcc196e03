"""LRU: evict the least recently used block.

One ordered dict, coldest first; every operation is O(1) per key. A batch is applied tail
first, so within one call the head of a prefix ends up more recent than its tail.

``OrderedDict.update`` and ``popitem`` are slow paths in CPython (update builds an item list,
popitem a tuple per key), so keys go in by a plain loop and victims are read off the front.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence
from itertools import islice

from manager.policies.base import CanEvict, EvictionPolicy
from manager.policies.registry import register_policy


@register_policy
class LRUPolicy(EvictionPolicy):
    """Least recently used first."""

    name = "lru"

    def __init__(self, capacity: int, params: dict[str, object] | None = None) -> None:
        super().__init__(capacity, params)
        self._order: OrderedDict[bytes, None] = OrderedDict()

    def insert(self, keys: Sequence[bytes]) -> None:
        order = self._order
        for key in reversed(keys):
            order[key] = None

    def touch(self, keys: Sequence[bytes]) -> None:
        order = self._order
        move = order.move_to_end
        for key in reversed(keys):
            if key in order:
                move(key)

    request_finished = touch  # LRU counts no uses, so a reorder is exactly a touch

    def remove(self, keys: Sequence[bytes]) -> None:
        pop = self._order.pop
        for key in keys:
            pop(key, None)

    def evict(self, n: int, can_evict: CanEvict | None = None) -> list[bytes] | None:
        if n <= 0:
            return []
        order = self._order
        victims: list[bytes]
        if can_evict is None:
            if n > len(order):
                return None
            victims = list(islice(order, n))
        else:
            victims = list(islice(filter(can_evict, order), n))
            if len(victims) < n:
                return None
        for key in victims:
            del order[key]
        return victims

    def coldest_first(self) -> Iterator[bytes]:
        return iter(list(self._order))

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order
