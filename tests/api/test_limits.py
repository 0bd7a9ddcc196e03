"""Body size limits at the edges (``app/limits.py``), in process.

- Each route's byte cap lets its largest legitimate body through: the most keys, every key at
  its longest in upper-case hex, block indexes and job ids at their largest, string fields at
  their longest written as escaped surrogate pairs, ``kv_transfer_params`` at its cap written
  with ``\\u`` escapes, all pretty-printed; one key or op more is 413 (``too_many_*``), one
  byte over the cap is 413 ``body_too_large`` naming the route, announced or chunked.
- ``kv_transfer_params`` over ``max_transfer_params_bytes`` (compact JSON) or nested deeper
  than the limit is 413 ``transfer_params_too_large`` and nothing changes: the request is not
  started, a batch runs none of its ops.
- A batch with more ops than allowed is refused before the body is parsed: ops past the limit
  may be garbage and the answer is still 413 ``too_many_ops``.
- Lists fail fast: thousands of invalid items make one error, not thousands.
- Admin bodies have a small cap; routes that read no body a tiny one.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from app.http.limits import MAX_TRANSFER_PARAMS_DEPTH, body_caps
from testsupport.api_harness import Harness, make_settings, running

pytestmark = pytest.mark.anyio

KEYS = 64
OPS = 4
PARAMS = 2048
JSON_TYPE = {"content-type": "application/json"}
# The widest character: four bytes of UTF-8, twelve as an escaped surrogate pair.
WIDE = "\U0001f600"


@pytest.fixture
async def small() -> AsyncIterator[Harness]:
    """Limits small enough that each route's derived cap is below ``max_body_bytes``."""
    settings = make_settings(
        num_blocks=2 * KEYS,
        max_keys_per_call=KEYS,
        max_batch_ops=OPS,
        max_transfer_params_bytes=PARAMS,
        max_body_bytes=8 << 20,
    )
    async with running(settings) as harness:
        yield harness


def longest_keys(n: int, start: int = 0) -> list[str]:
    """``n`` distinct keys of ``MAX_KEY_BYTES`` bytes in upper-case hex."""
    return [(start + i).to_bytes(64, "big").hex().upper() for i in range(n)]


def params_of_size(size: int) -> dict[str, Any]:
    """``kv_transfer_params`` whose compact JSON is exactly ``size`` bytes, mostly of wide
    characters (three times as long on the wire with ``ensure_ascii``)."""
    wide, narrow = divmod(size - len('{"p":""}'), 4)
    params = {"p": WIDE * wide + "a" * narrow}
    assert len(json.dumps(params, separators=(",", ":"), ensure_ascii=False).encode()) == size
    return params


def nested(depth: int) -> dict[str, Any]:
    """An object ``depth`` levels deep (alternating objects and lists)."""
    value: Any = 1
    for level in range(depth - 1):
        value = [value] if level % 2 else {"n": value}
    return {"n": value}


def pretty(body: Any) -> bytes:
    """Pretty-printed, escaped JSON: the longest spelling a common encoder writes."""
    return json.dumps(body, indent=4).encode()


async def post_raw(client: httpx.AsyncClient, path: str, raw: bytes) -> httpx.Response:
    return await client.post(path, content=raw, headers=JSON_TYPE)


async def put_raw(client: httpx.AsyncClient, path: str, raw: bytes) -> httpx.Response:
    return await client.put(path, content=raw, headers=JSON_TYPE)


def code(r: httpx.Response) -> tuple[int, str]:
    return r.status_code, r.json()["error"]["code"]


# --------------------------------------------------------------------------- byte caps


async def test_the_largest_legitimate_body_of_each_route_is_accepted(small: Harness) -> None:
    h = small
    r = await put_raw(
        h.client, "/v1/requests/r1", pretty({"kv_transfer_params": params_of_size(PARAMS)})
    )
    assert r.status_code == 201, r.text
    keys = longest_keys(KEYS)
    for op in ("lookup", "touch", "prepare-store"):
        r = await post_raw(h.client, f"/v1/requests/r1/{op}", pretty({"keys": keys}))
        assert r.status_code == 200, (op, r.text)
    r = await post_raw(
        h.client, "/v1/requests/r1/complete-store", pretty({"keys": keys, "success": False})
    )
    assert r.status_code == 200, r.text
    transfer = {"cache_id": WIDE * 256, "keys": keys, "device_blocks": [2**31 - 1] * KEYS}
    for op in ("offload", "onload"):
        r = await post_raw(h.client, f"/v1/requests/r1/{op}", pretty(transfer))
        assert code(r) == (404, "unknown_cache"), (op, r.text)  # past the guard and the parser
    r = await post_raw(h.client, "/v1/jobs/wait", pretty({"job_ids": [2**64 - 1] * 4096}))
    assert code(r) == (404, "unknown_job"), r.text


