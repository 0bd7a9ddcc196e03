"""The disk tier through the engine and admin APIs: one in-process service over a real directory.

The pool is small (32 blocks of 4 KiB) so a few dozen stores overflow it and the evicted blocks
are demoted to the disk; every test reads the bytes back and compares them with what was stored.
The fault tests use a tmpfs of their own (mounted here: root only) for a disk that really fills
up or turns read-only, and the store's ``pwritev``/``preadv`` seams for I/O errors. No call
through the HTTP API may answer 5xx in any of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import shutil
import subprocess
import threading
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

import app.core.asks as asks
import app.core.disk as disk_module
from app.core.disk import DiskLink
from app.core.service import Service
from app.settings import ConfigError
from manager import BlockKey
from testsupport.api_harness import BLOCK, Harness, hexkeys, make_settings, running
from testsupport.polling import until_async
from transfer.disk import DiskStore, disk_bytes_for

pytestmark = pytest.mark.anyio


@pytest.fixture(autouse=True)
def fast_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(disk_module, "PROBE_S", 0.05)


@contextlib.asynccontextmanager
async def disk_node(directory: Path, **overrides: Any) -> AsyncIterator[Harness]:
    settings: dict[str, Any] = {
        "disk_dir": directory,
        "disk_bytes": disk_bytes_for(64, 4096),
        "disk_admit_after": 1,
        "disk_batch_bytes": 8 * 4096,
        **overrides,
    }
    async with running(make_settings(**settings)) as h:
        yield h


def link(h: Harness) -> DiskLink:
    disk = h.service.tiers.get("disk")
    assert isinstance(disk, DiskLink)
    return disk


def gated(store: DiskStore, call: str) -> threading.Event:
    """Hold the store's ``preadv`` or ``pwritev`` (``call``) until the returned event is set
    (at most 10 s): I/O in flight at a moment the test chooses."""
    gate = threading.Event()
    real = getattr(store, call)

    def held(fd: int, bufs: list[memoryview], off: int) -> int:
        gate.wait(10)
        return int(real(fd, bufs, off))

    setattr(store, call, held)
    return gate


def pool_bytes(h: Harness, slot: int) -> bytes:
    return bytes(h.service.transfers().pool.tensor[slot].numpy())


async def store(h: Harness, req: str, keys: list[str]) -> dict[str, bytes]:
    """Store ``keys`` through the pool, random bytes each (8 at a time); their bytes."""
    await h.start(req)
    written: dict[str, bytes] = {}
    pool = h.service.transfers().pool
    for at in range(0, len(keys), 8):
        chunk = keys[at : at + 8]
        r = await h.post(f"/v1/requests/{req}/prepare-store", {"keys": chunk})
        assert r.status_code == 200, r.text
        body = r.json()
        for key, slot in zip(body["keys_to_store"], body["slots"], strict=True):
            data = os.urandom(BLOCK)
            pool.tensor[slot].numpy()[:] = memoryview(data)
            written[key] = data
        r = await h.post(f"/v1/requests/{req}/complete-store", {"keys": chunk})
        assert r.status_code == 200, r.text
    return written


async def stats(h: Harness) -> dict[str, Any]:
    r = await h.admin.get("/admin/v1/stats")
    assert r.status_code == 200, r.text
    disk: dict[str, Any] = r.json()["tiers"]["disk"]
    return disk


async def demoted(h: Harness, count: int) -> None:
    async def done() -> bool:
        return bool((await stats(h))["demotions"]["written"] >= count)

    await until_async("done", done)


async def lookup(h: Harness, req: str, keys: list[str]) -> list[str]:
    r = await h.post(f"/v1/requests/{req}/lookup", {"keys": keys})
    assert r.status_code == 200, r.text
    results: list[str] = r.json()["results"]
    return results


async def events(h: Harness) -> list[dict[str, Any]]:
    r = await h.client.get("/v1/events", params={"limit": 1000})
    assert r.status_code == 200, r.text
    out: list[dict[str, Any]] = r.json()["events"]
    return out


def disk_events(evs: list[dict[str, Any]], kind: str) -> set[str]:
    return {
        k for e in evs if e["type"] == kind and e["medium"] == "DISK" for k in e["block_hashes"]
    }


async def invariants(h: Harness) -> None:
    """The pool and the disk index at rest: nothing pinned, pending or held by a promotion.
    Waits first for the tier's own work to settle: a promotion's room-making may have demoted
    pool blocks whose writes are still running when the engine's job ends."""
    manager = h.service.pool_manager
    d = link(h)

    async def settled() -> bool:
        return (
            not len(d.writes)
            and d.index.index.stats().pending == 0
            and d.promotions.in_flight == 0
            and not d.store.held_slots()
        )

    await until_async("settled", settled)
    assert manager.num_pinned == 0
    assert manager.stats().pending == 0
    assert d.index.index.num_pinned == 0
    for m in (manager, d.index.index):
        st = m.stats()
        assert st.free + st.pending + st.ready == st.num_blocks
    # The disk index and the store's entries agree: each block on disk is listed at its slot.
    entries = d.store.index.entries
    for key in d.index.index.resident_keys():
        slot = d.index.index.slot_of(key)
        assert slot is not None
        assert entries[slot].key == key


# --------------------------------------------------------------------------- the happy path


