"""Logs of real API calls, rendered as the service renders them (``configure_logging`` on a
buffer): ids on every line, one canonical line per call, X-Request-ID, audit lines, live level."""

from __future__ import annotations

import asyncio
import io
import json
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any
from urllib.parse import quote

import httpx
import pytest

from app.core.service import Service
from app.http.apps import create_app
from app.telemetry.logging import (
    ACCESS_LOGGER,
    AUDIT_LOGGER,
    CALL_EVENT,
    configure_logging,
    flush_logs,
    set_level,
)
from app.telemetry.logging import unconfigure_logging as unconfigure
from app.telemetry.request_ids import safe_req_id
from manager import OffloadManager, ReqContext, create_manager
from testsupport.api_harness import TOKEN, Harness, hexkeys, make_settings, running

pytestmark = pytest.mark.anyio
Lines = Callable[[], list[dict[str, Any]]]


@pytest.fixture
def lines() -> Iterator[Lines]:
    """Every JSON line logged during the test (the service's own configuration, on a buffer)."""
    buffer = io.StringIO()
    root = logging.getLogger()
    level = root.level
    configure_logging("info", stream=buffer, fmt="json")
    try:

        def read() -> list[dict[str, Any]]:
            flush_logs()  # the call lines still queued for the end of the loop iteration
            return [json.loads(line) for line in buffer.getvalue().splitlines()]

        yield read
    finally:
        unconfigure()
        root.setLevel(level)


