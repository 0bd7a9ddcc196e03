"""Size limits at the wire, against a real server (64 KiB bodies, 256 keys, 16 batch ops).

A body far above the limit is cut off with 413 without the server reading, let alone buffering,
all of it, whether its ``Content-Length`` announces the size, lies about it, or is missing
(chunked). The proof is in the bytes: the client streams 64 MiB and counts how much the server
took before it answered and hung up (socket buffers hold a few MiB, so "much less than all of
it" tells cut-off from buffering), and in the server's peak RSS (``VmHWM``), which must not
move by anything like the body's size. Too many keys in one op, too many ops in one batch and
too many keys in one batch op are 413 with a code that says which.

Each route has its own cap below the global one (``app/limits.py``): a lookup body over the
lookup cap is cut off on its headers while the batch route still takes that size. A batch of
200k ops (7.6 MB, under the default 8 MiB limit) is refused by its op count before it is
parsed: the server's peak RSS moves by a fraction of what parsing it cost (+142 MiB before).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from kvoffload_client.client import Batch, KVOffloadClient, KVOffloadError

from app.http.limits import body_caps
from app.settings import Settings
from tests.load import wire
from testsupport.procfs import proc_status
from testsupport.server import ServerProcess

LIMIT = 64 * 1024
TOTAL = 64 << 20  # what a misbehaving client tries to push
CHUNK = 256 * 1024
# A server that buffered the body would have taken all of TOTAL; loopback socket buffers hold
# a few MiB at most.
MAX_TAKEN = TOTAL // 2
# Peak RSS may move a little (a few chunks in flight), never by the body's size.
MAX_HWM_GROWTH_KIB = 24 * 1024
# A 200k-op batch held whole (it is under the limit) and scanned: a few copies of its 7.6 MB,
# never the parse (+142 MiB).
MAX_BATCH_HWM_GROWTH_KIB = 48 * 1024


@pytest.fixture(scope="module")
def limited(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with ServerProcess(
        tmp_path_factory.mktemp("limits"),
        *("--max-body-bytes", str(LIMIT), "--max-keys-per-call", "256"),
        *("--max-batch-ops", "16"),
    ).serving() as srv:
        yield srv
    assert "Traceback" not in srv.log(), srv.log()


@pytest.fixture(scope="module")
def defaults(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A server with the default limits (8 MiB bodies, 1024 batch ops), its own peak RSS."""
    with ServerProcess(tmp_path_factory.mktemp("defaults")).serving() as srv:
        yield srv
    assert "Traceback" not in srv.log(), srv.log()


def hwm_kib(srv: ServerProcess) -> int:
    assert srv.proc is not None
    return proc_status(srv.proc.pid)["VmHWM"]


