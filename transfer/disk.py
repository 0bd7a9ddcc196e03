"""The disk tier's bytes: block slots in one file, an index of what each holds, keyed MACs.

``DiskStore`` keeps blocks of the host pool's ``block_bytes`` in a directory of its own,
``<root>/<name>`` (the service: ``<--disk-dir>/<namespace>``, so keys of two namespaces never
meet). Its pieces live beside it:

- ``transfer.disk_files``: the directories and files, and who may touch them (every level
  from ``/`` checked, nothing followed or written through that someone else could have
  planted); ``root/.key``, the master key of every directory below; ``DiskError``.
- ``transfer.disk_index``: the ``index`` file (one MAC'd 128-byte entry per slot) and the
  block MACs, keyed per directory and block size.
- ``transfer.disk_buffers``: the store's own memory that every transfer's disk side goes
  through (staging and read buffers, on huge pages where the kernel gives them).

The namespace's directory holds:

- ``blocks``: slot ``i`` at offset ``i x slot_bytes`` (``block_bytes`` rounded up to 4 KiB).
  Allocated to its full size when the store opens (``posix_fallocate``; ``preallocated``), after
  checking that the filesystem has room for both files (``DiskSpaceError`` otherwise, before
  anything is read or allocated). Written and read with ``O_DIRECT`` when the filesystem and
  the block size allow it (``direct``), buffered otherwise; runs of adjacent slots go in one
  ``preadv`` / ``pwritev`` (``RUN_BYTES`` at most).
- ``index``: a header, then one entry per slot (``transfer.disk_index``). Written buffered,
  never read on the data path: the entries live in memory.
- ``probe``: one page, written afresh (and freed again) to tell whether writes work again
  after a fault.
- ``lock``: ``flock``-ed while open, so two processes never share a directory.

**A block is served only when its MACs hold.** Writing a block: its entry is cleared, the bytes
are written, then the entry is written. A block torn by a crash (SIGKILL, power loss) is
therefore either unlisted or listed with a MAC its bytes do not match; reads check every block
against its entry, so a torn, corrupt or forged block is reported as failed (the caller drops
it), never returned as good. The keys are readable by the service alone: someone who could
write the files but not read ``.key`` can still not make a block or an entry that passes (an
unkeyed checksum, as format 1's xxh3, anyone can recompute).

Restart: opening reads the index (``transfer.disk_index.IndexFile``) and keeps the entries
whose own MAC holds; ``listed()`` returns them oldest write first. Entries that fail their MAC
are cleared and counted in ``checksum_failures`` and ``unauthenticated_dropped``; an index of
another format version is never loaded (its blocks counted in ``format_dropped``), nor one of
another block size.

Bytes under the directory never exceed ``disk_bytes``: ``slots_for(disk_bytes, block_bytes)``
sizes the slot count so that ``blocks`` (at most ``slots x slot_bytes``), ``index``
(4 KiB + 128 B per slot, rounded up to whole pages as the filesystem allocates it) and
``probe`` (4 KiB) fit. ``root/.key`` (one page) is shared by every namespace, outside their
budgets.

Faults: an ``OSError`` on a write (disk full, read-only, I/O error) or a read marks the store
``degraded`` (``health()``); the failed blocks are reported failed, nothing raises out of the
data calls. ``probe()`` tries a real write and returns the store to ``ok`` when it works.

Data calls run their blocks on a small pool of I/O threads (``io_threads``: the requests in
flight); they block the caller, so the service calls them off its event loop. The disk's side
of every request is the store's own private memory, on huge pages where the kernel gives them
(``transfer.disk_buffers``): blocks are copied out of the pool into staging buffers before they
are written, and read into read buffers (two per I/O thread, a run of ``READ_RUN_BYTES`` each)
before they are copied into the pool. The MACs (BLAKE3, about 4-5.5 GiB/s a core at 1 MiB blocks; it
releases the GIL) run on MAC threads (one per core, ``io_threads`` at most): a read's I/O
thread hands its buffer over, the MAC thread checks each block there and copies only the good
ones into their pool slots, and the I/O thread reads its next run into its other buffer at
once; a write's MACs are computed while its bytes are written. So no I/O thread waits on a hash
and the disk keeps ``io_threads`` requests in flight.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait

from transfer.disk_buffers import DiskBuffers, release_views
from transfer.disk_files import DiskError, DiskFiles
from transfer.disk_index import (
    ENTRY_BYTES,
    HEADER_BYTES,
    MAX_KEY,
    PAGE,
    IndexFile,
    block_mac,
    derive_keys,
)
from transfer.disk_reads import (
    IOV_MAX,
    READ_BUFFERS_PER_THREAD,
    DiskReads,
    read_run_blocks,
    slot_runs,
)
from transfer.health import TierHealth, TierState
from transfer.host_pool import HostPool

__all__ = [
    "DISK_COUNTERS",
    "DiskHealth",
    "DiskStore",
    "disk_bytes_for",
    "slots_for",
]

#: Bytes of contiguous slots read or written in one system call: large enough to amortize the
#: call and let the device stream, small enough to spread a batch over the I/O threads.
RUN_BYTES = 4 << 20

DiskState = TierState

DISK_COUNTERS = (
    "writes",  # blocks written whole
    "write_failures",  # blocks a write did not store (I/O error, disk full, read-only)
    "reads",  # blocks read back whole with a matching MAC
    "read_failures",  # blocks a read could not read (I/O error, short read)
    # blocks read back whose bytes did not match their MAC, and index entries that failed their
    # own MAC at open (forged, torn, another key's): dropped, never loaded
    "checksum_failures",
    "bytes_written",
    "bytes_read",
    "incidents",  # times the store went from ok to degraded
)


def slots_for(disk_bytes: int, block_bytes: int) -> int:
    """How many block slots fit in ``disk_bytes`` with the index, the probe page and the
    directory's own page."""
    slot = _slot_bytes(block_bytes)
    n = max(0, (disk_bytes - HEADER_BYTES - _FIXED) // (slot + ENTRY_BYTES))
    # The index takes whole pages on disk (``du``), not its 128 B per slot: at most one page
    # more than the estimate, so at most a slot or two less.
    while n > 0 and n * slot + _index_pages(n) + _FIXED > disk_bytes:
        n -= 1
    return n


#: Pages besides the blocks and the index: the probe's and the namespace directory's own.
_FIXED = 2 * PAGE


def disk_bytes_for(slots: int, block_bytes: int) -> int:
    """The smallest ``disk_bytes`` that holds ``slots`` blocks of ``block_bytes`` (the
    inverse of ``slots_for``)."""
    return slots * _slot_bytes(block_bytes) + _index_pages(slots) + _FIXED


def min_disk_bytes(block_bytes: int) -> int:
    """The smallest ``disk_bytes`` that holds one block of ``block_bytes``."""
    return disk_bytes_for(1, block_bytes)


def _index_pages(num_slots: int) -> int:
    return -(-(HEADER_BYTES + num_slots * ENTRY_BYTES) // PAGE) * PAGE


def _slot_bytes(block_bytes: int) -> int:
    return -(-block_bytes // PAGE) * PAGE


#: The store's state and counters (at least ``DISK_COUNTERS``): ``transfer.health.TierHealth``.
DiskHealth = TierHealth


class DiskStore:
    """Block slots on disk for one namespace; see the module docstring."""

    def __init__(
        self,
        directory: str,
        pool: HostPool,
        num_slots: int,
        *,
        staging_blocks: int = 64,
        io_threads: int = 4,
        direct: bool | None = None,
    ) -> None:
        """Open (or create) the store in ``directory`` for blocks of ``pool.block_bytes``.

        ``directory`` is ``<root>/<name>``: ``root`` is opened and checked level by level (made
        0700 where missing) and holds the master key (``root/.key``, made at the first start);
        ``name``, the store's own directory, is bound into its keys. ``direct``: None tries
        ``O_DIRECT`` and falls back to buffered I/O where the filesystem or the block size does
        not allow it; False forces buffered I/O. ``staging_blocks``: aligned buffers that hold
        blocks copied out of the pool until they are written. Raises ``DiskError`` (nothing
        left open) when the directory cannot be used or is refused (``transfer.disk_files``).

        After opening, ``format_dropped`` counts the blocks of an index of another format
        version that were dropped, and ``unauthenticated_dropped`` the index entries that
        failed their MAC (both 0 mostly; the caller logs them).
        """
        if num_slots <= 0:
            raise DiskError(f"the disk holds no block of {pool.block_bytes} bytes")
        self.directory = directory
        self.pool = pool
        self.block_bytes = pool.block_bytes
        self.slot_bytes = _slot_bytes(self.block_bytes)
        self.num_slots = num_slots
        self._files = self._open(direct)
        self.format_dropped = self.index.format_dropped
        self.unauthenticated_dropped = self.index.unauthenticated
        # The disk's side of every transfer is the store's own memory (``DiskBuffers``): the
        # pool is shared memory, on 4 KiB pages unless its tmpfs was mounted for huge ones,
        # and reads straight into it ran at 0.6-0.7x.
        self.staging_blocks = staging_blocks
        self._buffers = DiskBuffers(
            self.block_bytes,
            self.slot_bytes,
            staging_blocks,
            read_run_blocks(self.block_bytes, self.slot_bytes),
            READ_BUFFERS_PER_THREAD * io_threads,
        )
        #: Whether those buffers are on huge pages (``DiskBuffers.huge_pages``).
        self.huge_pages = self._buffers.huge_pages
        self._mutex = threading.Lock()
        self._state: DiskState = "ok"
        self._since = time.time()
        self._last_error: str | None = None
        self._counters = dict.fromkeys(DISK_COUNTERS, 0)
        # Entries dropped at open were blocks that would have failed their MAC on a read.
        self._counters["checksum_failures"] = self.unauthenticated_dropped
        self._closed = False
        # Test seam: the syscall that moves bytes (a fault test swaps in a failing one).
        self.pwritev: Callable[[int, list[memoryview], int], int] = os.pwritev
        self._start_io(io_threads)

    def _start_io(self, io_threads: int) -> None:
        """Start ``io_threads`` I/O threads, the MAC threads, and the read path on them."""
        self._pool = ThreadPoolExecutor(io_threads, thread_name_prefix="kvoffload-disk")
        # MAC threads: the I/O threads hand them the hashing, so that each I/O thread issues
        # its next request at once. More than the cores would only queue on them.
        self._macs = ThreadPoolExecutor(
            max(1, min(io_threads, os.cpu_count() or 1)), thread_name_prefix="kvoffload-disk-mac"
        )
        self._reads = DiskReads(
            data_fd=self._files.data_fd,
            index=self.index,
            mac_key=self._keys.block,
            pool=self.pool,
            slot_bytes=self.slot_bytes,
            buffers=self._buffers,
            io_threads=self._pool,
            mac_threads=self._macs,
            count=self._count,
            failed=self._failed,
        )

    # ------------------------------------------------------------------ opening

    def _open(self, direct: bool | None) -> DiskFiles:
        """Open the directory's files (``DiskFiles``), derive the keys, read the index
        (``index``), then allocate the blocks file (``preallocated``) and set ``direct``. Any
        ``OSError`` becomes a ``DiskError`` naming the directory; nothing is left open when it
        raises."""
        files: DiskFiles | None = None
        try:
            files = DiskFiles(self.directory)
            self._keys = derive_keys(files.master_key, files.name, self.block_bytes)
            # Before anything costs time or memory per slot (the index read, the allocation):
            # a tier larger than its filesystem is refused at once.
            needed = disk_bytes_for(self.num_slots, self.block_bytes)
            files.check_space(needed, self.num_slots, self.slot_bytes)
            self.index = IndexFile(
                files.index_fd,
                files.data_fd,
                self._keys.entry,
                self.block_bytes,
                self.slot_bytes,
                self.num_slots,
            )
            self.preallocated = files.preallocate(self.num_slots * self.slot_bytes, needed)
            self.direct = files.set_direct(direct, self.block_bytes)
        except OSError as exc:
            if files is not None:
                files.close()
            raise DiskError(f"cannot use {self.directory}: {exc.strerror or exc}") from None
        except BaseException:
            if files is not None:
                files.close()
            raise
        return files

    def listed(self) -> list[tuple[bytes, int]]:
        """``(key, slot)`` of every block the index lists, oldest write first (a key listed
        twice, from an interrupted rewrite, keeps its newest slot)."""
        return self.index.listed()

    # ------------------------------------------------------------------ staging

    def stage(self, pool_slots: Sequence[int]) -> list[int] | None:
        """Copy pool slots into free staging buffers (on the caller's thread, before the pool
        slots are reused); their buffer ids, or None when too few are free or the store is
        closed (nothing copied).
        One thread: a second one copying half (measured) moved no more bytes a second, the
        copy being bound by the memory's bandwidth, not the core; it lets go of the GIL while
        it copies, so the I/O threads keep the disk busy meanwhile."""
        return self._buffers.stage(self.pool, pool_slots)

    def unstage(self, ids: Sequence[int]) -> None:
        """Give staging buffers back (their blocks are written or dropped)."""
        self._buffers.unstage(ids)

    @property
    def staging_free(self) -> int:
        """Staging buffers free now."""
        return self._buffers.staging_free

    # ------------------------------------------------------------------ writes

    def write_many(self, items: Sequence[tuple[int, bytes, int]]) -> list[bool]:
        """``submit_writes(items)``, waited for."""
        return self.submit_writes(items).result()

    def submit_writes(self, items: Sequence[tuple[int, bytes, int]]) -> Future[list[bool]]:
        """Start writing staged blocks: ``(disk_slot, key, staging_id)`` each; the future says,
        per item, whether the block is whole on disk and listed. Runs of contiguous slots go
        to the I/O threads now, one system call each (``RUN_BYTES`` at most), queued behind
        the writes submitted before, so that a caller may submit a batch and stage the next
        while it is written. The staging buffers must stay untouched until the future is
        done."""
        done: Future[list[bool]] = Future()
        results = [False] * len(items)
        good = [
            i
            for i, (slot, key, _) in enumerate(items)
            if len(key) <= MAX_KEY and 0 <= slot < self.num_slots
        ]
        runs = slot_runs(good, lambda i: items[i][0], self._run_blocks(self.slot_bytes))
        left = [len(runs)]
        if not runs:
            done.set_result(results)
            return done

        def ran(run: list[int], future: Future[list[bool]]) -> None:
            # A run whose task raised (a bug, not an I/O error: those are caught) counts as
            # not written, rather than leaving the caller waiting forever.
            oks = future.result() if future.exception() is None else [False] * len(run)
            with self._mutex:
                for i, ok in zip(run, oks, strict=True):
                    results[i] = ok
                left[0] -= 1
                last = not left[0]
            if last:
                done.set_result(results)

        for at, run in enumerate(runs):
            try:
                future = self._pool.submit(self._write_run, [items[i] for i in run])
            except RuntimeError:  # the store closed: this run and the rest write nothing
                with self._mutex:
                    left[0] -= len(runs) - at
                    last = not left[0]
                if last:
                    done.set_result(results)
                break
            future.add_done_callback(functools.partial(ran, run))
        return done

    def _write_run(self, run: list[tuple[int, bytes, int]]) -> list[bool]:
        """Write blocks to contiguous slots: entries cleared, bytes written in one call, then
        the entries written (see the module docstring for why this order)."""
        if self._closed:
            return [False] * len(run)
        sb, first = self.slot_bytes, run[0][0]
        staging = memoryview(self._buffers.staging)
        views = [staging[buf * sb : (buf + 1) * sb] for _, _, buf in run]
        keys = [key for _, key, _ in run]
        # The MACs are computed on a MAC thread while this one writes (the staged bytes do not
        # change meanwhile): the write's time is not followed by the hashing's.
        hashing: Future[list[bytes]] | None = None
        with contextlib.suppress(RuntimeError):  # MAC threads shut down: hashed below
            hashing = self._macs.submit(self._block_macs, keys, views)
        try:
            self.index.clear(first, len(run))
            written = self.pwritev(self._files.data_fd, views, first * sb)
            if written != sb * len(run):
                raise OSError(errno.EIO, f"short write ({written} of {sb * len(run)} bytes)")
            macs = self._block_macs(keys, views) if hashing is None else hashing.result()
            self.index.write(first, list(zip(keys, macs, strict=True)))
        except OSError as exc:
            self._failed("write", exc)
            self._count("write_failures", len(run))
            return [False] * len(run)
        finally:
            if hashing is not None:
                futures_wait([hashing])  # it reads the views released below
            release_views(views)
            staging.release()
        self._count("writes", len(run))
        self._count("bytes_written", sb * len(run))
        return [True] * len(run)

    def _block_macs(self, keys: list[bytes], views: list[memoryview]) -> list[bytes]:
        """The MAC of each staged block (``views``: whole slots; the MAC covers the block's
        bytes only)."""
        bb = self.block_bytes
        return [block_mac(self._keys.block, k, v[:bb]) for k, v in zip(keys, views, strict=True)]

    def _run_blocks(self, block_bytes: int) -> int:
        return max(1, min(IOV_MAX, RUN_BYTES // block_bytes))

    def forget(self, slots: Sequence[int]) -> None:
        """Unlist slots whose blocks the caller dropped (evicted from the disk index or found
        corrupt), so a restart does not bring them back. Best effort: a failed write leaves an
        entry whose block the index no longer holds, found and dropped at the next restart."""
        for slot in slots:
            self.index.forget(slot)

    # ------------------------------------------------------------------ reads

    def read_many(self, items: Sequence[tuple[int, bytes, int]]) -> list[bool]:
        """``submit_reads(items)``, waited for."""
        return self.submit_reads(items).result()

    def submit_reads(self, items: Sequence[tuple[int, bytes, int]]) -> Future[list[bool]]:
        """Start reading blocks into pool slots: ``(disk_slot, key, pool_slot)`` each
        (``DiskReads.submit``); the future says, per item, True only when the whole block was
        read and matches its key and MAC (a False pool slot holds undefined bytes). The pool
        slots are in ``held_slots`` until the future is done."""
        return self._reads.submit(items)

    def held_slots(self) -> frozenset[int]:
        """Pool slots a read still writes into (a caller that gave up waiting must not reuse
        them until they leave this set)."""
        return self._reads.held_slots()

    @property
    def preadv(self) -> Callable[[int, list[memoryview], int], int]:
        """Test seam: the syscall reads move bytes with (a fault test swaps in a failing one)."""
        return self._reads.preadv

    @preadv.setter
    def preadv(self, call: Callable[[int, list[memoryview], int], int]) -> None:
        self._reads.preadv = call

    # ------------------------------------------------------------------ health

    def health(self) -> DiskHealth:
        """State and counters; never blocks on the disk."""
        with self._mutex:
            return DiskHealth(self._state, self._since, self._last_error, dict(self._counters))

    def probe(self) -> bool:
        """Try a real write (``DiskFiles.write_probe``: a new page, synced); back to ``ok`` when
        it works. Blocks."""
        try:
            self._files.write_probe()
        except OSError as exc:
            self._failed("probe", exc)
            return False
        with self._mutex:
            if self._state != "ok":
                self._state = "ok"
                self._since = time.time()
        return True

    def disk_usage(self) -> int:
        """Bytes the store's files and directory take on disk now (allocated blocks, not
        apparent size)."""
        return self._files.usage()

    def mark_degraded(self, why: str) -> None:
        """Degrade the store for a reason seen by its caller (a read past its timeout)."""
        self._degrade(why)

    def _failed(self, what: str, exc: OSError) -> None:
        self._degrade(f"{what}: {exc.strerror or exc}")

    def _degrade(self, message: str) -> None:
        with self._mutex:
            self._last_error = message
            if self._state == "ok":
                self._state = "degraded"
                self._since = time.time()
                self._counters["incidents"] += 1

    def _count(self, name: str, n: int) -> None:
        with self._mutex:
            self._counters[name] += n

    # ------------------------------------------------------------------ closing

    def close(self) -> None:
        """Finish the I/O in flight and close the files (idempotent). The index stays on disk
        for the next start."""
        if self._closed:
            return
        self._closed = True
        self._reads.closed = True
        self._pool.shutdown(wait=True)  # first: its tasks hand work to the MAC threads
        self._macs.shutdown(wait=True)
        self._files.close()
        self._buffers.close()
