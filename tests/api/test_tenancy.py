"""Tenants and namespaces through the engine and admin APIs (in process, lifespans running).

Two tenants: ``alpha`` owns namespaces ``a1`` and ``a2``, ``beta`` owns ``b1``. Each namespace
is a space of its own, so every cross-tenant attempt is checked for what it answers *and* for
what leaked (lookups, events, pool ids, admin views), with the same block hashes in both.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import logging
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.core import tenancy_reloads as tenancy_module
from app.core.tenancy import Tenancy
from app.core.tenants import Credentials
from app.http.apps import create_admin_app, create_app
from app.http.operations import OPERATIONS
from app.settings import Settings
from app.telemetry.logging import configure_logging, fields_of, unconfigure_logging
from testsupport.api_harness import TOKEN, hexkeys, make_settings

pytestmark = pytest.mark.anyio

ALPHA = "alpha-token-0000000000000001"
ALPHA_NEXT = "alpha-token-0000000000000002"
BETA = "beta-token-00000000000000001"
NS = "X-KVOffload-Namespace"

TENANTS = f"""
[tenants.alpha]
tokens = ["{ALPHA}"]
namespaces = {{ a1 = 8, a2 = 4 }}
max_pins = 3
max_requests = 3

[tenants.beta]
tokens = ["{BETA}"]
namespaces = ["b1"]
"""


def write_tenants(path: Path, text: str) -> None:
    """Write the tenants file as an operator would (not readable by others), so that a
    reload sees a new signature."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)


@dataclass
class Tenants:
    settings: Settings
    tenancy: Tenancy
    engine: httpx.AsyncClient
    admin: httpx.AsyncClient
    path: Path

    def as_(self, token: str | None, namespace: str | None = None) -> dict[str, str]:
        headers: dict[str, str] = {}
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        if namespace is not None:
            headers[NS] = namespace
        return headers

    async def call(
        self,
        token: str | None,
        method: str,
        path: str,
        body: Any = None,
        namespace: str | None = None,
    ) -> httpx.Response:
        return await self.engine.request(
            method, path, json=body, headers=self.as_(token, namespace)
        )

    async def store(self, token: str, ns: str | None, req: str, keys: list[str]) -> None:
        r = await self.call(token, "PUT", f"/v1/requests/{req}", {}, ns)
        assert r.status_code in (200, 201), r.text
        r = await self.call(token, "POST", f"/v1/requests/{req}/prepare-store", {"keys": keys}, ns)
        assert r.status_code == 200, r.text
        r = await self.call(token, "POST", f"/v1/requests/{req}/complete-store", {"keys": keys}, ns)
        assert r.status_code == 200, r.text
        assert r.json()["completed"] == keys


@contextlib.asynccontextmanager
async def tenants_running(
    tmp_path: Path, text: str = TENANTS, **overrides: Any
) -> AsyncIterator[Tenants]:
    """Both apps of a service with the tenants ``text``, lifespans running; ``overrides`` are
    settings (``make_settings``)."""
    path = tmp_path / "tenants.toml"
    write_tenants(path, text)
    settings = make_settings(**overrides)
    tenancy = Tenancy(settings, credentials=Credentials(path))
    app = create_app(settings, tenancy=tenancy)
    admin_app = create_admin_app(settings, tenancy=tenancy)
    async with (
        app.router.lifespan_context(app),
        admin_app.router.lifespan_context(admin_app),
        httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://e") as engine,
        httpx.AsyncClient(
            transport=httpx.ASGITransport(admin_app),
            base_url="http://a",
            headers={"Authorization": f"Bearer {TOKEN}"},
        ) as admin,
    ):
        yield Tenants(settings, tenancy, engine, admin, path)


