"""``bench/disk_onload.py``'s own arithmetic: the stage table it prints from the server's spans."""

from __future__ import annotations

import pytest

from bench.disk_onload import STAGES, stage_table


def test_the_stage_table_takes_each_calls_spans_relative_to_its_start() -> None:
    calls = [(10.0, 10.010), (20.0, 20.020)]
    spans = [
        ("read syscalls", 10.001, 10.004, 0.0001),
        ("read syscalls", 10.002, 10.006, 0.0001),
        ("MAC checks + pool copy", 10.005, 10.007, 0.002),
        ("read syscalls", 20.002, 20.012, 0.0002),
        ("MAC checks + pool copy", 20.013, 20.015, 0.001),
        ("read syscalls", 30.0, 30.1, 0.1),  # in no call: left out
    ]
    table = stage_table({"spans": spans, "missing": ["job observed"]}, calls)
    reads, macs = table["stages"]["read syscalls"], table["stages"]["MAC checks + pool copy"]
    # Medians over the two calls: starts 1 and 2 ms, ends 6 and 12, sums 7 and 10.
    assert reads["start"] == pytest.approx(1.5)
    assert reads["end"] == pytest.approx(9.0)
    assert reads["sum"] == pytest.approx(8.5)
    assert reads["count"] == 1.5
    assert reads["cpu"] == pytest.approx(0.2)
    assert macs["start"] == pytest.approx((5 + 13) / 2)
    assert macs["cpu"] == pytest.approx(1.5)
    assert table["call_ms"] == pytest.approx(15.0)
    assert table["missing"] == ["job observed"]
    # In the order the stages are listed, whatever order the spans came in.
    listed = [stage for _, _, _, stage, _ in STAGES]
    assert list(table["stages"]) == sorted(table["stages"], key=listed.index)
