"""The pool socket: a receiver maps the sender's pool read-write through the descriptor it gets;
every bad answer (no socket, nobody listening, a socket that never answers, a truncated, foreign
or lying header, descriptors missing or extra) is a ``PoolShareError`` quickly, with no
descriptor left open; the settings that place the socket; ``HostPool``'s passable descriptor."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from kvoffload_client.pool_socket import (
    MAX_HEADER_BYTES,
    PROTOCOL,
    PoolShareError,
    SharedPool,
    receive_pool,
)

from app.pool_share import PoolShareServer
from app.settings import Settings
from transfer import HostPool, PoolError

BLOCKS, BLOCK_BYTES = 8, 4096
ROOT = Path(__file__).resolve().parents[2]


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


@pytest.fixture(autouse=True)
def no_descriptor_leaks() -> Iterator[None]:
    """Set up first, checked last: after every server thread and fixture closed its own."""
    before = open_fds()
    yield
    assert open_fds() <= before, "a descriptor leaked"


@pytest.fixture
def sock_path(tmp_path: Path) -> str:
    return str(tmp_path / "engine.sock.pool")


@pytest.fixture
def memfd() -> Iterator[int]:
    """A pool-sized anonymous file (the sender's side)."""
    fd = os.memfd_create("pool-share-test", os.MFD_CLOEXEC)
    os.ftruncate(fd, BLOCKS * BLOCK_BYTES)
    yield fd
    os.close(fd)


def listening(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path)
    return sock


@contextlib.contextmanager
def share_server(path: str, current: Callable[[], SharedPool]) -> Iterator[PoolShareServer]:
    """A ``PoolShareServer`` on an event loop of its own thread (the test blocks in receive)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    server = PoolShareServer(listening(path), current)

    async def start() -> None:
        server.start()

    asyncio.run_coroutine_threadsafe(start(), loop).result(5)
    try:
        yield server
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(), loop).result(5)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()


@contextlib.contextmanager
def raw_server(path: str, answer: Callable[[socket.socket], None]) -> Iterator[None]:
    """Accept one connection, let ``answer`` speak on it, close it."""
    sock = listening(path)
    sock.listen(1)
    sock.settimeout(10)

    def run() -> None:
        with contextlib.suppress(OSError):
            conn, _ = sock.accept()
            with conn:
                answer(conn)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield
    finally:
        thread.join(10)
        sock.close()


def header(**fields: object) -> bytes:
    body: dict[str, object] = {
        "protocol": PROTOCOL,
        "pool_id": "p1",
        "num_blocks": BLOCKS,
        "block_bytes": BLOCK_BYTES,
        "offset": 0,
    }
    body.update(fields)
    return json.dumps(body).encode() + b"\n"


def refused(path: str, match: str, timeout_s: float = 5.0) -> PoolShareError:
    with pytest.raises(PoolShareError, match=match) as info:
        receive_pool(path, timeout_s=timeout_s)
    return info.value


# --------------------------------------------------------------------------- the happy path


def test_receiver_maps_the_senders_memory_read_write(sock_path: str, memfd: int) -> None:
    offered = SharedPool(memfd, "pool-a", BLOCKS, BLOCK_BYTES)
    with share_server(sock_path, lambda: offered):
        got = receive_pool(sock_path)
    try:
        assert (got.pool_id, got.num_blocks, got.block_bytes, got.offset) == (
            "pool-a",
            BLOCKS,
            BLOCK_BYTES,
            0,
        )
        assert got.fd != memfd
        assert not os.get_inheritable(got.fd)
        with got.map() as mapped:
            mapped[3 * BLOCK_BYTES : 3 * BLOCK_BYTES + 5] = b"hello"
            assert os.pread(memfd, 5, 3 * BLOCK_BYTES) == b"hello"
            os.pwrite(memfd, b"back", 7 * BLOCK_BYTES)
            assert mapped[7 * BLOCK_BYTES : 7 * BLOCK_BYTES + 4] == b"back"
    finally:
        os.close(got.fd)


def test_every_connection_gets_the_pool_current_at_that_time(sock_path: str, memfd: int) -> None:
    ids = iter(["first", "second"])

    def current() -> SharedPool:
        return SharedPool(memfd, next(ids), BLOCKS, BLOCK_BYTES)

    with share_server(sock_path, current):
        pools = [receive_pool(sock_path), receive_pool(sock_path)]
    for pool in pools:
        os.close(pool.fd)
    assert [p.pool_id for p in pools] == ["first", "second"]


def test_a_client_that_never_reads_does_not_hold_up_the_next(sock_path: str, memfd: int) -> None:
    offered = SharedPool(memfd, "pool-a", BLOCKS, BLOCK_BYTES)
    with share_server(sock_path, lambda: offered):
        idle = [socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(3)]
        for s in idle:
            s.connect(sock_path)
        got = receive_pool(sock_path, timeout_s=5)
        os.close(got.fd)
        for s in idle:
            s.close()
    assert got.pool_id == "pool-a"


def test_no_pool_closes_the_connection_without_an_answer(sock_path: str) -> None:
    def current() -> SharedPool:
        raise RuntimeError("service is stopping")

    with share_server(sock_path, current):
        refused(sock_path, "closed the connection without a pool header")


def test_stop_closes_the_socket(sock_path: str, memfd: int) -> None:
    offered = SharedPool(memfd, "pool-a", BLOCKS, BLOCK_BYTES)
    with share_server(sock_path, lambda: offered):
        pass
    refused(sock_path, "nobody listens")  # the file is the caller's to remove


# --------------------------------------------------------------------------- bad sockets


def test_missing_socket(sock_path: str) -> None:
    refused(sock_path, "no pool socket at")


def test_stale_socket_nobody_listens(sock_path: str) -> None:
    with listening(sock_path):  # bound, never listening: what a killed service leaves
        refused(sock_path, "nobody listens")


def test_a_socket_that_never_answers_times_out(sock_path: str) -> None:
    # The engine API's socket: an HTTP server waits for a request and says nothing.
    with listening(sock_path) as sock:
        sock.listen(1)
        refused(sock_path, "not a kvoffload pool socket", timeout_s=0.3)


def test_timeout_must_be_positive(sock_path: str) -> None:
    with pytest.raises(ValueError, match="timeout_s"):
        receive_pool(sock_path, timeout_s=0)


# --------------------------------------------------------------------------- bad answers


def test_an_http_answer_is_not_a_pool_header(sock_path: str) -> None:
    def answer(conn: socket.socket) -> None:
        conn.sendall(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n")

    with raw_server(sock_path, answer):
        refused(sock_path, "not a kvoffload pool header")


def test_truncated_header(sock_path: str, memfd: int) -> None:
    def answer(conn: socket.socket) -> None:
        socket.send_fds(conn, [header()[:20]], [memfd])

    with raw_server(sock_path, answer):
        refused(sock_path, "truncated pool header")


def test_a_header_split_over_several_writes_is_read_whole(sock_path: str, memfd: int) -> None:
    def answer(conn: socket.socket) -> None:
        line = header()
        socket.send_fds(conn, [line[:10]], [memfd])
        time.sleep(0.05)
        conn.sendall(line[10:])

    with raw_server(sock_path, answer):
        got = receive_pool(sock_path)
    os.close(got.fd)
    assert got.pool_id == "p1"


def test_oversized_header(sock_path: str) -> None:
    def answer(conn: socket.socket) -> None:
        with contextlib.suppress(OSError):
            conn.sendall(b"x" * (MAX_HEADER_BYTES + 10))

    with raw_server(sock_path, answer):
        refused(sock_path, f"over {MAX_HEADER_BYTES} bytes")


@pytest.mark.parametrize(
    ("line", "match"),
    [
        (header(protocol="kvoffload-pool/2"), "speaks kvoffload-pool/2"),
        (header(protocol="other"), "not a kvoffload pool header"),
        (b"[1, 2]\n", "not a kvoffload pool header"),
        (b"\xff\xfe\n", "not a kvoffload pool header"),
        (header(pool_id=""), "no pool_id"),
        (header(pool_id=7), "no pool_id"),
        (header(num_blocks=0), "invalid num_blocks"),
        (header(block_bytes="4096"), "invalid block_bytes"),
        (header(block_bytes=True), "invalid block_bytes"),
        (header(offset=-1), "invalid offset"),
        (header(num_blocks=BLOCKS + 1), "header says 0 \\+ 9 x 4096"),
        (header(offset=BLOCK_BYTES), "has 32768 bytes"),
    ],
)
def test_invalid_or_lying_headers(sock_path: str, memfd: int, line: bytes, match: str) -> None:
    def answer(conn: socket.socket) -> None:
        socket.send_fds(conn, [line], [memfd])

    with raw_server(sock_path, answer):
        refused(sock_path, match)


def test_no_descriptor(sock_path: str) -> None:
    def answer(conn: socket.socket) -> None:
        conn.sendall(header())

    with raw_server(sock_path, answer):
        refused(sock_path, "0 descriptors")


def test_two_descriptors_are_both_closed(sock_path: str, memfd: int) -> None:
    def answer(conn: socket.socket) -> None:
        socket.send_fds(conn, [header()], [memfd, memfd])

    with raw_server(sock_path, answer):
        refused(sock_path, "2 descriptors")


def test_a_descriptor_that_is_not_a_file(sock_path: str) -> None:
    left, right = socket.socketpair()

    def answer(conn: socket.socket) -> None:
        socket.send_fds(conn, [header()], [left.fileno()])

    with left, right, raw_server(sock_path, answer):
        refused(sock_path, "not a regular file")


def test_the_module_needs_only_the_standard_library() -> None:
    """Engines import the pool socket's client: no web framework, torch or third-party package
    comes along (not even httpx, which the engine side's clients use)."""
    code = (
        "import sys; before = set(sys.modules); import kvoffload_client.pool_socket; "
        "new = {m.split('.')[0] for m in set(sys.modules) - before}; "
        "print(sorted(new - set(sys.stdlib_module_names)))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.replace("'", '"')) == ["kvoffload_client"]


# --------------------------------------------------------------------------- HostPool


def test_host_pool_descriptor_maps_read_write_elsewhere(sock_path: str) -> None:
    pool = HostPool.create(BLOCKS, BLOCK_BYTES, pin=False)
    other = HostPool.create(BLOCKS, BLOCK_BYTES, pin=False)
    try:
        assert pool.pool_id != other.pool_id
        offered = SharedPool(pool.fd, pool.pool_id, pool.num_blocks, pool.block_bytes)
        with share_server(sock_path, lambda: offered):
            got = receive_pool(sock_path)
        with got.map() as mapped:
            os.close(got.fd)
            mapped[BLOCK_BYTES : BLOCK_BYTES + 3] = b"abc"
            assert bytes(pool.tensor[1, :3].tolist()) == b"abc"
            pool.tensor[2, 0] = 42
            assert mapped[2 * BLOCK_BYTES] == 42
            pool.close()
            with pytest.raises(PoolError, match="closed"):
                _ = pool.fd
            # The receiver's mapping keeps the memory alive after the service let go of it.
            assert mapped[BLOCK_BYTES : BLOCK_BYTES + 3] == b"abc"
    finally:
        pool.close()
        other.close()


# --------------------------------------------------------------------------- settings


def test_pool_socket_defaults_next_to_the_engine_socket(monkeypatch, tmp_path: Path) -> None:
    assert Settings().effective_pool_socket is None
    uds = tmp_path / "engine.sock"
    assert Settings(uds=uds).effective_pool_socket == tmp_path / "engine.sock.pool"
    explicit = tmp_path / "elsewhere.sock"
    assert Settings(uds=uds, pool_socket=explicit).effective_pool_socket == explicit
    assert Settings(pool_socket=explicit).effective_pool_socket == explicit
    monkeypatch.setenv("KVOFFLOAD_POOL_SOCKET", str(explicit))
    assert Settings().effective_pool_socket == explicit
    monkeypatch.delenv("KVOFFLOAD_POOL_SOCKET")
    config = tmp_path / "kv.toml"
    config.write_text(f'pool_socket = "{explicit}"\n')
    assert Settings(config=config).effective_pool_socket == explicit


def test_pool_socket_cannot_be_the_engine_socket(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"the engine socket.s path"):
        Settings(uds=tmp_path / "a.sock", pool_socket=tmp_path / "a.sock")
