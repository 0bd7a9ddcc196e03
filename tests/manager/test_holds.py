"""Holds (pins taken outside requests, for the remote tier's write-behind and promotions),
``is_ready`` and events about another medium."""

from __future__ import annotations

import pytest

from manager import (
    REMOTE_MEDIUM,
    BlockRemoved,
    BlockStored,
    InvalidArgumentError,
    OffloadManager,
    ReqContext,
    create_manager,
)


def stored(m: OffloadManager, req: str, keys: list[bytes]) -> None:
    ctx = ReqContext(req)
    m.on_new_request(ctx)
    out = m.prepare_store(keys, ctx)
    assert out is not None
    m.complete_store(out.keys_to_store, ctx)


def test_a_held_block_is_neither_evicted_nor_cleared_and_counts_as_pinned() -> None:
    m = create_manager(2)
    stored(m, "w", [b"a", b"b"])
    assert m.hold([b"a", b"zz"]) == [m.slot_of(b"a"), None]
    assert m.stats().pinned == 1
    loads = m.stats().loads
    ctx = ReqContext("x")
    m.on_new_request(ctx)
    out = m.prepare_store([b"c"], ctx)  # room comes from b, never from the held a
    assert out is not None
    assert out.evicted_keys == [b"b"]
    m.complete_store([b"c"], ctx)
    assert m.prepare_store([b"d", b"e"], ctx) is None  # a is held: only c is evictable
    assert m.reset().kept_pinned == 1
    assert m.is_ready(b"a")
    m.release_hold([b"a", b"a", b"never"])  # extra releases are ignored
    assert m.stats().pinned == 0
    assert m.stats().loads == loads  # a hold is no load
    assert m.prepare_store([b"d"], ctx) is not None


def test_holds_and_request_pins_add_up() -> None:
    m = create_manager(4)
    stored(m, "w", [b"a"])
    ctx = ReqContext("r")
    m.on_new_request(ctx)
    m.prepare_load([b"a"], ctx)
    m.hold([b"a"])
    assert m.ref_count(b"a") == 2
    m.on_request_finished(ctx, abort=True)  # the request's pin goes, the hold stays
    assert m.ref_count(b"a") == 1
    m.release_hold([b"a"])
    assert m.ref_count(b"a") == 0


def test_a_pending_block_is_not_ready_and_cannot_be_held() -> None:
    m = create_manager(4)
    ctx = ReqContext("w")
    m.on_new_request(ctx)
    m.prepare_store([b"a"], ctx)
    assert not m.is_ready(b"a")
    assert m.hold([b"a"]) == [None]
    with pytest.raises(InvalidArgumentError):
        m.hold(["not bytes"])  # type: ignore[list-item]


def test_events_about_another_medium_join_the_numbered_stream() -> None:
    m = create_manager(4)
    stored(m, "w", [b"a"])
    m.record_event("stored", [b"a"], REMOTE_MEDIUM)
    m.record_event("removed", [b"a"], REMOTE_MEDIUM)
    events = m.take_events()
    assert [type(e) for e in events] == [BlockStored, BlockStored, BlockRemoved]
    assert [e.seq for e in events] == [1, 2, 3]
    assert [e.medium for e in events] == ["CPU", "REMOTE", "REMOTE"]
    with pytest.raises(InvalidArgumentError):
        m.record_event("moved", [b"a"], REMOTE_MEDIUM)


def test_the_event_sink_hears_of_each_event_as_it_joins_and_may_take_it() -> None:
    m = create_manager(2)
    taken: list[list[type]] = []
    m.set_event_sink(lambda: taken.append([type(e) for e in m.take_events()]))
    stored(m, "w", [b"a", b"b"])
    stored(m, "v", [b"c"])  # evicts one: removed, then stored, each heard on its own
    assert taken == [[BlockStored], [BlockRemoved], [BlockStored]]
    assert m.take_events() == []
    m.set_event_sink(None)
    m.record_event("stored", [b"c"], REMOTE_MEDIUM)
    assert len(taken) == 3
    assert [type(e) for e in m.take_events()] == [BlockStored]


def test_new_pins_counts_distinct_blocks_nobody_pins_yet() -> None:
    m = create_manager(4)
    stored(m, "w", [b"a", b"b", b"c"])
    assert m.new_pins([b"a", b"a", b"b"]) == 2  # nothing pinned: distinct keys
    ctx = ReqContext("r")
    m.on_new_request(ctx)
    m.prepare_load([b"a"], ctx)
    m.hold([b"b"])
    assert m.new_pins([b"a", b"b", b"c", b"c"]) == 1  # a pinned by r, b held: only c is new
    assert m.num_pinned + m.new_pins([b"a", b"b", b"c"]) == 3
    with pytest.raises(InvalidArgumentError):
        m.new_pins([[b"a"]])  # type: ignore[list-item]