async def test_evicted_blocks_demote_and_onload_in_one_call_with_identical_bytes(
    tmp_path: Path,
) -> None:
    async with disk_node(tmp_path) as h:
        keys = hexkeys(*range(1, 49))
        data = await store(h, "w", keys)
        await demoted(h, 16)  # 48 stored, 32 fit: the 16 oldest went down
        assert await lookup(h, "w", keys[:16]) == ["disk"] * 16
        assert disk_events(await events(h), "BlockStored") == set(keys[:16])

        dev, cache_id = await h.device(16)
        await h.start("r")
        body = {"cache_id": cache_id, "keys": keys[:8], "device_blocks": list(range(8))}
        r = await h.post("/v1/requests/r/onload", body)
        assert r.status_code == 202, r.text  # one call: no 409 round trip
        job = await h.wait(r.json()["job_id"])
        assert job["state"] == "done", job
        assert [dev.read(i) for i in range(8)] == [data[k] for k in keys[:8]]

        # The batch API: same, in one op.
        op = {"op": "onload", "req_id": "r", "cache_id": cache_id}
        r = await h.post(
            "/v1/batch", {"ops": [{**op, "keys": keys[8:16], "device_blocks": list(range(8, 16))}]}
        )
        result = r.json()["results"][0]
        assert result["status"] == 202, result
        job = await h.wait(result["result"]["job_id"])
        assert job["state"] == "done", job
        assert [dev.read(8 + i) for i in range(8)] == [data[k] for k in keys[8:16]]

        # A key on no tier: still a 409 at onload, whichever way.
        bad = {"cache_id": cache_id, "keys": [keys[0], hexkeys(999)[0]], "device_blocks": [0, 1]}
        r = await h.post("/v1/requests/r/onload", bad)
        assert r.status_code == 409, r.text
        assert r.json()["error"]["code"] == "key_not_ready"
        r = await h.post("/v1/batch", {"ops": [{**op, **bad}]})
        assert r.json()["results"][0]["status"] == 409

        assert (await h.client.delete("/v1/requests/r")).status_code == 200
        assert (await h.client.delete("/v1/requests/w")).status_code == 200

        async def settled() -> bool:
            return h.service.pool_manager.num_pinned == 0

        await until_async("settled", settled)
        s = await stats(h)
        assert s["promotions"]["loaded"] >= 16
        assert s["state"] == "ok"
        assert s["corrupt_dropped"] == 0


async def test_prepare_load_of_a_disk_key_is_409_then_pending_then_hit(tmp_path: Path) -> None:
    async with disk_node(tmp_path) as h:
        keys = hexkeys(*range(1, 41))
        data = await store(h, "w", keys)
        await demoted(h, 8)
        cold = keys[:4]
        assert await lookup(h, "w", cold) == ["disk"] * 4
        await h.start("r")
        # Slow the read down so "pending" can be seen.
        store_ = link(h).store
        real = store_.preadv

        def slow(fd: int, bufs: list[memoryview], off: int) -> int:
            time.sleep(0.2)
            return real(fd, bufs, off)

        store_.preadv = slow
        r = await h.post("/v1/requests/r/prepare-load", {"keys": cold})
        assert r.status_code == 409
        assert r.json()["error"]["code"] == "key_not_ready"
        assert "pending" in await lookup(h, "r", cold)

        async def hit() -> bool:
            return await lookup(h, "r", cold) == ["hit"] * 4

        await until_async("hit", hit)
        store_.preadv = real
        r = await h.post("/v1/requests/r/prepare-load", {"keys": cold})
        assert r.status_code == 200, r.text
        assert [pool_bytes(h, s) for s in r.json()["slots"]] == [data[k] for k in cold]
        await h.post("/v1/requests/r/complete-load", {"keys": cold})
        await h.client.delete("/v1/requests/r")
        await h.client.delete("/v1/requests/w")
        await invariants(h)


# --------------------------------------------------------------------------- events


async def test_disk_events_stored_on_demotion_removed_on_eviction_and_on_corruption(
    tmp_path: Path,
) -> None:
    # 8 disk slots: demoting more than 8 evicts the disk's own oldest blocks.
    async with disk_node(tmp_path, disk_bytes=disk_bytes_for(8, 4096)) as h:
        assert link(h).index.num_slots == 8
        keys = hexkeys(*range(1, 45))  # 12 demoted into 8 slots: 4 evicted from disk
        await store(h, "w", keys)
        await demoted(h, 12)
        evs = await events(h)
        # Which blocks the pool evicts is its policy's choice (the deepest of a prefix first):
        # the events say which; 12 went down, the disk's LRU evicted 4 of them.
        stored = disk_events(evs, "BlockStored")
        evicted = disk_events(evs, "BlockRemoved")
        assert len(stored) == 12
        assert len(evicted) == 4
        assert evicted < stored
        assert (await stats(h))["evictions"] == 4
        on_disk = sorted(stored - evicted)
        assert await lookup(h, "w", on_disk) == ["disk"] * 8
        assert await lookup(h, "w", sorted(evicted)) == ["miss"] * 4

        # Corrupt one block on disk: its promotion fails, it is dropped, a DISK removal.
        d = link(h)
        victim = on_disk[0]
        (slot,) = [s for k, s in d.store.listed() if k == bytes.fromhex(victim)]
        with open(tmp_path / h.service.namespace / "blocks", "r+b") as f:
            f.seek(slot * d.store.slot_bytes + 100)
            f.write(b"\xff" * 16)
        dev, cache_id = await h.device(4)
        await h.start("r")
        before = dev.read(0)
        body = {"cache_id": cache_id, "keys": [victim], "device_blocks": [0]}
        r = await h.post("/v1/requests/r/onload", body)
        assert r.status_code == 202, r.text
        job = await h.wait(r.json()["job_id"])
        assert job["state"] == "failed", job
        assert dev.read(0) == before  # never the torn bytes
        assert victim in disk_events(await events(h), "BlockRemoved")
        assert await lookup(h, "r", [victim]) == ["miss"]
        s = await stats(h)
        assert s["corrupt_dropped"] == 1
        assert s["counters"]["checksum_failures"] == 1
        assert "bad" not in s["demotions"]["dropped"]  # a dropped block is no dropped demotion
        # Unlisted on disk too: a restart does not bring it back.
        assert bytes.fromhex(victim) not in {k for k, _ in d.store.listed()}
        await h.client.delete("/v1/requests/r")
        await h.client.delete("/v1/requests/w")
        await invariants(h)


# --------------------------------------------------------------------------- faults


