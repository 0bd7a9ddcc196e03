"""POST /v1/batch lets other calls run while it works (issue #42, finding 10): a large body is
validated one op at a time and the ops run with yields to the loop between them, with the same
ops, answers and refusals as a body validated whole. How long the loop is held is measured in
``bench/batch_flood.py``, not here."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest
import uvicorn

import app.core.slices as slices
import app.http.routes.engine as engine
from app.http.errors import APIError
from app.http.routes.engine import _BatchRunner
from testsupport.api_harness import Harness, hexkeys, make_settings, running
from testsupport.ports import free_port

pytestmark = pytest.mark.anyio


@pytest.fixture
def every_op_yields(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every body validated op by op, a yield after every op (the thresholds at zero)."""
    monkeypatch.setattr(engine, "SPLIT_ABOVE_BYTES", 0)
    monkeypatch.setattr(slices, "YIELD_AFTER_S", 0.0)


async def ticking() -> tuple[list[int], Callable[[], object]]:
    """A coroutine that counts the loop's turns it gets; (its count, a stop)."""
    count = [0]

    async def tick() -> None:
        while True:
            count[0] += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(tick())
    await asyncio.sleep(0)
    return count, task.cancel


async def test_a_batch_yields_to_the_loop_between_its_ops(
    h: Harness, every_op_yields: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    await h.start()
    count, stop = await ticking()
    seen: list[int] = []
    touch = h.service.manager.touch

    def counting_touch(*args: Any, **kwargs: Any) -> None:
        seen.append(count[0])
        touch(*args, **kwargs)

    monkeypatch.setattr(h.service.manager, "touch", counting_touch)
    ops = [{"op": "touch", "req_id": "r1", "keys": hexkeys(i)} for i in range(5)]
    r = await h.post("/v1/batch", {"ops": ops})
    stop()
    assert r.status_code == 200, r.text
    assert len(seen) == 5
    # Another coroutine ran between every two ops (before: all five in one loop turn).
    assert all(b > a for a, b in itertools.pairwise(seen))


async def test_a_call_arriving_during_a_batch_ends_before_the_batch_goes_on(
    h: Harness, every_op_yields: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over a real uvicorn, a lookup sent while a batch runs ends within one of the batch's
    slices: the batch gives way for several loop turns, not one (a call takes a few turns:
    read, route, answer; with one turn a slice it waited one slice a turn)."""
    await h.start()
    ran: list[int] = []
    touch = h.service.manager.touch

    def heavy_touch(*args: Any, **kwargs: Any) -> None:
        time.sleep(0.005)  # an op that holds the loop, as one of 8,192 keys does
        ran.append(1)
        touch(*args, **kwargs)

    monkeypatch.setattr(h.service.manager, "touch", heavy_touch)
    port = free_port()
    config = uvicorn.Config(h.app, host="127.0.0.1", port=port, log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    serving = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    url = f"http://127.0.0.1:{port}"
    ops = [{"op": "touch", "req_id": "r1", "keys": hexkeys(i)} for i in range(80)]
    waited: list[int] = []

    def lookups() -> None:  # another client, in a thread: its own turns are not the loop's
        with httpx.Client(base_url=url) as c:
            c.post("/v1/requests/r1/lookup", json={"keys": hexkeys(1)})  # connected, warm
            while not ran:
                time.sleep(0.001)
            for _ in range(7):
                before = len(ran)
                c.post("/v1/requests/r1/lookup", json={"keys": hexkeys(1)}).raise_for_status()
                waited.append(len(ran) - before)

    try:
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            batch = asyncio.create_task(client.post("/v1/batch", json={"ops": ops}))
            await asyncio.to_thread(lookups)
            assert (await batch).status_code == 200
    finally:
        server.should_exit = True
        await serving
    assert len(ran) == 80
    # Each lookup ended within the slice it arrived in (before: three slices). The median, so
    # that a client thread the OS ran late once does not decide.
    assert sorted(waited)[len(waited) // 2] <= 1, waited


async def test_a_large_body_is_validated_with_yields_between_its_ops(
    every_op_yields: None,
) -> None:
    runner = _BatchRunner(make_settings(max_keys_per_call=64))
    body = json.dumps(
        {"ops": [{"op": "lookup", "req_id": f"r{i}", "keys": hexkeys(i, i + 1)} for i in range(6)]}
    ).encode()
    count, stop = await ticking()
    before = count[0]
    ops = await runner.validated_yielding(body)
    turns = count[0] - before
    stop()
    assert ops == runner.validated(body)
    assert turns >= len(ops) - 1


def refusal(call: Callable[[], Any]) -> tuple[int, str, str]:
    with pytest.raises(APIError) as err:
        call()
    return err.value.status, err.value.code, err.value.message


async def split_refusal(runner: _BatchRunner, raw: bytes) -> tuple[int, str, str]:
    with pytest.raises(APIError) as err:
        await runner.validated_yielding(raw)
    return err.value.status, err.value.code, err.value.message


GOOD = {"op": "lookup", "req_id": "r1", "keys": ["00aa"]}


@pytest.mark.parametrize(
    "raw",
    [
        b"{",
        b"[]",
        b"{}",
        b'{"ops": []}',
        b'{"ops": "lookup"}',
        b'{"ops": [], "extra": 1}',
        b'{"ops": [{"op": "lookup", "req_id": "r1", "keys": ["00"]}], "extra": 1}',
        b'{"ops": [{"op": "lookup", "req_id": "r1", "keys": ["00"]} {"op": "touch"}]}',
        b'{"ops": [{"op": "lookup", "req_id": "r1", "keys": ["00"]}, ',
        b'{"ops": [{"op": "lookup", "req_id": "r1", "keys": ["00"]}, {"op": "lookup", "k',
        json.dumps({"ops": [GOOD, {"op": "lookup", "req_id": "r1", "keys": ["zz"]}]}).encode(),
        json.dumps({"ops": [GOOD, {"op": "teleport", "req_id": "r1"}]}).encode(),
        json.dumps({"ops": [GOOD, "not an object"]}).encode(),
        json.dumps({"ops": [GOOD, {"op": "lookup", "keys": []}]}).encode(),
        json.dumps({"ops": [GOOD, {"op": "lookup", "req_id": "r1", "keys": [], "x": 1}]}).encode(),
        json.dumps({"ops": [GOOD, {**GOOD, "keys": ["00"] * 65}]}).encode(),
        json.dumps({"ops": [GOOD] * 5}).encode(),
        b'{"ops": [{"op": "lookup", "req_id": "r1", "keys": [NaN]}]}',
        b'\xff{"ops": []}',
    ],
)
async def test_validated_op_by_op_refuses_as_the_whole_body_does(
    every_op_yields: None, raw: bytes
) -> None:
    runner = _BatchRunner(make_settings(max_keys_per_call=64, max_batch_ops=4))
    assert await split_refusal(runner, raw) == refusal(lambda: runner.validated(raw))


async def test_a_large_answer_is_sent_in_pieces_with_the_loop_given_way_between(
    every_op_yields: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over a real uvicorn, the answer of 8 stores of 2,048 keys (about 400 kB) is sent as it
    was made, in pieces of ``ANSWER_PIECE_BYTES``, the loop turning between them; the client
    reads one answer of its ``content-length``, each op's result whole and in order."""
    monkeypatch.setattr(engine, "ANSWER_PIECE_BYTES", 64 << 10)
    keys = [hexkeys(*range(j * 2048, (j + 1) * 2048)) for j in range(8)]
    ops: list[dict[str, Any]] = [{"op": "prepare_store", "req_id": "r1", "keys": k} for k in keys]
    ops.append({"op": "touch", "req_id": "missing", "keys": keys[0][:1]})  # an error's piece
    sends: list[tuple[int, int]] = []  # (body bytes, loop turns so far) of each body message
    call = engine.PiecesResponse.__call__
    count = [0]

    async def watched(self: engine.PiecesResponse, scope: Any, receive: Any, send: Any) -> None:
        async def watching(message: Any) -> None:
            if message["type"] == "http.response.body":
                sends.append((len(message["body"]), count[0]))
            await send(message)

        await call(self, scope, receive, watching)

    monkeypatch.setattr(engine.PiecesResponse, "__call__", watched)
    settings = make_settings(num_blocks=1 << 15, max_keys_per_call=2048, max_body_bytes=8 << 20)
    async with running(settings) as h:
        await h.start()
        count, stop = await ticking()
        port = free_port()
        server = uvicorn.Server(
            uvicorn.Config(h.app, host="127.0.0.1", port=port, log_level="warning", lifespan="off")
        )
        serving = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.01)
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as c:
                r = await c.post("/v1/batch", json={"ops": ops})
        finally:
            server.should_exit = True
            await serving
            stop()
    assert r.status_code == 200
    assert int(r.headers["content-length"]) == len(r.content) > 400_000
    results = r.json()["results"]
    assert [x["status"] for x in results] == [200] * 8 + [404]
    assert results[8]["error"]["code"] == "unknown_request"
    for j, result in enumerate(results[:8]):
        assert result["result"]["keys_to_store"] == keys[j]
        assert len(result["result"]["slots"]) == 2048
    assert sum(size for size, _ in sends) == len(r.content)
    # Ops' answers grouped to at least a piece a message (one op's answer is never split).
    assert len(sends) >= 4
    assert all(size >= 64 << 10 for size, _ in sends[:-1])
    turns = [t for _, t in sends]
    assert turns[-1] > turns[0]  # other callbacks ran while the answer was going out
