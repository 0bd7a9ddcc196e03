"""bench/control.py: its --quick run end to end (every part a smoke run writes), and the
retention replay's own rules on small hand-made traces."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.control import CAPACITIES, TTLS, TimedRequest, next_turns, replay_retained
from bench.harness import read_trace
from manager.replay import replay

ROOT = Path(__file__).resolve().parents[1]


def k(*ids: int) -> list[bytes]:
    return [i.to_bytes(8, "big") for i in ids]


def test_next_turn_is_the_first_later_request_keeping_the_full_blocks() -> None:
    reqs = [
        TimedRequest(0.0, k(1, 2, 3)),  # full blocks 1, 2; 3 is its tail
        TimedRequest(1.0, k(1, 9)),  # lacks block 2: not a turn of 0
        TimedRequest(2.0, k(1, 2, 4, 5)),  # keeps 1, 2: request 0's next turn (and 1's)
        TimedRequest(3.0, k(7)),  # one block: no full blocks, no next turn
        TimedRequest(4.0, k(1, 2, 4, 6)),  # request 2's next turn needs 1, 2, 4
        TimedRequest(5.0, k(1, 2)),  # too short to be request 4's next turn
    ]
    assert next_turns(reqs) == {0: 2, 1: 2, 2: 4}


def test_a_ttl_retention_keeps_blocks_until_it_expires() -> None:
    # Pool of 4: request 0's 2 blocks, then 6 new blocks push them out unless retained.
    reqs = [
        TimedRequest(0.0, k(1, 2)),
        TimedRequest(1.0, k(3, 4)),
        TimedRequest(2.0, k(5, 6)),
        TimedRequest(3.0, k(7, 8)),
        TimedRequest(4.0, k(1, 2)),
    ]
    assert replay_retained(reqs, 4, "none")["prefix_hits"] == 0
    kept = replay_retained(reqs, 4, "ttl", ttl_s=10.0, quota=2)
    assert kept["prefix_hits"] == 2
    assert kept["retained_hits"] == 2
    # The quota of 2 holds request 0's blocks; the next retentions are skipped (the last one
    # of 1, 2 adds no new block: it is made).
    assert kept["retentions_skipped"] == {"retained_blocks": 3}
    # Expired at t=2 (back into LRU as its hottest blocks), evicted by the store at t=3.
    short = replay_retained(reqs, 4, "ttl", ttl_s=1.5, quota=2)
    assert short["retentions_expired"] >= 1
    assert short["prefix_hits"] == 0
    oracle = replay_retained(reqs, 4, "oracle", turns={0: 4}, quota=2)
    assert oracle["prefix_hits"] == 2
    assert oracle["retained_hits"] == 2
    assert oracle["retentions_released"] == 1


@pytest.mark.slow
def test_quick_run_writes_every_part(tmp_path: Path) -> None:
    out = tmp_path / "control.json"
    proc = subprocess.run(
        [sys.executable, "bench/control.py", "--quick", "--out", str(out), "--dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    record = json.loads(out.read_text())
    # (a): every capacity has the baseline, each TTL and the oracle; the baseline is the
    # plain replay's LRU row on the same requests.
    rows = record["a"]["rows"]
    assert len(rows) == len(CAPACITIES) * (len(TTLS) + 2)
    requests = read_trace(limit=record["a"]["requests"])
    for cap in CAPACITIES:
        base = next(r for r in rows if r["capacity"] == cap and r["mode"] == "none")
        assert base["hit_ratio"] == pytest.approx(replay(requests, "lru", cap).hit_ratio)
        assert base["retentions_made"] == 0
    assert any(r["retained_hits"] for r in rows if r["mode"] == "ttl")
    # (b): every arm loaded its sessions; each prefetched key was used by its load.
    b = record["b"]
    assert b["rows"][0]["arm"] == "no prefetch"
    assert b["writes_while_timing"] == 0
    for row in b["rows"]:
        assert row["loads"] == b["rounds"]
        assert row["p50_ms"] > 0
        if row["arm"] != "no prefetch":
            assert row["prefetch_counts"]["used"] == b["rounds"] * b["keys_per_session"]
    # (c): the in-process costs (no servers in a quick run).
    c = record["c"]
    assert "http" not in c
    assert c["app"]["none_us"] > 0
    assert c["app"]["retained_us"] > 0
    assert c["manager"]["ratio"] > 0
