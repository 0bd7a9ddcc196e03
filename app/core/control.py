"""Cache control: what callers that know what comes next can tell one namespace's service.

Four verbs, each a hint about the future from an engine, an agent framework or a router:

- **retain** (``retain``, ``renew``, ``release``, ``retentions``): keep keys in the pool against
  eviction until a TTL ends, as a named retention (a session id; by default the caller's
  request id). The manager keeps the retained ready blocks out of eviction
  (``OffloadManager.retain``); the keys a tier below the pool holds are promoted at once and kept
  from the moment they land. Every key must be held somewhere (the pool, ready or pending, or a
  tier below it): a key held nowhere is ``UnknownKeysError`` and nothing changes. Bounded per
  namespace: distinct retained blocks (``max_retained_blocks``, a tenants-file namespace key, by
  default half the pool), live retentions (``max_retentions``), keys named by retentions summed
  over them (``max_retention_keys``: what their memory grows with, a few bytes a key) and the
  TTL (``retain_max_ttl_s``). The lease sweeper ends expired retentions (``expire``). A retention
  never makes room: a pool full of pinned and retained blocks refuses stores (507) as it does
  today. Retentions live in memory: a restart drops them.
- **prefetch** (``prefetch``, ``prefetch_state``, ``wait``, ``cancel``): start bringing keys
  that lie below the pool into it, and hold what lands, and what the pool already has, until a
  load pins it or the deadline passes. Held blocks are pinned, so a prefetch never evicts a
  pinned, retained or held block to make its room (the manager never does). Bounded per
  namespace: keys promoting or held at once (``prefetch_max_keys``) and the deadline
  (``prefetch_max_deadline_s``). Each key is counted once as it ends: ``used`` (a load pinned
  it while held), ``wasted`` (deadline or cancel first), ``failed`` (the tier's read failed).
- **demote**: evict chosen blocks now, as the policy would, so the tiers below take them
  (``NoLowerTierError`` without one); pinned, retained and pending blocks stay, and so do
  blocks no tier below holds or takes (``refused``: never reported moved, never lost).
- **drop**: remove chosen blocks from the pool now (this namespace's pool only); pinned,
  retained and pending blocks stay. Copies in the tiers below stay until their own bounds evict
  them.

Every verb runs on the event loop; the only ``await`` is the one question to the tiers below
(``TierChain.found``), after which every check and change happens in one step, so a refusal
changes nothing. Each verb's call is counted for its request id (``Observer.op``, or
``Observer.failed`` when it raises: ``app.core.observed.observed``, as the manager's are by
``ObservedManager``); the rest of the telemetry is ``metric_families`` (read at scrape time).

``Control`` is the facade the service and the HTTP layer call; the verbs live in rooms over one
``ControlShared`` (``app.core.control_shared``: the manager, tiers, counts, promotions):
``Retentions`` (``app.core.retentions``), ``Prefetches`` (``app.core.prefetches``) and
``CacheHints`` (``app.core.cache_hints``). This module re-exports the names callers import.
"""

from __future__ import annotations

from collections.abc import Generator, Iterator, Sequence

from prometheus_client.metrics_core import Metric

from app.core.cache_hints import CacheHints, Hinted
from app.core.control_shared import HIT, MISS, PENDING, REFUSED, ControlShared
from app.core.prefetches import (
    FINISHED_PREFETCHES_KEPT,
    PREFETCH_COUNTS,
    WON_BUCKETS,
    Prefetch,
    Prefetches,
)
from app.core.retentions import RETRY_KEYS, Retained, Retentions
from app.core.slices import StepRunner, all_at_once
from manager import BlockKey, RetentionInfo

__all__ = [
    "FINISHED_PREFETCHES_KEPT",
    "HIT",
    "MISS",
    "PENDING",
    "PREFETCH_COUNTS",
    "REFUSED",
    "RETRY_KEYS",
    "WON_BUCKETS",
    "Control",
    "Hinted",
    "Prefetch",
    "Retained",
]


