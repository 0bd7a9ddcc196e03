"""A slowloris without a token against a real ``kvoffload serve``, over TCP and the Unix socket,
and the connection caps (``app.http.connections``).

- The attack (``tests.load.slowloris``, a process of its own) holds silent and partial-head
  connections on both, reopening each one the server closes; meanwhile a tenant's lookups
  (TCP and Unix socket), ``/readyz`` and the admin listener answer. The server closes every
  attack connection once its head bound (1 s here) passes, counts it
  (``kvoffload_connections_closed_total{reason="head_timeout"}``) and logs the closes in a
  few lines with counts, never one per connection.
- A kept-alive connection's next head, and a trickled body, are bounded too.
- Per-peer cap (8): the ninth connection of a peer (127.0.0.1 on TCP, a uid on the Unix socket)
  is closed at once, while another peer (127.0.0.2) is served; listener cap (12): the next
  connection of anyone is closed at once while the admin listener answers.

The bounds are given as ``KVOFFLOAD_*`` variables, not flags, so that a service without them
(which ignores unknown variables) starts, and fails these tests for what it does, not for a
flag it does not know. Timing asserts are "closed within a generous deadline" only.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from kvoffload_client.client import KVOffloadClient

from tests.app.exposition import OPENMETRICS, Exposition, parse
from tests.load.slowloris import Target
from testsupport.polling import until
from testsupport.server import ROOT, TOKEN, ServerProcess

TENANT_TOKEN = "slowloris-e2e-token-000000001"
COUNT = 40  # per transport and kind: 160 attack connections open at once
ATTACK_S = 6.0
HEAD_TIMEOUT_S = 1.0
BODY_TIMEOUT_S = 2.0
CLOSED_WITHIN_S = 15.0  # generous: the bound is 1 s (30 s for the caps' held connections)
AT_ONCE_S = 5.0  # a refusal is immediate; this only bounds a test that would hang on old code


def tenants_dir(tmp_path: Path) -> Path:
    """One tenant, one namespace: the legitimate engine's credentials."""
    d = tmp_path / "tenants"
    d.mkdir()
    path = d / "alpha.toml"
    path.write_text(f'tokens = ["{TENANT_TOKEN}"]\nnamespaces = {{ a1 = 16 }}\n')
    os.chmod(path, 0o600)
    return d


def bounds(**extra: str) -> dict[str, str]:
    """The connection bounds as variables: 1 s head, 2 s body, and ``extra``."""
    env = {"KVOFFLOAD_HEAD_TIMEOUT_S": str(HEAD_TIMEOUT_S)}
    env["KVOFFLOAD_BODY_TIMEOUT_S"] = str(BODY_TIMEOUT_S)
    env.update({f"KVOFFLOAD_{k.upper()}": v for k, v in extra.items()})
    return env


def closed_by_server(sock: socket.socket, within_s: float) -> float | None:
    """Seconds until the server closed ``sock`` (EOF or reset), reading and dropping anything
    it answered first; None if still open after ``within_s``."""
    start = time.monotonic()
    sock.settimeout(0.2)
    while time.monotonic() - start < within_s:
        try:
            if sock.recv(65536) == b"":
                return time.monotonic() - start
        except TimeoutError:
            continue
        except OSError:
            return time.monotonic() - start
    return None


def closed_among(socks: list[socket.socket], expected: int, within_s: float) -> list[socket.socket]:
    """The sockets of ``socks`` the server closed, waiting up to ``within_s`` for ``expected``
    of them (then no longer)."""
    gone: list[socket.socket] = []
    deadline = time.monotonic() + within_s
    while len(gone) < expected and time.monotonic() < deadline:
        ready, _, _ = select.select([s for s in socks if s not in gone], [], [], 0.1)
        gone += [s for s in ready if not still_open(s)]
    return gone


def still_open(sock: socket.socket) -> bool:
    """True when nothing says the server closed ``sock`` (no EOF, no reset, nothing to read)."""
    ready, _, _ = select.select([sock], [], [], 0)
    if not ready:
        return True
    try:
        return sock.recv(1, socket.MSG_PEEK) != b""
    except OSError:
        return False


