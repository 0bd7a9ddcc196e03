"""Liveness and readiness.

``/livez`` answers 200 while the process serves HTTP at all. ``/readyz`` answers 503 while the
service is starting, draining for a shutdown, or when the oldest transfer in flight has run past
its deadline (a stuck copy: stop sending work here); 200 otherwise. It needs no credentials.
Without tenants it says why not (``reason``) and, ready, what still deserves a look
(``details``: a degraded tier; the node serves from its pool and its other tiers, so it stays
ready): the engine listener is on loopback then (``Settings`` refuses anything else), and
whoever reaches it may use the whole service anyway. With tenants it speaks for every namespace
and names none: ``status`` alone, and a ``reason`` naming no namespace, tenant, tier endpoint or
bucket (a tier's error quotes them); the full answer (``answer(tenancy, full=True)``) is the
admin API's ``GET /admin/v1/readiness``.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from app.core.tenancy import Tenancy
from app.http import schemas as s
from app.http.deps import tenancy_of

JSON = "application/json"
_LIVE = json.dumps({"status": "ok"}).encode()
#: ``/readyz``'s reason with tenants when a namespace is not ready (draining aside).
NOT_READY = "a namespace is not ready (the admin API's GET /admin/v1/readiness says which and why)"
SHUTTING_DOWN = "shutting down"


async def livez() -> Response:
    return Response(_LIVE, media_type=JSON)


def answer(tenancy: Tenancy, *, full: bool) -> tuple[int, dict[str, Any]]:
    """The readiness answer (status code, body) of ``tenancy``: ``full``, or with tenants
    without a name in it (module docstring)."""
    reason = tenancy.readiness()
    named = full or not tenancy.enabled
    body: dict[str, Any] = {"status": "ready" if reason is None else "not_ready"}
    if reason is not None:
        if named:
            body["reason"] = reason
        elif any(space.service.draining for space in list(tenancy.spaces.values())):
            body["reason"] = SHUTTING_DOWN
        else:
            body["reason"] = NOT_READY
    if named and (reason is None or full):
        details = tenancy.details()
        if details:
            body["details"] = details
    return (200 if reason is None else 503), body


async def readyz(request: Request) -> Response:
    status, body = answer(tenancy_of(request), full=False)
    return Response(json.dumps(body), status, media_type=JSON)


def register_health_routes(app: FastAPI) -> None:
    """Add ``/livez`` and ``/readyz``."""
    app.add_api_route(
        "/livez",
        livez,
        methods=["GET"],
        name="livez",
        operation_id="livez",
        summary="Liveness",
        tags=["health"],
        response_model=s.HealthAnswer,
    )
    app.add_api_route(
        "/readyz",
        readyz,
        methods=["GET"],
        name="readyz",
        operation_id="readyz",
        summary="Readiness: 503 while starting, draining, or a transfer is stuck",
        tags=["health"],
        response_model=s.HealthAnswer,
        responses={503: {"model": s.HealthAnswer, "description": "Not ready (see reason)"}},
    )
