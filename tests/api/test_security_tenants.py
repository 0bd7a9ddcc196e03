"""Issue #21: what an attacker holding one tenant's token tries against another tenant.

Two tenants (``tests.api.test_tenancy``'s ``alpha`` and ``beta``), in process. Each test is one
row of the README's attack table: the attempt, what it answers, and that nothing leaked.
"""

from __future__ import annotations

from pathlib import Path

import pytest

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