def calls(found: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [line for line in found if line["event"] == CALL_EVENT]


async def test_one_canonical_line_per_call(h: Harness, lines: Lines) -> None:
    await h.start("r1")
    await h.post("/v1/requests/r1/prepare-store", {"keys": hexkeys(1, 2, 3)})
    await h.post("/v1/requests/r1/lookup", {"keys": hexkeys(1, 2, 9)})
    await h.post("/v1/requests/ghost/lookup", {"keys": hexkeys(1)})
    await h.admin.get("/admin/v1/stats")
    found = calls(lines())
    assert len(found) == 5
    start, store, lookup, ghost, stats = found
    assert lookup == {
        "ts": lookup["ts"],
        "level": "info",
        "logger": ACCESS_LOGGER,
        "event": CALL_EVENT,
        "route": "/v1/requests/{req_id}/lookup",
        "method": "POST",
        "status": 200,
        "duration_ms": lookup["duration_ms"],
        "op": "lookup",
        "keys": 3,
        "result": "ok",
        "req_id": "r1",
        "request_id": lookup["request_id"],
    }
    assert lookup["duration_ms"] > 0
    assert list(lookup)[:4] == ["ts", "level", "logger", "event"]
    assert (start["op"], start["status"], start["keys"]) == ("start_request", 201, 0)
    assert (store["op"], store["keys"]) == ("prepare_store", 3)
    assert (ghost["status"], ghost["result"], ghost["req_id"]) == (404, "error", "ghost")
    assert ghost["code"] == "unknown_request"
    assert (stats["route"], stats["op"]) == ("/admin/v1/stats", "admin_stats")
    assert stats["req_id"] == stats["request_id"]  # not request-scoped: the call's own id
    assert len({line["request_id"] for line in found}) == 5


async def test_batch_line_counts_ops_and_failures(h: Harness, lines: Lines) -> None:
    await h.start("a")
    ops = [
        {"op": "lookup", "req_id": "a", "keys": hexkeys(1, 2)},
        {"op": "lookup", "req_id": "ghost", "keys": hexkeys(1)},
    ]
    await h.post("/v1/batch", {"ops": ops})
    (batch,) = [c for c in calls(lines()) if c["op"] == "batch"]
    assert (batch["ops"], batch["ops_failed"], batch["keys"]) == (2, 1, 2)
    assert batch["req_ids"] == ["a", "ghost"]
    assert "req_ids_more" not in batch


async def test_a_batch_of_refused_ops_writes_one_line_with_a_count_per_code(
    h: Harness, lines: Lines
) -> None:
    # Issue #21: 1,024 prepare-stores into a full pool wrote 1,024 error records with
    # tracebacks. A 507 is the documented answer: one warning line, counts, no traceback.
    keys = hexkeys(*range(1, 33))  # the harness pool: 32 blocks, all pinned below
    await h.start("w")
    for step in ("prepare-store", "complete-store", "prepare-load"):
        assert (await h.post(f"/v1/requests/w/{step}", {"keys": keys})).status_code == 200
    await h.start("s")
    ops: list[dict[str, Any]] = [
        {"op": "prepare_store", "req_id": "s", "keys": hexkeys(100 + i)} for i in range(200)
    ]
    ops.append({"op": "lookup", "req_id": "ghost", "keys": hexkeys(1)})
    r = await h.post("/v1/batch", {"ops": ops})
    assert r.status_code == 200
    assert [x["status"] for x in r.json()["results"]] == [507] * 200 + [404]
    found = lines()
    (batch,) = [c for c in calls(found) if c["op"] == "batch"]
    assert batch["level"] == "warning"
    assert batch["op_errors"] == {"507 no_space": 200, "404 unknown_request": 1}
    assert (batch["ops"], batch["ops_failed"]) == (201, 201)
    others = [line for line in found if line["event"] != CALL_EVENT and line["level"] != "info"]
    assert others == []
    assert not any("exception" in line for line in found)


async def test_batch_line_names_its_requests_safely_and_bounded(h: Harness, lines: Lines) -> None:
    from app.telemetry.observer import BATCH_REQ_IDS

    ids = ["has space"] + [f"r{i}" for i in range(BATCH_REQ_IDS + 2)] + ["r0"]
    ops = [{"op": "touch", "req_id": r, "keys": hexkeys(1)} for r in ids]
    await h.post("/v1/batch", {"ops": ops})
    (batch,) = [c for c in calls(lines()) if c["op"] == "batch"]
    expected = [safe_req_id("has space")] + [f"r{i}" for i in range(BATCH_REQ_IDS - 1)]
    assert batch["req_ids"] == expected
    assert batch["req_ids_more"] == 3  # r63, r64 and r65; r0 is named once


async def test_probes_log_at_debug(h: Harness, lines: Lines) -> None:
    await h.client.get("/livez")
    await h.client.get("/metrics")
    await h.client.get("/nowhere")
    found = calls(lines())
    assert [c["route"] for c in found] == ["unmatched"]


async def test_x_request_id_is_echoed_logged_and_sanitised(h: Harness, lines: Lines) -> None:
    r = await h.client.get("/v1/pool", headers={"x-request-id": "trace-42.a:b_c"})
    assert r.headers["x-request-id"] == "trace-42.a:b_c"
    bad = [b"has space", b'quote"d', b"x" * 121, "é".encode()]
    echoed: list[str] = []
    for sent in bad:
        r = await h.client.get("/v1/pool", headers=[(b"x-request-id", sent)])
        echoed.append(r.headers["x-request-id"])
    for got in echoed:  # refused values are replaced by a generated safe id
        assert got.encode() not in bad
        assert safe_req_id(got) == got
    found = calls(lines())
    assert found[0]["request_id"] == "trace-42.a:b_c"
    assert [c["request_id"] for c in found[1:]] == echoed
    text = json.dumps(lines())
    assert "has space" not in text
    assert 'quote\\"d' not in text


async def test_unsafe_path_req_id_is_logged_in_its_safe_form(h: Harness, lines: Lines) -> None:
    raw = 'req with spaces and "quotes"\n' + "z" * 200
    r = await h.client.put(f"/v1/requests/{quote(raw, safe='')}")
    assert r.status_code == 201
    assert r.json()["req_id"] == raw  # served under its own id
    (line,) = calls(lines())
    assert line["req_id"] == safe_req_id(raw)
    assert len(line["req_id"]) <= 120
    assert "\n" not in json.dumps(lines())[1:-1].replace("\\n", "")


async def test_every_line_of_a_request_carries_its_ids(lines: Lines) -> None:
    """Lines written while a call is served (here: by a hook and by the transfer layer's own
    logger) carry the call's req_id and request_id; lines outside a call do not."""
    settings = make_settings()
    service = Service(settings)
    inside = logging.getLogger("tests.inside")

    def hook(info: Any) -> None:
        inside.warning("seen by a hook", extra={"fields": {"op": info.op}})
        logging.getLogger("transfer.jobs").warning("third-party style line")

    app = create_app(settings, service=service, hooks=[hook])
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://e") as client,
    ):
        await client.put("/v1/requests/r7", headers={"x-request-id": "call-1"})
        await client.post("/v1/requests/r7/lookup", json={"keys": hexkeys(1)})
        logging.getLogger("tests.outside").warning("between calls")
    found = lines()
    hooked = [line for line in found if line["logger"] in ("tests.inside", "transfer.jobs")]
    assert len(hooked) == 4
    assert all(line["req_id"] == "r7" for line in hooked)
    assert hooked[0]["request_id"] == "call-1"
    assert hooked[2]["request_id"] != "call-1"
    (outside,) = [line for line in found if line["logger"] == "tests.outside"]
    assert "req_id" not in outside
    assert "request_id" not in outside
    for line in found:
        assert {"ts", "level", "logger", "event"} <= set(line)


class _BrokenManager(OffloadManager):
    def lookup(self, keys: Sequence[bytes], ctx: ReqContext) -> Any:
        raise RuntimeError("a bug")


async def test_unhandled_error_lines_carry_the_ids(lines: Lines) -> None:
    settings = make_settings()
    manager = create_manager(settings.num_blocks)
    manager.__class__ = _BrokenManager
    app = create_app(settings, service=Service(settings, manager=manager))
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(
            transport=httpx.ASGITransport(app, raise_app_exceptions=False), base_url="http://e"
        ) as client,
    ):
        await client.put("/v1/requests/r9")
        # A task of its own, as uvicorn serves each call: the ids the failed call leaves bound
        # for the error lines end with it.
        r = await asyncio.create_task(
            client.post("/v1/requests/r9/lookup", json={"keys": hexkeys(1)})
        )
        assert r.status_code == 500
        logging.getLogger("tests.after").warning("after the failed call")
    found = lines()
    errors = [line for line in found if line["level"] == "error"]
    assert {line["event"] for line in errors} == {CALL_EVENT, "unhandled error"}
    assert all(line["req_id"] == "r9" for line in errors)
    (unhandled,) = [line for line in errors if line["event"] == "unhandled error"]
    assert "RuntimeError: a bug" in unhandled["exception"]
    (after,) = [line for line in found if line["logger"] == "tests.after"]
    assert "req_id" not in after


