"""The service: one object that owns the manager, the host pool and the transfer machinery.

Both listeners (engine API and admin API) share one ``Service``. It owns:

- the ``OffloadManager`` (bookkeeping; every call runs on the event loop, with no ``await``
  between the calls that make up one operation, so operations are atomic w.r.t. each other);
- the ``HostPool`` (shared memory), the ``KVCacheRegistry`` (device KV caches registered by
  engines), the transfer worker and the ``JobTracker`` that calls ``complete_store`` /
  ``complete_load`` on the manager when a job ends (a completion that arrives after the
  request's leases were released is logged and dropped by the tracker);
- the ``EventBuffer`` of KV events served to routers;
- two background tasks: the *completion pump* (woken from the worker thread through
  ``loop.call_soon_threadsafe`` when a job ends; it finishes jobs in the manager) and the
  *lease sweeper* (``expire_requests(lease_ttl_s)``, so a crashed engine cannot leak the pool).

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
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from app.errors import APIError, no_space, unavailable
from app.events import EventBuffer
from app.logging import audit, get_logger
from app.settings import Settings
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
    ) -> None:
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
            self._tracker = JobTracker(worker, self.manager, max_finished=s.max_finished_jobs)
            self._tasks = [
                asyncio.create_task(self._pump_loop(), name="kvoffload-completion-pump"),
                asyncio.create_task(self._lease_loop(), name="kvoffload-lease-sweeper"),
            ]
            self.state = "running"
            self._users = 1
            log.info(
                "service started",
                extra={
                    "fields": {
                        "pool": pool.path,
                        "num_blocks": s.num_blocks,
                        "block_bytes": s.block_bytes,
                        "pinned": pool.pinned,
                        "policy": self.manager.policy.name,
                        "backend": s.transfer_backend,
                        "faults": faults is not None,
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
        if self._tracker is not None and self._tracker.poll():
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
            except Exception:
                log.exception("lease sweep failed; retrying")

    def expire_leases(self) -> list[ReleasedLeases]:
        """Release the leases of requests silent for longer than ``lease_ttl_s``."""
        released = self.manager.expire_requests(self.settings.lease_ttl_s)
        for r in released:
            log.warning(
                "request leases expired",
                extra={
                    "fields": {
                        "req_id": r.req_id,
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

    def start_request(self, req_id: str, kv_transfer_params: Mapping[str, Any] | None) -> bool:
        """Start or renew a request; True if it is new."""
        return self.manager.on_new_request(ReqContext(req_id, kv_transfer_params))

    def finish_request(self, req_id: str, abort: bool) -> ReleasedLeases:
        """Finish a request (abort: release its leases now)."""
        return self.manager.on_request_finished(ReqContext(req_id), abort=abort)

    def lookup(self, req_id: str, keys: Sequence[BlockKey]) -> LookupOutput:
        """Per-key state and ``hit_prefix``."""
        return self.manager.lookup(keys, ReqContext(req_id))

    def prepare_load(self, req_id: str, keys: Sequence[BlockKey]) -> list[int]:
        """Pin ready keys; their host slots."""
        return self.manager.prepare_load(keys, ReqContext(req_id))

    def touch(self, req_id: str, keys: Sequence[BlockKey]) -> None:
        """Mark keys recently used."""
        self.manager.touch(keys, ReqContext(req_id))

    def complete_load(self, req_id: str, keys: Sequence[BlockKey]) -> None:
        """Unpin keys pinned by ``prepare_load``."""
        self.manager.complete_load(keys, ReqContext(req_id))

    def prepare_store(self, req_id: str, keys: Sequence[BlockKey]) -> PrepareStoreOutput:
        """Reserve slots for the new keys; ``APIError`` 507 when no room can be made."""
        out = self.manager.prepare_store(keys, ReqContext(req_id))
        if out is None:
            raise no_space(len(keys))
        return out

    def complete_store(
        self, req_id: str, keys: Sequence[BlockKey], success: bool
    ) -> CompleteStoreOutput:
        """Finish this request's stores of ``keys``."""
        return self.manager.complete_store(keys, ReqContext(req_id), success=success)

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
        spec = self.manager.prepare_store(keys, ctx)
        if spec is None:
            raise no_space(len(keys))
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
        slots = self.manager.prepare_load(keys, ctx)
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
        """The host pool's layout (path, num_blocks, block_bytes, pinned)."""
        _, _, pool = self._running()
        return dict(pool.layout())

    # ------------------------------------------------------------------ admin operations

    def policy(self) -> tuple[PolicyInfo, list[str]]:
        """The active policy and the names of every policy."""
        return self.manager.policy, available_policies()

    def switch_policy(self, name: str, params: Mapping[str, Any], actor: str) -> PolicySwitch:
        """Switch the eviction policy live; audited when it changed something."""
        switch = self.manager.switch_policy(name, params)
        if switch.changed:
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

    def jobs_running(self) -> tuple[int, float | None]:
        """Number of running transfer jobs and the age of the oldest (None: none running)."""
        if self._tracker is None or self.state != "running":
            return 0, None
        running = self._tracker.running()
        return len(running), (self._tracker.oldest_running_age() if running else None)

    def requests(self) -> list[RequestLeases]:
        """Every tracked request and its leases."""
        return self.manager.requests()

    def release_request(self, req_id: str, actor: str) -> ReleasedLeases:
        """Force-release a request's leases (its engine is presumed gone); audited."""
        released = self.manager.release_request(req_id)
        audit(
            "request.release",
            actor,
            req_id=req_id,
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
