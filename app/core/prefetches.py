"""Cache control's prefetches (``app.core.control``'s **prefetch**): keys below the pool brought
up into it, and what lands and what the pool already has held until a load pins it or the
deadline passes.

``Prefetches`` keeps each prefetch (``Prefetch``) while it promotes or holds keys, and the last
``FINISHED_PREFETCHES_KEPT`` finished ones for ``prefetch_state``. A held block is pinned by one
``OffloadManager.hold`` per prefetch holding it, so a prefetch never evicts a pinned, retained or
held block to make its room. Each key is counted once as it ends: ``used``, ``wasted`` or
``failed``; a prefetch a load used is timed in ``kvoffload_prefetch_won_seconds``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.metrics_core import Metric

from app.core.control_shared import HIT, MISS, PENDING, REFUSED, ControlShared, bounded
from app.core.errors import QuotaExceededError, UnknownPrefetchError
from app.core.observed import observed_await
from app.telemetry.metrics import PREFIX, le_label
from manager import BlockKey, InvalidArgumentError

#: Finished prefetches kept for ``prefetch_state`` after their last hold ended.
FINISHED_PREFETCHES_KEPT = 1024
#: Buckets of ``kvoffload_prefetch_won_seconds`` (a disk read is ms, a remote one tens of ms).
WON_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
#: A prefetch's counts, every one in every answer (0 until it happens).
PREFETCH_COUNTS = (
    HIT, "promoted", PENDING, MISS, REFUSED, "landed", "failed", "used", "wasted"
)  # fmt: skip


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


class Prefetches:
    """The prefetches of one namespace; see the module docstring."""

    def __init__(self, shared: ControlShared) -> None:
        self.shared = shared
        self.manager = shared.manager
        self.counts = shared.counts
        self.max_prefetch_keys = shared.settings.effective_prefetch_max_keys
        self._ids = itertools.count(1)
        self._prefetches: dict[int, Prefetch] = {}
        self._finished: collections.OrderedDict[int, Prefetch] = collections.OrderedDict()
        # Per key, the live prefetches holding it (each with one ``OffloadManager.hold``), and
        # those whose promotion is bringing it up (a load may pin it before they hold it).
        self._holders: dict[BlockKey, set[int]] = {}
        self._coming: dict[BlockKey, set[int]] = {}
        self._prefetch_keys = 0  # keys promoting or held by prefetches, summed
        # ``kvoffload_prefetch_won_seconds``, by hand: see ``metric_families``.
        self._won = [0] * (len(WON_BUCKETS) + 1)
        self._won_sum = 0.0

    @property
    def live(self) -> int:
        """Prefetches promoting or holding keys now."""
        return len(self._prefetches)

    @property
    def keys(self) -> int:
        """Keys promoting or held by live prefetches, summed (``max_prefetch_keys`` bounds it)."""
        return self._prefetch_keys

    def check_deadline(self, deadline_s: float) -> float:
        """``deadline_s`` as a float; ``InvalidArgumentError`` unless 0 < it <= the bound."""
        return bounded(
            "deadline_s",
            deadline_s,
            self.shared.settings.prefetch_max_deadline_s,
            "prefetch_max_deadline_s",
        )

    async def prefetch(
        self, keys: Sequence[BlockKey], deadline_s: float, req_id: str
    ) -> tuple[Prefetch, list[str]]:
        """Start prefetching ``keys`` for ``deadline_s``; see the module docstring. The
        prefetch, and each key's state when it started (in ``keys``' order)."""
        observer = self.shared.observer
        out = await observed_await(
            observer, "prefetch", req_id, self._prefetch(keys, deadline_s, req_id)
        )
        observer.op("prefetch", req_id)
        return out

    async def _prefetch(
        self, keys: Sequence[BlockKey], deadline_s: float, req_id: str
    ) -> tuple[Prefetch, list[str]]:
        self.check_deadline(deadline_s)
        if not keys:
            raise InvalidArgumentError("keys: at least one key to prefetch")
        distinct = list(dict.fromkeys(keys))
        states = await self.shared.states(distinct, req_id)
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
        self.shared.observer.op("prefetch", req_id)
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
                self.shared.namespace,
                "prefetch_keys",
                self.max_prefetch_keys,
                f"{self._prefetch_keys} keys prefetching or held, this call would add {wanted}",
                scope="namespace",
            )
        now = self.shared.clock()
        p = Prefetch(next(self._ids), req_id, now, now + deadline)
        by_key = dict(zip(distinct, (s or MISS for s in states), strict=True))
        held = manager.hold(hits)
        for key, slot in zip(hits, held, strict=True):
            if slot is not None:
                self._take(p, key)
        p.counts[HIT] = len(p.held)
        if below:
            self.shared.promote(below, hits, lambda: self._landed(p))
            for key in below:
                if manager.slot_of(key) is not None and not manager.is_ready(key):
                    p.promoting.add(key)
                else:
                    by_key[key] = REFUSED
            p.counts["promoted"] = len(p.promoting)
            self._prefetch_keys += len(p.promoting)
            for key in p.promoting:
                self._coming.setdefault(key, set()).add(p.prefetch_id)
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
        p.landed_at = self.shared.clock()
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
        now = self.shared.clock()
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

    def close(self) -> None:
        """Release every prefetch hold (the service stops)."""
        for p in list(self._prefetches.values()):
            p.cancelled = True
            self._let_go(p, "wasted")
            if p.timer is not None:
                p.timer.cancel()
            p.settled.set()
        self._prefetches.clear()

    def metric_families(self) -> Iterator[Metric]:
        """The prefetch families, read at scrape time. The histogram is built by hand rather
        than kept in a prometheus_client ``Histogram``: that one would add a ``_created``
        series, and this family is yielded per service through the scrape-time snapshot
        (``ServiceSnapshot.tier_metrics``), not registered in a registry of its own."""
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
