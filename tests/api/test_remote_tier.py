"""The remote tier through the engine and admin APIs, two nodes in one process.

Both nodes are whole services (apps, lifespans, pools) sharing one ``MemoryStore``: a remote
tier backend that keeps blocks in a dict and copies them in and out of the real host pool's
slots, with the contract of ``transfer.remote`` (and ``held_slots`` for calls that outlive their
caller). What it lets these tests do that the Mooncake tests (``tests/remote``) cannot:
deterministic interleavings — a slow get, a degraded tier, a full queue — checked call by call.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest

from app.core.remote import RemoteBackend, RemoteLink
from app.settings import Settings
from testsupport.api_harness import BLOCK, Harness, hexkeys, make_settings, running
from testsupport.polling import until_async
from transfer import HostPool
from transfer.remote import (
    COUNTERS,
    RemoteHealth,
    RemoteState,
    check_blocks,
    check_slots,
    remote_name,
)

pytestmark = pytest.mark.anyio


class MemoryStore:
    """The shared store: remote name -> block bytes, and switches for faults."""

    def __init__(self) -> None:
        self.blocks: dict[str, bytes] = {}
        self.down = False
        self.get_delay = 0.0
        self.unanswered = False  # exists answers None (no answer) per key, the tier still ok
        self.asked: list[int] = []  # keys per exists call
        self.lock = threading.Lock()
        self.puts_open = threading.Event()  # cleared: every put waits until it is set
        self.puts_open.set()


class MemoryTier:
    """A ``transfer.remote.RemoteTier`` over a ``MemoryStore``."""

    def __init__(self, store: MemoryStore, pool: HostPool, namespace: str) -> None:
        self.store = store
        self.pool = pool
        self._namespace = namespace
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.held: set[int] = set()
        self.closed = False

    @property
    def namespace(self) -> str:
        return self._namespace

    def exists(self, keys: Sequence[bytes], timeout_s: float | None = None) -> list[bool | None]:
        self.store.asked.append(len(keys))
        if self.store.down or self.store.unanswered:
            self.counters["skipped"] += 1
            return [None] * len(keys)
        found = [remote_name(self._namespace, k) in self.store.blocks for k in keys]
        self.counters["hits"] += sum(found)
        self.counters["misses"] += len(found) - sum(found)
        return list[bool | None](found)

    def get_into(self, keys: Sequence[bytes], slots: Sequence[int]) -> list[bool]:
        check_slots(keys, slots, self.pool.num_blocks)
        if self.store.down:
            return [False] * len(keys)
        self.held.update(slots)
        try:
            time.sleep(self.store.get_delay)
            out = []
            for key, slot in zip(keys, slots, strict=True):
                data = self.store.blocks.get(remote_name(self._namespace, key))
                if data is None:
                    out.append(False)
                    continue
                self.pool.tensor[slot].numpy()[:] = memoryview(data)
                self.counters["gets"] += 1
                out.append(True)
            return out
        finally:
            self.held.difference_update(slots)

    def put_from(self, keys: Sequence[bytes], slots: Sequence[int]) -> list[bool]:
        check_slots(keys, slots, self.pool.num_blocks)
        return self.put_bytes(keys, [bytes(self.pool.tensor[s].numpy()) for s in slots])

    def put_bytes(self, keys: Sequence[bytes], blocks: Sequence[bytes]) -> list[bool]:
        check_blocks(keys, blocks, self.pool.block_bytes)
        self.store.puts_open.wait(10)
        if self.store.down:
            return [False] * len(keys)
        for key, block in zip(keys, blocks, strict=True):
            self.store.blocks[remote_name(self._namespace, key)] = bytes(block)
            self.counters["puts"] += 1
        return [True] * len(keys)

    def health(self) -> RemoteHealth:
        state: RemoteState = "degraded" if self.store.down else "ok"
        return RemoteHealth(
            state, 0.0, "store down" if self.store.down else None, dict(self.counters)
        )

    def held_slots(self) -> frozenset[int]:
        return frozenset(self.held)

    def close(self) -> None:
        self.closed = True


def remote_settings(**overrides: Any) -> Settings:
    # Removals reported on the first "not held" unless a test says otherwise (the memory
    # store has no takeover that answers "not held" for a while).
    return make_settings(
        **{
            "remote_tier": "mooncake",
            "mooncake_master": "store:1",
            "mooncake_metadata": "http://store/metadata",
            "remote_lookup_timeout_s": 1.0,
            "remote_removal_confirm_s": 0.0,
            **overrides,
        }
    )


@contextlib.asynccontextmanager
async def node(store: MemoryStore, **overrides: Any) -> AsyncIterator[Harness]:
    def factory(settings: Settings, pool: HostPool, namespace: str) -> MemoryTier:
        return MemoryTier(store, pool, f"kvoffload/{namespace}/{settings.block_bytes}")

    backend = RemoteBackend(factory)
    async with running(remote_settings(**overrides), tier_backends={"remote": backend}) as h:
        yield h


def remote_of(h: Harness) -> RemoteLink:
    remote = h.service.tiers.get("remote")
    assert isinstance(remote, RemoteLink)
    return remote


def pool_bytes(h: Harness, slot: int) -> bytes:
    return bytes(h.service.transfers().pool.tensor[slot].numpy())


async def store_on(h: Harness, req: str, keys: list[str], fill: int) -> dict[str, bytes]:
    """Store ``keys`` through the pool (bytes written into the slots); their bytes."""
    await h.start(req)
    r = await h.post(f"/v1/requests/{req}/prepare-store", {"keys": keys})
    assert r.status_code == 200, r.text
    written = {}
    pool = h.service.transfers().pool
    for i, (key, slot) in enumerate(zip(r.json()["keys_to_store"], r.json()["slots"], strict=True)):
        data = bytes([(fill + i) % 256]) * BLOCK
        pool.tensor[slot].numpy()[:] = memoryview(data)
        written[key] = data
    r = await h.post(f"/v1/requests/{req}/complete-store", {"keys": keys})
    assert r.json()["completed"] == keys
    return written


async def written(h: Harness, count: int) -> None:
    async def done() -> bool:
        stats = (await h.admin.get("/admin/v1/stats")).json()
        return bool(stats["tiers"]["remote"]["written"] >= count)

    await until_async("done", done)


async def test_a_prefix_stored_on_one_node_loads_with_identical_bytes_on_another() -> None:
    store = MemoryStore()
    keys = hexkeys(1, 2, 3)
    async with node(store) as a, node(store) as b:
        data = await store_on(a, "w", keys, fill=7)
        await written(a, 3)
        events = (await a.client.get("/v1/events")).json()["events"]
        assert [e["medium"] for e in events if e["type"] == "BlockStored"] == ["CPU", "REMOTE"]

        await b.start("r")
        r = await b.post("/v1/requests/r/lookup", {"keys": keys + hexkeys(9)})
        assert r.json() == {"results": ["remote"] * 3 + ["miss"], "hit_prefix": 0}
        r = await b.post("/v1/requests/r/prepare-load", {"keys": keys})
        assert r.status_code == 409  # brought in first

        async def ready() -> bool:
            r = await b.post("/v1/requests/r/lookup", {"keys": keys})
            return bool(r.json()["hit_prefix"] == 3)

        await until_async("ready", ready)
        r = await b.post("/v1/requests/r/prepare-load", {"keys": keys})
        assert r.status_code == 200, r.text
        for key, slot in zip(keys, r.json()["slots"], strict=True):
            assert pool_bytes(b, slot) == data[key]
        # Pinned once, by the request's own load: the promotion's hold let go of them.
        manager = b.service.pool_manager
        assert all(manager.ref_count(bytes.fromhex(k)) == 1 for k in keys)
        await b.post("/v1/requests/r/complete-load", {"keys": keys})
        assert (await b.client.delete("/v1/requests/r")).status_code == 200
        assert manager.num_pinned == 0
        stats = (await b.admin.get("/admin/v1/stats")).json()["tiers"]["remote"]
        assert stats["promotions"]["loaded"] == 3
        assert stats["state"] == "ok"


async def test_pool_hits_never_ask_the_remote_tier() -> None:
    store = MemoryStore()
    keys = hexkeys(1, 2)
    async with node(store) as a:
        await store_on(a, "w", keys, fill=1)
        tier = remote_of(a).tier
        assert isinstance(tier, MemoryTier)
        asked = tier.counters["hits"] + tier.counters["misses"]
        r = await a.post("/v1/requests/w/lookup", {"keys": keys})
        assert r.json()["hit_prefix"] == 2
        assert tier.counters["hits"] + tier.counters["misses"] == asked


async def test_a_degraded_tier_means_misses_readiness_with_details_and_no_writes() -> None:
    store = MemoryStore()
    keys = hexkeys(1, 2)
    async with node(store) as a, node(store) as b:
        await store_on(a, "w", keys, fill=3)
        await written(a, 2)
        store.down = True
        await b.start("r")
        r = await b.post("/v1/requests/r/lookup", {"keys": keys})
        assert r.json()["results"] == ["miss", "miss"]
        assert (await b.post("/v1/requests/r/prepare-load", {"keys": keys})).status_code == 409
        assert b.service.pool_manager.stats().pending == 0  # nothing was started
        ready = (await b.client.get("/readyz")).json()
        assert ready["status"] == "ready"
        assert "degraded" in ready["details"]["remote_tier"]
        # A's own blocks still hit; new blocks are not written while degraded (dropped, counted).
        r = await a.post("/v1/requests/w/lookup", {"keys": keys})
        assert r.json()["hit_prefix"] == 2
        await store_on(a, "w2", hexkeys(5), fill=9)
        stats = (await a.admin.get("/admin/v1/stats")).json()["tiers"]["remote"]

        async def dropped() -> bool:
            s = (await a.admin.get("/admin/v1/stats")).json()["tiers"]["remote"]
            return bool(s["queue"]["dropped"] >= 1)

        await until_async("dropped", dropped)
        # Back: the tier is used again.
        store.down = False
        r = await b.post("/v1/requests/r/lookup", {"keys": keys})
        assert r.json()["results"] == ["remote", "remote"]
        assert stats["state"] == "degraded"


async def test_a_key_that_vanished_remotely_is_dropped_never_loaded() -> None:
    store = MemoryStore()
    keys = hexkeys(1, 2)
    async with node(store) as a, node(store) as b:
        await store_on(a, "w", keys, fill=5)
        await written(a, 2)
        del store.blocks[next(n for n in store.blocks if n.endswith(keys[1]))]
        await b.start("r")
        assert (await b.post("/v1/requests/r/prepare-load", {"keys": keys})).status_code == 409

        async def settled() -> bool:
            r = await b.post("/v1/requests/r/lookup", {"keys": keys})
            return bool(r.json()["results"] == ["hit", "miss"])

        await until_async("settled", settled)
        assert (await b.post("/v1/requests/r/prepare-load", {"keys": keys})).status_code == 409
        r = await b.post("/v1/requests/r/prepare-load", {"keys": keys[:1]})
        assert r.status_code == 200


async def test_an_abort_during_a_slow_get_keeps_the_slots_until_it_ends() -> None:
    """The promotion's slots belong to its own internal request: the engine's abort neither
    frees them under the get nor drops the blocks; they land, for the next request."""
    store = MemoryStore()
    keys = hexkeys(1, 2)
    async with node(store) as a, node(store, lease_ttl_s=6.0, job_deadline_s=5.0) as b:
        await store_on(a, "w", keys, fill=11)
        await written(a, 2)
        store.get_delay = 0.3
        await b.start("r")
        assert (await b.post("/v1/requests/r/prepare-load", {"keys": keys})).status_code == 409
        writing = remote_of(b).writing()
        assert [w.startswith("kvoffload-remote-promote-") for w in writing] == [True]
        assert b.service.transfers().writing() == writing
        r = await b.client.delete("/v1/requests/r", params={"abort": "true"})
        assert r.status_code == 200
        manager = b.service.pool_manager
        assert manager.stats().free == b.settings.num_blocks - 2  # still reserved
        await b.start("x")

        async def landed() -> bool:
            r = await b.post("/v1/requests/x/lookup", {"keys": keys})
            return bool(r.json()["results"] == ["hit", "hit"])

        await until_async("landed", landed)
        assert "r" not in manager.request_ids  # the engine's own request is gone, as it asked
        assert not remote_of(b).writing()


async def test_write_behind_queue_is_bounded_and_counts_drops() -> None:
    store = MemoryStore()
    async with node(store, remote_queue_blocks=2, remote_batch_blocks=1) as a:
        store.get_delay = 0.0
        link = remote_of(a)
        assert link is not None
        link.stored([bytes([i]) for i in range(5)])  # not stored here: gone before the put
        assert link.queue_depth <= 2
        stats = (await a.admin.get("/admin/v1/stats")).json()["tiers"]["remote"]
        assert stats["queue"]["dropped"] == 3
        assert stats["queue"]["dropped_by"] == {"queue_full": 3}
        assert stats["queue"]["capacity"] == 2


async def test_metrics_show_the_remote_tier() -> None:
    store = MemoryStore()
    async with node(store) as a, node(store) as b:
        await store_on(a, "w", hexkeys(1), fill=1)
        await written(a, 1)
        await b.start("r")
        await b.post("/v1/requests/r/lookup", {"keys": hexkeys(1)})
        text = (
            await b.client.get("/metrics", headers={"accept": "application/openmetrics-text"})
        ).text
        assert 'kvoffload_tier_up{tier="remote"} 1.0' in text
        assert 'kvoffload_tier_io_keys_total{op="exists",tier="remote"} 1.0 # {req_id="r"}' in text
        assert "kvoffload_remote_hits_total 1.0" in text


async def test_an_onload_of_remote_keys_promotes_them_then_loads_identical_bytes() -> None:
    store = MemoryStore()
    keys = hexkeys(1, 2)
    async with node(store) as a, node(store) as b:
        data = await store_on(a, "w", keys, fill=21)
        await written(a, 2)
        dev, cache_id = await b.device()
        await b.start("r")
        body = {"cache_id": cache_id, "keys": keys, "device_blocks": [3, 4]}
        # One call: the job brings them in from the remote tier, then loads them.
        r = await b.post("/v1/requests/r/onload", body)
        assert r.status_code == 202, r.text
        job = await b.wait(r.json()["job_id"])
        assert job["state"] == "done", job
        assert [dev.read(3), dev.read(4)] == [data[k] for k in keys]
        # The job's load unpinned them, and the promotion's hold went with its pin.
        assert b.service.pool_manager.num_pinned == 0


# ---------------------------------------------------------------------- removals reported


def evict(store: MemoryStore, key: str) -> None:
    """What the store's own eviction does: the block is gone, and nobody is told."""
    del store.blocks[next(n for n in store.blocks if n.endswith(key))]


