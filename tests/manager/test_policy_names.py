"""Policy names as people write them: any case, ``-`` for ``_``, the literature's names as
aliases, and an unknown name answered with the closest one."""

from __future__ import annotations

import pytest

from app.settings import Settings
from manager import UnknownPolicyError, available_policies, create_manager
from manager.policies import canonical_policy_name


@pytest.mark.parametrize(
    ("written", "meant"),
    [
        ("lru", "lru"),
        ("LRU", "lru"),
        ("Arc", "arc"),
        ("LFU-DA", "lfu"),
        ("lfuda", "lfu"),
        ("S3-FIFO", "s3fifo"),
        ("s3fifo", "s3fifo"),
        ("prefix-LRFU", "prefix_lrfu"),
        (" SLRU ", "slru"),
    ],
)
def test_a_written_name_means_a_registered_one(written: str, meant: str) -> None:
    assert canonical_policy_name(written) == meant
    assert Settings(policy=written).policy == meant


@pytest.mark.parametrize(("written", "closest"), [("lruu", "lru"), ("s3fif", "s3fifo")])
def test_an_unknown_name_is_answered_with_the_closest(written: str, closest: str) -> None:
    with pytest.raises(UnknownPolicyError, match=f"did you mean '{closest}'"):
        canonical_policy_name(written)


def test_a_name_nothing_is_close_to_lists_the_policies_only() -> None:
    with pytest.raises(UnknownPolicyError) as refused:
        canonical_policy_name("belady")
    assert "did you mean" not in str(refused.value)
    assert ", ".join(available_policies()) in str(refused.value)


def test_a_live_switch_takes_any_spelling_and_the_same_policy_is_a_no_op() -> None:
    m = create_manager(8)
    assert not m.switch_policy("LRU").changed
    switch = m.switch_policy("S3-FIFO")
    assert switch.changed
    assert m.policy.name == "s3fifo"
    shadows = Settings(shadow_policies=["LRU", "prefix-LRFU"]).shadow_policies
    assert shadows == ["lru", "prefix_lrfu"]
