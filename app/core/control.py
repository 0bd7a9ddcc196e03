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
``Observer.failed`` when it raises), as the manager's are by ``ObservedManager``; the rest of
the telemetry is ``metric_families`` (read at scrape time).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.metrics_core import Metric

from app.core.errors import (
    NoLowerTierError,
    QuotaExceededError,
    UnknownKeysError,
    UnknownPrefetchError,
)
from app.core.lower_tiers import TierChain
from app.settings import Settings
from app.telemetry.logging import get_logger
from app.telemetry.metrics import PREFIX, le_label
from app.telemetry.observer import Observer
from manager import BlockKey, InvalidArgumentError, OffloadManager, RetentionInfo
from manager.retention import check_ttl

log = get_logger("control")
T = TypeVar("T")
#: Finished prefetches kept for ``prefetch_state`` after their last hold ended.
FINISHED_PREFETCHES_KEPT = 1024
#: Buckets of ``kvoffload_prefetch_won_seconds`` (a disk read is ms, a remote one tens of ms).
WON_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
HIT, PENDING, MISS, REFUSED = "hit", "pending", "miss", "refused"
#: A prefetch's counts, every one in every answer (0 until it happens).
PREFETCH_COUNTS = (
    HIT, "promoted", PENDING, MISS, REFUSED, "landed", "failed", "used", "wasted"
)  # fmt: skip
#: Retained keys a sweep round tries again to bring up from below, at most.
RETRY_KEYS = 256


@dataclass(slots=True)
class Retained:
    """What ``retain`` did: the retention now, whether the call created it, each key's state
    when it was retained (``hit``, ``pending`` or the name of the tier it is promoted from),
    and how many keys are on their way up."""

    info: RetentionInfo
    created: bool
    results: list[str]
    promoting: int


@dataclass(slots=True)
class Prefetch:
    """One prefetch: what it holds and brings up, and its counts. (Its keys' states when it
    started are the starting call's answer only: kept for a finished one, 8,192 of them
    would be kept a thousand times over.)"""

    prefetch_id: int
    req_id: str
    started_at: float
    deadline_at: float
    promoting: set[BlockKey] = field(default_factory=set)
    held: set[BlockKey] = field(default_factory=set)
    counts: collections.Counter[str] = field(default_factory=collections.Counter)
    landed_at: float | None = None
    cancelled: bool = False
    settled: asyncio.Event = field(default_factory=asyncio.Event)
    timer: asyncio.TimerHandle | None = None

    @property
    def state(self) -> str:
        """``promoting`` (reads in flight), ``held`` (landed, waiting for a load), ``done``
        (every key used, wasted or failed) or ``cancelled``."""
        if self.cancelled:
            return "cancelled"
        if self.promoting:
            return "promoting"
        return "held" if self.held else "done"


@dataclass(slots=True)
class Hinted:
    """What ``demote`` or ``drop`` did: the keys it moved, and why the others stayed
    (``pinned``, ``retained``, ``pending``, ``not_in_pool``; for ``demote`` also ``refused``:
    no tier below holds or takes it), counted."""

    done: list[BlockKey]
    kept: dict[str, int]


