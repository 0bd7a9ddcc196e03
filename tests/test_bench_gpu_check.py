"""bench/gpu_check.py without a GPU: the one-line failure, the table / JSON / verdict helpers,
section guarding (an error or a section past its cap is reported and the next one runs), the
remap SKIP, and the latency, concurrency and deadline sections' code run on the CUDA fakes
with CPU caches (so a first device run does not stumble on a name or a shape)."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from bench import gpu_check
from bench.gpu_check import Row
from tests.transfer.fake_cuda import FakeRaw, install
from transfer import HostPool, cuda_worker

ROOT = Path(__file__).resolve().parents[1]


def rows(*statuses: str) -> list[Row]:
    return [Row("s", f"check {i}", "1", "1", st) for i, st in enumerate(statuses)]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_without_cuda_it_fails_in_one_line(tmp_path: Path) -> None:
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run(
        [sys.executable, "bench/gpu_check.py", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("gpu_check: FAIL: no CUDA device visible")
    assert not out.exists()  # nothing measured, nothing written


@pytest.mark.parametrize(
    ("statuses", "strict", "code", "words"),
    [
        (["PASS", "PASS", "INFO"], False, 0, "every checked target met (2 pass)"),
        (["PASS", "FAIL"], False, 1, "SOME CHECKS FAILED (1 pass, 1 fail)"),
        (["PASS", "ERROR"], False, 1, "SOME CHECKS FAILED (1 pass, 1 error)"),
        (["PASS", "SKIP"], False, 0, "NOT checked (no pass): s: check 1"),
        (["PASS", "SKIP"], True, 1, "FAIL (--strict): not checked: s: check 1"),
        (["SKIP", "INFO"], False, 1, "no target was checked"),
        ([], False, 1, "nothing checked"),
    ],
)
def test_verdict(statuses: list[str], strict: bool, code: int, words: str) -> None:
    got, line = gpu_check.verdict(rows(*statuses), strict=strict)
    assert got == code
    assert words in line
    assert "\n" not in line


def test_a_row_has_a_known_status() -> None:
    with pytest.raises(ValueError, match="status must be one of"):
        Row("s", "w", "m", "t", "OK")


def test_table_is_one_aligned_block() -> None:
    table = gpu_check.format_table(
        [Row("bandwidth", "store vllm80", "41.0 GB/s = 0.91x", ">= 0.85x", "PASS"), *rows("SKIP")]
    )
    lines = table.splitlines()
    assert lines[0].split() == ["section", "check", "measured", "target", "result"]
    assert set(lines[1].replace(" ", "")) == {"-"}
    assert len(lines) == 4
    assert lines[2].endswith("PASS")
    assert lines[3].endswith("SKIP")
    starts = {line.index(word) for line, word in zip(lines[2:], ("store", "check"), strict=True)}
    assert len(starts) == 1  # columns line up


def test_percentile_is_nearest_rank() -> None:
    values = [float(v) for v in range(100, 0, -1)]  # 1..100, unsorted
    assert gpu_check.percentile(values, 0.5) == 50.0
    assert gpu_check.percentile(values, 0.99) == 99.0
    assert gpu_check.percentile(values, 1.0) == 100.0
    assert gpu_check.percentile([3.0], 0.99) == 3.0
    with pytest.raises(ValueError, match="no values"):
        gpu_check.percentile([], 0.5)


def test_pool_size_says_when_it_is_scaled() -> None:
    gib = 1 << 30
    assert gpu_check.pool_size_for(64 * gib, 128 * gib, 100 * gib) == (64 * gib, None)
    assert gpu_check.pool_size_for(64 * gib, None, None) == (64 * gib, None)
    size, note = gpu_check.pool_size_for(64 * gib, 20 * gib, 100 * gib)
    assert size == 15 * gib
    assert note is not None
    assert "available memory" in note
    size, note = gpu_check.pool_size_for(64 * gib, 128 * gib, 64 << 20)  # a container's shm
    assert size == 0
    assert note is not None
    assert "/dev/shm" in note


def test_remapped_env_swaps_the_first_two_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    assert gpu_check.remapped_env(3, None)["CUDA_VISIBLE_DEVICES"] == "1,0,2"
    assert gpu_check.remapped_env(2, "GPU-a, GPU-b")["CUDA_VISIBLE_DEVICES"] == "GPU-b,GPU-a"


def test_vllm_layouts_and_which_bandwidth_rows_are_gated() -> None:
    assert gpu_check.vllm_block_bytes("vllm32") == 2 << 20
    assert gpu_check.vllm_block_bytes("vllm80") == 5 << 19  # 2.5 MiB, 80 tensors
    assert gpu_check.VLLM_LAYOUTS["vllm80"][0] == 80

    def m(layout: str, bb: int, store: float, load: float) -> dict[str, Any]:
        return {
            "layout": layout,
            "block_bytes": bb,
            "pattern": "scattered",
            "copy_path": "batch",
            "store_gbps": 40.0,
            "load_gbps": 40.0,
            "store_ratio": store,
            "load_ratio": load,
        }

    got = gpu_check.bandwidth_rows(
        [
            m("4", 64 << 10, 0.5, 0.5),
            m("4", 2 << 20, 0.9, 0.84),
            m("vllm80", 5 << 19, 0.86, 0.95),
        ]
    )
    assert [r.status for r in got] == ["INFO", "INFO", "PASS", "FAIL", "PASS", "PASS"]
    assert "64 KiB" in got[0].what
    assert "2.50 MiB" in got[4].what
    assert "80 tensors" in got[4].what


@pytest.fixture
def report(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    out = tmp_path / "gpu_check.json"
    monkeypatch.setattr(gpu_check, "OUT_PATH", out)
    monkeypatch.setattr(gpu_check, "REPORT", {"benchmark": "gpu_check", "sections": {}})
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda *a, **k: None)
    return out


def test_a_failing_or_stuck_section_is_reported_and_the_next_one_runs(report: Path) -> None:
    table: list[Row] = []

    def boom() -> dict[str, Any]:
        raise RuntimeError("cudaErrorMemoryAllocation\nsecond line")

    def stuck() -> dict[str, Any]:
        while True:
            time.sleep(0.01)

    def fine() -> dict[str, Any]:
        return {"x": 1, "rows": gpu_check.rows_of(gpu_check.gate("fine", "w", "1", "1", True))}

    gpu_check.run_section("boom", boom, 30, table)
    gpu_check.run_section("stuck", stuck, 0.2, table)
    gpu_check.run_section("fine", fine, 30, table)
    assert [(r.section, r.status) for r in table] == [
        ("boom", "ERROR"),
        ("stuck", "ERROR"),
        ("fine", "PASS"),
    ]
    assert table[0].measured == "RuntimeError: cudaErrorMemoryAllocation"
    assert "ran past its cap" in table[1].measured
    saved = json.loads(report.read_text())
    assert set(saved["sections"]) == {"boom", "stuck", "fine"}
    assert "Traceback" in saved["sections"]["boom"]["error"]
    assert saved["sections"]["fine"]["x"] == 1
    assert [r["status"] for r in saved["rows"]] == ["ERROR", "ERROR", "PASS"]
    assert gpu_check.verdict(table)[0] == 1


def test_one_gpu_skips_the_remap_and_does_not_pass_it(
    report: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    table: list[Row] = []
    gpu_check.run_section("remap", gpu_check.remap, 30, table)
    assert [r.status for r in table] == ["SKIP"]
    assert gpu_check.verdict(table)[0] == 1  # a skip alone is no pass
    assert gpu_check.verdict([*table, *rows("PASS")], strict=True)[0] == 1


@pytest.fixture
def fakes(report: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA fakes, CPU "device" caches, and a pageable pool the worker accepts."""
    install(monkeypatch, FakeRaw())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)

    def cpu_cache(n: int, bb: int, tensors: int = 4, device: str = "cuda:0") -> Any:
        return [torch.full((n, bb // tensors), i, dtype=torch.uint8) for i in range(tensors)]

    monkeypatch.setattr(gpu_check, "flat_cache", cpu_cache)
    create = HostPool.create
    monkeypatch.setattr(
        HostPool, "create", functools.partial(create, pin=False, name_prefix="gpuchk")
    )
    worker = cuda_worker.CudaTransferWorker
    monkeypatch.setattr(
        cuda_worker, "CudaTransferWorker", functools.partial(worker, allow_pageable=True)
    )


@pytest.mark.usefixtures("fakes")
def test_small_jobs_concurrent_and_deadline_sections_run_on_the_fakes() -> None:
    table: list[Row] = []
    gpu_check.run_section("small_jobs", lambda: gpu_check.small_jobs(30, 40, 4096, 16), 60, table)
    gpu_check.run_section("concurrent", lambda: gpu_check.concurrent(1, bb=4096, n=16), 60, table)
    gpu_check.run_section(
        "deadline", lambda: gpu_check.deadline_in_flight(bb=64 << 10, n=64), 60, table
    )
    errors = [r for r in table if r.status == "ERROR"]
    assert not errors, errors
    by = {(r.section, r.what): r for r in table}
    assert by[("small_jobs", "burst of 40 1-block jobs")].status == "PASS"
    assert "ms" in by[("small_jobs", "1-block (4 KiB) job, p99 of 30")].measured
    assert by[("concurrent", "store + load together")].status in ("PASS", "FAIL")
    assert by[("deadline", "streams idle when the failure is reported")].status == "PASS"
    assert any(r.section == "deadline" and "shutdown" in r.what for r in table)


def test_one_way_failing_inside_a_section_leaves_the_others_checked(
    report: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def round_trip(staging: int, raw: bool) -> dict[str, Any]:
        if staging == 3000:
            raise RuntimeError("CUDA error: out of memory")
        return {"ok": True, "copy_path": "batch", "pinned": True}

    monkeypatch.setattr(gpu_check, "check_round_trip", round_trip)
    table: list[Row] = []
    gpu_check.run_section("correctness", gpu_check.correctness, 30, table)
    assert [r.status for r in table] == ["PASS", "ERROR", "PASS"]
    assert table[1].measured == "RuntimeError: CUDA error: out of memory"
    assert gpu_check.verdict(table)[0] == 1


@pytest.mark.parametrize(
    ("available_gib", "cap_s", "timed_gib", "note"),
    [
        (128, 90.0, 64, None),
        (20, 90.0, 15, "available memory"),
        (128, 10.0, 6, "scaled to 6 GiB to fit the section's time cap"),
    ],
)
def test_pool_registration_scales_and_says_so(
    report: Path,
    monkeypatch: pytest.MonkeyPatch,
    available_gib: int,
    cap_s: float,
    timed_gib: int,
    note: str | None,
) -> None:
    gib = 1 << 30
    timed: list[int] = []

    def fake_time_pool(size: int, bb: int) -> dict[str, Any]:
        timed.append(size)
        g = size / gib
        return {
            "bytes": size,
            "alloc_s": 0.5 * g,
            "pin_s": 0.2 * g,
            "unpin_s": 0.1 * g,
            "pinned": True,
            "chunks": 1,
        }

    monkeypatch.setattr(gpu_check, "_time_pool", fake_time_pool)
    monkeypatch.setattr(gpu_check, "_meminfo_available", lambda: available_gib * gib)
    monkeypatch.setattr(gpu_check, "shm_free", lambda path: 200 * gib)
    result = gpu_check.pool_registration(cap_s)
    assert timed == [gib, timed_gib * gib]  # a 1 GiB probe, then the pool timed
    got = [Row(**r) for r in result["rows"]]
    assert [r.status for r in got[:3]] == ["INFO", "PASS", "PASS"]
    assert got[2].measured == "12.8 s"  # 0.2 s per GiB, at 64 GiB
    if note is None:
        assert result["note"] is None
        assert got[1].what == "64 GiB: cudaHostRegister"
    else:
        assert note in result["note"]
        assert "(scaled, see note)" in got[1].what
        assert got[-1].what == "note"


# The device image has torch but not the service's HTTP stack, and only wheels for its own
# Python could be carried there (pydantic-core has none for it here): the check must not
# need any of these.
NOT_ON_THE_DEVICE = (
    "app",
    "fastapi",
    "kvoffload_client",
    "pydantic",
    "pydantic_settings",
    "starlette",
    "structlog",
    "uvicorn",
)


def test_the_device_check_needs_nothing_the_device_image_lacks() -> None:
    blocker = (
        "import importlib.abc, sys\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        f"        if name.split('.')[0] in {NOT_ON_THE_DEVICE!r}:\n"
        "            raise ImportError(f'{name} is not on the device')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import ast, pathlib\n"
        "import bench.gpu_check, bench.gpu_engine_child, testsupport.ipc_child\n"
        "import transfer.cuda_worker, transfer.cudart\n"
        # Imports inside functions (the sections import lazily) are read, not run.
        "for f in ('bench/gpu_check.py', 'bench/gpu_engine_child.py',\n"
        "          'testsupport/ipc_child.py'):\n"
        "    for node in ast.walk(ast.parse(pathlib.Path(f).read_text())):\n"
        "        names = [a.name for a in node.names] if isinstance(node, ast.Import) else (\n"
        "            [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])\n"
        "        for n in names:\n"
        "            __import__(n)\n"
        "print('ok')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", blocker], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "ok"
