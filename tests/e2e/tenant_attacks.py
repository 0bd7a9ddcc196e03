"""Attacks of a tenant's engine on the memory it registers, run as another, unprivileged user.

``python -m tests.e2e.tenant_attacks ATTACK --uds PATH --namespace NS [--user UID]`` (the
tenant's token in ``$KVO_ATTACK_TOKEN``) imports what it needs, drops to ``--user`` (and its
group) when started as root, runs one attack against the service's Unix sockets only, and
prints one JSON object: what each step answered. Every step is bounded (counts, timeouts), and
the script stops by itself. It imports the standard library and ``kvoffload_client.pool_socket``
only, all before it drops its rights (the interpreter may live where that user cannot read).

Attacks:

- ``truncate``: an unsealed memfd registered (refused?), then a sealed one, shrunk (refused by
  the kernel?) and hole-punched, then an offload from it and an onload into it.
- ``sparse-tmpfs --tmpfs DIR``: a sparse file on a small tmpfs filled to the last byte,
  registered, then an onload into its hole (the write the old service died of).
- ``descriptors --count N --tensors T``: N registrations of T tensors (T divides 4,096) all
  naming one passed descriptor (each tensor used to cost the service a descriptor).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import socket
import sys
from typing import Any

from kvoffload_client.pool_socket import (
    PoolShareError,
    default_pool_socket,
    register_kv_cache,
    sealed_memfd,
)

BLOCK = 4096
BLOCKS = 16
_FALLOC_PUNCH = 0x02 | 0x01  # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE


def drop_to(uid: int) -> None:
    """Become ``uid`` (group: the same number), keeping no supplementary group."""
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)


def http(uds: str, method: str, path: str, token: str, ns: str, body: Any = None) -> Any:
    """One HTTP/1.1 call over the engine's Unix socket: ``[status, json or None]``."""
    data = b"" if body is None else json.dumps(body).encode()
    head = (
        f"{method} {path} HTTP/1.1\r\nHost: kvoffload\r\nAuthorization: Bearer {token}\r\n"
        f"X-KVOffload-Namespace: {ns}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n"
    )
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(uds)
        s.sendall(head.encode() + data)
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    status_line, _, rest = answer.partition(b"\r\n")
    payload = rest.partition(b"\r\n\r\n")[2]
    try:
        parsed = json.loads(payload) if payload else None
    except ValueError:
        parsed = None
    return [int(status_line.split()[1]), parsed]


