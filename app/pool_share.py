"""The host pool handed to engines over a Unix socket: its descriptor, not a path.

A path to the pool (``/proc/<pid>/fd/<n>``) opens only for a process of the service's user in
its PID namespace. A descriptor passed over a Unix socket (``SCM_RIGHTS``) works for any process
that can connect to the socket, whatever its user, PID or mount namespace, so an engine in
another container needs nothing shared with the service but the socket's directory.

Protocol (one exchange per connection, the service speaks first and the client sends nothing):
the service answers each connection with one line of JSON, ``PROTOCOL`` plus the layout
(``pool_id``, ``num_blocks``, ``block_bytes``, ``offset``: byte offset of block 0 in the file),
ended by ``\\n`` and at most ``MAX_HEADER_BYTES`` long, with exactly one descriptor attached,
then closes the connection. The descriptor is the pool's own read-write one: the receiver maps
it read-write and ``MAP_SHARED``, and its copies see the service's bytes and vice versa.

Client: ``receive_pool(path)`` returns a ``SharedPool`` whose ``fd`` the caller owns (map it,
``SharedPool.map()``, then close it; the mapping outlives the descriptor). Every failure (no
socket, nobody listening, a socket that is not a pool socket, a truncated or invalid header, a
file whose size is not the layout's, no answer before ``timeout_s``) is a ``PoolShareError``
with a message naming the socket; no descriptor is leaked on failure.

Service: ``PoolShareServer`` answers connections on a listening socket from the event loop
without ever blocking it (a header of a few hundred bytes fits in a fresh socket's send buffer;
a send that would block drops that connection, and that client gets a ``PoolShareError``).

Restart detection: ``pool_id`` is new for every pool. The engine API answers carry it in the
``POOL_HEADER`` response header, so a client that mapped a pool notices in any answer that the
service behind the socket was restarted (its mapping then holds a pool nobody else sees).

Standard library only: engines import this module.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import json
import logging
import mmap
import os
import socket
import stat
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = [
    "MAX_HEADER_BYTES",
    "POOL_HEADER",
    "POOL_SOCKET_SUFFIX",
    "PROTOCOL",
    "PoolShareError",
    "PoolShareServer",
    "SharedPool",
    "default_pool_socket",
    "receive_pool",
]

PROTOCOL = "kvoffload-pool/1"
"""The ``protocol`` value of every header; another value is not a pool this client can map."""
MAX_HEADER_BYTES = 4096
POOL_HEADER = "X-KVOffload-Pool"
"""Response header of the engine API: the ``pool_id`` of the pool the service holds."""
POOL_SOCKET_SUFFIX = ".pool"
"""Added to the engine socket's path to name the pool socket, unless it is configured."""

log = logging.getLogger("kvoffload.pool_share")

# Room for a few descriptors: more than one is a protocol error, but each must be closed.
_FDS_SPACE = socket.CMSG_SPACE(4 * array.array("i").itemsize)
_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def default_pool_socket(engine_socket: str) -> str:
    """Where the service puts the pool socket when only the engine API's Unix socket is set."""
    return engine_socket + POOL_SOCKET_SUFFIX


class PoolShareError(Exception):
    """The pool could not be received from a pool socket (the message says why)."""


@dataclass(frozen=True)
class SharedPool:
    """A host pool's layout and a descriptor of its file.

    Blocks ``0 .. num_blocks - 1`` of ``block_bytes`` each lie back to back from byte ``offset``
    of the file. From ``receive_pool`` the caller owns ``fd``; on the service side it is the
    pool's own.
    """

    fd: int
    pool_id: str
    num_blocks: int
    block_bytes: int
    offset: int = 0

    @property
    def total_bytes(self) -> int:
        """Bytes of the blocks (``num_blocks * block_bytes``)."""
        return self.num_blocks * self.block_bytes

    @property
    def file_bytes(self) -> int:
        """Size of the file: ``offset + total_bytes``."""
        return self.offset + self.total_bytes

    def header(self) -> bytes:
        """The wire header announcing this pool (one JSON line)."""
        body = {
            "protocol": PROTOCOL,
            "pool_id": self.pool_id,
            "num_blocks": self.num_blocks,
            "block_bytes": self.block_bytes,
            "offset": self.offset,
        }
        return json.dumps(body, separators=(",", ":")).encode() + b"\n"

    def map(self) -> mmap.mmap:
        """A read-write shared mapping of the whole file (blocks start at ``offset``).

        The mapping stays valid after ``fd`` is closed.
        """
        return mmap.mmap(
            self.fd, self.file_bytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE
        )


