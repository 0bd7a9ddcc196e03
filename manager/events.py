"""The offload manager's KV events and listeners.

Events are numbered in one stream (``take_events`` drains it, ``record_event`` adds other media's
events to it, the event sink hears of each one as it joins); chain listeners hear each request's
chain when its record is dropped, eviction listeners hear the blocks evicted to make room. See
``manager.core`` for the contract.
"""

from __future__ import annotations

from collections.abc import Callable

from manager.errors import InvalidArgumentError
from manager.slots import ChainListener, EvictionListener, PoolState
from manager.spec import BlockKey, BlockRemoved, BlockStored, KVEvent


class EventsRoom(PoolState):
    """KV events (``take_events``, ``record_event``) and the chain and eviction listeners."""

    def _next_seq(self) -> int:
        self._event_seq += 1
        return self._event_seq

    def _emit(self, event: KVEvent) -> None:
        if not self._enable_events:
            return
        if len(self._events) == self._events.maxlen:
            self._events_dropped += 1
        self._events.append(event)
        sink = self._event_sink
        if sink is not None:
            sink()

    def _emit_removed(self, keys: list[BlockKey]) -> None:
        if keys:
            self._emit(BlockRemoved(self._next_seq(), keys))

    def take_events(self) -> list[KVEvent]:
        """Every event since the last call, oldest first; each event is returned once.

        Events carry increasing ``seq`` numbers; a gap means the bounded buffer overflowed
        (also counted in ``stats().events_dropped``).
        """
        events = list(self._events)
        self._events.clear()
        return events

    def record_event(self, kind: str, keys: list[BlockKey], medium: str) -> None:
        """Add a KV event about another medium (``kind``: ``stored`` or ``removed``) to the
        manager's numbered stream, so routers read every tier's events in one order."""
        if kind == "stored":
            self._emit(BlockStored(self._next_seq(), keys, medium))
        elif kind == "removed":
            self._emit(BlockRemoved(self._next_seq(), keys, medium))
        else:
            raise InvalidArgumentError(f"event kind must be stored or removed, got {kind!r}")

    def set_event_sink(self, sink: Callable[[], None] | None) -> None:
        """Call ``sink()`` after each event joins the stream, whichever call made it, so that
        its reader (``take_events``) hears of it at once and nobody has to remember to look.
        ``sink`` may call ``take_events`` and nothing else of the manager, and must not raise:
        it runs inside the call that emitted, which a raise would leave half done. None: no
        sink."""
        self._event_sink = sink

    def add_chain_listener(self, listener: ChainListener) -> None:
        """Call ``listener(chain)`` with every request's chain (head to tail) when its record
        is dropped (finish with no lease left, lease expiry, release). It must not call back
        into the manager; the shadow evaluator only queues the chain.
        """
        self._chain_listeners.append(listener)

    def add_eviction_listener(self, listener: EvictionListener) -> None:
        """Call ``listener(victims, slots)`` whenever ``prepare_store`` evicts blocks to make
        room, or ``demote`` evicts them, before their slots can be handed out again (a lower tier
        copies their bytes out there: demote on evict). Only those evictions are reported, not
        ``reset``, ``drop`` or failed stores. It must not call back into the manager.
        """
        self._eviction_listeners.append(listener)
