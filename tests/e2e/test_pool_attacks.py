"""A tenant's engine attacks the host pool the pool socket hands it, against a real
``kvoffload serve`` with tenants and a disk tier (issue #42, finding 1).

The pool used to be an unsealed file in ``/dev/shm``: the engine shrank it to nothing and the
service's next copy into it ended the process with ``SIGBUS``, for every tenant. Now the pool
is a memfd sealed against any change of size: the shrink is refused by the kernel, a punched
hole reads as zeros, and the service stays up. The attacker runs as uid 65534, as in
``tests.e2e.test_tenant_attacks`` (whose service setup this one follows).
"""

from __future__ import annotations

import grp
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kvoffload_client.client import KVOffloadClient

from tests.e2e.test_tenants import tenant_file
from testsupport.server import ROOT, ServerProcess
from testsupport.shm_device import MemfdDevice
from transfer.disk import disk_bytes_for

ALICE = "alice-pool-attack-token-000001"
BOB = "bob-pool-attack-token-00000001"
NOBODY = 65534
BLOCK = 4096

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None,
    reason="needs root (to run the attacker as another user) and util-linux's setpriv",
)


@pytest.fixture
def service() -> Iterator[ServerProcess]:
    work = Path(tempfile.mkdtemp(prefix="kvo-pool-attack-"))
    os.chmod(work, 0o711)  # the attacker's user passes through to the sockets
    tenants = work / "tenants"
    tenants.mkdir(mode=0o700)
    tenant_file(tenants, "alice", f'tokens = ["{ALICE}"]\nnamespaces = {{ a1 = 32 }}\n')
    tenant_file(tenants, "bob", f'tokens = ["{BOB}"]\nnamespaces = {{ b1 = 32 }}\n')
    srv = ServerProcess(
        work,
        *("--tenants", str(tenants), "--uds-mode", "0660"),
        *("--uds-group", grp.getgrgid(NOBODY).gr_name, "--log-level", "info"),
        *("--disk-dir", str(work / "disk"), "--disk-bytes", str(disk_bytes_for(64, BLOCK))),
        wrapper=["setpriv", "--bounding-set=-dac_override,-dac_read_search,-fowner", "--"],
    )
    try:
        with srv.serving():
            yield srv
    finally:
        shutil.rmtree(work, ignore_errors=True)


def attack_pool(srv: ServerProcess, token: str, ns: str) -> dict[str, Any]:
    env = {**os.environ, "KVO_ATTACK_TOKEN": token}
    argv = [sys.executable, "-m", "tests.e2e.pool_attacks", "--uds", str(srv.uds)]
    argv += ["--namespace", ns, "--user", str(NOBODY)]
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, timeout=120, check=False)
    assert srv.proc is not None
    assert srv.proc.poll() is None, f"service died ({srv.proc.returncode}):\n{srv.log()}"
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    result: dict[str, Any] = json.loads(done.stdout)
    assert result["uid"] == NOBODY
    return result


def test_an_engine_cannot_end_the_service_through_its_pool(service: ServerProcess) -> None:
    with (
        MemfdDevice(4, BLOCK, name="alice-kv") as dev,
        KVOffloadClient(uds=str(service.uds), token=ALICE, namespace="a1") as alice,
    ):
        cache = alice.register_kv_cache(dev.spec(), fds=[dev.fd])
        pattern = dev.fill(0, 91)
        alice.start_request("alice-r")
        key = bytes.fromhex("a1" * 16)
        stored = alice.offload("alice-r", cache.cache_id, [key], [0])
        assert stored.job_id is not None
        assert alice.wait_jobs([stored.job_id], 5).jobs[0].state == "done"

        out = attack_pool(service, BOB, "b1")

        assert out["mapped_rw"] is True  # the engine still maps its pool read-write
        assert out["shrunk"] == "Operation not permitted"  # the seal holds
        assert out["shrunk_size"] == out["pool_bytes"] == 32 * BLOCK
        assert out["punched"] is True  # allowed: a hole reads as zeros
        assert out["punched_again"] is True
        assert out["registered"] is True, out
        assert out["offload"][1] == "done", out
        assert out["onload"][1] == "done", out
        assert out["onloaded_bytes_ok"] is True  # the hole was before the store
        assert out["demote"][0] == 200, out
        assert out["demote"][1]["moved"] == ["ee" * 8], out
        # Bob's block went through his punched pool to disk and back up into it: no fault.
        assert out["promoted_onload"][1] == "done", out

        # Alice's pool is another memfd: her block is still there, byte for byte.
        loaded = alice.onload("alice-r", cache.cache_id, [key], [2])
        assert loaded.job_id is not None
        assert alice.wait_jobs([loaded.job_id], 5).jobs[0].state == "done"
        assert dev.read(2) == pattern
    assert service.proc is not None
    assert service.proc.poll() is None
    assert "Traceback" not in service.log()