def engine_routes() -> list[tuple[str, str, Any]]:
    """Every engine route with a body good enough to pass validation."""
    keys = {"keys": hexkeys(1)}
    bodies: dict[str, Any] = {
        "start_request": {},
        "complete_store": {**keys, "success": True},
        "offload": {**keys, "cache_id": "c", "device_blocks": [0]},
        "onload": {**keys, "cache_id": "c", "device_blocks": [0]},
    }
    routes = [
        (op.method, op.path.replace("{req_id}", "r1"), bodies.get(op.name, keys))
        for op in OPERATIONS
    ]
    routes += [
        ("POST", "/v1/batch", {"ops": [{"op": "lookup", "req_id": "r1", **keys}]}),
        ("GET", "/v1/jobs/1", None),
        ("POST", "/v1/jobs/wait", {"job_ids": [1], "timeout_s": 0}),
        ("GET", "/v1/events", None),
        ("GET", "/v1/kv-caches", None),
        ("DELETE", "/v1/kv-caches/c", None),
        ("POST", "/v1/kv-caches", {"name": "x"}),
        ("GET", "/v1/pool", None),
    ]
    return routes


@pytest.mark.parametrize(
    ("authorization", "code"),
    [
        (None, "missing_token"),
        ("Bearer wrong-token-000000000000000", "unknown_token"),
        ("Basic YWxwaGE6eA==", "malformed_authorization"),
        (f"Bearer {ALPHA} extra", "malformed_authorization"),
    ],
)
async def test_every_engine_route_refuses_a_caller_without_a_good_token(
    tmp_path: Path, authorization: str | None, code: str
) -> None:
    async with tenants_running(tmp_path) as t:
        headers = {} if authorization is None else {"Authorization": authorization}
        for method, path, body in engine_routes():
            r = await t.engine.request(method, path, json=body, headers=headers)
            assert r.status_code == 401, (method, path, r.text)
            assert r.json()["error"]["code"] == code, (method, path, r.text)
            assert r.headers["www-authenticate"] == "Bearer"
            assert "x-kvoffload-pool" not in r.headers  # not even which pool is there
            assert ALPHA not in r.text
        # Nothing was created by any of those calls.
        for space in t.tenancy.spaces.values():
            assert space.service.pool_manager.num_requests == 0


async def test_health_and_metrics_need_no_token(tmp_path: Path) -> None:
    async with tenants_running(tmp_path) as t:
        assert (await t.engine.get("/livez")).status_code == 200
        assert (await t.engine.get("/readyz")).status_code == 200
        assert (await t.engine.get("/metrics")).status_code == 200


async def test_a_tenant_with_several_namespaces_must_name_one(tmp_path: Path) -> None:
    async with tenants_running(tmp_path) as t:
        r = await t.call(ALPHA, "PUT", "/v1/requests/r1", {})
        assert r.status_code == 403
        assert r.json()["error"]["code"] == "namespace_required"
        r = await t.call(ALPHA, "PUT", "/v1/requests/r1", {}, "a1")
        assert r.status_code == 201
        # beta has one namespace: the header may be left out.
        r = await t.call(BETA, "PUT", "/v1/requests/r1", {})
        assert r.status_code == 201


