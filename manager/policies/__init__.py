"""Eviction policies: one interface (``EvictionPolicy``), a registry by name.

Importing this package registers the built-in policies. Each declares its parameters once
(``params_spec``: kind, default, finite bounds); the registry enforces them for every policy
and can describe them (``describe_policy_params``, ``policy_params_help``).
"""

from __future__ import annotations

from manager.policies.arc import ARCPolicy
from manager.policies.base import CanEvict, EvictionPolicy
from manager.policies.lfu import LFUPolicy
from manager.policies.lru import LRUPolicy
from manager.policies.params import ParamSpec
from manager.policies.prefix_lrfu import PrefixLRFUPolicy
from manager.policies.registry import (
    available_policies,
    canonical_policy_name,
    create_policy,
    describe_policy_params,
    parse_policy_params,
    policy_class,
    policy_params_help,
    policy_params_spec,
    register_policy,
)
from manager.policies.s3fifo import S3FIFOPolicy
from manager.policies.slru import SLRUPolicy

__all__ = [
    "ARCPolicy",
    "CanEvict",
    "EvictionPolicy",
    "LFUPolicy",
    "LRUPolicy",
    "ParamSpec",
    "PrefixLRFUPolicy",
    "S3FIFOPolicy",
    "SLRUPolicy",
    "available_policies",
    "canonical_policy_name",
    "create_policy",
    "describe_policy_params",
    "parse_policy_params",
    "policy_class",
    "policy_params_help",
    "policy_params_spec",
    "register_policy",
]
