"""The contract of a tier below the host pool, and the registry of tier backends by name.

A service stacks its lower tiers in one ordered chain (``app.core.lower_tiers``); every tier is a
``LowerTier`` with the same verbs in the same shapes, and the chain knows nothing of any one of
them:

- **ask**: ``found(keys, req_id)`` answers, per key, whether the tier holds it, loadable. It is
  a coroutine for every tier: one whose answer is in memory (disk) returns at once, one that
  asks a store (remote) bounds its wait and answers "not found" when late or degraded.
- **promote**: ``promote(keys, req_id, protect)`` starts bringing the keys the pool lacks into it
  for a request (``app.core.promotion``: pool slots reserved as pending stores, the tier's read
  into them, then held for the request) and returns the tasks that settle it (none: nothing
  started, the keys stay not ready). ``loaded`` lets go of the holds once the request pinned the
  keys itself; ``writing`` names the internal requests whose slots a read still writes into.
- **take demoted blocks**: ``takes(keys)`` answers, before an explicit ``demote`` evicts, which
  keys the tier holds or will take, admission aside (the others stay in the pool);
  ``evicted(victims, slots)`` is the pool's eviction listener (the
  victims' bytes are still in their slots: copy what you keep before returning, never call the
  manager; ``promoting``: the room is for a promotion, so evict none of the tier's own blocks
  before the loop's next turn), ``stored(keys)`` is told of every block that became ready in
  the pool. A tier takes
  what its admission admits, writes behind in the background, bounded, and drops and counts
  what does not fit: it never makes the pool wait.
- **admission**: ``asked(keys, req_id)`` counts every key an engine looks up, loads or stores.
- **report**: ``health()`` (``TierHealth``), ``state()`` (``/admin/v1/stats`` and the metrics),
  ``report()`` (what every tier exports, ``kvoffload_tier_*{tier}``), ``metric_families`` (its
  own, tier-specific families); its I/O calls go to ``observer.tier_io(name, op, ...)``
  (``kvoffload_tier_io_duration_seconds{tier,op}``).
- **lifecycle**: ``start()`` on the running loop, ``close()`` after which it touches the pool no
  more.

A backend is registered by name (``register``) with a ``TierBackend``: whether today's settings
turn it on without ``--tiers`` (``enabled``), and ``open(TierContext)``, which builds the tier off
the loop (opening a directory or a client blocks) and raises ``ConfigError`` naming the setting
when it cannot serve. The built-in backends register themselves when ``app.core.lower_tiers``
imports them; a new backend is its module, its ``register`` call, its settings group and its
tests.
"""

from __future__ import annotations

import abc
import asyncio
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client.metrics_core import Metric

from app.core.promotion import Promotions
from app.core.storage import Dropped
from app.settings import Settings
from app.telemetry.metrics import TierReport
from app.telemetry.observer import Observer
from manager import BlockKey, OffloadManager
from transfer import HostPool
from transfer.health import TierHealth

#: What a tier name must look like: it is a lookup state on the wire and a metric label.
NAME_PATTERN = re.compile(r"^[a-z][a-z0-9_]{0,15}$")
#: Names no tier may take: the pool's own lookup states, and the pool itself.
RESERVED_NAMES = frozenset(("hit", "pending", "miss", "pool"))


@dataclass(frozen=True, slots=True)
class TierContext:
    """What a backend's ``open`` gets: the name the chain opens it under (its lookup state,
    stats key and metric label), the settings, the running pool and its manager, the
    namespace's storage identity (``app.core.storage``: every tier keeps its blocks under it, so
    a namespace given to another tenant finds none of the old owner's), and the observer. KV
    events a tier records in the manager (``record_event``) reach the routers through the
    manager's event sink: there is nothing to call after them."""

    name: str
    settings: Settings
    pool: HostPool
    manager: OffloadManager
    storage: str
    observer: Observer


def dropped_by_reason(counts: Mapping[str, int]) -> dict[str, int]:
    """A tier's dropped demotions by reason, from its counts keyed ``dropped_<reason>``
    (``TierReport.dropped``, and its ``state()``), sorted by reason."""
    return {
        k.removeprefix("dropped_"): v for k, v in sorted(counts.items()) if k.startswith("dropped_")
    }


