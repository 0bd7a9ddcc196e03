"""A bounded slowloris against a kvoffload engine listener on this machine.

It holds ``count`` silent connections (connected, never a byte sent) and ``count``
partial-head connections (a request line and a few headers, then one more header byte every
``trickle_s``, never the blank line that ends the head) on each target, TCP and/or a Unix socket,
for ``seconds``; each one the server closes is opened again at once (as a real slowloris does),
so ``count`` of each kind stay open for the whole run whatever the server does. Nothing is sent
that carries a token: this is the attacker without credentials.

Bounded by construction: only loopback TCP addresses (127.0.0.1, ::1) or a Unix socket path
are dialled; at most ``4 * count`` connections are open at once (``MAX_COUNT`` caps ``count``);
the run stops by itself after ``seconds`` and closes what is still open.

Run alone (from the repository root)::

    .venv/bin/python -m tests.load.slowloris --tcp 127.0.0.1:8000 --uds /tmp/kv.sock \\
        --count 50 --seconds 20

prints ``ready`` once every connection is open, then one JSON object (``Report.as_dict``): per
target and kind, the connections opened, those the server closed, those refused at once (closed
before ``REFUSED_WITHIN_S``), those still open at the end, and how long the server let a
connection live before closing it (median and max, seconds).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import select
import socket
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LOOPBACK = ("127.0.0.1", "::1")
MAX_COUNT = 200  # per target and kind: 4 * 200 descriptors at most, on a shared machine
# A connection the server closes this soon after it opened was refused (a cap), not timed out.
REFUSED_WITHIN_S = 0.2
# What a partial-head connection sends first: a plausible lookup, its head never finished.
PARTIAL_HEAD = (
    b"POST /v1/requests/slowloris/lookup HTTP/1.1\r\n"
    b"Host: 127.0.0.1\r\n"
    b"Content-Type: application/json\r\n"
    b"X-Slow: "
)
KINDS = ("silent", "partial")


@dataclass(frozen=True)
class Target:
    """Where to connect: ``host``/``port`` (loopback only) or ``path`` (a Unix socket)."""

    name: str
    host: str = ""
    port: int = 0
    path: str = ""

    @classmethod
    def tcp(cls, address: str) -> Target:
        """``HOST:PORT`` (``[::1]:PORT`` for IPv6); ValueError off loopback."""
        host, _, port = address.rpartition(":")
        host = host.strip("[]")
        if host not in LOOPBACK:
            raise ValueError(f"refusing to dial {address!r}: 127.0.0.1 or ::1 only")
        return cls("tcp", host=host, port=int(port))

    @classmethod
    def unix(cls, path: str | Path) -> Target:
        """The Unix socket at ``path``."""
        return cls("uds", path=str(path))

    def connect(self) -> socket.socket:
        """A new non-blocking connection (connected: the connect itself blocks, briefly)."""
        if self.path:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            target: Any = self.path
        else:
            family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
            sock = socket.socket(family, socket.SOCK_STREAM)
            target = (self.host, self.port)
        try:
            sock.settimeout(5.0)
            sock.connect(target)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        return sock


@dataclass
class Tally:
    """What happened to the connections of one target and kind."""

    opened: int = 0
    closed_by_server: int = 0
    refused: int = 0
    connect_failed: int = 0
    open_at_end: int = 0
    lifetimes: list[float] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready; lifetimes of the connections the server closed (refusals aside)."""
        timed = [t for t in self.lifetimes if t >= REFUSED_WITHIN_S]
        return {
            "opened": self.opened,
            "closed_by_server": self.closed_by_server,
            "refused": self.refused,
            "connect_failed": self.connect_failed,
            "open_at_end": self.open_at_end,
            "lifetime_median_s": round(statistics.median(timed), 3) if timed else None,
            "lifetime_max_s": round(max(timed), 3) if timed else None,
        }


@dataclass
class _Held:
    sock: socket.socket
    target: Target
    kind: str
    opened_at: float
    next_trickle: float


@dataclass
class Report:
    """Tallies by ``(target name, kind)``."""

    tallies: dict[tuple[str, str], Tally] = field(default_factory=dict)

    def tally(self, target: str, kind: str) -> Tally:
        return self.tallies.setdefault((target, kind), Tally())

    def as_dict(self) -> dict[str, dict[str, Any]]:
        """``{"tcp/silent": {...}, "uds/partial": {...}, ...}``."""
        return {f"{t}/{k}": tally.as_dict() for (t, k), tally in sorted(self.tallies.items())}


