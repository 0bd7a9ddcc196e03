"""What the tiers below the pools keep under storage identities (``app.core.storage``): one
identity's blocks deleted on every tier (a namespace removed, or moved to another tenant, by a
tenants reload), and, at start, the blocks of identities no longer served swept away.

Which identities a sweep deletes, and which it keeps, is ``app.core.tenancy``'s contract (its
module docstring); this module carries it out, tier by tier, and logs what it did.
"""

from __future__ import annotations

import asyncio

from app.core.lower_tiers import chain_order
from app.core.service import DEFAULT_NAMESPACE
from app.core.storage import NotDropped, parse_identity
from app.core.tier import TierBackend, backends
from app.settings import Settings
from app.telemetry.logging import get_logger

log = get_logger("tenancy")


class TierStorage:
    """Every tier the settings put below each namespace's pool, as stores of identities."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    def backends(self) -> list[tuple[str, TierBackend]]:
        """The tiers below every namespace's pool, by name, in the chain's order."""
        known = backends()
        return [(name, known[name]) for name in chain_order(self.settings, known)]

    async def drop(self, identity: str, fields: dict[str, object]) -> None:
        """Delete what every tier keeps under ``identity`` (off the loop, one tier at a time).
        A tier that refuses or fails is logged and the others go on; ``fields`` (the caller's
        log line) gains each tier's ``<tier>_files_deleted`` and ``<tier>_bytes_deleted``."""
        for tier, backend in self.backends():
            try:
                dropped = await asyncio.to_thread(backend.drop, self.settings, identity)
            except (NotDropped, OSError) as exc:
                log.error(
                    "namespace's blocks on a tier not deleted; they stay there, out of every "
                    "other identity's reach",
                    extra={"fields": {**fields, "tier": tier, "error": str(exc)}},
                )
            else:
                if dropped is not None:
                    fields[f"{tier}_files_deleted"] = dropped.files
                    fields[f"{tier}_bytes_deleted"] = dropped.bytes

    def sweep(self, serving: set[str], *, tenants: bool) -> None:
        """At start (blocking; before any tier opens): on every tier, delete the blocks of the
        identities not in ``serving`` that a service with ``tenants`` may delete, keep the
        others, and log one line per tier naming what was deleted and what was kept (and
        why). Without tenants nothing is deleted."""
        for tier, backend in self.backends():
            self._sweep_tier(tier, backend, serving, tenants)

    def _sweep_tier(
        self, tier: str, backend: TierBackend, serving: set[str], tenants: bool
    ) -> None:
        try:
            names = [n for n in backend.identities(self.settings) if n not in serving]
        except OSError as exc:  # the tier's own open reports an unusable medium
            log.warning(
                "tier storage not swept", extra={"fields": {"tier": tier, "error": str(exc)}}
            )
            return
        deleted: list[str] = []
        files = size = 0
        kept: dict[str, str] = {}
        for name in names:
            parsed = parse_identity(name)
            if parsed is None:
                continue  # not the service's
            namespace, owner = parsed
            if not tenants:
                kept[name] = "a service without tenants does not know the tenants' namespaces"
                continue
            if owner is None and namespace == DEFAULT_NAMESPACE:
                kept[name] = "the storage of a service without tenants"
                continue
            try:
                # A bare name is an identity by chance as easily as by the layout before
                # identities: deleted only where the tier's own store is.
                dropped = backend.drop(self.settings, name, only_store=owner is None)
            except (NotDropped, OSError) as exc:
                kept[name] = str(exc)
                continue
            if dropped is not None:
                deleted.append(name)
                files += dropped.files
                size += dropped.bytes
        if not deleted and not kept:
            return
        fields = {"tier": tier, "deleted": deleted, "files": files, "bytes": size, "kept": kept}
        if deleted:
            log.warning(
                "blocks of namespaces no longer served deleted from a tier",
                extra={"fields": fields},
            )
        else:
            log.info(
                "blocks of namespaces not served here kept on a tier", extra={"fields": fields}
            )
