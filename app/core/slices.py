"""A call's hold on the shared event loop, and its steps driven with the manager suspended.

Every tenant's calls share one event loop, so a call that holds it for tens of milliseconds
delays every other tenant's calls by as much. A call gives way (``Slices.pause``: several loop
turns, so that a small call that arrived meanwhile ends before it goes on) once it has held the
loop ``YIELD_AFTER_S`` since it last gave way. A call that ends sooner never gives way, so small
calls cost nothing more. ``Slices.run`` drives a call's steps (a generator over the manager's
``*_steps`` verbs) so: while it gives way the manager is suspended (``manager.suspend``), and
any other entry into it first finishes the call. The engine API's large calls
(``app.http.steps``) and the lease sweep's large expiries run through it.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import time
from collections.abc import Awaitable, Generator
from typing import Any, Protocol, TypeVar

from manager.parts import whole
from manager.suspend import SuspendRoom

T = TypeVar("T")

#: A call gives way to the loop between steps once it has held it this long (other tenants'
#: calls run in between); a call that ends sooner never gives way.
YIELD_AFTER_S = 0.001
#: Loop turns a call gives way for: a small call that arrived meanwhile takes a few turns
#: (read, route, answer, each a callback of its own); with one turn per slice it would wait one
#: slice per turn. A turn with nothing else to run costs microseconds.
GIVE_WAY_TURNS = 8


async def give_way() -> None:
    """Let the loop turn ``GIVE_WAY_TURNS`` times before the caller goes on."""
    for _ in range(GIVE_WAY_TURNS):
        await asyncio.sleep(0)


async def after_others(manager: SuspendRoom) -> None:
    """Wait while another call is between its steps in ``manager``. A step that entered the
    manager now would settle that call, its whole rest run at once (``manager.suspend``):
    one long step, as if it had never been cut. The other call goes on at its next turn and
    stays suspended between its steps, so this one usually waits for it to end."""
    while manager.suspended:
        await asyncio.sleep(0)


class Slices:
    """One call's hold on the loop: ``await pause()`` between steps gives way once the call
    has held the loop ``YIELD_AFTER_S`` since it started or last gave way."""

    __slots__ = ("held",)

    def __init__(self) -> None:
        self.held = time.perf_counter()

    async def pause(self) -> None:
        """Give way if this call has held the loop long enough; else return at once."""
        if time.perf_counter() - self.held > YIELD_AFTER_S:
            await give_way()
            self.held = time.perf_counter()

    async def run(self, steps: Generator[None, None, T], manager: SuspendRoom | None = None) -> T:
        """Drive ``steps`` to its end, pausing between them; what it returns (or raises).

        With ``manager`` (the steps change it), the manager is suspended while the call gives
        way: any other entry into it first runs the rest of ``steps`` (``manager.suspend``),
        so that nobody sees it between two steps. A call cancelled while it gives way runs
        its rest before it ends: a call is never left half done. While another call is between
        its steps in ``manager``, this one waits before each step of its own (``after_others``)
        rather than run the other's rest: in practice it waits for the other to end."""
        while True:
            if manager is not None and manager.suspended:
                await after_others(manager)
                self.held = time.perf_counter()
            try:
                next(steps)
            except StopIteration as end:
                return end.value  # type: ignore[no-any-return]
            if time.perf_counter() - self.held <= YIELD_AFTER_S:
                continue
            if manager is None:
                await give_way()
            else:
                settled = _Settled(steps)
                manager.suspend(settled)
                try:
                    await give_way()
                except BaseException:  # cancelled: the rest now, its outcome lost with the call
                    if manager.resume():
                        with contextlib.suppress(Exception):
                            whole(steps)
                    raise
                if not manager.resume():  # someone entered meanwhile and ran the rest
                    return settled.outcome()  # type: ignore[no-any-return]
            self.held = time.perf_counter()


class StepRunner(Protocol):
    """Drives a call's steps (a generator that yields between them) to their end; what they
    return. ``stepper``'s gives way to other work between steps, the namespace's manager
    suspended meanwhile; ``all_at_once`` does not."""

    def __call__(self, steps: Generator[None, None, T], /) -> Awaitable[T]: ...


async def all_at_once(steps: Generator[None, None, T]) -> T:
    """The ``StepRunner`` that runs every step at once, giving way to nothing."""
    return whole(steps)


def stepper(manager: SuspendRoom, slices: Slices | None = None) -> StepRunner:
    """The ``StepRunner`` of one call on ``manager``: ``slices.run`` with the manager (a new
    call's ``Slices`` when None)."""
    hold = Slices() if slices is None else slices

    def run(steps: Generator[None, None, T]) -> Awaitable[T]:
        return hold.run(steps, manager)

    return run


class _Settled:
    """The rest of a suspended call, run by whoever enters the manager next: its outcome
    kept for the call (the one who runs it is not its caller), in the call's own context
    (its request id in the logs)."""

    def __init__(self, steps: Generator[None, Any, Any]) -> None:
        self.steps = steps
        self.context = contextvars.copy_context()
        self.value: Any = None
        self.error: Exception | None = None

    def __call__(self) -> None:
        try:
            self.value = self.context.run(whole, self.steps)
        except Exception as exc:  # the call's own outcome: raised again by the call
            self.error = exc

    def outcome(self) -> Any:
        if self.error is not None:
            raise self.error
        return self.value
