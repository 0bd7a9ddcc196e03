"""What the tier's three threads share (``Shared``: settings, the client, the fault state, the
queues between the threads, the counters, jobs' ends), and the records they pass: per-key probes,
jobs, a step's bundle of work, copies and the completions they owe; the tier's metric names."""

from __future__ import annotations

import collections
import json
import logging
import os
import queue
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    Locality,
    OffloadingCounterMetadata,
    OffloadingEvent,
    OffloadingGaugeMetadata,
    OffloadingMetricMetadata,
    OffloadKey,
)
from vllm.v1.kv_offload.tiering.base import JobResult

if TYPE_CHECKING:
    import numpy as np

    from kvoffload_client.client import KVOffloadClient

import httpx

from kvoffload_client.attach import MappedPool, parse_url
from kvoffload_client.pool_socket import default_pool_socket

log = logging.getLogger("kvoffload.vllm_tier")

OWNERSHIP = "kvoffload"  # of the KV events the tier reports to vLLM


# Metric names this tier reports through vLLM (build_metric_definitions / get_stats).
M_CALLS = "vllm:kv_offload_kvoffload_http_calls"
M_FAULTS = "vllm:kv_offload_kvoffload_faults"
M_STORES_DROPPED = "vllm:kv_offload_kvoffload_stores_dropped_blocks"
M_LOADS_FAILED = "vllm:kv_offload_kvoffload_loads_failed_blocks"
M_AVAILABLE = "vllm:kv_offload_kvoffload_available"
M_PREFETCHES = "vllm:kv_offload_kvoffload_prefetches"
#: The pool's own lookup answers. Any other answer names the tier below the pool that holds
#: the key (``disk``, ``remote``, or whatever tier the service runs): a prepare-load promotes it.
POOL_STATES = frozenset(("hit", "pending", "miss"))


def service_client(
    url: str,
    *,
    pool_socket: str | None,
    token_file: str | None,
    service_namespace: str | None,
    timeout_s: float,
    connect_timeout_s: float,
) -> tuple[KVOffloadClient, str | None]:
    """A client of the service at ``url`` (``unix:///path`` or ``http(s)://``) and the pool
    socket's path: ``pool_socket``, else the engine socket's neighbour for a ``unix://`` URL,
    else None. The token file is ``token_file``, else ``$KVOFFLOAD_TOKEN_FILE``; the client
    reads it, and again after a 401 that a rotated token cures."""
    from kvoffload_client.client import KVOffloadClient

    base_url, uds = parse_url(url)
    if pool_socket is None and uds is not None:
        pool_socket = default_pool_socket(uds)
    client = KVOffloadClient(
        base_url,
        uds=uds,
        timeout=httpx.Timeout(timeout_s, connect=connect_timeout_s),
        token_file=token_file or os.environ.get(TOKEN_FILE_ENV) or None,
        namespace=service_namespace,
    )
    return client, pool_socket


def block_size_refusal(block_bytes: int, stride: int) -> str:
    """Why a pool of ``block_bytes`` a block cannot hold vLLM's chunk rows of ``stride`` bytes,
    and the fix; the engine is refused with it (docs/vllm.md quotes it)."""
    return (
        f"kvoffload pool block size is {block_bytes} bytes but vLLM's chunk row stride is "
        f"{stride} bytes; start kvoffload with --block-bytes {stride} (or change vLLM's "
        "block_size / blocks_per_chunk)"
    )


def in_lower_tier(state: str | None) -> bool:
    """Whether a lookup answer names a tier below the pool (any name the pool does not use)."""
    return state is not None and state not in POOL_STATES


def not_yet(state: str | None) -> bool:
    """Whether a lookup answer is asked again while the probe may still wait: a key being
    stored, or one a lower tier holds (being promoted)."""
    return state == "pending" or in_lower_tier(state)


PENDING_WAIT_S = 0.5  # a key another engine is storing is asked again this long, then MISS
#: How long the service holds what a request's prefetch brought up for the request's load
#: (the tier's ``prefetch_deadline_s`` default; 0 turns prefetches off).
PREFETCH_DEADLINE_S = 10.0
TOKEN_FILE_ENV = "KVOFFLOAD_TOKEN_FILE"  # where token_file comes from when the config has none


