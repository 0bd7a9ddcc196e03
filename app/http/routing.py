"""Which of an app's routes a call belongs to, as the router picks it, for the middleware that
runs before routing (the call's route template for metrics and logs; its body cap).

``RouteMatcher`` holds one entry per route: its place in the app's route order, the methods it
answers (None: any), its path and path regex, and a value. ``match(method, path)`` is the first
entry in route order whose methods and regex accept the call, as Starlette's router tries them:
a static path is one dict look-up, and only the templated routes before it in order are tried
by regex (a templated path alone: every templated route in order).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Generic, TypeVar

from starlette.routing import BaseRoute, Route

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class RouteEntry(Generic[T]):
    """One route: ``order`` its place among the app's routes, ``methods`` those it answers
    (None: any), ``path`` and ``regex`` as the router matches them, and the ``value`` kept."""

    order: int
    methods: frozenset[str] | None
    path: str
    regex: re.Pattern[str]
    value: T

    def accepts(self, method: str | None) -> bool:
        """Whether a call of ``method`` (None: any) may belong here."""
        return self.methods is None or method is None or method in self.methods


class RouteMatcher(Generic[T]):
    """The entry a call selects; see the module docstring."""

    def __init__(self, entries: Iterable[RouteEntry[T]]) -> None:
        self._static: dict[str, list[RouteEntry[T]]] = {}
        self._patterns: list[RouteEntry[T]] = []
        for entry in sorted(entries, key=lambda e: e.order):
            if "{" in entry.path:  # a path parameter: matched by its regex
                self._patterns.append(entry)
            else:
                self._static.setdefault(entry.path, []).append(entry)

    @classmethod
    def of_routes(cls, routes: Iterable[BaseRoute]) -> RouteMatcher[str]:
        """Every HTTP route of an app, any method, its template as the value."""
        return RouteMatcher(
            RouteEntry(order, None, route.path, route.path_regex, route.path)
            for order, route in enumerate(routes)
            if isinstance(route, Route)
        )

    def match(self, method: str | None, path: str) -> RouteEntry[T] | None:
        """The first entry in route order that takes a call of ``method`` to ``path``."""
        static = next((e for e in self._static.get(path, ()) if e.accepts(method)), None)
        for candidate in self._patterns:
            if static is not None and candidate.order > static.order:
                break
            if candidate.accepts(method) and candidate.regex.match(path):
                return candidate
        return static
