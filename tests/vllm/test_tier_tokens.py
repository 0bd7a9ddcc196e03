"""The tier's credentials, inside vLLM's real tiering code: ``token_file`` (or
``$KVOFFLOAD_TOKEN_FILE``) and ``service_namespace`` reach every engine call and the pool
socket's request; a refusal of them (401, 403, the pool socket's) fails the engine's tier work
like a service fault, logged as an error once per incident, and the tier recovers when the
service accepts them again; a token rotated in the file is read again after the service revokes
the old one (no restart, no fault); a token file that holds no token refuses the engine's start.

The service here has no tenants: a proxy records the engine calls (and answers 401 / 403 on
demand), and a tenant-mode pool socket relays the service's own pool to a request whose token
and namespace it accepts.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kvoffload_client.client import NAMESPACE_HEADER
from kvoffload_client.pool_socket import SharedPool, receive_pool

from app.pool_share import PoolShareServer
from tests.vllm.conftest import serve
from tests.vllm.proxy import FaultProxy
from tests.vllm.test_faults import FAST, Traffic, faults
from testsupport.server import ServerProcess
from testsupport.vllm_sim import SimEngine, keys_of, kv_transfer_config

TOKEN = "engine-token-of-team-a-0001"
NEW_TOKEN = "engine-token-of-team-a-0002"
NAMESPACE = "llama-team-a"
REFUSED = "the service refused this engine's credentials"

# See tests/vllm/test_faults.py: httpcore leaves a failed Unix-socket connect to the collector.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


@pytest.fixture(autouse=True)
def _collect_leaked_sockets() -> Iterator[None]:
    yield
    gc.collect()


class RecordingProxy(FaultProxy):
    """A ``FaultProxy`` that records the headers of every call it receives."""

    def __init__(self, listen: str, upstream: str) -> None:
        super().__init__(listen, upstream)
        self.seen: list[dict[str, str]] = []

    async def _answer(
        self, method: str, target: str, headers: dict[str, str], body: bytes
    ) -> tuple[int, dict[str, str], bytes]:
        self.seen.append({"target": target, **headers})
        return await super()._answer(method, target, headers, body)


class RevokingProxy(RecordingProxy):
    """A ``RecordingProxy`` that answers 401 ``revoked_token`` to a bearer in ``revoked``."""

    def __init__(self, listen: str, upstream: str) -> None:
        super().__init__(listen, upstream)
        self.revoked: set[str] = set()

    async def _answer(
        self, method: str, target: str, headers: dict[str, str], body: bytes
    ) -> tuple[int, dict[str, str], bytes]:
        bearer = headers.get("authorization", "")
        if bearer.removeprefix("Bearer ") in self.revoked:
            self.seen.append({"target": target, **headers})
            error = {"error": {"code": "revoked_token", "message": "token revoked"}}
            return 401, {"content-type": "application/json"}, json.dumps(error).encode()
        return await super()._answer(method, target, headers, body)


class Relay:
    """A tenant-mode pool socket handing out the service's own pool to requests carrying
    one of ``tokens`` and ``NAMESPACE``; ``seen`` holds every request it read."""

    def __init__(self, path: str, service_pool_socket: str) -> None:
        self.path = path
        self.tokens = {TOKEN}  # the tokens it takes
        self.pool = receive_pool(service_pool_socket)
        self.seen: list[dict[str, Any]] = []
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(path)
        self._server = PoolShareServer(sock, self.current, read_request=True)

    def current(self, request: dict[str, Any]) -> SharedPool:
        self.seen.append(request)
        if request["token"] not in self.tokens:
            raise RefusedError("unknown_token")
        if request["namespace"] != NAMESPACE:
            raise RefusedError("namespace_denied")
        return self.pool

    @contextlib.contextmanager
    def running(self) -> Iterator[Relay]:
        self._thread.start()

        async def start() -> None:
            self._server.start()

        asyncio.run_coroutine_threadsafe(start(), self._loop).result(5)
        try:
            yield self
        finally:
            asyncio.run_coroutine_threadsafe(self._server.stop(), self._loop).result(5)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)
            self._loop.close()
            os.close(self.pool.fd)


class RefusedError(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@contextlib.contextmanager
def tenant_setup(
    tmp_path: Path, proxy_type: type[RecordingProxy] = RecordingProxy
) -> Iterator[tuple[ServerProcess, Any, Relay]]:
    with serve(tmp_path).serving() as srv:
        proxy = proxy_type(str(tmp_path / "proxy.sock"), str(srv.uds))
        proxy.start()
        relay = Relay(str(tmp_path / "relay.sock"), f"{srv.uds}.pool")
        try:
            with relay.running():
                yield srv, proxy, relay
        finally:
            proxy.stop()


def token_file(tmp_path: Path, token: str = TOKEN) -> str:
    path = tmp_path / "token"
    path.write_text(token + "\n")
    path.chmod(0o400)
    return str(path)


def engine_config(proxy: RecordingProxy, relay: Relay, **tier: Any) -> dict[str, Any]:
    return kv_transfer_config(
        f"unix://{proxy.listen}",
        cpu_chunks=16,
        pool_socket=relay.path,
        service_namespace=NAMESPACE,
        **FAST,
        **tier,
    )


def refusal_errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "kvoffload.vllm_tier" and r.levelno == logging.ERROR
    ]


def test_credentials_reach_every_call_and_the_pool_socket(tmp_path: Path) -> None:
    with tenant_setup(tmp_path) as (_, proxy, relay):
        config = engine_config(proxy, relay, token_file=token_file(tmp_path))
        a, b = SimEngine("t-tok-a", config), SimEngine("t-tok-b", config)
        try:
            Traffic(a, b, "tok").until_shared(keys_of(range(10, 16)))
            assert faults(a) == faults(b) == {}
        finally:
            a.close()
            b.close()
    assert proxy.seen
    for seen in proxy.seen:
        assert seen["authorization"] == f"Bearer {TOKEN}", seen["target"]
        assert seen[NAMESPACE_HEADER.lower()] == NAMESPACE, seen["target"]
    assert relay.seen == [{"token": TOKEN, "namespace": NAMESPACE}] * 2  # one map per engine
    assert TOKEN not in repr(a.tiers[0]._shared.client)


def test_the_token_file_may_come_from_the_environment(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("KVOFFLOAD_TOKEN_FILE", token_file(tmp_path))
    with tenant_setup(tmp_path) as (_, proxy, relay):
        engine = SimEngine("t-env", engine_config(proxy, relay))
        try:
            engine.run_request("env-1", keys_of(range(20, 24)))
            engine.settle()
            assert faults(engine) == {}
        finally:
            engine.close()
    assert {s["authorization"] for s in proxy.seen} == {f"Bearer {TOKEN}"}
    assert relay.seen == [{"token": TOKEN, "namespace": NAMESPACE}]


def test_refused_credentials_fail_like_a_fault_logged_once_per_incident(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="kvoffload.vllm_tier")
    fresh = (keys_of(range(n, n + 4), salt=b"refused") for n in itertools.count(0, 4))
    with tenant_setup(tmp_path) as (_, proxy, relay):
        config = engine_config(proxy, relay, token_file=token_file(tmp_path))
        a, b = SimEngine("t-ref-a", config), SimEngine("t-ref-b", config)
        traffic = Traffic(a, b, "ref")
        try:
            traffic.until_shared(next(fresh))
            assert refusal_errors(caplog) == []
            for status, reason in ((401, "unauthenticated"), (403, "forbidden")):
                proxy.status = status
                for _ in range(3):  # several requests, one incident: one error per engine
                    first, second = traffic.both(next(fresh))
                    assert first.hit_chunks == second.hit_chunks == 0
                assert faults(a).get(reason)
                assert faults(b).get(reason)
                errors = refusal_errors(caplog)
                assert len(errors) == 2, errors
                assert all(REFUSED in e and f"({status} " in e for e in errors), errors
                caplog.clear()
                proxy.status = None
                # Each tier finds the service back once its back-off lets it ask again.
                deadline = time.monotonic() + 30
                while sum("service back" in r.getMessage() for r in caplog.records) < 2:
                    assert time.monotonic() < deadline, "the tiers did not recover"
                    traffic.both(next(fresh))
                    time.sleep(0.02)
                keys = next(fresh)
                _, second = traffic.both(keys)
                assert second.hit_chunks == len(keys)  # stored by A, loaded by B
        finally:
            a.close()
            b.close()
    assert TOKEN not in caplog.text


def test_a_refused_pool_request_fails_like_a_fault(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="kvoffload.vllm_tier")
    other = token_file(tmp_path, "a-token-the-service-does-not-know")
    with tenant_setup(tmp_path) as (_, proxy, relay):
        engine = SimEngine("t-pool", engine_config(proxy, relay, token_file=other))
        try:
            outcome = engine.run_request("pool-1", keys_of(range(90, 94)))
            engine.settle()
            assert outcome.hit_chunks == 0
            assert faults(engine).get("pool_refused")
        finally:
            engine.close()
    (error,) = refusal_errors(caplog)
    assert "the pool socket refused: unknown_token" in error
    assert "a-token-the-service-does-not-know" not in caplog.text


@pytest.mark.parametrize(("content", "match"), [(None, "cannot read it"), ("\n", "empty")])
def test_a_token_file_without_a_token_refuses_the_start(
    tmp_path: Path, content: str | None, match: str
) -> None:
    path = tmp_path / "token"
    if content is not None:
        path.write_text(content)
    config = kv_transfer_config("unix:///nonexistent/kv.sock", cpu_chunks=4, token_file=str(path))
    with pytest.raises(ValueError, match=match) as info:
        SimEngine("t-bad-file", config)
    assert str(path) in str(info.value)


def test_a_rotated_token_is_read_again_without_restarting_the_engine(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The operator writes a new token into the engine's token file and the service revokes
    the old one: the engines' next calls are refused once each, read the file again and go on
    with the new token; no fault, no error logged, and B loads what A stored afterwards."""
    caplog.set_level(logging.WARNING, logger="kvoffload.vllm_tier")
    path = Path(token_file(tmp_path))
    with tenant_setup(tmp_path, RevokingProxy) as (_, proxy, relay):
        config = engine_config(proxy, relay, token_file=str(path))
        a, b = SimEngine("t-rot-a", config), SimEngine("t-rot-b", config)
        traffic = Traffic(a, b, "rot")
        try:
            traffic.until_shared(keys_of(range(30, 34)))
            # The rotation: a new file moved into place, the old token revoked.
            fresh = tmp_path / "token.new"
            fresh.write_text(NEW_TOKEN + "\n")
            fresh.chmod(0o400)
            os.replace(fresh, path)
            relay.tokens = {NEW_TOKEN}
            proxy.revoked = {TOKEN}
            at = len(proxy.seen)
            keys = keys_of(range(40, 44), salt=b"rotated")
            _, second = traffic.both(keys)
            assert second.hit_chunks == len(keys)  # stored by A, loaded by B, new token
            assert faults(a) == faults(b) == {}
            assert refusal_errors(caplog) == []
        finally:
            a.close()
            b.close()
    after = [s["authorization"] for s in proxy.seen[at:]]
    # Each engine's client is refused once (more only for calls already in flight then).
    assert 2 <= after.count(f"Bearer {TOKEN}") <= 4, after
    assert after[-1] == f"Bearer {NEW_TOKEN}"
    assert after.count(f"Bearer {NEW_TOKEN}") >= len(after) - 4
    assert TOKEN not in caplog.text
    assert NEW_TOKEN not in caplog.text
