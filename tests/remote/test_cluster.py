"""The remote tier across test hosts, bytes compared: shared reads, replicas, faults.

Every host is its own network namespace on one bridge (see ``tests.remote.hosts``); the master
runs on one, the nodes (a host pool and a ``MooncakeTier`` each) on the others.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import pytest

from tests.remote.hosts import Node
from testsupport.polling import until

BLOCK = 64 << 10


def blocks(n: int) -> list[bytes]:
    return [os.urandom(BLOCK) for _ in range(n)]


def keys(n: int, tag: str) -> list[bytes]:
    return [f"{tag}-{i}".encode() for i in range(n)]


def noticed(node: Node, ks: list[bytes]) -> Callable[[], bool]:
    """True once ``node`` skips ``ks`` (no answer: the store is not asked) and reports itself
    degraded."""
    return lambda: node.exists(ks) == [None] * len(ks) and node.health()["state"] == "degraded"


def state_is(node: Node, state: str) -> Callable[[], bool]:
    return lambda: node.health()["state"] == state


def reads_back(
    node: Node, ks: list[bytes], data: list[bytes], got: dict[bytes, bytes]
) -> Callable[[], bool]:
    """True once ``node`` has read every key of ``ks`` (into ``got``) with the bytes in ``data``;
    a read that fails is asked again, a read of other bytes fails the test."""

    def all_read() -> bool:
        missing = [k for k in ks if k not in got]
        for key, value in zip(missing, node.get(missing, range(len(missing))), strict=True):
            if value is not None:
                assert value == data[ks.index(key)], f"wrong bytes for {key!r}"
                got[key] = value
        return len(got) == len(ks)

    return all_read


@pytest.mark.timeout(120)
def test_a_block_put_on_one_host_is_read_identically_on_another(cluster) -> None:
    cluster.master.start()
    a, b = cluster.node("a"), cluster.node("b")
    other = cluster.node("c", namespace="model-b")
    ks, data = keys(8, "shared"), blocks(8)

    assert a.put(ks, range(8), data) == [True] * 8

    absent = b"never-stored"
    assert b.exists([*ks, absent]) == [True] * 8 + [False]
    assert b.get([*ks, absent], [3, 4, 5, 6, 7, 8, 9, 10, 11]) == [*data, None]
    # Another namespace never sees them.
    assert other.exists(ks) == [False] * 8
    assert other.get(ks[:2], [0, 1]) == [None, None]
    for node in (a, b, other):
        health = node.health()
        assert health["state"] == "ok", health
    assert b.health()["counters"]["bytes_read"] == 8 * BLOCK


@pytest.mark.timeout(150)
def test_two_replicas_survive_the_sigkill_of_a_host_that_held_one(cluster) -> None:
    cluster.master.start()
    # The writer contributes no memory, so each block's two replicas are on b and c.
    writer = cluster.node("a", segment_bytes=0, replicas=2)
    holder_b, holder_c = cluster.node("b"), cluster.node("c")
    ks, data = keys(12, "replicated"), blocks(12)
    assert writer.put(ks, range(12), data) == [True] * 12

    holder_b.kill()

    # Reads may fail while the master still lists b's segment; none may return wrong bytes,
    # and every block must come back once the master has dropped b.
    got: dict[bytes, bytes] = {}
    all_read = reads_back(writer, ks, data, got)
    until("every replicated block read after the kill", all_read, within_s=60, every_s=1)
    assert holder_c.exists(ks) == [True] * 12


@pytest.mark.timeout(150)
def test_master_killed_and_restarted_degrades_then_recovers(cluster) -> None:
    cluster.master.start()
    a, b = cluster.node("a"), cluster.node("b")
    before, data = keys(4, "before"), blocks(4)
    assert a.put(before, range(4), data) == [True] * 4
    incidents = a.health()["counters"]["incidents"]

    cluster.master.kill()
    killed = time.monotonic()
    # No call made: each tier's own health check of the master finds it gone.
    for node in (a, b):
        until(f"{node.host.name} degraded with no call made", state_is(node, "degraded"), 30)
        took = time.monotonic() - killed
        print(f"[master SIGKILL] {node.host.name} degraded {took:.2f} s later, no call made")
    # Calls now skip Mooncake.
    for node in (a, b):
        until(f"{node.host.name} answers misses", noticed(node, before), within_s=30)
    skipped = a.health()["counters"]["skipped"]
    assert a.exists(before) == [None] * 4  # no answer (skipped), not "absent"
    assert a.get(before, range(4, 8)) == [None] * 4
    health = a.health()
    assert health["counters"]["skipped"] == skipped + 2
    assert health["counters"]["incidents"] == incidents + 1
    assert health["last_error"]
    # One warning per incident, not one per failed call.
    assert a.log_path.read_text(errors="replace").count("degraded:") == incidents + 1

    cluster.master.start()
    for node in (a, b):
        until(f"{node.host.name} ok again", state_is(node, "ok"), 60)
    # A restarted master starts empty; the tier is used again once the segments are back.
    after, fresh = keys(4, "after"), blocks(4)
    until("a put after the restart", lambda: a.put(after, range(4), fresh) == [True] * 4, 60, 1)
    assert b.get(after, range(8, 12)) == fresh


@pytest.mark.timeout(150)
def test_a_host_cut_off_degrades_and_recovers_when_its_link_returns(cluster) -> None:
    if not cluster.net.can_cut_links:
        pytest.skip(f"links can be cut only between network namespaces: {cluster.net.reason}")
    cluster.master.start()
    a = cluster.node("a")
    # b holds no memory, so the blocks live on a and survive b's absence.
    b = cluster.node("b", segment_bytes=0)
    ks, data = keys(6, "cut"), blocks(6)
    assert a.put(ks, range(6), data) == [True] * 6

    cluster.net.link_down(b.host)
    try:
        # The first call waits for its timeout; its slots stay held while Mooncake's call
        # hangs, so they cannot be handed to another block.
        assert b.get(ks, range(6)) == [None] * 6
        health = b.health()
        print("after the first get while cut off:", health)
        assert health["state"] == "degraded"
        assert set(health["held_slots"]) <= set(range(6))
        assert b.exists(ks) == [None] * 6  # skipped: no answer, not "absent"
        # The rest of the cluster goes on.
        assert a.exists(ks) == [True] * 6
        assert a.health()["state"] == "ok"
    finally:
        cluster.net.link_up(b.host)

    until("b ok again", state_is(b, "ok"), 60)
    until("b reads again", lambda: b.get(ks, range(6, 12)) == data, 30, 1)
    health = b.health()
    assert health["counters"]["incidents"] >= 1
    assert health["held_slots"] == []


@pytest.mark.timeout(120)
def test_a_host_whose_master_is_down_at_start_connects_when_it_comes(cluster) -> None:
    a = cluster.node("a")
    assert a.ready["health"]["state"] == "degraded"
    assert a.exists([b"k"]) == [None]
    assert a.health()["counters"]["skipped"] == 1

    cluster.master.start()
    until("a connected", state_is(a, "ok"), 60)
    b = cluster.node("b")
    ks, data = keys(3, "late"), blocks(3)
    assert a.put(ks, range(3), data) == [True] * 3
    assert b.get(ks, range(3)) == data


@pytest.mark.timeout(360)
def test_ha_masters_a_killed_leader_loses_no_block_and_the_standby_takes_over(ha_cluster) -> None:
    """etcd, a leader and a standby master (``--enable_ha --enable_oplog``), three nodes that
    name the masters by their etcd. SIGKILL of the leader: the standby leads, blocks written
    before the kill read back with equal bytes (0 lost), and nodes write again."""
    ha_cluster.etcd.start()
    leader, standby = ha_cluster.masters
    leader.start()
    until("m1 leads", lambda: leader.role() == "leader", 60)
    standby.start()
    until("m2 stands by", lambda: standby.role() == "standby", 60)
    a, b, c = (ha_cluster.node(n) for n in ("a", "b", "c"))
    ks, data = keys(8, "ha"), blocks(8)
    assert a.put(ks, range(8), data) == [True] * 8
    assert b.exists(ks) == c.exists(ks) == [True] * 8

    leader.kill()
    killed = time.monotonic()
    until("m2 leads after the kill", lambda: standby.role() == "leader", 90)
    took_over = time.monotonic() - killed
    # Every block written before the kill, read back on another node with its bytes.
    got: dict[bytes, bytes] = {}
    all_read = reads_back(b, ks, data, got)
    # B reads once its own client has found the new leader, after running out its calls to the
    # dead one: 10-70 s seen alone, over 90 s once in a clean-clone CI run (2026-12-07).
    try:
        until("every block written before the kill read back", all_read, 180, every_s=0.5)
    except AssertionError as exc:
        raise AssertionError(f"{exc}: {len(got)}/{len(ks)} read back") from None
    read_back = time.monotonic() - killed
    lost = len(ks) - len(got)
    print(
        f"[HA leader SIGKILL] standby led {took_over:.1f} s later; {len(got)}/{len(ks)} blocks "
        f"read back with equal bytes {read_back:.1f} s after the kill; lost {lost}, wrong 0"
    )
    after, fresh = keys(4, "ha-after"), blocks(4)
    until("writes again", lambda: a.put(after, range(8, 12), fresh) == [True] * 4, 60, 1.0)
    # Each node's client finds the new leader on its own (seen 20-70 s after the kill: it runs
    # out its calls to the dead leader first), so c may read them a little later than a wrote.
    until("c reads what a wrote after", lambda: c.get(after, range(4)) == fresh, 90, 1.0)
    for node in (a, b, c):
        until(f"{node.host.name} ok", state_is(node, "ok"), 30)
