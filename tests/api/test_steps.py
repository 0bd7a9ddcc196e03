"""A body's long lists are validated in steps (``app.http.steps``, issue #42, finding 10): the
same body as a whole validation, and for a body with one error the same refusal, for every
body that carries long lists (keys, token_ids, device_blocks), alone and in a batch."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Generator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import app.core.background as background
import app.core.observed as observed
import app.core.slices as slices
import app.http.operations as operations
import app.http.routes.engine as engine
import app.http.steps as steps
from app.http import schemas as s
from app.http.errors import APIError
from app.http.routes.engine import _BatchRunner
from app.http.routes.raw import body_parser
from manager import OffloadManager, create_manager
from testsupport.api_harness import hexkeys, make_settings

pytestmark = pytest.mark.anyio

PIECE = 3  # items a step, so that short lists are long here


@pytest.fixture(autouse=True)
def small_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(steps, "STEP_ITEMS", PIECE)
    monkeypatch.setattr(engine, "SPLIT_ABOVE_BYTES", 0)


def drive(gen: Generator[None, None, Any]) -> tuple[int, Any]:
    """Run ``gen`` to its end; (the steps it took, what it returned)."""
    count = 0
    while True:
        try:
            next(gen)
        except StopIteration as end:
            return count, end.value
        count += 1


def outcome(call: Any) -> Any:
    """What ``call()`` returns, or its refusal as (status, code, message)."""
    try:
        return call()
    except APIError as err:
        return (err.status, err.code, err.message)


KINDS: dict[str, type[s.Body]] = {
    "touch": s.KeysBody,
    "prepare_store": s.PrepareStoreBody,
    "offload": s.OffloadBody,
}

# Each replaces one item of one list, or one field, with something wrong.
BAD_ITEMS = {
    "keys": ["zz", "0", "", "00" * 65, 7, None, ["00"]],
    "token_ids": [-1, 2**32, "1", 1.5, True],
    "device_blocks": [-1, 2**31, "3", 2.0, False],
}


@st.composite
def bodies(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    """A body of one kind with long lists, valid or with exactly one thing wrong."""
    kind = draw(st.sampled_from(sorted(KINDS)))
    n = draw(st.integers(PIECE + 1, 4 * PIECE + 2))
    body: dict[str, Any] = {"keys": [f"{i:04x}" for i in range(n)]}
    if kind != "touch":
        size = draw(st.integers(1, 3))
        body["token_ids"] = list(range(n * size))
        body["block_size"] = size
    if kind == "offload":
        body["cache_id"] = "c"
        body["device_blocks"] = list(range(n))
    fault = draw(st.sampled_from(["none", "item", "length", "field"]))
    if fault == "item":
        name = draw(st.sampled_from([k for k in BAD_ITEMS if k in body]))
        at = draw(st.integers(0, len(body[name]) - 1))
        body[name][at] = draw(st.sampled_from(BAD_ITEMS[name]))
    elif fault == "length" and kind != "touch":  # a list one short of what the keys need
        name = draw(st.sampled_from([k for k in ("token_ids", "device_blocks") if k in body]))
        body[name] = body[name][:-1]
    elif fault == "field":
        body[draw(st.sampled_from(["extra", "block_size"]))] = "x"
    return kind, body


@settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(bodies())
def test_a_body_validated_in_steps_is_the_body_validated_whole(
    small_steps: None, case: tuple[str, dict[str, Any]]
) -> None:
    kind, body = case
    model = KINDS[kind]
    raw = json.dumps(body).encode()
    whole = outcome(lambda: body_parser(model)(raw))
    stepped = outcome(lambda: drive(steps.OpParser(model).body_steps(raw))[1])
    assert stepped == whole


@settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(st.lists(bodies(), min_size=1, max_size=3))
async def test_a_batch_validated_in_steps_is_the_batch_validated_whole(
    small_steps: None, cases: list[tuple[str, dict[str, Any]]]
) -> None:
    runner = _BatchRunner(make_settings(max_keys_per_call=64))
    ops = [{"op": kind, "req_id": f"r{i}", **body} for i, (kind, body) in enumerate(cases)]
    raw = json.dumps({"ops": ops}).encode()
    whole = outcome(lambda: runner.validated(raw))
    stepped: Any
    try:
        stepped = await runner.validated_yielding(raw)
    except APIError as err:
        stepped = (err.status, err.code, err.message)
    assert stepped == whole


def test_a_long_list_takes_one_step_a_piece() -> None:
    keys = [f"{i:04x}" for i in range(10 * PIECE)]
    count, body = drive(steps.OpParser(s.KeysBody).body_steps(json.dumps({"keys": keys}).encode()))
    assert body.keys == [bytes.fromhex(k) for k in keys]
    assert count >= 10


def test_a_short_body_is_validated_in_one_step() -> None:
    raw = json.dumps({"keys": ["00", "01"]}).encode()
    assert drive(steps.OpParser(s.KeysBody).body_steps(raw)) == (0, s.KeysBody(keys=[b"\0", b"\1"]))


@pytest.mark.parametrize("raw", [b'{"keys": ["00"]} x', b"\xff{}", b'{"keys": ['])
def test_a_large_body_that_is_not_json_is_refused_as_such(raw: bytes) -> None:
    assert outcome(lambda: drive(steps.OpParser(s.KeysBody).body_steps(raw))) == (
        400,
        "malformed_body",
        "request body is not valid JSON",
    )


async def test_a_large_batch_of_another_shape_is_refused_without_validating_it_whole(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Past ``WHOLE_AT_MOST_BYTES``, a body that is not ``{"ops": [...]}`` alone is refused as
    it is read: its whole validation would hold the loop as long as the body is large."""
    monkeypatch.setattr(engine, "WHOLE_AT_MOST_BYTES", 64)
    runner = _BatchRunner(make_settings())
    op = {"op": "touch", "req_id": "r", "keys": ["00"] * 20}
    for raw in (
        json.dumps({"extra": 1, "ops": [op]}).encode(),
        json.dumps({"ops": [op], "extra": 1}).encode(),
        json.dumps([op] * 3).encode(),
    ):
        with pytest.raises(APIError) as err:
            await runner.validated_yielding(raw)
        assert err.value.status == 422
        assert "must be" in err.value.message
    with pytest.raises(APIError) as err:
        await runner.validated_yielding(json.dumps({"ops": [op]}).encode() + b"\xff")
    assert err.value.status == 400


