"""Shadow evaluation: ghost simulations of every policy over the live request stream."""

from __future__ import annotations

from pathlib import Path

import pytest

from manager import InvalidArgumentError, ReqContext, available_policies, create_manager
from manager.replay import block_key, parse_trace, replay
from manager.shadow import MIN_SAMPLED_REQUESTS, ShadowEvaluator

TRACE = Path(__file__).resolve().parents[2] / "bench" / "data" / "mooncake_synthetic_trace.jsonl"


@pytest.fixture(scope="module")
def requests() -> list[list[bytes]]:
    with TRACE.open() as fh:
        return parse_trace(fh)[:800]


def test_full_sampling_projects_exactly_what_an_offline_replay_measures(requests) -> None:
    ev = ShadowEvaluator(available_policies(), 2000, sample_rate=1.0, max_queue=10_000)
    for chain in requests:
        assert ev.observe(chain)
    assert ev.drain() == len(requests)
    report = ev.report()
    assert report.sampled == len(requests)
    for ratio in report.ratios:
        assert ratio.cumulative == pytest.approx(replay(requests, ratio.policy, 2000).hit_ratio)


def test_requests_sharing_a_root_are_sampled_together(requests) -> None:
    ev = ShadowEvaluator(["lru"], 2000, sample_rate=0.25)
    decisions: dict[bytes, bool] = {}
    for chain in requests:
        sampled = ev.observe(chain)
        assert decisions.setdefault(chain[0], sampled) == sampled
    fraction = sum(decisions.values()) / len(decisions)
    assert 0.1 < fraction < 0.4
    assert ev.report().shadow_capacity == 500


def test_the_window_covers_only_the_most_recent_sampled_requests() -> None:
    ev = ShadowEvaluator(["lru"], 100, sample_rate=1.0, window=2, min_capacity=1)
    chain = [block_key(1), block_key(2)]
    for _ in range(3):
        ev.observe(chain)
    ev.observe([block_key(7), block_key(8)])
    ev.drain()
    (ratio,) = ev.report().ratios
    assert ratio.requests == 4
    assert ratio.cumulative == pytest.approx(4 / 8)  # requests 2 and 3 hit both blocks
    assert ratio.window == pytest.approx(2 / 4)  # request 3 (2 hits) and request 4 (none)


def test_a_full_queue_drops_and_counts_instead_of_growing() -> None:
    ev = ShadowEvaluator(["lru"], 100, sample_rate=1.0, max_queue=2)
    results = [ev.observe([block_key(i)]) for i in range(5)]
    assert results == [True, True, False, False, False]
    report = ev.report()
    assert (report.queued, report.dropped, report.observed) == (2, 3, 5)


def test_drain_respects_its_budget() -> None:
    ev = ShadowEvaluator(["lru", "arc"], 100, sample_rate=1.0)
    for i in range(5):
        ev.observe([block_key(i)])
    assert ev.drain(2) == 2
    assert ev.report().queued == 3
    assert ev.drain() == 3
    assert ev.drain() == 0


@pytest.mark.parametrize(
    "kwargs",
    [{"sample_rate": 0.0}, {"sample_rate": 1.5}, {"window": 0}, {"max_queue": 0}],
)
def test_bad_settings_are_refused(kwargs) -> None:
    with pytest.raises(InvalidArgumentError):
        ShadowEvaluator(["lru"], 100, **kwargs)


def test_unknown_policy_is_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="unknown policy"):
        ShadowEvaluator(["lru", "nope"], 100)


def test_the_manager_feeds_every_finished_request_chain_to_its_listeners() -> None:
    m = create_manager(num_blocks=16)
    chains: list[list[bytes]] = []
    m.add_chain_listener(chains.append)
    ctx = ReqContext("r1")
    m.on_new_request(ctx)
    head, tail = [block_key(1), block_key(2)], [block_key(3)]
    out = m.prepare_store(head, ctx)
    assert out is not None
    m.complete_store(out.keys_to_store, ctx)
    slots = m.prepare_load(head, ctx)
    assert len(slots) == 2
    m.prepare_store(tail, ctx)
    m.on_request_finished(ctx)
    assert chains == []  # the pins and the pending store are still held
    m.complete_load(head, ctx)
    m.complete_store(tail, ctx)
    assert chains == [head + tail]


def _repeated(ev: ShadowEvaluator, n: int) -> None:
    """``n`` sampled requests of one 2-block chain: every one after the first hits both."""
    for _ in range(n):
        ev.observe([block_key(1), block_key(2)])
    ev.drain()


def test_no_ratio_until_the_window_holds_enough_sampled_requests() -> None:
    ev = ShadowEvaluator(["lru", "arc"], 100, sample_rate=1.0, window=50, min_requests=10)
    assert ev.report().min_requests == 10
    _repeated(ev, 9)
    for ratio in ev.report().ratios:
        assert (ratio.window, ratio.cumulative) == (None, None)
        assert (ratio.requests, ratio.blocks, ratio.window_requests) == (9, 18, 9)
    _repeated(ev, 1)
    for ratio in ev.report().ratios:
        assert ratio.window == pytest.approx(18 / 20)
        assert ratio.cumulative == pytest.approx(18 / 20)
        assert ratio.window_requests == 10


def test_the_default_minimum_is_a_few_hundred_requests_capped_by_the_window() -> None:
    assert MIN_SAMPLED_REQUESTS == 400
    assert ShadowEvaluator(["lru"], 100).report().min_requests == MIN_SAMPLED_REQUESTS
    small = ShadowEvaluator(["lru"], 100, sample_rate=1.0, window=3)
    assert small.report().min_requests == 3  # the window can hold no more
    _repeated(small, 2)
    assert small.report().ratios[0].window is None
    _repeated(small, 1)
    assert small.report().ratios[0].window == pytest.approx(4 / 6)


@pytest.mark.parametrize("bad", [0, -1])
def test_a_minimum_below_one_is_refused(bad: int) -> None:
    with pytest.raises(InvalidArgumentError):
        ShadowEvaluator(["lru"], 100, min_requests=bad)