async def test_io_errors_degrade_the_tier_and_a_failed_read_is_a_miss(tmp_path: Path) -> None:
    async with disk_node(tmp_path) as h:
        keys = hexkeys(*range(1, 41))
        data = await store(h, "w", keys)
        await demoted(h, 8)
        d = link(h)

        def eio(*_: object) -> int:
            raise OSError(errno.EIO, "Input/output error")

        # A failing device fails the probe's write too; until it is back, so does the probe.
        real_probe = d.store.probe
        d.store.probe = lambda: False  # type: ignore[method-assign]
        d.store.preadv = eio
        dev, cache_id = await h.device(8)
        await h.start("r")
        for i in range(8):
            dev.write(i, b"\0" * BLOCK)
        body = {"cache_id": cache_id, "keys": keys[:2], "device_blocks": [0, 1]}
        r = await h.post("/v1/requests/r/onload", body)
        assert r.status_code == 202, r.text
        job = await h.wait(r.json()["job_id"])
        assert job["state"] == "failed", job
        assert [dev.read(0), dev.read(1)] == [b"\0" * BLOCK] * 2
        ready = await h.client.get("/readyz")
        assert ready.status_code == 200
        assert "Input/output error" in ready.json()["details"]["disk_tier"]
        s = await stats(h)
        assert s["state"] == "degraded"
        assert s["counters"]["read_failures"] == 2
        # A failed read drops the block (it could be bad): a miss, never wrong bytes.
        assert await lookup(h, "r", keys[:2]) == ["miss", "miss"]
        # Degraded: demotions are dropped and counted, the pool keeps serving.
        await store(h, "w2", hexkeys(*range(100, 116)))
        s = await stats(h)
        assert s["demotions"]["dropped"].get("degraded", 0) >= 1, s
        assert await lookup(h, "w2", hexkeys(*range(100, 116))) == ["hit"] * 16
        d.store.preadv = os.preadv
        d.store.probe = real_probe  # type: ignore[method-assign]

        async def recovered() -> bool:
            return bool((await stats(h))["state"] == "ok")

        await until_async("recovered", recovered)
        assert "disk_tier" not in (await h.client.get("/readyz")).json().get("details", {})
        body = {"cache_id": cache_id, "keys": keys[2:4], "device_blocks": [2, 3]}
        r = await h.post("/v1/requests/r/onload", body)
        job = await h.wait(r.json()["job_id"])
        assert job["state"] == "done", job
        assert [dev.read(2), dev.read(3)] == [data[k] for k in keys[2:4]]
        assert all(c.status < 500 for c in h.calls)


def fill_up(mnt: Path) -> Path:
    """Another process fills the filesystem until ENOSPC; the filler file."""
    filler = mnt / "filler"
    subprocess.run(
        ["dd", "if=/dev/zero", f"of={filler}", "bs=64k", "count=1000"],
        check=False,
        capture_output=True,
    )
    st = os.statvfs(mnt)
    assert st.f_bavail == 0, st
    return filler


async def test_a_full_disk_degrades_drops_demotions_and_recovers_without_restart(
    tmpfs: Path,
) -> None:
    # 6 MiB of slots: room for the demotions, until another process takes it all.
    async with disk_node(tmpfs / "d", disk_bytes=6 * 1024 * 1024) as h:
        d = link(h)
        keys = hexkeys(*range(1, 41))
        await store(h, "w", keys)
        await demoted(h, 8)
        filler = fill_up(tmpfs)
        more = hexkeys(*range(100, 140))
        data = await store(h, "w2", more)  # 40 more: everything older goes down, and fails

        async def degraded() -> bool:
            return bool((await stats(h))["state"] == "degraded")

        async def degraded_and_counted() -> bool:
            # The store turns degraded inside the failing write, on its I/O thread; the
            # writer counts that batch's blocks as dropped once the write has returned.
            s = await stats(h)
            return bool(s["state"] == "degraded" and sum(s["demotions"]["dropped"].values()))

        await until_async("degraded_and_counted", degraded_and_counted)
        ready = await h.client.get("/readyz")
        assert ready.status_code == 200
        assert "No space left on device" in ready.json()["details"]["disk_tier"]
        s = await stats(h)
        dropped = s["demotions"]["dropped"]
        assert sum(dropped.values()) >= 1, s
        assert s["counters"]["write_failures"] >= 1
        # Still degraded a few probe periods later: the probe must not call a full disk ok.
        await asyncio.sleep(5 * disk_module.PROBE_S)
        assert (await stats(h))["state"] == "degraded"
        # The pool keeps serving; the blocks already on disk are still hits.
        assert await lookup(h, "w2", more[-8:]) == ["hit"] * 8
        assert await lookup(h, "w2", keys[:8]) == ["disk"] * 8
        dev, cache_id = await h.device(8)
        await h.start("r")
        r = await h.post(
            "/v1/requests/r/onload",
            {"cache_id": cache_id, "keys": more[-2:], "device_blocks": [0, 1]},
        )
        assert (await h.wait(r.json()["job_id"]))["state"] == "done"
        assert [dev.read(0), dev.read(1)] == [data[k] for k in more[-2:]]

        filler.unlink()

        async def recovered() -> bool:
            return bool((await stats(h))["state"] == "ok")

        await until_async("recovered", recovered)
        written = (await stats(h))["demotions"]["written"]
        await store(h, "w3", hexkeys(*range(200, 216)))
        await demoted(h, written + 1)  # demoting again
        assert d.store.health().ok

        # Full a second time (the probe's page now exists): degraded again, and it stays so
        # while the disk is full.
        filler = fill_up(tmpfs)
        await store(h, "w4", hexkeys(*range(300, 340)))
        await until_async("degraded", degraded)
        incidents = (await stats(h))["counters"]["incidents"]
        for _ in range(5):
            await asyncio.sleep(disk_module.PROBE_S)
            await store(h, "w4", hexkeys(*range(400 + 8 * _, 408 + 8 * _)))
        s = await stats(h)
        assert s["state"] == "degraded", s
        assert s["counters"]["incidents"] == incidents, s
        filler.unlink()
        await until_async("recovered", recovered)
        assert all(c.status < 500 for c in h.calls)


