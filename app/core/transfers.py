"""The data path of a running service: host pool, registered KV caches, worker and job tracker.

``Transfers`` exists while the service runs (``Transfers.open`` at start, ``close`` at stop).
It runs the two composite engine operations and everything about jobs and KV caches:

- ``offload`` = ``prepare_store`` (observed), then a device->host job for the keys that must
  move; the job's end completes the store (``complete_store(success=ok)``). Only
  ``keys_to_store`` move (resident keys are skipped). If the job cannot be submitted the
  reservation is undone, so a failed call changes nothing.
- ``onload`` = ``prepare_load`` (pins), then a host->device job; the job's end unpins
  (``complete_load``) whether it succeeded or not, and the job's state says whether the device
  blocks hold the data. A job that cannot be submitted unpins at once. Keys the pool lacks but a
  lower tier holds (disk, remote) are brought in inside the same job: it answers at once
  (``running``) and copies in parts, the pool's hits at once, then the keys of each promotion
  (a disk promotion is split in ``--disk-batch-bytes`` chunks) as soon as it lands
  (``DeferredLoad``), so copies overlap the reads still running; a key that could not be
  brought in fails the job (later parts are not copied; it ends once the parts copying have
  settled). Keys no tier holds: 409 as before.
- Both take an optional ``wait_event`` (a CUDA IPC event handle the engine recorded after its
  kernels): the copies wait on it. Refused (``InvalidJobError`` naming it) for a cache with no
  CUDA tensor, before anything is reserved.
- Registrations may carry a lease (``lease_s``): ``renew_cache`` extends it, ``expire_caches``
  (the service's sweep) forgets the lapsed ones and fails their queued jobs, so a dead
  engine's IPC mappings (its GPU memory) go once its running jobs end.
- ``wait``: long-poll until none of the given jobs runs, woken by ``collect`` when jobs end, and
  at once while draining or after ``close`` (so it never holds up a shutdown).

Completions go to the observed manager (the tracker's sink), so jobs are observed like engine
calls. Errors: ``UnknownJobError``, ``DeviceBlockError``, ``ServiceUnavailableError`` after
``close``, and the transfer layer's own; at ``open``, ``ConfigError`` (``app.settings``) for a
device the machine lacks or a pool that does not fit (``check_machine``, also called before the
listeners bind) and a pool that cannot be made with the settings.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from app.core.errors import DeviceBlockError, ServiceUnavailableError, UnknownJobError
from app.core.observed import Bringing, ObservedManager
from app.settings import Settings, config_error, setting_names
from app.telemetry.logging import get_logger
from manager import BlockKey, ManagerError, PrepareStoreOutput, ReqContext
from transfer import (
    FaultSpec,
    HostPool,
    InvalidJobError,
    JobRecord,
    JobTracker,
    KVCacheRegistry,
    KVCacheSpec,
    PoolError,
    RegisteredCache,
    TransferError,
    TransferWorker,
    create_worker,
)
from transfer.host_pool import available_memory

log = get_logger("service")


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


def fault_spec(settings: Settings) -> FaultSpec | None:
    """The injected faults the settings ask for (None: faults off)."""
    if not settings.faults_enabled:
        return None
    return FaultSpec(
        fail_rate=settings.fault_fail_rate,
        delay_s=settings.fault_delay_s,
        hang_rate=settings.fault_hang_rate,
        seed=settings.fault_seed,
    )


def check_machine(settings: Settings) -> None:
    """``ConfigError`` when this machine cannot run the settings: ``--device`` asks for a CUDA
    device it lacks (``cuda`` is ``cuda:0``; ``auto`` falls back to the CPU), ``--shm-dir`` is
    not a directory, or the pool (``--num-blocks`` x ``--block-bytes``) is larger than the
    memory available. Cheap, so it runs before anything is made.

    The pool is a sealed memfd (``transfer.host_pool``), in no directory: ``--shm-dir`` no
    longer places it and is only still checked, so that settings that name it keep starting.
    """
    _check_device(settings.device, settings.cuda_index)
    shm_dir = settings.shm_dir
    if not os.path.isdir(shm_dir):
        raise config_error("shm_dir", shm_dir, "not a directory; accepted: a directory")
    avail = available_memory()
    total = settings.num_blocks * settings.block_bytes
    if avail is not None and settings.block_bytes > avail:
        # Not one block fits: fewer blocks would not help, a smaller block would.
        raise config_error(
            "block_bytes",
            settings.block_bytes,
            f"one block does not fit in memory ({avail} bytes available); accepted: at most "
            f"{avail} bytes",
        )
    if avail is not None and total > avail:
        raise config_error(
            "num_blocks",
            settings.num_blocks,
            f"a pool of {total} bytes (x {setting_names('block_bytes')} = "
            f"{settings.block_bytes}) does not fit in memory ({avail} bytes available); "
            f"accepted: at most {avail // settings.block_bytes} blocks",
        )


def _check_device(device: str, index: int | None) -> None:
    if index is None:
        return
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if index < count:
        return
    if count == 0:
        raise config_error("device", device, "no CUDA device on this machine; accepted: auto, cpu")
    raise config_error(
        "device",
        device,
        f"this machine has {count} CUDA device(s); accepted: auto, cpu, cuda:0 to cuda:{count - 1}",
    )


class Transfers:
    """Pool, KV caches, worker and jobs of a running service; see the module docstring."""

    def __init__(
        self,
        settings: Settings,
        manager: ObservedManager,
        pool: HostPool,
        registry: KVCacheRegistry,
        worker: TransferWorker,
        also_writing: Callable[[], set[str]] | None = None,
    ) -> None:
        self.settings = settings
        self.manager = manager
        self.pool = pool
        self.registry = registry
        self.worker = worker
        self.tracker = JobTracker(worker, manager, max_finished=settings.max_finished_jobs)
        self.draining = False
        self.closed = False
        # Other writers into the pool's reserved slots (the lower tiers' promotions).
        self.also_writing = also_writing
        # Loads waiting for their keys to be brought up from a lower tier.
        self._deferred: set[asyncio.Task[None]] = set()
        # Replaced on every batch of finished jobs; waiters hold the one current when they
        # started waiting.
        self._changed = asyncio.Event()

    @classmethod
    async def open(
        cls,
        settings: Settings,
        manager: ObservedManager,
        on_finished: Callable[[], None],
        *,
        also_writing: Callable[[], set[str]] | None = None,
    ) -> Transfers:
        """Create the pool (off the loop: a large pinned pool takes a while), the registry and
        the worker; ``on_finished`` is called from the worker thread when a job ends.
        ``also_writing``: the internal requests of other writers into the pool's reserved
        slots (the lower tiers' promotions), whose stores no lease expiry may drop."""
        s = settings
        check_machine(s)
        try:
            pool = await asyncio.to_thread(
                HostPool.create,
                s.num_blocks,
                s.block_bytes,
                pin=s.pin_memory,
                pin_device=s.cuda_index,
            )
        except (PoolError, OSError) as exc:
            raise config_error(
                "num_blocks",
                s.num_blocks,
                f"cannot make the pool ({exc}); accepted: a pool that fits: fewer blocks, a "
                f"smaller {setting_names('block_bytes')}, or more memory",
            ) from None
        try:
            registry = KVCacheRegistry(
                pool, max_caches=s.max_registrations, max_bytes=s.max_mapped_bytes
            )
            worker = create_worker(
                pool,
                registry,
                backend=s.transfer_backend,
                faults=fault_spec(s),
                on_finished=on_finished,
                copy_threads=s.copy_threads or None,
                allow_pageable=s.allow_pageable_pool,
            )
        except BaseException:
            pool.close()
            raise
        return cls(settings, manager, pool, registry, worker, also_writing)

    async def close(self) -> list[JobRecord]:
        """Stop the worker (running jobs end or fail within the grace), complete what ended,
        free the KV caches and the pool, and release every waiter; the jobs that ended."""
        for task in list(self._deferred):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await asyncio.to_thread(self.worker.shutdown, self.settings.shutdown_grace_s)
        finished = self.collect()
        self.registry.close()
        # A DMA still queued on a stream must not see its memory unregistered.
        self.pool.close(unpin=self.worker.quiesced)
        self.closed = True
        self.notify()
        return finished

    def _open(self) -> None:
        if self.closed:
            raise ServiceUnavailableError("service is stopped")

    # ------------------------------------------------------------------ jobs

    def collect(self) -> list[JobRecord]:
        """Complete the jobs that ended (in the manager, through the observed sink) and wake
        the waiters; the finished records."""
        # A copied context: the ids the completions bind for logging stay in there.
        finished = contextvars.copy_context().run(self.tracker.poll)
        if finished:
            self.notify()
        return finished

    def notify(self) -> None:
        """Wake every ``wait`` to look again."""
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def job(self, job_id: int) -> JobRecord:
        """A transfer job by id; ``UnknownJobError`` when unknown (or long forgotten)."""
        self._open()
        record = self.tracker.get(job_id)
        if record is None:
            raise UnknownJobError(job_id)
        return record

    async def wait(self, job_ids: Sequence[int], timeout_s: float) -> list[JobRecord]:
        """Wait until none of the jobs is running, or ``timeout_s`` (capped by
        ``job_wait_max_s``) passed; their records. Answers at once while draining."""
        timeout_s = min(timeout_s, self.settings.job_wait_max_s)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            records = [self.job(j) for j in job_ids]
            remaining = deadline - loop.time()
            if remaining <= 0 or self.draining or all(r.state != "running" for r in records):
                return records
            changed = self._changed
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(remaining):
                    await changed.wait()

    def running(self) -> tuple[int, float | None]:
        """Number of running jobs and the age of the oldest (None: none running)."""
        running = self.tracker.running()
        return len(running), (self.tracker.oldest_running_age() if running else None)

    def writing(self) -> set[str]:
        """Requests whose store jobs run here (or whose blocks the remote tier is reading into
        the pool): the slots they reserved are being written."""
        jobs = {r.req_id for r in self.tracker.running() if r.direction == "store"}
        return jobs if self.also_writing is None else jobs | self.also_writing()

    # ------------------------------------------------------------------ engine operations

    def _cache(
        self, cache_id: str, device_blocks: Sequence[int], wait_event: bytes | None = None
    ) -> RegisteredCache:
        self._open()
        cache = self.registry.get(cache_id)
        bad = [b for b in device_blocks if b >= cache.num_blocks]
        if bad:
            raise DeviceBlockError(cache.cache_id, cache.num_blocks, bad)
        if wait_event is not None and not any(d.startswith("cuda") for d in cache.devices):
            raise InvalidJobError(
                f"wait_event: cache {cache_id} has no CUDA tensor; an event orders nothing here"
            )
        return cache

    def offload(
        self,
        req_id: str,
        cache_id: str,
        keys: Sequence[BlockKey],
        device_blocks: Sequence[int],
        wait_event: bytes | None = None,
    ) -> OffloadStarted:
        """Store device blocks under ``keys`` (module docstring)."""
        self._cache(cache_id, device_blocks, wait_event)
        ctx = ReqContext(req_id)
        spec = self.manager.prepare_store(keys, ctx)
        if not spec.keys_to_store:
            return OffloadStarted(None, spec)
        block_of: dict[BlockKey, int] = {}
        for key, block in zip(keys, device_blocks, strict=True):
            block_of.setdefault(key, block)
        blocks = [block_of[k] for k in spec.keys_to_store]
        # A refused job is completed as failed by the tracker (reservation undone) and re-raised.
        job = self.tracker.submit(
            "store",
            ctx,
            cache_id,
            spec.keys_to_store,
            blocks,
            spec.slots,
            self.settings.job_deadline_s,
            wait_event,
        )
        return OffloadStarted(job, spec)

    def onload(
        self,
        req_id: str,
        cache_id: str,
        keys: Sequence[BlockKey],
        device_blocks: Sequence[int],
        wait_event: bytes | None = None,
    ) -> OnloadStarted:
        """Load ready keys into device blocks (module docstring)."""
        self._cache(cache_id, device_blocks, wait_event)
        ctx = ReqContext(req_id)
        outcome = self.manager.load_or_bring_up(keys, ctx)
        if isinstance(outcome, Bringing):
            # A key nobody brings in (no tier below holds it, no promotion or store covers
            # it) is a 409; otherwise the load waits for what is coming.
            if not outcome.promotions or outcome.unreachable:
                raise outcome.refusal()
            record = self.tracker.defer(ctx, cache_id, keys)
            load = DeferredLoad(
                record,
                device_blocks,
                wait_event,
                tracker=self.tracker,
                manager=self.manager,
                check_cache=self._cache,
                deadline_s=self.settings.job_deadline_s,
                notify=self.notify,
            )
            # The pool's hits are pinned and copied now, before anything can evict them.
            if load.launch_ready(last=False):
                task = asyncio.get_running_loop().create_task(
                    load.run(outcome.promotions), name="kvoffload-onload-after-promotion"
                )
                self._deferred.add(task)
                task.add_done_callback(self._deferred.discard)
            return OnloadStarted(record, [])
        slots = outcome
        if not slots:
            return OnloadStarted(None, slots)
        # A refused job is unpinned by the tracker and re-raised.
        job = self.tracker.submit(
            "load",
            ctx,
            cache_id,
            list(keys),
            list(device_blocks),
            slots,
            self.settings.job_deadline_s,
            wait_event,
        )
        return OnloadStarted(job, slots)

    # ------------------------------------------------------------------ KV caches and pool

    def register_cache(
        self, spec: dict[str, Any], fds: Sequence[int] | None = None
    ) -> RegisteredCache:
        """Register a device KV cache (``RegistrationError`` when it does not fit the pool);
        ``fds``: the descriptors passed with it over the pool socket (None: an HTTP call).
        ``ServiceUnavailableError`` once the backend failed for good: mapping memory in a
        lost CUDA context fails, and freeing what was mapped would abort the process."""
        self._open()
        if self.worker.fatal is not None:
            raise ServiceUnavailableError(
                f"transfer backend failed for good (restart needed): {self.worker.fatal}"
            )
        cache = self.registry.register(KVCacheSpec.from_dict(spec), fds)
        log.info(
            "kv cache registered",
            extra={"fields": {"cache_id": cache.cache_id, "name": cache.name}},
        )
        return cache

    def unregister_cache(self, cache_id: str) -> None:
        """Forget a device KV cache (``UnknownCacheError`` when unknown)."""
        self._open()
        self.registry.get(cache_id)
        self.registry.unregister(cache_id)

    def renew_cache(self, cache_id: str) -> float:
        """Renew a registration's lease; its ``lease_s`` (0.0: none). ``UnknownCacheError``
        when unknown or already expired (the engine must register again)."""
        self._open()
        return self.registry.renew(cache_id)

    def expire_caches(self) -> list[RegisteredCache]:
        """Forget the registrations whose lease lapsed and fail their queued jobs; their
        mappings close once their running jobs end. The caches forgotten."""
        if self.closed:
            return []
        gone = self.registry.expire()
        for cache in gone:
            running = self.worker.drop_cache(cache.cache_id, "kv cache lease expired")
            log.warning(
                "kv cache lease expired; registration dropped",
                extra={
                    "fields": {
                        "cache_id": cache.cache_id,
                        "name": cache.name,
                        "jobs_still_running": len(running),
                    }
                },
            )
        return gone

    def caches(self) -> list[RegisteredCache]:
        """Every registered device KV cache."""
        self._open()
        return list(self.registry.list())

    def pool_layout(self) -> dict[str, Any]:
        """The host pool's layout (path, num_blocks, block_bytes, pinned, pool_id)."""
        self._open()
        return {**self.pool.layout(), "pool_id": self.pool.pool_id}


class DeferredLoad:
    """One ``onload`` whose keys a lower tier is still bringing into the pool, copied in parts:
    ``launch_ready`` pins and copies the keys ready now (first the load's pool hits, at once),
    ``run`` each promotion's keys as it lands, so the copy of one part overlaps the reads of
    the next. A key that no promotion made ready, or a part that cannot be pinned or copied,
    fails the load (``JobTracker.fail``); later parts are then not copied."""

    def __init__(
        self,
        record: JobRecord,
        device_blocks: Sequence[int],
        wait_event: bytes | None,
        *,
        tracker: JobTracker,
        manager: ObservedManager,
        check_cache: Callable[[str, Sequence[int], bytes | None], object],
        deadline_s: float,
        notify: Callable[[], None],
    ) -> None:
        self.record = record
        self.device_blocks = list(device_blocks)
        self.wait_event = wait_event
        self.tracker = tracker
        self.manager = manager
        self.check_cache = check_cache
        self.deadline_s = deadline_s
        self.notify = notify
        # Keys not copied yet, each with its positions in the load.
        self.todo: dict[BlockKey, list[int]] = {}
        for i, key in enumerate(record.keys):
            self.todo.setdefault(key, []).append(i)

    async def run(self, coming: list[asyncio.Task[None]]) -> None:
        """Copy the keys of each promotion in ``coming`` as it lands; the last one settles the
        load (module docstring)."""
        pending = set(coming)
        try:
            while pending:
                _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                if not self.launch_ready(last=not pending):
                    return
        except asyncio.CancelledError:
            self.tracker.fail(self.record, "service stopping")
            raise
        finally:
            self.notify()

    def launch_ready(self, last: bool) -> bool:
        """Pin and copy the keys that are ready now; ``last``: no promotion is left, so a key
        still missing fails the load. False once the load has failed."""
        record, tracker = self.record, self.tracker
        if tracker.failed(record):
            return False
        ready = self.manager.ready_among(self.todo)
        if last and len(ready) < len(self.todo):
            missing = len(self.todo) - len(ready)
            tracker.fail(record, f"not loadable after promotion: {missing} key(s) missing")
            return False
        positions = [i for k in ready for i in self.todo.pop(k)]
        keys = [record.keys[i] for i in positions]
        try:
            self.check_cache(record.cache_id, self.device_blocks, self.wait_event)
            slots = self.manager.prepare_load(keys, record.ctx) if keys else []
        except (ManagerError, TransferError, ServiceUnavailableError, DeviceBlockError) as exc:
            tracker.fail(record, f"not loadable after promotion: {type(exc).__name__}")
            return False
        left = self.deadline_s - (time.monotonic() - record.started)
        blocks = [self.device_blocks[i] for i in positions]
        return tracker.launch(
            record, keys, blocks, slots, max(left, 0.001), self.wait_event, last=last
        )
