"""Trace replay: the accounting, Belady's ceiling, trace parsing and the replay command."""

from __future__ import annotations

import argparse
import io
import json
from pathlib import Path

import pytest

from app import replay as replay_cli
from manager import InvalidArgumentError, available_policies
from manager.replay import BELADY, block_key, parse_trace, replay

TRACE = Path(__file__).resolve().parents[2] / "bench" / "data" / "mooncake_synthetic_trace.jsonl"


def keys(*ids: int) -> list[bytes]:
    return [block_key(i) for i in ids]


def test_hit_ratio_counts_only_leading_hits() -> None:
    # r1 stores 1,2,3; r2 hits 1,2 then misses 4; r3 = 1,4,3 hits 1 and 4 but the
    # accounting stops at nothing missing: 1 hit, 4 hit (stored by r2), 3 hit.
    requests = [keys(1, 2, 3), keys(1, 2, 4), keys(1, 4, 3), keys(9, 1, 2)]
    result = replay(requests, "lru", capacity=100)
    assert result.blocks == 12
    assert result.prefix_hits == 0 + 2 + 3 + 0
    assert result.hit_ratio == pytest.approx(5 / 12)
    assert result.evictions == 0
    assert result.stores == 5  # 1,2,3,4,9


def test_a_resident_block_after_a_miss_is_not_a_hit() -> None:
    requests = [keys(1, 2), keys(3, 2)]
    assert replay(requests, "lru", capacity=10).prefix_hits == 0


def test_small_capacity_evicts_and_counts_refusals_nowhere() -> None:
    requests = [keys(1, 2), keys(3, 4), keys(1, 2)]
    result = replay(requests, "lru", capacity=2)
    assert result.prefix_hits == 0  # 1,2 were evicted by 3,4
    assert result.evictions == 4  # 3,4 evict 1,2; then 1,2 evict 3,4
    assert result.refused == 0


def test_belady_keeps_the_block_used_soonest() -> None:
    # Capacity 2, one block per request: when 3 arrives LRU evicts 1 (least recent) although
    # 1 is used next; MIN keeps 1 (it skips 3, which has no future use).
    requests = [keys(1), keys(2), keys(3), keys(1)]
    assert replay(requests, "lru", capacity=2).prefix_hits == 0
    assert replay(requests, BELADY, capacity=2).prefix_hits == 1


def test_belady_never_stores_a_block_without_a_future_use() -> None:
    result = replay([keys(1, 2, 3), keys(4, 5)], BELADY, capacity=10)
    assert result.stores == 0


@pytest.mark.parametrize("capacity", [300, 1500])
def test_belady_bounds_every_policy_on_the_shipped_trace(capacity: int) -> None:
    with TRACE.open() as fh:
        requests = parse_trace(fh)[:600]
    ceiling = replay(requests, BELADY, capacity).hit_ratio
    for policy in available_policies():
        assert replay(requests, policy, capacity).hit_ratio <= ceiling + 1e-9, policy


def test_the_shipped_trace_has_the_documented_size() -> None:
    with TRACE.open() as fh:
        requests = parse_trace(fh)
    assert len(requests) == 3993
    assert sum(map(len, requests)) == 121_877
    assert len({k for r in requests for k in r}) == 43_924


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "trace line 2"),
        ('{"input_length": 3}', "trace line 2"),
        ('{"hash_ids": [1, -2]}', "non-negative"),
        ('{"hash_ids": [1, true]}', "non-negative"),
        ('{"hash_ids": "1,2"}', "list"),
    ],
)
def test_malformed_trace_lines_are_named(line: str, message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        parse_trace(['{"hash_ids": [1]}', line])


def test_blank_lines_are_skipped() -> None:
    assert parse_trace(['{"hash_ids": [1, 2]}', "", "  "]) == [keys(1, 2)]


def run_cli(*argv: str) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser()
    replay_cli.add_parser(parser.add_subparsers(dest="command"))
    out, err = io.StringIO(), io.StringIO()
    code = replay_cli.run(parser.parse_args(["replay", *argv]), out, err)
    return code, out.getvalue(), err.getvalue()


@pytest.fixture
def small_trace(tmp_path: Path) -> Path:
    path = tmp_path / "trace.jsonl"
    lines = [{"hash_ids": [1, 2, 3]}, {"hash_ids": [1, 2, 4]}, {"hash_ids": [1, 5]}] * 5
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    return path


def test_replay_command_prints_json_rows_with_fraction_of_belady(small_trace: Path) -> None:
    code, out, _ = run_cli(str(small_trace), "--policy", "lru,arc", "--capacity", "2,4", "--json")
    assert code == 0
    rows = json.loads(out)
    assert [(r["policy"], r["capacity"]) for r in rows] == [
        (BELADY, 2),
        (BELADY, 4),
        ("lru", 2),
        ("lru", 4),
        ("arc", 2),
        ("arc", 4),
    ]
    for row in rows[2:]:
        ceiling = next(
            r for r in rows if r["policy"] == BELADY and r["capacity"] == row["capacity"]
        )
        assert row["fraction_of_belady"] == pytest.approx(row["hit_ratio"] / ceiling["hit_ratio"])


def test_replay_command_table_and_plot(small_trace: Path, tmp_path: Path) -> None:
    png = tmp_path / "plot.png"
    code, out, _ = run_cli(str(small_trace), "--capacity", "3", "--plot", str(png))
    assert code == 0
    for policy in available_policies():
        assert policy in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--capacity", "0"], "positive"),
        (["--capacity", "ten"], "integers"),
        (["--capacity", "5", "--policy", "nope"], "unknown policy"),
        (["--capacity", "5", "--param", "x=1"], "single --policy"),
        (["--capacity", "5", "--policy", "lfu", "--param", "history_factor=-1"], ">= 0"),
        (["--capacity", "5", "--policy", "lru", "--param", "noequals"], "K=V"),
    ],
)
def test_replay_command_rejects_bad_input(small_trace: Path, args: list[str], message: str) -> None:
    code, out, err = run_cli(str(small_trace), *args)
    assert code == 2
    assert out == ""
    assert message in err


def test_replay_command_names_a_missing_trace(tmp_path: Path) -> None:
    code, _, err = run_cli(str(tmp_path / "absent.jsonl"), "--capacity", "5")
    assert code == 2
    assert "cannot read trace" in err