@pytest.fixture
def ext4(tmp_path: Path) -> Iterator[tuple[Path, str]]:
    """A 32 MiB ext4 on a loop device, mounted errors=remount-ro; (mount point, device)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a loop device needs root")
    image, mnt = tmp_path / "ext4.img", tmp_path / "ext4"
    mnt.mkdir()
    with open(image, "wb") as f:
        f.truncate(32 * 1024 * 1024)
    made = subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], check=False)
    opts = "loop,errors=remount-ro"
    mounted = subprocess.run(["mount", "-o", opts, str(image), str(mnt)], check=False)
    if made.returncode or mounted.returncode:
        pytest.skip("no mkfs.ext4 or no loop device here")
    source = subprocess.run(
        ["findmnt", "-n", "-o", "SOURCE", str(mnt)], capture_output=True, text=True, check=False
    ).stdout.strip()
    try:
        yield mnt, os.path.basename(source)
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


async def test_a_disk_gone_read_only_still_serves_its_hits(ext4: tuple[Path, str]) -> None:
    """``mount -o remount,ro`` is refused (EBUSY) while the service holds its files open for
    writing; a filesystem goes read-only under a live service when the kernel does it, as ext4
    does on an error with ``errors=remount-ro`` (triggered here through sysfs). It cannot be
    made writable again without an unmount (``emergency_ro``): recovery is the other tests'."""
    mnt, dev = ext4
    trigger = Path(f"/sys/fs/ext4/{dev}/trigger_fs_error")
    if not trigger.exists():
        pytest.skip(f"no {trigger}")
    async with disk_node(mnt / "d", disk_bytes=6 * 1024 * 1024) as h:
        keys = hexkeys(*range(1, 41))
        data = await store(h, "w", keys)
        await demoted(h, 8)
        ro = subprocess.run(
            ["mount", "-o", "remount,ro", str(mnt)], capture_output=True, check=False
        )
        assert ro.returncode != 0  # busy: the service writes there
        trigger.write_text("1")
        await store(h, "w2", hexkeys(*range(100, 120)))

        async def degraded() -> bool:
            return bool((await stats(h))["state"] == "degraded")

        await until_async("degraded", degraded)
        ready = await h.client.get("/readyz")
        assert ready.status_code == 200
        assert "Read-only file system" in ready.json()["details"]["disk_tier"]
        await asyncio.sleep(5 * disk_module.PROBE_S)
        assert (await stats(h))["state"] == "degraded"  # the probe cannot write either
        dev_, cache_id = await h.device(8)
        await h.start("r")
        r = await h.post(
            "/v1/requests/r/onload",
            {"cache_id": cache_id, "keys": keys[:4], "device_blocks": [0, 1, 2, 3]},
        )
        assert r.status_code == 202, r.text
        assert (await h.wait(r.json()["job_id"]))["state"] == "done"
        assert [dev_.read(i) for i in range(4)] == [data[k] for k in keys[:4]]
        s = await stats(h)
        assert (
            s["demotions"]["dropped"].get("degraded", 0)
            + s["demotions"]["dropped"].get("write_failed", 0)
            >= 1
        ), s
        assert all(c.status < 500 for c in h.calls)


# --------------------------------------------------------------------------- restart


async def test_a_restart_restores_the_disk_and_loads_identical_bytes(tmp_path: Path) -> None:
    async with disk_node(tmp_path) as h:
        keys = hexkeys(*range(1, 49))
        data = await store(h, "w", keys)
        await demoted(h, 16)
    async with disk_node(tmp_path) as h:
        s = await stats(h)
        assert s["restored"] >= 16
        await h.start("r")
        assert await lookup(h, "r", keys[:16]) == ["disk"] * 16
        dev, cache_id = await h.device(16)
        r = await h.post(
            "/v1/requests/r/onload",
            {"cache_id": cache_id, "keys": keys[:16], "device_blocks": list(range(16))},
        )
        assert r.status_code == 202, r.text
        assert (await h.wait(r.json()["job_id"]))["state"] == "done"
        assert [dev.read(i) for i in range(16)] == [data[k] for k in keys[:16]]


# --------------------------------------------------------------------------- concurrency


async def test_promotion_while_the_disk_evicts_under_store_pressure(tmp_path: Path) -> None:
    """Key K is being read up from disk (its read held at a gate) while the pool is under
    store pressure and the disk, full, must evict to take the pool's victims: K is pinned on
    disk, so the disk evicts the others; with every disk block pinned the demotions are
    dropped (no room), never waited for. The read then ends: K's bytes are the ones stored,
    nothing stays pinned, pending or held."""
    async with disk_node(tmp_path, disk_bytes=disk_bytes_for(16, 4096)) as h:
        d = link(h)
        keys = hexkeys(*range(1, 41))
        data = await store(h, "w", keys)
        await demoted(h, 8)
        on_disk = sorted(disk_events(await events(h), "BlockStored"))
        assert len(on_disk) == 8
        gate = gated(d.store, "preadv")
        k = on_disk[0]
        await h.start("r")
        r = await h.post("/v1/requests/r/prepare-load", {"keys": [k]})
        assert r.status_code == 409
        # Store pressure: 24 more blocks, 24 victims to demote into a 16-slot disk holding 8.
        more = hexkeys(*range(100, 124))
        data.update(await store(h, "w2", more))
        await demoted(h, 32)
        assert (await stats(h))["evictions"] >= 16
        assert d.index.found([bytes.fromhex(k)]) == [True]  # pinned: not evicted under its read
        assert await lookup(h, "r", [k]) == ["pending"]

        # Now pin every disk block with reads of their own, and push more victims down.
        await h.start("r2")
        rest = [
            x
            for x in sorted(disk_events(await events(h), "BlockStored"))
            if d.index.found([bytes.fromhex(x)])[0] and x != k
        ]
        r = await h.post("/v1/requests/r2/prepare-load", {"keys": rest})
        assert r.status_code == 409
        assert d.index.index.num_pinned == 16
        data.update(await store(h, "w3", hexkeys(*range(200, 216))))

        async def no_room() -> bool:
            return bool((await stats(h))["demotions"]["dropped"].get("no_room", 0) >= 1)

        await until_async("no_room", no_room)
        gate.set()

        async def hit() -> bool:  # both reads up: K's and the others' (their own promotion)
            return await lookup(h, "r", [k, *rest]) == ["hit"] * (1 + len(rest))

        await until_async("hit", hit)
        for req, ks in (("r", [k]), ("r2", rest)):
            r = await h.post(f"/v1/requests/{req}/prepare-load", {"keys": ks})
            assert r.status_code == 200, r.text
            assert [pool_bytes(h, s) for s in r.json()["slots"]] == [data[x] for x in ks]
            await h.post(f"/v1/requests/{req}/complete-load", {"keys": ks})
        for req in ("r", "r2", "w", "w2", "w3"):
            assert (await h.client.delete(f"/v1/requests/{req}")).status_code == 200
        await invariants(h)
        assert d.store.staging_free == d.store.staging_blocks
        assert all(c.status < 500 for c in h.calls)


