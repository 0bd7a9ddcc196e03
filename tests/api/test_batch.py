"""POST /v1/batch: ops run in order, each answers on its own; one failure aborts nothing."""

from __future__ import annotations

from typing import Any

import pytest

from testsupport.api_harness import Harness, hexkeys, make_settings, running

pytestmark = pytest.mark.anyio


async def test_mixed_successes_and_failures(h: Harness) -> None:
    keys = hexkeys(1, 2)
    ops: list[Any] = [
        {"op": "start_request", "req_id": "r1"},
        {"op": "lookup", "req_id": "r1", "keys": keys},
        {"op": "prepare_load", "req_id": "r1", "keys": keys},  # 409: not stored
        {"op": "prepare_store", "req_id": "r1", "keys": keys},
        {"op": "lookup", "req_id": "ghost", "keys": keys},  # 404
        {"op": "prepare_store", "req_id": "r1", "keys": hexkeys(*range(100, 200))},  # 507
        {"op": "complete_store", "req_id": "r1", "keys": keys, "success": True},
        {"op": "lookup", "req_id": "r1", "keys": keys},
        {"op": "finish_request", "req_id": "r1", "abort": False},
    ]
    r = await h.post("/v1/batch", {"ops": ops})
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    statuses = [201, 200, 409, 200, 404, 507, 200, 200, 200]
    assert [x["status"] for x in results] == statuses
    assert [x["ok"] for x in results] == [s < 400 for s in statuses]
    assert results[1]["result"] == {"results": ["miss", "miss"], "hit_prefix": 0}
    assert results[2]["error"]["code"] == "key_not_ready"
    assert results[4]["error"]["code"] == "unknown_request"
    assert results[5]["error"]["code"] == "no_space"
    assert results[7]["result"] == {"results": ["hit", "hit"], "hit_prefix": 2}
    for x in results:
        assert ("result" in x) == x["ok"]
        assert ("error" in x) != x["ok"]


@pytest.mark.parametrize(
    ("bad_op", "where"),
    [
        ({"op": "lookup", "req_id": "r1", "keys": ["zz"]}, "ops.1"),
        ({"op": "teleport", "req_id": "r1"}, "ops.1"),
        ("not an object", "ops.1"),
        ({"op": "lookup", "keys": []}, "ops.1"),
    ],
)
async def test_one_malformed_op_refuses_the_whole_batch(
    h: Harness, bad_op: Any, where: str
) -> None:
    ops = [{"op": "start_request", "req_id": "r9"}, bad_op]
    r = await h.post("/v1/batch", {"ops": ops})
    assert r.status_code == 422, r.text
    assert r.json()["error"]["message"].startswith(where)
    r = await h.post("/v1/requests/r9/lookup", {"keys": []})
    assert r.status_code == 404  # the valid op before it did not run either


async def test_batch_answers_match_the_single_routes(h: Harness) -> None:
    await h.start()
    await h.post("/v1/requests/r1/prepare-store", {"keys": hexkeys(1)})
    single = await h.post("/v1/requests/r1/lookup", {"keys": hexkeys(1, 2)})
    r = await h.post(
        "/v1/batch", {"ops": [{"op": "lookup", "req_id": "r1", "keys": hexkeys(1, 2)}]}
    )
    assert r.json()["results"][0]["result"] == single.json()


async def test_offload_and_onload_in_a_batch(h: Harness) -> None:
    _, cache_id = await h.device()
    r = await h.post(
        "/v1/batch",
        {
            "ops": [
                {"op": "start_request", "req_id": "r1"},
                {
                    "op": "offload",
                    "req_id": "r1",
                    "cache_id": cache_id,
                    "keys": hexkeys(1),
                    "device_blocks": [0],
                },
            ]
        },
    )
    offload = r.json()["results"][1]
    assert offload["status"] == 202
    await h.wait(offload["result"]["job_id"])
    r = await h.post(
        "/v1/batch",
        {
            "ops": [
                {
                    "op": "onload",
                    "req_id": "r1",
                    "cache_id": cache_id,
                    "keys": hexkeys(1),
                    "device_blocks": [5],
                }
            ]
        },
    )
    assert r.json()["results"][0]["status"] == 202


@pytest.mark.parametrize(
    ("raw", "status"),
    [
        (b"{", 400),
        (b"[]", 422),
        (b"{}", 422),
        (b'{"ops": []}', 422),
        (b'{"ops": "lookup"}', 422),
        (b'{"ops": [], "extra": 1}', 422),
    ],
)
async def test_envelope_errors_fail_the_call(h: Harness, raw: bytes, status: int) -> None:
    r = await h.client.post("/v1/batch", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text


async def test_too_many_ops_is_413() -> None:
    async with running(make_settings(max_batch_ops=3)) as h:
        ops = [{"op": "lookup", "req_id": "r1", "keys": []}] * 4
        r = await h.post("/v1/batch", {"ops": ops})
        assert (r.status_code, r.json()["error"]["code"]) == (413, "too_many_ops")


async def test_too_many_keys_in_one_op_refuses_the_batch(h: Harness) -> None:
    await h.start()
    limit = h.settings.max_keys_per_call
    ops = [
        {"op": "lookup", "req_id": "r1", "keys": hexkeys(1)},
        {"op": "lookup", "req_id": "r1", "keys": hexkeys(*range(limit + 1), width=2)},
    ]
    r = await h.post("/v1/batch", {"ops": ops})
    assert (r.status_code, r.json()["error"]["code"]) == (413, "too_many_keys")
    assert r.json()["error"]["message"].startswith("ops.1:")


async def test_call_info_records_each_op(h: Harness) -> None:
    await h.start()
    ops = [
        {"op": "lookup", "req_id": "r1", "keys": []},
        {"op": "lookup", "req_id": "nobody", "keys": []},
        {"op": "touch", "req_id": "r1", "keys": []},
    ]
    await h.post("/v1/batch", {"ops": ops})
    info = h.calls[-1]
    assert info.op == "batch"
    assert info.status == 200
    assert info.ops == [("lookup", 200), ("lookup", 404), ("touch", 200)]