def metrics(url: str, transport: httpx.HTTPTransport | None = None) -> Exposition:
    with httpx.Client(transport=transport, timeout=10) as client:
        r = client.get(f"{url}/metrics", headers={"accept": OPENMETRICS})
    assert r.status_code == 200, r.text
    return parse(r.text)


def closed(ex: Exposition, reason: str, listener: str = "engine") -> float:
    value = ex.value("kvoffload_connections_closed_total", listener=listener, reason=reason)
    assert value is not None, f"no kvoffload_connections_closed_total{{reason={reason!r}}}"
    return value


def close_lines(srv: ServerProcess) -> list[dict[str, Any]]:
    """The server's "connections closed" log lines."""
    lines = []
    for text in srv.log().splitlines():
        with contextlib.suppress(ValueError):
            line = json.loads(text)
            if line.get("event") == "connections closed":
                lines.append(line)
    return lines


@contextlib.contextmanager
def attack(srv: ServerProcess, seconds: float) -> Iterator[subprocess.Popen[str]]:
    """``tests.load.slowloris`` against ``srv`` (TCP and Unix socket) in a process of its own,
    yielded once every connection is open; killed if the test leaves early."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.load.slowloris",
            "--tcp",
            f"127.0.0.1:{srv.port}",
            "--uds",
            str(srv.uds),
            "--count",
            str(COUNT),
            "--seconds",
            str(seconds),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 30)
        assert ready, "the attack did not start within 30 s"
        assert proc.stdout.readline().strip() == "ready"
        yield proc
    finally:
        if proc.poll() is None and sys.exc_info()[0] is not None:
            proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(seconds + 30)


def test_a_slowloris_without_a_token_is_closed_and_the_service_keeps_answering(
    tmp_path: Path,
) -> None:
    srv = ServerProcess(tmp_path, "--tenants", str(tenants_dir(tmp_path)), env=bounds())
    with srv.serving():
        began = time.monotonic()
        with attack(srv, ATTACK_S) as proc:
            started = time.monotonic()
            calls = 0
            slowest = 0.0
            with (
                KVOffloadClient(srv.url, token=TENANT_TOKEN) as tcp,
                KVOffloadClient(uds=str(srv.uds), token=TENANT_TOKEN) as uds,
                httpx.Client(timeout=10) as plain,
            ):
                tcp.start_request("legit")
                # Across the attack's bound several times over: the server closing attack
                # connections (and the attacker reopening them) while these are served.
                while time.monotonic() - started < ATTACK_S - 1:
                    t0 = time.monotonic()
                    assert tcp.lookup("legit", [b"\x01", b"\x02"]).hit_prefix == 0
                    assert uds.lookup("legit", [b"\x01"]).hit_prefix == 0
                    assert plain.get(f"{srv.url}/readyz").status_code == 200
                    assert plain.get(f"{srv.admin_url}/livez").status_code == 200
                    tenants = plain.get(
                        f"{srv.admin_url}/admin/v1/tenants",
                        headers={"Authorization": f"Bearer {TOKEN}"},
                    )
                    assert tenants.status_code == 200, tenants.text
                    slowest = max(slowest, time.monotonic() - t0)
                    calls += 1
                    time.sleep(0.2)
            out, _ = proc.communicate(timeout=ATTACK_S + 30)
        report = json.loads(out.splitlines()[-1])
        ex = metrics(srv.url)
    served_s = time.monotonic() - began
    print(f"\nlegit rounds during the attack: {calls}, slowest round {slowest * 1e3:.0f} ms")
    for key, tally in report.items():
        print(f"{key}: {tally}")
    print(
        "time to close a silent connection (head bound 1 s): median "
        f"{report['tcp/silent']['lifetime_median_s']} s (TCP), "
        f"{report['uds/silent']['lifetime_median_s']} s (Unix socket)"
    )
    assert calls >= 3
    seen = 0
    for key in ("tcp/silent", "tcp/partial", "uds/silent", "uds/partial"):
        tally = report[key]
        assert tally["connect_failed"] == 0, (key, tally)
        # Every connection of the first generation closed by the server (the attacker then
        # reopened it); none refused at once: the caps are far away, the head bound did it.
        assert tally["closed_by_server"] >= COUNT, (key, tally)
        assert tally["refused"] == 0, (key, tally)
        assert tally["lifetime_max_s"] < CLOSED_WITHIN_S, (key, tally)
        seen += tally["closed_by_server"]
    opened = sum(tally["opened"] for tally in report.values())
    # The server counts what it closed; the attacker saw most of it (not the last closes
    # racing its own at the end).
    head = closed(ex, "head_timeout")
    assert seen <= head <= opened
    assert closed(ex, "peer_cap") == closed(ex, "listener_cap") == 0
    lines = [ln for ln in close_lines(srv) if ln["reason"] == "head_timeout"]
    # One line per 10 s at most (and one at the stop), each with a count: never one per
    # connection. Every close is in them (a sweep may still have caught a connection the
    # attacker was closing after the scrape).
    assert 1 <= len(lines) <= 2 + int(served_s / 10), lines
    assert head <= sum(int(ln["count"]) for ln in lines) <= opened
    assert {ln["listener"] for ln in lines} == {"engine"}


def test_a_kept_alive_connection_s_next_head_and_a_trickled_body_are_bounded(
    tmp_path: Path,
) -> None:
    srv = ServerProcess(tmp_path, env=bounds())
    with srv.serving():
        tcp = Target.tcp(f"127.0.0.1:{srv.port}")
        with contextlib.closing(tcp.connect()) as sock:
            sock.setblocking(True)
            sock.sendall(b"GET /livez HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            assert sock.recv(65536).startswith(b"HTTP/1.1 200")
            sock.sendall(b"GET /livez HTTP/1.1\r\nHo")  # the next head, never finished
            assert closed_by_server(sock, CLOSED_WITHIN_S) is not None
        with contextlib.closing(tcp.connect()) as sock:
            sock.setblocking(True)
            sock.sendall(
                b"POST /v1/requests/r/lookup HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{"
            )
            start = time.monotonic()
            gone = None
            while gone is None and time.monotonic() - start < CLOSED_WITHIN_S:
                with contextlib.suppress(OSError):
                    sock.send(b" ")  # progress, a byte at a time: the body's bound still holds
                gone = closed_by_server(sock, 0.3)
            assert gone is not None
        # Idle between requests: uvicorn's keep-alive timeout (5 s) closes it, uncounted.
        with contextlib.closing(tcp.connect()) as sock:
            sock.setblocking(True)
            sock.sendall(b"GET /livez HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            assert sock.recv(65536).startswith(b"HTTP/1.1 200")
            assert closed_by_server(sock, CLOSED_WITHIN_S) is not None
        ex = metrics(srv.url)
    assert closed(ex, "head_timeout") == 1
    assert closed(ex, "body_timeout") == 1


@pytest.fixture(scope="module")
def capped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A server whose engine listener holds 8 connections per peer and 12 in all; the head
    bound is long (30 s): what closes connections here is a cap."""
    env = {
        "KVOFFLOAD_HEAD_TIMEOUT_S": "30",
        "KVOFFLOAD_BODY_TIMEOUT_S": "30",
        "KVOFFLOAD_MAX_CONNECTIONS_PER_PEER": "8",
        "KVOFFLOAD_MAX_CONNECTIONS": "12",
    }
    with ServerProcess(tmp_path_factory.mktemp("capped"), env=env).serving() as srv:
        yield srv


