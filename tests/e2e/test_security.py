"""Security of a real ``kvoffload serve``: listeners, the admin token, what logs may hold.

- Both listeners are bound to loopback by default (read from ``/proc/<pid>/net/tcp*``, the
  sockets the process really holds), the admin API answers only on its own port (its routes are
  404 on the engine port and on the Unix socket), and the engine routes are 404 on the admin
  port.
- ``serve`` refuses (exit 2, before binding anything) an admin listener on a non-loopback
  address without a token.
- A token read from ``--admin-token-file`` appears neither in the process's command line nor
  in its environment, and no answer of either port (every GET route, errors, metrics) nor any
  log line holds it.
- Every log line is one JSON object; engine request ids and ``X-Request-ID`` values of any text
  (newlines, quotes, markup, 256 characters) reach the log lines and the exemplars only in their
  safe form (``app/request_ids.py``): a forged log line cannot be injected, a raw id never shows.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import httpx
import pytest

from app.telemetry.request_ids import safe_req_id
from testsupport.ports import free_port
from testsupport.server import ROOT, TOKEN, ServerProcess

SAFE_ID = re.compile(r"[A-Za-z0-9._:\-]{1,120}")


def listening_addresses(pid: int, port: int) -> list[str]:
    """Local addresses (hex, as the kernel writes them) of sockets listening on ``port`` in
    the network namespace of process ``pid``."""
    found = []
    for table in ("tcp", "tcp6"):
        path = f"/proc/{pid}/net/{table}"
        if not os.path.exists(path):
            continue
        with open(path, encoding="ascii") as f:
            next(f)
            for line in f:
                fields = line.split()
                addr, hex_port = fields[1].rsplit(":", 1)
                if fields[3] == "0A" and int(hex_port, 16) == port:
                    found.append(addr)
    return found


IPV4_LOOPBACK = "0100007F"  # 127.0.0.1, little-endian
IPV6_LOOPBACK = "00000000000000000000000001000000"  # ::1


@pytest.fixture(scope="module")
def token_file_server(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[ServerProcess, str]]:
    """A server whose token comes from a file (none in its environment), logging at debug;
    the server and its token."""
    workdir = tmp_path_factory.mktemp("sec")
    token = "file-token-" + secrets.token_hex(16)
    path = workdir / "token"
    path.write_text(token + "\n")
    path.chmod(0o600)
    srv = ServerProcess(workdir, "--admin-token-file", str(path), "--log-level", "debug")
    del srv.env["KVOFFLOAD_ADMIN_TOKEN"]
    srv.start()
    try:
        yield srv, token
    finally:
        status = srv.stop()
    assert status == 0, srv.log()


def test_both_listeners_are_loopback_only_by_default(server: ServerProcess) -> None:
    """The sockets the process listens on for the engine and admin ports are 127.0.0.1."""
    assert server.proc is not None
    for port in (server.port, server.admin_port):
        addrs = listening_addresses(server.proc.pid, port)
        assert addrs, f"nothing listens on {port}"
        assert set(addrs) <= {IPV4_LOOPBACK, IPV6_LOOPBACK}, addrs


def test_admin_api_answers_only_on_its_own_port(server: ServerProcess) -> None:
    """Admin routes (with the token) are 404 on the engine port and on the Unix socket; engine
    routes are 404 on the admin port."""
    headers = {"authorization": f"Bearer {TOKEN}"}
    with httpx.Client(timeout=5) as admin:
        spec = admin.get(f"{server.admin_url}/openapi.json").json()
        assert admin.get(f"{server.admin_url}/admin/v1/stats", headers=headers).status_code == 200
    admin_paths = [p.replace("{req_id}", "r1") for p in spec["paths"] if p.startswith("/admin")]
    assert len(admin_paths) >= 5
    uds = httpx.Client(transport=httpx.HTTPTransport(uds=str(server.uds)), timeout=5)
    with httpx.Client(timeout=5) as tcp, uds:
        for base, client in ((server.url, tcp), ("http://kvoffload", uds)):
            for path in admin_paths:
                for method in ("GET", "PUT", "POST", "DELETE"):
                    r = client.request(method, base + path, headers=headers)
                    assert r.status_code == 404, (base, method, path, r.text)
        for path in ("/v1/pool", "/v1/events", "/v1/kv-caches", "/metrics"):
            r = tcp.get(server.admin_url + path, headers=headers)
            assert r.status_code == 404, (path, r.text)
        r = tcp.put(server.admin_url + "/v1/requests/r1", headers=headers)
        assert r.status_code == 404


@pytest.mark.parametrize("host", ["192.0.2.1", "example.invalid", "::ffff:10.0.0.1"])
def test_serve_refuses_a_non_loopback_admin_without_a_token(host: str) -> None:
    """Exit status 2 and a message that says why, before any socket is bound (192.0.2.1 is
    TEST-NET-1: had the check been skipped, the bind itself would fail, with another message)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVOFFLOAD_")}
    port, admin_port = free_port(), free_port()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "app.cli",
            "serve",
            "--port",
            str(port),
            "--admin-port",
            str(admin_port),
            "--admin-host",
            host,
            "--device",
            "cpu",
            "--num-blocks",
            "16",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    assert "--admin-host / KVOFFLOAD_ADMIN_HOST" in done.stderr
    assert "not a loopback address and no admin token" in done.stderr


