"""``kvoffload serve`` nodes sharing a Mooncake Store, across test hosts, bytes compared.

Each node is a real ``kvoffload serve --remote-tier mooncake`` on its own test host (network
namespace), beside a stand-in engine that makes the engine's calls and reads and writes the
pool through its own mapping (``tests.remote.service``); a real ``mooncake_master`` runs on a
host of its own. No mocks: what a node reports is what its engine saw.

Shown: a prefix stored on node A is answered ``remote`` on node B, promoted (409, then pending,
then hit) and loaded with A's bytes; with two replicas, the SIGKILL of a node holding one loses
no block; a master killed and restarted, or one node's link cut and restored, leaves every node
up and ready (``/readyz`` naming the degraded tier), serving its pool's blocks, counting the
remote errors, and using the tier again once it is back. Blocks a master held before its
restart are gone with it (Mooncake keeps its metadata in memory), so recovery is shown with
blocks stored after it.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import time
from collections.abc import Iterator, Sequence
from typing import Any

import pytest

from tests.remote.service import ServeError, ServeNode
from testsupport.polling import until

BLOCK = 64 << 10
_req = itertools.count()


class Nodes:
    """The serve nodes a test starts on the cluster's hosts; all closed after the test."""

    def __init__(self, cluster: Any) -> None:
        self.cluster = cluster
        self.started: list[ServeNode] = []

    def start(self, host: str, **kwargs: Any) -> ServeNode:
        c = self.cluster
        node = ServeNode(c.net.hosts[host], c.master, c.workdir, **kwargs)
        self.started.append(node)
        return node

    def close(self) -> None:
        for node in self.started:
            node.close()


@pytest.fixture
def nodes(cluster: Any) -> Iterator[Nodes]:
    made = Nodes(cluster)
    try:
        yield made
    finally:
        made.close()


def prefix(n: int, tag: str) -> tuple[list[bytes], list[bytes]]:
    """``n`` fresh keys (unique per run) and random blocks for them."""
    run = os.urandom(4).hex()
    return [f"{tag}-{run}-{i}".encode() for i in range(n)], [os.urandom(BLOCK) for _ in range(n)]


def req(tag: str) -> str:
    return f"{tag}-{next(_req)}"


def written(node: ServeNode) -> int:
    count: int = node.remote()["written"]
    return count


def wait_written(node: ServeNode, at_least: int, timeout_s: float = 30) -> None:
    until(
        f"{node.host.name} wrote {at_least} blocks behind",
        lambda: written(node) >= at_least,
        timeout_s,
    )


def load_remote(
    node: ServeNode, keys: Sequence[bytes], timeout_s: float = 30, retry_failed: bool = False
) -> tuple[str, list[int], list[list[str]]]:
    """Load keys ``node``'s pool lacks as an engine would: prepare-load (409 while they are
    promoted), lookups until every key is a hit, prepare-load again. Returns the request, the
    slots and the lookup answers seen in between. ``retry_failed``: a key whose promotion
    failed (a miss again) is asked for again, until ``timeout_s``."""
    request = req(f"load-{node.host.name}")
    with pytest.raises(ServeError) as refused:
        node.prepare_load(request, keys)
    assert (refused.value.status, refused.value.code) == (409, "key_not_ready")
    seen: list[list[str]] = []
    deadline = time.monotonic() + timeout_s
    while True:
        results = node.lookup(request, keys)
        seen.append(results)
        if results == ["hit"] * len(keys):
            return request, node.prepare_load(request, keys), seen
        failed = [r for r in results if r not in ("pending", "hit")]
        if failed and not retry_failed:
            raise AssertionError(f"promotion on {node.host.name} failed: {results}")
        if time.monotonic() > deadline:
            raise AssertionError(f"not loaded on {node.host.name} in {timeout_s} s: {results}")
        if failed:
            with pytest.raises(ServeError):
                node.prepare_load(request, keys)
        time.sleep(0.2)


def degraded(node: ServeNode, probe: Sequence[bytes]) -> bool:
    """Ask about ``probe`` (keys nobody holds) so the tier notices; True once degraded."""
    assert node.lookup(req("probe"), probe) == ["miss"] * len(probe)
    state: str = node.remote()["state"]
    return state == "degraded"


def state_is(node: ServeNode, state: str) -> bool:
    return bool(node.remote()["state"] == state)


def errors(node: ServeNode) -> int:
    counters = node.remote()["counters"]
    return int(counters["errors"] + counters["timeouts"] + counters["skipped"])


