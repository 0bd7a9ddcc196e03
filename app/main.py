"""Application factories: the engine API app and the admin API app around one ``Service``.

``create_app(settings)`` builds the public (engine) app; ``create_admin_app(settings, service)``
builds the admin app on the same service. Nothing is created at import time. Each app's
lifespan holds the service running (reference counted), so either app works alone in tests and
both share one pool, manager and worker under ``kvoffload serve``.

Middleware (pure ASGI, outermost first): ``CallContextMiddleware`` (request id, the per-call
``CallInfo`` and the ``on_call`` hooks the observability layer plugs into), then
``BodyGuardMiddleware`` (413/415 before a body is parsed).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence

from fastapi import FastAPI

from app.errors import install_error_handlers
from app.middleware import BodyGuardMiddleware, CallContextMiddleware, CallHook
from app.openapi import KVOffloadAPI, add_docs_routes
from app.routes.admin import register_admin_health, register_admin_routes
from app.routes.engine import register_engine_routes
from app.routes.health import register_health_routes
from app.service import Service
from app.settings import Settings

VERSION = "0.1.0"

_ENGINE_DESCRIPTION = """\
KV-cache offloading for LLM inference engines. Keys are block hashes written as hex
(1..64 bytes). Every request-scoped call names the engine request in the path; pins and pending
stores are leases held by that request. Errors are `{"error": {"code", "message"}}`.
"""


def _install_middleware(app: FastAPI, settings: Settings, hooks: Sequence[CallHook]) -> None:
    # add_middleware wraps: the last added runs first.
    app.add_middleware(BodyGuardMiddleware, max_body_bytes=settings.max_body_bytes)
    app.add_middleware(CallContextMiddleware, hooks=tuple(hooks))


def create_app(
    settings: Settings | None = None,
    *,
    service: Service | None = None,
    hooks: Sequence[CallHook] = (),
) -> KVOffloadAPI:
    """The engine API app. ``service`` defaults to a new ``Service(settings)``.

    ``hooks`` are called with each call's ``CallInfo`` when it ends (metrics, access logs).
    """
    settings = settings if settings is not None else Settings()
    svc = service if service is not None else Service(settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with svc.running():
            yield

    app = KVOffloadAPI(
        title="kvoffload engine API",
        version=VERSION,
        description=_ENGINE_DESCRIPTION,
        lifespan=lifespan,
    )
    app.state.service = svc
    app.state.settings = settings
    install_error_handlers(app)
    register_engine_routes(app, svc)
    register_health_routes(app, svc)
    add_docs_routes(app)
    _install_middleware(app, settings, hooks)
    return app


def create_admin_app(
    settings: Settings,
    service: Service,
    *,
    hooks: Sequence[CallHook] = (),
) -> KVOffloadAPI:
    """The admin API app on ``service`` (bearer token from ``settings``)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with service.running():
            yield

    app = KVOffloadAPI(
        title="kvoffload admin API",
        version=VERSION,
        description="Operator API: eviction policy, statistics, leases, cache clear.",
        lifespan=lifespan,
    )
    app.state.service = service
    app.state.settings = settings
    install_error_handlers(app)
    register_admin_routes(app, service, settings.admin_token_value())
    register_admin_health(app)
    add_docs_routes(app)
    _install_middleware(app, settings, hooks)
    return app
