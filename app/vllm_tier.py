"""kvoffload as a secondary tier of vLLM 0.33's tiering offloading connector.

``KVOffloadTier`` is a ``SecondaryTierManager`` that vLLM loads by ``type`` + ``module_path``
from ``kv_connector_extra_config["secondary_tiers"]``; several engines on a node then share one
kvoffload service and its host pool. It imports vLLM, httpx, numpy, ``app.client`` and
``app.block_copy`` only (never the server's code), so it runs in an engine's environment.

Threads and guarantees:

- **Scheduler thread** (vLLM calls every tier method under its manager lock): methods only read
  and write in-memory state and enqueue work; none does I/O or waits. ``lookup`` answers RETRY
  for a key it has not asked the service about yet, then HIT or MISS once the answer is in.
  ``on_schedule_end`` hands the step's work (new requests, lookups, store and load jobs, touches,
  finished requests) to the link thread as one bundle.
- **Link thread**: per bundle (bundles that queued up meanwhile are merged) at most one
  ``POST /v1/batch`` carrying every op of the step, each op under its vLLM ``req_id``: starts
  (with ``kv_transfer_params``), lookups, prepare-store, prepare-load, touches, the
  complete-store / complete-load of copies finished since the last call, and finishes. Every
  call has a connect and a read timeout.
- **Copy thread**: copies between vLLM's primary tier (``primary_kv_view[chunk]``, host memory)
  and the service's host pool, mapped into this process. Stores: prepare-store, copy,
  complete-store. Loads: prepare-load (pins), copy, complete-load. The service never touches the
  engine's memory.

Faults (service down, slow past ``timeout_s``, restarted, answering errors): the step's jobs
fail (``success=False``: a failed load is never reported loaded, and its keys answer MISS from
then on), lookups answer MISS and stores are dropped for ``retry_interval_s`` (doubling while
the fault lasts), counted, and logged once per incident. A refusal of the engine's credentials
(401, 403, or the pool socket's refusal) is such a fault, logged as an error naming the reason.
A request whose prepare ops had an unknown outcome is aborted in the service once none of its
copies is running; a dead engine's leases expire in the service by its lease TTL. A job not
copied by ``job_deadline_s`` fails.

A restarted service serves a new pool: each answer's ``X-KVOffload-Pool`` header (or, for
services without it, the identity of the pool file) is compared with the mapped pool; on a
mismatch that call's store and load jobs fail (their reservations are released in the new
service without a copy), completions meant for the old pool are dropped, and the pool is
mapped again before the next call.

Lower tiers (a service run with ``--disk-dir`` or ``--remote-tier``): a key the service answers
``disk`` or ``remote`` for is asked to be brought into the pool (a prepare-load, whose 409 is
expected) and looked up again like a pending one (RETRY meanwhile), so a prefix the node's disk
holds, or another node stored, becomes a HIT here.

Keys: the service key of a vLLM ``OffloadKey`` is an 8-byte namespace digest followed by the key
(see ``namespace_digest``), so engines share blocks exactly when model, dtype, layout and chunk
size agree.

Tenants: with ``token_file`` (else ``$KVOFFLOAD_TOKEN_FILE``; read at start, and again when the
service refuses the token as unknown or revoked, so a rotated token needs no restart) every call
and the pool socket's request carry the token, and with ``service_namespace`` the service-side
namespace (a space of its own in the service: keys, pool, events); the ``namespace`` label above
only separates key digests inside one service namespace.
"""

from __future__ import annotations

import collections
import hashlib
import json
import logging
import mmap
import os
import queue
import threading
import time
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar
from urllib.parse import urlsplit

import httpx
import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    ConfigInfoMapping,
    Locality,
    LookupResult,
    Medium,
    OffloadingCounterMetadata,
    OffloadingEvent,
    OffloadingGaugeMetadata,
    OffloadingMetricMetadata,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from app.block_copy import BlockCopier
from app.client import (
    Batch,
    KVOffloadAuthError,
    KVOffloadClient,
    KVOffloadError,
    KVOffloadPermissionError,
    OpResult,
)
from app.pool_share import PoolShareError, default_pool_socket, receive_pool

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

__all__ = ["KVOffloadTier", "MappedPool", "map_pool", "namespace_digest"]

log = logging.getLogger("kvoffload.vllm_tier")

NAMESPACE_BYTES = 8
MAX_KEY_BYTES = 64
OWNERSHIP = "kvoffload"
_HIT, _MISS, _RETRY = LookupResult.HIT, LookupResult.MISS, LookupResult.RETRY

# Metric names this tier reports through vLLM (build_metric_definitions / get_stats).
M_CALLS = "vllm:kv_offload_kvoffload_http_calls"
M_FAULTS = "vllm:kv_offload_kvoffload_faults"
M_STORES_DROPPED = "vllm:kv_offload_kvoffload_stores_dropped_blocks"
M_LOADS_FAILED = "vllm:kv_offload_kvoffload_loads_failed_blocks"
M_AVAILABLE = "vllm:kv_offload_kvoffload_available"
#: Lookup answers for keys the service holds below the pool: promoted by a prepare-load.
_LOWER_TIERS = frozenset(("disk", "remote"))
#: Lookup answers asked again while the probe may still wait.
_NOT_YET = frozenset(("pending", *_LOWER_TIERS))
PENDING_WAIT_S = 0.5  # a key another engine is storing is asked again this long, then MISS
TOKEN_FILE_ENV = "KVOFFLOAD_TOKEN_FILE"  # where token_file comes from when the config has none


# What the tier reports through vLLM's stats (``build_metric_definitions``, ``get_stats``).
_METRIC_DEFINITIONS: dict[str, OffloadingMetricMetadata] = {
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
}