class Control:
    """Cache control of one namespace's service; see the module docstring."""

    def __init__(
        self,
        settings: Settings,
        manager: OffloadManager,
        tiers: TierChain,
        *,
        namespace: str,
        observer: Observer,
        on_event: Callable[[], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.observer = observer
        self.manager = manager
        self.tiers = tiers
        self.namespace = namespace
        self._on_event = on_event
        self._clock = clock
        #: The namespace's bound of distinct retained blocks (a tenants-file reload sets it).
        self.max_retained = settings.effective_max_retained_blocks
        self.max_prefetch_keys = settings.effective_prefetch_max_keys
        self.counts: collections.Counter[str] = collections.Counter()
        self._ids = itertools.count(1)
        self._promotion_ids = itertools.count(1)
        # Retained keys not in the pool when retained, with where they were then (the
        # ``kvoffload_retained_blocks{tier}`` gauge, and the keys each sweep round tries again
        # to bring up, oldest tried first). Pruned of the keys that landed or are no longer
        # retained every sweep round and whenever it outgrows the retained keys, so it stays
        # within the bound of retained blocks (twice it, between rounds).
        self._below: dict[BlockKey, str] = {}
        self._prefetches: dict[int, Prefetch] = {}
        self._finished: collections.OrderedDict[int, Prefetch] = collections.OrderedDict()
        # Per key, the live prefetches holding it (each with one ``OffloadManager.hold``), and
        # those whose promotion is bringing it up (a load may pin it before they hold it).
        self._holders: dict[BlockKey, set[int]] = {}
        self._coming: dict[BlockKey, set[int]] = {}
        self._prefetch_keys = 0  # keys promoting or held by prefetches, summed
        self._settling: set[asyncio.Task[None]] = set()
        self._won = [0] * (len(WON_BUCKETS) + 1)
        self._won_sum = 0.0

    # ------------------------------------------------------------------ where keys are

    async def _states(self, keys: Sequence[BlockKey], req_id: str) -> list[str | None]:
        """Per key: ``hit`` (ready in the pool), ``pending`` (a store or promotion in
        flight), the name of the first tier below that holds it, or None (nowhere)."""
        manager = self.manager
        out: list[str | None] = []
        below: list[int] = []
        for i, key in enumerate(keys):
            if manager.slot_of(key) is None:
                out.append(None)
                below.append(i)
            else:
                out.append(HIT if manager.is_ready(key) else PENDING)
        if below and self.tiers:
            found = await self.tiers.found([keys[i] for i in below], req_id)
            for i, tier in zip(below, found, strict=True):
                out[i] = tier
        return out

    def _promote(
        self, keys: list[BlockKey], protect: list[BlockKey], then: Callable[[], None] | None
    ) -> list[asyncio.Task[None]]:
        """Start promotions of ``keys`` under an internal request of their own; the tasks
        started. ``then`` runs once they settle; the promotions' own holds are let go of then."""
        req_id = f"kvoffload-control-{next(self._promotion_ids)}"
        tasks = self.tiers.promote(keys, req_id, protect, self.manager) if keys else []

        async def settle() -> None:
            try:
                # Each promotion settles its own failures (return_exceptions: none raises).
                await asyncio.gather(*tasks, return_exceptions=True)
                if then is not None:
                    then()
            finally:
                self.tiers.let_go(req_id)

        if tasks or then is not None:
            task = asyncio.get_running_loop().create_task(settle(), name="kvoffload-control-settle")
            # The loop keeps only a weak reference to a task: this one must not be collected.
            self._settling.add(task)
            task.add_done_callback(self._settling.discard)
        return tasks

    # ------------------------------------------------------------------ retain

    def _check_ttl(self, ttl_s: float) -> float:
        return _bounded("ttl_s", ttl_s, self.settings.retain_max_ttl_s, "retain_max_ttl_s")

    async def retain(
        self, keys: Sequence[BlockKey], ttl_s: float, name: str, req_id: str
    ) -> Retained:
        """Retain ``keys`` for ``ttl_s`` as retention ``name``; see the module docstring."""
        return await self._observed_async("retain", req_id, self._retain(keys, ttl_s, name, req_id))

    async def _retain(
        self, keys: Sequence[BlockKey], ttl_s: float, name: str, req_id: str
    ) -> Retained:
        ttl = self._check_ttl(ttl_s)
        manager = self.manager
        if not keys:
            raise InvalidArgumentError("keys: at least one key to retain")
        states = await self._states(keys, req_id)
        # From here on, no await: the checks and the change are one step.
        unknown = [k for k, s in zip(keys, states, strict=True) if s is None]
        if unknown:
            raise UnknownKeysError(unknown[:8], len(unknown))
        retained = manager.num_retained
        new = manager.new_retained(name, keys)
        if new and retained + new > self.max_retained:
            raise QuotaExceededError(
                self.namespace,
                "retained_blocks",
                self.max_retained,
                f"{retained} blocks retained, this call would retain {new} more",
                scope="namespace",
            )
        retentions = manager.num_retentions
        if not manager.has_retention(name) and retentions >= self.settings.max_retentions:
            raise QuotaExceededError(
                self.namespace,
                "retentions",
                self.settings.max_retentions,
                f"{retentions} retentions live; release one or reuse a name",
                scope="namespace",
            )
        refs = manager.retention_references
        more = manager.new_references(name, keys)
        if more and refs + more > self.settings.max_retention_keys:
            raise QuotaExceededError(
                self.namespace,
                "retention_keys",
                self.settings.max_retention_keys,
                f"{refs} keys named by retentions, this call would name {more} more",
                scope="namespace",
            )
        info = manager.retain(keys, ttl, name)
        created = info.created
        results = [s for s in states if s is not None]
        below = [k for k, s in zip(keys, results, strict=True) if s not in (HIT, PENDING)]
        if len(self._below) + len(below) > 2 * self.max_retained:
            self._prune_below()
        for key, where in zip(keys, results, strict=True):
            if where not in (HIT, PENDING):
                self._below[key] = where
        promoting = 0
        if below:
            hits = [k for k, s in zip(keys, results, strict=True) if s == HIT]
            tasks = self._promote(below, hits, None)
            promoting = sum(1 for k in below if manager.slot_of(k) is not None) if tasks else 0
            self._on_event()
        self.counts["retentions_created" if created else "retentions_renewed"] += 1
        return Retained(info, created, results, promoting)

    def renew(self, name: str, ttl_s: float) -> RetentionInfo:
        """Restart retention ``name``'s TTL."""
        ttl = self._check_ttl(ttl_s)
        info = self.manager.renew_retention(name, ttl)
        self.counts["retentions_renewed"] += 1
        return info

    def release(self, name: str) -> RetentionInfo:
        """End retention ``name`` now; what it was."""
        return self.manager.release_retention(name)

    def retentions(self) -> list[RetentionInfo]:
        """The namespace's live retentions, oldest first."""
        return self.manager.retentions()

    def get(self, name: str) -> RetentionInfo:
        """Retention ``name`` now."""
        return self.manager.retention(name)

    def now(self) -> float:
        """The clock deadlines are read against."""
        return self._clock()

    def expire(self) -> list[RetentionInfo]:
        """End the retentions whose TTL passed, and try again to bring up retained keys that
        a tier below holds and no promotion could bring up yet (no room then); the lease
        sweeper calls this every round."""
        ended = self.manager.expire_retentions()
        self._retry_below()
        if ended:
            log.info(
                "retentions expired",
                extra={
                    "fields": {
                        "namespace": self.namespace,
                        "retentions": len(ended),
                        "keys": sum(r.keys for r in ended),
                    }
                },
            )
        return ended

    def _prune_below(self) -> None:
        """Forget the retained-below keys that landed in the pool or are retained no more."""
        manager = self.manager
        below = self._below
        gone = [k for k in below if not manager.is_retained(k) or manager.is_ready(k)]
        for key in gone:
            del below[key]
        if gone and len(below) * 4 < len(gone):
            self._below = dict(below)  # a dict keeps its size after deletions: give it back

    def _retry_below(self) -> None:
        """Prune the retained-below keys, then try again to bring up the next ``RETRY_KEYS``
        of them that are not in the pool: the keys tried go to the back, so every round
        tries the next ones and each key gets its turn."""
        self._prune_below()
        below = self._below
        if not below or not self.tiers:
            return
        tried = list(itertools.islice(below, RETRY_KEYS))
        for key in tried:
            below[key] = below.pop(key)
        manager = self.manager
        again = [k for k in tried if manager.slot_of(k) is None]
        if again:
            tasks = self._promote(again, [], None)
            if tasks:
                self._on_event()

    # ------------------------------------------------------------------ prefetch

    def check_deadline(self, deadline_s: float) -> float:
        """``deadline_s`` as a float; ``InvalidArgumentError`` unless 0 < it <= the bound."""
        return _bounded(
            "deadline_s",
            deadline_s,
            self.settings.prefetch_max_deadline_s,
            "prefetch_max_deadline_s",
        )

    async def prefetch(
        self, keys: Sequence[BlockKey], deadline_s: float, req_id: str
    ) -> tuple[Prefetch, list[str]]:
        """Start prefetching ``keys`` for ``deadline_s``; see the module docstring. The
        prefetch, and each key's state when it started (in ``keys``' order)."""
        return await self._observed_async(
            "prefetch", req_id, self._prefetch(keys, deadline_s, req_id)
        )

    async def _prefetch(
        self, keys: Sequence[BlockKey], deadline_s: float, req_id: str
    ) -> tuple[Prefetch, list[str]]:
        self.check_deadline(deadline_s)
        if not keys:
            raise InvalidArgumentError("keys: at least one key to prefetch")
        distinct = list(dict.fromkeys(keys))
        states = await self._states(distinct, req_id)
        return self._start_prefetch(keys, distinct, states, deadline_s, req_id)

    def prefetch_found(
        self, found: dict[BlockKey, str], deadline_s: float, req_id: str
    ) -> Prefetch | None:
        """A lookup's prefetch (its ``prefetch_deadline_s``) of the keys it ``found`` in a tier
        below (key: the tier's name), started in the lookup's step and counted as the request's
        ``prefetch``. None past the namespace's bound of prefetch keys: the lookup answers as
        without it (a hint), and the keys are counted as refused."""
        keys = list(found)
        try:
            p, _ = self._start_prefetch(keys, keys, list(found.values()), deadline_s, req_id)
        except QuotaExceededError:
            self.counts["prefetch_refused"] += len(keys)
            return None
        self.observer.op("prefetch", req_id)
        return p

    def _start_prefetch(
        self,
        keys: Sequence[BlockKey],
        distinct: list[BlockKey],
        states: Sequence[str | None],
        deadline_s: float,
        req_id: str,
    ) -> tuple[Prefetch, list[str]]:
        """``prefetch`` once each of the ``distinct`` keys' state is known (``states``: hit,
        pending, a tier's name, None for nowhere; a lookup that knows them calls this in the
        same step); ``keys`` in the caller's order, for the answer."""
        deadline = self.check_deadline(deadline_s)
        manager = self.manager
        hits = [k for k, s in zip(distinct, states, strict=True) if s == HIT]
        below = [k for k, s in zip(distinct, states, strict=True) if s not in (HIT, PENDING, None)]
        wanted = len(hits) + len(below)
        if wanted and self._prefetch_keys + wanted > self.max_prefetch_keys:
            raise QuotaExceededError(
                self.namespace,
                "prefetch_keys",
                self.max_prefetch_keys,
                f"{self._prefetch_keys} keys prefetching or held, this call would add {wanted}",
                scope="namespace",
            )
        now = self._clock()
        p = Prefetch(next(self._ids), req_id, now, now + deadline)
        by_key = dict(zip(distinct, (s or MISS for s in states), strict=True))
        held = manager.hold(hits)
        for key, slot in zip(hits, held, strict=True):
            if slot is not None:
                self._take(p, key)
        p.counts[HIT] = len(p.held)
        if below:
            tasks = self._promote(below, hits, lambda: self._landed(p))
            for key in below:
                if manager.slot_of(key) is not None and not manager.is_ready(key):
                    p.promoting.add(key)
                else:
                    by_key[key] = REFUSED
            p.counts["promoted"] = len(p.promoting)
            self._prefetch_keys += len(p.promoting)
            for key in p.promoting:
                self._coming.setdefault(key, set()).add(p.prefetch_id)
            if tasks:
                self._on_event()
        if not p.promoting:
            p.settled.set()
        results = [by_key[k] for k in keys]
        for state in (PENDING, MISS, REFUSED):
            p.counts[state] = sum(1 for k in distinct if by_key[k] == state)
        for outcome in (HIT, "promoted", PENDING, MISS, REFUSED):
            self.counts[f"prefetch_{outcome}"] += p.counts[outcome]
        self._prefetches[p.prefetch_id] = p
        p.timer = asyncio.get_running_loop().call_later(deadline, self._expire_prefetch, p)
        self._maybe_finish(p)
        return p, results

    def _take(self, p: Prefetch, key: BlockKey) -> None:
        """``p`` holds ``key`` (one manager hold, already taken)."""
        p.held.add(key)
        self._holders.setdefault(key, set()).add(p.prefetch_id)
        self._prefetch_keys += 1

    def _landed(self, p: Prefetch) -> None:
        """``p``'s promotions settled: hold what landed (the promotions still hold it until
        their own holds are let go of, just after this)."""
        manager = self.manager
        self._forget_coming(p, p.promoting)
        landed = [k for k in p.promoting if manager.is_ready(k)]
        self._prefetch_keys -= len(p.promoting)
        failed = len(p.promoting) - len(landed)
        p.promoting.clear()
        p.landed_at = self._clock()
        p.counts["landed"] += len(landed)
        p.counts["failed"] += failed
        self.counts["prefetch_failed"] += failed
        if landed and not p.cancelled and p.landed_at < p.deadline_at:
            for key, slot in zip(landed, manager.hold(landed), strict=True):
                if slot is not None:
                    self._take(p, key)
        elif landed:
            p.counts["wasted"] += len(landed)
            self.counts["prefetch_wasted"] += len(landed)
        p.settled.set()
        self._maybe_finish(p)

    def _forget_coming(self, p: Prefetch, keys: Iterable[BlockKey]) -> None:
        coming = self._coming
        for key in keys:
            ids = coming.get(key)
            if ids is not None:
                ids.discard(p.prefetch_id)
                if not ids:
                    del coming[key]

    def loaded(self, keys: Sequence[BlockKey]) -> None:
        """A load pinned ``keys``: the prefetches holding any of them, or bringing them up
        (the load pinned what their read just landed, before they could hold it), are used,
        and let go."""
        holders, coming = self._holders, self._coming
        if coming and not coming.keys().isdisjoint(keys):
            self._loaded_coming(keys)
        if not holders or holders.keys().isdisjoint(keys):
            return
        for key in keys:
            ids = holders.pop(key, None)
            if ids is None:
                continue
            for pid in ids:
                p = self._prefetches.get(pid)
                if p is None:
                    continue
                p.held.discard(key)
                self._prefetch_keys -= 1
                self.manager.release_hold([key])
                if not p.counts["used"]:
                    # What the load did not wait for: the reads, from the prefetch to landing
                    # (none for blocks the pool had already).
                    landed_at = p.landed_at if p.counts["landed"] else None
                    self._observe_won(0.0 if landed_at is None else landed_at - p.started_at)
                p.counts["used"] += 1
                self.counts["prefetch_used"] += 1
                self._maybe_finish(p)

    def _loaded_coming(self, keys: Sequence[BlockKey]) -> None:
        """A load pinned keys a prefetch's promotion is bringing up: they landed and are used,
        and the prefetch will not hold them when its promotion settles."""
        now = self._clock()
        for key in keys:
            ids = self._coming.pop(key, None)
            for pid in ids or ():
                p = self._prefetches.get(pid)
                if p is None or p.cancelled or key not in p.promoting:
                    continue
                p.promoting.discard(key)
                self._prefetch_keys -= 1
                p.counts["landed"] += 1
                if not p.counts["used"]:
                    self._observe_won(now - p.started_at)
                p.counts["used"] += 1
                self.counts["prefetch_used"] += 1
                if not p.promoting:
                    p.landed_at = now

    def _let_go(self, p: Prefetch, outcome: str) -> None:
        """Release every hold of ``p``, each key counted as ``outcome``."""
        for key in p.held:
            ids = self._holders.get(key)
            if ids is not None:
                ids.discard(p.prefetch_id)
                if not ids:
                    del self._holders[key]
        if p.held:
            self.manager.release_hold(list(p.held))
            self._prefetch_keys -= len(p.held)
            p.counts[outcome] += len(p.held)
            self.counts[f"prefetch_{outcome}"] += len(p.held)
            p.held.clear()

    def _expire_prefetch(self, p: Prefetch) -> None:
        self._let_go(p, "wasted")
        self._maybe_finish(p)

    def _maybe_finish(self, p: Prefetch) -> None:
        """Move ``p`` to the finished ones once nothing of it is promoting or held."""
        if p.promoting or p.held or p.prefetch_id not in self._prefetches:
            return
        del self._prefetches[p.prefetch_id]
        if p.timer is not None:
            p.timer.cancel()
        self._finished[p.prefetch_id] = p
        while len(self._finished) > FINISHED_PREFETCHES_KEPT:
            self._finished.popitem(last=False)

    def cancel(self, prefetch_id: int) -> Prefetch:
        """Cancel prefetch ``prefetch_id``: its holds end now (``wasted``), and what its reads
        still bring is not held."""
        p = self.prefetch_state(prefetch_id)
        if p.state in ("promoting", "held"):
            p.cancelled = True
            self._let_go(p, "wasted")
            self._maybe_finish(p)
        return p

    def prefetch_state(self, prefetch_id: int) -> Prefetch:
        """Prefetch ``prefetch_id``, live or recently finished."""
        p = self._prefetches.get(prefetch_id) or self._finished.get(prefetch_id)
        if p is None:
            raise UnknownPrefetchError(prefetch_id)
        return p

    async def wait(self, prefetch_id: int, timeout_s: float) -> Prefetch:
        """Prefetch ``prefetch_id`` once its reads settled, or after ``timeout_s``."""
        p = self.prefetch_state(prefetch_id)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(0.0, timeout_s)):
                await p.settled.wait()
        return p

    def _observe_won(self, seconds: float) -> None:
        seconds = max(0.0, seconds)
        i = next((i for i, b in enumerate(WON_BUCKETS) if seconds <= b), len(WON_BUCKETS))
        self._won[i] += 1
        self._won_sum += seconds

    # ------------------------------------------------------------------ demote and drop

    def demote(self, keys: Sequence[BlockKey], req_id: str) -> Hinted:
        """Evict the movable ``keys`` that a tier below holds or takes (``LowerTier.takes``:
        the disk takes them whatever its admission says) now, into the tiers below; the
        others stay in the pool, ``refused``. ``NoLowerTierError`` without a tier below."""
        return self._observed("demote", req_id, self._demote, keys)

    def _demote(self, keys: Sequence[BlockKey]) -> Hinted:
        if not self.tiers:
            raise NoLowerTierError()
        movable, kept = self.manager.sort_for_hint(keys)
        # Only what a tier below holds or takes leaves the pool: a block no tier takes would
        # be lost, so it stays (``refused``), and ``moved`` never names a block held nowhere.
        taken = [False] * len(movable)
        for tier in self.tiers.tiers:
            taken = [a or b for a, b in zip(taken, tier.takes(movable), strict=True)]
        kept["refused"] = taken.count(False)
        movable = [k for k, t in zip(movable, taken, strict=True) if t]
        done = self.manager.demote(movable) if movable else []
        self.counts["demoted"] += len(done)
        if done:
            self._on_event()
        return Hinted(done, kept)

    def drop(self, keys: Sequence[BlockKey], req_id: str) -> Hinted:
        """Remove the movable ``keys`` from the pool now."""
        return self._observed("drop", req_id, self._drop, keys)

    def _drop(self, keys: Sequence[BlockKey]) -> Hinted:
        movable, kept = self.manager.sort_for_hint(keys)
        done = self.manager.drop(movable) if movable else []
        self.counts["dropped"] += len(done)
        if done:
            self._on_event()
        return Hinted(done, kept)

    # ------------------------------------------------------------------ lifecycle, telemetry

    def _observed(self, op: str, req_id: str, call: Callable[..., T], *args: Any) -> T:
        """``call(*args)``, counted as ``op`` of ``req_id`` (its error when it raises)."""
        try:
            out = call(*args)
        except Exception:
            self.observer.failed(op, req_id)
            raise
        self.observer.op(op, req_id)
        return out

    async def _observed_async(self, op: str, req_id: str, call: Awaitable[T]) -> T:
        """``await call``, counted as ``op`` of ``req_id`` (its error when it raises)."""
        try:
            out = await call
        except Exception:
            self.observer.failed(op, req_id)
            raise
        self.observer.op(op, req_id)
        return out

    def close(self) -> None:
        """Release every prefetch hold (the service stops; retentions die with the pool)."""
        for p in list(self._prefetches.values()):
            p.cancelled = True
            self._let_go(p, "wasted")
            if p.timer is not None:
                p.timer.cancel()
            p.settled.set()
        self._prefetches.clear()

    def state(self) -> dict[str, object]:
        """What ``/admin/v1/stats`` says about cache control."""
        st = self.manager.stats()
        return {
            "retentions": st.retentions,
            "retained_blocks": st.retained,
            "retained_in_pool": st.retained_ready,
            "max_retained_blocks": self.max_retained,
            "prefetches_live": len(self._prefetches),
            "prefetch_keys": self._prefetch_keys,
            "max_prefetch_keys": self.max_prefetch_keys,
            "counts": dict(sorted(self.counts.items())),
        }

    def retained_by_tier(self) -> dict[str, int]:
        """Retained blocks by where they are: ``pool`` (ready there), ``pending`` (a store or
        promotion in flight), the tier a key was found in when it was retained (not in the
        pool now), ``elsewhere`` (not in the pool, in no tier it was found in)."""
        manager = self.manager
        self._prune_below()
        below = self._below
        ready, pending, absent = manager.retained_where()
        out = {"pool": ready, "pending": pending, "elsewhere": 0}
        for key in absent:
            tier = below.get(key, "elsewhere")
            out[tier] = out.get(tier, 0) + 1
        return out

    def metric_families(self) -> Iterator[Metric]:
        """The cache-control families, read at scrape time."""
        st = self.manager.stats()
        yield GaugeMetricFamily(
            f"{PREFIX}_retentions_live", "Live retentions (named sets of keys kept in the pool).",
            value=st.retentions,
        )  # fmt: skip
        where = GaugeMetricFamily(
            f"{PREFIX}_retained_blocks",
            "Distinct retained blocks by where they are: pool (ready, never evicted while "
            "retained), the tier below they are promoted from, pending (a store or promotion "
            "in flight), elsewhere (not in the pool, e.g. a failed promotion).",
            labels=["tier"],
        )
        for tier, n in sorted(self.retained_by_tier().items()):
            where.add_metric([tier], n)
        yield where
        events = CounterMetricFamily(
            f"{PREFIX}_retentions", "Retentions by what happened to them.", labels=["event"]
        )
        for event, value in (
            ("created", st.retentions_started),
            ("renewed", self.counts["retentions_renewed"]),
            ("released", st.retentions_released),
            ("expired", st.retentions_expired),
        ):
            events.add_metric([event], value)
        yield events
        keys = CounterMetricFamily(
            f"{PREFIX}_prefetch_keys",
            "Prefetched keys by outcome: at the start hit (held), promoted, pending, miss, "
            "refused (no room, or a lookup's prefetch past the bound); at the end used (a load "
            "pinned it while held), wasted (deadline or cancel first), failed (the read failed).",
            labels=["outcome"],
        )
        for outcome in (HIT, "promoted", PENDING, MISS, REFUSED, "used", "wasted", "failed"):
            keys.add_metric([outcome], self.counts[f"prefetch_{outcome}"])
        yield keys
        won = HistogramMetricFamily(
            f"{PREFIX}_prefetch_won_seconds",
            "Per prefetch whose keys a load used: seconds from the prefetch to its blocks "
            "landing, which the load did not wait for.",
        )
        cumulative, buckets = 0, []
        for bound, n in zip((*WON_BUCKETS, float("inf")), self._won, strict=True):
            cumulative += n
            buckets.append((le_label(bound), cumulative))
        won.add_metric([], buckets, self._won_sum)
        yield won
        hints = CounterMetricFamily(
            f"{PREFIX}_cache_hint_blocks", "Blocks moved by cache hints.", labels=["hint"]
        )
        hints.add_metric(["demote"], self.counts["demoted"])
        hints.add_metric(["drop"], self.counts["dropped"])
        yield hints


def _bounded(field: str, value: float, bound: float, setting: str) -> float:
    """``value`` as a float; ``InvalidArgumentError`` naming ``field`` and ``setting`` (the
    bound's) unless it is a finite number with 0 < it <= ``bound``."""
    try:
        out = check_ttl(value)
    except InvalidArgumentError:
        out = -1.0
    if not 0 < out <= bound:
        raise InvalidArgumentError(
            f"{field} must be a finite number, 0 < {field} <= {bound:g} ({setting}), got {value!r}"
        )
    return out
