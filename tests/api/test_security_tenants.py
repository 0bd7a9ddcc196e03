"""Issue #21: what an attacker holding one tenant's token tries against another tenant.

Two tenants (``tests.api.test_tenancy``'s ``alpha`` and ``beta``), in process. Each test is one
row of the attack table (docs/security.md): the attempt, what it answers, and that nothing leaked.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from kvoffload_client.client import AsyncKVOffloadClient
from kvoffload_client.pool_socket import PoolShareError, register_kv_cache, sealed_memfd

from app.core.tenancy import Tenancy
from app.core.tenants import Credentials
from app.http.apps import create_app
from app.pool_share import PoolShareServer
from app.server import pool_of, register_over_socket
from tests.api.test_tenancy import (
    ALPHA,
    BETA,
    NS,
    TENANTS,
    Tenants,
    tenants_running,
    write_tenants,
)
from testsupport.api_harness import BLOCK, hexkeys, make_settings
from testsupport.shm_device import MemfdDevice, ShmDevice

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize(
    "headers",
    [
        [("Authorization", f"Bearer {BETA}"), ("Authorization", f"Bearer {ALPHA}")],
        [("Authorization", f"Bearer {ALPHA}"), ("Authorization", f"Bearer {ALPHA}")],
        [("Authorization", f"Bearer {ALPHA}"), (NS, "a1"), (NS, "a2")],
        [("Authorization", f"Bearer {BETA}"), (NS, "b1"), (NS, "a1")],
    ],
)
async def test_two_credential_headers_are_refused_whatever_their_values(
    tmp_path: Path, headers: list[tuple[str, str]]
) -> None:
    async with tenants_running(tmp_path) as t:
        r = await t.engine.put("/v1/requests/r1", json={}, headers=headers)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] == "ambiguous_credentials"
        assert "x-kvoffload-pool" not in r.headers
        assert ALPHA not in r.text
        assert BETA not in r.text
        for space in t.tenancy.spaces.values():
            assert space.service.pool_manager.num_requests == 0


async def test_two_admin_authorization_headers_are_refused(tmp_path: Path) -> None:
    async with tenants_running(tmp_path) as t:
        token = t.admin.headers["Authorization"]
        r = await t.admin.get(
            "/admin/v1/tenants",
            headers=[("Authorization", "Bearer wrong"), ("Authorization", token)],
        )
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] == "ambiguous_credentials"


async def test_a_namespace_named_twice_to_the_admin_api_is_a_documented_400(
    tmp_path: Path,
) -> None:
    # Found by schemathesis: the 400 was answered but not in the admin spec.
    async with tenants_running(tmp_path) as t:
        r = await t.admin.get("/admin/v1/requests", params=[("namespace", "a1")] * 2)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] == "ambiguous_credentials"
        spec = (await t.admin.get("/openapi.json")).json()
        for path, item in spec["paths"].items():
            for method, operation in item.items():
                if path != "/livez":
                    assert "400" in operation["responses"], (method, path)


async def test_max_pins_counts_distinct_blocks_pinned_by_any_request(tmp_path: Path) -> None:
    # alpha: max_pins = 3 over a1 and a2, max_requests = 3.
    keys = hexkeys(1, 2, 3, 4)
    async with tenants_running(tmp_path) as t:
        await t.store(ALPHA, "a1", "w", keys)
        for req in ("r1", "r2"):
            assert (await t.call(ALPHA, "PUT", f"/v1/requests/{req}", {}, "a1")).status_code == 201
        load = "/v1/requests/{}/prepare-load"
        r = await t.call(ALPHA, "POST", load.format("r1"), {"keys": keys[:3]}, "a1")
        assert r.status_code == 200, r.text
        # The same three blocks for another request, and again (with a repeat) for r1: no new
        # distinct block, so within the quota of 3.
        r = await t.call(ALPHA, "POST", load.format("r2"), {"keys": keys[:3]}, "a1")
        assert r.status_code == 200, r.text
        r = await t.call(ALPHA, "POST", load.format("r1"), {"keys": [keys[0], keys[0]]}, "a1")
        assert r.status_code == 200, r.text
        a1 = t.tenancy.spaces["a1"].service.pool_manager
        assert a1.num_pinned == 3
        assert t.tenancy.quotas["alpha"].pins() == 3
        # A fourth distinct block is one too many, and pins nothing.
        r = await t.call(ALPHA, "POST", load.format("r2"), {"keys": keys[2:]}, "a1")
        assert r.status_code == 429, r.text
        assert r.json()["error"]["quota"] == "pins"
        assert "would pin 1 more" in r.json()["error"]["message"]
        assert a1.num_pinned == 3
        tenants = (await t.admin.get("/admin/v1/tenants")).json()
        alpha = next(x for x in tenants["tenants"] if x["tenant"] == "alpha")
        assert alpha["pins"] == 3


# --------------------------------------------------------------------------- item 1: KV caches


@contextlib.asynccontextmanager
async def pool_socket(t: Tenants) -> AsyncIterator[str]:
    """The service's pool socket (tenant mode, registrations on) on this loop; its path."""
    where = tempfile.mkdtemp(prefix="kvo-", dir="/tmp")  # a Unix socket path is short
    path = os.path.join(where, "pool")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path)
    server = PoolShareServer(
        sock,
        lambda ask: pool_of(t.tenancy, ask),
        read_request=True,
        register=lambda ask, fds: register_over_socket(t.tenancy, ask, fds),
    )
    server.start()
    try:
        yield path
    finally:
        await server.stop()
        shutil.rmtree(where)


