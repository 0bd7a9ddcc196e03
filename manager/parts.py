"""A batch of keys cut in parts, for the verbs that run in steps (``manager.steps``,
``manager.retaining``): ``parts`` cuts, ``distinct_steps`` dedupes a part a step."""

from __future__ import annotations

from collections.abc import Generator, Sequence
from typing import TypeVar

T = TypeVar("T")

#: A step no batch reaches: a ``*_steps`` method given it runs whole, in one step.
WHOLE = 1 << 62


def parts(items: Sequence[T], step: int) -> list[Sequence[T]]:
    """``items`` in consecutive slices of ``step`` (the last one shorter)."""
    return [items[i : i + step] for i in range(0, len(items), step)]


def distinct_steps(items: Sequence[T], step: int) -> Generator[None, None, dict[T, None]]:
    """``dict.fromkeys(items)`` (each item once, in first-seen order), a part a step;
    ``TypeError`` for an unhashable item, as ``dict.fromkeys`` raises it."""
    out: dict[T, None] = {}
    for part in parts(items, step):
        yield
        out.update(dict.fromkeys(part))
    return out


def whole(steps: Generator[None, None, T]) -> T:
    """Run ``steps`` to its end at once; what it returns."""
    while True:
        try:
            next(steps)
        except StopIteration as end:
            return end.value  # type: ignore[no-any-return]
