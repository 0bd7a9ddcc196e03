"""Security of both apps, in process: who gets into the admin API, what answers and logs may
hold, which files a KV-cache registration may map, and what request ids may reach logs.

- Every route the admin app documents refuses a caller without the token (401, with
  ``WWW-Authenticate: Bearer``), with a wrong one (403: near misses, case, prefix, extension),
  or with another scheme (401); the admin routes do not exist on the engine app and the engine
  routes do not exist on the admin app.
- No answer of either app, error answers included, holds the token or a value of the
  environment (a canary among them); no log line holds the token, the right one or a wrong one.
- A registration maps a file only if its real path is inside ``/dev/shm``: symlinks out of it
  (to a file or a directory), ``..``, ``/proc/self/fd`` links and relative paths are refused
  with 422, and no refusal repeats the content of the file it was pointed at.
- Request ids (``app/request_ids.py``): a caller's ``X-Request-ID`` is used and echoed only if
  it is safe (``[A-Za-z0-9._:-]{1,120}``), otherwise replaced; an engine ``req_id`` of any text
  reaches the canonical log line and the metric exemplars only in its safe form.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import anyio
import anyio.from_thread
import anyio.to_thread
import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from app.telemetry.logging import fields_of
from app.telemetry.request_ids import safe_req_id
from testsupport.api_harness import TOKEN, Harness, hexkeys, make_settings, running
from testsupport.shm_device import SHM_DIR, ShmDevice

pytestmark = pytest.mark.anyio
SAFE_ID = re.compile(r"[A-Za-z0-9._:\-]{1,120}")
CANARY_VAR = "KVOFFLOAD_TEST_CANARY_SECRET"  # cleared by the autouse fixture after each test


def bare(app: Any, base: str, headers: dict[str, str] | None = None) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url=base, headers=headers)


def admin_operations(h: Harness) -> list[tuple[str, str, bool]]:
    """(method, path with ids filled, protected) of every operation the admin spec documents."""
    out = []
    for template, item in h.admin_app.openapi()["paths"].items():
        for method, op in item.items():
            path = template.replace("{req_id}", "r1")
            out.append((method.upper(), path, bool(op.get("security"))))
    return out


def body_for(method: str, path: str) -> Any:
    if method != "PUT":
        return None
    return {"level": "info"} if path.endswith("log-level") else {"name": "arc"}


# --------------------------------------------------------------------------- admin access


WRONG_TOKENS = [
    "not-the-token",
    TOKEN.upper(),
    TOKEN[:-1],
    TOKEN + "x",
    TOKEN + "\t" + TOKEN,
    "x" * 4096,
]


async def test_every_admin_operation_needs_the_exact_token(h: Harness) -> None:
    """For every documented admin operation: no header 401, another scheme 401, an empty bearer
    401, near-miss tokens 403; the right token gets through; nothing changed meanwhile."""
    ops = admin_operations(h)
    protected = [(m, p) for m, p, guarded in ops if guarded]
    assert len(protected) >= 6, ops
    assert {p for m, p, guarded in ops if not guarded} == {"/livez"}
    generation = (await h.admin.get("/admin/v1/policy")).json()["generation"]
    for method, path in protected:
        body = body_for(method, path)
        for headers, status in [
            ({}, 401),
            ({"authorization": f"Basic {TOKEN}"}, 401),
            ({"authorization": f"Token {TOKEN}"}, 401),
            ({"authorization": "Bearer"}, 401),
            ({"authorization": "Bearer "}, 401),
            ({"authorization": TOKEN}, 401),
            *[({"authorization": f"Bearer {t}"}, 403) for t in WRONG_TOKENS],
        ]:
            async with bare(h.admin_app, "http://admin", headers) as c:
                r = await c.request(method, path, json=body)
            assert r.status_code == status, (method, path, headers, r.text)
            assert r.json()["error"]["code"] == ("unauthorized" if status == 401 else "forbidden")
            if status == 401:
                assert r.headers["www-authenticate"] == "Bearer"
        r = await h.admin.request(method, path, json=body)
        assert r.status_code not in (401, 403), (method, path, r.text)
    policy = (await h.admin.get("/admin/v1/policy")).json()
    assert policy["generation"] >= generation  # only the authorised PUTs moved it


async def test_admin_checks_the_token_before_the_query(h: Harness) -> None:
    """An unknown query parameter without a token: 401 like any other unauthenticated call."""
    async with bare(h.admin_app, "http://admin") as anon:
        r = await anon.get("/admin/v1/stats", params={"token": TOKEN[:3]})
    assert r.status_code == 401, r.text


@pytest.mark.parametrize(
    ("path", "token", "status"),
    [
        ("/admin/v1/stats", "wrong-token", 403),  # the token is judged before the query
        ("/admin/v1/stats", TOKEN, 422),  # past the token, the query is still strict
        ("/livez", None, 422),  # the open route checks only the query
    ],
)
async def test_admin_guard_orders_the_token_before_the_query(
    h: Harness, path: str, token: str | None, status: int
) -> None:
    """Token first (401/403), then strict query parameters (422), on the admin listener."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with bare(h.admin_app, "http://admin") as client:
        r = await client.get(path, params={"unknown": "1"}, headers=headers)
    assert r.status_code == status, r.text


