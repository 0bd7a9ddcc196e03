"""The disk tier across restarts of a real ``kvoffload serve`` (CPU, a 32-block pool).

An engine-like client (``KVOffloadClient`` with a registered shm KV cache) offloads blocks of
random bytes, far more than the pool holds, so the pool evicts them to the disk. Then:

- SIGTERM and start again: every demoted block is looked up ``disk`` and comes back through one
  ``onload`` call (no 409) with the bytes written;
- SIGKILL during heavy demotion and start again: every block the restarted server serves holds
  the bytes written under its key (a torn block is dropped, never served); the count is shown.
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import pytest
from kvoffload_client.client import KVOffloadAdminClient, KVOffloadClient

from testsupport.server import TOKEN, ServerProcess
from testsupport.shm_device import ShmDevice
from transfer.disk import disk_bytes_for

BLOCK = 4096
POOL = 32
DEV = 16
SLOTS = 1024
#: The SIGKILL test's blocks: larger, so the kill lands with writes in flight more often.
BIG = 64 * 1024


def disk_server(workdir: Path, disk_dir: Path, block: int = BLOCK) -> ServerProcess:
    disk_bytes = disk_bytes_for(SLOTS, block)
    return ServerProcess(
        workdir,
        *("--num-blocks", str(POOL), "--block-bytes", str(block)),
        *("--disk-dir", str(disk_dir), "--disk-bytes", str(disk_bytes)),
        *("--disk-admit-after", "1", "--disk-batch-bytes", str(16 * block)),
    )


@pytest.fixture
def dirs(tmp_path: Path) -> tuple[Path, Path]:
    work, disk = tmp_path / "work", tmp_path / "disk"
    work.mkdir()
    return work, disk


def offload_waves(
    c: KVOffloadClient, cache: str, dev: ShmDevice, req: str, waves: int
) -> dict[bytes, bytes]:
    """``waves`` offloads of the whole device cache, fresh keys and random bytes each."""
    written: dict[bytes, bytes] = {}
    c.start_request(req)
    for _ in range(waves):
        keys = [os.urandom(16) for _ in range(DEV)]
        for i, key in enumerate(keys):
            data = os.urandom(BLOCK)
            dev.write(i, data)
            written[key] = data
        started = c.offload(req, cache, keys, list(range(DEV)))
        assert started.job_id is not None
        waited = c.wait_jobs([started.job_id], timeout_s=10)
        assert waited.done
        assert waited.jobs[0].state == "done", waited
    return written


def onload_all(
    c: KVOffloadClient, cache: str, dev: ShmDevice, req: str, keys: list[bytes], block: int = BLOCK
) -> list[tuple[bytes, str, bytes]]:
    """Onload ``keys`` DEV at a time, one call each; per key: (key, job state, device bytes)."""
    out: list[tuple[bytes, str, bytes]] = []
    for at in range(0, len(keys), DEV):
        chunk = keys[at : at + DEV]
        for i in range(len(chunk)):
            dev.write(i, b"\0" * block)
        started = c.onload(req, cache, chunk, list(range(len(chunk))))
        assert started.job_id is not None
        waited = c.wait_jobs([started.job_id], timeout_s=10)
        assert waited.done
        state = waited.jobs[0].state
        out.extend((k, state, dev.read(i)) for i, k in enumerate(chunk))
    return out


def disk_stats(admin: KVOffloadAdminClient) -> dict[str, object]:
    disk: dict[str, object] = admin.stats()["tiers"]["disk"]
    return disk


def found_again(
    c: KVOffloadClient, admin: KVOffloadAdminClient, dev: ShmDevice, keys: list[bytes]
) -> tuple[str, list[str], list[bytes]]:
    """After a restart: register ``dev``, start request ``r`` and look ``keys`` up; the cache
    id, the answers and the keys answered ``disk``, which must be exactly the blocks the tier
    says it restored."""
    restored = disk_stats(admin)["restored"]
    assert isinstance(restored, int)
    cache = c.register_kv_cache(dev.spec()).cache_id
    c.start_request("r")
    results = c.lookup("r", keys).results
    on_disk = [k for k, r in zip(keys, results, strict=True) if r == "disk"]
    assert len(on_disk) == restored
    return cache, results, on_disk


def test_sigterm_then_restart_serves_every_demoted_block_in_one_onload(
    dirs: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    work, disk = dirs
    with (
        disk_server(work, disk).serving() as srv,
        KVOffloadClient(srv.url, timeout=10) as c,
        KVOffloadAdminClient(srv.admin_url, token=TOKEN) as admin,
        ShmDevice(DEV, BLOCK) as dev,
    ):
        cache = c.register_kv_cache(dev.spec()).cache_id
        written = offload_waves(c, cache, dev, "w", waves=12)  # 192 blocks into 32
        c.finish_request("w")
        before = disk_stats(admin)
    # Stopped by SIGTERM (exit 0 checked by serving()); the queue was written on the way out.
    with (
        disk_server(work, disk).serving() as srv,
        KVOffloadClient(srv.url, timeout=10) as c,
        KVOffloadAdminClient(srv.admin_url, token=TOKEN) as admin,
        ShmDevice(DEV, BLOCK) as dev,
    ):
        cache, results, on_disk = found_again(c, admin, dev, list(written))
        restored = len(on_disk)
        assert set(results) <= {"disk", "miss"}
        # Everything the pool evicted went down (admit after 1, no faults): 192 - 32 at least.
        assert restored >= len(written) - POOL
        got = onload_all(c, cache, dev, "r", on_disk)
        assert [state for _, state, _ in got] == ["done"] * len(on_disk)
        assert all(data == written[k] for k, _, data in got)
        c.finish_request("r")
        after = disk_stats(admin)
    with capsys.disabled():
        print(
            f"\n[disk restart] stored {len(written)}, demoted {before['demotions']}, "
            f"restored {restored}, onloaded {len(got)} with identical bytes, "
            f"promotions {after['promotions']}"
        )


def test_sigkill_during_heavy_demotion_never_serves_a_torn_block(
    dirs: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    work, disk = dirs
    srv = disk_server(work, disk, BIG).start()
    written: dict[bytes, bytes] = {}
    errors: list[BaseException] = []
    try:
        with (
            KVOffloadClient(srv.url, timeout=10) as c,
            KVOffloadAdminClient(srv.admin_url, token=TOKEN) as admin,
            ShmDevice(DEV, BIG) as dev,
        ):
            cache = c.register_kv_cache(dev.spec()).cache_id
            stop = threading.Event()

            def engine() -> None:
                try:
                    c.start_request("w")
                    for _ in range(400):  # bounded; stopped by the kill well before
                        if stop.is_set():
                            return
                        keys = [os.urandom(16) for _ in range(DEV)]
                        for i, key in enumerate(keys):
                            data = os.urandom(BIG)
                            dev.write(i, data)
                            written[key] = data
                        started = c.offload("w", cache, keys, list(range(DEV)))
                        if started.job_id is not None:
                            c.wait_jobs([started.job_id], timeout_s=10)
                except BaseException as exc:  # the kill cuts it off mid call
                    errors.append(exc)

            thread = threading.Thread(target=engine, daemon=True)
            thread.start()
            # Kill once the disk has taken a good number of blocks, while demotions run.
            last: dict[str, object] = {}
            for _ in range(600):
                last = disk_stats(admin)
                demoted = last["demotions"]
                assert isinstance(demoted, dict)
                if demoted["written"] >= 150:
                    break
                stop.wait(0.02)
            assert srv.proc is not None
            srv.proc.send_signal(signal.SIGKILL)
            srv.proc.wait(10)
            stop.set()
            thread.join(20)
            assert not thread.is_alive()
    finally:
        srv.kill()
    assert len(written) > 150
    with (
        disk_server(work, disk, BIG).serving() as srv2,
        KVOffloadClient(srv2.url, timeout=10) as c,
        KVOffloadAdminClient(srv2.admin_url, token=TOKEN) as admin,
        ShmDevice(DEV, BIG) as dev,
    ):
        cache, _, on_disk = found_again(c, admin, dev, list(written))
        restored = len(on_disk)
        assert restored >= 100
        got = onload_all(c, cache, dev, "r", on_disk, BIG)
        served = [(k, data) for k, state, data in got if state == "done"]
        # Never a wrong byte: every block served is the one written under its key.
        assert all(data == written[k] for k, data in served)
        failed = len(got) - len(served)
        stats = disk_stats(admin)
        c.finish_request("r")
    with capsys.disabled():
        print(
            f"\n[disk SIGKILL] offloaded {len(written)} keys, last stats before the kill: "
            f"demotions {last['demotions']} queue {last['queue']}; restored {restored}, "
            f"served {len(served)} identical, failed {failed} jobs' keys, "
            f"corrupt_dropped {stats['corrupt_dropped']}, counters {stats['counters']}"
        )
