"""Bringing blocks up from a lower tier (disk, remote) into the pool for a request: one mechanism.

A promotion reserves pool slots for the keys as stores pending for an internal request of its
own (``PENDING`` to every lookup, not evictable; never the engine's request, whose own
``complete-store`` of the same keys would otherwise make them ready before their bytes are in),
runs the tier's read into those slots off the loop,
then completes the stores: each key read in full becomes ready (then ``HIT``) and is *held* for
that request (``OffloadManager.hold``) until the request pins it with its own load (``loaded``)
or ``hold_s`` passes, so it is still there when the engine comes back for it; a key not read is
dropped (``MISS``). Bytes not read in full are never made loadable. While a read may still write
into its slots, its internal request is in ``writing()``, so no lease expiry frees them under
it. The load's keys the pool already holds are offered along (``protect``), so making room for
the promoted blocks never evicts the blocks the same load is about to pin.

``Promotions.start`` calls ``read`` at once, as soon as the slots are reserved (a tier that
submits its I/O in that call starts reading before any task runs), and returns an
``asyncio.Task`` that ends when the read is settled: an ``onload`` waits on it and then copies
those keys in the same job (no 409 round trip); a ``prepare-load`` does not.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
from collections.abc import Awaitable, Callable, Sequence

from app.telemetry.logging import get_logger
from manager import BlockKey, OffloadManager, ReqContext
from manager.errors import ManagerError

log = get_logger("promotion")

#: ``read(keys, slots, req_id)``: the tier's read into pool slots, called once the slots are
#: reserved; what it returns, awaited, says per key whether it was read in full.
Read = Callable[[list[BlockKey], list[int], str], Awaitable[list[bool]]]


class Promotions:
    """Promotions in flight and the holds they keep; see the module docstring."""

    def __init__(self, manager: OffloadManager, *, hold_s: float, tier: str) -> None:
        self.manager = manager
        self.hold_s = hold_s
        self.tier = tier
        self._held_for: dict[str, set[BlockKey]] = {}
        self._running: dict[str, set[asyncio.Task[None]]] = {}  # by the engine's request
        self._internal: dict[str, str] = {}  # internal request -> the engine's, in flight
        self._by_key: dict[BlockKey, asyncio.Task[None]] = {}  # the promotion bringing it up
        self._ids = itertools.count()
        self.counts: collections.Counter[str] = collections.Counter()

    def start(
        self,
        keys: Sequence[BlockKey],
        req_id: str,
        read: Read,
        protect: Sequence[BlockKey] = (),
    ) -> asyncio.Task[None] | None:
        """Reserve pool slots for ``keys`` (those the pool lacks) and start ``read`` into
        them for request ``req_id``; the task that settles it, or None when nothing was
        started (no room, no key). ``protect``: other keys of the same load, not evicted to
        make the room."""
        manager = self.manager
        wanted = [k for k in dict.fromkeys(keys) if manager.slot_of(k) is None]
        if not wanted:
            return None
        # Resident keys in an offer are skipped and kept from eviction by prepare_store.
        shield = [k for k in protect if manager.slot_of(k) is not None]
        ctx = ReqContext(f"kvoffload-{self.tier}-promote-{next(self._ids)}")
        manager.on_new_request(ctx)
        try:
            out = manager.prepare_store(wanted + shield, ctx)
        except ManagerError:
            out = None
        if out is None or not out.keys_to_store:
            manager.on_request_finished(ctx)
            return None
        self.counts["promoted_keys"] += len(out.keys_to_store)
        reading = read(out.keys_to_store, out.slots, req_id)
        task = asyncio.get_running_loop().create_task(
            self._settle(ctx, req_id, out.keys_to_store, reading),
            name=f"kvoffload-{self.tier}-promote",
        )
        self._internal[ctx.req_id] = req_id
        tasks = self._running.setdefault(req_id, set())
        tasks.add(task)
        brought = out.keys_to_store
        self._by_key.update(dict.fromkeys(brought, task))
        task.add_done_callback(lambda t: self._done(req_id, t, brought))
        return task

    def _done(self, req_id: str, task: asyncio.Task[None], keys: list[BlockKey]) -> None:
        tasks = self._running.get(req_id)
        if tasks is not None:
            tasks.discard(task)
            if not tasks:
                del self._running[req_id]
        by_key = self._by_key
        for key in keys:
            if by_key.get(key) is task:
                del by_key[key]

    def running_for(self, req_id: str) -> list[asyncio.Task[None]]:
        """The promotions in flight for ``req_id``."""
        return list(self._running.get(req_id, ()))

    def covering(self, keys: Sequence[BlockKey]) -> set[asyncio.Task[None]]:
        """The promotions in flight bringing any of ``keys`` up, whoever started them (a
        prefetch, another request)."""
        by_key = self._by_key
        if not by_key:
            return set()
        return {t for t in map(by_key.get, keys) if t is not None}

    async def _settle(
        self, ctx: ReqContext, req_id: str, keys: list[BlockKey], reading: Awaitable[list[bool]]
    ) -> None:
        try:
            ok = await reading
            good = [k for k, g in zip(keys, ok, strict=True) if g]
            bad = [k for k, g in zip(keys, ok, strict=True) if not g]
        except Exception:
            log.exception(f"{self.tier} promotion failed; its blocks are dropped")
            good, bad = [], keys
        try:
            self._complete(ctx, req_id, good, bad)
        finally:
            with contextlib.suppress(ManagerError):
                self.manager.on_request_finished(ctx)
            # Its slots are no longer written from here, in the same step that made its
            # blocks ready (not in a done callback a caller could run ahead of).
            self._internal.pop(ctx.req_id, None)

    def _complete(
        self, ctx: ReqContext, req_id: str, good: list[BlockKey], bad: list[BlockKey]
    ) -> None:
        manager = self.manager
        settled = 0
        try:
            if bad:
                manager.complete_store(bad, ctx, success=False)
                self.counts["promoted_failed"] += len(bad)
                settled += len(bad)
            if good:
                done = manager.complete_store(good, ctx, success=True).completed
                self.counts["promoted_ready"] += len(done)
                settled += len(good)
                self.counts["promoted_abandoned"] += len(good) - len(done)
                if done:
                    slots = manager.hold(done)
                    held = [k for k, slot in zip(done, slots, strict=True) if slot is not None]
                    self._held_for.setdefault(req_id, set()).update(held)
                    asyncio.get_running_loop().call_later(self.hold_s, self.let_go, req_id, held)
        except ManagerError:  # the request was forgotten meanwhile: its stores went with it
            self.counts["promoted_abandoned"] += len(good) + len(bad) - settled

    def loaded(self, req_id: str, keys: Sequence[BlockKey]) -> None:
        """Request ``req_id`` pinned ``keys`` with its own load: promoted blocks among them
        need no hold of ours any more."""
        if req_id in self._held_for:
            self.let_go(req_id, keys)

    def let_go(self, req_id: str, keys: Sequence[BlockKey] | None) -> None:
        """Release the holds kept for ``req_id`` on ``keys`` (None: all of them)."""
        held = self._held_for.get(req_id)
        if held is None:
            return
        gone = list(held) if keys is None else [k for k in keys if k in held]
        if gone:
            held.difference_update(gone)
            self.manager.release_hold(gone)
        if not held:
            del self._held_for[req_id]

    def writing(self) -> set[str]:
        """The internal requests of the promotions in flight: their pending stores are being
        written."""
        return set(self._internal)

    @property
    def in_flight(self) -> int:
        return sum(len(t) for t in self._running.values())

    async def close(self) -> None:
        """Wait for promotions in flight, then release every hold."""
        for tasks in list(self._running.values()):
            for task in list(tasks):
                with contextlib.suppress(Exception, asyncio.CancelledError):
                    await task
        for req_id in list(self._held_for):
            self.let_go(req_id, None)
