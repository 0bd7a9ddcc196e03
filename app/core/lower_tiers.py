"""A service's tiers below the host pool, while it runs: the disk tier (``--disk-dir``,
``app.core.disk``) and the remote tier (``--remote-tier``, ``app.core.remote``).

``LowerTiers.open(transfers)`` builds them from the settings on the running pool (off the loop:
opening a disk directory or a Mooncake client blocks), starts them, and wires them: to the
observed manager, which asks them on every lookup and load of keys the pool lacks (pool, then
disk, then remote), and to the data path, whose lease expiry must not free the slots they write
into. ``close()`` undoes it, remote first, then disk, each after its I/O on the pool ended;
the service calls it before the pool goes. A directory or library that cannot serve is a
``ConfigError`` naming the setting.

Both tiers are opened under the namespace's *storage identity* (``app.core.storage``), never its
bare name: the disk directory ``<disk_dir>/<identity>`` and the remote prefix
``kvoffload/<identity>/<block_bytes>``. The identity names the owning tenant, so a namespace given
to another tenant opens other tiers and finds none of the old owner's blocks.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from app.core.disk import DiskLink, open_disk
from app.core.observed import ObservedManager
from app.core.remote import RemoteFactory, RemoteLink
from app.core.transfers import Transfers
from app.settings import Settings, config_error
from app.telemetry.logging import get_logger
from app.telemetry.observer import Observer
from transfer import RemoteTierError
from transfer.disk import DiskError

log = get_logger("service")


class LowerTiers:
    """The disk and remote tiers of one namespace's service; see the module docstring."""

    def __init__(
        self,
        settings: Settings,
        storage: str,
        manager: ObservedManager,
        observer: Observer,
        *,
        on_event: Callable[[], None],
        remote_factory: RemoteFactory,
    ) -> None:
        """``storage``: the namespace's storage identity (``app.core.storage``): the directory
        name under ``disk_dir`` and the remote tier's namespace."""
        self.settings = settings
        self.storage = storage
        self.manager = manager
        self.observer = observer
        self._on_event = on_event
        self._remote_factory = remote_factory
        self.disk: DiskLink | None = None
        self.remote: RemoteLink | None = None

    async def open(self, transfers: Transfers) -> None:
        """Open the tiers the settings name (disk, then remote) on the running data path; on a
        failure, those opened are closed again and the error raised."""
        s = self.settings
        try:
            if s.disk_dir is not None:
                await self._open_disk(transfers)
            if s.remote_tier != "none":
                await self._open_remote(transfers)
        except BaseException:
            await self.close()
            raise

    async def close(self) -> None:
        """Close the tiers (remote, then disk), each after its I/O on the pool ended."""
        remote, self.remote = self.remote, None
        disk, self.disk = self.disk, None
        self.manager.remote = None
        self.manager.disk = None
        if remote is not None:
            await remote.close()
        if disk is not None:
            await disk.close()

    def details(self) -> dict[str, str]:
        """What a ready service still wants known (``/readyz`` details): a degraded remote
        tier serves from the pool alone; a degraded disk tier takes no demotions."""
        out: dict[str, str] = {}
        remote = self.remote
        if remote is not None and not (health := remote.health()).ok:
            out["remote_tier"] = f"degraded: {health.last_error or 'unreachable'}"
        disk = self.disk
        if disk is not None and not (dhealth := disk.health()).ok:
            out["disk_tier"] = f"degraded: {dhealth.last_error or 'failing'}"
        return out

    async def _open_disk(self, transfers: Transfers) -> None:
        s = self.settings
        try:
            store, index = await asyncio.to_thread(open_disk, s, transfers.pool, self.storage)
        except DiskError as exc:
            raise config_error(
                "disk_dir",
                s.disk_dir,
                f"{exc}; accepted: a directory this process can write and no other kvoffload uses",
            ) from None
        per_batch = max(1, s.disk_batch_bytes // store.slot_bytes)
        disk = DiskLink(
            store,
            index,
            self.manager.manager,
            batch_blocks=per_batch,
            read_blocks=per_batch,
            timeout_s=s.disk_timeout_s,
            hold_s=s.lease_ttl_s,
            on_event=self._on_event,
            on_io=self.observer.disk_io,
        )
        disk.start()
        if not store.direct:
            log.warning(
                "disk tier uses buffered I/O (O_DIRECT not available here)",
                extra={"fields": {"directory": store.directory, "block_bytes": s.block_bytes}},
            )
        self.disk = disk
        self.manager.disk = disk
        self._link_writers(transfers)

    async def _open_remote(self, transfers: Transfers) -> None:
        s = self.settings
        try:
            tier = await asyncio.to_thread(self._remote_factory, s, transfers.pool, self.storage)
        except RemoteTierError as exc:  # its library is missing: the node cannot start so
            raise config_error("remote_tier", s.remote_tier, str(exc)) from None
        remote = RemoteLink(
            tier,
            self.manager.manager,
            lookup_timeout_s=s.remote_lookup_timeout_s,
            queue_blocks=s.remote_queue_blocks,
            batch_blocks=s.remote_batch_blocks,
            hold_s=s.lease_ttl_s,
            sweep_s=s.remote_sweep_s,
            tracked_blocks=s.remote_tracked_blocks,
            removal_confirm_s=s.remote_removal_confirm_s,
            on_event=self._on_event,
            on_call=self.observer.remote_call,
        )
        remote.start()
        self.remote = remote
        self.manager.remote = remote
        self._link_writers(transfers)

    def _link_writers(self, transfers: Transfers) -> None:
        """Tell the data path which requests' reserved slots the lower tiers write into."""
        tiers = [t for t in (self.disk, self.remote) if t is not None]
        transfers.also_writing = lambda: set().union(*(t.writing() for t in tiers))