async def test_the_largest_legitimate_batch_is_accepted(small: Harness) -> None:
    h = small
    req_id = WIDE * 256
    keys = longest_keys(KEYS)
    ops = [
        {"op": "start_request", "req_id": req_id, "kv_transfer_params": params_of_size(PARAMS)},
        {"op": "lookup", "req_id": req_id, "keys": keys},
        {
            "op": "offload",
            "req_id": req_id,
            "cache_id": WIDE * 256,
            "keys": keys,
            "device_blocks": [2**31 - 1] * KEYS,
        },
        {"op": "complete_store", "req_id": req_id, "keys": keys, "success": True},
    ]
    assert len(ops) == OPS
    r = await post_raw(h.client, "/v1/batch", pretty({"ops": ops}))
    assert r.status_code == 200, r.text
    assert [res["status"] for res in r.json()["results"]] == [201, 200, 404, 200]
    r = await post_raw(h.client, "/v1/batch", pretty({"ops": [*ops, ops[1]]}))
    assert code(r) == (413, "too_many_ops")


async def test_one_key_too_many_is_413(small: Harness) -> None:
    h = small
    await h.start()
    r = await post_raw(h.client, "/v1/requests/r1/lookup", pretty({"keys": longest_keys(KEYS + 1)}))
    assert code(r) == (413, "too_many_keys")
    ops = [{"op": "lookup", "req_id": "r1", "keys": longest_keys(KEYS + 1)}]
    r = await post_raw(h.client, "/v1/batch", pretty({"ops": ops}))
    assert code(r) == (413, "too_many_keys")


@pytest.mark.parametrize("chunked", [False, True])
async def test_a_body_one_byte_over_its_route_cap_is_413(small: Harness, chunked: bool) -> None:
    """Up to the cap (a valid body padded with whitespace) the call is served; one byte more is
    413 ``body_too_large`` naming the route, announced or streamed."""
    h = small
    await h.start()
    cap = body_caps(h.settings)["lookup"]
    assert cap < h.settings.max_body_bytes
    valid = json.dumps({"keys": longest_keys(2)}).encode()

    async def send(raw: bytes) -> httpx.Response:
        if not chunked:
            return await post_raw(h.client, "/v1/requests/r1/lookup", raw)

        async def chunks() -> AsyncIterator[bytes]:
            for i in range(0, len(raw), 4096):
                yield raw[i : i + 4096]

        return await h.client.post("/v1/requests/r1/lookup", content=chunks(), headers=JSON_TYPE)

    r = await send(valid + b" " * (cap - len(valid)))
    assert r.status_code == 200, r.text
    r = await send(valid + b" " * (cap - len(valid) + 1))
    assert code(r) == (413, "body_too_large")
    assert r.json()["error"]["message"] == (
        f"request body exceeds {cap} bytes, the limit of lookup"
    )
    assert r.headers["connection"] == "close"


async def test_every_body_route_is_held_to_its_own_cap(small: Harness) -> None:
    """Each route refuses a body one byte over its cap (announced length); the caps differ."""
    h = small
    caps = body_caps(h.settings)
    engine = {
        "start_request": ("PUT", "/v1/requests/r1"),
        "lookup": ("POST", "/v1/requests/r1/lookup"),
        "complete_store": ("POST", "/v1/requests/r1/complete-store"),
        "offload": ("POST", "/v1/requests/r1/offload"),
        "finish_request": ("DELETE", "/v1/requests/r1"),
        "batch": ("POST", "/v1/batch"),
        "wait_jobs": ("POST", "/v1/jobs/wait"),
        "register_kv_cache": ("POST", "/v1/kv-caches"),
        "unregister_kv_cache": ("DELETE", "/v1/kv-caches/kvc-x"),
    }
    admin = {
        "admin_put_policy": ("PUT", "/admin/v1/policy"),
        "admin_put_log_level": ("PUT", "/admin/v1/log-level"),
        "admin_release": ("POST", "/admin/v1/requests/r1/release"),
        "admin_clear": ("POST", "/admin/v1/cache/clear"),
    }
    for client, table in ((h.client, engine), (h.admin, admin)):
        for name, (method, path) in table.items():
            raw = b" " * (caps[name] + 1)
            r = await client.request(method, path, content=raw, headers=JSON_TYPE)
            assert code(r) == (413, "body_too_large"), (name, r.text)
            assert r.json()["error"]["message"].endswith(f"{caps[name]} bytes, the limit of {name}")
    assert caps["admin_put_policy"] == 64 << 10
    assert caps["admin_clear"] == caps["finish_request"] == 1 << 10


async def test_admin_bodies_within_their_cap_are_served(small: Harness) -> None:
    r = await small.admin.put("/admin/v1/policy", json={"name": "lru", "params": {}})
    assert r.status_code == 200, r.text
    r = await small.admin.post("/admin/v1/cache/clear", json={})
    assert r.status_code == 200, r.text


