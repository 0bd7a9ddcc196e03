"""kvoffload's transfer layer: host pool, registered device KV caches, transfer workers.

- ``HostPool``: the shared-memory pool the manager's slots index (``transfer.host_pool``).
- ``KVCacheRegistry``: device KV caches registered by engines, by shared-memory file or CUDA
  IPC handle, and the block geometry that maps them onto host blocks (``transfer.kv_cache``).
- ``TransferWorker``: executes store (device -> host) and load (host -> device) jobs; the
  contract, its job and result types and the machinery backends share (``transfer.worker``).
- Backends behind that contract: CPU (``transfer.cpu_worker``, copying with
  ``transfer.cpu_copy``), CUDA (``transfer.cuda_worker``), and the fault-injecting wrapper with
  its ``FaultSpec`` (``transfer.faulty_worker``); ``create_worker`` picks one by name
  (``transfer.backends``).
- ``JobTracker``: completes finished jobs against the manager (``transfer.jobs``).
- ``RemoteTier``: the contract of a store shared by many nodes behind the pool, and its
  ``RemoteHealth`` (``transfer.remote``); ``MooncakeTier`` implements it on Mooncake Store
  (``transfer.mooncake``; the library itself is the optional ``mooncake`` extra).

Knows ``manager.spec`` (and nothing else of ``manager``). Errors live in ``transfer.errors``.
"""

from __future__ import annotations

from transfer.backends import BACKENDS, create_worker
from transfer.errors import (
    InvalidJobError,
    PoolError,
    RegistrationError,
    RegistrationLimitError,
    RemoteTierError,
    TransferError,
    UnknownCacheError,
    WorkerClosedError,
)
from transfer.faulty_worker import FaultSpec
from transfer.host_pool import HostPool
from transfer.jobs import CompletionSink, JobRecord, JobTracker
from transfer.kv_cache import (
    DTYPES,
    KVCacheRegistry,
    KVCacheSpec,
    RegisteredCache,
    TensorLayout,
    TensorSpec,
    export_cuda_ipc_handle,
)
from transfer.mooncake import MooncakeConfig, MooncakeTier
from transfer.remote import RemoteHealth, RemoteTier, remote_name
from transfer.worker import JobResult, TransferJob, TransferWorker

__all__ = [
    "BACKENDS",
    "DTYPES",
    "CompletionSink",
    "FaultSpec",
    "HostPool",
    "InvalidJobError",
    "JobRecord",
    "JobResult",
    "JobTracker",
    "KVCacheRegistry",
    "KVCacheSpec",
    "MooncakeConfig",
    "MooncakeTier",
    "PoolError",
    "RegisteredCache",
    "RegistrationError",
    "RegistrationLimitError",
    "RemoteHealth",
    "RemoteTier",
    "RemoteTierError",
    "TensorLayout",
    "TensorSpec",
    "TransferError",
    "TransferJob",
    "TransferWorker",
    "UnknownCacheError",
    "WorkerClosedError",
    "create_worker",
    "export_cuda_ipc_handle",
    "remote_name",
]
