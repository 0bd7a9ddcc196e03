"""A shared tier's write-behind: blocks that became ready in the pool, put to the store.

``RemoteLink`` (``app.core.remote``, and the object tier built on it) serves lookups and
promotions; this room writes behind. A block that becomes ready in the pool is queued
(``stored``; the queue is bounded, what does not fit is dropped and counted); a task puts
batches of up to ``batch_blocks`` from their pool slots, each block held there
(``OffloadManager.hold``) until the put has let go of its slot. A queued block the pool evicts
before its turn is staged at the eviction (``evicted``: its bytes copied out while its slot
still holds them, bounded by ``staging_bytes``, the pool never waiting) and put from the copy.
What the bound cannot take is dropped and counted (``staging_full``). The counts are the
link's (``written``, ``put_failed``, ``staged``, ``gone_before_put``, ``dropped_<reason>``).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import Awaitable, Callable, Sequence

from app.telemetry.logging import get_logger
from manager import BlockKey, OffloadManager
from transfer import HostPool
from transfer.remote import RemoteTier

log = get_logger("remote")


class RemoteWrites:
    """The write-behind of one namespace's remote or object tier; see the module docstring."""

    def __init__(
        self,
        tier: RemoteTier,
        manager: OffloadManager,
        counts: collections.Counter[str],
        *,
        name: str,
        queue_blocks: int,
        batch_blocks: int,
        pool: HostPool | None,
        staging_bytes: int,
        observe: Callable[[str, float, int, str | None], None],
        written: Callable[[list[BlockKey]], None],
        released: Callable[[Sequence[int]], Awaitable[None]],
    ) -> None:
        """``pool``: the pool the manager's slots index, which queued blocks evicted before
        their put are copied out of, up to ``staging_bytes`` at a time (no pool or 0: such
        blocks are lost, counted ``gone_before_put``). ``observe(op, started, blocks, req_id)``:
        each put (``put``, when it started).
        ``written(keys)``: the keys a put stored. ``released(slots)``: waits until the tier
        no longer touches ``slots`` (a put past its timeout may still read them)."""
        self.tier = tier
        self.manager = manager
        self.counts = counts
        self.name = name
        self.queue_blocks = queue_blocks
        self.batch_blocks = batch_blocks
        self.pool = pool
        self.staging_bytes = staging_bytes if pool is not None else 0
        self._observe = observe
        self._written = written
        self._released = released
        self._queue: collections.deque[BlockKey] = collections.deque()
        self._queued: set[BlockKey] = set()
        # Queued blocks the pool evicted, their bytes copied out; and those it evicted that the
        # bound could not take (counted then, so their turn in the queue counts nothing more).
        self._staged: dict[BlockKey, bytes] = {}
        self._staged_total = 0
        self._unstaged: set[BlockKey] = set()
        self._wakeup = asyncio.Event()
        self._drain: asyncio.Task[None] | None = None

    def __len__(self) -> int:
        """Blocks queued, their put not started."""
        return len(self._queue)

    def state(self) -> dict[str, int]:
        """The queue's and the staging's state (the link's ``state()["queue"]``)."""
        return {
            "depth": len(self._queue),
            "capacity": self.queue_blocks,
            "staged_blocks": len(self._staged),
            "staged_bytes": self._staged_total,
            "staging_capacity_bytes": self.staging_bytes,
        }

    def start(self) -> None:
        """Start the write-behind task on the running loop."""
        self._drain = asyncio.get_running_loop().create_task(
            self._drain_loop(), name=f"kvoffload-{self.name}-write-behind"
        )

    async def close(self) -> None:
        """Stop writing behind; what is queued or staged is dropped (``dropped_shutdown``)."""
        task, self._drain = self._drain, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self.counts["dropped_shutdown"] += len(self._queue)
        self._queue.clear()
        self._queued.clear()
        self._staged.clear()
        self._staged_total = 0
        self._unstaged.clear()

    def evicted(
        self, victims: list[BlockKey], slots: list[int], *, promoting: bool = False
    ) -> None:
        """The pool evicts ``victims``: copy out the queued ones (their put has not started;
        a block being put is held, never evicted), as far as ``staging_bytes`` allows; the
        rest of them are counted dropped (``staging_full``). Runs inside the manager's
        ``prepare_store``, on the loop: never calls the manager."""
        queued = self._queued
        if not queued:
            return
        staged, unstaged = self._staged, self._unstaged
        pool = self.pool
        for key, slot in zip(victims, slots, strict=True):
            if key not in queued or key in staged:
                continue
            if pool is None or self._staged_total + pool.block_bytes > self.staging_bytes:
                if key not in unstaged:
                    unstaged.add(key)
                    self.counts["dropped_staging_full"] += 1
                continue
            staged[key] = pool.tensor[slot].numpy().tobytes()
            self._staged_total += pool.block_bytes
            self.counts["staged"] += 1

    def stored(self, keys: Sequence[BlockKey]) -> None:
        """Queue blocks that became ready for the remote tier; what does not fit is dropped."""
        if not keys:
            return
        room = self.queue_blocks - len(self._queue)
        queued = self._queued
        taken = 0
        for key in keys:
            if key in queued:
                continue
            if taken >= room:
                self.counts["dropped_queue_full"] += 1
                continue
            self._queue.append(key)
            queued.add(key)
            taken += 1
        if taken:
            self._wakeup.set()

    async def _drain_loop(self) -> None:
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            while self._queue:
                try:
                    await self._put_batch()
                except Exception:
                    log.exception(
                        "write-behind batch failed; its blocks are dropped",
                        extra={"fields": {"tier": self.name}},
                    )

    async def _put_batch(self) -> None:
        batch: list[BlockKey] = []
        while self._queue and len(batch) < self.batch_blocks:
            key = self._queue.popleft()
            self._queued.discard(key)
            batch.append(key)
        if not self.tier.health().ok:
            self.counts["dropped_degraded"] += len(batch)
            return
        manager = self.manager
        held = manager.hold(batch)
        keys: list[BlockKey] = []
        slots: list[int] = []
        copied: list[BlockKey] = []
        blocks: list[bytes] = []
        for key, slot in zip(batch, held, strict=True):
            block = self._unstage(key)
            if slot is not None:  # in the pool (again): put from there, the copy let go
                self._unstaged.discard(key)
                keys.append(key)
                slots.append(slot)
            elif block is not None:
                copied.append(key)
                blocks.append(block)
            elif key in self._unstaged:
                self._unstaged.discard(key)  # counted dropped at its eviction
            else:
                self.counts["gone_before_put"] += 1  # dropped from the pool, or lost
        if not keys and not copied:
            return
        started = time.perf_counter()
        ok: list[bool] = []
        try:
            if keys:
                ok = await asyncio.to_thread(self.tier.put_from, keys, slots)
            if copied:
                ok += await asyncio.to_thread(self.tier.put_bytes, copied, blocks)
            self._observe("put", started, len(keys) + len(copied), None)
            await self._released(slots)
        finally:
            manager.release_hold(keys)
        keys += copied
        stored = [k for k, good in zip(keys, ok, strict=True) if good]
        self.counts["written"] += len(stored)
        self.counts["put_failed"] += len(keys) - len(stored)
        if stored:
            self._written(stored)

    def _unstage(self, key: BlockKey) -> bytes | None:
        """The staged copy of ``key``, let go of (None: none)."""
        block = self._staged.pop(key, None)
        if block is not None:
            self._staged_total -= len(block)
        return block
