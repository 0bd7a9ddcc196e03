"""Application factories: the engine API app and the admin API app around one ``Service``.

``create_app(settings)`` builds the public (engine) app; ``create_admin_app(settings, service)``
builds the admin app on the same service. Nothing is created at import time. Each app's
lifespan holds the service running (reference counted), so either app works alone in tests and
both share one pool, manager and worker under ``kvoffload serve``.

Middleware (pure ASGI, outermost first): ``CallContextMiddleware`` (request id, the per-call
``CallInfo``, the ids bound for logging, the hooks, and on the engine app the
``X-KVOffload-Pool`` header), then ``BodyGuardMiddleware`` (413/415 before a body is parsed;
each route held to its own byte cap, ``app.http.limits.body_caps``, in a table built from the app's
routes once they are all registered). The service's
``observer.on_call`` is always the first hook of both apps (HTTP metrics, the canonical log
line); ``hooks`` given by the caller run after it.

Metrics: one ``Metrics`` per service, in the registry given to ``create_app`` (a fresh
``CollectorRegistry`` by default); ``GET /metrics`` on the engine app serves it unless
``metrics_enabled`` is off.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Sequence

from fastapi import Depends, FastAPI
from prometheus_client import CollectorRegistry

from app import package_version
from app.core.service import Service
from app.http.errors import install_error_handlers
from app.http.limits import BodyLimits, body_caps
from app.http.middleware import (
    ENGINE_REQUEST_PREFIX,
    BodyGuardMiddleware,
    CallContextMiddleware,
)
from app.http.openapi import KVOffloadAPI, add_docs_routes
from app.http.routes.admin import (
    ADMIN_REQUEST_PREFIX,
    admin_guard,
    register_admin_health,
    register_admin_routes,
)
from app.http.routes.engine import register_engine_routes
from app.http.routes.health import register_health_routes
from app.http.routes.metrics import register_metrics_route
from app.pool_share import POOL_HEADER
from app.settings import Settings
from app.telemetry.calls import CallHook

_ENGINE_DESCRIPTION = """\
KV-cache offloading for LLM inference engines. Keys are block hashes written as hex
(1..64 bytes). Every request-scoped call names the engine request in the path; pins and pending
stores are leases held by that request. Errors are `{"error": {"code", "message"}}`.
Every answer carries `X-KVOffload-Pool`, the `pool_id` of the host pool (new when the service
restarts).
"""


def _install_middleware(
    app: FastAPI,
    settings: Settings,
    service: Service,
    hooks: Sequence[CallHook],
    request_prefix: str,
    response_header: Callable[[], tuple[bytes, bytes] | None] | None = None,
) -> None:
    # Called after every route is registered: the table must know them all.
    limits = BodyLimits.for_routes(app.routes, body_caps(settings), settings.max_body_bytes)
    # add_middleware wraps: the last added runs first.
    app.add_middleware(BodyGuardMiddleware, limits=limits)
    app.add_middleware(
        CallContextMiddleware,
        hooks=(service.observer.on_call, *hooks),
        request_prefix=request_prefix,
        response_header=response_header,
    )


def pool_header(service: Service) -> Callable[[], tuple[bytes, bytes] | None]:
    """``X-KVOffload-Pool: <pool_id>`` for every engine answer once the service has a pool, so
    an engine that mapped a pool sees in any answer that the service behind it restarted."""
    name = POOL_HEADER.lower().encode()

    def header() -> tuple[bytes, bytes] | None:
        pool_id = service.pool_id
        return None if pool_id is None else (name, pool_id.encode())

    return header


def create_app(
    settings: Settings | None = None,
    *,
    service: Service | None = None,
    hooks: Sequence[CallHook] = (),
    registry: CollectorRegistry | None = None,
) -> KVOffloadAPI:
    """The engine API app. ``service`` defaults to a new ``Service(settings, registry=...)``.

    ``hooks`` are called with each call's ``CallInfo`` when it ends, after the service's own
    observer. ``registry`` is where a new service puts its metrics (a fresh one by default);
    with ``service`` given, its registry is used and ``registry`` must be None.
    """
    settings = settings if settings is not None else Settings()
    if service is not None and registry is not None:
        raise ValueError("pass registry to the Service, not beside it")
    svc = service if service is not None else Service(settings, registry=registry)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with svc.running():
            yield

    app = KVOffloadAPI(
        title="kvoffload engine API",
        version=package_version(),
        description=_ENGINE_DESCRIPTION,
        lifespan=lifespan,
    )
    app.state.service = svc
    app.state.settings = settings
    install_error_handlers(app)
    register_engine_routes(app, svc)
    register_health_routes(app)
    if svc.registry is not None:
        register_metrics_route(app, svc.registry)
    add_docs_routes(app)
    _install_middleware(app, settings, svc, hooks, ENGINE_REQUEST_PREFIX, pool_header(svc))
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
        version=package_version(),
        description=(
            "Operator API: eviction policy and its shadow projections, statistics, leases, "
            "cache clear, log level."
        ),
        lifespan=lifespan,
        dependencies=[Depends(admin_guard)],
    )
    app.state.service = service
    app.state.settings = settings
    install_error_handlers(app)
    register_admin_routes(app, settings.admin_token_value())
    register_admin_health(app)
    add_docs_routes(app)
    _install_middleware(app, settings, service, hooks, ADMIN_REQUEST_PREFIX)
    return app