async def events(h: Harness, kind: str, medium: str = "REMOTE") -> list[list[str]]:
    page = (await h.client.get("/v1/events")).json()["events"]
    return [e["block_hashes"] for e in page if e["type"] == kind and e["medium"] == medium]


async def sweeps(store: MemoryStore, n: int) -> None:
    """Wait until the store was asked ``n`` more times (sweeps ran meanwhile)."""
    asked = len(store.asked)

    async def enough() -> bool:
        return len(store.asked) >= asked + n

    await until_async("enough", enough)


async def removed_keys(h: Harness) -> list[str]:
    """Every key of the node's REMOTE ``BlockRemoved`` events, sorted (repeats kept)."""
    return sorted(k for keys in await events(h, "BlockRemoved") for k in keys)


async def test_a_block_the_store_evicts_is_reported_removed_by_the_sweep() -> None:
    store = MemoryStore()
    keys = hexkeys(1, 2, 3)
    async with node(store, remote_sweep_s=0.05) as a:
        await store_on(a, "w", keys, fill=3)
        await written(a, 3)
        assert await events(a, "BlockStored") == [keys]
        evict(store, keys[1])

        async def reported() -> bool:
            return bool(await events(a, "BlockRemoved"))

        await until_async("reported", reported)
        await sweeps(store, 3)  # the others are still there
        assert await events(a, "BlockRemoved") == [[keys[1]]]
        tracked = (await a.admin.get("/admin/v1/stats")).json()["tiers"]["remote"]["tracked"]
        assert tracked.pop("asked") >= 9  # three keys, three sweeps at least
        assert tracked == {
            "blocks": 2, "capacity": 262144, "suspected": 0, "removed": 1, "untracked": 0,
            "sweep_s": 0.05, "removal_confirm_s": 0.0,
        }  # fmt: skip
        text = (await a.client.get("/metrics")).text
        assert "kvoffload_remote_removed_blocks_total 1.0" in text
        assert "kvoffload_remote_hits_total 0.0" in text  # sweeps are not lookups
        assert "kvoffload_remote_tracked_blocks 2.0" in text
        assert 'kvoffload_tier_io_keys_total{op="sweep",tier="remote"}' in text
        # The store loses all (1 and 3 go too), 2 is written again and evicted again: each
        # removal reported once, 2 twice, as each of its stores.
        store.blocks.clear()
        await a.admin.post("/admin/v1/cache/clear")
        await store_on(a, "w2", keys[1:2], fill=9)
        await written(a, 4)
        evict(store, keys[1])

        async def all_reported() -> bool:
            return sum(len(k) for k in await events(a, "BlockRemoved")) == 4

        # And nothing is left to report: none is tracked.
        await until_async("every removal reported", all_reported)
        assert await removed_keys(a) == sorted([*keys, keys[1]])
        assert (await a.admin.get("/admin/v1/stats")).json()["tiers"]["remote"]["tracked"][
            "blocks"
        ] == 0


