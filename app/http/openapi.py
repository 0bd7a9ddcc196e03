"""OpenAPI plumbing for routes that read their body raw.

The engine routes validate their JSON body themselves (``TypeAdapter.validate_json`` on the raw
bytes, without FastAPI's per-request dependency machinery). ``json_body(Model)`` documents such a
body (``openapi_extra``) by reference, and ``KVOffloadAPI.openapi()`` adds the referenced models
to ``components.schemas``, so the published spec describes exactly what the routes validate.

``add_docs_routes`` serves ``/openapi.json`` and ``/docs``; it is called after the API routes so
the hot routes are matched first. ``/docs`` loads Swagger UI's script, stylesheet and icon from
the service itself (the files the ``fastapi-offline`` package ships), never from a CDN, so the
page works on a node without internet access.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from importlib.resources import files
from pathlib import Path
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse
from kvoffload_client.client import NAMESPACE_HEADER
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from app.http.errors import ErrorBody, responses
from app.http.routes.query import strict_query

_REF = "#/components/schemas/{model}"
_HAS_NATIVE_TELEMETRY = "telemetry" in inspect.signature(FastAPI.__init__).parameters


class KVOffloadAPI(FastAPI):
    """``FastAPI`` whose spec also holds the models documented by ``json_body``."""

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("docs_url", None)
        kwargs.setdefault("redoc_url", None)
        kwargs.setdefault("openapi_url", None)
        # No slash redirects: "/v1/requests/victim%2F" must not be redirected to the request
        # "victim" (a redirect-following client would act on another request).
        kwargs.setdefault("redirect_slashes", False)
        # Strict inputs everywhere: unknown query parameters are refused like unknown fields.
        kwargs.setdefault("dependencies", [Depends(strict_query)])
        # FastAPI's native OpenTelemetry hooks are off: the service's telemetry is Prometheus
        # and JSON logs (app/observability.py), and merely checking on every call whether a
        # global OTel provider is configured costs about 7% of a lookup's CPU. Older FastAPI
        # releases have no such hooks and no such argument.
        if _HAS_NATIVE_TELEMETRY:
            kwargs.setdefault("telemetry", {"tracing": False, "metrics": False, "logs": False})
        super().__init__(**kwargs)
        self.body_models: list[type[BaseModel]] = []
        # The engine API: its /v1 operations take the caller's credentials and namespace.
        self.engine_auth = False
        self._patched: dict[str, Any] | None = None

    def json_body(self, model: type[BaseModel], *, required: bool = True) -> dict[str, Any]:
        """``openapi_extra`` documenting a JSON request body of type ``model``."""
        if model not in self.body_models:
            self.body_models.append(model)
        return {
            "requestBody": {
                "required": required,
                "content": {
                    "application/json": {"schema": {"$ref": _REF.format(model=model.__name__)}}
                },
            }
        }

    def openapi(self) -> dict[str, Any]:
        """The generated spec, plus the raw-body models and the statuses every route shares.

        Cross-cutting answers are documented where they are produced: any route answers 422
        to an unknown query parameter (``strict_query``), and any route of a method that may
        carry a body answers 413/415 to an oversized or non-JSON body (``BodyGuardMiddleware``).
        """
        schema = super().openapi()
        # FastAPI caches the spec (and rebuilds it when routes change): patch each build once.
        if schema is self._patched:
            return schema
        _document_shared_errors(schema)
        if self.engine_auth:
            _document_engine_auth(schema)
        if self.body_models:
            _, defs = models_json_schema(
                [(m, "validation") for m in self.body_models], ref_template=_REF
            )
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for name, definition in defs.get("$defs", {}).items():
                if name in components and components[name] != definition:
                    raise RuntimeError(f"two different schemas named {name!r} in the spec")
                components[name] = definition
        self._patched = schema
        return schema


_BODY_METHODS = ("post", "put", "patch", "delete")


def _add_errors(operation: dict[str, Any], statuses: tuple[int, ...]) -> None:
    """Document ``statuses`` as error answers of ``operation`` (kept where it has its own)."""
    answers = operation.setdefault("responses", {})
    for status, doc in responses(statuses).items():
        answers.setdefault(
            str(status),
            {
                "description": doc["description"],
                "content": {"application/json": {"schema": _ERROR_REF}},
            },
        )


_ERROR_REF = {"$ref": "#/components/schemas/ErrorBody"}


def _document_shared_errors(schema: dict[str, Any]) -> None:
    for item in schema.get("paths", {}).values():
        for method, operation in item.items():
            _add_errors(operation, (422, 413, 415) if method in _BODY_METHODS else (422,))
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    _, defs = models_json_schema([(ErrorBody, "validation")], ref_template=_REF)
    for name, definition in defs.get("$defs", {}).items():
        components.setdefault(name, definition)


ENGINE_SECURITY = "EngineToken"


def _document_engine_auth(schema: dict[str, Any]) -> None:
    """Every ``/v1`` operation: the bearer token (needed when the service has tenants, so
    optional in the spec), the namespace header, and the 401/403 a call refused for either
    answers (``app.http.auth``: the middleware refuses them on every such route)."""
    schemes = schema.setdefault("components", {}).setdefault("securitySchemes", {})
    schemes[ENGINE_SECURITY] = {
        "type": "http",
        "scheme": "bearer",
        "description": "a tenant's engine token (required when the service has a tenants file)",
    }
    header = {
        "name": NAMESPACE_HEADER,
        "in": "header",
        "required": False,
        "description": "the namespace the call runs in (default: the tenant's only one)",
        "schema": {"type": "string", "minLength": 1, "maxLength": 63},
    }
    for path, item in schema.get("paths", {}).items():
        if not path.startswith("/v1/"):
            continue
        for operation in item.values():
            operation["security"] = [{ENGINE_SECURITY: []}, {}]
            operation.setdefault("parameters", []).append(header)
            _add_errors(operation, (401, 403))


# Swagger UI's files, served under /docs/ with these content types.
DOCS_ASSETS = {
    "swagger-ui-bundle.js": "text/javascript; charset=utf-8",
    "swagger-ui.css": "text/css; charset=utf-8",
    "favicon.png": "image/png",
}


def docs_asset_dir() -> Path:
    """The installed directory holding ``DOCS_ASSETS`` (``fastapi-offline``'s static files)."""
    return Path(str(files("fastapi_offline").joinpath("static")))


def add_docs_routes(app: KVOffloadAPI) -> None:
    """Serve ``/openapi.json``, a Swagger UI at ``/docs`` and its files at ``/docs/<asset>``.

    Raises ``RuntimeError`` if an asset is missing from the installed package (a blank docs
    page would be found much later than a service that does not start).
    """
    directory = docs_asset_dir()
    missing = [name for name in DOCS_ASSETS if not (directory / name).is_file()]
    if missing:
        raise RuntimeError(f"Swagger UI files {missing} not found in {directory}")

    async def openapi_json(request: Request) -> JSONResponse:
        return JSONResponse(app.openapi())

    async def swagger(request: Request) -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url="/openapi.json",
            title=f"{app.title} - docs",
            swagger_js_url="/docs/swagger-ui-bundle.js",
            swagger_css_url="/docs/swagger-ui.css",
            swagger_favicon_url="/docs/favicon.png",
            # No badge from the public validator service: the page makes no outside request.
            swagger_ui_parameters={"validatorUrl": None},
        )

    app.add_route("/openapi.json", openapi_json, include_in_schema=False)
    app.add_route("/docs", swagger, include_in_schema=False)
    for name, media_type in DOCS_ASSETS.items():
        app.add_route(
            f"/docs/{name}", _asset_route(directory / name, media_type), include_in_schema=False
        )


def _asset_route(path: Path, media_type: str) -> Callable[[Request], Awaitable[FileResponse]]:
    async def asset(request: Request) -> FileResponse:
        return FileResponse(path, media_type=media_type)

    return asset
