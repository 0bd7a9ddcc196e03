"""The service: one object that owns the manager, the data path and the background tasks.

Both listeners (engine API and admin API) share one ``Service``, a composition of rooms:

- ``manager``: the ``ObservedManager`` (``app.core.observed``), through which every
  request-scoped manager call goes, observed once. Every call runs on the event loop with no
  ``await`` between the calls that make up one operation, so operations are atomic w.r.t. each
  other. The bare ``OffloadManager`` is ``pool_manager``, for reads and the service's upkeep.
- ``transfers()``: the running data path (``app.core.transfers``: host pool, KV caches, worker,
  jobs; ``offload``, ``onload``, ``wait``), or ``ServiceUnavailableError`` when not running.
- ``admin``: the operator's operations (``app.core.admin``: policy, stats, leases, clear, log
  level), audited.
- ``events``: the ``EventBuffer`` of KV events served to routers (``drain_events`` fills it).
- telemetry: ``observer`` (``app.telemetry.observer``), the ``Metrics`` in ``registry`` (one per
  service; None when ``metrics_enabled`` is off) whose state collector reads ``snapshot()``.
- ``shadow``: with shadow evaluation on, the ``ShadowRunner`` (``app.core.shadow``) fed every
  finished request's chain by the manager (it only queues), replaying them off the request path.
- ``control``: cache control (``app.core.control``: retentions, prefetches, demote and drop
  hints) over the bare manager and the tiers.
- ``tiers``: the chain of tiers below the pool (``app.core.lower_tiers``: by default the disk
  tier, then the remote tier, as configured), opened on the pool at start and closed before it.

Background tasks while running (``app.core.background``): the *completion pump* (``pump``:
woken from the worker thread when a job ends; it completes jobs in the manager), the *lease
sweeper* (``sweeper``, so a crashed engine cannot leak the pool) and the *shadow drain*.

Lifecycle: ``async with service.running():`` starts it and stops it on exit; it is reference
counted, so each listener's lifespan can hold it and the last one out stops it.
``begin_drain()`` marks it not ready (``readiness``) ahead of a shutdown. Nothing here speaks
HTTP: refusals are domain errors (``app.core.errors`` and the libraries'), mapped at the edge.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Literal

from prometheus_client import CollectorRegistry

from app.core.admin import Admin
from app.core.background import CompletionPump, LeaseSweeper
from app.core.control import Control
from app.core.control_shared import ControlShared
from app.core.errors import ServiceUnavailableError
from app.core.events import EventBuffer
from app.core.kv_publisher import BlockMetadata, EventSink
from app.core.lower_tiers import TierChain
from app.core.observed import ObservedManager
from app.core.quota import TenantQuota
from app.core.shadow import ShadowRunner
from app.core.tier import TierBackend
from app.core.transfers import Transfers
from app.settings import Settings
from app.telemetry.logging import get_logger
from app.telemetry.metrics import Metrics, ServiceSnapshot
from app.telemetry.observer import Observer, RequestCounts
from manager import AllBlocksCleared, BlockKey, OffloadManager, ReleasedLeases, create_manager

log = get_logger("service")
#: The namespace of a service without tenants (the only one it has).
DEFAULT_NAMESPACE = "default"
Clock = Callable[[], float]
State = Literal["new", "running", "stopping", "stopped"]
# The request-count table may hold this many more entries than the live table shows.
_REQUEST_COUNTS_SLACK = 4


def _pool_manager(
    settings: Settings, manager: OffloadManager | None, clock: Clock
) -> OffloadManager:
    """``manager``, checked against ``settings``' pool size, or a new one from them."""
    if manager is None:
        return create_manager(
            settings.num_blocks,
            settings.policy,
            settings.store_threshold,
            policy_params=settings.policy_params,
            clock=clock,
            max_events=settings.event_buffer_size,
        )
    if manager.num_blocks != settings.num_blocks:
        raise ValueError(
            f"manager has {manager.num_blocks} blocks but settings say {settings.num_blocks}"
        )
    return manager


