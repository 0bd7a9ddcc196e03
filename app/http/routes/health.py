"""Liveness and readiness.

``/livez`` answers 200 while the process serves HTTP at all. ``/readyz`` answers 503 while the
service is starting, draining for a shutdown, or when the oldest transfer in flight has run past
its deadline (a stuck copy: stop sending work here); 200 otherwise. With tenants, it speaks for
every namespace (the first one not ready is named) and needs no credentials: it says nothing
but ready or not. A ready answer may carry ``details``: what still deserves a look (a degraded
remote tier: the node serves from its pool alone, so it stays ready).
"""

from __future__ import annotations

import json

from fastapi import FastAPI, Request
from fastapi.responses import Response

from app.http import schemas as s
from app.http.deps import tenancy_of

JSON = "application/json"
_LIVE = json.dumps({"status": "ok"}).encode()


async def livez() -> Response:
    return Response(_LIVE, media_type=JSON)


async def readyz(request: Request) -> Response:
    tenancy = tenancy_of(request)
    reason = tenancy.readiness()
    if reason is None:
        details = tenancy.details()
        ready: dict[str, object] = {"status": "ready"}
        if details:
            ready["details"] = details
        return Response(json.dumps(ready), media_type=JSON)
    body = json.dumps({"status": "not_ready", "reason": reason})
    return Response(body, 503, media_type=JSON)


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
