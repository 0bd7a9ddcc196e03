"""A service's tiers below the host pool, while it runs: one ordered chain of ``LowerTier``s.

The chain is built with the service (``TierChain(settings, ...)``): its order is ``tiers``
(``--tiers disk,remote``), or, when that is not set, every registered backend that today's flags
turn on, in their backends' ``position`` order (the disk tier, ``--disk-dir``, then the remote
tier, ``--remote-tier``, then the object tier, ``--object-bucket``). A name that is not
registered, named twice, or whose backend is not configured is a ``ConfigError`` naming
``tiers``. Backends are found by name in the registry of ``app.core.tier``; the built-in ones
register when this module imports them.

``open(pool)`` opens the tiers on the running pool, in order (each off the loop: opening a disk
directory or a store client blocks), and starts them; a tier that cannot serve is a
``ConfigError`` naming its setting, and those opened before it are closed again. ``close()``
closes them in the reverse order, each after its I/O on the pool ended; the service calls it
before the pool goes. Until ``open`` and after ``close`` the chain is empty and every verb is a
no-op, so the observed manager and the data path hold it from their construction.

What flows through it, tier by tier, in order:

- a lookup of keys the pool lacks (``found``): each tier is asked about the keys the tiers
  before it did not hold; a key is named by the first tier that holds it (``hit | pending |
  <tier name> | miss`` on the wire);
- a load of keys the pool lacks (``promote``): each tier promotes what it holds of the keys
  still missing, in order;
- a block the pool evicts (``evicted``) and a block that became ready (``stored``): offered to
  every tier, each taking what its admission admits;
- a request that pinned its keys (``loaded``), the keys an engine asked for (``asked``).

Every tier opens under the namespace's *storage identity* (``app.core.storage``), never its bare
name: the identity names the owning tenant, so a namespace given to another tenant opens other
tiers and finds none of the old owner's blocks.
"""

from __future__ import annotations

import asyncio
import difflib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from prometheus_client.metrics_core import Metric

# The built-in backends register themselves when imported (their positions order them).
import app.core.disk
import app.core.object
import app.core.remote  # noqa: F401
from app.core.tier import LowerTier, TierBackend, TierContext, backends
from app.settings import Settings, config_error
from app.telemetry.metrics import TierReport
from app.telemetry.observer import Observer
from manager import BlockKey, OffloadManager
from transfer import HostPool

#: Per key of a lookup: the name of the first tier that holds it, or None.
Found = list[str | None]


def chain_order(settings: Settings, known: Mapping[str, TierBackend]) -> list[str]:
    """The tier names ``settings`` put below the pool, in order (see the module docstring);
    ``ConfigError`` naming ``tiers`` for a name not registered, named twice, or not
    configured, or a configured tier that ``tiers`` leaves out."""
    if settings.tiers is None:
        return [name for name, backend in known.items() if backend.enabled(settings)]
    names = list(settings.tiers)
    accepted = f"accepted: a comma-separated list of {', '.join(known) or 'no tiers'}"
    for name in names:
        if name not in known:
            close = difflib.get_close_matches(name.lower(), list(known), n=1, cutoff=0.6)
            meant = f" (did you mean {close[0]!r}?)" if close else ""
            raise config_error(
                "tiers", ",".join(names), f"no tier named {name!r}{meant}; {accepted}"
            )
    if len(set(names)) != len(names):
        raise config_error("tiers", ",".join(names), f"a tier is named twice; {accepted}")
    left_out = [n for n, b in known.items() if b.enabled(settings) and n not in names]
    if left_out:
        raise config_error(
            "tiers",
            ",".join(names),
            f"the {', '.join(left_out)} tier is configured but not in the chain; name it, or "
            "drop its settings",
        )
    return names