# What the tier reports through vLLM's stats (``build_metric_definitions``, ``get_stats``).
METRIC_DEFINITIONS: dict[str, OffloadingMetricMetadata] = {
    M_CALLS: OffloadingCounterMetadata(
        documentation="HTTP calls the kvoffload tier made, by kind (batch, events, pool).",
        labelnames=("kind",),
    ),
    M_FAULTS: OffloadingCounterMetadata(
        documentation="Failed kvoffload calls or ops, by reason.",
        labelnames=("reason",),
    ),
    M_STORES_DROPPED: OffloadingCounterMetadata(
        documentation="Blocks the kvoffload tier did not store because of a fault or "
        "no room in the service.",
    ),
    M_LOADS_FAILED: OffloadingCounterMetadata(
        documentation="Blocks whose load from kvoffload failed (recomputed instead).",
    ),
    M_AVAILABLE: OffloadingGaugeMetadata(
        documentation="1 while the kvoffload service answers, 0 during a fault.",
    ),
    M_PREFETCHES: OffloadingCounterMetadata(
        documentation="Prefetches the kvoffload tier asked for (a request's first lookup, "
        "counted when keys lay in a tier below the service's pool), by outcome: started, "
        "refused (the service's bound on prefetching keys; promoted instead), failed (an error "
        "or no answer).",
        labelnames=("outcome",),
    ),
}

# --------------------------------------------------------------------------- shared state


class Probe:
    """One key's lookup: ``result`` None while asked, then True (hit) or False (miss);
    ``pending_since`` is when the service first answered "pending" (a store in flight)."""

    __slots__ = ("pending_since", "reqs", "result")

    def __init__(self) -> None:
        self.result: bool | None = None
        self.reqs: set[str] = set()
        self.pending_since = 0.0


class Job:
    """A vLLM transfer job in flight. ``lock`` orders the copy thread starting it against the
    scheduler cancelling it (deadline, drain): a job is copied or cancelled, never both."""

    __slots__ = ("copying", "deadline", "ended", "job_id", "keys", "load")

    def __init__(
        self, job_id: int, load: bool, keys: tuple[OffloadKey, ...], deadline: float
    ) -> None:
        self.job_id = job_id
        self.load = load
        self.keys = keys
        self.deadline = deadline
        self.copying = False
        self.ended = False


@dataclass
class Step:
    """What one scheduler step hands the link thread."""

    starts: dict[str, dict[str, Any] | None] = field(default_factory=dict)
    lookups: dict[str, list[ProbeRef]] = field(default_factory=dict)
    stores: list[Transfer] = field(default_factory=list)
    loads: list[Transfer] = field(default_factory=list)
    touches: dict[str, list[OffloadKey]] = field(default_factory=dict)
    finishes: list[str] = field(default_factory=list)

    def empty(self) -> bool:
        return not (
            self.starts
            or self.lookups
            or self.stores
            or self.loads
            or self.touches
            or self.finishes
        )

    def merge(self, other: Step) -> None:
        self.starts.update(other.starts)
        for req_id, refs in other.lookups.items():
            self.lookups.setdefault(req_id, []).extend(refs)
        self.stores.extend(other.stores)
        self.loads.extend(other.loads)
        for req_id, keys in other.touches.items():
            self.touches.setdefault(req_id, []).extend(keys)
        self.finishes.extend(other.finishes)


ProbeRef = tuple[OffloadKey, Probe]


@dataclass
class Transfer:
    job: Job
    req_id: str
    keys: tuple[OffloadKey, ...]
    chunk_ids: Any  # numpy array of primary chunk ids, parallel to keys


@dataclass
class Copy:
    """Copy-thread work: ``pairs`` of (pool slot, primary chunk); ``keys`` are service keys."""

    transfer: Transfer
    pool: MappedPool
    slots: list[int]
    chunks: list[int]
    skeys: list[bytes]


@dataclass
class Done:
    """A copy that ended, for the link thread: the completion op to send."""

    req_id: str
    load: bool
    skeys: list[bytes]
    pool_id: str
    success: bool


@dataclass
class Counters:
    """Cumulative counts by (metric, label), added to by all three threads; ``get_stats``
    reports them as deltas (``stats``)."""

    values: dict[tuple[str, str], int] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    reported: dict[tuple[str, str], int] = field(default_factory=dict)

    def add(self, metric: str, label: str = "", n: int = 1) -> None:
        with self.lock:
            self.values[metric, label] = self.values.get((metric, label), 0) + n

    def snapshot(self) -> dict[tuple[str, str], int]:
        with self.lock:
            return dict(self.values)

    def stats(self, available: bool) -> OffloadingConnectorStats:
        """vLLM's stats: what was counted since the last call, and ``M_AVAILABLE``."""
        stats = OffloadingConnectorStats()
        current = self.snapshot()
        for (metric, label), value in current.items():
            delta = value - self.reported.get((metric, label), 0)
            if delta:
                stats.increase_counter(metric, delta, (label,) if label else ())
        self.reported = current
        stats.set_gauge(M_AVAILABLE, 1.0 if available else 0.0)
        return stats


def sendable_params(
    params: Mapping[str, Any] | None, max_bytes: int, counters: Counters
) -> Mapping[str, Any] | None:
    """``kv_transfer_params`` as sent, or None (counted) when the service would refuse them (not
    JSON, or over its ``max_bytes``), and with them the whole call."""
    if params is None:
        return None
    try:
        size = len(json.dumps(params, separators=(",", ":")))
    except (TypeError, ValueError):
        size = -1
    if 0 <= size <= max_bytes:
        return params
    counters.add(M_FAULTS, "transfer_params_dropped")
    return None