async def test_admin_routes_do_not_exist_on_the_engine_app(h: Harness) -> None:
    """Each admin path, with every method, with and without the token: 404 on the engine app
    (and each engine route 404 on the admin app)."""
    for method, path, _ in admin_operations(h):
        if path == "/livez":
            continue
        for headers in ({}, {"authorization": f"Bearer {TOKEN}"}):
            r = await h.client.request(method, path, headers=headers, json=body_for(method, path))
            assert r.status_code == 404, (method, path, r.text)
            assert r.json()["error"]["code"] == "not_found"
    for template, item in h.app.openapi()["paths"].items():
        if template in ("/livez",):
            continue
        path = template.replace("{req_id}", "r1").replace("{job_id}", "1")
        path = path.replace("{cache_id}", "c")
        for method in item:
            r = await h.admin.request(method.upper(), path, json={})
            assert r.status_code == 404, (method, path, r.text)


# --------------------------------------------------------------------------- nothing leaks


async def walk(h: Harness, token: str) -> list[httpx.Response]:
    """A call to every GET route of both apps, a few refused calls of each, and the answers
    of a little real work (stats, requests, events, metrics after traffic)."""
    await h.start("walker")
    dev, cache_id = await h.device(4)
    dev.fill(0, seed=7)
    off = await h.post(
        "/v1/requests/walker/offload",
        {"cache_id": cache_id, "keys": hexkeys(1), "device_blocks": [0]},
    )
    await h.wait(off.json()["job_id"])
    answers = [off]
    for template, item in h.app.openapi()["paths"].items():
        if "get" in item:
            path = template.replace("{job_id}", str(off.json()["job_id"]))
            answers.append(await h.client.get(path))
    answers += [
        await h.client.get("/openapi.json"),
        await h.client.get("/docs"),
        await h.client.get("/metrics", headers={"accept": "application/openmetrics-text"}),
        await h.client.get("/nowhere"),
        await h.post("/v1/requests/nobody/lookup", {"keys": hexkeys(1)}),
        await h.post("/v1/requests/walker/lookup", {"keys": ["zz"]}),
        await h.post("/v1/kv-caches", {"name": "x", "device": "cpu", "tensors": []}),
        await h.client.post("/v1/batch", content=b"{", headers={"content-type": "text/plain"}),
    ]
    async with bare(h.admin_app, "http://admin", {"authorization": f"Bearer {token}"}) as admin:
        for method, path, _ in admin_operations(h):
            if method == "GET":
                answers.append(await admin.get(path))
        answers += [
            await admin.get("/openapi.json"),
            await admin.get("/docs"),
            await admin.put("/admin/v1/policy", json={"name": "nope"}),
            await admin.put("/admin/v1/log-level", json={"level": "loud"}),
        ]
    async with bare(h.admin_app, "http://admin", {"authorization": "Bearer wrong"}) as wrong:
        answers.append(await wrong.get("/admin/v1/stats"))
    return answers