async def test_a_lookup_that_finds_a_written_block_gone_reports_it_without_a_sweep() -> None:
    store = MemoryStore()
    keys = hexkeys(1, 2)
    async with node(store, remote_sweep_s=0) as a:
        await store_on(a, "w", keys, fill=3)
        await written(a, 2)
        evict(store, keys[0])
        await a.admin.post("/admin/v1/cache/clear")  # the pool lacks them: lookups ask
        await a.start("r")
        r = await a.post("/v1/requests/r/lookup", {"keys": keys})
        assert r.json()["results"] == ["miss", "remote"]
        assert await events(a, "BlockRemoved") == [[keys[0]]]
        r = await a.post("/v1/requests/r/lookup", {"keys": keys})
        assert await events(a, "BlockRemoved") == [[keys[0]]]  # reported once
        assert remote_of(a)._sweep is None


async def test_no_answer_is_not_a_removal() -> None:
    """A sweep (or lookup) the store did not answer, or skipped while degraded, reports
    nothing: only the store's own "not held" does."""
    store = MemoryStore()
    keys = hexkeys(1, 2)
    async with node(store, remote_sweep_s=0.05) as a:
        await store_on(a, "w", keys, fill=3)
        await written(a, 2)
        store.unanswered = True
        store.blocks.clear()  # gone, but the store gives no answer about them
        await sweeps(store, 3)
        assert await events(a, "BlockRemoved") == []
        store.unanswered = False
        store.down = True  # degraded: nothing is asked, nothing reported
        await a.admin.post("/admin/v1/cache/clear")
        await a.start("r")
        r = await a.post("/v1/requests/r/lookup", {"keys": keys})
        assert r.json()["results"] == ["miss", "miss"]
        asked = len(store.asked)
        await asyncio.sleep(0.2)  # four ticks of the sweep, each skipped
        assert len(store.asked) == asked
        assert await events(a, "BlockRemoved") == []
        store.down = False  # back, and empty: now the sweep can tell

        async def reported() -> bool:
            return bool(await events(a, "BlockRemoved"))

        await until_async("reported", reported)
        assert await removed_keys(a) == keys


