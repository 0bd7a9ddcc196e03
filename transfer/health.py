"""The health of a lower tier (disk, remote): one snapshot type for every backend."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Literal

__all__ = ["TierHealth", "TierState"]

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
