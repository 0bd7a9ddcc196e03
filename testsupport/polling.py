"""Waiting for what another thread, process or task makes true: one helper, bounded in time.

A check answers None or False while what it waits for has not come; anything else (a value
the caller wants back, True) ends the wait and is returned. An HTTP transport error from the
check counts as "not yet" (a server still starting, a node restarting), and the last one is
named if the wait fails. Past ``within_s`` the wait fails with an ``AssertionError`` naming
``what``: a wait is a test's precondition, never a measurement (nothing asserts on time).

Checks come every ``every_s`` when given; by default the pause between them starts at
``FIRST_PAUSE_S`` and grows to ``MAX_PAUSE_S``: a condition that comes at once is seen at once,
and a slow one (a server starting, a container turning healthy) is not asked 50 times a second.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable
from typing import Any, TypeVar

import httpx

T = TypeVar("T")

FIRST_PAUSE_S = 0.005
MAX_PAUSE_S = 0.2
GROWTH = 1.5

#: Errors of a check that mean "not yet" rather than a failure.
NOT_YET_ERRORS: tuple[type[BaseException], ...] = (httpx.TransportError,)


def _done(found: object) -> bool:
    return found is not None and found is not False


class _Wait:
    """One wait's deadline, pauses and last "not yet" error."""

    def __init__(self, what: str, within_s: float, every_s: float | None) -> None:
        self.what, self.within_s, self.every_s = what, within_s, every_s
        self.deadline = time.monotonic() + within_s
        self.pause_s = FIRST_PAUSE_S if every_s is None else every_s
        self.last_error: BaseException | None = None

    def pause(self) -> float:
        """Seconds to sleep before the next check; ``AssertionError`` past the deadline."""
        if time.monotonic() > self.deadline:
            said = "" if self.last_error is None else f" (last: {self.last_error!r})"
            raise AssertionError(f"not within {self.within_s:g} s: {self.what}{said}")
        pause = self.pause_s
        if self.every_s is None:
            self.pause_s = min(MAX_PAUSE_S, pause * GROWTH)
        return pause


def until(
    what: str, check: Callable[[], T | None], within_s: float = 10.0, every_s: float | None = None
) -> T:
    """``check()`` until it answers neither None nor False; that answer. ``AssertionError``
    naming ``what`` after ``within_s`` seconds."""
    wait = _Wait(what, within_s, every_s)
    while True:
        try:
            found = check()
        except NOT_YET_ERRORS as exc:
            found, wait.last_error = None, exc
        if _done(found):
            return found  # type: ignore[return-value]
        time.sleep(wait.pause())


async def until_async(
    what: str, check: Callable[[], Any], within_s: float = 10.0, every_s: float | None = None
) -> Any:
    """``until`` on the running loop: ``check`` may be a coroutine function (its result is
    awaited); the loop runs other tasks between checks."""
    wait = _Wait(what, within_s, every_s)
    while True:
        try:
            found = check()
            if inspect.isawaitable(found):
                found = await found
        except NOT_YET_ERRORS as exc:
            found, wait.last_error = None, exc
        if _done(found):
            return found
        await asyncio.sleep(wait.pause())