def serves_its_pool(node: ServeNode, keys: Sequence[bytes], data: Sequence[bytes]) -> None:
    """The node answers its pool's keys as hits and loads their bytes."""
    request = req(f"local-{node.host.name}")
    assert node.lookup(request, keys) == ["hit"] * len(keys)
    assert node.read(node.prepare_load(request, keys)) == list(data)
    node.finish(request)


def remote_events(node: ServeNode, kind: str) -> set[bytes]:
    """The keys of ``node``'s KV events of ``kind`` with medium ``REMOTE``: ``BlockStored``
    (written to the store), ``BlockRemoved`` (found gone from it)."""
    return {
        bytes.fromhex(k)
        for e in node.events()["events"]
        if e["type"] == kind and e["medium"] == "REMOTE"
        for k in e["keys"]
    }


def removed_remote(node: ServeNode) -> set[bytes]:
    return remote_events(node, "BlockRemoved")


def store_in_batches(node: ServeNode, keys: Sequence[bytes], data: Sequence[bytes]) -> None:
    for i in range(0, len(keys), 50):
        chunk = keys[i : i + 50]
        assert node.store(req("store"), chunk, data[i : i + 50]) == list(chunk)


def report(fault: str, node: ServeNode) -> None:
    """One line for the fault table (shown with ``-s``)."""
    r = node.remote()
    counters = {k: v for k, v in r["counters"].items() if v}
    print(
        f"[{fault}] {node.host.name}: state={r['state']} promotions={r['promotions']} "
        f"written={r['written']} queue_dropped={r['queue']['dropped']} counters={counters}"
    )


def ready_but_degraded(node: ServeNode) -> None:
    answer = node.readyz()
    assert answer["status"] == 200, answer
    assert answer["body"]["details"]["remote_tier"].startswith("degraded"), answer


