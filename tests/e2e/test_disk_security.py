"""The disk tier of a real ``kvoffload serve`` against a local user who could write its files.

- A ``--disk-dir`` others can write (sticky or not) or that belongs to another user: the
  service does not start (exit 2, one line naming the directory and the fix).
- A block forged on disk with the checksum format 1 used (unkeyed xxh3, which anyone can
  recompute): the engine stores blocks until the pool demotes them, the service stops, Mallory
  overwrites one block in ``blocks`` with her bytes and rewrites its index entry as format 1
  would have it, the service starts again and the engine onloads the key. Its device block
  never receives her bytes; the block is dropped and counted as corrupt.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import pytest
import xxhash
from kvoffload_client.client import KVOffloadAdminClient, KVOffloadClient, KVOffloadError

from tests.e2e.test_disk_restart import BLOCK, DEV, disk_server, disk_stats, offload_waves
from tests.e2e.test_startup_refusals import assert_refused, serve
from testsupport.server import TOKEN
from testsupport.shm_device import ShmDevice
from transfer.disk import disk_bytes_for

EVIL = b"EVIL-KV-FROM-MALLORY"
NOBODY = 65534
HEADER = 4096
ENTRY = 128


def refused_start(disk: Path) -> str:
    run = serve(
        *("--disk-dir", str(disk), "--disk-bytes", str(disk_bytes_for(16, BLOCK))),
        *("--block-bytes", str(BLOCK), "--num-blocks", "16", "--device", "cpu"),
    )
    return assert_refused(run, "--disk-dir / KVOFFLOAD_DISK_DIR", str(disk))


@pytest.mark.parametrize("mode", [0o777, 0o1777])
def test_a_disk_dir_others_can_write_stops_the_start(tmp_path: Path, mode: int) -> None:
    disk = tmp_path / "disk"
    disk.mkdir()
    disk.chmod(mode)
    line = refused_start(disk)
    assert f"mode {mode:04o}" in line
    assert f"chmod go-w {disk}" in line
    assert list(disk.iterdir()) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root; CI runs as root")
def test_a_disk_dir_of_another_user_stops_the_start(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    disk.mkdir(mode=0o700)
    os.chown(disk, NOBODY, NOBODY)
    line = refused_start(disk)
    assert f"belongs to uid {NOBODY}" in line
    assert f"chown 0 {disk}" in line


def forge_format_1(disk: Path, key: bytes) -> None:
    """What Mallory does with write access to the files: the block of ``key`` overwritten with
    her bytes, its index entry rewritten with the checksum format 1 used (xxh3-64 of the block
    seeded by the key's, then xxh3-64 of the entry: no secret in either), the newest write."""
    (index_path,) = disk.glob("*/index")
    index = index_path.read_bytes()
    slot = (index.index(key) - HEADER) // ENTRY
    evil = EVIL.ljust(BLOCK, b"!")
    checksum = xxhash.xxh3_64_intdigest(evil, seed=xxhash.xxh3_64_intdigest(key))
    body = struct.pack("<4sHQQ64s", b"KVOE", len(key), 1 << 40, checksum, key)
    entry = (body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body))).ljust(ENTRY, b"\0")
    with open(index_path, "r+b") as f:
        f.seek(HEADER + slot * ENTRY)
        f.write(entry)
    with open(index_path.parent / "blocks", "r+b") as f:
        f.seek(slot * BLOCK)
        f.write(evil)


def onload(c: KVOffloadClient, cache: str, key: bytes, block: int) -> str:
    """Onload ``key`` into device block ``block`` for request ``r``: the job's final state, or
    ``refused <status> <code>`` when the service refuses it at once."""
    try:
        started = c.onload("r", cache, [key], [block])
    except KVOffloadError as exc:
        return f"refused {exc.status} {exc.code}"
    assert started.job_id is not None
    state: str = c.wait_jobs([started.job_id], timeout_s=10).jobs[0].state
    return state


def test_a_block_forged_on_disk_never_reaches_the_device_after_a_restart(tmp_path: Path) -> None:
    work, disk = tmp_path / "work", tmp_path / "disk"
    work.mkdir()
    with (
        disk_server(work, disk).serving() as srv,
        KVOffloadClient(srv.url, timeout=10) as c,
        ShmDevice(DEV, BLOCK) as dev,
    ):
        cache = c.register_kv_cache(dev.spec()).cache_id
        written = offload_waves(c, cache, dev, "w", waves=4)  # 64 blocks into 32
        c.finish_request("w")
    # Stopped (SIGTERM): the queue is written, the index on disk.
    (index_path,) = disk.glob("*/index")
    index = index_path.read_bytes()
    on_disk = [k for k in written if k in index]
    assert len(on_disk) >= 16
    victim, other = on_disk[0], on_disk[1]
    forge_format_1(disk, victim)
    with (
        disk_server(work, disk).serving() as srv,
        KVOffloadClient(srv.url, timeout=10) as c,
        KVOffloadAdminClient(srv.admin_url, token=TOKEN) as admin,
        ShmDevice(DEV, BLOCK) as dev,
    ):
        cache = c.register_kv_cache(dev.spec()).cache_id
        c.start_request("r")
        dev.write(0, b"\0" * BLOCK)
        outcome = onload(c, cache, victim, 0)
        assert EVIL not in dev.read(0)
        assert outcome == "refused 409 key_not_ready"  # on no tier: the engine recomputes it
        assert c.lookup("r", [victim]).results == ["miss"]
        stats = disk_stats(admin)
        assert stats["corrupt_dropped"] == 1
        counters = stats["counters"]
        assert isinstance(counters, dict)
        assert counters["checksum_failures"] == 1
        # Logged once, at start, with the count.
        (logged,) = [line for line in srv.log().splitlines() if "failed their MAC at start" in line]
        assert '"blocks":1' in logged.replace(" ", ""), logged
        # The blocks Mallory did not touch are still served, byte for byte.
        assert onload(c, cache, other, 1) == "done"
        assert dev.read(1) == written[other]
        c.finish_request("r")
