"""Tenants reloads: the tenants file loaded again and applied to a running ``Tenancy``, with
no restart (``app.core.tenancy``'s module docstring says what a reload changes), and a removed
or moved namespace dropped with its blocks.

``TenancyReloads`` is a room of ``Tenancy`` (its base class): it reads and changes the
tenancy's spaces and quotas, and makes spaces through it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass

from app.core.quota import TenantQuota
from app.core.service import Service
from app.core.storage import storage_identity
from app.core.tenants import Credentials, NamespaceConfig, TenantsConfigError, TenantTable
from app.core.tier_storage import TierStorage
from app.core.transfers import check_machine
from app.settings import Settings
from app.telemetry.logging import get_logger
from manager import OffloadManager

log = get_logger("tenancy")

#: How often the tenants file is checked for changes (a stat call or a few).
RELOAD_POLL_S = 1.0


@dataclass(frozen=True, slots=True)
class Space:
    """One namespace: its owner (None without tenants) and its service."""

    tenant: str | None
    namespace: str
    service: Service


class TenancyReloads:
    """Reloading the tenants file into the tenancy's spaces and quotas (module docstring)."""

    # What the room works on, set by ``Tenancy.__init__``.
    settings: Settings
    credentials: Credentials | None
    spaces: dict[str, Space]
    quotas: dict[str, TenantQuota]
    storage: TierStorage
    reloads: int
    reload_failures: int
    file_in_force: bool
    _reload_wanted: asyncio.Event
    _reload_lock: asyncio.Lock
    _users: int
    _settings_of: Callable[[NamespaceConfig], Settings]
    _make_space: Callable[[str, NamespaceConfig], Space]
    _managers: Callable[[], list[OffloadManager]]

    def request_reload(self) -> None:
        """Reload the tenants file soon (SIGHUP's handler; safe from the loop only)."""
        self._reload_wanted.set()

    async def _watch(self) -> None:
        credentials = self.credentials
        assert credentials is not None
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(RELOAD_POLL_S):
                    await self._reload_wanted.wait()
            asked = self._reload_wanted.is_set()
            self._reload_wanted.clear()
            try:
                if asked or credentials.changed():
                    await self.reload()
            except Exception:
                log.exception("tenants reload failed; the previous tenants stay in force")

    async def reload(self) -> bool:
        """Load the tenants file again and apply it; False (and nothing changed) when it does
        not load. See the module docstring for what a reload changes.

        A reload that loads logs one ``tenants reloaded`` line: the ``ReloadReport``'s fields
        (tenant and namespace names; ``tokens_added`` and ``tokens_revoked`` as integer counts,
        never a token), ``changed`` and ``namespaces`` (how many are served now). At warning
        when it took something away (``ReloadReport.took_away``: a tenant removed, a token
        revoked, a namespace removed or changed), else at info: additions, quota changes, or
        nothing at all (a SIGHUP, or a file rewritten with the same contents)."""
        credentials = self.credentials
        if credentials is None:
            return False
        async with self._reload_lock:
            before = credentials.table
            try:
                report = credentials.reload()
            except TenantsConfigError as exc:
                self.reload_failures += 1
                self.file_in_force = False
                log.error(
                    "tenants file not reloaded; the previous tenants stay in force",
                    extra={"fields": {"error": str(exc)}},
                )
                return False
            self.reloads += 1
            self.file_in_force = True
            await self._apply(before, credentials.table)
            fields = {
                **dataclasses.asdict(report),
                "changed": report.changed,
                "namespaces": len(self.spaces),
            }
            level = logging.WARNING if report.took_away else logging.INFO
            log.log(level, "tenants reloaded", extra={"fields": fields})
            return True

    async def _apply(self, before: TenantTable, after: TenantTable) -> None:
        for name, tenant in after.tenants.items():
            quota = self.quotas.get(name)
            if quota is None:
                self.quotas[name] = TenantQuota(name, tenant.max_pins, tenant.max_requests)
            else:
                quota.max_pins, quota.max_requests = tenant.max_pins, tenant.max_requests
        old, new = before.namespaces(), after.namespaces()
        gone = [n for n in old if n not in new or before.owner(n) != after.owner(n)]
        # Every one of them out of resolution before the first await: no call reaches any.
        taken = [(name, before.owner(name), self.spaces.pop(name, None)) for name in gone]
        for name, owner, space in taken:
            await self._drop(name, owner, space)
        for name, ns in new.items():
            if name in self.spaces:
                # Registration bounds apply live, from the next registration on.
                transfers = self.spaces[name].service.running_transfers()
                if transfers is not None:
                    limits = self._settings_of(ns)
                    transfers.registry.max_caches = limits.max_registrations
                    transfers.registry.max_bytes = limits.max_mapped_bytes
                # So does the retention bound.
                self.spaces[name].service.control.max_retained = self._settings_of(
                    ns
                ).effective_max_retained_blocks
                sizes = ("blocks", "disk_bytes", "object_bytes")
                if [getattr(ns, k) for k in sizes] != [getattr(old[name], k) for k in sizes]:
                    log.warning(
                        "namespace size changed; it keeps its pool, disk and object bounds "
                        "until a restart",
                        extra={"fields": {"namespace": name, **{k: getattr(ns, k) for k in sizes}}},
                    )
                continue
            owner = after.owner(name)
            assert owner is not None
            try:
                # As at startup: the machine must hold the pool before its tables are made.
                check_machine(self._settings_of(ns))
                space = self._make_space(owner, ns)
                if self._users:
                    await space.service.start()
            except Exception as exc:  # e.g. its pool does not fit: the others go on
                quota = self.quotas[owner]
                quota.members = [m for m in quota.members if m in self._managers()]
                self.reload_failures += 1
                self.file_in_force = False
                log.error(
                    "namespace added by the tenants file cannot start; its tenant's calls to it "
                    "are refused",
                    extra={"fields": {"namespace": name, "tenant": owner, "error": str(exc)}},
                )
                continue
            self.spaces[name] = space  # reachable only once it runs
        for name in [t for t in self.quotas if t not in after.tenants]:
            del self.quotas[name]

    # ------------------------------------------------------------------ dropping storage

    async def _drop(self, name: str, tenant: str | None, space: Space | None) -> None:
        """Drop namespace ``name`` of ``tenant``, removed or given to another tenant by a
        reload and already out of resolution (``space``: its space, None when it had none):
        its service stopped, then its disk directory deleted (even without a space: one that
        could not start may have a directory from an earlier run); logs one line with what
        went."""
        identity = storage_identity(name, tenant)
        fields: dict[str, object] = {"namespace": name, "tenant": tenant, "storage": identity}
        if space is not None:
            service = space.service
            quota = self.quotas.get(space.tenant or "")
            if quota is not None:
                with contextlib.suppress(ValueError):
                    quota.members.remove(service.pool_manager)
            stats = service.pool_manager.stats()
            fields["pool_blocks"] = stats.ready + stats.pending
            for name, state in service.tiers.states().items():
                if "blocks" in state:
                    fields[f"{name}_blocks"] = state["blocks"]
            if self._users:
                service.begin_drain()
                try:
                    await service.stop()
                except Exception:
                    # Its disk store may still be open: the directory's lock then keeps it
                    # (refused and logged below); the reload goes on with the others.
                    log.exception("namespace did not stop cleanly", extra={"fields": fields})
        await self.storage.drop(identity, fields)
        log.warning("namespace removed; its blocks are dropped", extra={"fields": fields})
