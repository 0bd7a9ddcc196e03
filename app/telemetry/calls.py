"""The record of one HTTP call, as the telemetry sees it: ``CallInfo`` and the current call.

The HTTP layer (``app.http.middleware``) makes one ``CallInfo`` per call, keeps it in a context
variable for the call's duration (``current_call``) and hands it to its hooks when the call ends.
Code below the routes (the observed manager counting the keys it handled) reads it through
``current_call`` without knowing anything of HTTP.
"""

from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar, Token
from dataclasses import dataclass


@dataclass(slots=True)
class CallInfo:
    """What is known about one HTTP call; routes fill ``op``, ``req_id`` and ``ops``."""

    request_id: str
    method: str
    path: str
    started: float
    op: str | None = None
    req_id: str | None = None
    # Template of the matched route (``/v1/requests/{req_id}/lookup``); None: no route matched.
    route: str | None = None
    status: int = 0
    # For a batch: (op, status) of each op, in order.
    ops: list[tuple[str, int]] | None = None
    # For a batch: the engine request ids its ops named, each once, in order of first use.
    batch_req_ids: list[str] | None = None
    # For a batch: how many ops answered each (status, error code), for the one call line
    # (a refused op gets no line of its own: 1,024 of them would be a log flood).
    op_errors: dict[tuple[int, str], int] | None = None
    duration_s: float = 0.0
    # What the log line and exemplars say ``req_id`` is: the safe form of the path's engine
    # request id on a request-scoped path, else ``request_id``.
    log_id: str = ""
    # Keys handled by the manager calls the call made (added up by the observed manager).
    keys: int = 0
    # The caller: the ASGI scope's ``client`` (host, port); None on the Unix socket.
    client: tuple[str, int] | None = None
    # The ``code`` of the error body of an answer >= 400 (None: 2xx/3xx, or no such body).
    error_code: str | None = None
    # With tenants: whose call it was and the namespace it ran in (None: without tenants, or
    # refused before either was known).
    tenant: str | None = None
    namespace: str | None = None


CallHook = Callable[[CallInfo], None]


def host_port(host: str, port: int) -> str:
    """``host:port``, an IPv6 host in brackets (``[::1]:8000``)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


_current: ContextVar[CallInfo | None] = ContextVar("kvoffload_call", default=None)


def current_call() -> CallInfo | None:
    """The ``CallInfo`` of the HTTP call being served in this context (None outside one)."""
    return _current.get()


def enter_call(info: CallInfo) -> Token[CallInfo | None]:
    """Make ``info`` the current call; pass the token to ``leave_call`` when it ends."""
    return _current.set(info)


def leave_call(token: Token[CallInfo | None]) -> None:
    """End the call ``enter_call`` began."""
    _current.reset(token)


def add_keys(n: int) -> None:
    """Count ``n`` keys handled for the current call's log line (no-op outside a call)."""
    info = _current.get()
    if info is not None:
        info.keys += n
