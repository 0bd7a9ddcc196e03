"""The disk tier (#19): onload and demotion GB/s against raw O_DIRECT; hit ratio after a restart.

Part (a), bytes: for each block size, ``--mib`` MiB of blocks per timed call, medians of
``--repeats``, raw and tier interleaved in each round, the page cache dropped (``sync``; ``echo 3 >
/proc/sys/vm/drop_caches``, root only) before every timed read:

- raw O_DIRECT (the baseline): a plain file in the same directory opened ``O_DIRECT``, one
  ``os.pwrite`` / ``os.preadv`` per block from / into page-aligned buffers, on as many threads as
  the store has I/O threads (``--threads``, the service default 4);
- the store: ``DiskStore.write_many`` of blocks already staged (demotion), ``DiskStore.read_many``
  into pool slots (through its read buffers) with the MAC check (promotion's bytes);
- the service: an in-process ``Service`` (the API apps over ASGI, as the tests run it) with a disk
  tier and a registered shm CPU KV cache, its blocks random bytes: one ``onload`` of N keys that
  only the disk holds, timed to the end of its job (the promotion from disk into the pool, read
  in ``--disk-batch-bytes`` chunks, each copied on to the device while the next is read); and the
  demotion of N evicted blocks, timed from the ``prepare-store`` that evicts them to the last one
  written. Its baseline, in the same rounds and in alternating order: raw O_DIRECT reads (one
  ``os.preadv`` per block, ``--threads`` threads) of N other blocks the tier demoted, never read
  since, from the tier's own blocks file into the service's own pool slots, so both sides read
  the same file's extents into the same memory.
- fio (Debian's ``fio``; issue #32), the targets' denominator, in the same service rounds, on
  the same filesystem (``--dir``): a file of its own of N blocks, ``--direct=1``,
  ``--ioengine=libaio`` at ``--iodepth`` = ``--threads`` (the requests the tier keeps in
  flight; ``psync`` with that many threads where fio lacks libaio), ``--bs`` = the block size:
  sequential and random reads next to each onload (rotating order with the raw reads), and
  sequential and random writes (over the file's written extents) and a sequential write into
  a file made afresh (fio allocates it first, as the tier preallocates: unwritten extents, as a
  tier's first fill writes) next to each demotion (alternating order). A demotion here is one
  ``prepare-store`` that evicts N blocks, timed to the last of them written; the bytes are made
  once, untimed, so no fill on the event loop is timed with it. Targets: onload >= 0.8x fio's
  sequential read, demotion >= 0.8x fio's sequential write, each the median of the per-round
  ratios (fio seconds / tier seconds). Without fio (or with ``--no-fio``) the bench says so and
  leaves those columns out. The earlier target, onload >= 0.8x the raw per-block reads, is
  still printed.

Part (b), inside vLLM (needs vLLM 0.33, ``.venv-vllm``): the trace's first ``--b-requests``
requests alternating over two engines, each vLLM 0.33's own ``TieringOffloadingManager`` with a
``--b-primary-chunks`` CPU primary tier, driven as vLLM's scheduler drives it
(``bench/vllm_tier.py``'s replay, ``testsupport/vllm_sim.py``), with as secondary tier: a real
``kvoffload serve`` of ``--b-pool-blocks`` 4 KiB blocks alone; the same with its disk tier
(``--disk-dir`` under ``--dir``, ``--disk-bytes`` for ``--b-disk-blocks`` blocks, one row per
``--b-admit-after``, and one row with room for every distinct block, ``--b-big-disk-blocks``);
and vLLM's own ``fs`` tier (a directory under ``--dir``, same filesystem) instead of kvoffload:
vLLM cannot put ``fs`` below kvoffload, its secondary tiers are siblings that each receive every
stored chunk. Per configuration: prefix hit ratio, scheduler-thread time in the secondary tier
per step (p50 / p99 over every step of both engines), bytes on disk (st_blocks of the directory
tree, directories included) sampled every ``--b-sample-every`` requests, against the bound (the
fs tier has none).

Part (c), restart: the shipped trace, each request run as an engine would (lookup; onload of the
leading keys the pool or the disk holds; prepare/complete-store of the rest) through in-process
services with a pool of ``--pool-blocks`` and a disk tier of ``--disk-blocks`` 4 KiB blocks. The
hit ratio (leading blocks served / blocks asked) of the ``--window`` requests after the first
``--prefix``: served by the service that never restarted (warm), by one stopped after the prefix
and started again on the same disk directory (restart), and by a fresh service without a disk tier
(cold). Target: restart >= 0.9x warm. Bytes under the disk directory are sampled against
``disk_bytes`` throughout.

Usage: ``.venv/bin/python bench/disk_tier.py [--parts a,c] [--quick]`` (part (b) needs vLLM:
``.venv-vllm/bin/python bench/disk_tier.py --parts b``); run as root for the cache
drops (otherwise reads are still O_DIRECT on both sides, noted in the record).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app.core.disk import DiskLink
from app.settings import Settings
from bench.harness import RESULTS_DIR, machine, read_trace, write_results
from testsupport.polling import until_async
from transfer.disk import DiskStore, disk_bytes_for, slots_for
from transfer.disk_index import block_mac
from transfer.host_pool import HostPool

KIB = 1024
MIB = 1024 * KIB
PAGE = 4096


# ---------------------------------------------------------------------------- helpers


def drop_caches() -> bool:
    """Write back and drop the page cache; False when not allowed (not root)."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


class Device:
    """The block device under a directory, by its own counters (``/sys/dev/block/M:m/stat``):
    the requests a pass sent it and their average size. A request bigger than the memory's
    contiguous runs allow is split before it reaches the device (a 1 MiB block on 4 KiB pages
    went out as two), which no timing shows but these counts do. Other I/O on the same device
    in the window counts too: run the bench on an otherwise idle disk."""

    def __init__(self, directory: str) -> None:
        dev = os.stat(directory).st_dev
        self.file = f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/stat"
        self.passes: dict[str, list[dict[str, float]]] = {}

    def counters(self) -> list[int] | None:
        """Reads and sectors read, writes and sectors written so far (None: no such device,
        as on tmpfs or overlay filesystems)."""
        try:
            with open(self.file) as f:
                fields = [int(x) for x in f.read().split()]
        except (OSError, ValueError):
            return None
        return [fields[0], fields[2], fields[4], fields[6]]

    @contextlib.contextmanager
    def counting(self, name: str) -> Iterator[None]:
        """Count the requests of one pass named ``name``."""
        before = self.counters()
        yield
        after = self.counters()
        if before is None or after is None:
            return
        reads, rsect, writes, wsect = (b - a for a, b in zip(before, after, strict=True))
        self.passes.setdefault(name, []).append(
            {
                "reads": reads,
                "read_kib_per_request": rsect / 2 / reads if reads else 0.0,
                "writes": writes,
                "write_kib_per_request": wsect / 2 / writes if writes else 0.0,
            }
        )

    def summary(self) -> dict[str, dict[str, float]]:
        """Per pass name, the median of each count over its passes."""
        return {
            name: {k: med([p[k] for p in passes]) for k in passes[0]}
            for name, passes in self.passes.items()
        }


