"""Cache control's retentions (``app.core.control``'s **retain**): named sets of keys kept in the
pool against eviction until a TTL ends, the keys below the pool promoted and kept as they land.

``Retentions`` checks the namespace's bounds (retained blocks, live retentions, keys named by
retentions, the TTL) after the one question to the tiers below, in the same manager call as the
change, so a refusal changes nothing; the manager keeps the retained blocks
(``OffloadManager.retain_steps``). A large retain runs ``STEP_KEYS`` keys a step, its caller
giving way between steps (the manager suspended: to everyone else it is one call). It remembers the
retained keys that were below the pool, and where, for the ``kvoffload_retained_blocks{tier}``
gauge and for the sweep's retries (``expire``).
"""

from __future__ import annotations

import itertools
from collections.abc import Generator, Iterator, Sequence
from dataclasses import dataclass
from typing import cast

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from app.core.control_shared import HIT, PENDING, ControlShared, bounded
from app.core.errors import QuotaExceededError, UnknownKeysError
from app.core.observed import STEP_KEYS, observed_await
from app.core.slices import StepRunner, all_at_once
from app.telemetry.logging import get_logger
from app.telemetry.metrics import PREFIX
from manager import BlockKey, InvalidArgumentError, RetentionInfo

log = get_logger("control")
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


