"""The engine clients' credentials: every engine call carries the bearer token and the namespace
header (over a real connection to a small server on 127.0.0.1, and in process for the async
client); the token comes from a file, read again only when a 401 says the token is unknown or
revoked (rotation), and never shows in a repr, an error or a log line; refusals become typed
errors by status."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from kvoffload_client.client import (
    NAMESPACE_HEADER,
    AsyncKVOffloadClient,
    Batch,
    KVOffloadAuthError,
    KVOffloadClient,
    KVOffloadError,
    KVOffloadPermissionError,
    KVOffloadQuotaError,
    read_token_file,
)

from testsupport.ports import free_port

TOKEN = "team-a-token-0123456789"
KEY = [b"\x01" * 8]

Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


@dataclass
class Recorder:
    """A tiny ASGI app: records each request's headers, answers ``status`` with ``body``."""

    status: int = 404
    body: Any = field(
        default_factory=lambda: {"error": {"code": "unknown_request", "message": "no such"}}
    )
    seen: list[dict[str, str]] = field(default_factory=list)

    async def __call__(self, scope: MutableMapping[str, Any], receive: Receive, send: Send) -> None:
        assert scope["type"] == "http"
        while (await receive()).get("more_body"):
            pass
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        self.seen.append({"path": scope["path"], **headers})
        content = json.dumps(self.body).encode()
        await send(
            {
                "type": "http.response.start",
                "status": self.status,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": content})


@pytest.fixture(scope="module")
def live() -> Iterator[tuple[str, Recorder]]:
    """The recorder behind a real uvicorn on 127.0.0.1 (its own thread)."""
    app = Recorder()
    port = free_port()
    config = uvicorn.Config(
        app, host="127.0.0.1", port=port, log_level="warning", lifespan="off", ws="none"
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}", app
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.fixture
def recorder(live: tuple[str, Recorder]) -> Iterator[Recorder]:
    app = live[1]
    yield app
    app.status, app.body = 404, Recorder().body
    app.seen.clear()


@pytest.fixture
def url(live: tuple[str, Recorder]) -> str:
    return live[0]


def every_call(c: KVOffloadClient) -> list[Callable[[], object]]:
    """One of each engine call."""
    return [
        lambda: c.start_request("r1"),
        lambda: c.finish_request("r1"),
        lambda: c.lookup("r1", KEY),
        lambda: c.prepare_load("r1", KEY),
        lambda: c.touch("r1", KEY),
        lambda: c.complete_load("r1", KEY),
        lambda: c.prepare_store("r1", KEY),
        lambda: c.complete_store("r1", KEY),
        lambda: c.offload("r1", "cache", KEY, [0]),
        lambda: c.onload("r1", "cache", KEY, [0]),
        lambda: c.job(1),
        lambda: c.wait_jobs([1]),
        lambda: c.batch(Batch().lookup("r1", KEY)),
        lambda: c.events(),
        lambda: c.register_kv_cache({"name": "x"}),
        lambda: c.kv_caches(),
        lambda: c.unregister_kv_cache("cache"),
        lambda: c.pool(),
        lambda: c.ready(),
        lambda: c.retain("r1", KEY, 10.0),
        lambda: c.retentions(),
        lambda: c.retention("s"),
        lambda: c.renew_retention("s", 10.0),
        lambda: c.release_retention("s"),
        lambda: c.prefetch("r1", KEY, 5.0),
        lambda: c.prefetch_state(1),
        lambda: c.cancel_prefetch(1),
        lambda: c.demote("r1", KEY),
        lambda: c.drop("r1", KEY),
    ]


# --------------------------------------------------------------------------- headers


def test_every_engine_call_carries_the_token_and_namespace(url: str, recorder: Recorder) -> None:
    with KVOffloadClient(url, token=TOKEN, namespace="llama-70b") as c:
        calls = every_call(c)
        for call in calls:
            with pytest.raises(KVOffloadError):
                call()
    assert len(recorder.seen) == len(calls)
    for seen in recorder.seen:
        assert seen["authorization"] == f"Bearer {TOKEN}", seen["path"]
        assert seen[NAMESPACE_HEADER.lower()] == "llama-70b", seen["path"]


def test_without_credentials_no_header_is_sent(url: str, recorder: Recorder) -> None:
    with KVOffloadClient(url) as c:
        assert c.namespace is None
        with pytest.raises(KVOffloadError):
            c.lookup("r1", KEY)
    (seen,) = recorder.seen
    assert "authorization" not in seen
    assert NAMESPACE_HEADER.lower() not in seen


def test_a_token_alone_names_no_namespace(url: str, recorder: Recorder) -> None:
    with KVOffloadClient(url, token=TOKEN) as c, pytest.raises(KVOffloadError):
        c.pool()
    (seen,) = recorder.seen
    assert seen["authorization"] == f"Bearer {TOKEN}"
    assert NAMESPACE_HEADER.lower() not in seen


def test_the_async_client_carries_them_too() -> None:
    app = Recorder()

    async def run() -> None:
        transport = httpx.ASGITransport(app)
        async with AsyncKVOffloadClient(
            "http://engine", transport=transport, token=TOKEN, namespace="qwen-7b"
        ) as c:
            assert c.namespace == "qwen-7b"
            for call in (c.lookup("r1", KEY), c.batch(Batch().touch("r1", KEY)), c.pool()):
                with pytest.raises(KVOffloadError):
                    await call

    asyncio.run(run())
    assert len(app.seen) == 3
    for seen in app.seen:
        assert seen["authorization"] == f"Bearer {TOKEN}"
        assert seen[NAMESPACE_HEADER.lower()] == "qwen-7b"


# --------------------------------------------------------------------------- typed errors


@pytest.mark.parametrize(
    ("status", "error", "kind", "quota"),
    [
        (401, {"code": "unauthenticated", "message": "unknown_token"}, KVOffloadAuthError, None),
        (403, {"code": "forbidden", "message": "namespace_denied"}, KVOffloadPermissionError, None),
        (
            429,
            {"code": "quota_exceeded", "message": "pins", "quota": "pins"},
            KVOffloadQuotaError,
            "pins",
        ),
        (
            507,
            {"code": "quota_exceeded", "message": "blocks", "quota": "blocks"},
            KVOffloadQuotaError,
            "blocks",
        ),
        (507, {"code": "no_space", "message": "full"}, KVOffloadQuotaError, None),
        (409, {"code": "key_not_ready", "message": "not yet"}, KVOffloadError, None),
    ],
)
def test_refusals_are_typed_by_status(
    url: str,
    recorder: Recorder,
    status: int,
    error: dict[str, str],
    kind: type[KVOffloadError],
    quota: str | None,
) -> None:
    recorder.status, recorder.body = status, {"error": error}
    with KVOffloadClient(url, token=TOKEN) as c:
        with pytest.raises(KVOffloadError) as info:
            c.prepare_store("r1", KEY)
        # The same status inside a batch: the op's error is typed alike.
        recorder.status = 200
        recorder.body = {"results": [{"ok": False, "status": status, "error": error}]}
        (op,) = c.batch(Batch().prepare_store("r1", KEY))
    exc = info.value
    assert type(exc) is kind
    assert (exc.status, exc.code, exc.message) == (status, error["code"], error["message"])
    assert getattr(exc, "quota", None) == quota
    assert type(op.error) is kind
    assert getattr(op.error, "quota", None) == quota


def test_an_unreadable_refusal_keeps_its_status(url: str, recorder: Recorder) -> None:
    recorder.status, recorder.body = 401, "no"
    with KVOffloadClient(url) as c, pytest.raises(KVOffloadAuthError) as info:
        c.pool()
    assert (info.value.status, info.value.code, info.value.message) == (
        401,
        "http_error",
        "Unauthorized",
    )


# --------------------------------------------------------------------------- the token is secret


def test_the_token_shows_nowhere(url: str, recorder: Recorder, caplog, tmp_path: Path) -> None:
    caplog.set_level(logging.DEBUG)
    recorder.status = 401
    recorder.body = {"error": {"code": "unauthenticated", "message": "unknown_token"}}
    with KVOffloadClient(url, token=TOKEN, namespace="llama") as c:
        shown = [repr(c), str(vars(c)), repr(c._http.headers)]
        with pytest.raises(KVOffloadAuthError) as info:
            c.lookup("r1", KEY)
    assert "send_request_headers" in caplog.text  # the HTTP stack's debug lines were taken
    shown += [str(info.value), repr(info.value), caplog.text]
    assert "namespace='llama'" in shown[0]
    assert "token=set" in shown[0]
    for text in shown:
        assert TOKEN not in text
    assert "token=None" in repr(KVOffloadClient(url))

    async def run() -> str:
        async with AsyncKVOffloadClient(url, token=TOKEN) as a:
            return repr(a)

    assert TOKEN not in asyncio.run(run())


@pytest.mark.parametrize("bad", [f"{TOKEN} extra", f"{TOKEN}\nX-Injected: 1", f"{TOKEN}\u00e9", ""])
def test_a_malformed_token_is_refused_without_showing_it(bad: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a token") as given:
        KVOffloadClient(token=bad)
    path = tmp_path / "token"
    path.write_text(bad + "\n")
    with pytest.raises(ValueError, match=str(path)) as read:
        KVOffloadClient(token_file=path)
    for exc in (given.value, read.value):
        assert bad == "" or bad not in str(exc)
        assert TOKEN not in str(exc)


# --------------------------------------------------------------------------- token files


def test_the_token_file_is_read_without_its_newline_and_not_again_while_accepted(
    url: str, recorder: Recorder, tmp_path: Path
) -> None:
    path = tmp_path / "token"
    path.write_text(TOKEN + "\r\n")
    assert read_token_file(path) == TOKEN
    assert read_token_file(str(path)) == TOKEN
    with KVOffloadClient(url, token_file=path) as c:
        path.write_text("rotated-token-000000000\n")  # not read: no 401 asked for it
        with pytest.raises(KVOffloadError):
            c.pool()
    assert recorder.seen[0]["authorization"] == f"Bearer {TOKEN}"


@pytest.mark.parametrize(
    ("content", "match"),
    [(None, "cannot read it"), ("", "empty"), (" \n\n", "empty"), ("a b\n", "not a token")],
)
def test_bad_token_files_are_refused_naming_the_file(
    tmp_path: Path, content: str | None, match: str
) -> None:
    path = tmp_path / "token"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=match) as info:
        read_token_file(path)
    assert str(path) in str(info.value)
    with pytest.raises(ValueError, match=match):
        AsyncKVOffloadClient(token_file=path)


def test_a_directory_is_not_a_token_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot read it"):
        read_token_file(tmp_path)


def test_token_and_token_file_are_exclusive(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text(TOKEN)
    with pytest.raises(ValueError, match="not both"):
        KVOffloadClient(token=TOKEN, token_file=path)


@pytest.mark.parametrize("namespace", ["", "a b", "x\ny"])
def test_a_malformed_namespace_is_refused(namespace: str) -> None:
    with pytest.raises(ValueError, match="not a namespace name"):
        KVOffloadClient(namespace=namespace)


# --------------------------------------------------------------------------- rotation

OLD, NEW = "old-token-0123456789abcdef", "new-token-0123456789abcdef"


@dataclass
class Rotating:
    """An ``httpx.MockTransport`` handler that takes only ``accepted`` tokens: any other bearer
    is answered 401 with ``code``; records the bearer of every request."""

    accepted: set[str]
    code: str = "revoked_token"
    seen: list[str | None] = field(default_factory=list)

    def __call__(self, request: httpx.Request) -> httpx.Response:
        bearer = request.headers.get("authorization")
        self.seen.append(bearer)
        if bearer is not None and bearer.removeprefix("Bearer ") in self.accepted:
            return httpx.Response(200, json={})
        return httpx.Response(401, json={"error": {"code": self.code, "message": "refused"}})


def test_a_rotated_token_file_is_read_again_after_a_revoked_token(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "token"
    path.write_text(OLD + "\n")
    app = Rotating({NEW})
    with KVOffloadClient("http://engine", transport=httpx.MockTransport(app), token_file=path) as c:
        path.write_text(NEW + "\n")  # the operator rotates; the service revoked OLD
        c.touch("r1", KEY)  # refused once, read again, sent again: no error
        assert app.seen == [f"Bearer {OLD}", f"Bearer {NEW}"]
        c.touch("r1", KEY)
        assert app.seen[2:] == [f"Bearer {NEW}"]  # later calls carry it at once
        assert c.current_token() == NEW
        # The pool socket's registration carries the new token too.
        sent: dict[str, Any] = {}

        def register(path: str, spec: Any, fds: Any, *, token: Any, namespace: Any) -> Any:
            sent.update(token=token, namespace=namespace)
            raise RuntimeError("not sent")

        monkeypatch.setattr("kvoffload_client.client._register_over_socket", register)
        with pytest.raises(RuntimeError):
            c.register_kv_cache({"name": "e"}, fds=[0], pool_socket="/nonexistent")
        assert sent == {"token": NEW, "namespace": None}
        assert NEW not in repr(c)


def test_the_async_client_rotates_too(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text(OLD)
    app = Rotating({NEW}, code="unknown_token")

    async def run() -> None:
        transport = httpx.MockTransport(app)
        async with AsyncKVOffloadClient("http://engine", transport=transport, token_file=path) as c:
            path.write_text(NEW)
            await c.touch("r1", KEY)
            await c.touch("r1", KEY)
            assert c.current_token() == NEW

    asyncio.run(run())
    assert app.seen == [f"Bearer {OLD}", f"Bearer {NEW}", f"Bearer {NEW}"]


@pytest.mark.parametrize(
    ("code", "file_after", "why"),
    [
        ("revoked_token", None, "a token given directly, no file to read again"),
        ("revoked_token", OLD, "the file still holds the refused token"),
        ("revoked_token", "", "the file caught mid-rewrite (empty)"),
        ("missing_token", NEW, "a code that no new token cures"),
        ("malformed_authorization", NEW, "a code that no new token cures"),
    ],
)
def test_a_401_that_rotation_cannot_cure_is_raised_after_one_request(
    tmp_path: Path, code: str, file_after: str | None, why: str
) -> None:
    path = tmp_path / "token"
    path.write_text(OLD)
    app = Rotating({NEW}, code=code)
    credentials: dict[str, Any] = {"token": OLD} if file_after is None else {"token_file": path}
    with KVOffloadClient("http://engine", transport=httpx.MockTransport(app), **credentials) as c:
        path.write_text(NEW if file_after is None else file_after)
        with pytest.raises(KVOffloadAuthError):
            c.touch("r1", KEY)
        assert app.seen == [f"Bearer {OLD}"], why
        assert c.current_token() == OLD
