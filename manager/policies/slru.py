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
from typing import Any

from manager.errors import InvalidPolicyParamsError
from manager.policies.base import CanEvict, EvictionPolicy
from manager.policies.registry import register_policy


@register_policy
class SLRUPolicy(EvictionPolicy):
    """Probation and protected LRU segments."""

    name = "slru"

    def __init__(self, capacity: int, params: dict[str, object] | None = None) -> None:
        super().__init__(capacity, params)
        self._protected_cap = max(1, int(capacity * self.params["protected_ratio"]))
        self._probation: OrderedDict[bytes, None] = OrderedDict()
        self._protected: OrderedDict[bytes, None] = OrderedDict()

    @classmethod
    def parse_params(cls, params: dict[str, Any]) -> dict[str, Any]:
        ratio = params.pop("protected_ratio", 0.8)
        if params:
            raise InvalidPolicyParamsError(f"slru: unknown parameters {sorted(params)}")
        if isinstance(ratio, bool) or not isinstance(ratio, int | float) or not 0 < ratio < 1:
            raise InvalidPolicyParamsError(
                f"slru: protected_ratio must be in (0, 1), got {ratio!r}"
            )
        return {"protected_ratio": float(ratio)}

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
