"""The offload manager's write verbs: ``prepare_store`` and ``complete_store``.

An offer is sorted, room is made by evicting (all or nothing), slots are reserved for the new
keys; the writer's report makes them ready or drops them. See ``manager.core`` for the contract.
"""

from __future__ import annotations

from collections.abc import Sequence

from manager.events import EventsRoom
from manager.policies import CanEvict
from manager.requests import RequestsRoom
from manager.slots import RequestRecord, bad_key, check_keys
from manager.spec import (
    BlockKey,
    BlockStored,
    CompleteStoreOutput,
    PrepareStoreOutput,
    ReqContext,
)


class StoresRoom(RequestsRoom, EventsRoom):
    """Store offers (all or nothing, evicting to make room) and their completion."""

    def prepare_store(self, keys: Sequence[BlockKey], ctx: ReqContext) -> PrepareStoreOutput | None:
        """Reserve slots for the offered keys that are not resident yet.

        Resident keys (ready or pending) are skipped and counted as reuse; with a reuse filter,
        new keys below their threshold are returned in ``skipped_keys``. Room is made by
        evicting unpinned ready blocks that are not part of this offer. If that cannot cover the
        need, returns ``None`` and changes nothing (not even the reuse counts). Evicted keys are
        reported as one ``BlockRemoved`` event.
        """
        req = self._live(ctx)
        # All or nothing by order: deciding (sorting the offer, asking the reuse filter)
        # changes nothing, making room either succeeds whole or changes nothing, and only then
        # are the offers counted and the slots reserved, which cannot fail.
        new_keys, protected, chain, reused = self._sort_offer(keys)
        made = self._room_for(new_keys, protected)
        if made is None:
            return None
        admitted, skipped, victims = made
        slots = self._reserve(req, admitted, chain)
        return self._prepared(admitted, slots, victims, skipped, reused)

    def _room_for(
        self, new_keys: list[BlockKey], protected: set[BlockKey]
    ) -> tuple[list[BlockKey], list[BlockKey], list[BlockKey]] | None:
        """Admit the offer's ``new_keys`` (the reuse filter) and make room for them:
        ``(admitted, skipped, victims)``, or ``None`` (counted as refused) and nothing changed
        when no room can be made."""
        admitted = new_keys
        skipped: list[BlockKey] = []
        if self._reuse is not None and new_keys:
            admitted, skipped = self._reuse.split(new_keys)
        victims = self._make_room(len(admitted), protected)
        if victims is None:
            self._stores_refused += 1
            return None
        if self._reuse is not None and new_keys:
            self._reuse.record(new_keys)
        return admitted, skipped, victims

    def _prepared(
        self,
        admitted: list[BlockKey],
        slots: list[int],
        victims: list[BlockKey],
        skipped: list[BlockKey],
        reused: int,
    ) -> PrepareStoreOutput:
        """A store offer's counts, and its answer."""
        self._stores_prepared += len(slots)
        self._stores_reused += reused
        self._stores_skipped += len(skipped)
        return PrepareStoreOutput(admitted, slots, victims, skipped)

    def _sort_offer(
        self, keys: Sequence[BlockKey]
    ) -> tuple[list[BlockKey], set[BlockKey], dict[BlockKey, None], int]:
        """Split a store offer into ``(new_keys, protected, chain, reused)``; changes nothing.

        ``new_keys``: the distinct offered keys not resident, in order of first offer.
        ``protected``: the offered keys that are ready and evictable (unpinned); making room
        for this offer must not evict them. ``chain``: the distinct offered keys in order, as a
        fresh dict nobody else holds. ``reused``: how many offered keys (with repeats) are
        resident, ready or pending. Raises ``InvalidArgumentError`` if an offered key is not a
        key; only new keys need the check, resident ones passed it when they were offered.
        """
        try:
            resident = list(map(self._slot.__contains__, keys))  # hashes every key, in C
        except TypeError:
            raise bad_key(keys) from None
        reused = resident.count(True)
        chain = dict.fromkeys(keys)
        if reused == 0:
            # Common case, a new stretch of a prefix: the distinct keys are the new keys, and
            # no resident key needs protecting, so both come without a Python-level loop.
            check_keys(chain)
            return list(chain), set(), chain, 0
        refs, in_flight = self._refs, self._pending
        fresh = (k for k, r in zip(keys, resident, strict=True) if not r)
        new_keys = list(dict.fromkeys(fresh))
        check_keys(new_keys)
        protected = {
            k
            for k, r in zip(keys, resident, strict=True)
            if r and k not in refs and k not in in_flight  # ready and evictable
        }
        return new_keys, protected, chain, reused

    def _make_room(self, need: int, protected: set[BlockKey]) -> list[BlockKey] | None:
        """Evict until ``need`` slots are free; returns the victims (often none).

        Victims are ready blocks that no request has pinned and that are not in ``protected``.
        All or nothing: if evicting every such block would not free enough slots, returns
        ``None`` and changes nothing. The victims' slots join the free list, the eviction
        counters grow and one ``BlockRemoved`` event lists the victims.
        """
        slot_of, refs = self._slot, self._refs
        shortfall = need - len(self._free)
        if shortfall <= 0:
            return []
        # Exact, because every resident key is pending, pinned, or ready and unpinned, and
        # ``protected`` holds only the last kind; so the policy is asked only when it can
        # succeed, and a refusal costs no scan.
        evictable = len(slot_of) - len(self._pending) - len(refs) - len(protected)
        kept = self._kept
        if kept:
            # Kept blocks are ready but out of the policy. This bound counts a kept block that
            # is also pinned or offered twice; only when it falls short is the overlap counted.
            evictable -= len(kept)
            if shortfall > evictable:
                evictable += sum(map(kept.__contains__, refs))
                evictable += sum(map(kept.__contains__, protected))
        if shortfall > evictable:
            return None
        # No filter at all when nothing is pinned or protected: the policies' fast path, which
        # takes victims straight off their order without a call per candidate.
        can_evict: CanEvict | None = None
        if protected:

            def can_evict(key: BlockKey) -> bool:
                return key not in refs and key not in protected

        elif refs:

            def can_evict(key: BlockKey) -> bool:
                return key not in refs

        victims = self._policy.evict(shortfall, can_evict)
        if victims is None:  # the count above is exact; this guards a policy bug
            return None
        freed = list(map(slot_of.pop, victims))  # one C-level pass
        for listener in self._eviction_listeners:
            listener(victims, freed)
        self._push_free(freed)
        self._evictions += len(victims)
        name = self._policy.name
        self._evictions_by_policy[name] = self._evictions_by_policy.get(name, 0) + len(victims)
        self._emit_removed(victims)
        return victims

    def _reserve(
        self, req: RequestRecord, admitted: list[BlockKey], chain: dict[BlockKey, None]
    ) -> list[int]:
        """Give each admitted key a free slot, as a store pending for ``req``; returns the slots.

        There must be at least ``len(admitted)`` free slots. The offer's ``chain`` joins the
        request's chain (the order its blocks are reordered in when the request ends).
        """
        slots = self._take_slots(req, admitted)
        self._join_chain(req, chain)
        return slots

    def _take_slots(self, req: RequestRecord, admitted: list[BlockKey]) -> list[int]:
        """A free slot for each admitted key, as a store pending for ``req``; the slots."""
        count = len(admitted)
        if not count:
            return []
        # Slots come off the top of the free stack as one reversed slice (top first), not one
        # pop per key.
        free = self._free
        slots = free[: -count - 1 : -1]
        del free[-count:]
        self._slot.update(zip(admitted, slots, strict=True))
        self._pending.update(admitted)
        req.pending.update(admitted)
        return slots

    @staticmethod
    def _join_chain(req: RequestRecord, chain: dict[BlockKey, None]) -> None:
        """The call's ``chain`` (a fresh dict nobody else holds) joins the request's."""
        if req.keys:
            req.keys.update(chain)
        else:
            req.keys = chain  # adopted instead of copied

    def complete_store(
        self, keys: Sequence[BlockKey], ctx: ReqContext, success: bool = True
    ) -> CompleteStoreOutput:
        """Finish this request's stores of ``keys``.

        Success: its pending blocks become ready (one ``BlockStored`` event, policy insert).
        Failure: its pending blocks are dropped and their slots freed. Keys that are not a store
        this request has in flight are left untouched and reported in ``ignored``, so a repeated
        call is a no-op. Allowed after a normal finish or an abort (an abort's reserved slot is
        freed here).
        """
        req = self._any(ctx)
        pending = req.pending
        mine: list[BlockKey]
        dropped: list[BlockKey] = []
        ignored: list[BlockKey] = []
        try:
            unique = set(keys)  # hashes every key before anything changes
        except TypeError:
            raise bad_key(keys) from None
        fast = len(unique) == len(keys) and pending.issuperset(unique)
        if fast:
            mine = list(keys)
            pending.difference_update(mine)
        else:
            check_keys(keys)  # keys in flight were checked when offered; others may not be
            mine = []
            for key in keys:
                if key in pending:
                    pending.discard(key)
                    mine.append(key)
                elif key in req.reserved:
                    self._free.append(req.reserved.pop(key))
                    self._num_reserved -= 1
                    dropped.append(key)
                else:
                    ignored.append(key)
        completed: list[BlockKey] = []
        if success:
            completed = mine
            if mine:
                self._pending.difference_update(mine)
                self._stores_completed += len(mine)
                self._admit(mine)
                self._emit(BlockStored(self._next_seq(), mine))
                req.orderings += 1
        elif mine:
            self._pending.difference_update(mine)
            self._push_free(list(map(self._slot.pop, mine)))
            self._stores_failed += len(mine)
            dropped = mine + dropped
        if req.finished and not req.holds_leases():
            self._forget(req)
        return CompleteStoreOutput(completed, dropped, ignored)
