"""HTTP errors: the one place where domain errors become statuses.

The service core (``app.core``), the manager and the transfer layer raise their own error types
and know nothing of HTTP; the table below (``_MAPPED``, in code) gives each its status and code.

Every error answer is JSON ``{"error": {"code": "...", "message": "..."}}``. ``code`` is a stable
machine-readable word, ``message`` is for people.

============================  ======  ==========================
raised                        status  code
============================  ======  ==========================
malformed JSON / body         400     malformed_body
client hung up mid-body       400     client_disconnected
two Authorization / namespace 400     ambiguous_credentials
no / wrong admin token        401/403 unauthorized / forbidden
AuthenticationError           401     its reason: missing_token, malformed_authorization,
                                      unknown_token, revoked_token
PermissionDeniedError         403     its reason: namespace_denied, namespace_required,
                                      unknown_namespace
HandleNotHeldError            403     handle_not_held
QuotaExceededError            429/507 quota_exceeded (507 for blocks, 429 for the others:
                                      pins, requests, retained_blocks, retentions,
                                      retention_keys, prefetch_keys)
RegistrationLimitError        429     quota_exceeded (max_registrations, max_mapped_bytes)
UnknownRequestError           404     unknown_request
UnknownJobError               404     unknown_job
UnknownCacheError             404     unknown_cache
UnknownRetentionError         404     unknown_retention
UnknownPrefetchError          404     unknown_prefetch
UnknownKeysError              404     unknown_keys
NoLowerTierError              409     no_lower_tier
PoolTooSmallError             409     pool_too_small
KeyNotReadyError              409     key_not_ready
NotPinnedError                409     not_pinned
other StateConflictError      409     state_conflict
If-Match mismatch             412     precondition_failed
too many keys / ops, body     413     too_many_keys / too_many_ops / body_too_large
kv_transfer_params too large  413     transfer_params_too_large
wrong Content-Type            415     unsupported_media_type
invalid field                 422     invalid_field
UnknownPolicyError            422     unknown_policy
InvalidPolicyParamsError      422     invalid_policy_params
other InvalidArgumentError    422     invalid_argument
RegistrationError             422     invalid_registration
InvalidJobError               422     invalid_job
NoSpaceError                  507     no_space
ServiceUnavailableError       503     unavailable
DeviceBlockError              422     invalid_field
other TransferError           503     transfer_unavailable
============================  ======  ==========================

``error_for(exc)`` maps an exception to an ``APIError`` (used by the exception handlers and by
the batch route, which answers per op); ``install_error_handlers(app)`` wires the handlers;
``responses(...)`` documents the statuses a route can return so the OpenAPI spec is true.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import Response

from app.core.errors import (
    AuthenticationError,
    DeviceBlockError,
    HandleNotHeldError,
    NoLowerTierError,
    NoSpaceError,
    PermissionDeniedError,
    PoolTooSmallError,
    QuotaExceededError,
    ServiceUnavailableError,
    UnknownJobError,
    UnknownKeysError,
    UnknownPrefetchError,
)
from app.telemetry.logging import get_logger
from manager import (
    InvalidArgumentError,
    InvalidPolicyParamsError,
    KeyNotReadyError,
    NotPinnedError,
    StateConflictError,
    UnknownPolicyError,
    UnknownRequestError,
    UnknownRetentionError,
)
from transfer import (
    InvalidJobError,
    RegistrationError,
    RegistrationLimitError,
    TransferError,
    UnknownCacheError,
)

log = get_logger("errors")
JSON_TYPE = "application/json"


class APIError(Exception):
    """An error answer: HTTP ``status``, stable ``code``, human ``message``, extra headers."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        headers: Mapping[str, str] | None = None,
        quota: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.headers = dict(headers or {})
        self.quota = quota

    def body(self) -> bytes:
        """The JSON error body."""
        return error_body(self.code, self.message, self.quota)

    def response(self) -> Response:
        """A complete ``Response`` for this error."""
        return Response(self.body(), self.status, self.headers, media_type=JSON_TYPE)


def error_body(code: str, message: str, quota: str | None = None) -> bytes:
    """``{"error": {"code", "message"}}`` (and ``quota`` when one is named) as JSON bytes."""
    detail = {"code": code, "message": message}
    if quota is not None:
        detail["quota"] = quota
    return json.dumps({"error": detail}).encode()


class ErrorDetail(BaseModel):
    """What went wrong."""

    model_config = ConfigDict(extra="forbid")
    code: str
    message: str
    quota: (
        Literal[
            "blocks",
            "pins",
            "requests",
            "retained_blocks",
            "retentions",
            "retention_keys",
            "prefetch_keys",
        ]
        | None
    ) = Field(default=None, description="with quota_exceeded: the quota that refused the call")


class ErrorBody(BaseModel):
    """Every error answer."""

    model_config = ConfigDict(extra="forbid")
    error: ErrorDetail


def _first_error(errors: Sequence[Mapping[str, Any]]) -> str:
    if not errors:
        return "invalid input"
    err = errors[0]
    loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
    msg = str(err.get("msg", "invalid"))
    more = f" (+{len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"{loc}: {msg}{more}" if loc else f"{msg}{more}"


def validation_error(errors: Sequence[Mapping[str, Any]]) -> APIError:
    """400 for unparseable JSON, else 422 naming the first invalid field."""
    if any(e.get("type") == "json_invalid" for e in errors):
        return APIError(400, "malformed_body", "request body is not valid JSON")
    return APIError(422, "invalid_field", _first_error(errors))