async def test_no_answer_holds_the_token_or_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every GET route of both apps and a set of refusals, after real work: no answer (body or
    headers) holds the admin token, the canary environment variable's value, or any other
    distinctive (16+ characters) value of the environment."""
    canary = "canary-" + secrets.token_hex(16)
    monkeypatch.setenv(CANARY_VAR, canary)
    forbidden = {TOKEN, canary} | {v for v in os.environ.values() if len(v) >= 16}
    async with running(make_settings()) as h:
        answers = await walk(h, TOKEN)
    assert len(answers) > 20
    for r in answers:
        blob = r.content.decode(errors="replace") + repr(r.headers.multi_items())
        leaked = [v[:12] + "..." for v in forbidden if v in blob]
        assert not leaked, (r.request.method, r.request.url.path, leaked)


async def test_no_log_line_holds_a_token(h: Harness, caplog: pytest.LogCaptureFixture) -> None:
    """Audited admin changes, refused admin calls and ordinary calls: no record (message or
    structured fields) holds the right token or a wrong one presented."""
    wrong = "wrong-" + secrets.token_hex(8)
    caplog.set_level(logging.DEBUG)
    await walk(h, TOKEN)
    await h.admin.put("/admin/v1/policy", json={"name": "arc"})
    await h.admin.post("/admin/v1/cache/clear")
    async with bare(h.admin_app, "http://admin", {"authorization": f"Bearer {wrong}"}) as c:
        await c.put("/admin/v1/policy", json={"name": "lru"})
    assert caplog.records
    for record in caplog.records:
        text = record.getMessage() + repr(fields_of(record)) + repr(record.__dict__)
        assert TOKEN not in text, record
        assert wrong not in text, record


# --------------------------------------------------------------------------- registration paths


@pytest.fixture
def shm_links() -> Iterator[list[str]]:
    """Names to create in /dev/shm (symlinks, files); all removed afterwards."""
    made: list[str] = []
    yield made
    for path in made:
        if os.path.lexists(path):
            os.unlink(path)


def spec_for(path: str, num_blocks: int = 4, block_bytes: int = 4096) -> dict[str, Any]:
    return {
        "name": f"reg-{uuid.uuid4().hex[:6]}",
        "device": "cpu",
        "tensors": [
            {
                "shape": [num_blocks, block_bytes // 2],
                "dtype": "float16",
                "block_dim": 0,
                "handle": {"kind": "shm", "path": path},
            }
        ],
    }


async def test_registration_maps_only_files_whose_real_path_is_in_dev_shm(
    h: Harness, tmp_path: Path, shm_links: list[str]
) -> None:
    """Symlinks out of /dev/shm (to a file, through a directory), ``..``, /proc/self/fd links,
    relative and non-normal paths are refused with 422 and the refusal never repeats the
    target's content; a file really in /dev/shm (also through ``.`` or an inside symlink) is
    accepted."""
    secret = ("secret-content-" + secrets.token_hex(8)).encode()
    outside = tmp_path / "outside.bin"
    outside.write_bytes((secret * (16384 // len(secret) + 1))[:16384])
    tag = uuid.uuid4().hex[:8]
    link_file = f"{SHM_DIR}/kvoffload-test-link-{tag}"
    link_dir = f"{SHM_DIR}/kvoffload-test-dirlink-{tag}"
    os.symlink(outside, link_file)
    shm_links.append(link_file)
    os.symlink(tmp_path, link_dir)
    shm_links.append(link_dir)
    dev = ShmDevice(4, h.settings.block_bytes)
    h.devices.append(dev)
    link_in = f"{SHM_DIR}/kvoffload-test-inlink-{tag}"
    os.symlink(dev.path, link_in)
    shm_links.append(link_in)
    with open(outside, "rb") as held:
        refused = [
            str(outside),
            link_file,
            f"{link_dir}/outside.bin",
            f"{SHM_DIR}/../..{outside}",
            f"{SHM_DIR}/..{SHM_DIR}/../..{outside}",
            f"/proc/self/fd/{held.fileno()}",
            f"/proc/{os.getpid()}/fd/{held.fileno()}",
            "outside.bin",
            f"{SHM_DIR}",
            f"{SHM_DIR}/",
            f"{SHM_DIR}/kvoffload-test-missing-{tag}",
            f"{SHM_DIR}/kvoffload-test-missing-{tag}/../../etc/passwd",
            "/etc/passwd",
        ]
        for path in refused:
            r = await h.post("/v1/kv-caches", spec_for(path))
            assert r.status_code == 422, (path, r.text)
            assert r.json()["error"]["code"] in ("invalid_registration", "invalid_field")
            assert secret not in r.content, path
    for path in (dev.path, f"{SHM_DIR}/./{os.path.basename(dev.path)}", link_in):
        r = await h.post("/v1/kv-caches", spec_for(path))
        assert r.status_code == 201, (path, r.text)
    assert (await h.client.get("/v1/kv-caches")).json()["kv_caches"]  # only the accepted ones


async def test_a_refusal_names_the_path_sent_never_where_it_leads(
    h: Harness, tmp_path: Path, shm_links: list[str]
) -> None:
    """A symlink in /dev/shm to a file elsewhere, directly or through a linked directory, is
    refused with 422 naming the path as sent and the rule it broke; nothing of the target (its
    directory, its name, the real path) appears in the answer."""
    tag = uuid.uuid4().hex[:8]
    hidden = tmp_path / f"hidden-dir-{tag}"
    hidden.mkdir()
    target = hidden / f"hidden-file-{tag}.bin"
    target.write_bytes(b"\0" * 16384)
    link_file = f"{SHM_DIR}/kvoffload-test-leak-{tag}"
    link_dir = f"{SHM_DIR}/kvoffload-test-leakdir-{tag}"
    os.symlink(target, link_file)
    shm_links.append(link_file)
    os.symlink(hidden, link_dir)
    shm_links.append(link_dir)
    for sent, target_parts in (
        (link_file, [str(target), str(hidden), hidden.name, target.name, str(tmp_path)]),
        (f"{link_dir}/{target.name}", [str(target), str(hidden), hidden.name, str(tmp_path)]),
    ):
        r = await h.post("/v1/kv-caches", spec_for(sent))
        assert r.status_code == 422, r.text
        err = r.json()["error"]
        assert err == {
            "code": "invalid_registration",
            "message": f"tensors[0].handle.path {sent!r} is outside {SHM_DIR}: it must name a "
            f"file inside {SHM_DIR} once symlinks and '..' are followed",
        }
        for part in target_parts:
            assert part not in r.text, (sent, part)
    assert (await h.client.get("/v1/kv-caches")).json()["kv_caches"] == []


async def test_any_path_maps_only_inside_dev_shm(
    h: Harness, tmp_path: Path, shm_links: list[str]
) -> None:
    """Hypothesis builds paths from ``/dev/shm``, ``..``, ``.``, empty segments, links in and
    out and real files: a registration is accepted exactly when the path's real location is a
    large enough regular file inside /dev/shm."""
    outside = tmp_path / "f"
    outside.write_bytes(b"\0" * 16384)
    tag = uuid.uuid4().hex[:8]
    dev = ShmDevice(4, h.settings.block_bytes)
    h.devices.append(dev)
    names = {
        "out": f"kvoffload-test-out-{tag}",
        "dir": f"kvoffload-test-dir-{tag}",
        "in": f"kvoffload-test-in-{tag}",
    }
    os.symlink(outside, f"{SHM_DIR}/{names['out']}")
    os.symlink(tmp_path, f"{SHM_DIR}/{names['dir']}")
    os.symlink(dev.path, f"{SHM_DIR}/{names['in']}")
    shm_links.extend(f"{SHM_DIR}/{n}" for n in names.values())
    segments = st.sampled_from(
        [
            *["dev", "shm", "..", ".", "", "tmp", "f", "etc", "passwd", "proc", "self", "fd", "0"],
            *names.values(),
            os.path.basename(dev.path),
            str(tmp_path).strip("/"),
        ]
    )
    root = os.path.realpath(SHM_DIR)

    @settings(max_examples=200, deadline=None, database=None, derandomize=True)
    @given(parts=st.lists(segments, min_size=1, max_size=7), absolute=st.booleans())
    def paths(parts: list[str], absolute: bool) -> None:
        path = ("/" if absolute else "") + "/".join(parts)
        real = os.path.realpath(path)
        inside = real.startswith(root + os.sep)
        ok = inside and os.path.isfile(real) and os.path.getsize(real) >= 16384
        r = anyio.from_thread.run(lambda: h.post("/v1/kv-caches", spec_for(path)))
        assert r.status_code == (201 if ok else 422), (path, real, r.text)

    await anyio.to_thread.run_sync(paths)


# --------------------------------------------------------------------------- request ids


@pytest.mark.parametrize(
    ("sent", "echoed"),
    [
        ("abc-123", True),
        ("A.b:c_d-9", True),
        ("x" * 120, True),
        ("x" * 121, False),
        ("has space", False),
        ('quote"d', False),
        ("<script>", False),
        ("a/b", False),
        ("tab\there", False),
        ("{json}", False),
    ],
)
async def test_only_safe_request_ids_are_echoed(h: Harness, sent: str, echoed: bool) -> None:
    """``X-Request-ID`` is taken (and echoed) only when safe; otherwise the call gets a safe id
    of its own and the caller's value appears nowhere in the answer."""
    r = await h.client.get("/livez", headers={"x-request-id": sent})
    got = r.headers["x-request-id"]
    assert SAFE_ID.fullmatch(got), got
    assert (got == sent) is echoed
    if not echoed:
        assert sent not in r.text
        assert sent not in repr(r.headers.multi_items())


