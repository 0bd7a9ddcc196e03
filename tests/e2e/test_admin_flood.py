"""Issue #42 item 6: a local user without a token floods the admin listener of a real
``kvoffload serve`` with silent and partial-head connections from 127.0.0.1 (the peer every
local TCP client shares), reopening each one the server closes, more than the listener's cap;
meanwhile the operator's admin calls, each on a new connection, are answered.

The kernel hands the admin listener a connection only once its first bytes arrived
(``TCP_DEFER_ACCEPT``, ``app.server.defer_accept``): the silent ones take no slot. Past a cap
the admin listener closes its oldest connection still waiting on its client whose bytes are all
read, not the new one (``app.http.connections``): the flood evicts its own partial heads, the
operator's call arrives with its request and is read and answered. CI once lost one call in 30
before the deferral: under load the operator's connection was accepted before its request
came, and the peer's cap of the flood's reopened silent connections landed after it. The head
bound is long (30 s), so what frees a slot here is the eviction, not the timeout. Successes
are counted; nothing is timed.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.test_slowloris import closed, closed_by_server, metrics
from testsupport.server import ROOT, TOKEN, ServerProcess

COUNT = 40  # per kind: 80 attack connections, past the admin listener's cap of 64
CALLS = 30
ATTACK_S = 8.0


@pytest.fixture
def flooded(tmp_path: Path) -> Iterator[tuple[ServerProcess, subprocess.Popen[str]]]:
    """A server (30 s head and body bounds, default admin caps) with the flood on its admin
    listener, yielded once every attack connection was opened."""
    env = {"KVOFFLOAD_HEAD_TIMEOUT_S": "30", "KVOFFLOAD_BODY_TIMEOUT_S": "30"}
    with ServerProcess(tmp_path, env=env).serving() as srv:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.load.slowloris",
                "--tcp",
                f"127.0.0.1:{srv.admin_port}",
                "--count",
                str(COUNT),
                "--seconds",
                str(ATTACK_S),
            ],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert proc.stdout is not None
            assert proc.stdout.readline().strip() == "ready"
            yield srv, proc
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait(30)


def test_the_operator_s_admin_calls_are_answered_through_a_local_flood(
    flooded: tuple[ServerProcess, subprocess.Popen[str]],
) -> None:
    srv, proc = flooded
    answered = 0
    failures: list[str] = []
    for _ in range(CALLS):
        try:
            # A new connection each time: what an operator's one-off call is.
            r = httpx.get(
                f"{srv.admin_url}/admin/v1/stats",
                headers={"Authorization": f"Bearer {TOKEN}"},
                timeout=10,
            )
        except httpx.TransportError as exc:
            failures.append(repr(exc))
            continue
        if r.status_code == 200:
            answered += 1
        else:
            failures.append(f"{r.status_code} {r.text[:100]}")
    still_attacking = proc.poll() is None
    out, _ = proc.communicate(timeout=ATTACK_S + 30)
    report = json.loads(out.splitlines()[-1])
    ex = metrics(srv.url)
    print(f"\noperator's admin calls answered during the flood: {answered} of {CALLS}")
    print(f"attack: {report['tcp/silent']} {report['tcp/partial']}")
    assert still_attacking, "the flood ended before the operator's calls: lengthen ATTACK_S"
    assert answered == CALLS, failures[:5]
    # The flood was there all along: its partial heads were evicted (counted under the cap's
    # reason) and reopened, never refused for want of a slot the operator could have had; its
    # silent connections, held by the kernel, were neither served nor closed.
    evicted = closed(ex, "peer_cap", "admin") + closed(ex, "listener_cap", "admin")
    assert evicted >= COUNT - 16
    assert report["tcp/partial"]["opened"] > COUNT
    assert report["tcp/silent"]["open_at_end"] == report["tcp/silent"]["opened"] == COUNT


def test_a_silent_admin_connection_is_handed_over_after_the_deferral_and_closed(
    tmp_path: Path,
) -> None:
    # Held by the kernel for the head bound (1 s here), then given to the service, whose head
    # bound closes it: a silent connection is delayed, never kept forever.
    env = {"KVOFFLOAD_HEAD_TIMEOUT_S": "1", "KVOFFLOAD_BODY_TIMEOUT_S": "1"}
    with ServerProcess(tmp_path, env=env).serving() as srv:
        with socket.create_connection(("127.0.0.1", srv.admin_port)) as silent:
            assert closed_by_server(silent, within_s=30) is not None
        assert closed(metrics(srv.url), "head_timeout", "admin") == 1
