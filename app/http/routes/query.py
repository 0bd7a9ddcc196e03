"""Query strings are strict too: a route accepts only the query parameters it declares.

``strict_query`` is an app-wide dependency for ordinary routes (it reads the declared names off
the matched route); ``RawRoute`` handlers, which declare none, call ``refuse_query``.
"""

from __future__ import annotations

from fastapi import Request
from fastapi.dependencies.models import Dependant
from fastapi.routing import APIRoute

from app.http.errors import APIError

_NAMES = "_kvoffload_query_names"


def unknown_query(names: list[str]) -> APIError:
    """422 naming the query parameters the route does not take."""
    shown = ", ".join(sorted(names)[:5])
    return APIError(422, "invalid_field", f"query: unknown parameter(s): {shown}")


def _query_names(route: APIRoute) -> frozenset[str]:
    """The query parameters ``route`` takes, its dependencies' included (worked out once)."""
    names: frozenset[str] | None = route.__dict__.get(_NAMES)
    if names is None:
        names = frozenset(_declared(route.dependant))
        route.__dict__[_NAMES] = names
    return names


def _declared(dependant: Dependant) -> set[str]:
    names = {p.alias for p in dependant.query_params}
    for sub in dependant.dependencies:
        names |= _declared(sub)
    return names


async def strict_query(request: Request) -> None:
    """Refuse (422) query parameters the matched route does not declare."""
    if not request.scope.get("query_string"):
        return
    route = request.scope.get("route")
    allowed = _query_names(route) if isinstance(route, APIRoute) else frozenset()
    unknown = [name for name in request.query_params if name not in allowed]
    if unknown:
        raise unknown_query(unknown)


def refuse_query(request: Request) -> None:
    """Refuse (422) any query parameter (routes that declare none)."""
    if request.scope.get("query_string"):
        raise unknown_query(list(request.query_params) or ["?"])