async def test_any_request_id_header_yields_a_safe_id(h: Harness) -> None:
    """Hypothesis: any header value (bytes 0x20-0xff): the call's id is safe and is the sent
    value exactly when that value is safe."""

    @settings(
        max_examples=150,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow],
    )
    @given(sent=st.binary(min_size=1, max_size=200).filter(lambda b: all(c >= 0x20 for c in b)))
    def ids(sent: bytes) -> None:
        r = anyio.from_thread.run(lambda: h.client.get("/livez", headers={b"x-request-id": sent}))
        got = r.headers["x-request-id"]
        assert SAFE_ID.fullmatch(got), (sent, got)
        is_safe = sent.isascii() and SAFE_ID.fullmatch(sent.decode()) is not None
        assert (got.encode() == sent) is is_safe

    await anyio.to_thread.run_sync(ids)


NASTY_REQ_IDS = [
    'evil\n{"level":"error","event":"forged"}',
    "<script>alert(1)<\\script>",
    "ünï\u202ecode\u0000nul",
    "x" * 256,
    "..%2F..%2Fadmin",
    "a b?c#d",
    "safe-id.1:2",
]


def server_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    """Records of the service's own loggers (not the test client's httpx lines)."""
    return [r for r in caplog.records if r.name.startswith(("kvoffload", "uvicorn"))]


