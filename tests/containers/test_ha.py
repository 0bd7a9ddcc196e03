"""deploy/docker-compose.remote.yml with deploy/docker-compose.ha.yml, run by Docker Compose
v2: etcd, a leader and a standby Mooncake master (``--enable_ha --enable_oplog``) and two nodes
that find the leader through etcd. SIGKILL of the leader's container: the standby leads, every
block node A stored before the kill is read on node B with equal bytes (0 lost, 0 wrong), and
blocks stored after the takeover reach B too.

etcd runs from an image made here (the base image with Debian's etcd 3.4 and etcdctl, the
binaries the host has), as ETCD_IMAGE, since no registry can be reached."""

from __future__ import annotations

import secrets
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import httpx
import pytest

from tests.containers.conftest import BASE_IMAGE
from tests.containers.stack import (
    COMPOSE_V2,
    REPORT,
    Project,
    Stack,
    run,
)
from tests.containers.test_remote import NODE_A, NODE_B, lookup
from tests.e2e.server import wait_for

BLOCKS = 8
FILES = ["docker-compose.remote.yml", "docker-compose.ha.yml"]


# Building the image (the first module's setup) and bringing a stack up take minutes.
pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def etcd_image(workdir: Path) -> str:
    """An etcd image without a registry: the base plus the host's etcd and etcdctl."""
    context = workdir / "etcd-image"
    context.mkdir()
    for binary in ("etcd", "etcdctl"):
        found = shutil.which(binary)
        assert found is not None, f"no {binary} (Debian's etcd-server and etcd-client)"
        shutil.copy(found, context / binary)
    (context / "Dockerfile").write_text(
        f"FROM {BASE_IMAGE}\nCOPY etcd etcdctl /usr/local/bin/\nEXPOSE 2379 2380\n",
        encoding="utf-8",
    )
    tag = "kvoffload-etcd:test"
    run(["docker", "build", "-q", "--network=none", "-t", tag, str(context)], timeout=300)
    return tag


def role(container: str) -> str | None:
    """``leader`` / ``standby`` as the master's log last said (None before either)."""
    # glog writes to stderr, which `docker logs` gives back on its own stderr.
    logs = subprocess.run(
        ["docker", "logs", container],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    said = [line for line in logs.splitlines() if "Master runtime state -> " in line]
    if not said:
        return None
    if "-> serving, role=leader" in said[-1]:
        return "leader"
    return "standby" if "-> standby, role=standby" in said[-1] else None


@pytest.fixture(scope="module")
def stack(image: str, etcd_image: str, workdir: Path) -> Iterator[Stack]:
    project = Project.make(workdir / "ha")
    stack = Stack(project, "kvotest-ha", FILES, COMPOSE_V2, image, ETCD_IMAGE=etcd_image)
    try:
        # The leader first, then the standby: which one leads is then known.
        stack.up(["etcd", "mooncake-master"])
        leader = stack.container("mooncake-master")
        wait_for("the first master leads", lambda: role(leader) == "leader" or None, 60)
        stack.up(["mooncake-master-standby"])
        standby = stack.container("mooncake-master-standby")
        wait_for("the second master stands by", lambda: role(standby) == "standby" or None, 60)
        stack.up(["kvoffload-a", "kvoffload-b"])
        healthy = stack.wait_healthy(["kvoffload-a", "kvoffload-b"])
        REPORT.record("ha: nodes healthy (s)", round(healthy, 1))
        yield stack
    finally:
        stack.down()


def _reported_removed(url: str, token: str) -> set[str]:
    """The hex keys of the node's REMOTE ``BlockRemoved`` events (found gone from the store)."""
    auth = {"authorization": f"Bearer {token}"}
    page = httpx.get(f"{url}/v1/events", headers=auth, timeout=10).json()["events"]
    return {
        k
        for e in page
        if e["type"] == "BlockRemoved" and e["medium"] == "REMOTE"
        for k in e["block_hashes"]
    }


def _remote_on_b(stack: Stack, engine_module: ModuleType, seed: str, within_s: float) -> float:
    """Seconds until node B answers ``remote`` for every block of ``seed``."""
    keys = [engine_module.block_key(seed, i) for i in range(BLOCKS)]
    token = stack.project.engine_token
    started = time.monotonic()
    wait_for(
        f"node B answers remote for every block of {seed}",
        lambda: set(lookup(NODE_B, token, keys)) == {"remote"} or None,
        within_s,
    )
    return time.monotonic() - started


def test_a_killed_leader_loses_no_block_and_the_standby_serves(
    stack: Stack, engine_module: ModuleType
) -> None:
    before = f"ha-before-{secrets.token_hex(4)}"
    assert stack.engine("cpu-engine-a", "store", "--seed", before, "--blocks", str(BLOCKS))["ok"]
    _remote_on_b(stack, engine_module, before, 60)

    leader = stack.container("mooncake-master")
    standby = stack.container("mooncake-master-standby")
    run(["docker", "kill", "--signal=KILL", leader])
    killed = time.monotonic()
    wait_for("the standby leads", lambda: role(standby) == "leader" or None, 90)
    took_over = time.monotonic() - killed
    # B's tier reconnects to the new leader; the blocks A stored before the kill are there.
    # B's Mooncake client follows the new leader by itself; seen here 20-70 s after the kill
    # (most likely its calls to the dead leader's address, which answers nothing, time out
    # first).
    _remote_on_b(stack, engine_module, before, 180)
    seen = time.monotonic() - killed
    loaded = stack.engine(
        "cpu-engine-b", "load", "--seed", before, "--blocks", str(BLOCKS), "--expect", "remote"
    )
    assert loaded["ok"], loaded
    assert loaded["bytes_equal"] == BLOCKS, loaded

    after = f"ha-after-{secrets.token_hex(4)}"
    assert stack.engine("cpu-engine-a", "store", "--seed", after, "--blocks", str(BLOCKS))["ok"]
    _remote_on_b(stack, engine_module, after, 60)
    fresh = stack.engine(
        "cpu-engine-b", "load", "--seed", after, "--blocks", str(BLOCKS), "--expect", "remote"
    )
    assert fresh["ok"], fresh
    # A, which wrote them, never took the takeover for their loss: its tier was back long
    # before B read them again (20-70 s), so its sweep (every 10 s) asked after them more than
    # once, and the new leader answered that it holds them.
    written = {
        engine_module.block_key(seed, i).hex() for seed in (before, after) for i in range(BLOCKS)
    }
    assert not _reported_removed(NODE_A, stack.project.engine_token) & written
    REPORT.record(
        "ha: leader SIGKILL",
        {
            "standby led after (s)": round(took_over, 1),
            "blocks stored before the kill, remote on B again after (s)": round(seen, 1),
            "read back with equal bytes": f"{loaded['bytes_equal']}/{BLOCKS}",
            "lost": BLOCKS - loaded["bytes_equal"],
            "stored after the takeover, loaded on B": f"{fresh['bytes_equal']}/{BLOCKS}",
        },
    )