def receive_pool(socket_path: str | os.PathLike[str], timeout_s: float = 5.0) -> SharedPool:
    """Connect to the pool socket at ``socket_path`` and receive the pool.

    Returns a ``SharedPool`` whose ``fd`` (close-on-exec) the caller owns. The whole exchange
    takes at most about ``timeout_s``; any failure raises ``PoolShareError`` and leaves no
    descriptor open.
    """
    path = os.fspath(socket_path)
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s!r}")
    deadline = time.monotonic() + timeout_s
    fds: list[int] = []
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout_s)
            _connect(sock, path, timeout_s)
            line = _read_header(sock, path, fds, deadline, timeout_s)
        return _validate(line, fds, path)
    except BaseException:
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        raise


def _connect(sock: socket.socket, path: str, timeout_s: float) -> None:
    try:
        sock.connect(path)
    except FileNotFoundError:
        raise PoolShareError(
            f"no pool socket at {path}: is kvoffload running with --uds or --pool-socket, and is "
            "its socket directory mounted here?"
        ) from None
    except ConnectionRefusedError:
        raise PoolShareError(
            f"nobody listens on {path}: the service stopped (a stale socket) or is restarting"
        ) from None
    except PermissionError:
        raise PoolShareError(
            f"permission denied connecting to {path}: run as the service's user or group"
        ) from None
    except TimeoutError:
        raise PoolShareError(f"connecting to {path} took more than {timeout_s} s") from None
    except OSError as exc:
        raise PoolShareError(f"cannot connect to {path}: {exc.strerror or exc}") from None


def _read_header(
    sock: socket.socket, path: str, fds: list[int], deadline: float, timeout_s: float
) -> bytes:
    """Bytes up to the first newline; every descriptor that came along is appended to ``fds``."""
    buf = b""
    while b"\n" not in buf:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise _no_header(path, timeout_s)
        sock.settimeout(remaining)
        try:
            # Not socket.recv_fds: it drops its flags argument, and the descriptor must be
            # close-on-exec from the start (another thread may fork and exec meanwhile).
            data, ancillary, flags, _ = sock.recvmsg(
                MAX_HEADER_BYTES, _FDS_SPACE, socket.MSG_CMSG_CLOEXEC
            )
        except TimeoutError:
            raise _no_header(path, timeout_s) from None
        except OSError as exc:
            raise PoolShareError(f"reading from {path}: {exc.strerror or exc}") from None
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.extend(array.array("i", payload[: len(payload) - len(payload) % 4]))
        if flags & socket.MSG_CTRUNC:
            raise PoolShareError(f"{path} sent more descriptors than a pool socket does")
        if not data:
            if not buf:
                raise PoolShareError(
                    f"{path} closed the connection without a pool header (the service may be "
                    "stopping)"
                )
            raise PoolShareError(f"{path} sent a truncated pool header ({len(buf)} bytes)")
        buf += data
        if len(buf) > MAX_HEADER_BYTES:
            raise PoolShareError(f"{path} sent a pool header over {MAX_HEADER_BYTES} bytes")
    return buf.partition(b"\n")[0]


def _no_header(path: str, timeout_s: float) -> PoolShareError:
    return PoolShareError(
        f"no pool header from {path} within {timeout_s} s: not a kvoffload pool socket (the "
        f"engine API's socket is not; the pool socket's name ends in {POOL_SOCKET_SUFFIX!r})?"
    )


