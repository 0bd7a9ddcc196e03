"""Hypothesis-generated garbage against the engine app (in process, through ASGI).

Keys that are not hex, too long, odd-length, of the wrong type; sizes that are negative, huge or
not numbers; bodies that are not JSON, not objects, or objects with the wrong fields; batches
mixing valid and invalid ops; query strings nobody declared; request ids of any text. Every
answer must be one the route's OpenAPI entry documents (never a 5xx), every error answer must be
the ``{"error": {"code", "message"}}`` shape, and the manager must stay consistent: block counts
add up after every call, and once every request the fuzz started is released, nothing is pinned
or pending.

A second property drives *valid* calls in random order over a few requests and keys (stores and
loads, through jobs and through the pool, finishes and aborts) and checks the same things plus
the per-op status sets, so a state the manager cannot handle shows up as a 5xx or a broken count.

Hypothesis runs in a worker thread (``anyio.to_thread``) and calls the app on the test's event
loop (``anyio.from_thread``), so the service, its lifespan and its background tasks stay on one
loop. Examples are derandomized: the same cases run in CI every time.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Callable
from typing import Any
from urllib.parse import quote

import anyio
import anyio.from_thread
import anyio.to_thread
import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from testsupport.api_harness import Harness, hexkeys, make_settings, running

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

FUZZ = settings(
    max_examples=250,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# --------------------------------------------------------------------------- strategies

json_scalar = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
)
json_value = st.recursive(
    json_scalar,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
good_key = st.binary(min_size=1, max_size=64).map(bytes.hex)
bad_key = st.one_of(
    st.text(max_size=140),
    st.text(alphabet="0123456789abcdefABCDEF", min_size=0, max_size=140),  # odd, empty, too long
    st.binary(min_size=65, max_size=80).map(bytes.hex),
    json_scalar,
    st.lists(st.integers(), max_size=3),
)
keys_value = st.one_of(
    st.lists(good_key, max_size=12),
    st.lists(st.one_of(good_key, bad_key), max_size=12),
    json_value,
)
size = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([-1, 0, 1, 15, 16, 2**31 - 1, 2**31, 2**63, 2**64]),
    json_scalar,
)
body_fields = st.fixed_dictionaries(
    {},
    optional={
        "keys": keys_value,
        "success": json_value,
        "cache_id": st.text(max_size=300) | json_value,
        "device_blocks": st.lists(size, max_size=12) | json_value,
        "job_ids": st.lists(size, max_size=6) | json_value,
        "timeout_s": size,
        "kv_transfer_params": json_value,
        "name": st.text(max_size=40) | json_value,
        "tensors": json_value,
        "ops": json_value,
        "unexpected": json_value,
    },
)
raw_body = st.one_of(
    st.binary(max_size=300),
    body_fields.map(lambda d: json.dumps(d).encode()),
    json_value.map(lambda v: json.dumps(v).encode()),
    body_fields.map(lambda d: json.dumps(d).encode()).flatmap(
        lambda b: st.integers(0, len(b)).map(lambda n: b[:n])  # cut short
    ),
)
req_id = st.text(min_size=1, max_size=300)
content_type = st.sampled_from(
    ["application/json", "application/json; charset=utf-8", "text/plain", "", "application/x"]
)

# (method, template) of every engine route that takes a body or a path id.
OPS = [
    ("POST", "/v1/requests/{req_id}/lookup"),
    ("PUT", "/v1/requests/{req_id}"),
    ("DELETE", "/v1/requests/{req_id}"),
    ("POST", "/v1/requests/{req_id}/prepare-load"),
    ("POST", "/v1/requests/{req_id}/touch"),
    ("POST", "/v1/requests/{req_id}/complete-load"),
    ("POST", "/v1/requests/{req_id}/prepare-store"),
    ("POST", "/v1/requests/{req_id}/complete-store"),
    ("POST", "/v1/requests/{req_id}/offload"),
    ("POST", "/v1/requests/{req_id}/onload"),
    ("POST", "/v1/batch"),
    ("POST", "/v1/jobs/wait"),
    ("POST", "/v1/kv-caches"),
    ("GET", "/v1/jobs/{job_id}"),
    ("DELETE", "/v1/kv-caches/{cache_id}"),
    ("GET", "/v1/events"),
]
BATCH_OPS = [
    "start_request",
    "finish_request",
    "lookup",
    "prepare_load",
    "touch",
    "complete_load",
    "prepare_store",
    "complete_store",
    "offload",
    "onload",
]
ERROR_SHAPE = re.compile(r"^[a-z_]+$")


def server_error(r: httpx.Response) -> bool:
    """A 5xx other than 507 ``no_space`` (the documented "no evictable space" answer)."""
    if r.status_code < 500:
        return False
    return not (r.status_code == 507 and r.json()["error"]["code"] == "no_space")


POOL_KEYS = hexkeys(*range(1, 13))


# --------------------------------------------------------------------------- checks


class Checker:
    """Calls the app from the hypothesis thread and checks each answer against the spec."""

    def __init__(self, h: Harness) -> None:
        self.h = h
        self.spec = h.app.openapi()["paths"]
        self.calls = 0
        self.statuses: Counter[int] = Counter()

    def documented(self, method: str, template: str) -> set[int]:
        return {int(s) for s in self.spec[template][method.lower()]["responses"]}

    def call(
        self,
        method: str,
        template: str,
        path: str,
        content: bytes | None = None,
        ctype: str = "application/json",
        params: dict[str, Any] | None = None,
    ) -> httpx.Response:
        headers = {"content-type": ctype} if ctype else {}
        r: httpx.Response = anyio.from_thread.run(
            lambda: self.h.client.request(
                method, path, content=content, headers=headers, params=params
            )
        )
        self.calls += 1
        self.statuses[r.status_code] += 1
        allowed = self.documented(method, template)
        assert not server_error(r), (method, path, content, r.status_code, r.text)
        assert r.status_code in allowed, (method, template, r.status_code, r.text)
        if r.status_code >= 400:
            err = r.json()
            assert set(err) == {"error"}, err
            assert set(err["error"]) == {"code", "message"}, err
            assert ERROR_SHAPE.match(err["error"]["code"]), err
        elif r.status_code != 204:
            r.json()
        return r

    def counts(self) -> dict[str, int]:
        r = anyio.from_thread.run(lambda: self.h.admin.get("/admin/v1/stats"))
        blocks: dict[str, int] = r.json()["blocks"]
        assert blocks["free"] + blocks["pending"] + blocks["ready"] == blocks["num_blocks"]
        assert 0 <= blocks["pinned"] <= blocks["ready"], blocks
        return blocks

    def release_everything(self) -> dict[str, int]:
        """Wait for jobs, release every tracked request; the block counts after."""

        async def release() -> None:
            for _ in range(200):
                stats = (await self.h.admin.get("/admin/v1/stats")).json()
                if stats["jobs"]["running"] == 0:
                    break
                await anyio.sleep(0.01)
            listed = (await self.h.admin.get("/admin/v1/requests")).json()["requests"]
            for r in listed:
                path = f"/admin/v1/requests/{quote(r['req_id'], safe='')}/release"
                assert (await self.h.admin.post(path)).status_code == 200

        anyio.from_thread.run(release)
        return self.counts()


def fill_path(template: str, rid: str, number: int) -> str:
    return (
        template.replace("{req_id}", quote(rid, safe=""))
        .replace("{job_id}", str(number))
        .replace("{cache_id}", quote(rid, safe=""))
    )


async def fuzz(test: Callable[[], None]) -> None:
    """Run a hypothesis test in a worker thread; its calls come back to this loop."""
    await anyio.to_thread.run_sync(test)


# --------------------------------------------------------------------------- garbage


async def test_garbage_bodies_and_ids_get_documented_refusals() -> None:
    """Any body (bytes, wrong JSON, wrong fields), any content type, any request id, on every
    engine route: a documented status, never a 5xx, errors in the error shape."""
    async with running(make_settings()) as h:
        checker = Checker(h)
        await h.start("fuzz")

        @FUZZ
        @given(
            op=st.sampled_from(OPS),
            rid=st.one_of(st.just("fuzz"), req_id),
            number=size.filter(lambda v: isinstance(v, int) and v >= 0) | st.just(1),
            body=raw_body,
            ctype=content_type,
        )
        def garbage(op: tuple[str, str], rid: str, number: int, body: bytes, ctype: str) -> None:
            method, template = op
            path = fill_path(template, rid, number)
            checker.call(method, template, path, body if method != "GET" else None, ctype)

        await fuzz(garbage)
        assert checker.calls >= 250
        # The garbage reached past the guards: answers from the routes themselves too.
        assert {200, 400, 404, 415, 422} <= set(checker.statuses), checker.statuses
        blocks = await anyio.to_thread.run_sync(checker.release_everything)
        assert (blocks["pinned"], blocks["pending"]) == (0, 0)


def valid_batch_op(cache_id: str) -> st.SearchStrategy[dict[str, Any]]:
    """A well-formed batch op of any kind over requests a/b and a 12-key pool."""
    keys = st.lists(st.sampled_from(POOL_KEYS), min_size=0, max_size=6, unique=True)

    def fields(name: str) -> st.SearchStrategy[dict[str, Any]]:
        if name == "start_request":
            params = st.dictionaries(st.text(max_size=5), json_scalar, max_size=3)
            return st.fixed_dictionaries({}, optional={"kv_transfer_params": params})
        if name == "finish_request":
            return st.fixed_dictionaries({}, optional={"abort": st.booleans()})
        if name in ("offload", "onload"):
            return keys.flatmap(
                lambda ks: st.fixed_dictionaries(
                    {
                        "cache_id": st.sampled_from([cache_id, "kvc-unknown"]),
                        "keys": st.just(ks),
                        "device_blocks": st.permutations(range(16)).map(lambda p: p[: len(ks)]),
                    }
                )
            )
        if name == "complete_store":
            return st.fixed_dictionaries({"keys": keys}, optional={"success": st.booleans()})
        return st.fixed_dictionaries({"keys": keys})

    return st.sampled_from(BATCH_OPS).flatmap(
        lambda name: fields(name).map(
            lambda f: {"op": name, "req_id": "a" if len(f) % 2 else "b", **f}
        )
    )


async def test_garbage_batches_get_documented_refusals() -> None:
    """Batches of valid ops in any order (each answering alone: a status an op can have, never
    a 5xx), the same with one garbage op slipped in (the whole batch refused, nothing run), and
    plain garbage; the manager stays consistent and releases everything afterwards."""
    async with running(make_settings(num_blocks=8)) as h:
        checker = Checker(h)
        _, cache_id = await h.device(16)
        garbage_op = st.fixed_dictionaries(
            {"op": st.sampled_from(BATCH_OPS) | st.text(max_size=12)},
            optional={"req_id": st.sampled_from(["a", "b"]) | req_id},
        ).flatmap(lambda head: body_fields.map(lambda rest: {**rest, **head}))
        valid = st.lists(valid_batch_op(cache_id), min_size=1, max_size=12)
        spoiled = st.tuples(valid, garbage_op, st.integers(0, 12)).map(
            lambda t: [*t[0][: t[2]], t[1], *t[0][t[2] :]]
        )

        raw_garbage = st.none() | st.none() | st.none() | st.binary(max_size=40)

        @FUZZ
        @given(ops=valid | valid | spoiled | json_value, raw=raw_garbage)
        def batches(ops: Any, raw: bytes | None) -> None:
            body = json.dumps({"ops": ops}).encode() if raw is None else raw
            before = checker.counts()
            r = checker.call("POST", "/v1/batch", "/v1/batch", body)
            if r.status_code == 200:
                results = r.json()["results"]
                assert len(results) == len(ops)
                for res in results:
                    assert 200 <= res["status"] < 500 or res["status"] == 507, res
                    assert res["ok"] is (res["status"] < 400), res
            else:
                assert checker.counts() == before  # a refused batch ran nothing
            checker.counts()

        await fuzz(batches)
        assert {200, 400, 422} <= set(checker.statuses), checker.statuses
        assert checker.statuses[200] > 60, checker.statuses
        blocks = await anyio.to_thread.run_sync(checker.release_everything)
        assert (blocks["pinned"], blocks["pending"]) == (0, 0)


async def test_garbage_query_strings_get_documented_refusals() -> None:
    """Undeclared parameters, and declared ones with any value (``after``, ``limit``,
    ``abort``): 200 or 422 on the routes that take them, never a 5xx."""
    async with running(make_settings()) as h:
        checker = Checker(h)
        await h.start("q")
        name = st.sampled_from(["after", "limit", "abort", "x", "", "after[]"]) | st.text(
            max_size=8
        )
        value = st.text(max_size=12) | size.map(str)

        @FUZZ
        @given(
            op=st.sampled_from(OPS),
            params=st.dictionaries(name, value, max_size=3),
        )
        def queries(op: tuple[str, str], params: dict[str, str]) -> None:
            method, template = op
            body = None if method == "GET" else b"{}"
            checker.call(method, template, fill_path(template, "q", 1), body, params=params)

        await fuzz(queries)


@pytest.mark.parametrize(
    "body",
    [
        b'{"keys":' + b"[" * 5000 + b"]" * 5000 + b"}",  # nested far past any parser's depth
        b"[" * 100_000,
        b'{"keys":["00"]}{"keys":["01"]}',  # two documents
        b'{"keys":["00"],"keys":[1]}',  # duplicate field
        b'{"keys":["' + b"0" * 130 + b'"]}',  # 65 bytes
        b'{"keys":["zz"]}',
        b'{"keys":["0"]}',
        b'{"keys":[""]}',
        b'{"keys":NaN}',
        b'{"keys":[1e999]}',
        b'{"keys":["\\ud800"]}',
        b'\xef\xbb\xbf{"keys":["00"]}',  # UTF-8 byte order mark
        b'{"keys":["00"]}\x00',
        b"\xff\xfe\xfd",
        b"null",
        b"",
    ],
)
async def test_pathological_bodies_are_refused_cleanly(h: Harness, body: bytes) -> None:
    """Bodies built to trip parsers (deep nesting, two documents, bad escapes, NUL, BOM): an
    error status in the error shape, or a plain answer for the empty body, never a 5xx."""
    await h.start()
    r = await h.client.post(
        "/v1/requests/r1/lookup", content=body, headers={"content-type": "application/json"}
    )
    if body == b"":
        assert r.status_code == 422  # {} has no keys
    else:
        assert r.status_code in (400, 413, 422), (r.status_code, r.text)
    assert set(r.json()["error"]) == {"code", "message"}


# --------------------------------------------------------------------------- valid chaos

REQS = ["a", "b", "c"]
KEYS = POOL_KEYS
KINDS = [
    "lookup",
    "prepare_load",
    "complete_load",
    "touch",
    "prepare_store",
    "complete_store",
    "fail_store",
    "offload",
    "onload",
]
STEP = st.tuples(
    # Lifecycle steps are rarer than the work between them.
    st.sampled_from([*KINDS, *KINDS, *KINDS, "start", "finish", "abort"]),
    st.sampled_from(REQS),
    st.lists(st.sampled_from(KEYS), min_size=1, max_size=6, unique=True),
)
# What each valid call may answer (beyond the spec: a tighter set per op).
EXPECTED = {
    "start": {200, 201, 422},  # 422: restarting a finished request that still holds leases
    "finish": {200, 404},
    "abort": {200, 404},
    "lookup": {200, 404},
    "prepare_load": {200, 404, 409},
    "complete_load": {200, 404, 409},
    "touch": {200, 404},
    "prepare_store": {200, 404, 507},
    "complete_store": {200, 404},
    "fail_store": {200, 404},
    "offload": {202, 404, 507},
    "onload": {202, 404, 409},
}


async def test_valid_calls_in_any_order_keep_the_manager_consistent() -> None:
    """Random sequences of valid calls over 3 requests, 12 keys and an 8-block pool (heavy
    eviction): each answer in its op's set, block counts add up after every call, and once
    everything is released nothing is pinned or pending."""
    async with running(make_settings(num_blocks=8)) as h:
        checker = Checker(h)
        dev, cache_id = await h.device(16)
        for b in range(16):
            dev.fill(b, seed=b)

        def run(step: tuple[str, str, list[str]]) -> None:
            kind, rid, keys = step
            base = f"/v1/requests/{rid}"
            blocks = list(range(len(keys)))
            calls: dict[str, tuple[str, str, Any]] = {
                "start": ("PUT", "", None),
                "finish": ("DELETE", "", None),
                "abort": ("DELETE", "", None),
                "lookup": ("POST", "/lookup", {"keys": keys}),
                "prepare_load": ("POST", "/prepare-load", {"keys": keys}),
                "complete_load": ("POST", "/complete-load", {"keys": keys}),
                "touch": ("POST", "/touch", {"keys": keys}),
                "prepare_store": ("POST", "/prepare-store", {"keys": keys}),
                "complete_store": ("POST", "/complete-store", {"keys": keys}),
                "fail_store": ("POST", "/complete-store", {"keys": keys, "success": False}),
                "offload": (
                    "POST",
                    "/offload",
                    {"cache_id": cache_id, "keys": keys, "device_blocks": blocks},
                ),
                "onload": (
                    "POST",
                    "/onload",
                    {"cache_id": cache_id, "keys": keys, "device_blocks": blocks},
                ),
            }
            method, suffix, body = calls[kind]
            template = "/v1/requests/{req_id}" + suffix
            content = None if body is None else json.dumps(body).encode()
            params = {"abort": "true"} if kind == "abort" else None
            r = checker.call(method, template, base + suffix, content, params=params)
            assert r.status_code in EXPECTED[kind], (kind, r.status_code, r.text)
            checker.counts()

        @FUZZ
        @given(steps=st.lists(STEP, min_size=1, max_size=25))
        def chaos(steps: list[tuple[str, str, list[str]]]) -> None:
            for rid in REQS:
                run(("start", rid, KEYS[:1]))
            for step in steps:
                run(step)
            blocks = checker.release_everything()
            assert (blocks["pinned"], blocks["pending"]) == (0, 0), blocks
            assert blocks["free"] + blocks["ready"] == 8

        await fuzz(chaos)
        assert checker.calls > 500
        assert {200, 201, 202, 404, 409, 507} <= set(checker.statuses), checker.statuses
