"""Connection bounds of the HTTP listeners: silent or slow clients, and too many connections.

uvicorn (httptools) closes a kept-alive connection left idle between requests after its
``timeout_keep_alive`` (5 s), and bounds nothing else: a connection that never sends a byte,
one that stops half way through its request head, or one that trickles its body, stays open as
long as its client likes, each holding a descriptor of the process. Enough of them (a
slowloris) take every descriptor, and with them the admin listener and the pool socket too.

One ``ConnectionGuard`` per listener (``engine``: TCP and the Unix socket together; ``admin``)
bounds its connections:

- **head timeout**: a request head (request line and headers) must be complete
  ``head_timeout_s`` after its first byte; a new connection's first head, ``head_timeout_s``
  after the connection opened (a silent connection is closed then). Bytes trickling in do not
  extend it: the bound is on the whole head.
- **body timeout**: the whole request, body included, must be complete ``body_timeout_s``
  after the same start. While the app works on the answer nothing is bounded here (a long-poll
  may take its time); between requests uvicorn's keep-alive timeout applies.
- **per-peer cap** (``max_per_peer``, 0: none): connections open at once from one peer: the
  remote IP on TCP (an IPv6 peer's /64, what one host is usually given; an IPv4-mapped address
  is its IPv4 address), the peer's uid on a Unix socket (``SO_PEERCRED``). On loopback every
  local TCP client is the one peer ``127.0.0.1``.
- **listener cap** (``max_connections``): connections open at once in all. The engine
  listener's default leaves the descriptors the process needs besides (``listener_limits``),
  so a flood of it never reaches the admin listener's share; an engine connection handed a
  descriptor in the process's reserve anyway (``app.descriptors.in_reserve``: the table filled
  by something else) is refused as over the listener's cap too.

A connection past a cap is closed the moment it is accepted, before anything is read from it,
rather than answered 503: an answer needs the request head first (an HTTP client does not read
an answer to a request it has not sent yet), and waiting for the head is holding the descriptor
the cap is there to free, for as long as the client likes to send it. A refused client sees its
connection closed and may retry; the refusal is counted (``kvoffload_connections_closed_total``
by reason) and logged.

The admin listener (``evict_waiting``) closes another connection instead, when it can: past a
cap, the oldest connection under that cap that is waiting on its client (its request head or
body not complete, or idle between requests; never one the app is answering) is closed for the
new one, counted under the same reason; only when there is none is the new one closed. What the
pool socket does with its waiting connections, and for the same reason: on loopback every
local user is the one peer ``127.0.0.1``, and a local user without the token could otherwise
keep every slot filled with silent connections (reopened as fast as the head bound closes them)
and the operator's calls would find none. The operator's connection sends its request at once
and is answered, so a flood of connections that never complete a request evicts only its own.
On Linux the kernel holds the admin listener's new connections until their first bytes arrive
(``TCP_DEFER_ACCEPT`` for the head bound, ``app.server.defer_accept``): silent ones take no
slot until then, and the operator's connection is accepted with its request in its socket.
Until the loop reads it, a connection with bytes unread (``FIONREAD``) is passed over while
another can go; once read, a request sent whole is complete and being answered. Before that,
CI lost one call in 30: on a loaded host the operator's connection was accepted before its
request came, and more of the flood's reopened silent connections than the peer's cap landed
after it. A flood connection gains nothing by sending bytes: they are read on the loop's next
turn. Only when every waiting connection has bytes unread is the oldest of them closed.

Timeouts are enforced by one sweep per listener, a few times per bound (``sweep_interval``),
not by a timer per request: a request pays one clock read and three attribute writes, a timer
would cost its creation and its cancellation on every call. A connection is closed between its
bound and its bound plus one sweep interval. The sweep also writes the log lines: at most one
per interval (``LOG_INTERVAL_S``) and reason, with the count of connections closed since the
last one and the last peer, never a line per connection.
"""

from __future__ import annotations

import asyncio
import fcntl
import ipaddress
import socket
import struct
import termios
from collections.abc import Iterable
from dataclasses import dataclass
from typing import ClassVar

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from app.descriptors import RESERVE, in_reserve, limit
from app.settings import Settings, config_error, setting_names
from app.telemetry.logging import get_logger
from app.telemetry.metrics import CONNECTION_CLOSE_REASONS, ListenerConnections

log = get_logger("connections")

LOG_INTERVAL_S = 10.0
"""At most one log line per reason and listener this often."""
# Where a connection is in its current request: nothing unread is bounded (IDLE: between
# requests, or the app answering), else since ``guard_since``.
IDLE, HEAD, BODY = 0, 1, 2
_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
_INT = struct.Struct("i")  # FIONREAD's answer
_ZERO = bytes(_INT.size)
_SO_PEERCRED: int | None = getattr(socket, "SO_PEERCRED", None)


