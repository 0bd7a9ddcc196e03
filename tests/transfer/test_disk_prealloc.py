"""``transfer.disk.DiskStore``: the blocks file allocated whole at open, the free-space
refusal, the index read in chunks, runs in one system call, MACs off the I/O threads, the
store's own buffers (private, on huge pages where the kernel gives them).

The free-space tests mount a small tmpfs (root only; skipped otherwise, or where the container
refuses the mount).
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import transfer.disk as disk_module
import transfer.disk_buffers as buffers_module
import transfer.disk_index as disk_index
import transfer.disk_reads as reads_module
from transfer import HostPool
from transfer.disk import DiskStore, disk_bytes_for, slots_for
from transfer.disk_files import DiskError, DiskSpaceError
from transfer.disk_index import ENTRY_BYTES, HEADER_BYTES

BLOCK = 8192
MIB = 1 << 20


@pytest.fixture
def pool(make_pool: Callable[..., HostPool]) -> HostPool:
    return make_pool(16, BLOCK)


def opened(stores: list[DiskStore], directory: Path, pool: HostPool, slots: int) -> DiskStore:
    store = DiskStore(str(directory), pool, slots)
    stores.append(store)
    return store


def fill(pool: HostPool, slot: int) -> bytes:
    data = os.urandom(BLOCK)
    pool.tensor[slot].numpy()[:] = memoryview(data)
    return data


def write(store: DiskStore, items: list[tuple[int, bytes, int]]) -> list[bool]:
    """Stage pool slots and write them: ``(disk_slot, key, pool_slot)`` each."""
    staged = store.stage([p for _, _, p in items])
    assert staged is not None
    try:
        return store.write_many([(d, k, s) for (d, k, _), s in zip(items, staged, strict=True)])
    finally:
        store.unstage(staged)


def allocated(path: Path) -> int:
    return os.stat(path).st_blocks * 512


# --------------------------------------------------------------------------- preallocation


def test_the_blocks_file_is_allocated_whole_at_open(
    pool: HostPool, tmp_path: Path, stores: list[DiskStore]
) -> None:
    store = opened(stores, tmp_path / "d", pool, 32)
    assert store.preallocated
    blocks = tmp_path / "d" / "blocks"
    assert os.path.getsize(blocks) == 32 * store.slot_bytes
    assert allocated(blocks) >= 32 * store.slot_bytes  # not sparse: every slot has its space
    # Still within the budget the slots were sized for.
    assert store.disk_usage() <= disk_bytes_for(32, BLOCK)


def test_a_restart_adopts_its_blocks_in_the_preallocated_file(
    pool: HostPool, tmp_path: Path, stores: list[DiskStore]
) -> None:
    store = opened(stores, tmp_path / "d", pool, 32)
    data = {i: fill(pool, i) for i in range(3)}
    assert write(store, [(10 + i, f"k{i}".encode(), i) for i in range(3)]) == [True] * 3
    store.close()
    again = opened(stores, tmp_path / "d", pool, 32)
    assert sorted(again.listed()) == [(f"k{i}".encode(), 10 + i) for i in range(3)]
    assert again.read_many([(10 + i, f"k{i}".encode(), 8 + i) for i in range(3)]) == [True] * 3
    for i in range(3):
        assert bytes(pool.tensor[8 + i].numpy()) == data[i]


def test_a_filesystem_without_fallocate_still_opens(
    pool: HostPool, tmp_path: Path, stores: list[DiskStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    def unsupported(fd: int, offset: int, length: int) -> None:
        raise OSError(95, "Operation not supported")

    monkeypatch.setattr(os, "posix_fallocate", unsupported)
    store = opened(stores, tmp_path / "d", pool, 8)
    assert not store.preallocated
    fill(pool, 0)
    assert write(store, [(0, b"k", 0)]) == [True]


# --------------------------------------------------------------------------- free space


def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def test_a_tier_larger_than_its_filesystem_is_refused_before_anything_is_allocated(
    pool: HostPool, tmpfs: Path
) -> None:
    """10 TB asked on an 8 MiB filesystem: refused at open with the sizes and the fix, before
    the index is read or sized and before the blocks file takes a byte."""
    slots = slots_for(10 * 10**12, BLOCK)
    with pytest.raises(DiskSpaceError) as caught:
        DiskStore(str(tmpfs / "ns"), pool, slots)
    err = caught.value
    assert isinstance(err, DiskError)
    assert err.needed == disk_bytes_for(slots, BLOCK)
    assert 0 < err.available <= 8 * MIB
    message = str(err)
    for part in (str(err.needed), str(err.available), "disk_bytes", "fix:"):
        assert part in message, (part, message)
    for name in ("blocks", "index"):
        assert os.path.getsize(tmpfs / "ns" / name) == 0, name  # nothing sized, nothing taken


def test_a_tier_that_fits_takes_its_space_at_open(
    pool: HostPool, tmpfs: Path, stores: list[DiskStore]
) -> None:
    before = free_bytes(tmpfs)
    slots = slots_for(5 * MIB, BLOCK)  # two would not fit in 8 MiB
    opened(stores, tmpfs / "ns", pool, slots)
    assert before - free_bytes(tmpfs) >= slots * BLOCK
    # A second namespace on the same filesystem finds that space gone.
    with pytest.raises(DiskSpaceError):
        DiskStore(str(tmpfs / "other"), pool, slots)


def test_a_restart_counts_its_own_files_as_room(
    pool: HostPool, tmpfs: Path, stores: list[DiskStore]
) -> None:
    """A tier that took most of the filesystem opens again on it (its own files are room it
    already holds) and adopts its blocks."""
    slots = slots_for(6 * MIB, BLOCK)
    store = opened(stores, tmpfs / "ns", pool, slots)
    data = fill(pool, 0)
    assert write(store, [(slots - 1, b"last", 0)]) == [True]
    store.close()
    assert free_bytes(tmpfs) < disk_bytes_for(slots, BLOCK)  # a fresh one would not fit
    again = opened(stores, tmpfs / "ns", pool, slots)
    assert again.listed() == [(b"last", slots - 1)]
    assert again.read_many([(slots - 1, b"last", 5)]) == [True]
    assert bytes(pool.tensor[5].numpy()) == data


# --------------------------------------------------------------------------- the index


def test_the_index_is_read_in_chunks_and_every_entry_is_found(
    pool: HostPool, tmp_path: Path, stores: list[DiskStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chunks of 3 entries (the real ones are 4 MiB): entries on both sides of every boundary
    are adopted, a forged one in a later chunk is dropped and cleared."""
    monkeypatch.setattr(disk_index, "_INDEX_CHUNK", 3 * ENTRY_BYTES)
    store = opened(stores, tmp_path / "d", pool, 16)
    wanted = [2, 3, 5, 6, 9, 15]
    for s in wanted:
        fill(pool, 0)
        assert write(store, [(s, f"k{s}".encode(), 0)]) == [True]
    store.close()
    index = tmp_path / "d" / "index"
    with open(index, "r+b") as f:  # forge the entry of slot 12
        f.seek(HEADER_BYTES + 12 * ENTRY_BYTES)
        f.write(os.urandom(ENTRY_BYTES))
    again = opened(stores, tmp_path / "d", pool, 16)
    assert sorted(slot for _, slot in again.listed()) == wanted
    assert again.unauthenticated_dropped == 1
    with open(index, "rb") as f:
        f.seek(HEADER_BYTES + 12 * ENTRY_BYTES)
        assert f.read(ENTRY_BYTES) == bytes(ENTRY_BYTES)  # cleared


