"""kvoffload's KV events read by Dynamo's real standalone indexer: two ``kvoffload serve`` nodes
registered as two instances; the indexer names the node holding a prompt's prefix with its
token count and tier, follows evictions to disk, drops and clears, recovers through replay when
it joins late or restarts, and sees a kvoffload restart."""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest
from kvoffload_client import BlockTokens, KVOffloadAdminClient, KVOffloadClient

from testsupport.ports import free_port
from testsupport.router_indexer import BLOCK_TOKENS, Indexer
from testsupport.server import TOKEN, ServerProcess

PREFIX = list(range(1000, 1016))  # 4 blocks of 4 tokens
OTHER = list(range(2000, 2016))
MARK = [6000] * BLOCK_TOKENS
CHAINED = list(range(7000, 7016))
UNCHAINED = list(range(8000, 8016))


def endpoints() -> tuple[str, str]:
    return f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"


def node(workdir: Path, ends: tuple[str, str], *extra: str) -> ServerProcess:
    workdir.mkdir(exist_ok=True)
    pub, replay = ends
    return ServerProcess(
        workdir, "--kv-events-endpoint", pub, "--kv-events-replay-endpoint", replay, *extra
    )


def store(
    srv: ServerProcess, tokens: list[int], req_id: str = "r", parent: bytes | None = None
) -> list[bytes]:
    """An engine stores a prompt's blocks (keys are its own hashes: random here) with their
    tokens, as any engine passing ``BlockTokens`` does; ``parent``: the key before them."""
    keys = [os.urandom(16) for _ in range(len(tokens) // BLOCK_TOKENS)]
    with KVOffloadClient(srv.url) as kv:
        kv.start_request(req_id)
        meta = BlockTokens(tokens, BLOCK_TOKENS, parent)
        out = kv.prepare_store(req_id, keys, tokens=meta)
        kv.complete_store(req_id, out.keys_to_store)
        kv.finish_request(req_id)
    return keys


def holds(instance: str, tokens: int, **tiers: int):
    def check(answer: dict[str, dict[str, object]]) -> bool:
        found = answer.get(instance)
        return (
            found is not None
            and found["longest_matched"] == tokens
            and all(found[tier] == n for tier, n in tiers.items())
        )

    return check


def absent(instance: str):
    return lambda answer: instance not in answer


@pytest.fixture
def indexer(tmp_path: Path) -> Iterator[Indexer]:
    idx = Indexer(tmp_path)
    try:
        yield idx
    finally:
        idx.stop()


def test_two_nodes_prefix_found_on_its_node_then_to_disk_then_dropped_and_cleared(
    tmp_path: Path, indexer: Indexer
):
    ends_a, ends_b = endpoints(), endpoints()
    disk = tmp_path / "a-disk"
    disk.mkdir()
    # Node A: an 8-block pool over a disk tier that takes every evicted block.
    a = node(
        tmp_path / "a",
        ends_a,
        "--num-blocks",
        "8",
        "--disk-dir",
        str(disk),
        "--disk-bytes",
        "1M",
        "--disk-admit-after",
        "1",
    )
    b = node(tmp_path / "b", ends_b)
    with ExitStack() as stack:
        stack.enter_context(a.serving())
        stack.enter_context(b.serving())
        indexer.register(1, a, ends_a)
        indexer.register(2, b, ends_b)
        store(a, PREFIX)
        store(b, OTHER)
        answer = indexer.until(PREFIX, holds("1", 16, cpu=16))
        assert set(answer) == {"1"}, "node B holds nothing of A's prefix"
        assert indexer.until([*PREFIX[:8], 7, 7, 7, 7], holds("1", 8, cpu=8))["1"]["gpu"] == 0
        assert set(indexer.until(OTHER, holds("2", 16, cpu=16))) == {"2"}

        # A prompt stored in two calls, the second naming the first's last key as its
        # parent, is one sequence to the router; without the parent, the second call's blocks
        # start a sequence of their own, which the prompt's prefix does not reach.
        head = store(b, CHAINED[:8], "c1")
        store(b, CHAINED[8:], "c2", parent=head[-1])
        indexer.until(CHAINED, holds("2", 16, cpu=16))
        store(b, UNCHAINED[:8], "u1")
        store(b, UNCHAINED[8:], "u2")
        indexer.until(UNCHAINED, holds("2", 8, cpu=8))

        # Eight new blocks on A evict the prefix to its disk: the count moves to disk.
        store(a, list(range(3000, 3032)), "r2")
        indexer.until(PREFIX, holds("1", 16, cpu=0, disk=16))

        # A prefix in the pool, dropped by a hint: gone from the indexer.
        fresh = list(range(4000, 4008))
        keys = store(a, fresh, "r3")
        indexer.until(fresh, holds("1", 8, cpu=8))
        with KVOffloadClient(a.url) as kv:
            assert kv.drop("r4", keys).moved == keys
        indexer.until(fresh, absent("1"))

        # An operator's clear: every block of A forgotten (AllBlocksCleared), B's kept.
        store(a, fresh, "r5")
        indexer.until(fresh, holds("1", 8, cpu=8))
        with KVOffloadAdminClient(a.admin_url, token=TOKEN) as admin:
            admin.clear_cache()
        indexer.until(fresh, absent("1"))
        indexer.until(PREFIX, absent("1"))
        indexer.until(OTHER, holds("2", 16, cpu=16))


def test_a_late_or_restarted_indexer_recovers_through_replay(tmp_path: Path, indexer: Indexer):
    ends = endpoints()
    with node(tmp_path / "a", ends).serving() as a:
        # Stored before any subscriber: only a replay can tell the indexer.
        store(a, PREFIX)
        indexer.register(1, a, ends)
        store(a, OTHER, "r2")  # its sequence number is past what the indexer expects: a gap
        indexer.until(PREFIX, holds("1", 16, cpu=16))
        indexer.stop()

        again = Indexer(tmp_path)
        try:
            again.register(1, a, ends)
            store(a, list(range(5000, 5004)), "r3")
            again.until(PREFIX, holds("1", 16, cpu=16))
            again.until(OTHER, holds("1", 16, cpu=16))
            assert "Gap detected" in again.log()
            assert "Replay complete" in again.log()
        finally:
            again.stop()


def test_a_kvoffload_restart_is_seen_through_its_clear(tmp_path: Path, indexer: Indexer):
    ends = endpoints()
    with node(tmp_path / "a", ends).serving() as a:
        indexer.register(1, a, ends)
        store(a, PREFIX)
        indexer.until(PREFIX, holds("1", 16, cpu=16))
    # The same addresses, a new process: its pool is empty. Its sequence numbers start above
    # the old one's, so the indexer sees a gap at its first batch it receives, replays the new
    # stream from its opening AllBlocksCleared and forgets the old blocks.
    with node(tmp_path / "a", ends).serving() as a:
        stores = itertools.count()

        def store_until_seen(answer: dict[str, dict[str, object]]) -> bool:
            # The indexer's SUB socket reconnects in its own time; what the new process sends
            # before that reaches it by replay once a later batch does.
            if "1" in answer:
                return True
            store(a, MARK, f"m{next(stores)}")
            return False

        indexer.until(MARK, store_until_seen)
        indexer.until(PREFIX, absent("1"))
