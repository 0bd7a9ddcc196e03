"""Asks counted for admission a part at a time (``app.core.asks``, issue #42, finding 10): the
counts, once settled, are those of counting every ask at once, in its order; a large ask is
counted over several loop turns."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import app.core.asks as asks_module
from app.core.asks import QueuedAsks
from manager import DiskIndex

KEYS = [bytes([i]) * 32 for i in range(6)]
REQS = ["r1", "r2", "r3"]

asks = st.lists(
    st.tuples(st.lists(st.sampled_from(KEYS), max_size=7), st.sampled_from(REQS)),
    max_size=12,
)


@settings(max_examples=200, deadline=None)
@given(sequence=asks, turns=st.lists(st.integers(0, 3), min_size=12, max_size=12))
def test_settled_counts_are_those_of_counting_at_once(
    sequence: list[tuple[list[bytes], str]], turns: list[int]
) -> None:
    """Asks of any size by any request, the counting task given 0-3 loop turns between them,
    then settled: every key's count equals the twin's, which counted each ask at once."""
    at_once = DiskIndex(8, admit_after=2)
    for keys, req in sequence:
        at_once.asked(keys, req)

    async def queued() -> DiskIndex:
        index = DiskIndex(8, admit_after=2)
        q = QueuedAsks(index.asked)
        task = asyncio.create_task(q.run())
        await asyncio.sleep(0)  # running
        for (keys, req), n in zip(sequence, turns, strict=False):
            q.add(keys, req)
            for _ in range(n):
                await asyncio.sleep(0)
        q.settle()
        task.cancel()
        return index

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(asks_module, "ASK_STEP", 2)
        index = asyncio.run(queued())
    assert [index.asks(k) for k in KEYS] == [at_once.asks(k) for k in KEYS]


def test_a_large_ask_is_counted_over_several_loop_turns(monkeypatch: pytest.MonkeyPatch) -> None:
    """An ask of 10 keys, 2 a step: after one loop turn some are counted and not all; after
    enough turns, all of them, without anyone settling."""
    monkeypatch.setattr(asks_module, "ASK_STEP", 2)
    index = DiskIndex(16, admit_after=2)
    q = QueuedAsks(index.asked)
    keys = [bytes([i]) * 32 for i in range(10)]

    async def main() -> list[int]:
        task = asyncio.create_task(q.run())
        await asyncio.sleep(0)
        q.add(keys, "r")
        seen = []
        for _ in range(8):
            await asyncio.sleep(0)
            seen.append(sum(index.asks(k) for k in keys))
        task.cancel()
        return seen

    seen = asyncio.run(main())
    assert 0 < seen[0] < 10
    assert seen[-1] == 10


def test_before_its_task_runs_an_ask_is_counted_at_once() -> None:
    index = DiskIndex(1024, admit_after=2)
    q = QueuedAsks(index.asked)
    keys = [i.to_bytes(2, "big") * 16 for i in range(1000)]
    q.add(keys, "r")
    assert all(index.asks(k) == 1 for k in keys)


def test_a_queue_past_its_bound_is_settled_by_the_ask(monkeypatch: pytest.MonkeyPatch) -> None:
    """The counting task starved: the ask that takes the queue past ``MAX_QUEUED_KEYS``
    counts it all in its own call (memory stays bounded)."""
    monkeypatch.setattr(asks_module, "ASK_STEP", 2)
    monkeypatch.setattr(asks_module, "MAX_QUEUED_KEYS", 8)
    index = DiskIndex(16, admit_after=2)
    q = QueuedAsks(index.asked)
    keys = [bytes([i]) * 32 for i in range(6)]

    async def main() -> tuple[int, int]:
        task = asyncio.create_task(q.run())
        await asyncio.sleep(0)
        q.add(keys, "r1")  # queued, not counted yet
        first = sum(index.asks(k) for k in keys)
        q.add(keys, "r2")  # 12 queued > 8: settled now
        second = sum(index.asks(k) for k in keys)
        task.cancel()
        return first, second

    assert asyncio.run(main()) == (0, 12)
