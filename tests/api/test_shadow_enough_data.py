"""Shadow evaluation with little traffic: no projected number (null, with the reason and what is
needed) and no gauge sample until a policy's window holds enough sampled requests; then every
policy, the active one included, has both."""

from __future__ import annotations

import pytest

from app.http.routes.admin import SAMPLED
from manager import available_policies
from manager.shadow import MIN_SAMPLED_REQUESTS
from tests.api.test_obs_shadow import lives, shadow
from testsupport.api_harness import Harness, make_settings, running

pytestmark = pytest.mark.anyio


def _gauge(h: Harness, policy: str) -> float | None:
    registry = h.service.registry
    assert registry is not None
    return registry.get_sample_value("kvoffload_policy_projected_hit_ratio", {"policy": policy})


async def test_little_traffic_projects_no_number_and_says_how_much_is_needed() -> None:
    async with running(make_settings(shadow_sample_rate=1.0)) as h:
        await lives(h, 6)
        assert h.service.shadow is not None
        assert h.service.shadow.drain() == 6
        answer = await shadow(h)
        assert answer["min_sampled_requests"] == MIN_SAMPLED_REQUESTS
        assert answer["live_prefix_hit_ratio"] == pytest.approx(10 / 24)
        assert sorted(p["policy"] for p in answer["policies"]) == sorted(available_policies())
        for p in answer["policies"]:
            assert (p["projected_hit_ratio"], p["cumulative_hit_ratio"]) == (None, None)
            assert (p["sampled_requests"], p["window_requests"]) == (6, 6)
            assert p["reason"] == (
                f"not enough data: 6 of {MIN_SAMPLED_REQUESTS} sampled requests ({SAMPLED})"
            )
            assert _gauge(h, p["policy"]) is None
        text = (await h.client.get("/metrics")).text
        assert "kvoffload_policy_projected_hit_ratio{" not in text


async def test_with_enough_data_every_policy_is_projected_and_exported_the_active_one_too() -> None:
    settings = make_settings(shadow_sample_rate=1.0, shadow_window=4)  # 4 sampled are enough
    async with running(settings) as h:
        await lives(h, 3)
        assert h.service.shadow is not None
        h.service.shadow.drain()
        answer = await shadow(h)
        assert answer["min_sampled_requests"] == 4
        assert {p["reason"] for p in answer["policies"]} == {
            f"not enough data: 3 of 4 sampled requests ({SAMPLED})"
        }
        await lives(h, 1, "fourth")
        h.service.shadow.drain()
        answer = await shadow(h)
        policies = {p["policy"]: p for p in answer["policies"]}
        assert [name for name, p in policies.items() if p["active"]] == ["lru"]
        for name, p in policies.items():
            assert p["reason"] is None
            assert p["window_requests"] == 4
            assert 0 < p["projected_hit_ratio"] <= 1
            assert _gauge(h, name) == pytest.approx(p["projected_hit_ratio"])
        assert _gauge(h, "lru") is not None  # the active policy, the control, is exported


async def test_lookups_alone_are_not_sampled_and_the_reason_says_so() -> None:
    """The trap: thousands of lookup-only requests, and still "not enough data"; the reason
    says which requests count."""
    async with running(make_settings(shadow_sample_rate=1.0)) as h:
        for i in range(50):
            req = f"look-{i}"
            await h.start(req)
            r = await h.post(f"/v1/requests/{req}/lookup", {"keys": ["0a0b"]})
            assert r.status_code == 200, r.text
            assert (await h.client.delete(f"/v1/requests/{req}")).status_code == 200
        assert h.service.shadow is not None
        h.service.shadow.drain()
        answer = await shadow(h)
        for p in answer["policies"]:
            assert p["sampled_requests"] == 0
            assert "not lookups alone" in p["reason"]