class TierChain:
    """The ordered lower tiers of one namespace's service; see the module docstring."""

    def __init__(
        self,
        settings: Settings,
        storage: str,
        *,
        overrides: Mapping[str, TierBackend] | None = None,
    ) -> None:
        """``storage``: the namespace's storage identity. ``overrides``: backends to use
        instead of the registered ones of the same name (tests)."""
        self.settings = settings
        self.storage = storage
        known = {**backends(), **(overrides or {})}
        self.names = chain_order(settings, known)
        self._backends = [known[name] for name in self.names]
        self.tiers: list[LowerTier] = []
        self._promoting = False  # inside promote: pool evictions make room for a load

    def __bool__(self) -> bool:
        return bool(self.tiers)

    def get(self, name: str) -> LowerTier | None:
        """The open tier ``name``, or None."""
        for tier in self.tiers:
            if tier.name == name:
                return tier
        return None

    # ------------------------------------------------------------------ lifecycle

    async def open(self, pool: HostPool, manager: OffloadManager, observer: Observer) -> None:
        """Open and start the tiers in order on the running ``pool`` of ``manager``; on a
        failure, those opened are closed again and the error raised."""
        try:
            for name, backend in zip(self.names, self._backends, strict=True):
                ctx = TierContext(name, self.settings, pool, manager, self.storage, observer)
                tier = await asyncio.to_thread(backend.open, ctx)
                tier.start()
                self.tiers.append(tier)
        except BaseException:
            await self.close()
            raise
        if self.tiers:
            manager.add_eviction_listener(self.evicted)

    async def close(self) -> None:
        """Close the tiers, last first, each after its I/O on the pool ended."""
        tiers, self.tiers = self.tiers, []
        for tier in reversed(tiers):
            await tier.close()

    def details(self) -> dict[str, str]:
        """What a ready service still wants known (``/readyz`` details): each degraded tier,
        as ``<name>_tier``, with what it still does."""
        out: dict[str, str] = {}
        for tier in self.tiers:
            health = tier.health()
            if not health.ok:
                why = health.last_error or "failing"
                out[f"{tier.name}_tier"] = f"degraded: {why}; {tier.degraded_means}"
        return out

    def states(self) -> dict[str, dict[str, Any]]:
        """Each open tier's ``state()``, by name, in order."""
        return {tier.name: tier.state() for tier in self.tiers}

    def reports(self) -> dict[str, TierReport]:
        """Each open tier's ``report()``, by name (the ``kvoffload_tier_*`` families)."""
        return {tier.name: tier.report() for tier in self.tiers}

    def metric_families(self) -> Iterator[Metric]:
        """Every open tier's own metric families."""
        for tier in self.tiers:
            yield from tier.metric_families()

    # ------------------------------------------------------------------ what flows through

    def asked(self, keys: Sequence[BlockKey], req_id: str) -> None:
        """An engine asked for ``keys``: every tier counts it for its admission."""
        for tier in self.tiers:
            tier.asked(keys, req_id)

    async def found(self, keys: Sequence[BlockKey], req_id: str | None) -> Found:
        """Per key, the name of the first tier that holds it (None: none does); each tier is
        asked only about the keys the tiers before it lack."""
        out: Found = [None] * len(keys)
        left = list(range(len(keys)))
        for tier in self.tiers:
            if not left:
                break
            asked = keys if len(left) == len(keys) else [keys[i] for i in left]
            there = await tier.found(asked, req_id)
            if not any(there):  # a lookup of misses: nothing to sort out, key by key
                continue
            still = []
            for i, held in zip(left, there, strict=True):
                if held:
                    out[i] = tier.name
                else:
                    still.append(i)
            left = still
        return out

    def promote(
        self,
        keys: Sequence[BlockKey],
        req_id: str,
        protect: Sequence[BlockKey],
        manager: OffloadManager,
    ) -> list[asyncio.Task[None]]:
        """Start bringing ``keys`` the pool lacks into it for ``req_id``, each tier in order
        taking what it holds of the keys still missing; the promotions started."""
        started: list[asyncio.Task[None]] = []
        self._promoting = True
        try:
            for tier in self.tiers:
                if not keys:
                    break
                tasks = tier.promote(keys, req_id, protect)
                if tasks:
                    started.extend(tasks)
                    keys = [k for k in keys if manager.slot_of(k) is None]
        finally:
            self._promoting = False
        return started

    def promotions_for(self, req_id: str) -> list[asyncio.Task[None]]:
        """The promotions in flight for ``req_id`` on every tier."""
        return [t for tier in self.tiers for t in tier.promotions.running_for(req_id)]

    def promotions_covering(self, keys: Sequence[BlockKey]) -> set[asyncio.Task[None]]:
        """The promotions in flight bringing any of ``keys`` up, on every tier, whoever
        started them."""
        out: set[asyncio.Task[None]] = set()
        for tier in self.tiers:
            out |= tier.promotions.covering(keys)
        return out

    def loaded(self, req_id: str, keys: Sequence[BlockKey]) -> None:
        """Request ``req_id`` pinned ``keys`` with its own load."""
        for tier in self.tiers:
            tier.loaded(req_id, keys)

    def let_go(self, req_id: str) -> None:
        """Release every hold the tiers' promotions keep for ``req_id`` (an internal request
        of cache control, whose caller holds what it wants itself)."""
        for tier in self.tiers:
            tier.promotions.let_go(req_id, None)

    def evicted(self, victims: list[BlockKey], slots: list[int]) -> None:
        """Pool eviction listener: every tier takes what it admits of the victims (told when
        the room is for a promotion, ``LowerTier.evicted``)."""
        for tier in self.tiers:
            tier.evicted(victims, slots, promoting=self._promoting)

    def stored(self, keys: Sequence[BlockKey]) -> None:
        """``keys`` became ready in the pool: every tier takes what it admits."""
        for tier in self.tiers:
            tier.stored(keys)

    def writing(self) -> set[str]:
        """Internal requests whose promotions write into reserved pool slots, on any tier."""
        out: set[str] = set()
        for tier in self.tiers:
            out |= tier.writing()
        return out
