"""Pure ASGI middleware (no ``BaseHTTPMiddleware``: contextvars and streaming stay intact).

``CallContextMiddleware`` gives every HTTP call a ``CallInfo`` in its scope (``call_info``): the
request id (``X-Request-ID`` taken from the caller or made up, and echoed), the op and engine
``req_id`` once a route knows them, the per-op outcome of a batch, and the final status. When the
call ends it hands the ``CallInfo`` to its hooks (``create_app(hooks=...)``): the observability
layer (metrics, canonical log line) plugs in there, and routes only fill in the ``CallInfo``.
A hook that raises is logged and does not affect the call.

``BodyGuardMiddleware`` refuses bodies before they are parsed: 413 when ``Content-Length`` says
too large, or when a body without one grows past the limit while it is received; 415 when a
body is not ``application/json``.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.errors import APIError, error_body
from app.logging import get_logger

log = get_logger("middleware")
CALL_KEY = "kvoffload.call"
_REQUEST_ID = b"x-request-id"
_MAX_REQUEST_ID = 128


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
    duration_s: float = 0.0


CallHook = Callable[[CallInfo], None]


def call_info(scope: Scope) -> CallInfo | None:
    """The ``CallInfo`` of the call, when ``CallContextMiddleware`` is installed."""
    info = scope.get(CALL_KEY)
    return info if isinstance(info, CallInfo) else None


def _valid_request_id(raw: bytes) -> bool:
    return 0 < len(raw) <= _MAX_REQUEST_ID and raw.isascii() and raw.decode().isprintable()


class CallContextMiddleware:
    """Attach a ``CallInfo`` to each HTTP call, echo ``X-Request-ID``, run the hooks at the end."""

    def __init__(self, app: ASGIApp, hooks: Sequence[CallHook] = ()) -> None:
        self.app = app
        self.hooks = tuple(hooks)
        # Made-up ids: a random per-process prefix and a counter (unique without an RNG call
        # per request).
        self._id_prefix = os.urandom(6).hex()
        self._counter = itertools.count(1)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        raw_id = b""
        for name, value in scope["headers"]:
            if name == _REQUEST_ID:
                raw_id = value
                break
        if raw_id and _valid_request_id(raw_id):
            request_id = raw_id.decode()
        else:
            request_id = f"{self._id_prefix}{next(self._counter):08x}"
        info = CallInfo(request_id, scope["method"], scope["path"], time.perf_counter())
        scope[CALL_KEY] = info
        echoed = (_REQUEST_ID, request_id.encode())

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                info.status = message["status"]
                message["headers"] = [*message.get("headers", ()), echoed]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            info.duration_s = time.perf_counter() - info.started
            if not info.status:
                info.status = 500
            route = scope.get("route")  # set by the router on the scope it was given
            info.route = getattr(route, "path", None)
            for hook in self.hooks:
                try:
                    hook(info)
                except Exception:
                    log.exception("call hook failed", extra={"fields": {"hook": repr(hook)}})


class PayloadTooLarge(APIError):
    """The body grew past the limit while it was being received."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, "body_too_large", f"request body exceeds {limit} bytes")


_JSON_TYPES = (b"application/json", b"application/problem+json")


class BodyGuardMiddleware:
    """Refuse oversized or non-JSON bodies before any route reads them."""

    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        length: bytes | None = None
        ctype = b""
        for name, value in scope["headers"]:
            if name == b"content-length":
                length = value
            elif name == b"content-type":
                ctype = value
        limit = self.max_body_bytes
        if length is not None:
            if not length.isdigit():
                await _refuse(send, 400, "malformed_body", "invalid Content-Length")
                return
            size = int(length)
            if size > limit:
                await _refuse(send, 413, "body_too_large", f"request body exceeds {limit} bytes")
                return
            if size and not _is_json(ctype):
                await _refuse(
                    send, 415, "unsupported_media_type", "request body must be application/json"
                )
                return
            # Content-Length is enforced by the HTTP server: no more bytes than announced.
            await self.app(scope, receive, send)
            return

        received = 0
        checked_type = False

        async def counting_receive() -> Message:
            nonlocal received, checked_type
            message = await receive()
            if message["type"] == "http.request":
                chunk = message.get("body", b"")
                received += len(chunk)
                if received > limit:
                    raise PayloadTooLarge(limit)
                if chunk and not checked_type:
                    checked_type = True
                    if not _is_json(ctype):
                        raise APIError(
                            415, "unsupported_media_type", "request body must be application/json"
                        )
            return message

        await self.app(scope, counting_receive, send)


def _is_json(ctype: bytes) -> bool:
    if ctype == b"application/json":
        return True
    media = ctype.split(b";", 1)[0].strip().lower()
    return media in _JSON_TYPES


async def _refuse(send: Send, status: int, code: str, message: str) -> None:
    body = error_body(code, message)
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                # The unread body would be taken for the next request on this connection.
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
