"""Issue #42 (items 4, 5, 12): what a caller without a token reads of a service with tenants,
and a repeated admin query parameter.

Two tenants (``tests.api.test_tenancy``'s ``alpha``, namespaces ``a1`` and ``a2``, and ``beta``,
``b1``), in process. ``/readyz`` and an open ``/metrics`` name no tenant, namespace, request id,
endpoint or bucket; the admin API's ``GET /admin/v1/readiness`` (token required) says it all.
An admin call naming a query parameter twice is refused and changes nothing.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from app.http.routes.health import NOT_READY
from tests.api.test_security_tenants import OPENMETRICS, SCRAPE, engine_with
from tests.api.test_tenancy import ALPHA, BETA, NS, tenants_running
from testsupport.api_harness import hexkeys

pytestmark = pytest.mark.anyio

# What a degraded object tier's error quotes: the endpoint, the bucket, the namespace's prefix.
S3_ERROR = (
    "degraded: Could not connect to the endpoint URL: "
    '"http://minio.internal:9000/kv-secret-bucket/kv/b1@beta/65536/"; '
    "serves from the pool and the other tiers; blocks in the bucket wait"
)
NAMES = ("b1", "beta", "alpha", "a1", "minio.internal", "kv-secret-bucket")


def names_in(text: str) -> list[str]:
    """The names of ``NAMES`` that ``text`` carries."""
    return [name for name in NAMES if name in text]


async def test_readyz_with_a_degraded_tier_names_no_namespace_endpoint_or_bucket(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with tenants_running(tmp_path) as t:
        tiers = t.tenancy.spaces["b1"].service.tiers
        monkeypatch.setattr(tiers, "details", lambda: {"object_tier": S3_ERROR})
        r = await t.engine.get("/readyz")
        assert r.status_code == 200
        assert r.json() == {"status": "ready"}
        assert names_in(r.text) == []
        # The operator reads it all on the admin API, and only with the token.
        r = await t.admin.get("/admin/v1/readiness")
        assert r.status_code == 200, r.text
        assert r.json() == {"status": "ready", "details": {"b1.object_tier": S3_ERROR}}
        r = await t.admin.get("/admin/v1/readiness", headers={"Authorization": ""})
        assert r.status_code == 401
        assert names_in(r.text) == []


async def test_a_namespace_not_ready_is_not_named_on_readyz(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transfer.cpu_worker import CpuTransferWorker

    async with tenants_running(tmp_path) as t:
        fatal = "copy failed: CUDA error: an illegal memory access was encountered"
        monkeypatch.setattr(CpuTransferWorker, "fatal", property(lambda self: fatal))
        r = await t.engine.get("/readyz")
        assert r.status_code == 503
        assert r.json() == {"status": "not_ready", "reason": NOT_READY}
        assert names_in(r.text) == []
        assert "CUDA" not in r.text
        r = await t.admin.get("/admin/v1/readiness")
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["status"] == "not_ready"
        assert body["reason"].startswith("namespace 'a1': transfer backend failed")
        assert fatal in body["reason"]


async def test_a_draining_service_with_tenants_says_only_that(tmp_path: Path) -> None:
    async with tenants_running(tmp_path) as t:
        t.tenancy.begin_drain()
        r = await t.engine.get("/readyz")
        assert r.status_code == 503
        assert r.json() == {"status": "not_ready", "reason": "shutting down"}
        r = await t.admin.get("/admin/v1/readiness")
        assert r.json() == {"status": "not_ready", "reason": "namespace 'a1': shutting down"}


async def test_open_metrics_with_tenants_name_no_tenant_namespace_or_request_id(
    tmp_path: Path,
) -> None:
    headers = {"Authorization": f"Bearer {ALPHA}", NS: "a1"}
    async with engine_with(tmp_path, metrics_live_requests=True) as client:
        r = await client.put("/v1/requests/alice-secret-session-42", json={}, headers=headers)
        assert r.status_code == 201, r.text
        for accept in ({}, OPENMETRICS):
            r = await client.get("/metrics", headers=accept)
            assert r.status_code == 200
            assert "alice-secret-session-42" not in r.text
            assert "req_id=" not in r.text
            # No namespace's series: each names its tenant and namespace (#42.4).
            assert "tenant=" not in r.text
            assert "namespace=" not in r.text
            assert "kvoffload_live_requests" not in r.text
            # The service-wide series stay.
            assert "kvoffload_tenants_reloads_total 0.0" in r.text
            assert "# HELP kvoffload_http_requests" in r.text


async def test_a_scrape_token_brings_live_request_ids_back(tmp_path: Path) -> None:
    headers = {"Authorization": f"Bearer {ALPHA}", NS: "a1"}
    token_file = tmp_path / "scrape-token"
    token_file.write_text(SCRAPE + "\n")
    token_file.chmod(0o640)
    async with engine_with(
        tmp_path, metrics_live_requests=True, metrics_token_file=token_file
    ) as client:
        r = await client.put("/v1/requests/alice-session-7", json={}, headers=headers)
        assert r.status_code == 201, r.text
        r = await client.get("/metrics")
        assert r.status_code == 401
        assert "alice-session-7" not in r.text
        r = await client.get("/metrics", headers={"Authorization": f"Bearer {SCRAPE}"})
        assert r.status_code == 200
        assert (
            'kvoffload_request_blocks{kind="pinned",namespace="a1",req_id="alice-session-7"'
            in r.text
        )
        assert 'kvoffload_live_requests{namespace="a1",tenant=' in r.text


async def test_a_repeated_admin_namespace_is_refused_and_clears_nothing(tmp_path: Path) -> None:
    async with tenants_running(tmp_path) as t:
        await t.store(ALPHA, "a1", "w", hexkeys(1, 2))
        await t.store(BETA, "b1", "w", hexkeys(3))
        for query in ("namespace=a1&namespace=b1", "namespace=b1&namespace=b1"):
            r = await t.admin.post(f"/admin/v1/cache/clear?{query}")
            assert r.status_code == 400, r.text
            assert r.json()["error"]["code"] == "ambiguous_credentials"
            r = await t.admin.get(f"/admin/v1/stats?{query}")
            assert r.status_code == 400, r.text
        for ns, ready in (("a1", 2), ("b1", 1)):
            stats = await t.admin.get("/admin/v1/stats", params={"namespace": ns})
            assert stats.json()["blocks"]["ready"] == ready
        # Any other parameter given twice: 422, whatever the values.
        r = await t.admin.get("/admin/v1/requests?namespace=a1&limit=1&limit=1")
        assert r.status_code == 422, r.text
        assert "limit" in r.json()["error"]["message"]
        # Without the token: 401 first, as for any query.
        r = await t.admin.post(
            "/admin/v1/cache/clear?namespace=a1&namespace=b1", headers={"Authorization": ""}
        )
        assert r.status_code == 401
        r = await t.admin.post("/admin/v1/cache/clear", params={"namespace": "b1"})
        assert r.status_code == 200
        assert (await t.admin.get("/admin/v1/stats?namespace=b1")).json()["blocks"]["ready"] == 0


async def test_without_tenants_readyz_still_says_why_and_what(tmp_path: Path) -> None:
    """Without tenants the engine listener is on loopback and open to its caller anyway:
    ``/readyz`` keeps its details, and the admin route answers the same."""
    from app.core.service import Service
    from app.http.apps import create_admin_app, create_app
    from testsupport.api_harness import TOKEN, make_settings

    settings = make_settings()
    service = Service(settings)
    app = create_app(settings, service=service)
    admin_app = create_admin_app(settings, service)
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
        service.tiers.details = lambda: {"object_tier": S3_ERROR}  # type: ignore[method-assign]
        expected = {"status": "ready", "details": {"object_tier": S3_ERROR}}
        assert (await engine.get("/readyz")).json() == expected
        assert (await admin.get("/admin/v1/readiness")).json() == expected
