"""The Python face shown in DESIGN.md works as written."""

from __future__ import annotations

import types

import manager
from manager import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    LookupResult,
    ReqContext,
    create_manager,
)


def test_design_example_round_trip() -> None:
    m = create_manager(num_blocks=4096, policy="lru", store_threshold=0)
    ctx = ReqContext(req_id="r1")
    assert m.on_new_request(ctx) is True
    keys = [i.to_bytes(8, "big") for i in range(1, 9)]
    out = m.prepare_store(keys, ctx)
    assert out is not None
    assert out.keys_to_store == keys
    assert sorted(out.slots) == list(range(8))
    assert out.evicted_keys == []
    m.complete_store(out.keys_to_store, ctx, success=True)
    res = m.lookup([*keys, b"\xff"], ctx)
    assert res.results == [LookupResult.HIT] * 8 + [LookupResult.MISS]
    assert res.hit_prefix == 8
    slots = m.prepare_load(keys, ctx)
    assert slots == out.slots
    m.complete_load(keys, ctx)
    m.on_request_finished(ctx, abort=False)
    switch = m.switch_policy("arc")
    assert switch.changed
    assert switch.blocks_migrated == 8
    events = m.take_events()
    assert [type(e) for e in events] == [BlockStored]
    assert m.take_events() == []
    counts = m.reset()
    assert counts.dropped == 8
    assert [type(e) for e in m.take_events()] == [AllBlocksCleared]
    assert BlockRemoved is manager.BlockRemoved


def test_exported_names_are_exactly_all() -> None:
    # Submodules and the __future__ feature are attributes of the package too; the public
    # face is every other name, and it must be exactly __all__.
    public = {
        name
        for name in dir(manager)
        if not name.startswith("_")
        and name != "annotations"
        and not isinstance(getattr(manager, name), types.ModuleType)
    }
    assert public == set(manager.__all__)
