"""Application factory.

``create_app(manager)`` builds the FastAPI application around one offload manager. This is the
foundation's minimal service (liveness, readiness, lookup); the full engine and admin API is built
on top of the same factory.
"""

from __future__ import annotations

from fastapi import FastAPI

from manager import OffloadManager, create_manager


def create_app(manager: OffloadManager | None = None) -> FastAPI:
    """Return an app serving ``manager`` (a fresh 4096-block LRU manager when omitted)."""
    mgr = manager if manager is not None else create_manager(num_blocks=4096)
    app = FastAPI(title="kvoffload")
    app.state.manager = mgr

    @app.get("/livez")
    async def livez() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz() -> dict[str, object]:
        stats = mgr.stats()
        return {"status": "ready", "num_blocks": stats.num_blocks, "free": stats.free}

    return app