class Retentions:
    """The retentions of one namespace; see the module docstring."""

    def __init__(self, shared: ControlShared) -> None:
        self.shared = shared
        self.manager = shared.manager
        #: The namespace's bound of distinct retained blocks (a tenants-file reload sets it).
        self.max_retained = shared.settings.effective_max_retained_blocks
        # Retained keys not in the pool when retained, with where they were then (the
        # ``kvoffload_retained_blocks{tier}`` gauge, and the keys each sweep round tries again
        # to bring up, oldest tried first). Pruned of the keys that landed or are no longer
        # retained every sweep round and whenever it outgrows the retained keys, so it stays
        # within the bound of retained blocks (twice it, between rounds).
        self._below: dict[BlockKey, str] = {}

    def _check_ttl(self, ttl_s: float) -> float:
        settings = self.shared.settings
        return bounded("ttl_s", ttl_s, settings.retain_max_ttl_s, "retain_max_ttl_s")

    async def retain(
        self,
        keys: Sequence[BlockKey],
        ttl_s: float,
        name: str,
        req_id: str,
        run: StepRunner = all_at_once,
    ) -> Retained:
        """Retain ``keys`` for ``ttl_s`` as retention ``name``, counted as ``req_id``'s
        ``retain`` (its error when it raises); see the module docstring. The work is done
        ``STEP_KEYS`` keys a step, ``run`` driving the steps."""
        shared = self.shared
        out = await observed_await(
            shared.observer, "retain", req_id, self._retain(keys, ttl_s, name, req_id, run)
        )
        shared.observer.op("retain", req_id)
        return out

    async def _retain(
        self, keys: Sequence[BlockKey], ttl_s: float, name: str, req_id: str, run: StepRunner
    ) -> Retained:
        ttl = self._check_ttl(ttl_s)
        if not keys:
            raise InvalidArgumentError("keys: at least one key to retain")
        states = await self.shared.states(keys, req_id, run)
        if None in states:
            unknown = [k for k, s in zip(keys, states, strict=True) if s is None]
            raise UnknownKeysError(unknown[:8], len(unknown))
        # From here on, no await but ``run``'s: the checks and the change are one call.
        return await run(self._retain_steps(keys, cast(list[str], states), ttl, name))

    def _retain_steps(
        self, keys: Sequence[BlockKey], results: list[str], ttl: float, name: str
    ) -> Generator[None, None, Retained]:
        manager = self.manager

        def check(new: int, more: int) -> None:
            self._check_bounds(name, new, more)

        info = yield from manager.retain_steps(keys, ttl, name, STEP_KEYS, check)
        below: list[BlockKey] = []
        hits: list[BlockKey] = []
        if results.count(HIT) + results.count(PENDING) < len(results):  # some below the pool
            for at in range(0, len(keys), STEP_KEYS):
                yield
                part = zip(keys[at : at + STEP_KEYS], results[at : at + STEP_KEYS], strict=True)
                for key, where in part:
                    if where == HIT:
                        hits.append(key)
                    elif where != PENDING:
                        below.append(key)
                        self._below[key] = where
            if len(self._below) > 2 * self.max_retained:
                self._prune_below()
        promoting = 0
        if below:
            tasks = self.shared.promote(below, hits, None)
            promoting = sum(1 for k in below if manager.slot_of(k) is not None) if tasks else 0
        self.shared.counts["retentions_created" if info.created else "retentions_renewed"] += 1
        return Retained(info, info.created, results, promoting)

    def _check_bounds(self, name: str, new: int, more: int) -> None:
        """``QuotaExceededError`` (the namespace's) when retaining as ``name`` ``new`` keys no
        retention names yet and ``more`` keys it does not name yet would pass the bound of
        retained blocks, of live retentions or of keys named by them."""
        manager, settings, namespace = self.manager, self.shared.settings, self.shared.namespace
        retained = manager.num_retained
        if new and retained + new > self.max_retained:
            raise QuotaExceededError(
                namespace,
                "retained_blocks",
                self.max_retained,
                f"{retained} blocks retained, this call would retain {new} more",
                scope="namespace",
            )
        retentions = manager.num_retentions
        if not manager.has_retention(name) and retentions >= settings.max_retentions:
            raise QuotaExceededError(
                namespace,
                "retentions",
                settings.max_retentions,
                f"{retentions} retentions live; release one or reuse a name",
                scope="namespace",
            )
        refs = manager.retention_references
        if more and refs + more > settings.max_retention_keys:
            raise QuotaExceededError(
                namespace,
                "retention_keys",
                settings.max_retention_keys,
                f"{refs} keys named by retentions, this call would name {more} more",
                scope="namespace",
            )

    def renew(self, name: str, ttl_s: float) -> RetentionInfo:
        """Restart retention ``name``'s TTL."""
        ttl = self._check_ttl(ttl_s)
        info = self.manager.renew_retention(name, ttl)
        self.shared.counts["retentions_renewed"] += 1
        return info

    async def release(self, name: str, run: StepRunner = all_at_once) -> RetentionInfo:
        """End retention ``name`` now, ``STEP_KEYS`` keys a step (``run`` driving the steps);
        what it was."""
        return await run(self.manager.release_retention_steps(name, STEP_KEYS))

    def retentions(self) -> list[RetentionInfo]:
        """The namespace's live retentions, oldest first."""
        return self.manager.retentions()

    def get(self, name: str) -> RetentionInfo:
        """Retention ``name`` now."""
        return self.manager.retention(name)

    async def expire(self, run: StepRunner = all_at_once) -> list[RetentionInfo]:
        """End the retentions whose TTL passed, ``STEP_KEYS`` keys a step (``run`` driving the
        steps: many large retentions ending at once are no one long step), and try again to
        bring up retained keys that a tier below holds and no promotion could bring up yet (no
        room then); the lease sweeper calls this every round."""
        ended = await run(self.manager.expire_retentions_steps(STEP_KEYS))
        self._retry_below()
        if ended:
            log.info(
                "retentions expired",
                extra={
                    "fields": {
                        "namespace": self.shared.namespace,
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
        if not below or not self.shared.tiers:
            return
        tried = list(itertools.islice(below, RETRY_KEYS))
        for key in tried:
            below[key] = below.pop(key)
        manager = self.manager
        again = [k for k in tried if manager.slot_of(k) is None]
        if again:
            self.shared.promote(again, [], None)

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
        """The retention families, read at scrape time."""
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
            ("renewed", self.shared.counts["retentions_renewed"]),
            ("released", st.retentions_released),
            ("expired", st.retentions_expired),
        ):
            events.add_metric([event], value)
        yield events