# The library errors with an HTTP answer of their own, as (type, status, code). Order matters:
# ``error_for`` takes the first type that matches, so a subclass comes before its base.
_MAPPED: tuple[tuple[type[Exception], int, str], ...] = (
    (UnknownRequestError, 404, "unknown_request"),
    (KeyNotReadyError, 409, "key_not_ready"),
    (NotPinnedError, 409, "not_pinned"),
    (StateConflictError, 409, "state_conflict"),
    (UnknownPolicyError, 422, "unknown_policy"),
    (InvalidPolicyParamsError, 422, "invalid_policy_params"),
    (InvalidArgumentError, 422, "invalid_argument"),
    (UnknownCacheError, 404, "unknown_cache"),
    (RegistrationError, 422, "invalid_registration"),
    (InvalidJobError, 422, "invalid_job"),
    (TransferError, 503, "transfer_unavailable"),
    (ServiceUnavailableError, 503, "unavailable"),
    (NoSpaceError, 507, "no_space"),
    (UnknownJobError, 404, "unknown_job"),
    (DeviceBlockError, 422, "invalid_field"),
    (HandleNotHeldError, 403, "handle_not_held"),
    (UnknownRetentionError, 404, "unknown_retention"),
    (UnknownPrefetchError, 404, "unknown_prefetch"),
    (UnknownKeysError, 404, "unknown_keys"),
    (NoLowerTierError, 409, "no_lower_tier"),
    (PoolTooSmallError, 409, "pool_too_small"),
)


def error_for(exc: BaseException) -> APIError:
    """The HTTP error for ``exc``; anything unexpected is a 500 ``internal`` error."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ValidationError):
        return validation_error(exc.errors(include_url=False, include_input=False))
    if isinstance(exc, RegistrationLimitError):  # before RegistrationError's 422 below
        return APIError(429, "quota_exceeded", str(exc), quota=exc.limit)
    for exc_type, status, code in _MAPPED:
        if isinstance(exc, exc_type):
            return APIError(status, code, str(exc))
    if isinstance(exc, AuthenticationError):
        return APIError(401, exc.reason, str(exc), {"WWW-Authenticate": "Bearer"})
    if isinstance(exc, PermissionDeniedError):
        return APIError(403, exc.reason, str(exc))
    if isinstance(exc, QuotaExceededError):
        if exc.quota == "blocks":
            return APIError(507, "quota_exceeded", str(exc), quota=exc.quota)
        return APIError(429, "quota_exceeded", str(exc), {"Retry-After": "1"}, exc.quota)
    return APIError(500, "internal", "internal error")


def too_many(what: str, count: int | None, limit: int) -> APIError:
    """413: more keys (or ops) in one call than the service accepts; ``count`` None when the
    call was refused before all of them were counted."""
    counted = f"more than {limit}" if count is None else str(count)
    return APIError(413, f"too_many_{what}", f"{counted} {what} in one call; the limit is {limit}")


# --------------------------------------------------------------------------- handlers


async def _api_error(request: Request, exc: Exception) -> Response:
    return error_for(exc).response()


async def _request_validation(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    return validation_error(exc.errors()).response()


async def _http_exception(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    codes = {404: "not_found", 405: "method_not_allowed"}
    code = codes.get(exc.status_code, "http_error")
    message = exc.detail if isinstance(exc.detail, str) else code.replace("_", " ")
    return APIError(exc.status_code, code, message, exc.headers).response()


async def _disconnected(request: Request, exc: Exception) -> Response:
    # The caller hung up mid-body: nobody reads this answer, and it is not a server error.
    return APIError(400, "client_disconnected", "client disconnected").response()


async def _unexpected(request: Request, exc: Exception) -> Response:
    log.error(
        "unhandled error",
        exc_info=exc,
        extra={"fields": {"path": request.url.path, "method": request.method}},
    )
    return APIError(500, "internal", "internal error").response()


def install_error_handlers(app: FastAPI) -> None:
    """Answer every error of ``app`` in the JSON error shape."""
    app.add_exception_handler(APIError, _api_error)
    handled: list[type[Exception]] = [
        ValidationError,
        *(t for t, _, _ in _MAPPED),
        AuthenticationError,
        PermissionDeniedError,
        QuotaExceededError,
    ]
    for exc_type in handled:
        app.add_exception_handler(exc_type, _api_error)
    app.add_exception_handler(RequestValidationError, _request_validation)
    app.add_exception_handler(StarletteHTTPException, _http_exception)
    app.add_exception_handler(ClientDisconnect, _disconnected)
    app.add_exception_handler(Exception, _unexpected)


# --------------------------------------------------------------------------- documentation

_DESCRIPTIONS = {
    400: "Malformed body (not JSON, or not the expected shape of JSON), or credentials or "
    "namespace given twice (code says which)",
    401: "No bearer token, or one that is malformed, unknown or revoked (code says which)",
    403: "Wrong admin token, or a namespace that is not the caller's (code says which)",
    404: "Unknown request, job, KV cache, namespace, retention or prefetch, or keys held nowhere",
    409: "The blocks are not in the state this call needs",
    412: "If-Match does not name the current generation",
    413: "Too many keys or ops in one call, body too large for the route, or "
    "kv_transfer_params too large",
    415: "Body is not application/json",
    422: "A field or parameter is invalid",
    429: "A quota (pins, requests, retained blocks, retentions, prefetch keys) is reached: "
    "nothing was done (retry later)",
    503: "The service is starting or shutting down",
    507: "No evictable space (with tenants: the namespace's blocks quota): nothing was stored",
}

BODY_ERRORS = (400, 413, 415, 422)


def responses(*statuses: int | Iterable[int]) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` for the given error statuses (each with the error body schema)."""
    flat: set[int] = set()
    for s in statuses:
        if isinstance(s, int):
            flat.add(s)
        else:
            flat.update(s)
    return {s: {"model": ErrorBody, "description": _DESCRIPTIONS[s]} for s in sorted(flat)}
