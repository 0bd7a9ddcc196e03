"""bench/router.py: its sessions and stand-in tokens, and a short run end to end."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.control import next_turns, read_timed_trace
from bench.harness import TRACE
from bench.router import STAND_IN_TOKENS, requests_of, round_robin, session_hash, step

ROOT = Path(__file__).resolve().parents[1]


def test_a_next_turn_joins_its_predecessors_session_and_tokens_follow_the_blocks():
    reqs = requests_of(400)
    turns = next_turns(read_timed_trace(TRACE, 400))
    assert turns, "the trace's first requests have next turns"
    for i, j in turns.items():
        assert reqs[j].session == reqs[i].session
    for r in reqs:
        assert len(r.tokens) == STAND_IN_TOKENS * len(r.keys)
    # The same block id, the same stand-in tokens, wherever it appears.
    by_key: dict[str, list[int]] = {}
    for r in reqs:
        for n, key in enumerate(r.keys):
            tokens = r.tokens[n * STAND_IN_TOKENS : (n + 1) * STAND_IN_TOKENS]
            assert by_key.setdefault(key, tokens) == tokens


def test_routers_and_the_step_batch():
    reqs = requests_of(50)
    assert [round_robin(3)(i, reqs[i]) for i in range(5)] == [0, 1, 2, 0, 1]
    route = session_hash(4)
    assert all(0 <= route(i, r) < 4 for i, r in enumerate(reqs))
    assert route(0, reqs[0]) == route(7, reqs[0])
    ops = step("q1", reqs[0])["ops"]
    assert [op["op"] for op in ops] == [
        "start_request",
        "lookup",
        "prepare_store",
        "complete_store",
        "finish_request",
    ]
    assert ops[2]["token_ids"] == reqs[0].tokens
    assert "token_ids" not in step("q1", reqs[0], tokens=False)["ops"][2]


@pytest.mark.slow
def test_a_short_run_writes_both_parts(tmp_path: Path):
    out = tmp_path / "router.json"
    argv = [sys.executable, "bench/router.py", "--quick", "--limit", "60", "--out", str(out)]
    argv += ["--rounds", "1", "--seconds", "0.3", "--cost-requests", "20"]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    record = json.loads(out.read_text())
    rows = {row["arm"]: row for row in record["routing"]}
    assert set(rows) == {"round-robin", "session-hash", "indexer"}
    for arm in ("round-robin", "session-hash"):
        assert rows[arm]["requests"] == 60
        assert 0 <= rows[arm]["hit_ratio"] <= 1
        assert sum(rows[arm]["requests_per_node"]) == 60
    assert rows["round-robin"]["vs_round_robin"] in (1, None)  # None: no hit at all
    cost = record["publisher_cost"]
    for kind in ("tokens", "hashes"):
        assert cost[kind]["calls_per_s"]["on"] > 0
        assert cost[kind]["calls_per_s"]["off"] > 0
        assert cost[kind]["cpu_us_per_call"]["on"] > 0  # the server's own CPU, read from /proc