class Slowloris:
    """Hold ``count`` silent and ``count`` partial-head connections on each of ``targets``."""

    def __init__(
        self,
        targets: list[Target],
        count: int,
        *,
        trickle_s: float = 0.5,
        reconnect: bool = True,
    ) -> None:
        if not 0 < count <= MAX_COUNT:
            raise ValueError(f"count must be 1 to {MAX_COUNT}")
        self.targets = targets
        self.count = count
        self.trickle_s = trickle_s
        self.reconnect = reconnect
        self.report = Report()
        self.held: dict[int, _Held] = {}
        # Reopened later, not at once: a refused connection reopened in a tight loop would
        # only burn this machine's CPU (``(when, target, kind)``).
        self._later: list[tuple[float, Target, str]] = []
        self._poll = select.poll()

    def _open(self, target: Target, kind: str) -> None:
        tally = self.report.tally(target.name, kind)
        try:
            sock = target.connect()
        except OSError:
            # A full backlog or a refusal at connect: counted, not retried in a tight loop.
            tally.connect_failed += 1
            return
        now = time.monotonic()
        if kind == "partial":
            with contextlib.suppress(OSError):
                sock.send(PARTIAL_HEAD)
        tally.opened += 1
        self.held[sock.fileno()] = _Held(sock, target, kind, now, now + self.trickle_s)
        self._poll.register(sock.fileno(), select.POLLIN | select.POLLHUP | select.POLLERR)

    def open_all(self) -> None:
        """Open every connection (``count`` per target and kind)."""
        for target in self.targets:
            for kind in KINDS:
                for _ in range(self.count):
                    self._open(target, kind)

    def _closed(self, fd: int, now: float) -> None:
        held = self.held.pop(fd)
        self._poll.unregister(fd)
        held.sock.close()
        tally = self.report.tally(held.target.name, held.kind)
        lifetime = now - held.opened_at
        tally.closed_by_server += 1
        tally.lifetimes.append(lifetime)
        if lifetime < REFUSED_WITHIN_S:
            tally.refused += 1
            if self.reconnect:
                self._later.append((now + REFUSED_WITHIN_S, held.target, held.kind))
        elif self.reconnect:
            self._open(held.target, held.kind)

    def _server_closed(self, sock: socket.socket) -> bool:
        """True when the server closed (EOF or reset); a partial connection's readable data
        (an error answer) is read and counts as closed only with the EOF behind it."""
        try:
            data = sock.recv(65536)
        except BlockingIOError:
            return False
        except OSError as exc:
            return exc.errno in (errno.ECONNRESET, errno.EPIPE, errno.ENOTCONN)
        return data == b""

    def run(self, seconds: float) -> Report:
        """Hold the connections for ``seconds`` (trickling, reopening what the server closes),
        then close what is still open; the report."""
        deadline = time.monotonic() + seconds
        while True:
            now = time.monotonic()
            if now >= deadline:
                break
            for fd, _events in self._poll.poll(min(100.0, (deadline - now) * 1000)):
                held = self.held.get(fd)
                if held is not None and self._server_closed(held.sock):
                    self._closed(fd, time.monotonic())
            now = time.monotonic()
            due = [item for item in self._later if item[0] <= now]
            self._later = [item for item in self._later if item[0] > now]
            for _when, target, kind in due:
                self._open(target, kind)
            for fd, held in list(self.held.items()):
                if held.kind != "partial" or now < held.next_trickle:
                    continue
                held.next_trickle = now + self.trickle_s
                try:
                    held.sock.send(b"a")  # one more byte of a header value: progress, never done
                except BlockingIOError:
                    pass
                except OSError:
                    self._closed(fd, now)
        for held in self.held.values():
            self.report.tally(held.target.name, held.kind).open_at_end += 1
            held.sock.close()
        self.held.clear()
        return self.report


def main(argv: list[str] | None = None) -> int:
    """The command line; see the module docstring."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tcp", help="HOST:PORT of the engine listener (loopback only)")
    parser.add_argument("--uds", help="path of the engine listener's Unix socket")
    parser.add_argument("--count", type=int, default=50, help="connections per target and kind")
    parser.add_argument("--seconds", type=float, default=10.0, help="how long the attack runs")
    parser.add_argument("--trickle-s", type=float, default=0.5, help="a partial head's pace")
    parser.add_argument(
        "--no-reconnect", action="store_true", help="do not reopen what the server closes"
    )
    args = parser.parse_args(argv)
    targets = []
    if args.tcp:
        targets.append(Target.tcp(args.tcp))
    if args.uds:
        targets.append(Target.unix(args.uds))
    if not targets:
        parser.error("give --tcp, --uds or both")
    attack = Slowloris(
        targets, args.count, trickle_s=args.trickle_s, reconnect=not args.no_reconnect
    )
    attack.open_all()
    print("ready", flush=True)
    report = attack.run(args.seconds)
    print(json.dumps(report.as_dict()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
