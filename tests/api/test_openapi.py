"""The published OpenAPI specs are true: every route, body, answer and status is documented."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from pydantic import BaseModel

from app.http import schemas as s
from app.http.errors import ErrorBody
from app.http.operations import OPERATIONS
from app.http.routes.admin import LogLevelAnswer, LogLevelSwitchAnswer, ShadowAnswer
from testsupport.api_harness import Harness, hexkeys

pytestmark = pytest.mark.anyio

ENGINE_ROUTES = {
    ("put", "/v1/requests/{req_id}"),
    ("delete", "/v1/requests/{req_id}"),
    ("post", "/v1/requests/{req_id}/lookup"),
    ("post", "/v1/requests/{req_id}/prepare-load"),
    ("post", "/v1/requests/{req_id}/touch"),
    ("post", "/v1/requests/{req_id}/complete-load"),
    ("post", "/v1/requests/{req_id}/prepare-store"),
    ("post", "/v1/requests/{req_id}/complete-store"),
    ("post", "/v1/requests/{req_id}/offload"),
    ("post", "/v1/requests/{req_id}/onload"),
    ("get", "/v1/jobs/{job_id}"),
    ("post", "/v1/jobs/wait"),
    ("post", "/v1/batch"),
    ("get", "/v1/events"),
    ("post", "/v1/kv-caches"),
    ("get", "/v1/kv-caches"),
    ("delete", "/v1/kv-caches/{cache_id}"),
    ("post", "/v1/kv-caches/{cache_id}/renew"),
    ("get", "/v1/pool"),
    ("post", "/v1/requests/{req_id}/retain"),
    ("post", "/v1/requests/{req_id}/prefetch"),
    ("post", "/v1/requests/{req_id}/demote"),
    ("post", "/v1/requests/{req_id}/drop"),
    ("get", "/v1/retentions"),
    ("get", "/v1/retentions/{name}"),
    ("post", "/v1/retentions/{name}/renew"),
    ("delete", "/v1/retentions/{name}"),
    ("get", "/v1/prefetches/{prefetch_id}"),
    ("delete", "/v1/prefetches/{prefetch_id}"),
    ("get", "/livez"),
    ("get", "/readyz"),
    ("get", "/metrics"),
}
ADMIN_ROUTES = {
    ("get", "/admin/v1/policy"),
    ("put", "/admin/v1/policy"),
    ("get", "/admin/v1/stats"),
    ("get", "/admin/v1/tenants"),
    ("get", "/admin/v1/readiness"),
    ("get", "/admin/v1/requests"),
    ("post", "/admin/v1/requests/{req_id}/release"),
    ("post", "/admin/v1/cache/clear"),
    ("get", "/admin/v1/retentions"),
    ("delete", "/admin/v1/retentions/{name}"),
    ("get", "/admin/v1/policy/shadow"),
    ("get", "/admin/v1/log-level"),
    ("put", "/admin/v1/log-level"),
    ("get", "/livez"),
}


def operations(spec: dict[str, Any]) -> set[tuple[str, str]]:
    return {(m, p) for p, item in spec["paths"].items() for m in item}


def resolve(spec: dict[str, Any], ref: str) -> dict[str, Any]:
    node: Any = spec
    for part in ref.removeprefix("#/").split("/"):
        node = node[part]
    assert isinstance(node, dict)
    return node


def refs(node: Any) -> list[str]:
    if isinstance(node, dict):
        found = [node["$ref"]] if isinstance(node.get("$ref"), str) else []
        return found + [r for v in node.values() for r in refs(v)]
    if isinstance(node, list):
        return [r for v in node for r in refs(v)]
    return []


async def test_engine_spec_lists_every_route(h: Harness) -> None:
    spec = (await h.client.get("/openapi.json")).json()
    assert operations(spec) == ENGINE_ROUTES
    for ref in refs(spec):
        resolve(spec, ref)  # every $ref resolves


async def test_admin_spec_lists_every_route(h: Harness) -> None:
    spec = (await h.admin.get("/openapi.json")).json()
    assert operations(spec) == ADMIN_ROUTES
    for ref in refs(spec):
        resolve(spec, ref)
    put = spec["paths"]["/admin/v1/policy"]["put"]
    assert {"401", "403", "412", "422", "400", "413"} <= set(put["responses"])
    assert put["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith(
        "/PolicyBody"
    )


async def test_raw_body_routes_document_their_body_and_statuses(h: Harness) -> None:
    spec = (await h.client.get("/openapi.json")).json()
    for op in OPERATIONS:
        operation = spec["paths"][op.path][op.method.lower()]
        statuses = set(operation["responses"])
        assert str(op.status) in statuses
        assert {str(e) for e in op.errors} <= statuses, op.name
        if op.method != "DELETE":
            schema = operation["requestBody"]["content"]["application/json"]["schema"]
            assert resolve(spec, schema["$ref"])["title"] == op.body.__name__
            assert {"400", "413", "415", "422"} <= statuses
        params = {p["name"]: p for p in operation["parameters"]}
        assert params["req_id"]["in"] == "path"
    key = spec["components"]["schemas"]["KeysBody"]["properties"]["keys"]["items"]
    assert key["pattern"] == s.HEX_KEY_PATTERN
    batch = spec["paths"]["/v1/batch"]["post"]
    assert "not atomic" in batch["description"]


async def test_docs_page(h: Harness) -> None:
    r = await h.client.get("/docs")
    assert r.status_code == 200
    assert "swagger" in r.text.lower()


async def check(
    spec: dict[str, Any], method: str, path: str, r: httpx.Response, model: type[BaseModel]
) -> None:
    documented = spec["paths"][path][method]["responses"]
    assert str(r.status_code) in documented, (path, r.status_code)
    if r.status_code == 204:
        return
    if r.status_code >= 400:
        ErrorBody.model_validate(r.json())
    else:
        model.model_validate(r.json())


async def test_every_answer_matches_its_model(h: Harness) -> None:
    spec = (await h.client.get("/openapi.json")).json()
    aspec = (await h.admin.get("/openapi.json")).json()
    req = "/v1/requests/{req_id}"
    dev, cache_id = await h.device()
    keys = hexkeys(1, 2)

    async def engine(method: str, path: str, model: type[BaseModel], **kw: Any) -> httpx.Response:
        url = path.replace("{req_id}", "r1").replace("{cache_id}", cache_id)
        r = await h.client.request(method, url, **kw)
        await check(spec, method, path, r, model)
        return r

    await engine("put", req, s.StartRequestAnswer)
    await engine("post", req + "/lookup", s.LookupAnswer, json={"keys": keys})
    await engine("post", req + "/prepare-store", s.PrepareStoreAnswer, json={"keys": keys})
    await engine("post", req + "/complete-store", s.CompleteStoreAnswer, json={"keys": keys})
    await engine("post", req + "/prepare-load", s.SlotsAnswer, json={"keys": keys})
    await engine("post", req + "/complete-load", s.EmptyAnswer, json={"keys": keys})
    await engine("post", req + "/touch", s.EmptyAnswer, json={"keys": keys})
    await engine("post", req + "/prepare-load", s.SlotsAnswer, json={"keys": hexkeys(9)})
    body = {"cache_id": cache_id, "keys": hexkeys(3), "device_blocks": [0]}
    r = await engine("post", req + "/offload", s.OffloadAnswer, json=body)
    job_id = r.json()["job_id"]
    await engine("post", "/v1/jobs/wait", s.WaitJobsAnswer, json={"job_ids": [job_id]})
    r = await h.client.get(f"/v1/jobs/{job_id}")
    await check(spec, "get", "/v1/jobs/{job_id}", r, s.JobAnswer)
    body = {"cache_id": cache_id, "keys": hexkeys(3), "device_blocks": [1]}
    await engine("post", req + "/onload", s.OnloadAnswer, json=body)
    ops = {
        "ops": [
            {"op": "lookup", "req_id": "r1", "keys": keys},
            {"op": "touch", "req_id": "x", "keys": []},
        ]
    }
    r = await engine("post", "/v1/batch", s.BatchAnswer, json=ops)
    for result in r.json()["results"]:
        if result["ok"]:
            s.LookupAnswer.model_validate(result["result"])
    await engine("get", "/v1/events", s.EventsAnswer)
    await engine("get", "/v1/kv-caches", s.KVCacheListAnswer)
    await engine("post", "/v1/kv-caches", s.KVCacheAnswer, json=dev.spec())
    await engine("get", "/v1/pool", s.PoolAnswer)
    await engine("get", "/livez", s.HealthAnswer)
    await engine("get", "/readyz", s.HealthAnswer)
    await engine("delete", req, s.FinishRequestAnswer)
    await engine("delete", req, s.FinishRequestAnswer)  # 404

    async def admin(method: str, path: str, model: type[BaseModel], **kw: Any) -> None:
        r = await h.admin.request(method, path.replace("{req_id}", "r1"), **kw)
        await check(aspec, method, path, r, model)

    await admin("get", "/admin/v1/policy", s.PolicyAnswer)
    await admin("put", "/admin/v1/policy", s.PolicySwitchAnswer, json={"name": "arc"})
    await admin("get", "/admin/v1/stats", s.StatsAnswer)
    await admin("get", "/admin/v1/requests", s.RequestsAnswer)
    await admin("post", "/admin/v1/requests/{req_id}/release", s.ReleaseAnswer)
    await admin("post", "/admin/v1/cache/clear", s.ClearAnswer)
    await admin("get", "/admin/v1/policy/shadow", ShadowAnswer)
    await admin("get", "/admin/v1/log-level", LogLevelAnswer)
    level = (await h.admin.get("/admin/v1/log-level")).json()["level"]
    await admin("put", "/admin/v1/log-level", LogLevelSwitchAnswer, json={"level": level})


async def test_shared_statuses_are_documented_on_every_route(h: Harness) -> None:
    for client in (h.client, h.admin):
        spec = (await client.get("/openapi.json")).json()
        for path, item in spec["paths"].items():
            for method, operation in item.items():
                statuses = set(operation["responses"])
                assert "422" in statuses, (method, path)
                if method in ("post", "put", "delete"):
                    assert {"413", "415"} <= statuses, (method, path)


async def test_unknown_query_parameters_are_refused(h: Harness) -> None:
    await h.start()
    r = await h.client.post("/v1/requests/r1/lookup?x=1", json={"keys": []})
    assert (r.status_code, r.json()["error"]["code"]) == (422, "invalid_field")
    assert "x" in r.json()["error"]["message"]
    r = await h.client.get("/v1/events", params={"after": 0, "afterr": 1})
    assert r.status_code == 422
    r = await h.client.get("/v1/events", params={"after": 0})
    assert r.status_code == 200
    r = await h.admin.get("/admin/v1/stats", params={"verbose": 1})
    assert r.status_code == 422
