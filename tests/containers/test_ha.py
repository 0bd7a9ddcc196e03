"""deploy/docker-compose.remote.yml with deploy/docker-compose.ha.yml, run by Docker Compose
v2: etcd, a leader and a standby Mooncake master (``--enable_ha --enable_oplog``) and two nodes
that find the leader through etcd. SIGKILL of the leader's container: the standby leads, every
block node A stored before the kill is read on node B with equal bytes (0 lost, 0 wrong), and
blocks stored after the takeover reach B too.

etcd runs from an image made here (the base image with Debian's etcd 3.4 and etcdctl, the
binaries the host has), as ETCD_IMAGE, since no registry can be reached.

The stack starts from nothing: what an earlier run cut short left of the project is taken down
first. Left up past its SIGKILL, the old standby leads and holds the leader key in etcd (its
lease renewed every second), so the killed master, restarted by ``up``, stands by for good. A
master that does not take the role it should fails with etcd's leader key, each master's address
and election lines, and the tails of etcd's and the masters' logs."""

from __future__ import annotations

import re
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

BLOCKS = 8
FILES = ["docker-compose.remote.yml", "docker-compose.ha.yml"]
MASTERS = ("mooncake-master", "mooncake-master-standby")
# A master takes the leader key in etcd at once when there is none (its lease: 5 s), then warms
# up for that lease before it serves: "role=leader" about 5 s after it starts (5.2-5.8 s in
# seven bring-ups, on 2 busy cores and a busy disk too). The bound is for a slow machine.
LEADS_WITHIN_S = 60
# The master's log lines about the election (glog: I/W/E, date, time, thread, file:line]).
ELECTION = re.compile(r"Master runtime state|phase|[Ll]eadership|master_view|Failed to")


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


def election(stack: Stack) -> str:
    """Who leads as etcd has it (the leader key, its lease's time to live) and as each master
    says (its address, its election lines with Docker's timestamps)."""
    etcd = stack.container("etcd")
    etcdctl = ["docker", "exec", etcd, "etcdctl", "--endpoints=http://127.0.0.1:2379"]
    keys = run([*etcdctl, "get", "--prefix", "mooncake-store/", "-w", "fields"], check=False)
    said = ["etcd, mooncake-store/*:"]
    for line in keys.splitlines():
        if line.startswith(('"Key"', '"Value"', '"Lease"')):
            said.append(f"  {line}")
        if line.startswith('"Lease"') and line.split(":", 1)[1].strip() != "0":
            lease = format(int(line.split(":", 1)[1]), "x")
            ttl = run([*etcdctl, "lease", "timetolive", lease], check=False).strip()
            said.append(f"  {ttl}")
    for service in MASTERS:
        ids = stack("ps", "-a", "-q", service, check=False).split()
        for cid in ids:
            where = run(
                [
                    "docker",
                    "inspect",
                    "-f",
                    "{{.Name}} {{range .NetworkSettings.Networks}}{{.IPAddress}} {{end}}"
                    "{{.State.Status}} restarts={{.RestartCount}} started={{.State.StartedAt}}",
                    cid,
                ],
                check=False,
            ).strip()
            logs = subprocess.run(
                ["docker", "logs", "--timestamps", cid],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                timeout=30,
                check=False,
            ).stdout
            said.append("\n".join([f"{service}: {where.lstrip('/')}", *_election_lines(logs)]))
    return "\n".join(said)


def _election_lines(logs: str, last: int = 20) -> list[str]:
    """The last ``last`` election lines of a master's log (with Docker's timestamps), a run of
    the same message as one line with its count: a master that finds the leader key taken goes
    candidate -> standby every second."""
    runs: list[tuple[str, str, int]] = []  # (first line, message, how many)
    for line in logs.splitlines():
        if not ELECTION.search(line) or "-> candidate," in line:
            continue
        message = line.split("] ", 1)[-1]
        if runs and runs[-1][1] == message:
            first, _, count = runs[-1]
            runs[-1] = (first, message, count + 1)
        else:
            runs.append((line, message, 1))
    return [f"{first[:300]}" + (f"  (x{count})" if count > 1 else "") for first, _, count in runs][
        -last:
    ]


def wait_role(stack: Stack, service: str, want: str, what: str, within_s: float) -> None:
    """Until ``service``'s master says ``want``; failing, what etcd and the masters say."""
    cid = stack.container(service)
    stack.wait_for(
        what,
        lambda: role(cid) == want or None,
        within_s,
        services=["etcd", *MASTERS],
        also=lambda: election(stack),
    )


@pytest.fixture(scope="module")
def stack(image: str, etcd_image: str, workdir: Path) -> Iterator[Stack]:
    project = Project.make(workdir / "ha")
    stack = Stack(project, "kvotest-ha", FILES, COMPOSE_V2, image, ETCD_IMAGE=etcd_image)
    # From nothing: a standby left up by a run cut short would hold the leader key.
    stack.clear()
    try:
        # The leader first, then the standby: which one leads is then known.
        stack.up(["etcd", "mooncake-master"])
        started = time.monotonic()
        wait_role(stack, "mooncake-master", "leader", "the first master leads", LEADS_WITHIN_S)
        REPORT.record("ha: first master led after (s)", round(time.monotonic() - started, 1))
        stack.up(["mooncake-master-standby"])
        wait_role(stack, "mooncake-master-standby", "standby", "the second master stands by", 60)
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
    stack.wait_for(
        f"node B answers remote for every block of {seed}",
        lambda: set(lookup(NODE_B, token, keys)) == {"remote"} or None,
        within_s,
        services=["kvoffload-b", *MASTERS],
    )
    return time.monotonic() - started


def test_a_killed_leader_loses_no_block_and_the_standby_serves(
    stack: Stack, engine_module: ModuleType
) -> None:
    before = f"ha-before-{secrets.token_hex(4)}"
    assert stack.engine("cpu-engine-a", "store", "--seed", before, "--blocks", str(BLOCKS))["ok"]
    _remote_on_b(stack, engine_module, before, 60)

    run(["docker", "kill", "--signal=KILL", stack.container("mooncake-master")])
    killed = time.monotonic()
    wait_role(stack, "mooncake-master-standby", "leader", "the standby leads", 90)
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
