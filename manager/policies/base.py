"""The eviction-policy interface.

A policy only *orders* keys: it decides which resident block to drop next. Block state (slot,
ref count, readiness) lives in the manager, which tells the policy about the life of every ready
block and asks it for victims:

- ``insert(keys)``: the keys became ready (a store completed). They are new to the policy.
- ``touch(keys)``: the keys were used (a hit). Keys the policy does not hold are ignored.
- ``request_finished(keys)``: a request ended; ``keys`` is its chain, head to tail (the keys it
  loaded, offered for store or touched, in order of first use; some may not be held). Reorder
  the held ones so that its tail blocks go before its head blocks, counting no new use.
- ``remove(keys)``: the manager dropped the keys itself (failed store, reset, clear).
- ``evict(n, can_evict)``: choose ``n`` victims among keys with ``can_evict(key)`` true (every
  held key when ``can_evict`` is ``None``, the manager's fast path when nothing is pinned),
  remove them and return them; or return ``None`` and change nothing if fewer than ``n`` qualify.
- ``coldest_first()``: every held key, the next victim first (used to rebuild another policy
  during a live switch).

Parameters are declared, never hand-checked: a policy lists them in ``params_spec`` (one
``ParamSpec`` each: kind, default, finite bounds) and ``parse_params``, the same for every
policy, checks a caller's values against them (``manager.policies.params``).

Every batch argument is ordered head to tail (the order of the blocks in a request's prefix).
Within one call the head must end up hotter than the tail: a prefix is useless without its
head, so the tail should go first.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, ClassVar, final

from manager.errors import InvalidPolicyParamsError
from manager.policies.params import ParamSpec, check_params

CanEvict = Callable[[bytes], bool]


class EvictionPolicy(ABC):
    """Base of every policy; subclasses register themselves with ``@register_policy``."""

    name: ClassVar[str]
    #: The manager calls ``request_finished`` only when a request ordered its keys in two or
    #: more calls (one call already files its batch tail first). A policy that learns from
    #: whole request chains sets this to get every finished request's chain.
    wants_request_chains: ClassVar[bool] = False
    #: Whether ``touch`` reorders the touched keys (head hotter than tail). FIFO-family
    #: policies only count a use and keep insertion order; they still order a chain tail
    #: before head on ``insert`` and ``request_finished``.
    reorders_on_touch: ClassVar[bool] = True
    #: The parameters the policy takes, each with its bounds (none by default). Declared here
    #: once; ``parse_params`` and the registry enforce them for every policy.
    params_spec: ClassVar[tuple[ParamSpec, ...]] = ()

    def __init__(self, capacity: int, params: Mapping[str, Any] | None = None) -> None:
        if capacity <= 0:
            raise InvalidPolicyParamsError(f"capacity must be positive, got {capacity}")
        self.capacity = capacity
        self.params: dict[str, Any] = self.parse_params(dict(params or {}))

    @final
    @classmethod
    def parse_params(cls, params: Mapping[str, Any]) -> dict[str, Any]:
        """``params`` checked against ``params_spec``, with defaults filled in.

        Raises ``InvalidPolicyParamsError`` naming the policy, the parameter and its bounds
        for an unknown name, a wrong type, a non-finite number or a value out of range.
        Idempotent (a result passed again comes back equal). Final: a policy declares
        ``params_spec`` instead of overriding this (``register_policy`` refuses one that does).
        """
        return check_params(cls.name, cls.params_spec, params)

    @abstractmethod
    def insert(self, keys: Sequence[bytes]) -> None:
        """Admit keys that just became ready (none of them is held yet)."""

    @abstractmethod
    def touch(self, keys: Sequence[bytes]) -> None:
        """Record a use of the held keys among ``keys``."""

    @abstractmethod
    def request_finished(self, keys: Sequence[bytes]) -> None:
        """Reorder the held keys among ``keys`` tail-before-head, counting no new use."""

    @abstractmethod
    def remove(self, keys: Sequence[bytes]) -> None:
        """Forget the held keys among ``keys`` (not an eviction: no ghost entry)."""

    @abstractmethod
    def evict(self, n: int, can_evict: CanEvict | None = None) -> list[bytes] | None:
        """Remove and return ``n`` evictable keys, or return ``None`` and change nothing."""

    @abstractmethod
    def coldest_first(self) -> Iterator[bytes]:
        """Iterate over every held key, the next victim first."""

    @abstractmethod
    def __len__(self) -> int:
        """Number of held keys."""

    @abstractmethod
    def __contains__(self, key: object) -> bool:
        """Whether ``key`` is held."""

    def rebuild(self, coldest_first: Iterator[bytes]) -> int:
        """Fill an empty policy from another policy's order; returns the number of keys.

        ``insert`` applies a batch tail first, so the batch is passed hottest first: the
        coldest key goes in first and stays the next victim.
        """
        keys = list(coldest_first)
        keys.reverse()
        self.insert(keys)
        return len(keys)
