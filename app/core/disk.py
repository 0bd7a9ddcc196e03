"""One namespace's disk tier, as the service uses it: admission, demotion, lookups, promotion.

``transfer.disk.DiskStore`` moves the bytes (block slots in a file, checksums, O_DIRECT, I/O
threads); ``manager.tiers.DiskIndex`` decides (what is on disk where, admission, the disk's own
eviction). ``DiskLink`` runs them for a service:

It is the ``disk`` tier of the lower-tier contract (``app.core.tier``), registered here:

- **Admission** (``asked``): the observed manager counts every key an engine looks up, loads or
  stores; a block is demoted only once asked ``--disk-admit-after`` times. An explicit
  ``demote`` (``takes``) is taken whatever the count says.
- **Demote on evict** (``evicted``, told of every pool eviction; ``app.core.disk_writes``, the
  tier's write path): when the pool evicts blocks to make room, the admitted ones not yet on
  disk are copied into staging buffers right there, before their slots are handed out again (a
  memcpy on the loop that lets go of the GIL), a ``--disk-batch-bytes`` batch at a time, each
  batch's write handed to the store's I/O threads as soon as it is copied (on a disk of a few
  batches, the ones that would hold more than half its slots wait for a background task), so
  the disk writes while the loop copies. Never write-through: a block reaches the disk only
  when the pool lets it go. No staging buffer free, or the tier degraded: the demotion is
  dropped and counted, never waited for.
- **Lookups** (``found``): the in-memory index answers at once; the disk is not read.
- **Promotion** (``promote``): ``app.core.promotion`` with a read from disk into the reserved
  pool slots (through the store's read buffers), checked against each block's keyed MAC, in
  ``PROMOTION_PARTS`` chunks at least (an ``onload`` copies each on as it lands). A
  block that fails (torn, corrupt, forged, unreadable) is dropped from the disk (counted) and is
  a miss; its bytes are never loadable.
- **Start** (``open_disk``): the store refuses a directory others could have planted files in
  (``transfer.disk_files``: a ``DiskError`` naming the path and the fix, which the service turns
  into a refusal to start, or at a tenants reload into a namespace that does not start). Index
  entries that fail their MAC at open (forged, torn, another key's) are dropped and counted
  with the blocks that fail on a read (``corrupt_dropped``, the store's ``checksum_failures``);
  the blocks of an index of an older format (unkeyed checksums) are dropped too, never loaded,
  counted apart (``format_dropped``: an upgrade is no corruption). Either is logged once.
- **Events**: demoted blocks are one ``BlockStored`` (medium ``DISK``) per batch, the disk's own
  evictions and dropped blocks ``BlockRemoved`` (``DISK``), in the manager's numbered stream.
- **Faults**: a failed write or read degrades the store (``health``); a probe every second
  tries a real write and brings it back. While degraded, demotions are dropped (counted); disk
  hits are still served (a read-only or full disk still reads; a failing read is a miss).

Manager calls happen on the loop; the store's calls run on threads.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import time
from collections.abc import Awaitable, Iterator, Sequence
from pathlib import Path
from typing import Any

from prometheus_client.core import CounterMetricFamily
from prometheus_client.metrics_core import Metric

from app.core.asks import QueuedAsks
from app.core.disk_writes import DiskWrites, OnIO
from app.core.promotion import Promotions
from app.core.storage import Dropped, drop_disk_dir, leftover_dirs
from app.core.tier import LowerTier, TierBackend, TierContext, dropped_by_reason, register
from app.settings import Settings, config_error
from app.telemetry.logging import get_logger
from app.telemetry.metrics import PREFIX, TierReport
from manager import DISK_MEDIUM, BlockKey, DiskIndex, DiskOp, OffloadManager
from transfer import HostPool
from transfer.disk import DiskStore, disk_bytes_for, slots_for
from transfer.disk_files import DiskError, DiskSpaceError
from transfer.health import TierHealth

log = get_logger("disk")

#: How often a degraded store tries a write again.
PROBE_S = 1.0


#: Chunks a promotion is split into at least (each ``read_blocks`` at most).
PROMOTION_PARTS = 4


class DiskLink(LowerTier):
    """The disk tier of one namespace's service; see the module docstring."""

    degraded_means = "takes no demotions; blocks on disk are still served"

    def __init__(
        self,
        store: DiskStore,
        index: DiskIndex,
        manager: OffloadManager,
        *,
        batch_blocks: int = 32,
        read_blocks: int = 32,
        timeout_s: float = 10.0,
        hold_s: float = 60.0,
        on_io: OnIO | None = None,
        name: str = "disk",
    ) -> None:
        """``on_io(op, seconds, blocks, req_id)``: each disk read or write batch (metrics).
        ``name``: the name the chain knows it by."""
        self.name = name
        self.store = store
        self.index = index
        self.manager = manager
        self.batch_blocks = batch_blocks
        self.read_blocks = read_blocks
        self.timeout_s = timeout_s
        self._on_io = on_io
        self.promotions = Promotions(manager, hold_s=hold_s, tier=name)
        self._tasks: list[asyncio.Task[None]] = []
        self.asks = QueuedAsks(index.asked)
        self.counts: collections.Counter[str] = collections.Counter()
        self.writes = DiskWrites(
            store,
            index,
            manager,
            self.counts,
            batch_blocks=batch_blocks,
            on_io=self._io,
            removed=self._removed,
        )
        # Index entries the store dropped at open for failing their MAC: corrupt blocks too.
        self.counts["corrupt_dropped"] = store.unauthenticated_dropped
        self.restored = 0

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Adopt the blocks found on disk, start the writer and the probe on the running
        loop."""
        listed = self.store.listed()
        # More listed blocks than slots cannot happen (the store sized both); a restart with
        # a smaller --disk-bytes truncated the index, so only slots that still exist remain.
        self.restored = self.index.restore(listed)
        loop = asyncio.get_running_loop()
        self.writes.start()
        self._tasks = [
            loop.create_task(self._probe_loop(), name="kvoffload-disk-probe"),
            loop.create_task(self.asks.run(), name="kvoffload-disk-asks"),
        ]

    async def close(self) -> None:
        """Write what is staged (the blocks are not lost to a graceful stop), stop the tasks,
        wait for promotions, close the store (its I/O ends first)."""
        await self.writes.close(self.timeout_s)
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        await self.promotions.close()
        await asyncio.to_thread(self.store.close)

    def health(self) -> TierHealth:
        return self.store.health()

    def state(self) -> dict[str, Any]:
        """What ``/admin/v1/stats``, ``/readyz`` and the metrics say about the tier."""
        health = self.store.health().as_dict()
        index = self.index.index
        promoted = self.promotions.counts
        health.update(
            {
                "directory": self.store.directory,
                "direct_io": self.store.direct,
                "huge_pages": self.store.huge_pages,
                "slots": self.index.num_slots,
                "blocks": self.index.blocks,
                "block_bytes": self.store.block_bytes,
                "capacity_bytes": self.index.num_slots * self.store.slot_bytes,
                "admit_after": self.index.admit_after,
                "policy": index.policy.name,
                "restored": self.restored,
                "queue": {
                    "depth": len(self.writes),
                    "staging_free": self.store.staging_free,
                    "capacity": self.store.staging_blocks,
                },
                "demotions": {
                    "written": self.counts["demoted"],
                    "refused_admission": self.index.refused,
                    "dropped": dropped_by_reason(self.counts),
                },
                "evictions": self.counts["evicted"],
                "promotions": {
                    "running": self.promotions.in_flight,
                    "started": promoted["promoted_keys"],
                    "loaded": promoted["promoted_ready"],
                    "failed": promoted["promoted_failed"],
                    "abandoned": promoted["promoted_abandoned"],
                },
                "corrupt_dropped": self.counts["corrupt_dropped"],
                "format_dropped": self.store.format_dropped,
                "read_timeouts": self.counts["read_timeouts"],
            }
        )
        return health

    def report(self) -> TierReport:
        health = self.store.health()
        counters = health.counters
        return TierReport(
            up=health.ok,
            queue_depth=len(self.writes),
            demoted=self.counts["demoted"],
            dropped=dropped_by_reason(self.counts),
            promoted=self.promotions.counts["promoted_ready"],
            bytes_read=counters.get("bytes_read", 0),
            bytes_written=counters.get("bytes_written", 0),
            incidents=counters.get("incidents", 0),
            blocks=self.index.blocks,
            capacity_blocks=self.index.num_slots,
        )

    def summary(self) -> dict[str, Any]:
        return {
            "directory": self.store.directory,
            "slots": self.index.num_slots,
            "direct_io": self.store.direct,
            "huge_pages": self.store.huge_pages,
            "restored_blocks": self.restored,
        }

    def disk_usage(self) -> int:
        """Bytes the tier's files take on disk now."""
        return self.store.disk_usage()

    # ------------------------------------------------------------------ admission and lookups

    def asked(self, keys: Sequence[BlockKey], req_id: str) -> None:
        """An engine asked for ``keys`` (lookup, load or store): count it for admission (a
        large ask in steps on the loop, ``app.core.asks``)."""
        self.asks.add(keys, req_id)

    async def found(self, keys: Sequence[BlockKey], req_id: str | None = None) -> list[bool]:
        """Per key, whether the disk holds it, loadable (in memory: never reads the disk)."""
        return self.index.found(keys)

    # ------------------------------------------------------------------ demotion

    def takes(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Per key an explicit ``demote`` is about to evict, whether the tier takes it
        (``DiskWrites.takes``)."""
        return self.writes.takes(keys)

    def evicted(
        self, victims: list[BlockKey], slots: list[int], *, promoting: bool = False
    ) -> None:
        """The pool evicts ``victims``: the admitted ones are staged for the disk
        (``DiskWrites.evicted``), admission having read every ask made before."""
        self.asks.settle()
        self.writes.evicted(victims, slots, promoting=promoting)

    def _removed(self, keys: list[BlockKey], why: str) -> None:
        self.counts[why] += len(keys)
        self.manager.record_event("removed", keys, DISK_MEDIUM)

    async def _probe_loop(self) -> None:
        while True:
            await asyncio.sleep(PROBE_S)
            health = self.store.health()
            if health.ok:
                continue
            if await asyncio.to_thread(self.store.probe):
                log.warning(
                    "disk tier recovered",
                    extra={"fields": {"directory": self.store.directory}},
                )

    # ------------------------------------------------------------------ promotion

    def promote(
        self, keys: Sequence[BlockKey], req_id: str, protect: Sequence[BlockKey] = ()
    ) -> list[asyncio.Task[None]]:
        """Start reading the keys on disk that the pool lacks into it for ``req_id``, in
        chunks of ``read_blocks`` read concurrently (each its own disk pin and promotion, so
        a load can copy one chunk while the next is read); the tasks that settle them (none
        when no key is on disk or the pool has no room). ``protect``: the load's other keys,
        not evicted to make room."""
        pool = self.manager
        on_disk = [k for k in dict.fromkeys(keys) if pool.slot_of(k) is None]
        on_disk = [k for k, there in zip(on_disk, self.index.found(on_disk), strict=True) if there]
        started: list[asyncio.Task[None]] = []
        # At least PROMOTION_PARTS chunks where there are blocks enough: a load copies each
        # chunk on as it lands, so only the last chunk's copy comes after the last read (one
        # chunk of a 16-block onload made the whole copy wait for all 16 reads).
        step = max(1, min(self.read_blocks, -(-len(on_disk) // PROMOTION_PARTS)))
        for first in range(0, len(on_disk), step):
            task = self._promote(on_disk[first : first + step], req_id, protect)
            if task is None:  # no room (or nothing left on disk): later chunks fare no better
                break
            started.append(task)
        return started

    def _promote(
        self, keys: list[BlockKey], req_id: str, protect: Sequence[BlockKey]
    ) -> asyncio.Task[None] | None:
        pin = self.index.pin(keys)
        if pin is None:
            return None
        disk_slot = dict(zip(pin.keys, pin.slots, strict=True))

        def read(keys: list[BlockKey], slots: list[int], req_id: str) -> Awaitable[list[bool]]:
            # Submitted to the I/O threads now, in the order the chunks were reserved: the
            # first chunk is read first, so the load can copy it while the rest is read.
            items = [(disk_slot[k], k, s) for k, s in zip(keys, slots, strict=True)]
            reading = asyncio.wrap_future(self.store.submit_reads(items))
            return self._settle_read(reading, keys, pin, req_id, time.perf_counter())

        task = self.promotions.start(pin.keys, req_id, read, protect)
        if task is None:
            self.index.unpin(pin)
        return task

    async def _settle_read(
        self,
        reading: asyncio.Future[list[bool]],
        keys: list[BlockKey],
        pin: DiskOp,
        req_id: str,
        started: float,
    ) -> list[bool]:
        """Per key, read whole and checked; the disk pin is let go, blocks whose disk copy is
        bad (torn, corrupt, unreadable) dropped. A timeout says nothing about the blocks (none
        is dropped then), and the slots stay reserved until the read has returned."""
        bad: list[BlockKey] = []
        try:
            try:
                async with asyncio.timeout(self.timeout_s):
                    ok = await asyncio.shield(reading)
            except TimeoutError:
                self.counts["read_timeouts"] += 1
                self.store.mark_degraded(f"read of {len(keys)} block(s) past {self.timeout_s}s")
                # The read may still write into the slots (or not have started on its thread).
                with contextlib.suppress(Exception):
                    await reading
                return [False] * len(keys)
            self._io("read", time.perf_counter() - started, len(keys), req_id)
            bad = [k for k, good in zip(keys, ok, strict=True) if not good]
            return ok
        finally:
            self._unpin(pin, bad)

    def _unpin(self, pin: DiskOp, bad: list[BlockKey]) -> None:
        dropped = self.index.unpin(pin, bad)
        if dropped:
            by_key = dict(zip(pin.keys, pin.slots, strict=True))
            self.store.forget([by_key[k] for k in dropped])
            self.counts["corrupt_dropped"] += len(dropped)
            self._removed(dropped, "removed_bad")

    # ------------------------------------------------------------------ metrics

    def metric_families(self) -> Iterator[Metric]:
        return disk_families(self.state())

    # ------------------------------------------------------------------ helpers

    def _io(self, op: str, seconds: float, blocks: int, req_id: str | None) -> None:
        if self._on_io is not None:
            self._on_io(op, seconds, blocks, req_id)


# The disk store's counters (``transfer.disk.DISK_COUNTERS``) exported as counters, by name.
_DISK_COUNTERS = {
    "writes": "Blocks written whole to the disk tier (demotions).",
    "write_failures": "Blocks a disk write did not store (I/O error, disk full, read-only).",
    "reads": "Blocks read back whole from the disk tier with a matching checksum.",
    "read_failures": "Blocks a disk read could not read (I/O error, short read).",
    "checksum_failures": "Blocks read from disk whose bytes did not match their checksum "
    "(torn or corrupt: dropped, never loaded).",
}


def disk_families(state: dict[str, Any]) -> Iterator[Metric]:
    """The disk tier's own families (the ones every tier has are ``kvoffload_tier_*``)."""
    counters = state.get("counters", {})
    for name, doc in _DISK_COUNTERS.items():
        yield CounterMetricFamily(f"{PREFIX}_disk_{name}", doc, value=counters.get(name, 0))
    yield CounterMetricFamily(
        f"{PREFIX}_disk_admissions_refused",
        "Evicted blocks not demoted: asked for fewer than --disk-admit-after times.",
        value=state["demotions"]["refused_admission"],
    )
    yield CounterMetricFamily(
        f"{PREFIX}_disk_evictions",
        "Blocks the disk tier evicted to make room.",
        value=state["evictions"],
    )


class DiskBackend(TierBackend):
    """The ``disk`` tier backend: on with ``--disk-dir``, in ``<disk_dir>/<storage identity>``;
    an identity's blocks are its directory (``app.core.storage``)."""

    position = 10

    def identities(self, settings: Settings) -> list[str]:
        return [] if settings.disk_dir is None else leftover_dirs(settings.disk_dir)

    def drop(
        self, settings: Settings, identity: str, *, only_store: bool = False
    ) -> Dropped | None:
        if settings.disk_dir is None:
            return None
        return drop_disk_dir(settings.disk_dir, identity, only_store=only_store)

    def enabled(self, settings: Settings) -> bool:
        return settings.disk_dir is not None

    def open(self, ctx: TierContext) -> DiskLink:
        s = ctx.settings
        if s.disk_dir is None:
            raise config_error("tiers", "disk", "the disk tier needs --disk-dir")
        check_index_memory(s)
        try:
            store, index = open_disk(s, ctx.pool, ctx.storage)
        except DiskSpaceError as exc:
            raise config_error("disk_bytes", s.disk_bytes, str(exc)) from None
        except DiskError as exc:
            raise config_error(
                "disk_dir",
                s.disk_dir,
                f"{exc}; accepted: a directory this process can write and no other kvoffload uses",
            ) from None
        per_batch = max(1, s.disk_batch_bytes // store.slot_bytes)
        link = DiskLink(
            store,
            index,
            ctx.manager,
            batch_blocks=per_batch,
            read_blocks=per_batch,
            timeout_s=s.disk_timeout_s,
            hold_s=s.lease_ttl_s,
            on_io=lambda op, sec, n, req: ctx.observer.tier_io(ctx.name, op, sec, n, req),
            name=ctx.name,
        )
        if not store.direct:
            log.warning(
                "disk tier uses buffered I/O (O_DIRECT not available here)",
                extra={"fields": {"directory": store.directory, "block_bytes": s.block_bytes}},
            )
        elif store.huge_pages is False:
            mode = _thp_mode()
            fix = (
                f"transparent huge pages are on ({mode}) but the kernel had none to give (its "
                "memory too fragmented); fix: start with more memory free, or after "
                "echo 1 > /proc/sys/vm/compact_memory"
                if mode in ("always", "madvise")
                else f"fix: echo madvise > {THP_ENABLED}"
            )
            log.warning(
                "disk tier's buffers have no huge pages: each block read or written is split "
                f"into more device requests (measured 0.6x as fast); {fix}",
                extra={"fields": {"directory": store.directory, "thp": mode}},
            )
        return link


#: The kernel's transparent huge pages switch (the disk tier's buffers ask for them).
THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"


def _thp_mode() -> str | None:
    """The transparent huge pages mode in force (``always``, ``madvise`` or ``never``)."""
    try:
        with open(THP_ENABLED, encoding="ascii") as f:
            text = f.read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else None


register("disk", DiskBackend())

#: Memory the disk tier's index takes per slot once full, rounded up: 186-426 B measured by
#: policy (the index's tables, lru to prefix_lrfu) plus the key itself (a 32-byte hash: 65 B).
INDEX_MEMORY_PER_SLOT = 512


def memory_available() -> int | None:
    """The machine's available memory (``MemAvailable``), None where it cannot be read."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_index_memory(settings: Settings) -> None:
    """``ConfigError`` naming ``disk_bytes`` when the disk tier's index, once the disk is full,
    would take more memory than the machine has available, saying what it would cost (a huge
    ``--disk-bytes`` with small blocks is millions of slots, each indexed in memory)."""
    slots = slots_for(settings.disk_bytes, settings.block_bytes)
    needed = slots * INDEX_MEMORY_PER_SLOT
    available = memory_available()
    if available is None or needed <= available:
        return
    accepted = disk_bytes_for(available // INDEX_MEMORY_PER_SLOT, settings.block_bytes)
    # The bound named is one the next start passes: the disk's free space is checked after this
    # (at open), so a bound above it would only trade this refusal for that one.
    free = _free_bytes(settings.disk_dir)
    why = "at this block size, or larger blocks (--block-bytes)"
    if free is not None and free < accepted:
        accepted, why = free, f"(the free space under {settings.disk_dir})"
    raise config_error(
        "disk_bytes",
        settings.disk_bytes,
        f"its index would take about {_gib(needed)} of memory once the disk is full ({slots} "
        f"slots of {settings.block_bytes} bytes, about {INDEX_MEMORY_PER_SLOT} B each) but "
        f"this machine has {_gib(available)} available; accepted: at most {accepted} bytes "
        f"{why}",
    )


def _free_bytes(directory: Path | None) -> int | None:
    """Free space (for an unprivileged user) of the filesystem ``directory`` is on, or would
    be made on (its nearest existing parent); None where it cannot be read."""
    path = directory
    while path is not None and not path.exists() and path != path.parent:
        path = path.parent
    if path is None:
        return None
    try:
        vfs = os.statvfs(path)
    except OSError:
        return None
    return vfs.f_bavail * vfs.f_frsize


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.1f} GiB"


def open_disk(settings: Settings, pool: HostPool, namespace: str) -> tuple[DiskStore, DiskIndex]:
    """The disk tier ``settings`` name on ``pool``, in ``<disk_dir>/<namespace>``
    (``namespace``: that directory's name, bound into its blocks' MACs); blocking: call it off
    the loop. ``DiskError`` when the directory cannot be used or is refused (someone else's,
    writable by others, a link or a hard link planted in it: ``transfer.disk_files``). Blocks
    dropped at open (an older format's, entries failing their MAC) are logged here, once."""
    s = settings
    assert s.disk_dir is not None
    slots = slots_for(s.disk_bytes, s.block_bytes)
    store = DiskStore(
        os.path.join(str(s.disk_dir), namespace),
        pool,
        slots,
        staging_blocks=max(1, s.disk_staging_bytes // s.block_bytes),
        io_threads=s.disk_io_threads,
        direct=None if s.disk_direct_io else False,
    )
    fields = {"directory": store.directory}
    if store.format_dropped:
        log.warning(
            "disk tier written in an older on-disk format (unkeyed checksums): its blocks are "
            "dropped, never loaded unauthenticated, and its files start afresh",
            extra={"fields": {**fields, "blocks": store.format_dropped}},
        )
    if store.unauthenticated_dropped:
        log.error(
            "disk tier index entries failed their MAC at start (forged, torn by a crash, or "
            "written under another key or into another directory): dropped, never loaded",
            extra={"fields": {**fields, "blocks": store.unauthenticated_dropped}},
        )
    index = DiskIndex(slots, s.disk_policy, admit_after=s.disk_admit_after)
    return store, index