async def test_a_block_stored_again_while_it_is_asked_after_is_not_reported() -> None:
    store = MemoryStore()
    async with node(store, remote_sweep_s=0) as a:
        link = remote_of(a)
        assert link is not None
        key = bytes.fromhex(hexkeys(1)[0])
        link._track([key])
        stamps = link.written.stamps_of([key])
        link._track([key])  # a put of the same key ended while the store was asked
        link._settle([key], stamps, [False])
        assert link.state()["tracked"]["blocks"] == 1
        link._settle([key], link.written.stamps_of([key]), [None])
        assert link.state()["tracked"]["blocks"] == 1
        link._settle([key], link.written.stamps_of([key]), [False])
        assert link.state()["tracked"]["blocks"] == 0
        assert await events(a, "BlockRemoved") == [[hexkeys(1)[0]]]


async def test_tracking_is_bounded_and_the_head_of_the_line_is_reported_removed() -> None:
    store = MemoryStore()
    keys = hexkeys(1, 2, 3)
    async with node(store, remote_sweep_s=0, remote_tracked_blocks=2, remote_batch_blocks=1) as a:
        await store_on(a, "w", keys, fill=3)
        await written(a, 3)
        assert await events(a, "BlockRemoved") == [keys[:1]]
        tracked = (await a.admin.get("/admin/v1/stats")).json()["tiers"]["remote"]["tracked"]
        assert (tracked["blocks"], tracked["untracked"], tracked["removed"]) == (2, 1, 1)


