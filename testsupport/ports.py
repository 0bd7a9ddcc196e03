"""A free TCP port on loopback, for the servers tests and benchmarks start (stdlib only: the
local gateway's command line imports it too)."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (another process may take it before
    the caller binds it; the servers that use it refuse a taken port at start)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port
