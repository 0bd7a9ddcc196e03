"""The pool socket, the engine's side: the host pool handed over a Unix socket, a descriptor,
not a path; and KV caches registered by passing their descriptors.

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
- **Registration** (tenant mode): the request line also holds ``"register_kv_cache": SPEC``
  (the body of ``POST /v1/kv-caches``) and comes with the KV cache files' descriptors
  (``SCM_RIGHTS``; ``{"kind": "shm", "fd": K}`` names the K-th). The answer is one line,
  ``{"kv_cache": {...}}`` or ``{"error": "<code>", "message": "..."}`` (the message only once
  the credentials were accepted: what it says is about the caller's own descriptors). Such a
  line may be up to ``MAX_REGISTER_BYTES`` long once a descriptor came with its first bytes,
  with at most ``MAX_REGISTER_FDS`` descriptors. Client: ``register_kv_cache``. This is how a
  service with tenants takes a KV cache: it maps a file the caller proved it holds, never a
  path it would open with its own rights. Each such file must be a memfd sealed against
  shrinking (``sealed_memfd`` makes one): the service copies from and to it, and a file its
  holder could shrink would fault those copies.

The answer is one line of JSON, ``PROTOCOL`` plus the layout (``pool_id``, ``num_blocks``,
``block_bytes``, ``offset``: byte offset of block 0 in the file), ended by ``\n`` and at most
``MAX_HEADER_BYTES`` long, with exactly one descriptor attached; then the service closes the
connection. The descriptor is the pool's own read-write one: the receiver maps it read-write
and ``MAP_SHARED``, and its copies see the service's bytes and vice versa. The file is a memfd
sealed against any change of size (``F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL``): a receiver
cannot shrink or grow it (``EPERM``) nor add a seal, and a hole it punches reads as zeros
again, so it can lose its own namespace's blocks but never fault the service. A client that sends
a request to an open-mode service gets the pool all the same (the service answers without
reading it).

Client: ``receive_pool(path, token=..., namespace=...)`` (with neither, nothing is sent)
returns a ``SharedPool`` whose ``fd`` the caller owns (map it, ``SharedPool.map()``, then close
it; the mapping outlives the descriptor). Every failure (no socket, nobody listening, a socket
that is not a pool socket, a refusal, a truncated or invalid header, a file whose size is not
the layout's, no answer before ``timeout_s``) is a ``PoolShareError`` with a message naming the
socket (and ``reason``, the service's code, for a refusal); no descriptor is leaked on failure.

Service: the kvoffload server answers on the pool socket (its ``app.pool_share``), with the
constants of this module; in tenant mode a connection that sends no whole request line within
its deadline is dropped, and one peer cannot hold many connections waiting.

Restart detection: ``pool_id`` is new for every pool. The engine API answers carry it in the
``POOL_HEADER`` response header, so a client that mapped a pool notices in any answer that the
service behind the socket was restarted (its mapping then holds a pool nobody else sees).

Standard library only: engines import this module, and the server takes the protocol from it.
"""

from __future__ import annotations

import array
import contextlib
import fcntl
import json
import mmap
import os
import socket
import stat
import time
from dataclasses import dataclass
from typing import Any

__all__ = [
    "FDS_PER_MESSAGE",
    "MAX_HEADER_BYTES",
    "MAX_REGISTER_BYTES",
    "MAX_REGISTER_FDS",
    "MAX_REQUEST_BYTES",
    "POOL_HEADER",
    "POOL_SOCKET_SUFFIX",
    "PROTOCOL",
    "PoolShareError",
    "SharedPool",
    "default_pool_socket",
    "receive_pool",
    "register_kv_cache",
    "sealed_memfd",
]

PROTOCOL = "kvoffload-pool/1"
"""The ``protocol`` value of every header; another value is not a pool this client can map."""
MAX_HEADER_BYTES = 4096
MAX_REQUEST_BYTES = 4096
"""Longest pool request line (tenant mode), newline included."""
MAX_REGISTER_BYTES = 256 * 1024
"""Longest registration request line (tenant mode), newline included."""
MAX_REGISTER_FDS = 512
"""Most descriptors one registration may pass (``SCM_RIGHTS``: at most ``FDS_PER_MESSAGE`` per
message, so a registration of more is sent over several)."""
POOL_HEADER = "X-KVOffload-Pool"
"""Response header of the engine API: the ``pool_id`` of the pool the service holds."""
POOL_SOCKET_SUFFIX = ".pool"
"""Added to the engine socket's path to name the pool socket, unless it is configured."""

# Room for a few descriptors: more than one is a protocol error, but each must be closed.
_FDS_SPACE = socket.CMSG_SPACE(4 * array.array("i").itemsize)
FDS_PER_MESSAGE = 253
"""The kernel's limit of descriptors in one message (``SCM_MAX_FD``)."""


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


