"""Retained keys found below the pool with no room to come up: cache control tries them again
every sweep round (``Control.expire``), each in its turn, without a scrape of ``/metrics``, and
its list of them stays within the bound of retained blocks.

A fake chain of one tier (``disk``) holds every key; its promotions start nothing (no room),
and record what they were asked to bring up.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, cast

from app.core.control import RETRY_KEYS, Control
from app.core.control_shared import ControlShared
from app.core.lower_tiers import TierChain
from app.settings import Settings
from app.telemetry.observer import Observer
from manager import BlockKey, OffloadManager, create_manager


class NoRoomTier:
    """A chain whose one tier holds every key and never has room to bring one up."""

    def __init__(self) -> None:
        self.asked: list[BlockKey] = []

    def __bool__(self) -> bool:
        return True

    async def found(self, keys: Sequence[BlockKey], req_id: str | None) -> list[str]:
        return ["disk"] * len(keys)

    def promote(self, keys: Sequence[BlockKey], *args: Any) -> list[asyncio.Task[None]]:
        self.asked.extend(keys)
        return []


def control_of(max_retained: int) -> tuple[Control, OffloadManager, NoRoomTier]:
    manager = create_manager(num_blocks=8)
    settings = Settings(num_blocks=8, max_retained_blocks=max_retained)
    tier = NoRoomTier()
    control = Control(
        ControlShared(
            settings,
            manager,
            cast(TierChain, tier),
            namespace="default",
            observer=Observer(None),
        )
    )
    return control, manager, tier


def keys_of(start: int, n: int) -> list[BlockKey]:
    return [i.to_bytes(8, "big") for i in range(start, start + n)]


def test_a_retained_key_behind_released_ones_is_tried_without_a_scrape() -> None:
    control, _, tier = control_of(4096)

    async def run() -> None:
        for n in range(0, 2 * RETRY_KEYS, 64):  # released retentions of keys below
            await control.retain(keys_of(n, 64), 30, f"gone{n}", "r")
            await control.release(f"gone{n}")
        await control.retain(keys_of(10_000, 1), 30, "live", "r")
        tier.asked.clear()
        await control.expire()  # one sweep round

    asyncio.run(run())
    assert tier.asked == keys_of(10_000, 1)


def test_every_retained_key_below_gets_its_turn() -> None:
    control, _, tier = control_of(4096)
    wanted = keys_of(0, 3 * RETRY_KEYS)

    async def run() -> None:
        await control.retain(wanted, 30, "a", "r")
        tier.asked.clear()
        for _ in range(3):
            await control.expire()

    asyncio.run(run())
    assert sorted(tier.asked) == wanted  # each once, in three rounds of RETRY_KEYS


def test_the_list_of_keys_below_stays_bounded_without_a_scrape() -> None:
    control, manager, _ = control_of(16)

    async def run() -> None:
        for n in range(0, 1600, 16):
            await control.retain(keys_of(n, 16), 30, "s", "r")
            await control.release("s")

    asyncio.run(run())
    assert manager.num_retained == 0
    assert len(control.retaining._below) <= 2 * 16
