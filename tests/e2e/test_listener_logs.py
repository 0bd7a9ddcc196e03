"""The log of a real ``kvoffload serve``: uvicorn's lines say which listener they are about, and
refused calls name their caller (``host:port`` over TCP, ``unix`` on the Unix socket) and the
error code."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from testsupport.server import ServerProcess


def log_lines(server: ServerProcess) -> list[dict[str, Any]]:
    return [json.loads(line) for line in server.log().splitlines() if line.startswith("{")]


def test_uvicorn_lines_name_their_listener_and_calls_their_caller(tmp_path: Path) -> None:
    srv = ServerProcess(tmp_path, "--log-level", "info", "--log-format", "json")
    with srv.serving():
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(srv.uds))) as unix:
            assert unix.get("http://kvoffload/v1/jobs/999999").status_code == 404
        with httpx.Client(base_url=srv.url) as tcp:
            assert tcp.get("/v1/jobs/999999").status_code == 404
            assert tcp.get("/v1/pool").status_code == 200
        wrong = httpx.get(
            f"{srv.admin_url}/admin/v1/stats", headers={"authorization": "Bearer wrong"}
        )
        assert wrong.status_code == 403
    lines = log_lines(srv)

    uvicorn = [line for line in lines if line["logger"].startswith("uvicorn")]
    assert uvicorn
    assert {line.get("listener") for line in uvicorn} == {"engine", "admin"}
    per_event = Counter((line["event"], line["listener"]) for line in uvicorn)
    started = {listener for event, listener in per_event if event.startswith("Started server")}
    assert started == {"engine", "admin"}
    assert set(per_event.values()) == {1}  # each line once per listener

    calls = [line for line in lines if line["event"] == "http_call"]
    missing = [line for line in calls if line["route"] == "/v1/jobs/{job_id}"]
    assert [line["code"] for line in missing] == ["unknown_job", "unknown_job"]
    assert missing[0]["client"] == "unix"
    host, port = missing[1]["client"].rsplit(":", 1)
    assert host == "127.0.0.1"
    assert int(port) > 0
    assert all("client" not in line for line in calls if line["route"] == "/v1/pool")
    (refused,) = [line for line in calls if line["status"] == 403]
    assert refused["code"] == wrong.json()["error"]["code"]
    assert refused["client"].startswith("127.0.0.1:")