class Control:
    """Cache control of one namespace's service; see the module docstring. Each verb is its
    room's; this class composes them and answers what spans them (``state``, the metrics)."""

    def __init__(self, shared: ControlShared) -> None:
        """Cache control over ``shared`` (the namespace's settings, manager, tiers, observer
        and clock, which every room reads)."""
        self.shared = shared
        self.settings = shared.settings
        self.observer = shared.observer
        self.manager = shared.manager
        self.tiers = shared.tiers
        self.namespace = shared.namespace
        self.counts = self.shared.counts
        self.retaining = Retentions(self.shared)
        self.prefetching = Prefetches(self.shared)
        self.hints = CacheHints(self.shared)

    @property
    def max_retained(self) -> int:
        """The namespace's bound of distinct retained blocks (a tenants-file reload sets it)."""
        return self.retaining.max_retained

    @max_retained.setter
    def max_retained(self, value: int) -> None:
        self.retaining.max_retained = value

    @property
    def max_prefetch_keys(self) -> int:
        """The namespace's bound of keys promoting or held by prefetches at once."""
        return self.prefetching.max_prefetch_keys

    def now(self) -> float:
        """The clock deadlines are read against."""
        return self.shared.clock()

    # ------------------------------------------------------------------ retain

    async def retain(
        self,
        keys: Sequence[BlockKey],
        ttl_s: float,
        name: str,
        req_id: str,
        run: StepRunner = all_at_once,
    ) -> Retained:
        """``Retentions.retain``: retain ``keys`` for ``ttl_s`` as retention ``name``, ``run``
        driving its steps."""
        return await self.retaining.retain(keys, ttl_s, name, req_id, run)

    def renew(self, name: str, ttl_s: float) -> RetentionInfo:
        """Restart retention ``name``'s TTL."""
        return self.retaining.renew(name, ttl_s)

    async def release(self, name: str, run: StepRunner = all_at_once) -> RetentionInfo:
        """End retention ``name`` now, ``run`` driving the steps; what it was."""
        return await self.retaining.release(name, run)

    def retentions(self) -> list[RetentionInfo]:
        """The namespace's live retentions, oldest first."""
        return self.retaining.retentions()

    def get(self, name: str) -> RetentionInfo:
        """Retention ``name`` now."""
        return self.retaining.get(name)

    async def expire(self, run: StepRunner = all_at_once) -> list[RetentionInfo]:
        """``Retentions.expire``: end the retentions whose TTL passed, retry keys below (the
        lease sweeper calls this every round), ``run`` driving the steps."""
        return await self.retaining.expire(run)

    def retained_by_tier(self) -> dict[str, int]:
        """``Retentions.retained_by_tier``: retained blocks by where they are."""
        return self.retaining.retained_by_tier()

    # ------------------------------------------------------------------ prefetch

    def check_deadline(self, deadline_s: float) -> float:
        """``deadline_s`` as a float; ``InvalidArgumentError`` unless 0 < it <= the bound."""
        return self.prefetching.check_deadline(deadline_s)

    async def prefetch(
        self, keys: Sequence[BlockKey], deadline_s: float, req_id: str
    ) -> tuple[Prefetch, list[str]]:
        """``Prefetches.prefetch``: the prefetch started, and each key's state then."""
        return await self.prefetching.prefetch(keys, deadline_s, req_id)

    def prefetch_found(
        self, found: dict[BlockKey, str], deadline_s: float, req_id: str
    ) -> Prefetch | None:
        """``Prefetches.prefetch_found``: a lookup's prefetch of the keys it found below."""
        return self.prefetching.prefetch_found(found, deadline_s, req_id)

    def loaded(self, keys: Sequence[BlockKey]) -> None:
        """A load pinned ``keys`` (``ObservedManager.load_listeners``): ``Prefetches.loaded``."""
        self.prefetching.loaded(keys)

    def cancel(self, prefetch_id: int) -> Prefetch:
        """``Prefetches.cancel``: cancel prefetch ``prefetch_id``."""
        return self.prefetching.cancel(prefetch_id)

    def prefetch_state(self, prefetch_id: int) -> Prefetch:
        """Prefetch ``prefetch_id``, live or recently finished."""
        return self.prefetching.prefetch_state(prefetch_id)

    async def wait(self, prefetch_id: int, timeout_s: float) -> Prefetch:
        """Prefetch ``prefetch_id`` once its reads settled, or after ``timeout_s``."""
        return await self.prefetching.wait(prefetch_id, timeout_s)

    # ------------------------------------------------------------------ demote and drop

    def demote(self, keys: Sequence[BlockKey], req_id: str) -> Hinted:
        """``CacheHints.demote``: evict the movable ``keys`` into the tiers below now."""
        return self.hints.demote(keys, req_id)

    def drop(self, keys: Sequence[BlockKey], req_id: str) -> Hinted:
        """``CacheHints.drop``: remove the movable ``keys`` from the pool now."""
        return self.hints.drop(keys, req_id)

    def demote_steps(self, keys: Sequence[BlockKey], req_id: str) -> Generator[None, None, Hinted]:
        """``CacheHints.demote_steps``: ``demote`` in steps."""
        return self.hints.demote_steps(keys, req_id)

    def drop_steps(self, keys: Sequence[BlockKey], req_id: str) -> Generator[None, None, Hinted]:
        """``CacheHints.drop_steps``: ``drop`` in steps."""
        return self.hints.drop_steps(keys, req_id)

    # ------------------------------------------------------------------ lifecycle, telemetry

    def close(self) -> None:
        """Release every prefetch hold (the service stops; retentions die with the pool)."""
        self.prefetching.close()

    def state(self) -> dict[str, object]:
        """What ``/admin/v1/stats`` says about cache control."""
        st = self.manager.stats()
        return {
            "retentions": st.retentions,
            "retained_blocks": st.retained,
            "retained_in_pool": st.retained_ready,
            "max_retained_blocks": self.max_retained,
            "prefetches_live": self.prefetching.live,
            "prefetch_keys": self.prefetching.keys,
            "max_prefetch_keys": self.max_prefetch_keys,
            "counts": dict(sorted(self.counts.items())),
        }

    def metric_families(self) -> Iterator[Metric]:
        """The cache-control families, read at scrape time: each room's, in one order."""
        yield from self.retaining.metric_families()
        yield from self.prefetching.metric_families()
        yield from self.hints.metric_families()
