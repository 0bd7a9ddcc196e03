"""Query strings are strict too: a route accepts only the query parameters it declares.

``strict_query`` is an app-wide dependency for ordinary routes (it reads the declared names off
the matched route); ``RawRoute`` handlers, which declare none, call ``refuse_query``.
"""

from __future__ import annotations

from fastapi import Request
from fastapi.routing import APIRoute

from app.http.errors import APIError


def unknown_query(names: list[str]) -> APIError:
    """422 naming the query parameters the route does not take."""
    shown = ", ".join(sorted(names)[:5])
    return APIError(422, "invalid_field", f"query: unknown parameter(s): {shown}")


async def strict_query(request: Request) -> None:
    """Refuse (422) query parameters the matched route does not declare."""
    if not request.scope.get("query_string"):
        return
    route = request.scope.get("route")
    allowed = (
        {p.alias for p in route.dependant.query_params} if isinstance(route, APIRoute) else set()
    )
    unknown = [name for name in request.query_params if name not in allowed]
    if unknown:
        raise unknown_query(unknown)


def refuse_query(request: Request) -> None:
    """Refuse (422) any query parameter (routes that declare none)."""
    if request.scope.get("query_string"):
        raise unknown_query(list(request.query_params) or ["?"])
