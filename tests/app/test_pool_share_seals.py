"""The pool an engine receives over the pool socket is the service's own read-write memory, and
the engine can still not change its size (issue #42, finding 1): a shrunk pool used to end the
service with ``SIGBUS`` at its next copy. A hole the engine punches reads as zeros again."""

from __future__ import annotations

import ctypes
import fcntl
import os
from pathlib import Path

import pytest
from kvoffload_client.pool_socket import SharedPool, receive_pool

from tests.app.test_pool_share import share_server
from transfer import HostPool
from transfer.host_pool import POOL_SEALS

BLOCKS, BLOCK_BYTES = 8, 4096
_FALLOC_PUNCH = 0x02 | 0x01  # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE


def test_a_received_pool_maps_read_write_but_cannot_change_size(tmp_path: Path) -> None:
    path = str(tmp_path / "engine.sock.pool")
    with HostPool.create(BLOCKS, BLOCK_BYTES, pin=False) as pool:
        pool.tensor.fill_(5)
        offered = SharedPool(pool.fd, pool.pool_id, pool.num_blocks, pool.block_bytes)
        with share_server(path, lambda: offered):
            got = receive_pool(path)
        try:
            assert fcntl.fcntl(got.fd, fcntl.F_GET_SEALS) == POOL_SEALS
            with pytest.raises(PermissionError):
                os.ftruncate(got.fd, 0)
            with pytest.raises(PermissionError):
                os.ftruncate(got.fd, got.file_bytes * 2)
            with pytest.raises(PermissionError):  # F_SEAL_WRITE would stop the service's copies
                fcntl.fcntl(got.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)
            assert os.fstat(got.fd).st_size == pool.total_bytes
            fallocate = ctypes.CDLL(None, use_errno=True).fallocate
            fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
            assert fallocate(got.fd, _FALLOC_PUNCH, BLOCK_BYTES, 2 * BLOCK_BYTES) == 0
            with got.map() as mapped:
                # The service's view: the hole reads as zeros and takes writes; the rest stays.
                assert int(pool.tensor[1:3].sum()) == 0
                pool.tensor[2].fill_(9)
                assert mapped[2 * BLOCK_BYTES] == 9
                mapped[3 * BLOCK_BYTES] = 77  # and the engine still writes into it
                assert int(pool.tensor[3, 0]) == 77
                assert int(pool.tensor[0, 0]) == int(pool.tensor[7, 0]) == 5
        finally:
            os.close(got.fd)
