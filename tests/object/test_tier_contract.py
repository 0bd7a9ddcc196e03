"""The lower-tier contract (``tests.tiers.test_tier_contract``) against a real Ceph RADOS Gateway.

The same tests as for the disk, the remote store and the memory tier, run on the service core
with its ``object`` tier (the registered backend, nothing overridden) on a bucket of its own on
the session's gateway (``testsupport/rgw.py``). Credentials come the way an operator gives
them: AWS's environment variables. A fault is the gateway killed (SIGKILL) and started again. The
bucket outlives the service, so the restart test applies.
"""

from __future__ import annotations

import pytest

import tests.tiers.test_tier_contract as contract
from app.core.tier import LowerTier
from tests.tiers.test_tier_contract import (
    Backend,
    test_a_block_the_pool_lets_go_is_found_in_the_tier,
    test_a_broken_tier_drops_what_it_is_given_and_recovers,
    test_a_burst_of_stores_three_times_the_pool_reaches_the_tier,
    test_a_restarted_service_finds_the_tier_s_blocks,
    test_one_onload_brings_the_blocks_up_from_the_tier,
)
from testsupport.rgw import RadosGateway

pytestmark = pytest.mark.anyio

__all__ = [
    "test_a_block_the_pool_lets_go_is_found_in_the_tier",
    "test_a_broken_tier_drops_what_it_is_given_and_recovers",
    "test_a_burst_of_stores_three_times_the_pool_reaches_the_tier",
    "test_a_restarted_service_finds_the_tier_s_blocks",
    "test_one_onload_brings_the_blocks_up_from_the_tier",
]


def object_settings(rgw: RadosGateway, bucket: str) -> dict[str, object]:
    """The object tier's settings for ``bucket`` on the session's gateway."""
    return {
        "object_bucket": bucket,
        "object_endpoint": rgw.endpoint,
        "object_region": rgw.region,
        "object_timeout_s": 2.0,
        "object_lookup_timeout_s": 2.0,
    }


@pytest.fixture
def aws_keys(rgw: RadosGateway, monkeypatch: pytest.MonkeyPatch) -> None:
    """The gateway user's keys where AWS's credential chain looks first (the environment)."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", rgw.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", rgw.secret_key)
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")


@pytest.fixture
def backend(
    rgw: RadosGateway, bucket: str, aws_keys: None, monkeypatch: pytest.MonkeyPatch
) -> Backend:
    """The ``object`` tier on the gateway (replaces the suite's parametrized fixture)."""
    # A gateway started again answers within a second; the probe runs every second.
    monkeypatch.setattr(contract, "UNTIL_S", 30.0)

    def breaks(tier: LowerTier) -> None:
        rgw.kill_gateway()  # SIGKILL: no goodbye to its clients

    def mends(tier: LowerTier) -> None:
        rgw.start_gateway()

    return Backend("object", object_settings(rgw, bucket), {}, breaks, mends)
