"""Trace replay: the accounting, Belady's ceiling, the oracle-admission bound, trace parsing and
the replay command."""

from __future__ import annotations

import argparse
import io
import json
import math
from pathlib import Path

import pytest

from app import replay as replay_cli
from manager import InvalidArgumentError, InvalidPolicyParamsError, available_policies
from manager.replay import BELADY, DiskReplay, ReplayResult, block_key, parse_trace, replay

TRACE = Path(__file__).resolve().parents[2] / "bench" / "data" / "mooncake_synthetic_trace.jsonl"


def keys(*ids: int) -> list[bytes]:
    return [block_key(i) for i in ids]


@pytest.fixture(scope="module")
def shipped() -> list[list[bytes]]:
    with TRACE.open() as fh:
        return parse_trace(fh)


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


def oracle_lru(requests: list[list[bytes]], capacity: int, horizon: float) -> ReplayResult:
    return replay(requests, "oracle-lru", capacity, params={"horizon": horizon})


def test_oracle_admission_never_stores_a_one_off_block() -> None:
    # Only block 1 is used twice; 2 and 3 are one-offs. Nothing is evicted, so skipping the
    # one-offs loses no hit, and the bound stores 1 block where LRU stores 3.
    requests = [keys(1, 2), keys(1, 3)]
    bound = oracle_lru(requests, 10, math.inf)
    assert (bound.prefix_hits, bound.stores, bound.evictions) == (1, 1, 0)
    plain = replay(requests, "lru", 10)
    assert (plain.prefix_hits, plain.stores) == (1, 3)


@pytest.mark.parametrize(
    ("horizon", "hits", "stores"),
    [
        (0.75, 1, 1),  # reach 0.75 * 4 = 3 references: block 1 comes back exactly 3 later
        (0.7, 0, 0),  # reach 2.8: 1 comes back just beyond, so it is not stored
        (0.5, 0, 0),
    ],
)
def test_oracle_admission_cuts_at_the_horizon(horizon: float, hits: int, stores: int) -> None:
    # Block 1's next use (request 2) starts 1 + 2 = 3 block references after request 0 starts;
    # 2 and 3 are one-offs. Capacity 4 holds everything, so plain LRU gets the hit: the bound
    # is a ceiling for reuse predictors at that horizon, not for every policy.
    requests = [keys(1), keys(2, 3), keys(1)]
    result = oracle_lru(requests, 4, horizon)
    assert (result.prefix_hits, result.stores) == (hits, stores)
    assert replay(requests, "lru", 4).prefix_hits == 1


def test_oracle_admission_stores_exactly_the_blocks_used_again() -> None:
    # Used again: 1 (request 1), 6 and 2 (request 3). Request 1 misses on 4 (a one-off, not
    # stored) and still offers the resident 1; request 3 hits 6 and 2.
    requests = [keys(1, 2, 3), keys(4, 1), keys(5, 6), keys(6, 2)]
    result = oracle_lru(requests, 100, math.inf)
    assert (result.prefix_hits, result.stores) == (2, 3)
    assert replay(requests, "lru", 100).stores == 6  # every distinct block


def test_oracle_admission_still_offers_resident_blocks() -> None:
    # Capacity 2. Request 2 misses on 3 and offers the resident 1 with it: offered, 1 is
    # shielded from that store's eviction, so 2 goes and requests 3, 4 and 5 hit 1, 3 and 1
    # (then 2 misses, as with plain LRU). Dropping resident keys from the offer would evict 1
    # (the least recent) instead; request 3 would miss and evict 2, so only 4 and 5 would hit.
    requests = [keys(1), keys(2), keys(3, 1), keys(1), keys(3), keys(1), keys(2)]
    assert replay(requests, "lru", 2).prefix_hits == 3
    assert oracle_lru(requests, 2, math.inf).prefix_hits == 3


def test_horizon_inf_means_ever_used_again(shipped: list[list[bytes]]) -> None:
    requests = shipped[:800]
    capacity = 500
    # Any horizon covering the whole slice admits exactly the blocks that have a next use.
    whole = sum(map(len, requests)) / capacity + 1
    ever = oracle_lru(requests, capacity, math.inf).to_dict()
    covering = oracle_lru(requests, capacity, whole).to_dict()
    assert ever.pop("params") == {"horizon": "inf"}  # JSON has no infinity
    covering.pop("params")
    assert ever == covering


