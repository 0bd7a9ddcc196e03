"""What a route handler gets from its app: the service both listeners share.

``create_app`` and ``create_admin_app`` put the ``Service`` in ``app.state.service``; handlers
are module-level functions that take it from there (``service_of``), or as a FastAPI dependency
(``ServiceDep``) where a route already resolves dependencies.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from app.core.service import Service


def service_of(request: Request) -> Service:
    """The service of the app serving ``request``."""
    service: Service = request.app.state.service
    return service


ServiceDep = Annotated[Service, Depends(service_of)]
