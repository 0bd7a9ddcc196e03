"""The offload manager's state, and its slots and pins: the room every other room stands on.

``PoolState`` holds every table and counter ``OffloadManager`` keeps (its ``__init__`` is the
manager's) and the methods over slots and pins alone: the free stack, holds taken outside
requests, adopting and asking about resident blocks. ``RequestRecord`` is one request's
accounting (its leases), kept here because the state's request table holds them. The other rooms
(``manager.events``, ``manager.requests``, ``manager.switch``, ``manager.loads``,
``manager.stores``, ``manager.retaining``) subclass it; ``manager.core`` assembles them and states
the contract.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any

from manager.errors import InvalidArgumentError
from manager.policies import EvictionPolicy, create_policy
from manager.retention import RetentionTable
from manager.reuse import ReuseFilter
from manager.spec import MAX_KEY_BYTES, BlockKey, KVEvent, ReqContext

Clock = Callable[[], float]
_ONLY_BYTES = frozenset({bytes})
_KEY_SIZES = frozenset(range(1, MAX_KEY_BYTES + 1))
ChainListener = Callable[[list[BlockKey]], None]
#: ``listener(victims, slots)``: blocks evicted to make room, with the slots they held. Called
#: before any of those slots is handed out again, so the listener may still read their bytes.
EvictionListener = Callable[[list[BlockKey], list[int]], None]
DEFAULT_MAX_EVENTS = 1_000_000


def check_keys(keys: Collection[BlockKey]) -> None:
    """Raise ``InvalidArgumentError`` unless every key is ``bytes`` of 1..``MAX_KEY_BYTES``.

    Two C-level passes, about 30 ns a key: every type must be in a set holding only ``bytes``
    (exactly ``bytes``, not a subclass or another hashable buffer such as a ``memoryview``,
    which would compare equal to a key), then every length in the set of valid lengths. The
    Python loop that names the culprit runs only on failure.
    """
    if not (_ONLY_BYTES.issuperset(map(type, keys)) and _KEY_SIZES.issuperset(map(len, keys))):
        raise bad_key(keys)


def bad_key(keys: Iterable[object]) -> InvalidArgumentError:
    """The error for a batch holding something that is not a key (wrong type or size, or
    unhashable); it shows the first such."""
    bad = next((k for k in keys if type(k) is not bytes or not 0 < len(k) <= MAX_KEY_BYTES), None)
    return InvalidArgumentError(f"keys must be 1..{MAX_KEY_BYTES} bytes, got {bad!r:.80}")


class RequestRecord:
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


class PoolState:
    """The manager's tables and counters, and its slot and pin methods (``manager.core``)."""

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
        self._retained = self._retentions.ids
        self._kept: set[BlockKey] = set()
        # Free slots as a stack whose top is the end of the list, read top-down when handing
        # out: stored descending, a fresh pool hands out 0, 1, 2, ... so a batch gets one
        # ascending run, which the transfer backends copy as one piece (``_push_free``).
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._num_reserved = 0
        self._requests: dict[str, RequestRecord] = {}
        self._chain_listeners: list[ChainListener] = []
        self._eviction_listeners: list[EvictionListener] = []

        self._enable_events = enable_events
        self._events: deque[KVEvent] = deque(maxlen=max_events)
        self._event_sink: Callable[[], None] | None = None
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

    # ------------------------------------------------------------------ slots and pins

    def _push_free(self, slots: list[int]) -> None:
        """Return ``slots`` (consumed) to the free stack so that they come off it again in
        ascending order: a run freed in any order (victims come in policy order, often tail
        first) is handed out again as one ascending run. The sort costs one linear pass when
        the slots already form runs, the usual case."""
        slots.sort(reverse=True)
        self._free.extend(slots)

    def _admit(self, keys: list[BlockKey]) -> None:
        """``keys`` just became ready: into the policy, except the retained ones, kept out."""
        retained = self._retained
        if retained and not retained.keys().isdisjoint(keys):
            self._kept.update(k for k in keys if k in retained)
            keys = [k for k in keys if k not in retained]
        self._policy.insert(keys)

    def hold(self, keys: Sequence[BlockKey]) -> list[int | None]:
        """Pin the ready keys among ``keys`` for the caller itself, outside any request; their
        slots (``None`` for a key not ready, which is not held), in order.

        For a reader of the pool that is not an engine request (the remote tier's
        write-behind): a held block is not evicted, cleared or expired, its slot not reused,
        until ``release_hold``. Holds count in ``pinned`` but not in ``loads``, never touch the
        policy's order and belong to no request (nothing expires them: the caller must release
        every hold it takes).
        """
        check_keys(keys)
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
        check_keys(keys)
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

    def is_ready(self, key: BlockKey) -> bool:
        """Whether ``key`` is stored and ready (no statistics counted)."""
        return key in self._slot and key not in self._pending

    def new_pins(self, keys: Iterable[BlockKey]) -> int:
        """How many distinct blocks of ``keys`` no request holds pinned: how much a
        ``prepare_load`` of them would add to ``num_pinned`` (a block pinned already, by any
        request, counts once there). ``InvalidArgumentError`` for a key that is no key."""
        refs = self._refs
        try:
            distinct = set(keys)
        except TypeError:
            raise bad_key(keys) from None
        return len(distinct) if not refs else len(distinct - refs.keys())

    @property
    def num_pinned(self) -> int:
        """How many distinct blocks some request has pinned (``stats().pinned``, without
        building the stats)."""
        return len(self._refs)

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
