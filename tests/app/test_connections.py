"""The listeners' connection bounds (``app.http.connections``) without a server: the caps sized
against the descriptor limit and refused when they do not fit, the settings and their flags,
who counts as one peer, which connections the sweep closes, and that closes are logged once per
interval with a count. The bounds against a real ``kvoffload serve``: tests/e2e/test_slowloris.py.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, cast

import pytest

from app.cli import _build_parser, commands, full_help
from app.http.connections import (
    BODY,
    HEAD,
    IDLE,
    ConnectionGuard,
    ConnectionLimits,
    descriptor_reserve,
    ipv6_peer,
    listener_limits,
)
from app.settings import ConfigError, load_settings
from app.telemetry.logging import fields_of

SETTINGS = (
    "head_timeout_s",
    "body_timeout_s",
    "max_connections",
    "max_connections_per_peer",
    "admin_max_connections",
)


def test_the_engine_cap_is_what_the_descriptor_table_leaves_after_a_reserve_and_the_admin():
    settings = load_settings()
    for soft in (1024, 20000, 1 << 20):
        limits = listener_limits(settings, soft)
        engine, admin = limits["engine"], limits["admin"]
        assert admin.max_connections == 64
        assert engine.max_connections == soft - descriptor_reserve(soft) - 64
        assert engine.max_connections + admin.max_connections < soft
        assert engine.max_per_peer == 256
        assert (admin.max_per_peer, admin.evict_waiting) == (16, True)
        assert engine.spare_reserve
        assert not admin.spare_reserve
        assert (engine.head_timeout_s, engine.body_timeout_s) == (5.0, 30.0)
    assert listener_limits(settings, 20000)["engine"].max_connections == 17436
    assert listener_limits(settings, 1024)["engine"].max_connections == 704


def test_caps_the_descriptor_table_cannot_hold_are_refused_naming_the_setting() -> None:
    with pytest.raises(ConfigError) as refused:
        listener_limits(load_settings(max_connections=20000), 20000)
    assert str(refused.value).startswith(
        "--max-connections / KVOFFLOAD_MAX_CONNECTIONS = 20000: more than the descriptors left"
    )
    assert "accepted: at most 17436" in str(refused.value)
    assert listener_limits(load_settings(max_connections=17436), 20000)
    with pytest.raises(ConfigError, match="--admin-max-connections / KVOFFLOAD_ADMIN_MAX_CONN"):
        listener_limits(load_settings(admin_max_connections=800), 1024)


def test_a_body_bound_shorter_than_the_head_bound_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"--body-timeout-s .* at least --head-timeout-s"):
        load_settings(head_timeout_s=10, body_timeout_s=5)
    assert load_settings(head_timeout_s=5, body_timeout_s=5).body_timeout_s == 5


def test_the_bounds_are_flags_variables_and_config_keys(tmp_path, monkeypatch) -> None:
    serve = dict(commands(_build_parser()))["kvoffload serve"]
    help_text = full_help(serve)  # each option's whole text
    for name in SETTINGS:
        assert "--" + name.replace("_", "-") in help_text
        assert f"KVOFFLOAD_{name.upper()}" in help_text
    monkeypatch.setenv("KVOFFLOAD_MAX_CONNECTIONS_PER_PEER", "8")
    config = tmp_path / "kv.toml"
    config.write_text("head_timeout_s = 2.5\nadmin_max_connections = 16\n")
    settings = load_settings(config=config)
    assert settings.max_connections_per_peer == 8
    assert settings.head_timeout_s == 2.5
    assert settings.admin_max_connections == 16
    with pytest.raises(ConfigError, match="--max-connections-per-peer"):
        load_settings(max_connections_per_peer=-1)


@pytest.mark.parametrize(
    ("host", "peer"),
    [
        ("2001:db8:1:2:3:4:5:6", "2001:db8:1:2::/64"),
        ("2001:db8:1:2:ffff::1", "2001:db8:1:2::/64"),  # the same host, another address
        ("2001:db8:1:3::1", "2001:db8:1:3::/64"),
        ("::ffff:10.0.0.7", "10.0.0.7"),
        ("::1", "::1"),
        ("fe80::1%eth0", "fe80::/64"),
        ("not-an-address", "not-an-address"),
    ],
)
def test_an_ipv6_peer_is_its_64(host: str, peer: str) -> None:
    assert ipv6_peer(host) == peer


class _Conn:
    """What the sweep reads of a connection (and what ``admit`` keeps)."""

    def __init__(self, phase: int = IDLE, since: float = 0.0, peer: str = "10.0.0.1") -> None:
        self.guard_phase = phase
        self.guard_since = since
        self.guard_peer = peer


class _Transport:
    """A TCP transport from ``host``: no socket object, a peer name."""

    def __init__(self, host: str) -> None:
        self.host = host

    def get_extra_info(self, name: str) -> Any:
        return (self.host, 40000) if name == "peername" else None


def test_the_sweep_closes_heads_and_bodies_past_their_bound_never_an_idle_connection() -> None:
    guard = ConnectionGuard("engine", ConnectionLimits(1.0, 3.0, 100))
    conns = {
        "fresh head": _Conn(HEAD, 9.5),
        "old head": _Conn(HEAD, 8.0),
        "fresh body": _Conn(BODY, 8.0),
        "old body": _Conn(BODY, 6.0),
        "idle": _Conn(IDLE, 0.0),  # between requests, or the app answering: uvicorn's affair
    }
    guard.open = cast(Any, set(conns.values()))
    names = {id(conn): name for name, conn in conns.items()}
    expired = {(names[id(c)], reason) for c, reason in guard.expired(10.0)}
    assert expired == {("old head", "head_timeout"), ("old body", "body_timeout")}


def test_a_sweep_late_from_a_stalled_loop_closes_nothing_that_round() -> None:
    # The loop runs due timers before it reads sockets: after a stall, heads that arrived
    # meanwhile are unread, and a connection past its bound may have sent one.
    guard = ConnectionGuard("engine", ConnectionLimits(0.2, 0.2, 10))  # sweeps every 50 ms
    aborted: list[float] = []

    class _Aborts:
        def abort(self) -> None:
            aborted.append(time.monotonic())

    async def run() -> None:
        conn = _Conn(HEAD, asyncio.get_running_loop().time())
        cast(Any, conn).transport = _Aborts()
        guard.open = cast(Any, {conn})
        guard.start()
        time.sleep(0.5)  # the loop stalls; the head's bound (0.2 s) passes meanwhile
        await asyncio.sleep(0.01)  # the late sweep ran: nothing closed
        assert aborted == []
        for _ in range(200):  # the next sweep, on time, closes it
            if aborted:
                break
            await asyncio.sleep(0.01)
        guard.stop()

    asyncio.run(run())
    assert len(aborted) == 1
    assert guard.closed["head_timeout"] == 1


def test_caps_refuse_past_the_peer_s_and_the_listener_s_and_release_gives_room_back() -> None:
    guard = ConnectionGuard("engine", ConnectionLimits(5.0, 30.0, 3, max_per_peer=2))
    a1, a2, a3, b1, c1 = (_Conn() for _ in range(5))
    assert guard.admit(cast(Any, a1), cast(Any, _Transport("10.0.0.1"))) == "10.0.0.1"
    assert guard.admit(cast(Any, a2), cast(Any, _Transport("10.0.0.1"))) == "10.0.0.1"
    assert guard.admit(cast(Any, a3), cast(Any, _Transport("10.0.0.1"))) is None  # peer_cap
    assert guard.admit(cast(Any, b1), cast(Any, _Transport("10.0.0.2"))) == "10.0.0.2"
    assert guard.admit(cast(Any, c1), cast(Any, _Transport("10.0.0.3"))) is None  # listener_cap
    assert guard.closed == {"head_timeout": 0, "body_timeout": 0, "peer_cap": 1, "listener_cap": 1}
    guard.release(cast(Any, a1))
    assert guard.peers == {"10.0.0.1": 1, "10.0.0.2": 1}
    assert guard.admit(cast(Any, c1), cast(Any, _Transport("10.0.0.3"))) == "10.0.0.3"
    counts = guard.counts()
    assert (counts.listener, counts.open, counts.limit) == ("engine", 3, 3)


def test_closes_are_logged_at_most_once_per_interval_and_reason_with_a_count(
    caplog: pytest.LogCaptureFixture,
) -> None:
    guard = ConnectionGuard(
        "engine", ConnectionLimits(0.2, 0.2, 1, max_per_peer=1), log_interval_s=0.4
    )
    held = _Conn()
    flood = [_Conn() for _ in range(500)]

    async def run() -> None:
        guard.start()  # sweeps every 50 ms
        assert guard.admit(cast(Any, held), cast(Any, _Transport("10.0.0.1")))
        for conn in flood[:300]:  # a peer over its cap, 300 times
            guard.admit(cast(Any, conn), cast(Any, _Transport("10.0.0.1")))
        for conn in flood[300:]:  # others while the listener is full, 200 times
            guard.admit(cast(Any, conn), cast(Any, _Transport("10.0.0.9")))
        await asyncio.sleep(0.15)  # a sweep or two: one line per reason, with its count
        for conn in flood[:50]:
            guard.admit(cast(Any, conn), cast(Any, _Transport("10.0.0.1")))
        await asyncio.sleep(0.1)  # within the interval: nothing more written
        assert len(lines()) == 2
        guard.stop()  # what is left is written at the stop

    def lines() -> list[dict[str, Any]]:
        return [fields_of(r) for r in caplog.records if r.getMessage() == "connections closed"]

    with caplog.at_level(logging.WARNING, logger="kvoffload.connections"):
        asyncio.run(run())
    got = [(ln["reason"], ln["count"], ln["last_peer"]) for ln in lines()]
    assert got == [
        ("peer_cap", 300, "10.0.0.1"),
        ("listener_cap", 200, "10.0.0.9"),
        ("peer_cap", 50, "10.0.0.1"),
    ]
    assert {ln["listener"] for ln in lines()} == {"engine"}
