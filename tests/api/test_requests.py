"""Request-scoped engine routes: lifecycle, loads, stores, and their error statuses."""

from __future__ import annotations

from typing import Any

import pytest
from starlette.types import Message

from testsupport.api_harness import Harness, hexkeys, make_settings, running

pytestmark = pytest.mark.anyio


async def test_start_is_idempotent_and_finish_forgets(h: Harness) -> None:
    r = await h.client.put("/v1/requests/r1", json={"kv_transfer_params": {"do_remote": True}})
    assert (r.status_code, r.json()) == (201, {"req_id": "r1", "created": True})
    r = await h.client.put("/v1/requests/r1")
    assert (r.status_code, r.json()) == (200, {"req_id": "r1", "created": False})
    r = await h.client.delete("/v1/requests/r1")
    assert r.status_code == 200
    assert r.json() == {"req_id": "r1", "pins_released": 0, "stores_dropped": 0}
    r = await h.client.delete("/v1/requests/r1")
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "unknown_request"


async def test_engine_copy_flow_store_lookup_load(h: Harness) -> None:
    """prepare-store / complete-store / lookup / prepare-load / complete-load, as an engine
    that copies through the mapped pool would call them."""
    await h.start()
    keys = hexkeys(1, 2, 3)
    r = await h.post("/v1/requests/r1/prepare-store", {"keys": keys})
    assert r.status_code == 200
    spec = r.json()
    assert spec["keys_to_store"] == keys
    assert len(set(spec["slots"])) == 3
    assert spec["evicted_keys"] == spec["skipped_keys"] == []

    r = await h.post("/v1/requests/r1/lookup", {"keys": [*keys, hexkeys(9)[0]]})
    assert r.json() == {"results": ["pending"] * 3 + ["miss"], "hit_prefix": 0}

    r = await h.post("/v1/requests/r1/complete-store", {"keys": keys, "success": True})
    assert r.json() == {"completed": keys, "dropped": [], "ignored": []}
    r = await h.post("/v1/requests/r1/complete-store", {"keys": keys})
    assert r.json() == {"completed": [], "dropped": [], "ignored": keys}  # retry is a no-op

    r = await h.post("/v1/requests/r1/lookup", {"keys": [keys[0], hexkeys(9)[0], keys[1]]})
    assert r.json() == {"results": ["hit", "miss", "hit"], "hit_prefix": 1}

    r = await h.post("/v1/requests/r1/prepare-load", {"keys": keys})
    assert r.status_code == 200
    assert r.json() == {"slots": spec["slots"]}
    r = await h.admin.get("/admin/v1/stats")
    assert r.json()["blocks"]["pinned"] == 3
    r = await h.post("/v1/requests/r1/complete-load", {"keys": keys})
    assert (r.status_code, r.json()) == (200, {})
    r = await h.post("/v1/requests/r1/touch", {"keys": [*keys, hexkeys(99)[0]]})
    assert (r.status_code, r.json()) == (200, {})
    r = await h.admin.get("/admin/v1/stats")
    assert r.json()["blocks"]["pinned"] == 0


async def test_uppercase_hex_is_accepted_and_answered_lowercase(h: Harness) -> None:
    await h.start()
    r = await h.post("/v1/requests/r1/prepare-store", {"keys": ["ABCDEF01"]})
    assert r.json()["keys_to_store"] == ["abcdef01"]


async def test_prepare_load_of_a_missing_or_pending_key_is_409_and_pins_nothing(
    h: Harness,
) -> None:
    await h.start()
    ready, pending, missing = hexkeys(1, 2, 3)
    await h.post("/v1/requests/r1/prepare-store", {"keys": [ready, pending]})
    await h.post("/v1/requests/r1/complete-store", {"keys": [ready]})
    r = await h.post("/v1/requests/r1/prepare-load", {"keys": [ready, pending, missing]})
    assert r.status_code == 409
    err = r.json()["error"]
    assert err["code"] == "key_not_ready"
    assert "1 not stored" in err["message"]
    assert "1 still pending" in err["message"]
    r = await h.admin.get("/admin/v1/stats")
    assert r.json()["blocks"]["pinned"] == 0


async def test_complete_load_without_pin_is_409(h: Harness) -> None:
    await h.start()
    r = await h.post("/v1/requests/r1/complete-load", {"keys": hexkeys(1)})
    assert r.status_code == 409
    assert r.json()["error"]["code"] == "not_pinned"


async def test_failed_store_drops_the_blocks(h: Harness) -> None:
    await h.start()
    keys = hexkeys(1, 2)
    await h.post("/v1/requests/r1/prepare-store", {"keys": keys})
    r = await h.post("/v1/requests/r1/complete-store", {"keys": keys, "success": False})
    assert r.json() == {"completed": [], "dropped": keys, "ignored": []}
    r = await h.post("/v1/requests/r1/lookup", {"keys": keys})
    assert r.json()["results"] == ["miss", "miss"]


