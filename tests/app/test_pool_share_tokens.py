"""The pool socket in tenant mode: the client speaks first with its token and namespace, and the
service hands out that namespace's pool or one refusal line without a descriptor. A client
that says nothing in time, too much, or something unreadable is refused and dropped, without
ever holding up the others; refusals are logged with the peer and the reason, never the token.
A client with credentials still gets the pool from a service in open mode."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from kvoffload_client.pool_socket import MAX_REQUEST_BYTES, PoolShareError, SharedPool, receive_pool

from app.pool_share import PoolShareServer

BLOCKS, BLOCK_BYTES = 4, 4096
TOKEN_A = "token-of-team-a-0001"
TOKEN_B = "token-of-team-b-0002"
TENANTS = {TOKEN_A: {"a"}, TOKEN_B: {"b", "b2"}}


class Refused(Exception):
    """What the service's resolver raises: a ``reason`` code, like app.core.errors'."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"refused: {reason}")
        self.reason = reason


@pytest.fixture(autouse=True)
def no_descriptor_leaks() -> Iterator[None]:
    before = set(os.listdir("/proc/self/fd"))
    yield
    assert set(os.listdir("/proc/self/fd")) <= before, "a descriptor leaked"


@pytest.fixture
def sock_path(tmp_path: Path) -> str:
    return str(tmp_path / "engine.sock.pool")


@pytest.fixture
def pools() -> Iterator[dict[str, SharedPool]]:
    """One pool-sized anonymous file per namespace, each its own pool."""
    out = {}
    for name in ("a", "b", "b2"):
        fd = os.memfd_create(f"pool-{name}", os.MFD_CLOEXEC)
        os.ftruncate(fd, BLOCKS * BLOCK_BYTES)
        out[name] = SharedPool(fd, f"pool-{name}", BLOCKS, BLOCK_BYTES)
    yield out
    for pool in out.values():
        os.close(pool.fd)


def resolver(
    pools: dict[str, SharedPool], seen: list[dict[str, Any]] | None = None
) -> Callable[[dict[str, Any]], SharedPool]:
    """The service's part: token -> tenant, namespace (or the tenant's only one) -> pool."""

    def current(request: dict[str, Any]) -> SharedPool:
        if seen is not None:
            seen.append(request)
        token, namespace = request["token"], request["namespace"]
        if token is None:
            raise Refused("missing_token")
        owned = TENANTS.get(token)
        if owned is None:
            raise Refused("unknown_token")
        if namespace is None:
            if len(owned) != 1:
                raise Refused("namespace_required")
            (namespace,) = owned
        if namespace not in owned:
            raise Refused("namespace_denied")
        return pools[namespace]

    return current


@contextlib.contextmanager
def serving(path: str, current: Callable[..., SharedPool], **options: Any) -> Iterator[None]:
    """A ``PoolShareServer`` on an event loop of its own thread (the test blocks in receive)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path)
    server = PoolShareServer(sock, current, **options)

    async def start() -> None:
        server.start()

    asyncio.run_coroutine_threadsafe(start(), loop).result(5)
    try:
        yield
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(), loop).result(5)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()


def tenant_server(path: str, pools: dict[str, SharedPool], **options: Any) -> Any:
    return serving(path, resolver(pools), read_request=True, **options)


def connect(path: str) -> socket.socket:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.settimeout(10)
    conn.connect(path)
    return conn


def answer_of(conn: socket.socket) -> tuple[bytes, int]:
    """Everything the service sent until it closed, and how many descriptors came along (each
    closed here)."""
    data, fds = b"", 0
    while True:
        try:
            chunk, got, _, _ = socket.recv_fds(conn, 8192, 4)
        except ConnectionResetError:  # it closed with our unread bytes: the answer came first
            break
        for fd in got:
            os.close(fd)
        fds += len(got)
        if not chunk:
            break
        data += chunk
    return data, fds


def refusal(conn: socket.socket) -> str:
    data, fds = answer_of(conn)
    assert fds == 0
    line = data.decode()
    assert line.endswith("\n")
    assert line.count("\n") == 1
    reason: str = json.loads(line)["error"]
    return reason


def written_through(got: SharedPool, pool: SharedPool) -> bool:
    """Whether bytes written through the received descriptor land in ``pool``'s file."""
    try:
        with got.map() as mapped:
            mapped[BLOCK_BYTES : BLOCK_BYTES + 4] = b"mine"
        return os.pread(pool.fd, 4, BLOCK_BYTES) == b"mine"
    finally:
        os.close(got.fd)


# --------------------------------------------------------------------------- credentials


def test_a_good_token_gets_its_namespaces_pool(sock_path: str, pools) -> None:
    seen: list[dict[str, Any]] = []
    with serving(sock_path, resolver(pools, seen), read_request=True):
        got_b2 = receive_pool(sock_path, token=TOKEN_B, namespace="b2")
        got_a = receive_pool(sock_path, token=TOKEN_A)  # the tenant's only namespace
    assert (got_b2.pool_id, got_a.pool_id) == ("pool-b2", "pool-a")
    assert written_through(got_b2, pools["b2"])
    assert os.pread(pools["b"].fd, 4, BLOCK_BYTES) == b"\0" * 4
    assert written_through(got_a, pools["a"])
    assert seen == [
        {"token": TOKEN_B, "namespace": "b2"},
        {"token": TOKEN_A, "namespace": None},
    ]


