"""kvoffload's offload manager: pure-Python bookkeeping of the host pool.

No torch, no web framework, no I/O, no clock read except through the injected clock. The
manager decides which blocks live where and returns specs; ``transfer/`` moves the bytes and
``app/`` wires the two. See ``manager.core`` for the contract.
"""

from __future__ import annotations

from manager.core import OffloadManager, create_manager
from manager.errors import (
    InvalidArgumentError,
    InvalidPolicyParamsError,
    KeyNotReadyError,
    ManagerError,
    NotPinnedError,
    PolicyError,
    StateConflictError,
    UnknownPolicyError,
    UnknownRequestError,
    UnknownRetentionError,
)
from manager.policies import EvictionPolicy, available_policies, create_policy, register_policy
from manager.reuse import ReuseFilter
from manager.spec import (
    DISK_MEDIUM,
    MAX_KEY_BYTES,
    MEDIUM,
    REMOTE_MEDIUM,
    AllBlocksCleared,
    BlockKey,
    BlockRemoved,
    BlockStored,
    CompleteStoreOutput,
    KVEvent,
    LookupOutput,
    LookupResult,
    ManagerStats,
    PolicyInfo,
    PolicySwitch,
    PrepareStoreOutput,
    ReleasedLeases,
    ReqContext,
    RequestLeases,
    ResetCounts,
    RetentionInfo,
)
from manager.tiers import DiskIndex, DiskOp

__all__ = [
    "DISK_MEDIUM",
    "MAX_KEY_BYTES",
    "MEDIUM",
    "REMOTE_MEDIUM",
    "AllBlocksCleared",
    "BlockKey",
    "BlockRemoved",
    "BlockStored",
    "CompleteStoreOutput",
    "DiskIndex",
    "DiskOp",
    "EvictionPolicy",
    "InvalidArgumentError",
    "InvalidPolicyParamsError",
    "KVEvent",
    "KeyNotReadyError",
    "LookupOutput",
    "LookupResult",
    "ManagerError",
    "ManagerStats",
    "NotPinnedError",
    "OffloadManager",
    "PolicyError",
    "PolicyInfo",
    "PolicySwitch",
    "PrepareStoreOutput",
    "ReleasedLeases",
    "ReqContext",
    "RequestLeases",
    "ResetCounts",
    "RetentionInfo",
    "ReuseFilter",
    "StateConflictError",
    "UnknownPolicyError",
    "UnknownRequestError",
    "UnknownRetentionError",
    "available_policies",
    "create_manager",
    "create_policy",
    "register_policy",
]
