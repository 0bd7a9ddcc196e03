"""Errors of the service core: what a service call refuses beyond the manager's and transfer's.

Hierarchy::

    ServiceError
    ├── ServiceUnavailableError   not running (starting, stopping, stopped): try again later
    ├── NoSpaceError              prepare_store found no evictable room; nothing changed
    ├── UnknownJobError           no transfer job by that id (never, or long forgotten)
    ├── DeviceBlockError          a device block index outside the registered KV cache
    ├── AuthenticationError       no, malformed, unknown or revoked engine token (who are you?)
    ├── PermissionDeniedError     a known tenant asked for a namespace that is not its own
    ├── HandleNotHeldError        with tenants, a KV cache named by a path or handle, not passed
    ├── QuotaExceededError        a tenant's or namespace's quota would be exceeded
    ├── UnknownKeysError          keys held nowhere (not in the pool, not in a lower tier)
    ├── UnknownPrefetchError      no prefetch by that id (never, or long forgotten)
    ├── PoolTooSmallError         a load of more distinct blocks than the pool holds
    └── NoLowerTierError          a demotion asked of a service with no tier below the pool

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
    """``prepare_store`` could not make room for ``needed`` blocks; nothing was stored.
    ``why``: what holds the pool (pinned, retained, pending blocks), for people."""

    def __init__(self, needed: int, why: str = "") -> None:
        held = f" ({why})" if why else ""
        super().__init__(f"no evictable space for {needed} block(s){held}; nothing was stored")
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


class AuthenticationError(ServiceError):
    """The caller could not be identified; nothing was done.

    ``reason`` is a stable code for logs and answers: ``missing_token``,
    ``malformed_authorization``, ``unknown_token`` or ``revoked_token``. Never carries the token.
    """

    def __init__(self, reason: str) -> None:
        super().__init__(f"engine credentials refused: {reason}{_AUTH_HINTS.get(reason, '')}")
        self.reason = reason


#: What to send instead, for the refusals that are the caller's own doing (no token, or not
#: one in the ``Bearer`` scheme); never the token itself.
_AUTH_HINTS = {
    "missing_token": "; send the tenant's token as `Authorization: Bearer <token>`",
    "malformed_authorization": "; send `Authorization: Bearer <token>` (one token, no spaces)",
}


class PermissionDeniedError(ServiceError):
    """A known tenant asked for something outside its namespaces; nothing was done.

    ``reason``: ``namespace_denied`` (a caller known by its token named a namespace that is not
    its tenant's, whether another tenant's or nobody's: one answer for both, so that no tenant
    learns which namespaces exist), ``namespace_required`` (the tenant, or for a caller trusted
    by the socket's file mode the service, has several and the call named none),
    ``unknown_namespace`` (no such namespace, answered only to callers that may reach every
    namespace anyway: trusted by ``--uds-auth file-mode``, or of a service without tenants).
    """

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class HandleNotHeldError(ServiceError):
    """With tenants, a KV-cache registration named memory by a path or a CUDA IPC handle
    instead of passing its descriptor; nothing was opened. The message names the tensor and
    the way to register, never anything about the file named."""

    def __init__(self, where: str, kind: str) -> None:
        super().__init__(
            f"{where}: this service has tenants and opens no {kind} a caller names; pass the "
            "file's descriptor over the pool socket instead (KVOffloadClient.register_kv_cache("
            "spec, fds=...), or kvoffload_client.pool_socket.register_kv_cache)"
        )
        self.where = where
        self.kind = kind


class QuotaExceededError(ServiceError):
    """The call would take tenant ``tenant`` past its ``quota`` (``blocks``, ``pins`` or
    ``requests``) of ``limit``, or (``scope="namespace"``) a namespace past one of its own
    bounds (``retained_blocks``, ``retentions``, ``prefetch_keys``); nothing was done.
    ``detail`` says by how much, for people."""

    def __init__(
        self, tenant: str, quota: str, limit: int, detail: str, *, scope: str = "tenant"
    ) -> None:
        super().__init__(f"{scope} {tenant!r} is at its {quota!r} quota of {limit}: {detail}")
        self.tenant = tenant
        self.quota = quota
        self.limit = limit


class UnknownKeysError(ServiceError):
    """Keys that neither the pool nor any tier below it holds (``keys``: the first few)."""

    def __init__(self, keys: list[bytes], total: int) -> None:
        shown = ", ".join(k.hex() for k in keys[:4])
        more = f" and {total - 4} more" if total > 4 else ""
        super().__init__(
            f"{total} key(s) held nowhere (not in the pool, not in a tier below it): "
            f"{shown}{more}; nothing was done"
        )
        self.keys = keys
        self.total = total


class UnknownPrefetchError(ServiceError):
    """No prefetch ``prefetch_id`` is known."""

    def __init__(self, prefetch_id: int) -> None:
        super().__init__(f"unknown prefetch {prefetch_id} (never made, or long finished)")
        self.prefetch_id = prefetch_id


class NoLowerTierError(ServiceError):
    """A demotion asked of a namespace with no tier below its pool."""

    def __init__(self) -> None:
        super().__init__(
            "no tier below the pool to demote to (start with --disk-dir, --remote-tier or "
            "--object-bucket); to free pool room without keeping the blocks, drop them"
        )


class PoolTooSmallError(ServiceError):
    """A load of ``needed`` distinct blocks into a pool of ``capacity``: it can never be
    pinned at once, wherever the blocks are (a tier below the pool included)."""

    def __init__(self, needed: int, capacity: int) -> None:
        super().__init__(
            f"this load needs {needed} distinct blocks in the pool at once, but the pool holds "
            f"{capacity} (--num-blocks, or the namespace's blocks in the tenants file); load "
            f"in parts of at most {capacity} keys"
        )
        self.needed = needed
        self.capacity = capacity