async def test_the_same_hashes_in_two_tenants_are_two_blocks_and_nothing_crosses(
    tmp_path: Path,
) -> None:
    keys = hexkeys(1, 2, 3)
    async with tenants_running(tmp_path) as t:
        await t.store(ALPHA, "a1", "ra", keys)

        # beta naming alpha's namespace: refused like a namespace nobody has.
        for ns in ("a1", "a2", "nobody"):
            for method, path, body in engine_routes():
                r = await t.call(BETA, method, path, body, ns)
                assert r.status_code == 403, (ns, method, path, r.text)
                assert r.json()["error"]["code"] == "namespace_denied"
                assert "x-kvoffload-pool" not in r.headers

        # beta in its own namespace: alpha's blocks do not exist there.
        r = await t.call(BETA, "PUT", "/v1/requests/rb", {})
        assert r.status_code == 201
        r = await t.call(BETA, "POST", "/v1/requests/rb/lookup", {"keys": keys})
        assert r.json() == {"results": ["miss"] * 3, "hit_prefix": 0}
        r = await t.call(BETA, "POST", "/v1/requests/rb/prepare-load", {"keys": keys})
        assert r.status_code == 409  # not ready here: nothing pinned, no slot revealed
        r = await t.call(BETA, "POST", "/v1/requests/rb/touch", {"keys": keys})
        assert r.status_code == 200
        events = (await t.call(BETA, "GET", "/v1/events")).json()
        assert events["events"] == []
        # Completing a store of alpha's keys it never reserved: ignored, nothing visible.
        r = await t.call(
            BETA, "POST", "/v1/requests/rb/complete-store", {"keys": keys, "success": True}
        )
        assert r.json()["ignored"] == keys
        # beta storing the same hashes gets blocks of its own.
        await t.store(BETA, None, "rb2", keys)
        a1 = t.tenancy.spaces["a1"].service.pool_manager
        b1 = t.tenancy.spaces["b1"].service.pool_manager
        assert a1.stats().ready == 3
        assert b1.stats().ready == 3
        # Clearing beta's namespace (an operator, on beta's behalf) leaves alpha's alone.
        r = await t.admin.post("/admin/v1/cache/clear", params={"namespace": "b1"})
        assert r.json()["dropped"] == 3
        r = await t.call(ALPHA, "POST", "/v1/requests/ra/lookup", {"keys": keys}, "a1")
        assert r.json()["hit_prefix"] == 3
        # Each namespace has a pool of its own.
        pool_a = (await t.call(ALPHA, "GET", "/v1/pool", namespace="a1")).json()
        pool_b = (await t.call(BETA, "GET", "/v1/pool")).json()
        assert pool_a["pool_id"] != pool_b["pool_id"]
        assert pool_a["num_blocks"] == 8
        assert pool_b["num_blocks"] == t.settings.num_blocks
        r = await t.call(BETA, "GET", "/v1/pool")
        assert r.headers["x-kvoffload-pool"] == pool_b["pool_id"]


async def test_alpha_s_two_namespaces_are_apart_too(tmp_path: Path) -> None:
    keys = hexkeys(7)
    async with tenants_running(tmp_path) as t:
        await t.store(ALPHA, "a1", "r", keys)
        await t.call(ALPHA, "PUT", "/v1/requests/r", {}, "a2")
        r = await t.call(ALPHA, "POST", "/v1/requests/r/lookup", {"keys": keys}, "a2")
        assert r.json()["results"] == ["miss"]


async def test_request_quota_is_429_and_changes_nothing(tmp_path: Path) -> None:
    async with tenants_running(tmp_path) as t:
        for i, ns in enumerate(("a1", "a2", "a1")):
            r = await t.call(ALPHA, "PUT", f"/v1/requests/r{i}", {}, ns)
            assert r.status_code == 201
        r = await t.call(ALPHA, "PUT", "/v1/requests/r9", {}, "a2")
        assert r.status_code == 429, r.text
        assert r.json()["error"]["code"] == "quota_exceeded"
        assert r.json()["error"]["quota"] == "requests"
        assert r.headers["retry-after"] == "1"
        # Renewing a live request is not a new one.
        assert (await t.call(ALPHA, "PUT", "/v1/requests/r0", {}, "a1")).status_code == 200
        # beta is not held to alpha's quota.
        for i in range(5):
            assert (await t.call(BETA, "PUT", f"/v1/requests/b{i}", {})).status_code == 201
        # One finished: room again.
        assert (await t.call(ALPHA, "DELETE", "/v1/requests/r1", None, "a2")).status_code == 200
        assert (await t.call(ALPHA, "PUT", "/v1/requests/r9", {}, "a2")).status_code == 201


async def test_pin_quota_is_429_and_pins_nothing(tmp_path: Path) -> None:
    keys = hexkeys(1, 2, 3, 4)
    async with tenants_running(tmp_path) as t:
        await t.store(ALPHA, "a1", "w", keys)
        await t.call(ALPHA, "PUT", "/v1/requests/r", {}, "a1")
        r = await t.call(ALPHA, "POST", "/v1/requests/r/prepare-load", {"keys": keys}, "a1")
        assert r.status_code == 429, r.text
        assert r.json()["error"]["quota"] == "pins"
        a1 = t.tenancy.spaces["a1"].service.pool_manager
        assert a1.num_pinned == 0
        r = await t.call(ALPHA, "POST", "/v1/requests/r/prepare-load", {"keys": keys[:3]}, "a1")
        assert r.status_code == 200
        # In a batch, the refused op answers 429 on its own.
        r = await t.call(
            ALPHA,
            "POST",
            "/v1/batch",
            {"ops": [{"op": "prepare_load", "req_id": "r", "keys": keys[3:]}]},
            "a1",
        )
        assert r.json()["results"][0]["status"] == 429
        assert r.json()["results"][0]["error"]["quota"] == "pins"


