"""The offload manager: which blocks live in the host pool, in which slot, in which state.

Primitives (all batch-native, all carrying a ``ReqContext``):

- ``lookup(keys)``: per key HIT / PENDING / MISS plus ``hit_prefix``; changes only statistics.
- ``prepare_load(keys)`` / ``complete_load(keys)``: pin ready blocks for a host->device copy and
  unpin them afterwards. Pins are counted per request, so a request can only release what it
  holds and a retried ``complete_load`` cannot unpin twice.
- ``touch(keys)``: record a use (policy order); keys that are not ready are ignored.
- ``prepare_store(keys)`` / ``complete_store(keys, success)``: reserve slots for the keys not yet
  resident, evicting unpinned ready blocks if needed, then make them ready (or drop them).
  ``prepare_store`` is all-or-nothing: ``None`` and no change when the room cannot be made.
- ``on_new_request`` / ``on_request_finished``: the request lifecycle. Pins and pending stores are
  *leases* owned by the request. A normal finish keeps them until their ``complete_*`` call
  arrives (a store may finish after its request). An abort releases every pin at once and drops
  every pending store from the index; the slot of a dropped store stays reserved (an *orphaned
  reservation*) until the writer reports (``complete_store``) or a writer deadline passes,
  because a copy may still be writing into it and the slot must not be handed to another block
  under that copy.
- ``expire_requests(lease_ttl, writer_deadline=...)``: force-release the leases of requests
  silent for longer than the TTL (a crashed engine cannot leak the pool), and end orphaned
  reservations whose writer has not reported within the deadline (an engine that aborts and
  never reports cannot hold the pool either). Time comes only from the injected clock.
- ``retain(keys, ttl_s, name)`` / ``renew_retention`` / ``release_retention`` /
  ``expire_retentions``: named retentions (``manager.retention``) keep their keys' ready blocks
  out of eviction until their TTL passes; such a *kept* block leaves the policy's order and
  returns to it when the last retention naming it ends. ``demote(keys)``: evict chosen blocks
  now, through the eviction listeners (a lower tier takes them).
- ``take_events()``: KV events since the last call, drained once, in order.
- ``switch_policy(name, params)``: rebuild a new policy from the resident blocks, coldest first;
  block state is untouched and no block is lost. ``reset()``: drop every ready block that is
  neither pinned nor retained.

Keys: a key is ``bytes`` (exactly) of 1..``MAX_KEY_BYTES`` bytes. Every call that takes keys
(``lookup``, ``touch``, ``prepare_load``, ``complete_load``, ``prepare_store``,
``complete_store``) raises ``InvalidArgumentError`` and changes nothing (the request's lease is
still renewed) when one of them is not a key and not equal to a key the manager holds. Held keys
(resident, pending or pinned) were checked when ``prepare_store`` admitted them, so each call
checks its batch only on the paths where some key was not found in the table it was looked up
in; a batch of held keys in the expected state, the hot case, pays nothing for the check. The
tables compare by equality, as dicts do: an object equal to a held key (a ``bytes`` subclass, a
``memoryview`` of it) is taken as that key.

Block states: a key is *pending* from ``prepare_store`` until ``complete_store``, then *ready*;
a ready block with a ref count above zero is *pinned*. The policy only holds ready blocks, and
the manager only lets it evict ready blocks with a zero ref count that are not part of the
store offer being served; retained ready blocks are not in the policy at all. Invariant:
``free + pending + ready == num_blocks``, where *pending* also counts the reserved slots of
dropped in-flight stores.

Not thread-safe: the service calls it from one event loop, each call runs to completion.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter, deque
from collections.abc import Callable, Collection, Container, Iterable, Mapping, Sequence
from typing import Any

from manager.errors import (
    InvalidArgumentError,
    KeyNotReadyError,
    NotPinnedError,
    UnknownRequestError,
)
from manager.policies import (
    CanEvict,
    EvictionPolicy,
    canonical_policy_name,
    create_policy,
    policy_class,
)
from manager.retention import RetentionTable
from manager.reuse import ReuseFilter
from manager.spec import (
    MAX_KEY_BYTES,
    AllBlocksCleared,
    BlockKey,
    BlockRemoved,
    BlockStored,
    CompleteStoreOutput,
    KVEvent,
    LookupOutput,
    LookupResult,
    ManagerStats,
    PolicyInfo,
    PolicySwitch,
    PrepareStoreOutput,
    ReleasedLeases,
    ReqContext,
    RequestLeases,
    ResetCounts,
    RetentionInfo,
)

HIT = LookupResult.HIT
PENDING = LookupResult.PENDING
MISS = LookupResult.MISS

Clock = Callable[[], float]
# A shared infinite iterator: ``map(get, keys, _ALWAYS_ZERO)`` is ``get(k, 0)`` per key, run
# in C; ``_consume`` drains an iterator in C (a deque that keeps nothing).
_ALWAYS_ZERO = itertools.repeat(0)
_consume: Callable[[Iterable[object]], None] = deque[object](maxlen=0).extend
_ONLY_BYTES = frozenset({bytes})
_KEY_SIZES = frozenset(range(1, MAX_KEY_BYTES + 1))
_READY_OR_MISS = {True: HIT, False: MISS}
ChainListener = Callable[[list[BlockKey]], None]
#: ``listener(victims, slots)``: blocks evicted to make room, with the slots they held. Called
#: before any of those slots is handed out again, so the listener may still read their bytes.
EvictionListener = Callable[[list[BlockKey], list[int]], None]
DEFAULT_MAX_EVENTS = 1_000_000


def _check_keys(keys: Collection[BlockKey]) -> None:
    """Raise ``InvalidArgumentError`` unless every key is ``bytes`` of 1..``MAX_KEY_BYTES``.

    Two C-level passes, about 30 ns a key: every type must be in a set holding only ``bytes``
    (exactly ``bytes``, not a subclass or another hashable buffer such as a ``memoryview``,
    which would compare equal to a key), then every length in the set of valid lengths. The
    Python loop that names the culprit runs only on failure.
    """
    if not (_ONLY_BYTES.issuperset(map(type, keys)) and _KEY_SIZES.issuperset(map(len, keys))):
        raise _bad_key(keys)


def _bad_key(keys: Iterable[object]) -> InvalidArgumentError:
    """The error for a batch holding something that is not a key (wrong type or size, or
    unhashable); it shows the first such."""
    bad = next((k for k in keys if type(k) is not bytes or not 0 < len(k) <= MAX_KEY_BYTES), None)
    return InvalidArgumentError(f"keys must be 1..{MAX_KEY_BYTES} bytes, got {bad!r:.80}")


class _Request:
    """Server-side accounting of one request: its leases and the keys it used, in order."""

    __slots__ = (
        "finished",
        "keys",
        "kv_transfer_params",
        "orderings",
        "pending",
        "pins",
        "renewed_at",
        "req_id",
        "reserved",
        "reserved_at",
    )

    def __init__(self, ctx: ReqContext, now: float) -> None:
        self.req_id = ctx.req_id
        self.kv_transfer_params = ctx.kv_transfer_params
        self.pins: dict[BlockKey, int] = {}
        # Keys whose store this request has in flight (the block is in the index, pending).
        self.pending: set[BlockKey] = set()
        # Slots of stores dropped by an abort while their copy may still be running, and when
        # the latest of them was dropped (the writer deadline runs from there).
        self.reserved: dict[BlockKey, int] = {}
        self.reserved_at = now
        # The request's chain, head to tail in order of first use (keys it loaded, offered for
        # store or touched), for tail-before-head reordering when the record is dropped. Only
        # the keys and their order matter; values are whatever the cheapest update carried.
        self.keys: dict[BlockKey, Any] = {}
        # Number of calls that changed policy order for these keys; one call orders its own
        # batch correctly, so a reorder is only needed after two or more.
        self.orderings = 0
        self.renewed_at = now
        self.finished = False

    def holds_leases(self) -> bool:
        return bool(self.pins or self.pending or self.reserved)


class OffloadManager:
    """Bookkeeping of the host pool; see the module docstring for the contract."""

    def __init__(
        self,
        num_blocks: int,
        policy: str = "lru",
        policy_params: Mapping[str, Any] | None = None,
        store_threshold: int = 0,
        *,
        reuse_tracker_size: int | None = None,
        clock: Clock = time.monotonic,
        enable_events: bool = True,
        max_events: int = DEFAULT_MAX_EVENTS,
    ) -> None:
        if type(num_blocks) is not int or num_blocks <= 0:
            raise InvalidArgumentError(f"num_blocks must be a positive integer, got {num_blocks!r}")
        if type(store_threshold) is not int or store_threshold < 0:
            raise InvalidArgumentError(
                f"store_threshold must be a non-negative integer, got {store_threshold!r}"
            )
        if max_events <= 0:
            raise InvalidArgumentError(f"max_events must be positive, got {max_events}")
        self.num_blocks = num_blocks
        self._policy: EvictionPolicy = create_policy(policy, num_blocks, policy_params)
        self._generation = 1
        self._clock = clock
        self._reuse: ReuseFilter | None = None
        if store_threshold >= 2:
            tracked = reuse_tracker_size if reuse_tracker_size is not None else 4 * num_blocks
            self._reuse = ReuseFilter(store_threshold, tracked)
        self.store_threshold = store_threshold

        # Block state, laid out so that the common batch cases run as C-level operations and
        # touch one large table per key: every resident key (ready or pending) has a slot; the
        # keys whose store is in flight form a set that stays small (a resident key not in it
        # is ready); only pinned keys have a ref count.
        self._slot: dict[BlockKey, int] = {}
        self._pending: set[BlockKey] = set()
        self._refs: dict[BlockKey, int] = {}
        # Holds taken outside requests (``hold``), also counted in ``_refs``.
        self._held: Counter[BlockKey] = Counter()
        # Retentions (``retain``): the keys some live retention names, and of those the ones
        # ready in the pool (``_kept``), which are out of the policy's order so that no
        # eviction ever looks at them and the policies' fast paths stay as they are.
        self._retentions = RetentionTable()
        self._retained = self._retentions.counts
        self._kept: set[BlockKey] = set()
        # Free slots as a stack whose top is the end of the list, read top-down when handing
        # out: stored descending, a fresh pool hands out 0, 1, 2, ... so a batch gets one
        # ascending run, which the transfer backends copy as one piece (``_push_free``).
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._num_reserved = 0
        self._requests: dict[str, _Request] = {}
        self._chain_listeners: list[ChainListener] = []
        self._eviction_listeners: list[EvictionListener] = []

        self._enable_events = enable_events
        self._events: deque[KVEvent] = deque(maxlen=max_events)
        self._event_seq = 0

        self._lookup_hit = 0
        self._lookup_pending = 0
        self._lookup_miss = 0
        self._loads = 0
        self._stores_prepared = 0
        self._stores_completed = 0
        self._stores_failed = 0
        self._stores_reused = 0
        self._stores_skipped = 0
        self._stores_refused = 0
        self._evictions = 0
        self._evictions_by_policy: dict[str, int] = {}
        self._forced_lease_releases = 0
        self._reservations_expired = 0
        self._policy_switches = 0
        self._events_dropped = 0
        self._retentions_started = 0
        self._retentions_expired = 0
        self._retentions_released = 0
        self._demoted = 0

    # ------------------------------------------------------------------ requests

    def on_new_request(self, ctx: ReqContext) -> bool:
        """Start (or renew) request ``ctx.req_id``; returns True if it was new.

        Idempotent: announcing a live request again renews its leases and updates its
        ``kv_transfer_params``. A finished request that still holds leases cannot be restarted.
        """
        req_id = ctx.req_id
        if type(req_id) is not str or not req_id:
            raise InvalidArgumentError(f"req_id must be a non-empty string, got {req_id!r}")
        req = self._requests.get(req_id)
        now = self._clock()
        if req is None:
            self._requests[req_id] = _Request(ctx, now)
            return True
        if req.finished:
            raise InvalidArgumentError(
                f"request {req_id!r} has finished and still holds leases; use a new req_id"
            )
        req.kv_transfer_params = ctx.kv_transfer_params
        req.renewed_at = now
        return False

    def on_request_finished(self, ctx: ReqContext, abort: bool = False) -> ReleasedLeases:
        """End request ``ctx.req_id``.

        Normal finish: pins and pending stores stay valid until their ``complete_*`` calls (the
        record is dropped once it holds nothing). Abort: every pin is released and every pending
        store dropped from the index at once; see the module docstring for their slots. Finishing
        a finished request again is a no-op, except that ``abort=True`` still aborts it.
        """
        req = self._requests.get(ctx.req_id)
        if req is None:
            raise UnknownRequestError(ctx.req_id)
        req.renewed_at = self._clock()
        req.finished = True
        released = ReleasedLeases(ctx.req_id, 0, 0)
        if abort:
            released = self._release(req, writers_alive=True)
        if not req.holds_leases():
            self._forget(req)
        return released

    def expire_requests(
        self,
        lease_ttl: float,
        idle_ttl: float | None = None,
        *,
        writing: Container[str] = (),
        writer_deadline: float | None = None,
    ) -> list[ReleasedLeases]:
        """Force-release requests that have been silent too long, and end overdue reservations.

        A request holding leases (pins, pending stores, reserved slots) and silent for more than
        ``lease_ttl`` seconds loses them: its engine is presumed gone, so its slots are freed at
        once and it is forgotten, unless its id is in ``writing`` (a copy the caller runs may
        still be writing its stores): then, as after an abort, those slots stay reserved until
        the copy reports through ``complete_store``.

        With ``writer_deadline``, the reserved slots of a request's dropped stores (after an
        abort, a release or an expiry with writers alive) are freed once ``writer_deadline``
        seconds have passed since the drop, unless its id is in ``writing``: a writer that
        has not reported by then is presumed gone (counted in ``reservations_expired``). The
        request is forgotten with them, so a late ``complete_store`` from it raises
        ``UnknownRequestError`` and changes nothing, whatever became of those slots.

        With ``idle_ttl``, requests holding nothing and silent for longer are forgotten too.
        Every call a request makes renews it. Returns what was released, one entry per request
        that held leases or reserved slots.
        """
        now = self._clock()
        out: list[ReleasedLeases] = []
        for req in list(self._requests.values()):
            alive = req.req_id in writing
            if (
                req.reserved
                and writer_deadline is not None
                and now - req.reserved_at > writer_deadline
                and not alive
            ):
                # A drop released the request's pins and pending stores; only these remain.
                out.append(ReleasedLeases(req.req_id, 0, 0, self._end_reservations(req)))
                if not req.holds_leases():
                    self._forget(req)
                continue
            idle = now - req.renewed_at
            if req.holds_leases():
                if idle <= lease_ttl:
                    continue
                if alive and not req.pins and not req.pending:
                    continue  # only reserved slots under a running copy: wait for its report
                req.finished = True
                out.append(self._release(req, writers_alive=alive))
                self._forced_lease_releases += 1
                if not req.holds_leases():
                    self._forget(req)
            elif idle_ttl is not None and idle > idle_ttl:
                self._forget(req)
        return out

    def release_request(self, req_id: str, *, writers_alive: bool = False) -> ReleasedLeases:
        """Operator action: release every lease of ``req_id`` now and end the request.

        Pins are released and pending stores dropped from the index at once. With
        ``writers_alive=False`` (the engine is gone) their slots are freed and the request is
        forgotten, like a lease expiry. With ``writers_alive=True`` (a copy may still be writing,
        e.g. a transfer job the service itself runs) the slots stay reserved, as after an abort,
        until ``complete_store`` from that request reports them; the request is forgotten then.
        """
        req = self._requests.get(req_id)
        if req is None:
            raise UnknownRequestError(req_id)
        req.finished = True
        released = self._release(req, writers_alive=writers_alive)
        self._forced_lease_releases += 1
        if not req.holds_leases():
            self._forget(req)
        return released

    def _live(self, ctx: ReqContext) -> _Request:
        req = self._requests.get(ctx.req_id)
        if req is None or req.finished:
            raise UnknownRequestError(ctx.req_id)
        req.renewed_at = self._clock()
        return req

    def _any(self, ctx: ReqContext) -> _Request:
        """The request, live or finished-with-leases (``complete_*`` may follow a finish)."""
        req = self._requests.get(ctx.req_id)
        if req is None:
            raise UnknownRequestError(ctx.req_id)
        req.renewed_at = self._clock()
        return req

    def _release(self, req: _Request, *, writers_alive: bool) -> ReleasedLeases:
        refs = self._refs
        pins = 0
        for key, count in req.pins.items():
            left = refs[key] - count
            pins += count
            if left:
                refs[key] = left
            else:
                del refs[key]
        req.pins.clear()
        dropped = list(req.pending)
        self._pending.difference_update(dropped)
        slots = list(map(self._slot.pop, dropped))
        req.pending.clear()
        self._stores_failed += len(dropped)
        ended = 0
        if writers_alive:
            if dropped:
                req.reserved.update(zip(dropped, slots, strict=True))
                self._num_reserved += len(dropped)
                # The writer deadline runs from the latest drop: later slots get their full time.
                req.reserved_at = self._clock()
        else:
            self._push_free(slots)
            if req.reserved:
                ended = self._end_reservations(req)
        return ReleasedLeases(req.req_id, pins, len(dropped), ended)

    def _end_reservations(self, req: _Request) -> int:
        """Free the reserved slots of ``req``'s dropped stores without their writer's report
        (counted in ``reservations_expired``); how many there were."""
        ended = len(req.reserved)
        self._push_free(list(req.reserved.values()))
        self._num_reserved -= ended
        self._reservations_expired += ended
        req.reserved.clear()
        return ended

    def _push_free(self, slots: list[int]) -> None:
        """Return ``slots`` (consumed) to the free stack so that they come off it again in
        ascending order: a run freed in any order (victims come in policy order, often tail
        first) is handed out again as one ascending run. The sort costs one linear pass when
        the slots already form runs, the usual case."""
        slots.sort(reverse=True)
        self._free.extend(slots)

    def _forget(self, req: _Request) -> None:
        """Drop a request record; reorder its blocks tail-before-head if it used several calls."""
        self._requests.pop(req.req_id, None)
        reorder = req.orderings > 1 or self._policy.wants_request_chains
        if reorder or self._chain_listeners:
            chain = list(req.keys)
            if reorder:
                self._policy.request_finished(chain)
            for listener in self._chain_listeners:
                listener(chain)

    def add_chain_listener(self, listener: ChainListener) -> None:
        """Call ``listener(chain)`` with every request's chain (head to tail) when its record
        is dropped (finish with no lease left, lease expiry, release). It must not call back
        into the manager; the shadow evaluator only queues the chain.
        """
        self._chain_listeners.append(listener)

    def add_eviction_listener(self, listener: EvictionListener) -> None:
        """Call ``listener(victims, slots)`` whenever ``prepare_store`` evicts blocks to make
        room, or ``demote`` evicts them, before their slots can be handed out again (a lower tier
        copies their bytes out there: demote on evict). Only those evictions are reported, not
        ``reset``, ``drop`` or failed stores. It must not call back into the manager.
        """
        self._eviction_listeners.append(listener)

    # ------------------------------------------------------------------ lookups and loads

    def lookup(self, keys: Sequence[BlockKey], ctx: ReqContext) -> LookupOutput:
        """Per-key state and the count of leading hits. Changes nothing but statistics."""
        self._live(ctx)
        try:
            resident = list(map(self._slot.__contains__, keys))
        except TypeError:
            raise _bad_key(keys) from None
        n = len(resident)
        found = resident.count(True)
        if found != n:
            _check_keys(keys)  # a batch of resident keys, checked when offered, skips this
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
            raise _bad_key(keys) from None
        except KeyError:
            ready = False
        if not ready:
            _check_keys(keys)  # a missing key may be no key at all
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
            raise _bad_key(keys) from None
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
            _check_keys(keys)  # pinned keys were checked when offered; others may be no keys
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
            raise _bad_key(keys) from None
        if chain:
            # A resident key was checked when offered; the view comparison runs in C and
            # costs less than checking the keys themselves.
            if not self._slot.keys() >= chain.keys():
                _check_keys(keys)
            self._policy.touch(keys)
            if req.keys:
                req.keys.update(chain)
            else:
                req.keys = chain
            req.orderings += 1

    # ------------------------------------------------------------------ stores

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
        slots = self._reserve(req, admitted, chain)
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
            raise _bad_key(keys) from None
        reused = resident.count(True)
        chain = dict.fromkeys(keys)
        if reused == 0:
            # Common case, a new stretch of a prefix: the distinct keys are the new keys, and
            # no resident key needs protecting, so both come without a Python-level loop.
            _check_keys(chain)
            return list(chain), set(), chain, 0
        refs, in_flight = self._refs, self._pending
        fresh = (k for k, r in zip(keys, resident, strict=True) if not r)
        new_keys = list(dict.fromkeys(fresh))
        _check_keys(new_keys)
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
        self, req: _Request, admitted: list[BlockKey], chain: dict[BlockKey, None]
    ) -> list[int]:
        """Give each admitted key a free slot, as a store pending for ``req``; returns the slots.

        There must be at least ``len(admitted)`` free slots. The offer's ``chain`` joins the
        request's chain (the order its blocks are reordered in when the request ends).
        """
        count = len(admitted)
        slots: list[int] = []
        if count:
            # Slots come off the top of the free stack as one reversed slice (top first), not
            # one pop per key.
            free = self._free
            slots = free[: -count - 1 : -1]
            del free[-count:]
            self._slot.update(zip(admitted, slots, strict=True))
            self._pending.update(admitted)
            req.pending.update(admitted)
        if req.keys:
            req.keys.update(chain)
        else:
            req.keys = chain  # a fresh dict nobody else holds: adopted instead of copied
        return slots

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
            raise _bad_key(keys) from None
        fast = len(unique) == len(keys) and pending.issuperset(unique)
        if fast:
            mine = list(keys)
            pending.difference_update(mine)
        else:
            _check_keys(keys)  # keys in flight were checked when offered; others may not be
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

    # ------------------------------------------------------------------ events

    def _next_seq(self) -> int:
        self._event_seq += 1
        return self._event_seq

    def _emit(self, event: KVEvent) -> None:
        if not self._enable_events:
            return
        if len(self._events) == self._events.maxlen:
            self._events_dropped += 1
        self._events.append(event)

    def _emit_removed(self, keys: list[BlockKey]) -> None:
        if keys:
            self._emit(BlockRemoved(self._next_seq(), keys))

    def take_events(self) -> list[KVEvent]:
        """Every event since the last call, oldest first; each event is returned once.

        Events carry increasing ``seq`` numbers; a gap means the bounded buffer overflowed
        (also counted in ``stats().events_dropped``).
        """
        events = list(self._events)
        self._events.clear()
        return events

    # ------------------------------------------------------------------ policy and admin

    @property
    def policy(self) -> PolicyInfo:
        """The active policy."""
        p = self._policy
        return PolicyInfo(p.name, dict(p.params), self._generation)

    def switch_policy(self, name: str, params: Mapping[str, Any] | None = None) -> PolicySwitch:
        """Replace the eviction policy live.

        The new policy is built from the resident ready blocks, coldest first (retained ones stay
        out of it until released); slots, ref counts, pending stores, readiness and retentions
        are untouched. The same name with the same parameters is a
        no-op (``changed`` false, generation kept). An unknown name or bad parameters raise a
        ``PolicyError`` and change nothing.
        """
        previous = self.policy
        name = canonical_policy_name(name)
        parsed = policy_class(name).parse_params(dict(params or {}))
        if name == previous.name and parsed == previous.params:
            return PolicySwitch(previous, previous, 0, changed=False)
        new_policy = create_policy(name, self.num_blocks, parsed)
        migrated = new_policy.rebuild(self._policy.coldest_first())
        ready = len(self._slot) - len(self._pending) - len(self._kept)
        if migrated != len(self._policy) or migrated != ready:
            raise AssertionError(f"policy rebuild migrated {migrated} of {ready} ready blocks")
        self._policy = new_policy
        self._generation += 1
        self._policy_switches += 1
        return PolicySwitch(previous, self.policy, migrated, changed=True)

    def reset(self) -> ResetCounts:
        """Drop every ready block that no request has pinned and no retention names.

        Pinned blocks (a load may be reading them), retained blocks and pending stores (a copy
        may be writing them) are kept. Emits ``AllBlocksCleared`` when no ready block remains,
        else a ``BlockRemoved`` listing the dropped keys.
        """
        refs = self._refs
        in_flight = self._pending
        slot_of = self._slot
        kept = self._kept
        victims = [k for k in slot_of if k not in refs and k not in in_flight and k not in kept]
        self._push_free(list(map(slot_of.pop, victims)))
        self._policy.remove(victims)
        if len(slot_of) == len(in_flight):  # no ready block left
            self._emit(AllBlocksCleared(self._next_seq()))
        else:
            self._emit_removed(victims)
        return ResetCounts(
            dropped=len(victims),
            kept_pinned=len(refs),
            kept_pending=len(in_flight) + self._num_reserved,
            kept_retained=sum(1 for k in kept if k not in refs),
        )

    # ------------------------------------------------------------------ retentions and hints

    def _admit(self, keys: list[BlockKey]) -> None:
        """``keys`` just became ready: into the policy, except the retained ones, kept out."""
        retained = self._retained
        if retained and not retained.keys().isdisjoint(keys):
            self._kept.update(k for k in keys if k in retained)
            keys = [k for k in keys if k not in retained]
        self._policy.insert(keys)

    def retain(self, keys: Sequence[BlockKey], ttl_s: float, name: str) -> RetentionInfo:
        """Keep ``keys`` in the pool against eviction for ``ttl_s`` seconds, as retention
        ``name`` (``manager.retention``: a taken name gets the keys it lacks and its TTL
        restarted). A retained key that is ready is never evicted, by a store or a
        promotion, until the last retention naming it ends; one that is not resident yet is
        kept from the moment it becomes ready. Retaining makes no room: when the pool is full
        of pinned and retained blocks, ``prepare_store`` refuses as it does for pins.
        ``InvalidArgumentError`` for a bad key, name or TTL; nothing changes then."""
        _check_keys(keys)
        added = self._retentions.add(name, keys, ttl_s, self._clock())
        if added.created:
            self._retentions_started += 1
        slot_of, in_flight = self._slot, self._pending
        ready = [k for k in added.newly_retained if k in slot_of and k not in in_flight]
        if ready:
            self._policy.remove(ready)
            self._kept.update(ready)
        return self._retention_info(name, added=len(added.added), created=added.created)

    def renew_retention(self, name: str, ttl_s: float) -> RetentionInfo:
        """Restart retention ``name``'s TTL (``UnknownRetentionError`` if there is none)."""
        self._retentions.renew(name, ttl_s, self._clock())
        return self._retention_info(name)

    def release_retention(self, name: str) -> RetentionInfo:
        """End retention ``name`` now; what it was. Its keys no other retention names go back
        to the policy (head hotter than tail), evictable again."""
        info = self._retention_info(name)
        self._end_retention(name)
        self._retentions_released += 1
        return info

    def expire_retentions(self) -> list[RetentionInfo]:
        """End every retention whose TTL has passed (by the injected clock); what they were."""
        now = self._clock()
        out = []
        for name in self._retentions.due(now):
            out.append(self._retention_info(name))
            self._end_retention(name)
        self._retentions_expired += len(out)
        return out

    def retentions(self) -> list[RetentionInfo]:
        """Every live retention, oldest first."""
        return [self._retention_info(n) for n in self._retentions.names()]

    def retention(self, name: str) -> RetentionInfo:
        """Retention ``name`` now (``UnknownRetentionError`` if there is none)."""
        return self._retention_info(name)

    def retention_keys(self, name: str) -> list[BlockKey]:
        """The keys retention ``name`` names, head to tail."""
        return self._retentions.keys_of(name)

    def new_retained(self, name: str, keys: Sequence[BlockKey]) -> int:
        """How many distinct keys of ``keys`` no retention names yet: how much retaining
        them would add to ``stats().retained`` (a quota's measure); changes nothing."""
        return self._retentions.new_keys(name, keys)

    def retained_where(self) -> tuple[int, int, list[BlockKey]]:
        """Where the retained keys are: how many are ready in the pool, how many pending
        there, and the keys not in the pool (one pass over the retained keys)."""
        slot_of, in_flight = self._slot, self._pending
        absent: list[BlockKey] = []
        pending = 0
        for key in self._retained:
            if key not in slot_of:
                absent.append(key)
            elif key in in_flight:
                pending += 1
        return len(self._kept), pending, absent

    def is_retained(self, key: BlockKey) -> bool:
        """Whether a live retention names ``key``."""
        return key in self._retained

    @property
    def num_retained(self) -> int:
        """How many distinct keys live retentions name (``stats().retained``)."""
        return len(self._retained)

    @property
    def num_retentions(self) -> int:
        """How many retentions are live (``stats().retentions``)."""
        return len(self._retentions)

    def has_retention(self, name: str) -> bool:
        """Whether retention ``name`` is live."""
        return name in self._retentions

    def _retention_info(self, name: str, *, added: int = 0, created: bool = False) -> RetentionInfo:
        kept = self._kept
        keys = self._retentions.keys_of(name) if kept else ()
        in_pool = sum(map(kept.__contains__, keys))
        return self._retentions.info(name, self._clock(), in_pool, added=added, created=created)

    def _end_retention(self, name: str) -> None:
        freed = self._retentions.remove(name)
        kept = self._kept
        back = [k for k in freed if k in kept]
        if back:
            kept.difference_update(back)
            self._policy.insert(back)

    def demote(self, keys: Sequence[BlockKey]) -> list[BlockKey]:
        """Evict the ready blocks among ``keys`` that nothing pins and no retention names, now,
        as the policy would (the eviction listeners copy them down: a lower tier takes them);
        the keys evicted, reported as one ``BlockRemoved`` event. Others are left as they are.
        """
        _check_keys(keys)
        refs, in_flight, slot_of, kept = self._refs, self._pending, self._slot, self._kept
        victims = [
            k
            for k in dict.fromkeys(keys)
            if k in slot_of and k not in refs and k not in in_flight and k not in kept
        ]
        if victims:
            self._policy.remove(victims)
            freed = list(map(slot_of.pop, victims))
            for listener in self._eviction_listeners:
                listener(victims, freed)
            self._push_free(freed)
            self._demoted += len(victims)
            self._emit_removed(victims)
        return victims

    # ------------------------------------------------------------------ introspection

    def stats(self) -> ManagerStats:
        """Current gauges and counters."""
        ready = len(self._slot) - len(self._pending)
        return ManagerStats(
            num_blocks=self.num_blocks,
            free=len(self._free),
            pending=len(self._pending) + self._num_reserved,
            ready=ready,
            pinned=len(self._refs),
            reserved=self._num_reserved,
            live_requests=len(self._requests),
            policy=self._policy.name,
            lookup_hit=self._lookup_hit,
            lookup_pending=self._lookup_pending,
            lookup_miss=self._lookup_miss,
            loads=self._loads,
            stores_prepared=self._stores_prepared,
            stores_completed=self._stores_completed,
            stores_failed=self._stores_failed,
            stores_reused=self._stores_reused,
            stores_skipped=self._stores_skipped,
            stores_refused=self._stores_refused,
            evictions=self._evictions,
            evictions_by_policy=dict(self._evictions_by_policy),
            forced_lease_releases=self._forced_lease_releases,
            reservations_expired=self._reservations_expired,
            policy_switches=self._policy_switches,
            events_dropped=self._events_dropped,
            retentions=len(self._retentions),
            retained=len(self._retained),
            retained_ready=len(self._kept),
            retentions_started=self._retentions_started,
            retentions_expired=self._retentions_expired,
            retentions_released=self._retentions_released,
            demoted=self._demoted,
        )

    def requests(self) -> list[RequestLeases]:
        """Every request the manager tracks (live, or finished with leases), with its leases."""
        now = self._clock()
        return [
            RequestLeases(
                req_id=r.req_id,
                pins=dict(r.pins),
                pending_stores=sorted(r.pending) + sorted(r.reserved),
                idle_seconds=max(0.0, now - r.renewed_at),
                reserved_stores=sorted(r.reserved),
                reserved_seconds=max(0.0, now - r.reserved_at) if r.reserved else None,
            )
            for r in self._requests.values()
        ]

    # ------------------------------------------------------------------ holds

    def hold(self, keys: Sequence[BlockKey]) -> list[int | None]:
        """Pin the ready keys among ``keys`` for the caller itself, outside any request; their
        slots (``None`` for a key not ready, which is not held), in order.

        For a reader of the pool that is not an engine request (the remote tier's
        write-behind): a held block is not evicted, cleared or expired, its slot not reused,
        until ``release_hold``. Holds count in ``pinned`` but not in ``loads``, never touch the
        policy's order and belong to no request (nothing expires them: the caller must release
        every hold it takes).
        """
        _check_keys(keys)
        slot_of, in_flight, refs, held = self._slot, self._pending, self._refs, self._held
        out: list[int | None] = []
        for key in keys:
            slot = slot_of.get(key)
            if slot is None or key in in_flight:
                out.append(None)
                continue
            refs[key] = refs.get(key, 0) + 1
            held[key] += 1
            out.append(slot)
        return out

    def release_hold(self, keys: Sequence[BlockKey]) -> None:
        """Undo one ``hold`` of each key (keys not held are ignored)."""
        refs, held = self._refs, self._held
        for key in keys:
            if held.get(key, 0) <= 0:
                continue
            held[key] -= 1
            if not held[key]:
                del held[key]
            left = refs[key] - 1
            if left:
                refs[key] = left
            else:
                del refs[key]

    def restore(self, blocks: Sequence[tuple[BlockKey, int]]) -> int:
        """Adopt ready blocks at the given slots, coldest first (a tier rebuilding its index
        after a restart); how many were adopted.

        Each slot must be free and each key absent, else ``InvalidArgumentError`` and nothing
        changes. No event is emitted (the blocks were reported when first stored).
        """
        keys = [k for k, _ in blocks]
        _check_keys(keys)
        slots = [s for _, s in blocks]
        free = set(self._free)
        bad = [s for s in slots if type(s) is not int or s not in free]
        if bad or len(set(slots)) != len(slots):
            raise InvalidArgumentError(f"restore needs distinct free slots; not free: {bad[:4]}")
        if len(set(keys)) != len(keys) or any(k in self._slot for k in keys):
            raise InvalidArgumentError("restore needs distinct keys that are not resident")
        taken = set(slots)
        self._free = [s for s in self._free if s not in taken]
        self._slot.update(blocks)
        self._admit(keys)
        return len(keys)

    def drop(self, keys: Sequence[BlockKey]) -> list[BlockKey]:
        """Remove the ready, unpinned blocks among ``keys`` (found unusable, e.g. corrupt);
        the ones removed, reported as one ``BlockRemoved`` event. Others are left as they are.
        """
        _check_keys(keys)
        refs, in_flight, slot_of = self._refs, self._pending, self._slot
        gone = [
            k for k in dict.fromkeys(keys) if k in slot_of and k not in refs and k not in in_flight
        ]
        if gone:
            self._push_free(list(map(slot_of.pop, gone)))
            kept = self._kept
            if kept and not kept.isdisjoint(gone):
                kept.difference_update(gone)
                self._policy.remove([k for k in gone if k not in self._retained])
            else:
                self._policy.remove(gone)
            self._emit_removed(gone)
        return gone

    def is_ready(self, key: BlockKey) -> bool:
        """Whether ``key`` is stored and ready (no statistics counted)."""
        return key in self._slot and key not in self._pending

    def record_event(self, kind: str, keys: list[BlockKey], medium: str) -> None:
        """Add a KV event about another medium (``kind``: ``stored`` or ``removed``) to the
        manager's numbered stream, so routers read every tier's events in one order."""
        if kind == "stored":
            self._emit(BlockStored(self._next_seq(), keys, medium))
        elif kind == "removed":
            self._emit(BlockRemoved(self._next_seq(), keys, medium))
        else:
            raise InvalidArgumentError(f"event kind must be stored or removed, got {kind!r}")

    def new_pins(self, keys: Iterable[BlockKey]) -> int:
        """How many distinct blocks of ``keys`` no request holds pinned: how much a
        ``prepare_load`` of them would add to ``num_pinned`` (a block pinned already, by any
        request, counts once there). ``InvalidArgumentError`` for a key that is no key."""
        refs = self._refs
        try:
            distinct = set(keys)
        except TypeError:
            raise _bad_key(keys) from None
        return len(distinct) if not refs else len(distinct - refs.keys())

    @property
    def num_pinned(self) -> int:
        """How many distinct blocks some request has pinned (``stats().pinned``, without
        building the stats)."""
        return len(self._refs)

    @property
    def request_ids(self) -> Collection[str]:
        """The ids of the tracked requests (a live view: do not keep it across calls)."""
        return self._requests.keys()

    @property
    def num_requests(self) -> int:
        """How many requests are tracked: live, or finished and still holding leases."""
        return len(self._requests)

    def slot_of(self, key: BlockKey) -> int | None:
        """Host slot of a resident (ready or pending) key, or None."""
        return self._slot.get(key)

    def ref_count(self, key: BlockKey) -> int:
        """Ref count of a resident key (0 when not resident)."""
        return self._refs.get(key, 0)

    def resident_keys(self) -> list[BlockKey]:
        """Every ready key, the policy's next victim first (retained ones, which are no
        victims while retained, last)."""
        return [*self._policy.coldest_first(), *self._kept]


def create_manager(
    num_blocks: int,
    policy: str = "lru",
    store_threshold: int = 0,
    *,
    policy_params: Mapping[str, Any] | None = None,
    reuse_tracker_size: int | None = None,
    clock: Clock = time.monotonic,
    enable_events: bool = True,
    max_events: int = DEFAULT_MAX_EVENTS,
) -> OffloadManager:
    """Build an ``OffloadManager`` for a pool of ``num_blocks`` slots.

    ``store_threshold >= 2`` turns on the reuse filter (a new key is admitted on its N-th
    offer); ``clock`` is the only time source the manager reads.
    """
    return OffloadManager(
        num_blocks,
        policy,
        policy_params,
        store_threshold,
        reuse_tracker_size=reuse_tracker_size,
        clock=clock,
        enable_events=enable_events,
        max_events=max_events,
    )