async def test_admin_changes_write_one_audit_line_without_the_token(
    h: Harness, lines: Lines
) -> None:
    await h.start("r1")
    await h.post("/v1/requests/r1/prepare-store", {"keys": hexkeys(1)})
    await h.admin.put("/admin/v1/policy", json={"name": "arc"})
    await h.admin.put("/admin/v1/policy", json={"name": "arc"})  # no change: no audit
    await h.admin.post("/admin/v1/requests/r1/release")
    await h.admin.post("/admin/v1/cache/clear")
    await h.admin.put("/admin/v1/log-level", json={"level": "debug"})
    await h.admin.put("/admin/v1/log-level", json={"level": "debug"})  # no change
    await h.admin.put("/admin/v1/log-level", json={"level": "info"})
    found = lines()
    audits = [line for line in found if line["logger"] == AUDIT_LOGGER]
    assert [a["event"] for a in audits] == [
        "policy.switch",
        "request.release",
        "cache.clear",
        "log_level.set",
        "log_level.set",
    ]
    assert all(a["audit"] is True and a["actor"] for a in audits)
    assert audits[1]["req_id"] == "r1"
    assert (audits[3]["from_level"], audits[3]["to_level"]) == ("info", "debug")
    assert TOKEN not in json.dumps(found)


async def test_log_level_switches_live(h: Harness, lines: Lines) -> None:
    r = await h.admin.get("/admin/v1/log-level")
    assert r.json() == {"level": "info", "available": ["debug", "info", "warning", "error"]}
    r = await h.admin.put("/admin/v1/log-level", json={"level": "warning"})
    assert r.json() == {"level": "warning", "previous": "info", "changed": True}
    await h.start("quiet")  # an info line: not written
    await h.post("/v1/requests/ghost/prepare-store", {"keys": hexkeys(1)})  # 404: info too
    r = await h.admin.put("/admin/v1/log-level", json={"level": "debug"})
    assert r.json()["previous"] == "warning"
    await h.client.get("/livez")  # a probe: debug, written now
    r = await h.admin.put("/admin/v1/log-level", json={"level": "loud"})
    assert r.status_code == 422
    found = lines()
    routes = [c["route"] for c in calls(found)]
    assert "/v1/requests/{req_id}" not in routes
    assert "/livez" in routes
    # The change itself is audited even while the level hides info lines.
    assert [a["to_level"] for a in found if a["logger"] == AUDIT_LOGGER] == [
        "warning",
        "debug",
    ]
    assert logging.getLogger("uvicorn.error").getEffectiveLevel() == logging.DEBUG


async def test_log_level_needs_the_token(h: Harness) -> None:
    r = await h.admin.put(
        "/admin/v1/log-level", json={"level": "debug"}, headers={"authorization": "Bearer no"}
    )
    assert r.status_code == 403


async def test_transfer_lines_carry_the_jobs_request(lines: Lines) -> None:
    """A load job whose request was aborted mid-copy: the job's line and the tracker's own
    line about the refused completion both name the job's request."""
    set_level("debug")  # a successful job's line is a debug line
    async with running(make_settings(fault_delay_s=0.3)) as h:
        await h.start("loader")
        _, cache_id = await h.device(8)
        await h.post("/v1/requests/loader/prepare-store", {"keys": hexkeys(1)})
        await h.post("/v1/requests/loader/complete-store", {"keys": hexkeys(1)})
        r = await h.post(
            "/v1/requests/loader/onload",
            {"cache_id": cache_id, "keys": hexkeys(1), "device_blocks": [0]},
        )
        await h.client.delete("/v1/requests/loader", params={"abort": "true"})
        job = await h.wait(r.json()["job_id"])
    found = lines()
    (done,) = [line for line in found if line.get("job_id") == job["job_id"]]
    assert (done["req_id"], done["direction"]) == ("loader", "load")
    tracker = [line for line in found if line["logger"] == "transfer.jobs"]
    assert tracker, [line["event"] for line in found]
    assert all(line["req_id"] == "loader" for line in tracker)


@pytest.mark.parametrize(
    ("settings", "said"),
    [({"device": "auto"}, "cpu"), ({"device": "auto", "fault_delay_s": 0.001}, "faulty(cpu)")],
)
async def test_the_start_line_names_the_backend_chosen(
    lines: Lines, settings: dict[str, Any], said: str
) -> None:
    """``auto`` is what was asked; the line says what it became (no GPU here: ``cpu``)."""
    async with running(make_settings(**settings)):
        pass
    (started,) = [line for line in lines() if line["event"] == "service started"]
    assert started["backend"] == said
