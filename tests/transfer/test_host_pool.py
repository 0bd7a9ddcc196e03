"""HostPool: sizing errors, the sealed memfd, cleanup, pinning (with a fake CUDA)."""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import signal
import stat
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from testsupport.kvref import unique_prefix
from transfer import HostPool, PoolError
from transfer import host_pool as host_pool_mod

REPO = Path(__file__).resolve().parents[2]


def shm_entries(prefix: str) -> list[str]:
    return [name for name in os.listdir("/dev/shm") if name.startswith(prefix)]


def test_create_layout_and_tensor(make_pool) -> None:
    pool = make_pool(8, 4096, pin=False)
    assert pool.num_blocks == 8
    assert pool.block_bytes == 4096
    assert pool.total_bytes == 8 * 4096
    assert pool.pinned is False
    assert pool.tensor.shape == (8, 4096)
    assert pool.tensor.dtype == torch.uint8
    assert pool.layout() == {
        "path": pool.path,
        "num_blocks": 8,
        "block_bytes": 4096,
        "pinned": False,
    }
    assert pool.path == f"/proc/{os.getpid()}/fd/{pool._fd}"
    # The region is zero-filled and writable, and the path maps the same memory.
    assert int(pool.tensor.sum()) == 0
    pool.tensor[3, 17] = 99
    with open(pool.path, "rb") as f:
        f.seek(3 * 4096 + 17)
        assert f.read(1) == b"\x63"


def test_the_file_never_has_a_name(make_pool) -> None:
    prefix = unique_prefix("named")
    pool = make_pool(4, 4096, pin=False, name_prefix=prefix)
    assert os.readlink(pool.path) == f"/memfd:{prefix} (deleted)"  # in no directory
    assert shm_entries(prefix) == []
    assert stat.S_IMODE(os.fstat(pool.fd).st_mode) == 0o600  # a memfd starts 0777


def test_the_pool_is_sealed_against_any_change_of_size(make_pool) -> None:
    pool = make_pool(4, 4096, pin=False)
    held = os.dup(pool.fd)  # what an engine holds: a copy of the descriptor
    try:
        assert fcntl.fcntl(held, fcntl.F_GET_SEALS) == host_pool_mod.POOL_SEALS
        for change in (
            lambda: os.ftruncate(held, 0),
            lambda: os.ftruncate(held, pool.total_bytes + 4096),
            lambda: os.posix_fallocate(held, 0, pool.total_bytes + 4096),
            lambda: fcntl.fcntl(held, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE),
        ):
            with pytest.raises(PermissionError):
                change()
        assert os.fstat(held).st_size == pool.total_bytes
        # The holder still maps it read-write: the same memory as the pool's.
        with mmap.mmap(held, pool.total_bytes) as view:
            view[4096:4100] = b"kv!!"
            assert bytes(pool.tensor[1, :4].numpy()) == b"kv!!"
    finally:
        os.close(held)


