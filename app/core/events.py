"""The bounded buffer of KV events served by ``GET /v1/events``.

The manager numbers its events (``seq`` 1, 2, 3, ...) and drains them once (``take_events``);
the service moves them here, where routers read them by cursor: ``page(after)`` returns the
events with ``seq > after``. The buffer keeps the newest ``capacity`` events. A reader whose
cursor points before the oldest event still known *fell behind*: events it has not seen were
dropped (here, or already in the manager's own bounded buffer, visible as a gap in ``seq``).
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from manager import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent


@dataclass(frozen=True, slots=True)
class EventPage:
    """Up to ``limit`` events after the cursor, and what the reader should know about them."""

    events: list[KVEvent]
    next_after: int
    latest_seq: int
    fell_behind: bool


class EventBuffer:
    """Newest ``capacity`` KV events, readable by sequence number."""

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"event buffer capacity must be positive, got {capacity}")
        self.capacity = capacity
        self._events: deque[KVEvent] = deque()
        self._latest = 0
        # Every event with seq <= _lost_upto that is not in the buffer was dropped.
        self._lost_upto = 0
        self.dropped = 0

    def __len__(self) -> int:
        return len(self._events)

    @property
    def latest_seq(self) -> int:
        """Sequence number of the newest event seen (0: none yet)."""
        return self._latest

    def extend(self, events: Iterable[KVEvent]) -> None:
        """Append events in ``seq`` order; a gap means the manager dropped some."""
        buf = self._events
        for event in events:
            if event.seq <= self._latest:
                continue  # already have it; the manager never repeats a seq, but be safe
            if event.seq != self._latest + 1:
                self.dropped += event.seq - self._latest - 1
                self._lost_upto = event.seq - 1
            self._latest = event.seq
            buf.append(event)
            if len(buf) > self.capacity:
                gone = buf.popleft()
                self.dropped += 1
                self._lost_upto = max(self._lost_upto, gone.seq)

    def page(self, after: int, limit: int) -> EventPage:
        """Events with ``seq > after``, at most ``limit``, oldest first."""
        buf = self._events
        fell_behind = after < self._lost_upto or after > self._latest
        start = bisect.bisect_right(buf, after, key=_seq) if after <= self._latest else len(buf)
        stop = min(len(buf), start + limit)
        events = [buf[i] for i in range(start, stop)]
        next_after = events[-1].seq if events else min(after, self._latest)
        return EventPage(events, next_after, self._latest, fell_behind)


def _seq(event: KVEvent) -> int:
    return event.seq


def event_type(event: KVEvent) -> str:
    """vLLM's event type name."""
    if isinstance(event, BlockStored):
        return "BlockStored"
    if isinstance(event, BlockRemoved):
        return "BlockRemoved"
    assert isinstance(event, AllBlocksCleared)
    return "AllBlocksCleared"


def event_json(event: KVEvent) -> dict[str, object]:
    """The wire form of one event."""
    hashes = [] if isinstance(event, AllBlocksCleared) else [k.hex() for k in event.block_hashes]
    return {
        "seq": event.seq,
        "type": event_type(event),
        "block_hashes": hashes,
        "medium": event.medium,
    }
