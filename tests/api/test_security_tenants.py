"""Issue #21: what an attacker holding one tenant's token tries against another tenant.

Two tenants (``tests.api.test_tenancy``'s ``alpha`` and ``beta``), in process. Each test is one
row of the README's attack table: the attempt, what it answers, and that nothing leaked.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.api.harness import hexkeys
from tests.api.test_tenancy import ALPHA, BETA, NS, tenants_running

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize(
    "headers",
    [
        [("Authorization", f"Bearer {BETA}"), ("Authorization", f"Bearer {ALPHA}")],
        [("Authorization", f"Bearer {ALPHA}"), ("Authorization", f"Bearer {ALPHA}")],
        [("Authorization", f"Bearer {ALPHA}"), (NS, "a1"), (NS, "a2")],
        [("Authorization", f"Bearer {BETA}"), (NS, "b1"), (NS, "a1")],
    ],
)
async def test_two_credential_headers_are_refused_whatever_their_values(
    tmp_path: Path, headers: list[tuple[str, str]]
) -> None:
    async with tenants_running(tmp_path) as t:
        r = await t.engine.put("/v1/requests/r1", json={}, headers=headers)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] == "ambiguous_credentials"
        assert "x-kvoffload-pool" not in r.headers
        assert ALPHA not in r.text
        assert BETA not in r.text
        for space in t.tenancy.spaces.values():
            assert space.service.manager.manager.num_requests == 0


async def test_two_admin_authorization_headers_are_refused(tmp_path: Path) -> None:
    async with tenants_running(tmp_path) as t:
        token = t.admin.headers["Authorization"]
        r = await t.admin.get(
            "/admin/v1/tenants",
            headers=[("Authorization", "Bearer wrong"), ("Authorization", token)],
        )
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] == "ambiguous_credentials"


async def test_max_pins_counts_distinct_blocks_pinned_by_any_request(tmp_path: Path) -> None:
    # alpha: max_pins = 3 over a1 and a2, max_requests = 3.
    keys = hexkeys(1, 2, 3, 4)
    async with tenants_running(tmp_path) as t:
        await t.store(ALPHA, "a1", "w", keys)
        for req in ("r1", "r2"):
            assert (await t.call(ALPHA, "PUT", f"/v1/requests/{req}", {}, "a1")).status_code == 201
        load = "/v1/requests/{}/prepare-load"
        r = await t.call(ALPHA, "POST", load.format("r1"), {"keys": keys[:3]}, "a1")
        assert r.status_code == 200, r.text
        # The same three blocks for another request, and again (with a repeat) for r1: no new
        # distinct block, so within the quota of 3.
        r = await t.call(ALPHA, "POST", load.format("r2"), {"keys": keys[:3]}, "a1")
        assert r.status_code == 200, r.text
        r = await t.call(ALPHA, "POST", load.format("r1"), {"keys": [keys[0], keys[0]]}, "a1")
        assert r.status_code == 200, r.text
        a1 = t.tenancy.spaces["a1"].service.manager.manager
        assert a1.num_pinned == 3
        assert t.tenancy.quotas["alpha"].pins() == 3
        # A fourth distinct block is one too many, and pins nothing.
        r = await t.call(ALPHA, "POST", load.format("r2"), {"keys": keys[2:]}, "a1")
        assert r.status_code == 429, r.text
        assert r.json()["error"]["quota"] == "pins"
        assert "would pin 1 more" in r.json()["error"]["message"]
        assert a1.num_pinned == 3
        tenants = (await t.admin.get("/admin/v1/tenants")).json()
        alpha = next(x for x in tenants["tenants"] if x["tenant"] == "alpha")
        assert alpha["pins"] == 3
