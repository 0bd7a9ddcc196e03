"""``kvoffload serve``: one process, one event loop, two listeners on one ``Service``.

The engine API (TCP ``host:port``, plus the Unix socket ``uds`` when set) and the admin API
(``admin_host:admin_port``) are two ``uvicorn.Server`` instances gathered on one uvloop loop,
with httptools and no access log (the service's call hook writes one canonical line per call).
uvicorn gets no log configuration and no level of its own: its records go through the root
handler ``app.telemetry.logging.configure_logging`` installed, at the level set there (and
changed live).
The sockets are bound here, before anything starts, so a busy port fails fast and port 0 works
(the ``listening`` log line names the real ports). What the machine lacks (checked first) and
an address that cannot be listened on are refused as a ``ConfigError`` naming the setting
(``--port / KVOFFLOAD_PORT = 8000: 127.0.0.1:8000 is already in use (engine listener) ...``).
Each listener's task binds its name for logging (``bind_listener``), so uvicorn's lines, written
once per listener, say which listener they are about.

Each listener serves its connections under a ``ConnectionGuard`` (``app.http.connections``):
a request head must be complete within ``head_timeout_s`` (a silent connection is closed then),
its body within ``body_timeout_s``; the engine listener holds at most
``max_connections_per_peer`` connections of one peer and ``max_connections`` in all, sized
against the descriptor limit so that a flood of it leaves the admin listener its
``admin_max_connections`` and the process its own descriptors. The caps are checked before
anything is bound (``ConfigError`` naming the setting); their metrics join the engine app's
``/metrics``.

The pool socket (``Settings.effective_pool_socket``: ``pool_socket``, by default the engine
socket's path plus ``.pool``) hands engines the pool's descriptor (``app.pool_share``) while the
service runs, on the same loop; it stops before the service frees the pool, and its file is
removed at exit like the engine socket's. Both Unix sockets get the file mode ``uds_mode``
(owner only by default) and, with ``uds_group``, that group: who may connect to them.

Shutdown: the first SIGTERM/SIGINT marks the service not ready (``/readyz`` 503), waits
``shutdown_delay_s`` (time for a load balancer to notice), then stops both listeners, which let
calls in flight finish (up to ``shutdown_grace_s``); the service then stops the transfer worker
and frees the pool. A second SIGINT forces the exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import gc
import grp
import math
import os
import signal
import socket
import stat
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import uvicorn
from kvoffload_client.pool_socket import SharedPool

from app.core.handles import check_registration
from app.core.kv_publisher import BlockMetadata, KVEventPublisher
from app.core.service import Service
from app.core.tenancy import Tenancy
from app.core.tenants import Credentials
from app.core.transfers import check_machine
from app.descriptors import raise_limit
from app.http.apps import create_admin_app, create_app
from app.http.connections import ConnectionGuard, guards_counts, listener_limits
from app.http.errors import error_for
from app.pool_share import PoolShareServer
from app.settings import Settings, config_error
from app.telemetry.calls import host_port
from app.telemetry.logging import bind_listener, get_logger
from app.telemetry.metrics import register_connections, register_kv_events
from transfer import HostPool
from transfer.disk_files import DiskError, open_checked_dir

log = get_logger("server")

#: The collector's youngest generation, in net allocations of tracked objects (CPython's
#: default is 700). A large call keeps lists of thousands of keys alive while it runs, and
#: every young pass walks each of their items (12 lists of 8,192 keys: about 3.5 ms here);
#: passes ten times rarer are ten times fewer such stalls for every other caller, while
#: what a pass frees waits at most this many allocations longer.
GC_YOUNG_OBJECTS = 10_000


class Listener(uvicorn.Server):
    """A uvicorn server that leaves signal handling to the process (two servers, one loop)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def bind_tcp(host: str, port: int) -> socket.socket:
    """A listening-ready TCP socket on ``host:port`` (IPv6 literals allowed)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except BaseException:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


SOCKET_DIR_HARM = (
    "put a socket of their own in the service's place and take the next engine's token and "
    "namespace"
)


class SocketGroupError(OSError):
    """The socket could not be given to ``uds_group`` (``bind_unix`` removed it again)."""


def bind_unix(path: Path, mode: int = 0o600, gid: int | None = None) -> socket.socket:
    """A Unix stream socket at ``path`` with file ``mode`` (and group ``gid``); a stale socket
    file left by a dead process is replaced.

    The socket's directory is checked as ``--disk-dir`` is
    (``transfer.disk_files.open_checked_dir``: ``DiskError`` when someone but root and the service's
    user could write it or a level above it), since whoever can write it could swap the socket for
    their own. A path that exists and is not a socket (a symbolic link included) is never removed.
    The mode and group are set through a descriptor of the name opened without following a symbolic
    link, never through the path (``_set_mode``). Nobody can connect before the socket listens, so
    its mode and group are in place before anyone can. ``SocketGroupError`` when ``gid`` cannot be
    given.
    """
    directory = open_checked_dir(os.path.dirname(os.path.abspath(path)), harm=SOCKET_DIR_HARM)
    name = os.path.basename(path)
    try:
        try:
            found = os.stat(name, dir_fd=directory, follow_symlinks=False)
        except FileNotFoundError:
            found = None
        if found is not None:
            if not stat.S_ISSOCK(found.st_mode):
                raise OSError(f"{path} exists and is not a socket")
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.connect(str(path))
            except OSError:
                os.unlink(name, dir_fd=directory)  # nobody listens: stale
            else:
                raise OSError(f"{path} is in use by another process")
            finally:
                probe.close()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(str(path))
            _set_mode(directory, name, path, mode, gid)
        except BaseException:
            sock.close()
            raise
        return sock
    finally:
        os.close(directory)


def _set_mode(directory: int, name: str, path: Path, mode: int, gid: int | None) -> None:
    """chmod (and chown to ``gid``) the socket ``name`` just bound in ``directory``, through an
    ``O_PATH | O_NOFOLLOW`` descriptor of it: a symbolic link planted in its place is refused,
    never followed. ``SocketGroupError`` (the socket removed) when ``gid`` cannot be given."""
    fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=directory)
    try:
        if not stat.S_ISSOCK(os.fstat(fd).st_mode):
            raise OSError(f"{path} was replaced by something that is not a socket")
        # chmod and chown have no descriptor form for an O_PATH descriptor: its /proc link
        # names exactly the inode it holds.
        held = f"/proc/self/fd/{fd}"
        os.chmod(held, mode)
        if gid is not None:
            try:
                os.chown(held, -1, gid)
            except OSError as exc:
                os.unlink(name, dir_fd=directory)  # ours: bound a moment ago
                raise SocketGroupError(exc.errno, exc.strerror) from None
    finally:
        os.close(fd)


def listen_tcp(settings: Settings, listener: str) -> socket.socket:
    """``bind_tcp`` on the ``engine`` or ``admin`` listener's address; ``ConfigError`` naming
    the host or port setting when it cannot be bound."""
    prefix = "admin_" if listener == "admin" else ""
    host: str = getattr(settings, f"{prefix}host")
    port: int = getattr(settings, f"{prefix}port")
    try:
        sock = bind_tcp(host, port)
    except OSError as exc:
        where = host_port(host, port)
        if exc.errno == errno.EADDRINUSE:
            reason = f"{where} is already in use ({listener} listener); accepted: a free port, "
            raise config_error(f"{prefix}port", port, reason + "or 0 for any") from None
        if exc.errno == errno.EACCES:
            reason = f"not allowed to listen on {where} ({listener} listener); accepted: a port "
            raise config_error(f"{prefix}port", port, reason + "above 1023, or 0 for any") from None
        why = exc.strerror or str(exc)
        raise config_error(
            f"{prefix}host",
            host,
            f"cannot listen on {where} ({listener} listener: {why}); accepted: an address of "
            "this machine (127.0.0.1, ::1, 0.0.0.0, ...)",
        ) from None
    if listener == "admin":
        defer_accept(sock, settings.head_timeout_s)
    return sock


def defer_accept(sock: socket.socket, seconds: float) -> None:
    """Have the kernel hand a connection of ``sock`` to the service only once its first bytes
    arrived, or ``seconds`` (rounded up) after its handshake (Linux ``TCP_DEFER_ACCEPT``; a
    no-op elsewhere). A connection that stays silent is held by the kernel, not the service:
    it takes no slot under the admin listener's caps, so silent connections reopened as fast
    as they are closed cannot evict the operator's connection before its request is read
    (``app.http.connections``)."""
    option = getattr(socket, "TCP_DEFER_ACCEPT", None)
    if option is not None:
        sock.setsockopt(socket.IPPROTO_TCP, option, max(1, math.ceil(seconds)))


def socket_group(settings: Settings) -> int | None:
    """The gid of ``uds_group`` (a group name or a number); ``ConfigError`` naming the setting
    when this machine has no such group."""
    name = settings.uds_group
    if name is None:
        return None
    if name.isdigit():
        return int(name)
    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        raise config_error(
            "uds_group", name, "no such group on this machine; accepted: a group name or a gid"
        ) from None


def listen_unix(settings: Settings, path: Path, field: str, listener: str) -> socket.socket:
    """``bind_unix`` for the setting ``field`` (``uds``, ``pool_socket``) with ``uds_mode`` and
    ``uds_group``; ``ConfigError`` naming the setting that does not work out."""
    gid = socket_group(settings)
    try:
        return bind_unix(path, settings.uds_mode, gid)
    except DiskError as exc:
        raise config_error(
            field,
            path,
            f"{exc}; accepted: a socket in a directory that only root and the service's user "
            "can write",
        ) from None
    except SocketGroupError as exc:
        raise config_error(
            "uds_group",
            settings.uds_group,
            f"cannot give {path} to it ({exc.strerror}); accepted: a group of the "
            "service's user (or any, as root)",
        ) from None
    except OSError as exc:
        why = exc.strerror or str(exc)
        raise config_error(
            field,
            path,
            f"cannot listen there ({listener}: {why}); accepted: a path no process listens on, "
            "in a writable directory, under 108 bytes",
        ) from None


def uvicorn_config(
    app: Any,
    *,
    graceful_shutdown_s: float = 1.0,
    protocol: type[asyncio.Protocol] | None = None,
) -> uvicorn.Config:
    """The uvicorn configuration of every listener (also the benchmarks' floor servers).

    Our own loop, httptools (``protocol``: a subclass of uvicorn's httptools protocol, the
    listener's ``ConnectionGuard.protocol``), no websockets, no access log (the service writes
    one canonical line per call), uvicorn leaves logging alone, and no ``Server`` or proxy
    headers.
    """
    return uvicorn.Config(
        app,
        loop="none",
        http="httptools" if protocol is None else protocol,
        ws="none",
        lifespan="on",
        access_log=False,
        log_config=None,
        log_level=None,
        server_header=False,
        proxy_headers=False,
        timeout_graceful_shutdown=max(1, round(graceful_shutdown_s)),
    )


def shared_pool(pool: HostPool) -> SharedPool:
    """What the pool socket hands out for ``pool``: its layout and its own descriptor."""
    return SharedPool(
        fd=pool.fd, pool_id=pool.pool_id, num_blocks=pool.num_blocks, block_bytes=pool.block_bytes
    )


def pool_of(tenancy: Tenancy, ask: Mapping[str, Any] | None) -> SharedPool:
    """The pool the pool socket hands to a caller: without tenants, the one pool (``ask`` is
    None); with them, the pool of the namespace the caller's token and ``namespace`` lead to
    (``Tenancy.resolve``; its refusals carry a ``reason``). With ``--uds-auth file-mode`` the
    socket's file mode is the credential here too, as on the engine socket beside it."""
    if ask is None:
        assert tenancy.single is not None
        return shared_pool(tenancy.single.transfers().pool)
    token, namespace = ask.get("token"), ask.get("namespace")
    authorization = f"Bearer {token}" if isinstance(token, str) else None
    trusted = tenancy.settings.uds_auth == "file-mode"
    space = tenancy.resolve(
        authorization, namespace if isinstance(namespace, str) else None, trusted=trusted
    )
    return shared_pool(space.service.transfers().pool)


class SocketRefusal(Exception):
    """A refusal the pool socket answers: ``reason`` (the HTTP API's error code for the same
    refusal) and ``public_message`` (its message, for a caller that proved who it is)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(reason)
        self.reason = reason
        self.public_message = message


def register_over_socket(
    tenancy: Tenancy, ask: Mapping[str, Any], fds: list[int]
) -> dict[str, Any]:
    """A registration that came over the pool socket with its descriptors ``fds``: run in the
    namespace the caller's token and ``namespace`` lead to, as ``POST /v1/kv-caches`` would
    (the same rule on named handles: ``app.core.handles``), answered as that route answers.

    Credentials refused: their reason only (as ``pool_of``). Once the caller is known, a
    refusal carries the route's code and message (``SocketRefusal``): every file it can be
    about came as one of the caller's own descriptors."""
    token, namespace = ask.get("token"), ask.get("namespace")
    authorization = f"Bearer {token}" if isinstance(token, str) else None
    trusted = tenancy.settings.uds_auth == "file-mode"
    space = tenancy.resolve(
        authorization, namespace if isinstance(namespace, str) else None, trusted=trusted
    )
    spec = ask["register_kv_cache"]
    try:
        check_registration(
            spec, tenants=tenancy.enabled, trusted=tenancy.settings.registration_by_name
        )
        cache = space.service.transfers().register_cache(spec, fds)
    except Exception as exc:
        err = error_for(exc)
        if err.status >= 500 and err.code == "internal":
            log.error("registration over the pool socket failed", exc_info=exc)
        raise SocketRefusal(err.code, err.message) from None
    return {
        "cache_id": cache.cache_id,
        "name": cache.name,
        "block_bytes": cache.block_bytes,
        "num_blocks": cache.num_blocks,
        "device": str(cache.device),
    }


def _address(sock: socket.socket) -> str:
    name = sock.getsockname()
    if sock.family == socket.AF_UNIX:
        return f"unix:{name}"
    return f"http://{host_port(name[0], name[1])}"


class TransferBackendFailed(RuntimeError):
    """The transfer backend cannot copy any more (a sticky CUDA error): restart the process."""


@dataclass
class Sockets:
    """The listening sockets the settings ask for: the engine API's (TCP, and the Unix socket
    with ``--uds``), the admin API's and the pool socket. ``close`` closes them all and removes
    the socket files made here."""

    engine: list[socket.socket] = field(default_factory=list)
    admin: list[socket.socket] = field(default_factory=list)
    pool: list[socket.socket] = field(default_factory=list)
    files: list[Path] = field(default_factory=list)

    @classmethod
    def bind(cls, settings: Settings) -> Sockets:
        """Bind every listener (``ConfigError`` naming an address that cannot be listened on;
        what was bound by then is closed again)."""
        made = cls()
        try:
            made.engine.append(listen_tcp(settings, "engine"))
            if settings.uds is not None:
                made.engine.append(listen_unix(settings, settings.uds, "uds", "engine listener"))
                made.files.append(settings.uds)
            pool_path = settings.effective_pool_socket
            if pool_path is not None:
                made.pool.append(listen_unix(settings, pool_path, "pool_socket", "pool socket"))
                made.files.append(pool_path)
            made.admin.append(listen_tcp(settings, "admin"))
        except BaseException:
            made.close()
            raise
        return made

    def addresses(self) -> dict[str, list[str]]:
        return {
            "engine": [_address(s) for s in self.engine],
            "admin": [_address(s) for s in self.admin],
            "pool": [_address(s) for s in self.pool],
        }

    def close(self) -> None:
        for sock in (*self.engine, *self.admin, *self.pool):
            sock.close()
        for path in self.files:  # ours: made by bind
            with contextlib.suppress(FileNotFoundError):
                path.unlink()


class Stopper:
    """How the listeners stop. SIGTERM or SIGINT: the services drain (not ready), and the
    listeners stop after ``shutdown_delay_s``; a second signal stops them at once (a second
    SIGINT without waiting for calls in flight). SIGHUP reloads the tenants. ``fail(reason)``:
    a poisoned CUDA context; drain and stop at once, ``failure`` keeps the reason."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)

    def __init__(self, servers: Sequence[Listener], tenancy: Tenancy, delay_s: float) -> None:
        self.servers = servers
        self.tenancy = tenancy
        self.delay_s = delay_s
        self.stopping = False
        self.failure: str | None = None
        self._loop = asyncio.get_running_loop()

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._loop.add_signal_handler(sig, self._on_signal, sig)
        self._loop.add_signal_handler(signal.SIGHUP, self.tenancy.request_reload)

    def remove(self) -> None:
        for sig in self.SIGNALS:
            self._loop.remove_signal_handler(sig)

    def stop(self) -> None:
        for srv in self.servers:
            srv.should_exit = True

    def fail(self, reason: str) -> None:
        if self.failure is None:
            self.failure = reason
            self.tenancy.begin_drain()
            self.stop()

    def _on_signal(self, sig: signal.Signals) -> None:
        if self.stopping:
            if sig == signal.SIGINT:
                for srv in self.servers:
                    srv.force_exit = True
            self.stop()
            return
        self.stopping = True
        log.info("shutdown requested", extra={"fields": {"signal": sig.name}})
        self.tenancy.begin_drain()
        self._loop.call_later(self.delay_s, self.stop)


def pool_share_server(tenancy: Tenancy, sock: socket.socket) -> PoolShareServer:
    """The pool socket's server: open, or reading each request first with tenants."""
    if tenancy.enabled:
        return PoolShareServer(
            sock,
            lambda ask: pool_of(tenancy, ask),
            read_request=True,
            register=lambda ask, fds: register_over_socket(tenancy, ask, fds),
        )
    return PoolShareServer(sock, lambda: pool_of(tenancy, None))


async def serve(
    settings: Settings, *, on_ready: Callable[[dict[str, list[str]]], None] | None = None
) -> None:
    """Run both listeners until a signal (or a listener failing) stops them.

    ``ConfigError`` before anything starts when the settings ask for what the machine lacks
    (a device, room for the pool: ``check_machine``; connection caps the descriptor limit
    cannot hold: ``listener_limits``) or name an address that cannot be listened on (and when
    the pool cannot be made after all, as the service starts).
    """
    credentials = None if settings.tenants is None else Credentials(settings.tenants)
    # Before any Service exists: each builds its manager's tables for its blocks at once.
    table = None if credentials is None else credentials.table
    check_machine(settings.model_copy(update={"num_blocks": Tenancy.total_blocks(settings, table)}))
    # Sized against the descriptor limit in force now (raised by ``run`` before the loop).
    guards = {name: ConnectionGuard(name, lim) for name, lim in listener_limits(settings).items()}
    socks = Sockets.bind(settings)
    if settings.admin_token_value() is None:
        log.warning(
            "admin API has no token: open to local callers only",
            extra={"fields": {"admin_host": settings.admin_host}},
        )
    tenancy = Tenancy(settings, credentials=credentials)
    publisher = kv_event_publisher(settings, credentials)
    if tenancy.enabled and tenancy.front_registry is not None and settings.metrics_token is None:
        log.warning(
            "/metrics has no scrape token: with tenants it serves only the service-wide series "
            "(no tenant, namespace or request id); --metrics-token-file serves them all"
        )
    grace = settings.shutdown_grace_s
    public = Listener(
        uvicorn_config(
            create_app(settings, tenancy=tenancy),
            graceful_shutdown_s=grace,
            protocol=guards["engine"].protocol,
        )
    )
    admin = Listener(
        uvicorn_config(
            create_admin_app(settings, tenancy=tenancy),
            graceful_shutdown_s=grace,
            protocol=guards["admin"].protocol,
        )
    )
    # The process's connections: in the one service's registry, or with tenants the front
    # registry (no tenant labels: they belong to no namespace). None: metrics off.
    registry = tenancy.single.registry if tenancy.single is not None else tenancy.front_registry
    if registry is not None:
        register_connections(registry, lambda: guards_counts(guards.values()))
        if publisher is not None:
            register_kv_events(registry, publisher.counts)
    servers = (public, admin)
    stopper = Stopper(servers, tenancy, settings.shutdown_delay_s)
    stopper.install()
    pool_share = None if not socks.pool else pool_share_server(tenancy, socks.pool[0])
    # A poisoned CUDA context fails every later copy: stop, and exit non-zero
    # (TransferBackendFailed) for the supervisor to start a fresh process. Set before the
    # services start, and inherited by the namespaces a tenants reload adds.
    tenancy.set_on_fatal(stopper.fail)
    try:
        if publisher is not None:
            # Bound before the services start: each one's stream opens with its clear.
            publisher.start()
            tenancy.set_kv_events(
                lambda tenant, service: attach_kv_events(publisher, settings, tenant, service)
            )
            publisher.started()  # a namespace a tenants reload adds is new to the routers
        async with tenancy.running():
            if pool_share is not None:
                pool_share.start()
            tasks = [
                asyncio.create_task(
                    _listen("engine", public, socks.engine, guards["engine"]),
                    name="kvoffload-engine",
                ),
                asyncio.create_task(
                    _listen("admin", admin, socks.admin, guards["admin"]), name="kvoffload-admin"
                ),
            ]
            while not all(srv.started for srv in servers) and not any(t.done() for t in tasks):
                await asyncio.sleep(0.01)
            if all(srv.started for srv in servers):
                addresses = socks.addresses()
                log.info("listening", extra={"fields": addresses})
                # What exists now (torch, FastAPI, schemas) lives as long as the process;
                # frozen, the collector's full passes stop rescanning it between calls.
                gc.collect()
                gc.freeze()
                gc.set_threshold(GC_YOUNG_OBJECTS, *gc.get_threshold()[1:])
                if on_ready is not None:
                    on_ready(addresses)
            # One listener ending (a failure) takes the other down with it.
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            stopper.stop()
            results = await asyncio.gather(*tasks, return_exceptions=True)
            if pool_share is not None:
                # Before the service frees the pool: nobody receives a pool being closed.
                await pool_share.stop()
            # The backend's failure first: a listener that failed after it says less.
            if stopper.failure is not None:
                raise TransferBackendFailed(stopper.failure)
            for result in results:
                if isinstance(result, BaseException):
                    raise result
    finally:
        stopper.remove()
        if pool_share is not None:
            await pool_share.stop()
        if publisher is not None:
            publisher.close()
        socks.close()
        log.info("stopped")


def kv_event_publisher(
    settings: Settings, credentials: Credentials | None
) -> KVEventPublisher | None:
    """The KV-event publisher the settings ask for (None: off), not started; a ``ConfigError``
    when its extra is missing or ``kv_events_tenant`` names no tenant. Its ``ipc://`` sockets
    are owner-only when they carry more than one tenant's namespaces (the admin's view: the
    service's own user reads them), else their mode is ``uds_mode`` (and group ``uds_group``)."""
    if settings.kv_events_endpoint is None:
        return None
    mode = settings.uds_mode
    if credentials is not None:
        tenant = settings.kv_events_tenant
        if tenant is None:
            mode = 0o600
        elif tenant not in credentials.table.tenants:
            named = ", ".join(sorted(credentials.table.tenants))
            raise config_error(
                "kv_events_tenant",
                tenant,
                f"no such tenant in the tenants file; accepted: one it names ({named})",
            )
    return KVEventPublisher(settings, socket_mode=mode)


def attach_kv_events(
    publisher: KVEventPublisher, settings: Settings, tenant: str | None, service: Service
) -> None:
    """Give ``service`` (a namespace of ``tenant``) its sink on ``publisher``, unless the
    publisher serves another tenant's namespaces only (``kv_events_tenant``)."""
    if settings.kv_events_tenant is not None and tenant != settings.kv_events_tenant:
        return
    service.block_meta = BlockMetadata(settings.kv_events_metadata_blocks)
    service.on_events = publisher.sink(service.namespace, service.block_meta)


async def _listen(
    name: str, server: Listener, socks: list[socket.socket], guard: ConnectionGuard
) -> None:
    bind_listener(name)  # in this task's own context: uvicorn's lines about it say its name
    guard.start()  # its sweep's lines too
    try:
        await server.serve(sockets=socks)
    finally:
        guard.stop()


def run(settings: Settings) -> None:
    """Run ``serve`` on a fresh uvloop event loop until it returns (``ConfigError``: refused
    before serving, see ``serve``). The descriptor limit is raised first (``app.descriptors``)."""
    import uvloop

    raise_limit()
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(serve(settings))
