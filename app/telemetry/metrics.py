"""Prometheus metrics of the service, ``kvoffload_`` prefix, registry injected.

Two kinds of metric, two mechanisms:

- **Per-call** counters and histograms (HTTP calls, manager operations and keys, transfer jobs,
  policy switches) are updated by the code that does the work, each observation made for a
  request carrying an OpenMetrics exemplar ``{req_id="..."}`` (the last observation's, per
  series and, for a histogram, per bucket: what a scrape can show). The children are plain
  Python objects updated in place and turned into metric families when the registry is
  collected (see ``Metrics``), so an observation costs a dict lookup and a few additions.
- **State** (blocks by state, pool, live requests, policy, in-flight transfers, totals the
  manager keeps, shadow projections, the opt-in live-request table) is read at scrape time from
  one ``ServiceSnapshot`` by a custom collector: the hot path pays nothing for it, and the series
  of a request that finished disappear by construction.

Labels are bounded (route templates, op, result, direction, reason, policy). ``req_id`` is never
a label, except on the opt-in ``kvoffload_request_blocks`` gauge, which lists live requests only
and at most ``max_live_series`` of them. ``deploy/metrics_catalogue.json`` lists every family;
a test checks the exported families against it.
"""

from __future__ import annotations

import math
import time
from bisect import bisect_left
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.samples import Exemplar, Sample
from prometheus_client.utils import floatToGoString

from app.telemetry.request_ids import exemplar_id
from manager import ManagerStats, PolicyInfo

# prometheus_client's own spelling of bucket bounds (``le``); the function is untyped upstream.
#: A histogram bucket's ``le`` label as Prometheus writes it (``0.005``, ``+Inf``).
le_label = cast(Callable[[float], str], floatToGoString)

PREFIX = "kvoffload"
# Latency buckets from 50 us (an in-process manager call) to 2.5 s (a long-poll or a slow copy).
LATENCY_BUCKETS = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
    0.5, 1.0, 2.5,
)  # fmt: skip
TRANSFER_BUCKETS = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 30.0)


FAILURE_REASONS = ("deadline", "shutdown", "injected")


def failure_reason(reason: str | None) -> str:
    """The bounded label for a failure reason: a known kind it starts with, else ``error``."""
    if reason:
        lowered = reason.lower()
        for kind in FAILURE_REASONS:
            if lowered.startswith(kind):
                return kind
    return "error"


@dataclass(frozen=True, slots=True)
class TierReport:
    """What every tier below the pool exports, under its name as the ``tier`` label
    (``kvoffload_tier_*``; ``app.core.tier``): whether it serves, demoted blocks waiting to be
    written, written, and dropped by reason, blocks promoted into the pool, bytes each way,
    incidents (ok -> degraded). ``blocks`` / ``capacity_blocks``: what it holds and can hold,
    None for a tier that does not know (a store shared by nodes)."""

    up: bool
    queue_depth: int
    demoted: int
    dropped: Mapping[str, int]
    promoted: int
    bytes_read: int
    bytes_written: int
    incidents: int
    blocks: int | None = None
    capacity_blocks: int | None = None


@dataclass(frozen=True, slots=True)
class LiveRequestRow:
    """One row of the live-request table."""

    req_id: str
    pinned: int
    pending: int
    loaded: int
    stored: int


@dataclass(frozen=True, slots=True)
class ServiceSnapshot:
    """Everything the state collector exports, read once per scrape."""

    stats: ManagerStats
    policy: PolicyInfo
    block_bytes: int
    pool_pinned: bool
    inflight: dict[str, int]
    oldest_inflight_seconds: float
    events_dropped: int
    prefix_hit_ratio: float | None = None
    projected_hit_ratio: dict[str, float] = field(default_factory=dict)
    live_requests: list[LiveRequestRow] = field(default_factory=list)
    # Each lower tier's report (the ``kvoffload_tier_*`` families), by tier name.
    tier_reports: dict[str, TierReport] = field(default_factory=dict)
    # The lower tiers' own families (``LowerTier.metric_families``), read with the snapshot.
    tier_metrics: list[Metric] = field(default_factory=list)


