"""Request ids and the per-call ``CallInfo`` the observability layer plugs into."""

from __future__ import annotations

import pytest

from testsupport.api_harness import Harness, hexkeys

pytestmark = pytest.mark.anyio


async def test_request_id_is_echoed_or_made_up(h: Harness) -> None:
    r = await h.client.get("/livez", headers={"x-request-id": "abc-123"})
    assert r.headers["x-request-id"] == "abc-123"
    r1 = await h.client.get("/livez")
    r2 = await h.client.get("/livez")
    assert r1.headers["x-request-id"] != r2.headers["x-request-id"]
    r = await h.client.get("/livez", headers={"x-request-id": "x" * 500})
    assert len(r.headers["x-request-id"]) < 100  # refused and replaced


async def test_call_info_names_the_op_and_request(h: Harness) -> None:
    await h.start()
    await h.post("/v1/requests/r1/lookup", {"keys": hexkeys(1)})
    await h.post("/v1/requests/nobody/lookup", {"keys": hexkeys(1)})
    await h.admin.get("/admin/v1/stats")
    lookup, missing, stats = h.calls[-3:]
    assert (lookup.op, lookup.req_id, lookup.status, lookup.method) == ("lookup", "r1", 200, "POST")
    assert lookup.path == "/v1/requests/r1/lookup"
    assert lookup.route == "/v1/requests/{req_id}/lookup"
    assert stats.route == "/admin/v1/stats"
    assert lookup.duration_s > 0
    assert (missing.op, missing.req_id, missing.status) == ("lookup", "nobody", 404)
    assert (stats.op, stats.status) == ("admin_stats", 200)


async def test_refused_bodies_are_seen_by_the_hooks(h: Harness) -> None:
    r = await h.client.post(
        "/v1/requests/r1/lookup", content=b"{}", headers={"content-type": "text/plain"}
    )
    assert r.status_code == 415
    assert h.calls[-1].status == 415
    await h.client.get("/nowhere")
    assert (h.calls[-1].status, h.calls[-1].route) == (404, None)