def garbage_chunks(total: int = TOTAL, chunk: int = CHUNK) -> Iterator[bytes]:
    block = b"[" * chunk
    for _ in range(total // chunk):
        yield block


def chunked(chunks: Iterator[bytes]) -> Iterator[bytes]:
    for c in chunks:
        yield f"{len(c):x}\r\n".encode() + c + b"\r\n"


def assert_refused_as_too_large(answer: wire.RawAnswer | None) -> None:
    assert answer is not None, "the server hung up without an answer"
    assert answer.status == 413, answer
    assert json.loads(answer.body)["error"]["code"] == "body_too_large"


def test_an_announced_oversized_body_is_refused_before_it_is_sent(limited: ServerProcess) -> None:
    """``Content-Length: 1 GiB``: 413 on the headers alone, and the connection is closed (the
    unread body must not be taken for the next request)."""
    sock = wire.connect(limited.url)
    try:
        sock.sendall(
            wire.head(
                "POST",
                "/v1/requests/r/lookup",
                {"Content-Type": "application/json", "Content-Length": str(1 << 30)},
            )
        )
        answer = wire.read_answer(sock)
        assert_refused_as_too_large(answer)
        assert answer.headers.get("connection") == "close"
        assert wire.closed_by_peer(sock)
    finally:
        sock.close()


@pytest.mark.parametrize("path", ["/v1/requests/r/lookup", "/v1/batch", "/v1/kv-caches"])
def test_a_body_without_length_is_refused_at_the_limit(limited: ServerProcess, path: str) -> None:
    """Chunked, no ``Content-Length``, 64 MiB on offer: 413 once the limit is passed, long
    before the body ends; a client that keeps sending anyway does not make the server buffer
    it (peak RSS flat), and the server keeps answering others."""
    before = hwm_kib(limited)
    sock = wire.connect(limited.url)
    try:
        sock.sendall(
            wire.head(
                "POST", path, {"Content-Type": "application/json", "Transfer-Encoding": "chunked"}
            )
        )
        chunks = chunked(garbage_chunks())
        taken, answer = wire.send_until_answered(sock, chunks)
        assert_refused_as_too_large(answer)
        assert taken < MAX_TAKEN, f"the server read {taken} of {TOTAL} bytes"
        for chunk in chunks:  # the rest of the 64 MiB, if the server still takes it
            try:
                sock.sendall(chunk)
            except (BrokenPipeError, ConnectionResetError):
                break
    finally:
        sock.close()
    assert hwm_kib(limited) - before < MAX_HWM_GROWTH_KIB
    with KVOffloadClient(limited.url, timeout=10) as c:
        assert c.ready()


def test_a_body_without_length_over_the_limit_gets_its_connection_closed(
    limited: ServerProcess,
) -> None:
    """After the 413 for an over-long chunked body the server hangs up, as it does for an
    announced one, instead of draining the rest of the body."""
    sock = wire.connect(limited.url)
    try:
        sock.sendall(
            wire.head(
                "POST",
                "/v1/requests/r/lookup",
                {"Content-Type": "application/json", "Transfer-Encoding": "chunked"},
            )
        )
        _, answer = wire.send_until_answered(sock, chunked(garbage_chunks(4 * LIMIT)))
        assert_refused_as_too_large(answer)
        assert answer is not None
        assert answer.headers.get("connection") == "close"
        assert wire.closed_by_peer(sock, timeout=2)
    finally:
        sock.close()


def test_a_lying_content_length_is_cut_off(limited: ServerProcess) -> None:
    """``Content-Length: 100`` followed by 64 MiB: the server reads the 100 bytes it was told
    of (a truncated body), takes what follows for a next request, refuses it (400) and closes;
    it never reads the rest, and its peak RSS stays flat."""
    before = hwm_kib(limited)
    sock = wire.connect(limited.url)
    try:
        body = b'{"keys":["' + b"00" * 100
        sock.sendall(
            wire.head(
                "POST",
                "/v1/requests/r/lookup",
                {"Content-Type": "application/json", "Content-Length": "100"},
            )
            + body
        )
        # The app's answer to the truncated body (400 malformed_body), or uvicorn's own 400 to
        # the bytes after it, whichever the parser sends first: then it hangs up.
        first = wire.read_answer(sock)
        assert first.status == 400, first
        taken = 0
        for chunk in garbage_chunks():
            try:
                sock.sendall(chunk)
            except (BrokenPipeError, ConnectionResetError):
                break
            taken += len(chunk)
        assert taken < MAX_TAKEN, f"the server read {taken} of {TOTAL} bytes"
    finally:
        sock.close()
    assert hwm_kib(limited) - before < MAX_HWM_GROWTH_KIB
    with KVOffloadClient(limited.url, timeout=10) as c:
        assert c.ready()


@pytest.mark.parametrize("length", ["12abc", "-1", "1e3", " 5"])
def test_a_malformed_content_length_is_refused(limited: ServerProcess, length: str) -> None:
    """A ``Content-Length`` that is not a decimal number: 400 (from the HTTP parser or the
    body guard), never a 5xx."""
    sock = wire.connect(limited.url)
    try:
        sock.sendall(
            wire.head(
                "POST",
                "/v1/requests/r/lookup",
                {"Content-Type": "application/json", "Content-Length": length},
            )
            + b'{"keys":[]}'
        )
        try:
            answer = wire.read_answer(sock)
        except ConnectionError:
            return  # the parser hung up on it: refused too
        assert answer.status == 400, answer
    finally:
        sock.close()


def test_too_many_keys_or_ops_are_413_naming_the_limit(limited: ServerProcess) -> None:
    """257 keys in one op (single call or batch op), 17 ops in one batch: 413 whose code says
    which limit, nothing run."""
    keys = [i.to_bytes(4, "big") for i in range(257)]
    with KVOffloadClient(limited.url, timeout=10) as c:
        c.start_request("limits")
        for call in (
            lambda: c.lookup("limits", keys),
            lambda: c.prepare_store("limits", keys),
            lambda: c.complete_store("limits", keys),
            lambda: c.offload("limits", "kvc-none", keys, range(257)),
        ):
            with pytest.raises(KVOffloadError) as info:
                call()
            assert (info.value.status, info.value.code) == (413, "too_many_keys")
            assert "256" in info.value.message
        with pytest.raises(KVOffloadError) as info:
            c.batch(Batch().lookup("limits", keys[:1]).prepare_store("limits", keys))
        assert (info.value.status, info.value.code) == (413, "too_many_keys")
        assert info.value.message.startswith("ops.1:")
        many = Batch()
        for _ in range(17):
            many.lookup("limits", keys[:1])
        with pytest.raises(KVOffloadError) as info:
            c.batch(many)
        assert (info.value.status, info.value.code) == (413, "too_many_ops")
        assert c.lookup("limits", keys[:256]).results == ["miss"] * 256  # at the limit: fine
        c.finish_request("limits")


def test_limits_hold_for_the_unix_socket_too(limited: ServerProcess, tmp_path: Path) -> None:
    """The engine API on the Unix socket has the same body guard."""
    with (
        KVOffloadClient(uds=str(limited.uds), timeout=10) as c,
        pytest.raises(KVOffloadError) as info,
    ):
        c.lookup("r", [b"\x00" * 64] * 600)  # ~80 KiB of JSON
    assert (info.value.status, info.value.code) == (413, "body_too_large")


def test_each_route_is_held_to_its_own_cap(limited: ServerProcess) -> None:
    """A body over the lookup cap but under the global limit: 413 on its headers for lookup
    (connection closed), while the batch route, whose cap is the global limit, reads it."""
    caps = body_caps(Settings(max_body_bytes=LIMIT, max_keys_per_call=256, max_batch_ops=16))
    assert caps["lookup"] < LIMIT == caps["batch"]
    body = b'{"ops": []}'
    body += b" " * (caps["lookup"] + 1 - len(body))
    sock = wire.connect(limited.url)
    try:
        sock.sendall(
            wire.head(
                "POST",
                "/v1/requests/r/lookup",
                {"Content-Type": "application/json", "Content-Length": str(len(body))},
            )
        )
        answer = wire.read_answer(sock)
        assert_refused_as_too_large(answer)
        assert json.loads(answer.body)["error"]["message"].endswith("the limit of lookup")
        assert answer.headers.get("connection") == "close"
    finally:
        sock.close()
    r = httpx.post(
        f"{limited.url}/v1/batch",
        content=body,
        headers={"Content-Type": "application/json"},
        timeout=10,
    )
    assert (r.status_code, r.json()["error"]["code"]) == (422, "invalid_field")


def test_a_batch_of_200k_ops_is_refused_before_it_is_parsed(defaults: ServerProcess) -> None:
    """200k small ops under the default body limit: 413 ``too_many_ops`` from the count, with
    peak RSS up by a few copies of the body, and the server serves on."""
    op = {"op": "touch", "req_id": "r", "keys": []}
    body = json.dumps({"ops": [op] * 200_000}, separators=(",", ":")).encode()
    assert len(body) < 8 << 20
    before = hwm_kib(defaults)
    r = httpx.post(
        f"{defaults.url}/v1/batch",
        content=body,
        headers={"Content-Type": "application/json"},
        timeout=30,
    )
    assert (r.status_code, r.json()["error"]["code"]) == (413, "too_many_ops")
    assert r.json()["error"]["message"] == "more than 1024 ops in one call; the limit is 1024"
    assert hwm_kib(defaults) - before < MAX_BATCH_HWM_GROWTH_KIB
    with KVOffloadClient(defaults.url, timeout=10) as c:
        assert c.ready()