def sealed_memfd(size: int, name: str = "kvoffload-kv-cache") -> int:
    """A new memfd of ``size`` zero bytes, sealed so that it can never shrink or grow: the
    kind of file a service with tenants takes as a KV cache (``register_kv_cache``). The
    descriptor is the caller's (close-on-exec); map it (``mmap.mmap(fd, size)``) and write
    the cache through the mapping. ``OSError`` if the kernel refuses (no memfd, no room)."""
    if not isinstance(size, int) or size <= 0:
        raise ValueError(f"size must be a positive number of bytes, got {size!r}")
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        seals = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    except BaseException:
        os.close(fd)
        raise
    return fd


def register_kv_cache(
    socket_path: str | os.PathLike[str],
    spec: dict[str, Any],
    fds: list[int],
    timeout_s: float = 5.0,
    *,
    token: str | None = None,
    namespace: str | None = None,
) -> dict[str, Any]:
    """Register a KV cache by passing its files' descriptors over the pool socket.

    ``spec`` is the body ``POST /v1/kv-caches`` takes, except that a shared-memory tensor's
    handle is ``{"kind": "shm", "fd": K}``: the K-th of ``fds`` (each a memfd sealed against
    shrinking, open read-write, at least the tensor's size: ``sealed_memfd``). The service
    maps the descriptors it receives, never a path: holding the descriptor is the proof that
    the caller may use the file. ``fds`` stay the caller's (the service gets copies).

    Returns the registered cache (``cache_id``, ``name``, ``block_bytes``, ``num_blocks``,
    ``device``). ``PoolShareError`` on any failure: a refusal carries the service's ``reason``
    (``invalid_registration``, ``unknown_token``, ``namespace_denied``, ...) and its message,
    ``reason="no_tenants"`` when the service has no tenants (its pool socket takes no
    registrations: register by path with ``POST /v1/kv-caches`` there).
    """
    path = os.fspath(socket_path)
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s!r}")
    if not fds or len(fds) > MAX_REGISTER_FDS:
        raise ValueError(f"pass 1 to {MAX_REGISTER_FDS} descriptors, got {len(fds)}")
    body = {"token": token, "namespace": namespace, "register_kv_cache": spec}
    line = json.dumps(body, separators=(",", ":")).encode() + b"\n"
    if len(line) > MAX_REGISTER_BYTES:
        raise ValueError(f"the registration is over {MAX_REGISTER_BYTES} bytes as JSON")
    # The descriptors go with the line's first bytes, FDS_PER_MESSAGE to a message (one byte
    # of the line at least carries each batch).
    batches = [fds[i : i + FDS_PER_MESSAGE] for i in range(0, len(fds), FDS_PER_MESSAGE)]
    deadline = time.monotonic() + timeout_s
    got: list[int] = []
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout_s)
            _connect(sock, path, timeout_s)
            try:
                for i, batch in enumerate(batches):
                    last = i == len(batches) - 1
                    chunk = line[i:] if last else line[i : i + 1]
                    rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", batch))]
                    sent = sock.sendmsg([chunk], rights, socket.MSG_NOSIGNAL)
                    if sent < len(chunk):
                        sock.sendall(chunk[sent:], socket.MSG_NOSIGNAL)
            except (BrokenPipeError, ConnectionResetError):
                pass  # an open-mode service answered with the pool at once: read it below
            except TimeoutError:
                raise PoolShareError(
                    f"sending the registration to {path} took over {timeout_s} s"
                ) from None
            except OSError as exc:
                raise PoolShareError(f"writing to {path}: {exc.strerror or exc}") from None
            answer = _read_header(sock, path, got, deadline, timeout_s)
        return _registered(answer, path)
    finally:
        for fd in got:  # an open-mode service's pool, or anything else: not asked for
            with contextlib.suppress(OSError):
                os.close(fd)


def _registered(line: bytes, path: str) -> dict[str, Any]:
    try:
        answer: Any = json.loads(line)
    except ValueError:
        answer = None
    if isinstance(answer, dict) and isinstance(answer.get("kv_cache"), dict):
        cache: dict[str, Any] = answer["kv_cache"]
        return cache
    if isinstance(answer, dict) and "protocol" in answer:
        raise PoolShareError(
            f"{path} belongs to a service without tenants: its pool socket takes no "
            "registrations; register by path (POST /v1/kv-caches)",
            "no_tenants",
        )
    if isinstance(answer, dict) and "error" in answer:
        reason = str(answer["error"])[:100]
        message = str(answer.get("message", ""))[:2000]
        text = f"{path} refused the registration: {reason}" + (f": {message}" if message else "")
        raise PoolShareError(text, reason)
    raise PoolShareError(f"{path} answered something that is not a registration answer")


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