async def test_the_sweep_asks_after_every_block_once_per_period_in_slices() -> None:
    store = MemoryStore()
    async with node(store, remote_sweep_s=0) as a:  # no sweep of its own in between
        link = remote_of(a)
        assert link is not None
        link.sweep_s = 4
        keys = [i.to_bytes(8, "big") for i in range(100)]
        store.blocks.update((remote_name(link.tier.namespace, k), b"") for k in keys)
        link._track(keys)
        store.asked.clear()
        for _ in range(4):  # four ticks of a second: a quarter each, oldest first
            assert await link.sweep() == 25
        assert store.asked == [25] * 4
        assert list(link.written) == keys  # every one asked once, back in its order


async def test_a_block_is_reported_removed_only_once_it_stayed_gone_for_the_confirm_time() -> None:
    """A "not held" that does not last (a segment not yet back with a new HA leader) is a
    suspicion, not a removal; one that lasts ``remote_removal_confirm_s`` is reported."""
    store = MemoryStore()
    keys = hexkeys(1, 2)
    async with node(store, remote_sweep_s=0.05, remote_removal_confirm_s=0.5) as a:
        await store_on(a, "w", keys, fill=3)
        await written(a, 2)
        name = next(n for n in store.blocks if n.endswith(keys[0]))
        data = store.blocks.pop(name)  # gone for a moment
        await sweeps(store, 2)
        stats = (await a.admin.get("/admin/v1/stats")).json()["tiers"]["remote"]["tracked"]
        assert (stats["suspected"], stats["removed"]) == (1, 0)
        store.blocks[name] = data  # back: the suspicion is cleared
        await sweeps(store, 2)
        stats = (await a.admin.get("/admin/v1/stats")).json()["tiers"]["remote"]["tracked"]
        assert (stats["suspected"], stats["blocks"]) == (0, 2)
        await asyncio.sleep(0.5)  # longer than the confirm time: a fresh absence starts again
        gone_at = time.monotonic()
        del store.blocks[name]

        async def reported() -> bool:
            return bool(await events(a, "BlockRemoved"))

        await until_async("reported", reported)
        assert time.monotonic() - gone_at >= 0.5
        assert await removed_keys(a) == keys[:1]


