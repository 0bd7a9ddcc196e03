"""Raw HTTP/1.1 over a TCP socket to 127.0.0.1, for tests that misbehave at the wire level.

httpx will not lie about ``Content-Length``, stream a body without end, or drop a connection in
the middle of a request; these helpers do. Only loopback addresses are ever dialled.
"""

from __future__ import annotations

import select
import socket
import struct
import time
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

LOOPBACK = ("127.0.0.1", "::1")


@dataclass(frozen=True)
class RawAnswer:
    """An HTTP answer read off the wire."""

    status: int
    headers: dict[str, str]
    body: bytes


def connect(url: str, timeout: float = 10.0) -> socket.socket:
    """A TCP connection to the loopback server at ``url``."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if host not in LOOPBACK or parts.port is None:
        raise ValueError(f"refusing to dial {url!r}: loopback host and explicit port only")
    return socket.create_connection((host, parts.port), timeout=timeout)


def head(method: str, path: str, headers: dict[str, str] | None = None) -> bytes:
    """The request line and headers (``Host`` added), ending with the blank line."""
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def reset(sock: socket.socket) -> None:
    """Close with a TCP RST (linger 0): the peer sees the connection torn down at once."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def read_answer(sock: socket.socket, timeout: float = 10.0) -> RawAnswer:
    """Read one answer (its body by ``Content-Length``); raises ``ConnectionError`` if the peer
    closes before a whole answer arrived."""
    deadline = time.monotonic() + timeout
    data = b""
    while b"\r\n\r\n" not in data:
        data += _recv(sock, deadline)
    raw_head, _, body = data.partition(b"\r\n\r\n")
    lines = raw_head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    length = int(headers.get("content-length", "0"))
    while len(body) < length:
        body += _recv(sock, deadline)
    return RawAnswer(status, headers, body[:length])


def _recv(sock: socket.socket, deadline: float) -> bytes:
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise TimeoutError("no complete answer in time")
    sock.settimeout(remaining)
    chunk = sock.recv(65536)
    if not chunk:
        raise ConnectionError("peer closed the connection before a whole answer")
    return chunk


def closed_by_peer(sock: socket.socket, timeout: float = 5.0) -> bool:
    """True if the peer closes the connection (EOF or reset) within ``timeout``; bytes that
    arrive first are discarded."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            if not sock.recv(65536):
                return True
        except TimeoutError:
            return False
        except ConnectionError:
            return True
    return False


def send_until_answered(
    sock: socket.socket, chunks: Iterable[bytes], timeout: float = 10.0
) -> tuple[int, RawAnswer | None]:
    """Send ``chunks`` one by one until the server answers or stops reading.

    Returns the number of body bytes sent before that and the answer (None if the server closed
    without one). The server is expected to answer early: a body it would buffer whole is sent
    whole, so the count tells the two apart.
    """
    sent = 0
    for chunk in chunks:
        readable, _, _ = select.select([sock], [], [], 0)
        if readable:
            break
        try:
            sock.sendall(chunk)
        except (BrokenPipeError, ConnectionResetError):
            break
        sent += len(chunk)
    try:
        return sent, read_answer(sock, timeout)
    except ConnectionError:
        return sent, None