# --------------------------------------------------------------------------- keys


def namespace_digest(namespace: str | None, spec_config: Any, row_stride: int) -> bytes:
    """The 8-byte prefix of this engine's service keys.

    It hashes the configured ``namespace`` label (default: the model name) together with what
    makes a chunk's bytes comparable: model, KV dtype, chunk row stride, blocks per chunk,
    tokens per block of each group, parallel layout and KV cache layout. Two engines share
    blocks exactly when all of these agree; a label alone never makes different layouts mix.
    """
    model = spec_config.model
    par = spec_config.parallel
    facts = {
        "namespace": namespace if namespace is not None else model.name,
        "model": model.name,
        "dtype": model.dtype,
        "row_stride": row_stride,
        "worker_kv_bytes_per_block": spec_config.worker_kv_bytes_per_block,
        "blocks_per_chunk": spec_config.cache.blocks_per_chunk,
        "tokens_per_hash": spec_config.cache.tokens_per_hash,
        "groups": [[g.group_id, g.tokens_per_block] for g in spec_config.groups],
        "parallel": [par.world_size, par.tp_size, par.pp_size, par.pcp_size, par.dcp_size],
        "replicated_layout": spec_config.replicated_layout,
        "canonical_layout": spec_config.canonical_layout,
        "kv_cache_layout": spec_config.kv_cache_layout,
    }
    text = json.dumps(facts, sort_keys=True, default=str).encode()
    return hashlib.blake2b(text, digest_size=NAMESPACE_BYTES).digest()


def service_key(prefix: bytes, key: bytes) -> bytes:
    """The service key of ``key`` under ``prefix``: the prefix and the key, or the prefix and
    a 32-byte digest of a key too long to fit the service's 64-byte keys."""
    if len(key) + len(prefix) <= MAX_KEY_BYTES:
        return prefix + key
    return prefix + hashlib.blake2b(key, digest_size=32).digest()


# --------------------------------------------------------------------------- the pool


@dataclass
class MappedPool:
    """The service's host pool mapped into this process: ``blocks[slot]`` is one block.

    ``pool_id`` names the pool the service announced (its ``X-KVOffload-Pool``) or, for a
    pool mapped through its ``/proc`` path, the file's identity; ``path`` is that path (None
    when the descriptor came over the pool socket).
    """

    pool_id: str
    num_blocks: int
    block_bytes: int
    blocks: np.ndarray
    path: str | None = None

    @classmethod
    def from_fd(
        cls,
        fd: int,
        pool_id: str,
        num_blocks: int,
        block_bytes: int,
        path: str | None = None,
        offset: int = 0,
    ) -> MappedPool:
        """Map the blocks of ``fd`` (from byte ``offset``) shared and writable; the caller
        keeps ``fd`` (the mapping outlives it)."""
        total = num_blocks * block_bytes
        region = mmap.mmap(fd, offset + total, mmap.MAP_SHARED)
        flat = np.frombuffer(region, dtype=np.uint8, count=total, offset=offset)
        return cls(pool_id, num_blocks, block_bytes, flat.reshape(num_blocks, block_bytes), path)

    def still_current(self, announced: str | None) -> bool:
        """Whether an answer with pool header ``announced`` came from the service of this
        pool. Without a header, a pool mapped through a ``/proc`` path is current while that
        path still names the same file (it vanishes with the service process)."""
        if announced is not None:
            return announced == self.pool_id
        if self.path is None:
            return True
        try:
            return _file_id(os.stat(self.path)) == self.pool_id
        except OSError:
            return False


def _file_id(st: os.stat_result) -> str:
    return f"file:{st.st_dev}:{st.st_ino}"


def map_pool(
    client: KVOffloadClient,
    pool_socket: str | None,
    timeout_s: float,
    *,
    token: str | None = None,
    namespace: str | None = None,
) -> MappedPool:
    """Map the service's host pool; the one place that knows how a pool is obtained.

    Through the pool socket (``app.pool_share.receive_pool``, asking with ``token`` and
    ``namespace`` when either is given: the descriptor passed over a Unix socket, works across
    containers) when that module and socket exist, else through the ``/proc/<pid>/fd/<n>`` path
    ``GET /v1/pool`` answers (same user and PID namespace; ``client`` carries the credentials).
    Raises (``OSError``, ``httpx.HTTPError``, ``KVOffloadError``, the pool socket's
    ``PoolShareError``, ...) when neither works.
    """
    if pool_socket is not None and os.path.exists(pool_socket):
        shared = receive_pool(pool_socket, timeout_s=timeout_s, token=token, namespace=namespace)
        try:
            return MappedPool.from_fd(
                shared.fd,
                str(shared.pool_id),
                shared.num_blocks,
                shared.block_bytes,
                offset=shared.offset,
            )
        finally:
            os.close(shared.fd)
    layout = client.pool()
    fd = os.open(layout.path, os.O_RDWR)
    try:
        pool_id = client.last_pool_id or _file_id(os.fstat(fd))
        path = None if client.last_pool_id else layout.path
        return MappedPool.from_fd(fd, pool_id, layout.num_blocks, layout.block_bytes, path)
    finally:
        os.close(fd)


# --------------------------------------------------------------------------- shared state


class _Probe:
    """One key's lookup: ``result`` None while asked, then True (hit) or False (miss);
    ``pending_since`` is when the service first answered "pending" (a store in flight)."""

    __slots__ = ("pending_since", "reqs", "result")

    def __init__(self) -> None:
        self.result: bool | None = None
        self.reqs: set[str] = set()
        self.pending_since = 0.0