async def test_a_block_evicted_twice_before_it_is_written_leaks_no_staging_buffer(
    tmp_path: Path,
) -> None:
    """The pool evicts K, K is queued for the disk; the engine stores K again and the pool
    evicts it again before the writer reached the first copy: K is queued twice. Both staging
    buffers come back, K is written once, with its bytes."""
    # Batches of 32 on a disk of 64: one write in flight at most (half the disk).
    async with disk_node(tmp_path, disk_batch_bytes=32 * 4096) as h:
        d = link(h)
        assert d.writes._max_writes == 1
        keys = hexkeys(*range(1, 33))
        data = await store(h, "w", keys)
        gate = gated(d.store, "pwritev")
        # A first batch in flight (held at the gate), so the writer leaves the queue alone.
        await store(h, "w2", hexkeys(*range(100, 108)))

        async def in_flight() -> bool:
            return bool(d.index.index.stats().pending == 8)

        await until_async("in_flight", in_flight)
        pool = h.service.pool_manager
        k = bytes.fromhex(keys[-1])
        slot = pool.slot_of(k)
        assert slot is not None
        # The listener, as the pool calls it on two evictions of K (between them the engine
        # stored K again, same bytes, in another slot).
        d.evicted([k], [slot])
        d.evicted([k], [slot])
        assert d.store.staging_free == d.store.staging_blocks - 8 - 2
        gate.set()

        async def settled() -> bool:
            return d.store.staging_free == d.store.staging_blocks and not len(d.writes)

        await until_async("settled", settled)
        assert d.index.found([k]) == [True]
        (on_disk,) = [s for key, s in d.store.listed() if key == k]
        assert d.store.read_many([(on_disk, k, slot)]) == [True]  # same bytes, same slot
        assert pool_bytes(h, slot) == data[keys[-1]]
        s = await stats(h)
        assert s["demotions"]["written"] == 9
        assert s["demotions"]["dropped"]["duplicate"] == 1


async def test_an_onload_of_pool_and_disk_keys_survives_store_pressure_during_promotion(
    tmp_path: Path,
) -> None:
    """One onload of [pool key P, disk key D]: D is read up (held at a gate) while other
    requests store enough to evict everything evictable from the pool. The one-call onload
    must still end ``done`` with both blocks' bytes: P was a hit when the call came."""
    async with disk_node(tmp_path) as h:
        d = link(h)
        keys = hexkeys(*range(1, 41))
        data = await store(h, "w", keys)
        await demoted(h, 8)
        on_disk = sorted(disk_events(await events(h), "BlockStored"))
        results = await lookup(h, "w", keys)
        p = keys[results.index("hit")]
        dk = on_disk[0]
        gate = gated(d.store, "preadv")
        dev, cache_id = await h.device(4)
        await h.start("r")
        body = {"cache_id": cache_id, "keys": [p, dk], "device_blocks": [0, 1]}
        r = await h.post("/v1/requests/r/onload", body)
        assert r.status_code == 202, r.text
        data.update(await store(h, "w2", hexkeys(*range(100, 140))))  # the pool turns over
        gate.set()
        job = await h.wait(r.json()["job_id"])
        assert job["state"] == "done", job
        assert [dev.read(0), dev.read(1)] == [data[p], data[dk]]


