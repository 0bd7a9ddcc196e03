"""A request's whole life against a live ``kvoffload serve``, over TCP and the Unix socket."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from kvoffload_client.client import KVOffloadAdminClient, KVOffloadClient, KVOffloadError

from testsupport.server import ROOT, TOKEN, ServerProcess
from testsupport.shm_device import ShmDevice


def client_for(server: ServerProcess, transport: str) -> KVOffloadClient:
    if transport == "uds":
        return KVOffloadClient(uds=str(server.uds), timeout=10)
    return KVOffloadClient(server.url, timeout=10)


@pytest.mark.parametrize("transport", ["tcp", "uds"])
def test_request_life(server: ServerProcess, transport: str) -> None:
    req = f"life-{transport}"
    with client_for(server, transport) as c, ShmDevice(16, 4096) as dev:
        pool = c.pool()
        assert (pool.num_blocks, pool.block_bytes) == (256, 4096)
        cache = c.register_kv_cache(dev.spec())
        assert c.start_request(req) is True
        keys = [os.urandom(16) for _ in range(6)]
        assert c.lookup(req, keys).results == ["miss"] * 6

        written = [dev.fill(b, seed=int.from_bytes(keys[b][:4], "little")) for b in range(6)]
        started = c.offload(req, cache.cache_id, keys, list(range(6)))
        assert started.keys_to_store == keys
        assert started.job_id is not None
        waited = c.wait_jobs([started.job_id], timeout_s=10)
        assert waited.done
        assert waited.jobs[0].state == "done"
        assert waited.jobs[0].bytes == 6 * 4096

        hit = c.lookup(req, keys)
        assert (hit.results, hit.hit_prefix) == (["hit"] * 6, 6)

        loaded = c.onload(req, cache.cache_id, keys, list(range(8, 14)))
        assert loaded.job_id is not None
        assert c.wait_jobs([loaded.job_id], timeout_s=10).jobs[0].state == "done"
        assert [dev.read(b) for b in range(8, 14)] == written

        events = c.events()
        assert any(e.type == "BlockStored" and e.block_hashes == keys for e in events.events)
        assert c.finish_request(req).pins_released == 0
        with pytest.raises(KVOffloadError) as info:
            c.lookup(req, keys)
        assert info.value.status == 404
        c.unregister_kv_cache(cache.cache_id)


def test_admin_cli_talks_to_the_admin_api(server: ServerProcess, tmp_path: Path) -> None:
    env = {**os.environ, "KVOFFLOAD_ADMIN_TOKEN": TOKEN, "KVOFFLOAD_ADMIN_URL": server.admin_url}

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "app.cli", "admin", *args],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )

    got = cli("policy", "get")
    assert got.returncode == 0, got.stderr
    assert '"name": "lru"' in got.stdout or '"name": "arc"' in got.stdout
    with KVOffloadAdminClient(server.admin_url, token=TOKEN) as admin:
        generation = admin.policy()["generation"]
    stale = cli("policy", "set", "arc", "--if-match", str(generation + 100))
    assert stale.returncode == 1
    assert "412" in stale.stderr
    switched = cli("policy", "set", "arc", "--if-match", str(generation))
    assert switched.returncode == 0, switched.stderr
    assert '"changed": true' in switched.stdout
    back = cli("policy", "set", "lru")
    assert back.returncode == 0, back.stderr
    shadow = cli("policy", "shadow")
    assert shadow.returncode == 0, shadow.stderr
    assert json.loads(shadow.stdout)["active"]["name"] == "lru"

    level = json.loads(cli("log-level", "get").stdout)["level"]
    louder = cli("log-level", "set", "debug")
    assert louder.returncode == 0, louder.stderr
    assert json.loads(louder.stdout) == {"level": "debug", "previous": level, "changed": True}
    with KVOffloadAdminClient(server.admin_url, token=TOKEN) as admin:
        assert admin.log_level()["level"] == "debug"
        assert admin.set_log_level(level)["changed"] is True
    bad = cli("log-level", "set", "chatty")
    assert bad.returncode == 1
    assert "422" in bad.stderr

    token_file = tmp_path / "wrong-token"
    token_file.write_text("nope")
    token_file.chmod(0o600)  # a token file others can read is refused before any call
    denied = cli("--token-file", str(token_file), "stats")
    assert denied.returncode == 1
    assert "403" in denied.stderr


def test_shutdown_on_sigterm_is_clean(tmp_path: Path) -> None:
    srv = ServerProcess(tmp_path, "--shutdown-delay-s", "1.0").start()
    try:
        with KVOffloadClient(srv.url, timeout=5) as c:
            c.start_request("bye")
            assert c.ready()
            assert srv.proc is not None
            srv.proc.send_signal(15)
            time.sleep(0.3)
            assert c.ready() is False  # draining: not ready, still answering
        status = srv.stop()
    finally:
        srv.kill()
    assert status == 0, srv.log()
    assert not srv.uds.exists()
    assert "Traceback" not in srv.log()