class _Job:
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
class _Step:
    """What one scheduler step hands the link thread."""

    starts: dict[str, dict[str, Any] | None] = field(default_factory=dict)
    lookups: dict[str, list[_ProbeRef]] = field(default_factory=dict)
    stores: list[_Transfer] = field(default_factory=list)
    loads: list[_Transfer] = field(default_factory=list)
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

    def merge(self, other: _Step) -> None:
        self.starts.update(other.starts)
        for req_id, refs in other.lookups.items():
            self.lookups.setdefault(req_id, []).extend(refs)
        self.stores.extend(other.stores)
        self.loads.extend(other.loads)
        for req_id, keys in other.touches.items():
            self.touches.setdefault(req_id, []).extend(keys)
        self.finishes.extend(other.finishes)


_ProbeRef = tuple[OffloadKey, _Probe]


@dataclass
class _Transfer:
    job: _Job
    req_id: str
    keys: tuple[OffloadKey, ...]
    chunk_ids: Any  # numpy array of primary chunk ids, parallel to keys


@dataclass
class _Copy:
    """Copy-thread work: ``pairs`` of (pool slot, primary chunk); ``keys`` are service keys."""

    transfer: _Transfer
    pool: MappedPool
    slots: list[int]
    chunks: list[int]
    skeys: list[bytes]


@dataclass
class _Done:
    """A copy that ended, for the link thread: the completion op to send."""

    req_id: str
    load: bool
    skeys: list[bytes]
    pool_id: str
    success: bool


@dataclass
class _Counters:
    """Cumulative counts by (metric, label), added to by all three threads; ``get_stats``
    reports them as deltas."""

    values: dict[tuple[str, str], int] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, metric: str, label: str = "", n: int = 1) -> None:
        with self.lock:
            self.values[metric, label] = self.values.get((metric, label), 0) + n

    def snapshot(self) -> dict[tuple[str, str], int]:
        with self.lock:
            return dict(self.values)


class _Incident:
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


# --------------------------------------------------------------------------- the tier


