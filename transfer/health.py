"""The health of a lower tier (disk, remote): one snapshot type for every backend, and the
tracker the shared stores (Mooncake, S3) keep it in."""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

__all__ = ["HealthTracker", "TierHealth", "TierState"]

TierState = Literal["ok", "degraded"]


@dataclass(frozen=True)
class TierHealth:
    """A snapshot of a tier's state.

    ``since`` is the ``time.time()`` at which ``state`` began; ``last_error`` is the most
    recent failure's description (kept after recovery, for the operator), ``None`` if there
    never was one; ``counters`` holds at least the tier's documented counters
    (``transfer.remote.COUNTERS``, ``transfer.disk.DISK_COUNTERS``).
    """

    state: TierState
    since: float
    last_error: str | None = None
    counters: dict[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.state == "ok"

    def as_dict(self) -> dict[str, object]:
        """JSON-ready form (for stats and readiness details)."""
        return {
            "state": self.state,
            "since": self.since,
            "seconds_in_state": max(0.0, time.time() - self.since),
            "last_error": self.last_error,
            "counters": dict(self.counters),
        }


class HealthTracker:
    """A store's health, shared by its calls' threads and its probe thread: the state, since
    when, the last error, the counters and whether the store is closed, all under ``lock``
    (which the store may take for its own state too: one lock, no order between two).

    The store starts degraded (``last_error`` says why until its first probe, ``started``).
    A call that fails for every key degrades it (``fail``, an incident) and wakes the probe
    (``wake``), which brings it back (``recovered``) once a probe answers; a call that fails
    for some keys only is noted (``note``) and leaves the state alone. A closed store's state
    no longer changes.
    """

    def __init__(
        self, what: str, counters: Iterable[str], first_error: str, logger: logging.Logger
    ) -> None:
        """``what``: the store in ``logger``'s lines (``"object tier"``). ``counters``: the
        names it counts (every one starts at 0; ``incidents`` among them)."""
        self.what = what
        self.log = logger
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self.counters = dict.fromkeys(counters, 0)
        self.state: TierState = "degraded"
        self.since = time.time()
        self.last_error: str | None = first_error
        self.closed = False
        # Pool slots the store's calls may still read or write (a call past its timeout too).
        self.held: collections.Counter[int] = collections.Counter()

    def started(self, ok: bool) -> None:
        """The first probe's outcome: ok, or degraded from the start (an incident)."""
        with self.lock:
            if ok:
                self.state, self.since, self.last_error = "ok", time.time(), None
                return
            self.counters["incidents"] += 1
        self.log.warning("%s starts degraded: %s", self.what, self.last_error)

    def snapshot(self) -> TierHealth:
        with self.lock:
            return TierHealth(self.state, self.since, self.last_error, dict(self.counters))

    def hold(self, slots: Sequence[int]) -> bool:
        """A call over ``slots`` begins: they are held until ``release``. False (nothing held,
        the call counted ``skipped``: it answers without the store) while the store is closed
        or degraded."""
        with self.lock:
            if self.closed or self.state != "ok":
                self.counters["skipped"] += 1
                return False
            self.held.update(slots)
            return True

    def release(self, slots: Sequence[int]) -> None:
        """The calls over ``slots`` no longer touch them."""
        with self.lock:
            self.held.subtract(slots)
            self.held += collections.Counter()  # drops the zero counts

    def held_slots(self) -> frozenset[int]:
        with self.lock:
            return frozenset(self.held)

    def count(self, **deltas: int) -> None:
        with self.lock:
            for name, delta in deltas.items():
                self.counters[name] += delta

    def note(self, reason: str) -> None:
        """The last error, the state left as it is."""
        with self.lock:
            self.last_error = reason

    def judge(self, what: str, bad: int, total: int, why: str) -> None:
        """A call's per-key failures (``bad`` of ``total``, ``why``): an error counted, and
        every key failing degrades the store; none: nothing."""
        if not bad:
            return
        self.count(errors=1)
        message = f"{what}: {bad} of {total} keys failed ({why})"
        if bad == total:
            self.fail(message)
        else:
            self.note(message)

    def fail(self, reason: str) -> None:
        """Degrade (an incident) and wake the probe; already degraded or closed: only the
        reason is kept."""
        with self.lock:
            self.last_error = reason
            if self.state != "ok" or self.closed:
                return
            self.state = "degraded"
            self.since = time.time()
            self.counters["incidents"] += 1
        self.log.warning("%s degraded: %s", self.what, reason)
        self.wake.set()

    def recovered(self) -> None:
        """Ok again (a probe answered); already ok or closed: nothing."""
        with self.lock:
            if self.state == "ok" or self.closed:
                return
            was = time.time() - self.since
            self.state = "ok"
            self.since = time.time()
        self.log.info("%s ok again after %.1f s degraded", self.what, was)

    def close(self) -> bool:
        """Mark closed and wake the probe (to end); False if it was closed already."""
        with self.lock:
            if self.closed:
                return False
            self.closed = True
        self.wake.set()
        return True

    def next_look(self, interval: float) -> tuple[bool, TierState]:
        """The probe's wait: until ``interval`` passes or something wakes it (a state change,
        the close); then whether the store is closed, and its state."""
        if self.wake.wait(interval):
            self.wake.clear()
        with self.lock:
            return self.closed, self.state