@pytest.mark.timeout(240)
def test_a_prefix_stored_on_one_node_is_loaded_with_identical_bytes_on_another(
    cluster: Any, nodes: Nodes
) -> None:
    cluster.master.start()
    a, b = nodes.start("a"), nodes.start("b")
    # Another block size: another namespace in the shared store.
    other = nodes.start("c", block_bytes=BLOCK // 2)
    keys, data = prefix(8, "shared")

    assert a.store(req("store"), keys, data) == keys
    wait_written(a, 8)
    assert remote_events(a, "BlockStored") == set(keys)

    absent = b"stored-nowhere"
    assert b.lookup(req("look"), [*keys, absent]) == ["remote"] * 8 + ["miss"]
    assert other.lookup(req("look"), keys) == ["miss"] * 8

    request, slots, seen = load_remote(b, keys)
    print(f"lookups while promoting on b: {seen}")
    assert all(r in ("pending", "hit") for answer in seen for r in answer)
    assert b.read(slots) == data
    b.finish(request)
    remote = b.remote()
    assert remote["state"] == "ok"
    assert remote["promotions"]["loaded"] == 8
    assert remote["promotions"]["failed"] == 0
    assert remote["counters"]["bytes_read"] == 8 * BLOCK
    # Now in b's pool: a hit without the remote tier.
    serves_its_pool(b, keys, data)
    assert b.remote()["counters"]["gets"] == 8
    # Every line a node wrote (stdout and stderr, as a container's log has them) is JSON,
    # Mooncake's own glog lines among them.
    for node in (a, b):
        lines = node.log_path.read_text(errors="replace").splitlines()
        records = [json.loads(line) for line in lines]
        assert any(r.get("source") == "mooncake" for r in records), lines[:20]


@pytest.mark.timeout(240)
def test_a_promoted_block_is_unpinned_when_its_engine_completes_the_load_and_finishes(
    cluster: Any, nodes: Nodes
) -> None:
    """The engine's lease protocol: one complete_load per prepare_load that returned slots,
    then finish; nothing of the request may stay pinned (a pin left behind holds its block
    against eviction until the lease expires, and fills a small pool)."""
    cluster.master.start()
    a, b = nodes.start("a"), nodes.start("b")
    keys, data = prefix(4, "unpinned")
    assert a.store(req("store"), keys, data) == keys
    wait_written(a, 4)
    request, slots, _ = load_remote(b, keys)
    assert b.read(slots) == data
    b.complete_load(request, keys)
    b.finish(request)
    left = b.live_requests().get(request)
    assert left is None, f"finished request still holds {left}"
    assert b.stats()["blocks"]["pinned"] == 0


@pytest.mark.timeout(240)
def test_two_replicas_survive_the_sigkill_of_the_node_holding_one(
    cluster: Any, nodes: Nodes
) -> None:
    cluster.master.start()
    # a and c give the store memory, b none: each block's two replicas are on a and c.
    a = nodes.start("a", replicas=2)
    b = nodes.start("b", segment_bytes=0)
    c = nodes.start("c")
    keys, data = prefix(12, "replicated")
    assert a.store(req("store"), keys, data) == keys
    wait_written(a, 12)

    a.kill()

    # Until the master drops a's segment a get may pick its replica and fail (the key is
    # asked for again); no promotion may load wrong bytes, and every block comes back.
    request, slots, _ = load_remote(b, keys, timeout_s=90, retry_failed=True)
    assert b.read(slots) == data
    b.finish(request)
    assert b.remote()["promotions"]["loaded"] >= 12
    report("replica holder killed", b)
    assert c.alive()
    assert b.alive()


@pytest.mark.timeout(300)
def test_master_killed_and_restarted_nodes_serve_their_pools_then_use_the_tier_again(
    cluster: Any, nodes: Nodes
) -> None:
    cluster.master.start()
    # A lone master comes back empty: what it held is gone for good, reported once it has
    # been "not held" for 3 s (the default of 120 s rides out an HA takeover).
    a, b = nodes.start("a", extra=("--remote-removal-confirm-s=3",)), nodes.start("b")
    keys, data = prefix(4, "before")
    assert a.store(req("store"), keys, data) == keys
    wait_written(a, 4)
    request, slots, _ = load_remote(b, keys)
    assert b.read(slots) == data
    b.finish(request)
    errors_before = {n.host.name: errors(n) for n in (a, b)}

    cluster.master.kill()
    probe, _ = prefix(2, "nobody")
    for node in (a, b):
        until(f"{node.host.name} degraded", functools.partial(degraded, node, probe), 60, 0.5)
        assert node.alive()
        ready_but_degraded(node)
        serves_its_pool(node, keys, data)
        assert errors(node) > errors_before[node.host.name]
        remote = node.remote()
        assert remote["counters"]["incidents"] >= 1
        assert remote["last_error"]
    # A store while the master is down: local, ready at once; write-behind drops it (counted).
    during, during_data = prefix(4, "during")
    dropped = a.remote()["queue"]["dropped"]
    assert a.store(req("store"), during, during_data) == during
    serves_its_pool(a, during, during_data)
    until("a dropped the write-behind", lambda: a.remote()["queue"]["dropped"] > dropped, 30)
    assert b.lookup(req("look"), during) == ["miss"] * 4

    cluster.master.start()
    for node in (a, b):
        until(f"{node.host.name} ok again", functools.partial(state_is, node, "ok"), 60, 0.5)

    # A restarted master starts empty, and takes puts again once the nodes' segments are
    # mounted again: fresh blocks until one batch is written behind.
    fresh: list[tuple[list[bytes], list[bytes]]] = []

    def stored_after() -> bool:
        start = written(a)
        fresh.append(prefix(4, "after"))
        assert a.store(req("store"), *fresh[-1]) == fresh[-1][0]
        try:
            wait_written(a, start + 4, timeout_s=5)
        except AssertionError:
            return False
        return True

    until("a block written behind after the restart", stored_after, 90, 0.5)
    # The blocks written before the restart went with the master: the node that wrote them
    # finds them gone (its sweep, every 10 s by default) and says so in its KV events.
    until("a reported the blocks lost with the master", lambda: removed_remote(a) >= set(keys), 40)
    after, after_data = fresh[-1]
    assert b.lookup(req("look"), after) == ["remote"] * 4
    request, slots, _ = load_remote(b, after)
    assert b.read(slots) == after_data
    b.finish(request)
    serves_its_pool(b, keys, data)
    assert not removed_remote(a) & set(after)  # read back on b: not reported removed
    for node in (a, b):
        report("master restarted", node)


@pytest.mark.timeout(240)
def test_blocks_the_store_evicts_are_reported_removed_by_the_node_that_wrote_them(
    cluster: Any, nodes: Nodes
) -> None:
    """Mooncake evicts on its own and tells nobody: the writer's sweep sees it, and its KV
    events then name exactly the blocks another node can no longer find."""
    cluster.master.start()
    # The smallest segment Mooncake takes (16 MiB: 256 blocks), the only one in the store.
    a = nodes.start(
        "a",
        num_blocks=512,
        segment_bytes=16 << 20,
        extra=("--remote-sweep-s=1", "--remote-removal-confirm-s=0"),
    )
    b = nodes.start("b", segment_bytes=0, extra=("--remote-lookup-timeout-s=2",))
    first, first_data = prefix(200, "evict-first")
    store_in_batches(a, first, first_data)
    wait_written(a, 200)
    # Their leases run out (MooncakeMaster sets no --default_kv_lease_ttl: the master's 5 s
    # default), so the master may evict them to make room.
    time.sleep(6)
    second, second_data = prefix(120, "evict-second")
    store_in_batches(a, second, second_data)
    until(
        "a tried to write every block behind",
        lambda: written(a) + a.remote()["write_behind_failed"]["put"] >= 320,
        60,
    )
    every = first + second
    stored = remote_events(a, "BlockStored")  # puts that failed (the store full) are not
    assert len(stored) == written(a)
    seen: dict[str, Any] = {}

    def agree() -> bool:
        found = b.lookup(req("look"), every)
        seen["gone"] = {k for k, r in zip(every, found, strict=True) if r == "miss"} & stored
        seen["removed"] = removed_remote(a)
        return bool(seen["gone"]) and seen["gone"] == seen["removed"]

    until("a's removals = what b cannot find", agree, 60, 0.5)
    tracked = a.remote()["tracked"]
    assert tracked["removed"] == len(seen["removed"])
    assert tracked["blocks"] == written(a) - len(seen["removed"])
    # What is left reads back with a's bytes.
    kept = [k for k in every if k not in seen["gone"]][:8]
    request, slots, _ = load_remote(b, kept)
    by_key = dict(zip(every, first_data + second_data, strict=True))
    assert b.read(slots) == [by_key[k] for k in kept]
    b.finish(request)
    print(
        f"[remote eviction] written {written(a)} of 320 blocks into a 256-block segment; "
        f"evicted and reported removed {len(seen['removed'])}, wrong reports 0, "
        f"put failures {a.remote()['write_behind_failed']['put']}"
    )


@pytest.mark.timeout(300)
def test_a_node_cut_off_serves_its_pool_and_uses_the_tier_again_when_its_link_returns(
    cluster: Any, nodes: Nodes
) -> None:
    if not cluster.net.can_cut_links:
        pytest.skip(f"links can be cut only between network namespaces: {cluster.net.reason}")
    cluster.master.start()
    a = nodes.start("a")
    # b gives the store no memory: what a stores lives on a and survives b's absence.
    b = nodes.start("b", segment_bytes=0)
    keys, data = prefix(4, "loaded")
    assert a.store(req("store"), keys, data) == keys
    wait_written(a, 4)
    request, slots, _ = load_remote(b, keys)
    assert b.read(slots) == data
    b.finish(request)
    errors_before = errors(b)

    cluster.net.link_down(b.host)
    try:
        probe, _ = prefix(2, "nobody")
        until("b degraded", lambda: degraded(b, probe), 60, 0.5)
        assert b.alive()
        ready_but_degraded(b)
        serves_its_pool(b, keys, data)
        assert errors(b) > errors_before
        assert b.remote()["counters"]["incidents"] >= 1
        # The rest of the cluster goes on: a writes behind, its tier ok.
        during, during_data = prefix(4, "during")
        start = written(a)
        assert a.store(req("store"), during, during_data) == during
        wait_written(a, start + 4)
        assert a.remote()["state"] == "ok"
        # b does not see them while cut off: misses, never an error to the engine.
        assert b.lookup(req("look"), during) == ["miss"] * 4
    finally:
        cluster.net.link_up(b.host)

    until("b ok again", lambda: state_is(b, "ok"), 60, 0.5)
    until("b sees a's blocks", lambda: b.lookup(req("look"), during) == ["remote"] * 4, 30)
    request, slots, _ = load_remote(b, during)
    assert b.read(slots) == during_data
    b.finish(request)
    serves_its_pool(b, keys, data)
    report("link cut", b)


@pytest.mark.timeout(240)
def test_a_node_started_before_its_master_serves_and_connects_when_it_comes(
    cluster: Any, nodes: Nodes
) -> None:
    a = nodes.start("a")
    ready_but_degraded(a)
    early, early_data = prefix(2, "early")
    dropped = a.remote()["queue"]["dropped"]
    assert a.store(req("store"), early, early_data) == early
    serves_its_pool(a, early, early_data)
    until("a dropped the write-behind", lambda: a.remote()["queue"]["dropped"] > dropped, 30)

    cluster.master.start()
    until("a connected", lambda: state_is(a, "ok"), 60, 0.5)
    assert a.readyz()["body"].get("details") is None
    b = nodes.start("b")
    keys, data = prefix(4, "late")
    assert a.store(req("store"), keys, data) == keys
    wait_written(a, 4)
    request, slots, _ = load_remote(b, keys)
    assert b.read(slots) == data
    b.finish(request)
    report("master down at start", a)