async def test_an_unknown_path_is_held_to_max_body_bytes(small: Harness) -> None:
    r = await small.client.post(
        "/v1/nowhere", content=b" " * (small.settings.max_body_bytes + 1), headers=JSON_TYPE
    )
    assert code(r) == (413, "body_too_large")
    assert r.json()["error"]["message"] == (
        f"request body exceeds {small.settings.max_body_bytes} bytes"
    )
    r = await small.client.post("/v1/nowhere", content=b" " * 4096, headers=JSON_TYPE)
    assert r.status_code == 404


# --------------------------------------------------------------------------- kv_transfer_params


async def test_transfer_params_at_the_cap_are_kept_one_byte_more_is_413(small: Harness) -> None:
    h = small
    r = await h.client.put("/v1/requests/ok", json={"kv_transfer_params": params_of_size(PARAMS)})
    assert r.status_code == 201, r.text
    r = await h.client.put(
        "/v1/requests/big", json={"kv_transfer_params": params_of_size(PARAMS + 1)}
    )
    assert code(r) == (413, "transfer_params_too_large")
    assert r.json()["error"]["message"] == (
        f"kv_transfer_params is {PARAMS + 1} bytes as compact JSON; the limit is {PARAMS} "
        "(max_transfer_params_bytes)"
    )
    # Nothing changed: the request was not started.
    live = (await h.admin.get("/admin/v1/requests")).json()["requests"]
    assert [req["req_id"] for req in live] == ["ok"]
    r = await h.post("/v1/requests/big/lookup", {"keys": []})
    assert code(r) == (404, "unknown_request")


async def test_transfer_params_nested_too_deep_are_413(small: Harness) -> None:
    h = small
    r = await h.client.put(
        "/v1/requests/deep", json={"kv_transfer_params": nested(MAX_TRANSFER_PARAMS_DEPTH)}
    )
    assert r.status_code == 201, r.text
    r = await h.client.put(
        "/v1/requests/deeper", json={"kv_transfer_params": nested(MAX_TRANSFER_PARAMS_DEPTH + 1)}
    )
    assert code(r) == (413, "transfer_params_too_large")
    assert str(MAX_TRANSFER_PARAMS_DEPTH) in r.json()["error"]["message"]
    r = await h.post("/v1/requests/deeper/lookup", {"keys": []})
    assert code(r) == (404, "unknown_request")


async def test_a_batch_with_too_large_transfer_params_runs_nothing(small: Harness) -> None:
    h = small
    ops = [
        {"op": "start_request", "req_id": "first"},
        {
            "op": "start_request",
            "req_id": "second",
            "kv_transfer_params": params_of_size(PARAMS + 1),
        },
    ]
    r = await h.post("/v1/batch", {"ops": ops})
    assert code(r) == (413, "transfer_params_too_large")
    assert r.json()["error"]["message"].startswith("ops.1: kv_transfer_params is")
    assert (await h.admin.get("/admin/v1/requests")).json()["requests"] == []


# --------------------------------------------------------------------------- batch op count


async def test_too_many_ops_are_refused_before_the_body_is_parsed(small: Harness) -> None:
    """One op past the limit, then bytes that are not JSON: the count stops at the extra op, so
    the answer is 413 ``too_many_ops``, not the 400 a parse would give."""
    h = small
    op = json.dumps({"op": "touch", "req_id": "r1", "keys": []})
    raw = ('{"ops": [' + ", ".join([op] * (OPS + 1)) + ", this is not JSON").encode()
    r = await post_raw(h.client, "/v1/batch", raw)
    assert code(r) == (413, "too_many_ops")
    assert r.json()["error"]["message"] == f"more than {OPS} ops in one call; the limit is {OPS}"
    r = await post_raw(h.client, "/v1/batch", raw.replace(b", this is not JSON", b"]}"))
    assert code(r) == (413, "too_many_ops")
    # At the limit, the same garbage is the parser's to refuse.
    raw = ('{"ops": [' + ", ".join([op] * OPS) + ", this is not JSON").encode()
    assert code(await post_raw(h.client, "/v1/batch", raw)) == (400, "malformed_body")


async def test_a_flood_of_non_ops_is_refused_by_its_count() -> None:
    async with running(make_settings(max_batch_ops=16)) as h:
        for item in ("1", "[]", "{}", "null"):
            raw = ('{"ops": [' + ",".join([item] * 10_000) + "]}").encode()
            r = await post_raw(h.client, "/v1/batch", raw)
            assert code(r) == (413, "too_many_ops"), item


# --------------------------------------------------------------------------- fail fast


async def test_thousands_of_invalid_items_make_one_error(h: Harness) -> None:
    """Lists stop at their first invalid item: one error, no "(+N more)"."""
    await h.start()
    r = await h.post("/v1/batch", {"ops": ["x"] * 5000})
    assert code(r) == (422, "invalid_field")
    assert r.json()["error"]["message"].startswith("ops.0:")
    assert "more)" not in r.json()["error"]["message"]
    r = await h.post("/v1/requests/r1/lookup", {"keys": ["0"] * 200})
    assert code(r) == (422, "invalid_field")
    assert r.json()["error"]["message"].startswith("keys.0:")
    assert "more)" not in r.json()["error"]["message"]