async def by_fd(path: str, spec: dict[str, Any], fd: int, token: str, ns: str) -> dict[str, Any]:
    """Register over the pool socket from another thread (the client blocks)."""
    return await asyncio.to_thread(register_kv_cache, path, spec, [fd], token=token, namespace=ns)


async def test_b_cannot_register_a_s_file_and_learns_nothing_about_files(tmp_path: Path) -> None:
    async with tenants_running(tmp_path) as t, pool_socket(t) as sock:
        with (
            ShmDevice(4, BLOCK, name="alpha-cache") as dev,
            MemfdDevice(4, BLOCK, name="alpha-cache") as sealed,
        ):
            cache = await by_fd(sock, sealed.spec(), sealed.fd, ALPHA, "a1")
            assert (cache["name"], cache["num_blocks"]) == ("alpha-cache", 4)
            # beta names alpha's file: refused before anything is opened, and the answer is
            # the same for alpha's file, a missing one, a directory and a file outside /dev/shm.
            answers = set()
            for named in (dev.path, dev.path + "-missing", "/dev/shm", "/etc/shadow"):
                body = dev.spec()
                body["tensors"][0]["handle"]["path"] = named
                r = await t.call(BETA, "POST", "/v1/kv-caches", body)
                assert r.status_code == 403, r.text
                assert r.json()["error"]["code"] == "handle_not_held"
                answers.add(r.text.replace(named, "PATH"))
                assert named not in r.text
                assert "bytes" not in r.text
            assert len(answers) == 1
            # Over the pool socket, naming the path is refused the same way.
            with pytest.raises(PoolShareError) as info:
                await asyncio.to_thread(
                    register_kv_cache, sock, dev.spec(), [0], token=BETA, namespace="b1"
                )
            assert info.value.reason == "handle_not_held"
            # beta has no cache at all; alpha's cache is alpha's.
            assert (await t.call(BETA, "GET", "/v1/kv-caches")).json()["kv_caches"] == []
            mine = (await t.call(ALPHA, "GET", "/v1/kv-caches", None, "a1")).json()["kv_caches"]
            assert [c["cache_id"] for c in mine] == [cache["cache_id"]]
            # ... which beta cannot offload from: it does not exist in beta's namespace.
            await t.call(BETA, "PUT", "/v1/requests/rb", {})
            body = {"keys": hexkeys(9), "cache_id": cache["cache_id"], "device_blocks": [0]}
            r = await t.call(BETA, "POST", "/v1/requests/rb/offload", body)
            assert r.status_code == 404, r.text
            assert r.json()["error"]["code"] == "unknown_cache"


