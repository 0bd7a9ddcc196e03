"""``app/limits.py`` on its own: the cap formulas, the route table, the ``kv_transfer_params``
check and the early op count of a batch (sound: it never says "too many" of a body that is not;
complete for the shapes it promises to count)."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from fastapi import FastAPI
from hypothesis import given, settings
from hypothesis import strategies as st

import app.http.limits as limits_module
from app.http.apps import create_admin_app, create_app
from app.http.limits import (
    MAX_TRANSFER_PARAMS_DEPTH,
    OP_FIXED_BYTES,
    STRING_FIELD_BYTES,
    BodyLimits,
    batch_exceeds_ops,
    body_caps,
    transfer_params_error,
)
from app.settings import Settings


def test_default_caps_are_the_documented_numbers() -> None:
    caps = body_caps(Settings())
    eight_mib = 8 << 20
    assert caps == {
        "lookup": 1343488,
        "prepare_load": 1343488,
        "touch": 1343488,
        "complete_load": 1343488,
        "prepare_store": 2916352,
        "complete_store": 1343488,
        "offload": 3268608,
        "onload": 1695744,
        "start_request": 139264,
        "finish_request": 1024,
        "batch": eight_mib,
        "wait_jobs": 225280,
        "register_kv_cache": eight_mib,
        "unregister_kv_cache": 1024,
        "renew_kv_cache": 1024,
        "admin_put_policy": 65536,
        "admin_put_log_level": 65536,
        "admin_release": 1024,
        "admin_clear": 1024,
        "retain": 1343488,
        "prefetch": 1343488,
        "demote": 1343488,
        "drop": 1343488,
        "renew_retention": 8192,
        "release_retention": 1024,
        "cancel_prefetch": 1024,
        "admin_release_retention": 1024,
    }
    doc = limits_module.__doc__ or ""
    for number in ("1343488", "1695744", "139264", "225280"):
        assert f"({number})" in doc


def test_an_ops_fixed_part_holds_two_string_fields_at_their_longest() -> None:
    assert OP_FIXED_BYTES >= 2 * STRING_FIELD_BYTES + 1024


@settings(max_examples=50, deadline=None, database=None, derandomize=True)
@given(
    keys=st.integers(1, 100_000),
    ops=st.integers(1, 10_000),
    params=st.integers(1, 1 << 20),
    body=st.integers(1, 1 << 30),
)
def test_no_cap_exceeds_max_body_bytes(keys: int, ops: int, params: int, body: int) -> None:
    s = Settings(
        max_keys_per_call=keys,
        max_batch_ops=ops,
        max_transfer_params_bytes=params,
        max_body_bytes=body,
    )
    caps = body_caps(s)
    assert max(caps.values()) <= body
    assert caps["batch"] >= min(body, caps["offload"], caps["start_request"])


def test_both_apps_have_a_cap_for_every_route_that_takes_a_body() -> None:
    s = Settings()
    engine = create_app(s)
    create_admin_app(s, tenancy=engine.state.tenancy)  # each builds its table; none missing


def test_a_body_route_without_a_cap_fails_the_table() -> None:
    app = FastAPI()

    @app.get("/open")
    async def open_route() -> None:
        return None

    @app.post("/things/{thing}", operation_id="make_thing")
    async def make_thing(thing: str) -> None:
        return None

    with pytest.raises(ValueError, match=r"'make_thing' \(POST /things/\{thing\}\) takes a body"):
        BodyLimits.for_routes(app.routes, {}, 100)
    limits = BodyLimits.for_routes(app.routes, {"make_thing": 7}, 100)
    assert limits.limit_for("POST", "/things/a") == (7, "make_thing")
    assert limits.limit_for("POST", "/things/a/b") == (100, None)
    assert limits.limit_for("PUT", "/things/a") == (100, None)
    assert limits.limit_for("GET", "/open") == (100, None)


def test_routes_are_matched_in_the_routers_order() -> None:
    """A parameterised route registered before a static one that it also matches wins, as it
    does in the router; a static one registered first wins over a later pattern."""
    app = FastAPI()

    @app.post("/a/{name}", operation_id="by_name")
    async def by_name(name: str) -> None:
        return None

    @app.post("/a/fixed", operation_id="fixed")
    async def fixed() -> None:
        return None

    @app.post("/b/fixed", operation_id="b_fixed")
    async def b_fixed() -> None:
        return None

    @app.post("/b/{name}", operation_id="b_by_name")
    async def b_by_name(name: str) -> None:
        return None

    caps = {"by_name": 1, "fixed": 2, "b_fixed": 3, "b_by_name": 4}
    limits = BodyLimits.for_routes(app.routes, caps, 100)
    assert limits.limit_for("POST", "/a/fixed") == (1, "by_name")
    assert limits.limit_for("POST", "/b/fixed") == (3, "b_fixed")
    assert limits.limit_for("POST", "/b/other") == (4, "b_by_name")


# --------------------------------------------------------------------------- kv_transfer_params


def compact_size(value: Any) -> int:
    text = json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    return len(text.encode("utf-8", "surrogatepass"))


@pytest.mark.parametrize("params", [None, {}])
def test_no_params_pass(params: dict[str, Any] | None) -> None:
    assert transfer_params_error(params, 1) is None


def test_params_size_is_their_compact_utf8_json() -> None:
    params = {"engine": "é" * 10, "ids": [1, 2, 3]}
    size = compact_size(params)
    assert transfer_params_error(params, size) is None
    err = transfer_params_error(params, size - 1)
    assert err is not None
    assert (err.status, err.code) == (413, "transfer_params_too_large")
    assert f"{size} bytes" in err.message


def test_a_lone_surrogate_is_counted_not_an_error() -> None:
    params = {"s": "\ud800"}
    assert transfer_params_error(params, 64) is None
    assert transfer_params_error(params, compact_size(params) - 1) is not None


def test_depth_limit_counts_containers_not_brackets_in_strings() -> None:
    deep: Any = 1
    for _ in range(MAX_TRANSFER_PARAMS_DEPTH - 1):
        deep = [deep]
    assert transfer_params_error({"d": deep}, 1 << 20) is None
    err = transfer_params_error({"d": [deep]}, 1 << 20)
    assert err is not None
    assert err.code == "transfer_params_too_large"
    assert transfer_params_error({"s": "[" * 1000 + "{" * 1000}, 1 << 20) is None


# --------------------------------------------------------------------------- batch op count

scalars = st.one_of(
    st.integers(-(10**6), 10**6),
    st.booleans(),
    st.none(),
    st.text(max_size=5),
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner),
    max_leaves=6,
)
ops_like = st.dictionaries(
    st.sampled_from(["op", "req_id", "keys", "x"]), values, max_size=4
) | st.just({"op": "touch", "req_id": "r", "keys": []})
layouts = st.sampled_from(
    [
        {"separators": (",", ":")},
        {},
        {"indent": 2},
        {"indent": "\t", "ensure_ascii": False},
    ]
)


@settings(max_examples=300, deadline=None, database=None, derandomize=True)
@given(
    elements=st.lists(st.one_of(ops_like, values), max_size=12),
    limit=st.integers(0, 8),
    layout=layouts,
)
def test_the_count_never_refuses_a_batch_within_the_limit(
    elements: list[Any], limit: int, layout: dict[str, Any]
) -> None:
    raw = json.dumps({"ops": elements}, **layout).encode()
    if batch_exceeds_ops(raw, limit):
        assert len(json.loads(raw)["ops"]) > limit


@settings(max_examples=300, deadline=None, database=None, derandomize=True)
@given(
    elements=st.lists(
        st.one_of(ops_like, st.integers(), st.lists(values, max_size=2), st.none()),
        min_size=1,
        max_size=12,
    ),
    limit=st.integers(0, 8),
    layout=layouts,
)
def test_the_count_finds_too_many_ops_that_are_not_strings(
    elements: list[Any], limit: int, layout: dict[str, Any]
) -> None:
    raw = json.dumps({"ops": elements}, **layout).encode()
    assert batch_exceeds_ops(raw, limit) == (len(elements) > limit)


def test_the_count_reads_an_escaped_key_and_whitespace() -> None:
    raw = b' \n{ "\\u006fps" :\t[ 1 , 2 , 3 ] } '
    assert batch_exceeds_ops(raw, 2)
    assert not batch_exceeds_ops(raw, 3)


@pytest.mark.parametrize(
    "raw",
    [
        b'[{"ops": [1, 2, 3, 4, 5, 6]}]',  # not an object
        b'{"x": 1, "ops": [1, 2, 3, 4, 5, 6]}',  # another member first
        b'{"ops": {"a": 1, "b": 2, "c": 3, "d": 4}}',  # not a list
        b'{"ops": [1, 2 3, 4, 5, 6]}',  # malformed before the limit
        b'{"ops": [' + b"[" * 5000 + b"]" * 5000 + b", 1, 2, 3, 4, 5]}",  # deeper than json's stack
    ],
)
def test_shapes_the_count_does_not_read_are_left_to_the_parser(raw: bytes) -> None:
    assert not batch_exceeds_ops(raw, 3)


def test_the_count_stops_at_the_first_op_past_the_limit() -> None:
    raw = b'{"ops": [1, 2, 3, 4, ' + b"@" * 1000
    assert batch_exceeds_ops(raw, 3)
    assert not batch_exceeds_ops(raw, 4)


def test_a_flood_of_strings_is_not_counted() -> None:
    """The documented gap: strings do not pass the comma bound (the parser refuses them at
    the first one, lists being fail-fast)."""
    raw = json.dumps({"ops": ["x"] * 100}).encode()
    assert not batch_exceeds_ops(raw, 3)
    assert re.search(rb'"x",', raw)
