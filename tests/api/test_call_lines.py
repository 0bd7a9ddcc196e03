"""What the canonical call line and the HTTP metrics say about refused calls: the error code
and the caller on the line, and the route a call was aimed at for calls the router does not
mark (the docs routes, bodies the guard refused before routing)."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from app.http.middleware import error_code
from app.telemetry.logging import ACCESS_LOGGER, CALL_EVENT
from testsupport.api_harness import Harness, hexkeys

pytestmark = pytest.mark.anyio
LOOKUP = "/v1/requests/{req_id}/lookup"


def call_lines(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    """The fields of every call line (unconfigured, the line is a record on the access logger)."""
    return [
        dict(r.fields)  # type: ignore[attr-defined]
        for r in caplog.records
        if r.name == ACCESS_LOGGER and r.getMessage() == CALL_EVENT
    ]


def requests_total(h: Harness, route: str, method: str, status: int) -> float | None:
    assert h.service.registry is not None
    return h.service.registry.get_sample_value(
        "kvoffload_http_requests_total", {"route": route, "method": method, "status": str(status)}
    )


async def test_error_lines_carry_the_code_sent_and_the_caller(
    h: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    await h.start("r1")
    ghost = await h.post("/v1/requests/ghost/lookup", {"keys": hexkeys(1)})
    bad = await h.post("/v1/requests/r1/lookup", {"keys": ["not hex"]})
    ok, missing, invalid = call_lines(caplog)
    assert "code" not in ok  # a success has no error code to report, and names no caller
    assert "client" not in ok
    assert (missing["status"], missing["code"]) == (404, ghost.json()["error"]["code"])
    assert (invalid["status"], invalid["code"]) == (bad.status_code, bad.json()["error"]["code"])
    assert missing["code"] != invalid["code"]
    # httpx's ASGI transport calls from 127.0.0.1:123.
    assert {line["client"] for line in (missing, invalid)} == {"127.0.0.1:123"}


@pytest.mark.parametrize(("authorization", "status"), [(None, 401), ("Bearer wrong", 403)])
async def test_refused_admin_calls_are_traceable_to_their_caller(
    h: Harness, caplog: pytest.LogCaptureFixture, authorization: str | None, status: int
) -> None:
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    if authorization is None:
        del h.admin.headers["authorization"]
    else:
        h.admin.headers["authorization"] = authorization
    answer = await h.admin.get("/admin/v1/stats")
    assert answer.status_code == status
    (line,) = call_lines(caplog)
    assert line["status"] == status
    assert line["code"] == answer.json()["error"]["code"]
    assert line["client"] == "127.0.0.1:123"


async def test_docs_and_guard_refusals_count_under_their_route(h: Harness) -> None:
    assert (await h.client.get("/docs")).status_code == 200
    assert (await h.client.get("/openapi.json")).status_code == 200
    not_json = await h.client.post(
        "/v1/requests/r1/lookup", content=b"keys", headers={"content-type": "text/plain"}
    )
    assert not_json.status_code == 415
    too_large = await h.client.put(
        "/v1/requests/r1",
        content=b" " * (h.settings.max_body_bytes + 1),
        headers={"content-type": "application/json"},
    )
    assert too_large.status_code == 413
    assert (await h.client.get("/nowhere")).status_code == 404

    assert requests_total(h, "/docs", "GET", 200) == 1
    assert requests_total(h, "/openapi.json", "GET", 200) == 1
    assert requests_total(h, LOOKUP, "POST", 415) == 1
    assert requests_total(h, "/v1/requests/{req_id}", "PUT", 413) == 1
    assert requests_total(h, "unmatched", "GET", 404) == 1
    assert [c.route for c in h.calls] == [
        "/docs",
        "/openapi.json",
        LOOKUP,
        "/v1/requests/{req_id}",
        None,
    ]
    assert [c.error_code for c in h.calls[2:]] == [
        not_json.json()["error"]["code"],
        too_large.json()["error"]["code"],
        "not_found",
    ]


@pytest.mark.parametrize(
    ("body", "code"),
    [
        (b'{"error": {"code": "forbidden", "message": "no"}}', "forbidden"),
        (b"not json", None),
        (b"[1, 2]", None),
        (b'{"error": "flat"}', None),
        (b'{"error": {"code": 7}}', None),
        (b"", None),
    ],
)
def test_error_code_reads_only_error_bodies(body: bytes, code: str | None) -> None:
    assert error_code(body) == code