async def test_a_cuda_ipc_handle_is_named_not_held_and_refused(tmp_path: Path) -> None:
    handle = {
        "kind": "cuda_ipc",
        "storage_handle": "AAAA",
        "storage_size_bytes": 4096,
        "storage_offset_bytes": 0,
        "ref_counter_handle": "L2Rldi9zaG0vYQ==",
        "ref_counter_offset": 0,
    }
    body = {
        "name": "x",
        "device": "cuda:0",
        "tensors": [{"shape": [4, 1024], "dtype": "uint8", "block_dim": 0, "handle": handle}],
    }
    async with tenants_running(tmp_path) as t:
        r = await t.call(BETA, "POST", "/v1/kv-caches", body)
        assert r.status_code == 403, r.text
        assert r.json()["error"]["code"] == "handle_not_held"


async def test_a_cache_registered_by_descriptor_offloads_and_onloads(tmp_path: Path) -> None:
    async with tenants_running(tmp_path) as t, pool_socket(t) as sock:
        with MemfdDevice(4, BLOCK) as dev:
            cache_id = (await by_fd(sock, dev.spec(), dev.fd, BETA, "b1"))["cache_id"]
            pattern = dev.fill(0, 21)
            keys = hexkeys(5)
            await t.call(BETA, "PUT", "/v1/requests/r", {})
            for op, block in (("offload", 0), ("onload", 1)):
                body = {"keys": keys, "cache_id": cache_id, "device_blocks": [block]}
                r = await t.call(BETA, "POST", f"/v1/requests/r/{op}", body)
                assert r.status_code in (200, 202), r.text
                waited = await t.call(
                    BETA, "POST", "/v1/jobs/wait", {"job_ids": [r.json()["job_id"]], "timeout_s": 5}
                )
                assert waited.json()["jobs"][0]["state"] == "done", waited.text
            assert dev.read(1) == pattern


async def test_a_descriptor_must_be_a_regular_file_open_read_write(tmp_path: Path) -> None:
    async with tenants_running(tmp_path) as t, pool_socket(t) as sock:
        with MemfdDevice(4, BLOCK) as dev:
            cases = [
                (os.O_RDONLY, "not open for reading and writing"),
                (os.O_WRONLY, "not open for reading and writing"),
            ]
            for flags, message in cases:
                fd = os.open(f"/proc/self/fd/{dev.fd}", flags | os.O_CLOEXEC)
                try:
                    with pytest.raises(PoolShareError, match=message) as info:
                        await by_fd(sock, dev.spec(), fd, BETA, "b1")
                finally:
                    os.close(fd)
                assert info.value.reason == "invalid_registration"
            r, w = os.pipe()
            try:
                with pytest.raises(PoolShareError, match="not a regular file"):
                    await by_fd(sock, dev.spec(), r, BETA, "b1")
            finally:
                os.close(r)
                os.close(w)
            small = sealed_memfd(10, "small")
            try:
                with pytest.raises(PoolShareError, match="holds 10 bytes"):
                    await by_fd(sock, dev.spec(), small, BETA, "b1")
                # A stranger's token: refused by its reason alone.
                with pytest.raises(PoolShareError) as info:
                    await by_fd(sock, dev.spec(), small, "wrong-token-0000000000000", "b1")
                assert info.value.reason == "unknown_token"
                assert "bytes" not in str(info.value)
            finally:
                os.close(small)
            assert (await t.call(BETA, "GET", "/v1/kv-caches")).json()["kv_caches"] == []


async def test_an_operator_may_trust_every_caller_with_paths(tmp_path: Path) -> None:
    async with tenants_running(tmp_path) as t:
        t.tenancy.settings = t.tenancy.settings.model_copy(update={"registration_by_name": True})
        with ShmDevice(4, BLOCK) as dev:
            r = await t.call(BETA, "POST", "/v1/kv-caches", dev.spec())
            assert r.status_code == 201, r.text


