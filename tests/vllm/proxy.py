"""A fault-injecting HTTP/1.1 proxy on a Unix socket, in front of a real kvoffload service.

``FaultProxy(listen, upstream).start()`` forwards every call to ``upstream`` (keep-alive, bodies
by ``content-length``, as httpx and uvicorn speak) until ``status`` is set: then it answers that
status with a kvoffload error body and forwards nothing. It runs its own event loop on a daemon
thread; ``stop()`` ends it. ``RemoteProxy`` rewrites lookup answers to ``"remote"`` (a
service with a remote tier) and records every batch.
"""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

import httpx


class FaultProxy:
    """See the module docstring."""

    def __init__(self, listen: str, upstream: str) -> None:
        self.listen = listen
        self.upstream = upstream
        self.status: int | None = None  # answer every call with this status instead
        self.calls = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.AbstractServer | None = None
        self._client: httpx.AsyncClient | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    def start(self) -> FaultProxy:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._open(), self._loop).result(10)
        return self

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._close(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    async def _open(self) -> None:
        transport = httpx.AsyncHTTPTransport(uds=self.upstream)
        self._client = httpx.AsyncClient(
            base_url="http://kvoffload", transport=transport, timeout=30
        )
        self._server = await asyncio.start_unix_server(self._serve, path=self.listen)

    async def _close(self) -> None:
        assert self._server is not None
        assert self._client is not None
        self._server.close()
        for writer in list(self._writers):  # connections the engine keeps alive
            writer.close()
        await self._client.aclose()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, target, _ = lines[0].split(" ", 2)
                headers = dict(
                    (k.strip().lower(), v.strip())
                    for k, _, v in (line.partition(":") for line in lines[1:] if line)
                )
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                self.calls += 1
                status, out_headers, content = await self._answer(method, target, headers, body)
                reply = [f"HTTP/1.1 {status} X"]
                reply += [f"{k}: {v}" for k, v in out_headers.items()]
                reply += [f"content-length: {len(content)}", "", ""]
                writer.write("\r\n".join(reply).encode("latin-1") + content)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self._writers.discard(writer)
            writer.close()

    async def _answer(
        self, method: str, target: str, headers: dict[str, str], body: bytes
    ) -> tuple[int, dict[str, str], bytes]:
        if self.status is not None:
            error = {"error": {"code": "injected", "message": f"proxy answers {self.status}"}}
            return self.status, {"content-type": "application/json"}, json.dumps(error).encode()
        assert self._client is not None
        keep = {k: v for k, v in headers.items() if k in ("content-type", "accept")}
        response = await self._client.request(method, target, headers=keep, content=body)
        out = {
            k: v
            for k, v in response.headers.items()
            if k.lower() in ("content-type", "x-kvoffload-pool")
        }
        return response.status_code, out, response.content


class RemoteProxy(FaultProxy):
    """A ``FaultProxy`` that plays a service with a remote tier, and records every batch.

    For the service keys (hex) in ``remote``, a lookup answer of ``turn`` (``"hit"`` or
    ``"miss"``) becomes ``"remote"`` in the ``POST /v1/batch`` answer (``hit_prefix`` follows):
    once per key with ``once``, else every time. ``batches`` holds, per batch call, its ops and
    the op results as the service answered them (rewritten). With ``lose_answer`` set to an op
    name, the next batch carrying that op runs in the service but the engine gets a 503 for it.
    """

    def __init__(self, listen: str, upstream: str, turn: str, once: bool) -> None:
        super().__init__(listen, upstream)
        self.turn = turn
        self.once = once
        self.remote: set[str] = set()
        self.batches: list[tuple[list[dict[str, Any]], list[dict[str, Any]]]] = []
        self.lose_answer: str | None = None

    async def _answer(
        self, method: str, target: str, headers: dict[str, str], body: bytes
    ) -> tuple[int, dict[str, str], bytes]:
        status, out, content = await super()._answer(method, target, headers, body)
        if method != "POST" or target != "/v1/batch" or status != 200:
            return status, out, content
        ops = json.loads(body)["ops"]
        answer = json.loads(content)
        results = answer["results"]
        for op, res in zip(ops, results, strict=True):
            if op["op"] == "lookup" and res["ok"]:
                self._rewrite(op["keys"], res["result"])
        self.batches.append((ops, results))
        if self.lose_answer is not None and any(op["op"] == self.lose_answer for op in ops):
            self.lose_answer = None
            error = {"error": {"code": "injected", "message": "proxy lost the answer"}}
            return 503, {"content-type": "application/json"}, json.dumps(error).encode()
        return status, out, json.dumps(answer).encode()

    def _rewrite(self, keys: list[str], result: dict[str, Any]) -> None:
        states = result["results"]
        for i, key in enumerate(keys):
            if key in self.remote and states[i] == self.turn:
                states[i] = "remote"
                if self.once:
                    self.remote.discard(key)
        prefix = 0
        while prefix < len(states) and states[prefix] == "hit":
            prefix += 1
        result["hit_prefix"] = prefix
