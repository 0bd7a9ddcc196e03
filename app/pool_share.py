"""The pool socket, the service's side: ``PoolShareServer`` hands the host pool's descriptor to
engines over a Unix socket and takes KV caches registered by descriptor.

The protocol, its limits and the engine's side (``receive_pool``, ``register_kv_cache``) are in
``kvoffload_client.pool_socket``, which the engine side installs without the server; this
module is the server. It answers connections from the event loop without ever blocking it (a
header of a few hundred bytes fits in a fresh socket's send buffer; a send that would block
drops that connection, and that client gets a ``PoolShareError``). In tenant mode each
connection waits for its request in a task of its own, with a deadline of its own
(``REQUEST_TIMEOUT_S``); idle connections cannot starve the others: one peer process holds at
most ``MAX_WAITING_PER_PEER`` waiting connections and all together ``MAX_WAITING_REQUESTS``,
and past either bound the oldest waiting one is dropped, never the new one. Descriptors passed
by connections still waiting are bounded too (``MAX_PASSED_HELD`` over all of them), in the
same way. A connection accepted while the process's descriptor table is in its reserve
(``app.descriptors``) is closed at once, and a failed ``accept`` (a full table) waits a moment
instead of spinning; both are counted, and logged at most once per ten seconds. Refusals are
logged with the peer's pid, uid and gid and the reason; the token never is.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import json
import logging
import os
import socket
import struct
from collections.abc import Callable
from typing import Any, Literal, overload

from kvoffload_client.pool_socket import (
    FDS_PER_MESSAGE,
    MAX_REGISTER_BYTES,
    MAX_REGISTER_FDS,
    MAX_REQUEST_BYTES,
    PoolShareError,
    SharedPool,
)

from app.descriptors import RateLimitedLog, in_reserve

__all__ = [
    "MAX_PASSED_HELD",
    "MAX_WAITING_PER_PEER",
    "MAX_WAITING_REQUESTS",
    "REQUEST_TIMEOUT_S",
    "PoolShareError",
    "PoolShareServer",
    "SharedPool",
]

REQUEST_TIMEOUT_S = 2.0
"""How long a tenant-mode server waits for a connection's request line."""
MAX_WAITING_REQUESTS = 1024
"""Connections a tenant-mode server waits on at once; one more drops the oldest waiting one."""
MAX_WAITING_PER_PEER = 8
"""Connections of one peer process a tenant-mode server waits on at once; one more drops that
peer's oldest waiting one."""
MAX_PASSED_HELD = 4096
"""Descriptors that waiting connections may hold at once, all together (each registration
passes up to ``MAX_REGISTER_FDS``); past it the oldest waiting connections holding some are
dropped, with what they passed."""

log = logging.getLogger("kvoffload.pool_share")

# Room to receive a registration's descriptors (the kernel's most per message).
_REGISTER_FDS_SPACE = socket.CMSG_SPACE(FDS_PER_MESSAGE * array.array("i").itemsize)
_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


