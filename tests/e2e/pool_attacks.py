"""A tenant's engine attacks the host pool the pool socket hands it, run as another user.

``python -m tests.e2e.pool_attacks --uds PATH --namespace NS [--user UID]`` (the tenant's token
in ``$KVO_ATTACK_TOKEN``) receives the namespace's pool over the pool socket, maps it read-write,
tries to shrink it, punches a hole over all of it, and then makes the service write into it: an
offload from a sealed KV cache of its own, an onload back, a demote to the disk tier and an
onload that brings the block back up into the pool. It prints one JSON object: what each step
answered. Imports and helpers as ``tests.e2e.tenant_attacks`` (all before it drops its rights).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import time
from typing import Any

from kvoffload_client.pool_socket import default_pool_socket, receive_pool, sealed_memfd

from tests.e2e.tenant_attacks import BLOCK, BLOCKS, copy, drop_to, http, register, spec

_FALLOC_PUNCH = 0x02 | 0x01  # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE


def pool(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    shared = receive_pool(default_pool_socket(args.uds), 10.0, token=args.token, namespace=args.ns)
    out["pool_bytes"] = shared.file_bytes
    with shared.map() as view:
        view[:8] = b"mapped!!"
        out["mapped_rw"] = os.pread(shared.fd, 8, 0) == b"mapped!!"
    try:
        os.ftruncate(shared.fd, 0)
        out["shrunk"] = "shrunk"
    except OSError as exc:
        out["shrunk"] = exc.strerror
    fallocate = ctypes.CDLL(None, use_errno=True).fallocate
    fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
    whole = shared.file_bytes
    out["punched"] = fallocate(shared.fd, _FALLOC_PUNCH, 0, whole) == 0
    fd = sealed_memfd(BLOCKS * BLOCK, "attack-pool-cache")
    os.pwrite(fd, b"bob's own block!" * (BLOCK // 16), 0)
    cache = register(args, spec("pool-attack"), fd).get("cache_id")
    out["registered"] = cache is not None
    if cache is None:
        return out
    key = "ee" * 8
    out["offload"] = copy(args, "offload", cache, key, 0)
    out["onload"] = copy(args, "onload", cache, key, 5)
    out["onloaded_bytes_ok"] = os.pread(fd, BLOCK, 5 * BLOCK) == os.pread(fd, BLOCK, 0)
    # Again, between the store and the demotion: the demotion reads the block from the pool.
    out["punched_again"] = fallocate(shared.fd, _FALLOC_PUNCH, 0, whole) == 0
    rid = "attack-demote"
    http(args.uds, "PUT", f"/v1/requests/{rid}", args.token, args.ns, {})
    out["demote"] = http(
        args.uds, "POST", f"/v1/requests/{rid}/demote", args.token, args.ns, {"keys": [key]}
    )
    # The demotion is written in the background: until it lands the key is not ready.
    for _ in range(100):
        out["promoted_onload"] = copy(args, "onload", cache, key, 9)
        if out["promoted_onload"] != [409, "key_not_ready"]:
            break
        time.sleep(0.05)
    out["shrunk_size"] = os.fstat(shared.fd).st_size
    return out


def main() -> None:
    parser = argparse.ArgumentParser(prog="pool_attacks")
    parser.add_argument("--uds", required=True)
    parser.add_argument("--namespace", dest="ns", required=True)
    parser.add_argument("--user", type=int, default=None)
    args = parser.parse_args()
    args.token = os.environ["KVO_ATTACK_TOKEN"]
    if args.user is not None and os.geteuid() == 0:
        drop_to(args.user)
    result = pool(args)
    result["uid"] = os.geteuid()
    sys.stdout.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