def other_peer() -> httpx.HTTPTransport:
    """A client transport from 127.0.0.2: another peer of a listener on 127.0.0.1."""
    return httpx.HTTPTransport(local_address="127.0.0.2")


def wait_released(srv: ServerProcess) -> Exposition:
    """Until the engine listener holds no connection but the scrape asking (from 127.0.0.2):
    the closes of connections a test let go have reached the server. The last scrape (at once
    from a service without the gauge: there the test fails on what it checks next)."""

    def quiet() -> Exposition | None:
        ex = metrics(srv.url, other_peer())
        held = ex.value("kvoffload_connections_open", listener="engine")
        return ex if held is None or held == 1 else None

    return until("the engine listener's connections released", quiet, CLOSED_WITHIN_S)


def wait_until_served(srv: ServerProcess) -> None:
    """Until the engine listener serves 127.0.0.1 again (the held connections' closes have
    reached the server)."""
    until(
        "the engine listener serving 127.0.0.1 again",
        lambda: httpx.get(f"{srv.url}/readyz", timeout=2).status_code == 200 or None,
        within_s=CLOSED_WITHIN_S,
    )


def test_past_its_cap_a_peer_s_next_connection_is_closed_at_once(capped: ServerProcess) -> None:
    tcp, uds = Target.tcp(f"127.0.0.1:{capped.port}"), Target.unix(capped.uds)
    before = wait_released(capped)
    held = [tcp.connect() for _ in range(8)]
    try:
        extra = tcp.connect()
        with contextlib.closing(extra):
            assert closed_by_server(extra, AT_ONCE_S) is not None, "a 9th from 127.0.0.1"
        # Another peer is served meanwhile, and the admin listener answers.
        with httpx.Client(transport=other_peer(), timeout=10) as other:
            assert other.get(f"{capped.url}/readyz").status_code == 200
        admin = httpx.get(
            f"{capped.admin_url}/admin/v1/stats",
            headers={"Authorization": f"Bearer {TOKEN}"},
            timeout=10,
        )
        assert admin.status_code == 200
        assert all(still_open(s) for s in held)
    finally:
        for s in held:
            s.close()
    # The Unix socket: its peer is the uid (this test's own, as every local caller here).
    wait_released(capped)  # under the listener's cap of 12 again
    held = [uds.connect() for _ in range(8)]
    try:
        extra = uds.connect()
        with contextlib.closing(extra):
            assert closed_by_server(extra, AT_ONCE_S) is not None, "a 9th from this uid"
        assert all(still_open(s) for s in held)
    finally:
        for s in held:
            s.close()
    wait_until_served(capped)
    after = wait_released(capped)
    assert closed(after, "peer_cap") - closed(before, "peer_cap") == 2
    assert closed(after, "listener_cap") == closed(before, "listener_cap")


