"""A TCP proxy in front of the gateway that a test turns into a fault: S3's 503 SlowDown on every
request, or a network cut (connections reset as they come). Switching modes drops the
connections open at that moment, so a client's pooled keep-alive connections see the new mode
at their next request, as they would on a real network.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Literal

Mode = Literal["pass", "slowdown", "cut"]

_SLOWDOWN_BODY = (
    b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message></Error>"
)
_SLOWDOWN = (
    b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\n"
    b"Content-Length: " + str(len(_SLOWDOWN_BODY)).encode() + b"\r\n\r\n" + _SLOWDOWN_BODY
)


class FaultProxy:
    """``endpoint`` forwards to ``upstream`` (``host``, ``port``) while ``mode`` is ``pass``."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.mode: Mode = "pass"
        self.requests_refused = 0
        self._server: asyncio.Server | None = None
        self._open: set[asyncio.StreamWriter] = set()

    @property
    def endpoint(self) -> str:
        assert self._server is not None
        port = self._server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    async def start(self) -> FaultProxy:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def close(self) -> None:
        self._drop_open()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    def set(self, mode: Mode) -> None:
        """Switch to ``mode``; the connections open now are dropped."""
        self.mode = mode
        self._drop_open()

    def _drop_open(self) -> None:
        for writer in list(self._open):
            writer.transport.abort()
        self._open.clear()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._open.add(writer)
        try:
            if self.mode == "cut":
                writer.transport.abort()  # a reset, as a cut link or a dead host's RST
            elif self.mode == "slowdown":
                await self._slow_down(reader, writer)
            else:
                await self._forward(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self._open.discard(writer)
            writer.transport.abort()

    async def _slow_down(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Answer every request on the connection 503 SlowDown (its body read and ignored)."""
        while self.mode == "slowdown":
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n"):
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value.strip())
            if length:
                await reader.readexactly(length)
            self.requests_refused += 1
            writer.write(_SLOWDOWN)
            await writer.drain()

    async def _forward(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        self._open.add(up_writer)

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(ConnectionError):
                while data := await src.read(1 << 16):
                    dst.write(data)
                    await dst.drain()
            dst.transport.abort()

        try:
            await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
        finally:
            self._open.discard(up_writer)
            up_writer.transport.abort()