class _StateCollector(Collector):
    def __init__(
        self, snapshot: Callable[[], ServiceSnapshot], live_series: bool, max_live: int
    ) -> None:
        self._snapshot = snapshot
        self._live_series = live_series
        self._max_live = max_live

    def describe(self) -> list[Metric]:
        # An empty description keeps the registry from calling collect() at registration.
        return []

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot()
        st = snap.stats
        blocks = GaugeMetricFamily(
            f"{PREFIX}_blocks", "Host-pool blocks by state (pinned is a subset of ready).",
            labels=["state"],
        )  # fmt: skip
        for state, value in (
            ("free", st.free), ("pending", st.pending), ("ready", st.ready), ("pinned", st.pinned)
        ):  # fmt: skip
            blocks.add_metric([state], value)
        yield blocks
        yield GaugeMetricFamily(
            f"{PREFIX}_pool_capacity_blocks", "Blocks in the host pool.", value=st.num_blocks
        )
        yield GaugeMetricFamily(
            f"{PREFIX}_pool_block_bytes", "Bytes per host-pool block.", value=snap.block_bytes
        )
        yield GaugeMetricFamily(
            f"{PREFIX}_pool_pinned_memory",
            "1 if the host pool is page-locked (registered with CUDA), else 0.",
            value=1 if snap.pool_pinned else 0,
        )
        yield GaugeMetricFamily(
            f"{PREFIX}_live_requests", "Requests the manager tracks.", value=st.live_requests
        )
        evictions = CounterMetricFamily(
            f"{PREFIX}_evictions", "Blocks evicted, by the policy that chose them.",
            labels=["policy"],
        )  # fmt: skip
        for name, value in sorted(st.evictions_by_policy.items()):
            evictions.add_metric([name], value)
        yield evictions
        yield CounterMetricFamily(
            f"{PREFIX}_store_refusals", "prepare_store calls refused for lack of evictable room.",
            value=st.stores_refused,
        )  # fmt: skip
        yield CounterMetricFamily(
            f"{PREFIX}_lease_force_releases",
            "Requests whose pins and pending stores were force-released (TTL or operator).",
            value=st.forced_lease_releases,
        )
        yield GaugeMetricFamily(
            f"{PREFIX}_orphaned_reserved_blocks",
            "Slots of stores dropped by an abort, reserved until the writer reports or its "
            'deadline passes (part of kvoffload_blocks{state="pending"}).',
            value=st.reserved,
        )
        yield CounterMetricFamily(
            f"{PREFIX}_orphaned_reservations_expired",
            "Reserved slots of dropped stores freed without the writer's report (writer "
            "deadline or lease expiry).",
            value=st.reservations_expired,
        )
        yield CounterMetricFamily(
            f"{PREFIX}_events_dropped", "KV events lost to a full event buffer.",
            value=snap.events_dropped + st.events_dropped,
        )  # fmt: skip
        info = GaugeMetricFamily(
            f"{PREFIX}_policy_info", "1 for the active eviction policy.", labels=["policy"]
        )
        info.add_metric([snap.policy.name], 1)
        yield info
        yield GaugeMetricFamily(
            f"{PREFIX}_policy_generation", "Generation of the active policy (+1 per switch).",
            value=snap.policy.generation,
        )  # fmt: skip
        inflight = GaugeMetricFamily(
            f"{PREFIX}_transfer_inflight_jobs", "Transfer jobs in flight.", labels=["direction"]
        )
        for direction in ("store", "load"):
            inflight.add_metric([direction], snap.inflight.get(direction, 0))
        yield inflight
        yield GaugeMetricFamily(
            f"{PREFIX}_transfer_oldest_inflight_seconds",
            "Age of the oldest transfer job in flight (0 when none).",
            value=snap.oldest_inflight_seconds,
        )
        if snap.prefix_hit_ratio is not None:
            yield GaugeMetricFamily(
                f"{PREFIX}_prefix_hit_ratio",
                "Leading hits over keys looked up, over the recent window of lookups.",
                value=snap.prefix_hit_ratio,
            )
        projected = GaugeMetricFamily(
            f"{PREFIX}_policy_projected_hit_ratio",
            "Prefix hit ratio each policy, the active one included, reaches in the shadow "
            "simulation (recent window; absent until it has enough sampled requests).",
            labels=["policy"],
        )
        for name, ratio in sorted(snap.projected_hit_ratio.items()):
            projected.add_metric([name], ratio)
        yield projected
        if snap.tier_reports:
            yield from _tier_families(snap.tier_reports)
        yield from snap.tier_metrics
        if self._live_series:
            table = GaugeMetricFamily(
                f"{PREFIX}_request_blocks",
                "Blocks of each live request by kind (opt-in, capped, live requests only).",
                labels=["req_id", "kind"],
            )
            for row in snap.live_requests[: self._max_live]:
                for kind, value in (
                    ("pinned", row.pinned), ("pending", row.pending),
                    ("loaded", row.loaded), ("stored", row.stored),
                ):  # fmt: skip
                    table.add_metric([row.req_id, kind], value)
            yield table


