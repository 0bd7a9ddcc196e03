"""The service: one object that owns the manager, the host pool and the transfer machinery.

Both listeners (engine API and admin API) share one ``Service``. It owns:

- the ``OffloadManager`` (bookkeeping; every call runs on the event loop, with no ``await``
  between the calls that make up one operation, so operations are atomic w.r.t. each other);
- the ``HostPool`` (shared memory), the ``KVCacheRegistry`` (device KV caches registered by
  engines), the transfer worker and the ``JobTracker`` that calls ``complete_store`` /
  ``complete_load`` on the manager when a job ends (a completion that arrives after the
  request's leases were released is logged and dropped by the tracker);
- the ``EventBuffer`` of KV events served to routers;
- background tasks: the *completion pump* (woken from the worker thread through
  ``loop.call_soon_threadsafe`` when a job ends; it finishes jobs in the manager), the
  *lease sweeper* (``expire_requests(lease_ttl_s)``, so a crashed engine cannot leak the pool)
  and, with shadow evaluation on, the *shadow drain* (below);
- its observability: ``observer`` (``app.observability``: every manager op, finished job and
  HTTP call to metrics and log lines), the ``Metrics`` in ``registry`` (one per service; None
  when ``metrics_enabled`` is off) whose state collector reads ``snapshot()`` at scrape time.

Shadow evaluation (``shadow_enabled``, ``app.shadow``): the manager hands every finished
request's chain to the ``ShadowRunner`` (``add_chain_listener``; it only queues), whose task
replays them through one simulated pool per policy within ``shadow_cpu_budget``, never on the
request path. The control (the active policy) follows policy switches.

Lifecycle: ``async with service.running():`` starts it (pool, worker, tasks) and stops it on
exit. It is reference counted, so each listener's lifespan can hold it and the last one out
stops it. ``begin_drain()`` marks it not ready (``/readyz`` 503) ahead of a shutdown.

Operations are plain methods raising domain errors (manager, transfer) or ``APIError``; the HTTP
layer maps them (``app.errors``). ``offload`` = ``prepare_store`` + a device->host job for the
keys that must move, ``complete_store`` when it ends; ``onload`` = ``prepare_load`` + a
host->device job, ``complete_load`` when it ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from prometheus_client import CollectorRegistry
from structlog.contextvars import bind_contextvars

from app import logging as app_logging
from app.errors import APIError, no_space, unavailable
from app.events import EventBuffer
from app.logging import audit, get_logger
from app.metrics import Metrics, ServiceSnapshot
from app.observability import Observer, RequestCounts
from app.request_ids import safe_req_id
from app.settings import Settings
from app.shadow import ShadowRunner, ShadowState
from manager import (
    BlockKey,
    CompleteStoreOutput,
    LookupOutput,
    ManagerStats,
    OffloadManager,
    PolicyInfo,
    PolicySwitch,
    PrepareStoreOutput,
    ReleasedLeases,
    ReqContext,
    RequestLeases,
    ResetCounts,
    available_policies,
    create_manager,
)
from transfer import (
    FaultSpec,
    HostPool,
    JobRecord,
    JobTracker,
    KVCacheRegistry,
    KVCacheSpec,
    RegisteredCache,
    TransferWorker,
    create_worker,
)

log = get_logger("service")
Clock = Callable[[], float]
State = Literal["new", "running", "stopping", "stopped"]
# The request-count table may hold this many more entries than the live table shows.
_REQUEST_COUNTS_SLACK = 4


class _ObservedCompletions:
    """The job tracker's completion sink: the manager's ``complete_*`` calls, observed.

    Each completion binds the job's ``req_id`` (safe form) for logging, and leaves it bound: the
    tracker's own line about a failed completion comes right after the call returns. The
    service runs ``poll`` in a copied context, so nothing outlives it.
    """

    def __init__(self, manager: OffloadManager, observer: Observer) -> None:
        self.manager = manager
        self.observer = observer

    def complete_store(
        self, keys: Sequence[BlockKey], ctx: ReqContext, success: bool
    ) -> CompleteStoreOutput:
        bind_contextvars(req_id=safe_req_id(ctx.req_id))
        try:
            out = self.manager.complete_store(keys, ctx, success=success)
        except Exception:
            self.observer.failed("complete_store", ctx.req_id)
            raise
        self.observer.complete_store(ctx.req_id, out)
        return out

    def complete_load(self, keys: Sequence[BlockKey], ctx: ReqContext) -> None:
        bind_contextvars(req_id=safe_req_id(ctx.req_id))
        try:
            self.manager.complete_load(keys, ctx)
        except Exception:
            self.observer.failed("complete_load", ctx.req_id)
            raise
        self.observer.complete_load(ctx.req_id, len(keys), by_engine=False)


@dataclass(frozen=True, slots=True)
class OffloadStarted:
    """What ``offload`` started: the job (None when nothing had to move) and the store spec."""

    job: JobRecord | None
    spec: PrepareStoreOutput


@dataclass(frozen=True, slots=True)
class OnloadStarted:
    """What ``onload`` started: the job (None for an empty key list) and the pinned slots."""

    job: JobRecord | None
    slots: list[int]


class Service:
    """The shared state of both listeners; see the module docstring."""

    def __init__(
        self,
        settings: Settings,
        *,
        manager: OffloadManager | None = None,
        clock: Clock = time.monotonic,
        registry: CollectorRegistry | None = None,
    ) -> None:
        """``registry``: where the metrics go (a new one by default); unused with metrics off."""
        self.settings = settings
        if manager is None:
            manager = create_manager(
                settings.num_blocks,
                settings.policy,
                settings.store_threshold,
                policy_params=settings.policy_params,
                clock=clock,
                max_events=settings.event_buffer_size,
            )
        elif manager.num_blocks != settings.num_blocks:
            raise ValueError(
                f"manager has {manager.num_blocks} blocks but settings say {settings.num_blocks}"
            )
        self.manager = manager
        self.events = EventBuffer(settings.event_buffer_size)
        self.instance = uuid.uuid4().hex[:16]
        self.state: State = "new"
        self.draining = False
        self._users = 0
        self._pool: HostPool | None = None
        self._registry: KVCacheRegistry | None = None
        self._worker: TransferWorker | None = None
        self._tracker: JobTracker | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._pump_wakeup = asyncio.Event()
        # Replaced on every batch of finished jobs; waiters hold the one current when they
        # started waiting.
        self._jobs_changed = asyncio.Event()
        self._lock = asyncio.Lock()

        self.registry: CollectorRegistry | None = None
        self.metrics: Metrics | None = None
        if settings.metrics_enabled:
            self.registry = registry if registry is not None else CollectorRegistry()
            self.metrics = Metrics(
                self.registry,
                snapshot=self.snapshot,
                live_request_series=settings.metrics_live_requests,
                max_live_series=settings.metrics_live_requests_max,
            )
        self._request_counts = (
            RequestCounts(_REQUEST_COUNTS_SLACK * settings.metrics_live_requests_max)
            if self.metrics is not None and settings.metrics_live_requests
            else None
        )
        self.observer = Observer(
            self.metrics,
            hit_window=settings.metrics_hit_window,
            request_counts=self._request_counts,
        )
        self._completions = _ObservedCompletions(manager, self.observer)
        self.shadow: ShadowRunner | None = None
        if settings.shadow_enabled:
            self.shadow = ShadowRunner(
                manager.policy,
                capacity=settings.num_blocks,
                policies=settings.shadow_policies,
                sample_rate=settings.shadow_sample_rate,
                store_threshold=settings.store_threshold,
                window=settings.shadow_window,
                max_queue=settings.shadow_max_queue,
                cpu_budget=settings.shadow_cpu_budget,
                interval_s=settings.shadow_drain_interval_s,
            )
            manager.add_chain_listener(self.shadow.observe)

    # ------------------------------------------------------------------ lifecycle

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[Service]:
        """Hold the service running for the duration of the block (reference counted)."""
        await self.start()
        try:
            yield self
        finally:
            await self.stop()

    async def start(self) -> None:
        """Create the pool, registry, worker and tracker and start the background tasks."""
        async with self._lock:
            if self._users:
                self._users += 1
                return
            if self.state != "new":
                raise RuntimeError(f"service cannot start from state {self.state!r}")
            s = self.settings
            self._loop = asyncio.get_running_loop()
            # Creating (and pinning) a large pool takes a while; keep the loop responsive.
            pool = await asyncio.to_thread(
                HostPool.create,
                s.num_blocks,
                s.block_bytes,
                pin=s.pin_memory,
                shm_dir=str(s.shm_dir),
            )
            try:
                registry = KVCacheRegistry(pool)
                faults = (
                    FaultSpec(
                        fail_rate=s.fault_fail_rate,
                        delay_s=s.fault_delay_s,
                        hang_rate=s.fault_hang_rate,
                        seed=s.fault_seed,
                    )
                    if s.faults_enabled
                    else None
                )
                worker = create_worker(
                    pool,
                    registry,
                    backend=s.transfer_backend,
                    faults=faults,
                    on_finished=self._wake_pump,
                )
            except BaseException:
                pool.close()
                raise
            self._pool, self._registry, self._worker = pool, registry, worker
            self._tracker = JobTracker(worker, self._completions, max_finished=s.max_finished_jobs)
            self._tasks = [
                asyncio.create_task(self._pump_loop(), name="kvoffload-completion-pump"),
                asyncio.create_task(self._lease_loop(), name="kvoffload-lease-sweeper"),
            ]
            if self.shadow is not None:
                self._tasks.append(
                    asyncio.create_task(self.shadow.run(), name="kvoffload-shadow-drain")
                )
            self.state = "running"
            self._users = 1
            log.info(
                "service started",
                extra={
                    "fields": {
                        "pool": pool.path,
                        "pool_id": pool.pool_id,
                        "num_blocks": s.num_blocks,
                        "block_bytes": s.block_bytes,
                        "pinned": pool.pinned,
                        "policy": self.manager.policy.name,
                        "backend": s.transfer_backend,
                        "faults": faults is not None,
                        "metrics": self.metrics is not None,
                        "shadow_policies": (
                            None if self.shadow is None else self.shadow.evaluator.policies
                        ),
                    }
                },
            )

    async def stop(self) -> None:
        """Drop one hold; the last one stops the worker (jobs end or fail) and frees the pool."""
        async with self._lock:
            self._users -= 1
            if self._users > 0 or self.state != "running":
                return
            self.state = "stopping"
            self.draining = True
            for task in self._tasks:
                task.cancel()
            for task in self._tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            self._tasks = []
            assert self._worker is not None
            await asyncio.to_thread(self._worker.shutdown, self.settings.shutdown_grace_s)
            self._collect()
            if self._registry is not None:
                self._registry.close()
            if self._pool is not None:
                self._pool.close()
            self.state = "stopped"
            self._notify_jobs()
            log.info("service stopped")

    def begin_drain(self) -> None:
        """Report not-ready from now on (a shutdown is coming); long-polls answer now."""
        self.draining = True
        self._notify_jobs()

    def readiness(self) -> str | None:
        """None when ready, else why not."""
        if self.state != "running":
            return f"service is {self.state}"
        if self.draining:
            return "shutting down"
        assert self._tracker is not None
        age = self._tracker.oldest_running_age()
        if age > self.settings.job_deadline_s:
            deadline = self.settings.job_deadline_s
            return f"a transfer has been running {age:.1f}s, past its {deadline}s deadline"
        return None

    def _running(self) -> tuple[JobTracker, KVCacheRegistry, HostPool]:
        if self.state != "running":
            raise unavailable(f"service is {self.state}")
        assert self._tracker is not None
        assert self._registry is not None
        assert self._pool is not None
        return self._tracker, self._registry, self._pool

    # ------------------------------------------------------------------ background tasks

    def _wake_pump(self) -> None:
        """Called by the worker thread when a job ends."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        with contextlib.suppress(RuntimeError):  # the loop closed under us: nothing to wake
            loop.call_soon_threadsafe(self._pump_wakeup.set)

    async def _pump_loop(self) -> None:
        # The periodic poll is a safety net (a wake-up lost in a race costs at most this long)
        # and keeps the event buffer fed.
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(0.25):
                    await self._pump_wakeup.wait()
            self._pump_wakeup.clear()
            try:
                self._collect()
            except Exception:
                log.exception("completion pump failed; retrying")

    def _collect(self) -> None:
        """Finish ended jobs in the manager, wake job waiters, move new events to the buffer."""
        if self._tracker is not None:
            # A copied context: the ids the completions bind for logging stay in there.
            finished = contextvars.copy_context().run(self._tracker.poll)
            if finished:
                for record in finished:
                    self.observer.transfer_done(record)
                self._notify_jobs()
        self.drain_events()

    def _notify_jobs(self) -> None:
        changed, self._jobs_changed = self._jobs_changed, asyncio.Event()
        changed.set()

    async def _lease_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.lease_check_interval_s)
            try:
                self.expire_leases()
                counts = self._request_counts
                if counts is not None and len(counts) > counts.limit // 2:
                    counts.prune(r.req_id for r in self.manager.requests())
            except Exception:
                log.exception("lease sweep failed; retrying")

    def expire_leases(self) -> list[ReleasedLeases]:
        """Release the leases of requests silent for longer than ``lease_ttl_s`` (the slots of
        a store job still running here stay reserved until it ends), and forget requests that
        hold nothing and have been silent for the request idle TTL."""
        released = self.manager.expire_requests(
            self.settings.lease_ttl_s,
            self.settings.effective_request_idle_ttl_s,
            writing=self._requests_writing(),
        )
        for r in released:
            log.warning(
                "request leases expired",
                extra={
                    "fields": {
                        "req_id": safe_req_id(r.req_id),
                        "pins_released": r.pins_released,
                        "stores_dropped": r.stores_dropped,
                        "lease_ttl_s": self.settings.lease_ttl_s,
                    }
                },
            )
        if released:
            self.drain_events()
        return released

    def drain_events(self) -> None:
        """Move the manager's new KV events into the buffer routers read."""
        events = self.manager.take_events()
        if events:
            self.events.extend(events)

    # ------------------------------------------------------------------ engine operations

    # Each op is observed (``self.observer``): its result, its keys by outcome, with the
    # request's id as exemplar; a manager error is counted as result "error" and re-raised.

    def start_request(self, req_id: str, kv_transfer_params: Mapping[str, Any] | None) -> bool:
        """Start or renew a request; True if it is new."""
        try:
            created = self.manager.on_new_request(ReqContext(req_id, kv_transfer_params))
        except Exception:
            self.observer.failed("request_start", req_id)
            raise
        self.observer.op("request_start", req_id)
        return created

    def finish_request(self, req_id: str, abort: bool) -> ReleasedLeases:
        """Finish a request (abort: release its leases now)."""
        try:
            released = self.manager.on_request_finished(ReqContext(req_id), abort=abort)
        except Exception:
            self.observer.failed("request_finish", req_id)
            raise
        self.observer.op("request_finish", req_id)
        return released

    def lookup(self, req_id: str, keys: Sequence[BlockKey]) -> LookupOutput:
        """Per-key state and ``hit_prefix``."""
        try:
            out = self.manager.lookup(keys, ReqContext(req_id))
        except Exception:
            self.observer.failed("lookup", req_id)
            raise
        self.observer.lookup(req_id, out)
        return out

    def prepare_load(self, req_id: str, keys: Sequence[BlockKey]) -> list[int]:
        """Pin ready keys; their host slots."""
        try:
            slots = self.manager.prepare_load(keys, ReqContext(req_id))
        except Exception:
            self.observer.failed("prepare_load", req_id)
            raise
        self.observer.prepare_load(req_id, len(slots))
        return slots

    def touch(self, req_id: str, keys: Sequence[BlockKey]) -> None:
        """Mark keys recently used."""
        try:
            self.manager.touch(keys, ReqContext(req_id))
        except Exception:
            self.observer.failed("touch", req_id)
            raise
        self.observer.op("touch", req_id)

    def complete_load(self, req_id: str, keys: Sequence[BlockKey]) -> None:
        """Unpin keys pinned by ``prepare_load``."""
        try:
            self.manager.complete_load(keys, ReqContext(req_id))
        except Exception:
            self.observer.failed("complete_load", req_id)
            raise
        self.observer.complete_load(req_id, len(keys), by_engine=True)

    def _prepare_store(self, req_id: str, keys: Sequence[BlockKey]) -> PrepareStoreOutput:
        try:
            out = self.manager.prepare_store(keys, ReqContext(req_id))
        except Exception:
            self.observer.failed("prepare_store", req_id)
            raise
        self.observer.prepare_store(req_id, len(keys), out)
        if out is None:
            raise no_space(len(keys))
        return out

    def prepare_store(self, req_id: str, keys: Sequence[BlockKey]) -> PrepareStoreOutput:
        """Reserve slots for the new keys; ``APIError`` 507 when no room can be made."""
        return self._prepare_store(req_id, keys)

    def complete_store(
        self, req_id: str, keys: Sequence[BlockKey], success: bool
    ) -> CompleteStoreOutput:
        """Finish this request's stores of ``keys``."""
        try:
            out = self.manager.complete_store(keys, ReqContext(req_id), success=success)
        except Exception:
            self.observer.failed("complete_store", req_id)
            raise
        self.observer.complete_store(req_id, out)
        return out

    def _check_blocks(self, cache: RegisteredCache, device_blocks: Sequence[int]) -> None:
        limit = cache.num_blocks
        bad = [b for b in device_blocks if b >= limit]
        if bad:
            raise APIError(
                422,
                "invalid_field",
                f"device_blocks: {len(bad)} index(es) out of range for KV cache "
                f"{cache.cache_id!r} of {limit} blocks (first: {bad[0]})",
            )

    def offload(
        self,
        req_id: str,
        cache_id: str,
        keys: Sequence[BlockKey],
        device_blocks: Sequence[int],
    ) -> OffloadStarted:
        """Store device blocks under ``keys``: prepare_store, then a device->host job.

        Only ``keys_to_store`` move (resident keys are skipped). The job's end calls
        ``complete_store(success=ok)``. If the job cannot be submitted the reservation is
        undone, so a failed call changes nothing.
        """
        tracker, registry, _ = self._running()
        cache = registry.get(cache_id)
        self._check_blocks(cache, device_blocks)
        ctx = ReqContext(req_id)
        spec = self._prepare_store(req_id, keys)
        if not spec.keys_to_store:
            return OffloadStarted(None, spec)
        block_of: dict[BlockKey, int] = {}
        for key, block in zip(keys, device_blocks, strict=True):
            block_of.setdefault(key, block)
        blocks = [block_of[k] for k in spec.keys_to_store]
        # A refused job is completed as failed by the tracker (reservation undone) and re-raised.
        job = tracker.submit(
            "store",
            ctx,
            cache_id,
            spec.keys_to_store,
            blocks,
            spec.slots,
            self.settings.job_deadline_s,
        )
        return OffloadStarted(job, spec)

    def onload(
        self,
        req_id: str,
        cache_id: str,
        keys: Sequence[BlockKey],
        device_blocks: Sequence[int],
    ) -> OnloadStarted:
        """Load ready keys into device blocks: prepare_load (pins), then a host->device job.

        The job's end calls ``complete_load`` (unpin) whether it succeeded or not; the job
        state says whether the device blocks hold the data. A job that cannot be submitted
        unpins at once.
        """
        tracker, registry, _ = self._running()
        cache = registry.get(cache_id)
        self._check_blocks(cache, device_blocks)
        ctx = ReqContext(req_id)
        slots = self.prepare_load(req_id, keys)
        if not slots:
            return OnloadStarted(None, slots)
        # A refused job is unpinned by the tracker and re-raised.
        job = tracker.submit(
            "load",
            ctx,
            cache_id,
            list(keys),
            list(device_blocks),
            slots,
            self.settings.job_deadline_s,
        )
        return OnloadStarted(job, slots)

    def job(self, job_id: int) -> JobRecord:
        """A transfer job by id; ``APIError`` 404 when unknown (or long forgotten)."""
        tracker, _, _ = self._running()
        record = tracker.get(job_id)
        if record is None:
            raise APIError(404, "unknown_job", f"unknown job {job_id}")
        return record

    async def wait_jobs(self, job_ids: Sequence[int], timeout_s: float) -> list[JobRecord]:
        """Wait until none of the jobs is running, or ``timeout_s`` passed; their records.

        While draining for a shutdown it answers at once, so it never holds up the exit.
        """
        timeout_s = min(timeout_s, self.settings.job_wait_max_s)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            records = [self.job(j) for j in job_ids]
            remaining = deadline - loop.time()
            if remaining <= 0 or self.draining or all(r.state != "running" for r in records):
                return records
            changed = self._jobs_changed
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(remaining):
                    await changed.wait()

    # ------------------------------------------------------------------ KV caches and pool

    def register_cache(self, spec: dict[str, Any]) -> RegisteredCache:
        """Register a device KV cache (``RegistrationError`` when it does not fit the pool)."""
        _, registry, _ = self._running()
        cache = registry.register(KVCacheSpec.from_dict(spec))
        log.info(
            "kv cache registered",
            extra={"fields": {"cache_id": cache.cache_id, "name": cache.name}},
        )
        return cache

    def unregister_cache(self, cache_id: str) -> None:
        """Forget a device KV cache (``UnknownCacheError`` when unknown)."""
        _, registry, _ = self._running()
        registry.get(cache_id)
        registry.unregister(cache_id)

    def caches(self) -> list[RegisteredCache]:
        """Every registered device KV cache."""
        _, registry, _ = self._running()
        return list(registry.list())

    def pool_layout(self) -> dict[str, Any]:
        """The host pool's layout (path, num_blocks, block_bytes, pinned, pool_id)."""
        _, _, pool = self._running()
        return {**pool.layout(), "pool_id": pool.pool_id}

    def host_pool(self) -> HostPool:
        """The running service's pool (to hand its descriptor to engines); 503 otherwise."""
        return self._running()[2]

    @property
    def pool_id(self) -> str | None:
        """The id of the pool this service created (None before it started)."""
        return None if self._pool is None else self._pool.pool_id

    # ------------------------------------------------------------------ admin operations

    def policy(self) -> tuple[PolicyInfo, list[str]]:
        """The active policy and the names of every policy."""
        return self.manager.policy, available_policies()

    def switch_policy(self, name: str, params: Mapping[str, Any], actor: str) -> PolicySwitch:
        """Switch the eviction policy live; audited when it changed something."""
        switch = self.manager.switch_policy(name, params)
        if switch.changed:
            self.observer.policy_switched(switch.previous.name, switch.current.name)
            if self.shadow is not None:
                self.shadow.follow(switch.current)
            audit(
                "policy.switch",
                actor,
                from_policy=switch.previous.name,
                from_params=switch.previous.params,
                to_policy=switch.current.name,
                to_params=switch.current.params,
                generation=switch.current.generation,
                blocks_migrated=switch.blocks_migrated,
            )
        return switch

    def stats(self) -> ManagerStats:
        """The manager's gauges and counters."""
        return self.manager.stats()

    def shadow_state(self) -> ShadowState | None:
        """The shadow evaluation's state (None when it is off)."""
        return None if self.shadow is None else self.shadow.state()

    def log_level(self) -> str:
        """The current log level."""
        return app_logging.get_level()

    def set_log_level(self, level: str, actor: str) -> tuple[str, str]:
        """Set the log level of the whole process live; (previous, current). Audited when it
        changed (audit lines are written whatever the level)."""
        previous = app_logging.set_level(level)
        if previous != level:
            audit("log_level.set", actor, from_level=previous, to_level=level)
        return previous, level

    def snapshot(self) -> ServiceSnapshot:
        """Everything the state collector exports, read now (at scrape time, on the loop)."""
        stats = self.manager.stats()
        inflight = {"store": 0, "load": 0}
        oldest = 0.0
        tracker = self._tracker
        if tracker is not None and self.state == "running":
            for record in tracker.running():
                inflight[record.direction] += 1
            oldest = tracker.oldest_running_age()
        rows = []
        counts = self._request_counts
        if counts is not None:
            rows = counts.rows(self.manager.requests(), self.settings.metrics_live_requests_max)
        projected: dict[str, float] = {}
        if self.shadow is not None:
            projected = dict(self.shadow.projections())
        return ServiceSnapshot(
            stats=stats,
            policy=self.manager.policy,
            block_bytes=self.settings.block_bytes,
            pool_pinned=self._pool is not None and bool(self._pool.pinned),
            inflight=inflight,
            oldest_inflight_seconds=oldest,
            events_dropped=self.events.dropped,
            prefix_hit_ratio=self.observer.hit_window.ratio(),
            projected_hit_ratio=projected,
            live_requests=rows,
        )

    def jobs_running(self) -> tuple[int, float | None]:
        """Number of running transfer jobs and the age of the oldest (None: none running)."""
        if self._tracker is None or self.state != "running":
            return 0, None
        running = self._tracker.running()
        return len(running), (self._tracker.oldest_running_age() if running else None)

    def requests(self) -> list[RequestLeases]:
        """Every tracked request and its leases."""
        return self.manager.requests()

    def _requests_writing(self) -> set[str]:
        """Requests whose store jobs this service is running: their slots are being written."""
        if self._tracker is None:
            return set()
        return {r.req_id for r in self._tracker.running() if r.direction == "store"}

    def release_request(self, req_id: str, actor: str) -> ReleasedLeases:
        """Force-release a request's leases (its engine is presumed gone); audited.

        If one of its store jobs is still running here, the slots that job writes stay
        reserved until it ends, so no other block can be given a slot under a running copy.
        """
        released = self.manager.release_request(
            req_id, writers_alive=req_id in self._requests_writing()
        )
        audit(
            "request.release",
            actor,
            req_id=safe_req_id(req_id),
            pins_released=released.pins_released,
            stores_dropped=released.stores_dropped,
        )
        self.drain_events()
        return released

    def clear_cache(self, actor: str) -> ResetCounts:
        """Drop every unpinned ready block; audited."""
        counts = self.manager.reset()
        audit(
            "cache.clear",
            actor,
            dropped=counts.dropped,
            kept_pinned=counts.kept_pinned,
            kept_pending=counts.kept_pending,
        )
        self.drain_events()
        return counts