async def test_block_quota_is_the_namespace_pool_and_507_names_it(tmp_path: Path) -> None:
    keys = hexkeys(*range(1, 5))
    async with tenants_running(tmp_path) as t:
        await t.store(ALPHA, "a2", "w", keys)  # a2 holds 4 blocks: full
        await t.call(ALPHA, "PUT", "/v1/requests/r", {}, "a2")
        r = await t.call(ALPHA, "POST", "/v1/requests/r/prepare-load", {"keys": keys[:3]}, "a2")
        assert r.status_code == 200
        await t.call(ALPHA, "PUT", "/v1/requests/s", {}, "a2")
        # Three pinned, one evictable: a store of two cannot fit.
        r = await t.call(
            ALPHA, "POST", "/v1/requests/s/prepare-store", {"keys": hexkeys(8, 9)}, "a2"
        )
        assert r.status_code == 507, r.text
        assert r.json()["error"]["code"] == "quota_exceeded"
        assert r.json()["error"]["quota"] == "blocks"
        # One fits: alpha's own cold block is evicted, nobody else's.
        r = await t.call(ALPHA, "POST", "/v1/requests/s/prepare-store", {"keys": hexkeys(8)}, "a2")
        assert r.status_code == 200
        assert r.json()["evicted_keys"] == keys[3:]


async def test_a_token_file_replaced_while_serving_takes_effect_without_restart(
    tmp_path: Path,
) -> None:
    async with tenants_running(tmp_path) as t:
        assert (await t.call(ALPHA, "PUT", "/v1/requests/r", {}, "a1")).status_code == 201
        rotated = TENANTS.replace(f'tokens = ["{ALPHA}"]', f'tokens = ["{ALPHA_NEXT}"]')
        rotated = rotated.replace('namespaces = ["b1"]', 'namespaces = ["b1", "b2"]')
        write_tenants(t.path, rotated)
        assert await t.tenancy.reload()
        r = await t.call(ALPHA, "GET", "/v1/events", namespace="a1")
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "revoked_token"
        r = await t.call(ALPHA_NEXT, "GET", "/v1/events", namespace="a1")
        assert r.status_code == 200
        # The request started under the old token lives on in its namespace.
        assert t.tenancy.spaces["a1"].service.pool_manager.num_requests == 1
        # A namespace added by the reload serves at once.
        r = await t.call(BETA, "PUT", "/v1/requests/x", {}, "b2")
        assert r.status_code == 201
        # A broken file changes nothing.
        write_tenants(t.path, "[tenants.alpha]\ntokens = 3\n")
        assert not await t.tenancy.reload()
        assert t.tenancy.reload_failures == 1
        metrics = (await t.engine.get("/metrics")).text
        assert "kvoffload_tenants_file_in_force 0.0" in metrics.splitlines()
        assert (await t.call(ALPHA_NEXT, "GET", "/v1/events", namespace="a1")).status_code == 200
        # beta removed: its token is revoked and its namespaces are gone.
        write_tenants(t.path, rotated[: rotated.index("[tenants.beta]")])
        assert await t.tenancy.reload()
        r = await t.call(BETA, "GET", "/v1/events")
        assert r.json()["error"]["code"] == "revoked_token"
        assert set(t.tenancy.spaces) == {"a1", "a2"}
        view = (await t.admin.get("/admin/v1/tenants")).json()
        assert [row["tenant"] for row in view["tenants"]] == ["alpha"]
        assert view["reloads"] == 2
        assert view["reload_failures"] == 1


