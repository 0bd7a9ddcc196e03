"""The host pool handed to engines over a Unix socket: its descriptor, not a path.

A path to the pool (``/proc/<pid>/fd/<n>``) opens only for a process of the service's user in
its PID namespace. A descriptor passed over a Unix socket (``SCM_RIGHTS``) works for any process
that can connect to the socket, whatever its user, PID or mount namespace, so an engine in
another container needs nothing shared with the service but the socket's directory.

Protocol (one exchange per connection), in one of two modes the server is started in:

- **Open** (no tenants): the service speaks first, the client sends nothing.
- **Tenants** (``read_request=True``): the client speaks first with one request line of JSON,
  ``{"token": "..." | null, "namespace": "..." | null}`` ended by ``\n``, at most
  ``MAX_REQUEST_BYTES`` long; the service answers with the pool of the namespace the request
  resolves to, or with one refusal line ``{"error": "<reason code>"}`` and no descriptor. A
  client that sends no whole line within ``REQUEST_TIMEOUT_S``, a longer one, or one that is
  not such an object is refused (``request_timeout``, ``request_too_large``, ``bad_request``)
  and dropped.

The answer is one line of JSON, ``PROTOCOL`` plus the layout (``pool_id``, ``num_blocks``,
``block_bytes``, ``offset``: byte offset of block 0 in the file), ended by ``\n`` and at most
``MAX_HEADER_BYTES`` long, with exactly one descriptor attached; then the service closes the
connection. The descriptor is the pool's own read-write one: the receiver maps it read-write
and ``MAP_SHARED``, and its copies see the service's bytes and vice versa. A client that sends
a request to an open-mode service gets the pool all the same (the service answers without
reading it).

Client: ``receive_pool(path, token=..., namespace=...)`` (with neither, nothing is sent)
returns a ``SharedPool`` whose ``fd`` the caller owns (map it, ``SharedPool.map()``, then close
it; the mapping outlives the descriptor). Every failure (no socket, nobody listening, a socket
that is not a pool socket, a refusal, a truncated or invalid header, a file whose size is not
the layout's, no answer before ``timeout_s``) is a ``PoolShareError`` with a message naming the
socket (and ``reason``, the service's code, for a refusal); no descriptor is leaked on failure.

Service: ``PoolShareServer`` answers connections on a listening socket from the event loop
without ever blocking it (a header of a few hundred bytes fits in a fresh socket's send buffer;
a send that would block drops that connection, and that client gets a ``PoolShareError``). In
tenant mode each connection waits for its request in a task of its own, at most
``MAX_WAITING_REQUESTS`` at once (more are dropped at once). Refusals are logged with the
peer's pid, uid and gid and the reason; the token never is.

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
from typing import Any, Literal, overload

__all__ = [
    "MAX_HEADER_BYTES",
    "MAX_REQUEST_BYTES",
    "MAX_WAITING_REQUESTS",
    "POOL_HEADER",
    "POOL_SOCKET_SUFFIX",
    "PROTOCOL",
    "REQUEST_TIMEOUT_S",
    "PoolShareError",
    "PoolShareServer",
    "SharedPool",
    "default_pool_socket",
    "receive_pool",
]

PROTOCOL = "kvoffload-pool/1"
"""The ``protocol`` value of every header; another value is not a pool this client can map."""
MAX_HEADER_BYTES = 4096
MAX_REQUEST_BYTES = 4096
"""Longest request line (tenant mode), newline included."""
REQUEST_TIMEOUT_S = 2.0
"""How long a tenant-mode server waits for a connection's request line."""
MAX_WAITING_REQUESTS = 64
"""Connections a tenant-mode server waits on at once; one more is dropped unanswered."""
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
    """The pool could not be received from a pool socket (the message says why).

    ``reason`` is the service's code when it refused (tenant mode: the credentials or the
    namespace were not accepted, or the request came too late or too long), else None.
    """

    def __init__(self, message: str, reason: str | None = None) -> None:
        super().__init__(message)
        self.reason = reason


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


