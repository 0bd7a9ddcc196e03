"""``EventBuffer``: cursor reads, bounded memory, and gaps left by the manager's own buffer."""

from __future__ import annotations

import pytest

from app.core.events import EventBuffer
from manager import AllBlocksCleared, BlockRemoved, BlockStored


def stored(seq: int) -> BlockStored:
    return BlockStored(seq, [seq.to_bytes(2, "big")])


def test_keeps_the_newest_and_flags_readers_behind() -> None:
    buf = EventBuffer(3)
    buf.extend(stored(i) for i in range(1, 6))
    assert len(buf) == 3
    assert buf.dropped == 2
    page = buf.page(after=0, limit=10)
    assert [e.seq for e in page.events] == [3, 4, 5]
    assert page.fell_behind
    assert not buf.page(after=2, limit=10).fell_behind
    assert buf.page(after=1, limit=10).fell_behind


def test_a_gap_in_sequence_numbers_counts_as_dropped() -> None:
    buf = EventBuffer(10)
    buf.extend([stored(1), BlockRemoved(2, [b"\x01"])])
    buf.extend([stored(7), AllBlocksCleared(8)])  # the manager dropped 3..6
    assert buf.dropped == 4
    assert buf.page(after=2, limit=10).fell_behind
    assert not buf.page(after=6, limit=10).fell_behind
    page = buf.page(after=2, limit=1)
    assert [e.seq for e in page.events] == [7]
    assert page.next_after == 7
    assert page.latest_seq == 8


def test_repeated_events_are_ignored() -> None:
    buf = EventBuffer(10)
    buf.extend([stored(1), stored(2)])
    buf.extend([stored(2)])
    assert [e.seq for e in buf.page(0, 10).events] == [1, 2]


def test_capacity_must_be_positive() -> None:
    with pytest.raises(ValueError, match="positive"):
        EventBuffer(0)