async def test_prepare_store_without_room_is_507_and_changes_nothing(h: Harness) -> None:
    await h.start()
    n = h.settings.num_blocks
    await h.post("/v1/requests/r1/prepare-store", {"keys": hexkeys(*range(n))})  # all pending
    r = await h.post("/v1/requests/r1/prepare-store", {"keys": hexkeys(1000, 1001)})
    assert r.status_code == 507
    assert r.json()["error"]["code"] == "no_space"
    r = await h.post("/v1/requests/r1/lookup", {"keys": hexkeys(1000)})
    assert r.json()["results"] == ["miss"]


async def test_abort_releases_pins_and_pending_stores(h: Harness) -> None:
    await h.start()
    await h.post("/v1/requests/r1/prepare-store", {"keys": hexkeys(1)})
    await h.post("/v1/requests/r1/complete-store", {"keys": hexkeys(1)})
    await h.post("/v1/requests/r1/prepare-load", {"keys": hexkeys(1)})
    await h.post("/v1/requests/r1/prepare-store", {"keys": hexkeys(2)})
    r = await h.client.delete("/v1/requests/r1", params={"abort": "true"})
    assert r.json() == {"req_id": "r1", "pins_released": 1, "stores_dropped": 1}
    r = await h.client.delete("/v1/requests/r1", params={"abort": "maybe"})
    assert r.status_code in (404, 422)


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("post", "lookup", {"keys": hexkeys(1)}),
        ("post", "prepare-load", {"keys": hexkeys(1)}),
        ("post", "touch", {"keys": hexkeys(1)}),
        ("post", "complete-load", {"keys": hexkeys(1)}),
        ("post", "prepare-store", {"keys": hexkeys(1)}),
        ("post", "complete-store", {"keys": hexkeys(1), "success": True}),
        ("post", "offload", {"cache_id": "c", "keys": hexkeys(1), "device_blocks": [0]}),
        ("post", "onload", {"cache_id": "c", "keys": hexkeys(1), "device_blocks": [0]}),
    ],
)
async def test_unknown_request_is_404(h: Harness, method: str, path: str, body: Any) -> None:
    if path in ("offload", "onload"):
        _, cache_id = await h.device()
        body = {**body, "cache_id": cache_id}
    r = await h.client.request(method, f"/v1/requests/ghost/{path}", json=body)
    assert r.status_code == 404, r.text
    assert r.json()["error"]["code"] == "unknown_request"


# --------------------------------------------------------------------------- strict bodies

BAD_BODIES: list[tuple[str, Any, int]] = [
    ("lookup", {"keys": "00ff"}, 422),
    ("lookup", {"keys": ["zz"]}, 422),  # not hex
    ("lookup", {"keys": ["abc"]}, 422),  # odd number of digits
    ("lookup", {"keys": [" ab"]}, 422),  # whitespace
    ("lookup", {"keys": [""]}, 422),  # empty key
    ("lookup", {"keys": ["ab" * 65]}, 422),  # 65 bytes
    ("lookup", {"keys": [1]}, 422),
    ("lookup", {"keys": [None]}, 422),
    ("lookup", {"keys": [], "extra": 1}, 422),
    ("lookup", {}, 422),
    ("lookup", [], 422),
    ("lookup", None, 422),
    ("complete-store", {"keys": hexkeys(1), "success": 0}, 422),  # 0 is not false
    ("complete-store", {"keys": hexkeys(1), "success": "true"}, 422),
    ("offload", {"cache_id": "c", "keys": hexkeys(1), "device_blocks": [False]}, 422),
    ("offload", {"cache_id": "c", "keys": hexkeys(1), "device_blocks": [1.0]}, 422),
    ("offload", {"cache_id": "c", "keys": hexkeys(1), "device_blocks": ["1"]}, 422),
    ("offload", {"cache_id": "c", "keys": hexkeys(1), "device_blocks": [-1]}, 422),
    ("offload", {"cache_id": "c", "keys": hexkeys(1, 2), "device_blocks": [0]}, 422),
    ("offload", {"cache_id": "", "keys": hexkeys(1), "device_blocks": [0]}, 422),
    ("onload", {"cache_id": 7, "keys": hexkeys(1), "device_blocks": [0]}, 422),
]