def receive_pool(
    socket_path: str | os.PathLike[str],
    timeout_s: float = 5.0,
    *,
    token: str | None = None,
    namespace: str | None = None,
) -> SharedPool:
    """Connect to the pool socket at ``socket_path`` and receive the pool.

    With ``token`` or ``namespace`` (a service with tenants), the request line is sent first;
    with neither, nothing is. Returns a ``SharedPool`` whose ``fd`` (close-on-exec) the caller
    owns. The whole exchange takes at most about ``timeout_s``; any failure raises
    ``PoolShareError`` (a refusal: with its ``reason``) and leaves no descriptor open. The
    token appears in no message.
    """
    path = os.fspath(socket_path)
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s!r}")
    request = None if token is None and namespace is None else _request_line(token, namespace)
    deadline = time.monotonic() + timeout_s
    fds: list[int] = []
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout_s)
            _connect(sock, path, timeout_s)
            if request is not None:
                _send_request(sock, path, request, timeout_s)
            line = _read_header(sock, path, fds, deadline, timeout_s)
        return _validate(line, fds, path, asked=request is not None)
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


def _request_line(token: str | None, namespace: str | None) -> bytes:
    line = json.dumps({"token": token, "namespace": namespace}, separators=(",", ":"))
    if len(line) + 1 > MAX_REQUEST_BYTES:
        raise ValueError(
            f"the pool request (token and namespace) is over {MAX_REQUEST_BYTES} bytes"
        )
    return line.encode() + b"\n"


def _send_request(sock: socket.socket, path: str, request: bytes, timeout_s: float) -> None:
    try:
        # MSG_NOSIGNAL: a peer that already closed must not kill the process with SIGPIPE.
        sock.sendall(request, socket.MSG_NOSIGNAL)
    except (BrokenPipeError, ConnectionResetError):
        # An open-mode service answers at once and closes without reading: its answer is
        # already here to be read.
        pass
    except TimeoutError:
        raise PoolShareError(
            f"sending the pool request to {path} took over {timeout_s} s"
        ) from None
    except OSError as exc:
        raise PoolShareError(f"writing to {path}: {exc.strerror or exc}") from None


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


def _validate(line: bytes, fds: list[int], path: str, asked: bool = False) -> SharedPool:
    try:
        header: Any = json.loads(line)
    except ValueError:  # JSONDecodeError and UnicodeDecodeError
        header = None
    if isinstance(header, dict) and "protocol" not in header and "error" in header:
        reason = str(header["error"])[:100]
        hint = "" if asked else " (this pool socket wants a token or namespace first)"
        raise PoolShareError(f"{path} refused to hand out the pool: {reason}{hint}", reason)
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
    """Answer every connection on a listening Unix socket with a pool, then close it.

    Open mode (``read_request=False``): ``current()`` returns the pool to hand out; when it
    raises (no pool: the service is not running) the connection is closed without an answer.

    Tenant mode (``read_request=True``): each connection's request line is read first (see the
    module docstring) and ``current(request)`` is called with ``{"token": str | None,
    "namespace": str | None}``; it returns the pool of that namespace, or raises to refuse: the
    exception's ``reason`` attribute (a code such as ``unknown_token``; ``refused`` when it has
    none) is answered and logged, never its message.

    The pool's ``fd`` stays the caller's: the server never closes it. ``start()`` runs the server
    on the running event loop; ``stop()`` ends it and closes the socket (the caller removes the
    socket file).
    """

    @overload
    def __init__(
        self,
        sock: socket.socket,
        current: Callable[[], SharedPool],
        *,
        backlog: int = 64,
        read_request: Literal[False] = False,
        request_timeout_s: float = REQUEST_TIMEOUT_S,
    ) -> None: ...

    @overload
    def __init__(
        self,
        sock: socket.socket,
        current: Callable[[dict[str, Any]], SharedPool],
        *,
        backlog: int = 64,
        read_request: Literal[True],
        request_timeout_s: float = REQUEST_TIMEOUT_S,
    ) -> None: ...

    def __init__(
        self,
        sock: socket.socket,
        current: Callable[..., SharedPool],
        *,
        backlog: int = 64,
        read_request: bool = False,
        request_timeout_s: float = REQUEST_TIMEOUT_S,
    ) -> None:
        self._sock = sock
        self._current = current
        self._backlog = backlog
        self._read_request = read_request
        self._request_timeout_s = request_timeout_s
        self._task: asyncio.Task[None] | None = None
        self._waiting: set[asyncio.Task[None]] = set()

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
        """Stop answering, drop connections still waiting, close the listening socket.
        Idempotent."""
        task, self._task = self._task, None
        for t in [task, *self._waiting]:
            if t is not None:
                t.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await t
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
            if not self._read_request:
                with conn:
                    self._open_answer(conn)
            elif len(self._waiting) >= MAX_WAITING_REQUESTS:
                log.warning(
                    "pool request dropped: %d connections already waiting",
                    len(self._waiting),
                    extra={"fields": _peer(conn)},
                )
                conn.close()
            else:
                waiting = loop.create_task(self._tenant_answer(conn))
                self._waiting.add(waiting)
                waiting.add_done_callback(self._waiting.discard)

    def _open_answer(self, conn: socket.socket) -> None:
        peer = _peer(conn)
        try:
            pool = self._current()
        except Exception as exc:
            log.info("pool not handed out: %s", exc, extra={"fields": peer})
            return
        _send_pool(conn, pool, peer)

    async def _tenant_answer(self, conn: socket.socket) -> None:
        with conn:
            peer = _peer(conn)
            try:
                async with asyncio.timeout(self._request_timeout_s):
                    line = await _read_request(conn)
            except TimeoutError:
                _refuse(conn, "request_timeout", peer)
                return
            except OSError as exc:  # the peer reset the connection, or closed it without a line
                log.warning("pool request not read: %s", exc, extra={"fields": peer})
                return
            if len(line) >= MAX_REQUEST_BYTES:
                _refuse(conn, "request_too_large", peer)
                return
            request = _parse_request(line)
            if request is None:
                _refuse(conn, "bad_request", peer)
                return
            try:
                pool = self._current(request)
            except Exception as exc:
                reason = getattr(exc, "reason", None)
                if not isinstance(reason, str) or not reason:
                    # Not a refusal but a failure: its type only (its text is not ours to log).
                    log.warning("pool resolver failed: %s", type(exc).__name__)
                    reason = "refused"
                _refuse(conn, reason, peer)
                return
            _send_pool(conn, pool, peer)