@pytest.mark.parametrize("route", ["single", "batch"])
async def test_a_large_call_gives_way_and_is_one_call_to_the_others(
    h: Any, monkeypatch: pytest.MonkeyPatch, route: str
) -> None:
    """A store of 12 keys, in steps of 2 with the loop given way between them: other calls
    run meanwhile (a coroutine counts loop turns), and one that enters the namespace's
    manager while the store is suspended finds it whole (all 12 pending), not half done; the
    store's answer is the one a whole call gives."""
    monkeypatch.setattr(operations, "STEP_KEYS", 2)
    monkeypatch.setattr(observed, "STEP_KEYS", 2)
    monkeypatch.setattr(slices, "YIELD_AFTER_S", 0.0)
    await h.start()
    keys = hexkeys(*range(12))
    manager = h.service.pool_manager
    seen: list[int] = []

    async def other_calls() -> None:
        for _ in range(200):
            await asyncio.sleep(0)
            if type(manager) is not OffloadManager:  # the store is between two steps
                r = await h.post("/v1/requests/r1/lookup", {"keys": keys})
                seen.append(r.json()["results"].count("pending"))
                return

    looker = asyncio.create_task(other_calls())
    if route == "single":
        r = await h.post("/v1/requests/r1/prepare-store", {"keys": keys})
        answer = r.json()
    else:
        r = await h.post(
            "/v1/batch", {"ops": [{"op": "prepare_store", "req_id": "r1", "keys": keys}]}
        )
        answer = r.json()["results"][0]["result"]
    await looker
    assert r.status_code == 200, r.text
    assert seen == [12]  # whole: the lookup came in while the store was suspended
    assert answer["keys_to_store"] == keys
    assert answer["slots"] == list(range(12))


