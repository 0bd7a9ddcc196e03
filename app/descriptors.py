"""The process's descriptor table: its limit raised at start, and a reserve kept free.

Every connection, passed descriptor and open file takes a slot of one table per process, and
the table is shared by every tenant. ``raise_limit`` lifts the soft ``RLIMIT_NOFILE`` to the
hard one at start (the soft default, often 1,024, is a relic of ``select``; the service uses
none). The last ``RESERVE`` slots are kept for the service itself (its admin listener, disk
files, health checks, logs): code that takes a descriptor on a caller's behalf (an accepted
connection, descriptors passed over the pool socket) refuses it when the table is that full
(``in_reserve``), so a flood of callers can fill the table up to the reserve and never past it.

``in_reserve`` is O(1): the kernel hands out the *lowest* free descriptor, so a descriptor
numbered at or above ``limit - RESERVE`` means every number below it is taken.
"""

from __future__ import annotations

import logging
import resource
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

RESERVE = 256
"""Descriptors kept for the service itself; callers' connections and descriptors stop short."""
_NR_OPEN = "/proc/sys/fs/nr_open"
_FALLBACK_CEILING = 1 << 20


def raise_limit() -> int:
    """Raise the soft ``RLIMIT_NOFILE`` to the hard limit (to ``fs.nr_open`` when the hard
    limit is unlimited); the soft limit in force afterwards. Never lowers it; a refusal by
    the kernel leaves it as it was (logged)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard
    if hard == resource.RLIM_INFINITY:
        try:
            with open(_NR_OPEN) as f:
                target = int(f.read())
        except (OSError, ValueError):
            target = _FALLBACK_CEILING
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (OSError, ValueError) as exc:
            log.warning(
                "descriptor limit not raised",
                extra={"fields": {"soft": soft, "hard": hard, "error": str(exc)}},
            )
    return soft


def limit() -> int:
    """The soft ``RLIMIT_NOFILE`` now (what ``open``, ``accept`` and ``recvmsg`` are held to)."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return _FALLBACK_CEILING if soft == resource.RLIM_INFINITY else soft


def in_reserve(fd: int) -> bool:
    """True when descriptor ``fd``, just handed out by the kernel, lies in the reserve: at most
    ``RESERVE`` slots of the table were free before it was taken (see the module docstring)."""
    return fd >= limit() - RESERVE


class RateLimitedLog:
    """One log line per ``every_s`` seconds at most, carrying how many events it stands for:
    a flood (a full descriptor table, a peer refused a thousand times) must not become a log
    flood. ``clock`` is injectable for tests."""

    def __init__(
        self,
        logger: logging.Logger,
        every_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._log = logger
        self._every_s = every_s
        self._last: dict[str, float] = {}
        self._pending: dict[str, int] = {}
        self._clock = clock

    def warning(self, event: str, **fields: object) -> bool:
        """Count one ``event``; log it (with ``count``: the events since the last line) when the
        last line of this event is ``every_s`` old or there was none. True when it logged."""
        now = self._clock()
        self._pending[event] = self._pending.get(event, 0) + 1
        last = self._last.get(event)
        if last is not None and now - last < self._every_s:
            return False
        count = self._pending.pop(event)
        self._last[event] = now
        self._log.warning(event, extra={"fields": {**fields, "count": count}})
        return True