class KVOffloadTier(SecondaryTierManager):  # type: ignore[misc,unused-ignore]
    """A kvoffload service as vLLM's secondary tier (see the module docstring).

    Config keys (beside vLLM's ``type`` and ``module_path``): ``url`` (``unix:///path`` or
    ``http://host:port``), ``namespace`` (label mixed into the key namespace; default: the
    model name), ``pool_socket`` (default: the socket path + ``.pool``), ``token_file`` (file
    holding the engine's token; default ``$KVOFFLOAD_TOKEN_FILE``, else none; never the token
    itself: the config is on the engine's command line), ``service_namespace`` (the service's
    namespace to work in; default: the tenant's only one), ``timeout_s`` (read timeout of one
    call, 2.0), ``connect_timeout_s`` (0.5), ``job_deadline_s`` (10.0), ``retry_interval_s``
    (first back-off after a fault, 0.5), ``events_interval_s`` (KV events poll period when
    vLLM's KV events are on, 1.0), ``max_keys_per_op`` (8192), ``max_transfer_params_bytes``
    (16384), ``locality`` (``LOCAL``).

    A token file that cannot be read or holds no token refuses the engine's start
    (``ValueError`` naming the file).
    """

    medium: ClassVar[Medium] = Medium.CPU

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        url: str = "unix:///run/kvoffload/engine.sock",
        namespace: str | None = None,
        pool_socket: str | None = None,
        token_file: str | None = None,
        service_namespace: str | None = None,
        timeout_s: float = 2.0,
        connect_timeout_s: float = 0.5,
        job_deadline_s: float = 10.0,
        retry_interval_s: float = 0.5,
        events_interval_s: float = 1.0,
        max_keys_per_op: int = 8192,
        max_transfer_params_bytes: int = 16384,
        locality: str | None = "LOCAL",
        backpressure_detector: BackpressureDetector | None = None,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.locality = Locality(locality) if locality is not None else None
        stride = self.block_size_bytes
        self._primary = np.frombuffer(primary_kv_view, dtype=np.uint8).reshape(-1, stride)
        self._prefix = namespace_digest(namespace, offloading_spec.config, stride)
        self._namespace = namespace or offloading_spec.config.model.name
        self._url = url
        self._job_deadline_s = job_deadline_s
        self._retry_interval_s = retry_interval_s
        self._max_keys = max_keys_per_op
        self._max_params = max_transfer_params_bytes
        self._events_enabled = bool(offloading_spec.kv_events_config.enable_kv_cache_events)
        self._events_interval_s = events_interval_s

        base_url, uds = _parse_url(url)
        if pool_socket is None and uds is not None:
            pool_socket = default_pool_socket(uds)
        self._pool_socket = pool_socket
        token_file = token_file or os.environ.get(TOKEN_FILE_ENV) or None
        self._service_namespace = service_namespace
        # The client reads the token file, and again after a 401 that a rotated token cures.
        self._client = KVOffloadClient(
            base_url,
            uds=uds,
            timeout=httpx.Timeout(timeout_s, connect=connect_timeout_s),
            token_file=token_file,
            namespace=service_namespace,
        )

        # Scheduler-thread state.
        self._probes: dict[OffloadKey, _Probe] = {}
        self._req_keys: dict[str, list[OffloadKey]] = {}
        self._step = _Step()
        self._jobs: dict[int, _Job] = {}
        self._failed_now: list[JobResult] = []

        # Shared between threads (GIL-atomic operations only, or under the job's lock).
        self._results: queue.SimpleQueue[tuple[JobResult, tuple[OffloadKey, ...] | None]] = (
            queue.SimpleQueue()
        )
        self._events: collections.deque[OffloadingEvent] = collections.deque()
        self._job_lock = threading.Lock()
        self._down_until = 0.0  # lookups MISS and stores drop until this monotonic time
        self._disabled: str | None = None  # set for good by a configuration error
        self.counters = _Counters()
        self._reported: dict[tuple[str, str], int] = {}
        self._incident = _Incident(url)

        self._inbox: queue.SimpleQueue[_Step | None] = queue.SimpleQueue()
        self._copies: queue.SimpleQueue[_Copy | None] = queue.SimpleQueue()
        self._block_copier = BlockCopier()
        self._link = _Link(self)
        try:
            self._link.connect(refuse_mismatch=True)
        except BaseException:
            self._client.close()
            raise
        self._link_thread = threading.Thread(
            target=self._link.run, name="kvoffload-tier-link", daemon=True
        )
        self._copy_thread = threading.Thread(
            target=self._copy_loop, name="kvoffload-tier-copy", daemon=True
        )
        self._link_thread.start()
        self._copy_thread.start()

    # ------------------------------------------------------------------ metrics definitions

    @classmethod
    def build_metric_definitions(
        cls, extra_config: dict[str, Any]
    ) -> dict[str, OffloadingMetricMetadata]:
        """The tier's own metrics (vLLM adds ``tier`` to none of them)."""
        return dict(_METRIC_DEFINITIONS)

    @classmethod
    def config_info_keys(cls, tier_config: dict[str, Any]) -> tuple[str, ...]:
        return ("kvoffload_url", "kvoffload_namespace")

    def config_info(self) -> ConfigInfoMapping:
        return {"kvoffload_url": self._url, "kvoffload_namespace": self._namespace}

    # ------------------------------------------------------------------ scheduler thread

    def _unavailable(self) -> bool:
        return self._disabled is not None or time.monotonic() < self._down_until

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        """RETRY until the step's lookup call answered, then HIT or MISS (cached while a
        request that asked for the key is live)."""
        probe = self._probes.get(key)
        req_id = req_context.req_id
        if probe is None:
            if self._unavailable():
                return _MISS
            probe = _Probe()
            self._probes[key] = probe
            step = self._step
            refs = step.lookups.get(req_id)
            if refs is None:
                refs = step.lookups[req_id] = []
                self._note_request(req_context)
            refs.append((key, probe))
        if req_id not in probe.reqs:
            probe.reqs.add(req_id)
            self._req_keys.setdefault(req_id, []).append(key)
        result = probe.result
        if result is None:
            return _RETRY
        return _HIT if result else _MISS

    def _note_request(self, ctx: ReqContext) -> None:
        if ctx.req_id not in self._step.starts:
            self._step.starts[ctx.req_id] = ctx.kv_transfer_params

    def submit_store(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, load=False)

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, load=True)

    def _submit(self, meta: TransferJob, load: bool) -> None:
        keys = tuple(meta.keys)
        if self._unavailable() or not keys:
            ok = not keys
            self._failed_now.append(JobResult(job_id=meta.job_id, success=ok))
            if not ok:
                self.counters.add(M_LOADS_FAILED if load else M_STORES_DROPPED, "", len(keys))
                if load:
                    self._mark_miss(keys)
            return
        job = _Job(meta.job_id, load, keys, time.monotonic() + self._job_deadline_s)
        self._jobs[meta.job_id] = job
        self._note_request(meta.req_context)
        transfer = _Transfer(job, meta.req_context.req_id, keys, meta.chunk_ids)
        (self._step.loads if load else self._step.stores).append(transfer)

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        if keys and not self._unavailable():
            self._step.touches.setdefault(req_context.req_id, []).extend(keys)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        out = self._failed_now
        self._failed_now = []
        results = self._results
        jobs = self._jobs
        while not results.empty():
            result, failed_keys = results.get_nowait()
            if jobs.pop(result.job_id, None) is None:
                continue  # already reported (cancelled at its deadline)
            if failed_keys:
                self._mark_miss(failed_keys)
            out.append(result)
        if jobs:
            now = time.monotonic()
            for job in [j for j in jobs.values() if j.deadline <= now]:
                if self._cancel(job):
                    out.append(JobResult(job_id=job.job_id, success=False))
                    self._jobs.pop(job.job_id, None)
                    self.counters.add(M_FAULTS, "deadline")
                    if job.load:
                        self._mark_miss(job.keys)
        return out

    def _cancel(self, job: _Job) -> bool:
        """End a job that has not started copying; False if it is copying or ended."""
        with self._job_lock:
            if job.copying or job.ended:
                return False
            job.ended = True
            return True

    def _mark_miss(self, keys: Iterable[OffloadKey]) -> None:
        # A failed load must not be promoted again from a cached HIT (vLLM would retry it
        # every step); the key answers MISS until its requests are gone.
        probes = self._probes
        for key in keys:
            probe = probes.get(key)
            if probe is not None:
                probe.result = False

    def has_pending_work(self) -> bool:
        return bool(self._jobs) or self._link.has_unsent()

    def take_events(self) -> Iterable[OffloadingEvent]:
        events = self._events
        while events:
            yield events.popleft()

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        # The service hears of a request with its first op (lookup or job), not here: most
        # requests that hit vLLM's primary tier never reach this tier.
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        req_id = req_context.req_id
        probes = self._probes
        for key in self._req_keys.pop(req_id, ()):
            probe = probes.get(key)
            if probe is None:
                continue
            probe.reqs.discard(req_id)
            if not probe.reqs:
                del probes[key]
        self._step.finishes.append(req_id)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        step = self._step
        # A step with no tier work still carries the completions of copies that ended (they
        # release pins and make stores loadable for the other engines).
        if not step.empty() or self._link.done or self._link.reask:
            self._step = _Step()
            self._inbox.put(step)

    def drain_jobs(self) -> None:
        """Cancel every job not yet copying, wait for the ones copying; every result is then
        queued for ``get_finished_jobs``."""
        for job in list(self._jobs.values()):
            if self._cancel(job):
                self._failed_now.append(JobResult(job_id=job.job_id, success=False))
                self._jobs.pop(job.job_id, None)
                if job.load:
                    self._mark_miss(job.keys)
        while True:
            with self._job_lock:
                copying = any(j.copying and not j.ended for j in self._jobs.values())
            if not copying:
                return
            time.sleep(0.001)

    def shutdown(self) -> None:
        """Drain jobs, finish every request the tier opened (one last bounded call), stop the
        threads and close the connection."""
        self.drain_jobs()
        self._inbox.put(self._step)
        self._step = _Step()
        self._inbox.put(None)
        self._link_thread.join(timeout=10.0)
        self._copies.put(None)
        self._copy_thread.join(timeout=10.0)
        self._block_copier.close()
        self._client.close()
        # vLLM unmaps the primary tier after this: no view of it may remain.
        self._primary = np.empty((0, self.block_size_bytes), dtype=np.uint8)

    def get_stats(self) -> OffloadingConnectorStats | None:
        stats = OffloadingConnectorStats()
        current = self.counters.snapshot()
        for (metric, label), value in current.items():
            delta = value - self._reported.get((metric, label), 0)
            if delta:
                stats.increase_counter(metric, delta, (label,) if label else ())
        self._reported = current
        stats.set_gauge(M_AVAILABLE, 0.0 if self._incident.active else 1.0)
        return stats

    # ------------------------------------------------------------------ copy thread

    def _copy_loop(self) -> None:
        while True:
            task = self._copies.get()
            if task is None:
                return
            self._copy(task)

    def _copy(self, task: _Copy) -> None:
        transfer = task.transfer
        job = transfer.job
        with self._job_lock:
            run = not job.ended
            job.copying = run
        success = False
        started = time.perf_counter()
        if run:
            try:
                pool, primary = task.pool.blocks, self._primary
                # Runs of rows in one memmove each, on a few threads, without the GIL.
                if job.load:
                    self._block_copier.copy(primary, task.chunks, pool, task.slots)
                else:
                    self._block_copier.copy(pool, task.slots, primary, task.chunks)
                success = True
            except Exception:
                log.exception("kvoffload tier: copy of job %d failed", job.job_id)
                self.counters.add(M_FAULTS, "copy")
        seconds = time.perf_counter() - started
        self._link.done.append(
            _Done(transfer.req_id, job.load, task.skeys, task.pool.pool_id, success)
        )
        if not run:
            return
        nbytes = len(task.slots) * self.block_size_bytes
        self._finish_job(job, success, seconds if success else None, nbytes if success else None)

    def _finish_job(
        self, job: _Job, success: bool, seconds: float | None = None, nbytes: int | None = None
    ) -> None:
        """Report a job's end once (link or copy thread). The result is queued under the job
        lock, so once ``drain_jobs`` sees a job ended its result is there to collect."""
        result = JobResult(
            job_id=job.job_id, success=success, transfer_time=seconds, transfer_bytes=nbytes
        )
        with self._job_lock:
            if job.ended:
                return
            job.ended = True
            self._results.put((result, job.keys if job.load and not success else None))
        if not success:
            self.counters.add(M_LOADS_FAILED if job.load else M_STORES_DROPPED, "", len(job.keys))