def _shadow_runner(settings: Settings, manager: OffloadManager) -> ShadowRunner | None:
    """With shadow evaluation on, its runner, fed every finished request's chain."""
    if not settings.shadow_enabled:
        return None
    shadow = ShadowRunner(
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
    manager.add_chain_listener(shadow.observe)
    return shadow


class Service:
    """The shared state of both listeners; see the module docstring."""

    def __init__(
        self,
        settings: Settings,
        *,
        manager: OffloadManager | None = None,
        clock: Clock = time.monotonic,
        registry: CollectorRegistry | None = None,
        namespace: str = DEFAULT_NAMESPACE,
        quota: TenantQuota | None = None,
        tier_backends: Mapping[str, TierBackend] | None = None,
        storage: str | None = None,
    ) -> None:
        """``registry``: where the metrics go (a new one by default); unused with metrics off.

        ``namespace``: the namespace this service is (one service per namespace;
        ``app.core.tenancy``), as logs, metrics and the admin API name it. ``storage``: its
        storage identity (``app.core.storage``), the name its blocks live under below the pool
        (its disk directory, its remote key prefix), which must change whenever its owner does;
        None: ``namespace`` itself (a service without tenants). ``quota``: the quotas of the
        tenant that owns it (None: none). ``tier_backends``: tier backends by name, used
        instead of the registered ones of the same name (``app.core.tier``; tests give their
        own). A ``tiers`` chain that names an unknown or unconfigured tier is a ``ConfigError``
        here, before anything starts.
        """
        self.settings = settings
        self.namespace = namespace
        self.storage = namespace if storage is None else storage
        self.quota = quota
        #: The pool's bookkeeping itself, for reads and the service's own upkeep (events,
        #: snapshots, lease expiry); engine-facing calls go through ``manager`` (observed).
        self.pool_manager = _pool_manager(settings, manager, clock)
        self._init_state()
        # Every event the manager emits, whichever call made it, reaches the routers' buffer
        # and the publisher at once: nothing else has to remember to drain them.
        self.pool_manager.set_event_sink(self.drain_events)
        self.tiers = TierChain(settings, self.storage, overrides=tier_backends)
        self._init_telemetry(registry)
        self._init_rooms(clock)

    def _init_state(self) -> None:
        """The service's own state: its event buffer, publisher hooks, identity, lifecycle."""
        self.events = EventBuffer(self.settings.event_buffer_size)
        # KV events for routers (app.core.kv_publisher), set by whoever runs the publisher:
        # the sink hears every event drained into ``events``; ``block_meta`` keeps what
        # engines said of their blocks (token ids, parents) for those events.
        self.on_events: EventSink | None = None
        self.block_meta: BlockMetadata | None = None
        self.instance = uuid.uuid4().hex[:16]
        self.state: State = "new"
        self.draining = False
        # Called once with the reason when the transfer backend fails for good (a poisoned
        # CUDA context); the server sets it to stop and exit non-zero.
        self.on_fatal: Callable[[str], None] | None = None
        self._fatal_reported = False
        self._users = 0
        self._transfers: Transfers | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._lock = asyncio.Lock()

    def _init_telemetry(self, registry: CollectorRegistry | None) -> None:
        """The metrics (in ``registry``, a new one by default; none with metrics off), the
        live-request counts and the observer every room reports to."""
        settings = self.settings
        self.registry: CollectorRegistry | None = None
        self.metrics: Metrics | None = None
        if settings.metrics_enabled:
            self.registry = registry if registry is not None else CollectorRegistry()
            self.metrics = Metrics(
                self.registry,
                snapshot=self.snapshot,
                live_request_series=settings.metrics_live_requests,
                max_live_series=settings.metrics_live_requests_max,
                tiers=self.tiers.names,
            )
        self.request_counts = (
            RequestCounts(_REQUEST_COUNTS_SLACK * settings.metrics_live_requests_max)
            if self.metrics is not None and settings.metrics_live_requests
            else None
        )
        self.observer = Observer(
            self.metrics,
            hit_window=settings.metrics_hit_window,
            request_counts=self.request_counts,
        )

    def _init_rooms(self, clock: Clock) -> None:
        """The rooms over the pool: the observed manager, cache control, the background
        tasks, shadow evaluation and the admin operations."""
        settings, manager = self.settings, self.pool_manager
        self.manager = ObservedManager(manager, self.observer, self.tiers, self.quota)
        shared = ControlShared(
            settings,
            manager,
            self.tiers,
            namespace=self.namespace,
            observer=self.observer,
            clock=clock,
        )
        self.control = Control(shared)
        self.manager.load_listeners.append(self.control.loaded)
        self.pump = CompletionPump(lambda: self._transfers, self.observer)
        self.sweeper = LeaseSweeper(
            settings,
            manager,
            lambda: self._transfers,
            self._check_fatal,
            self.request_counts,
            self.control,
        )
        self.shadow = _shadow_runner(settings, manager)
        self.admin = Admin(
            manager,
            self.observer,
            self.shadow,
            transfers=self.running_transfers,
            namespace=self.namespace,
        )

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
        """Open the data path (pool, registry, worker, tracker) and start the background
        tasks."""
        async with self._lock:
            if self._users:
                self._users += 1
                return
            if self.state != "new":
                raise RuntimeError(f"service cannot start from state {self.state!r}")
            s = self.settings
            if self.on_events is not None:
                # A router's view of this namespace starts empty, as its pool does: a restarted
                # kvoffload's stream opens with a clear (its sequence numbers jump: kv_publisher).
                self.on_events([AllBlocksCleared(0)])
            self.pump.bind(asyncio.get_running_loop())
            transfers = await Transfers.open(
                s, self.manager, self.pump.wake, also_writing=self.tiers.writing
            )
            self._transfers = transfers
            try:
                await self.tiers.open(transfers.pool, self.pool_manager, self.observer)
            except BaseException:
                for record in await transfers.close():
                    self.observer.transfer_done(record)
                self._transfers = None
                raise
            self._tasks = [
                asyncio.create_task(self.pump.run(), name="kvoffload-completion-pump"),
                asyncio.create_task(self.sweeper.run(), name="kvoffload-lease-sweeper"),
            ]
            if self.shadow is not None:
                self._tasks.append(
                    asyncio.create_task(self.shadow.run(), name="kvoffload-shadow-drain")
                )
            self.state = "running"
            self._users = 1
            log.info("service started", extra={"fields": _started_fields(self, transfers)})

    async def stop(self) -> None:
        """Drop one hold; the last one stops the worker (jobs end or fail) and frees the pool."""
        async with self._lock:
            self._users -= 1
            if self._users > 0 or self.state != "running":
                return
            self.state = "stopping"
            self.begin_drain()
            for task in self._tasks:
                task.cancel()
            for task in self._tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            self._tasks = []
            self.control.close()
            assert self._transfers is not None
            # Before the pool goes: the tiers wait for their calls still touching it.
            await self.tiers.close()
            for record in await self._transfers.close():
                self.observer.transfer_done(record)
            self.state = "stopped"
            log.info("service stopped", extra={"fields": {"namespace": self.namespace}})

    def begin_drain(self) -> None:
        """Report not-ready from now on (a shutdown is coming); long-polls answer now."""
        self.draining = True
        if self._transfers is not None:
            self._transfers.draining = True
            self._transfers.notify()

    def readiness(self) -> str | None:
        """None when ready, else why not."""
        if self.state != "running":
            return f"service is {self.state}"
        assert self._transfers is not None
        fatal = self._transfers.worker.fatal
        if fatal is not None:
            return f"transfer backend failed for good (restart needed): {fatal}"
        if self.draining:
            return "shutting down"
        age = self._transfers.tracker.oldest_running_age()
        if age > self.settings.job_deadline_s:
            deadline = self.settings.job_deadline_s
            return f"a transfer has been running {age:.1f}s, past its {deadline}s deadline"
        return None

    def details(self) -> dict[str, str]:
        """What a ready service still wants known (``/readyz`` details: degraded tiers)."""
        return self.tiers.details()

    def transfers(self) -> Transfers:
        """The running data path; ``ServiceUnavailableError`` when the service is not running."""
        transfers = self.running_transfers()
        if transfers is None:
            raise ServiceUnavailableError(f"service is {self.state}")
        return transfers

    @property
    def pool_id(self) -> str | None:
        """The id of the pool this service created (None before it started)."""
        return None if self._transfers is None else self._transfers.pool.pool_id

    def running_transfers(self) -> Transfers | None:
        """The data path while the service runs, else None."""
        return self._transfers if self.state == "running" else None

    # ------------------------------------------------------------------ background work

    def _check_fatal(self) -> None:
        """A poisoned CUDA context fails every later copy: hand over to ``on_fatal`` (the
        server stops and exits non-zero for its supervisor to restart it), once."""
        t = self._transfers
        if t is None or t.worker.fatal is None or self._fatal_reported:
            return
        self._fatal_reported = True
        log.error(
            "transfer backend failed for good; the service must restart",
            extra={"fields": {"reason": t.worker.fatal}},
        )
        self.begin_drain()
        if self.on_fatal is not None:
            self.on_fatal(t.worker.fatal)

    def expire_leases(self) -> list[ReleasedLeases]:
        """Release the leases of silent requests now (``LeaseSweeper.expire``)."""
        return self.sweeper.expire()

    def drain_events(self) -> None:
        """Move the manager's new KV events into the buffer routers read."""
        events = self.pool_manager.take_events()
        if events:
            self.events.extend(events)
            if self.on_events is not None:
                # This runs inside the manager call that emitted them (its event sink): a
                # publisher that raised must not leave that call half done.
                try:
                    self.on_events(events)
                except Exception:
                    log.exception("KV events not handed to the publisher")

    def note_blocks(
        self,
        keys: list[BlockKey],
        token_ids: list[int] | None,
        block_size: int | None,
        parent: BlockKey | None,
        stored: list[BlockKey],
    ) -> None:
        """Keep what an engine's store call said of ``keys`` (its tokens, ``block_size`` per
        key, and the key before the first) for the routers' events, for ``stored``, the keys
        it stores (``BlockMetadata.note``); nothing when KV events are off. The caller has
        checked the lengths."""
        if self.block_meta is not None and (token_ids or parent is not None):
            self.block_meta.note(keys, token_ids, block_size, parent, stored)

    # ------------------------------------------------------------------ telemetry

    def snapshot(self) -> ServiceSnapshot:
        """Everything the state collector exports, read now (at scrape time, on the loop)."""
        manager = self.pool_manager
        inflight = {"store": 0, "load": 0}
        oldest = 0.0
        transfers = self._transfers
        if transfers is not None and self.state == "running":
            for record in transfers.tracker.running():
                inflight[record.direction] += 1
            oldest = transfers.tracker.oldest_running_age()
        rows = []
        counts = self.request_counts
        if counts is not None:
            rows = counts.rows(manager.requests(), self.settings.metrics_live_requests_max)
        projected: dict[str, float] = {}
        if self.shadow is not None:
            projected = dict(self.shadow.projections())
        return ServiceSnapshot(
            stats=manager.stats(),
            policy=manager.policy,
            block_bytes=self.settings.block_bytes,
            pool_pinned=transfers is not None and bool(transfers.pool.pinned),
            inflight=inflight,
            oldest_inflight_seconds=oldest,
            events_dropped=self.events.dropped,
            prefix_hit_ratio=self.observer.hit_window.ratio(),
            projected_hit_ratio=projected,
            live_requests=rows,
            tier_reports=self.tiers.reports(),
            tier_metrics=[*self.tiers.metric_families(), *self.control.metric_families()],
        )


def _backend_name(transfers: Transfers) -> str:
    """The transfer backend chosen (``auto`` resolved: ``cpu`` or ``cuda``; a fault-injecting
    wrapper as ``faulty(<the backend it wraps>)``)."""
    worker = transfers.worker
    inner = getattr(worker, "inner", None)
    if inner is not None:
        return f"{worker.backend}({inner.backend})"
    return worker.backend


def _started_fields(service: Service, transfers: Transfers) -> dict[str, object]:
    """What the ``service started`` line says: where the pool is and what serves it."""
    s, shadow = service.settings, service.shadow
    return {
        "namespace": service.namespace,
        "tenant": None if service.quota is None else service.quota.tenant,
        "storage": service.storage,
        "pool": transfers.pool.path,
        "pool_id": transfers.pool.pool_id,
        "num_blocks": s.num_blocks,
        "block_bytes": s.block_bytes,
        "pinned": transfers.pool.pinned,
        "policy": service.pool_manager.policy.name,
        "backend": _backend_name(transfers),
        "faults": s.faults_enabled,
        "metrics": service.metrics is not None,
        "shadow_policies": None if shadow is None else shadow.evaluator.policies,
        "tiers": {tier.name: tier.summary() for tier in service.tiers.tiers},
    }
