"""``kvoffload admin retentions list`` and ``kvoffload admin retentions release NAME`` run as the
operator runs them (``python -m app.cli``, the token from ``KVOFFLOAD_ADMIN_TOKEN``) against a
real admin listener (``tests.api.test_client_control.live_service``): JSON in a pipe, a table
when asked, ``--namespace`` forwarded, a refusal one line on stderr and exit status 1."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
from kvoffload_client.client import KVOffloadClient

from app.core.service import DEFAULT_NAMESPACE
from tests.api.test_client_control import Live, keys_of, live_service, stored
from testsupport.api_harness import TOKEN
from testsupport.server import ROOT


@pytest.fixture(scope="module")
def live() -> Iterator[Live]:
    with live_service() as service:
        yield service


def admin(live: Live, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVOFFLOAD_")}
    return subprocess.run(
        [sys.executable, "-m", "app.cli", "admin", "--url", live.admin_url, *args],
        cwd=ROOT,
        env={**env, "KVOFFLOAD_ADMIN_TOKEN": TOKEN},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_retentions_list_and_release(live: Live) -> None:
    with KVOffloadClient(live.engine_url) as c:
        stored(c, "w", keys_of(1, 2, 3))
        c.retain("w", keys_of(1, 2), 30.0, name="session-1")
        c.retain("w", keys_of(3), 30.0, name="session-2")

    listed = admin(live, "retentions", "list")
    assert listed.returncode == 0, listed.stderr
    answer = json.loads(listed.stdout)
    assert [(r["name"], r["keys"], r["in_pool"]) for r in answer["retentions"]] == [
        ("session-1", 2, 2),
        ("session-2", 1, 1),
    ]
    assert answer["retained_blocks"] == 3
    assert answer["max_retained_blocks"] > 0

    scoped = admin(live, "--namespace", DEFAULT_NAMESPACE, "retentions", "list")
    assert scoped.returncode == 0, scoped.stderr
    in_namespace = json.loads(scoped.stdout)
    assert [r["name"] for r in in_namespace["retentions"]] == ["session-1", "session-2"]
    assert in_namespace["retained_blocks"] == 3
    table = admin(live, "--table", "retentions", "list")
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    header = next(line for line in lines if line.startswith("name "))
    assert header.split()[:3] == ["name", "keys", "in_pool"]
    assert any(line.split()[:3] == ["session-1", "2", "2"] for line in lines)

    released = admin(live, "retentions", "release", "session-1")
    assert released.returncode == 0, released.stderr
    gone = json.loads(released.stdout)
    assert (gone["name"], gone["keys"]) == ("session-1", 2)
    after = json.loads(admin(live, "retentions", "list").stdout)
    assert [r["name"] for r in after["retentions"]] == ["session-2"]
    assert after["retained_blocks"] == 1


def test_refusals_are_one_line_and_exit_status_1(live: Live) -> None:
    unknown = admin(live, "retentions", "release", "no-such-session")
    assert unknown.returncode == 1
    (line,) = unknown.stderr.splitlines()
    assert "404 unknown_retention" in line

    elsewhere = admin(live, "--namespace", "nope", "retentions", "list")
    assert elsewhere.returncode == 1
    (line,) = elsewhere.stderr.splitlines()
    assert "404 unknown_namespace" in line

    usage = admin(live, "retentions", "release")
    assert usage.returncode == 2
    assert "name" in usage.stderr