async def test_the_watcher_reloads_a_changed_file_by_itself(tmp_path: Path) -> None:
    import asyncio

    async with tenants_running(tmp_path) as t:
        write_tenants(t.path, TENANTS.replace(ALPHA, ALPHA_NEXT))
        for _ in range(100):  # the watcher polls every RELOAD_POLL_S (1 s)
            if t.tenancy.reloads:
                break
            await asyncio.sleep(0.05)
        assert t.tenancy.reloads == 1
        r = await t.call(ALPHA_NEXT, "GET", "/v1/events", namespace="a1")
        assert r.status_code == 200


async def test_admin_views_break_down_by_tenant_and_need_a_namespace(tmp_path: Path) -> None:
    async with tenants_running(tmp_path) as t:
        await t.store(ALPHA, "a1", "w", hexkeys(1, 2))
        await t.call(BETA, "PUT", "/v1/requests/b", {})
        r = await t.admin.get("/admin/v1/stats")
        assert r.status_code == 422
        assert "namespace" in r.json()["error"]["message"]
        r = await t.admin.get("/admin/v1/stats", params={"namespace": "zz"})
        assert r.status_code == 404
        r = await t.admin.get("/admin/v1/stats", params={"namespace": "a1"})
        assert r.json()["blocks"]["ready"] == 2
        r = await t.admin.get("/admin/v1/requests", params={"namespace": "b1"})
        assert [row["req_id"] for row in r.json()["requests"]] == ["b"]
        r = await t.admin.get("/admin/v1/policy/shadow", params={"namespace": "b1"})
        assert r.status_code == 200
        view = (await t.admin.get("/admin/v1/tenants")).json()
        assert view["enabled"] is True
        alpha, beta = view["tenants"]
        assert (alpha["tenant"], alpha["max_pins"], alpha["max_requests"]) == ("alpha", 3, 3)
        assert alpha["blocks"] == 12
        assert [ns["namespace"] for ns in alpha["namespaces"]] == ["a1", "a2"]
        assert alpha["namespaces"][0]["ready"] == 2
        assert (beta["tenant"], beta["requests"]) == ("beta", 1)
        assert "token" not in r.text


async def test_metrics_carry_tenant_and_namespace_labels(tmp_path: Path) -> None:
    scrape = "scrape-token-for-the-labels-test-0001"
    async with tenants_running(tmp_path, metrics_token=scrape) as t:
        await t.store(ALPHA, "a1", "w", hexkeys(1))
        await t.call(None, "GET", "/v1/events")  # refused: counted in the front metrics
        auth = {"Authorization": f"Bearer {scrape}"}
        text = (await t.engine.get("/metrics", headers=auth)).text
        lines = text.splitlines()
        ops = [line for line in lines if line.startswith("kvoffload_manager_ops_total{")]
        assert any(
            'namespace="a1"' in line and 'tenant="alpha"' in line and 'op="prepare_store"' in line
            for line in ops
        ), ops
        assert 'tenant="beta"' in text  # beta's namespace exports its (zero) state too
        refused = [line for line in text.splitlines() if 'route="/v1/events"' in line]
        assert any('status="401"' in line and "tenant=" not in line for line in refused)
        assert text.count("# TYPE kvoffload_manager_ops_total counter") == 1
        assert "kvoffload_tenants_reload_failures_total 0.0" in lines


async def test_a_namespace_that_cannot_start_leaves_the_others_serving(tmp_path: Path) -> None:
    async with tenants_running(tmp_path) as t:
        huge = TENANTS.replace(
            'namespaces = ["b1"]', "namespaces = { b1 = 32, b2 = 1099511627776 }"
        )
        write_tenants(t.path, huge)
        assert await t.tenancy.reload()  # the file loaded: tokens and the rest apply
        assert "b2" not in t.tenancy.spaces
        assert t.tenancy.reload_failures == 1
        assert t.tenancy.file_in_force is False
        r = await t.call(BETA, "PUT", "/v1/requests/x", {}, "b2")
        assert r.status_code == 403
        r = await t.call(BETA, "PUT", "/v1/requests/x", {}, "b1")
        assert r.status_code == 201


