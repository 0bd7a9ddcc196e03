"""deploy/docker-compose.yml run by Docker Compose v2: the service with tenants, engines on the
host and in a container of their own, the admin API, and /metrics scraped by Prometheus on the
host. Every engine call carries the tenant's token; the cache registrations pass descriptors
over the pool socket in the shared volume ``kvoffload-run``."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import httpx
import pytest
from kvoffload_client import KVOffloadClient

from tests.containers.stack import (
    COMPOSE_V2,
    REPORT,
    Project,
    Stack,
    host_prometheus,
    run,
    scraped,
)

ENGINE = "http://127.0.0.1:8000"
ADMIN = "http://127.0.0.1:8001"


# Building the image (the first module's setup) and bringing a stack up take minutes.
pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def stack(image: str, workdir: Path) -> Iterator[Stack]:
    project = Project.make(workdir)
    stack = Stack(project, "kvotest-single", ["docker-compose.yml"], COMPOSE_V2, image)
    stack.clear()
    try:
        stack.up(["kvoffload"])
        REPORT.record("single: time to healthy (s)", round(stack.wait_healthy(["kvoffload"]), 1))
        yield stack
    finally:
        stack.down()


def _auth(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


def test_engine_calls_from_the_host_need_the_tenants_token(stack: Stack) -> None:
    token = stack.project.engine_token
    req = f"r-{secrets.token_hex(4)}"
    with httpx.Client(base_url=ENGINE, timeout=10) as http:
        refused = http.put(f"/v1/requests/{req}")
        assert refused.status_code == 401
        assert refused.json()["error"]["code"] == "missing_token"
        started = http.put(f"/v1/requests/{req}", headers=_auth(token))
        assert started.status_code in (200, 201), started.text
        # The call as Getting started writes it: a JSON body with its content type.
        looked = http.post(
            f"/v1/requests/{req}/lookup",
            headers={**_auth(token), "content-type": "application/json"},
            json={"keys": ["0a01", "0a02"]},
        )
        assert looked.status_code == 200, looked.text
        assert looked.json() == {"results": ["miss", "miss"], "hit_prefix": 0}
        finished = http.delete(f"/v1/requests/{req}", headers=_auth(token))
        assert finished.status_code == 200, finished.text
    REPORT.record(
        "single: host engine calls",
        {
            "PUT without token": f"{refused.status_code} {refused.json()['error']['code']}",
            "PUT": started.json(),
            "lookup": looked.json(),
            "DELETE": finished.json(),
        },
    )


def test_a_host_path_is_refused_and_a_descriptor_is_taken(
    stack: Stack, engine_module: ModuleType
) -> None:
    """The container has its own /dev/shm: a path from the host names nothing it should open,
    and with tenants it is refused before anything is opened; the same file's descriptor over
    the pool socket (in the volume) registers it."""
    token = stack.project.engine_token
    with httpx.Client(base_url=ENGINE, timeout=10) as http:
        by_path = http.post(
            "/v1/kv-caches",
            headers=_auth(token),
            json={
                "name": "host-by-path",
                "device": "cpu",
                "tensors": [
                    {
                        "shape": [4, 65536],
                        "dtype": "uint8",
                        "block_dim": 0,
                        "handle": {"kind": "shm", "path": "/dev/shm/host-engine-kv"},
                    }
                ],
            },
        )
    assert by_path.status_code == 403
    assert by_path.json()["error"]["code"] == "handle_not_held"
    pool_socket = stack.volume_dir("kvoffload-run") / "engine.sock.pool"
    with KVOffloadClient(ENGINE, token=token) as client:
        engine = engine_module.Engine(client, str(pool_socket), 4)
        cache_id = engine.cache.cache_id
        engine.close()
    REPORT.record(
        "single: host KV cache",
        {"by path": f"403 {by_path.json()['error']['code']}", "by descriptor": cache_id},
    )


def test_blocks_stored_on_the_host_load_in_the_engine_container_and_back(
    stack: Stack, engine_module: ModuleType
) -> None:
    pool_socket = str(stack.volume_dir("kvoffload-run") / "engine.sock.pool")
    host_seed, container_seed = f"host-{secrets.token_hex(4)}", f"ctr-{secrets.token_hex(4)}"
    with KVOffloadClient(ENGINE, token=stack.project.engine_token) as client:
        engine = engine_module.Engine(client, pool_socket, 8)
        try:
            stored = engine_module.store(engine, host_seed)
        finally:
            engine.close()
    assert stored["ok"], stored
    loaded = stack.engine(
        "cpu-engine", "load", "--seed", host_seed, "--blocks", "8", "--expect", "hit"
    )
    assert loaded["ok"], loaded
    assert loaded["bytes_equal"] == 8, loaded
    stored_in = stack.engine("cpu-engine", "store", "--seed", container_seed, "--blocks", "8")
    assert stored_in["ok"], stored_in
    with KVOffloadClient(ENGINE, token=stack.project.engine_token) as client:
        engine = engine_module.Engine(client, pool_socket, 8)
        try:
            back = engine_module.load(engine, container_seed, "hit")
        finally:
            engine.close()
    assert back["ok"], back
    assert back["bytes_equal"] == 8, back
    REPORT.record(
        "single: host -> engine container",
        {"host store": stored["offloaded"], "container load": loaded},
    )
    REPORT.record(
        "single: engine container -> host",
        {"container store": stored_in["offloaded"], "host load": back},
    )


def test_admin_policy_switch_names_the_namespace_and_loses_no_block(stack: Stack) -> None:
    admin = _auth(stack.project.admin_token)
    seed = f"policy-{secrets.token_hex(4)}"
    assert stack.engine("cpu-engine", "store", "--seed", seed, "--blocks", "8")["ok"]
    with httpx.Client(base_url=ADMIN, timeout=10) as http:
        # compose always has tenants: the admin API must be told which namespace.
        unnamed = http.get("/admin/v1/policy", headers=admin)
        assert unnamed.status_code == 422, unnamed.text
        before = http.get("/admin/v1/policy", params={"namespace": "local"}, headers=admin)
        assert before.status_code == 200, before.text
        switched = http.put(
            "/admin/v1/policy",
            params={"namespace": "local"},
            headers=admin,
            json={"name": "arc", "params": {}},
        )
        assert switched.status_code == 200, switched.text
    cli = run(
        [
            *("docker", "exec", stack.container("kvoffload")),
            *("kvoffload", "admin", "--json", "--namespace", "local", "policy", "get"),
        ]
    )
    assert '"name": "arc"' in cli, cli
    after = stack.engine("cpu-engine", "load", "--seed", seed, "--blocks", "8", "--expect", "hit")
    assert after["ok"], after
    assert after["bytes_equal"] == 8, after
    REPORT.record(
        "single: admin policy",
        {
            "GET without namespace": f"422 {unnamed.json()['error']['code']}",
            "before": before.json()["name"],
            "PUT arc": switched.json(),
            "docker exec kvoffload admin --namespace local policy get": "arc",
            "blocks hit after the switch": after["bytes_equal"],
        },
    )


def test_prometheus_on_the_host_scrapes_metrics_with_the_token(stack: Stack, workdir: Path) -> None:
    assert httpx.get(f"{ENGINE}/metrics", timeout=10).status_code == 401
    with host_prometheus(
        workdir / "prometheus", ["127.0.0.1:8000"], stack.project.metrics_token
    ) as url:
        up = scraped(url, 'up{job="kvoffload"}')
        moved = scraped(url, "sum by (instance) (kvoffload_transfer_bytes_total)")
    assert up == {"127.0.0.1:8000": 1.0}
    REPORT.record(
        "single: Prometheus scrape",
        {"up": up, "kvoffload_transfer_bytes_total": moved},
    )