async def test_demote_moves_what_the_remote_tier_wrote_and_keeps_what_it_did_not() -> None:
    store = MemoryStore()
    async with node(store) as h:
        keys = [bytes([0x0A, i]).hex() for i in (1, 2)]
        data = await store_on(h, "w", keys, fill=7)
        await written(h, 2)
        stopped = remote_of(h)  # a third key the write-behind never takes: its queue is full
        stopped.writes.queue_blocks = 0
        late = bytes([0x0A, 3]).hex()
        await store_on(h, "x", [late], fill=9)
        r = await h.post("/v1/requests/hint/demote", {"keys": [*keys, late]})
        assert r.status_code == 200, r.text
        assert r.json()["moved"] == keys
        assert r.json()["kept"]["refused"] == 1  # not written below: it stays in the pool
        await h.start("l")
        r = await h.post("/v1/requests/l/lookup", {"keys": [*keys, late]})
        assert r.json()["results"] == ["remote", "remote", "hit"], r.text
        assert set(data) == set(keys)


async def burst(h: Harness, stores: int, per_store: int) -> dict[str, bytes]:
    """``stores`` offloads of ``per_store`` new blocks each, back to back; their bytes."""
    data: dict[str, bytes] = {}
    for i in range(stores):
        keys = hexkeys(*range(100 + i * per_store, 100 + (i + 1) * per_store))
        data |= await store_on(h, f"burst{i}", keys, fill=i * per_store)
    return data