def med(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


class Raw:
    """A plain O_DIRECT file: one pwrite / preadv per block on ``threads`` threads."""

    def __init__(self, directory: str, block: int, n: int, threads: int) -> None:
        self.block, self.n = block, n
        self.fd = os.open(
            os.path.join(directory, "raw"), os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600
        )
        # Page-aligned and pre-faulted, as the pool is (reads into never-touched anonymous
        # pages ran at half speed here at 256 KiB: 0.39 against 0.90 GB/s).
        self.src = mmap.mmap(-1, n * block)
        self.src[:] = os.urandom(MIB) * (n * block // MIB)
        self.dst = mmap.mmap(-1, n * block)
        self.dst[:] = bytes(n * block)
        self.pool = ThreadPoolExecutor(threads)

    def write(self, fresh: bool = False) -> float:
        """Write the blocks; ``fresh``: into a file emptied first (extents allocated anew, as a
        disk tier's first fill does), else over the blocks already there."""
        view = memoryview(self.src)
        b = self.block
        if fresh:
            os.ftruncate(self.fd, 0)
            os.fsync(self.fd)

        def one(i: int) -> None:
            assert os.pwrite(self.fd, view[i * b : (i + 1) * b], i * b) == b

        t = time.perf_counter()
        list(self.pool.map(one, range(self.n)))
        return time.perf_counter() - t

    def read(self) -> float:
        view = memoryview(self.dst)
        b = self.block

        def one(i: int) -> None:
            assert os.preadv(self.fd, [view[i * b : (i + 1) * b]], i * b) == b

        t = time.perf_counter()
        list(self.pool.map(one, range(self.n)))
        return time.perf_counter() - t

    def close(self) -> None:
        self.pool.shutdown()
        os.close(self.fd)


#: fio's jobs, one per column: (column, fio's --rw).
FIO_JOBS = (
    ("seq_read", "read"),
    ("rand_read", "randread"),
    ("seq_write", "write"),
    ("rand_write", "randwrite"),
    # Into a file made afresh (fio allocates it with fallocate first, as the tier preallocates
    # its blocks file): writes into unwritten extents, as a tier's first fill does.
    ("seq_write_fresh", "write"),
)


class Fio:
    """fio (Debian's package) on a file of its own in the bench's directory (the same
    filesystem as the tier's blocks file): ``n`` blocks of ``block`` bytes, ``O_DIRECT``
    (``--direct=1``), one job at queue depth ``depth`` (the tier's I/O threads: the requests
    it keeps in flight). Engine: ``libaio`` (asynchronous, ``--iodepth`` requests in flight
    from one thread); where fio lacks it, ``psync`` with ``depth`` threads (``--numjobs``),
    each on its own part of the file. ``run(rw)``: the seconds fio took to move the ``n`` blocks
    (its own clock: ``io_bytes / bw_bytes``, without the process's start). ``Fio.path()`` is
    None when fio is not installed: the bench then says so and leaves its columns out."""

    def __init__(self, directory: str, block: int, n: int, depth: int) -> None:
        exe = Fio.path()
        assert exe is not None
        self.exe, self.block, self.n, self.depth = exe, block, n, depth
        self.file = os.path.join(directory, "fio-file")
        self.engine = "libaio" if self._has_engine("libaio") else "psync"
        self.cpu_s: dict[str, list[float]] = {}  # per --rw: fio's CPU seconds of each pass
        self.run("write")  # lays the file out (its extents allocated, as the tier's are)

    @staticmethod
    def path() -> str | None:
        return shutil.which("fio")

    def _has_engine(self, name: str) -> bool:
        done = subprocess.run(
            [self.exe, f"--enghelp={name}"], capture_output=True, text=True, check=False
        )
        return done.returncode == 0

    def args(self, rw: str) -> list[str]:
        """fio's command line for one ``rw`` pass over the file."""
        size = self.n * self.block
        cmd = [
            self.exe,
            "--name=kvoffload-baseline",
            f"--filename={self.file}",
            f"--rw={rw}",
            f"--bs={self.block}",
            "--direct=1",
            f"--ioengine={self.engine}",
            "--output-format=json",
            "--randrepeat=0",
        ]
        if self.engine == "libaio":
            return [*cmd, f"--size={size}", f"--iodepth={self.depth}"]
        per = -(-self.n // self.depth) * self.block
        return [
            *cmd,
            f"--size={per}",
            f"--numjobs={self.depth}",
            f"--offset_increment={per}",
            "--thread",
            "--group_reporting",
        ]

    def warm(self) -> None:
        """Run fio without I/O, so that its program and engine are read back into the page
        cache (after a drop) before a pass whose device requests are counted."""
        self._has_engine(self.engine)

    def run(self, rw: str, fresh: bool = False) -> float:
        if fresh:
            self.close()
        done = subprocess.run(self.args(rw), capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"fio {rw} failed: {done.stderr.strip() or done.stdout[-500:]}")
        job = json.loads(done.stdout[done.stdout.index("{") :])["jobs"][0]
        side = job["read" if "read" in rw else "write"]
        # fio's own CPU (user + system, percent of its run time), for the CPU per GB column.
        cpu = (float(job["usr_cpu"]) + float(job["sys_cpu"])) / 100 * job["job_runtime"] / 1000
        self.cpu_s.setdefault(rw, []).append(cpu)
        return float(side["io_bytes"]) / float(side["bw_bytes"])

    def close(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.file)


class RawSlots:
    """The baseline of the service rounds: plain O_DIRECT reads of the disk tier's own blocks
    file (its own descriptor), one ``os.preadv`` per block on ``threads`` threads, into the
    service's own pool slots: the same file, extents and destination memory as the tier's reads
    (a file of the bench's own, or an anonymous buffer, moved the result by up to 4x here)."""

    def __init__(self, path: str, slot_bytes: int, pool: Any, threads: int) -> None:
        self.fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        self.slot_bytes = slot_bytes
        self.pool = pool
        self.threads = ThreadPoolExecutor(threads)

    def read(self, disk_slots: list[int]) -> float:
        """Read the blocks at ``disk_slots`` into pool slots 0.. (bytes overwritten there are
        promoted copies the next onload evicts; the disk keeps the originals); seconds."""
        block = self.pool.shape[1]

        def one(i: int) -> None:
            dest = self.pool[i].numpy().data
            try:
                got = os.preadv(self.fd, [dest], disk_slots[i] * self.slot_bytes)
                assert got == block, (got, block)
            finally:
                dest.release()

        t = time.perf_counter()
        list(self.threads.map(one, range(len(disk_slots))))
        return time.perf_counter() - t

    def close(self) -> None:
        self.threads.shutdown()
        os.close(self.fd)


# ---------------------------------------------------------------------------- part (a): store


def part_a_store(base: str, block: int, mib: int, repeats: int, threads: int) -> dict[str, Any]:
    """Raw O_DIRECT vs DiskStore write_many / read_many, interleaved, medians."""
    n = mib * MIB // block
    d = tempfile.mkdtemp(dir=base, prefix=f"store-{block // KIB}k-")
    pool = HostPool.create(n, block, pin=False)
    pool.tensor.numpy().reshape(-1)[:] = 7  # any bytes; the MAC covers them
    for s in range(0, n, max(1, n // 8)):
        pool.tensor[s].numpy()[:16] = s % 251  # blocks differ
    store = DiskStore(d, pool, n, staging_blocks=n, io_threads=threads)
    raw = Raw(d, block, n, threads)
    assert store.direct, "the store fell back to buffered I/O"
    keys = [i.to_bytes(8, "big") for i in range(n)]
    staged = store.stage(list(range(n)))
    assert staged is not None
    w_items = [(i, keys[i], staged[i]) for i in range(n)]
    r_items = [(i, keys[i], i) for i in range(n)]
    # Warm-up: allocate both files' extents (the timed writes overwrite, as a steady disk does).
    raw.write()
    assert all(store.write_many(w_items))
    out: dict[str, list[float]] = {
        k: [] for k in ("raw_w", "raw_w_fresh", "store_w", "raw_r", "store_r")
    }
    dropped = True
    for r in range(repeats):
        order = [("raw", "store"), ("store", "raw")][r % 2]
        for who in order:
            os.sync()
            if who == "raw":
                out["raw_w_fresh"].append(raw.write(fresh=True))
                os.sync()
                out["raw_w"].append(raw.write())
            else:
                t = time.perf_counter()
                ok = store.write_many(w_items)
                out["store_w"].append(time.perf_counter() - t)
                assert all(ok)
        for who in order:
            dropped &= drop_caches()
            if who == "raw":
                out["raw_r"].append(raw.read())
            else:
                t = time.perf_counter()
                ok = store.read_many(r_items)
                out["store_r"].append(time.perf_counter() - t)
                assert all(ok), "a read failed its MAC"
    nbytes = n * block
    # Profile: what a read does besides the syscall.
    t = time.perf_counter()
    for i in range(n):
        block_mac(bytes(32), keys[i], pool.tensor[i].numpy().data)  # keyed BLAKE3, as stored
    checksum_s = time.perf_counter() - t
    raw.close()
    store.close()
    pool.close()
    shutil.rmtree(d, ignore_errors=True)
    rec: dict[str, Any] = {
        "block_bytes": block,
        "blocks": n,
        "bytes": nbytes,
        "threads": threads,
        "cache_dropped": dropped,
        "seconds": out,
        "raw_write_gbps": gbps(nbytes, med(out["raw_w"])),
        "raw_write_fresh_gbps": gbps(nbytes, med(out["raw_w_fresh"])),
        "store_write_gbps": gbps(nbytes, med(out["store_w"])),
        "raw_read_gbps": gbps(nbytes, med(out["raw_r"])),
        "store_read_gbps": gbps(nbytes, med(out["store_r"])),
        "checksum_gbps_one_thread": gbps(nbytes, checksum_s),
    }
    rec["write_ratio"] = rec["store_write_gbps"] / rec["raw_write_gbps"]
    rec["read_ratio"] = rec["store_read_gbps"] / rec["raw_read_gbps"]
    return rec


# ---------------------------------------------------------------------------- service harness


def hexkey(prefix: int, i: int) -> str:
    return ((prefix << 40) | i).to_bytes(8, "big").hex()


@contextlib.asynccontextmanager
async def service(**overrides: Any) -> AsyncIterator[Any]:
    from testsupport.api_harness import make_settings, running

    base = {
        "job_deadline_s": 120.0,
        "disk_timeout_s": 120.0,
        "max_keys_per_call": 8192,
        "max_body_bytes": 4 * MIB,
        "lease_ttl_s": 3600.0,
        "event_buffer_size": 1 << 16,
    }
    base.update(overrides)
    async with running(make_settings(**base)) as h:
        yield h


async def store_keys(h: Any, req: str, keys: list[str], fill: int | None = None) -> None:
    """Store ``keys`` through the pool (prepare/complete-store); ``fill``: a seed for random
    bytes written into their slots first (None: the pool's bytes as they are)."""
    await h.start(req)
    r = await h.post(f"/v1/requests/{req}/prepare-store", {"keys": keys})
    assert r.status_code == 200, r.text
    if fill is not None:
        rng = np.random.default_rng(fill)
        pool = h.service.transfers().pool.tensor
        for slot in r.json()["slots"]:
            pool[slot].numpy()[:] = rng.integers(0, 256, pool.shape[1], dtype=np.uint8)
    r = await h.post(f"/v1/requests/{req}/complete-store", {"keys": keys})
    assert r.status_code == 200, r.text
    await h.client.delete(f"/v1/requests/{req}")


def disk_link(h: Any) -> DiskLink:
    """The disk tier of harness ``h``'s service."""
    disk = h.service.tiers.get("disk")
    assert isinstance(disk, DiskLink)
    return disk


def demoted(h: Any) -> int:
    return int(disk_link(h).counts["demoted"])


def dropped(h: Any) -> int:
    return sum(v for k, v in disk_link(h).counts.items() if k.startswith("dropped_"))


# ---------------------------------------------------------------------------- part (a): service


def write_over(path: str) -> None:
    """Write zeros over the whole file at ``path`` (O_DIRECT, 16 MiB a call), so that its
    extents are written ones; the tier lists none of its slots yet, so nothing is lost."""
    piece = 16 * MIB
    buf = mmap.mmap(-1, piece)
    fd = os.open(path, os.O_WRONLY | os.O_DIRECT)
    try:
        size = os.fstat(fd).st_size
        for off in range(0, size, piece):
            n = min(piece, size - off)
            assert os.pwrite(fd, memoryview(buf)[:n], off) == n
        os.fsync(fd)
    finally:
        os.close(fd)
        buf.close()


async def part_a_service(
    base: str,
    block: int,
    mib: int,
    repeats: int,
    threads: int,
    batch_bytes: int,
    use_fio: bool = True,
    written_slots: bool = True,
) -> dict[str, Any]:
    """End to end: demotion of N evicted blocks, onload of N disk-only keys (one call, one job),
    each in rounds with fio's passes over N blocks (``use_fio`` and fio installed) and the raw
    per-block reads of the tier's own file, in rotating order. ``written_slots``: the tier's
    (preallocated) blocks file is written over once before the rounds, as a tier whose slots
    all held a block once is (its steady state; fio's writes overwrite too); False: the
    demotions are the first writes of their slots (unwritten extents, slower here)."""
    n = mib * MIB // block
    fio = Fio(base, block, n, threads) if use_fio and Fio.path() else None
    fio_s: dict[str, list[float]] = {col: [] for col, _ in FIO_JOBS}

    device = Device(base)

    def fio_pass(*cols: str) -> None:
        assert fio is not None
        for col, rw in FIO_JOBS:
            if col in cols:
                if "read" in rw:
                    drop_caches()
                    fio.warm()  # its program back in the page cache: not in the counts
                with device.counting(f"fio_{col}"):
                    fio_s[col].append(fio.run(rw, fresh=col.endswith("_fresh")))

    # Chunk 0: the warm-up onload; then two per round (one onloaded, one read raw), each read
    # once, never before; the last chunk stays in the pool.
    chunks = 2 * repeats + 2
    d = tempfile.mkdtemp(dir=base, prefix=f"svc-{block // KIB}k-")
    disk_bytes = disk_bytes_for(chunks * n + 16, block)
    settings = {
        "num_blocks": n,
        "block_bytes": block,
        "disk_dir": d,
        "disk_bytes": disk_bytes,
        "disk_admit_after": 1,
        "disk_io_threads": threads,
        "disk_staging_bytes": n * block,
        "disk_batch_bytes": max(block, batch_bytes),
    }
    demote_s: list[float] = []
    demote_cpu_s: list[float] = []
    phases: list[dict[str, float]] = []
    onload_s: list[float] = []
    pool_onload_s: list[float] = []
    raw_s: list[float] = []
    promote_s: list[float] = []
    dropped_ok = True
    async with service(**settings) as h:
        disk = disk_link(h)
        assert disk is not None
        assert disk.store.direct
        # Phase stamps (profile): the store's calls and the job's launch after the promotion.
        stamps: list[tuple[str, float]] = []
        store = disk.store
        real_submit = store.submit_reads

        def submit_reads(items: Any) -> Any:
            stamps.append(("read0", time.perf_counter()))
            future = real_submit(items)
            future.add_done_callback(lambda _: stamps.append(("read1", time.perf_counter())))
            return future

        store.submit_reads = submit_reads  # type: ignore[method-assign]
        tracker = h.service.transfers().tracker
        real_launch = tracker.launch

        def launch(*a: Any, **k: Any) -> Any:
            stamps.append(("launch", time.perf_counter()))
            return real_launch(*a, **k)

        tracker.launch = launch
        if written_slots:
            await asyncio.to_thread(write_over, os.path.join(store.directory, "blocks"))
        dev, cache_id = await h.device(n)
        chunk_keys = [[hexkey(c + 1, i) for i in range(n)] for c in range(chunks)]
        # Fill: chunk c+1's store evicts chunk c from the pool, to disk. The timed demotions
        # are those of chunks 1.. (chunk 0's store evicts nothing), each in a round with fio's
        # writes (order alternating). Only chunk 0's bytes are made (random, untimed): the
        # later chunks keep the bytes their slots hold, so no timed demotion waits on a fill
        # that runs on the event loop.
        for c in range(chunks):
            want = demoted(h) + n
            for who in [("fio", "tier"), ("tier", "fio")][c % 2] if c else ("tier",):
                if who == "fio":
                    if fio is not None:
                        await asyncio.to_thread(
                            fio_pass, "seq_write", "rand_write", "seq_write_fresh"
                        )
                    continue
                with device.counting("demotion" if c else "first fill"):
                    t, cpu = time.perf_counter(), time.process_time()
                    await store_keys(h, f"fill{c}", chunk_keys[c], fill=0 if c == 0 else None)
                    if c:

                        def all_out(w: int = want) -> bool:
                            return demoted(h) + dropped(h) >= w

                        await until_async("every block out", all_out, 120, every_s=0.002)
                        demote_s.append(time.perf_counter() - t)
                        # Every thread of this process: the loop's copy, the MACs, the I/O.
                        demote_cpu_s.append(time.process_time() - cpu)
        assert dropped(h) == 0, dict(disk.counts)
        # Warm-up onload of chunk 0: evicts the last chunk (demoted: written now, untimed).
        blocks = list(range(n))

        async def onload(c: int) -> float:
            req = f"on{c}"
            await h.start(req)
            stamps.clear()
            t = time.perf_counter()
            r = await h.post(
                f"/v1/requests/{req}/onload",
                {"cache_id": cache_id, "keys": chunk_keys[c], "device_blocks": blocks},
            )
            assert r.status_code == 202, r.text
            job = await h.wait(r.json()["job_id"], timeout_s=120)
            took = time.perf_counter() - t
            # A load of several chunks: the first read's start, the last read's end, the
            # last part's launch.
            at: dict[str, list[float]] = {}
            for name, when in stamps:
                at.setdefault(name, []).append(when)
            if {"read0", "read1", "launch"} <= at.keys():
                phases.append(
                    {
                        "to_read": min(at["read0"]) - t,
                        "read": max(at["read1"]) - min(at["read0"]),
                        "read_to_launch": max(at["launch"]) - max(at["read1"]),
                        "job": t + took - max(at["launch"]),
                    }
                )
            assert job["state"] == "done", job
            await h.client.delete(f"/v1/requests/{req}")
            return took

        before = demoted(h)
        await onload(0)
        await until_async(
            "the demotions done", lambda: demoted(h) + dropped(h) >= before + n, 120, every_s=0.002
        )
        writes_before = disk.store.health().counters["writes"]
        phases.clear()
        pool = h.service.transfers().pool.tensor
        raw = RawSlots(os.path.join(store.directory, "blocks"), store.slot_bytes, pool, threads)
        index = disk.index.index
        for r in range(repeats):
            tier_c, raw_c = 1 + 2 * r, 2 + 2 * r
            found = [index.slot_of(bytes.fromhex(k)) for k in chunk_keys[raw_c]]
            raw_slots = [slot for slot in found if slot is not None]
            assert len(raw_slots) == len(found)
            # Rotating order: each of the three goes first, second and last in turn.
            order = ["fio", "raw", "tier"][r % 3 :] + ["fio", "raw", "tier"][: r % 3]
            for who in order:
                dropped_ok &= drop_caches()
                if who == "fio":
                    if fio is not None:
                        await asyncio.to_thread(fio_pass, "seq_read", "rand_read")
                    continue
                if who == "raw":
                    raw_s.append(await asyncio.to_thread(raw.read, raw_slots))
                    continue
                with device.counting("onload"):
                    onload_s.append(await onload(tier_c))
                # The chunks are read concurrently: the span from the first read's start to
                # the last one's end.
                promote_s.append(phases[-1]["read"])
                # The same keys again, now pool hits: the copy and the calls without the disk.
                pool_onload_s.append(await onload(tier_c))
        raw.close()
        # The timed onloads evicted promoted blocks only (inclusive: on disk already, no write).
        extra_writes = disk.store.health().counters["writes"] - writes_before
        counters = disk.store.health().counters
    dev.close()
    shutil.rmtree(d, ignore_errors=True)
    if fio is not None:
        fio.close()
    nbytes = n * block

    def per_round(base_s: list[float], tier_s: list[float]) -> list[float]:
        """Per round: baseline seconds / tier seconds (the tier's share of the baseline's
        speed); the rounds pair up in order."""
        return [a / b for a, b in zip(base_s, tier_s, strict=False)]

    fio_rec: dict[str, Any] = {"available": fio is not None}
    if fio is not None:
        fio_rec.update(
            {
                "engine": fio.engine,
                "iodepth": threads,
                "command_example": " ".join(fio.args("read")),
                "seconds": fio_s,
                **{f"{col}_gbps": gbps(nbytes, med(fio_s[col])) for col, _ in FIO_JOBS},
                "seq_write_cpu_s_per_gb": med(fio.cpu_s["write"]) / (nbytes / 1e9),
                # The targets: onload >= 0.8x fio's sequential read, demotion >= 0.8x fio's
                # sequential write (the tier's slots of one call are adjacent on disk), the
                # median of the per-round ratios.
                "onload_vs_seq_read_by_round": per_round(fio_s["seq_read"], onload_s),
                "onload_vs_rand_read_by_round": per_round(fio_s["rand_read"], onload_s),
                "demote_vs_seq_write_by_round": per_round(fio_s["seq_write"], demote_s),
                "demote_vs_rand_write_by_round": per_round(fio_s["rand_write"], demote_s),
                "demote_vs_seq_write_fresh_by_round": per_round(fio_s["seq_write_fresh"], demote_s),
            }
        )
        for k in [k for k in fio_rec if k.endswith("_by_round")]:
            fio_rec[k.removesuffix("_by_round")] = med(fio_rec[k])
    return {
        "fio": fio_rec,
        "block_bytes": block,
        "blocks": n,
        "bytes": nbytes,
        "threads": threads,
        "cache_dropped": dropped_ok,
        "seconds": {
            "demote": demote_s,
            "demote_cpu": demote_cpu_s,
            "onload": onload_s,
            "onload_pool_hits": pool_onload_s,
            "raw_read": raw_s,
            "disk_read": promote_s,
        },
        "onload_phases_median_s": {
            k: med([p[k] for p in phases]) for k in ("to_read", "read", "read_to_launch", "job")
        },
        "demote_gbps": gbps(nbytes, med(demote_s)),
        # CPU seconds of the whole process per demoted GB (the machine has os.cpu_count()).
        "demote_cpu_s_per_gb": med(demote_cpu_s) / (nbytes / 1e9),
        "onload_gbps": gbps(nbytes, med(onload_s)),
        # Per round: raw seconds / onload seconds (>= 0.8 is the target), and their median.
        "onload_ratio_by_round": [a / b for a, b in zip(raw_s, onload_s, strict=True)],
        "onload_ratio_paired": med([a / b for a, b in zip(raw_s, onload_s, strict=True)]),
        "raw_read_gbps": gbps(nbytes, med(raw_s)),
        "onload_pool_hits_gbps": gbps(nbytes, med(pool_onload_s)),
        "disk_read_gbps": gbps(nbytes, med(promote_s)),
        "writes_during_timed_onloads": extra_writes,
        "store_counters": counters,
        # The device's own counts per pass (medians): requests and their average size.
        "device_requests": device.summary(),
    }


# ---------------------------------------------------------------------------- part (c)


class Replay:
    """Requests run as an engine would; counts of blocks asked and served."""

    def __init__(self, h: Any, cache_id: str) -> None:
        self.h, self.cache_id = h, cache_id
        self.n = 0
        self.reasons: collections.Counter[str] = collections.Counter()

    async def run(
        self, requests: Sequence[list[bytes]], samples: list[int] | None = None
    ) -> dict[str, Any]:
        h = self.h
        self.reasons = collections.Counter()
        asked = pool_hits = disk_hits = failed = 0
        for i, req_keys in enumerate(requests):
            self.n += 1
            req = f"q{self.n}"
            keys = [k.hex() for k in dict.fromkeys(req_keys)]
            asked += len(req_keys)
            await h.start(req)
            r = await h.post(f"/v1/requests/{req}/lookup", {"keys": keys})
            body = r.json()
            results = body["results"]
            lead = 0
            while lead < len(results) and results[lead] in ("hit", "disk"):
                lead += 1
            if lead:
                r = await h.post(
                    f"/v1/requests/{req}/onload",
                    {
                        "cache_id": self.cache_id,
                        "keys": keys[:lead],
                        "device_blocks": list(range(lead)),
                    },
                )
                ok = False
                if r.status_code == 202:
                    jid = r.json()["job_id"]
                    job = {"state": "done"} if jid is None else await h.wait(jid, timeout_s=60)
                    ok = job["state"] == "done"
                    if not ok:
                        self.reasons[str(job.get("reason"))] += 1
                else:
                    self.reasons[f"HTTP {r.status_code}"] += 1
                if ok:
                    hp = min(body["hit_prefix"], lead)
                    pool_hits += hp
                    disk_hits += lead - hp
                else:
                    failed += 1
                    lead = 0
            rest = keys[lead:]
            if rest:
                r = await h.post(f"/v1/requests/{req}/prepare-store", {"keys": rest})
                if r.status_code == 200 and r.json()["keys_to_store"]:
                    await h.post(
                        f"/v1/requests/{req}/complete-store", {"keys": r.json()["keys_to_store"]}
                    )
            await h.client.delete(f"/v1/requests/{req}")
            if samples is not None and h.service.tiers.get("disk") is not None and i % 50 == 0:
                samples.append(disk_link(h).disk_usage())
        return {
            "requests": len(requests),
            "blocks": asked,
            "pool_hits": pool_hits,
            "disk_hits": disk_hits,
            "failed_onloads": failed,
            "failed_reasons": dict(self.reasons),
        }


def ratio(c: dict[str, Any]) -> float:
    return (c["pool_hits"] + c["disk_hits"]) / c["blocks"] if c["blocks"] else 0.0


async def part_c(
    base: str, prefix: int, window: int, pool_blocks: int, disk_blocks: int
) -> dict[str, Any]:
    trace = read_trace(limit=prefix + window)
    head, tail = trace[:prefix], trace[prefix : prefix + window]
    longest = max(len(r) for r in trace)
    block = 4 * KIB
    disk_bytes = disk_bytes_for(disk_blocks, block)
    assert slots_for(disk_bytes, block) == disk_blocks
    common = {
        "num_blocks": pool_blocks,
        "block_bytes": block,
        "max_keys_per_call": max(8192, longest),
    }
    out: dict[str, Any] = {
        "prefix": prefix,
        "window": window,
        "pool_blocks": pool_blocks,
        "disk_blocks": disk_blocks,
        "block_bytes": block,
        "disk_bytes": disk_bytes,
    }
    usage: list[int] = []

    async def replay(h: Any, parts: list[Sequence[list[bytes]]], tag: str) -> list[dict[str, Any]]:
        dev, cache_id = await h.device(longest)
        rp = Replay(h, cache_id)
        res = []
        for p in parts:
            t = time.perf_counter()
            c = await rp.run(p, usage)
            c["seconds"] = round(time.perf_counter() - t, 2)
            res.append(c)
            print(f"[c] {tag}: {c['requests']} requests in {c['seconds']} s", flush=True)
        dev.close()
        return res

    # Warm: one service with a disk tier, never restarted.
    d = tempfile.mkdtemp(dir=base, prefix="warm-")
    async with service(**common, disk_dir=d, disk_bytes=disk_bytes) as h:
        w_head, w_tail = await replay(h, [head, tail], "warm")
        out["warm_disk_state"] = _disk_summary(h)
        usage.append(disk_link(h).disk_usage())
    shutil.rmtree(d, ignore_errors=True)
    # Restart: the prefix, a graceful stop, a new service on the same directory, the window.
    d = tempfile.mkdtemp(dir=base, prefix="restart-")
    async with service(**common, disk_dir=d, disk_bytes=disk_bytes) as h:
        (r_head,) = await replay(h, [head], "restart, before")
        before_stop = disk_link(h).state()["blocks"]
    usage.append(_dir_usage(d))
    t = time.perf_counter()
    async with service(**common, disk_dir=d, disk_bytes=disk_bytes) as h:
        out["restart_open_s"] = round(time.perf_counter() - t, 3)
        restored = disk_link(h).restored
        (r_tail,) = await replay(h, [tail], "restart, after")
        out["restart_disk_state"] = _disk_summary(h)
        usage.append(disk_link(h).disk_usage())
    shutil.rmtree(d, ignore_errors=True)
    # Cold: a fresh service without a disk tier serves the window.
    async with service(**common) as h:
        (c_tail,) = await replay(h, [tail], "cold")
    out.update(
        {
            "warm": {"prefix": w_head, "window": w_tail, "hit_ratio": ratio(w_tail)},
            "restart": {
                "prefix": r_head,
                "window": r_tail,
                "hit_ratio": ratio(r_tail),
                "disk_blocks_at_stop": before_stop,
                "restored_blocks": restored,
            },
            "cold": {"window": c_tail, "hit_ratio": ratio(c_tail)},
            "disk_usage_max": max(usage),
            "disk_usage_samples": len(usage),
        }
    )
    out["restart_vs_warm"] = out["restart"]["hit_ratio"] / out["warm"]["hit_ratio"]
    out["cold_vs_warm"] = out["cold"]["hit_ratio"] / out["warm"]["hit_ratio"]
    return out


def _dir_usage(d: str) -> int:
    total = 0
    for root, _, files in os.walk(d):
        for f in files:
            total += os.stat(os.path.join(root, f)).st_blocks * 512
    return total


def _disk_summary(h: Any) -> dict[str, Any]:
    s = disk_link(h).state()
    return {
        "blocks": s["blocks"],
        "demoted": s["demotions"]["written"],
        "refused_admission": s["demotions"]["refused_admission"],
        "dropped": s["demotions"]["dropped"],
        "evictions": s["evictions"],
        "promotions": s["promotions"],
        "usage_bytes": disk_link(h).disk_usage(),
    }


# ---------------------------------------------------------------------------- part (b): vLLM


def _tree_usage(d: str) -> tuple[int, int, int]:
    """Bytes allocated under ``d`` (st_blocks of every file and directory, ``d`` included), the
    part of it in files, and the number of files."""
    total = in_files = files = 0
    for root, _, names in os.walk(d):
        with contextlib.suppress(FileNotFoundError):
            total += os.stat(root).st_blocks * 512
        for name in names:
            with contextlib.suppress(FileNotFoundError):  # a store's temp file, renamed
                used = os.stat(os.path.join(root, name)).st_blocks * 512
                total, in_files, files = total + used, in_files + used, files + 1
    return total, in_files, files


def _listing(d: str) -> dict[str, int]:
    """Allocated bytes per file under ``d`` (the disk tier has a few)."""
    out = {}
    for root, _, names in os.walk(d):
        for name in names:
            path = os.path.join(root, name)
            with contextlib.suppress(FileNotFoundError):
                out[os.path.relpath(path, d)] = os.stat(path).st_blocks * 512
    return out


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def part_b(
    base: str,
    n_requests: int,
    primary_chunks: int,
    pool_blocks: int,
    disk_blocks: int,
    admits: list[int],
    fs_threads: int,
    sample_every: int,
    big_disk_blocks: int = 0,
) -> dict[str, Any]:
    """The trace's first ``n_requests`` through two vLLM 0.33 engines (``bench/vllm_tier.py``'s
    replay): kvoffload's pool alone, pool + its disk tier (one row per ``--disk-admit-after``),
    and vLLM's own ``fs`` tier as the engines' only secondary tier (vLLM does not chain tiers:
    every secondary tier receives every stored chunk and is looked up side by side)."""
    # vLLM is needed here only (.venv-vllm); parts (a) and (c) run without it.
    from kvoffload_client.client import KVOffloadAdminClient

    from bench import vllm_tier
    from testsupport.server import TOKEN, ServerProcess
    from testsupport.vllm_sim import kv_transfer_config

    requests = vllm_tier.load_trace(n_requests)
    block = 4 * KIB
    disk_bytes = disk_bytes_for(disk_blocks, block)
    assert slots_for(disk_bytes, block) == disk_blocks
    serve_flags = [
        *("--block-bytes", str(block), "--num-blocks", str(pool_blocks)),
        *("--log-level", "warning", "--shadow-enabled", "false"),
    ]
    distinct = len({h for r in requests for h in r})
    out: dict[str, Any] = {
        "requests": len(requests),
        "block_refs": sum(len(r) for r in requests),
        "distinct_blocks": distinct,
        "primary_chunks_per_engine": primary_chunks,
        "pool_blocks": pool_blocks,
        "disk_blocks": disk_blocks,
        "disk_bytes": disk_bytes,
        "fs_threads": fs_threads,
        "rows": [],
    }

    def run(name: str, cfg: dict[str, Any], disk_dir: str | None) -> dict[str, Any]:
        growth: list[tuple[int, int]] = []

        def sample(n: int) -> None:
            if disk_dir is not None and (n + 1) % sample_every == 0:
                growth.append((n + 1, _tree_usage(disk_dir)[0]))

        t = time.monotonic()
        hit, engines, _ = vllm_tier.replay(requests, cfg, name.split()[0], sample)
        seconds = time.monotonic() - t
        step_us = [ns / 1000 for e in engines for ns in e.step_tier_ns]
        for e in engines:
            e.close()  # the fs tier's close waits for its writes
        row: dict[str, Any] = {
            "name": name,
            "hit_ratio": hit,
            "steps": len(step_us),
            "step_us_p50": _pct(step_us, 0.50),
            "step_us_p99": _pct(step_us, 0.99),
            "step_us_mean": statistics.fmean(step_us) if step_us else float("nan"),
            "replay_s": round(seconds, 1),
        }
        if disk_dir is not None:
            usage, in_files, files = _tree_usage(disk_dir)
            row.update(disk_usage=usage, disk_usage_files=in_files, files=files, growth=growth)
        print(
            f"[b] {name}: hit {hit:.3f}, step p50/p99 {row['step_us_p50']:.1f}/"
            f"{row['step_us_p99']:.1f} us, {seconds:.1f} s"
            + (f", {row['disk_usage']} bytes on disk" if disk_dir else ""),
            flush=True,
        )
        return row

    def kvoffload(
        name: str, *extra: str, disk_dir: str | None = None, bound: int = disk_bytes
    ) -> dict[str, Any]:
        started = time.monotonic()
        with tempfile.TemporaryDirectory(dir=base) as tmp:
            with ServerProcess(Path(tmp), *serve_flags, *extra).serving() as srv:
                cfg = kv_transfer_config(f"unix://{srv.uds}", cpu_chunks=primary_chunks)
                row = run(name, cfg, disk_dir)
                if disk_dir is not None:
                    with KVOffloadAdminClient(srv.admin_url, token=TOKEN) as admin:
                        d = admin.stats()["disk"]
                    row["disk_state"] = {
                        "blocks": d["blocks"],
                        "demoted": d["demotions"]["written"],
                        "refused_admission": d["demotions"]["refused_admission"],
                        "dropped": d["demotions"]["dropped"],
                        "promoted": d["promotions"]["loaded"],
                        "promotions_failed": d["promotions"]["failed"],
                    }
                    row["disk_usage_stopped"] = None
            if disk_dir is not None:  # after the stop (the index written)
                row["disk_usage_stopped"] = _tree_usage(disk_dir)[0]
                row["files_at_stop"] = _listing(disk_dir)
                row["bound"] = bound
                shutil.rmtree(disk_dir, ignore_errors=True)
        row["wall_s"] = round(time.monotonic() - started, 1)  # server start and stop included
        return row

    out["rows"].append(kvoffload("kvoffload pool alone"))
    for k in admits:
        d = os.path.join(base, f"kvoffload-disk-{k}")
        flags = ("--disk-dir", d, "--disk-bytes", str(disk_bytes), "--disk-admit-after", str(k))
        out["rows"].append(kvoffload(f"pool + disk tier, admit after {k}", *flags, disk_dir=d))
    if big_disk_blocks:  # room for every distinct block: capacity as the fs tier's
        big = disk_bytes_for(big_disk_blocks, block)
        d = os.path.join(base, "kvoffload-disk-big")
        flags = ("--disk-dir", d, "--disk-bytes", str(big), "--disk-admit-after", str(admits[0]))
        row = kvoffload(
            f"pool + disk of {big_disk_blocks}, admit {admits[0]}", *flags, disk_dir=d, bound=big
        )
        out["rows"].append(row)
    fs_dir = tempfile.mkdtemp(dir=base, prefix="vllm-fs-")
    cfg = kv_transfer_config("unix:///unused", cpu_chunks=primary_chunks)
    cfg["kv_connector_extra_config"]["secondary_tiers"] = [
        {
            "type": "fs",
            "root_dir": fs_dir,
            "n_read_threads": fs_threads,
            "n_write_threads": fs_threads,
        }
    ]
    started = time.monotonic()
    row = run("vLLM fs tier alone", cfg, fs_dir)
    row["bound"] = None
    row["wall_s"] = round(time.monotonic() - started, 1)
    out["rows"].append(row)
    shutil.rmtree(fs_dir, ignore_errors=True)
    return out


# ---------------------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--parts", default="a,c")
    ap.add_argument("--blocks-kib", default="256,1024")
    ap.add_argument("--mib", type=int, default=128, help="MiB per timed call (part a)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=4, help="I/O threads, store and raw alike")
    ap.add_argument(
        "--disk-batch-bytes",
        type=int,
        default=Settings.model_fields["disk_batch_bytes"].default,
        help="the service's --disk-batch-bytes (write batches, promotion read chunks)",
    )
    ap.add_argument("--prefix", type=int, default=3493, help="requests before the restart (c)")
    ap.add_argument("--window", type=int, default=500)
    ap.add_argument("--pool-blocks", type=int, default=2000)
    ap.add_argument("--disk-blocks", type=int, default=20000)
    ap.add_argument("--b-requests", type=int, default=1500, help="trace prefix replayed (b)")
    ap.add_argument("--b-primary-chunks", type=int, default=500, help="per engine (b)")
    ap.add_argument("--b-pool-blocks", type=int, default=2000, help="kvoffload pool (b)")
    ap.add_argument("--b-disk-blocks", type=int, default=6000, help="kvoffload disk tier (b)")
    ap.add_argument(
        "--b-big-disk-blocks",
        type=int,
        default=28000,
        help="one more (b) row: a disk tier this large (0: none)",
    )
    ap.add_argument("--b-admit-after", default="1,2", help="one (b) row per value")
    ap.add_argument("--b-fs-threads", type=int, default=4, help="fs tier read and write threads")
    ap.add_argument("--b-sample-every", type=int, default=250, help="requests (b)")
    ap.add_argument("--dir", default=str(Path(__file__).resolve().parent / ".disk-bench"))
    ap.add_argument(
        "--quick",
        action="store_true",
        help="smoke test: 32 MiB, 3 repeats, 1000+200 requests (no disk hits in (c))",
    )
    ap.add_argument(
        "--no-fio", action="store_true", help="leave fio's baseline columns out of part (a)"
    )
    ap.add_argument(
        "--fresh-slots",
        action="store_true",
        help="part (a): demote into never-written slots (a tier's first fill) instead of over "
        "slots written once (its steady state, the default)",
    )
    ap.add_argument("--out", default=str(RESULTS_DIR / "disk_tier.json"))
    args = ap.parse_args()
    if args.quick:
        args.mib, args.repeats, args.prefix, args.window = 32, 3, 1000, 200
        args.b_requests = min(args.b_requests, 300)
    parts = set(args.parts.split(","))
    os.makedirs(args.dir, exist_ok=True)
    base = tempfile.mkdtemp(dir=args.dir)
    record: dict[str, Any] = {
        "bench": "disk_tier",
        "machine": machine(root=os.geteuid() == 0, load_avg=os.getloadavg()),
        "args": vars(args),
    }
    started = time.time()
    if "a" in parts and not args.no_fio and Fio.path() is None:
        print(
            "[a] fio not found (Debian: apt-get install -y fio): its baseline columns, the "
            "targets' denominators, are left out of this run",
            flush=True,
        )
    try:
        if "a" in parts:
            record["a"] = []
            for kib in [int(x) for x in args.blocks_kib.split(",")]:
                block = kib * KIB
                st = part_a_store(base, block, args.mib, args.repeats, args.threads)
                sv = asyncio.run(
                    part_a_service(
                        base,
                        block,
                        args.mib,
                        args.repeats,
                        args.threads,
                        args.disk_batch_bytes,
                        use_fio=not args.no_fio,
                        written_slots=not args.fresh_slots,
                    )
                )
                row = {"store": st, "service": sv}
                row["onload_ratio"] = sv["onload_ratio_paired"]
                row["onload_ratio_of_medians"] = sv["onload_gbps"] / sv["raw_read_gbps"]
                row["service_demote_ratio"] = sv["demote_gbps"] / st["raw_write_fresh_gbps"]
                record["a"].append(row)
                write_results(Path(args.out), record, quiet=True)
                print_a_row(row)
        if "b" in parts:
            record["b"] = part_b(
                base,
                args.b_requests,
                args.b_primary_chunks,
                args.b_pool_blocks,
                args.b_disk_blocks,
                [int(k) for k in args.b_admit_after.split(",")],
                args.b_fs_threads,
                args.b_sample_every,
                args.b_big_disk_blocks,
            )
            write_results(Path(args.out), record, quiet=True)
        if "c" in parts:
            record["c"] = asyncio.run(
                part_c(base, args.prefix, args.window, args.pool_blocks, args.disk_blocks)
            )
    finally:
        shutil.rmtree(base, ignore_errors=True)
        with contextlib.suppress(OSError):
            os.rmdir(args.dir)
    record["machine"]["load_avg_end"] = os.getloadavg()
    record["seconds"] = round(time.time() - started, 1)
    print()
    print_tables(record)
    write_results(Path(args.out), record)


def print_a_row(row: dict[str, Any]) -> None:
    st, sv = row["store"], row["service"]
    fio = sv["fio"]
    vs_fio = (
        f"; fio seq r/w {fio['seq_read_gbps']:.2f}/{fio['seq_write_gbps']:.2f}, onload "
        f"{fio['onload_vs_seq_read']:.2f}x, demotion {fio['demote_vs_seq_write']:.2f}x; CPU s/GB "
        f"demotion {sv['demote_cpu_s_per_gb']:.2f}, fio write {fio['seq_write_cpu_s_per_gb']:.2f}"
        if fio["available"]
        else "; fio: not run"
    )
    print(
        f"[a] {st['block_bytes'] // KIB} KiB: raw r/w "
        f"{st['raw_read_gbps']:.2f}/{st['raw_write_gbps']:.2f}"
        f" store r/w {st['store_read_gbps']:.2f}/{st['store_write_gbps']:.2f}"
        f" service onload {sv['onload_gbps']:.2f} demote {sv['demote_gbps']:.2f}" + vs_fio,
        flush=True,
    )


def print_fio_table(rows: list[dict[str, Any]]) -> None:
    """Part (a) against fio: GB/s medians of the service rounds; ratios are medians of the
    per-round ratios (tier seconds against fio's seconds of the same round)."""
    fio_rows = [r for r in rows if r["service"]["fio"]["available"]]
    if not fio_rows:
        print("(a) vs fio: fio not run (not installed, or --no-fio): no fio columns")
        return
    f0 = fio_rows[0]["service"]["fio"]
    print(
        f"(a) vs fio ({f0['engine']}, O_DIRECT, iodepth {f0['iodepth']}, the tier's block "
        "size), same rounds; GB/s medians; ratio = median of per-round ratios"
    )
    print(
        f"{'block':>8} | {'fio seq read':>12} {'rand read':>9} | {'onload':>6} "
        f"{'/seq':>5} {'/rand':>5} {'>=0.8':>5} | {'fio seq write':>13} {'rand write':>10} "
        f"{'fresh file':>10} | {'demotion':>8} {'/seq':>5} {'/rand':>5} {'/fresh':>6} {'>=0.8':>5}"
    )
    for row in fio_rows:
        sv = row["service"]
        f = sv["fio"]
        print(
            f"{sv['block_bytes'] // KIB:>4} KiB | {f['seq_read_gbps']:>12.2f} "
            f"{f['rand_read_gbps']:>9.2f} | {sv['onload_gbps']:>6.2f} "
            f"{f['onload_vs_seq_read']:>5.2f} {f['onload_vs_rand_read']:>5.2f} "
            f"{'pass' if f['onload_vs_seq_read'] >= 0.8 else 'FAIL':>5} | "
            f"{f['seq_write_gbps']:>13.2f} {f['rand_write_gbps']:>10.2f} "
            f"{f['seq_write_fresh_gbps']:>10.2f} | "
            f"{sv['demote_gbps']:>8.2f} {f['demote_vs_seq_write']:>5.2f} "
            f"{f['demote_vs_rand_write']:>5.2f} {f['demote_vs_seq_write_fresh']:>6.2f} "
            f"{'pass' if f['demote_vs_seq_write'] >= 0.8 else 'FAIL':>5}"
        )
    for row in fio_rows:
        sv, f = row["service"], row["service"]["fio"]
        rounds = ", ".join(f"{x:.2f}" for x in f["onload_vs_seq_read_by_round"])
        wrounds = ", ".join(f"{x:.2f}" for x in f["demote_vs_seq_write_by_round"])
        print(
            f"  {sv['block_bytes'] // KIB} KiB rounds: onload/fio seq read ({rounds}); "
            f"demotion/fio seq write ({wrounds})"
        )
        dev = sv.get("device_requests") or {}
        said = [
            f"{name} {c[kind + 's']:.0f} x {c[kind + '_kib_per_request']:.0f} KiB"
            for name, kind in (
                ("demotion", "write"),
                ("fio_seq_write", "write"),
                ("onload", "read"),
                ("fio_seq_read", "read"),
            )
            if (c := dev.get(name))
        ]
        if said:
            print(f"  device requests a pass (medians): {'; '.join(said)}")


def print_tables(rec: dict[str, Any]) -> None:
    if "a" in rec:
        print_fio_table(rec["a"])
        print("(a) GB/s, medians; ratios to raw O_DIRECT of the same bytes in the same rounds")
        print(f"{'':>8} | {'store rounds':<27} | service rounds")
        print(
            f"{'block':>8} | {'raw read':>8} | {'store read':>10} {'ratio':>5} | {'raw read':>8} | "
            f"{'onload':>6} {'ratio':>5} {'>=0.8':>5} | {'inside onload: disk read':>24} | "
            f"{'onload of pool hits':>19}"
        )
        for row in rec["a"]:
            st, sv = row["store"], row["service"]
            ph = sv["onload_phases_median_s"]
            print(
                f"{st['block_bytes'] // KIB:>4} KiB | {st['raw_read_gbps']:>8.2f} | "
                f"{st['store_read_gbps']:>10.2f} {st['read_ratio']:>5.2f} | "
                f"{sv['raw_read_gbps']:>8.2f} | "
                f"{sv['onload_gbps']:>6.2f} {row['onload_ratio']:>5.2f} "
                f"{'pass' if row['onload_ratio'] >= 0.8 else 'FAIL':>5} | "
                f"{sv['disk_read_gbps']:>7.2f} ({ph['read'] * 1e3:.0f} of "
                f"{sum(ph.values()) * 1e3:.0f} ms) | {sv['onload_pool_hits_gbps']:>19.2f}"
            )
        print(
            f"{'block':>8} | {'raw write':>9} | {'store write':>11} {'ratio':>5} | "
            f"{'raw write, fresh file':>21} | {'service demotion':>16} {'ratio':>5}"
        )
        for row in rec["a"]:
            st, sv = row["store"], row["service"]
            print(
                f"{st['block_bytes'] // KIB:>4} KiB | {st['raw_write_gbps']:>9.2f} | "
                f"{st['store_write_gbps']:>11.2f} {st['write_ratio']:>5.2f} | "
                f"{st['raw_write_fresh_gbps']:>21.2f} | {sv['demote_gbps']:>16.2f} "
                f"{row['service_demote_ratio']:>5.2f}"
            )
        for row in rec["a"]:
            st, sv = row["store"], row["service"]
            ph = sv["onload_phases_median_s"]
            print(
                f"  {st['block_bytes'] // KIB} KiB: {st['bytes'] // MIB} MiB per call, "
                f"{st['threads']} threads; onload phases (ms): to read {ph['to_read'] * 1e3:.1f}, "
                f"read {ph['read'] * 1e3:.1f}, to job {ph['read_to_launch'] * 1e3:.1f}, "
                f"job {ph['job'] * 1e3:.1f}; checksum {st['checksum_gbps_one_thread']:.1f} GB/s "
                f"on one thread; writes in timed onloads {sv['writes_during_timed_onloads']}; "
                f"cache dropped {st['cache_dropped'] and sv['cache_dropped']}"
            )
    if "b" in rec:
        print_b(rec["b"])
    if "c" in rec:
        c = rec["c"]
        print()
        print(
            f"(c) the {c['window']} requests after the first {c['prefix']}: pool "
            f"{c['pool_blocks']} x 4 KiB, disk {c['disk_blocks']} blocks ({c['disk_bytes']} bytes)"
        )
        print(
            f"{'service':<34} | {'hit ratio':>9} | {'pool hits':>9} | {'disk hits':>9} | "
            f"{'vs warm':>7}"
        )
        rows = [
            ("warm (never restarted)", c["warm"]),
            ("restarted on the same disk dir", c["restart"]),
            ("cold start, no disk tier", c["cold"]),
        ]
        for name, r in rows:
            w = r["window"]
            print(
                f"{name:<34} | {r['hit_ratio']:>9.3f} | {w['pool_hits']:>9} | "
                f"{w['disk_hits']:>9} | "
                f"{r['hit_ratio'] / c['warm']['hit_ratio']:>7.2f}"
            )
        verdict = "pass" if c["restart_vs_warm"] >= 0.9 else "FAIL"
        print(
            f"  restart / warm {c['restart_vs_warm']:.3f} (target >= 0.9: {verdict}); "
            f"restored {c['restart']['restored_blocks']} blocks "
            f"(index listed {c['restart']['disk_blocks_at_stop']} at stop); "
            f"bytes on disk max {c['disk_usage_max']} <= disk_bytes {c['disk_bytes']}: "
            f"{c['disk_usage_max'] <= c['disk_bytes']}"
        )
        ws = c["warm_disk_state"]
        print(
            f"  warm service: {ws['demoted']} blocks demoted, dropped {ws['dropped']}, "
            f"{ws['refused_admission']} refused admission; failed onloads warm "
            f"{c['warm']['window']['failed_onloads']}, restart "
            f"{c['restart']['window']['failed_onloads']} (window); restart opened in "
            f"{c['restart_open_s']} s"
        )


def print_b(b: dict[str, Any]) -> None:
    print()
    print(
        f"(b) the trace's first {b['requests']} requests ({b['block_refs']} block references, "
        f"{b['distinct_blocks']} distinct) over two vLLM 0.33 engines; primary "
        f"{b['primary_chunks_per_engine']} chunks each; kvoffload pool {b['pool_blocks']} x "
        f"4 KiB, disk tier {b['disk_blocks']} blocks ({b['disk_bytes']} bytes); fs tier "
        f"{b['fs_threads']}+{b['fs_threads']} threads"
    )
    print(
        f"{'configuration':<34} | {'hit ratio':>9} | {'steps':>6} | {'p50 us':>7} | "
        f"{'p99 us':>8} | {'bytes on disk':>13} | {'bound':>10} | replay s"
    )
    for r in b["rows"]:
        usage = f"{r['disk_usage']:>13}" if "disk_usage" in r else f"{'-':>13}"
        bound = r.get("bound")
        print(
            f"{r['name']:<34} | {r['hit_ratio']:>9.3f} | {r['steps']:>6} | "
            f"{r['step_us_p50']:>7.1f} | {r['step_us_p99']:>8.1f} | {usage} | "
            f"{bound if bound else 'none':>10} | {r['replay_s']} ({r['wall_s']})"
        )
    for r in b["rows"]:
        if "growth" in r:
            extra = ""
            if "disk_state" in r:
                extra = (
                    f"; in files {r['disk_usage_files']}; after the stop "
                    f"{r['disk_usage_stopped']} {r['files_at_stop']}; {r['disk_state']}"
                )
            else:
                extra = f"; {r['files']} files, {r['disk_usage_files']} bytes in them"
            growth = ", ".join(f"{n}: {u}" for n, u in r["growth"])
            print(f"  {r['name']}: bytes on disk by request {growth}{extra}")


if __name__ == "__main__":
    main()
