"""Cache control with tenants: retentions and prefetches belong to the caller's namespace.

Two tenants: ``alpha`` owns ``a1`` (16 blocks, at most 2 retained, from the tenants file) and
``beta`` owns ``b1`` (the service's 32 blocks, half of them retainable). The same retention
names and block hashes are used in both, so a leak would show.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.core.tenancy import Tenancy
from app.core.tenants import Credentials
from app.http.apps import create_admin_app, create_app
from tests.api.harness import TOKEN, hexkeys, make_settings

pytestmark = pytest.mark.anyio

ALPHA = "alpha-token-0000000000000001"
BETA = "beta-token-00000000000000001"

TENANTS = f"""
[tenants.alpha]
tokens = ["{ALPHA}"]
namespaces = {{ a1 = {{ blocks = 16, max_retained_blocks = 2 }} }}

[tenants.beta]
tokens = ["{BETA}"]
namespaces = ["b1"]
"""


def write_tenants(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)


@dataclass
class Tenants:
    tenancy: Tenancy
    engine: httpx.AsyncClient
    admin: httpx.AsyncClient
    path: Path

    async def call(self, token: str, method: str, path: str, body: Any = None) -> httpx.Response:
        headers = {"Authorization": f"Bearer {token}"}
        return await self.engine.request(method, path, json=body, headers=headers)

    async def store(self, token: str, req: str, keys: list[str]) -> None:
        r = await self.call(token, "PUT", f"/v1/requests/{req}", {})
        assert r.status_code in (200, 201), r.text
        r = await self.call(token, "POST", f"/v1/requests/{req}/prepare-store", {"keys": keys})
        assert r.status_code == 200, r.text
        r = await self.call(token, "POST", f"/v1/requests/{req}/complete-store", {"keys": keys})
        assert r.status_code == 200, r.text

    async def retain(
        self, token: str, name: str, keys: list[str], ttl_s: float = 30.0
    ) -> httpx.Response:
        body = {"keys": keys, "ttl_s": ttl_s, "name": name}
        return await self.call(token, "POST", "/v1/requests/r/retain", body)

    async def names(self, token: str) -> list[str]:
        r = await self.call(token, "GET", "/v1/retentions")
        assert r.status_code == 200, r.text
        return [x["name"] for x in r.json()["retentions"]]


@contextlib.asynccontextmanager
async def tenants_running(tmp_path: Path, text: str = TENANTS) -> AsyncIterator[Tenants]:
    path = tmp_path / "tenants.toml"
    write_tenants(path, text)
    settings = make_settings()
    tenancy = Tenancy(settings, credentials=Credentials(path))
    app = create_app(settings, tenancy=tenancy)
    admin_app = create_admin_app(settings, tenancy=tenancy)
    async with (
        app.router.lifespan_context(app),
        admin_app.router.lifespan_context(admin_app),
        httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://e") as engine,
        httpx.AsyncClient(
            transport=httpx.ASGITransport(admin_app),
            base_url="http://a",
            headers={"Authorization": f"Bearer {TOKEN}"},
        ) as admin,
    ):
        yield Tenants(tenancy, engine, admin, path)


def error(r: httpx.Response) -> tuple[int, str]:
    return r.status_code, r.json()["error"]["code"]


async def test_each_tenant_sees_and_ends_only_its_own_retentions(tmp_path: Path) -> None:
    async with tenants_running(tmp_path) as t:
        keys = hexkeys(1, 2)
        await t.store(ALPHA, "w", keys)
        await t.store(BETA, "w", keys)
        assert (await t.retain(ALPHA, "shared", keys[:1])).status_code == 201
        assert (await t.retain(BETA, "shared", keys)).status_code == 201  # its own, not 200
        assert (await t.retain(BETA, "beta-only", keys[1:])).status_code == 201

        assert await t.names(ALPHA) == ["shared"]
        assert await t.names(BETA) == ["shared", "beta-only"]
        r = await t.call(ALPHA, "GET", "/v1/retentions/shared")
        assert r.json()["keys"] == 1
        r = await t.call(BETA, "GET", "/v1/retentions/shared")
        assert r.json()["keys"] == 2

        # Alpha cannot reach beta's retention by its name.
        r = await t.call(ALPHA, "GET", "/v1/retentions/beta-only")
        assert error(r) == (404, "unknown_retention")
        r = await t.call(ALPHA, "POST", "/v1/retentions/beta-only/renew", {"ttl_s": 1})
        assert error(r) == (404, "unknown_retention")
        r = await t.call(ALPHA, "DELETE", "/v1/retentions/beta-only")
        assert error(r) == (404, "unknown_retention")
        # Releasing its own "shared" leaves beta's "shared".
        assert (await t.call(ALPHA, "DELETE", "/v1/retentions/shared")).status_code == 200
        assert await t.names(ALPHA) == []
        assert await t.names(BETA) == ["shared", "beta-only"]
        r = await t.call(BETA, "GET", "/v1/retentions/beta-only")
        assert r.status_code == 200, r.text
        assert r.json()["ttl_s"] == 30  # not renewed by alpha

        # The admin API names the namespace.
        r = await t.admin.get("/admin/v1/retentions", params={"namespace": "b1"})
        assert r.status_code == 200, r.text
        assert [x["name"] for x in r.json()["retentions"]] == ["shared", "beta-only"]
        r = await t.admin.get("/admin/v1/retentions", params={"namespace": "a1"})
        assert r.json()["retentions"] == []
        r = await t.admin.delete("/admin/v1/retentions/beta-only", params={"namespace": "a1"})
        assert error(r) == (404, "unknown_retention")
        r = await t.admin.delete("/admin/v1/retentions/beta-only", params={"namespace": "b1"})
        assert r.status_code == 200, r.text
        assert await t.names(BETA) == ["shared"]


async def test_a_tenant_cannot_see_or_cancel_another_tenants_prefetch(tmp_path: Path) -> None:
    async with tenants_running(tmp_path) as t:
        keys = hexkeys(1, 2)
        await t.store(ALPHA, "w", keys)
        r = await t.call(ALPHA, "POST", "/v1/requests/r/prefetch", {"keys": keys, "deadline_s": 30})
        assert r.status_code == 202, r.text
        pid = r.json()["prefetch_id"]
        assert error(await t.call(BETA, "GET", f"/v1/prefetches/{pid}")) == (
            404,
            "unknown_prefetch",
        )
        r = await t.call(BETA, "DELETE", f"/v1/prefetches/{pid}")
        assert error(r) == (404, "unknown_prefetch")
        r = await t.call(ALPHA, "GET", f"/v1/prefetches/{pid}")
        assert r.status_code == 200, r.text
        assert r.json()["state"] == "held"
        # Beta's keys of the same hashes are beta's own: a miss there, nothing held.
        r = await t.call(BETA, "POST", "/v1/requests/r/prefetch", {"keys": keys, "deadline_s": 30})
        assert r.status_code == 202, r.text
        assert (r.json()["results"], r.json()["state"]) == (["miss", "miss"], "done")


async def test_a_namespace_max_retained_blocks_bounds_that_namespace(tmp_path: Path) -> None:
    async with tenants_running(tmp_path) as t:
        keys = hexkeys(1, 2, 3)
        await t.store(ALPHA, "w", keys)
        await t.store(BETA, "w", keys)
        assert (await t.retain(ALPHA, "s", keys[:2])).status_code == 201
        r = await t.retain(ALPHA, "s", keys)
        assert error(r) == (429, "quota_exceeded"), r.text
        assert r.json()["error"]["quota"] == "retained_blocks"
        r = await t.call(ALPHA, "GET", "/v1/retentions")
        assert (r.json()["retained_blocks"], r.json()["max_retained_blocks"]) == (2, 2)
        assert r.json()["retentions"][0]["keys"] == 2
        # Beta keeps the default (half of its 32 blocks).
        assert (await t.retain(BETA, "s", keys)).status_code == 201
        r = await t.call(BETA, "GET", "/v1/retentions")
        assert (r.json()["retained_blocks"], r.json()["max_retained_blocks"]) == (3, 16)

        # A reload of the tenants file applies a new bound live.
        write_tenants(t.path, TENANTS.replace("max_retained_blocks = 2", "max_retained_blocks = 3"))
        assert await t.tenancy.reload()
        assert (await t.retain(ALPHA, "s", keys)).status_code == 200
        r = await t.call(ALPHA, "GET", "/v1/retentions")
        assert (r.json()["retained_blocks"], r.json()["max_retained_blocks"]) == (3, 3)
