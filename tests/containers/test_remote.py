"""deploy/docker-compose.remote.yml run by Debian's docker-compose 1.29: a Mooncake master and
two kvoffload nodes, each with its own engine container. An engine on node A stores; node B
answers ``remote`` for those keys and an engine on B loads them with equal bytes; Prometheus on
the host scrapes both nodes."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import httpx
import pytest

from tests.containers.stack import (
    COMPOSE_V1,
    REPORT,
    Project,
    Stack,
    host_prometheus,
    scraped,
)
from testsupport.polling import until

NODE_A = "http://127.0.0.1:8000"
NODE_B = "http://127.0.0.1:8010"
BLOCKS = 16


# Building the image (the first module's setup) and bringing a stack up take minutes.
pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def stack(image: str, workdir: Path) -> Iterator[Stack]:
    project = Project.make(workdir)
    stack = Stack(project, "kvotest-remote", ["docker-compose.remote.yml"], COMPOSE_V1, image)
    services = ["mooncake-master", "kvoffload-a", "kvoffload-b"]
    stack.clear()
    try:
        stack.up(services)
        REPORT.record("remote: time to healthy (s)", round(stack.wait_healthy(services[1:]), 1))
        yield stack
    finally:
        stack.down()


def lookup(url: str, token: str, keys: list[bytes]) -> list[str]:
    req = f"probe-{secrets.token_hex(4)}"
    auth = {"authorization": f"Bearer {token}"}
    with httpx.Client(base_url=url, timeout=10, headers=auth) as http:
        assert http.put(f"/v1/requests/{req}").status_code in (200, 201)
        try:
            r = http.post(f"/v1/requests/{req}/lookup", json={"keys": [k.hex() for k in keys]})
            assert r.status_code == 200, r.text
            results: list[str] = r.json()["results"]
            return results
        finally:
            http.delete(f"/v1/requests/{req}")


def test_both_nodes_are_ready_with_the_remote_tier(stack: Stack) -> None:
    for url in (NODE_A, NODE_B):

        def ready(url: str = url) -> dict[str, str] | None:
            body: dict[str, str] = httpx.get(f"{url}/readyz", timeout=5).json()
            return body if body.get("status") == "ready" else None

        until(f"{url}/readyz ready", ready, 60)


def test_an_engine_on_a_stores_and_one_on_b_loads_the_same_bytes(
    stack: Stack, engine_module: ModuleType, workdir: Path
) -> None:
    seed = f"remote-{secrets.token_hex(4)}"
    stored = stack.engine("cpu-engine-a", "store", "--seed", seed, "--blocks", str(BLOCKS))
    assert stored["ok"], stored
    keys = [engine_module.block_key(seed, i) for i in range(BLOCKS)]
    token = stack.project.engine_token
    # Node A writes behind to the shared store; B sees the keys once A's puts have landed.
    on_b = until(
        "node B answers remote for every key A stored",
        lambda: r if set(r := lookup(NODE_B, token, keys)) == {"remote"} else None,
        60,
    )
    loaded = stack.engine(
        "cpu-engine-b", "load", "--seed", seed, "--blocks", str(BLOCKS), "--expect", "remote"
    )
    assert loaded["ok"], loaded
    assert loaded["bytes_equal"] == BLOCKS, loaded
    # Loaded, the blocks are in B's pool now.
    assert set(lookup(NODE_B, token, keys)) == {"hit"}
    REPORT.record(
        "remote: A -> B",
        {
            "store on A": stored["offloaded"],
            "lookup on B": sorted(set(on_b)),
            "load on B": loaded,
        },
    )
    targets = ["127.0.0.1:8000", "127.0.0.1:8010"]
    with host_prometheus(workdir / "prometheus", targets, stack.project.metrics_token) as url:
        # The tiers below the pool share kvoffload_tier_*, labelled by tier.
        up = scraped(url, 'kvoffload_tier_up{job="kvoffload", tier="remote"}', instances=targets)
        written = scraped(
            url,
            "sum by (instance) (kvoffload_tier_bytes_written_total"
            '{tier="remote", instance="127.0.0.1:8000"})',
        )
        read = scraped(
            url,
            "sum by (instance) (kvoffload_tier_bytes_read_total"
            '{tier="remote", instance="127.0.0.1:8010"})',
        )
    assert set(up) == set(targets)
    REPORT.record(
        "remote: Prometheus scrape",
        {
            'kvoffload_tier_up{tier="remote"}': up,
            "bytes written (A)": written,
            "bytes read (B)": read,
        },
    )