@pytest.mark.parametrize("second", ["read", "eio"])
async def test_an_onload_copies_each_chunk_while_the_next_is_still_read(
    tmp_path: Path, second: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An onload of 16 disk keys is promoted in four chunks of 4 (``PROMOTION_PARTS``, each
    within ``disk_batch_bytes``): the first half's bytes reach the device cache while the
    second half's reads are held, the job still ``running``. Then either those reads complete
    (every byte arrives) or fail with EIO (the job fails, nothing stays pinned, its device
    blocks are untouched)."""
    async with disk_node(tmp_path) as h:
        d = link(h)
        keys = hexkeys(*range(1, 49))
        data = await store(h, "w", keys)
        await demoted(h, 16)
        load = keys[:16]
        assert await lookup(h, "w", load) == ["disk"] * 16
        index = d.index.index
        second_slots = {index.slot_of(bytes.fromhex(k)) for k in load[8:]}
        gate = threading.Event()
        real = d.store.preadv

        def held(fd: int, bufs: list[memoryview], off: int) -> int:
            first = off // d.store.slot_bytes
            if second_slots & set(range(first, first + len(bufs))):
                gate.wait(10)
                if second == "eio":
                    raise OSError(errno.EIO, "Input/output error")
            return int(real(fd, bufs, off))

        d.store.preadv = held
        parts: list[int] = []
        start = d.promotions.start

        def counted(keys: Sequence[BlockKey], *args: Any) -> asyncio.Task[None] | None:
            parts.append(len(keys))
            return start(keys, *args)

        monkeypatch.setattr(d.promotions, "start", counted)
        dev, cache_id = await h.device(16)
        for i in range(16):
            dev.write(i, b"\0" * BLOCK)
        await h.start("r")
        body = {"cache_id": cache_id, "keys": load, "device_blocks": list(range(16))}
        r = await h.post("/v1/requests/r/onload", body)
        assert r.status_code == 202, r.text
        job_id = r.json()["job_id"]
        assert parts == [4, 4, 4, 4]

        async def first_chunk_copied() -> bool:
            return [dev.read(i) for i in range(8)] == [data[k] for k in load[:8]]

        await until_async("first_chunk_copied", first_chunk_copied)
        assert (await h.client.get(f"/v1/jobs/{job_id}")).json()["state"] == "running"
        gate.set()
        job = await h.wait(job_id)
        if second == "read":
            assert job["state"] == "done", job
            assert job["bytes"] == 16 * BLOCK
            assert [dev.read(i) for i in range(16)] == [data[k] for k in load]
        else:
            assert job["state"] == "failed", job
            assert [dev.read(i) for i in range(8, 16)] == [b"\0" * BLOCK] * 8
        d.store.preadv = real
        assert (await h.client.delete("/v1/requests/r")).status_code == 200
        assert (await h.client.delete("/v1/requests/w")).status_code == 200

        await invariants(h)
        assert all(c.status < 500 for c in h.calls)


# --------------------------------------------------------------------------- admission, lock


@pytest.mark.parametrize("ask_step", [asks.ASK_STEP, 1])
async def test_only_blocks_asked_for_often_enough_go_to_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ask_step: int
) -> None:
    """``disk_admit_after=2``: asks count once per request. Of the blocks the pool evicts,
    exactly those another request also looked up are demoted; the ones only their writer asked
    for (its store and its own lookup: one request) are refused. The same when every ask is
    queued and counted a key a step (``app.core.asks``): the eviction settles them first."""
    monkeypatch.setattr(asks, "ASK_STEP", ask_step)
    async with disk_node(tmp_path, disk_admit_after=2) as h:
        keys = hexkeys(*range(1, 33))
        await store(h, "w", keys)
        await lookup(h, "w", keys)  # the writer again: still one ask each
        asked_twice = set(keys[::2])
        await h.start("reader")
        await lookup(h, "reader", sorted(asked_twice))
        await store(h, "w2", hexkeys(*range(100, 116)))  # 16 victims
        evs = await events(h)
        victims = {
            k
            for e in evs
            if e["type"] == "BlockRemoved" and e["medium"] == "CPU"
            for k in e["block_hashes"]
        }
        assert len(victims) == 16
        want = victims & asked_twice
        await demoted(h, len(want))
        assert disk_events(await events(h), "BlockStored") == want
        s = await stats(h)
        assert s["demotions"]["refused_admission"] == len(victims - asked_twice)


async def test_a_second_service_on_the_same_disk_directory_refuses_to_start(
    tmp_path: Path,
) -> None:
    from app.settings import ConfigError

    async with disk_node(tmp_path) as h:
        assert link(h).store.directory.startswith(str(tmp_path))
        with pytest.raises(ConfigError, match="in use by another process"):
            async with disk_node(tmp_path):
                pass


async def test_a_read_past_its_timeout_is_a_miss_and_keeps_its_slots_until_it_ends(
    tmp_path: Path,
) -> None:
    """A disk read held past ``disk_timeout_s``: the promotion ends as a miss (409 stays a
    409, never a 5xx), the tier is marked degraded, and the pool slots the read still writes
    into stay reserved until it lets go; then everything is released and the block, whole on
    disk, loads again."""
    async with disk_node(tmp_path, disk_timeout_s=0.2) as h:
        d = link(h)
        real_probe = d.store.probe
        d.store.probe = lambda: False  # type: ignore[method-assign]
        keys = hexkeys(*range(1, 41))
        data = await store(h, "w", keys)
        await demoted(h, 8)
        k = sorted(disk_events(await events(h), "BlockStored"))[0]
        gate = gated(d.store, "preadv")
        await h.start("r")
        r = await h.post("/v1/requests/r/prepare-load", {"keys": [k]})
        assert r.status_code == 409
        pool = h.service.pool_manager

        async def timed_out() -> bool:
            return bool((await stats(h))["state"] == "degraded")

        await until_async("timed_out", timed_out)
        assert "past 0.2s" in (await h.client.get("/readyz")).json()["details"]["disk_tier"]
        assert (await stats(h))["read_timeouts"] == 1
        held = d.store.held_slots()
        assert len(held) == 1
        assert pool.stats().pending == 1  # still reserved: the read writes there
        # The promotion's own internal request holds the slot, never the engine's.
        assert [w.startswith("kvoffload-disk-promote-") for w in d.writing()] == [True]
        gate.set()

        async def released() -> bool:
            return not d.store.held_slots() and pool.stats().pending == 0

        await until_async("released", released)
        assert await lookup(h, "r", [k]) == ["disk"]  # a timeout says nothing of the block
        d.store.preadv = os.preadv
        d.store.probe = real_probe  # type: ignore[method-assign]

        async def recovered() -> bool:
            return bool((await stats(h))["state"] == "ok")

        await until_async("recovered", recovered)
        dev, cache_id = await h.device(2)
        r = await h.post(
            "/v1/requests/r/onload", {"cache_id": cache_id, "keys": [k], "device_blocks": [0]}
        )
        assert r.status_code == 202, r.text
        assert (await h.wait(r.json()["job_id"]))["state"] == "done"
        assert dev.read(0) == data[k]
        await h.client.delete("/v1/requests/r")
        await h.client.delete("/v1/requests/w")
        await invariants(h)
        assert all(c.status < 500 for c in h.calls)


async def test_an_abort_during_a_disk_read_keeps_the_slots_until_it_ends(tmp_path: Path) -> None:
    async with disk_node(tmp_path, lease_ttl_s=6.0) as h:
        d = link(h)
        keys = hexkeys(*range(1, 41))
        data = await store(h, "w", keys)
        await demoted(h, 8)
        two = sorted(disk_events(await events(h), "BlockStored"))[:2]
        gate = gated(d.store, "preadv")
        await h.start("r")
        assert (await h.post("/v1/requests/r/prepare-load", {"keys": two})).status_code == 409
        r = await h.client.delete("/v1/requests/r", params={"abort": "true"})
        assert r.status_code == 200
        pool = h.service.pool_manager
        assert pool.stats().pending == 2  # still reserved while the read writes there
        gate.set()

        async def settled() -> bool:
            return d.promotions.in_flight == 0 and pool.stats().pending == 0

        await until_async("settled", settled)
        p = (await stats(h))["promotions"]
        assert p["started"] == 2
        assert p["loaded"] + p["failed"] + p["abandoned"] == 2, p
        # The read ended whole: whatever the pool kept of it holds the right bytes.
        for key in two:
            slot = pool.slot_of(bytes.fromhex(key))
            if slot is not None:
                assert pool_bytes(h, slot) == data[key]
        await h.client.delete("/v1/requests/w")

        async def unheld() -> bool:
            return pool.num_pinned == 0

        await until_async("unheld", unheld)
        await invariants(h)


async def test_a_disk_smaller_than_a_write_batch_still_takes_the_victims(tmp_path: Path) -> None:
    """8 disk slots, write batches of up to 32 blocks (the default): 16 victims queued at once
    must not be refused as a whole for want of room: the disk takes the 8 warmest (the last
    evicted), the 8 others are dropped as no room; nothing stays pinned."""
    small = disk_bytes_for(8, 4096)
    async with disk_node(tmp_path, disk_bytes=small, disk_batch_bytes=32 * 4096) as h:
        d = link(h)
        keys = hexkeys(*range(1, 33))
        await store(h, "w", keys)
        await h.start("w2")
        more = hexkeys(*range(100, 116))
        r = await h.post("/v1/requests/w2/prepare-store", {"keys": more})  # 16 victims at once
        assert r.status_code == 200, r.text
        assert len(r.json()["evicted_keys"]) == 16
        await h.post("/v1/requests/w2/complete-store", {"keys": more})

        async def full() -> bool:
            return len(d.index.index.resident_keys()) == 8 and not len(d.writes)

        await until_async("full", full)
        s = await stats(h)
        assert s["demotions"]["written"] == 8, s
        assert s["demotions"]["dropped"].get("no_room", 0) == 8, s
        evs = await events(h)
        victims = [
            k
            for e in evs
            if e["type"] == "BlockRemoved" and e["medium"] == "CPU"
            for k in e["block_hashes"]
        ]
        assert disk_events(evs, "BlockStored") == set(victims[-8:])
        await invariants(h)


# --------------------------------------------------------------------------- mixed load


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_mixed_concurrent_stores_onloads_and_loads_never_serve_wrong_bytes(
    tmp_path: Path, seed: int
) -> None:
    """Four engine requests at once over a 32-block pool and a 24-slot disk: stores, onloads
    and prepare-loads of 80 keys picked at random (each key always holds the same bytes),
    disk reads slowed at random so promotions, demotions and evictions interleave. Every
    block that reaches a device or is pinned holds its key's bytes; no 5xx; at rest nothing
    is pinned, pending or held and the disk index matches the store."""
    import random

    rng = random.Random(seed)
    universe = hexkeys(*range(1, 81))
    content = {k: rng.randbytes(BLOCK) for k in universe}
    small = disk_bytes_for(24, 4096)
    async with disk_node(tmp_path, disk_bytes=small, disk_batch_bytes=8 * 4096) as h:
        d = link(h)
        real = d.store.preadv

        def jittered(fd: int, bufs: list[memoryview], off: int) -> int:
            time.sleep(random.random() * 0.01)
            return real(fd, bufs, off)

        d.store.preadv = jittered
        dev, cache_id = await h.device(16)
        pool = h.service.transfers().pool
        served = {"onload": 0, "load": 0, "store": 0, "409": 0}
        stored: list[str] = []  # keys stored once: loads mostly ask for those

        async def engine(i: int) -> None:
            req = f"e{i}"
            await h.start(req)
            my = random.Random(seed * 100 + i)
            for _ in range(40):
                action = my.random()
                pick = universe if action < 0.45 or len(stored) < 8 or my.random() < 0.1 else stored
                keys = my.sample(pick, my.randint(1, 4))
                if action < 0.45:
                    r = await h.post(f"/v1/requests/{req}/prepare-store", {"keys": keys})
                    assert r.status_code in (200, 507), r.text
                    if r.status_code == 200:
                        body = r.json()
                        for k, slot in zip(body["keys_to_store"], body["slots"], strict=True):
                            pool.tensor[slot].numpy()[:] = memoryview(content[k])
                        r = await h.post(f"/v1/requests/{req}/complete-store", {"keys": keys})
                        assert r.status_code == 200, r.text
                        served["store"] += 1
                        stored.extend(k for k in body["keys_to_store"] if k not in stored)
                elif action < 0.8:
                    blocks = [4 * i + j for j in range(len(keys))]
                    body = {"cache_id": cache_id, "keys": keys, "device_blocks": blocks}
                    r = await h.post(f"/v1/requests/{req}/onload", body)
                    assert r.status_code in (202, 409), r.text
                    if r.status_code == 409:
                        served["409"] += 1
                        continue
                    job = await h.wait(r.json()["job_id"])
                    if job["state"] == "done":
                        assert [dev.read(b) for b in blocks] == [content[k] for k in keys]
                        served["onload"] += 1
                else:
                    r = await h.post(f"/v1/requests/{req}/prepare-load", {"keys": keys})
                    assert r.status_code in (200, 409), r.text
                    if r.status_code == 409:
                        served["409"] += 1
                        continue
                    got = [pool_bytes(h, s) for s in r.json()["slots"]]
                    assert got == [content[k] for k in keys]
                    served["load"] += 1
                    await asyncio.sleep(0)
                    r = await h.post(f"/v1/requests/{req}/complete-load", {"keys": keys})
                    assert r.status_code == 200, r.text
            r = await h.client.delete(f"/v1/requests/{req}")
            assert r.status_code == 200, r.text

        await asyncio.gather(*(engine(i) for i in range(4)))

        async def at_rest() -> bool:
            m = h.service.pool_manager
            return (
                d.promotions.in_flight == 0
                and not len(d.writes)
                and d.index.index.stats().pending == 0
                and m.stats().pending == 0
            )

        await until_async("at_rest", at_rest)
        for req_id in list(d.promotions._held_for):
            d.promotions.let_go(req_id, None)  # holds of promotions nobody loaded (hold_s)
        await invariants(h)
        s = await stats(h)
        assert served["onload"] + served["load"] > 0, served
        assert s["demotions"]["written"] > 0, s
        assert s["demotions"]["refused_admission"] == 0, s  # admit_after=1: none refused
        # Whether the random mix asked for a block while only the disk had it depends on the
        # timing of the four engines (one run in many asks none): one more onload does, so
        # a promotion is always checked, bytes included.
        m = h.service.pool_manager
        disk_only = [k for k in universe if m.slot_of(bytes.fromhex(k)) is None]
        disk_only = [k for k in disk_only if d.index.found([bytes.fromhex(k)])[0]]
        assert disk_only, s
        await h.start("last")
        last, blocks = disk_only[:2], [0, 1][: len(disk_only[:2])]
        r = await h.post(
            "/v1/requests/last/onload",
            {"cache_id": cache_id, "keys": last, "device_blocks": blocks},
        )
        assert r.status_code == 202, r.text
        assert (await h.wait(r.json()["job_id"]))["state"] == "done"
        assert [dev.read(b) for b in blocks] == [content[k] for k in last]
        assert (await h.client.delete("/v1/requests/last")).status_code == 200
        s = await stats(h)
        assert s["promotions"]["loaded"] > 0, s
        p = s["promotions"]
        assert p["started"] == p["loaded"] + p["failed"] + p["abandoned"], p
        assert all(c.status < 500 for c in h.calls)


async def test_the_engines_own_complete_store_cannot_complete_a_promotion(
    tmp_path: Path,
) -> None:
    """A request asks a disk key up (prepare-load: 409, a slow read starts), then reports a
    complete-store naming the same key, as an engine may for every key of its step. The
    promotion's slot is the service's own reservation: that call does not make the key ready
    before its bytes are read, and once they are, the pinned slot holds exactly them."""
    async with disk_node(tmp_path) as h:
        d = link(h)
        keys = hexkeys(*range(1, 41))
        data = await store(h, "w", keys)
        await demoted(h, 8)
        k = sorted(disk_events(await events(h), "BlockStored"))[0]
        gate = gated(d.store, "preadv")
        await h.start("r")
        r = await h.post("/v1/requests/r/prepare-load", {"keys": [k]})
        assert r.status_code == 409
        assert await lookup(h, "r", [k]) == ["pending"]
        r = await h.post("/v1/requests/r/complete-store", {"keys": [k], "success": True})
        assert r.status_code == 200, r.text
        assert r.json()["ignored"] == [k]  # not this request's store
        assert await lookup(h, "r", [k]) == ["pending"]  # still being read
        r = await h.post("/v1/requests/r/prepare-load", {"keys": [k]})
        assert r.status_code == 409  # not loadable before its bytes are in
        gate.set()

        async def ready() -> bool:
            return await lookup(h, "r", [k]) == ["hit"]

        await until_async("ready", ready)
        r = await h.post("/v1/requests/r/prepare-load", {"keys": [k]})
        assert r.status_code == 200, r.text
        assert pool_bytes(h, r.json()["slots"][0]) == data[k]
        await h.post("/v1/requests/r/complete-load", {"keys": [k]})
        await h.client.delete("/v1/requests/r")
        await h.client.delete("/v1/requests/w")
        d.store.preadv = os.preadv
        await invariants(h)


@pytest.mark.parametrize(("slots", "at_once"), [(64, 4), (16, 4), (8, 2), (6, 1)])
async def test_demotion_batches_are_written_several_at_once_where_the_disk_has_room(
    tmp_path: Path, slots: int, at_once: int
) -> None:
    # Batches of two blocks, four evicted at once. 64 and 16 slots: all four are written at
    # once (the device's queue never empties between them); 8 and 6 slots: a batch in flight
    # holds slots another would need, so at most half the disk is being written, nothing
    # dropped for want of room.
    async with disk_node(
        tmp_path, disk_bytes=disk_bytes_for(slots, 4096), disk_batch_bytes=2 * 4096
    ) as h:
        d = link(h)
        gate = gated(d.store, "pwritev")
        entered: list[int] = []
        real = d.store.submit_writes

        def counted(items: Any) -> Any:
            entered.append(len(items))
            return real(items)

        d.store.submit_writes = counted  # type: ignore[method-assign]
        await store(h, "w", hexkeys(*range(1, 41)))  # 8 evicted from a pool of 32

        async def writing() -> bool:
            return len(entered) >= at_once

        await until_async("writing", writing)
        await asyncio.sleep(0.2)  # the next batch waits for one of these to end
        assert entered == [2] * at_once
        gate.set()
        await demoted(h, 8)
        assert sum(v for k, v in d.counts.items() if k.startswith("dropped_")) == 0


async def test_a_large_eviction_is_written_batch_by_batch_while_it_is_staged(
    tmp_path: Path,
) -> None:
    """One prepare-store that evicts four batches: each batch's write starts as soon as it is
    staged, before the next is copied (the disk writes while the loop copies), and every
    block reaches the disk with its bytes."""
    async with disk_node(tmp_path, disk_batch_bytes=2 * 4096) as h:
        d = link(h)
        data = await store(h, "w", hexkeys(*range(1, 33)))  # the pool of 32 full
        calls: list[str] = []
        real_stage, real_submit = d.store.stage, d.store.submit_writes

        def stage(pool_slots: Any) -> Any:
            calls.append(f"stage {len(pool_slots)}")
            return real_stage(pool_slots)

        def submit(items: Any) -> Any:
            calls.append(f"write {len(items)}")
            return real_submit(items)

        d.store.stage = stage  # type: ignore[method-assign]
        d.store.submit_writes = submit  # type: ignore[method-assign]
        await store(h, "w2", hexkeys(*range(100, 108)))  # one prepare-store: 8 evicted
        assert calls == ["stage 2", "write 2"] * 4
        await demoted(h, 8)
        listed = d.store.listed()
        assert len(listed) == 8
        for key, slot in listed:  # read back into pool slot 0 (the test ends: its bytes may go)
            assert d.store.read_many([(slot, key, 0)]) == [True]
            assert pool_bytes(h, 0) == data[key.hex()]


async def test_a_disk_bytes_past_the_free_space_stops_the_start_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Memory for its index taken as plenty: this is the disk's own check (the memory one runs
    # first: tests/tiers/test_disk_memory.py).
    monkeypatch.setattr(disk_module, "memory_available", lambda: None)
    free = shutil.disk_usage(tmp_path).free
    settings = make_settings(
        disk_dir=tmp_path / "d", disk_bytes=4 * free + (1 << 40), disk_admit_after=1
    )
    service = Service(settings)
    with pytest.raises(ConfigError) as err:
        async with service.running():
            pass
    assert err.value.field == "disk_bytes"
    assert "free" in str(err.value)
    # Refused before anything is allocated.
    assert sum(p.stat().st_blocks for p in (tmp_path / "d").rglob("*") if p.is_file()) < 2048


async def test_stats_say_whether_the_tier_s_buffers_are_on_huge_pages(tmp_path: Path) -> None:
    async with disk_node(tmp_path / "d") as h:
        said = (await stats(h))["huge_pages"]
        assert said is link(h).store.huge_pages
        assert said is not None  # /proc/self/smaps is readable here


@pytest.mark.parametrize(
    ("mode", "fix"),
    [
        ("never", f"fix: echo madvise > {disk_module.THP_ENABLED}"),
        ("madvise", "but the kernel had none to give"),
    ],
)
async def test_buffers_without_huge_pages_are_warned_of_at_start_with_the_fix(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    mode: str,
    fix: str,
) -> None:
    """Without them each block read or written is split into more device requests. The fix
    named depends on why: huge pages off, or on and none to give."""
    import transfer.disk_buffers as buffers_module

    real = buffers_module._buffer
    monkeypatch.setattr(buffers_module, "_buffer", lambda nbytes: (real(nbytes)[0], False))
    monkeypatch.setattr(disk_module, "_thp_mode", lambda: mode)
    async with disk_node(tmp_path / "d") as h:
        assert (await stats(h))["huge_pages"] is False
    (warned,) = [r for r in caplog.records if "no huge pages" in r.getMessage()]
    assert warned.levelname == "WARNING"
    assert fix in warned.getMessage()
