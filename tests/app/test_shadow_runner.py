"""ShadowRunner: budgeted drains, the control following the active policy, overload."""

from __future__ import annotations

import pytest

from app.core.shadow import MIN_SAMPLE_RATE, ShadowRunner
from manager import PolicyInfo

pytestmark = pytest.mark.anyio


def runner(**overrides: object) -> ShadowRunner:
    kwargs: dict[str, object] = {
        "capacity": 64,
        "policies": ["lru", "arc"],
        "sample_rate": 1.0,
        "store_threshold": 0,
        "window": 100,
        "max_queue": 100,
        "cpu_budget": 1.0,
        "interval_s": 1.0,
    }
    kwargs.update(overrides)
    return ShadowRunner(PolicyInfo("lru", {}, 1), **kwargs)  # type: ignore[arg-type]


def chain(i: int) -> list[bytes]:
    return [bytes([1, 2]), bytes([3, i])]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_tick_replays_the_queue_within_its_budget() -> None:
    r = runner(window=5)  # 5 sampled requests fill the window: enough data to project
    for i in range(5):
        r.observe(chain(i))
    assert r.evaluator.report().queued == 5
    assert await r.tick() == 5
    assert r.state().report.sampled == 5
    assert r.projections().keys() == {"lru", "arc"}
    starved = runner(cpu_budget=1e-9)  # a budget too small for one chain
    starved.observe(chain(0))
    assert await starved.tick() <= 1


def test_the_control_is_always_simulated() -> None:
    r = runner(policies=["arc"])
    assert r.evaluator.policies == ["arc", "lru"]
    r.follow(PolicyInfo("arc", {}, 2))  # simulated already
    assert (r.restarts, r.state().since_generation) == (0, 1)
    r.follow(PolicyInfo("slru", {}, 3))
    assert r.evaluator.policies == ["arc", "slru"]
    assert (r.restarts, r.state().since_generation) == (1, 3)


async def test_drops_halve_the_sample_rate() -> None:
    r = runner(max_queue=2, cpu_budget=1e-9)
    for i in range(6):
        r.observe(chain(i))
    assert r.evaluator.dropped == 4
    await r.tick()
    assert r.sample_rate == 0.5
    assert r.restarts == 1
    assert r.evaluator.report().sample_rate == 0.5
    await r.tick()  # nothing dropped since: the rate stays
    assert r.sample_rate == 0.5
    floor = runner(max_queue=1, cpu_budget=1e-9, sample_rate=MIN_SAMPLE_RATE)
    floor._adapt(-1)
    assert floor.sample_rate == MIN_SAMPLE_RATE
