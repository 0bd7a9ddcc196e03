"""A key the service answers ``disk`` for, inside vLLM's real tiering code, against a real
service whose pool is too small to keep what was stored: the blocks went to its disk tier.

Engine A stores a prefix, then enough other blocks to push it out of the 8-block pool (every
evicted block is demoted: ``--disk-admit-after 1``). Engine B, with a primary tier of its own,
looks the prefix up: the tier answers RETRY while the service brings the blocks up from disk
(its prepare-load's 409 is expected), then HIT, and B loads the bytes A computed. No pin and no
fault is left. B's prefetches are off: this is the promotion by prepare-load
(``tests/vllm/test_tier_prefetch.py`` covers the prefetch).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from kvoffload_client.client import KVOffloadAdminClient
from vllm.v1.kv_offload.base import ReqContext

from tests.vllm.conftest import leases, serve
from tests.vllm.test_tier_remote import answered, faults, store_through_tier
from testsupport.server import TOKEN, ServerProcess
from testsupport.vllm_sim import SimEngine, chunk_bytes, keys_of, kv_transfer_config

POOL_BLOCKS = 8


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    work = tmp_path_factory.mktemp("disk")
    flags = ["--num-blocks", str(POOL_BLOCKS), "--disk-dir", str(work / "disk")]
    flags += ["--disk-bytes", str(4 << 20), "--disk-admit-after", "1"]
    with serve(work, *flags).serving() as s:
        yield s


def disk_stats(srv: ServerProcess) -> dict[str, object]:
    with KVOffloadAdminClient(srv.admin_url, token=TOKEN) as admin:
        stats = admin.stats()
    disk = stats["tiers"]["disk"]
    assert isinstance(disk, dict)
    return disk


def test_disk_key_is_promoted_and_loaded_with_the_bytes_written(
    srv: ServerProcess, tmp_path: Path
) -> None:
    prefix = keys_of(range(2000, 2006))
    store_through_tier(srv, prefix)
    # More blocks than the pool holds (in requests the engine's primary tier can hold): the
    # prefix is evicted, demoted to disk.
    for first in range(2100, 2100 + 3 * POOL_BLOCKS, 6):
        store_through_tier(srv, keys_of(range(first, first + 6)))
    for _ in range(500):  # the demotions are written in the background
        before = disk_stats(srv)
        if before["demotions"]["written"] >= len(prefix):  # type: ignore[index]
            break
        time.sleep(0.01)
    assert before["demotions"]["written"] >= len(prefix), before  # type: ignore[index]
    config = kv_transfer_config(f"unix://{srv.uds}", cpu_chunks=16, prefetch_deadline_s=0)
    b = SimEngine("t-disk-b", config)
    try:
        ctx = ReqContext(req_id="disk-b")
        b.start(ctx)
        assert b.prefix_lookup(prefix, ctx) is None  # RETRY: asked of the service
        seen = answered(b, prefix, ctx)
        assert seen[-1] == len(prefix)
        assert all(s is None for s in seen[:-1])  # RETRY until then, never MISS
        assert b.load(prefix, ctx) == {k: chunk_bytes(k, b.model) for k in prefix}
        b.finish(ctx)
        b.step()
        b.settle()
        assert faults(b) == {}  # the promotion's 409 is expected
    finally:
        b.close()
    after = disk_stats(srv)
    promoted = after["promotions"]["loaded"]  # type: ignore[index]
    assert promoted >= len(prefix)
    assert after["counters"]["checksum_failures"] == 0  # type: ignore[index]
    assert leases(srv) == []
