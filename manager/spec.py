"""Data the manager hands out: request context, lookup results, store specs, events, stats.

These are the seam between the parts: ``app/`` serialises them, ``transfer/`` executes the slot
lists they carry. They are plain dataclasses (or enums) with no behaviour, to be treated as
read-only. Those built on every hot call (lookup, store, finish results and the store events) are
``slots=True`` without ``frozen``: a frozen dataclass's ``__init__`` sets each field through
``object.__setattr__`` and costs about three times as much, a measurable share of a 16-key
lookup. The rest are frozen.

Keys are opaque block hashes: ``bytes`` of 1..64 bytes (hex strings on the wire). A *slot* is an
index into the host pool, ``0 <= slot < num_blocks``.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

BlockKey = bytes
MAX_KEY_BYTES = 64
MEDIUM = "CPU"
#: The medium of KV events about the remote tier (a block stored there, or gone from it).
REMOTE_MEDIUM = "REMOTE"
#: The medium of KV events about the disk tier (a block demoted to it, or evicted from it).
DISK_MEDIUM = "DISK"


@dataclass(frozen=True, slots=True)
class ReqContext:
    """Per-request context carried by every manager call.

    ``req_id`` names the engine request (required, non-empty); ``kv_transfer_params`` is the
    engine's opaque per-request parameter dict (vLLM's ``kv_transfer_params``).
    """

    req_id: str
    kv_transfer_params: Mapping[str, Any] | None = None


class LookupResult(enum.Enum):
    """State of one key as seen by ``lookup``."""

    HIT = "hit"  # stored and ready: loadable now
    PENDING = "pending"  # a store is in flight
    MISS = "miss"  # not stored
    # Not in the pool but in the service's remote tier (the service says so, never the
    # manager): a prepare-load brings it in, PENDING until it is ready.
    REMOTE = "remote"
    # Not in the pool but on the node's disk tier (the service says so, from its in-memory
    # disk index): a prepare-load or onload brings it in, PENDING until it is ready.
    DISK = "disk"

    # Members are singletons compared by identity, so the identity hash agrees with equality;
    # Enum's own __hash__ is Python code, and callers map every key's result through dicts.
    __hash__ = object.__hash__


@dataclass(slots=True)
class LookupOutput:
    """Per-key results of ``lookup`` plus ``hit_prefix``, the count of leading ``HIT`` keys."""

    results: list[LookupResult]
    hit_prefix: int


@dataclass(slots=True)
class PrepareStoreOutput:
    """What the caller must copy for a successful ``prepare_store``.

    ``keys_to_store[i]`` goes to host slot ``slots[i]``. ``evicted_keys`` were dropped to make
    room (their slots may be among ``slots``). ``skipped_keys`` were offered but not admitted by
    the reuse filter; offered keys that were already resident appear in none of the lists.
    """

    keys_to_store: list[BlockKey]
    slots: list[int]
    evicted_keys: list[BlockKey]
    skipped_keys: list[BlockKey] = field(default_factory=list)


@dataclass(slots=True)
class CompleteStoreOutput:
    """Outcome of ``complete_store`` per key.

    ``completed``: became ready. ``dropped``: failed store, block freed. ``ignored``: not a store
    this request has in flight (already ready, unknown, or reserved by another request); the
    call leaves those keys untouched, so a retried ``complete_store`` is a no-op.
    """

    completed: list[BlockKey]
    dropped: list[BlockKey]
    ignored: list[BlockKey]


@dataclass(slots=True)
class BlockStored:
    """KV event: blocks became loadable (vLLM ``BlockStored`` shape, medium ``CPU``)."""

    seq: int
    block_hashes: list[BlockKey]
    medium: str = MEDIUM


@dataclass(slots=True)
class BlockRemoved:
    """KV event: blocks that were reported stored are gone (evicted, cleared, expired)."""

    seq: int
    block_hashes: list[BlockKey]
    medium: str = MEDIUM


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """KV event: every block of this medium is gone."""

    seq: int
    medium: str = MEDIUM


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class ResetCounts:
    """Result of ``reset``: blocks dropped and blocks kept because a transfer holds them."""

    dropped: int
    kept_pinned: int
    kept_pending: int
    kept_retained: int = 0


@dataclass(slots=True)
class ReleasedLeases:
    """Pins and pending stores released from one request (abort or lease expiry), and the
    reserved slots of its earlier dropped stores freed without their writer's report."""

    req_id: str
    pins_released: int
    stores_dropped: int
    reservations_ended: int = 0


@dataclass(frozen=True, slots=True)
class PolicyInfo:
    """The active eviction policy; ``generation`` increases on every effective switch."""

    name: str
    params: dict[str, Any]
    generation: int


@dataclass(frozen=True, slots=True)
class PolicySwitch:
    """Result of ``switch_policy``. ``changed`` is false for a same-policy, same-params call."""

    previous: PolicyInfo
    current: PolicyInfo
    blocks_migrated: int
    changed: bool


@dataclass(frozen=True, slots=True)
class RequestLeases:
    """What one live request holds: pin counts per key, keys whose store it has in flight.

    ``reserved_stores`` (a subset of ``pending_stores``): stores dropped by an abort or a
    release whose slot stays reserved until the writer reports or its deadline passes
    (orphaned reservations); ``reserved_seconds``: time since they were dropped (None when
    there are none).
    """

    req_id: str
    pins: dict[BlockKey, int]
    pending_stores: list[BlockKey]
    idle_seconds: float
    reserved_stores: list[BlockKey] = field(default_factory=list)
    reserved_seconds: float | None = None


@dataclass(frozen=True, slots=True)
class ManagerStats:
    """Gauges and counters the service exports.

    Blocks: ``free + pending + ready == num_blocks``; ``pinned`` counts ready blocks with a
    ref count above zero (a subset of ``ready``); ``reserved`` counts the slots of dropped
    stores still reserved for a writer that has not reported (a subset of ``pending``).
    Counters are totals since creation; key counters count keys, not calls.
    ``evictions_by_policy`` splits ``evictions`` by the policy that chose the victims;
    ``reservations_expired`` counts reserved slots freed without their writer's report.
    """

    num_blocks: int
    free: int
    pending: int
    ready: int
    pinned: int
    reserved: int
    live_requests: int
    policy: str
    lookup_hit: int
    lookup_pending: int
    lookup_miss: int
    loads: int
    stores_prepared: int
    stores_completed: int
    stores_failed: int
    stores_reused: int
    stores_skipped: int
    stores_refused: int
    evictions: int
    evictions_by_policy: dict[str, int]
    forced_lease_releases: int
    reservations_expired: int
    policy_switches: int
    events_dropped: int
    retentions: int = 0
    retained: int = 0
    retained_ready: int = 0
    retentions_started: int = 0
    retentions_expired: int = 0
    retentions_released: int = 0
    demoted: int = 0


@dataclass(frozen=True, slots=True)
class RetentionInfo:
    """One retention (``OffloadManager.retain``): its name, how many keys it names and how many
    of them are ready in the pool now, the TTL it was last given, the seconds left before it
    expires, its age, and how many keys the call that returned it added (and whether it created
    the retention)."""

    name: str
    keys: int
    in_pool: int
    ttl_s: float
    expires_in_s: float
    age_s: float
    added: int = 0
    created: bool = False