@pytest.mark.parametrize(("path", "body", "status"), BAD_BODIES)
async def test_strict_bodies(h: Harness, path: str, body: Any, status: int) -> None:
    await h.start()
    r = await h.post(f"/v1/requests/r1/{path}", body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["code"] == "invalid_field"


async def test_false_is_not_zero_and_true_is_not_one(h: Harness) -> None:
    await h.start()
    r = await h.client.put("/v1/requests/r2", json={"kv_transfer_params": False})
    assert r.status_code == 422


@pytest.mark.parametrize(
    "raw", [b"{", b"not json", b'{"keys": [}', b"\xff\xfe", b'{"keys": ["00"]} trailing']
)
async def test_malformed_json_is_400(h: Harness, raw: bytes) -> None:
    await h.start()
    r = await h.client.post(
        "/v1/requests/r1/lookup", content=raw, headers={"content-type": "application/json"}
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "malformed_body"


async def test_too_many_keys_is_413(h: Harness) -> None:
    await h.start()
    limit = h.settings.max_keys_per_call
    r = await h.post("/v1/requests/r1/lookup", {"keys": hexkeys(*range(limit + 1), width=2)})
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "too_many_keys"
    r = await h.post("/v1/requests/r1/lookup", {"keys": hexkeys(*range(limit), width=2)})
    assert r.status_code == 200


async def test_oversized_body_is_413_before_parsing(h: Harness) -> None:
    await h.start()
    raw = b'{"keys": ["' + b"00" * h.settings.max_body_bytes + b'"]}'
    r = await h.client.post(
        "/v1/requests/r1/lookup", content=raw, headers={"content-type": "application/json"}
    )
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "body_too_large"
    assert r.headers["connection"] == "close"


async def test_oversized_chunked_body_is_413_while_receiving(h: Harness) -> None:
    await h.start()
    chunk = b" " * 8192

    async def body() -> Any:
        for _ in range(h.settings.max_body_bytes // len(chunk) + 2):
            yield chunk

    r = await h.client.post(
        "/v1/requests/r1/lookup", content=body(), headers={"content-type": "application/json"}
    )
    assert "content-length" not in r.request.headers
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "body_too_large"


async def test_chunked_body_within_limit_is_served(h: Harness) -> None:
    await h.start()

    async def body() -> Any:
        yield b'{"keys": ["00'
        yield b'01"]}'

    r = await h.client.post(
        "/v1/requests/r1/lookup", content=body(), headers={"content-type": "application/json"}
    )
    assert r.json() == {"results": ["miss"], "hit_prefix": 0}


@pytest.mark.parametrize("ctype", ["text/plain", "application/x-www-form-urlencoded", ""])
async def test_non_json_content_type_is_415(h: Harness, ctype: str) -> None:
    await h.start()
    r = await h.client.post(
        "/v1/requests/r1/lookup", content=b'{"keys": []}', headers={"content-type": ctype}
    )
    assert r.status_code == 415
    assert r.json()["error"]["code"] == "unsupported_media_type"


async def test_json_content_type_with_charset_is_accepted(h: Harness) -> None:
    await h.start()
    r = await h.client.post(
        "/v1/requests/r1/lookup",
        content=b'{"keys": []}',
        headers={"content-type": "Application/JSON; charset=utf-8"},
    )
    assert r.status_code == 200


async def test_overlong_req_id_is_422(h: Harness) -> None:
    long_id = "r" * 257
    r = await h.post(f"/v1/requests/{long_id}/lookup", {"keys": []})
    assert r.status_code == 422
    r = await h.client.put(f"/v1/requests/{long_id}")
    assert r.status_code == 422


async def test_unknown_route_and_method_use_the_error_shape(h: Harness) -> None:
    r = await h.client.get("/v1/nope")
    assert (r.status_code, r.json()["error"]["code"]) == (404, "not_found")
    r = await h.client.get("/v1/requests/r1/lookup")
    assert (r.status_code, r.json()["error"]["code"]) == (405, "method_not_allowed")


async def test_finished_request_can_still_complete_its_store() -> None:
    async with running(make_settings()) as h:
        await h.start()
        await h.post("/v1/requests/r1/prepare-store", {"keys": hexkeys(1)})
        r = await h.client.delete("/v1/requests/r1")
        assert r.status_code == 200
        r = await h.post("/v1/requests/r1/lookup", {"keys": hexkeys(1)})
        assert r.status_code == 404  # finished: no new calls
        r = await h.post("/v1/requests/r1/complete-store", {"keys": hexkeys(1)})
        assert r.json()["completed"] == hexkeys(1)


async def test_a_client_that_hangs_up_mid_body_is_not_a_server_error(h: Harness) -> None:
    messages: list[Message] = [
        {"type": "http.request", "body": b'{"keys": [', "more_body": True},
        {"type": "http.disconnect"},
    ]
    sent: list[Message] = []

    async def receive() -> Message:
        return messages.pop(0)

    async def send(message: Message) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/requests/r1/lookup",
        "raw_path": b"/v1/requests/r1/lookup",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json")],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 2),
    }
    await h.app(scope, receive, send)
    assert sent[0]["status"] == 400