async def test_a_namespace_added_by_a_reload_reports_a_failed_backend_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transfer.cpu_worker import CpuTransferWorker

    async with tenants_running(tmp_path) as t:
        asked: list[str] = []
        t.tenancy.set_on_fatal(asked.append)
        write_tenants(t.path, TENANTS.replace('namespaces = ["b1"]', 'namespaces = ["b1", "b2"]'))
        assert await t.tenancy.reload()
        added = t.tenancy.spaces["b2"].service
        assert added.on_fatal == asked.append
        reason = "copy failed: CUDA error: an illegal memory access was encountered"
        monkeypatch.setattr(CpuTransferWorker, "fatal", property(lambda self: reason))
        # Every namespace's sweep reports it once: the one the reload added among them.
        for _ in range(500):
            if len(asked) == len(t.tenancy.spaces):
                break
            await asyncio.sleep(0.02)
        assert asked == [reason] * 4
        assert added._fatal_reported
        r = await t.call(BETA, "GET", "/readyz")
        assert r.status_code == 503


def reload_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    """The ``tenants reloaded`` records caplog holds, then clears them."""
    records = [r for r in caplog.records if r.getMessage() == "tenants reloaded"]
    caplog.clear()
    return records


@pytest.fixture
def no_watcher_reloads(monkeypatch: pytest.MonkeyPatch) -> None:
    """The file watcher waits an hour between looks: only the test's own reloads happen, so
    each change is logged once."""
    monkeypatch.setattr(tenancy_module, "RELOAD_POLL_S", 3600.0)


@pytest.mark.usefixtures("no_watcher_reloads")
async def test_a_reload_logs_counts_at_info_unless_it_took_something_away(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="kvoffload.tenancy")
    async with tenants_running(tmp_path) as t:
        # Nothing changed (a SIGHUP, the same file rewritten): info, zero counts.
        write_tenants(t.path, TENANTS)
        assert await t.tenancy.reload()
        (same,) = reload_records(caplog)
        assert same.levelno == logging.INFO
        fields = fields_of(same)
        assert (fields["tokens_added"], fields["tokens_revoked"], fields["changed"]) == (
            0,
            0,
            False,
        )
        # A token added: still info.
        both = TENANTS.replace(f'tokens = ["{ALPHA}"]', f'tokens = ["{ALPHA}", "{ALPHA_NEXT}"]')
        write_tenants(t.path, both)
        assert await t.tenancy.reload()
        (added,) = reload_records(caplog)
        assert added.levelno == logging.INFO
        assert (fields_of(added)["tokens_added"], fields_of(added)["changed"]) == (1, True)
        # The old token removed: revoked, so warning.
        write_tenants(
            t.path, TENANTS.replace(f'tokens = ["{ALPHA}"]', f'tokens = ["{ALPHA_NEXT}"]')
        )
        assert await t.tenancy.reload()
        (revoked,) = reload_records(caplog)
        assert revoked.levelno == logging.WARNING
        assert (fields_of(revoked)["tokens_added"], fields_of(revoked)["tokens_revoked"]) == (0, 1)
        assert ALPHA not in str(fields_of(revoked))
        assert ALPHA_NEXT not in str(fields_of(revoked))


@pytest.mark.usefixtures("no_watcher_reloads")
async def test_the_reload_line_shows_its_token_counts_as_integers(tmp_path: Path) -> None:
    """Rendered as the service writes it (JSON): the counts, not ``[redacted]``."""
    buffer = io.StringIO()
    root_level = logging.getLogger().level
    configure_logging("info", stream=buffer, fmt="json")
    try:
        async with tenants_running(tmp_path) as t:
            write_tenants(t.path, TENANTS[: TENANTS.index("[tenants.beta]")])  # beta goes
            assert await t.tenancy.reload()
    finally:
        unconfigure_logging()
        logging.getLogger().setLevel(root_level)
    lines = [json.loads(line) for line in buffer.getvalue().splitlines()]
    (line,) = [line for line in lines if line["event"] == "tenants reloaded"]
    assert line["level"] == "warning"
    assert (line["tokens_added"], line["tokens_revoked"]) == (0, 1)
    assert BETA not in buffer.getvalue()
