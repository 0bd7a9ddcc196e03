"""OpenAPI plumbing for routes that read their body raw.

The engine routes validate their JSON body themselves (``TypeAdapter.validate_json`` on the raw
bytes, without FastAPI's per-request dependency machinery). ``json_body(Model)`` documents such a
body (``openapi_extra``) by reference, and ``KVOffloadAPI.openapi()`` adds the referenced models
to ``components.schemas``, so the published spec describes exactly what the routes validate.

``add_docs_routes`` serves ``/openapi.json`` and ``/docs``; it is called after the API routes so
the hot routes are matched first.
"""

from __future__ import annotations

import inspect
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse
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


def _document_shared_errors(schema: dict[str, Any]) -> None:
    shared = responses(422)
    guarded = responses(413, 415)
    error_ref = {"$ref": "#/components/schemas/ErrorBody"}
    for item in schema.get("paths", {}).values():
        for method, operation in item.items():
            answers = operation.setdefault("responses", {})
            extra = {**shared, **(guarded if method in _BODY_METHODS else {})}
            for status, doc in extra.items():
                answers.setdefault(
                    str(status),
                    {
                        "description": doc["description"],
                        "content": {"application/json": {"schema": error_ref}},
                    },
                )
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    _, defs = models_json_schema([(ErrorBody, "validation")], ref_template=_REF)
    for name, definition in defs.get("$defs", {}).items():
        components.setdefault(name, definition)


def add_docs_routes(app: KVOffloadAPI) -> None:
    """Serve ``/openapi.json`` and a Swagger UI at ``/docs``."""

    async def openapi_json(request: Request) -> JSONResponse:
        return JSONResponse(app.openapi())

    async def swagger(request: Request) -> HTMLResponse:
        return get_swagger_ui_html(openapi_url="/openapi.json", title=f"{app.title} - docs")

    app.add_route("/openapi.json", openapi_json, include_in_schema=False)
    app.add_route("/docs", swagger, include_in_schema=False)
