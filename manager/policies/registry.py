"""Policies by name. ``create_policy`` validates the name and the parameters before building."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from manager.errors import UnknownPolicyError

if TYPE_CHECKING:
    from manager.policies.base import EvictionPolicy

_REGISTRY: dict[str, type[EvictionPolicy]] = {}
P = TypeVar("P", bound="type[EvictionPolicy]")


def register_policy(cls: P) -> P:
    """Class decorator: make ``cls`` available under ``cls.name``."""
    name = cls.name
    if name in _REGISTRY and _REGISTRY[name] is not cls:
        raise ValueError(f"policy name {name!r} registered twice")
    _REGISTRY[name] = cls
    return cls


def available_policies() -> list[str]:
    """Names of every registered policy, sorted."""
    return sorted(_REGISTRY)


def policy_class(name: str) -> type[EvictionPolicy]:
    """The class registered under ``name``; ``UnknownPolicyError`` if there is none."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise UnknownPolicyError(name, available_policies()) from None


def create_policy(
    name: str, capacity: int, params: Mapping[str, Any] | None = None
) -> EvictionPolicy:
    """Build the policy ``name`` for ``capacity`` blocks; raises ``PolicyError`` subclasses."""
    return policy_class(name)(capacity, dict(params or {}))