def _validate(line: bytes, fds: list[int], path: str) -> SharedPool:
    try:
        header: Any = json.loads(line)
    except ValueError:  # JSONDecodeError and UnicodeDecodeError
        header = None
    if not isinstance(header, dict) or header.get("protocol") != PROTOCOL:
        protocol = header.get("protocol") if isinstance(header, dict) else None
        if isinstance(protocol, str) and protocol.startswith("kvoffload-pool/"):
            raise PoolShareError(f"{path} speaks {protocol}, this client {PROTOCOL}")
        raise PoolShareError(f"{path} answered something that is not a kvoffload pool header")
    pool_id = header.get("pool_id")
    if not isinstance(pool_id, str) or not pool_id:
        raise PoolShareError(f"pool header from {path} has no pool_id")
    sizes = {}
    for name, least in (("num_blocks", 1), ("block_bytes", 1), ("offset", 0)):
        value = header.get(name)
        if type(value) is not int or value < least:
            raise PoolShareError(f"pool header from {path} has an invalid {name}: {value!r}")
        sizes[name] = value
    if len(fds) != 1:
        raise PoolShareError(f"{path} sent {len(fds)} descriptors with the pool header, not 1")
    pool = SharedPool(fds[0], pool_id, sizes["num_blocks"], sizes["block_bytes"], sizes["offset"])
    st = os.fstat(pool.fd)
    if not stat.S_ISREG(st.st_mode):
        raise PoolShareError(f"the descriptor from {path} is not a regular file")
    if st.st_size != pool.file_bytes:
        raise PoolShareError(
            f"the pool file from {path} has {st.st_size} bytes, the header says "
            f"{pool.offset} + {pool.num_blocks} x {pool.block_bytes} = {pool.file_bytes}"
        )
    return pool


class PoolShareServer:
    """Answer every connection on a listening Unix socket with the current pool, then close it.

    ``current`` returns the pool to hand out (its ``fd`` stays the caller's: the server never
    closes it); when it raises (no pool: the service is not running) the connection is closed
    without an answer. ``start()`` runs the server on the running event loop; ``stop()`` ends it
    and closes the socket (the caller removes the socket file).
    """

    def __init__(
        self, sock: socket.socket, current: Callable[[], SharedPool], *, backlog: int = 64
    ) -> None:
        self._sock = sock
        self._current = current
        self._backlog = backlog
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start answering connections (call from the event loop that will run the server)."""
        if self._task is not None:
            raise RuntimeError("pool share server already started")
        self._sock.listen(self._backlog)
        self._sock.setblocking(False)
        self._task = asyncio.get_running_loop().create_task(
            self._accept_loop(), name="kvoffload-pool-share"
        )

    async def stop(self) -> None:
        """Stop answering and close the listening socket. Idempotent."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._sock.close()

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, _ = await loop.sock_accept(self._sock)
            except OSError as exc:  # EMFILE and the like: wait instead of spinning
                log.warning("pool socket cannot accept: %s", exc)
                await asyncio.sleep(0.1)
                continue
            with conn:
                self._answer(conn)

    def _answer(self, conn: socket.socket) -> None:
        peer = _peer(conn)
        try:
            pool = self._current()
        except Exception as exc:
            log.info("pool not handed out: %s", exc, extra={"fields": peer})
            return
        header = pool.header()
        try:
            sent = socket.send_fds(conn, [header], [pool.fd])
        except OSError as exc:  # the peer left, or (never in practice) a full send buffer
            log.warning("pool not handed out: %s", exc, extra={"fields": peer})
            return
        if sent != len(header):
            log.warning("pool header cut short", extra={"fields": {**peer, "sent": sent}})
            return
        log.info("pool handed out", extra={"fields": {**peer, "pool_id": pool.pool_id}})


def _peer(conn: socket.socket) -> dict[str, int]:
    """The connecting process (pid 0 when it lives in a PID namespace this one cannot see)."""
    try:
        pid, uid, gid = _PEERCRED.unpack(
            conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
        )
    except OSError:
        return {}
    return {"peer_pid": pid, "peer_uid": uid, "peer_gid": gid}
