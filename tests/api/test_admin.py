"""Admin API: bearer auth, live policy switch (ETag / If-Match), stats, leases, clear, audit."""

from __future__ import annotations

import logging

import httpx
import pytest
from pydantic import SecretStr, ValidationError

from app.cli import main as cli_main
from app.settings import Settings
from app.telemetry.logging import AUDIT_LOGGER, fields_of
from testsupport.api_harness import TOKEN, Harness, hexkeys, make_settings, running

pytestmark = pytest.mark.anyio

ADMIN_ROUTES = [
    ("GET", "/admin/v1/policy"),
    ("PUT", "/admin/v1/policy"),
    ("GET", "/admin/v1/stats"),
    ("GET", "/admin/v1/requests"),
    ("POST", "/admin/v1/requests/r1/release"),
    ("POST", "/admin/v1/cache/clear"),
]


def bare(h: Harness, headers: dict[str, str] | None = None) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(h.admin_app), base_url="http://admin", headers=headers
    )


@pytest.mark.parametrize(("method", "path"), ADMIN_ROUTES)
async def test_no_token_is_401_wrong_token_is_403(h: Harness, method: str, path: str) -> None:
    body = {"name": "arc"} if method == "PUT" else None
    async with bare(h) as anon:
        r = await anon.request(method, path, json=body)
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "unauthorized"
        assert r.headers["www-authenticate"] == "Bearer"
    async with bare(h, {"authorization": "Bearer not-the-token"}) as wrong:
        r = await wrong.request(method, path, json=body)
        assert (r.status_code, r.json()["error"]["code"]) == (403, "forbidden")
    async with bare(h, {"authorization": f"Basic {TOKEN}"}) as basic:
        assert (await basic.request(method, path, json=body)).status_code == 401
    assert (await h.admin.get("/admin/v1/policy")).json()["name"] == "lru"  # nothing changed


async def test_admin_livez_and_docs_are_open(h: Harness) -> None:
    async with bare(h) as anon:
        assert (await anon.get("/livez")).status_code == 200
        assert (await anon.get("/openapi.json")).status_code == 200


async def test_without_a_token_loopback_admin_is_open() -> None:
    async with running(make_settings(admin_token=None)) as h, bare(h) as anon:
        assert (await anon.get("/admin/v1/stats")).status_code == 200


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3", "::", "example.com"])
def test_non_loopback_admin_without_token_is_refused(host: str) -> None:
    with pytest.raises(ValidationError, match="not a loopback address and no admin token"):
        Settings(admin_host=host)
    assert Settings(admin_host=host, admin_token=SecretStr("t")).admin_host == host


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "localhost", "127.0.0.2"])
def test_loopback_admin_without_token_is_allowed(host: str) -> None:
    assert Settings(admin_host=host).admin_token_value() is None


def test_serve_refuses_non_loopback_admin_without_token(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["serve", "--admin-host", "0.0.0.0"]) == 2
    assert "not a loopback address and no admin token" in capsys.readouterr().err