def test_an_index_shorter_than_the_slots_is_read_to_its_end(
    pool: HostPool, tmp_path: Path, stores: list[DiskStore]
) -> None:
    """A restart with more slots than last time: the old entries are adopted, the new slots
    are empty."""
    store = opened(stores, tmp_path / "d", pool, 4)
    fill(pool, 0)
    assert write(store, [(3, b"k", 0)]) == [True]
    store.close()
    again = opened(stores, tmp_path / "d", pool, 64)
    assert again.listed() == [(b"k", 3)]
    assert os.path.getsize(tmp_path / "d" / "blocks") == 64 * again.slot_bytes


# --------------------------------------------------------------------------- runs and MACs


def test_adjacent_slots_move_in_one_call_each_way(
    pool: HostPool, tmp_path: Path, stores: list[DiskStore]
) -> None:
    store = opened(stores, tmp_path / "d", pool, 16)
    calls: list[tuple[str, int, int]] = []
    real_w, real_r = store.pwritev, store.preadv

    def pwritev(fd: int, bufs: list[memoryview], off: int) -> int:
        calls.append(("w", len(bufs), off))
        return real_w(fd, bufs, off)

    def preadv(fd: int, bufs: list[memoryview], off: int) -> int:
        calls.append(("r", len(bufs), off))
        return real_r(fd, bufs, off)

    store.pwritev, store.preadv = pwritev, preadv
    for i in range(6):
        fill(pool, i)
    # Slots 4..7 and 10..11, given out of order: two runs.
    items = [(7, b"k7", 3), (4, b"k4", 0), (10, b"k10", 4), (5, b"k5", 1), (11, b"k11", 5)]
    items.append((6, b"k6", 2))
    assert write(store, items) == [True] * 6
    assert sorted(c for c in calls if c[0] == "w") == [
        ("w", 2, 10 * store.slot_bytes),
        ("w", 4, 4 * store.slot_bytes),
    ]
    reads = [(s, k, 8 + i) for i, (s, k, _) in enumerate(items)]
    assert store.read_many(reads) == [True] * 6
    assert sorted(c for c in calls if c[0] == "r") == [
        ("r", 2, 10 * store.slot_bytes),
        ("r", 4, 4 * store.slot_bytes),
    ]
    for i, (_, _, src) in enumerate(items):
        assert bytes(pool.tensor[8 + i].numpy()) == bytes(pool.tensor[src].numpy())


