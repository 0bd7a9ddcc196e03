"""Declared policy parameters: each policy lists a ``ParamSpec`` per parameter, once.

A policy class sets ``params_spec`` to a tuple of ``ParamSpec``; ``check_params`` is the one
place that turns a caller's mapping into the policy's parameters, for every policy: unknown
names, wrong types (a bool is never a number), non-finite numbers and values outside the
declared bounds raise ``InvalidPolicyParamsError`` whose message names the policy, the
parameter and what is accepted (``lfu: history_factor must be a number in [0, 16], got
1e+308``). Every numeric parameter has a finite lower and upper bound: a spec without them
cannot be built, so no policy can take an unbounded value (a history sized ``1e30 x
capacity``, or one whose ``int()`` overflows).

Pure Python, no I/O: the service, the command line and the replay tool all reach it through
the registry (``manager.policies.registry``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from manager.errors import InvalidPolicyParamsError

#: ``float``: an int or a float (stored as float); ``int``: an int only; ``choice``: one of
#: ``choices`` (strings). Bools are refused by every kind: ``true`` for a ratio is a typo.
ParamKind = Literal["float", "int", "choice"]
ParamValue = float | int | str

# A refused value is echoed in the message; a huge int or string is cut to this many characters
# so an error stays one readable line (the value came from a request body or a flag).
_MAX_SHOWN = 48


def _show(value: object) -> str:
    """``repr(value)``, cut to ``_MAX_SHOWN`` characters."""
    text = repr(value)
    if len(text) > _MAX_SHOWN:
        return text[: _MAX_SHOWN - 3] + "..."
    return text


def _num(x: float) -> str:
    """A bound as a reader writes it: ``16`` rather than ``16.0``, else the exact repr."""
    return str(int(x)) if float(x).is_integer() else repr(float(x))


@dataclass(frozen=True, slots=True, kw_only=True)
class ParamSpec:
    """One policy parameter: its name, kind, default and accepted values.

    Numeric kinds (``float``, ``int``) need finite ``low`` < ``high``; ``low_open`` /
    ``high_open`` make a bound exclusive (a ratio strictly between 0 and 1). ``choice`` needs
    ``choices`` and no bounds. The default must itself be accepted. A spec breaking any of this
    raises ``ValueError`` when it is built (a programming error, found at import).
    """

    name: str
    kind: ParamKind
    default: ParamValue
    doc: str
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    choices: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.name.isidentifier():
            raise ValueError(f"parameter name {self.name!r} is not an identifier")
        if self.kind == "choice":
            if not self.choices or self.low is not None or self.high is not None:
                raise ValueError(f"{self.name}: a choice needs choices and no bounds")
            if not all(isinstance(c, str) for c in self.choices):
                raise ValueError(f"{self.name}: choices must be strings")
        else:
            low, high = self.low, self.high
            if low is None or high is None:
                raise ValueError(f"{self.name}: a numeric parameter needs both bounds")
            if not (math.isfinite(low) and math.isfinite(high) and low < high):
                raise ValueError(f"{self.name}: bounds must be finite with low < high")
            if self.choices:
                raise ValueError(f"{self.name}: only a choice takes choices")
        if self._refusal(self.default) is not None:
            raise ValueError(f"{self.name}: default {self.default!r} is outside its own bounds")

    def accepted(self) -> str:
        """What the parameter accepts, in words: ``a number in [0, 16]``, ``one of 'a', 'b'``."""
        if self.kind == "choice":
            return "one of " + ", ".join(repr(c) for c in self.choices)
        low, high = self._bounds()
        what = "an integer" if self.kind == "int" else "a number"
        left = "(" if self.low_open else "["
        right = ")" if self.high_open else "]"
        return f"{what} in {left}{_num(low)}, {_num(high)}{right}"

    def _bounds(self) -> tuple[float, float]:
        """``(low, high)`` of a numeric spec (``__post_init__`` made sure both are set)."""
        low, high = self.low, self.high
        if low is None or high is None:
            raise TypeError(f"{self.name}: a {self.kind} parameter has no bounds")
        return low, high

    def _refusal(self, value: object) -> str | None:
        """Why ``value`` is refused (a short reason), or None when it is accepted."""
        if self.kind == "choice":
            return None if isinstance(value, str) and value in self.choices else "not a choice"
        # bool is an int subclass: refuse it before the number checks.
        if isinstance(value, bool):
            return "a bool"
        if self.kind == "int":
            if not isinstance(value, int):
                return "not an integer"
        elif not isinstance(value, int | float):
            return "not a number"
        elif isinstance(value, float) and not math.isfinite(value):
            return "not finite"
        low, high = self._bounds()
        # Compared as given: an int too large for a float is still ordered exactly (float()
        # would raise OverflowError on it), and it is refused here, before any conversion.
        number: int | float = value
        below = number <= low if self.low_open else number < low
        above = number >= high if self.high_open else number > high
        return "out of range" if below or above else None

    def check(self, policy: str, value: object) -> ParamValue:
        """``value`` as the policy stores it (a float for ``float``), or
        ``InvalidPolicyParamsError`` naming ``policy``, the parameter and its bounds."""
        if self._refusal(value) is not None:
            raise InvalidPolicyParamsError(
                f"{policy}: {self.name} must be {self.accepted()}, got {_show(value)}"
            )
        if self.kind == "float":
            assert isinstance(value, int | float)
            return float(value)  # in range, so finite and representable
        assert isinstance(value, int | str)
        return value

    def describe(self) -> dict[str, Any]:
        """The spec as plain data (JSON-ready), for help texts and API answers."""
        out: dict[str, Any] = {"name": self.name, "type": self.kind, "default": self.default}
        if self.kind == "choice":
            out["choices"] = list(self.choices)
        else:
            out["min"] = self.low
            out["max"] = self.high
            out["min_exclusive"] = self.low_open
            out["max_exclusive"] = self.high_open
        out["accepted"] = self.accepted()
        out["doc"] = self.doc
        return out

    def summary(self) -> str:
        """One phrase: ``history_factor (a number in [0, 16], default 2)``."""
        default = (
            _num(self.default) if isinstance(self.default, int | float) else repr(self.default)
        )
        return f"{self.name} ({self.accepted()}, default {default})"


def check_specs(policy: str, specs: Sequence[ParamSpec]) -> None:
    """``ValueError`` unless ``specs`` is a sequence of ``ParamSpec`` with distinct names."""
    names = [s.name for s in specs if isinstance(s, ParamSpec)]
    if len(names) != len(specs):
        raise ValueError(f"policy {policy!r}: params_spec must hold ParamSpec entries only")
    if len(set(names)) != len(names):
        raise ValueError(f"policy {policy!r}: params_spec names a parameter twice")


def check_params(
    policy: str, specs: Sequence[ParamSpec], params: Mapping[str, object]
) -> dict[str, Any]:
    """The parameters of ``policy``: every declared one, given or defaulted, checked.

    Raises ``InvalidPolicyParamsError`` for a name not declared (listing the accepted ones) or
    for the first declared parameter whose value is refused. Idempotent: the result, passed
    again, comes back equal. Never changes ``params``.
    """
    declared = {s.name for s in specs}
    unknown = sorted(str(k) for k in params if k not in declared)
    if unknown:
        if not specs:
            raise InvalidPolicyParamsError(f"policy {policy!r} takes no parameters, got {unknown}")
        accepted = ", ".join(s.summary() for s in specs)
        raise InvalidPolicyParamsError(
            f"{policy}: unknown parameters {unknown}; accepted: {accepted}"
        )
    return {s.name: s.check(policy, params.get(s.name, s.default)) for s in specs}