@pytest.mark.parametrize("req_id", NASTY_REQ_IDS)
async def test_engine_req_ids_reach_logs_and_exemplars_only_in_safe_form(
    h: Harness, caplog: pytest.LogCaptureFixture, req_id: str
) -> None:
    """A request served under any id: its canonical log lines and its metric exemplars carry
    ``safe_req_id(req_id)`` (safe charset, at most 120 characters), never the raw id."""
    caplog.set_level(logging.DEBUG)
    path = f"/v1/requests/{quote(req_id, safe='')}"
    assert (await h.client.put(path)).status_code == 201
    r = await h.post(f"{path}/lookup", {"keys": hexkeys(1)})
    assert r.status_code == 200
    safe = safe_req_id(req_id)
    assert SAFE_ID.fullmatch(safe)
    records = server_records(caplog)
    mine = [
        fields_of(rec)
        for rec in records
        if str(fields_of(rec).get("route", "")).startswith("/v1/requests/")
    ]
    assert mine, [fields_of(rec) for rec in records]
    for fields in mine:
        assert fields["req_id"] == safe, fields
    for record in records:
        for key, value in fields_of(record).items():
            if key in ("req_id", "request_id"):
                assert SAFE_ID.fullmatch(str(value)), (key, value)
        if req_id != safe:
            assert req_id not in record.getMessage() + repr(fields_of(record))
    text = (await h.client.get("/metrics", headers={"accept": "application/openmetrics-text"})).text
    exemplars = re.findall(r'# \{req_id="([^"]*)"\}', text)
    assert safe in exemplars
    assert all(SAFE_ID.fullmatch(e) for e in exemplars), exemplars
    if req_id != safe:
        assert req_id not in text