@pytest.mark.parametrize(
    ("token", "namespace", "reason"),
    [
        ("not-a-known-token-9999", "a", "unknown_token"),
        (TOKEN_A, "b", "namespace_denied"),
        (TOKEN_B, None, "namespace_required"),
        (None, "a", "missing_token"),
    ],
)
def test_a_refusal_is_one_line_without_a_descriptor(
    sock_path: str, pools, caplog, token: str | None, namespace: str | None, reason: str
) -> None:
    caplog.set_level(logging.INFO, logger="kvoffload.pool_share")
    with tenant_server(sock_path, pools):
        with pytest.raises(PoolShareError, match=f"refused to hand out the pool: {reason}") as info:
            receive_pool(sock_path, token=token, namespace=namespace)
        assert info.value.reason == reason
        assert "wants a token" not in str(info.value)  # it did send one
        # The same refusal on the wire: one line, no descriptor, then the end.
        with connect(sock_path) as conn:
            conn.sendall(json.dumps({"token": token, "namespace": namespace}).encode() + b"\n")
            assert refusal(conn) == reason
    refusals = [r for r in caplog.records if r.getMessage() == f"pool request refused: {reason}"]
    assert len(refusals) == 2
    fields = refusals[0].fields
    assert (fields["peer_pid"], fields["peer_uid"], fields["peer_gid"]) == (
        os.getpid(),
        os.getuid(),
        os.getgid(),
    )
    assert fields["reason"] == reason
    for record in caplog.records:
        assert token is None or token not in f"{record.getMessage()} {record.__dict__}"


def test_a_resolver_failure_without_a_reason_is_refused(sock_path: str, pools, caplog) -> None:
    def current(request: dict[str, Any]) -> SharedPool:
        raise KeyError(request["token"])  # its text holds the token: never logged

    with serving(sock_path, current, read_request=True), pytest.raises(PoolShareError) as info:
        receive_pool(sock_path, token=TOKEN_A)
    assert info.value.reason == "refused"
    assert "pool resolver failed: KeyError" in caplog.text
    assert TOKEN_A not in caplog.text


# --------------------------------------------------------------------------- bad clients


def test_a_client_that_says_nothing_is_refused_at_the_deadline(sock_path: str, pools) -> None:
    with tenant_server(sock_path, pools, request_timeout_s=0.2):
        with connect(sock_path) as conn:
            assert refusal(conn) == "request_timeout"
        # A client of open mode (sends nothing) learns why.
        with pytest.raises(PoolShareError, match="wants a token or namespace first") as info:
            receive_pool(sock_path)
        assert info.value.reason == "request_timeout"


def test_a_client_that_dawdles_does_not_hold_up_the_others(sock_path: str, pools) -> None:
    with tenant_server(sock_path, pools, request_timeout_s=30), connect(sock_path) as idle:
        idle.sendall(b'{"token": ')  # and nothing more for now
        got = receive_pool(sock_path, timeout_s=5, token=TOKEN_A)
        os.close(got.fd)
        # The split line, once whole, is read whole.
        idle.sendall(json.dumps(TOKEN_A).encode() + b"}\n")
        data, fds = answer_of(idle)
    assert got.pool_id == "pool-a"
    assert fds == 1
    assert json.loads(data)["pool_id"] == "pool-a"


def test_an_oversized_request_is_refused(sock_path: str, pools) -> None:
    with tenant_server(sock_path, pools):
        with connect(sock_path) as conn:
            conn.sendall(b'{"token": "' + b"x" * MAX_REQUEST_BYTES)
            assert refusal(conn) == "request_too_large"
        # A line of exactly MAX_REQUEST_BYTES, newline included, is still read.
        overhead = len(json.dumps({"token": "", "namespace": None}, separators=(",", ":"))) + 1
        longest = "t" * (MAX_REQUEST_BYTES - overhead)
        with pytest.raises(PoolShareError) as info:
            receive_pool(sock_path, token=longest)
        assert info.value.reason == "unknown_token"
    with pytest.raises(ValueError, match="over 4096 bytes") as too_long:
        receive_pool(sock_path, token=longest + "t")
    assert longest not in str(too_long.value)


@pytest.mark.parametrize(
    "line",
    [b"[1, 2]\n", b"\xff\xfe\n", b'{"token": 5}\n', b'{"namespace": ["a"]}\n', b"\n"],
)
def test_an_unreadable_request_is_refused(sock_path: str, pools, line: bytes) -> None:
    with tenant_server(sock_path, pools), connect(sock_path) as conn:
        conn.sendall(line)
        assert refusal(conn) == "bad_request"


