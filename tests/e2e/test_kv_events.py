"""KV events for routers against a real ``kvoffload serve`` (``--kv-events-endpoint``): what a
pyzmq subscriber in vLLM's framing reads when engines store, clear and restart, with tenants
too, and the pull feed beside it unchanged."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
from kvoffload_client import BlockTokens, KVOffloadClient

from app.core.kv_publisher import hash64
from tests.e2e.router import RouterFeed
from tests.e2e.test_tenants import granted, tenant_file
from testsupport.polling import until
from testsupport.ports import free_port
from testsupport.server import ROOT, TOKEN, ServerProcess

BLOCK = 4096
KEYS = [bytes([i]) * 16 for i in range(1, 4)]
TOKENS = list(range(100, 112))  # 4 tokens a block, 3 blocks


ALPHA = "alpha-events-token-0000000001"
BETA = "beta-events-token-00000000001"


def tenants_dir(tmp_path: Path) -> Path:
    """Tenants alpha (namespace a1) and beta (b1), in ``tmp_path / "tenants"``."""
    directory = tmp_path / "tenants"
    directory.mkdir()
    tenant_file(directory, "alpha", f'tokens = ["{ALPHA}"]\nnamespaces = {{ a1 = 16 }}\n')
    tenant_file(directory, "beta", f'tokens = ["{BETA}"]\nnamespaces = {{ b1 = 16 }}\n')
    return directory


def tenants_server(tmp_path: Path, *extra: str) -> tuple[ServerProcess, str, str]:
    """(server, publisher endpoint, replay endpoint): a server, not started, with the tenants of
    ``tenants_dir`` and its events on two ipc sockets in ``tmp_path``; ``extra``: more flags."""
    pub, replay = f"ipc://{tmp_path}/events", f"ipc://{tmp_path}/replay"
    flags = ("--kv-events-endpoint", pub, "--kv-events-replay-endpoint", replay)
    srv = ServerProcess(tmp_path, "--tenants", str(tenants_dir(tmp_path)), *flags, *extra)
    return srv, pub, replay


def endpoints() -> tuple[str, str]:
    return f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"


def kinds(feed: RouterFeed) -> list[str]:
    return [e["type"] for _, e in feed.events() if isinstance(e, dict)]


def stored(feed: RouterFeed) -> list[dict[str, Any]]:
    return [e for _, e in feed.events() if isinstance(e, dict) and e["type"] == "BlockStored"]


def test_engine_stores_reach_a_subscriber_with_tokens_parent_and_64_bit_hashes(tmp_path: Path):
    pub, replay = endpoints()
    srv = ServerProcess(
        tmp_path, "--kv-events-endpoint", pub, "--kv-events-replay-endpoint", replay
    )
    cache_file = Path(f"/dev/shm/kvoffload-e2e-events-{os.getpid()}")
    cache_file.write_bytes(os.urandom(4 * BLOCK))
    spec = {
        "name": "e2e",
        "device": "cpu",
        "tensors": [
            {
                "shape": [4, BLOCK],
                "dtype": "uint8",
                "block_dim": 0,
                "handle": {"kind": "shm", "path": str(cache_file)},
            }
        ],
    }
    with srv.serving(), RouterFeed(pub, replay) as feed, KVOffloadClient(srv.url) as kv:
        # The stream opens with the namespace's clear, on its topic.
        feed.wait_for(lambda f: kinds(f) == ["AllBlocksCleared"])
        assert feed.seen[0][1] == "default"
        cache = kv.register_kv_cache(spec)
        kv.start_request("r1")
        started = kv.offload(
            "r1", cache.cache_id, KEYS[1:], [1, 2], tokens=BlockTokens(TOKENS[4:], 4, KEYS[0])
        )
        assert started.job_id is not None
        kv.wait_jobs([started.job_id])
        kv.finish_request("r1")
        feed.wait_for(lambda f: len(stored(f)) == 1)
        assert stored(feed) == [
            {
                "type": "BlockStored",
                "block_hashes": [hash64(KEYS[1]), hash64(KEYS[2])],
                "parent_block_hash": hash64(KEYS[0]),
                "token_ids": TOKENS[4:],
                "block_size": 4,
                "lora_id": None,
                "medium": "CPU",
                "lora_name": None,
            }
        ]
        # The pull feed still says the same in its own shape.
        pulled = httpx.get(f"{srv.url}/v1/events").json()["events"]
        assert pulled == [
            {
                "seq": pulled[0]["seq"],
                "type": "BlockStored",
                "block_hashes": [KEYS[1].hex(), KEYS[2].hex()],
                "medium": "CPU",
            }
        ]
        # An operator's clear reaches routers.
        cleared = httpx.post(
            f"{srv.admin_url}/admin/v1/cache/clear",
            headers={"Authorization": f"Bearer {TOKEN}"},
        )
        assert cleared.status_code == 200, cleared.text
        feed.wait_for(lambda f: kinds(f)[-1:] == ["AllBlocksCleared"] and len(kinds(f)) == 3)
        kv.unregister_kv_cache(cache.cache_id)
        cache_file.unlink()
        metrics = httpx.get(f"{srv.url}/metrics").text
        assert "kvoffload_kv_events_published_total 3.0" in metrics
        assert "kvoffload_kv_events_dropped_total 0.0" in metrics


def test_a_restarted_service_opens_a_new_stream_with_a_clear(tmp_path: Path):
    pub, replay = endpoints()
    flags = ("--kv-events-endpoint", pub, "--kv-events-replay-endpoint", replay)
    with ServerProcess(tmp_path, *flags).serving() as srv, KVOffloadClient(srv.url) as kv:
        kv.start_request("r")
        out = kv.prepare_store("r", KEYS, tokens=BlockTokens(TOKENS, 4))
        kv.complete_store("r", out.keys_to_store)
        with RouterFeed(pub, replay) as feed:
            feed.wait_for(lambda f: kinds(f) == ["AllBlocksCleared", "BlockStored"])
            assert stored(feed)[0]["token_ids"] == TOKENS
            last = feed.seen[-1][0]
    with ServerProcess(tmp_path, *flags).serving(), RouterFeed(pub, replay) as feed:
        # A fresh publisher: its first batch a clear, so a router forgets what the stopped
        # process held, numbered above the old stream's (a tracking router sees a gap).
        feed.wait_for(lambda f: kinds(f) == ["AllBlocksCleared"])
        assert feed.seen[0][0] > last


def test_with_tenants_a_tenant_socket_carries_that_tenant_only(tmp_path: Path):
    srv, pub, replay = tenants_server(tmp_path, "--kv-events-tenant", "alpha")
    with srv.serving(), RouterFeed(pub, replay) as feed:
        for token in (ALPHA, BETA):
            with KVOffloadClient(srv.url, token=token) as kv:
                kv.start_request("r")
                out = kv.prepare_store("r", KEYS[:1])
                kv.complete_store("r", out.keys_to_store)
        feed.wait_for(lambda f: kinds(f) == ["AllBlocksCleared", "BlockStored"])
        assert {topic for topic, _ in feed.events()} == {"a1"}
        # The socket files: the mode and group of the engine socket (--uds-mode: 0600).
        assert stat.S_IMODE(os.stat(pub.removeprefix("ipc://")).st_mode) == 0o600


def test_with_tenants_tcp_and_an_unknown_tenant_are_refused_at_start(tmp_path: Path):
    tenants = tenants_dir(tmp_path)
    base = [sys.executable, "-m", "app.cli", "serve", "--tenants", str(tenants)]
    tcp = subprocess.run(
        [*base, "--kv-events-endpoint", "tcp://127.0.0.1:5557"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert tcp.returncode == 2
    assert "not an ipc:// path, with --tenants" in tcp.stderr
    unknown = subprocess.run(
        [
            *base,
            "--kv-events-endpoint",
            f"ipc://{tmp_path}/e.sock",
            "--kv-events-tenant",
            "nobody",
            "--port",
            str(free_port()),
            "--admin-port",
            str(free_port()),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert unknown.returncode == 2, unknown.stderr
    assert (
        "--kv-events-tenant / KVOFFLOAD_KV_EVENTS_TENANT = 'nobody': no such tenant in the "
        "tenants file; accepted: one it names (alpha, beta)"
    ) in unknown.stderr


def test_a_namespace_a_reload_adds_opens_without_the_clear_that_would_wipe_the_node(
    tmp_path: Path,
):
    """alpha gets a second namespace by a tenants reload (SIGHUP, or the file's poll). A
    router such as Dynamo reads the node's namespaces as one instance, so an opening clear of
    a2 would forget a1's blocks: a2's stream opens with its first store instead."""
    srv, pub, replay = tenants_server(tmp_path)
    with srv.serving(), RouterFeed(pub, replay) as feed:
        with KVOffloadClient(srv.url, token=ALPHA, namespace="a1") as kv:
            kv.start_request("r")
            out = kv.prepare_store("r", KEYS[:1])
            kv.complete_store("r", out.keys_to_store)
        feed.wait_for(lambda f: ("a1", "BlockStored") in by_topic(f))
        tenant_file(
            tmp_path / "tenants",
            "alpha",
            f'tokens = ["{ALPHA}"]\nnamespaces = {{ a1 = 16, a2 = 16 }}\n',
        )
        assert srv.proc is not None
        srv.proc.send_signal(signal.SIGHUP)

        until("a2 added by the reload", lambda: granted(srv.url, ALPHA, "a2"), 30)
        with KVOffloadClient(srv.url, token=ALPHA, namespace="a2") as kv:
            kv.start_request("r2")
            out = kv.prepare_store("r2", KEYS[1:2])
            kv.complete_store("r2", out.keys_to_store)
        feed.wait_for(lambda f: ("a2", "BlockStored") in by_topic(f))
        assert [t for t in by_topic(feed) if t[0] == "a2"] == [("a2", "BlockStored")]
        assert by_topic(feed).count(("a1", "AllBlocksCleared")) == 1  # the start's, only
        assert by_topic(feed).count(("b1", "AllBlocksCleared")) == 1


def by_topic(feed: RouterFeed) -> list[tuple[str, str]]:
    """Each event seen as (topic, type), in order."""
    return [(topic, e["type"]) for topic, e in feed.events() if isinstance(e, dict)]
