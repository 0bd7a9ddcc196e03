"""The offload manager's read verbs: ``lookup``, ``prepare_load``, ``complete_load``, ``touch``.

The hot path of every engine step; see ``manager.core`` for the contract and the comments for
why each batch case runs as it does.
"""

from __future__ import annotations

import itertools
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence

from manager.errors import KeyNotReadyError, NotPinnedError
from manager.requests import RequestsRoom
from manager.slots import bad_key, check_keys
from manager.spec import BlockKey, LookupOutput, LookupResult, ReqContext

HIT = LookupResult.HIT
PENDING = LookupResult.PENDING
MISS = LookupResult.MISS

# A shared infinite iterator: ``map(get, keys, _ALWAYS_ZERO)`` is ``get(k, 0)`` per key, run
# in C; ``_consume`` drains an iterator in C (a deque that keeps nothing).
_ALWAYS_ZERO = itertools.repeat(0)
_consume: Callable[[Iterable[object]], None] = deque[object](maxlen=0).extend
_READY_OR_MISS = {True: HIT, False: MISS}


class LoadsRoom(RequestsRoom):
    """Lookups, loads (pins per request) and touches."""

    def lookup(self, keys: Sequence[BlockKey], ctx: ReqContext) -> LookupOutput:
        """Per-key state and the count of leading hits. Changes nothing but statistics."""
        self._live(ctx)
        try:
            resident = list(map(self._slot.__contains__, keys))
        except TypeError:
            raise bad_key(keys) from None
        n = len(resident)
        found = resident.count(True)
        if found != n:
            check_keys(keys)  # a batch of resident keys, checked when offered, skips this
        in_flight = self._pending
        if found == 0:
            results = [MISS] * n
            hits = pending = prefix = 0
        elif not in_flight or in_flight.isdisjoint(keys):
            # Every resident key is ready: hits and misses only, mapped in C.
            hits, pending = found, 0
            if found == n:
                results = [HIT] * n
                prefix = n
            else:
                results = list(map(_READY_OR_MISS.__getitem__, resident))
                prefix = resident.index(False)
        else:
            results = [
                (PENDING if k in in_flight else HIT) if r else MISS
                for k, r in zip(keys, resident, strict=True)
            ]
            hits = results.count(HIT)
            pending = results.count(PENDING)
            prefix = 0
            for r in results:
                if r is not HIT:
                    break
                prefix += 1
        self._lookup_hit += hits
        self._lookup_pending += pending
        self._lookup_miss += n - hits - pending
        return LookupOutput(results, prefix)

    def peek(self, keys: Sequence[BlockKey]) -> list[LookupResult]:
        """Each key's state, as ``lookup`` finds it, for no request and counted nowhere (a
        read, for cache control); per key in C unless a key's store is in flight."""
        try:
            resident = list(map(self._slot.__contains__, keys))
        except TypeError:
            raise bad_key(keys) from None
        if not all(resident):
            check_keys(keys)
        in_flight = self._pending
        if not in_flight or in_flight.isdisjoint(keys):
            return list(map(_READY_OR_MISS.__getitem__, resident))
        return [
            (PENDING if k in in_flight else HIT) if r else MISS
            for k, r in zip(keys, resident, strict=True)
        ]

    def prepare_load(self, keys: Sequence[BlockKey], ctx: ReqContext) -> list[int]:
        """Pin every key (ref count +1 per occurrence) and return their slots, in order.

        Every key must be ready; otherwise ``KeyNotReadyError`` names the missing and pending
        keys and nothing is pinned.
        """
        req = self._live(ctx)
        slot_of = self._slot
        in_flight = self._pending
        try:
            slots = list(map(slot_of.__getitem__, keys))
            ready = not in_flight or in_flight.isdisjoint(keys)
        except TypeError:
            raise bad_key(keys) from None
        except KeyError:
            ready = False
        if not ready:
            check_keys(keys)  # a missing key may be no key at all
            missing = [k for k in keys if k not in slot_of]
            pending = [k for k in keys if k in in_flight]
            raise KeyNotReadyError(missing, pending)
        refs = self._refs
        pins = req.pins
        once = dict.fromkeys(keys, 1)
        if len(once) == len(slots) and (not refs or refs.keys().isdisjoint(once)):
            # Common case: distinct keys that nobody holds pinned (so this request neither).
            refs.update(once)
            pins.update(once)
        else:
            refs_get, pins_get = refs.get, pins.get
            for key in keys:
                refs[key] = refs_get(key, 0) + 1
                pins[key] = pins_get(key, 0) + 1
        self._loads += len(slots)
        if req.keys:
            req.keys.update(once)
        else:
            req.keys = once  # the ref and pin tables copied what they needed from it
        return slots

    def complete_load(self, keys: Sequence[BlockKey], ctx: ReqContext) -> None:
        """Unpin keys this request pinned (once per occurrence).

        A key the request does not hold pinned (as many times as listed) raises
        ``NotPinnedError`` and nothing is unpinned. Allowed after a normal finish.
        """
        req = self._any(ctx)
        pins = req.pins
        refs = self._refs
        pins_get = pins.get
        try:
            held = list(map(pins_get, keys, _ALWAYS_ZERO))
        except TypeError:
            raise bad_key(keys) from None
        n = len(held)
        once = held.count(1) == n
        if once:
            # Common case: every key pinned once by this request. Deleting them proves they
            # are listed once; a key listed twice fails the second time, and every listed key
            # (all held once) is put back before the counting path below reports it.
            try:
                _consume(map(pins.__delitem__, keys))
            except KeyError:
                pins.update(dict.fromkeys(keys, 1))
                once = False
        if once:
            counts = list(map(refs.pop, keys))
            if counts.count(1) != n:  # others pin some of these blocks too: they keep theirs
                refs.update((k, c - 1) for k, c in zip(keys, counts, strict=True) if c > 1)
        else:
            check_keys(keys)  # pinned keys were checked when offered; others may be no keys
            bad = [k for k, c in Counter(keys).items() if pins_get(k, 0) < c]
            if bad:
                raise NotPinnedError(req.req_id, bad)
            for key in keys:
                left = pins[key] - 1
                if left:
                    pins[key] = left
                else:
                    del pins[key]
                left = refs[key] - 1
                if left:
                    refs[key] = left
                else:
                    del refs[key]
        if req.finished and not req.holds_leases():
            self._forget(req)

    def touch(self, keys: Sequence[BlockKey], ctx: ReqContext) -> None:
        """Record a use of the ready keys among ``keys`` (head first); others are ignored."""
        req = self._live(ctx)
        try:
            chain = dict.fromkeys(keys)  # hashes every key before the policy sees one
        except TypeError:
            raise bad_key(keys) from None
        if chain:
            # A resident key was checked when offered; the view comparison runs in C and
            # costs less than checking the keys themselves.
            if not self._slot.keys() >= chain.keys():
                check_keys(keys)
            self._policy.touch(keys)
            if req.keys:
                req.keys.update(chain)
            else:
                req.keys = chain
            req.orderings += 1