def _tier_families(reports: Mapping[str, TierReport]) -> Iterator[Metric]:
    """The families every lower tier exports, by ``tier`` (``TierReport``)."""
    labels = ["tier"]

    def gauge(name: str, doc: str, value: Callable[[TierReport], int | None]) -> Metric:
        family = GaugeMetricFamily(f"{PREFIX}_tier_{name}", doc, labels=labels)
        for tier, report in reports.items():
            v = value(report)
            if v is not None:
                family.add_metric([tier], v)
        return family

    def counter(name: str, doc: str, value: Callable[[TierReport], int]) -> Metric:
        family = CounterMetricFamily(f"{PREFIX}_tier_{name}", doc, labels=labels)
        for tier, report in reports.items():
            family.add_metric([tier], value(report))
        return family

    yield gauge(
        "up",
        "1 while the tier serves (ok), 0 while degraded (what it still does: /readyz details).",
        lambda r: 1 if r.up else 0,
    )
    yield gauge("blocks", "Blocks the tier holds, loadable (tiers that know).", lambda r: r.blocks)
    yield gauge(
        "capacity_blocks",
        "Blocks the tier can hold (tiers that know).",
        lambda r: r.capacity_blocks,
    )
    yield gauge(
        "queue_depth", "Demoted blocks waiting to be written to the tier.", lambda r: r.queue_depth
    )
    yield counter(
        "demoted_blocks", "Blocks written to the tier (demoted, or written behind).",
        lambda r: r.demoted,
    )  # fmt: skip
    dropped = CounterMetricFamily(
        f"{PREFIX}_tier_demotions_dropped",
        "Blocks the tier was given and did not write, by reason (degraded, staging_full, "
        "no_room, write_failed, queue_full, shutdown, duplicate).",
        labels=["tier", "reason"],
    )
    for tier, report in reports.items():
        for reason, n in sorted(report.dropped.items()):
            dropped.add_metric([tier, reason], n)
    yield dropped
    yield counter(
        "promoted_blocks", "Blocks brought from the tier into the pool for a load.",
        lambda r: r.promoted,
    )  # fmt: skip
    yield counter("bytes_read", "Bytes read from the tier into the pool.", lambda r: r.bytes_read)
    yield counter(
        "bytes_written", "Bytes written from the pool to the tier.", lambda r: r.bytes_written
    )
    yield counter("incidents", "Times the tier went from ok to degraded.", lambda r: r.incidents)


class _CounterSeries:
    """One labelled counter: its value, when it was created, the last observation's exemplar."""

    __slots__ = ("created", "ex_id", "ex_time", "ex_value", "value")

    def __init__(self, now: float) -> None:
        self.value = 0.0
        self.created = now
        self.ex_id: str | None = None
        self.ex_value = 0.0
        self.ex_time = 0.0


class _HistogramSeries:
    """One labelled histogram: per-bucket counts (not cumulative), sum, exemplar per bucket."""

    __slots__ = ("counts", "created", "exemplars", "sum")

    def __init__(self, buckets: int, now: float) -> None:
        self.counts = [0] * buckets
        self.sum = 0.0
        self.created = now
        self.exemplars: list[tuple[str, float, float] | None] = [None] * buckets


class _Counter:
    """A counter family whose children are plain Python objects, read at scrape time."""

    def __init__(self, name: str, documentation: str, labels: tuple[str, ...]) -> None:
        self.name = name
        self.documentation = documentation
        self.labels = labels
        self.series: dict[tuple[str, ...], _CounterSeries] = {}

    def inc(self, labels: tuple[str, ...], amount: float, req_id: str | None, now: float) -> None:
        series = self.series.get(labels)
        if series is None:
            series = self.series[labels] = _CounterSeries(now)
        series.value += amount
        if req_id is not None:
            series.ex_id, series.ex_value, series.ex_time = req_id, amount, now

    def family(self) -> CounterMetricFamily:
        family = CounterMetricFamily(self.name, self.documentation, labels=list(self.labels))
        for labels, series in self.series.items():
            ex = (
                None
                if series.ex_id is None
                else Exemplar({"req_id": series.ex_id}, series.ex_value, series.ex_time)
            )
            family.add_metric(labels, series.value, created=series.created, exemplar=ex)
        return family


