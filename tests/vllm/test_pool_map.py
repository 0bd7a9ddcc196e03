"""``MappedPool``: blocks of a shared file, and how an answer tells that the pool changed."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from kvoffload_client.vllm import MappedPool


def pool_file(tmp_path: Path, blocks: int, block_bytes: int, offset: int = 0) -> int:
    fd = os.open(tmp_path / "pool", os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, offset + blocks * block_bytes)
    return fd


def test_blocks_are_the_file_after_its_offset(tmp_path: Path):
    fd = pool_file(tmp_path, 4, 4096, offset=8192)
    try:
        pool = MappedPool.from_fd(fd, "p1", 4, 4096, offset=8192)
        pool.blocks[2] = np.full(4096, 7, dtype=np.uint8)
        assert os.pread(fd, 4096, 8192 + 2 * 4096) == bytes([7]) * 4096
        assert os.pread(fd, 4096, 2 * 4096) == bytes(4096)
    finally:
        os.close(fd)


def test_an_answer_names_the_pool_it_came_from(tmp_path: Path):
    fd = pool_file(tmp_path, 2, 4096)
    try:
        announced = MappedPool.from_fd(fd, "pool-a", 2, 4096)
        assert announced.still_current("pool-a")
        assert not announced.still_current("pool-b")
        assert announced.still_current(None)  # no header and no path: nothing tells
        st = os.fstat(fd)
        path = str(tmp_path / "pool")
        by_path = MappedPool.from_fd(fd, f"file:{st.st_dev}:{st.st_ino}", 2, 4096, path=path)
        assert by_path.still_current(None)
        os.unlink(path)  # the service is gone with its /proc/<pid>/fd/<n> link
        assert not by_path.still_current(None)
    finally:
        os.close(fd)
