"""Issue #42 item 6: the admin listener's caps evict (``app.http.connections``), without a
server. Past a cap, the oldest connection waiting on its client (request not complete, or idle
between requests) is closed for the new one, under that cap (the peer's, else the listener's);
one the app is answering never is; with none to close, the new one is refused. The flood
against a real ``kvoffload serve``: tests/e2e/test_admin_flood.py.
"""

from __future__ import annotations

from typing import Any, cast

import pytest

from app.cli import _build_parser, commands, full_help
from app.http.connections import BODY, HEAD, IDLE, ConnectionGuard, ConnectionLimits
from app.settings import ConfigError, load_settings


class _Transport:
    """A TCP transport from ``host`` that records its abort."""

    def __init__(self, host: str) -> None:
        self.host = host
        self.aborted = False

    def get_extra_info(self, name: str) -> Any:
        return (self.host, 40000) if name == "peername" else None

    def abort(self) -> None:
        self.aborted = True


class _Conn:
    """What ``admit`` and the eviction read of a connection (``connection_made`` sets phase
    and start after ``admit``: here they are set first)."""

    def __init__(self, phase: int, since: float, host: str, keep_alive: bool = False) -> None:
        self.guard_phase = phase
        self.guard_since = since
        self.guard_peer: str | None = None
        self.transport = _Transport(host)
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
