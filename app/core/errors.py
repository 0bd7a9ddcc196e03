"""Errors of the service core: what a service call refuses beyond the manager's and transfer's.

Hierarchy::

    ServiceError
    ├── ServiceUnavailableError   not running (starting, stopping, stopped): try again later
    ├── NoSpaceError              prepare_store found no evictable room; nothing changed
    ├── UnknownJobError           no transfer job by that id (never, or long forgotten)
    └── DeviceBlockError          a device block index outside the registered KV cache

The core raises these and the library errors (``manager.errors``, ``transfer.errors``); the
HTTP layer maps every one of them to a status in one table (``app.http.errors``).
"""

from __future__ import annotations


class ServiceError(Exception):
    """Base of the service core's own errors."""


class ServiceUnavailableError(ServiceError):
    """The service cannot take this call now; ``reason`` says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class NoSpaceError(ServiceError):
    """``prepare_store`` could not make room for ``needed`` blocks; nothing was stored."""

    def __init__(self, needed: int) -> None:
        super().__init__(f"no evictable space for {needed} block(s); nothing was stored")
        self.needed = needed


class UnknownJobError(ServiceError):
    """No transfer job ``job_id`` is known."""

    def __init__(self, job_id: int) -> None:
        super().__init__(f"unknown job {job_id}")
        self.job_id = job_id


class DeviceBlockError(ServiceError):
    """Device block indexes out of range for a registered KV cache; nothing was started."""

    def __init__(self, cache_id: str, num_blocks: int, bad: list[int]) -> None:
        super().__init__(
            f"device_blocks: {len(bad)} index(es) out of range for KV cache "
            f"{cache_id!r} of {num_blocks} blocks (first: {bad[0]})"
        )
        self.cache_id = cache_id
        self.num_blocks = num_blocks
        self.bad = bad
