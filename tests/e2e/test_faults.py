"""Faults against real ``kvoffload serve`` processes: what breaks, and that nothing leaks.

- Transfer failures and deadline overruns (the fault-injecting backend, selected by settings):
  jobs end ``failed`` with their reason, failed stores are dropped, no pin or pending store is
  left, the blocks that did move hold the right bytes.
- An engine process killed while holding pins and pending stores: its lease expires and the
  service takes everything back.
- Clients that hang up mid-call (an abandoned long-poll, a body cut off, headers cut off): the
  server stays up, healthy and consistent, and logs no traceback.
- SIGTERM with jobs in flight: ``/readyz`` turns 503 first, long-polls answer at once, jobs that
  can finish during the drain finish, the process exits 0; with jobs that cannot finish, it
  still exits 0 within its grace period.
- SIGKILL, then a restart on the same ports and socket: the new process starts clean (no block,
  request, cache or job of the old one), its host pool never had a name in ``/dev/shm``, and
  clients get clear 404s for the old ids.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from kvoffload_client.client import KVOffloadAdminClient, KVOffloadClient, KVOffloadError

from tests.load import wire
from testsupport.polling import until
from testsupport.server import ROOT, TOKEN, ServerProcess
from testsupport.shm_device import ShmDevice

BLOCK = 4096
NUM_BLOCKS = 256  # ServerProcess's pool


def blocks(admin: KVOffloadAdminClient) -> dict[str, int]:
    counts: dict[str, int] = admin.stats()["blocks"]
    assert counts["free"] + counts["pending"] + counts["ready"] == counts["num_blocks"], counts
    return counts


def at_rest(admin: KVOffloadAdminClient) -> dict[str, Any]:
    """Stats once nothing is pinned, pending or running (fails if that does not come)."""

    def idle() -> dict[str, Any] | None:
        st = admin.stats()
        b = st["blocks"]
        return st if (b["pinned"], b["pending"], st["jobs"]["running"]) == (0, 0, 0) else None

    stats: dict[str, Any] = until("nothing pinned, pending or running", idle, 10)
    return stats


def clean_log(srv: ServerProcess) -> None:
    log = srv.log()
    assert "Traceback" not in log, log
    assert "unhandled error" not in log, log


def shm_names() -> set[str]:
    return set(os.listdir("/dev/shm"))


@pytest.fixture(scope="module")
def faulty(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """Half the jobs misbehave: 30% fail at once, 20% hang until their 0.5 s deadline."""
    with ServerProcess(
        tmp_path_factory.mktemp("faulty"),
        *("--fault-fail-rate", "0.3", "--fault-hang-rate", "0.2", "--fault-seed", "7"),
        *("--job-deadline-s", "0.5", "--lease-ttl-s", "1.5", "--lease-check-interval-s", "0.1"),
    ).serving() as srv:
        yield srv
    clean_log(srv)


@pytest.fixture(scope="module")
def slow(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """Every job starts 1 s late (long-polls have something to wait for)."""
    with ServerProcess(
        tmp_path_factory.mktemp("slow"),
        *("--fault-delay-s", "1.0", "--job-deadline-s", "5", "--lease-ttl-s", "10"),
    ).serving() as srv:
        yield srv
    clean_log(srv)


# --------------------------------------------------------------------------- transfer faults


def test_failed_and_overdue_transfers_drop_their_stores_and_release_their_pins(
    faulty: ServerProcess,
) -> None:
    """Injected failures and deadline overruns end jobs ``failed`` with their reason; the
    manager drops the failed stores and unpins the failed loads; what did move is right."""
    with (
        KVOffloadClient(faulty.url, timeout=10) as c,
        KVOffloadAdminClient(faulty.admin_url, token=TOKEN) as admin,
        ShmDevice(16, BLOCK) as dev,
    ):
        cache = c.register_kv_cache(dev.spec()).cache_id
        before = admin.stats()["counters"]
        c.start_request("faults")
        stored: dict[bytes, bytes] = {}  # key -> bytes, for every store that succeeded
        store_jobs: dict[int, list[bytes]] = {}
        for wave in range(6):  # 6 waves of 8 two-block stores over the 16 device blocks
            ids = []
            for j in range(8):
                keys = [os.urandom(16), os.urandom(16)]
                data = [dev.fill(2 * j + i, seed=wave * 100 + 2 * j + i) for i in range(2)]
                started = c.offload("faults", cache, keys, [2 * j, 2 * j + 1])
                assert started.job_id is not None
                assert started.keys_to_store == keys
                store_jobs[started.job_id] = keys
                ids.append(started.job_id)
                for k, d in zip(keys, data, strict=True):
                    stored[k] = d
            waited = c.wait_jobs(ids, timeout_s=10)
            assert waited.done, waited
            for job in waited.jobs:
                if job.state == "failed":
                    for k in store_jobs[job.job_id]:
                        del stored[k]

        outcomes = Counter(c.job(j).reason or c.job(j).state for j in store_jobs)
        assert outcomes["injected failure"] > 0, outcomes
        assert outcomes["deadline"] > 0, outcomes
        assert outcomes["done"] > 0, outcomes
        assert set(outcomes) == {"done", "injected failure", "deadline"}, outcomes
        for job_id, keys in store_jobs.items():
            job = c.job(job_id)
            expected = "hit" if job.state == "done" else "miss"
            assert c.lookup("faults", keys).results == [expected] * 2, job
            assert job.bytes == (2 * BLOCK if job.state == "done" else 0)

        # Loads of the stored blocks, through the same faults: failed loads unpin too.
        keys = list(stored)
        load_outcomes: Counter[str] = Counter()
        for i in range(0, len(keys), 16):
            part = keys[i : i + 16]
            started = c.onload("faults", cache, part, range(len(part)))
            assert started.job_id is not None
            job = c.wait_jobs([started.job_id], timeout_s=10).jobs[0]
            load_outcomes[job.reason or job.state] += 1
            if job.state == "done":
                assert [dev.read(b) for b in range(len(part))] == [stored[k] for k in part]
        print(f"store jobs {dict(outcomes)}, load jobs {dict(load_outcomes)}")
        assert load_outcomes["done"] > 0, load_outcomes
        assert set(load_outcomes) <= {"done", "injected failure", "deadline"}, load_outcomes

        c.finish_request("faults")
        stats = at_rest(admin)
        b = stats["blocks"]
        assert b["pinned"] == b["pending"] == 0
        assert b["free"] + b["ready"] == NUM_BLOCKS
        failed_keys = 2 * (outcomes["injected failure"] + outcomes["deadline"])
        counters = stats["counters"]
        assert counters["stores_failed"] - before["stores_failed"] == failed_keys
        assert counters["stores_completed"] - before["stores_completed"] == 2 * outcomes["done"]
        assert admin.requests()["total"] == 0
        c.unregister_kv_cache(cache)


ENGINE = textwrap.dedent(
    """
    import os, signal, sys
    from kvoffload_client.client import KVOffloadClient
    url, ready, new = sys.argv[1], sys.argv[2].split(","), sys.argv[3].split(",")
    with KVOffloadClient(url) as c:
        c.start_request("doomed")
        c.prepare_load("doomed", [bytes.fromhex(k) for k in ready])
        c.prepare_store("doomed", [bytes.fromhex(k) for k in new])
        print("holding", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """
)


def test_an_engine_killed_holding_pins_gets_them_taken_back(faulty: ServerProcess) -> None:
    """A real engine process pins two ready blocks, reserves two stores, and is SIGKILLed: the
    lease TTL (1.5 s) frees all four; the ready blocks stay, the reserved ones are dropped."""
    ready = [os.urandom(16), os.urandom(16)]
    new = [os.urandom(16), os.urandom(16)]
    with (
        KVOffloadClient(faulty.url, timeout=10) as c,
        KVOffloadAdminClient(faulty.admin_url, token=TOKEN) as admin,
    ):
        c.start_request("setup")
        spec = c.prepare_store("setup", ready)  # the engine-copy path: no transfer job
        c.complete_store("setup", spec.keys_to_store)
        c.finish_request("setup")
        forced = admin.stats()["counters"]["forced_lease_releases"]

        engine = subprocess.run(
            [
                sys.executable,
                "-c",
                ENGINE,
                faulty.url,
                *(",".join(k.hex() for k in ks) for ks in (ready, new)),
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert engine.returncode == -signal.SIGKILL, engine.stderr
        assert "holding" in engine.stdout
        counts = blocks(admin)
        assert (counts["pinned"], counts["pending"]) == (2, 2), counts
        held = {r["req_id"]: r for r in admin.requests()["requests"]}["doomed"]
        assert sorted(held["pins"]) == sorted(k.hex() for k in ready)
        assert sorted(held["pending_stores"]) == sorted(k.hex() for k in new)

        until(
            "nothing pinned or pending",
            lambda: blocks(admin)["pinned"] == 0 and blocks(admin)["pending"] == 0,
            10,
        )
        stats = admin.stats()
        assert stats["counters"]["forced_lease_releases"] == forced + 1
        assert "doomed" not in {r["req_id"] for r in admin.requests()["requests"]}
        c.start_request("after")
        assert c.lookup("after", ready + new).results == ["hit", "hit", "miss", "miss"]
        c.finish_request("after")
        with pytest.raises(KVOffloadError) as info:
            c.lookup("doomed", ready)
        assert (info.value.status, info.value.code) == (404, "unknown_request")


# --------------------------------------------------------------------------- disconnects


def _running_store(c: KVOffloadClient, cache: str, dev: ShmDevice, req_id: str) -> int:
    key = os.urandom(16)
    dev.fill(0, seed=int.from_bytes(key[:4], "little"))
    started = c.offload(req_id, cache, [key], [0])
    assert started.job_id is not None
    assert started.state == "running"
    return started.job_id


def test_abandoned_long_polls_leave_the_server_healthy(slow: ServerProcess) -> None:
    """Twenty ``POST /v1/jobs/wait`` long-polls torn down (RST) mid-wait, and one closed
    politely: the job still finishes, the server answers, nothing is left behind."""
    with (
        KVOffloadClient(slow.url, timeout=10) as c,
        KVOffloadAdminClient(slow.admin_url, token=TOKEN) as admin,
        ShmDevice(4, BLOCK) as dev,
    ):
        cache = c.register_kv_cache(dev.spec()).cache_id
        c.start_request("poll")
        job_id = _running_store(c, cache, dev, "poll")
        body = json.dumps({"job_ids": [job_id], "timeout_s": 20}).encode()
        hdrs = {"Content-Type": "application/json", "Content-Length": str(len(body))}
        socks = []
        for _ in range(21):
            sock = wire.connect(slow.url)
            sock.sendall(wire.head("POST", "/v1/jobs/wait", hdrs) + body)
            socks.append(sock)
        time.sleep(0.3)
        for sock in socks[:-1]:
            wire.reset(sock)
        socks[-1].shutdown(socket.SHUT_RDWR)
        socks[-1].close()

        assert c.ready()
        waited = c.wait_jobs([job_id], timeout_s=10)
        assert (waited.done, waited.jobs[0].state) == (True, "done")
        c.finish_request("poll")
        stats = at_rest(admin)
        assert stats["live_requests"] == 0
        c.unregister_kv_cache(cache)
    clean_log(slow)


def test_bodies_and_headers_cut_off_mid_upload_leave_the_server_healthy(
    slow: ServerProcess,
) -> None:
    """A 4 MiB upload cut off after 256 KiB (announced length), a chunked upload cut off mid
    chunk, and headers cut off mid line, each torn down: every later call is answered and the
    cut-off calls changed nothing."""
    payload = b'{"keys":["' + b"00" * 2_000_000 + b'"]}'
    cuts: list[bytes] = [
        wire.head(
            "POST",
            "/v1/requests/cut/prepare-store",
            {"Content-Type": "application/json", "Content-Length": str(len(payload))},
        )
        + payload[: 256 * 1024],
        wire.head(
            "POST",
            "/v1/batch",
            {"Content-Type": "application/json", "Transfer-Encoding": "chunked"},
        )
        + b"10000\r\n"
        + b"[" * 30000,
        b"PUT /v1/requests/cut HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Le",
    ]
    with (
        KVOffloadClient(slow.url, timeout=10) as c,
        KVOffloadAdminClient(slow.admin_url, token=TOKEN) as admin,
    ):
        before = blocks(admin)
        for raw in cuts * 3:
            sock = wire.connect(slow.url)
            sock.sendall(raw)
            time.sleep(0.05)
            wire.reset(sock)
        assert c.ready()
        assert c.start_request("after-cuts") is True
        assert c.lookup("after-cuts", [b"\x01"]).results == ["miss"]
        c.finish_request("after-cuts")
        assert blocks(admin) == before
        assert "cut" not in {r["req_id"] for r in admin.requests()["requests"]}
    clean_log(slow)


def test_a_cancelled_async_long_poll_leaves_the_server_healthy(slow: ServerProcess) -> None:
    """The async client's long-poll cancelled by the caller (task cancellation closes the
    connection): the job still completes and later calls are answered."""
    import asyncio

    from kvoffload_client.client import AsyncKVOffloadClient

    with KVOffloadClient(slow.url, timeout=10) as c, ShmDevice(4, BLOCK) as dev:
        cache = c.register_kv_cache(dev.spec()).cache_id
        c.start_request("cancel")
        job_id = _running_store(c, cache, dev, "cancel")

        async def abandon() -> None:
            async with AsyncKVOffloadClient(slow.url, timeout=30) as ac:
                with pytest.raises(TimeoutError):
                    async with asyncio.timeout(0.2):
                        await ac.wait_jobs([job_id], timeout_s=20)
                assert await ac.ready()

        asyncio.run(abandon())
        assert c.wait_jobs([job_id], timeout_s=10).jobs[0].state == "done"
        c.finish_request("cancel")
        c.unregister_kv_cache(cache)
    clean_log(slow)


# --------------------------------------------------------------------------- signals


def test_sigterm_drains_then_exits_cleanly(tmp_path: Path) -> None:
    """SIGTERM with three store jobs in flight and a long-poll on them: ``/readyz`` is 503
    at once, the long-poll answers at once (``done`` false), calls are still served during the
    2 s drain, the jobs finish during it, and the process exits 0 without a traceback."""
    srv = ServerProcess(
        tmp_path,
        *("--fault-delay-s", "1.0", "--job-deadline-s", "5", "--lease-ttl-s", "10"),
        *("--shutdown-delay-s", "2.0", "--shutdown-grace-s", "3", "--log-level", "info"),
    ).start()
    assert srv.proc is not None
    try:
        with KVOffloadClient(srv.url, timeout=10) as c, ShmDevice(4, BLOCK) as dev:
            cache = c.register_kv_cache(dev.spec()).cache_id
            c.start_request("drain")
            keys = [os.urandom(16) for _ in range(3)]
            for b in range(3):
                dev.fill(b, seed=b)
            ids = []
            for b, key in enumerate(keys):
                started = c.offload("drain", cache, [key], [b])
                assert started.job_id is not None
                ids.append(started.job_id)
            with (
                concurrent.futures.ThreadPoolExecutor(1) as pool,
                KVOffloadClient(srv.url, timeout=30) as poller,
            ):
                poll = pool.submit(poller.wait_jobs, ids, 20)
                time.sleep(0.2)
                srv.proc.send_signal(signal.SIGTERM)
                until("the service not ready", lambda: not c.ready(), 2)
                waited = poll.result(timeout=2)
            assert waited.done is False  # answered by the drain, not by the jobs
            assert c.lookup("drain", keys).results  # still served while draining

            def ended() -> list[str] | None:
                states: list[str] = [c.job(j).state for j in ids]
                return None if "running" in states else states

            assert until("the jobs ended", ended, 3) == ["done", "done", "done"]
        status = srv.proc.wait(timeout=20)
    finally:
        srv.kill()
    log = srv.log()
    assert status == 0, log
    assert "shutdown requested" in log, log
    assert "service stopped" in log, log
    assert "Traceback" not in log, log
    assert not srv.uds.exists()


def test_sigterm_with_jobs_that_never_finish_still_exits_cleanly(tmp_path: Path) -> None:
    """Every job hangs (deadline 20 s): SIGTERM still ends the process with status 0 within
    its grace period, failing the jobs instead of waiting for them."""
    srv = ServerProcess(
        tmp_path,
        *("--fault-hang-rate", "1", "--job-deadline-s", "20", "--lease-ttl-s", "30"),
        *("--shutdown-grace-s", "1", "--log-level", "info"),
    ).start()
    assert srv.proc is not None
    try:
        with KVOffloadClient(srv.url, timeout=10) as c, ShmDevice(4, BLOCK) as dev:
            cache = c.register_kv_cache(dev.spec()).cache_id
            c.start_request("stuck")
            ids = [c.offload("stuck", cache, [os.urandom(8)], [b]).job_id for b in range(2)]
            assert all(c.job(j).state == "running" for j in ids if j is not None)
        srv.proc.send_signal(signal.SIGTERM)
        status = srv.proc.wait(timeout=15)
    finally:
        srv.kill()
    log = srv.log()
    assert status == 0, log
    assert "service stopped" in log, log
    assert "Traceback" not in log, log


def _pool_fd_target(pid: int, pool_path: str) -> str:
    fd = pool_path.rsplit("/", 1)[1]
    return os.readlink(f"/proc/{pid}/fd/{fd}")


def test_sigkill_then_restart_starts_clean(tmp_path: Path) -> None:
    """SIGKILL mid-work, restart on the same ports and Unix socket: the old pool never had a
    name in /dev/shm (nothing left behind), and the new process knows nothing of the old one's
    blocks, requests, caches or jobs: clear 404s, ``fell_behind`` for an old event cursor."""
    shm_before = shm_names()
    old = ServerProcess(tmp_path, "--log-level", "info").start()
    assert old.proc is not None
    with (
        KVOffloadClient(old.url, timeout=10) as c,
        ShmDevice(8, BLOCK) as dev,
    ):
        pool = c.pool()
        target = _pool_fd_target(old.proc.pid, pool.path)
        assert target.startswith("/memfd:kvoffload"), target  # a sealed memfd: no name
        assert target.endswith("(deleted)"), target
        cache = c.register_kv_cache(dev.spec()).cache_id
        c.start_request("old")
        keys = [os.urandom(16) for _ in range(4)]
        for b in range(4):
            dev.fill(b, seed=b)
        job_id = c.offload("old", cache, keys, range(4)).job_id
        assert job_id is not None
        assert c.wait_jobs([job_id], 10).jobs[0].state == "done"
        c.prepare_load("old", keys[:2])  # pinned when the process dies
        events = c.events()
        assert events.latest_seq > 0

        old.proc.kill()
        assert old.proc.wait(10) == -signal.SIGKILL
        leftovers = {
            n for n in shm_names() - shm_before if n.startswith("kvoffload") and "test" not in n
        }
        assert leftovers == set()

        new = ServerProcess(tmp_path, "--port", str(old.port), "--admin-port", str(old.admin_port))
        new.port, new.admin_port, new.url, new.admin_url = (
            old.port,
            old.admin_port,
            old.url,
            old.admin_url,
        )
        new.start()
        try:
            assert c.ready()  # same client, same address: a new process answers
            with KVOffloadAdminClient(new.admin_url, token=TOKEN) as admin:
                stats = admin.stats()
            assert stats["blocks"] == {
                "num_blocks": NUM_BLOCKS,
                "free": NUM_BLOCKS,
                "pending": 0,
                "ready": 0,
                "pinned": 0,
            }
            assert (stats["live_requests"], stats["kv_caches"]) == (0, 0)
            for call, code in [
                (lambda: c.job(job_id), "unknown_job"),
                (lambda: c.lookup("old", keys), "unknown_request"),
                (lambda: c.finish_request("old"), "unknown_request"),
                (lambda: c.complete_load("old", keys[:2]), "unknown_request"),
                (lambda: c.unregister_kv_cache(cache), "unknown_cache"),
            ]:
                with pytest.raises(KVOffloadError) as info:
                    call()
                assert (info.value.status, info.value.code) == (404, code)
            c.start_request("new")
            with pytest.raises(KVOffloadError) as info:
                c.onload("new", cache, keys[:1], [0])
            assert (info.value.status, info.value.code) == (404, "unknown_cache")
            assert c.lookup("new", keys).results == ["miss"] * 4
            page = c.events(after=events.latest_seq)
            assert page.instance != events.instance
            assert page.fell_behind is True
            # The Unix socket of the killed process was stale and has been replaced.
            with KVOffloadClient(uds=str(new.uds), timeout=10) as over_uds:
                assert over_uds.ready()
            status = new.stop()
        finally:
            new.kill()
    assert status == 0, new.log()
    assert "Traceback" not in new.log(), new.log()
    with httpx.Client(timeout=2) as probe, pytest.raises(httpx.TransportError):
        probe.get(f"{new.url}/livez")