@dataclass(frozen=True)
class ConnectionLimits:
    """One listener's bounds (see the module docstring); ``max_per_peer`` 0: no per-peer cap."""

    head_timeout_s: float
    body_timeout_s: float
    max_connections: int
    max_per_peer: int = 0
    # Whether an accepted descriptor in the process's reserve is refused (the engine listener:
    # yes; the admin listener is what the reserve is kept for).
    spare_reserve: bool = False
    # Past a cap, close the oldest connection waiting on its client instead of the new one
    # (the admin listener; see the module docstring).
    evict_waiting: bool = False

    @property
    def sweep_interval(self) -> float:
        """How often the bounds are checked: a quarter of the shorter bound, 50 ms to 1 s."""
        return min(1.0, max(0.05, min(self.head_timeout_s, self.body_timeout_s) / 4))


def descriptor_reserve(soft: int) -> int:
    """Descriptors of a process whose limit is ``soft`` kept from both listeners: for the pool
    and its socket, registered caches, disk files, logs; ``app.descriptors.RESERVE`` at least,
    an eighth of the table with a large one (registrations and the pool socket's waiting
    connections grow with the load as connections do)."""
    return max(RESERVE, soft // 8)


def listener_limits(settings: Settings, soft: int | None = None) -> dict[str, ConnectionLimits]:
    """Each listener's bounds from ``settings``, its caps sized against the descriptor limit
    ``soft`` (default: the soft ``RLIMIT_NOFILE`` now, raised at start by
    ``app.descriptors.raise_limit``): the engine listener's cap, unless set, is what is left
    of the table after ``descriptor_reserve`` and the admin listener's cap.

    ``ConfigError`` naming the setting when the caps set do not fit the table (or nothing is
    left for the engine listener): past them, a flood would take the admin listener's
    descriptors and the process's own."""
    soft = limit() if soft is None else soft
    reserve = descriptor_reserve(soft)
    admin = settings.admin_max_connections
    table = f"RLIMIT_NOFILE is {soft}, {reserve} of them kept for the process"
    raise_it = "or a higher limit (ulimit -n; systemd LimitNOFILE=)"
    if admin > soft - reserve - 1:
        raise config_error(
            "admin_max_connections",
            admin,
            f"leaves no descriptor for the engine listener ({table}); accepted: at most "
            f"{max(1, soft - reserve - 1)}, {raise_it}",
        )
    room = soft - reserve - admin
    engine = settings.max_connections
    if engine is None:
        engine = room
    elif engine > room:
        raise config_error(
            "max_connections",
            engine,
            f"more than the descriptors left for the engine listener ({table}, "
            f"{admin} for the admin listener: {setting_names('admin_max_connections')}); "
            f"accepted: at most {room}, {raise_it}",
        )
    head, body = settings.head_timeout_s, settings.body_timeout_s
    return {
        "engine": ConnectionLimits(
            head, body, engine, settings.max_connections_per_peer, spare_reserve=True
        ),
        "admin": ConnectionLimits(
            head, body, admin, settings.admin_max_connections_per_peer, evict_waiting=True
        ),
    }


def peer_of(transport: asyncio.BaseTransport) -> str:
    """Who a connection comes from, as the per-peer cap counts it: the remote IP (an IPv6
    peer's /64 as ``2001:db8:1:2::/64``, an IPv4-mapped one as its IPv4 address), or
    ``uid:N`` on a Unix socket (``unix`` where the uid cannot be read)."""
    sock = transport.get_extra_info("socket")
    family = getattr(sock, "family", None)
    if family == socket.AF_UNIX:
        if _SO_PEERCRED is None:
            return "unix"
        try:
            _pid, uid, _gid = _UCRED.unpack(
                sock.getsockopt(socket.SOL_SOCKET, _SO_PEERCRED, _UCRED.size)
            )
        except OSError:
            return "unix"
        return f"uid:{uid}"
    peername = transport.get_extra_info("peername")
    host = str(peername[0]) if peername else "unknown"
    if family == socket.AF_INET6:
        return ipv6_peer(host)
    return host


def ipv6_peer(host: str) -> str:
    """The per-peer key of an IPv6 address: its /64 (``::1`` stays ``::1``), an IPv4-mapped
    address's IPv4 address; the text itself when it does not parse."""
    try:
        addr = ipaddress.IPv6Address(host.split("%", 1)[0])
    except ValueError:
        return host
    if addr.ipv4_mapped is not None:
        return str(addr.ipv4_mapped)
    if addr.is_loopback:
        return str(addr)
    return str(ipaddress.IPv6Network((int(addr) >> 64 << 64, 64)))


class GuardedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol under a listener's ``ConnectionGuard`` (``guard``, set on
    the subclass ``ConnectionGuard.protocol`` makes).

    A connection the guard refuses is closed in ``connection_made`` without uvicorn ever
    seeing it (not among the server's connections). Otherwise each request marks where it is
    (``guard_phase``: head, body, idle) and since when (``guard_since``) for the sweep."""

    guard: ClassVar[ConnectionGuard]
    # Class defaults: a refused connection keeps guard_peer None.
    guard_peer: str | None = None
    guard_phase: int = IDLE
    guard_since: float = 0.0

    def guard_waiting(self) -> bool:
        """Whether the connection waits on its client: its request not complete, or idle
        between requests (uvicorn's keep-alive timer armed). False while the app answers."""
        return self.guard_phase != IDLE or self.timeout_keep_alive_task is not None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        peer = self.guard.admit(self, transport)
        if peer is None:
            transport.abort()  # nothing to flush: the descriptor is free at once
            return
        self.guard_peer = peer
        # The first head is bounded from the connection's start: silence counts.
        self.guard_phase = HEAD
        self.guard_since = self.loop.time()
        super().connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.guard_peer is None:
            return  # refused in connection_made: nothing of uvicorn's to undo
        self.guard.release(self)
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        # A request's first byte. A connection's first request keeps the connection's start.
        if self.guard_phase == IDLE:
            self.guard_since = self.loop.time()
        self.guard_phase = HEAD
        HttpToolsProtocol.on_message_begin(self)  # no super object per request

    def on_headers_complete(self) -> None:
        self.guard_phase = BODY
        HttpToolsProtocol.on_headers_complete(self)

    def on_message_complete(self) -> None:
        self.guard_phase = IDLE
        HttpToolsProtocol.on_message_complete(self)


class ConnectionGuard:
    """The bounds of one listener (``listener``: ``engine`` or ``admin``): who may connect,
    and the sweep that closes connections past their time. Single-threaded: the event loop's.

    ``protocol`` is the uvicorn protocol class to serve the listener with; ``start`` (on the
    running loop, in the listener's logging context) and ``stop`` run the sweep; ``counts`` is
    what the metrics read."""

    def __init__(
        self, listener: str, limits: ConnectionLimits, *, log_interval_s: float = LOG_INTERVAL_S
    ) -> None:
        self.listener = listener
        self.limits = limits
        self.log_interval_s = log_interval_s
        self.open: set[GuardedProtocol] = set()
        self.peers: dict[str, int] = {}
        self.closed: dict[str, int] = dict.fromkeys(CONNECTION_CLOSE_REASONS, 0)
        # Closed since the last log line, by reason, and the last peer of each.
        self._unlogged: dict[str, int] = {}
        self._last_peer: dict[str, str] = {}
        self._next_log = 0.0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sweeper: asyncio.TimerHandle | None = None
        self._due = 0.0  # loop time the next sweep is due
        self.protocol = _protocol_for(self)

    # --- admission -------------------------------------------------------------------------

    def admit(self, conn: GuardedProtocol, transport: asyncio.BaseTransport) -> str | None:
        """The peer of a connection just accepted, now counted open; None when a cap refuses
        it (counted as closed; the caller closes it)."""
        peer = peer_of(transport)
        limits = self.limits
        per_peer = limits.max_per_peer
        if per_peer and self.peers.get(peer, 0) >= per_peer and not self._evict("peer_cap", peer):
            self._count("peer_cap", peer)
            return None
        if limits.spare_reserve and self._in_reserve(transport):
            self._count("listener_cap", peer)
            return None
        if len(self.open) >= limits.max_connections and not self._evict("listener_cap", None):
            self._count("listener_cap", peer)
            return None
        if per_peer:
            self.peers[peer] = self.peers.get(peer, 0) + 1
        self.open.add(conn)
        return peer

    @staticmethod
    def _in_reserve(transport: asyncio.BaseTransport) -> bool:
        sock = transport.get_extra_info("socket")
        return sock is not None and in_reserve(sock.fileno())

    def _evict(self, reason: str, peer: str | None) -> bool:
        """With ``evict_waiting``, close the oldest open connection waiting on its client (of
        ``peer``; of anyone when None) to make room, counted under ``reason``; whether one was.
        """
        if not self.limits.evict_waiting:
            return False
        waiting = [
            conn
            for conn in self.open
            if (peer is None or conn.guard_peer == peer) and conn.guard_waiting()
        ]
        if not waiting:
            return False
        waiting.sort(key=_since)
        # The oldest with nothing unread: a request already in its socket is about to be read.
        oldest = next((conn for conn in waiting if not _unread(conn.transport)), waiting[0])
        self._count(reason, oldest.guard_peer)
        # Forgotten now, not when its close reaches connection_lost: the room is the new one's.
        self.release(oldest)
        oldest.transport.abort()
        return True

    def release(self, conn: GuardedProtocol) -> None:
        """Forget a connection ``admit`` let in, once it is closed (or evicted); once."""
        if conn not in self.open:
            return  # evicted: forgotten then
        self.open.remove(conn)
        peer = conn.guard_peer
        if self.limits.max_per_peer and peer is not None:
            left = self.peers.get(peer, 0) - 1
            if left > 0:
                self.peers[peer] = left
            else:
                self.peers.pop(peer, None)

    def _count(self, reason: str, peer: str | None) -> None:
        self.closed[reason] += 1
        self._unlogged[reason] = self._unlogged.get(reason, 0) + 1
        if peer is not None:
            self._last_peer[reason] = peer

    # --- the sweep -------------------------------------------------------------------------

    def start(self) -> None:
        """Start the sweep on the running loop. Call it in the listener's own context
        (``bind_listener``): its log lines then say which listener they are about."""
        self._loop = asyncio.get_running_loop()
        self._schedule()

    def _schedule(self) -> None:
        assert self._loop is not None
        self._due = self._loop.time() + self.limits.sweep_interval
        self._sweeper = self._loop.call_later(self.limits.sweep_interval, self._sweep)

    def stop(self) -> None:
        """Stop the sweep and write what is not logged yet."""
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        self._write_log()

    def expired(self, now: float) -> list[tuple[GuardedProtocol, str]]:
        """The open connections past a bound at loop time ``now``, with the reason."""
        head_s, body_s = self.limits.head_timeout_s, self.limits.body_timeout_s
        found = []
        for conn in self.open:
            phase = conn.guard_phase
            if phase == HEAD:
                if now - conn.guard_since > head_s:
                    found.append((conn, "head_timeout"))
            elif phase == BODY and now - conn.guard_since > body_s:
                found.append((conn, "body_timeout"))
        return found

    def _sweep(self) -> None:
        assert self._loop is not None
        try:
            now = self._loop.time()
            # A sweep a whole interval late means the loop was stalled: the loop runs due
            # timers before it reads sockets, so heads that arrived meanwhile are still unread.
            # Closing nothing this time lets them be read first.
            stalled = now - self._due > self.limits.sweep_interval
            for conn, reason in [] if stalled else self.expired(now):
                conn.guard_phase = IDLE  # closed once, counted once
                self._count(reason, conn.guard_peer)
                # abort, not close: a client that reads nothing cannot keep the descriptor
                # by leaving answers of earlier requests unflushed.
                conn.transport.abort()
            if self._unlogged and now >= self._next_log:
                self._write_log()
                self._next_log = now + self.log_interval_s
        finally:
            self._schedule()

    def _write_log(self) -> None:
        for reason, count in self._unlogged.items():
            log.warning(
                "connections closed",
                extra={
                    "fields": {
                        "listener": self.listener,
                        "reason": reason,
                        "count": count,
                        "last_peer": self._last_peer.get(reason, ""),
                        "open": len(self.open),
                        "max_connections": self.limits.max_connections,
                    }
                },
            )
        self._unlogged.clear()

    # --- metrics ---------------------------------------------------------------------------

    def counts(self) -> ListenerConnections:
        """This listener's connections for the metrics (``register_connections``)."""
        return ListenerConnections(
            self.listener, len(self.open), self.limits.max_connections, dict(self.closed)
        )


def _since(conn: GuardedProtocol) -> float:
    return conn.guard_since


def _unread(transport: asyncio.BaseTransport) -> bool:
    """Whether the connection's socket holds bytes the loop has not read yet (False where it
    cannot tell)."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return False
    try:
        return bool(_INT.unpack(fcntl.ioctl(sock.fileno(), termios.FIONREAD, _ZERO))[0])
    except OSError:
        return False


def _protocol_for(guard: ConnectionGuard) -> type[GuardedProtocol]:
    """A ``GuardedProtocol`` subclass under ``guard`` (uvicorn makes each connection's protocol
    from a class alone)."""

    class Protocol(GuardedProtocol):
        pass

    Protocol.guard = guard
    Protocol.__name__ = Protocol.__qualname__ = f"{guard.listener.capitalize()}Protocol"
    return Protocol


def guards_counts(guards: Iterable[ConnectionGuard]) -> list[ListenerConnections]:
    """``counts`` of each guard, for ``register_connections``."""
    return [guard.counts() for guard in guards]
