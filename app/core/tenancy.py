"""Namespaces and tenants: which space an engine call runs in, and who may call.

A *namespace* is a space of its own: one ``Service`` (manager, host pool, worker, jobs, KV-cache
registrations, events, shadow) per namespace. Keys, slots, pool memory, requests and events are
therefore disjoint between namespaces by construction: the same block hash in two namespaces is
two blocks, no slot ever passes from one namespace to another (nothing to scrub), and the pool
handed to an engine is its namespace's pool only.

Without a tenants file there is one namespace, ``default``, and no credentials (the engine
listener is then loopback-only: ``app.settings``). With one (``--tenants``: ``app.core.tenants``),
each tenant owns one or more namespaces (a namespace belongs to exactly one tenant), every engine
call carries a bearer token, and a call names its namespace in the ``X-KVOffload-Namespace``
header (absent: the tenant's only namespace). A tenant's blocks are its namespaces' pools; its
pins and requests are held to its ``TenantQuota`` (``app.core.quota``) across them.

``resolve`` answers a call's space or raises ``AuthenticationError`` (401) or
``PermissionDeniedError`` (403); it never says whether a namespace it denies exists. The
tenants file is reloaded when it changes (polled) or on ``request_reload`` (SIGHUP), with no
restart: tokens and quotas apply from the next call; a new namespace gets a new space (started
before any call can reach it); a namespace whose ``blocks`` changed keeps its pool until a
restart (logged). A file that fails to load changes nothing (logged, counted in
``reload_failures``).

**A namespace's blocks belong to the tenant that stored them.** Below the pool, a namespace's
blocks live under its *storage identity* (``app.core.storage``): ``NAMESPACE@TENANT`` with
tenants, the bare ``default`` without (the disk tier's directory ``<disk_dir>/<identity>``, the
remote tier's prefix ``kvoffload/<identity>/<block_bytes>``). A namespace removed, or moved to
another tenant, by a reload is taken out of resolution first, then its service is stopped (its
pool, requests, jobs, registrations and KV events go with it) and then, its tiers closed, each
tier deletes what it keeps under the identity (``TierBackend.drop``: the disk its directory);
one ``namespace removed; its blocks are dropped`` line tells what went (pool and tier blocks,
files and bytes deleted). A namespace moved to another tenant is a new space under a new
identity, so its new owner starts empty in the pool and on every tier, and so does a namespace
removed and added back. A tier whose store is shared by nodes (remote) deletes nothing: other
nodes may still serve the old identity's objects to their owner, and no other identity can
reach them.

At start (``running``), before any tier opens, a service with tenants deletes on every tier the
blocks of identities it no longer serves (``TierBackend.identities``: namespaces removed, or
given to another tenant, while it was down; and those named by the bare namespace, the layout
before identities, whose owner was never recorded, only where the tier's own store is), and
logs one line per tier naming them. It keeps the bare ``default`` (the storage of a service
without tenants, which no tenant's identity names). A service without tenants deletes nothing
(a run without the tenants file does not know which namespaces are still served) and logs the
identities it does not serve. Only a name that parses as an identity is ever deleted: anything
else is not the service's.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Iterator

from prometheus_client import CollectorRegistry

from app.core.errors import PermissionDeniedError
from app.core.quota import TenantQuota
from app.core.service import DEFAULT_NAMESPACE, Service
from app.core.storage import storage_identity
from app.core.tenancy_reloads import Space, TenancyReloads
from app.core.tenants import Credentials, NamespaceConfig, TenantTable
from app.core.tier_storage import TierStorage
from app.settings import Settings
from app.telemetry.calls import CallInfo
from app.telemetry.logging import get_logger
from app.telemetry.metrics import Metrics, register_tenancy
from app.telemetry.observer import Observer
from manager import OffloadManager

log = get_logger("tenancy")


class Tenancy(TenancyReloads):
    """Every namespace's space, and the credentials that lead to them; see the module docstring.

    ``service``: without tenants, the one service to serve (a new one from ``settings`` by
    default; ``registry`` is where a new one puts its metrics). With ``credentials``, each
    namespace's service is made here with a registry of its own, and ``registry`` (a fresh one
    by default) holds the front metrics: the HTTP calls that reached no namespace (refused,
    health, metrics) and the admin API's calls.
    """

    def __init__(
        self,
        settings: Settings,
        *,
        credentials: Credentials | None = None,
        service: Service | None = None,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.settings = settings
        self.storage = TierStorage(settings)
        self.credentials = credentials
        self.spaces: dict[str, Space] = {}
        self.quotas: dict[str, TenantQuota] = {}
        self.reloads = 0
        self.reload_failures = 0
        # False from a refused reload until the file loads again.
        self.file_in_force = True
        self._reload_wanted = asyncio.Event()
        self._reload_lock = asyncio.Lock()
        self._users = 0
        self._watcher: asyncio.Task[None] | None = None
        self._on_fatal: Callable[[str], None] | None = None
        self._attach_events: Callable[[str | None, Service], None] | None = None
        if credentials is None:
            svc = service if service is not None else Service(settings, registry=registry)
            self.single: Service | None = svc
            self.spaces[DEFAULT_NAMESPACE] = Space(None, DEFAULT_NAMESPACE, svc)
            self.front = svc.observer
            self.front_registry = svc.registry
            return
        if service is not None:
            raise ValueError("a tenancy with credentials makes one service per namespace")
        self.single = None
        self.front_registry = None
        metrics = None
        if settings.metrics_enabled:
            self.front_registry = registry if registry is not None else CollectorRegistry()
            metrics = Metrics(self.front_registry)
            register_tenancy(
                self.front_registry,
                lambda: (self.reloads, self.reload_failures, self.file_in_force),
            )
        self.front = Observer(metrics)
        table = credentials.table
        for name, tenant in table.tenants.items():
            self.quotas[name] = TenantQuota(name, tenant.max_pins, tenant.max_requests)
        for name, ns in table.namespaces().items():
            owner = table.owner(name)
            assert owner is not None
            self.spaces[name] = self._make_space(owner, ns)

    # ------------------------------------------------------------------ building

    def _settings_of(self, ns: NamespaceConfig) -> Settings:
        s = self.settings
        blocks = ns.blocks if ns.blocks is not None else s.num_blocks
        disk = ns.disk_bytes if ns.disk_bytes is not None else s.disk_bytes
        update: dict[str, object] = {"num_blocks": blocks, "disk_bytes": disk}
        if ns.max_registrations is not None:
            update["max_registrations"] = ns.max_registrations
        if ns.max_mapped_bytes is not None:
            update["max_mapped_bytes"] = ns.max_mapped_bytes
        if ns.object_bytes is not None:
            update["object_bytes"] = ns.object_bytes
        if ns.max_retained_blocks is not None:
            update["max_retained_blocks"] = ns.max_retained_blocks
        return s.model_copy(update=update)

    def _managers(self) -> list[OffloadManager]:
        return [space.service.pool_manager for space in self.spaces.values()]

    def _make_space(self, tenant: str, ns: NamespaceConfig) -> Space:
        settings = self._settings_of(ns)
        quota = self.quotas[tenant]
        service = Service(
            settings,
            registry=CollectorRegistry(),
            namespace=ns.name,
            quota=quota,
            storage=storage_identity(ns.name, tenant),
        )
        service.on_fatal = self._on_fatal
        if self._attach_events is not None:
            self._attach_events(tenant, service)
        quota.members.append(service.pool_manager)
        return Space(tenant, ns.name, service)

    def set_on_fatal(self, callback: Callable[[str], None] | None) -> None:
        """Who hears of a transfer backend failed for good (``Service.on_fatal``): every
        space's service now, and those a tenants reload adds later."""
        self._on_fatal = callback
        for service in self.services():
            service.on_fatal = callback

    def set_kv_events(self, attach: Callable[[str | None, Service], None]) -> None:
        """Hand every space's service to ``attach(tenant, service)`` (the KV-event publisher's
        wiring: ``app.server``), now and for those a tenants reload adds later; set before the
        services start, so that each one's stream opens with its clear."""
        self._attach_events = attach
        for space in list(self.spaces.values()):
            attach(space.tenant, space.service)

    @property
    def enabled(self) -> bool:
        """Whether engine calls need credentials (a tenants file is loaded)."""
        return self.credentials is not None

    def services(self) -> Iterator[Service]:
        """Every namespace's service (a snapshot: safe while spaces come and go)."""
        return iter([space.service for space in self.spaces.values()])

    @staticmethod
    def total_blocks(settings: Settings, table: TenantTable | None) -> int:
        """Blocks over every namespace's pool: what the machine must hold."""
        if table is None:
            return settings.num_blocks
        return sum(
            ns.blocks if ns.blocks is not None else settings.num_blocks
            for ns in table.namespaces().values()
        )

    # ------------------------------------------------------------------ calls

    def resolve(
        self, authorization: str | None, namespace: str | None, *, trusted: bool = False
    ) -> Space:
        """The space an engine call runs in.

        ``authorization``: the ``Authorization`` header; ``namespace``: the
        ``X-KVOffload-Namespace`` header (None: absent); ``trusted``: the caller came through a
        Unix socket whose file mode is its credential (``--uds-auth file-mode``), and may name
        any namespace. Raises ``AuthenticationError`` (who is this?) before anything about
        namespaces is said, then ``PermissionDeniedError``: ``unknown_namespace`` without
        tenants (any namespace but ``default``) and for a trusted caller (one the service lacks),
        ``namespace_denied`` for a caller known by its token (whether the namespace is another
        tenant's or nobody's), ``namespace_required`` when the call must name one.
        """
        single = self.single
        if single is not None:
            if namespace is None or namespace == DEFAULT_NAMESPACE:
                return self.spaces[DEFAULT_NAMESPACE]
            raise PermissionDeniedError(
                "unknown_namespace",
                f"this service has no tenants and one namespace, {DEFAULT_NAMESPACE!r}",
            )
        credentials = self.credentials
        assert credentials is not None
        if trusted:
            if namespace is None:
                if len(self.spaces) == 1:
                    return next(iter(self.spaces.values()))
                raise PermissionDeniedError(
                    "namespace_required", "name the namespace (X-KVOffload-Namespace)"
                )
            space = self.spaces.get(namespace)
            if space is None:
                raise PermissionDeniedError("unknown_namespace", "no such namespace")
            return space
        tenant = credentials.authenticate(authorization)
        if namespace is None:
            if len(tenant.namespaces) != 1:
                raise PermissionDeniedError(
                    "namespace_required",
                    "this tenant has several namespaces: name one (X-KVOffload-Namespace)",
                )
            namespace = tenant.namespaces[0].name
        space = self.spaces.get(namespace)
        if space is None or space.tenant != tenant.name:
            # Same answer whether the namespace is another tenant's or nobody's.
            raise PermissionDeniedError("namespace_denied", "not a namespace of this tenant")
        return space

    def on_call(self, info: CallInfo) -> None:
        """The ``CallInfo`` hook: the call's namespace's observer, else the front one."""
        space = self.spaces.get(info.namespace) if info.namespace is not None else None
        observer = space.service.observer if space is not None else self.front
        observer.on_call(info)

    def pool_id(self, namespace: str | None) -> str | None:
        """The pool id of ``namespace`` (None: unknown, or not started)."""
        space = self.spaces.get(namespace) if namespace is not None else None
        return None if space is None else space.service.pool_id

    # ------------------------------------------------------------------ lifecycle

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[Tenancy]:
        """Hold every space running for the block, and watch the tenants file meanwhile.

        Reference counted like ``Service.running`` (each listener's lifespan holds it): the
        first hold deletes, on every tier, the blocks of namespaces no longer served (module
        docstring) and starts every space, the last one out stops them.
        """
        async with self._reload_lock:
            if self._users == 0:
                # Before any tier opens: what the sweep drops is opened by no store.
                serving = {space.service.storage for space in self.spaces.values()}
                await asyncio.to_thread(self.storage.sweep, serving, tenants=self.single is None)
                started: list[Service] = []
                try:
                    for service in self.services():
                        await service.start()
                        started.append(service)
                except BaseException:
                    for service in reversed(started):
                        await service.stop()
                    raise
                if self.credentials is not None:
                    self._watcher = asyncio.create_task(
                        self._watch(), name="kvoffload-tenants-watch"
                    )
            self._users += 1
        try:
            yield self
        finally:
            async with self._reload_lock:
                self._users -= 1
                if self._users == 0:
                    watcher, self._watcher = self._watcher, None
                    if watcher is not None:
                        watcher.cancel()
                        with contextlib.suppress(asyncio.CancelledError):
                            await watcher
                    for service in reversed(list(self.services())):
                        await service.stop()

    def begin_drain(self) -> None:
        """Every space reports not-ready from now on."""
        for service in self.services():
            service.begin_drain()

    def readiness(self) -> str | None:
        """None when every space is ready, else why the first one is not."""
        for space in list(self.spaces.values()):
            reason = space.service.readiness()
            if reason is not None:
                if self.single is not None:
                    return reason
                return f"namespace {space.namespace!r}: {reason}"
        return None

    def details(self) -> dict[str, str]:
        """What a ready tenancy still wants known, from every space (``Service.details``)."""
        out: dict[str, str] = {}
        for space in list(self.spaces.values()):
            for name, text in space.service.details().items():
                key = name if self.single is not None else f"{space.namespace}.{name}"
                out[key] = text
        return out
