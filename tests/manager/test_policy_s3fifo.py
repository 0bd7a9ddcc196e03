"""S3-FIFO specifics: quick demotion of one-hit wonders, ghost re-admission, CLOCK in main."""

from __future__ import annotations

import pytest

from manager import InvalidPolicyParamsError
from manager.policies.s3fifo import S3FIFOPolicy
from tests.manager.harness import key, keys


def always(_: bytes) -> bool:
    return True


def test_a_block_never_used_leaves_the_small_queue_before_a_used_one() -> None:
    p = S3FIFOPolicy(10)  # small queue target: 1 block
    p.insert([key(0)])
    p.insert([key(1)])
    p.touch([key(0)])  # 0 is used while on probation: it moves to main instead of leaving
    assert p.evict(1, always) == [key(1)]
    assert key(0) in p


def test_an_evicted_one_hit_wonder_comes_back_into_main_from_the_ghost() -> None:
    p = S3FIFOPolicy(10)
    p.insert([key(0)])
    assert p.evict(1, always) == [key(0)]
    p.insert([key(1), key(0)])  # 0 is stored again while its ghost is remembered
    p.insert(keys(2, 4))
    # 0 went straight to main, so the small queue (1, 2, 3, never used) drains first.
    assert p.evict(3, always) == [key(1), key(3), key(2)]
    assert key(0) in p


def test_main_is_a_clock_a_used_block_gets_a_second_pass() -> None:
    p = S3FIFOPolicy(10, {"small_ratio": 0.5})
    p.insert([key(0)])
    p.touch([key(0)])
    p.insert([key(1)])
    p.touch([key(1)])
    assert p.evict(0, always) == []
    order = list(p.coldest_first())
    victims = []
    while len(p):
        got = p.evict(1, always)
        assert got is not None
        victims += got
    assert victims == order


def test_a_use_reorders_nothing() -> None:
    p = S3FIFOPolicy(10)
    assert not p.reorders_on_touch
    p.insert([key(0)])
    p.insert([key(1)])
    p.touch([key(1), key(0)])
    assert list(p.coldest_first())[:2] == [key(0), key(1)]


@pytest.mark.parametrize("ratio", [0, 1, -0.1, 1.5, True, "0.1"])
def test_small_ratio_must_be_a_fraction(ratio: object) -> None:
    with pytest.raises(InvalidPolicyParamsError, match="small_ratio"):
        S3FIFOPolicy(10, {"small_ratio": ratio})