def test_a_token_from_a_file_is_nowhere_to_be_read(
    token_file_server: tuple[ServerProcess, str],
) -> None:
    """Not in the command line, not in the environment; the token works, and no answer of
    either port (every GET route, errors, metrics, docs) nor any log line holds it."""
    srv, token = token_file_server
    assert srv.proc is not None
    with open(f"/proc/{srv.proc.pid}/cmdline", "rb") as f:
        assert token.encode() not in f.read()
    with open(f"/proc/{srv.proc.pid}/environ", "rb") as f:
        assert token.encode() not in f.read()
    answers: list[httpx.Response] = []
    with httpx.Client(timeout=5) as c:
        spec = c.get(f"{srv.url}/openapi.json").json()
        for path, item in spec["paths"].items():
            if "get" in item:
                answers.append(c.get(srv.url + path.replace("{job_id}", "1")))
        answers.append(
            c.get(f"{srv.url}/metrics", headers={"accept": "application/openmetrics-text"})
        )
        for headers in ({"authorization": f"Bearer {token}"}, {"authorization": "Bearer nope"}, {}):
            admin_spec = c.get(f"{srv.admin_url}/openapi.json")
            answers.append(admin_spec)
            for path, item in admin_spec.json()["paths"].items():
                if "get" in item:
                    answers.append(c.get(srv.admin_url + path, headers=headers))
            answers.append(
                c.put(f"{srv.admin_url}/admin/v1/policy", json={"name": "arc"}, headers=headers)
            )
            answers.append(
                c.put(f"{srv.admin_url}/admin/v1/log-level", json={"level": "x"}, headers=headers)
            )
    statuses = {r.status_code for r in answers}
    assert {200, 401, 403} <= statuses, statuses
    for r in answers:
        assert token not in r.text, r.request.url
        assert token not in repr(r.headers.multi_items()), r.request.url
    assert token not in srv.log()


NASTY = [
    'evil\n{"level":"error","logger":"kvoffload.audit","event":"forged"}',
    "<script>alert('x')<\\script>",  # no '/': a path segment cannot hold one
    'tab\tquote"back\\slash é \u202e',
    "y" * 256,
]


def test_log_lines_and_exemplars_hold_only_safe_ids(tmp_path: Path) -> None:
    """Calls under hostile engine request ids and ``X-Request-ID`` values: every line the
    process writes is one JSON object, every ``req_id``/``request_id`` in it is safe, the safe
    form of each hostile id is what shows (log and exemplars), the raw form never does."""
    srv = ServerProcess(tmp_path, "--log-level", "info").start()
    try:
        with httpx.Client(base_url=srv.url, timeout=5) as c:
            for i, req_id in enumerate(NASTY):
                path = f"/v1/requests/{quote(req_id, safe='')}"
                header = {"x-request-id": f'hdr {i} "x" <{i}>'}
                assert c.put(path, headers=header).status_code == 201
                r = c.post(f"{path}/lookup", json={"keys": ["00"]}, headers=header)
                assert r.status_code == 200
                assert SAFE_ID.fullmatch(r.headers["x-request-id"])
                assert c.post(f"{path}/lookup", json={"keys": ["zz"]}).status_code == 422
                assert c.delete(path).status_code == 200
            r = c.post("/v1/batch", json={"ops": [{"op": "start_request", "req_id": NASTY[0]}]})
            assert r.status_code == 200
            c.get(f"/nowhere/{quote(NASTY[1], safe='')}")
            metrics = c.get("/metrics", headers={"accept": "application/openmetrics-text"}).text
        status = srv.stop()
    finally:
        srv.kill()
    assert status == 0
    log = srv.log()
    seen: set[str] = set()
    for line in log.splitlines():
        record = json.loads(line)  # one object per line: nothing was injected
        assert isinstance(record, dict), line
        for key in ("req_id", "request_id"):
            if key in record:
                assert SAFE_ID.fullmatch(str(record[key])), (key, record)
                seen.add(str(record[key]))
        assert record.get("event") != "forged", line
    # A series keeps only its latest exemplar: the last hostile id's safe form must be there.
    exemplars = set(re.findall(r'# \{req_id="([^"]*)"\}', metrics))
    assert all(SAFE_ID.fullmatch(e) for e in exemplars), exemplars
    assert safe_req_id(NASTY[-1]) in exemplars, exemplars
    for req_id in NASTY:
        safe = safe_req_id(req_id)
        assert safe in seen, (safe, sorted(seen))
        assert req_id not in log
        assert json.dumps(req_id)[1:-1] not in log  # nor its JSON-escaped form
        assert req_id not in metrics
    for i in range(len(NASTY)):
        assert f"hdr {i}" not in log
