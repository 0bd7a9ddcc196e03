"""The engine clients' own errors, and the service's messages an engine author reads: a key that
is not ``bytes`` is refused before anything is sent; a service nothing answers for names its URL
or socket and the fix (sync and async, TCP and Unix socket, over real sockets); the engine API's
401 says what to send; ``handle_not_held`` names the engine side's function."""

from __future__ import annotations

import gc
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from kvoffload_client.client import (
    AsyncKVOffloadClient,
    Batch,
    KVOffloadClient,
    KVOffloadConnectError,
)

from tests.api.test_tenancy import BETA, tenants_running

pytestmark = pytest.mark.anyio

BAD_KEYS: list[tuple[Any, str]] = [
    (["0102030405060708"], "keys[0]: expected bytes, got str; a hex str is not accepted"),
    ([b"\x01" * 8, 7], "keys[1]: expected bytes, got int"),
    (b"\x01" * 8, "keys: expected a sequence of bytes keys (e.g. a list), got one bytes"),
    ("0102", "keys: expected a sequence of bytes keys (e.g. a list), got one str"),
]


def _nothing_sent(sent: list[httpx.Request]) -> httpx.MockTransport:
    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(request)
        return httpx.Response(200, json={})

    return httpx.MockTransport(handler)


@pytest.mark.parametrize(("keys", "message"), BAD_KEYS)
def test_the_sync_client_refuses_keys_that_are_not_bytes_before_sending(
    keys: Any, message: str
) -> None:
    sent: list[httpx.Request] = []
    with KVOffloadClient("http://engine", transport=_nothing_sent(sent)) as c:
        for call in (
            lambda: c.lookup("r1", keys),
            lambda: c.prepare_store("r1", keys),
            lambda: c.offload("r1", "kvc-1", keys, [0]),
            lambda: c.retain("r1", keys, 1.0),
            lambda: Batch().lookup("r1", keys),
        ):
            with pytest.raises(TypeError) as info:
                call()
            assert str(info.value).startswith(message)
        assert sent == []
        good: list[Any] = [b"\x01" * 8, bytearray(b"\x02" * 8)]  # bytearray is taken too
        c.touch("r1", good)
    assert [r.read() for r in sent] == [b'{"keys": ["0101010101010101", "0202020202020202"]}']


@pytest.mark.parametrize(("keys", "message"), BAD_KEYS[:2])
async def test_the_async_client_refuses_keys_that_are_not_bytes_before_sending(
    keys: Any, message: str
) -> None:
    sent: list[httpx.Request] = []
    async with AsyncKVOffloadClient("http://engine", transport=_nothing_sent(sent)) as c:
        with pytest.raises(TypeError, match=r"^keys\[\d\]: expected bytes"):
            await c.lookup("r1", keys)
        with pytest.raises(TypeError, match=r"^keys\[\d\]: expected bytes"):
            await c.onload("r1", "kvc-1", keys, [0])
    assert sent == []


@pytest.fixture
def refusing_port() -> Iterator[int]:
    """A port on 127.0.0.1 bound but not listening: a connection to it is refused, and no
    other test can take it meanwhile."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]


def _check_unreachable(err: KVOffloadConnectError, where: str, fix: str) -> None:
    message = str(err)
    assert message.startswith(f"cannot connect to the kvoffload service at {where} ("), message
    assert fix in message
    assert isinstance(err.__cause__, httpx.ConnectError)
    assert not isinstance(err.__cause__, KVOffloadConnectError)
    assert err.where == where
    # Still a transport error to code that catches those (the vLLM tier's link does).
    assert isinstance(err, httpx.TransportError)


def test_a_refused_tcp_connection_names_the_url_and_the_fix(refusing_port: int) -> None:
    url = f"http://127.0.0.1:{refusing_port}"
    with KVOffloadClient(url) as c, pytest.raises(KVOffloadConnectError) as info:
        c.start_request("r1")
    _check_unreachable(info.value, url, "is the service running (`kvoffload serve`)")


async def test_a_refused_tcp_connection_names_the_url_and_the_fix_async(
    refusing_port: int,
) -> None:
    url = f"http://127.0.0.1:{refusing_port}"
    async with AsyncKVOffloadClient(url) as c:
        with pytest.raises(KVOffloadConnectError) as info:
            await c.lookup("r1", [b"\x01"])
    _check_unreachable(info.value, url, "is the service running (`kvoffload serve`)")


def test_a_missing_unix_socket_names_the_path_and_the_fix(tmp_path: Path) -> None:
    path = str(tmp_path / "engine.sock")
    with KVOffloadClient(uds=path) as c, pytest.raises(KVOffloadConnectError) as info:
        c.pool()
    _check_unreachable(info.value, f"Unix socket {path}", f"`kvoffload serve --uds {path}`")
    assert "No such file or directory" in str(info.value)


def test_failed_unix_socket_connects_leave_no_descriptor_open(tmp_path: Path) -> None:
    # httpcore's sync backend leaves the failed connect's socket to the garbage collector;
    # the client closes it, so retries against a service that is down hold no descriptors.
    path = str(tmp_path / "engine.sock")
    errors: list[KVOffloadConnectError] = []  # held, as an engine holding its last error does
    gc.disable()
    try:
        with KVOffloadClient(uds=path) as c:
            before = len(os.listdir("/proc/self/fd"))
            for _ in range(5):
                with pytest.raises(KVOffloadConnectError) as info:
                    c.start_request("r1")
                errors.append(info.value)
            assert len(os.listdir("/proc/self/fd")) == before
    finally:
        gc.enable()


async def test_a_unix_socket_nobody_listens_on_names_the_path_and_the_fix(tmp_path: Path) -> None:
    path = str(tmp_path / "engine.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(path)  # the file is there, nothing accepts: refused
        async with AsyncKVOffloadClient(uds=path) as c:
            with pytest.raises(KVOffloadConnectError) as info:
                await c.start_request("r1")
    _check_unreachable(info.value, f"Unix socket {path}", "--uds-mode 0660 --uds-group")


async def test_the_engine_401_says_to_send_a_bearer_token(tmp_path: Path) -> None:
    async with tenants_running(tmp_path) as t:
        for headers, code in (
            ({}, "missing_token"),
            ({"Authorization": "Basic YWxwaGE6eA=="}, "malformed_authorization"),
        ):
            r = await t.engine.put("/v1/requests/r1", json={}, headers=headers)
            assert r.status_code == 401, r.text
            error = r.json()["error"]
            assert error["code"] == code
            assert "Authorization: Bearer <token>" in error["message"]
        # An unknown token is not a format problem: no hint that would send anyone looking.
        unknown = {"Authorization": "Bearer wrong-token-000000000000000"}
        r = await t.engine.put("/v1/requests/r1", json={}, headers=unknown)
        assert r.json()["error"]["code"] == "unknown_token"
        assert "Bearer" not in r.json()["error"]["message"]


async def test_handle_not_held_names_the_engine_side_function(tmp_path: Path) -> None:
    body = {
        "name": "x",
        "device": "cpu",
        "tensors": [
            {
                "shape": [4, 1024],
                "dtype": "uint8",
                "block_dim": 0,
                "handle": {"kind": "shm", "path": "/dev/shm/x"},
            }
        ],
    }
    async with tenants_running(tmp_path) as t:
        r = await t.call(BETA, "POST", "/v1/kv-caches", body)
        assert r.status_code == 403, r.text
        message = r.json()["error"]["message"]
        assert "kvoffload_client.pool_socket.register_kv_cache" in message
        assert "app." not in message  # the server's modules are not on an engine's path