class LowerTier(abc.ABC):
    """One tier below the pool; see the module docstring. Subclasses set ``name`` (the name
    it is opened under: ``TierContext.name``) and ``promotions``, and implement the abstract
    verbs."""

    name: str
    promotions: Promotions
    #: What a degraded tier still does, for ``/readyz`` ("degraded: <error>; <this>").
    degraded_means: str = "serves from the other tiers"

    @abc.abstractmethod
    def start(self) -> None:
        """Start the tier's background tasks on the running loop."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Stop; when it returns, the tier touches the pool no more."""

    @abc.abstractmethod
    def health(self) -> TierHealth:
        """Its state (``ok`` or ``degraded``), since when, its last error and its counters
        (``transfer.health``; never blocks)."""

    @abc.abstractmethod
    def state(self) -> dict[str, Any]:
        """What ``/admin/v1/stats`` says about it (JSON-ready)."""

    @abc.abstractmethod
    def report(self) -> TierReport:
        """What every tier exports (``kvoffload_tier_*{tier}``), read at scrape time."""

    @abc.abstractmethod
    async def found(self, keys: Sequence[BlockKey], req_id: str | None) -> list[bool]:
        """Per key, whether the tier holds it, loadable."""

    @abc.abstractmethod
    def promote(
        self, keys: Sequence[BlockKey], req_id: str, protect: Sequence[BlockKey] = ()
    ) -> list[asyncio.Task[None]]:
        """Start bringing those of ``keys`` the pool lacks and the tier holds into the pool
        for ``req_id``; the tasks that settle it. ``protect``: the load's other keys, never
        evicted to make room."""

    def summary(self) -> dict[str, Any]:
        """What the ``service started`` line says about it (none by default)."""
        return {}

    def metric_families(self) -> Iterable[Metric]:
        """The tier's own metric families, read at scrape time (none by default)."""
        return ()

    def asked(self, keys: Sequence[BlockKey], req_id: str) -> None:
        """An engine asked for ``keys`` (lookup, load or store): admission's count."""
        return None

    def evicted(
        self, victims: list[BlockKey], slots: list[int], *, promoting: bool = False
    ) -> None:
        """The pool evicts ``victims`` from ``slots`` (their bytes still there): take what the
        tier admits. Runs inside the manager's ``prepare_store``: never call the manager.
        ``promoting``: the room is for a promotion (``promote``, of this tier or another),
        whose load may want this tier's blocks next: the tier may copy the victims now but
        must evict none of its own blocks for them until the loop's next turn."""
        return None

    def takes(self, keys: Sequence[BlockKey]) -> list[bool]:
        """An explicit ``demote`` is about to evict ``keys`` (ready, unpinned): per key,
        whether the tier holds it or will take it from that eviction, whatever its admission
        says (the very next ``evicted`` of the pool must then take it). ``demote`` evicts
        only the keys some tier takes; the others stay in the pool. None by default."""
        return [False] * len(keys)

    def stored(self, keys: Sequence[BlockKey]) -> None:
        """``keys`` became ready in the pool: take what the tier admits."""
        return None

    def loaded(self, req_id: str, keys: Sequence[BlockKey]) -> None:
        """Request ``req_id`` pinned ``keys`` with its own load (promoted blocks let go)."""
        self.promotions.loaded(req_id, keys)

    def writing(self) -> set[str]:
        """Internal requests whose promotions write into reserved pool slots now."""
        return self.promotions.writing()


class TierBackend(abc.ABC):
    """How a tier is made, and what it keeps under a storage identity while no service has it
    open: registered by name with ``register``.

    ``identities`` and ``drop`` let the tenancy delete the blocks of a namespace removed, or
    given to another tenant (``app.core.tenancy``), without naming the tier: by default a tier
    keeps nothing it would delete (a store shared by nodes keeps the old owner's blocks for the
    nodes that still serve them, out of every other identity's reach). Both block: call them
    off the loop, with no tier of that identity open."""

    #: Where the tier goes in a chain built without ``tiers`` (nearest the pool first): the
    #: built-in ones 10 (disk), 20 (remote), 30 (object); any other after them.
    position: int = 100

    @abc.abstractmethod
    def enabled(self, settings: Settings) -> bool:
        """Whether ``settings`` turn this tier on when ``tiers`` is not set (today's flags:
        ``--disk-dir``, ``--remote-tier``)."""

    @abc.abstractmethod
    def open(self, ctx: TierContext) -> LowerTier:
        """The tier, built off the loop (it may block), not started; ``ConfigError`` naming
        the setting when it cannot serve."""

    def identities(self, settings: Settings) -> list[str]:
        """The storage identities this tier holds blocks of now (none by default)."""
        return []

    def drop(
        self, settings: Settings, identity: str, *, only_store: bool = False
    ) -> Dropped | None:
        """Delete the blocks this tier keeps under ``identity``; what went, None when it keeps
        none. ``only_store``: only where this tier's own store is recognised (a bare name is an
        identity by chance as easily as by design). ``NotDropped`` when it refuses (nothing
        deleted); ``OSError`` when the medium refuses."""
        return None


_BACKENDS: dict[str, TierBackend] = {}


def register(name: str, backend: TierBackend) -> None:
    """Make ``backend`` available as tier ``name`` (``--tiers``). ``ValueError`` for a name
    that is not a lowercase identifier of at most 16 characters, is reserved, or is taken."""
    if not NAME_PATTERN.match(name) or name in RESERVED_NAMES:
        raise ValueError(
            f"tier name {name!r} refused: a lowercase identifier of at most 16 characters, not "
            f"one of {sorted(RESERVED_NAMES)}"
        )
    if name in _BACKENDS:
        raise ValueError(f"tier {name!r} is already registered")
    _BACKENDS[name] = backend


def unregister(name: str) -> None:
    """Forget tier ``name`` (tests that register one of their own)."""
    _BACKENDS.pop(name, None)


def backends() -> Mapping[str, TierBackend]:
    """The registered backends by name, in their ``position`` order (registration order among
    equals): the default chain's order, whatever order their modules were imported in."""
    ranked = sorted(enumerate(_BACKENDS.items()), key=lambda e: (e[1][1].position, e[0]))
    return {name: backend for _, (name, backend) in ranked}