def test_macs_are_computed_off_the_io_threads(
    pool: HostPool, tmp_path: Path, stores: list[DiskStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An I/O thread never hashes: it hands a read's checks to a MAC thread and issues its next
    request; a write's MACs are computed while its bytes are written."""
    threads: list[str] = []
    real = disk_index.block_mac

    def block_mac(*args: bytes | memoryview) -> bytes:
        threads.append(threading.current_thread().name)
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(disk_module, "block_mac", block_mac)  # the writes'
    monkeypatch.setattr(reads_module, "block_mac", block_mac)  # the reads'
    store = opened(stores, tmp_path / "d", pool, 16)
    for i in range(4):
        fill(pool, i)
    assert write(store, [(i, f"k{i}".encode(), i) for i in range(4)]) == [True] * 4
    assert store.read_many([(i, f"k{i}".encode(), 8 + i) for i in range(4)]) == [True] * 4
    assert len(threads) == 8
    assert all(name.startswith("kvoffload-disk-mac") for name in threads), threads


def test_a_mac_check_that_raises_fails_its_blocks_and_lets_the_slots_go(
    pool: HostPool, tmp_path: Path, stores: list[DiskStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bug in the check (not an I/O error) must not leave the read waiting forever or its
    pool slots held: the blocks read as failed."""
    store = opened(stores, tmp_path / "d", pool, 16)
    for i in range(3):
        fill(pool, i)
    assert write(store, [(i, f"k{i}".encode(), i) for i in range(3)]) == [True] * 3

    def broken(*_: object) -> bytes:
        raise RuntimeError("bug")

    monkeypatch.setattr(reads_module, "block_mac", broken)
    future = store.submit_reads([(i, f"k{i}".encode(), 8 + i) for i in range(3)])
    assert future.result(timeout=30) == [False] * 3
    assert store.held_slots() == frozenset()


def test_reads_submitted_before_close_all_settle(
    pool: HostPool, tmp_path: Path, stores: list[DiskStore]
) -> None:
    store = opened(stores, tmp_path / "d", pool, 16)
    for i in range(8):
        fill(pool, i)
    assert write(store, [(2 * i, f"k{i}".encode(), i) for i in range(8)]) == [True] * 8
    futures = [store.submit_reads([(2 * i, f"k{i}".encode(), 8 + i)]) for i in range(8)]
    store.close()
    for future in futures:
        assert future.done()
        assert len(future.result()) == 1
    assert store.held_slots() == frozenset()


# --------------------------------------------------------------------------- the store's memory


def thp_mode() -> str | None:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return None
    return text[text.find("[") + 1 : text.find("]")] if "[" in text else None


def mapping_line(address: int) -> str:
    """The ``/proc/self/smaps`` line that opens the mapping starting at ``address``."""
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split(maxsplit=1)[0]
            if "-" in head and int(head.split("-", 1)[0], 16) == address:
                return line
    raise AssertionError(f"no mapping starts at {address:#x}")


def test_the_store_s_buffers_are_private_memory() -> None:
    """Private, not shared: shared anonymous memory is shmem, which this kernel (and most,
    by default) never backs with huge pages."""
    buf, _ = buffers_module._buffer(4 * MIB)
    rows = np.frombuffer(buf, dtype=np.uint8)
    try:
        assert mapping_line(rows.ctypes.data).split()[1] == "rw-p"
        assert not rows.any()  # faulted in, zeros
    finally:
        del rows
        buf.close()


def test_the_store_s_buffers_are_on_huge_pages_where_the_kernel_gives_them(
    tmp_path: Path, stores: list[DiskStore], make_pool: Callable[..., HostPool]
) -> None:
    """Staging (512 blocks of 8 KiB: 4 MiB, room for a whole huge page) and read buffers."""
    mode = thp_mode()
    if mode is None:
        pytest.skip("no transparent huge pages switch here")
    store = DiskStore(str(tmp_path / "d"), make_pool(16, BLOCK), 16, staging_blocks=512)
    stores.append(store)
    assert store.huge_pages is (mode in ("always", "madvise"))


def test_without_smaps_the_store_says_it_does_not_know(
    tmp_path: Path,
    stores: list[DiskStore],
    pool: HostPool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(buffers_module, "_anon_huge_bytes", lambda address: None)
    store = opened(stores, tmp_path / "d", pool, 16)
    assert store.huge_pages is None


def test_a_failed_read_gives_its_read_buffer_back(
    pool: HostPool, tmp_path: Path, stores: list[DiskStore]
) -> None:
    """Reads go through one buffer per I/O thread: failures (more of them than threads) must
    each hand theirs back, or the reads after them would find none."""
    store = opened(stores, tmp_path / "d", pool, 16)
    data = [fill(pool, i) for i in range(4)]
    assert write(store, [(i, b"k%d" % i, i) for i in range(4)]) == [True] * 4
    real = store.preadv

    def failing(fd: int, bufs: list[memoryview], off: int) -> int:
        raise OSError(errno.EIO, "injected")

    store.preadv = failing
    for _ in range(3 * 4):  # the store's 4 I/O threads, three times over
        assert store.read_many([(0, b"k0", 8)]) == [False]
    store.preadv = real
    assert store.read_many([(i, b"k%d" % i, 8 + i) for i in range(4)]) == [True] * 4
    for i in range(4):
        assert bytes(pool.tensor[8 + i].numpy()) == data[i]


def test_buffers_made_one_after_the_other_each_say_what_they_got() -> None:
    """The kernel merges adjacent private mappings with the same flags, as the staging and the
    read buffers are made: each buffer's answer is its own, not its neighbour's."""
    if thp_mode() not in ("always", "madvise"):
        pytest.skip("no transparent huge pages here")
    made = [buffers_module._buffer(8 * MIB) for _ in range(3)]
    try:
        assert [huge for _, huge in made] == [True, True, True]
    finally:
        for buf, _ in made:
            buf.close()


def test_a_buffer_too_small_for_a_huge_page_says_nothing() -> None:
    buf, huge = buffers_module._buffer(buffers_module.HUGE_PAGE // 2)
    buf.close()
    assert huge is None


def test_huge_bytes_are_found_for_any_address_inside_a_mapping() -> None:
    """A merged mapping starts below the buffer asked about: the lookup is by containment."""
    buf, _ = buffers_module._buffer(8 * MIB)
    rows = np.frombuffer(buf, dtype=np.uint8)
    try:
        inside = buffers_module._anon_huge_bytes(rows.ctypes.data + 4 * MIB)
        assert inside is not None
        assert inside == buffers_module._anon_huge_bytes(rows.ctypes.data)
    finally:
        del rows
        buf.close()