class _Histogram:
    """A histogram family whose children are plain Python objects, read at scrape time."""

    def __init__(
        self, name: str, documentation: str, labels: tuple[str, ...], buckets: tuple[float, ...]
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.labels = labels
        self.bounds = (*buckets, math.inf)
        self.le = [le_label(b) for b in self.bounds]
        self.series: dict[tuple[str, ...], _HistogramSeries] = {}

    def observe(
        self, labels: tuple[str, ...], value: float, req_id: str | None, now: float
    ) -> None:
        series = self.series.get(labels)
        if series is None:
            series = self.series[labels] = _HistogramSeries(len(self.bounds), now)
        i = bisect_left(self.bounds, value)  # the first bucket whose bound is >= value
        series.counts[i] += 1
        series.sum += value
        if req_id is not None:
            series.exemplars[i] = (req_id, value, now)

    def family(self) -> HistogramMetricFamily:
        family = HistogramMetricFamily(self.name, self.documentation, labels=list(self.labels))
        for labels, series in self.series.items():
            buckets: list[Any] = []
            total = 0
            for le, count, ex in zip(self.le, series.counts, series.exemplars, strict=True):
                total += count
                if ex is None:
                    buckets.append((le, total))
                else:
                    buckets.append((le, total, Exemplar({"req_id": ex[0]}, ex[1], ex[2])))
            family.add_metric(labels, buckets, series.sum)
            family.samples.append(
                Sample(
                    f"{self.name}_created",
                    dict(zip(self.labels, labels, strict=True)),
                    series.created,
                    None,
                )
            )
        return family


class _CallCollector(Collector):
    """Exports the per-call families from their plain-Python children."""

    def __init__(self, families: list[_Counter | _Histogram]) -> None:
        self._families = families

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        for family in self._families:
            yield family.family()


class Metrics:
    """Every metric of one service instance, registered in ``registry``.

    The per-call instruments are plain Python counters and bucket arrays updated in place
    (a dict lookup and a few additions per observation, the exemplar kept as three fields) and
    turned into metric families when the registry is collected. prometheus_client's own
    ``Counter``/``Histogram`` take a lock and validate and allocate an exemplar on every
    observation, several times the cost of the manager call being observed. The price: like
    the manager, a ``Metrics`` is not thread-safe; the service observes and is scraped on its
    event loop only.
    """

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        *,
        snapshot: Callable[[], ServiceSnapshot] | None = None,
        live_request_series: bool = False,
        max_live_series: int = 500,
        clock: Callable[[], float] = time.time,
        tiers: Sequence[str] = (),
    ) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self._clock = clock
        self.http_requests = _Counter(
            f"{PREFIX}_http_requests", "HTTP calls by route template, method and status.",
            ("route", "method", "status"),
        )  # fmt: skip
        self.http_duration = _Histogram(
            f"{PREFIX}_http_request_duration_seconds", "HTTP call latency by route and method.",
            ("route", "method"), LATENCY_BUCKETS,
        )  # fmt: skip
        self.manager_ops = _Counter(
            f"{PREFIX}_manager_ops", "Manager operations by result (ok, error, refused).",
            ("op", "result"),
        )  # fmt: skip
        self.manager_keys = _Counter(
            f"{PREFIX}_manager_keys", "Keys handled by manager operations, by result.",
            ("op", "result"),
        )  # fmt: skip
        self.transfer_jobs = _Counter(
            f"{PREFIX}_transfer_jobs", "Finished transfer jobs by direction and result.",
            ("direction", "result"),
        )  # fmt: skip
        self.transfer_bytes = _Counter(
            f"{PREFIX}_transfer_bytes", "Bytes moved by successful transfer jobs.",
            ("direction",),
        )  # fmt: skip
        self.transfer_duration = _Histogram(
            f"{PREFIX}_transfer_duration_seconds", "Transfer job duration by direction.",
            ("direction",), TRANSFER_BUCKETS,
        )  # fmt: skip
        self.transfer_failures = _Counter(
            f"{PREFIX}_transfer_failures", "Failed transfer jobs by direction and reason.",
            ("direction", "reason"),
        )  # fmt: skip
        self.policy_switches = _Counter(
            f"{PREFIX}_policy_switches", "Live policy switches.", ("from_policy", "to_policy")
        )
        # Only with tiers below the pool (the families would otherwise be exported empty).
        self.tier_io_duration = _Histogram(
            f"{PREFIX}_tier_io_duration_seconds",
            "I/O calls of the tiers below the pool, by tier and op (disk: read, a promotion, and "
            "write, demotions; remote: exists, a lookup's question, get, put, sweep); the "
            "exemplar names the engine request that caused it.",
            ("tier", "op"), TRANSFER_BUCKETS,
        )  # fmt: skip
        self.tier_io_keys = _Counter(
            f"{PREFIX}_tier_io_keys", "Keys (blocks) named by the tiers' I/O calls, by op.",
            ("tier", "op"),
        )  # fmt: skip
        self.registry.register(
            _CallCollector(
                [
                    self.http_requests,
                    self.http_duration,
                    self.manager_ops,
                    self.manager_keys,
                    self.transfer_jobs,
                    self.transfer_bytes,
                    self.transfer_duration,
                    self.transfer_failures,
                    self.policy_switches,
                    *((self.tier_io_duration, self.tier_io_keys) if tiers else ()),
                ]
            )
        )
        # Label tuples of HTTP calls by (route, method, status): no str(status) per call.
        self._http_labels: dict[tuple[str, str, int], tuple[str, str, str]] = {}
        if snapshot is not None:
            self.registry.register(_StateCollector(snapshot, live_request_series, max_live_series))

    def http_call(
        self, route: str, method: str, status: int, seconds: float, req_id: str | None
    ) -> None:
        """One HTTP call: counter by status, latency histogram, both with the exemplar."""
        ex = exemplar_id(req_id)
        now = self._clock()
        key = (route, method, status)
        labels = self._http_labels.get(key)
        if labels is None:
            labels = self._http_labels[key] = (route, method, str(status))
        self.http_requests.inc(labels, 1, ex, now)
        self.http_duration.observe(labels[:2], seconds, ex, now)

    def manager_op(
        self,
        op: str,
        result: str,
        req_id: str | None,
        keys: dict[str, int] | None = None,
    ) -> None:
        """One manager operation and, optionally, its key counts by result (zero counts make
        no series)."""
        ex = exemplar_id(req_id)
        now = self._clock()
        self.manager_ops.inc((op, result), 1, ex, now)
        if keys:
            inc = self.manager_keys.inc
            for key_result, count in keys.items():
                if count:
                    inc((op, key_result), count, ex, now)

    def transfer_done(
        self,
        direction: str,
        ok: bool,
        nbytes: int,
        seconds: float,
        reason: str | None,
        req_id: str | None,
    ) -> None:
        """One finished transfer job; ``reason`` is reduced to a bounded label."""
        ex = exemplar_id(req_id)
        now = self._clock()
        self.transfer_jobs.inc((direction, "ok" if ok else "failed"), 1, ex, now)
        self.transfer_duration.observe((direction,), seconds, ex, now)
        if ok:
            self.transfer_bytes.inc((direction,), nbytes, ex, now)
        else:
            self.transfer_failures.inc((direction, failure_reason(reason)), 1, ex, now)

    def policy_switched(self, from_policy: str, to_policy: str) -> None:
        """One effective live policy switch."""
        self.policy_switches.inc((from_policy, to_policy), 1, None, self._clock())

    def tier_io(self, tier: str, op: str, seconds: float, keys: int, req_id: str | None) -> None:
        """One I/O call of lower tier ``tier``: its latency and keys (or blocks), the engine
        request as exemplar."""
        ex = exemplar_id(req_id)
        now = self._clock()
        self.tier_io_duration.observe((tier, op), seconds, ex, now)
        self.tier_io_keys.inc((tier, op), keys, ex, now)


