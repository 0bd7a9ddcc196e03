"""Policies by name. ``create_policy`` validates the name and the parameters before building.

The registry is where parameter bounds are enforced for every policy: ``register_policy``
admits a class only when its ``params_spec`` is well formed and it does not override
``parse_params`` (so no policy can skip or loosen the declared checks), and
``parse_policy_params`` / ``create_policy`` check every value against the declared specs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

from manager.errors import UnknownPolicyError
from manager.policies.base import EvictionPolicy
from manager.policies.params import ParamSpec, check_params, check_specs

_REGISTRY: dict[str, type[EvictionPolicy]] = {}
P = TypeVar("P", bound="type[EvictionPolicy]")


def register_policy(cls: P) -> P:
    """Class decorator: make ``cls`` available under ``cls.name``.

    Raises ``ValueError`` for a name taken by another class or a malformed ``params_spec``,
    and ``TypeError`` for a class that defines its own ``parse_params`` (its parameters must be
    declared in ``params_spec``, where the registry enforces them).
    """
    name = cls.name
    if name in _REGISTRY and _REGISTRY[name] is not cls:
        raise ValueError(f"policy name {name!r} registered twice")
    for klass in cls.__mro__:
        if klass is EvictionPolicy:
            break
        if "parse_params" in vars(klass):
            raise TypeError(
                f"policy {name!r}: declare parameters in params_spec, do not override parse_params"
            )
    check_specs(name, cls.params_spec)
    _REGISTRY[name] = cls
    return cls


def available_policies() -> list[str]:
    """Names of every registered policy, sorted."""
    return sorted(_REGISTRY)


#: The names the literature gives some policies, folded (``_fold``), to the registered ones.
_ALIASES = {"lfu_da": "lfu", "lfuda": "lfu", "s3_fifo": "s3fifo", "prefixlrfu": "prefix_lrfu"}


def _fold(name: str) -> str:
    return name.strip().lower().replace("-", "_")


def canonical_policy_name(name: str) -> str:
    """The registered name ``name`` means: matched without regard to case, with ``-`` as
    ``_``, and the literature's names as aliases (``LFU-DA``, ``S3-FIFO``, ``prefix-LRFU``);
    ``UnknownPolicyError`` (naming the closest one) otherwise."""
    if name in _REGISTRY:
        return name
    if isinstance(name, str):
        folded = _fold(name)
        found = folded if folded in _REGISTRY else _ALIASES.get(folded)
        if found in _REGISTRY:
            assert found is not None
            return found
    raise UnknownPolicyError(name, available_policies())


def policy_class(name: str) -> type[EvictionPolicy]:
    """The class registered under ``name`` (``canonical_policy_name``); ``UnknownPolicyError``
    if there is none."""
    return _REGISTRY[canonical_policy_name(name)]


def policy_params_spec(name: str) -> tuple[ParamSpec, ...]:
    """The declared parameters of policy ``name``; ``UnknownPolicyError`` if there is none."""
    return policy_class(name).params_spec


def parse_policy_params(name: str, params: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The parameters of policy ``name`` checked against its declared bounds, defaults filled
    in; ``UnknownPolicyError`` or ``InvalidPolicyParamsError`` (naming the policy, the
    parameter and the bound) otherwise. Builds nothing."""
    return check_params(name, policy_params_spec(name), params or {})


def describe_policy_params(name: str) -> list[dict[str, Any]]:
    """Every parameter of policy ``name`` as plain data: name, type, default, bounds, doc."""
    return [spec.describe() for spec in policy_params_spec(name)]


def policy_params_help() -> str:
    """One line per policy that takes parameters, for ``--help`` texts:
    ``lfu: history_factor (a number in [0, 16], default 2)``."""
    lines = []
    for name in available_policies():
        specs = policy_params_spec(name)
        if specs:
            lines.append(f"{name}: " + ", ".join(spec.summary() for spec in specs))
    return "\n".join(lines)


def create_policy(
    name: str, capacity: int, params: Mapping[str, Any] | None = None
) -> EvictionPolicy:
    """Build the policy ``name`` for ``capacity`` blocks from ``params`` checked against its
    declared bounds; raises ``PolicyError`` subclasses (and builds nothing) otherwise."""
    return policy_class(name)(capacity, parse_policy_params(name, params))
