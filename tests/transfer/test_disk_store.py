"""``transfer.disk.DiskStore`` on its own: bytes, MACs, torn writes, the index, the budget.

Each test drives a real store in a temporary directory over a real host pool: blocks are
staged out of pool slots, written, and read back into other pool slots. Crashes are simulated
by writing the on-disk state a process would leave and reopening the directory.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import transfer.disk_reads as reads_module
from transfer import HostPool
from transfer.disk import DiskStore, slots_for
from transfer.disk_files import DiskError
from transfer.disk_index import ENTRY_BYTES, HEADER_BYTES, PAGE, block_mac

BLOCK = 8192

Opener = Callable[..., DiskStore]


@pytest.fixture
def pool(make_pool: Callable[..., HostPool]) -> HostPool:
    return make_pool(16, BLOCK)


@pytest.fixture
def open_store(pool: HostPool, tmp_path: Path) -> Iterator[Opener]:
    stores: list[DiskStore] = []

    def open_(num_slots: int = 8, directory: Path | None = None, **kw: object) -> DiskStore:
        store = DiskStore(str(directory or tmp_path / "d"), pool, num_slots, **kw)  # type: ignore[arg-type]
        stores.append(store)
        return store

    yield open_
    for store in stores:
        store.close()


def fill(pool: HostPool, slot: int, seed: int) -> bytes:
    data = os.urandom(8) * (pool.block_bytes // 8)
    data = bytes([seed % 256]) + data[1:]
    pool.tensor[slot].numpy()[:] = memoryview(data)
    return data


def slot_bytes(pool: HostPool, slot: int) -> bytes:
    return bytes(pool.tensor[slot].numpy())


def write(store: DiskStore, pool_slot: int, disk_slot: int, key: bytes) -> bool:
    staged = store.stage([pool_slot])
    assert staged is not None
    try:
        (ok,) = store.write_many([(disk_slot, key, staged[0])])
    finally:
        store.unstage(staged)
    return ok


def test_bytes_written_read_back_equal(pool: HostPool, open_store: Opener) -> None:
    store = open_store()
    data = {i: fill(pool, i, i) for i in range(4)}
    for i in range(4):
        assert write(store, i, i, f"k{i}".encode())
    assert store.read_many([(i, f"k{i}".encode(), 8 + i) for i in range(4)]) == [True] * 4
    for i in range(4):
        assert slot_bytes(pool, 8 + i) == data[i]
    counters = store.health().counters
    assert (counters["writes"], counters["reads"], counters["checksum_failures"]) == (4, 4, 0)
    assert store.health().ok


def test_mac_is_bound_to_the_key(pool: HostPool, open_store: Opener) -> None:
    store = open_store()
    data = fill(pool, 0, 1)
    assert write(store, 0, 0, b"alpha")
    assert block_mac(bytes(32), b"alpha", data) != block_mac(bytes(32), b"beta", data)
    # The index answers by slot: asking for another key there is refused outright ...
    assert store.read_many([(0, b"beta", 5)]) == [False]
    # ... and even an entry rewritten to claim another key fails the MAC.
    store.index.entries[0] = type(store.index.entries[0])(b"beta", store.index.entries[0].mac, 1)
    assert store.read_many([(0, b"beta", 5)]) == [False]
    assert store.health().counters["checksum_failures"] == 1


def test_a_flipped_bit_on_disk_fails_the_read_and_is_counted(
    pool: HostPool, open_store: Opener, tmp_path: Path
) -> None:
    store = open_store()
    fill(pool, 0, 2)
    fill(pool, 1, 3)
    assert write(store, 0, 0, b"k0")
    assert write(store, 1, 1, b"k1")
    with open(tmp_path / "d" / "blocks", "r+b") as f:
        f.seek(store.slot_bytes + 1234)
        byte = f.read(1)[0]
        f.seek(store.slot_bytes + 1234)
        f.write(bytes([byte ^ 0x10]))
    assert store.read_many([(0, b"k0", 6), (1, b"k1", 7)]) == [True, False]
    assert store.health().counters["checksum_failures"] == 1
    assert store.health().counters["reads"] == 1


def test_a_torn_write_is_unlisted_or_fails_its_checksum_after_a_restart(
    pool: HostPool, open_store: Opener, tmp_path: Path
) -> None:
    """A rewrite of slot 0 torn by a crash: entry cleared, half the new bytes written, then
    the process dies. And a crash after the bytes but with the OLD entry still on disk (the
    clear lost). Either way the slot is never read back as good."""
    directory = tmp_path / "d"
    store = open_store(directory=directory)
    fill(pool, 0, 4)
    fill(pool, 1, 5)
    assert write(store, 0, 0, b"old")
    assert write(store, 1, 1, b"other")
    index = (directory / "index").read_bytes()
    old_entry = index[HEADER_BYTES : HEADER_BYTES + ENTRY_BYTES]
    store.close()

    def crash(entry: bytes) -> None:
        fd = os.open(directory / "index", os.O_RDWR)
        os.pwrite(fd, entry, HEADER_BYTES)
        os.close(fd)
        fd = os.open(directory / "blocks", os.O_RDWR)
        os.pwrite(fd, os.urandom(BLOCK // 2), 0)  # half the new block, then death
        os.close(fd)

    crash(bytes(ENTRY_BYTES))  # entry cleared before the bytes: unlisted
    again = open_store(directory=directory)
    assert [k for k, _ in again.listed()] == [b"other"]
    again.close()

    crash(old_entry)  # the old entry survived: listed, but its bytes no longer match
    third = open_store(directory=directory)
    assert sorted(k for k, _ in third.listed()) == [b"old", b"other"]
    assert third.read_many([(0, b"old", 9), (1, b"other", 10)]) == [False, True]
    assert third.health().counters["checksum_failures"] == 1


def test_a_corrupt_index_entry_is_ignored(
    pool: HostPool, open_store: Opener, tmp_path: Path
) -> None:
    directory = tmp_path / "d"
    store = open_store(directory=directory)
    fill(pool, 0, 6)
    assert write(store, 0, 0, b"k")
    assert write(store, 0, 1, b"j")
    store.close()
    fd = os.open(directory / "index", os.O_RDWR)
    os.pwrite(fd, b"X", HEADER_BYTES + 20)  # inside entry 0's key area
    os.close(fd)
    again = open_store(directory=directory)
    assert [k for k, _ in again.listed()] == [b"j"]


def test_an_index_of_another_block_size_starts_empty(
    make_pool: Callable[..., HostPool], open_store: Opener, pool: HostPool, tmp_path: Path
) -> None:
    directory = tmp_path / "d"
    store = open_store(directory=directory)
    fill(pool, 0, 7)
    assert write(store, 0, 0, b"k")
    store.close()
    other = make_pool(4, 2 * BLOCK)
    s2 = DiskStore(str(directory), other, 8)
    try:
        assert s2.listed() == []
        # Emptied, then allocated afresh at its full size: none of the old bytes is left.
        assert (directory / "blocks").read_bytes() == bytes(8 * 2 * BLOCK)
    finally:
        s2.close()
    # And back at the first size: still empty (the other size rewrote the header).
    s3 = open_store(directory=directory)
    assert s3.listed() == []


def test_fewer_slots_on_reopen_truncates(
    pool: HostPool, open_store: Opener, tmp_path: Path
) -> None:
    directory = tmp_path / "d"
    store = open_store(8, directory=directory)
    for i in range(8):
        fill(pool, i, i)
        assert write(store, i, i, f"k{i}".encode())
    store.close()
    small = open_store(3, directory=directory)
    assert sorted(k for k, _ in small.listed()) == [b"k0", b"k1", b"k2"]
    assert os.path.getsize(directory / "blocks") <= 3 * small.slot_bytes
    assert os.path.getsize(directory / "index") == HEADER_BYTES + 3 * ENTRY_BYTES
    assert small.read_many([(2, b"k2", 12)]) == [True]


def test_a_second_store_on_the_same_directory_is_refused(
    pool: HostPool, open_store: Opener, tmp_path: Path
) -> None:
    open_store(directory=tmp_path / "d")
    with pytest.raises(DiskError, match="in use"):
        DiskStore(str(tmp_path / "d"), pool, 8)


@pytest.mark.parametrize("block_bytes", [4096, 8192, 12288, 5000])
def test_a_full_store_stays_within_its_byte_budget(
    make_pool: Callable[..., HostPool], tmp_path: Path, block_bytes: int
) -> None:
    """Every slot written, the probe page written: neither the allocated bytes (``du``, via
    ``st_blocks``, the directory's own page included) nor the apparent sizes exceed the
    ``disk_bytes`` the slots were sized for, at a budget with no slack (``slots_for`` exactly
    at a boundary) and with some."""
    pool = make_pool(4, block_bytes)
    slot = -(-block_bytes // PAGE) * PAGE
    for n in (1, 3, 7, 33):
        for slack in (0, ENTRY_BYTES - 1, PAGE - 1):
            budget = HEADER_BYTES + 2 * PAGE + n * (slot + ENTRY_BYTES) + slack
            slots = slots_for(budget, block_bytes)
            assert slots >= n - 1  # the index's page rounding costs one slot at most
            if slots == 0:
                continue
            directory = tmp_path / f"b{block_bytes}-{n}-{slack}"
            store = DiskStore(str(directory), pool, slots)
            try:
                fill(pool, 0, n)
                for i in range(slots):
                    assert write(store, 0, i, f"k{i}".encode())
                assert store.probe()
                names = ("blocks", "index", "probe", "lock")
                apparent = sum(os.path.getsize(directory / f) for f in names)
                allocated = sum(os.stat(directory / f).st_blocks * 512 for f in names)
                allocated += os.stat(directory).st_blocks * 512  # the directory's own page
                assert apparent <= budget, (n, slack, apparent, budget)
                assert allocated <= budget, (n, slack, allocated, budget)
                assert store.disk_usage() == allocated
            finally:
                store.close()


def test_io_errors_from_the_seams_degrade_and_never_return_bytes(
    pool: HostPool, open_store: Opener
) -> None:
    store = open_store()
    data = fill(pool, 0, 9)
    assert write(store, 0, 0, b"k")

    def eio(*_: object) -> int:
        raise OSError(errno.EIO, "Input/output error")

    store.preadv = eio
    pool.tensor[5].numpy()[:] = 0
    assert store.read_many([(0, b"k", 5)]) == [False]
    health = store.health()
    assert (health.state, health.counters["read_failures"]) == ("degraded", 1)
    assert "Input/output error" in (health.last_error or "")
    store.pwritev = eio
    fill(pool, 1, 10)
    assert not write(store, 1, 1, b"j")
    assert store.health().counters["write_failures"] == 1
    # A short read is no better than an error.
    store.preadv = lambda fd, bufs, off: 100
    assert store.read_many([(0, b"k", 5)]) == [False]
    # Back: the probe brings the state back, the block was never harmed.
    store.preadv = os.preadv
    assert store.probe()
    assert store.health().ok
    assert store.health().counters["incidents"] == 1
    assert store.read_many([(0, b"k", 6)]) == [True]
    assert slot_bytes(pool, 6) == data
    assert [k for k, _ in store.listed()] == [b"k"]


def test_submitted_reads_run_in_order_and_hold_their_slots_until_done(
    pool: HostPool, open_store: Opener
) -> None:
    """``submit_reads`` returns at once; the pool slots are held until its future is done, and
    runs go to the I/O threads in the order they were submitted (one thread: strictly)."""
    store = open_store(io_threads=1)
    data = {i: fill(pool, i, i) for i in range(4)}
    for i in range(4):
        assert write(store, i, i, f"k{i}".encode())
    gate = threading.Event()
    order: list[int] = []
    real = store.preadv

    def held(fd: int, bufs: list[memoryview], off: int) -> int:
        gate.wait(10)
        order.append(off // store.slot_bytes)
        return int(real(fd, bufs, off))

    store.preadv = held
    # Slots 0 and 2 (two runs: not contiguous), then 3 and 1 (one run) in another submission.
    first = store.submit_reads([(0, b"k0", 8), (2, b"k2", 9)])
    second = store.submit_reads([(3, b"k3", 10), (1, b"k1", 11), (1, b"bad", 12)])
    assert not first.done()
    assert store.held_slots() == {8, 9, 10, 11, 12}
    gate.set()
    assert first.result(10) == [True, True]
    assert second.result(10) == [True, True, False]  # a key the slot does not hold: False
    assert order == [0, 2, 1, 3]  # submission by submission; inside one, by disk slot
    assert store.held_slots() == frozenset()
    assert [slot_bytes(pool, s) for s in (8, 9, 10, 11)] == [data[0], data[2], data[3], data[1]]
    assert store.submit_reads([]).result() == []


def test_a_block_that_fails_its_mac_never_reaches_its_pool_slot(
    pool: HostPool, open_store: Opener, tmp_path: Path
) -> None:
    store = open_store()
    fill(pool, 0, 2)
    assert write(store, 0, 0, b"k0")
    with open(tmp_path / "d" / "blocks", "r+b") as f:
        f.seek(7)
        byte = f.read(1)[0]
        f.seek(7)
        f.write(bytes([byte ^ 1]))
    before = fill(pool, 6, 9)
    assert store.read_many([(0, b"k0", 6)]) == [False]
    assert slot_bytes(pool, 6) == before  # the bad bytes stopped in the store's own buffer


def test_reads_are_runs_of_read_run_bytes_and_overlap_their_checks(
    pool: HostPool, open_store: Opener, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read takes ``READ_RUN_BYTES`` of contiguous slots at most, and the I/O thread reads the
    next run while the MAC threads check the last one, two read buffers a thread: with the
    checks held, one I/O thread has read two runs (and waits for a buffer), never a third."""
    monkeypatch.setattr(reads_module, "READ_RUN_BYTES", 2 * BLOCK)
    store = open_store(io_threads=1)
    data = {i: fill(pool, i, i) for i in range(6)}
    for i in range(6):
        assert write(store, i, i, f"k{i}".encode())
    reads: list[tuple[int, int]] = []
    real_read = store.preadv

    def counted(fd: int, bufs: list[memoryview], off: int) -> int:
        reads.append((off // store.slot_bytes, len(bufs)))
        return int(real_read(fd, bufs, off))

    gate = threading.Event()
    real_mac = block_mac

    def held_mac(mac_key: bytes, key: bytes, data: object) -> bytes:
        gate.wait(10)
        return real_mac(mac_key, key, data)  # type: ignore[arg-type]

    store.preadv = counted
    monkeypatch.setattr(reads_module, "block_mac", held_mac)
    future = store.submit_reads([(i, f"k{i}".encode(), 8 + i) for i in range(6)])
    deadline = time.monotonic() + 10
    while len(reads) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)  # a third read, were it to come, has had the time to
    assert reads == [(0, 2), (2, 2)]
    gate.set()
    assert future.result(10) == [True] * 6
    assert reads == [(0, 2), (2, 2), (4, 2)]
    assert [slot_bytes(pool, 8 + i) for i in range(6)] == [data[i] for i in range(6)]


def test_reads_submitted_to_a_closed_store_read_nothing(pool: HostPool, open_store: Opener) -> None:
    store = open_store()
    fill(pool, 0, 1)
    assert write(store, 0, 0, b"k")
    store.close()
    assert store.submit_reads([(0, b"k", 5)]).result(10) == [False]
    assert store.held_slots() == frozenset()


def test_submitted_writes_run_in_order_and_settle_per_item(
    pool: HostPool, open_store: Opener
) -> None:
    """``submit_writes`` returns at once; runs go to the I/O threads in submission order (one
    thread: strictly); the future says per item whether its block is on disk and listed (a key
    too long or a slot out of range: False, nothing written for it)."""
    store = open_store(io_threads=1)
    data = {i: fill(pool, i, i) for i in range(4)}
    staged = store.stage([0, 1, 2, 3])
    assert staged is not None
    gate = threading.Event()
    order: list[int] = []
    real = store.pwritev

    def held(fd: int, bufs: list[memoryview], off: int) -> int:
        gate.wait(10)
        order.append(off // store.slot_bytes)
        return int(real(fd, bufs, off))

    store.pwritev = held
    first = store.submit_writes([(5, b"k0", staged[0]), (2, b"k1", staged[1])])
    second = store.submit_writes(
        [(4, b"k2", staged[2]), (3, b"k3", staged[3]), (99, b"k9", staged[3])]
    )
    assert not first.done()
    gate.set()
    assert first.result(10) == [True, True]
    assert second.result(10) == [True, True, False]
    assert order == [2, 5, 3]  # submission by submission; 3 and 4 one run
    store.unstage(staged)
    assert dict(store.listed()) == {b"k0": 5, b"k1": 2, b"k2": 4, b"k3": 3}
    reads = [(5, b"k0", 8), (2, b"k1", 9), (4, b"k2", 10), (3, b"k3", 11)]
    assert store.read_many(reads) == [True] * 4
    assert [slot_bytes(pool, s) for s in (8, 9, 10, 11)] == [data[i] for i in range(4)]
    assert store.submit_writes([]).result() == []


def test_a_closed_store_stages_and_writes_nothing(pool: HostPool, open_store: Opener) -> None:
    store = open_store()
    fill(pool, 0, 1)
    staged = store.stage([0])
    assert staged is not None
    store.close()
    assert store.stage([1]) is None
    assert store.submit_writes([(0, b"k", staged[0])]).result(10) == [False]
