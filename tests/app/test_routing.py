"""``app.http.routing``: the route a call selects, in the router's own order, for the call's
template (metrics, logs) and for its body cap alike."""

from __future__ import annotations

import re

from fastapi import FastAPI
from starlette.routing import Match, Route

from app.http.routing import RouteEntry, RouteMatcher


def app() -> FastAPI:
    api = FastAPI()

    @api.get("/x/{name}")
    def by_name(name: str) -> dict[str, str]:
        return {"route": "/x/{name}"}

    @api.get("/x/fixed")
    def fixed() -> dict[str, str]:
        return {"route": "/x/fixed"}

    @api.get("/y/static")
    def static() -> dict[str, str]:
        return {"route": "/y/static"}

    return api


def routers_choice(api: FastAPI, path: str) -> str:
    """The template of the route Starlette's router picks for ``GET path``: the first that
    matches fully, in order."""
    scope = {"type": "http", "path": path, "method": "GET", "root_path": ""}
    for route in api.routes:
        if isinstance(route, Route) and route.matches(scope)[0] is Match.FULL:
            return route.path
    raise AssertionError(f"no route for {path}")


def test_templates_follow_the_routers_order() -> None:
    api = app()
    matcher = RouteMatcher.of_routes(api.routes)
    for path in ("/x/fixed", "/x/other", "/y/static"):
        entry = matcher.match("GET", path)
        assert entry is not None
        assert entry.value == routers_choice(api, path), path
    assert matcher.match("GET", "/x/fixed").value == "/x/{name}"  # type: ignore[union-attr]
    assert matcher.match("GET", "/nowhere") is None
    assert matcher.match(None, "/y/static") is not None


def test_methods_select_among_routes_of_one_path() -> None:
    def entry(order: int, methods: set[str], path: str, value: str) -> RouteEntry[str]:
        regex = re.compile("^" + re.sub(r"\{\w+\}", "[^/]+", path) + "$")
        return RouteEntry(order, frozenset(methods), path, regex, value)

    matcher = RouteMatcher(
        [
            entry(0, {"PUT"}, "/r/{id}", "put-any"),
            entry(1, {"POST"}, "/r/one", "post-one"),
            entry(2, {"POST", "PUT"}, "/r/{id}", "later"),
        ]
    )
    found = {m: matcher.match(m, "/r/one") for m in ("PUT", "POST", "DELETE")}
    assert {m: e.value if e else None for m, e in found.items()} == {
        "PUT": "put-any",
        "POST": "post-one",
        "DELETE": None,
    }
    post_two = matcher.match("POST", "/r/two")
    assert post_two is not None
    assert post_two.value == "later"