def _parse_url(url: str) -> tuple[str | None, str | None]:
    """(base_url, uds) of a tier ``url``: ``unix:///path`` or ``http(s)://host:port``."""
    parts = urlsplit(url)
    if parts.scheme == "unix":
        if not parts.path:
            raise ValueError(f"kvoffload tier url {url!r} names no socket path")
        return None, parts.path
    if parts.scheme in ("http", "https"):
        return url.rstrip("/"), None
    raise ValueError(f"kvoffload tier url {url!r}: use unix:///path or http://host:port")


# --------------------------------------------------------------------------- link thread


@dataclass
class _Pending:
    """What an op in a batch was for, to act on its result."""

    kind: str  # start, lookup, promote, store, load, touch, complete, finish, abort
    req_id: str
    probes: Sequence[_ProbeRef] = ()
    holder: _Holder | None = None
    skeys: Sequence[bytes] = ()


class _Holder:
    """A store or load job, sent as one op or, above the op key limit, as several: it is
    copied once every part answered, whole or not at all."""

    def __init__(self, transfer: _Transfer, parts: int) -> None:
        self.transfer = transfer
        self.parts = parts
        self.answered = 0
        self.failed = False
        self.copies: list[_Copy] = []

    def answer(self, link: _Link, copy: _Copy | None) -> None:
        """Record one part's answer (None: it failed); at the last one, queue the copy or fail
        the job and release what the other parts reserved."""
        self.answered += 1
        if copy is None:
            self.failed = True
        else:
            self.copies.append(copy)
        if self.answered < self.parts:
            return
        t = self.transfer
        tier = link.tier
        if self.failed:
            tier._finish_job(t.job, False)
            for c in self.copies:
                link.release(t.req_id, t.job.load, c.skeys)
            return
        slots = [s for c in self.copies for s in c.slots]
        if not slots:
            tier._finish_job(t.job, True, 0.0, 0)  # every key was already stored
            return
        merged = _Copy(
            t,
            self.copies[0].pool,
            slots,
            [ch for c in self.copies for ch in c.chunks],
            [k for c in self.copies for k in c.skeys],
        )
        link.copying[t.req_id] += 1
        tier._copies.put(merged)


