"""Pure ASGI middleware (no ``BaseHTTPMiddleware``: contextvars and streaming stay intact).

``CallContextMiddleware`` gives every HTTP call a ``CallInfo`` (``app.telemetry.calls``) in its
scope (``call_info``) and as the current call (``current_call``, for code below the routes: the
observed manager counts the keys it handles there): the request id (``X-Request-ID`` taken
from the caller when it is a safe id, else made up; echoed either way), the op and engine
``req_id`` once a route knows them, the per-op outcome of a batch, the keys handled, and the
final status.

For the duration of the call it binds for logging (``app.telemetry.logging.bind_call``, a context
variable) ``request_id`` (the call's id) and ``req_id``: on a request-scoped path
(``/v1/requests/{req_id}...``; the prefix is a parameter) the engine request id from the path in
its safe form (``app.telemetry.request_ids``), else the call's id. So every log line written
while serving the call carries them.

The call's route is the template the router matched (``scope["route"]``). Calls the router
does not mark (plain Starlette routes: ``/docs``, ``/openapi.json``; bodies the guard refused
before routing; 404s) are matched against the app's route templates (``app.http.routing``, built
from ``scope["app"]`` on the first such call), so ``/docs`` counts as ``/docs`` and a 415 for a
lookup as the lookup route; a path no route matches stays without one.

When the call ends it hands the ``CallInfo`` to its hooks (``create_app(hooks=...)``), still
inside the bound context (left bound when an exception escapes the app, for the error lines
written outside this middleware): the observability layer (metrics, canonical log line) plugs
in there, and routes only fill in the ``CallInfo``. A hook that raises is logged and does not
affect the call.

``BodyGuardMiddleware`` refuses bodies before they are parsed: 413 when ``Content-Length`` says
too large, or when a body without one grows past the limit while it is received; 415 when a
body is not ``application/json``. The limit is the cap of the route the call is for
(``app.http.limits.BodyLimits``: derived from the settings, at most ``max_body_bytes``).
"""

from __future__ import annotations

import itertools
import json
import os
import time
from collections.abc import Callable, Mapping, Sequence

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.http.errors import APIError, error_body
from app.http.limits import BodyLimits
from app.http.routing import RouteMatcher
from app.telemetry.calls import CallHook, CallInfo, enter_call, leave_call
from app.telemetry.logging import bind_call, get_logger, unbind_call
from app.telemetry.request_ids import MAX_SAFE_ID, SAFE_ID, safe_req_id

log = get_logger("middleware")
CALL_KEY = "kvoffload.call"
ENGINE_REQUEST_PREFIX = "/v1/requests/"
_REQUEST_ID = b"x-request-id"


def call_info(scope: Scope) -> CallInfo | None:
    """The ``CallInfo`` of the call, when ``CallContextMiddleware`` is installed."""
    info = scope.get(CALL_KEY)
    return info if isinstance(info, CallInfo) else None


def _valid_request_id(raw: bytes) -> bool:
    if not 0 < len(raw) <= MAX_SAFE_ID or not raw.isascii():
        return False
    return SAFE_ID.fullmatch(raw.decode()) is not None


def path_req_id(path: str, prefix: str) -> str | None:
    """The ``{req_id}`` segment of ``path`` under ``prefix`` (``/v1/requests/``), else None."""
    if not path.startswith(prefix):
        return None
    segment = path[len(prefix) :].split("/", 1)[0]
    return segment or None


def error_code(body: bytes) -> str | None:
    """The ``code`` of an error body ``{"error": {"code": ...}}``; None for any other body."""
    try:
        code = json.loads(body)["error"]["code"]
    except (ValueError, TypeError, KeyError):
        return None
    return code if isinstance(code, str) else None