def test_oracle_bound_is_above_lru_on_the_shipped_trace(shipped: list[list[bytes]]) -> None:
    lru = replay(shipped, "lru", 2000).hit_ratio
    for horizon in (2, math.inf):
        assert oracle_lru(shipped, 2000, horizon).hit_ratio > lru, horizon


@pytest.mark.parametrize(
    ("policy", "params", "error", "message"),
    [
        ("oracle-lru", {}, InvalidPolicyParamsError, "needs the parameter horizon"),
        ("oracle-lru", {"horizon": 0}, InvalidPolicyParamsError, "positive number or inf"),
        ("oracle-lru", {"horizon": -2}, InvalidPolicyParamsError, "positive number or inf"),
        ("oracle-lru", {"horizon": math.nan}, InvalidPolicyParamsError, "got nan"),
        ("oracle-lru", {"horizon": True}, InvalidPolicyParamsError, "got True"),
        ("oracle-lru", {"horizon": "2"}, InvalidPolicyParamsError, "got '2'"),
        ("oracle-lru", {"horizon": 2, "x": 1}, InvalidPolicyParamsError, "'lru' takes no"),
        ("oracle-nope", {"horizon": 2}, InvalidArgumentError, "'oracle-nope'; available: or"),
        ("oracle-belady", {"horizon": 2}, InvalidArgumentError, "unknown policy"),
        ("oracle-", {"horizon": 2}, InvalidArgumentError, "unknown policy"),
    ],
)
def test_oracle_bound_rejects_bad_parameters(
    policy: str, params: dict[str, object], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        replay([keys(1)], policy, 2, params=params)


def test_oracle_bound_passes_other_params_to_its_policy() -> None:
    with pytest.raises(InvalidArgumentError, match=r"history_factor must be a number in \[0, 16\]"):
        replay([keys(1)], "oracle-lfu", 2, params={"horizon": 2, "history_factor": -1})
    result = replay([keys(1)], "oracle-lfu", 2, params={"horizon": 2, "history_factor": 1})
    assert result.params == {"horizon": 2, "history_factor": 1}


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
        (["--capacity", "5", "--policy", "lfu", "--param", "history_factor=-1"], "[0, 16]"),
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


def test_replay_command_runs_the_oracle_bound(small_trace: Path) -> None:
    code, out, _ = run_cli(
        str(small_trace), "--policy", "oracle-lru", "--param", "horizon=inf", "--capacity", "2"
    )
    assert code == 0
    assert "oracle-lru" in out

    def no_constants(name: str) -> None:
        raise AssertionError(f"non-standard JSON constant {name}")

    code, out, _ = run_cli(
        str(small_trace),
        *("--policy", "oracle-lru", "--param", "horizon=inf", "--capacity", "2", "--json"),
    )
    assert code == 0
    rows = json.loads(out, parse_constant=no_constants)
    assert [(r["policy"], r["params"]) for r in rows] == [
        (BELADY, {}),
        ("oracle-lru", {"horizon": "inf"}),
    ]
    assert rows[1]["fraction_of_belady"] == pytest.approx(
        rows[1]["hit_ratio"] / rows[0]["hit_ratio"]
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--policy", "oracle-nope"], "unknown policy oracle-nope"),
        (["--policy", "oracle-lru"], "needs the parameter horizon"),
        (["--policy", "oracle-lru", "--param", "horizon=0"], "positive number"),
    ],
)
def test_replay_command_rejects_a_bad_oracle_bound(
    small_trace: Path, args: list[str], message: str
) -> None:
    code, out, err = run_cli(str(small_trace), "--capacity", "2", *args)
    assert (code, out) == (2, "")
    assert message in err


# ---------------------------------------------------------------- two levels: pool over disk


def two_levels(requests: list[list[bytes]], capacity: int, disk: int, admit: int) -> ReplayResult:
    return replay(requests, "lru", capacity, disk_capacity=disk, disk_admit_after=admit)


def disk_of(result: ReplayResult) -> DiskReplay:
    assert result.disk is not None
    return result.disk


