"""Load and soak: simulated engines, a live operator and faults against one real server.

``test_load`` (CI) runs 32 engines (in 2 worker processes) for at most 20 s (or 300 request
lives each) against a ``kvoffload serve`` on 127.0.0.1 with a pool of 1024 blocks (a fraction
of the key space: heavy eviction), a 3 s lease TTL (vanished engines' leases come back during
the run) and 2% injected transfer failures; the operator switches the eviction policy every
second through every registered policy and clears the cache once. ``test_soak`` is the same run
for ``KVOFFLOAD_SOAK_SECONDS`` with ``KVOFFLOAD_SOAK_ENGINES`` engines (default 64) in
``KVOFFLOAD_SOAK_PROCESSES`` processes (default 2); it is skipped unless the duration is set
(see ``tests/load/README.md``). The driver is ``testsupport/load_sim.py``.

What a run must show: no server error (5xx; 507 ``no_space`` is the documented answer of a store
that finds nothing evictable, counted apart); no refusal but the expected ones (409 for a hit
evicted before its load, 507); every loaded byte right; no block lost (every block the events
report stored and not removed is still a hit, and the ready count equals that set); no lease left
once every request has finished or expired (``pinned == pending == 0``, ``free + ready ==
num_blocks``, no live request); the policy switched to every registered policy; no secret in any
answer; the server's RSS after warm-up grows by at most ``RSS_GROWTH_BOUND_MIB``; a clean exit.
"""

from __future__ import annotations

import asyncio
import os
import secrets
from pathlib import Path

import pytest

from testsupport.load_sim import LoadConfig, LoadReport, Target, run_load
from testsupport.server import TOKEN, ServerProcess

# Growth of the server's RSS between the end of warm-up (the first 30% of the run) and its peak
# over the rest of the run and the quiescent end. Every buffer the service keeps is bounded
# (finished jobs, KV events, request records), and the server is configured below so that they
# fill up during warm-up: growth past this bound is a leak.
RSS_GROWTH_BOUND_MIB = 48
LEASE_TTL_S = 3.0
NUM_BLOCKS = 1024
SERVER_ARGS = (
    "--num-blocks",
    str(NUM_BLOCKS),
    "--block-bytes",
    "4096",
    "--lease-ttl-s",
    str(LEASE_TTL_S),
    "--job-deadline-s",
    "2",
    "--lease-check-interval-s",
    "0.2",
    "--max-finished-jobs",
    "2000",
    "--event-buffer-size",
    "16384",
    "--fault-fail-rate",
    "0.02",
    "--fault-seed",
    "11",
)
SOAK_SECONDS = float(os.environ.get("KVOFFLOAD_SOAK_SECONDS") or 0)
SOAK_ENGINES = int(os.environ.get("KVOFFLOAD_SOAK_ENGINES") or 64)
SOAK_PROCESSES = int(os.environ.get("KVOFFLOAD_SOAK_PROCESSES") or 2)


def secret_values(server: ServerProcess) -> tuple[str, ...]:
    """What no answer may contain: the token, and every distinctive value of the server's
    environment (16 characters or more: paths, the canary, anything credential-like)."""
    values = {v for v in server.env.values() if len(v) >= 16}
    return (TOKEN, *sorted(values))


def run_against_server(tmp_path: Path, cfg: LoadConfig) -> tuple[LoadReport, int, str]:
    """Start a server, drive ``cfg`` against it, stop it: (report, exit status, server log)."""
    canary = "canary-" + secrets.token_hex(16)
    srv = ServerProcess(tmp_path, *SERVER_ARGS, env={"LOAD_CANARY_SECRET": canary}).start()
    try:
        assert srv.proc is not None
        target = Target(srv.url, srv.admin_url, TOKEN, srv.proc.pid, secret_values(srv))
        report = asyncio.run(run_load(target, cfg))
        print(report.summary())
        status = srv.stop()
    finally:
        srv.kill()
    return report, status, srv.log()


def assert_held(report: LoadReport, status: int, log: str) -> None:
    """The end-state checks shared by the load and soak tests (see the module docstring)."""
    assert report.server_errors == 0, report.summary()
    assert report.problems == [], "\n".join(report.problems) + "\n" + report.summary()
    assert report.blocks_lost == 0, report.summary()
    assert report.final_blocks["pinned"] == 0
    assert report.final_blocks["pending"] == 0
    assert report.final_blocks["free"] + report.final_blocks["ready"] == NUM_BLOCKS
    assert report.live_requests == 0
    assert report.leaks == [], report.leaks
    # The run did what it claims: every life kind, loads checked, every policy, one clear.
    assert {"finish", "abort", "vanish"} <= set(report.lives), report.summary()
    assert report.lives["failed"] == 0
    assert report.blocks_verified > 0
    assert set(report.switches) == set(report.policies), report.summary()
    assert report.clear is not None
    assert "dropped" in report.clear, report.clear
    assert any("injected failure" in kind for kind in report.jobs), report.summary()
    assert report.rss_growth_mib <= RSS_GROWTH_BOUND_MIB, report.summary()
    assert status == 0, log
    assert "Traceback" not in log, log


@pytest.mark.slow
def test_load(tmp_path: Path) -> None:
    """32 engines, <= 20 s: no 5xx, no block lost, no lease leaked, bounded memory."""
    cfg = LoadConfig(engines=32, processes=2, seconds=20.0, max_requests=300, seed=1234)
    report, status, log = run_against_server(tmp_path, cfg)
    assert_held(report, status, log)


@pytest.mark.skipif(
    not SOAK_SECONDS, reason="soak run: set KVOFFLOAD_SOAK_SECONDS (tests/load/README.md)"
)
@pytest.mark.timeout(int(SOAK_SECONDS) + 300)
def test_soak(tmp_path: Path) -> None:
    """The load test for ``KVOFFLOAD_SOAK_SECONDS`` with ``KVOFFLOAD_SOAK_ENGINES`` engines."""
    cfg = LoadConfig(
        engines=SOAK_ENGINES,
        processes=SOAK_PROCESSES,
        seconds=SOAK_SECONDS,
        max_requests=1 << 30,
        seed=int(os.environ.get("KVOFFLOAD_SOAK_SEED") or 4321),
        switch_every_s=3.0,
        warmup=min(0.3, max(0.1, 60.0 / SOAK_SECONDS)),
    )
    report, status, log = run_against_server(tmp_path, cfg)
    assert_held(report, status, log)