async def test_the_client_addresses_exactly_the_request_it_names(h: Harness) -> None:
    """Hypothesis: for any request id, the typed client starts, looks up and aborts that
    request and no other (``?``, ``#``, ``%``, ``..`` cannot redirect a call to another
    request); an id holding ``/`` cannot be a path segment and is refused (404, 405, or the
    307 of the next test) without touching anyone."""
    from kvoffload_client.client import AsyncKVOffloadClient, KVOffloadError

    client = AsyncKVOffloadClient("http://engine", transport=httpx.ASGITransport(h.app))
    await h.start("bystander")

    async def life(req_id: str) -> tuple[bool, list[str]]:
        served, refused = False, 0
        try:
            await client.start_request(req_id)
            await client.lookup(req_id, [b"\x01"])
            released = await client.finish_request(req_id, abort=True)
            served = released.req_id == req_id
        except KVOffloadError as exc:
            refused = exc.status
        assert served or refused in (307, 404, 405), (req_id, refused)
        listed = (await h.admin.get("/admin/v1/requests")).json()["requests"]
        return served, [r["req_id"] for r in listed]

    @settings(max_examples=150, deadline=None, database=None, derandomize=True)
    @given(
        req_id=st.text(min_size=1, max_size=40)
        | st.sampled_from(["bystander?x", "bystander#x", "%62ystander", "./bystander", ".."])
        | st.text(alphabet="?#%/.&=+ab", min_size=1, max_size=12)
    )
    def ids(req_id: str) -> None:
        served, listed = anyio.from_thread.run(life, req_id)
        assert listed == ["bystander"], (req_id, listed)  # nobody else started or aborted
        if "/" not in req_id:
            assert served, req_id

    try:
        await anyio.to_thread.run_sync(ids)
    finally:
        await client.aclose()


async def test_an_id_ending_in_a_slash_is_not_redirected_to_another_request(h: Harness) -> None:
    """``DELETE /v1/requests/victim%2F?abort=true`` must not send the caller on to abort
    ``victim``."""
    await h.start("victim")
    r = await h.client.delete("/v1/requests/victim%2F", params={"abort": "true"})
    assert r.status_code in (404, 405), (r.status_code, r.headers.get("location"))
