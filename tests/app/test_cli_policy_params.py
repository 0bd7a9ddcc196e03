"""``kvoffload serve --policy-param`` and ``kvoffload replay --param`` with a value outside the
policy's declared bounds (or not finite): exit status 2 and one line on stderr naming the
policy, the parameter and the bound, before anything starts (no server, no trace read), no
traceback. Run as the real console command, in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from testsupport.server import ROOT

LFU_BOUND = "lfu: history_factor must be a number in [0, 16], got "


def kvoffload(*argv: str) -> subprocess.CompletedProcess[str]:
    """``python -m app.cli ARGV`` without any ``KVOFFLOAD_`` variable of the caller."""
    return subprocess.run(
        [sys.executable, "-m", "app.cli", *argv],
        cwd=ROOT,
        env={k: v for k, v in os.environ.items() if not k.startswith("KVOFFLOAD_")},
        capture_output=True,
        text=True,
        # A refusal takes about a second; a server that starts instead (the bug) would run on.
        timeout=60,
    )


def one_refusal_line(run: subprocess.CompletedProcess[str], *needles: str) -> str:
    assert run.returncode == 2, (run.returncode, run.stdout, run.stderr)
    assert "Traceback" not in run.stdout + run.stderr
    assert run.stdout == ""
    (line,) = run.stderr.splitlines()
    for needle in needles:
        assert needle in line, line
    return line


@pytest.mark.parametrize(
    ("policy", "param", "shown"),
    [
        ("lfu", "history_factor=1e308", LFU_BOUND + "1e+308"),
        ("lfu", "history_factor=1e30", LFU_BOUND + "1e+30"),
        ("lfu", "history_factor=1e999", LFU_BOUND + "inf"),  # JSON 1e999 is inf in Python
        ("lfu", "history_factor=NaN", LFU_BOUND + "nan"),
        ("lfu", "history_factor=-1", LFU_BOUND + "-1"),
        ("lfu", "history_factor=true", LFU_BOUND + "True"),
        ("prefix_lrfu", "ghost_factor=17", "prefix_lrfu: ghost_factor must be a number in (0, 16]"),
        ("slru", "protected_ratio=1", "slru: protected_ratio must be a number in (0, 1), got 1"),
    ],
)
def test_serve_refuses_a_parameter_out_of_bounds(policy: str, param: str, shown: str) -> None:
    run = kvoffload(
        *("serve", "--port", "0", "--admin-port", "0", "--device", "cpu"),
        *("--num-blocks", "16", "--block-bytes", "4096"),
        *("--policy", policy, "--policy-param", param),
    )
    one_refusal_line(run, "--policy-param / KVOFFLOAD_POLICY_PARAMS", shown)


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_text('{"hash_ids": [1, 2, 3]}\n{"hash_ids": [1, 2, 4]}\n' * 4)
    return path


@pytest.mark.parametrize(
    ("policy", "params", "shown"),
    [
        ("lfu", ["history_factor=1e308"], LFU_BOUND + "1e+308"),
        ("lfu", ["history_factor=1e30"], LFU_BOUND + "1e+30"),
        ("lfu", ["history_factor=inf"], LFU_BOUND + "inf"),
        ("lfu", ["history_factor=1e400"], LFU_BOUND + "inf"),
        ("lfu", ["history_factor=nan"], LFU_BOUND + "nan"),
        ("lfu", ["history_factor=16.000001"], LFU_BOUND + "16.000001"),
        ("oracle-lfu", ["horizon=2", "history_factor=1e30"], LFU_BOUND + "1e+30"),
        ("s3fifo", ["small_ratio=0"], "s3fifo: small_ratio must be a number in (0, 1), got 0"),
        ("prefix_lrfu", ["half_life=1001"], "prefix_lrfu: half_life must be a number in (0, 1000]"),
    ],
)
def test_replay_refuses_a_parameter_out_of_bounds(
    trace: Path, policy: str, params: list[str], shown: str
) -> None:
    flags = [arg for p in params for arg in ("--param", p)]
    run = kvoffload("replay", str(trace), "--capacity", "4", "--policy", policy, *flags)
    line = one_refusal_line(run, "kvoffload replay: ", shown)
    assert line.startswith("kvoffload replay: ")


def test_replay_refuses_bad_parameters_before_reading_the_trace(tmp_path: Path) -> None:
    missing = tmp_path / "absent.jsonl"
    run = kvoffload(
        *("replay", str(missing), "--capacity", "4", "--policy", "lfu"),
        *("--param", "history_factor=1e308"),
    )
    line = one_refusal_line(run, LFU_BOUND + "1e+308")
    assert "cannot read trace" not in line


def test_values_at_the_bounds_still_replay(trace: Path) -> None:
    for param in ("history_factor=0", "history_factor=16"):
        run = kvoffload(
            "replay", str(trace), "--capacity", "2", "--policy", "lfu", "--param", param
        )
        assert run.returncode == 0, run.stderr
        assert "lfu" in run.stdout