class _TenancyCollector(Collector):
    """The tenants file's reloads, for the front registry of a service with tenants."""

    def __init__(self, counts: Callable[[], tuple[int, int, bool]]) -> None:
        self._counts = counts

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        reloads, failures, in_force = self._counts()
        yield GaugeMetricFamily(
            f"{PREFIX}_tenants_file_in_force",
            "1 when the tenants file as it is now is the one in force; 0 when its last change "
            "was refused (the previous tenants still apply).",
            value=1 if in_force else 0,
        )
        yield CounterMetricFamily(
            f"{PREFIX}_tenants_reloads", "Reloads of the tenants file that took effect.",
            value=reloads,
        )  # fmt: skip
        yield CounterMetricFamily(
            f"{PREFIX}_tenants_reload_failures",
            "Reloads of the tenants file refused (the previous tenants stayed in force).",
            value=failures,
        )


def register_tenancy(
    registry: CollectorRegistry, counts: Callable[[], tuple[int, int, bool]]
) -> None:
    """Export ``counts() -> (reloads, failures, in force)`` of the tenants file."""
    registry.register(_TenancyCollector(counts))


# Why a listener's bounds (``app.http.connections``) closed a connection: the closed set of
# values of the ``reason`` label, every one exported from the start (at 0) so rates and alerts
# see a series before the first close.
CONNECTION_CLOSE_REASONS = ("head_timeout", "body_timeout", "peer_cap", "listener_cap")


