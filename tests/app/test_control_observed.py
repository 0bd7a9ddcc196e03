"""Cache control's verbs are counted for their request id in the core, without HTTP: each call
is one ``Observer.op`` (``ok``), or its error when it raises, as the manager's verbs are."""

from __future__ import annotations

import asyncio

import pytest

from app.core.control import Control
from app.core.control_shared import ControlShared
from app.core.errors import NoLowerTierError
from app.core.lower_tiers import TierChain
from app.settings import Settings
from app.telemetry.observer import Observer
from manager import InvalidArgumentError, ReqContext, create_manager


class Recording(Observer):
    def __init__(self) -> None:
        super().__init__(None)
        self.seen: list[tuple[str, str, str]] = []

    def op(self, op: str, req_id: str, result: str = "ok") -> None:
        self.seen.append((op, req_id, result))


def test_each_verb_is_counted_once_for_its_request_and_its_errors_as_errors() -> None:
    manager = create_manager(num_blocks=8)
    settings = Settings(num_blocks=8)
    tiers = TierChain(settings, "default")
    observer = Recording()
    control = Control(
        ControlShared(settings, manager, tiers, namespace="default", observer=observer)
    )
    keys = [bytes([i]) * 8 for i in range(3)]
    ctx = ReqContext("w")
    manager.on_new_request(ctx)
    manager.prepare_store(keys, ctx)
    manager.complete_store(keys, ctx)

    async def calls() -> None:
        await control.retain(keys[:1], 30, "s", "r1")
        with pytest.raises(InvalidArgumentError):
            await control.prefetch(keys, 0, "r2")

    asyncio.run(calls())
    assert control.drop(keys[1:2], "r3").done == keys[1:2]
    with pytest.raises(NoLowerTierError):
        control.demote(keys[2:], "r4")
    assert observer.seen == [
        ("retain", "r1", "ok"),
        ("prefetch", "r2", "error"),
        ("drop", "r3", "ok"),
        ("demote", "r4", "error"),
    ]