def spec(name: str, blocks: int = BLOCKS, tensors: int = 1) -> dict[str, Any]:
    """A CPU cache of ``tensors`` uint8 tensors of ``blocks`` x ``BLOCK // tensors`` bytes,
    each naming descriptor 0."""
    tensor = {
        "shape": [blocks, BLOCK // tensors],
        "dtype": "uint8",
        "block_dim": 0,
        "handle": {"kind": "shm", "fd": 0},
    }
    return {"name": name, "device": "cpu", "tensors": [dict(tensor) for _ in range(tensors)]}


def register(args: argparse.Namespace, body: dict[str, Any], fd: int) -> Any:
    """``{"cache_id": ...}`` or ``{"refused": reason, "message": ...}``."""
    try:
        got = register_kv_cache(
            default_pool_socket(args.uds), body, [fd], 10.0, token=args.token, namespace=args.ns
        )
    except PoolShareError as exc:
        return {"refused": exc.reason, "message": str(exc)[-300:]}
    return {"cache_id": got["cache_id"]}


def copy(args: argparse.Namespace, op: str, cache_id: str, key: str, block: int) -> Any:
    """An offload or onload of one block, and the job's end: ``[status, state]``."""
    rid = f"attack-{op}-{block}"
    http(args.uds, "PUT", f"/v1/requests/{rid}", args.token, args.ns, {})
    body = {"keys": [key], "cache_id": cache_id, "device_blocks": [block]}
    status, answer = http(args.uds, "POST", f"/v1/requests/{rid}/{op}", args.token, args.ns, body)
    job = (answer or {}).get("job_id")
    if job is None:
        return [status, (answer or {}).get("error", {}).get("code")]
    wait = {"job_ids": [job], "timeout_s": 5}
    _s, waited = http(args.uds, "POST", "/v1/jobs/wait", args.token, args.ns, wait)
    return [status, waited["jobs"][0]["state"]]


def truncate(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    unsealed = os.memfd_create("attack-unsealed")
    os.ftruncate(unsealed, BLOCKS * BLOCK)
    out["unsealed"] = register(args, spec("unsealed"), unsealed)
    if "cache_id" in out["unsealed"]:  # the old service took it: shrink it under the copies
        os.ftruncate(unsealed, 0)
        out["unsealed_offload"] = copy(args, "offload", out["unsealed"]["cache_id"], "aa" * 8, 3)
    fd = sealed_memfd(BLOCKS * BLOCK, "attack-sealed")
    os.pwrite(fd, b"attacker-bytes!!" * (BLOCK // 16), 0)
    out["sealed"] = register(args, spec("sealed"), fd)
    try:
        os.ftruncate(fd, 0)
        out["shrunk"] = "shrunk"
    except OSError as exc:
        out["shrunk"] = exc.strerror
    fallocate = ctypes.CDLL(None, use_errno=True).fallocate
    fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
    out["punched"] = fallocate(fd, _FALLOC_PUNCH, BLOCK, (BLOCKS - 1) * BLOCK) == 0
    cache = out["sealed"].get("cache_id")
    if cache is not None:
        out["offload"] = copy(args, "offload", cache, "bb" * 8, 0)
        out["onload"] = copy(args, "onload", cache, "bb" * 8, 9)
        out["onloaded_bytes_ok"] = os.pread(fd, BLOCK, 9 * BLOCK) == os.pread(fd, BLOCK, 0)
    return out


def sparse_tmpfs(args: argparse.Namespace) -> dict[str, Any]:
    path = os.path.join(args.tmpfs, "sparse-kv")
    fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_EXCL, 0o600)
    os.ftruncate(fd, BLOCKS * BLOCK)  # a hole: no page behind it
    filler = os.open(os.path.join(args.tmpfs, "filler"), os.O_CREAT | os.O_WRONLY, 0o600)
    filled = 0
    try:
        while filled < 64 << 20:  # bounded: the tmpfs is far smaller
            filled += os.write(filler, b"\xff" * 65536)
    except OSError as exc:
        full = exc.strerror
    else:
        full = "not full"
    out: dict[str, Any] = {"tmpfs": full, "registered": register(args, spec("sparse"), fd)}
    cache = out["registered"].get("cache_id")
    if cache is not None:
        out["offload"] = copy(args, "offload", cache, "cc" * 8, 0)
        out["onload"] = copy(args, "onload", cache, "cc" * 8, 5)
    return out


def descriptors(args: argparse.Namespace) -> dict[str, Any]:
    fd = sealed_memfd(BLOCKS * BLOCK, "attack-many-tensors")
    body = spec("many", tensors=args.tensors)
    answers = [register(args, {**body, "name": f"many-{i}"}, fd) for i in range(args.count)]
    reasons: dict[str, int] = {}
    for a in answers:
        key = "registered" if "cache_id" in a else a["refused"]
        reasons[key] = reasons.get(key, 0) + 1
    return {"answers": reasons, "last": answers[-1]}


def main() -> None:
    parser = argparse.ArgumentParser(prog="tenant_attacks")
    parser.add_argument("attack", choices=["truncate", "sparse-tmpfs", "descriptors"])
    parser.add_argument("--uds", required=True)
    parser.add_argument("--namespace", dest="ns", required=True)
    parser.add_argument("--user", type=int, default=None)
    parser.add_argument("--tmpfs", default=None)
    parser.add_argument("--count", type=int, default=23)
    parser.add_argument("--tensors", type=int, default=2048)
    args = parser.parse_args()
    args.token = os.environ["KVO_ATTACK_TOKEN"]
    if args.user is not None and os.geteuid() == 0:
        drop_to(args.user)
    run = {"truncate": truncate, "sparse-tmpfs": sparse_tmpfs, "descriptors": descriptors}
    result = run[args.attack](args)
    result["uid"] = os.geteuid()
    sys.stdout.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
