"""The policy names the README and the refusals print (``ARC``, ``LFU-DA``, ``S3-FIFO``,
``prefix-LRFU``, any case) are accepted wherever a policy is named (#43.1): ``serve --policy``,
the live switch (``PUT /admin/v1/policy`` and ``kvoffload admin policy set``) and
``kvoffload replay --policy`` / ``--disk-policy`` (``serve --policy``: tests/api/test_settings)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.api.test_client_control import Live, live_service
from testsupport.api_harness import TOKEN, make_settings, running
from testsupport.server import ROOT

NAMES = [
    ("ARC", "arc"),
    ("LFU-DA", "lfu"),
    ("S3-FIFO", "s3fifo"),
    ("s3-fifo", "s3fifo"),
    ("prefix-LRFU", "prefix_lrfu"),
    ("SLRU", "slru"),
]


@pytest.fixture(scope="module")
def live() -> Iterator[Live]:
    with live_service() as service:
        yield service


@pytest.mark.anyio
@pytest.mark.parametrize(("name", "registered"), NAMES)
async def test_the_admin_api_switches_to_a_display_name(name: str, registered: str) -> None:
    async with running(make_settings()) as h:
        r = await h.admin.put("/admin/v1/policy", json={"name": name})
        assert r.status_code == 200, r.text
        assert r.json()["to"]["name"] == registered
        r = await h.admin.put("/admin/v1/policy", json={"name": "ARCC"})
        assert (r.status_code, r.json()["error"]["code"]) == (422, "unknown_policy")
        assert "did you mean 'arc'?" in r.json()["error"]["message"]


def admin(live: Live, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVOFFLOAD_")}
    return subprocess.run(
        [sys.executable, "-m", "app.cli", "admin", "--url", live.admin_url, "--json", *args],
        cwd=ROOT,
        env={**env, "KVOFFLOAD_ADMIN_TOKEN": TOKEN},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_admin_policy_set_takes_a_display_name(live: Live) -> None:
    for name, registered in (("ARC", "arc"), ("LFU-DA", "lfu"), ("lru", "lru")):
        run = admin(live, "policy", "set", name)
        assert run.returncode == 0, run.stderr
        assert json.loads(run.stdout)["to"]["name"] == registered


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_text('{"hash_ids": [1, 2, 3]}\n{"hash_ids": [1, 2, 4]}\n' * 4)
    return path


def replay(trace: Path, *args: str) -> subprocess.CompletedProcess[str]:
    argv = ["replay", str(trace), "--capacity", "4", "--json", "--no-belady", *args]
    return subprocess.run(
        [sys.executable, "-m", "app.cli", *argv],
        cwd=ROOT,
        env={k: v for k, v in os.environ.items() if not k.startswith("KVOFFLOAD_")},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_replay_takes_display_names(trace: Path) -> None:
    run = replay(trace, "--policy", "LRU,S3-FIFO,LFU-DA")
    assert run.returncode == 0, run.stderr
    assert [row["policy"] for row in json.loads(run.stdout)] == ["lru", "s3fifo", "lfu"]
    run = replay(trace, "--policy", "oracle-ARC", "--param", "horizon=2")
    assert run.returncode == 0, run.stderr
    assert {row["policy"] for row in json.loads(run.stdout)} == {"oracle-arc"}
    run = replay(trace, "--policy", "ARC", "--disk-capacity", "4", "--disk-policy", "LFU-DA")
    assert run.returncode == 0, run.stderr
    run = replay(trace, "--policy", "LRUU")
    assert run.returncode == 2
    assert "unknown policy LRUU" in run.stderr