def test_past_the_listener_cap_every_next_connection_is_closed_and_the_admin_listener_answers(
    capped: ServerProcess,
) -> None:
    tcp, uds = Target.tcp(f"127.0.0.1:{capped.port}"), Target.unix(capped.uds)
    before = wait_released(capped)
    time.sleep(0.2)  # that scrape's own close reaching the server: nothing signals it
    # 14 connections, 7 on each transport (neither peer at its own cap of 8): 2 past the
    # listener's 12. Which 2 is the server's accept order across its two sockets.
    conns = [tcp.connect() for _ in range(7)] + [uds.connect() for _ in range(7)]
    try:
        refused = closed_among(conns, 2, AT_ONCE_S)
        assert len(refused) == 2, f"{len(refused)} of 14 closed at once"
        held = [s for s in conns if s not in refused]
        with (
            httpx.Client(transport=other_peer(), timeout=10) as other,
            pytest.raises(httpx.TransportError),
        ):
            other.get(f"{capped.url}/readyz")
        # The admin listener has its own connections and descriptors.
        with httpx.Client(timeout=10) as admin:
            assert admin.get(f"{capped.admin_url}/livez").status_code == 200
            stats = admin.get(
                f"{capped.admin_url}/admin/v1/stats", headers={"Authorization": f"Bearer {TOKEN}"}
            )
            assert stats.status_code == 200
        assert all(still_open(s) for s in held)
    finally:
        for s in conns:
            s.close()
    wait_until_served(capped)
    after = wait_released(capped)
    assert closed(after, "listener_cap") - closed(before, "listener_cap") == 3
    assert closed(after, "peer_cap") == closed(before, "peer_cap")
    assert after.value("kvoffload_connections_max", listener="engine") == 12
    assert after.value("kvoffload_connections_max", listener="admin") == 64
    assert closed(after, "listener_cap", listener="admin") == 0
