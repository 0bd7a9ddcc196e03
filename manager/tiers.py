"""The disk tier's bookkeeping: which blocks are on disk, where, and which evicted blocks go there.

Pure Python like the rest of ``manager``: no I/O. The service (``app.core.disk``) moves the bytes
and the replay (``manager.replay``) simulates them; both decide with this one class, so what the
replay predicts is what the service does.

- **The index** is an ``OffloadManager`` whose slots are the disk's block slots: the disk evicts
  by a policy of the pool's family, a block being read is pinned (not evicted under its read),
  a block being written is a pending store (not loadable until it is whole on disk).
- **Admission** (``admit_after``): a block the pool evicts is demoted only once it has been
  asked for (looked up, loaded or stored: ``asked``) at least ``admit_after`` times while
  tracked, so one-off prefixes never reach the SSD. An ask names its request: the calls of one
  request (an engine looks a block up, then stores it) count once, so ``admit_after=2`` means
  two requests wanted the block. ``admit_after=1`` demotes every evicted block. The counts live
  in a bounded tracker (least recently asked forgotten first).
- **Inclusive**: a block promoted back into the pool keeps its disk copy, so evicting it again
  costs no write (``select`` only touches it there).

Every reservation and pin runs under an internal request of its own (``DiskOp``), so the index
keeps no per-key state beyond the manager's.
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from manager.core import OffloadManager
from manager.errors import InvalidArgumentError
from manager.spec import BlockKey, ReqContext

#: How many keys the ask tracker remembers per disk slot (bounded memory, ~100 B a key).
TRACKED_PER_SLOT = 4


@dataclass(slots=True)
class DiskOp:
    """One write (``reserve``) or read (``pin``) in flight on the disk index.

    ``keys[i]`` is at disk slot ``slots[i]``; ``evicted`` lists the disk blocks a write evicted
    to make room (already gone from the index).
    """

    ctx: ReqContext
    keys: list[BlockKey]
    slots: list[int]
    evicted: list[BlockKey] = field(default_factory=list)


class DiskIndex:
    """What is on the disk tier and what goes there; see the module docstring."""

    def __init__(
        self,
        num_slots: int,
        policy: str = "lru",
        *,
        admit_after: int = 2,
        policy_params: Mapping[str, Any] | None = None,
        max_tracked: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if type(admit_after) is not int or admit_after < 1:
            raise InvalidArgumentError(f"admit_after must be an integer >= 1, got {admit_after!r}")
        self.index = OffloadManager(
            num_slots, policy, policy_params, clock=clock, enable_events=False
        )
        self.admit_after = admit_after
        self._max_tracked = max_tracked if max_tracked is not None else TRACKED_PER_SLOT * num_slots
        if self._max_tracked <= 0:
            raise InvalidArgumentError(f"max_tracked must be positive, got {self._max_tracked}")
        # key -> (asks, the request that asked last); None when every block is admitted.
        self._asks: OrderedDict[BlockKey, tuple[int, str | None]] | None = (
            OrderedDict() if admit_after >= 2 else None
        )
        self._ids = itertools.count()
        self.refused = 0  # evicted blocks not admitted (asked too few times)

    @property
    def num_slots(self) -> int:
        return self.index.num_blocks

    @property
    def blocks(self) -> int:
        """Blocks on disk, loadable (O(1): no walk of the index)."""
        return self.index.stats().ready

    # ------------------------------------------------------------------ admission

    def asked(self, keys: Sequence[BlockKey], asker: str | None = None) -> None:
        """Count one ask (lookup, load or store) of each key by request ``asker``: a key
        asked again by the request that asked it last is not counted again (None: every
        call counts)."""
        asks = self._asks
        if asks is None or not keys:
            return
        for key in keys:
            count, last = asks.pop(key, (0, None))
            if asker is None or last != asker:
                count += 1
            asks[key] = (count, asker)
        while len(asks) > self._max_tracked:
            asks.popitem(last=False)

    def asks(self, key: BlockKey) -> int:
        """Asks counted for ``key`` (0 when untracked or every block is admitted)."""
        return 0 if self._asks is None else self._asks.get(key, (0, None))[0]

    def admits(self, key: BlockKey) -> bool:
        """Whether ``key`` has been asked for often enough to be demoted."""
        return self._asks is None or self.asks(key) >= self.admit_after

    def select(self, victims: Sequence[BlockKey]) -> list[BlockKey]:
        """Of blocks the pool evicts, those to write to disk: admitted and not on disk yet
        (a victim already on disk is touched there instead; the others count as refused)."""
        index = self.index
        on_disk = [k for k in victims if index.is_ready(k)]
        if on_disk:
            self._touch(on_disk)
        absent = [k for k in victims if index.slot_of(k) is None]
        chosen = [k for k in absent if self.admits(k)]
        # Refused: absent and not admitted (a victim still being written is neither).
        self.refused += len(absent) - len(chosen)
        return chosen

    # ------------------------------------------------------------------ writes

    def reserve(self, keys: Sequence[BlockKey]) -> DiskOp | None:
        """Disk slots for ``keys`` (pending: not loadable until ``written``), evicting cold
        disk blocks as needed; None when the disk cannot make room (everything pinned or being
        written), nothing changed."""
        ctx = self._begin("w")
        out = self.index.prepare_store(keys, ctx)
        if out is None or not out.keys_to_store:
            self.index.on_request_finished(ctx)
            return None
        return DiskOp(ctx, out.keys_to_store, out.slots, out.evicted_keys)

    def written(self, op: DiskOp, ok: Sequence[bool]) -> list[BlockKey]:
        """The write ``op`` ended: the keys written whole become loadable, the others are
        dropped (their slots freed); the keys now on disk."""
        good = [k for k, g in zip(op.keys, ok, strict=True) if g]
        bad = [k for k, g in zip(op.keys, ok, strict=True) if not g]
        index = self.index
        if bad:
            index.complete_store(bad, op.ctx, success=False)
        done = index.complete_store(good, op.ctx, success=True).completed if good else []
        index.on_request_finished(op.ctx)
        return done

    # ------------------------------------------------------------------ reads

    def found(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Per key, whether it is on disk and loadable (no statistics, no policy touch)."""
        is_ready = self.index.is_ready
        return [is_ready(k) for k in keys]

    def pin(self, keys: Sequence[BlockKey]) -> DiskOp | None:
        """Pin the loadable ``keys`` for a read (not evicted until ``unpin``); None when any
        is not on disk (nothing pinned)."""
        index = self.index
        wanted = list(dict.fromkeys(keys))
        if not all(index.is_ready(k) for k in wanted):
            return None
        ctx = self._begin("r")
        slots = index.prepare_load(wanted, ctx)
        return DiskOp(ctx, wanted, slots)

    def unpin(self, op: DiskOp, bad: Sequence[BlockKey] = ()) -> list[BlockKey]:
        """The read ``op`` ended: unpin; ``bad`` keys (torn or corrupt on disk) are dropped from
        the index; the keys dropped.

        A read does not touch the disk's order (only a policy that reads request chains,
        prefix_lrfu, sees the read's chain): the block is back in the pool, and ``select``
        touches its disk copy when the pool evicts it again. Touching on read measured worse
        (replay, pool 5k + disk 15k: lru 0.5476 -> 0.5464, arc 0.5578 -> 0.5537).
        """
        index = self.index
        index.complete_load(op.keys, op.ctx)
        index.on_request_finished(op.ctx)
        return index.drop(list(bad)) if bad else []

    # ------------------------------------------------------------------ restart and admin

    def restore(self, blocks: Sequence[tuple[BlockKey, int]]) -> int:
        """Adopt blocks found on disk at start, coldest first; how many."""
        return self.index.restore(blocks)

    def drop(self, keys: Sequence[BlockKey]) -> list[BlockKey]:
        """Remove unpinned, written blocks from the index; the keys removed."""
        return self.index.drop(keys)

    def _touch(self, keys: Sequence[BlockKey]) -> None:
        ctx = self._begin("t")
        self.index.touch(keys, ctx)
        self.index.on_request_finished(ctx)

    def _begin(self, kind: str) -> ReqContext:
        ctx = ReqContext(f"kvoffload-disk-{kind}{next(self._ids)}")
        self.index.on_new_request(ctx)
        return ctx
