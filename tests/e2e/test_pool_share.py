"""The pool socket of a live ``kvoffload serve --uds``: an engine process that receives the pool
writes blocks through its own mapping and the service moves exactly those bytes; an engine in
another PID and mount namespace (what a container is) cannot open the ``/proc`` path but
receives the pool all the same; a restart brings a new ``pool_id``, which every engine answer's
``X-KVOffload-Pool`` header shows; the socket file goes away with the service."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest
from kvoffload_client.client import KVOffloadClient
from kvoffload_client.pool_socket import POOL_HEADER, PoolShareError, receive_pool

from testsupport.server import ROOT, ServerProcess
from testsupport.shm_device import ShmDevice

UNSHARE = ("unshare", "--pid", "--fork", "--mount-proc")


def pool_socket(server: ServerProcess) -> str:
    return f"{server.uds}.pool"


def uds_client(server: ServerProcess) -> httpx.Client:
    return httpx.Client(
        base_url="http://kvoffload", transport=httpx.HTTPTransport(uds=str(server.uds)), timeout=10
    )


def run_engine(
    server: ServerProcess, writes: dict[int, bytes], prefix: Sequence[str] = ()
) -> dict[str, Any]:
    """Run ``tests.e2e.pool_engine`` (under ``prefix``, e.g. unshare) and return its answer."""
    with uds_client(server) as http:
        proc_path = http.get("/v1/pool").json()["path"]
    argv = [
        *prefix,
        sys.executable,
        "-m",
        "tests.e2e.pool_engine",
        pool_socket(server),
        proc_path,
        json.dumps({str(slot): data.hex() for slot, data in writes.items()}),
    ]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    answer: dict[str, Any] = json.loads(done.stdout)
    return answer


def store_through_engine(
    server: ServerProcess, req: str, prefix: Sequence[str] = ()
) -> dict[str, Any]:
    """prepare-store, the engine process writes the slots, complete-store, then onload into a
    device cache: the device must hold what the engine wrote. Returns the engine's answer."""
    keys = [os.urandom(16) for _ in range(3)]
    with KVOffloadClient(uds=str(server.uds), timeout=10) as c, ShmDevice(8, 4096) as dev:
        cache = c.register_kv_cache(dev.spec())
        c.start_request(req)
        plan = c.prepare_store(req, keys)
        assert plan.keys_to_store == keys
        written = {slot: os.urandom(4096) for slot in plan.slots}
        answer = run_engine(server, written, prefix)
        c.complete_store(req, keys, success=True)
        loaded = c.onload(req, cache.cache_id, keys, [4, 5, 6])
        assert loaded.job_id is not None
        assert c.wait_jobs([loaded.job_id], timeout_s=10).jobs[0].state == "done"
        assert [dev.read(b) for b in (4, 5, 6)] == [written[s] for s in plan.slots]
        c.finish_request(req)
        c.unregister_kv_cache(cache.cache_id)
    return answer


def test_engine_writes_through_its_mapping_and_the_service_moves_those_bytes(
    server: ServerProcess,
) -> None:
    answer = store_through_engine(server, "pool-share-engine")
    with uds_client(server) as http:
        r = http.get("/v1/pool")
    layout = r.json()
    assert answer["pool_id"] == layout["pool_id"] == r.headers[POOL_HEADER]
    assert (answer["num_blocks"], answer["block_bytes"]) == (256, 4096)
    # Same host, same user, same PID namespace: the /proc path still opens (compatibility).
    assert answer["proc_path"] == "opened"


def test_a_second_receiver_sees_the_first_ones_bytes(server: ServerProcess) -> None:
    marker = os.urandom(64)
    run_engine(server, {255: marker})
    pool = receive_pool(pool_socket(server))
    with pool.map() as mapped:
        os.close(pool.fd)
        start = pool.offset + 255 * pool.block_bytes
        assert mapped[start : start + 64] == marker


def _unshare_works() -> str | None:
    """None when ``unshare --pid --fork --mount-proc`` runs here, else why not."""
    if shutil.which(UNSHARE[0]) is None:
        return "unshare (util-linux) is not installed"
    try:
        probe = subprocess.run(
            [*UNSHARE, "true"], capture_output=True, text=True, timeout=30, check=False
        )
    except OSError as exc:
        return f"unshare cannot run: {exc}"
    if probe.returncode != 0:
        return f"new PID and mount namespaces are not allowed here: {probe.stderr.strip()}"
    return None


def test_engine_in_another_pid_and_mount_namespace_gets_the_pool(server: ServerProcess) -> None:
    """Like a container sharing only the socket's directory: the /proc path is not there, the
    pool socket works."""
    reason = _unshare_works()
    if reason is not None:
        pytest.skip(reason)
    answer = store_through_engine(server, "pool-share-container", prefix=UNSHARE)
    assert answer["proc_path"] == "FileNotFoundError"
    with uds_client(server) as http:
        assert answer["pool_id"] == http.get("/v1/pool").json()["pool_id"]


def test_restart_brings_a_new_pool_id_in_every_answer(tmp_path: Path) -> None:
    first = ServerProcess(tmp_path)
    with first.serving():
        old = receive_pool(pool_socket(first))
        with uds_client(first) as http:
            answers = [
                http.get("/livez"),
                http.get("/v1/pool"),
                http.post("/v1/requests/nobody/lookup", json={"keys": []}),  # 404
                http.post("/v1/requests/nobody/lookup", json={"keys": 1}),  # 422
                http.get("/no/such/route"),
                http.get("/metrics"),
            ]
        assert [r.status_code for r in answers] == [200, 200, 404, 422, 404, 200]
        assert {r.headers.get(POOL_HEADER) for r in answers} == {old.pool_id}
        with httpx.Client(timeout=10) as tcp:
            assert tcp.get(f"{first.url}/livez").headers[POOL_HEADER] == old.pool_id
    assert not Path(pool_socket(first)).exists()
    with pytest.raises(PoolShareError, match="no pool socket"):
        receive_pool(pool_socket(first), timeout_s=2)

    with old.map() as old_map:
        os.close(old.fd)
        second = ServerProcess(tmp_path)  # same socket paths, a new process and pool
        with second.serving():
            new = receive_pool(pool_socket(second))
            with uds_client(second) as http:
                seen = http.get("/livez").headers[POOL_HEADER]
            assert seen == new.pool_id != old.pool_id
            # The old mapping is a pool nobody else sees any more: the header told the engine.
            old_map[:4] = b"gone"
            with new.map() as new_map:
                os.close(new.fd)
                assert new_map[:4] == b"\0\0\0\0"


def test_an_explicit_pool_socket_path(tmp_path: Path) -> None:
    path = tmp_path / "elsewhere" / "pool.sock"
    path.parent.mkdir()
    srv = ServerProcess(tmp_path, "--pool-socket", str(path))
    with srv.serving():
        assert not Path(pool_socket(srv)).exists()
        pool = receive_pool(path)
        os.close(pool.fd)
        assert oct(path.stat().st_mode & 0o777) == oct(0o600)  # --uds-mode default
        with uds_client(srv) as http:
            assert http.get("/v1/pool").json()["pool_id"] == pool.pool_id
    assert not path.exists()
