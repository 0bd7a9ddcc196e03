"""A caller's work suspended between its steps, and settled by whoever enters next.

A large call (thousands of keys) may be run as consecutive manager calls of a bounded size,
its caller giving way to other work between them (the service's event loop, so that one
tenant's large call does not hold every other tenant's calls). Between two of its steps the
call is *suspended*: ``suspend(rest)`` records how to finish it, and until ``resume()``, any
other entry into the manager (every public method and property) first runs ``rest``
(*settles* it), so that nothing ever sees the manager between two steps of another's call: to
every other caller, the call is one.

The check costs nothing while nothing is suspended: a suspended manager's class is swapped for
a subclass whose public methods and properties settle first, and swapped back when settled or
resumed. A verb in steps (a generator) settles at its first step, not when it is made: its
caller may wait for the suspended call to go on before stepping it. Plain attributes
(``num_blocks``, ``store_threshold``) are constants and do not settle, nor do the methods a
class names in ``_unsettled``: the event stream's (a lower tier's event appended, the events
taken by their reader) read and change no block's state, and are called by the tiers'
background work often enough (a disk write's end) to settle every suspended call at once.
``rest`` must not raise (the one who settles it is not its caller): it keeps its outcome for
its caller.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Generator
from functools import wraps
from typing import Any

Rest = Callable[[], None]

_SETTLING: dict[type, type] = {}


class SuspendRoom:
    """``suspend`` / ``resume`` / ``settle``; see the module docstring."""

    _rest: Rest | None = None
    #: Public methods that do not settle first (see the module docstring).
    _unsettled: frozenset[str] = frozenset()

    def suspend(self, rest: Rest) -> None:
        """Until ``resume``, any other entry first calls ``rest`` (once). A call already
        suspended is settled first: one at a time."""
        if self._rest is not None:
            self.settle()
        base = type(self)
        settling = _SETTLING.get(base)
        if settling is None:
            settling = _SETTLING[base] = _settling_class(base)
        self._rest = rest
        self.__class__ = settling

    def resume(self) -> bool:
        """End the suspension without running the rest: True when the caller goes on with it;
        False when it was settled meanwhile (its rest ran) or nothing was suspended."""
        if self._rest is None:
            return False
        self._end_suspension()
        return True

    @property
    def suspended(self) -> bool:
        """Whether a call is suspended between two of its steps (asking does not settle it)."""
        return self._rest is not None

    def settle(self) -> None:
        """Run the suspended rest now, if any."""
        rest = self._rest
        if rest is not None:
            self._end_suspension()
            rest()

    def _end_suspension(self) -> None:
        self._rest = None
        self.__class__ = type(self).__mro__[1]


def _settling_class(base: type) -> type:
    """``base`` with every public method and property settling first (but those of
    ``_unsettled`` and the suspension's own)."""
    members: dict[str, Any] = {"__slots__": ()} if hasattr(base, "__slots__") else {}
    unsettled = {"suspend", "resume", "settle", "suspended", *getattr(base, "_unsettled", ())}
    for name in dir(base):
        if name.startswith("_") or name in unsettled:
            continue
        member = inspect.getattr_static(base, name)
        if isinstance(member, property) and member.fget is not None:
            members[name] = property(_settling_first(member.fget))
        elif inspect.isfunction(member):
            members[name] = _settling_first(member)
    return type(f"Settling{base.__name__}", (base,), members)


def _settling_first(method: Callable[..., Any]) -> Callable[..., Any]:
    if inspect.isgeneratorfunction(method):  # a verb in steps: it settles at its first step

        @wraps(method)
        def settling_steps(self: SuspendRoom, *args: Any, **kwargs: Any) -> Any:
            return _settled_then(self, method, args, kwargs)

        return settling_steps

    @wraps(method)
    def settling(self: SuspendRoom, *args: Any, **kwargs: Any) -> Any:
        self.settle()
        return method(self, *args, **kwargs)

    return settling


def _settled_then(
    manager: SuspendRoom, method: Callable[..., Any], args: Any, kwargs: Any
) -> Generator[None, None, Any]:
    manager.settle()
    return (yield from method(manager, *args, **kwargs))
