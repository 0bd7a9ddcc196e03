"""Observer building blocks: the live hit-ratio window, per-request counts, op accounting."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from app.telemetry.metrics import Metrics
from app.telemetry.observer import HitRatioWindow, Observer, RequestCounts
from manager import (
    CompleteStoreOutput,
    LookupOutput,
    LookupResult,
    PrepareStoreOutput,
    RequestLeases,
)

HIT, PENDING, MISS = LookupResult.HIT, LookupResult.PENDING, LookupResult.MISS


def test_hit_window_keeps_the_last_lookups() -> None:
    window = HitRatioWindow(2)
    assert window.ratio() is None
    window.add(0, 0)  # empty lookups do not count
    assert window.ratio() is None
    window.add(4, 4)
    window.add(0, 4)
    assert window.ratio() == 0.5
    window.add(2, 4)  # the 4/4 lookup leaves the window
    assert window.ratio() == 0.25
    with pytest.raises(ValueError, match="positive"):
        HitRatioWindow(0)


def test_request_counts_are_pruned_to_tracked_requests_and_bounded() -> None:
    counts = RequestCounts(limit=2)
    counts.add("a", loaded=2)
    counts.add("a", stored=3)
    counts.add("b", stored=1)
    counts.add("c", stored=1)  # over the limit: not counted
    assert len(counts) == 2
    tracked = [RequestLeases("a", {b"k": 2, b"j": 1}, [b"p"], 0.0), RequestLeases("c", {}, [], 0.0)]
    rows = counts.rows(tracked, limit=10)
    assert [(r.req_id, r.pinned, r.pending, r.loaded, r.stored) for r in rows] == [
        ("a", 3, 1, 2, 3),
        ("c", 0, 0, 0, 0),
    ]
    assert len(counts) == 1  # b finished: forgotten
    assert [r.req_id for r in counts.rows(tracked, limit=1)] == ["a"]


def test_observer_key_results() -> None:
    reg = CollectorRegistry()
    obs = Observer(Metrics(reg))
    obs.lookup("r", LookupOutput([HIT, HIT, PENDING, MISS, HIT], 2))
    obs.prepare_store("r", 5, PrepareStoreOutput([b"a", b"b"], [0, 1], [], [b"c"]))
    obs.prepare_store("r", 1, None)
    obs.complete_store("r", CompleteStoreOutput([b"a"], [b"b"], [b"x", b"y"]))

    def keys(op: str, result: str) -> float | None:
        return reg.get_sample_value("kvoffload_manager_keys_total", {"op": op, "result": result})

    assert [keys("lookup", r) for r in ("hit", "pending", "miss")] == [3, 1, 1]
    assert [keys("prepare_store", r) for r in ("stored", "skipped", "reused")] == [2, 1, 2]
    assert [keys("complete_store", r) for r in ("completed", "dropped", "ignored")] == [1, 1, 2]
    ops = "kvoffload_manager_ops_total"
    assert reg.get_sample_value(ops, {"op": "prepare_store", "result": "refused"}) == 1
    assert obs.hit_window.ratio() == 2 / 5


def test_observer_without_metrics_still_counts_the_window() -> None:
    obs = Observer(None)
    obs.lookup("r", LookupOutput([HIT, MISS], 1))
    obs.failed("lookup", "r")
    assert obs.hit_window.ratio() == 0.5
