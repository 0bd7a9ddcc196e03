"""A namespace given to another tenant, against a real ``kvoffload serve`` with a disk tier.

The attack: ``alice`` stores 40 blocks of random bytes in namespace ``a2`` (a pool of 8, so 32
are demoted to the disk) through the engine API and the pool she maps from the pool socket. The
operator rewrites the tenants directory so that ``a2`` belongs to ``bob`` and sends SIGHUP. bob
must find none of alice's blocks (lookups miss, a load is refused, no KV event names them, his
pool holds none of her bytes), no file under ``--disk-dir`` may hold them any more, and the same
must hold after a restart.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx
import pytest
from kvoffload_client.client import KVOffloadClient, KVOffloadError
from kvoffload_client.pool_socket import default_pool_socket, receive_pool

from tests.e2e.test_tenants import granted, tenant_file
from testsupport.polling import until
from testsupport.server import TOKEN, ServerProcess
from transfer.disk import disk_bytes_for

ALICE = "alice-e2e-token-00000000001"
BOB = "bob-e2e-token-000000000000001"
BLOCK = 4096
POOL = 8
STORED = 40


def namespaces(*names: str) -> str:
    return "{ " + ", ".join(f"{n} = {POOL}" for n in names) + " }"


@pytest.fixture
def tenants_dir(tmp_path: Path) -> Path:
    d = tmp_path / "tenants"
    d.mkdir()
    tenant_file(d, "alice", f'tokens = ["{ALICE}"]\nnamespaces = {namespaces("a1", "a2")}\n')
    tenant_file(d, "bob", f'tokens = ["{BOB}"]\nnamespaces = {namespaces("b1")}\n')
    return d


def disk_server(tmp_path: Path, tenants_dir: Path) -> ServerProcess:
    return ServerProcess(
        tmp_path,
        *("--tenants", str(tenants_dir), "--log-level", "info"),
        *("--disk-dir", str(tmp_path / "disk"), "--disk-bytes", str(disk_bytes_for(64, BLOCK))),
        *("--disk-admit-after", "1", "--disk-batch-bytes", str(8 * BLOCK)),
    )


@pytest.fixture
def keys() -> list[bytes]:
    return [os.urandom(16) for _ in range(STORED)]


def store(srv: ServerProcess, keys: list[bytes]) -> dict[bytes, bytes]:
    """alice stores ``keys`` in a2, random bytes each written into the slots she maps."""
    written: dict[bytes, bytes] = {}
    shared = receive_pool(default_pool_socket(str(srv.uds)), token=ALICE, namespace="a2")
    pool = shared.map()
    os.close(shared.fd)
    with KVOffloadClient(srv.url, token=ALICE, namespace="a2") as alice:
        alice.start_request("w")
        for at in range(0, len(keys), 4):
            chunk = keys[at : at + 4]
            prepared = alice.prepare_store("w", chunk)
            for key, slot in zip(prepared.keys_to_store, prepared.slots, strict=True):
                data = os.urandom(BLOCK)
                start = shared.offset + slot * BLOCK
                pool[start : start + BLOCK] = data
                written[key] = data
            assert alice.complete_store("w", chunk).completed == chunk
        alice.finish_request("w")
    pool.close()
    return written


def disk_blocks(srv: ServerProcess, ns: str) -> int:
    r = httpx.get(
        f"{srv.admin_url}/admin/v1/stats",
        params={"namespace": ns},
        headers={"Authorization": f"Bearer {TOKEN}"},
    )
    assert r.status_code == 200, r.text
    blocks: int = r.json()["tiers"]["disk"]["blocks"]
    return blocks


def bytes_on_disk(root: Path, written: dict[bytes, bytes]) -> set[bytes]:
    """The keys whose block bytes some file under ``root`` holds (every file read whole)."""
    found: set[bytes] = set()
    for directory, _, files in os.walk(root):
        for name in files:
            path = Path(directory, name)
            if path.is_file() and not path.is_symlink():
                content = path.read_bytes()
                found.update(k for k, data in written.items() if data in content)
    return found


def bob_sees_nothing(srv: ServerProcess, written: dict[bytes, bytes]) -> None:
    """bob, in a2: every lookup a miss, a load refused (nothing promoted by it), no KV event
    naming one of alice's keys, none of her bytes in the pool he maps."""
    keys = list(written)
    with KVOffloadClient(srv.url, token=BOB, namespace="a2") as bob:
        bob.start_request("r")
        assert bob.lookup("r", keys).results == ["miss"] * len(keys)
        with pytest.raises(KVOffloadError) as refused:
            bob.prepare_load("r", keys[:4])
        assert refused.value.status == 409
        assert bob.lookup("r", keys).results == ["miss"] * len(keys)
        named = {k for e in bob.events().events for k in e.block_hashes}
        assert not named & set(keys)
        bob.finish_request("r")
    shared = receive_pool(default_pool_socket(str(srv.uds)), token=BOB, namespace="a2")
    pool = shared.map()
    os.close(shared.fd)
    try:
        assert not [k for k, data in written.items() if data in pool[:]]
    finally:
        pool.close()


def test_a_namespace_given_to_another_tenant_hands_over_none_of_the_old_owners_blocks(
    tmp_path: Path, tenants_dir: Path, keys: list[bytes]
) -> None:
    root = tmp_path / "disk"
    srv = disk_server(tmp_path, tenants_dir)
    with srv.serving():
        written = store(srv, keys)
        until(
            "alice's evicted blocks on disk",
            lambda: True if disk_blocks(srv, "a2") == STORED - POOL else None,
            30,
            0.05,
        )
        with KVOffloadClient(srv.url, token=ALICE, namespace="a2") as alice:
            alice.start_request("r")
            got = alice.lookup("r", keys).results
            assert (got.count("disk"), got.count("hit")) == (STORED - POOL, POOL)
        assert len(bytes_on_disk(root, written)) == STORED - POOL  # the check sees them

        tenant_file(
            tenants_dir, "alice", f'tokens = ["{ALICE}"]\nnamespaces = {namespaces("a1")}\n'
        )
        tenant_file(
            tenants_dir, "bob", f'tokens = ["{BOB}"]\nnamespaces = {namespaces("b1", "a2")}\n'
        )
        assert srv.proc is not None
        srv.proc.send_signal(signal.SIGHUP)

        # Refused as not bob's until the reload applies.
        until("a2 given to bob", lambda: granted(srv.url, BOB, "a2"), 30, 0.05)
        bob_sees_nothing(srv, written)
        assert not bytes_on_disk(root, written)
        assert ALICE not in srv.log()
        assert BOB not in srv.log()
    # Restarted with the rewritten tenants directory: still nothing of alice's.
    with disk_server(tmp_path, tenants_dir).serving() as srv2:
        bob_sees_nothing(srv2, written)
        assert disk_blocks(srv2, "a2") == 0
    assert not bytes_on_disk(root, written)
