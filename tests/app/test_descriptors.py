"""The descriptor table: the limit raised at start, the reserve, and log lines about a full
table that stay few however often it is hit."""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys

import pytest

from app.descriptors import RESERVE, RateLimitedLog, in_reserve, limit
from testsupport.server import ROOT


@pytest.mark.skipif(shutil.which("prlimit") is None, reason="needs util-linux's prlimit")
def test_the_soft_limit_is_raised_to_the_hard_one() -> None:
    code = "from app.descriptors import raise_limit, limit; print(raise_limit(), limit())"
    argv = ["prlimit", "--nofile=64:2048", "--", sys.executable, "-c", code]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["2048", "2048"]


def test_the_reserve_is_the_top_of_the_table() -> None:
    assert in_reserve(limit() - RESERVE)
    assert not in_reserve(limit() - RESERVE - 1)
    assert not in_reserve(3)


def test_a_flood_of_events_is_a_few_lines_with_counts(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    limited = RateLimitedLog(logging.getLogger("test.flood"), every_s=10.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="test.flood"):
        logged = [limited.warning("table full", where="pool") for _ in range(1000)]
        now[0] = 10.5
        logged.append(limited.warning("table full", where="pool"))
        logged.append(limited.warning("another event"))
    assert logged.count(True) == 3
    counts = [(r.getMessage(), getattr(r, "fields", {}).get("count")) for r in caplog.records]
    assert counts == [("table full", 1), ("table full", 1000), ("another event", 1)]
