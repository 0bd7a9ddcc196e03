"""A tenant's engine attacks the memory it registers and the process's descriptors, as another,
unprivileged user, against a real ``kvoffload serve`` (issue #31, items 1 and 2).

The service runs as root without the capabilities that set root apart here
(``CAP_SYS_RESOURCE``: raising a hard limit; ``CAP_DAC_*``/``CAP_FOWNER``: files), under a
lowered descriptor limit, so it behaves as an unprivileged service would. The attacker
(``tests.e2e.tenant_attacks``) drops to uid/gid 65534, which reaches the sockets through their
group. Each attack used to end the process (SIGBUS) or fill its descriptor table.
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
from kvoffload_client.pool_socket import default_pool_socket, register_kv_cache

from tests.e2e.test_tenants import tenant_file
from testsupport.server import ROOT, ServerProcess
from testsupport.shm_device import MemfdDevice

ALICE = "alice-attack-token-00000000001"
BOB = "bob-attack-token-0000000000001"
NOBODY = 65534
SOFT, HARD = 1024, 4096
BLOCK = 4096

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None or shutil.which("prlimit") is None,
    reason="needs root (to run the attacker as another user) and util-linux's setpriv, prlimit",
)


@pytest.fixture
def service() -> Iterator[ServerProcess]:
    # A directory the attacker's user can pass through to the sockets (pytest's is 0700).
    work = Path(tempfile.mkdtemp(prefix="kvo-attack-"))
    os.chmod(work, 0o711)
    tenants = work / "tenants"
    tenants.mkdir(mode=0o700)
    tenant_file(tenants, "alice", f'tokens = ["{ALICE}"]\nnamespaces = {{ a1 = 32, a2 = 32 }}\n')
    tenant_file(
        tenants,
        "bob",
        f'tokens = ["{BOB}"]\n'
        "namespaces = { b1 = { blocks = 32, max_registrations = 4 }, "
        "b2 = { blocks = 32, max_mapped_bytes = 65536 } }\n",
    )
    group = grp.getgrgid(NOBODY).gr_name
    wrapper = [
        "prlimit",
        f"--nofile={SOFT}:{HARD}",
        "--",
        "setpriv",
        "--bounding-set=-sys_resource,-dac_override,-dac_read_search,-fowner",
        "--",
    ]
    srv = ServerProcess(
        work,
        "--tenants",
        str(tenants),
        "--uds-mode",
        "0660",
        "--uds-group",
        group,
        "--log-level",
        "info",
        wrapper=wrapper,
    )
    try:
        with srv.serving():
            yield srv
    finally:
        shutil.rmtree(work, ignore_errors=True)


def attack(srv: ServerProcess, name: str, token: str, ns: str, *extra: str) -> dict[str, Any]:
    """Run one attack as uid 65534; its JSON result. The service must still be running."""
    env = {**os.environ, "KVO_ATTACK_TOKEN": token}
    argv = [sys.executable, "-m", "tests.e2e.tenant_attacks", name, "--uds", str(srv.uds)]
    argv += ["--namespace", ns, "--user", str(NOBODY), *extra]
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    result: dict[str, Any] = json.loads(done.stdout)
    assert result["uid"] == NOBODY
    assert srv.proc is not None
    assert srv.proc.poll() is None, f"service died:\n{srv.log()}"
    return result


def alice_still_served(srv: ServerProcess) -> None:
    """Alice registers a cache, stores a block from it and loads it back."""
    with (
        MemfdDevice(4, BLOCK, name="alice-kv") as dev,
        KVOffloadClient(uds=str(srv.uds), token=ALICE, namespace="a1") as alice,
    ):
        cache = alice.register_kv_cache(dev.spec(), fds=[dev.fd])
        pattern = dev.fill(0, 77)
        alice.start_request("alice-r")
        key = bytes.fromhex("a1" * 16)
        stored = alice.offload("alice-r", cache.cache_id, [key], [0])
        assert stored.job_id is not None
        assert alice.wait_jobs([stored.job_id], 5).jobs[0].state == "done"
        loaded = alice.onload("alice-r", cache.cache_id, [key], [2])
        assert loaded.job_id is not None
        assert alice.wait_jobs([loaded.job_id], 5).jobs[0].state == "done"
        assert dev.read(2) == pattern


def fds_of(srv: ServerProcess) -> int:
    assert srv.proc is not None
    return len(os.listdir(f"/proc/{srv.proc.pid}/fd"))


def test_a_shrunk_or_sparse_registration_cannot_end_the_process(service: ServerProcess) -> None:
    out = attack(service, "truncate", BOB, "b1")
    assert out["unsealed"]["refused"] == "invalid_registration"
    assert "not a memfd sealed against shrinking" in out["unsealed"]["message"]
    assert "cache_id" in out["sealed"], out
    assert out["shrunk"] == "Operation not permitted"  # the seal holds: the kernel refuses
    assert out["punched"] is True  # a hole is no fault: it reads as zeros
    assert out["offload"][1] == "done", out
    assert out["onload"][1] == "done", out
    assert out["onloaded_bytes_ok"] is True

    tmpfs = Path(tempfile.mkdtemp(prefix="kvo-tmpfs-"))
    os.chmod(tmpfs, 0o755)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k,mode=1777", "tmpfs", str(tmpfs)],
        capture_output=True,
        check=False,
    )
    if mounted.returncode != 0:
        tmpfs.rmdir()
        pytest.skip(f"cannot mount a tmpfs: {mounted.stderr.decode().strip()}")
    try:
        out = attack(service, "sparse-tmpfs", BOB, "b1", "--tmpfs", str(tmpfs))
    finally:
        subprocess.run(["umount", str(tmpfs)], check=False)
        tmpfs.rmdir()
    assert out["tmpfs"] == "No space left on device"
    assert out["registered"]["refused"] == "invalid_registration", out
    alice_still_served(service)
    assert "Traceback" not in service.log()


def test_one_tenant_cannot_take_the_process_s_descriptors(service: ServerProcess) -> None:
    assert service.proc is not None
    with open(f"/proc/{service.proc.pid}/limits") as f:
        line = next(ln for ln in f if ln.startswith("Max open files"))
    assert line.split()[3:5] == [str(HARD), str(HARD)]  # the soft limit raised to the hard one
    before = fds_of(service)
    out = attack(service, "descriptors", BOB, "b1", "--count", "23", "--tensors", "2048")
    assert out["answers"] == {"registered": 4, "quota_exceeded": 19}, out
    assert "max_registrations" in out["last"]["message"]
    assert fds_of(service) <= before + 8  # each registration holds no descriptor
    with open(f"/proc/{service.proc.pid}/maps") as f:
        maps = sum(1 for ln in f if "memfd:attack-many-tensors" in ln)
    assert maps == 4  # one mapping per registration, not one per tensor
    # Bob's other namespace is held to its bytes: 64 KiB mapped, the next cache refused.
    with MemfdDevice(16, BLOCK, name="bob-b2") as dev:
        sock = default_pool_socket(str(service.uds))
        register_kv_cache(sock, dev.spec(), [dev.fd], token=BOB, namespace="b2")
        with pytest.raises(Exception, match="max_mapped_bytes") as refused:
            register_kv_cache(
                sock, {**dev.spec(), "name": "bob-b2-more"}, [dev.fd], token=BOB, namespace="b2"
            )
        assert getattr(refused.value, "reason", None) == "quota_exceeded"
    alice_still_served(service)
    assert "Traceback" not in service.log()