class Incident:
    """Logs a fault once when it starts and once when it ends, counting what happened between."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.active = False
        self.refused = False  # the service refused this engine's credentials in this incident
        self.failures = 0
        self.lock = threading.Lock()

    def fail(self, reason: str, refused: bool = False) -> None:
        """Record a failure. Logged when it starts an incident, and as an error the first time
        in an incident that the service refused the engine's credentials (``refused``)."""
        with self.lock:
            self.failures += 1
            starts, self.active = not self.active, True
            shout = refused and not self.refused
            self.refused = self.refused or refused
        if shout:
            log.error(
                "kvoffload tier %s: %s; answering MISS and dropping stores until it accepts "
                "them (check the tier's token_file and service_namespace)",
                self.name,
                reason,
            )
        elif starts:
            log.warning(
                "kvoffload tier %s: %s; answering MISS and dropping stores until it recovers",
                self.name,
                reason,
            )

    def ok(self, dropped_blocks: int) -> None:
        with self.lock:
            if not self.active:
                return
            self.active = self.refused = False
            failures, self.failures = self.failures, 0
        log.warning(
            "kvoffload tier %s: service back after %d failed calls (%d store blocks dropped "
            "in total so far)",
            self.name,
            failures,
            dropped_blocks,
        )


def in_parts(items: Sequence[Any], size: int) -> Iterable[Sequence[Any]]:
    """``items`` in slices of at most ``size`` (the service's keys-per-op limit)."""
    for i in range(0, len(items), size):
        yield items[i : i + size]


class Shared:
    """What the scheduler, link and copy threads of one tier share.

    Settings (read only): ``client``, ``prefix`` (the key namespace digest), ``block_size_bytes``,
    ``max_keys`` (per op), ``max_params`` (bytes of ``kv_transfer_params``), ``retry_interval_s``,
    ``events_enabled`` / ``events_interval_s``, ``locality``, ``pool_socket``,
    ``service_namespace``, ``prefetch_deadline_s`` (0: no prefetches). Fault state:
    ``incident``, ``down_until`` (lookups MISS and stores drop until this monotonic time),
    ``disabled`` (set for good by a configuration error).
    Between the threads: ``inbox`` (steps, scheduler to link; None stops it), ``done`` (ended
    copies whose completions the link sends), ``results`` (jobs' ends, for the scheduler),
    ``events`` (KV events for vLLM). ``primary`` is vLLM's primary tier, one row per chunk.
    GIL-atomic operations only, or under ``job_lock``.
    """

    def __init__(
        self,
        *,
        client: KVOffloadClient,
        url: str,
        prefix: bytes,
        primary: np.ndarray,
        block_size_bytes: int,
        max_keys: int,
        max_params: int,
        retry_interval_s: float,
        events_enabled: bool,
        events_interval_s: float,
        locality: Locality | None,
        pool_socket: str | None,
        service_namespace: str | None,
        prefetch_deadline_s: float = 0.0,
    ) -> None:
        self.client = client
        self.prefix = prefix
        self.primary = primary
        self.block_size_bytes = block_size_bytes
        self.max_keys = max_keys
        self.max_params = max_params
        self.retry_interval_s = retry_interval_s
        self.events_enabled = events_enabled
        self.events_interval_s = events_interval_s
        self.locality = locality
        self.pool_socket = pool_socket
        self.service_namespace = service_namespace
        self.prefetch_deadline_s = prefetch_deadline_s
        self.counters = Counters()
        self.incident = Incident(url)
        self.down_until = 0.0
        self.disabled: str | None = None
        self.job_lock = threading.Lock()
        self.inbox: queue.SimpleQueue[Step | None] = queue.SimpleQueue()
        self.done: collections.deque[Done] = collections.deque()
        self.results: queue.SimpleQueue[tuple[JobResult, tuple[OffloadKey, ...] | None]] = (
            queue.SimpleQueue()
        )
        self.events: collections.deque[OffloadingEvent] = collections.deque()

    def unavailable(self) -> bool:
        """Whether the tier answers MISS and drops stores now (fault back-off, disabled)."""
        return self.disabled is not None or time.monotonic() < self.down_until

    def finish_job(
        self, job: Job, success: bool, seconds: float | None = None, nbytes: int | None = None
    ) -> None:
        """Report a job's end once (link or copy thread). The result is queued under the job
        lock, so once the scheduler's drain sees a job ended its result is there to collect."""
        result = JobResult(
            job_id=job.job_id, success=success, transfer_time=seconds, transfer_bytes=nbytes
        )
        with self.job_lock:
            if job.ended:
                return
            job.ended = True
            self.results.put((result, job.keys if job.load and not success else None))
        if not success:
            self.counters.add(M_LOADS_FAILED if job.load else M_STORES_DROPPED, "", len(job.keys))
