"""The disk tier's bytes: block slots in one file, an index of what each holds, checksums.

``DiskStore`` keeps blocks of the host pool's ``block_bytes`` in a directory of its own (one per
service namespace, so keys of two namespaces never meet):

- ``blocks``: slot ``i`` at offset ``i x slot_bytes`` (``block_bytes`` rounded up to 4 KiB).
  Sparse: a slot takes disk space once written. Written and read with ``O_DIRECT`` when the
  filesystem and the block size allow it (``direct``), buffered otherwise.
- ``index``: a 4 KiB header (format, block and slot size, slot count), then one 128-byte entry
  per slot: key, the block's checksum (xxh3-64 of its bytes, seeded with a hash of the key, so a
  block read back under another key fails too), a write sequence number and the entry's own
  checksum. Written buffered, never read on the data path: the entries live in memory.
- ``probe``: one page, written afresh (and freed again) to tell whether writes work again
  after a fault.
- ``lock``: ``flock``-ed while open, so two processes never share a directory.

Writing a block: its entry is cleared, the bytes are written, then the entry is written. A block
torn by a crash (SIGKILL, power loss) is therefore either unlisted or listed with a checksum its
bytes do not match; reads check every block against its entry, so a torn or corrupt block is
reported as failed (the caller drops it), never returned as good.

Restart: ``open`` reads the index file in one pass (128 bytes per slot: 512 MiB for 1 TB of
256 KiB blocks, a sequential read) and keeps the entries whose own checksum holds; ``listed()``
returns them oldest write first. A header of another block size starts the directory empty.

Bytes under the directory never exceed ``disk_bytes``: ``slots_for(disk_bytes, block_bytes)``
sizes the slot count so that ``blocks`` (at most ``slots x slot_bytes``), ``index``
(4 KiB + 128 B per slot, rounded up to whole pages as the filesystem allocates it) and
``probe`` (4 KiB) fit.

Faults: an ``OSError`` on a write (disk full, read-only, I/O error) or a read marks the store
``degraded`` (``health()``); the failed blocks are reported failed, nothing raises out of the
data calls. ``probe()`` tries a real write and returns the store to ``ok`` when it works.

Data calls run their blocks on a small pool of I/O threads (``io_threads``); they block the
caller, so the service calls them off its event loop. Checksums release the GIL.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import mmap
import os
import struct
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import xxhash

from transfer.errors import TransferError
from transfer.health import TierHealth, TierState
from transfer.host_pool import HostPool

__all__ = [
    "DISK_COUNTERS",
    "DiskError",
    "DiskHealth",
    "DiskStore",
    "block_checksum",
    "disk_bytes_for",
    "slots_for",
]

PAGE = 4096
#: Bytes of contiguous slots read or written in one system call: large enough to amortize the
#: call and let the device stream, small enough to spread a batch over the I/O threads.
RUN_BYTES = 4 << 20
_IOV_MAX = 1024  # Linux's limit of buffers per readv/writev
ENTRY_BYTES = 128
HEADER_BYTES = PAGE
_MAGIC = b"KVODISK1"
_HEADER = struct.Struct("<8sIQQQ")  # magic, version, block_bytes, slot_bytes, num_slots
_VERSION = 1
_ENTRY_MAGIC = b"KVOE"
# magic, key length, write sequence, block checksum, key (padded): then the entry's checksum.
_ENTRY = struct.Struct("<4sHQQ64s")
_ENTRY_SUM = struct.Struct("<Q")
_EMPTY = bytes(ENTRY_BYTES)
_MAX_KEY = 64

DiskState = TierState

DISK_COUNTERS = (
    "writes",  # blocks written whole
    "write_failures",  # blocks a write did not store (I/O error, disk full, read-only)
    "reads",  # blocks read back whole with a matching checksum
    "read_failures",  # blocks a read could not read (I/O error, short read)
    "checksum_failures",  # blocks read back whose bytes did not match their checksum
    "bytes_written",
    "bytes_read",
    "incidents",  # times the store went from ok to degraded
)


class DiskError(TransferError):
    """The disk tier cannot be opened: a directory that is not one, in use by another process,
    or not writable."""


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


def block_checksum(key: bytes, data: object) -> int:
    """The checksum a block is stored with: xxh3-64 of its bytes, seeded by its key."""
    return xxhash.xxh3_64_intdigest(data, seed=xxhash.xxh3_64_intdigest(key))  # type: ignore[arg-type]


#: The store's state and counters (at least ``DISK_COUNTERS``): ``transfer.health.TierHealth``.
DiskHealth = TierHealth


@dataclass(frozen=True, slots=True)
class _Entry:
    key: bytes
    checksum: int
    seq: int


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

        ``direct``: None tries ``O_DIRECT`` and falls back to buffered I/O where the filesystem
        or the block size does not allow it; False forces buffered I/O. ``staging_blocks``:
        aligned buffers that hold blocks copied out of the pool until they are written.
        Raises ``DiskError`` (nothing left open) when the directory cannot be used.
        """
        if num_slots <= 0:
            raise DiskError(f"the disk holds no block of {pool.block_bytes} bytes")
        self.directory = directory
        self.pool = pool
        self.block_bytes = pool.block_bytes
        self.slot_bytes = _slot_bytes(self.block_bytes)
        self.num_slots = num_slots
        self._lock_fd = -1
        self._data_fd = -1
        self._index_fd = -1
        try:
            os.makedirs(directory, mode=0o700, exist_ok=True)
            if not os.path.isdir(directory):
                raise DiskError(f"{directory} is not a directory")
            self._lock_fd = os.open(os.path.join(directory, "lock"), os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise DiskError(f"{directory} is in use by another process") from None
            self.direct = self._open_data(direct)
            self._index_fd = os.open(
                os.path.join(directory, "index"), os.O_RDWR | os.O_CREAT, 0o600
            )
            self.index = _IndexFile(
                self._index_fd, self._data_fd, self.block_bytes, self.slot_bytes, num_slots
            )
        except OSError as exc:
            self._close_fds()
            raise DiskError(f"cannot use {directory}: {exc.strerror or exc}") from None
        except BaseException:
            self._close_fds()
            raise
        # Page-aligned (mmap) buffers for blocks on their way from the pool to the disk.
        self.staging_blocks = staging_blocks
        self._staging = mmap.mmap(-1, max(1, staging_blocks) * self.slot_bytes)
        self._staging_free = list(range(staging_blocks - 1, -1, -1))
        self._pool = ThreadPoolExecutor(io_threads, thread_name_prefix="kvoffload-disk")
        self._mutex = threading.Lock()
        self._held: dict[int, int] = {}  # pool slots a read still writes into -> count
        self._state: DiskState = "ok"
        self._since = time.time()
        self._last_error: str | None = None
        self._counters = dict.fromkeys(DISK_COUNTERS, 0)
        self._closed = False
        # Test seam: the syscalls that move bytes (a fault test swaps in failing ones).
        self.pwritev: Callable[[int, list[memoryview], int], int] = os.pwritev
        self.preadv: Callable[[int, list[memoryview], int], int] = os.preadv

    # ------------------------------------------------------------------ opening

    def _open_data(self, direct: bool | None) -> bool:
        path = os.path.join(self.directory, "blocks")
        flags = os.O_RDWR | os.O_CREAT
        if direct is not False and self.block_bytes % PAGE == 0 and hasattr(os, "O_DIRECT"):
            try:
                self._data_fd = os.open(path, flags | os.O_DIRECT, 0o600)
                return True
            except OSError as exc:  # tmpfs and some others refuse O_DIRECT
                if exc.errno != errno.EINVAL:
                    raise
        self._data_fd = os.open(path, flags, 0o600)
        return False

    def listed(self) -> list[tuple[bytes, int]]:
        """``(key, slot)`` of every block the index lists, oldest write first (a key listed
        twice, from an interrupted rewrite, keeps its newest slot)."""
        return self.index.listed()

    # ------------------------------------------------------------------ staging

    def stage(self, pool_slots: Sequence[int]) -> list[int] | None:
        """Copy pool slots into free staging buffers (on the caller's thread, before the pool
        slots are reused); their buffer ids, or None when too few are free (nothing copied)."""
        with self._mutex:
            if len(self._staging_free) < len(pool_slots):
                return None
            ids = [self._staging_free.pop() for _ in pool_slots]
        pool = self.pool.tensor.numpy()
        bb = self.block_bytes
        for buf, slot in zip(ids, pool_slots, strict=True):
            off = buf * self.slot_bytes
            self._staging[off : off + bb] = pool[slot].data
        return ids

    def unstage(self, ids: Sequence[int]) -> None:
        """Give staging buffers back (their blocks are written or dropped)."""
        with self._mutex:
            self._staging_free.extend(ids)

    @property
    def staging_free(self) -> int:
        return len(self._staging_free)

    # ------------------------------------------------------------------ writes

    def write_many(self, items: Sequence[tuple[int, bytes, int]]) -> list[bool]:
        """Write staged blocks: ``(disk_slot, key, staging_id)`` each; per item, whether the
        block is whole on disk and listed. Blocks; runs of contiguous slots go to the I/O
        threads, one system call each (``RUN_BYTES`` at most)."""
        results = [False] * len(items)
        good = [
            i
            for i, (slot, key, _) in enumerate(items)
            if len(key) <= _MAX_KEY and 0 <= slot < self.num_slots
        ]
        runs = _runs(good, lambda i: items[i][0], self._run_blocks(self.slot_bytes))
        done = self._pool.map(lambda r: self._write_run([items[i] for i in r]), runs)
        for run, oks in zip(runs, done, strict=True):
            for i, ok in zip(run, oks, strict=True):
                results[i] = ok
        return results

    def _write_run(self, run: list[tuple[int, bytes, int]]) -> list[bool]:
        """Write blocks to contiguous slots: entries cleared, bytes written in one call, then
        the entries written (see the module docstring for why this order)."""
        if self._closed:
            return [False] * len(run)
        sb, first = self.slot_bytes, run[0][0]
        staging = memoryview(self._staging)
        views = [staging[buf * sb : (buf + 1) * sb] for _, _, buf in run]
        try:
            self.index.clear(first, len(run))
            written = self.pwritev(self._data_fd, views, first * sb)
            if written != sb * len(run):
                raise OSError(errno.EIO, f"short write ({written} of {sb * len(run)} bytes)")
            sums = [
                block_checksum(key, v[: self.block_bytes])
                for (_, key, _), v in zip(run, views, strict=True)
            ]
            self.index.write(first, [(key, s) for (_, key, _), s in zip(run, sums, strict=True)])
        except OSError as exc:
            self._failed("write", exc)
            self._count("write_failures", len(run))
            return [False] * len(run)
        finally:
            for v in views:
                v.release()
            staging.release()
        self._count("writes", len(run))
        self._count("bytes_written", sb * len(run))
        return [True] * len(run)

    def _run_blocks(self, block_bytes: int) -> int:
        return max(1, min(_IOV_MAX, RUN_BYTES // block_bytes))

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
        """Start reading blocks straight into pool slots: ``(disk_slot, key, pool_slot)``
        each; the future says, per item, True only when the whole block was read and matches
        its key and checksum (a False pool slot holds undefined bytes). Runs of contiguous
        slots go to the I/O threads now, one system call each (``RUN_BYTES`` at most), queued
        behind the reads submitted before: reads submitted in order finish roughly in order.
        The pool slots are in ``held_slots`` until the future is done."""
        done: Future[list[bool]] = Future()
        items = list(items)
        if not items:
            done.set_result([])
            return done
        with self._mutex:
            for _, _, pool_slot in items:
                self._held[pool_slot] = self._held.get(pool_slot, 0) + 1
        results = [False] * len(items)
        listed = []
        for i, (slot, key, _) in enumerate(items):
            entry = self.index.entries.get(slot)
            if entry is None or entry.key != key:
                self._count("read_failures", 1)
            else:
                listed.append(i)
        # Blocks of a run land in separate pool slots; padding between them on disk (a block
        # size that is not whole pages) keeps them one block a call.
        cap = self._run_blocks(self.slot_bytes) if self.slot_bytes == self.block_bytes else 1
        runs = _runs(listed, lambda i: items[i][0], cap)
        left = [len(runs)]

        def settle() -> None:
            with self._mutex:
                for _, _, pool_slot in items:
                    n = self._held[pool_slot] - 1
                    if n:
                        self._held[pool_slot] = n
                    else:
                        del self._held[pool_slot]
            done.set_result(results)

        def ran(run: list[int], future: Future[list[bool]]) -> None:
            oks = [False] * len(run) if future.exception() else future.result()
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
            try:
                future = self._pool.submit(self._read_run, [items[i] for i in run])
            except RuntimeError:  # the store closed: this run and the rest read nothing
                self._count("read_failures", sum(len(r) for r in runs[at:]))
                with self._mutex:
                    left[0] -= len(runs) - at
                    last = not left[0]
                if last:
                    settle()
                break
            future.add_done_callback(functools.partial(ran, run))
        return done

    def _read_run(self, run: list[tuple[int, bytes, int]]) -> list[bool]:
        """Read contiguous slots straight into their pool slots in one call (O_DIRECT: the
        pool slots are page-aligned whole pages, as ``direct`` requires), then check each."""
        if self._closed:
            self._count("read_failures", len(run))
            return [False] * len(run)
        pool = self.pool.tensor
        dests = [pool[pool_slot].numpy().data for _, _, pool_slot in run]
        want = self.block_bytes * len(run)
        try:
            got = self.preadv(self._data_fd, dests, run[0][0] * self.slot_bytes)
            if got != want:
                raise OSError(errno.EIO, f"short read ({got} of {want} bytes)")
            ok = []
            for (slot, key, _), dest in zip(run, dests, strict=True):
                entry = self.index.entries.get(slot)
                ok.append(entry is not None and block_checksum(key, dest) == entry.checksum)
        except OSError as exc:
            self._failed("read", exc)
            self._count("read_failures", len(run))
            return [False] * len(run)
        finally:
            for dest in dests:
                dest.release()
        good = ok.count(True)
        self._count("checksum_failures", len(run) - good)
        self._count("reads", good)
        self._count("bytes_read", self.block_bytes * good)
        return ok

    def held_slots(self) -> frozenset[int]:
        """Pool slots a read still writes into (a caller that gave up waiting must not reuse
        them until they leave this set)."""
        with self._mutex:
            return frozenset(self._held)

    # ------------------------------------------------------------------ health

    def health(self) -> DiskHealth:
        """State and counters; never blocks on the disk."""
        with self._mutex:
            return DiskHealth(self._state, self._since, self._last_error, dict(self._counters))

    def probe(self) -> bool:
        """Try a real write (the probe page, synced); back to ``ok`` when it works. Blocks.

        The page is a new one each time (the file is emptied after each probe): rewriting a
        page already allocated works on a full disk, so it would call a full disk ``ok``."""
        path = os.path.join(self.directory, "probe")
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.pwrite(fd, os.urandom(64).ljust(PAGE, b"\0"), 0)
                os.fsync(fd)
                os.ftruncate(fd, 0)
            finally:
                os.close(fd)
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
        total = 0
        with contextlib.suppress(OSError):
            total += os.stat(self.directory).st_blocks * 512
        for name in ("blocks", "index", "probe", "lock"):
            with contextlib.suppress(OSError):
                total += os.stat(os.path.join(self.directory, name)).st_blocks * 512
        return total

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
        self._pool.shutdown(wait=True)
        self._close_fds()
        self._staging.close()

    def _close_fds(self) -> None:
        for name in ("_data_fd", "_index_fd", "_lock_fd"):
            fd = getattr(self, name, -1)
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
                setattr(self, name, -1)


class _IndexFile:
    """The ``index`` file: a header (format, block and slot size, slot count), then one
    128-byte entry per slot. Its entries live in memory (``entries``) and are written through,
    buffered; the file is read once, when the store opens. Thread-safe for distinct slots."""

    def __init__(
        self, fd: int, data_fd: int, block_bytes: int, slot_bytes: int, num_slots: int
    ) -> None:
        """Read the file (an empty, foreign or other-block-size one starts empty, the blocks
        file emptied with it) and size both files for ``num_slots``."""
        self.fd = fd
        self.entries: dict[int, _Entry] = {}
        self._mutex = threading.Lock()
        size = os.fstat(fd).st_size
        header = os.pread(fd, _HEADER.size, 0) if size >= HEADER_BYTES else b""
        fresh = True
        if len(header) == _HEADER.size:
            magic, version, old_block, old_slot, _ = _HEADER.unpack(header)
            fresh = not (
                magic == _MAGIC
                and version == _VERSION
                and old_block == block_bytes
                and old_slot == slot_bytes
            )
        if fresh:
            # Another format or block size: the old blocks cannot be served; start empty.
            os.ftruncate(fd, 0)
            os.ftruncate(data_fd, 0)
        else:
            raw = os.pread(fd, num_slots * ENTRY_BYTES, HEADER_BYTES)
            for slot in range(len(raw) // ENTRY_BYTES):
                entry = _parse_entry(raw[slot * ENTRY_BYTES : (slot + 1) * ENTRY_BYTES])
                if entry is not None:
                    self.entries[slot] = entry
        head = _HEADER.pack(_MAGIC, _VERSION, block_bytes, slot_bytes, num_slots)
        os.pwrite(fd, head.ljust(HEADER_BYTES, b"\0"), 0)
        # A smaller disk than last time: the slots past the end are gone.
        os.ftruncate(fd, HEADER_BYTES + num_slots * ENTRY_BYTES)
        if os.fstat(data_fd).st_size > num_slots * slot_bytes:
            os.ftruncate(data_fd, num_slots * slot_bytes)
        self._seq = max((e.seq for e in self.entries.values()), default=0)

    def clear(self, first: int, count: int) -> None:
        """Unlist slots ``first .. first + count - 1`` before their bytes are rewritten."""
        slots = range(first, first + count)
        if any(s in self.entries for s in slots):
            os.pwrite(self.fd, _EMPTY * count, HEADER_BYTES + first * ENTRY_BYTES)
            for s in slots:
                self.entries.pop(s, None)

    def write(self, first: int, rows: list[tuple[bytes, int]]) -> None:
        """List ``(key, checksum)`` rows at slots ``first ..``, once their bytes are whole
        on disk, with the next write sequence numbers."""
        with self._mutex:
            seqs = range(self._seq + 1, self._seq + 1 + len(rows))
            self._seq += len(rows)
        packed = b"".join(_pack_entry(key, s, q) for (key, s), q in zip(rows, seqs, strict=True))
        os.pwrite(self.fd, packed, HEADER_BYTES + first * ENTRY_BYTES)
        for i, ((key, s), q) in enumerate(zip(rows, seqs, strict=True)):
            self.entries[first + i] = _Entry(key, s, q)

    def forget(self, slot: int) -> None:
        """Unlist one slot (best effort: an entry left behind fails or is dropped later)."""
        if self.entries.pop(slot, None) is None:
            return
        with contextlib.suppress(OSError):
            os.pwrite(self.fd, _EMPTY, HEADER_BYTES + slot * ENTRY_BYTES)

    def listed(self) -> list[tuple[bytes, int]]:
        """``(key, slot)`` of every listed block, oldest write first; a key listed twice
        (an interrupted rewrite) keeps its newest slot, the other is unlisted."""
        by_key: dict[bytes, tuple[int, int]] = {}
        for slot, e in self.entries.items():
            old = by_key.get(e.key)
            if old is None or old[0] < e.seq:
                by_key[e.key] = (e.seq, slot)
        keep = {slot for _, slot in by_key.values()}
        for slot in [s for s in self.entries if s not in keep]:
            self.forget(slot)
        return [(key, slot) for key, (_, slot) in sorted(by_key.items(), key=lambda kv: kv[1][0])]


def _runs(order: list[int], slot_of: Callable[[int], int], cap: int) -> list[list[int]]:
    """Item indices grouped into runs of consecutive disk slots (ascending, ``cap`` at most)."""
    runs: list[list[int]] = []
    for i in sorted(order, key=slot_of):
        if runs and len(runs[-1]) < cap and slot_of(runs[-1][-1]) + 1 == slot_of(i):
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs


def _pack_entry(key: bytes, checksum: int, seq: int) -> bytes:
    body = _ENTRY.pack(_ENTRY_MAGIC, len(key), seq, checksum, key)
    own = _ENTRY_SUM.pack(xxhash.xxh3_64_intdigest(body))
    return (body + own).ljust(ENTRY_BYTES, b"\0")


def _parse_entry(raw: bytes) -> _Entry | None:
    if raw[:4] != _ENTRY_MAGIC:
        return None
    body = raw[: _ENTRY.size]
    (own,) = _ENTRY_SUM.unpack_from(raw, _ENTRY.size)
    if xxhash.xxh3_64_intdigest(body) != own:
        return None
    _, key_len, seq, checksum, key = _ENTRY.unpack(body)
    if not 1 <= key_len <= _MAX_KEY:
        return None
    return _Entry(key[:key_len], checksum, seq)
