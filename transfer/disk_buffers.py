"""The disk tier's buffers: the store's own private memory, on huge pages where the kernel gives
them, that every transfer's disk side goes through (``O_DIRECT`` needs aligned memory, and the
pool's shared memory is on 4 KiB pages unless its tmpfs was mounted for huge ones).

Blocks are copied out of the pool into staging buffers before they are written, and read into
read buffers (two per I/O thread, a run each) before they are copied into the pool: while a MAC
thread checks one read buffer and copies its good blocks on, the I/O thread reads its next run
into the other. Why huge pages, and why private memory: ``_buffer``.
"""

from __future__ import annotations

import contextlib
import mmap
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from transfer.disk_index import PAGE
from transfer.host_pool import HostPool

__all__ = ["HUGE_PAGE", "DiskBuffers", "release_views"]


class DiskBuffers:
    """A store's staging buffers (``staging_blocks`` slots, handed out by ``stage``) and read
    buffers (``read_buffers`` of ``read_run_blocks`` slots each, handed out by
    ``take_read_buffer``). Thread-safe; ``close`` only once no transfer uses them."""

    def __init__(
        self,
        block_bytes: int,
        slot_bytes: int,
        staging_blocks: int,
        read_run_blocks: int,
        read_buffers: int,
    ) -> None:
        """Map and fault in both (``_buffer``); ``huge_pages`` says whether they got huge
        pages."""
        self.block_bytes = block_bytes
        self.staging, staging_huge = _buffer(max(1, staging_blocks) * slot_bytes)
        read_bytes = read_run_blocks * slot_bytes
        self._reads, reads_huge = _buffer(read_buffers * read_bytes)
        self.read_rows: np.ndarray[Any, np.dtype[np.uint8]] | None = np.frombuffer(
            self._reads, dtype=np.uint8
        ).reshape(read_buffers, read_bytes)
        self._reads_free = list(range(read_buffers))
        # Each buffer's block views, made once: an I/O thread runs no Python it can spare
        # between two reads (it needs the GIL for it, and the disk idles meanwhile).
        bb = block_bytes
        self.read_views: list[list[memoryview]] = [
            [row[i * bb : (i + 1) * bb].data for i in range(read_bytes // slot_bytes)]
            for row in self.read_rows
        ]
        self._read_buffer_freed = threading.Condition(threading.Lock())
        #: Whether those buffers are on huge pages (False: each block read or written is
        #: split into more device requests; see ``_buffer``). None: unknown (no smaps), or
        #: both too small to hold one.
        said = [h for h in (staging_huge, reads_huge) if h is not None]
        self.huge_pages = all(said) if said else None
        # numpy's copy into it releases the GIL (a slice assignment into the mmap holds it
        # through each block: the I/O threads, back from their writes, waited up to the
        # interpreter's 5 ms switch interval for it, and the disk idled meanwhile).
        self.staging_rows: np.ndarray[Any, np.dtype[np.uint8]] | None = np.frombuffer(
            self.staging, dtype=np.uint8
        ).reshape(-1, slot_bytes)
        self._staging_free = list(range(staging_blocks - 1, -1, -1))
        self._mutex = threading.Lock()

    def stage(self, pool: HostPool, pool_slots: Sequence[int]) -> list[int] | None:
        """Copy ``pool``'s slots into free staging buffers; their buffer ids, or None when too
        few are free or the buffers are closed (nothing copied)."""
        rows = self.staging_rows
        with self._mutex:
            if rows is None or len(self._staging_free) < len(pool_slots):
                return None
            ids = [self._staging_free.pop() for _ in pool_slots]
        tensor = pool.tensor.numpy()
        bb = self.block_bytes
        for buf, slot in zip(ids, pool_slots, strict=True):
            rows[buf, :bb] = tensor[slot]
        return ids

    def unstage(self, ids: Sequence[int]) -> None:
        """Give staging buffers back (their blocks are written or dropped)."""
        with self._mutex:
            self._staging_free.extend(ids)

    @property
    def staging_free(self) -> int:
        """Staging buffers free now."""
        return len(self._staging_free)

    def take_read_buffer(self) -> int:
        """A free read buffer, waiting for the MAC threads to give one back if none is (two
        per I/O thread: the wait is the MAC threads falling behind the disk)."""
        with self._read_buffer_freed:
            while not self._reads_free:
                self._read_buffer_freed.wait()
            return self._reads_free.pop()

    def give_read_buffer(self, buf: int) -> None:
        """Give read buffer ``buf`` back (its blocks are copied on or dropped)."""
        with self._read_buffer_freed:
            self._reads_free.append(buf)
            self._read_buffer_freed.notify()

    def close(self) -> None:
        """Unmap both (once: the store calls it when its threads are done with them)."""
        self.staging_rows = None  # its export of the mapping ends before the mapping
        self.staging.close()
        for views in self.read_views:
            release_views(views)
        self.read_views = []
        self.read_rows = None  # as the staging rows
        self._reads.close()


def _buffer(nbytes: int) -> tuple[mmap.mmap, bool | None]:
    """A private anonymous mapping of ``nbytes``, on huge pages where the kernel gives them
    (``MADV_HUGEPAGE``: transparent huge pages in ``madvise`` or ``always`` mode), faulted in
    now, in one pass; and whether it got huge pages (None: ``/proc/self/smaps`` unreadable, or
    ``nbytes`` too small to hold an aligned huge page).

    Why: an O_DIRECT request is split where its memory is not physically contiguous, and a
    block on scattered 4 KiB pages (256 of them in 1 MiB) exceeds a virtio disk's 254 segments
    a request, so each 1 MiB write went to the device as a request of 1016 KiB and one of
    8 KiB. Measured here (2026-12-03, 128 MiB in 4 MiB writes on 4 threads): 3.1 GB/s from
    4 KiB pages, 5.3 GB/s from huge pages; the service's demotion went from 0.55-0.69x fio's
    sequential write to 0.83-1.09x, and an onload read through these buffers from 0.84-1.03x
    fio's sequential read to 1.40-1.49x. The mapping must be private: shared anonymous memory
    (``mmap(-1, n)``'s default) is shmem, which gets huge pages only where
    ``/sys/kernel/mm/transparent_hugepage/shmem_enabled`` allows, and that is ``never`` by
    default. Faulting at open also keeps the first transfer's page faults (and the kernel's
    compaction for huge pages) off the loop."""
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(AttributeError, OSError):  # no THP: 4 KiB pages, still faulted
        buf.madvise(mmap.MADV_HUGEPAGE)
    rows = np.frombuffer(buf, dtype=np.uint8)
    if nbytes < 2 * HUGE_PAGE:  # too small to hold an aligned huge page: nothing to ask smaps
        rows[::PAGE] = 0
        return buf, None
    # The kernel merges adjacent private mappings with the same flags into one (the staging
    # and the read buffers, made one after the other): what this buffer got is the mapping's
    # huge bytes after faulting it in, less those before.
    before = _anon_huge_bytes(rows.ctypes.data)
    rows[::PAGE] = 0
    after = _anon_huge_bytes(rows.ctypes.data)
    del rows  # its export of the mapping
    if before is None or after is None:
        return buf, None  # unknown
    return buf, after > before


def _huge_page_bytes() -> int:
    """The size of a transparent huge page here (x86-64's 2 MiB where the kernel does not say)."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size", encoding="ascii") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 2 << 20


HUGE_PAGE = _huge_page_bytes()


def _anon_huge_bytes(address: int) -> int | None:
    """``AnonHugePages`` of this process's mapping that holds ``address``, in bytes (None:
    ``/proc/self/smaps`` unreadable, or no such mapping)."""
    try:
        with open("/proc/self/smaps", encoding="ascii", errors="replace") as smaps:
            inside = False
            for line in smaps:
                head = line.split(maxsplit=1)[0]
                if "-" in head and not head.endswith(":"):  # a mapping's first line
                    start, end = (int(x, 16) for x in head.split("-", 1))
                    inside = start <= address < end
                elif inside and head == "AnonHugePages:":
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return None


def release_views(views: list[memoryview]) -> None:
    """Release each view (a mapping cannot close while a view of it is alive)."""
    for v in views:
        v.release()