class CallContextMiddleware:
    """Attach a ``CallInfo`` to each HTTP call, bind the ids for logging, echo ``X-Request-ID``
    (and add ``response_header(info)`` when given), run the hooks at the end."""

    def __init__(
        self,
        app: ASGIApp,
        hooks: Sequence[CallHook] = (),
        request_prefix: str | None = ENGINE_REQUEST_PREFIX,
        response_header: Callable[[CallInfo], tuple[bytes, bytes] | None] | None = None,
    ) -> None:
        self.app = app
        self.hooks = tuple(hooks)
        self.request_prefix = request_prefix
        # Added to every answer beside X-Request-ID while it returns one (engine app: the pool).
        self.response_header = response_header
        # Made-up ids: a random per-process prefix and a counter (unique without an RNG call
        # per request).
        self._id_prefix = os.urandom(6).hex()
        self._counter = itertools.count(1)
        self._templates: RouteMatcher[str] | None = None

    def _template(self, scope: Scope) -> str | None:
        # Off the hot path: only calls the router did not mark come here.
        if self._templates is None:
            app = scope.get("app")
            self._templates = RouteMatcher.of_routes(getattr(app, "routes", ()))
        entry = self._templates.match(scope.get("method"), scope["path"])
        return None if entry is None else entry.value

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
        path: str = scope["path"]
        info = CallInfo(request_id, scope["method"], path, time.perf_counter())
        info.client = scope.get("client")
        engine_req = (
            path_req_id(path, self.request_prefix) if self.request_prefix is not None else None
        )
        info.log_id = request_id if engine_req is None else safe_req_id(engine_req)
        scope[CALL_KEY] = info
        current = enter_call(info)
        bound = bind_call(request_id, info.log_id)
        echoed = (_REQUEST_ID, request_id.encode())

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                info.status = message["status"]
                headers = [*message.get("headers", ()), echoed]
                extra = self.response_header(info) if self.response_header is not None else None
                if extra is not None:
                    headers.append(extra)
                message["headers"] = headers
            elif info.status >= 400 and info.error_code is None:
                info.error_code = error_code(message.get("body", b""))
            await send(message)

        escaped = True
        try:
            await self.app(scope, receive, send_with_id)
            escaped = False
        finally:
            info.duration_s = time.perf_counter() - info.started
            if not info.status:
                info.status = 500
            route = scope.get("route")  # set by the router on the scope it was given
            template = getattr(route, "path", None)
            info.route = template if template is not None else self._template(scope)
            for hook in self.hooks:
                try:
                    hook(info)
                except Exception:
                    log.exception("call hook failed", extra={"fields": {"hook": repr(hook)}})
            # An exception escaping the app is logged after this middleware (Starlette's
            # outermost error handler, then the server): the ids stay bound for those lines.
            # uvicorn serves each HTTP call in a task of its own, whose context dies with it.
            if not escaped:
                unbind_call(bound)
            leave_call(current)


def too_large_message(limit: int, route: str | None) -> str:
    """What a 413 ``body_too_large`` says: the limit, and whose it is when a route's own."""
    if route is None:
        return f"request body exceeds {limit} bytes"
    return f"request body exceeds {limit} bytes, the limit of {route}"


class PayloadTooLarge(APIError):
    """The body grew past the limit while it was being received."""

    def __init__(self, limit: int, route: str | None = None) -> None:
        super().__init__(413, "body_too_large", too_large_message(limit, route))


_JSON_TYPES = (b"application/json", b"application/problem+json")


class BodyGuardMiddleware:
    """Refuse oversized or non-JSON bodies before any route reads them; each call is held to
    the cap ``limits`` gives its method and path."""

    def __init__(self, app: ASGIApp, limits: BodyLimits) -> None:
        self.app = app
        self.limits = limits

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
        limit, route = self.limits.limit_for(scope["method"], scope["path"])
        if length is not None:
            if not length.isdigit():
                await refuse(send, 400, "malformed_body", "invalid Content-Length")
                return
            size = int(length)
            if size > limit:
                await refuse(send, 413, "body_too_large", too_large_message(limit, route))
                return
            if size and not _is_json(ctype):
                await refuse(
                    send, 415, "unsupported_media_type", "request body must be application/json"
                )
                return
            # Content-Length is enforced by the HTTP server: no more bytes than announced.
            await self.app(scope, receive, send)
            return

        received = 0
        checked_type = False
        refused = False  # the body was refused mid-way: the rest of it is still on the wire

        async def counting_receive() -> Message:
            nonlocal received, checked_type, refused
            message = await receive()
            if message["type"] == "http.request":
                chunk = message.get("body", b"")
                received += len(chunk)
                if received > limit:
                    refused = True
                    raise PayloadTooLarge(limit, route)
                if chunk and not checked_type:
                    checked_type = True
                    if not _is_json(ctype):
                        refused = True
                        raise APIError(
                            415, "unsupported_media_type", "request body must be application/json"
                        )
            return message

        async def closing_send(message: Message) -> None:
            # Like _refuse: after a refused body the connection must close, or the server would
            # go on reading (and discarding) whatever the client still sends on it.
            if refused and message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k != b"connection"]
                headers.append((b"connection", b"close"))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, counting_receive, closing_send)


def _is_json(ctype: bytes) -> bool:
    if ctype == b"application/json":
        return True
    media = ctype.split(b";", 1)[0].strip().lower()
    return media in _JSON_TYPES


async def refuse(
    send: Send, status: int, code: str, message: str, headers: Mapping[str, str] | None = None
) -> None:
    """Answer an error before the app has read the call's body, and close the connection."""
    body = error_body(code, message)
    extra = [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                # The unread body would be taken for the next request on this connection.
                (b"connection", b"close"),
                *extra,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
