"""SLRU: segmented LRU (Karedla et al. 1994).

Two LRU segments: *probation* receives new blocks, *protected* (``protected_ratio`` of the
capacity) receives blocks used again while on probation. When protected is over its share, its
least recent block is demoted to the most recent end of probation. Victims come from probation
first (least recent first), then from protected. A block used once never displaces a block used
twice, which shields the reused prefix heads from scans of one-off requests.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence

from manager.policies.base import CanEvict, EvictionPolicy
from manager.policies.params import ParamSpec
from manager.policies.registry import register_policy


@register_policy
class SLRUPolicy(EvictionPolicy):
    """Probation and protected LRU segments."""

    name = "slru"
    params_spec = (
        # The protected segment's share of the capacity. SLRU is two segments: 0 would leave
        # no protected segment (plain LRU) and 1 no probation, so both ends are excluded;
        # inside, any share works (the protected cap is at least one block).
        ParamSpec(
            name="protected_ratio",
            kind="float",
            default=0.8,
            low=0.0,
            high=1.0,
            low_open=True,
            high_open=True,
            doc="share of the capacity for blocks used twice (the protected segment)",
        ),
    )

    def __init__(self, capacity: int, params: dict[str, object] | None = None) -> None:
        super().__init__(capacity, params)
        self._protected_cap = max(1, int(capacity * self.params["protected_ratio"]))
        self._probation: OrderedDict[bytes, None] = OrderedDict()
        self._protected: OrderedDict[bytes, None] = OrderedDict()

    def insert(self, keys: Sequence[bytes]) -> None:
        probation = self._probation
        for key in reversed(keys):  # a loop: OrderedDict.update is slower
            probation[key] = None

    def touch(self, keys: Sequence[bytes]) -> None:
        probation, protected = self._probation, self._protected
        for key in reversed(keys):
            if key in probation:
                del probation[key]
                protected[key] = None
            elif key in protected:
                protected.move_to_end(key)
        while len(protected) > self._protected_cap:
            key, _ = protected.popitem(last=False)
            probation[key] = None

    def request_finished(self, keys: Sequence[bytes]) -> None:
        probation, protected = self._probation, self._protected
        for key in reversed(keys):
            if key in probation:
                probation.move_to_end(key)
            elif key in protected:
                protected.move_to_end(key)

    def remove(self, keys: Sequence[bytes]) -> None:
        probation, protected = self._probation, self._protected
        for key in keys:
            if key in probation:
                del probation[key]
            else:
                protected.pop(key, None)

    def evict(self, n: int, can_evict: CanEvict | None = None) -> list[bytes] | None:
        if n <= 0:
            return []
        victims: list[bytes] = []
        for segment in (self._probation, self._protected):
            for key in segment:
                if can_evict is None or can_evict(key):
                    victims.append(key)
                    if len(victims) == n:
                        break
            if len(victims) == n:
                break
        else:
            return None
        probation, protected = self._probation, self._protected
        for key in victims:
            if key in probation:
                del probation[key]
            else:
                del protected[key]
        return victims

    def coldest_first(self) -> Iterator[bytes]:
        return iter([*self._probation, *self._protected])

    def __len__(self) -> int:
        return len(self._probation) + len(self._protected)

    def __contains__(self, key: object) -> bool:
        return key in self._probation or key in self._protected
