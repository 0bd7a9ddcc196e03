"""Which namespace refusal the engine and admin APIs answer, and when (docs/security.md;
docs/api.md, "Credentials and namespaces"): ``namespace_denied`` to a caller known by its token
(the same answer whether the namespace is another tenant's or nobody's), ``unknown_namespace``
only where the caller may reach every namespace anyway (a Unix socket trusted by its file mode,
a service without tenants) and from the admin API (404), ``namespace_required`` when the call
must name one and did not."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from starlette.types import ASGIApp, Receive, Scope, Send

from app.core.tenancy import Tenancy
from app.core.tenants import Credentials
from app.http.apps import create_app
from tests.api.test_tenancy import ALPHA, BETA, NS, TENANTS, tenants_running, write_tenants
from testsupport.api_harness import make_settings, running

pytestmark = pytest.mark.anyio


class UnixSocketPeer:
    """The app as uvicorn serves it on a Unix socket: the scope names no client address."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.app({**scope, "client": None}, receive, send)


def code_of(r: httpx.Response) -> tuple[int, str]:
    """(status, error code) of a refusal."""
    code: str = r.json()["error"]["code"]
    return r.status_code, code


@contextlib.asynccontextmanager
async def on_a_file_mode_socket(
    tmp_path: Path,
) -> AsyncIterator[tuple[httpx.AsyncClient, httpx.AsyncClient]]:
    """Two clients of the engine API of a service with tenants and ``--uds-auth file-mode``:
    a caller on its Unix socket (no token: the socket's file mode is the credential), and one
    over TCP (which still needs a token)."""
    path = tmp_path / "tenants.toml"
    write_tenants(path, TENANTS)
    settings = make_settings(uds_auth="file-mode")
    tenancy = Tenancy(settings, credentials=Credentials(path))
    app = create_app(settings, tenancy=tenancy)
    on_socket = httpx.ASGITransport(UnixSocketPeer(app))
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=on_socket, base_url="http://uds") as uds,
        httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://tcp") as tcp,
    ):
        yield uds, tcp


async def test_a_caller_with_a_token_gets_namespace_denied_for_another_s_and_for_nobody_s(
    tmp_path: Path,
) -> None:
    async with tenants_running(tmp_path) as t:
        for namespace in ("a1", "nobody"):
            r = await t.call(BETA, "PUT", "/v1/requests/r", {}, namespace)
            assert code_of(r) == (403, "namespace_denied"), namespace
        r = await t.call(ALPHA, "PUT", "/v1/requests/r", {})  # alpha has two: name one
        assert code_of(r) == (403, "namespace_required")


async def test_a_file_mode_socket_caller_gets_unknown_namespace_for_one_the_service_lacks(
    tmp_path: Path,
) -> None:
    async with on_a_file_mode_socket(tmp_path) as (uds, tcp):
        r = await uds.put("/v1/requests/r", headers={NS: "nobody"})
        assert code_of(r) == (403, "unknown_namespace")
        r = await uds.put("/v1/requests/r")  # three namespaces here: name one
        assert code_of(r) == (403, "namespace_required")
        r = await uds.put("/v1/requests/r", headers={NS: "a1"})  # any of them, no token
        assert r.status_code == 201, r.text
        # Over TCP the same service wants a token, and then hides which namespaces exist.
        beta = {"Authorization": f"Bearer {BETA}", NS: "nobody"}
        assert code_of(await tcp.put("/v1/requests/r", headers=beta)) == (403, "namespace_denied")


async def test_a_service_without_tenants_answers_unknown_namespace_for_all_but_default() -> None:
    async with running(make_settings()) as h:
        r = await h.client.put("/v1/requests/r", headers={NS: "a1"})
        assert code_of(r) == (403, "unknown_namespace")
        r = await h.client.put("/v1/requests/r", headers={NS: "default"})
        assert r.status_code == 201, r.text


async def test_the_admin_api_answers_404_unknown_namespace(tmp_path: Path) -> None:
    async with tenants_running(tmp_path) as t:
        r = await t.admin.get("/admin/v1/stats", params={"namespace": "nobody"})
        assert code_of(r) == (404, "unknown_namespace")
        assert (await t.admin.get("/admin/v1/stats", params={"namespace": "a1"})).is_success
    async with running(make_settings()) as h:
        r = await h.admin.get("/admin/v1/stats", params={"namespace": "a1"})
        assert code_of(r) == (404, "unknown_namespace")
