"""Issue #42 item 6: the admin listener's caps evict (``app.http.connections``), without a
server. Past a cap, the oldest connection waiting on its client (request not complete, or idle
between requests) is closed for the new one, under that cap (the peer's, else the listener's);
one the app is answering never is; with none to close, the new one is refused. The flood
against a real ``kvoffload serve``: tests/e2e/test_admin_flood.py.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any, cast

import pytest

from app.cli import _build_parser, commands, full_help
from app.http.connections import BODY, HEAD, IDLE, ConnectionGuard, ConnectionLimits
from app.settings import ConfigError, load_settings


class _Transport:
    """A TCP transport from ``host`` that records its abort (``sock``: the socket eviction
    asks for unread bytes, none when None)."""

    def __init__(self, host: str, sock: socket.socket | None = None) -> None:
        self.host = host
        self.sock = sock
        self.aborted = False

    def get_extra_info(self, name: str) -> Any:
        if name == "socket":
            return self.sock
        return (self.host, 40000) if name == "peername" else None

    def abort(self) -> None:
        self.aborted = True


class _Conn:
    """What ``admit`` and the eviction read of a connection (``connection_made`` sets phase
    and start after ``admit``: here they are set first)."""

    def __init__(
        self,
        phase: int,
        since: float,
        host: str,
        keep_alive: bool = False,
        sock: socket.socket | None = None,
    ) -> None:
        self.guard_phase = phase
        self.guard_since = since
        self.guard_peer: str | None = None
        self.transport = _Transport(host, sock)
        self.keep_alive = keep_alive

    def guard_waiting(self) -> bool:
        return self.guard_phase != IDLE or self.keep_alive


def admit(guard: ConnectionGuard, conn: _Conn) -> bool:
    peer = guard.admit(cast(Any, conn), cast(Any, conn.transport))
    conn.guard_peer = peer
    return peer is not None


def test_past_a_peer_s_cap_its_oldest_waiting_connection_makes_room() -> None:
    guard = ConnectionGuard("admin", ConnectionLimits(5.0, 30.0, 4, 2, evict_waiting=True))
    old, newer = _Conn(HEAD, 1.0, "127.0.0.1"), _Conn(BODY, 2.0, "127.0.0.1")
    other = _Conn(HEAD, 0.5, "10.0.0.2")  # older still, but another peer's
    operator = _Conn(HEAD, 3.0, "127.0.0.1")
    assert [admit(guard, c) for c in (old, newer, other)] == [True] * 3
    assert admit(guard, operator)
    assert old.transport.aborted
    assert [c.transport.aborted for c in (newer, other)] == [False, False]
    assert guard.peers == {"127.0.0.1": 2, "10.0.0.2": 1}
    assert guard.open == {cast(Any, c) for c in (newer, other, operator)}
    assert guard.closed["peer_cap"] == 1
    # Its close reaching connection_lost later changes nothing: it was forgotten at once.
    guard.release(cast(Any, old))
    assert guard.peers == {"127.0.0.1": 2, "10.0.0.2": 1}
    assert len(guard.open) == 3


def test_past_the_listener_s_cap_anyone_s_oldest_waiting_connection_makes_room() -> None:
    guard = ConnectionGuard("admin", ConnectionLimits(5.0, 30.0, 3, evict_waiting=True))
    answering = _Conn(IDLE, 0.0, "127.0.0.1")  # the app works on its answer: never closed
    kept = _Conn(IDLE, 1.0, "10.0.0.2", keep_alive=True)  # idle between requests
    silent = _Conn(HEAD, 2.0, "10.0.0.3")
    for conn in (answering, kept, silent):
        assert admit(guard, conn)
    assert admit(guard, _Conn(HEAD, 3.0, "10.0.0.4"))
    assert [c.transport.aborted for c in (kept, answering)] == [True, False]
    assert admit(guard, _Conn(HEAD, 4.0, "10.0.0.5"))
    assert silent.transport.aborted
    assert guard.closed["listener_cap"] == 2
    assert len(guard.open) == 3


@pytest.fixture
def socket_pairs() -> Iterator[list[tuple[socket.socket, socket.socket]]]:
    """Four TCP connections on 127.0.0.1 (accepted side, client side), closed after the test."""
    pairs = []
    with socket.create_server(("127.0.0.1", 0)) as listener:
        for _ in range(4):
            client = socket.create_connection(listener.getsockname())
            pairs.append((listener.accept()[0], client))
    yield pairs
    for pair in pairs:
        for sock in pair:
            sock.close()


def test_a_connection_whose_request_is_unread_is_passed_over_while_another_can_go(
    socket_pairs: list[tuple[socket.socket, socket.socket]],
) -> None:
    # The operator's connection, accepted before a burst of the flood's and its request not
    # read yet, is the oldest waiting: the next silent one goes instead (CI lost a call so).
    (op_srv, op_cli), (a_srv, _a_cli), (b_srv, b_cli), (c_srv, _c_cli) = socket_pairs
    guard = ConnectionGuard("admin", ConnectionLimits(5.0, 30.0, 8, 2, evict_waiting=True))
    operator = _Conn(HEAD, 1.0, "127.0.0.1", sock=op_srv)
    silent = _Conn(HEAD, 2.0, "127.0.0.1", sock=a_srv)
    op_cli.sendall(b"GET /admin/v1/stats HTTP/1.1\r\nHost: x\r\n\r\n")
    assert [admit(guard, c) for c in (operator, silent)] == [True, True]
    assert admit(guard, _Conn(HEAD, 3.0, "127.0.0.1", sock=b_srv))
    assert (operator.transport.aborted, silent.transport.aborted) == (False, True)
    # Once every waiting connection has bytes unread, the oldest of them goes after all.
    b_cli.sendall(b"GET / HTTP/1.1\r\n")
    assert admit(guard, _Conn(HEAD, 4.0, "127.0.0.1", sock=c_srv))
    assert operator.transport.aborted
    assert guard.closed["peer_cap"] == 2


def test_with_nothing_waiting_or_on_the_engine_listener_the_new_connection_is_refused() -> None:
    guard = ConnectionGuard("admin", ConnectionLimits(5.0, 30.0, 2, 1, evict_waiting=True))
    a, b = _Conn(IDLE, 0.0, "127.0.0.1"), _Conn(IDLE, 0.0, "10.0.0.2")
    assert [admit(guard, c) for c in (a, b)] == [True, True]
    assert not admit(guard, _Conn(HEAD, 1.0, "127.0.0.1"))  # its peer's one is answering
    assert not admit(guard, _Conn(HEAD, 1.0, "10.0.0.3"))  # so is everyone's
    assert guard.closed["peer_cap"] == guard.closed["listener_cap"] == 1
    assert [c.transport.aborted for c in (a, b)] == [False, False]
    # The engine listener evicts nothing: past a cap the new connection is closed.
    engine = ConnectionGuard("engine", ConnectionLimits(5.0, 30.0, 2, 1))
    held = _Conn(HEAD, 0.0, "127.0.0.1")
    assert admit(engine, held)
    assert not admit(engine, _Conn(HEAD, 1.0, "127.0.0.1"))
    assert not held.transport.aborted


def test_the_admin_per_peer_cap_is_a_setting_with_its_flag() -> None:
    assert load_settings().admin_max_connections_per_peer == 16
    assert load_settings(admin_max_connections_per_peer=0).admin_max_connections_per_peer == 0
    with pytest.raises(ConfigError) as refused:
        load_settings(admin_max_connections_per_peer=-1)
    assert str(refused.value) == (
        "--admin-max-connections-per-peer / KVOFFLOAD_ADMIN_MAX_CONNECTIONS_PER_PEER = -1: "
        "too small; accepted: an integer at least 0"
    )
    serve = dict(commands(_build_parser()))["kvoffload serve"]
    help_text = full_help(serve)
    assert "--admin-max-connections-per-peer" in help_text
    assert "KVOFFLOAD_ADMIN_MAX_CONNECTIONS_PER_PEER" in help_text
