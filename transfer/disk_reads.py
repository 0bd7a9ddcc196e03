"""The disk tier's read path: blocks read from the ``blocks`` file in runs of contiguous slots,
checked against their MACs and copied into their pool slots (``DiskReads``).

Each run is read in one ``preadv`` (``READ_RUN_BYTES`` at most) on an I/O thread, into a read
buffer of the store's own (``transfer.disk_buffers``); the I/O thread hands that buffer to a
MAC thread, which checks each block there against its index entry (``transfer.disk_index``)
and copies only the good ones into the pool, while the I/O thread reads its next run into its
other buffer at once. So no I/O thread waits on a hash and the disk keeps ``io_threads`` reads
in flight. Writes group their slots into runs the same way (``slot_runs``).
"""

from __future__ import annotations

import errno
import functools
import hmac
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from transfer.disk_buffers import DiskBuffers
from transfer.disk_index import IndexFile, block_mac
from transfer.host_pool import HostPool

__all__ = [
    "IOV_MAX",
    "READ_BUFFERS_PER_THREAD",
    "READ_RUN_BYTES",
    "DiskReads",
    "read_run_blocks",
    "slot_runs",
]

#: Bytes of contiguous slots a read takes in one system call. Smaller than a write's run: an
#: onload waits for its last block, and with 1 MiB reads four in flight stream as well as
#: 4 MiB ones here (2.8 GB/s) while each block's MAC check and copy overlap the reads still in
#: flight instead of all coming after them (with 4 MiB runs, a 16-block onload's four reads
#: landed together and their checks added 3-4 ms after the last one).
READ_RUN_BYTES = 1 << 20
#: Read buffers per I/O thread: one being read into while the MAC threads check the other.
READ_BUFFERS_PER_THREAD = 2
IOV_MAX = 1024  # Linux's limit of buffers per readv/writev