@pytest.mark.parametrize("window", [1, 3, 7, 64, 1 << 20])
async def test_a_batch_is_read_op_by_op_through_windows_of_any_size(
    monkeypatch: pytest.MonkeyPatch, window: int
) -> None:
    """Each op is found by decoding a window of the body from the op (doubled until the op
    fits), never the whole body: the same ops whatever the window, with characters of several
    bytes (a request id in UTF-8) cut at a window's edge."""
    monkeypatch.setattr(steps, "WINDOW_BYTES", window)
    runner = _BatchRunner(make_settings(max_keys_per_call=64))
    ops = [
        {"op": "touch", "req_id": "r-é-😀-" + str(i), "keys": [f"{j:04x}" for j in range(i)]}
        for i in range(1, 9)
    ]
    raw = json.dumps({"ops": ops}, ensure_ascii=False).encode()
    assert await runner.validated_yielding(raw) == runner.validated(raw)
    with pytest.raises(APIError) as err:  # cut short inside the last op: not JSON
        await runner.validated_yielding(raw[:-5])
    assert err.value.status == 400


def test_a_long_list_of_plain_elements_is_kept_as_its_text_in_pieces() -> None:
    """Hex keys and integers are left as their JSON text, a piece of ``STEP_ITEMS`` elements
    a step (no Python object per element until each piece is validated); a list with any other
    element is decoded whole by the C decoder, as ``json`` does."""
    keys = [f"{i:04x}" for i in range(10)]
    raw = json.dumps({"op": "touch", "req_id": "r", "keys": keys, "token_ids": [1, 2]}).encode()
    count, (value, text, end) = drive(steps.value_at(raw, 0))
    assert (text, end) == (raw.decode(), len(raw))
    assert isinstance(value["keys"], steps.ListText)
    assert [n for _, n in value["keys"].pieces] == [3, 3, 3, 1]
    assert json.loads("[" + ",".join(p for p, _ in value["keys"].pieces) + "]") == keys
    assert count >= 3  # a step a piece
    odd = json.dumps({"op": "touch", "keys": [*keys[:5], None]}).encode()
    odd = odd.replace(b"null", b'null, "0\\u0030"')  # an escape: not plain either
    _, (value, _, _) = drive(steps.value_at(odd, 0))
    assert value["keys"] == [*keys[:5], None, "00"]


async def test_housekeeping_waits_for_a_suspended_call_instead_of_settling_it() -> None:
    """The lease sweep waits (``unsuspended``) while a large call is between its steps: the
    call's caller resumes it, and its rest is never run whole by the sweep."""
    manager = create_manager(4)
    ran: list[str] = []
    manager.suspend(lambda: ran.append("rest"))

    async def resume_soon() -> None:
        for _ in range(5):
            await asyncio.sleep(0)
        assert manager.resume()

    task = asyncio.create_task(resume_soon())
    await background.unsuspended(manager, 60.0)
    await task
    assert ran == []
    assert not manager.suspended


async def test_housekeeping_waits_no_longer_than_its_patience() -> None:
    manager = create_manager(4)
    manager.suspend(lambda: None)
    await background.unsuspended(manager, 0.01)
    assert manager.suspended  # the sweep goes on and settles it


async def test_a_call_in_steps_waits_for_another_rather_than_run_its_rest(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two calls in steps on one manager at once (a large engine call and the sweep's expiry,
    say): the second waits for the first to go on rather than settle it, so neither call's
    steps run inside the other's (one long step); both end with their own outcome."""
    monkeypatch.setattr(slices, "YIELD_AFTER_S", 0.0)
    manager = create_manager(4)
    ran: list[tuple[str, str]] = []

    def steps(name: str) -> Generator[None, None, str]:
        for _ in range(4):
            manager.stats()  # an entry: it would settle a suspended call
            task = asyncio.current_task()
            ran.append((name, "" if task is None else task.get_name()))
            yield
        return name

    calls = [
        asyncio.create_task(slices.Slices().run(steps(name), manager), name=name)
        for name in ("a", "b")
    ]
    assert await asyncio.gather(*calls) == ["a", "b"]
    assert sorted(ran) == [("a", "a")] * 4 + [("b", "b")] * 4, ran  # each in its own task
    assert not manager.suspended