async def _read_request(conn: socket.socket) -> bytes:
    """The request line without its newline, or, when none came in ``MAX_REQUEST_BYTES``,
    those bytes (too long: the caller refuses them)."""
    loop = asyncio.get_running_loop()
    buf = b""
    while b"\n" not in buf:
        if len(buf) >= MAX_REQUEST_BYTES:
            return buf[:MAX_REQUEST_BYTES]
        data = await loop.sock_recv(conn, MAX_REQUEST_BYTES - len(buf))
        if not data:
            raise ConnectionAbortedError("the peer closed the connection without a request")
        buf += data
    return buf.partition(b"\n")[0]


def _parse_request(line: bytes) -> dict[str, Any] | None:
    """``{"token", "namespace"}`` of a request line, or None when it is not a valid one."""
    try:
        body: Any = json.loads(line)
    except ValueError:  # JSONDecodeError and UnicodeDecodeError
        return None
    if not isinstance(body, dict):
        return None
    request = {"token": body.get("token"), "namespace": body.get("namespace")}
    if not all(value is None or isinstance(value, str) for value in request.values()):
        return None
    return request


def _send_pool(conn: socket.socket, pool: SharedPool, peer: dict[str, int]) -> None:
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


def _refuse(conn: socket.socket, reason: str, peer: dict[str, int]) -> None:
    """Answer a refusal line (best effort: the peer may be gone) and log it."""
    log.warning("pool request refused: %s", reason, extra={"fields": {**peer, "reason": reason}})
    line = json.dumps({"error": reason}, separators=(",", ":")).encode() + b"\n"
    with contextlib.suppress(OSError):
        conn.send(line, socket.MSG_NOSIGNAL)


def _peer(conn: socket.socket) -> dict[str, int]:
    """The connecting process (pid 0 when it lives in a PID namespace this one cannot see)."""
    try:
        pid, uid, gid = _PEERCRED.unpack(
            conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
        )
    except OSError:
        return {}
    return {"peer_pid": pid, "peer_uid": uid, "peer_gid": gid}
