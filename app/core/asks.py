"""An engine's asks, counted for a tier's admission a part at a time instead of in its call.

Counting an ask (``DiskIndex.asked``) is bookkeeping a key at a time: about 5 ms for a lookup of
8,192 keys on a 2-core machine, run inside the engine's lookup, load or store, and the longest
thing left in such a call with a disk tier (issue #42, finding 10: no call may hold the loop
shared by every tenant for more than a few ms). Here a large ask is only queued; a task on the
loop counts the queue ``ASK_STEP`` keys at a time, in the order the asks came, giving way
between parts. Whoever reads the counts (the tier's admission, when the pool evicts) calls
``settle`` first, so every decision is the one counting at once would have made: an ask of one
request cut into parts counts as the whole (a key its request asked already is not counted
again), and no ask overtakes another.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable, Sequence

from app.telemetry.logging import get_logger
from manager import BlockKey

log = get_logger("asks")

#: Keys counted a step (an ask of at most this many, with nothing queued, is counted at once).
ASK_STEP = 512
#: Keys queued at most: past it, an ask settles the queue in its own call (the counting task
#: fell behind; memory stays bounded).
MAX_QUEUED_KEYS = 64 * ASK_STEP

Count = Callable[[Sequence[BlockKey], str], None]


class QueuedAsks:
    """The asks of one tier; see the module docstring. ``count(keys, req_id)``: the tier's
    own counting (it must not raise)."""

    def __init__(self, count: Count) -> None:
        self._count = count
        # (keys, req_id, the index of the first key not counted yet)
        self._queue: collections.deque[tuple[Sequence[BlockKey], str, int]] = collections.deque()
        self._queued_keys = 0
        self._wakeup = asyncio.Event()
        self._running = False

    def add(self, keys: Sequence[BlockKey], req_id: str) -> None:
        """An engine asked for ``keys``: counted now when small, nothing is queued and no task
        counts (before ``run``), else queued."""
        if not self._queue and (len(keys) <= ASK_STEP or not self._running):
            self._count(keys, req_id)
            return
        self._queue.append((keys, req_id, 0))
        self._queued_keys += len(keys)
        if self._queued_keys > MAX_QUEUED_KEYS:
            self.settle()
        else:
            self._wakeup.set()

    def settle(self) -> None:
        """Count every queued ask now, in order."""
        queue = self._queue
        while queue:
            keys, req_id, start = queue.popleft()
            self._count(keys[start:] if start else keys, req_id)
        self._queued_keys = 0

    def _step(self) -> None:
        """Count the next ``ASK_STEP`` queued keys."""
        keys, req_id, start = self._queue[0]
        end = start + ASK_STEP
        if end < len(keys):
            self._queue[0] = (keys, req_id, end)
        else:
            self._queue.popleft()
        self._queued_keys -= min(end, len(keys)) - start
        self._count(keys[start:end], req_id)

    async def run(self) -> None:
        """Count what is queued, a step a loop turn, until cancelled (then settle: nothing
        asked is dropped)."""
        self._running = True
        try:
            while True:
                await self._wakeup.wait()
                self._wakeup.clear()
                while self._queue:
                    try:
                        self._step()
                    except Exception:  # a count that raised: its part is not retried
                        log.exception("counting an ask for admission failed")
                    await asyncio.sleep(0)
        finally:
            self._running = False
            self.settle()