async def test_the_client_registers_by_descriptor_with_its_own_credentials(tmp_path: Path) -> None:
    async with tenants_running(tmp_path) as t, pool_socket(t) as sock:
        with MemfdDevice(4, BLOCK, name="via-client") as dev:
            async with AsyncKVOffloadClient("http://e", token=ALPHA, namespace="a2") as c:
                cache = await c.register_kv_cache(dev.spec(), [dev.fd], pool_socket=sock)
                assert "ALPHA" not in repr(c)
                assert ALPHA not in repr(c)
            async with AsyncKVOffloadClient("http://e", token=BETA, namespace="a2") as c:
                with pytest.raises(PoolShareError) as info:
                    await c.register_kv_cache(dev.spec(), [dev.fd], pool_socket=sock)
                assert info.value.reason == "namespace_denied"
        assert cache.name == "via-client"
        mine = (await t.call(ALPHA, "GET", "/v1/kv-caches", None, "a2")).json()["kv_caches"]
        assert [c["cache_id"] for c in mine] == [cache.cache_id]


# --------------------------------------------------------------------------- item 7: /metrics

OPENMETRICS = {"Accept": "application/openmetrics-text; version=1.0.0"}
SCRAPE = "scrape-token-0123456789abcdef"


@contextlib.asynccontextmanager
async def engine_with(tmp_path: Path, **overrides: Any) -> AsyncIterator[httpx.AsyncClient]:
    """The engine app of a service with the two tenants and these settings."""
    path = tmp_path / "tenants.toml"
    write_tenants(path, TENANTS)
    settings = make_settings(**overrides)
    tenancy = Tenancy(settings, credentials=Credentials(path))
    app = create_app(settings, tenancy=tenancy)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://e") as client,
    ):
        yield client


async def lookups(client: httpx.AsyncClient, req_id: str) -> None:
    headers = {"Authorization": f"Bearer {ALPHA}", NS: "a1"}
    r = await client.put(f"/v1/requests/{req_id}", json={}, headers=headers)
    assert r.status_code == 201, r.text
    body = {"keys": hexkeys(1)}
    r = await client.post(f"/v1/requests/{req_id}/lookup", json=body, headers=headers)
    assert r.status_code == 200, r.text


async def test_open_metrics_of_a_service_with_tenants_carry_no_request_ids(
    tmp_path: Path,
) -> None:
    async with engine_with(tmp_path) as client:
        await lookups(client, "alpha-secret-request-42")
        r = await client.get("/metrics", headers=OPENMETRICS)
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("application/openmetrics-text")
        assert "# TYPE kvoffload_http_requests counter" in r.text  # service-wide series stay
        assert "tenant=" not in r.text  # no namespace's series (#42.4)
        assert "alpha-secret-request-42" not in r.text
        assert " # {" not in r.text  # no exemplar at all


async def test_a_scrape_token_guards_metrics_and_brings_exemplars_back(tmp_path: Path) -> None:
    token_file = tmp_path / "scrape-token"
    token_file.write_text(SCRAPE + "\n")
    token_file.chmod(0o640)
    async with engine_with(tmp_path, metrics_token_file=token_file) as client:
        await lookups(client, "alpha-request-7")
        r = await client.get("/metrics", headers=OPENMETRICS)
        assert r.status_code == 401
        assert r.headers["www-authenticate"] == "Bearer"
        r = await client.get(
            "/metrics", headers={**OPENMETRICS, "Authorization": f"Bearer {ALPHA}"}
        )
        assert r.status_code == 403
        assert ALPHA not in r.text
        r = await client.get(
            "/metrics", headers={**OPENMETRICS, "Authorization": f"Bearer {SCRAPE}"}
        )
        assert r.status_code == 200
        assert 'req_id="alpha-request-7"' in r.text
        assert SCRAPE not in r.text
        assert (await client.get("/livez")).status_code == 200  # health stays open
