"""What cache control's rooms share (``app.core.control``): the namespace's manager, tiers and
settings, its observer and clock, one set of counts, where keys are (``ControlShared.states``)
and promotions under control's own request ids (``ControlShared.promote``).

The rooms (``app.core.retentions``, ``app.core.prefetches``, ``app.core.cache_hints``) each hold
the one ``ControlShared`` of their namespace: a promotion's request id must be unique across
them (the tiers let go of a promotion's holds by it), and ``/admin/v1/stats`` and the metrics
read every room's counts from one ``Counter``.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import time
from collections.abc import Callable, Generator, Sequence

from app.core.lower_tiers import TierChain
from app.core.observed import STEP_KEYS
from app.core.slices import StepRunner, all_at_once
from app.settings import Settings
from app.telemetry.observer import Observer
from manager import BlockKey, InvalidArgumentError, LookupResult, OffloadManager
from manager.parts import parts
from manager.retention import check_ttl

HIT, PENDING, MISS, REFUSED = "hit", "pending", "miss", "refused"
_NAMES = {LookupResult.HIT: HIT, LookupResult.PENDING: PENDING, LookupResult.MISS: None}


class ControlShared:
    """One namespace's cache-control state and helpers that every room uses; see the module
    docstring. Not thread-safe: every call runs on the event loop."""

    def __init__(
        self,
        settings: Settings,
        manager: OffloadManager,
        tiers: TierChain,
        *,
        namespace: str,
        observer: Observer,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.observer = observer
        self.manager = manager
        self.tiers = tiers
        self.namespace = namespace
        #: The clock deadlines are read against.
        self.clock = clock
        #: Every room's counts (``/admin/v1/stats``' ``counts``, and the metrics' sources).
        self.counts: collections.Counter[str] = collections.Counter()
        self._promotion_ids = itertools.count(1)
        self._settling: set[asyncio.Task[None]] = set()

    async def states(
        self, keys: Sequence[BlockKey], req_id: str, run: StepRunner = all_at_once
    ) -> list[str | None]:
        """Per key: ``hit`` (ready in the pool), ``pending`` (a store or promotion in
        flight), the name of the first tier below that holds it, or None (nowhere). The pool
        is asked ``STEP_KEYS`` keys a step (``run`` drives them)."""
        out = await run(self._peek_steps(keys))
        below = [i for i, s in enumerate(out) if s is None] if None in out else []
        if below and self.tiers:
            found = await self.tiers.found([keys[i] for i in below], req_id)
            for i, tier in zip(below, found, strict=True):
                out[i] = tier
        return out

    def _peek_steps(self, keys: Sequence[BlockKey]) -> Generator[None, None, list[str | None]]:
        out: list[str | None] = []
        peek = self.manager.peek
        for part in parts(keys, STEP_KEYS):
            yield
            out += map(_NAMES.__getitem__, peek(part))
        return out

    def promote(
        self, keys: list[BlockKey], protect: list[BlockKey], then: Callable[[], None] | None
    ) -> list[asyncio.Task[None]]:
        """Start promotions of ``keys`` under an internal request of their own; the tasks
        started. ``then`` runs once they settle; the promotions' own holds are let go of then."""
        req_id = f"kvoffload-control-{next(self._promotion_ids)}"
        tasks = self.tiers.promote(keys, req_id, protect, self.manager) if keys else []

        async def settle() -> None:
            try:
                # Each promotion settles its own failures (return_exceptions: none raises).
                await asyncio.gather(*tasks, return_exceptions=True)
                if then is not None:
                    then()
            finally:
                self.tiers.let_go(req_id)

        if tasks or then is not None:
            task = asyncio.get_running_loop().create_task(settle(), name="kvoffload-control-settle")
            # The loop keeps only a weak reference to a task: this one must not be collected.
            self._settling.add(task)
            task.add_done_callback(self._settling.discard)
        return tasks


def bounded(field: str, value: float, bound: float, setting: str) -> float:
    """``value`` as a float; ``InvalidArgumentError`` naming ``field`` and ``setting`` (the
    bound's) unless it is a finite number with 0 < it <= ``bound``."""
    try:
        out = check_ttl(value)
    except InvalidArgumentError:
        out = -1.0
    if not 0 < out <= bound:
        raise InvalidArgumentError(
            f"{field} must be a finite number, 0 < {field} <= {bound:g} ({setting}), got {value!r}"
        )
    return out
