"""What a route handler gets from its app: the tenancy both listeners share, and the service
(the namespace's space) a call runs in.

``create_app`` and ``create_admin_app`` put the ``Tenancy`` in ``app.state.tenancy``. Engine
handlers take their service with ``service_of(request)``: the space of the call's namespace,
resolved from its credentials before anything else (``app.http.auth``).
Admin handlers name a namespace with the ``namespace`` query parameter (``ServiceDep``); a
service without tenants has one, ``default``, taken when none is named.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Query, Request

from app.core.service import Service
from app.core.tenancy import Tenancy
from app.core.tenancy_reloads import Space
from app.http.auth import SPACE_KEY
from app.http.errors import APIError


def tenancy_of(request: Request) -> Tenancy:
    """The tenancy of the app serving ``request``."""
    tenancy: Tenancy = request.app.state.tenancy
    return tenancy


def space_of(request: Request) -> Space:
    """The space an engine call runs in, as ``app.http.auth.SpaceMiddleware`` resolved it."""
    space: Space = request.scope[SPACE_KEY]
    return space


def service_of(request: Request) -> Service:
    """The service an engine call runs in (``space_of``)."""
    return space_of(request).service


def admin_service(
    request: Request,
    namespace: Annotated[
        str | None,
        Query(
            min_length=1,
            max_length=63,
            description="the namespace to act on; required when the service has tenants",
        ),
    ] = None,
) -> Service:
    """The service an admin call acts on: the namespace it names (404 if none such), or the
    only one (422 when the service has tenants and the call names none)."""
    tenancy: Tenancy = request.app.state.tenancy
    if namespace is None:
        if tenancy.single is not None:
            return tenancy.single
        names = ", ".join(sorted(tenancy.spaces)[:10])
        raise APIError(
            422,
            "invalid_field",
            f"query: namespace: required, this service has tenants (namespaces: {names})",
        )
    space = tenancy.spaces.get(namespace)
    if space is None:
        raise APIError(404, "unknown_namespace", f"no namespace {namespace!r}")
    return space.service


ServiceDep = Annotated[Service, Depends(admin_service)]
