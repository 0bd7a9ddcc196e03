"""Who is calling the engine API, and which namespace the call runs in: decided first.

``SpaceMiddleware`` (pure ASGI, inside ``CallContextMiddleware`` and outside everything else)
resolves every engine call's space (``app.core.tenancy.Tenancy.resolve``) from its
``Authorization`` and ``X-KVOffload-Namespace`` headers before any other check reads the call:
a call with two of either is refused (400 ``ambiguous_credentials``: which one counts would
depend on who reads the headers, the service or a proxy in front of it), and
a caller without good credentials gets 401 (or 403 for a namespace that is not its own) whatever
its path, query or body, and so learns nothing from validation. The space goes in the scope
(``SPACE_KEY``) for ``app.http.deps.service_of``; with tenants the call's ``CallInfo`` gets the
tenant and namespace (log line, metrics, pool header). Open paths (health, metrics, the API
documents) skip it: they say nothing about any namespace.
"""

from __future__ import annotations

from kvoffload_client.client import NAMESPACE_HEADER
from starlette.types import ASGIApp, Receive, Scope, Send

from app.core.errors import AuthenticationError, PermissionDeniedError
from app.core.service import DEFAULT_NAMESPACE
from app.core.tenancy import Tenancy
from app.core.tenancy_reloads import Space
from app.http.errors import APIError, error_for
from app.http.middleware import call_info, refuse

SPACE_KEY = "kvoffload.space"
OPEN_PATHS = frozenset({"/livez", "/readyz", "/metrics", "/openapi.json", "/docs"})
_DOCS_PREFIX = "/docs/"
_AUTHORIZATION = b"authorization"
_NAMESPACE = NAMESPACE_HEADER.lower().encode()


def ambiguous(header: str) -> APIError:
    """400 ``ambiguous_credentials``: the call carries ``header`` more than once."""
    return APIError(
        400, "ambiguous_credentials", f"more than one {header} header; accepted: one at most"
    )


def resolve_scope(tenancy: Tenancy, scope: Scope) -> Space:
    """The space of the call ``scope`` (``Tenancy.resolve`` on its headers); the Unix socket
    is trusted by its file mode when ``--uds-auth file-mode`` says so. ``APIError`` 400
    (``ambiguous``) when either header comes twice, whatever the values."""
    authorization: str | None = None
    namespace: str | None = None
    for name, value in scope["headers"]:
        if name == _NAMESPACE:
            if namespace is not None:
                raise ambiguous(NAMESPACE_HEADER)
            namespace = value.decode("latin-1")
        elif name == _AUTHORIZATION:
            if authorization is not None:
                raise ambiguous("Authorization")
            authorization = value.decode("latin-1")
    if tenancy.single is not None and namespace is None:  # no tenants: the common case
        return tenancy.spaces[DEFAULT_NAMESPACE]
    trusted = scope.get("client") is None and tenancy.settings.uds_auth == "file-mode"
    return tenancy.resolve(authorization, namespace, trusted=trusted)


class SpaceMiddleware:
    """Resolve each engine call's space before the app sees it; see the module docstring."""

    def __init__(self, app: ASGIApp, tenancy: Tenancy) -> None:
        self.app = app
        self.tenancy = tenancy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        if path in OPEN_PATHS or path.startswith(_DOCS_PREFIX):
            await self.app(scope, receive, send)
            return
        try:
            space = resolve_scope(self.tenancy, scope)
        except (APIError, AuthenticationError, PermissionDeniedError) as exc:
            err = error_for(exc)
            await refuse(send, err.status, err.code, err.message, err.headers)
            return
        scope[SPACE_KEY] = space
        if space.tenant is not None:
            info = call_info(scope)
            if info is not None:
                info.tenant = space.tenant
                info.namespace = space.namespace
        await self.app(scope, receive, send)