def test_a_block_evicted_from_a_one_block_pool_is_a_disk_hit() -> None:
    # r1 stores 2, evicting 1 to disk; r2 finds 1 on disk and reads it back, evicting 2 (to
    # disk too). The pool alone hits nothing.
    requests = [keys(1), keys(2), keys(1)]
    assert replay(requests, "lru", 1).prefix_hits == 0
    result = two_levels(requests, 1, 10, admit=1)
    disk = disk_of(result)
    assert (result.prefix_hits, disk.pool_hits, disk.disk_hits) == (1, 0, 1)
    assert (disk.demotions, disk.refused, disk.evictions, disk.unwritten) == (2, 0, 0, 0)
    assert result.hit_ratio == pytest.approx(1 / 3)
    assert disk.disk_hit_ratio == pytest.approx(1 / 3)
    assert disk.pool_hit_ratio == 0


@pytest.mark.parametrize(
    ("admit", "demotions", "refused", "disk_hits"),
    [
        (1, 2, 0, 1),
        # Asks count once per request: 1 (asked by r0 and r1) has 2 when r2 evicts it, the
        # one-off 2 has 1 when r3's promotion of 1 evicts it: K = 2 writes 1, refuses 2.
        (2, 1, 1, 1),
        # K = 3: 1 is refused too; r3 misses it, stores it again and evicts 2 (refused).
        (3, 0, 2, 0),
        (5, 0, 2, 0),
    ],
)
def test_admission_counts_asks_at_lookup_load_and_store(
    admit: int, demotions: int, refused: int, disk_hits: int
) -> None:
    # Pool of 1: r1 hits 1 in the pool, r2 evicts 1 (asked by r0 and r1), r3 reads 1 back
    # from disk if it was written, evicting 2 (asked by r2 alone).
    requests = [keys(1), keys(1), keys(2), keys(1)]
    disk = disk_of(two_levels(requests, 1, 10, admit))
    assert (disk.pool_hits, disk.disk_hits) == (1, disk_hits)
    assert (disk.demotions, disk.refused) == (demotions, refused)


def test_the_disk_holds_at_most_its_capacity_and_never_evicts_a_block_being_read() -> None:
    # Pool of 1, disk of 2, LRU on both. 1, 2, 3 go to disk as 2, 3, 4 arrive; 3 evicts 1 there.
    # r4 and r5 miss (1 and 2 are gone from disk), writing 4 then 1 over 2 and 3: disk [4, 1].
    # r6 reads 4 back; its promotion evicts 2 from the pool, whose write must evict a disk
    # block: 4 is the coldest but pinned by the read, so 1 goes.
    requests = [keys(1), keys(2), keys(3), keys(4), keys(1), keys(2), keys(4), keys(1)]
    result = two_levels(requests, 1, 2, admit=1)
    disk = disk_of(result)
    assert (disk.disk_hits, disk.demotions, disk.evictions) == (1, 6, 4)
    assert disk.demotions - disk.evictions == 2  # what the disk holds: its capacity
    assert result.prefix_hits == 1  # r7's 1 was evicted from disk in r6


def test_a_prefix_runs_through_disk_and_pool_hits_and_keeps_the_disk_copy() -> None:
    # Pool of 2: r1 evicts 1 to disk. r2 = 1 (disk), 2 (pool), 4 (neither): prefix 2. The
    # promotion of 1 must not evict 2, the prefix's pool hit (LRU's victim otherwise): it evicts
    # 3. Storing 4 then evicts 1, already on disk (inclusive): no second write.
    requests = [keys(1, 2), keys(3), keys(1, 2, 4)]
    result = two_levels(requests, 2, 10, admit=1)
    disk = disk_of(result)
    assert (result.prefix_hits, disk.pool_hits, disk.disk_hits) == (2, 1, 1)
    assert disk.demotions == 2  # 1 and 3


def test_a_disk_hit_the_pool_has_no_room_for_ends_the_prefix() -> None:
    # Pool of 1: r2 = 2 (pool hit), 1 (on disk). Reading 1 back needs a slot, and the only one
    # holds 2, which the prefix protects: 1 is not read, the prefix ends at 2, and storing 1
    # afterwards evicts 2 to disk.
    requests = [keys(1), keys(2), keys(2, 1)]
    result = two_levels(requests, 1, 10, admit=1)
    disk = disk_of(result)
    assert (result.prefix_hits, disk.pool_hits, disk.disk_hits, disk.demotions) == (1, 1, 0, 2)


