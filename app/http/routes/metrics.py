"""``GET /metrics`` on the public listener: the service's registry for Prometheus.

Content negotiation follows prometheus_client (``choose_encoder``): OpenMetrics 1.0 when the
``Accept`` header asks for ``application/openmetrics-text`` (what Prometheus sends when it
stores exemplars; only this format carries them), the classic text format otherwise. The route
answers on ``/metrics`` itself (no redirect to ``/metrics/``, unlike a mounted ASGI app). The
registry is read on the event loop, so the state collector sees the manager between two calls.

Who may read it. With a scrape token (``--metrics-token-file``, or ``KVOFFLOAD_METRICS_TOKEN``)
every scrape needs ``Authorization: Bearer <token>`` (what Prometheus's scrape
``authorization`` setting sends): 401 without it, 403 with another (constant-time comparison).
Without one, ``/metrics`` is open; and with tenants it then carries no request id: no
exemplars (an exemplar names the engine request, ``req_id``, of whichever tenant made the last
observation) and no series labelled ``req_id`` (the opt-in live-request table,
``--metrics-live-requests``), so an open endpoint tells no tenant another's request ids. Names
and counts stay (restrict them by network, or give the endpoint a token).
"""

from __future__ import annotations

import hmac
from collections.abc import Iterator

from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import Metric

from app.http.errors import APIError

_TEXT_SCHEMA = {"type": "string"}


class WithoutRequestIds:
    """``registry``'s metrics without a request id: every sample's exemplar left out, and every
    sample labelled ``req_id`` (a collector-like view the encoders read as they read a
    registry)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def collect(self) -> Iterator[Metric]:
        """Every family of ``registry``, its samples without exemplars or ``req_id`` labels."""
        for family in self.registry.collect():
            family.samples = [
                s if s.exemplar is None else s._replace(exemplar=None)
                for s in family.samples
                if "req_id" not in s.labels
            ]
            yield family


def register_metrics_route(
    app: FastAPI,
    registry: CollectorRegistry,
    *,
    token: str | None = None,
    request_ids: bool = True,
) -> None:
    """Add ``GET /metrics`` serving ``registry``; with ``token``, only to callers bearing it
    (401 / 403); without ``request_ids``, every exemplar and every ``req_id``-labelled series
    left out (module docstring)."""
    expected = None if token is None else token.encode()
    source: CollectorRegistry | WithoutRequestIds = (
        registry if request_ids else WithoutRequestIds(registry)
    )

    async def metrics(request: Request) -> Response:
        if expected is not None:
            values = request.headers.getlist("authorization")
            if len(values) > 1:
                raise APIError(400, "ambiguous_credentials", "more than one Authorization header")
            scheme, _, presented = (values[0] if values else "").partition(" ")
            if scheme.lower() != "bearer" or not presented:
                raise APIError(
                    401, "unauthorized", "scrape token required", {"WWW-Authenticate": "Bearer"}
                )
            if not hmac.compare_digest(presented.encode(), expected):
                raise APIError(403, "forbidden", "wrong scrape token")
        encode, content_type = choose_encoder(request.headers.get("accept", ""))
        return Response(encode(source), headers={"content-type": content_type})

    app.add_api_route(
        "/metrics",
        metrics,
        methods=["GET"],
        name="metrics",
        operation_id="metrics",
        summary="Prometheus metrics (OpenMetrics with exemplars when Accept asks for it)",
        description=(
            "Classic Prometheus text format by default; OpenMetrics 1.0 (with `req_id` "
            "exemplars) when `Accept` names `application/openmetrics-text`. With a scrape "
            "token (`--metrics-token-file`) it needs `Authorization: Bearer <token>`; a "
            "service with tenants and no scrape token serves no request id (no exemplars, no "
            "`req_id` label)."
        ),
        tags=["health"],
        response_class=Response,
        responses={
            200: {
                "description": "The metrics",
                "content": {
                    "text/plain": {"schema": _TEXT_SCHEMA},
                    "application/openmetrics-text": {"schema": _TEXT_SCHEMA},
                },
            },
            401: {"description": "No scrape token (only when the service has one)"},
            403: {"description": "Another scrape token"},
        },
    )
