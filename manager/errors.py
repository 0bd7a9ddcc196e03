"""Errors raised by the manager. A call that raises has changed no block, pin, lease or
counter, with one exception: a call naming a live request renews that request's lease (any call
it makes shows the engine is alive).

Hierarchy::

    ManagerError
    ├── InvalidArgumentError      malformed input (bad key, bad req_id, bad number)
    │   └── PolicyError
    │       ├── UnknownPolicyError      no policy registered under that name
    │       └── InvalidPolicyParamsError
    ├── UnknownRequestError       the req_id is not a live request
    └── StateConflictError        the call is valid but the blocks are not in the needed state
        ├── KeyNotReadyError      prepare_load of a key that is missing or still pending
        └── NotPinnedError        complete_load of a key this request does not hold pinned

``app/`` maps these to HTTP statuses in one place (422, 404, 409).
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence


class ManagerError(Exception):
    """Base of every manager error."""


class InvalidArgumentError(ManagerError, ValueError):
    """An argument is malformed."""


class PolicyError(InvalidArgumentError):
    """A policy name or its parameters are not acceptable."""


class UnknownPolicyError(PolicyError):
    """No policy is registered under the requested name."""

    def __init__(self, name: str, available: Sequence[str]) -> None:
        self.name = name
        self.available = list(available)
        folded = str(name).strip().lower().replace("-", "_")
        close = difflib.get_close_matches(folded, self.available, n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        super().__init__(
            f"unknown policy {name!r}{hint}; available: {', '.join(self.available)} (any case; "
            "also LFU-DA, S3-FIFO, prefix-LRFU)"
        )


class InvalidPolicyParamsError(PolicyError):
    """A policy parameter is unknown or out of range."""


class UnknownRequestError(ManagerError, LookupError):
    """The request is not live: never announced, already finished, or its leases expired."""

    def __init__(self, req_id: str) -> None:
        self.req_id = req_id
        super().__init__(f"unknown request {req_id!r} (not started, finished, or expired)")


class UnknownRetentionError(ManagerError, LookupError):
    """No retention of that name: never made, released, or expired."""

    def __init__(self, name: str) -> None:
        self.name = name
        super().__init__(f"no retention named {name!r} (never made, released, or expired)")


class StateConflictError(ManagerError):
    """The blocks are not in the state the call needs."""

    def __init__(self, message: str, keys: Sequence[bytes]) -> None:
        self.keys = list(keys)
        super().__init__(message)


def _preview(keys: Sequence[bytes], limit: int = 4) -> str:
    shown = ", ".join(k.hex() for k in keys[:limit])
    more = len(keys) - limit
    return shown + (f" (+{more} more)" if more > 0 else "")


class KeyNotReadyError(StateConflictError):
    """``prepare_load`` named keys that are not stored (``missing``) or not ready (``pending``)."""

    def __init__(self, missing: Sequence[bytes], pending: Sequence[bytes]) -> None:
        self.missing = list(missing)
        self.pending = list(pending)
        parts = []
        if self.missing:
            parts.append(f"{len(self.missing)} not stored: {_preview(self.missing)}")
        if self.pending:
            parts.append(f"{len(self.pending)} still pending: {_preview(self.pending)}")
        super().__init__("cannot load; " + "; ".join(parts), [*self.missing, *self.pending])


class NotPinnedError(StateConflictError):
    """``complete_load`` named keys that this request does not hold pinned (that many times)."""

    def __init__(self, req_id: str, keys: Sequence[bytes]) -> None:
        self.req_id = req_id
        super().__init__(
            f"request {req_id!r} holds no pin for {len(keys)} key(s): {_preview(keys)}", keys
        )