class _Link:
    """The link thread: one ``/v1/batch`` per bundle of steps. It owns the mapped pool, which
    requests the service knows, and the ops carried to the next call."""

    def __init__(self, tier: KVOffloadTier) -> None:
        self.tier = tier
        self.client = tier._client
        self.pool: MappedPool | None = None
        self.done: collections.deque[_Done] = collections.deque()  # ended copies, to complete
        self.started: set[str] = set()
        self.params: dict[str, dict[str, Any] | None] = {}
        self.copying: collections.Counter[str] = collections.Counter()  # copies per request
        self.aborts: set[str] = set()  # outcome unknown: abort once none of its copies runs
        self.finishes: list[str] = []  # finishes not delivered yet
        # Keys answered "pending" (another engine's store in flight), asked again next call.
        self.reask: dict[str, list[_ProbeRef]] = {}
        # Keys answered "disk" or "remote" (in a lower tier): a prepare-load asks the
        # service to bring them into the pool (its answer, 409, is expected); they are asked
        # again as pending. A prepare-load that pins (they were in already) is undone.
        self.promote: dict[str, list[bytes]] = {}
        self.unpin: dict[str, list[bytes]] = {}
        self.backoff = tier._retry_interval_s
        self.busy = False  # a call is being built or is in flight
        self.events = _EventFollower(tier)

    def has_unsent(self) -> bool:
        """Work the engine should keep stepping for (while the service answers)."""
        if self.tier._incident.active:
            return False
        return (
            self.busy
            or not self.tier._inbox.empty()
            or bool(self.done or self.finishes or self.aborts or self.reask or self.unpin)
        )

    def connect(self, refuse_mismatch: bool = False) -> bool:
        """Map the pool if not mapped; False when it cannot be. A pool whose block size is not
        vLLM's chunk row stride disables the tier for good (raises with ``refuse_mismatch``:
        at start, so the engine refuses to start with the reason)."""
        if self.pool is not None:
            return True
        tier = self.tier
        if tier._disabled is not None:
            return False
        try:
            pool = map_pool(
                self.client,
                tier._pool_socket,
                timeout_s=5.0,
                token=self.client.current_token(),
                namespace=tier._service_namespace,
            )
        except (KVOffloadAuthError, KVOffloadPermissionError) as exc:
            self.fault(*self.refusal(exc), refused=True)
            return False
        except PoolShareError as exc:
            if exc.reason is None:
                self.fault("unreachable", f"cannot map the pool ({exc})")
            else:
                self.fault("pool_refused", f"the pool socket refused: {exc.reason}", refused=True)
            return False
        except Exception as exc:  # whatever the way to the pool failed with: a fault
            self.fault("unreachable", f"cannot map the pool ({type(exc).__name__}: {exc})")
            return False
        finally:
            tier.counters.add(M_CALLS, "pool")
        stride = tier.block_size_bytes
        if pool.block_bytes != stride:
            message = (
                f"kvoffload pool block size is {pool.block_bytes} bytes but vLLM's chunk row "
                f"stride is {stride} bytes; start kvoffload with --block-bytes {stride} (or "
                "change vLLM's block_size / blocks_per_chunk)"
            )
            if refuse_mismatch:
                raise ValueError(message)
            tier._disabled = message
            log.error("kvoffload tier disabled: %s", message)
            return False
        self.pool = pool
        return True

    def fault(self, reason: str, message: str, refused: bool = False) -> None:
        """Count a fault, log it once per incident (``refused``: the service refused the
        engine's credentials, an error), and back off (doubling, up to 16 times
        ``retry_interval_s``)."""
        tier = self.tier
        tier.counters.add(M_FAULTS, reason)
        tier._incident.fail(message, refused)
        tier._down_until = time.monotonic() + self.backoff
        self.backoff = min(self.backoff * 2, 16 * tier._retry_interval_s)

    def run(self) -> None:
        tier = self.tier
        stop = False
        while not stop:
            try:
                items: list[_Step | None] = [tier._inbox.get(timeout=0.2)]
            except queue.Empty:
                items = [_Step()]  # idle: deliver ended copies' completions and finishes
            self.busy = True
            while not tier._inbox.empty():
                items.append(tier._inbox.get_nowait())
            step = _Step()
            for item in items:
                if item is None:
                    stop = True
                else:
                    step.merge(item)
            try:
                self.exchange(step, final=stop)
                self.events.poll(self.client)
            except Exception:
                log.exception("kvoffload tier: link step failed")
                self.fault("internal", "internal error in the tier's link thread")
            finally:
                self.busy = False

    def exchange(self, step: _Step, final: bool = False) -> None:
        """Send one batch for ``step`` and the carried ops; act on each op's result."""
        tier = self.tier
        for req_id, params in step.starts.items():
            self.params.setdefault(req_id, params)
        self.finishes.extend(step.finishes)
        if self.reask:
            finishing = set(self.finishes)
            for req_id, refs in self.reask.items():
                if req_id in self.started and req_id not in finishing:
                    step.lookups.setdefault(req_id, []).extend(refs)
                else:
                    for _, probe in refs:
                        probe.result = False
            self.reask = {}
        backing_off = tier._incident.active and time.monotonic() < tier._down_until
        if (backing_off and not final) or (
            (step.lookups or step.stores or step.loads) and not self.connect()
        ):
            self.fail_step(step)
            return
        pool_id = self.pool.pool_id if self.pool is not None else None
        batch = Batch()
        pending: list[_Pending] = []

        def add(kind: str, req_id: str, **what: Any) -> None:
            pending.append(_Pending(kind, req_id, **what))

        def begin(req_id: str) -> None:
            if req_id not in self.started:
                self.started.add(req_id)
                batch.start_request(req_id, self._params(self.params.get(req_id)))
                add("start", req_id)

        # Completions first: they release pins and make stores loadable.
        while self.done:
            d = self.done.popleft()
            self.copying[d.req_id] -= 1
            if self.copying[d.req_id] <= 0:
                del self.copying[d.req_id]
            if d.pool_id != pool_id:
                continue  # meant for a pool that is gone with its service
            for part in _parts(d.skeys, tier._max_keys):
                if d.load:
                    batch.complete_load(d.req_id, part)
                else:
                    batch.complete_store(d.req_id, part, success=d.success)
                add("complete", d.req_id)
        for req_id in sorted(self.aborts):
            if not self.copying.get(req_id):
                self.aborts.discard(req_id)
                batch.finish_request(req_id, abort=True)
                add("abort", req_id)
        for req_id, skeys in self.unpin.items():
            for part in _parts(skeys, tier._max_keys):
                batch.complete_load(req_id, part)
                add("complete", req_id)
        self.unpin = {}
        for req_id, skeys in self.promote.items():
            if req_id in self.started:
                for part in _parts(skeys, tier._max_keys):
                    batch.prepare_load(req_id, part)
                    add("promote", req_id, skeys=part)
        self.promote = {}
        prefix = tier._prefix
        for req_id, refs in step.lookups.items():
            begin(req_id)
            for part in _parts(refs, tier._max_keys):
                batch.lookup(req_id, [service_key(prefix, k) for k, _ in part])
                add("lookup", req_id, probes=part)
        for kind, transfers in (("store", step.stores), ("load", step.loads)):
            for t in transfers:
                begin(t.req_id)
                skeys = [service_key(prefix, k) for k in t.keys]
                parts = list(_parts(skeys, tier._max_keys))
                holder = _Holder(t, len(parts))
                for part in parts:
                    if kind == "load":
                        batch.prepare_load(t.req_id, part)
                    else:
                        batch.prepare_store(t.req_id, part)
                    add(kind, t.req_id, holder=holder, skeys=part)
        for req_id, keys in step.touches.items():
            if req_id in self.started:
                for part in _parts(keys, tier._max_keys):
                    batch.touch(req_id, [service_key(prefix, k) for k in part])
                    add("touch", req_id)
        finishes, self.finishes = self.finishes, []
        for req_id in finishes:
            self.params.pop(req_id, None)
            if req_id in self.started:
                self.started.discard(req_id)
                # At shutdown no copy runs any more: an abort gives back whatever a cancelled
                # copy still held.
                batch.finish_request(req_id, abort=final)
                add("finish", req_id)
        if final:  # shutdown: requests vLLM left open are aborted too
            for req_id in sorted(self.started | self.aborts):
                batch.finish_request(req_id, abort=True)
                add("abort", req_id)
            self.started.clear()
            self.aborts.clear()
        if batch.ops:
            self.send(batch, pending)

    def _params(self, params: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
        """``kv_transfer_params`` as sent, or None when they would make the service refuse the
        whole batch (not JSON, or over its size limit)."""
        if params is None:
            return None
        try:
            size = len(json.dumps(params, separators=(",", ":")))
        except (TypeError, ValueError):
            size = -1
        if 0 <= size <= self.tier._max_params:
            return params
        self.tier.counters.add(M_FAULTS, "transfer_params_dropped")
        return None

    def send(self, batch: Batch, pending: list[_Pending]) -> None:
        tier = self.tier
        tier.counters.add(M_CALLS, "batch")
        try:
            results = self.client.batch(batch)
        except httpx.TimeoutException as exc:
            self.fail_batch(pending, "timeout", f"timed out ({type(exc).__name__})")
            return
        except (httpx.HTTPError, OSError) as exc:
            self.fail_batch(pending, "unreachable", f"unreachable ({type(exc).__name__}: {exc})")
            return
        except (KVOffloadAuthError, KVOffloadPermissionError) as exc:
            self.fail_batch(pending, *self.refusal(exc), refused=True)
            return
        except KVOffloadError as exc:
            reason = "http_5xx" if exc.status >= 500 else f"http_{exc.status}"
            self.fail_batch(pending, reason, f"answered {exc.status} {exc.code}")
            return
        except (ValueError, KeyError, TypeError) as exc:
            self.fail_batch(pending, "bad_answer", f"answered something unreadable ({exc})")
            return
        if len(results) != len(pending):
            self.fail_batch(pending, "bad_answer", "answered a batch of the wrong length")
            return
        pool = self.pool
        stale = pool is not None and not pool.still_current(self.client.last_pool_id)
        if stale:
            self.fault("restarted", "the service restarted with a new host pool")
            self.pool = None
            self.started.clear()
            tier._down_until = 0.0  # the new service answers: map its pool and go on
            self.connect()
        else:
            self.backoff = tier._retry_interval_s
            tier._incident.ok(tier.counters.values.get((M_STORES_DROPPED, ""), 0))
        for res, p in zip(results, pending, strict=True):
            self.on_result(res, p, stale)

    def on_result(self, res: OpResult, p: _Pending, stale_pool: bool) -> None:
        tier = self.tier
        if not res.ok and res.status == 404 and p.kind not in ("finish", "abort"):
            self.started.discard(p.req_id)  # the service forgot it (restart, idle TTL)
        if p.kind == "lookup":
            hits = res.result["results"] if res.ok and res.result is not None else None
            if hits is None:
                tier.counters.add(M_FAULTS, f"lookup_{res.status}")
            for i, ref in enumerate(p.probes):
                probe = ref[1]
                state = None if hits is None else hits[i]
                if state in _NOT_YET and self._still_waiting(probe):
                    self.reask.setdefault(p.req_id, []).append(ref)
                    if state in _LOWER_TIERS:
                        skey = service_key(tier._prefix, ref[0])
                        self.promote.setdefault(p.req_id, []).append(skey)
                else:
                    probe.result = state == "hit"
        elif p.kind == "promote":
            if res.ok:  # already in the pool: it pinned them, which nobody will load
                self.unpin.setdefault(p.req_id, []).extend(p.skeys)
            elif res.status != 409:  # 409: not ready yet, being brought in (expected)
                tier.counters.add(M_FAULTS, f"promote_{res.status}")
        elif p.holder is not None:
            self.on_transfer(res, p, p.holder, stale_pool)
        elif not res.ok and not (p.kind in ("finish", "abort") and res.status == 404):
            tier.counters.add(M_FAULTS, f"{p.kind}_{res.status}")

    @staticmethod
    def _still_waiting(probe: _Probe) -> bool:
        now = time.monotonic()
        if not probe.pending_since:
            probe.pending_since = now
        return now - probe.pending_since < PENDING_WAIT_S

    def on_transfer(self, res: OpResult, p: _Pending, holder: _Holder, stale_pool: bool) -> None:
        tier = self.tier
        t = holder.transfer
        load = p.kind == "load"
        if not res.ok or res.result is None:
            tier.counters.add(
                M_FAULTS, "no_space" if res.status == 507 else f"{p.kind}_{res.status}"
            )
            holder.answer(self, None)
            return
        slots = [int(s) for s in res.result["slots"]]
        # A load copies every key it pinned; a store only the keys the service admitted.
        skeys = list(p.skeys) if load else [bytes.fromhex(k) for k in res.result["keys_to_store"]]
        if stale_pool or self.pool is None or t.job.ended:
            # Reserved or pinned in a pool we did not copy against (the service restarted
            # between mapping and answer), or for a job that already ended (deadline, drain):
            # given back without a copy, or by aborting the request when no pool is mapped.
            if self.pool is not None:
                self.release(t.req_id, load, skeys)
            elif skeys:
                self.aborts.add(t.req_id)
            holder.answer(self, None)
            return
        chunk_ids = t.chunk_ids.tolist()
        chunk_of = dict(zip([service_key(tier._prefix, k) for k in t.keys], chunk_ids, strict=True))
        chunks = [int(chunk_of[k]) for k in skeys]
        holder.answer(self, _Copy(t, self.pool, slots, chunks, skeys))

    def release(self, req_id: str, load: bool, skeys: Sequence[bytes]) -> None:
        """Queue the completion that gives back what the service reserved (store: a failed
        complete-store; load: complete-load), without a copy."""
        if skeys and self.pool is not None:
            self.copying[req_id] += 1
            self.done.append(_Done(req_id, load, list(skeys), self.pool.pool_id, success=False))

    def fail_step(self, step: _Step) -> None:
        """The service cannot be asked now: lookups miss, jobs fail."""
        tier = self.tier
        for refs in step.lookups.values():
            for _, probe in refs:
                probe.result = False
        for t in (*step.stores, *step.loads):
            tier._finish_job(t.job, False)

    @staticmethod
    def refusal(exc: KVOffloadError) -> tuple[str, str]:
        """The fault reason and message of a 401 / 403 answer."""
        reason = "unauthenticated" if exc.status == 401 else "forbidden"
        return reason, f"the service refused this engine's credentials ({exc})"

    def fail_batch(
        self, pending: list[_Pending], reason: str, message: str, refused: bool = False
    ) -> None:
        """A call failed with an unknown outcome: lookups miss, jobs fail, requests whose
        reservations may exist are aborted later, undelivered finishes are carried."""
        self.fault(reason, message, refused)
        tier = self.tier
        for p in pending:
            if p.kind == "lookup":
                for _, probe in p.probes:
                    probe.result = False
            elif p.kind in ("store", "load", "promote", "complete", "abort"):
                if p.holder is not None and p.holder.transfer.job is not None:
                    tier._finish_job(p.holder.transfer.job, False)
                self.aborts.add(p.req_id)
                self.started.discard(p.req_id)
            elif p.kind == "finish":
                self.finishes.append(p.req_id)
            elif p.kind == "start":
                self.started.discard(p.req_id)
        if len(self.finishes) > 100_000:  # the service's lease TTL frees what was never said
            del self.finishes[:50_000]


class _EventFollower:
    """The service's KV events of this namespace, as vLLM ``OffloadingEvent``s (ownership
    ``kvoffload``): polled by the link thread every ``events_interval_s`` while vLLM's KV events
    are on and the service answers."""

    def __init__(self, tier: KVOffloadTier) -> None:
        self.tier = tier
        self.after = 0
        self.instance: str | None = None
        self.due = 0.0

    def poll(self, client: KVOffloadClient) -> None:
        tier = self.tier
        if not tier._events_enabled or tier._incident.active:
            return
        now = time.monotonic()
        if now < self.due:
            return
        self.due = now + tier._events_interval_s
        tier.counters.add(M_CALLS, "events")
        try:
            page = client.events(self.after, 1000)
        except (httpx.HTTPError, OSError, KVOffloadError, ValueError, KeyError):
            tier.counters.add(M_FAULTS, "events")
            return
        if self.instance is not None and page.instance != self.instance:
            self.after = 0  # a new service numbers its events from the start
        self.instance = page.instance
        if page.fell_behind:
            tier.counters.add(M_FAULTS, "events_fell_behind")
        self.after = page.next_after
        prefix = tier._prefix
        n = len(prefix)
        for event in page.events:
            if event.type not in ("BlockStored", "BlockRemoved"):
                continue
            keys = [OffloadKey(k[n:]) for k in event.block_hashes if k[:n] == prefix]
            if keys:
                tier._events.append(
                    OffloadingEvent(
                        keys=keys,
                        medium=Medium.CPU,
                        removed=event.type == "BlockRemoved",
                        locality=tier.locality,
                        ownership=OWNERSHIP,
                    )
                )


def _parts(items: Sequence[Any], size: int) -> Iterable[Sequence[Any]]:
    for i in range(0, len(items), size):
        yield items[i : i + size]
