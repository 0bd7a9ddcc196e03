"""Shadow evaluation in the service: projections in the admin API and /metrics after traffic,
the control following policy switches, the background drain."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from manager import available_policies
from testsupport.api_harness import Harness, hexkeys, make_settings, running

pytestmark = pytest.mark.anyio
SHADOW = "/admin/v1/policy/shadow"


async def lives(h: Harness, n: int, prefix: str = "life") -> None:
    """``n`` finished requests; each looks up and stores 4 keys, the first 2 shared."""
    for i in range(n):
        req = f"{prefix}-{i}"
        keys = hexkeys(1, 2, 100 + i, 200 + i)
        await h.start(req)
        await h.post(f"/v1/requests/{req}/lookup", {"keys": keys})
        await h.post(f"/v1/requests/{req}/prepare-store", {"keys": keys})
        await h.post(f"/v1/requests/{req}/complete-store", {"keys": keys})
        r = await h.client.delete(f"/v1/requests/{req}")
        assert r.status_code == 200


async def shadow(h: Harness) -> dict[str, Any]:
    r = await h.admin.get(SHADOW)
    assert r.status_code == 200
    answer: dict[str, Any] = r.json()
    return answer


async def test_projections_in_the_admin_api_and_metrics_after_traffic() -> None:
    # A window of 6 sampled requests: 6 are enough data (tests/api/test_shadow_enough_data.py).
    async with running(make_settings(shadow_sample_rate=1.0, shadow_window=6)) as h:
        await lives(h, 6)
        assert h.service.shadow is not None
        before = await shadow(h)
        assert before["queued"] == 6  # queued on the request path, replayed off it
        assert h.service.shadow.drain() == 6
        answer = await shadow(h)
        assert answer["enabled"] is True
        assert answer["sample_rate"] == 1.0
        assert (answer["observed"], answer["sampled"], answer["queued"]) == (6, 6, 0)
        assert answer["dropped"] == 0
        assert answer["active"]["name"] == "lru"
        assert answer["since_generation"] == 1
        # Lookups of lives 1..5 hit the 2 shared keys of 4: the live ratio.
        assert answer["live_prefix_hit_ratio"] == pytest.approx(10 / 24)
        policies = {p["policy"]: p for p in answer["policies"]}
        assert sorted(policies) == sorted(available_policies())
        assert [p["policy"] for p in answer["policies"] if p["active"]] == ["lru"]
        for p in policies.values():
            assert p["sampled_requests"] == 6
            assert p["sampled_blocks"] == 24
            assert 0 < p["projected_hit_ratio"] <= 1
            assert p["cumulative_hit_ratio"] == pytest.approx(p["projected_hit_ratio"])
        # The control replays what really happened here (the pool never filled).
        assert policies["lru"]["projected_hit_ratio"] == pytest.approx(10 / 24)

        registry = h.service.registry
        assert registry is not None
        for name, p in policies.items():
            value = registry.get_sample_value(
                "kvoffload_policy_projected_hit_ratio", {"policy": name}
            )
            assert value == pytest.approx(p["projected_hit_ratio"])


async def test_no_projection_before_a_sample(h: Harness) -> None:
    answer = await shadow(h)
    assert answer["sampled"] == 0
    assert all(p["projected_hit_ratio"] is None for p in answer["policies"])
    text = (await h.client.get("/metrics")).text
    assert "kvoffload_policy_projected_hit_ratio{" not in text  # the family, no sample


async def test_the_control_follows_a_switch_to_a_simulated_policy() -> None:
    async with running(make_settings(shadow_sample_rate=1.0)) as h:
        await lives(h, 3)
        assert h.service.shadow is not None
        h.service.shadow.drain()
        await h.admin.put("/admin/v1/policy", json={"name": "arc"})
        answer = await shadow(h)
        # Every registered policy is simulated already: nothing restarts.
        assert (answer["since_generation"], answer["restarts"], answer["sampled"]) == (1, 0, 3)
        assert [p["policy"] for p in answer["policies"] if p["active"]] == ["arc"]
        assert answer["active"]["generation"] == 2


async def test_a_switch_outside_the_simulated_set_restarts_with_it() -> None:
    settings = make_settings(shadow_sample_rate=1.0, shadow_policies="slru")
    async with running(settings) as h:
        answer = await shadow(h)
        assert [p["policy"] for p in answer["policies"]] == ["slru", "lru"]  # + the control
        await lives(h, 2)
        assert h.service.shadow is not None
        h.service.shadow.drain()
        await h.admin.put("/admin/v1/policy", json={"name": "arc"})
        answer = await shadow(h)
        assert [p["policy"] for p in answer["policies"]] == ["slru", "arc"]
        assert [p["policy"] for p in answer["policies"] if p["active"]] == ["arc"]
        assert (answer["since_generation"], answer["restarts"], answer["sampled"]) == (2, 1, 0)
        await lives(h, 2, "after")
        h.service.shadow.drain()
        assert (await shadow(h))["sampled"] == 2


async def test_the_background_task_drains_the_queue() -> None:
    settings = make_settings(shadow_sample_rate=1.0, shadow_drain_interval_s=0.01)
    async with running(settings) as h:
        await lives(h, 3)
        for _ in range(500):  # bounded wait for the task, not a timing assertion
            if (await shadow(h))["sampled"] == 3:
                break
            await asyncio.sleep(0.01)
        assert (await shadow(h))["sampled"] == 3


async def test_shadow_off() -> None:
    async with running(make_settings(shadow_enabled=False)) as h:
        await lives(h, 2)
        assert h.service.shadow is None
        answer = await shadow(h)
        assert answer["enabled"] is False
        assert answer["policies"] == []
        assert answer["live_prefix_hit_ratio"] is not None
        text = (await h.client.get("/metrics")).text
        assert "kvoffload_policy_projected_hit_ratio{" not in text