class PoolShareServer:
    """Answer every connection on a listening Unix socket with a pool, then close it.

    Open mode (``read_request=False``): ``current()`` returns the pool to hand out; when it
    raises (no pool: the service is not running) the connection is closed without an answer.

    Tenant mode (``read_request=True``): each connection's request line is read first (see the
    module docstring) and ``current(request)`` is called with ``{"token": str | None,
    "namespace": str | None}``; it returns the pool of that namespace, or raises to refuse: the
    exception's ``reason`` attribute (a code such as ``unknown_token``; ``refused`` when it has
    none) is answered and logged, never its message. A request with ``register_kv_cache`` goes
    to ``register(request, fds)`` instead (``request`` then holds the registration too, ``fds``
    the descriptors that came with the line, closed by the server afterwards): it returns the
    answer object, or raises like ``current`` (its ``public_message`` attribute, when a string,
    is answered too). Without ``register``, such a request is refused (``bad_request``).

    Waiting connections (tenant mode) are bounded without letting idle ones starve the others:
    each has ``request_timeout_s`` to send its line, one peer process holds at most
    ``MAX_WAITING_PER_PEER`` of them and all peers ``MAX_WAITING_REQUESTS``; past either bound
    the *oldest* waiting connection (of that peer, or of all) is dropped, never the new one. A
    legitimate client sends its line as soon as it connects and is answered at once, so it is
    never the oldest for long; a connection that sends nothing is.

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
        backlog: int = 1024,
        read_request: Literal[False] = False,
        request_timeout_s: float = REQUEST_TIMEOUT_S,
    ) -> None: ...

    @overload
    def __init__(
        self,
        sock: socket.socket,
        current: Callable[[dict[str, Any]], SharedPool],
        *,
        backlog: int = 1024,
        read_request: Literal[True],
        request_timeout_s: float = REQUEST_TIMEOUT_S,
        register: Callable[[dict[str, Any], list[int]], dict[str, Any]] | None = None,
    ) -> None: ...

    def __init__(
        self,
        sock: socket.socket,
        current: Callable[..., SharedPool],
        *,
        backlog: int = 1024,
        read_request: bool = False,
        request_timeout_s: float = REQUEST_TIMEOUT_S,
        register: Callable[[dict[str, Any], list[int]], dict[str, Any]] | None = None,
    ) -> None:
        self._sock = sock
        self._current = current
        self._register = register
        self._backlog = backlog
        self._read_request = read_request
        self._request_timeout_s = request_timeout_s
        self._task: asyncio.Task[None] | None = None
        # Waiting connections and their peer, oldest first (a dict keeps insertion order).
        self._waiting: dict[asyncio.Task[None], tuple[int, int]] = {}
        self._conns: dict[asyncio.Task[None], socket.socket] = {}
        # The descriptors each waiting connection passed so far (the lists its task fills).
        self._passed: dict[asyncio.Task[None], list[int]] = {}
        self.dropped = 0
        """Waiting connections dropped to make room for newer ones (since start)."""
        self.refused_in_reserve = 0
        """Connections closed at once: the descriptor table was in its reserve."""
        self.accept_failures = 0
        """``accept`` calls that failed (a full descriptor table, mostly)."""
        self._table_log = RateLimitedLog(log)

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
        for t in [task, *self._conns]:
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
                self.accept_failures += 1
                self._table_log.warning("pool socket cannot accept", error=str(exc))
                await asyncio.sleep(0.1)
                continue
            if in_reserve(conn.fileno()):
                conn.close()
                self.refused_in_reserve += 1
                self._table_log.warning(
                    "pool socket connection closed: the descriptor table is in its reserve"
                )
                continue
            if not self._read_request:
                with conn:
                    self._open_answer(conn)
                continue
            peer = _peer(conn)
            key = (peer.get("peer_pid", 0), peer.get("peer_uid", -1))
            self._make_room(key)
            passed: list[int] = []
            waiting = loop.create_task(self._tenant_answer(conn, peer, passed))
            self._waiting[waiting] = key
            self._conns[waiting] = conn
            self._passed[waiting] = passed
            waiting.add_done_callback(self._forget)

    def _forget(self, task: asyncio.Task[None]) -> None:
        self._waiting.pop(task, None)
        self._passed.pop(task, None)
        # Closed here too: a task cancelled before it ran never reached its own ``with conn``.
        self._conns.pop(task).close()

    def _make_room(self, key: tuple[int, int]) -> None:
        """Drop the oldest waiting connection of peer ``key`` when it is at its bound, else the
        oldest of all when every slot is taken: a new connection is always waited on."""
        mine = [t for t, k in self._waiting.items() if k == key]
        if len(mine) >= MAX_WAITING_PER_PEER:
            victim = mine[0]
        elif len(self._waiting) >= MAX_WAITING_REQUESTS:
            victim = next(iter(self._waiting))
        else:
            return
        self._waiting.pop(victim)
        victim.cancel()  # its task closes the connection, unanswered
        self.dropped += 1
        # Debug only: an idle flood must not turn into a log flood (``dropped`` counts them).
        log.debug("pool request dropped for a newer connection", extra={"fields": {"key": key}})

    def _open_answer(self, conn: socket.socket) -> None:
        peer = _peer(conn)
        try:
            pool = self._current()
        except Exception as exc:
            log.info("pool not handed out: %s", exc, extra={"fields": peer})
            return
        _send_pool(conn, pool, peer)

    def _bound_passed(self) -> None:
        """Drop the oldest waiting connections that hold passed descriptors while all of them
        hold more than ``MAX_PASSED_HELD`` (the newest, still reading, is never dropped)."""
        held = sum(len(fds) for t, fds in self._passed.items() if t in self._waiting)
        if held <= MAX_PASSED_HELD:
            return
        current = asyncio.current_task()
        for task, fds in list(self._passed.items()):
            if held <= MAX_PASSED_HELD:
                break
            if task is current or not fds or task not in self._waiting:
                continue
            held -= len(fds)
            self._waiting.pop(task)
            task.cancel()  # its task closes the connection and what it passed
            self.dropped += 1

    async def _tenant_answer(
        self, conn: socket.socket, peer: dict[str, int], fds: list[int]
    ) -> None:
        try:
            with conn:
                await self._answer(conn, peer, fds)
        finally:
            for fd in fds:  # whatever came along; a registration mapped what it kept
                with contextlib.suppress(OSError):
                    os.close(fd)

    async def _answer(self, conn: socket.socket, peer: dict[str, int], fds: list[int]) -> None:
        conn.setblocking(False)  # read with recvmsg as the loop says it is readable
        try:
            async with asyncio.timeout(self._request_timeout_s):
                line = await _read_request(conn, fds, self._bound_passed)
        except TimeoutError:
            _refuse(conn, "request_timeout", peer)
            return
        except _TooManyDescriptors:
            _refuse(conn, "too_many_descriptors", peer)
            return
        except OSError as exc:  # the peer reset the connection, or closed it without a line
            log.info("pool request not read: %s", exc, extra={"fields": peer})
            return
        if len(line) >= (MAX_REGISTER_BYTES if fds else MAX_REQUEST_BYTES):
            _refuse(conn, "request_too_large", peer)
            return
        request = _parse_request(line)
        registration = request is not None and "register_kv_cache" in request
        if request is None or (fds and not registration):  # a pool request passes nothing
            _refuse(conn, "bad_request", peer)
            return
        try:
            if registration:
                if self._register is None:
                    raise _Refusal("bad_request")
                answer = self._register(request, fds)
            else:
                pool = self._current(request)
        except Exception as exc:
            reason = getattr(exc, "reason", None)
            if not isinstance(reason, str) or not reason:
                # Not a refusal but a failure: its type only (its text is not ours to log).
                log.warning("pool resolver failed: %s", type(exc).__name__)
                reason = "refused"
            message = getattr(exc, "public_message", None)
            _refuse(conn, reason, peer, message if isinstance(message, str) else None)
            return
        if registration:
            _send_line(conn, {"kv_cache": answer}, peer)
            return
        _send_pool(conn, pool, peer)


class _Refusal(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class _TooManyDescriptors(Exception):
    """A request passed more descriptors than ``MAX_REGISTER_FDS`` (or the kernel cut some)."""


async def _readable(conn: socket.socket) -> None:
    """Wait until ``conn`` has something to read (or is closed)."""
    loop = asyncio.get_running_loop()
    ready = loop.create_future()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    loop.add_reader(conn.fileno(), wake)
    try:
        await ready
    finally:
        loop.remove_reader(conn.fileno())


async def _read_request(
    conn: socket.socket, fds: list[int], on_passed: Callable[[], None] = lambda: None
) -> bytes:
    """The request line without its newline, or, when none came within the limit, those bytes
    (too long: the caller refuses them). Descriptors passed with it (``SCM_RIGHTS``) are appended
    to ``fds`` as they come, close-on-exec, for the caller to close. The limit is
    ``MAX_REQUEST_BYTES``, or ``MAX_REGISTER_BYTES`` once descriptors came (a registration
    passes its first ones with its first bytes): a peer that passes none is held to a short
    line."""
    buf = b""
    while b"\n" not in buf:
        limit = MAX_REGISTER_BYTES if fds else MAX_REQUEST_BYTES
        if len(buf) >= limit:
            return buf[:limit]
        try:
            # Never past the short limit before a descriptor came: the rest stays unread.
            data, ancillary, flags, _ = conn.recvmsg(
                limit - len(buf), _REGISTER_FDS_SPACE, socket.MSG_CMSG_CLOEXEC
            )
        except BlockingIOError:
            await _readable(conn)
            continue
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.extend(array.array("i", payload[: len(payload) - len(payload) % 4]))
                on_passed()
        if flags & socket.MSG_CTRUNC or len(fds) > MAX_REGISTER_FDS:
            raise _TooManyDescriptors
        if fds and in_reserve(max(fds)):
            raise _TooManyDescriptors  # the table is nearly full: keep the rest for the service
        if not data:
            raise ConnectionAbortedError("the peer closed the connection without a request")
        buf += data
    return buf.partition(b"\n")[0]


def _parse_request(line: bytes) -> dict[str, Any] | None:
    """``{"token", "namespace"}`` of a request line (and ``register_kv_cache``, an object, when
    it has one), or None when it is not a valid one."""
    try:
        body: Any = json.loads(line)
    except ValueError:  # JSONDecodeError and UnicodeDecodeError
        return None
    if not isinstance(body, dict):
        return None
    request = {"token": body.get("token"), "namespace": body.get("namespace")}
    if not all(value is None or isinstance(value, str) for value in request.values()):
        return None
    if "register_kv_cache" in body:
        if not isinstance(body["register_kv_cache"], dict):
            return None
        request["register_kv_cache"] = body["register_kv_cache"]
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


def _refuse(
    conn: socket.socket, reason: str, peer: dict[str, int], message: str | None = None
) -> None:
    """Answer a refusal line (best effort: the peer may be gone) and log it (the reason only)."""
    log.warning("pool request refused: %s", reason, extra={"fields": {**peer, "reason": reason}})
    body: dict[str, str] = {"error": reason}
    if message is not None:
        body["message"] = message
    _send_line(conn, body, peer, quiet=True)


def _send_line(
    conn: socket.socket, body: dict[str, Any], peer: dict[str, int], *, quiet: bool = False
) -> None:
    """Send one JSON line (best effort: the peer may be gone). An answer is small and the
    socket's send buffer fresh: it is written whole or the peer is dropped, never waited on."""
    line = json.dumps(body, separators=(",", ":")).encode() + b"\n"
    try:
        sent = conn.send(line, socket.MSG_NOSIGNAL | socket.MSG_DONTWAIT)
    except OSError as exc:
        if not quiet:
            log.info("pool socket answer not sent: %s", exc, extra={"fields": peer})
        return
    if sent != len(line) and not quiet:
        log.info("pool socket answer cut short", extra={"fields": {**peer, "sent": sent}})


def _peer(conn: socket.socket) -> dict[str, int]:
    """The connecting process (pid 0 when it lives in a PID namespace this one cannot see)."""
    try:
        pid, uid, gid = _PEERCRED.unpack(
            conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
        )
    except OSError:
        return {}
    return {"peer_pid": pid, "peer_uid": uid, "peer_gid": gid}
