"""Cache control's hints that move blocks now (``app.core.control``'s **demote** and **drop**).

Both leave pinned, retained and pending blocks where they are (``OffloadManager.sort_for_hint``
sorts the named keys); ``demote`` also keeps in the pool what no tier below holds or takes, so a
block is never reported moved while held nowhere. Each call is counted for its request id.
"""

from __future__ import annotations

from collections.abc import Generator, Iterator, Sequence
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily
from prometheus_client.metrics_core import Metric

from app.core.control_shared import ControlShared
from app.core.errors import NoLowerTierError
from app.core.observed import STEP_KEYS, observed, observed_steps
from app.telemetry.metrics import PREFIX
from manager import BlockKey
from manager.parts import distinct_steps, parts

#: Bounds of a step of ``demote_steps`` (``CacheHints.demote_step_keys``).
DEMOTE_STEP_KEYS = 64
DEMOTE_STEP_BYTES = 1 << 20


@dataclass(slots=True)
class Hinted:
    """What ``demote`` or ``drop`` did: the keys it moved, and why the others stayed
    (``pinned``, ``retained``, ``pending``, ``not_in_pool``; for ``demote`` also ``refused``:
    no tier below holds or takes it), counted."""

    done: list[BlockKey]
    kept: dict[str, int]


class CacheHints:
    """The demote and drop hints of one namespace; see the module docstring."""

    def __init__(self, shared: ControlShared) -> None:
        self.shared = shared

    def demote(self, keys: Sequence[BlockKey], req_id: str) -> Hinted:
        """Evict the movable ``keys`` that a tier below holds or takes (``LowerTier.takes``:
        the disk takes them whatever its admission says) now, into the tiers below; the
        others stay in the pool, ``refused``. ``NoLowerTierError`` without a tier below."""
        out = observed(self.shared.observer, "demote", req_id, self._demote, keys)
        self.shared.observer.op("demote", req_id)
        return out

    def demote_steps(self, keys: Sequence[BlockKey], req_id: str) -> Generator[None, None, Hinted]:
        """``demote`` in steps: the distinct keys a part a step, each part sorted, offered to
        the tiers below and demoted as ``demote`` does it (so each part is one
        ``BlockRemoved`` event). A part is ``demote_step_keys`` keys: a tier below copies
        each demoted block out of the pool within the step."""
        out = yield from observed_steps(
            self.shared.observer, "demote", req_id, self._demote_steps(keys)
        )
        self.shared.observer.op("demote", req_id)
        return out

    def demote_step_keys(self) -> int:
        """Keys a step of ``demote_steps``: about 1 MiB of blocks, at most 64 (a block's
        staging and index work is some 26 µs on top of its copy), at least one."""
        return max(1, min(DEMOTE_STEP_KEYS, DEMOTE_STEP_BYTES // self.shared.settings.block_bytes))

    def _demote_steps(self, keys: Sequence[BlockKey]) -> Generator[None, None, Hinted]:
        if not self.shared.tiers:
            raise NoLowerTierError()
        chain = yield from distinct_steps(keys, STEP_KEYS)
        done: list[BlockKey] = []
        kept: dict[str, int] = {}
        for part in parts(list(chain), self.demote_step_keys()):
            yield
            hinted = self._demote(part)
            done += hinted.done
            for why, n in hinted.kept.items():
                kept[why] = kept.get(why, 0) + n
        return Hinted(done, kept)

    def _demote(self, keys: Sequence[BlockKey]) -> Hinted:
        shared = self.shared
        if not shared.tiers:
            raise NoLowerTierError()
        movable, kept = shared.manager.sort_for_hint(keys)
        # Only what a tier below holds or takes leaves the pool: a block no tier takes would
        # be lost, so it stays (``refused``), and ``moved`` never names a block held nowhere.
        taken = [False] * len(movable)
        for tier in shared.tiers.tiers:
            taken = [a or b for a, b in zip(taken, tier.takes(movable), strict=True)]
        kept["refused"] = taken.count(False)
        movable = [k for k, t in zip(movable, taken, strict=True) if t]
        done = shared.manager.demote(movable) if movable else []
        shared.counts["demoted"] += len(done)
        return Hinted(done, kept)

    def drop(self, keys: Sequence[BlockKey], req_id: str) -> Hinted:
        """Remove the movable ``keys`` from the pool now."""
        out = observed(self.shared.observer, "drop", req_id, self._drop, keys)
        self.shared.observer.op("drop", req_id)
        return out

    def drop_steps(self, keys: Sequence[BlockKey], req_id: str) -> Generator[None, None, Hinted]:
        """``drop`` in steps of ``STEP_KEYS`` (``manager.steps``)."""
        shared = self.shared
        steps = shared.manager.drop_steps(keys, STEP_KEYS)
        done, kept = yield from observed_steps(shared.observer, "drop", req_id, steps)
        shared.counts["dropped"] += len(done)
        shared.observer.op("drop", req_id)
        return Hinted(done, kept)

    def _drop(self, keys: Sequence[BlockKey]) -> Hinted:
        shared = self.shared
        movable, kept = shared.manager.sort_for_hint(keys)
        done = shared.manager.drop(movable) if movable else []
        shared.counts["dropped"] += len(done)
        return Hinted(done, kept)

    def metric_families(self) -> Iterator[Metric]:
        """The hint family, read at scrape time."""
        hints = CounterMetricFamily(
            f"{PREFIX}_cache_hint_blocks", "Blocks moved by cache hints.", labels=["hint"]
        )
        hints.add_metric(["demote"], self.shared.counts["demoted"])
        hints.add_metric(["drop"], self.shared.counts["dropped"])
        yield hints