def test_without_a_disk_the_rows_are_unchanged() -> None:
    requests = [keys(1, 2), keys(1, 3)]
    row = replay(requests, "lru", 10).to_dict()
    assert "disk" not in row
    with_disk = replay(requests, "lru", 10, disk_capacity=5).to_dict()
    assert with_disk.pop("disk")["admit_after"] == 2  # the service's default
    assert with_disk == row  # nothing is evicted: the disk changes nothing


def test_the_disk_runs_the_pools_policy_unless_told() -> None:
    assert disk_of(replay([keys(1)], "arc", 4, disk_capacity=2)).policy == "arc"
    assert disk_of(replay([keys(1)], "arc", 4, disk_capacity=2, disk_policy="lfu")).policy == "lfu"


@pytest.mark.parametrize("policy", [BELADY, "oracle-lru"])
def test_bounds_do_not_run_with_a_disk(policy: str) -> None:
    with pytest.raises(InvalidArgumentError, match="pool-only bound"):
        replay([keys(1)], policy, 2, params={"horizon": 2}, disk_capacity=2)


@pytest.mark.parametrize(("disk", "admit"), [(0, 2), (4, 0)])
def test_a_bad_disk_is_refused(disk: int, admit: int) -> None:
    with pytest.raises(InvalidArgumentError):
        replay([keys(1)], "lru", 2, disk_capacity=disk, disk_admit_after=admit)


def test_an_inclusive_disk_of_15k_under_5k_reaches_095_of_a_20k_pool(
    shipped: list[list[bytes]],
) -> None:
    # The figure of docs/tiers.md, "Sizing the disk" (issue #19's target): LRU, K = 1 (K = 2
    # writes 3.2x less to the disk for 0.90x: the table there).
    flat = replay(shipped, "lru", 20_000).hit_ratio
    result = replay(shipped, "lru", 5_000, disk_capacity=15_000, disk_admit_after=1)
    disk = disk_of(result)
    assert result.hit_ratio >= 0.95 * flat
    assert disk.pool_hit_ratio == pytest.approx(replay(shipped, "lru", 5_000).hit_ratio)
    assert disk.pool_hits + disk.disk_hits == result.prefix_hits


def test_replay_command_with_a_disk_prints_both_levels_and_no_belady(small_trace: Path) -> None:
    args = ("--policy", "lru", "--capacity", "1,2", "--disk-capacity", "3")
    code, out, _ = run_cli(str(small_trace), *args, "--json")
    assert code == 0
    rows = json.loads(out)
    assert [(r["policy"], r["capacity"]) for r in rows] == [("lru", 1), ("lru", 2)]
    for row in rows:
        disk = row["disk"]
        assert (disk["capacity"], disk["admit_after"], disk["policy"]) == (3, 2, "lru")
        assert disk["pool_hits"] + disk["disk_hits"] == row["prefix_hits"]
        assert "fraction_of_belady" not in row
    code, out, _ = run_cli(str(small_trace), *args, "--disk-admit-after", "3")
    assert code == 0
    head, _, first = out.splitlines()[:3]
    assert head.split() == [
        *("policy", "pool", "disk", "K", "hit", "pool", "hit", "disk", "hit"),
        *("demotions", "refused", "disk", "evictions"),
    ]
    assert first.split()[:4] == ["lru", "1", "3", "3"]
    assert "demotions: blocks written to disk" in out
    assert BELADY not in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--disk-admit-after", "1"], "need --disk-capacity"),
        (["--disk-policy", "lru"], "need --disk-capacity"),
        (["--disk-capacity", "0"], "positive integer"),
        (["--disk-capacity", "4", "--disk-admit-after", "0"], "admit_after"),
        (["--disk-capacity", "4", "--disk-policy", "nope"], "unknown --disk-policy nope"),
        (["--disk-capacity", "4", "--policy", "lru,oracle-lru"], "oracle-lru is a pool-only"),
    ],
)
def test_replay_command_rejects_a_bad_disk(
    small_trace: Path, args: list[str], message: str
) -> None:
    code, out, err = run_cli(str(small_trace), "--capacity", "2", *args)
    assert (code, out) == (2, "")
    assert message in err