@dataclass(frozen=True, slots=True)
class ListenerConnections:
    """One listener's connections as a scrape reads them: ``open`` now, its cap ``limit``, and
    ``closed``: those its bounds closed, by reason (keys of ``CONNECTION_CLOSE_REASONS``)."""

    listener: str
    open: int
    limit: int
    closed: Mapping[str, int]


class _ConnectionCollector(Collector):
    """The listeners' connections, read at scrape time (the accept path pays nothing)."""

    def __init__(self, listeners: Callable[[], Sequence[ListenerConnections]]) -> None:
        self._listeners = listeners

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        rows = self._listeners()
        opened = GaugeMetricFamily(
            f"{PREFIX}_connections_open",
            "Connections open on each listener (engine: TCP and the Unix socket together).",
            labels=["listener"],
        )
        limit = GaugeMetricFamily(
            f"{PREFIX}_connections_max",
            "Connections each listener keeps open at most (more are closed as they come).",
            labels=["listener"],
        )
        closed = CounterMetricFamily(
            f"{PREFIX}_connections_closed",
            "Connections the service closed, by listener and reason: head_timeout (request "
            "head not complete in time), body_timeout (request body not complete in time), "
            "peer_cap (the peer held its most), listener_cap (the listener held its most).",
            labels=["listener", "reason"],
        )
        for row in rows:
            opened.add_metric([row.listener], row.open)
            limit.add_metric([row.listener], row.limit)
            for reason in CONNECTION_CLOSE_REASONS:
                closed.add_metric([row.listener, reason], row.closed.get(reason, 0))
        yield opened
        yield limit
        yield closed


def register_connections(
    registry: CollectorRegistry, listeners: Callable[[], Sequence[ListenerConnections]]
) -> None:
    """Export ``listeners()``, one ``ListenerConnections`` per listener, at each scrape."""
    registry.register(_ConnectionCollector(listeners))


class _KVEventsCollector(Collector):
    """The KV-event publisher's counts, read at scrape time (``offer`` pays nothing more)."""

    def __init__(self, counts: Callable[[], tuple[int, int, int]]) -> None:
        self._counts = counts

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        published, dropped, replays = self._counts()
        yield CounterMetricFamily(
            f"{PREFIX}_kv_events_published",
            "KV events sent to routers on the ZMQ publisher (--kv-events-endpoint).",
            value=published,
        )
        yield CounterMetricFamily(
            f"{PREFIX}_kv_events_dropped",
            "KV events not sent to routers: their batch found the publisher's queue full "
            "(--kv-events-queue-batches) or could not be sent.",
            value=dropped,
        )
        yield CounterMetricFamily(
            f"{PREFIX}_kv_events_replays",
            "Replay requests the publisher answered (--kv-events-replay-endpoint).",
            value=replays,
        )


def register_kv_events(
    registry: CollectorRegistry, counts: Callable[[], tuple[int, int, int]]
) -> None:
    """Export ``counts() -> (published, dropped, replays)`` of the KV-event publisher."""
    registry.register(_KVEventsCollector(counts))