def test_seventy_idle_connections_do_not_starve_a_client(sock_path: str, pools) -> None:
    # Issue #21: 70 connections that send nothing made every receive_pool fail at once
    # (dropped) until they timed out. Now a new connection is always waited on: one peer holds
    # at most MAX_WAITING_PER_PEER waiting connections, its oldest dropped for a newer one.
    with tenant_server(sock_path, pools, request_timeout_s=30):
        idle = [connect(sock_path) for _ in range(70)]
        try:
            for _ in range(5):  # each served at once, the idle ones still open
                got = receive_pool(sock_path, timeout_s=5, token=TOKEN_A)
                assert written_through(got, pools["a"])
            # This process's oldest idle connections were dropped unanswered, its newest wait.
            assert answer_of(idle[0]) == (b"", 0)
            idle[-1].sendall(json.dumps({"token": TOKEN_B, "namespace": "b2"}).encode() + b"\n")
            data, fds = answer_of(idle[-1])
            assert (json.loads(data)["pool_id"], fds) == ("pool-b2", 1)
        finally:
            for conn in idle:
                conn.close()


def test_a_long_line_is_read_only_after_a_descriptor(sock_path: str, pools) -> None:
    with tenant_server(sock_path, pools, register=lambda request, fds: {"n": len(fds)}):
        # No descriptor: held to MAX_REQUEST_BYTES, refused as soon as that much came.
        with connect(sock_path) as conn:
            conn.sendall(b'{"register_kv_cache": {"x": "' + b"x" * MAX_REQUEST_BYTES)
            assert refusal(conn) == "request_too_large"
        # With one, a registration may be longer; the descriptors reach the handler.
        line = json.dumps({"register_kv_cache": {"x": "x" * 3 * MAX_REQUEST_BYTES}}).encode()
        with connect(sock_path) as conn, open(os.devnull, "rb") as f:
            socket.send_fds(conn, [line + b"\n"], [f.fileno(), f.fileno()])
            data, fds = answer_of(conn)
            assert (json.loads(data), fds) == ({"kv_cache": {"n": 2}}, 0)
        # A pool request passes no descriptor.
        with connect(sock_path) as conn, open(os.devnull, "rb") as f:
            socket.send_fds(conn, [json.dumps({"token": TOKEN_A}).encode() + b"\n"], [f.fileno()])
            assert refusal(conn) == "bad_request"


def test_stop_drops_the_connections_still_waiting(sock_path: str, pools) -> None:
    with connect_later(sock_path) as waiting:
        with tenant_server(sock_path, pools, request_timeout_s=30):
            conn = waiting()
            got = receive_pool(sock_path, token=TOKEN_A)  # the server took conn before this
            os.close(got.fd)
        assert answer_of(conn) == (b"", 0)


@contextlib.contextmanager
def connect_later(path: str) -> Iterator[Callable[[], socket.socket]]:
    made: list[socket.socket] = []

    def make() -> socket.socket:
        made.append(connect(path))
        return made[-1]

    try:
        yield make
    finally:
        for conn in made:
            conn.close()


# --------------------------------------------------------------------------- open mode


def test_a_client_with_credentials_gets_the_pool_from_an_open_service(
    sock_path: str, pools
) -> None:
    # The open service answers at once and closes without reading the request: whichever of
    # the two comes first, the client reads the answer.
    with serving(sock_path, lambda: pools["a"]):
        for _ in range(20):
            got = receive_pool(sock_path, token=TOKEN_A, namespace="a")
            assert got.pool_id == "pool-a"
            os.close(got.fd)
        assert written_through(receive_pool(sock_path, token=TOKEN_B), pools["a"])


def test_descriptors_held_by_waiting_connections_are_bounded(
    sock_path: str, pools: dict[str, SharedPool], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Connections that pass descriptors and never end their line hold at most
    ``MAX_PASSED_HELD`` of them together: the oldest such holder is dropped, with what it
    passed, never the newest (a registration sends its descriptors and line at once)."""
    from app import pool_share

    monkeypatch.setattr(pool_share, "MAX_PASSED_HELD", 16)
    spare = os.memfd_create("passed", os.MFD_CLOEXEC)
    conns = []
    try:
        with tenant_server(sock_path, pools, request_timeout_s=30):
            for _ in range(5):
                conn = connect(sock_path)
                socket.send_fds(conn, [b'{"register_kv_cache": {'], [spare] * 8)
                conns.append(conn)
            # Each waiting holder keeps 8; past 16 together the oldest go.
            for conn in conns[:3]:
                assert json.loads(conn.recv(4096) or b'{"error": "closed"}') == {"error": "closed"}
            for conn in conns[3:]:
                conn.settimeout(0.3)
                with pytest.raises(TimeoutError):
                    conn.recv(1)  # still waited on
    finally:
        for conn in conns:
            conn.close()
        os.close(spare)


def test_a_connection_in_the_descriptor_reserve_is_closed_at_once(
    sock_path: str, pools: dict[str, SharedPool], monkeypatch: pytest.MonkeyPatch
) -> None:
    from app import pool_share

    monkeypatch.setattr(pool_share, "in_reserve", lambda fd: True)
    with tenant_server(sock_path, pools):
        conn = connect(sock_path)
        with conn:
            assert conn.recv(1) == b""  # closed unanswered
        with pytest.raises(PoolShareError):
            receive_pool(sock_path, token=TOKEN_A, timeout_s=2)