def test_a_punched_hole_refaults_as_zeros_and_never_kills_the_owner() -> None:
    # In a child: a SIGBUS there fails this test instead of ending pytest.
    code = textwrap.dedent(
        """
        import ctypes, os
        from transfer import HostPool
        pool = HostPool.create(8, 65536, pin=False)
        pool.tensor.fill_(7)
        fallocate = ctypes.CDLL(None, use_errno=True).fallocate
        fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
        held = os.dup(pool.fd)
        assert fallocate(held, 3, 65536, 3 * 65536) == 0  # PUNCH_HOLE | KEEP_SIZE: blocks 1-3
        assert int(pool.tensor[1:4].sum()) == 0  # read back as zeros
        pool.tensor[2].fill_(9)  # and written again
        assert int(pool.tensor[2].sum()) == 9 * 65536
        assert int(pool.tensor[0].sum()) == int(pool.tensor[4:].sum()) / 4 == 7 * 65536
        print("alive")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=False
    )
    assert (done.returncode, done.stdout.strip()) == (0, "alive"), done.stderr[-2000:]


@pytest.mark.parametrize(
    ("num_blocks", "block_bytes"),
    [(0, 4096), (-1, 4096), (4, 0), (4, -8), (True, 4096), (4, 4096.0), ("4", 4096)],
)
def test_rejects_bad_sizes(num_blocks, block_bytes) -> None:
    with pytest.raises(PoolError, match="must be a positive integer"):
        HostPool.create(num_blocks, block_bytes, pin=False)


def test_a_reservation_the_kernel_refuses_is_a_pool_error(monkeypatch) -> None:
    def full(fd: int, offset: int, size: int) -> None:
        raise OSError(errno.ENOMEM, os.strerror(errno.ENOMEM))

    monkeypatch.setattr(os, "posix_fallocate", full)
    before = set(os.listdir("/proc/self/fd"))
    with pytest.raises(PoolError, match="cannot reserve 16384 bytes of shared memory"):
        HostPool.create(4, 4096, pin=False)
    assert set(os.listdir("/proc/self/fd")) <= before  # the memfd was closed again


def test_rejects_pool_larger_than_available_memory(monkeypatch) -> None:
    monkeypatch.setattr(host_pool_mod, "_available_memory", lambda: 1 << 20)
    with pytest.raises(PoolError, match=r"does not fit in memory \(1048576 bytes available\)"):
        HostPool.create(512, 4096, pin=False)


def test_available_memory_is_readable_here() -> None:
    avail = host_pool_mod._available_memory()
    assert avail is None or avail > 0


def test_close_is_idempotent_and_final(make_pool) -> None:
    prefix = unique_prefix("close")
    pool = make_pool(4, 4096, pin=False, name_prefix=prefix)
    path = pool.path
    assert os.path.exists(path)
    pool.close()
    pool.close()
    assert pool.closed
    assert not os.path.exists(path)
    with pytest.raises(PoolError, match="closed"):
        _ = pool.tensor
    assert shm_entries(prefix) == []


def test_context_manager_closes() -> None:
    with HostPool.create(2, 4096, pin=False) as pool:
        path = pool.path
        assert os.path.exists(path)
    assert pool.closed
    assert not os.path.exists(path)


def test_nothing_survives_sigkill_of_the_owner() -> None:
    prefix = unique_prefix("kill")
    code = textwrap.dedent(
        f"""
        import os, sys, time
        import transfer
        from transfer import HostPool
        pool = HostPool.create(16, 65536, pin=False, name_prefix={prefix!r})
        pool.tensor[5].fill_(7)
        print(pool.path, flush=True)
        time.sleep(120)
        """
    )
    with subprocess.Popen(
        [sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True
    ) as child:
        try:
            assert child.stdout is not None
            path = child.stdout.readline().strip()
            assert path == f"/proc/{child.pid}/fd/{path.rsplit('/', 1)[1]}"
            # While the owner lives: the pool is reachable by its path and has no name.
            assert os.readlink(path) == f"/memfd:{prefix} (deleted)"
            with open(path, "rb") as f:
                f.seek(5 * 65536)
                assert f.read(4) == b"\x07" * 4
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL
    assert not os.path.exists(path)
    assert shm_entries(prefix) == []


class FakeCudart:
    """Stands in for torch.cuda.cudart(): records registrations, fails on request."""

    def __init__(self, fail_on_call: int | None = None) -> None:
        self.fail_on_call = fail_on_call
        self.registered: list[tuple[int, int, int]] = []
        self.unregistered: list[int] = []
        self.calls = 0
        self.errors_cleared = 0

    def cudaGetLastError(self) -> int:
        self.errors_cleared += 1
        return 0

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        self.calls += 1
        if self.fail_on_call is not None and self.calls == self.fail_on_call:
            return 2  # cudaErrorMemoryAllocation
        self.registered.append((ptr, size, flags))
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:
        self.unregistered.append(ptr)
        return 0


def test_pins_in_block_aligned_chunks_and_unpins_on_close(make_pool, monkeypatch) -> None:
    fake = FakeCudart()
    monkeypatch.setattr(host_pool_mod, "_cudart", lambda: fake)
    monkeypatch.setattr(host_pool_mod, "MAX_PIN_CHUNK_BYTES", 5 * 8192)
    pool = make_pool(12, 8192, pin=True)
    assert pool.pinned
    assert pool.layout()["pinned"] is True
    base = pool.tensor.data_ptr()
    assert fake.registered == [
        (base, 5 * 8192, 1),
        (base + 5 * 8192, 5 * 8192, 1),
        (base + 10 * 8192, 2 * 8192, 1),
    ]
    assert pool.pin_chunk_blocks == 5
    pool.close()
    assert fake.unregistered == [base, base + 5 * 8192, base + 10 * 8192]
    assert not pool.pinned


def test_failed_registration_rolls_back_and_stays_pageable(make_pool, monkeypatch, caplog) -> None:
    fake = FakeCudart(fail_on_call=3)
    monkeypatch.setattr(host_pool_mod, "_cudart", lambda: fake)
    monkeypatch.setattr(host_pool_mod, "MAX_PIN_CHUNK_BYTES", 4 * 4096)
    with caplog.at_level(logging.WARNING, logger="transfer.host_pool"):
        pool = make_pool(16, 4096, pin=True)
    assert pool.pinned is False
    assert pool.pin_chunk_blocks is None
    assert [p for p, _s, _f in fake.registered] == fake.unregistered  # both chunks rolled back
    assert len(fake.unregistered) == 2
    assert "stays pageable" in caplog.text
    assert fake.errors_cleared == 1  # the failed call's sticky-until-read error was cleared
    pool.tensor[15].fill_(1)  # still a working pool
    pool.close()
    assert len(fake.unregistered) == 2  # nothing more to unregister


def test_pin_without_cuda_warns_and_stays_pageable(make_pool, caplog) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with caplog.at_level(logging.WARNING, logger="transfer.host_pool"):
        pool = make_pool(2, 4096, pin=True)
    assert not pool.pinned
    assert "stays pageable" in caplog.text


def test_pin_none_follows_cuda_availability(make_pool, monkeypatch) -> None:
    fake = FakeCudart()
    monkeypatch.setattr(host_pool_mod, "_cudart", lambda: fake)
    monkeypatch.setattr(host_pool_mod, "_cuda_available", lambda: False)
    assert not make_pool(2, 4096).pinned
    assert fake.calls == 0
    monkeypatch.setattr(host_pool_mod, "_cuda_available", lambda: True)
    assert make_pool(2, 4096).pinned
    assert fake.calls == 1


def test_chunk_size_falls_on_block_and_page_boundaries() -> None:
    chunk = host_pool_mod._pin_chunk_bytes
    gib = 1 << 30
    assert chunk(2 << 20, 64 * gib) == 64 * gib
    assert chunk(3 * 4096, 64 * gib) % (3 * 4096) == 0
    assert chunk(3 * 4096, 64 * gib) <= 64 * gib
    odd = chunk(1000, 64 * gib)  # lcm(1000, 4096) fits: block and page aligned
    assert odd % 1000 == 0
    assert odd % 4096 == 0
    huge = chunk(100 * gib + 1, 64 * gib)  # no common multiple fits: page-aligned chunks
    assert huge % 4096 == 0
    assert huge <= 64 * gib


def test_close_without_unpinning_keeps_the_registration(make_pool, monkeypatch) -> None:
    """A shutdown whose copies did not end leaves the pool registered until the process ends."""
    fake = FakeCudart()
    monkeypatch.setattr(host_pool_mod, "_cudart", lambda: fake)
    pool = make_pool(4, 8192, pin=True)
    pool.close(unpin=False)
    assert pool.closed
    assert fake.unregistered == []


def test_the_pool_is_registered_from_the_named_gpu_s_context(make_pool, monkeypatch) -> None:
    """cudaHostRegister makes a context on the calling thread's current device: the pool is
    registered under the device the service serves, not on GPU 0 by default."""
    import contextlib

    fake = FakeCudart()
    current: list[int | None] = [None]
    seen: list[int | None] = []

    @contextlib.contextmanager
    def device(index: int) -> Iterator[None]:
        current[0] = index
        try:
            yield
        finally:
            current[0] = None

    def register(ptr: int, size: int, flags: int) -> int:
        seen.append(current[0])
        return FakeCudart.cudaHostRegister(fake, ptr, size, flags)

    monkeypatch.setattr(host_pool_mod, "_cudart", lambda: fake)
    monkeypatch.setattr(torch.cuda, "device", device)
    monkeypatch.setattr(fake, "cudaHostRegister", register)
    assert make_pool(2, 4096, pin=True, pin_device=3).pinned
    assert make_pool(2, 4096, pin=True).pinned
    assert seen == [3, None]
