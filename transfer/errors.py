"""Errors raised by the transfer layer. A call that raises has changed nothing.

Hierarchy::

    TransferError
    ├── PoolError                 host pool sizing or allocation (zero size, no room in shm or RAM)
    ├── RegistrationError         a KV-cache registration is malformed or does not fit the pool
    │   │                         (also a ValueError); the message names the offending numbers
    │   └── RegistrationLimitError  it would take the registry past a limit it was given
    │                             (registrations held, bytes mapped): ``limit`` names it
    ├── UnknownCacheError         no KV cache is registered under that cache_id (also a LookupError)
    ├── InvalidJobError           a transfer job is malformed: block or slot out of range,
    │                             lengths differ, duplicate destination, unknown direction
    │                             (also a ValueError)
    ├── WorkerClosedError         the worker was shut down and takes no more jobs (also a
    │                             RuntimeError)
    └── RemoteTierError           a remote tier cannot be built: its client library is missing,
                                  its configuration is invalid, its setup was refused

Failures *during* a copy are not raised: the job finishes with ``ok=False`` and a reason (see
``transfer.worker``). ``app/`` maps these classes to HTTP statuses in one place (422, 404, 503).
"""

from __future__ import annotations


class TransferError(Exception):
    """Base of every transfer-layer error."""


class PoolError(TransferError):
    """The host pool cannot be created with the requested size, or is closed."""


class RegistrationError(TransferError, ValueError):
    """A device KV-cache registration is malformed or incompatible with the host pool."""


class RegistrationLimitError(RegistrationError):
    """A registration would take the registry past ``limit`` (``max_registrations`` or
    ``max_mapped_bytes``) of ``value``; nothing was published or kept mapped."""

    def __init__(self, limit: str, value: int, detail: str) -> None:
        super().__init__(f"at the {limit} limit of {value}: {detail}")
        self.limit = limit
        self.value = value


class UnknownCacheError(TransferError, LookupError):
    """No KV cache is registered under the given id."""

    def __init__(self, cache_id: str) -> None:
        self.cache_id = cache_id
        super().__init__(f"unknown KV cache {cache_id!r} (never registered, or unregistered)")


class InvalidJobError(TransferError, ValueError):
    """A transfer job does not describe a valid copy for its cache and the pool."""


class WorkerClosedError(TransferError, RuntimeError):
    """The transfer worker has been shut down."""


class RemoteTierError(TransferError):
    """A remote tier cannot be built (library missing, invalid configuration, refused setup).

    Its data calls never raise it: they answer False and report the failure in ``health()``.
    """
