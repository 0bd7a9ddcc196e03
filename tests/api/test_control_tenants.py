"""Cache control with tenants: retentions and prefetches belong to the caller's namespace.

Two tenants: ``alpha`` owns ``a1`` (16 blocks, at most 2 retained, from the tenants file) and
``beta`` owns ``b1`` (the service's 32 blocks, half of them retainable). The same retention
names and block hashes are used in both, so a leak would show.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from tests.api.test_tenancy import Tenants, tenants_running, write_tenants
from testsupport.api_harness import hexkeys

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


class Control:
    """The test's calls, as one tenant or the other (``Tenants`` of the tenancy tests)."""

    def __init__(self, t: Tenants) -> None:
        self.t = t
        self.tenancy, self.admin, self.path = t.tenancy, t.admin, t.path

    async def call(self, token: str, method: str, path: str, body: object = None) -> httpx.Response:
        return await self.t.call(token, method, path, body)

    async def store(self, token: str, req: str, keys: list[str]) -> None:
        await self.t.store(token, None, req, keys)

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
async def control_tenants(tmp_path: Path) -> AsyncIterator[Control]:
    async with tenants_running(tmp_path, TENANTS) as t:
        yield Control(t)


def error(r: httpx.Response) -> tuple[int, str]:
    return r.status_code, r.json()["error"]["code"]


async def test_each_tenant_sees_and_ends_only_its_own_retentions(tmp_path: Path) -> None:
    async with control_tenants(tmp_path) as t:
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
    async with control_tenants(tmp_path) as t:
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
    async with control_tenants(tmp_path) as t:
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