async def test_policy_switch_with_etag_and_if_match(
    h: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=AUDIT_LOGGER)
    await h.start()
    await h.post("/v1/requests/r1/prepare-store", {"keys": hexkeys(1, 2, 3)})
    await h.post("/v1/requests/r1/complete-store", {"keys": hexkeys(1, 2, 3)})

    r = await h.admin.get("/admin/v1/policy")
    assert r.headers["etag"] == '"1"'
    assert r.json()["name"] == "lru"
    assert {"lru", "arc"} <= set(r.json()["available"])

    r = await h.admin.put("/admin/v1/policy", json={"name": "arc"}, headers={"if-match": '"1"'})
    assert r.status_code == 200, r.text
    assert r.headers["etag"] == '"2"'
    assert r.json() == {
        "from": {"name": "lru", "params": {}, "generation": 1},
        "to": {"name": "arc", "params": {}, "generation": 2},
        "blocks_migrated": 3,
        "changed": True,
    }
    # A stale If-Match changes nothing.
    r = await h.admin.put("/admin/v1/policy", json={"name": "lru"}, headers={"if-match": '"1"'})
    assert (r.status_code, r.json()["error"]["code"]) == (412, "precondition_failed")
    assert r.headers["etag"] == '"2"'
    r = await h.admin.put("/admin/v1/policy", json={"name": "lru"}, headers={"if-match": 'W/"2"'})
    assert r.status_code == 412
    # Same policy again: idempotent, generation kept, no audit line.
    r = await h.admin.put("/admin/v1/policy", json={"name": "arc", "params": {}})
    assert r.status_code == 200
    assert r.json()["changed"] is False
    assert r.json()["to"]["generation"] == 2
    r = await h.admin.put("/admin/v1/policy", json={"name": "lru"}, headers={"if-match": "*"})
    assert r.json()["to"] == {"name": "lru", "params": {}, "generation": 3}

    audits = [rec for rec in caplog.records if rec.name == AUDIT_LOGGER]
    assert [rec.getMessage() for rec in audits] == ["policy.switch", "policy.switch"]
    first = fields_of(audits[0])
    assert (first["from_policy"], first["to_policy"], first["blocks_migrated"]) == ("lru", "arc", 3)
    assert first["actor"]
    assert TOKEN not in caplog.text
    # Blocks survived both switches.
    r = await h.post("/v1/requests/r1/lookup", {"keys": hexkeys(1, 2, 3)})
    assert r.json()["hit_prefix"] == 3


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        ({"name": "belady"}, 422, "unknown_policy"),
        ({"name": "lru", "params": {"no_such_param": 1}}, 422, "invalid_policy_params"),
        ({"name": "lru", "params": []}, 422, "invalid_field"),
        ({"name": 3}, 422, "invalid_field"),
        ({}, 422, "invalid_field"),
        ({"name": "lru", "extra": True}, 422, "invalid_field"),
    ],
)
async def test_bad_policy_puts(h: Harness, body: object, status: int, code: str) -> None:
    r = await h.admin.put("/admin/v1/policy", json=body)
    assert (r.status_code, r.json()["error"]["code"]) == (status, code)
    assert (await h.admin.get("/admin/v1/policy")).headers["etag"] == '"1"'


async def test_malformed_policy_body_is_400(h: Harness) -> None:
    r = await h.admin.put(
        "/admin/v1/policy", content=b"{name", headers={"content-type": "application/json"}
    )
    assert r.status_code == 400


async def test_stats(h: Harness) -> None:
    await h.start()
    await h.post("/v1/requests/r1/prepare-store", {"keys": hexkeys(1, 2)})
    await h.post("/v1/requests/r1/complete-store", {"keys": hexkeys(1)})
    await h.post("/v1/requests/r1/lookup", {"keys": hexkeys(1, 2, 3, 4)})
    stats = (await h.admin.get("/admin/v1/stats")).json()
    n = h.settings.num_blocks
    assert stats["blocks"] == {
        "num_blocks": n,
        "free": n - 2,
        "pending": 1,
        "ready": 1,
        "pinned": 0,
    }
    assert stats["hit_ratio"] == pytest.approx(0.25)
    assert stats["live_requests"] == 1
    assert stats["policy"]["name"] == "lru"
    assert stats["counters"]["lookup_miss"] == 2
    assert stats["jobs"] == {"running": 0, "oldest_running_age_s": None}
    assert stats["events"]["latest_seq"] >= 0


async def test_requests_release_and_clear(h: Harness, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=AUDIT_LOGGER)
    await h.start()
    await h.post("/v1/requests/r1/prepare-store", {"keys": hexkeys(1, 2)})
    await h.post("/v1/requests/r1/complete-store", {"keys": hexkeys(1)})
    await h.post("/v1/requests/r1/prepare-load", {"keys": hexkeys(1, 1)})

    listing = (await h.admin.get("/admin/v1/requests")).json()
    assert listing["total"] == 1
    (req,) = listing["requests"]
    assert req["req_id"] == "r1"
    assert req["pins"] == {hexkeys(1)[0]: 2}
    assert req["pending_stores"] == hexkeys(2)

    r = await h.admin.post("/admin/v1/requests/r1/release")
    assert r.json() == {"req_id": "r1", "pins_released": 2, "stores_dropped": 1}
    assert (await h.admin.get("/admin/v1/requests")).json()["total"] == 0
    r = await h.admin.post("/admin/v1/requests/r1/release")
    assert (r.status_code, r.json()["error"]["code"]) == (404, "unknown_request")

    r = await h.admin.post("/admin/v1/cache/clear")
    assert r.json() == {"dropped": 1, "kept_pinned": 0, "kept_pending": 0, "kept_retained": 0}
    await h.start("r2")
    r = await h.post("/v1/requests/r2/lookup", {"keys": hexkeys(1)})
    assert r.json()["results"] == ["miss"]
    actions = [rec.getMessage() for rec in caplog.records if rec.name == AUDIT_LOGGER]
    assert actions == ["request.release", "cache.clear"]
    assert TOKEN not in caplog.text