async def test_blocks_the_pool_evicts_before_their_put_are_staged_and_written() -> None:
    # A pool of 16 blocks and 6 stores of 8 new blocks while the store is slow (its puts wait):
    # the first batch is held in the pool for its put, the 32 blocks after it that the pool
    # evicts before their turn are copied out at the eviction and written from the copy.
    store = MemoryStore()
    store.puts_open.clear()
    async with node(store, num_blocks=16) as a:
        data = await burst(a, 6, 8)
        remote = remote_of(a)
        assert remote.counts["staged"] >= 24
        assert remote.state()["queue"]["staged_bytes"] > 0
        store.puts_open.set()
        await written(a, 48)
        tier = remote.tier
        assert isinstance(tier, MemoryTier)
        for key, block in data.items():
            assert store.blocks[remote_name(tier.namespace, bytes.fromhex(key))] == block
        state = remote.state()
        assert state["queue"]["dropped"] == 0
        assert state["queue"]["staged_bytes"] == 0
        assert state["write_behind_failed"]["gone_before_put"] == 0


async def test_staging_is_bounded_in_bytes_and_what_it_cannot_take_is_counted() -> None:
    store = MemoryStore()
    store.puts_open.clear()
    async with node(store, num_blocks=16, remote_staging_bytes=4 * BLOCK) as a:
        data = await burst(a, 6, 8)
        remote = remote_of(a)
        assert remote.state()["queue"]["staged_bytes"] == 4 * BLOCK
        store.puts_open.set()
        dropped = remote.counts["dropped_staging_full"]
        assert dropped > 0
        await written(a, len(data) - dropped)
        stats = (await a.admin.get("/admin/v1/stats")).json()["tiers"]["remote"]
        assert stats["queue"]["dropped_by"]["staging_full"] == dropped
        assert stats["write_behind_failed"]["gone_before_put"] == 0
        names = {remote_name(remote.tier.namespace, bytes.fromhex(k)) for k in data}
        assert len(names & store.blocks.keys()) == len(data) - dropped


async def test_without_staging_the_evicted_blocks_are_lost_and_counted() -> None:
    # The setting's floor, and what the staging above changes: nothing is copied out.
    store = MemoryStore()
    store.puts_open.clear()
    async with node(store, num_blocks=16, remote_staging_bytes=0) as a:
        data = await burst(a, 6, 8)
        remote = remote_of(a)
        dropped = remote.counts["dropped_staging_full"]
        assert dropped >= 24
        assert remote.counts["staged"] == 0
        store.puts_open.set()
        await written(a, len(data) - dropped)
        assert remote.counts["gone_before_put"] == 0
