"""The lower-tier contract (``tests.tiers.test_tier_contract``) against a real Mooncake Store.

The same tests as for the disk, the in-process remote store and the memory tier, run on the
service core with its remote tier on a real ``mooncake_master`` on a test host (the registered
``remote`` backend, ``app.core.remote.build_tier``, nothing overridden). The service is in this
process, so its Mooncake client registers this host's side of the test net (the bridge's
address, or loopback). A fault is the master stopped (and started again). A single node's puts
live in its own segment, which goes with its client: the restart test does not apply (the
cluster tests, ``test_service_tier.py``, restart a node beside another that keeps the blocks).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

import tests.tiers.test_tier_contract as contract
from app.core.tier import LowerTier
from tests.remote.hosts import MooncakeMaster, TestNet
from tests.tiers.test_tier_contract import (
    Backend,
    test_a_block_the_pool_lets_go_is_found_in_the_tier,
    test_a_broken_tier_drops_what_it_is_given_and_recovers,
    test_a_burst_of_stores_three_times_the_pool_reaches_the_tier,
    test_one_onload_brings_the_blocks_up_from_the_tier,
)

pytestmark = pytest.mark.anyio

__all__ = [
    "test_a_block_the_pool_lets_go_is_found_in_the_tier",
    "test_a_broken_tier_drops_what_it_is_given_and_recovers",
    "test_a_burst_of_stores_three_times_the_pool_reaches_the_tier",
    "test_one_onload_brings_the_blocks_up_from_the_tier",
]


@pytest.fixture
def backend(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Backend]:
    """The ``remote`` tier on a real master (replaces the suite's parametrized fixture)."""
    # A master that comes back takes a few seconds to let the client in again.
    monkeypatch.setattr(contract, "UNTIL_S", 60.0)
    net = TestNet.create(["master"])
    master = MooncakeMaster(net.hosts["master"], tmp_path).start()
    here = "127.0.0.1" if net.mode == "loopback" else master.host.addr.rsplit(".", 1)[0] + ".1"

    def mends(tier: LowerTier) -> None:
        master.start()

    try:
        yield Backend(
            "remote",
            {
                "remote_tier": "mooncake",
                "mooncake_master": master.address,
                "mooncake_metadata": master.metadata_url,
                "mooncake_local_hostname": here,
                "mooncake_segment_bytes": 32 << 20,
                "remote_timeout_s": 2.0,
                "remote_lookup_timeout_s": 1.0,
                "remote_removal_confirm_s": 0.0,
            },
            {},
            lambda tier: master.stop(),
            mends,
        )
    finally:
        master.stop()
        net.close()
