"""Prometheus metrics of the service, ``kvoffload_`` prefix, registry injected.

Two kinds of metric, two mechanisms:

- **Per-call** counters and histograms (HTTP calls, manager operations and keys, transfer jobs,
  policy switches) are updated by the code that does the work, each observation made for a
  request carrying an OpenMetrics exemplar ``{req_id="..."}``. Label children are cached, so an
  observation costs a dict lookup and the instrument's own update.
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

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from manager import ManagerStats, PolicyInfo

PREFIX = "kvoffload"
# Latency buckets from 50 us (an in-process manager call) to 2.5 s (a long-poll or a slow copy).
LATENCY_BUCKETS = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
    0.5, 1.0, 2.5,
)  # fmt: skip
TRANSFER_BUCKETS = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 30.0)
# OpenMetrics caps an exemplar's label set at 128 characters; ``req_id=`` takes 6.
_EXEMPLAR_ID = re.compile(r"[A-Za-z0-9._:\-]{1,120}")


FAILURE_REASONS = ("deadline", "shutdown", "injected")


def failure_reason(reason: str | None) -> str:
    """The bounded label for a failure reason: a known kind it starts with, else ``error``."""
    if reason:
        lowered = reason.lower()
        for kind in FAILURE_REASONS:
            if lowered.startswith(kind):
                return kind
    return "error"


def exemplar(req_id: str | None) -> dict[str, str] | None:
    """The exemplar label set for ``req_id``, or None when it cannot be one (bad charset or
    length): an observation is never refused for its exemplar."""
    if req_id and _EXEMPLAR_ID.fullmatch(req_id):
        return {"req_id": req_id}
    return None


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
            "Prefix hit ratio each policy reaches in the shadow simulation (recent window).",
            labels=["policy"],
        )
        for name, ratio in sorted(snap.projected_hit_ratio.items()):
            projected.add_metric([name], ratio)
        yield projected
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


class Metrics:
    """Every metric of one service instance, registered in ``registry``."""

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        *,
        snapshot: Callable[[], ServiceSnapshot] | None = None,
        live_request_series: bool = False,
        max_live_series: int = 500,
    ) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        reg = self.registry
        self.http_requests = Counter(
            f"{PREFIX}_http_requests", "HTTP calls by route template, method and status.",
            ["route", "method", "status"], registry=reg,
        )  # fmt: skip
        self.http_duration = Histogram(
            f"{PREFIX}_http_request_duration_seconds", "HTTP call latency by route and method.",
            ["route", "method"], buckets=LATENCY_BUCKETS, registry=reg,
        )  # fmt: skip
        self.manager_ops = Counter(
            f"{PREFIX}_manager_ops", "Manager operations by result (ok, error, refused).",
            ["op", "result"], registry=reg,
        )  # fmt: skip
        self.manager_keys = Counter(
            f"{PREFIX}_manager_keys", "Keys handled by manager operations, by result.",
            ["op", "result"], registry=reg,
        )  # fmt: skip
        self.transfer_jobs = Counter(
            f"{PREFIX}_transfer_jobs", "Finished transfer jobs by direction and result.",
            ["direction", "result"], registry=reg,
        )  # fmt: skip
        self.transfer_bytes = Counter(
            f"{PREFIX}_transfer_bytes", "Bytes moved by successful transfer jobs.",
            ["direction"], registry=reg,
        )  # fmt: skip
        self.transfer_duration = Histogram(
            f"{PREFIX}_transfer_duration_seconds", "Transfer job duration by direction.",
            ["direction"], buckets=TRANSFER_BUCKETS, registry=reg,
        )  # fmt: skip
        self.transfer_failures = Counter(
            f"{PREFIX}_transfer_failures", "Failed transfer jobs by direction and reason.",
            ["direction", "reason"], registry=reg,
        )  # fmt: skip
        self.policy_switches = Counter(
            f"{PREFIX}_policy_switches", "Live policy switches.",
            ["from_policy", "to_policy"], registry=reg,
        )  # fmt: skip
        self._counters: dict[tuple[object, ...], Counter] = {}
        self._histograms: dict[tuple[object, ...], Histogram] = {}
        if snapshot is not None:
            reg.register(_StateCollector(snapshot, live_request_series, max_live_series))

    def _counter(self, metric: Counter, *labels: str) -> Counter:
        key = (id(metric), *labels)
        child = self._counters.get(key)
        if child is None:
            child = self._counters[key] = metric.labels(*labels)
        return child

    def _histogram(self, metric: Histogram, *labels: str) -> Histogram:
        key = (id(metric), *labels)
        child = self._histograms.get(key)
        if child is None:
            child = self._histograms[key] = metric.labels(*labels)
        return child

    def http_call(
        self, route: str, method: str, status: int, seconds: float, req_id: str | None
    ) -> None:
        """One HTTP call: counter by status, latency histogram, both with the exemplar."""
        ex = exemplar(req_id)
        self._counter(self.http_requests, route, method, str(status)).inc(1, ex)
        self._histogram(self.http_duration, route, method).observe(seconds, ex)

    def manager_op(
        self,
        op: str,
        result: str,
        req_id: str | None,
        keys: dict[str, int] | None = None,
    ) -> None:
        """One manager operation and, optionally, its key counts by result."""
        ex = exemplar(req_id)
        self._counter(self.manager_ops, op, result).inc(1, ex)
        if keys:
            for key_result, count in keys.items():
                if count:
                    self._counter(self.manager_keys, op, key_result).inc(count, ex)

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
        ex = exemplar(req_id)
        self._counter(self.transfer_jobs, direction, "ok" if ok else "failed").inc(1, ex)
        self._histogram(self.transfer_duration, direction).observe(seconds, ex)
        if ok:
            self._counter(self.transfer_bytes, direction).inc(nbytes, ex)
        else:
            self._counter(self.transfer_failures, direction, failure_reason(reason)).inc(1, ex)

    def policy_switched(self, from_policy: str, to_policy: str) -> None:
        """One effective live policy switch."""
        self.policy_switches.labels(from_policy, to_policy).inc()
