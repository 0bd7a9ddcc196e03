"""Eviction policies: one interface (``EvictionPolicy``), a registry by name.

Importing this package registers the built-in policies.
"""

from __future__ import annotations

from manager.policies.arc import ARCPolicy
from manager.policies.base import CanEvict, EvictionPolicy
from manager.policies.lfu import LFUPolicy
from manager.policies.lru import LRUPolicy
from manager.policies.prefix_lrfu import PrefixLRFUPolicy
from manager.policies.registry import (
    available_policies,
    create_policy,
    policy_class,
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
    "PrefixLRFUPolicy",
    "S3FIFOPolicy",
    "SLRUPolicy",
    "available_policies",
    "create_policy",
    "policy_class",
    "register_policy",
]
