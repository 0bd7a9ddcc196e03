"""``GET /metrics`` on the public listener: the service's registry for Prometheus.

Content negotiation follows prometheus_client (``choose_encoder``): OpenMetrics 1.0 when the
``Accept`` header asks for ``application/openmetrics-text`` (what Prometheus sends when it
stores exemplars; only this format carries them), the classic text format otherwise. The route
answers on ``/metrics`` itself (no redirect to ``/metrics/``, unlike a mounted ASGI app). The
registry is read on the event loop, so the state collector sees the manager between two calls.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

_TEXT_SCHEMA = {"type": "string"}


def register_metrics_route(app: FastAPI, registry: CollectorRegistry) -> None:
    """Add ``GET /metrics`` serving ``registry``."""

    async def metrics(request: Request) -> Response:
        encode, content_type = choose_encoder(request.headers.get("accept", ""))
        return Response(encode(registry), headers={"content-type": content_type})

    app.add_api_route(
        "/metrics",
        metrics,
        methods=["GET"],
        name="metrics",
        operation_id="metrics",
        summary="Prometheus metrics (OpenMetrics with exemplars when Accept asks for it)",
        description=(
            "Classic Prometheus text format by default; OpenMetrics 1.0 (with `req_id` "
            "exemplars) when `Accept` names `application/openmetrics-text`."
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
            }
        },
    )
