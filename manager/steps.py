"""The large write verbs in steps: ``prepare_store``, ``complete_store``, ``touch``, ``drop``.

``X_steps(..., step)`` is a generator that does what ``X`` does, at most about ``step`` keys'
work between two ``yield``s, and returns what ``X`` returns. Its caller gives way to other work
at each ``yield``, having suspended the manager (``manager.suspend``): nobody sees the manager
between two steps, so to everyone else the call is one. A call of at most ``step`` keys is
``X`` itself, with no ``yield``.

The outcome is ``X``'s: the same answer, state, counts and events, with one difference:

- the policy is told in parts (tail part first, as ``X`` files a batch tail first, so that a
  policy that orders each key by its own history ends in ``X``'s order; one that weighs a
  whole batch, ``prefix_lrfu``, sees parts).

``prepare_store_steps`` makes room for the whole offer in its first step (so its victims and
slots are ``prepare_store``'s), then reserves the slots in parts. All or nothing holds: every
check that can refuse runs before the first change.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence

from manager.loads import LoadsRoom
from manager.parts import distinct_steps, parts
from manager.slots import RequestRecord, bad_key, check_keys
from manager.spec import BlockKey, BlockStored, CompleteStoreOutput, PrepareStoreOutput, ReqContext
from manager.stores import StoresRoom
from manager.switch import SwitchRoom


class StepsRoom(StoresRoom, LoadsRoom, SwitchRoom):
    """The ``*_steps`` verbs; see the module docstring."""

    def touch_steps(
        self, keys: Sequence[BlockKey], ctx: ReqContext, step: int
    ) -> Generator[None, None, None]:
        """``touch`` in steps."""
        if len(keys) <= step:
            return self.touch(keys, ctx)
        req = self._live(ctx)
        chain = yield from _chain_steps(keys, step)
        resident = self._slot.__contains__
        for part in parts(keys, step):
            yield  # 512 look-ups in a slot table of 100,000s of keys: about 1 ms, out of cache
            if not all(map(resident, part)):
                check_keys(part)  # a resident key was checked when offered
        for part in reversed(parts(keys, step)):
            yield
            self._policy.touch(part)
        yield from self._join_chain_steps(req, chain, step)
        req.orderings += 1
        return None

    def complete_store_steps(
        self, keys: Sequence[BlockKey], ctx: ReqContext, success: bool, step: int
    ) -> Generator[None, None, CompleteStoreOutput]:
        """``complete_store`` in steps. A call whose keys are not all distinct stores of this
        request (the rare case) is ``complete_store`` itself, in one step."""
        if len(keys) <= step:
            return self.complete_store(keys, ctx, success)
        req = self._any(ctx)
        pending = req.pending
        unique = yield from _chain_steps(keys, step)
        for part in parts(keys, step):
            yield
            if not pending.issuperset(part):
                return self.complete_store(keys, ctx, success)
        if len(unique) != len(keys):
            return self.complete_store(keys, ctx, success)
        mine = list(keys)
        for part in parts(mine, step):
            yield
            pending.difference_update(part)
            self._pending.difference_update(part)
        if success:
            self._stores_completed += len(mine)
            for part in reversed(parts(mine, step)):
                yield
                self._admit(list(part))
            self._emit(BlockStored(self._next_seq(), mine))
            req.orderings += 1
        else:
            freed: list[int] = []
            for part in parts(mine, step):
                yield
                freed += map(self._slot.pop, part)
            self._push_free(freed)  # once: the free stack in ``complete_store``'s order
            self._stores_failed += len(mine)
        if req.finished and not req.holds_leases():
            self._forget(req)
        return CompleteStoreOutput(mine if success else [], [] if success else mine, [])

    def prepare_store_steps(
        self, keys: Sequence[BlockKey], ctx: ReqContext, step: int
    ) -> Generator[None, None, PrepareStoreOutput | None]:
        """``prepare_store`` in steps; ``None`` and nothing changed when the whole offer finds
        no room."""
        if len(keys) <= step:
            return self.prepare_store(keys, ctx)
        req = self._live(ctx)
        new_keys, protected, chain, reused = yield from self._sort_offer_steps(keys, step)
        made = self._room_for(new_keys, protected)
        if made is None:
            return None
        admitted, skipped, victims = made
        slots: list[int] = []
        for part in parts(admitted, step):
            yield
            slots += self._take_slots(req, list(part))
        yield from self._join_chain_steps(req, chain, step)
        return self._prepared(admitted, slots, victims, skipped, reused)

    def _sort_offer_steps(
        self, keys: Sequence[BlockKey], step: int
    ) -> Generator[None, None, tuple[list[BlockKey], set[BlockKey], dict[BlockKey, None], int]]:
        """``_sort_offer``, a part of the offer a step (it changes nothing)."""
        contains, refs, in_flight = self._slot.__contains__, self._refs, self._pending
        chain: dict[BlockKey, None] = {}
        new: dict[BlockKey, None] = {}
        protected: set[BlockKey] = set()
        reused = 0
        for part in parts(keys, step):
            yield
            try:
                resident = list(map(contains, part))
            except TypeError:
                raise bad_key(keys) from None
            chain.update(dict.fromkeys(part))
            found = resident.count(True)
            reused += found
            fresh = part if not found else [k for k, r in zip(part, resident, strict=True) if not r]
            check_keys(fresh)  # a resident key was checked when offered
            new.update(dict.fromkeys(fresh))
            if found:
                protected.update(
                    k
                    for k, r in zip(part, resident, strict=True)
                    if r and k not in refs and k not in in_flight  # ready and evictable
                )
        return list(new), protected, chain, reused

    def _join_chain_steps(
        self, req: RequestRecord, chain: dict[BlockKey, None], step: int
    ) -> Generator[None, None, None]:
        """``_join_chain``, a part of the chain a step."""
        if not req.keys:
            req.keys = chain  # adopted, as ``_join_chain`` adopts it
            return
        order = list(chain)
        for part in parts(order, step):
            yield
            req.keys.update(dict.fromkeys(part))

    def drop_steps(
        self, keys: Sequence[BlockKey], step: int
    ) -> Generator[None, None, tuple[list[BlockKey], dict[str, int]]]:
        """``sort_for_hint`` then ``drop`` of what it found movable, in steps: the keys
        dropped, and why the others stayed (``sort_for_hint``'s counts)."""
        if len(keys) <= step:
            movable, kept = self.sort_for_hint(keys)
            return (self.drop(movable) if movable else []), kept
        chain = yield from _chain_steps(keys, step)
        movable = []
        kept = {"pinned": 0, "retained": 0, "pending": 0, "not_in_pool": 0}
        for part in parts(list(chain), step):
            yield
            moves, stays = self.sort_for_hint(part)
            movable += moves
            for why, n in stays.items():
                kept[why] += n
        slot_of = self._slot
        freed: list[int] = []
        for part in parts(movable, step):
            yield
            freed += map(slot_of.pop, part)
            self._policy.remove(part)
        self._push_free(freed)  # once: the free stack in ``drop``'s order
        self._emit_removed(movable)
        return movable, kept


def _chain_steps(
    keys: Sequence[BlockKey], step: int
) -> Generator[None, None, dict[BlockKey, None]]:
    """``dict.fromkeys(keys)``, a part a step; ``InvalidArgumentError`` for an unhashable."""
    try:
        return (yield from distinct_steps(keys, step))
    except TypeError:
        raise bad_key(keys) from None
