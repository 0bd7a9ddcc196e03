"""Choosing a transfer backend: ``create_worker`` builds one of the workers by name.

``BACKENDS`` lists the names: ``auto`` (cuda if available, else cpu), ``cpu``
(``transfer.cpu_worker``), ``cuda`` (``transfer.cuda_worker``) and ``faulty`` (``auto`` wrapped
in fault injection, ``transfer.faulty_worker``). Every backend follows the contract in
``transfer.worker``.
"""

from __future__ import annotations

import torch

from transfer.cpu_worker import CpuTransferWorker
from transfer.cuda_worker import DEFAULT_STAGING_BYTES, CudaTransferWorker
from transfer.faulty_worker import FaultSpec, FaultyWorker
from transfer.host_pool import HostPool
from transfer.kv_cache import KVCacheRegistry
from transfer.worker import OnFinished, TransferWorker, WorkerBase

__all__ = ["BACKENDS", "create_worker"]

BACKENDS = ("auto", "cpu", "cuda", "faulty")


def create_worker(
    pool: HostPool,
    registry: KVCacheRegistry,
    backend: str = "auto",
    *,
    faults: FaultSpec | None = None,
    on_finished: OnFinished | None = None,
    copy_threads: int | None = None,
    staging_bytes: int | None = None,
    allow_pageable: bool = False,
) -> TransferWorker:
    """Build a worker. ``backend``: ``auto`` (cuda if available, else cpu), ``cpu``, ``cuda``,
    or ``faulty`` (``auto`` wrapped in fault injection). With ``faults`` given, the chosen
    backend is wrapped in the fault-injecting worker. ``copy_threads`` tunes the CPU copies;
    ``staging_bytes`` the CUDA staging buffers (per device and direction). The cuda backend
    refuses a pool that is not pinned unless ``allow_pageable``.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown transfer backend {backend!r}; choose one of {BACKENDS}")
    if backend == "faulty" and faults is None:
        faults = FaultSpec()
    real = backend if backend in ("cpu", "cuda") else "auto"
    if real == "auto":
        real = "cuda" if torch.cuda.is_available() else "cpu"

    def build(callback: OnFinished | None) -> WorkerBase:
        if real == "cuda":
            return CudaTransferWorker(
                pool,
                registry,
                on_finished=callback,
                staging_bytes=DEFAULT_STAGING_BYTES if staging_bytes is None else staging_bytes,
                allow_pageable=allow_pageable,
            )
        return CpuTransferWorker(pool, registry, on_finished=callback, copy_threads=copy_threads)

    if faults is None:
        return build(on_finished)
    return FaultyWorker(build, faults, on_finished=on_finished)
