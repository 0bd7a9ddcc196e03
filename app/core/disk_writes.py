"""The disk tier's demotions: blocks the pool evicts, staged and written to disk.

``DiskLink`` (``app.core.disk``) decides what goes down (admission) and serves what comes up;
this room takes what goes down. An evicted block the tier admitted is copied into a staging
buffer right inside the pool's eviction (before its slot is handed out again), queued, and
written a ``batch_blocks`` batch at a time on the store's I/O threads, as many batches at once
as half the disk's slots allow; a task on the loop settles each batch (its blocks loadable,
one ``BlockStored`` event, or dropped and counted). Nothing here waits for the disk inside the
pool's calls: no staging buffer free, or the store degraded, and the demotion is dropped and
counted (``dropped_<reason>`` in the link's counts), never waited for.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from app.telemetry.logging import get_logger
from manager import DISK_MEDIUM, BlockKey, DiskIndex, DiskOp, OffloadManager
from transfer.disk import DiskStore

log = get_logger("disk")

OnIO = Callable[[str, float, int, str | None], None]


class DiskWrites:
    """The demotion path of one namespace's disk tier; see the module docstring."""

    def __init__(
        self,
        store: DiskStore,
        index: DiskIndex,
        manager: OffloadManager,
        counts: collections.Counter[str],
        *,
        batch_blocks: int,
        on_io: OnIO,
        removed: Callable[[list[BlockKey], str], None],
    ) -> None:
        """``counts``: the link's counters, which this adds its own to (``demoted``,
        ``dropped_<reason>``). ``on_io(op, seconds, blocks, req_id)``: each written batch.
        ``removed(keys, why)``: disk blocks evicted to make room (told on the loop)."""
        self.store = store
        self.index = index
        self.manager = manager
        self.counts = counts
        self.batch_blocks = batch_blocks
        self._on_io = on_io
        self._removed = removed
        self._queue: collections.deque[tuple[BlockKey, int]] = collections.deque()
        self._wakeup = asyncio.Event()
        self._writer: asyncio.Task[None] | None = None
        self._writing: set[asyncio.Task[None]] = set()  # batches being written
        self._forced: set[BlockKey] = set()  # an explicit demote's keys (``takes``)
        # Batches written at once. Every staged batch is handed to the I/O threads as soon as
        # it is copied (their queue keeps --disk-io-threads requests on the device, the
        # staging bytes bound the rest): a cap of a few batches left the device idle while the
        # loop copied the rest of a large eviction (the batches done were settled only after
        # it). But a batch in flight holds its disk slots (pending, not evictable): on a disk
        # of a few batches a second one would find no room and drop its blocks, so at most
        # half the disk is being written at once.
        self._max_writes = max(1, index.num_slots // (2 * batch_blocks))

    def __len__(self) -> int:
        """Blocks staged and queued, their write not started."""
        return len(self._queue)

    def start(self) -> None:
        """Start the writer on the running loop (nothing is written before)."""
        self._writer = asyncio.get_running_loop().create_task(
            self._write_loop(), name="kvoffload-disk-writer"
        )

    async def close(self, timeout_s: float) -> None:
        """Write what is staged (the blocks are not lost to a graceful stop) within
        ``timeout_s``, stop the writer, let the batches in flight end (their slots written or
        dropped), and drop what is left (counted ``shutdown``)."""
        if self._queue and self.store.health().ok:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(timeout_s):
                    while self._queue:
                        await self._write_batch()
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await writer
        for task in list(self._writing):
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await task
        self._drop_queue("shutdown")

    def takes(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Per key an explicit ``demote`` is about to evict: on disk or being written
        already, or, while the tier is healthy, taken from that eviction whatever
        ``--disk-admit-after`` says (an explicit demote is the strongest ask there is; the
        admission guards the disk against the pool's own eviction traffic), as many as free
        staging buffers hold. The next ``evicted`` stages those."""
        slot_of = self.index.index.slot_of
        room = self.store.staging_free if self.store.health().ok else 0
        out: list[bool] = []
        forced: set[BlockKey] = set()
        for key in keys:
            if slot_of(key) is not None:
                out.append(True)
            elif room > 0 and key not in forced:
                forced.add(key)
                room -= 1
                out.append(True)
            else:
                out.append(key in forced)
        self._forced = forced
        return out

    def evicted(
        self, victims: list[BlockKey], slots: list[int], *, promoting: bool = False
    ) -> None:
        """The pool evicts ``victims``: stage the admitted ones for the disk (see the module
        docstring), a batch at a time, each batch's write started as soon as it is staged, so
        that the disk writes while the next batch is copied. Runs inside the manager's
        ``prepare_store``: never calls the manager (events wait for the loop). ``promoting``:
        only staged; the writer reserves their disk slots after the promotion, so that no
        block the same load reads next is evicted for them."""
        forced, self._forced = self._forced, set()
        if forced:  # an explicit demote (``takes``): admission aside
            disk_slot = self.index.index.slot_of
            taken = [k for k in victims if k in forced and disk_slot(k) is None]
            rest = [k for k in victims if k not in forced or disk_slot(k) is not None]
            chosen = taken + self.index.select(rest)
        else:
            chosen = self.index.select(victims)
        if not chosen:
            return
        if not self.store.health().ok:
            self._count_dropped("degraded", len(chosen))
            return
        slot_of = dict(zip(victims, slots, strict=True))
        for at in range(0, len(chosen), self.batch_blocks):
            part = chosen[at : at + self.batch_blocks]
            staged = self.store.stage([slot_of[k] for k in part])
            if staged is None:
                self._count_dropped("staging_full", len(chosen) - at)
                break
            self._queue.extend(zip(part, staged, strict=True))
            if not promoting:
                self._start_writes(defer_events=True)
        self._wakeup.set()

    def _count_dropped(self, why: str, n: int) -> None:
        self.counts[f"dropped_{why}"] += n

    def _drop_queue(self, why: str) -> None:
        if self._queue:
            self._count_dropped(why, len(self._queue))
            self.store.unstage([buf for _, buf in self._queue])
            self._queue.clear()

    async def _write_loop(self) -> None:
        # Batches left queued by ``evicted`` (the writes in flight at their limit) start as
        # writes end.
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            while self._queue:
                self._start_writes()
                if self._queue and self._writing:
                    await asyncio.wait(self._writing, return_when=asyncio.FIRST_COMPLETED)

    def _start_writes(self, *, defer_events: bool = False) -> None:
        """Take batches off the queue and start writing them, up to ``_max_writes`` at once:
        each goes to the store's I/O threads now; a task on the loop settles it (one batch at
        a time left the device's queue empty between batches: demotion measured 0.42-0.54x
        fio's write). ``defer_events``: called inside the manager's ``prepare_store``, so the
        disk's evictions are told on the loop after it. Nothing starts before ``start`` (the
        loop's writer takes the queue then)."""
        if self._writer is None:
            return
        loop = asyncio.get_running_loop()
        while self._queue and len(self._writing) < self._max_writes:
            try:
                batch = self._take_batch(defer_events=defer_events)
            except Exception:
                log.exception("disk write batch failed; its blocks are dropped")
                continue
            if batch is None:
                continue
            # Submitted here, settled by the task.
            task = loop.create_task(self._submit(*batch), name="kvoffload-disk-write")
            self._writing.add(task)
            task.add_done_callback(self._written)

    def _written(self, task: asyncio.Task[None]) -> None:
        self._writing.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("disk write batch failed; its blocks are dropped", exc_info=task.exception())

    async def _write_batch(self) -> None:
        """Take one batch off the queue and write it (the graceful stop's drain)."""
        batch = self._take_batch()
        if batch is not None:
            await self._submit(*batch)

    def _take_batch(
        self, *, defer_events: bool = False
    ) -> tuple[DiskOp, dict[BlockKey, int]] | None:
        """Up to ``batch_blocks`` staged blocks off the queue, their disk slots reserved (the
        index op and each key's staging buffer); None when none is left to write (each
        dropped one counted, its buffer given back). ``defer_events``: the disk blocks
        evicted for room are told on the loop's next turn (see ``_start_writes``)."""
        batch: list[tuple[BlockKey, int]] = []
        while self._queue and len(batch) < self.batch_blocks:
            batch.append(self._queue.popleft())
        # A key queued twice (evicted, stored again, evicted again before the writer got to
        # it): its newest copy is written, the older buffer goes back now.
        staged: dict[BlockKey, int] = {}
        for key, buf in batch:
            old = staged.pop(key, None)
            if old is not None:
                self.store.unstage([old])
                self._count_dropped("duplicate", 1)
            staged[key] = buf
        # Queued twice across batches: on disk (or being written) already, nothing to write.
        for key in [k for k in staged if self.index.index.slot_of(k) is not None]:
            self.store.unstage([staged.pop(key)])
        if not staged:
            return None
        if not self.store.health().ok:
            self._count_dropped("degraded", len(staged))
            self.store.unstage(list(staged.values()))
            return None
        keys = list(staged)
        op = self.index.reserve(keys)
        # Fewer evictable disk slots than the batch (a disk smaller than a batch, blocks
        # pinned by reads): as many as fit, the last evicted (the warmest) first; a refused
        # reserve changes nothing.
        n = len(keys)
        while op is None and n > 1:
            n //= 2
            op = self.index.reserve(keys[-n:])
        taken = set() if op is None else set(op.keys)
        left = [k for k in keys if k not in taken]
        if left:  # every disk block pinned or being written: no room now
            self._count_dropped("no_room", len(left))
            self.store.unstage([staged.pop(k) for k in left])
        if op is None:
            return None
        if op.evicted:
            if defer_events:
                asyncio.get_running_loop().call_soon(self._removed, op.evicted, "evicted")
            else:
                self._removed(op.evicted, "evicted")
        return op, staged

    def _submit(self, op: DiskOp, staged: dict[BlockKey, int]) -> Coroutine[Any, Any, None]:
        """Hand a batch ``_take_batch`` reserved to the store's I/O threads now (not when a
        task gets to it: the loop may still be copying the next batch); the coroutine that
        settles it."""
        items = [(slot, key, staged[key]) for key, slot in zip(op.keys, op.slots, strict=True)]
        started = time.perf_counter()
        try:
            future = asyncio.wrap_future(self.store.submit_writes(items))
        except BaseException:
            self._settle_write(op, staged, items, started, [False] * len(items))
            raise
        return self._await_write(op, staged, items, started, future)

    async def _await_write(
        self,
        op: DiskOp,
        staged: dict[BlockKey, int],
        items: list[tuple[int, BlockKey, int]],
        started: float,
        future: asyncio.Future[list[bool]],
    ) -> None:
        ok = [False] * len(items)
        try:
            ok = await future
        finally:
            self._settle_write(op, staged, items, started, ok)

    def _settle_write(
        self,
        op: DiskOp,
        staged: dict[BlockKey, int],
        items: list[tuple[int, BlockKey, int]],
        started: float,
        ok: list[bool],
    ) -> None:
        """A batch ``_take_batch`` reserved is written (``ok`` per item): its blocks become
        loadable (or are dropped, counted, where the write failed) and its staging buffers
        go back."""
        self.store.unstage(list(staged.values()))
        self._on_io("write", time.perf_counter() - started, len(items), None)
        done = self.index.written(op, ok)
        self.counts["demoted"] += len(done)
        self._count_dropped("write_failed", len(items) - len(done))
        if done:
            self.manager.record_event("stored", done, DISK_MEDIUM)