def read_run_blocks(block_bytes: int, slot_bytes: int) -> int:
    """Blocks a read run holds at most (``READ_RUN_BYTES``; one block when padded: blocks of a
    run land in separate pool slots, and padding between them on disk, a block size that is
    not whole pages, keeps them one block a call)."""
    if slot_bytes != block_bytes:
        return 1
    return max(1, min(IOV_MAX, READ_RUN_BYTES // slot_bytes))


def slot_runs(order: list[int], slot_of: Callable[[int], int], cap: int) -> list[list[int]]:
    """Item indices grouped into runs of consecutive disk slots (ascending, ``cap`` at most)."""
    runs: list[list[int]] = []
    for i in sorted(order, key=slot_of):
        if runs and len(runs[-1]) < cap and slot_of(runs[-1][-1]) + 1 == slot_of(i):
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs


class DiskReads:
    """A store's reads: ``submit`` starts them, ``held_slots`` says which pool slots they still
    write into. Shares the store's files, index, buffers and threads; reports its counters and
    failures through ``count`` and ``failed`` (the store's health). ``closed``: set when the
    store closes, after which a run reads nothing."""

    def __init__(
        self,
        *,
        data_fd: int,
        index: IndexFile,
        mac_key: bytes,
        pool: HostPool,
        slot_bytes: int,
        buffers: DiskBuffers,
        io_threads: ThreadPoolExecutor,
        mac_threads: ThreadPoolExecutor,
        count: Callable[[str, int], None],
        failed: Callable[[str, OSError], None],
    ) -> None:
        """Reads of ``pool.block_bytes`` blocks from ``data_fd`` (the ``blocks`` file), checked
        under ``mac_key`` (the directory's block key) against ``index``'s entries; slot ``i`` at
        offset ``i x slot_bytes``."""
        self._data_fd = data_fd
        self.index = index
        self._mac_key = mac_key
        self.pool = pool
        self.block_bytes = pool.block_bytes
        self.slot_bytes = slot_bytes
        self._buffers = buffers
        self._pool = io_threads
        self._macs = mac_threads
        self._count = count
        self._failed = failed
        self._mutex = threading.Lock()
        self._held: dict[int, int] = {}  # pool slots a read still writes into -> count
        self.closed = False
        # Test seam: the syscall that moves bytes (a fault test swaps in a failing one).
        self.preadv: Callable[[int, list[memoryview], int], int] = os.preadv

    def submit(self, items: Sequence[tuple[int, bytes, int]]) -> Future[list[bool]]:
        """Start reading blocks into pool slots: ``(disk_slot, key, pool_slot)``
        each; the future says, per item, True only when the whole block was read and matches
        its key and checksum (a False pool slot holds undefined bytes). Runs of contiguous
        slots go to the I/O threads now, one system call each (``READ_RUN_BYTES`` at most), queued
        behind the reads submitted before: reads submitted in order finish roughly in order.
        The pool slots are in ``held_slots`` until the future is done."""
        done: Future[list[bool]] = Future()
        items = list(items)
        if not items:
            done.set_result([])
            return done
        self._hold(items)
        results = [False] * len(items)
        # Blocks of a run land in separate pool slots; padding between them on disk (a block
        # size that is not whole pages) keeps them one block a call.
        runs = slot_runs(
            self._listed_items(items),
            lambda i: items[i][0],
            read_run_blocks(self.block_bytes, self.slot_bytes),
        )
        left = [len(runs)]

        def settle() -> None:
            self._let_go(items)
            done.set_result(results)

        def ran(run: list[int], oks: list[bool]) -> None:
            for i, ok in zip(run, oks, strict=True):
                results[i] = ok
            with self._mutex:
                left[0] -= 1
                last = not left[0]
            if last:
                settle()

        if not runs:
            settle()
            return done
        for at, run in enumerate(runs):
            finish = _Once(functools.partial(ran, run), len(run))
            try:
                future = self._pool.submit(self._read_run, [items[i] for i in run], finish)
            except RuntimeError:  # the store closed: this run and the rest read nothing
                self._count("read_failures", sum(len(r) for r in runs[at:]))
                with self._mutex:
                    left[0] -= len(runs) - at
                    last = not left[0]
                if last:
                    settle()
                break
            # A run whose task raised (a bug, not an I/O error: those are caught) reads as
            # failed rather than leaving the load waiting forever.
            future.add_done_callback(finish.on_error)
        return done

    def _hold(self, items: list[tuple[int, bytes, int]]) -> None:
        """Count the items' pool slots in ``held_slots`` (once per item)."""
        with self._mutex:
            for _, _, pool_slot in items:
                self._held[pool_slot] = self._held.get(pool_slot, 0) + 1

    def _let_go(self, items: list[tuple[int, bytes, int]]) -> None:
        """Undo ``_hold(items)``: a slot leaves ``held_slots`` when no read holds it."""
        with self._mutex:
            for _, _, pool_slot in items:
                n = self._held[pool_slot] - 1
                if n:
                    self._held[pool_slot] = n
                else:
                    del self._held[pool_slot]

    def _listed_items(self, items: list[tuple[int, bytes, int]]) -> list[int]:
        """Indices of the items whose slot the index lists under their key; the others are
        counted as failed reads (their results stay False)."""
        listed = []
        for i, (slot, key, _) in enumerate(items):
            entry = self.index.entries.get(slot)
            if entry is None or entry.key != key:
                self._count("read_failures", 1)
            else:
                listed.append(i)
        return listed

    def _read_run(self, run: list[tuple[int, bytes, int]], finish: _Once) -> None:
        """Read contiguous slots in one call into a free read buffer (``DiskBuffers``), then hand
        the buffer to the MAC threads, which check each block there and copy the good ones
        into their pool slots (``_check_run``), so that this I/O thread starts its next read
        at once (the disk keeps ``io_threads`` reads in flight). ``finish`` gets, per block,
        whether it was read and matches its MAC (a False slot holds bytes nobody may use)."""
        if self.closed:
            self._count("read_failures", len(run))
            finish([False] * len(run))
            return
        buf = self._buffers.take_read_buffer()
        try:
            views = self._buffers.read_views[buf][: len(run)]
            want = self.block_bytes * len(run)
            got = self.preadv(self._data_fd, views, run[0][0] * self.slot_bytes)
            if got != want:
                raise OSError(errno.EIO, f"short read ({got} of {want} bytes)")
        except OSError as exc:
            self._buffers.give_read_buffer(buf)
            self._failed("read", exc)
            self._count("read_failures", len(run))
            finish([False] * len(run))
            return
        except BaseException:
            self._buffers.give_read_buffer(buf)
            raise
        try:
            checking = self._macs.submit(self._check_run, run, buf, finish)
        except RuntimeError:  # the MAC threads are shut down (closing): check here
            self._check_run(run, buf, finish)
            return
        checking.add_done_callback(finish.on_error)

    def _check_run(self, run: list[tuple[int, bytes, int]], buf: int, finish: _Once) -> None:
        """Check each block of the run read into read buffer ``buf`` against its entry's MAC
        (keyed BLAKE3, the GIL released while it hashes), copy the good ones into their pool
        slots (numpy's copy releases the GIL too), give the buffer back, and ``finish`` with
        the result. The MAC is of the bytes copied on, so no block reaches the pool that
        failed its check."""
        ok: list[bool] = []
        try:
            bb = self.block_bytes
            rows = self._buffers.read_rows
            assert rows is not None  # closing waits for these threads before dropping it
            views = self._buffers.read_views[buf]
            entries, mac_key = self.index.entries, self._mac_key
            pool = self.pool.tensor.numpy()
            for i, (slot, key, pool_slot) in enumerate(run):
                entry = entries.get(slot)
                good = (
                    entry is not None
                    and entry.key == key
                    and hmac.compare_digest(block_mac(mac_key, key, views[i]), entry.mac)
                )
                if good:
                    pool[pool_slot] = rows[buf, i * bb : (i + 1) * bb]
                ok.append(good)
        finally:
            self._buffers.give_read_buffer(buf)
        good_blocks = ok.count(True)
        self._count("checksum_failures", len(run) - good_blocks)
        self._count("reads", good_blocks)
        self._count("bytes_read", self.block_bytes * good_blocks)
        finish(ok)

    def held_slots(self) -> frozenset[int]:
        """Pool slots a read still writes into (a caller that gave up waiting must not reuse
        them until they leave this set)."""
        with self._mutex:
            return frozenset(self._held)


class _Once:
    """A run's completion: calls ``done(oks)`` the first time it is called, never again (a
    run is finished by its read, its MAC check, or the error handler of whichever raised)."""

    def __init__(self, done: Callable[[list[bool]], None], n: int) -> None:
        self._done: Callable[[list[bool]], None] | None = done
        self._n = n
        self._lock = threading.Lock()

    def __call__(self, oks: list[bool]) -> None:
        with self._lock:
            done, self._done = self._done, None
        if done is not None:
            done(oks)

    def on_error(self, future: Future[None]) -> None:
        """Done callback of a task that should have finished the run: finish it as failed if
        the task raised (a no-op when it finished the run already)."""
        if future.exception() is not None:
            self([False] * self._n)
