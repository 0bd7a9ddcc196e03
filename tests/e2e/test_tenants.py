"""Tenants against a real ``kvoffload serve``: tokens on TCP and the Unix socket, the pool
socket handing each tenant its own pool, bytes that never cross, a tenants directory changed
while serving (by itself and on SIGHUP), and the log of refused calls.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from kvoffload_client.client import KVOffloadClient, KVOffloadError
from kvoffload_client.pool_socket import PoolShareError, default_pool_socket, receive_pool

from tests.e2e.test_admin_cli import admin, clean_env
from testsupport.server import TOKEN, ServerProcess

ALPHA = "alpha-e2e-token-000000000001"
ALPHA_NEXT = "alpha-e2e-token-000000000002"
BETA = "beta-e2e-token-0000000000001"
BLOCK = 4096


def granted(url: str, token: str, namespace: str) -> bool | None:
    """True once ``token`` may start a request in ``namespace`` (a tenants reload applied);
    None while it is refused with 403 (for ``until``)."""
    with KVOffloadClient(url, token=token, namespace=namespace) as kv:
        try:
            kv.start_request("probe")
        except KVOffloadError as exc:
            if exc.status != 403:
                raise
            return None
        return True


def tenant_file(directory: Path, name: str, body: str) -> None:
    """Write ``NAME.toml`` as Kubernetes or an operator would: whole, owner-only."""
    tmp = directory / f".{name}.tmp"
    tmp.write_text(body)
    os.chmod(tmp, 0o600)
    os.replace(tmp, directory / f"{name}.toml")


@pytest.fixture
def tenants_dir(tmp_path: Path) -> Path:
    d = tmp_path / "tenants"
    d.mkdir()
    tenant_file(d, "alpha", f'tokens = ["{ALPHA}"]\nnamespaces = {{ a1 = 16 }}\n')
    tenant_file(d, "beta", f'tokens = ["{BETA}"]\nnamespaces = {{ b1 = 16 }}\n')
    return d


@pytest.fixture
def server(tmp_path: Path, tenants_dir: Path) -> Iterator[ServerProcess]:
    srv = ServerProcess(tmp_path, "--tenants", str(tenants_dir), "--log-level", "info")
    with srv.serving():
        yield srv


def log_lines(srv: ServerProcess) -> list[dict[str, object]]:
    out = []
    for line in srv.log().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def test_tokens_guard_tcp_and_the_unix_socket_and_refusals_are_logged(
    server: ServerProcess,
) -> None:
    with KVOffloadClient(server.url) as anonymous:
        with pytest.raises(KVOffloadError) as refused:
            anonymous.start_request("r1")
        assert refused.value.status == 401
    with KVOffloadClient(uds=str(server.uds)) as local:
        with pytest.raises(KVOffloadError) as refused:
            local.lookup("r1", [b"\x01"])
        assert refused.value.status == 401  # --uds-auth token (the default)
    with KVOffloadClient(uds=str(server.uds), token=ALPHA) as alpha:
        assert alpha.start_request("r1") is True
    lines = log_lines(server)
    refusals = [ln for ln in lines if ln.get("code") == "missing_token"]
    assert len(refusals) == 2
    assert {str(ln["client"]).split(":")[0] for ln in refusals} == {"127.0.0.1", "unix"}
    assert all(ln["status"] == 401 for ln in refusals)
    assert ALPHA not in server.log()
    assert BETA not in server.log()


def test_each_tenant_gets_its_own_pool_and_bytes_never_cross(server: ServerProcess) -> None:
    pool_socket = default_pool_socket(str(server.uds))
    with pytest.raises(PoolShareError) as refused:
        receive_pool(pool_socket, token="wrong-token-00000000000000")
    assert refused.value.reason == "unknown_token"
    with pytest.raises(PoolShareError) as refused:
        receive_pool(pool_socket, token=BETA, namespace="a1")
    assert refused.value.reason == "namespace_denied"

    key = bytes.fromhex("ab" * 16)
    pattern = b"alpha-secret-kv!" * (BLOCK // 16)
    alpha_pool = receive_pool(pool_socket, token=ALPHA)
    beta_pool = receive_pool(pool_socket, token=BETA)
    try:
        assert alpha_pool.pool_id != beta_pool.pool_id
        alpha_map, beta_map = alpha_pool.map(), beta_pool.map()
    finally:
        os.close(alpha_pool.fd)
        os.close(beta_pool.fd)
    with (
        KVOffloadClient(server.url, token=ALPHA) as alpha,
        KVOffloadClient(server.url, token=BETA) as beta,
    ):
        alpha.start_request("w")
        prepared = alpha.prepare_store("w", [key])
        slot = prepared.slots[0]
        start = alpha_pool.offset + slot * BLOCK
        alpha_map[start : start + BLOCK] = pattern
        alpha.complete_store("w", [key])
        assert alpha.pool().pool_id == alpha_pool.pool_id

        beta.start_request("r")
        assert beta.lookup("r", [key]).hit_prefix == 0
        # beta stores the same hash: a block of its own, in its own pool.
        beta.prepare_store("r", [key])
        beta.complete_store("r", [key])
        assert beta.lookup("r", [key]).hit_prefix == 1
        # Nowhere in beta's pool is there a byte of alpha's block.
        assert pattern[:64] not in beta_map[:]
        assert alpha_map[start : start + BLOCK] == pattern
        assert alpha.lookup("w", [key]).hit_prefix == 1
    alpha_map.close()
    beta_map.close()


def test_a_tenants_directory_changed_while_serving_applies_without_restart(
    server: ServerProcess, tenants_dir: Path
) -> None:
    def status(token: str) -> int:
        with KVOffloadClient(server.url, token=token) as c:
            try:
                c.events()
            except KVOffloadError as exc:
                return exc.status
            return 200

    assert status(ALPHA) == 200
    assert status(ALPHA_NEXT) == 401
    # Rotation, step 1: both tokens (picked up by the watcher, no signal).
    tenant_file(
        tenants_dir, "alpha", f'tokens = ["{ALPHA}", "{ALPHA_NEXT}"]\nnamespaces = {{ a1 = 16 }}\n'
    )
    deadline = time.monotonic() + 10
    while status(ALPHA_NEXT) != 200 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert status(ALPHA_NEXT) == 200
    assert status(ALPHA) == 200
    # Step 2: the old token removed, then SIGHUP: revoked at once.
    tenant_file(tenants_dir, "alpha", f'tokens = ["{ALPHA_NEXT}"]\nnamespaces = {{ a1 = 16 }}\n')
    assert server.proc is not None
    server.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 10
    while status(ALPHA) != 401 and time.monotonic() < deadline:
        time.sleep(0.05)
    with KVOffloadClient(server.url, token=ALPHA) as old:
        with pytest.raises(KVOffloadError) as refused:
            old.events()
        assert refused.value.code == "revoked_token"
    assert status(ALPHA_NEXT) == 200
    assert status(BETA) == 200
    reloads = [ln for ln in log_lines(server) if ln.get("event") == "tenants reloaded"]
    assert len(reloads) >= 2
    assert ALPHA_NEXT not in server.log()


def test_file_mode_lets_socket_callers_in_and_tcp_still_needs_a_token(
    tmp_path: Path, tenants_dir: Path
) -> None:
    srv = ServerProcess(tmp_path, "--tenants", str(tenants_dir), "--uds-auth", "file-mode")
    with srv.serving():
        with KVOffloadClient(uds=str(srv.uds), namespace="b1") as local:
            assert local.start_request("r1") is True
        with KVOffloadClient(uds=str(srv.uds)) as local:
            with pytest.raises(KVOffloadError) as refused:
                local.start_request("r2")  # two namespaces here: name one
            assert refused.value.code == "namespace_required"
        with KVOffloadClient(srv.url, namespace="b1") as remote:
            with pytest.raises(KVOffloadError) as refused:
                remote.start_request("r3")
            assert refused.value.status == 401
        pool = receive_pool(default_pool_socket(str(srv.uds)), namespace="b1")
        os.close(pool.fd)
        assert pool.num_blocks == 16


def test_the_admin_cli_names_a_namespace_and_lists_tenants(server: ServerProcess) -> None:
    with KVOffloadClient(server.url, token=BETA) as beta:
        beta.start_request("r")
    stats = admin(server, "--json", "stats")
    assert stats.returncode == 1
    assert "422 invalid_field" in stats.stderr
    assert "namespace" in stats.stderr
    stats = admin(server, "--json", "--namespace", "b1", "stats")
    assert stats.returncode == 0, stats.stderr
    assert json.loads(stats.stdout)["live_requests"] == 1
    env = {**clean_env(KVOFFLOAD_ADMIN_TOKEN=TOKEN), "KVOFFLOAD_ADMIN_NAMESPACE": "a1"}
    stats = admin(server, "--json", "stats", env=env)
    assert json.loads(stats.stdout)["live_requests"] == 0
    listed = admin(server, "--json", "tenants")
    assert listed.returncode == 0, listed.stderr
    rows = json.loads(listed.stdout)["tenants"]
    assert [(r["tenant"], r["requests"]) for r in rows] == [("alpha", 0), ("beta", 1)]
    assert ALPHA not in listed.stdout
    assert BETA not in listed.stdout


def test_kv_caches_register_by_descriptor_and_idle_clients_starve_nobody(
    server: ServerProcess,
) -> None:
    # Issue #21 against the real server (uvloop, both sockets): beta cannot register alpha's
    # file by path (on TCP or the Unix socket) and learns nothing; alpha registers its cache in
    # a sealed memfd by passing its descriptor over the pool socket; 70 idle connections on
    # that socket starve nobody.
    from testsupport.shm_device import MemfdDevice, ShmDevice

    pool_socket = default_pool_socket(str(server.uds))
    with ShmDevice(4, BLOCK, name="alpha-kv") as dev, MemfdDevice(4, BLOCK, "alpha-kv") as mem:
        for beta in (
            KVOffloadClient(server.url, token=BETA),
            KVOffloadClient(uds=str(server.uds), token=BETA),
        ):
            with beta, pytest.raises(KVOffloadError) as refused:
                beta.register_kv_cache(dev.spec())
            assert (refused.value.status, refused.value.code) == (403, "handle_not_held")
            assert dev.path not in str(refused.value)
        idle = []
        try:
            with KVOffloadClient(uds=str(server.uds), token=ALPHA) as alpha:
                cache = alpha.register_kv_cache(mem.spec(), fds=[mem.fd])
                assert [c.cache_id for c in alpha.kv_caches()] == [cache.cache_id]
            for _ in range(70):
                conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                conn.connect(pool_socket)
                idle.append(conn)
            got = receive_pool(pool_socket, timeout_s=5, token=BETA)
            os.close(got.fd)
        finally:
            for conn in idle:
                conn.close()
    assert "Traceback" not in server.log()
