"""A stand-in engine process: receives the pool on the pool socket, writes through its mapping.

``python -m tests.e2e.pool_engine SOCKET PROC_PATH WRITES`` where ``PROC_PATH`` is the path the
service answers in ``GET /v1/pool`` (``/proc/<pid>/fd/<n>``) and ``WRITES`` a JSON object
``{slot: hex bytes}``. It tries to open ``PROC_PATH`` (what an engine did before the pool
socket), receives the pool, writes each slot's bytes at the start of that block, and prints one
JSON line: ``{"proc_path": "opened" | <error name>, "pool_id", "num_blocks", "block_bytes"}``.
"""

from __future__ import annotations

import json
import os
import sys

from kvoffload_client.pool_socket import receive_pool


def main(socket_path: str, proc_path: str, writes: str) -> None:
    try:
        with open(proc_path, "r+b"):
            opened = "opened"
    except OSError as exc:
        opened = type(exc).__name__
    pool = receive_pool(socket_path, timeout_s=10)
    mapped = pool.map()
    os.close(pool.fd)
    for slot, data in json.loads(writes).items():
        start = pool.offset + int(slot) * pool.block_bytes
        mapped[start : start + len(data) // 2] = bytes.fromhex(data)
    mapped.close()
    answer = {
        "proc_path": opened,
        "pool_id": pool.pool_id,
        "num_blocks": pool.num_blocks,
        "block_bytes": pool.block_bytes,
    }
    print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:4])
