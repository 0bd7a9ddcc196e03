"""Routes that read their JSON body raw, for the hot engine API.

FastAPI's per-call machinery (resolving every declared parameter, then serialising the answer)
costs more than a ``lookup`` itself. A ``RawRoute`` keeps everything else of FastAPI (routing,
exception handlers, middleware, the OpenAPI operation built from the endpoint's signature,
``response_model`` and ``openapi_extra``) but calls its endpoint as
``endpoint(request, **path_params)`` (no query parameters: any is refused with 422): the
endpoint checks its path parameters, reads the body
with ``read_body`` and validates it with a ``body_parser`` (the same model the spec documents),
and returns a ready ``Response``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from fastapi import Request
from fastapi.responses import Response
from fastapi.routing import APIRoute
from pydantic import BaseModel, TypeAdapter, ValidationError
from starlette.requests import ClientDisconnect

from app.http.errors import APIError, validation_error
from app.http.routes.query import refuse_query

MAX_PATH_PARAM = 256


class RawRoute(APIRoute):
    """An ``APIRoute`` that calls ``endpoint(request, **path_params)`` and returns its answer."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        endpoint: Callable[..., Awaitable[Response]] = self.endpoint

        async def handler(request: Request) -> Response:
            if request.scope.get("query_string"):
                refuse_query(request)
            return await endpoint(request, **request.path_params)

        return handler


def check_path_param(name: str, value: str) -> str:
    """``value`` if it is 1..256 characters, else ``APIError`` 422 (what the spec declares)."""
    if not 0 < len(value) <= MAX_PATH_PARAM:
        raise APIError(422, "invalid_field", f"path.{name}: must be 1..{MAX_PATH_PARAM} characters")
    return value


async def read_body(request: Request) -> bytes | bytearray:
    """The whole request body: one ASGI message's, or a ``bytearray`` the messages were added
    to as they came (no copy of a large body at its end: joining 6.7 MB of messages held the
    served process's loop up to 5 ms)."""
    message = await request.receive()
    if message["type"] != "http.request":
        raise ClientDisconnect()
    body: bytes = message.get("body", b"")
    if not message.get("more_body", False):
        return body
    whole = bytearray(body)
    while True:
        message = await request.receive()
        if message["type"] != "http.request":
            raise ClientDisconnect()
        whole += message.get("body", b"")
        if not message.get("more_body", False):
            return whole


def body_parser(model: type[BaseModel]) -> Callable[[bytes | bytearray], Any]:
    """``parse(raw) -> model instance``; an empty body counts as ``{}``.

    Raises ``APIError`` 400 for bytes that are not JSON, 422 naming the first invalid field.
    """
    validate = TypeAdapter(model).validate_json

    def parse(raw: bytes | bytearray) -> Any:
        try:
            return validate(raw or b"{}")
        except ValidationError as exc:
            raise validation_error(exc.errors(include_url=False, include_input=False)) from None

    return parse
