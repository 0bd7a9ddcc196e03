"""Fixtures for the transfer tests: pools and shared-memory "device" caches, cleaned up after.

Every file a test creates in /dev/shm carries the test's unique prefix and is removed at
teardown. The helpers these build on live in ``tests.transfer.helpers``.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Callable, Iterator

import pytest

from tests.transfer.helpers import ShmCache, build_shm_cache
from testsupport.kvref import unique_prefix
from testsupport.shm_device import SHM_DIR
from transfer import HostPool, KVCacheRegistry
from transfer.disk import DiskStore


@pytest.fixture
def shm_prefix() -> Iterator[str]:
    prefix = unique_prefix("t")
    yield prefix
    for path in glob.glob(f"{SHM_DIR}/{prefix}*"):
        os.unlink(path)


@pytest.fixture
def make_pool() -> Iterator[Callable[..., HostPool]]:
    pools: list[HostPool] = []

    def make(num_blocks: int, block_bytes: int, **kwargs: object) -> HostPool:
        pool = HostPool.create(num_blocks, block_bytes, **kwargs)  # type: ignore[arg-type]
        pools.append(pool)
        return pool

    yield make
    for pool in pools:
        pool.close()


@pytest.fixture
def shm_cache(shm_prefix: str) -> Callable[..., ShmCache]:
    """Factory: ``build_shm_cache`` with a fresh name under this test's prefix."""
    count = [0]

    def build(
        registry: KVCacheRegistry, n: int = 24, seed: int = 0, device: str = "cpu"
    ) -> ShmCache:
        count[0] += 1
        return build_shm_cache(registry, f"{shm_prefix}-c{count[0]}", n, seed, device)

    return build


@pytest.fixture
def stores() -> Iterator[list[DiskStore]]:
    """Disk stores a test opens (append them): closed after it."""
    opened: list[DiskStore] = []
    yield opened
    for store in opened:
        store.close()
