"""Application factories: the engine API app and the admin API app around one ``Service``.

``create_app(settings)`` builds the public (engine) app; ``create_admin_app(settings, service)``
builds the admin app on the same service. Nothing is created at import time. Each app's
lifespan holds the service running (reference counted), so either app works alone in tests and
both share one pool, manager and worker under ``kvoffload serve``.

Middleware (pure ASGI, outermost first): ``CallContextMiddleware`` (request id, the per-call
``CallInfo``, the ids bound for logging, the hooks, and on the engine app the
``X-KVOffload-Pool`` header), on the engine app ``SpaceMiddleware`` (the caller's credentials
and namespace, ``app.http.auth``), then ``BodyGuardMiddleware`` (413/415 before a body is parsed;
each route held to its own byte cap, ``app.http.limits.body_caps``, in a table built from the app's
routes once they are all registered). The tenancy's ``on_call`` (the call's namespace's
observer) is always the first hook of both apps (HTTP metrics, the canonical log line);
``hooks`` given by the caller run after it.

Metrics: one ``Metrics`` per service, in the registry given to ``create_app`` (a fresh
``CollectorRegistry`` by default); ``GET /metrics`` on the engine app serves it unless
``metrics_enabled`` is off.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Sequence

from fastapi import Depends, FastAPI
from kvoffload_client.pool_socket import POOL_HEADER
from prometheus_client import CollectorRegistry

from app import package_version
from app.core.service import Service
from app.core.tenancy import Tenancy
from app.http.auth import SpaceMiddleware
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
from app.settings import Settings
from app.telemetry.calls import CallHook, CallInfo
from app.telemetry.merged import LabelledRegistries

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
    tenancy: Tenancy,
    hooks: Sequence[CallHook],
    request_prefix: str,
    *,
    engine: bool,
) -> None:
    # Called after every route is registered: the table must know them all.
    limits = BodyLimits.for_routes(app.routes, body_caps(settings), settings.max_body_bytes)
    # add_middleware wraps: the last added runs first.
    app.add_middleware(BodyGuardMiddleware, limits=limits)
    if engine:  # credentials before any other check
        app.add_middleware(SpaceMiddleware, tenancy=tenancy)
    app.add_middleware(
        CallContextMiddleware,
        hooks=(tenancy.on_call, *hooks),
        request_prefix=request_prefix,
        response_header=pool_header(tenancy) if engine else None,
    )


def holding(tenancy: Tenancy) -> Callable[[FastAPI], contextlib.AbstractAsyncContextManager[None]]:
    """An app lifespan that holds ``tenancy`` running (reference counted: both listeners'
    apps hold the same one)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with tenancy.running():
            yield

    return lifespan


def pool_header(tenancy: Tenancy) -> Callable[[CallInfo], tuple[bytes, bytes] | None]:
    """``X-KVOffload-Pool: <pool_id>`` for every engine answer once the call's namespace has a
    pool, so an engine that mapped a pool sees in any answer that the service behind it
    restarted. With tenants, only answers to calls that reached a namespace carry it."""
    name = POOL_HEADER.lower().encode()
    single = tenancy.single

    def header(info: CallInfo) -> tuple[bytes, bytes] | None:
        pool_id = single.pool_id if single is not None else tenancy.pool_id(info.namespace)
        return None if pool_id is None else (name, pool_id.encode())

    return header


def create_app(
    settings: Settings | None = None,
    *,
    service: Service | None = None,
    tenancy: Tenancy | None = None,
    hooks: Sequence[CallHook] = (),
    registry: CollectorRegistry | None = None,
) -> KVOffloadAPI:
    """The engine API app on ``tenancy`` (default: one without tenants around ``service``,
    itself a new ``Service(settings, registry=...)`` by default).

    ``hooks`` are called with each call's ``CallInfo`` when it ends, after the tenancy's own
    observer. ``registry`` is where a new service puts its metrics (a fresh one by default);
    with ``service`` or ``tenancy`` given, theirs is used and ``registry`` must be None.
    """
    settings = settings if settings is not None else Settings()
    if (service is not None or tenancy is not None) and registry is not None:
        raise ValueError("pass registry to the Service or Tenancy, not beside it")
    if tenancy is None:
        tenancy = Tenancy(settings, service=service, registry=registry)
    elif service is not None:
        raise ValueError("pass service or tenancy, not both")
    app = KVOffloadAPI(
        title="kvoffload engine API",
        version=package_version(),
        description=_ENGINE_DESCRIPTION,
        lifespan=holding(tenancy),
    )
    app.engine_auth = True
    app.state.tenancy = tenancy
    app.state.settings = settings
    install_error_handlers(app)
    register_engine_routes(app, settings)
    register_health_routes(app)
    token = settings.metrics_token
    # An open /metrics of a service with tenants names no tenant, namespace or request id.
    guarded = token is not None or not tenancy.enabled
    exposition = metrics_registry(tenancy, namespaces=guarded)
    if exposition is not None:
        register_metrics_route(
            app,
            exposition,
            token=None if token is None else token.get_secret_value(),
            request_ids=guarded,
        )
    add_docs_routes(app)
    _install_middleware(app, settings, tenancy, hooks, ENGINE_REQUEST_PREFIX, engine=True)
    return app


def metrics_registry(tenancy: Tenancy, *, namespaces: bool = True) -> CollectorRegistry | None:
    """What ``GET /metrics`` serves: the one service's registry without tenants; with them,
    the front metrics (calls that reached no namespace, the tenants file's reloads) and, with
    ``namespaces``, every namespace's metrics labelled ``tenant`` and ``namespace``. None with
    metrics off."""
    if tenancy.single is not None:
        return tenancy.single.registry
    if tenancy.front_registry is None:
        return None
    front = tenancy.front_registry
    if not namespaces:
        return front

    def sources() -> list[tuple[dict[str, str], CollectorRegistry]]:
        found: list[tuple[dict[str, str], CollectorRegistry]] = [({}, front)]
        for space in list(tenancy.spaces.values()):
            registry = space.service.registry
            if registry is not None:
                labels = {"tenant": space.tenant or "", "namespace": space.namespace}
                found.append((labels, registry))
        return found

    merged = CollectorRegistry()
    merged.register(LabelledRegistries(sources))
    return merged


def create_admin_app(
    settings: Settings,
    service: Service | None = None,
    *,
    tenancy: Tenancy | None = None,
    hooks: Sequence[CallHook] = (),
) -> KVOffloadAPI:
    """The admin API app on ``tenancy`` (or one without tenants around ``service``); bearer
    token from ``settings``."""
    if tenancy is None:
        if service is None:
            raise ValueError("pass service or tenancy")
        tenancy = Tenancy(settings, service=service)
    elif service is not None:
        raise ValueError("pass service or tenancy, not both")
    app = KVOffloadAPI(
        title="kvoffload admin API",
        version=package_version(),
        description=(
            "Operator API: eviction policy and its shadow projections, statistics, leases, "
            "cache clear, log level."
        ),
        lifespan=holding(tenancy),
        dependencies=[Depends(admin_guard)],
    )
    app.state.tenancy = tenancy
    app.state.settings = settings
    install_error_handlers(app)
    register_admin_routes(app, settings.admin_token_value())
    register_admin_health(app)
    add_docs_routes(app)
    _install_middleware(app, settings, tenancy, hooks, ADMIN_REQUEST_PREFIX, engine=False)
    return app
