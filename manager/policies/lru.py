"""LRU: evict the least recently used block.

One ordered dict, coldest first; every operation is O(1) per key. A batch is applied tail
first, so within one call the head of a prefix ends up more recent than its tail.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence

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
        self._order.update(dict.fromkeys(reversed(keys)))

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
        if can_evict is None:
            if n > len(order):
                return None
            popitem = order.popitem
            return [popitem(last=False)[0] for _ in range(n)]
        victims: list[bytes] = []
        for key in self._order:
            if can_evict(key):
                victims.append(key)
                if len(victims) == n:
                    break
        else:
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
