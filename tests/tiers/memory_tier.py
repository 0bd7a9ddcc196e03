"""A tier below the pool that keeps blocks in process memory: the third backend of the contract.

It exists to show what a new backend costs: this module alone. Importing it registers the
``memory`` tier (``app.core.tier.register``); a service then runs it with ``tiers=["memory"]``
(``--tiers memory``). Nothing else in the service names it.

- **Demotion** (``evicted``): the pool's victims are copied out of their slots at once, while
  the manager evicts them, into a bounded store (least recently demoted dropped first, counted).
  While the tier is ``down`` they are dropped and counted instead.
- **Lookup** (``found``): the store's keys; "not found" while down.
- **Promotion**: ``app.core.promotion`` with a read that copies the bytes into the reserved
  slots; a key that left the store meanwhile is a miss.
- **Restart**: the store is kept per storage identity for the life of the process
  (``STORES``), so a service started again under the same identity finds its blocks, as a disk
  tier would after a restart; ``identities`` and ``drop`` let the tenancy delete an identity's
  blocks (a namespace removed or given to another tenant), as it deletes a disk directory.
- **Events**: each demotion batch is one ``BlockStored`` of medium ``MEMORY``, recorded on the
  next loop turn (``evicted`` runs inside the manager's ``prepare_store``, which a listener must
  not call back into).
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Sequence
from typing import Any

from app.core.promotion import Promotions
from app.core.storage import Dropped
from app.core.tier import LowerTier, TierBackend, TierContext, register
from app.settings import Settings
from app.telemetry.metrics import TierReport
from manager import BlockKey
from transfer.health import TierHealth

MEDIUM = "MEMORY"
#: Each storage identity's blocks, kept across services of this process (its "restart").
STORES: dict[str, collections.OrderedDict[BlockKey, bytes]] = {}


class MemoryTier(LowerTier):
    """See the module docstring."""

    degraded_means = "drops demotions and answers nothing"

    def __init__(self, ctx: TierContext, capacity: int) -> None:
        self.name = ctx.name
        self.ctx = ctx
        self.capacity = capacity
        self.blocks = STORES.setdefault(ctx.storage, collections.OrderedDict())
        self.promotions = Promotions(ctx.manager, hold_s=ctx.settings.lease_ttl_s, tier=ctx.name)
        self._down = False
        self._since = time.time()
        self.counts: collections.Counter[str] = collections.Counter()

    @property
    def down(self) -> bool:
        return self._down

    @down.setter
    def down(self, down: bool) -> None:
        """Switch the tier down (a fault it sees) or up again."""
        if down != self._down:
            self._down, self._since = down, time.time()
            self.counts["incidents"] += down

    def start(self) -> None:
        return None

    async def close(self) -> None:
        await self.promotions.close()

    def health(self) -> TierHealth:
        error = "switched down" if self.counts["incidents"] else None
        if self.down:
            return TierHealth("degraded", self._since, error)
        return TierHealth("ok", self._since, error)

    def report(self) -> TierReport:
        return TierReport(
            up=not self.down,
            queue_depth=0,  # demotions are copied at once
            demoted=self.counts["demoted"],
            dropped={"degraded": self.counts["dropped_degraded"]},
            promoted=self.promotions.counts["promoted_ready"],
            bytes_read=self.counts["bytes_read"],
            bytes_written=self.counts["bytes_written"],
            incidents=self.counts["incidents"],
            blocks=len(self.blocks),
            capacity_blocks=self.capacity,
        )

    def state(self) -> dict[str, Any]:
        return {
            "state": "degraded" if self.down else "ok",
            "blocks": len(self.blocks),
            "capacity": self.capacity,
            "demoted": self.counts["demoted"],
            "dropped": {"degraded": self.counts["dropped_degraded"]},
            "evicted": self.counts["evicted"],
            "promoted": self.promotions.counts["promoted_ready"],
        }

    def evicted(
        self, victims: list[BlockKey], slots: list[int], *, promoting: bool = False
    ) -> None:
        if self.down:
            self.counts["dropped_degraded"] += len(victims)
            return
        tensor = self.ctx.pool.tensor
        for key, slot in zip(victims, slots, strict=True):
            self.blocks.pop(key, None)
            self.blocks[key] = bytes(tensor[slot].numpy())
            self.counts["bytes_written"] += tensor.shape[1]
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)
            self.counts["evicted"] += 1
        self.counts["demoted"] += len(victims)
        asyncio.get_running_loop().call_soon(self._stored_event, list(victims))

    def _stored_event(self, keys: list[BlockKey]) -> None:
        self.ctx.manager.record_event("stored", keys, MEDIUM)

    async def found(self, keys: Sequence[BlockKey], req_id: str | None) -> list[bool]:
        if self.down:
            return [False] * len(keys)
        return [k in self.blocks for k in keys]

    def promote(
        self, keys: Sequence[BlockKey], req_id: str, protect: Sequence[BlockKey] = ()
    ) -> list[asyncio.Task[None]]:
        if self.down:
            return []
        pool = self.ctx.manager
        held = [k for k in dict.fromkeys(keys) if pool.slot_of(k) is None and k in self.blocks]
        if not held:
            return []
        task = self.promotions.start(held, req_id, self._read, protect)
        return [] if task is None else [task]

    async def _read(self, keys: list[BlockKey], slots: list[int], req_id: str) -> list[bool]:
        tensor = self.ctx.pool.tensor
        ok = []
        for key, slot in zip(keys, slots, strict=True):
            data = self.blocks.get(key)
            if data is None or self.down:
                ok.append(False)
                continue
            tensor[slot].numpy()[:] = memoryview(data)
            self.counts["bytes_read"] += len(data)
            ok.append(True)
        return ok


class MemoryBackend(TierBackend):
    """The ``memory`` tier: only when ``--tiers`` names it; four times the pool's blocks."""

    def enabled(self, settings: Settings) -> bool:
        return False

    def open(self, ctx: TierContext) -> MemoryTier:
        return MemoryTier(ctx, capacity=4 * ctx.pool.num_blocks)

    def identities(self, settings: Settings) -> list[str]:
        return sorted(STORES)

    def drop(
        self, settings: Settings, identity: str, *, only_store: bool = False
    ) -> Dropped | None:
        blocks = STORES.pop(identity, None)
        if blocks is None:
            return None
        return Dropped(identity, files=0, bytes=sum(map(len, blocks.values())))


register("memory", MemoryBackend())
