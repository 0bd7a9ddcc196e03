"""A namespace's stored blocks belong to the tenant that stored them (in process, real files).

``alice`` stores blocks of random bytes in namespace ``a2`` (a pool of 8 blocks, so most of them
are demoted to the disk tier, or written behind to a remote store). Then the tenants file takes
``a2`` away: removed, given to ``bob``, or added back to ``alice`` later. Each test checks what
the new owner can reach (lookups, loads, events, the pool) *and* what is left of the bytes: no
file under ``--disk-dir`` holds any of them once the namespace is dropped. Start-up's sweep of
the disk directory deletes only what parses as a storage identity, never a file or directory
the service did not make.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from app.core import tenancy_reloads as tenancy_module
from app.core.disk import open_disk
from app.core.tenancy import Tenancy
from app.settings import Settings
from app.telemetry.logging import fields_of
from tests.api.test_remote_tier import MemoryStore, MemoryTier
from tests.api.test_tenancy import Tenants, tenants_running, write_tenants
from testsupport.api_harness import BLOCK, hexkeys, make_settings
from testsupport.polling import until_async
from transfer import HostPool
from transfer.disk import disk_bytes_for

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("no_watcher_reloads")]

ALICE = "alice-token-000000000000001"
BOB = "bob-token-00000000000000001"
POOL = 8
STORED = 40


@pytest.fixture
def no_watcher_reloads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the test's own reloads happen (the watcher would apply the same file again)."""
    monkeypatch.setattr(tenancy_module, "RELOAD_POLL_S", 3600.0)


def tenants(alice: list[str], bob: list[str]) -> str:
    """A tenants file: ``alice`` and ``bob`` own these namespaces, of ``POOL`` blocks each."""

    def table(names: list[str]) -> str:
        return "{ " + ", ".join(f"{n} = {POOL}" for n in names) + " }"

    return (
        f'[tenants.alice]\ntokens = ["{ALICE}"]\nnamespaces = {table(alice)}\n\n'
        f'[tenants.bob]\ntokens = ["{BOB}"]\nnamespaces = {table(bob)}\n'
    )


def disk(tmp_path: Path) -> dict[str, Any]:
    """Settings of a disk tier that takes every evicted block (admitted after one ask)."""
    return {
        "disk_dir": tmp_path / "disk",
        "disk_bytes": disk_bytes_for(64, BLOCK),
        "disk_admit_after": 1,
        "disk_batch_bytes": 8 * BLOCK,
    }


async def store_blocks(t: Tenants, token: str, ns: str, keys: list[str]) -> dict[str, bytes]:
    """Store ``keys`` in ``ns`` four at a time, random bytes each written into the pool slots
    (as an engine that maps the pool does); the request is finished after. Their bytes."""
    written: dict[str, bytes] = {}
    r = await t.call(token, "PUT", "/v1/requests/w", {}, ns)
    assert r.status_code == 201, r.text
    pool = t.tenancy.spaces[ns].service.transfers().pool
    for at in range(0, len(keys), 4):
        chunk = keys[at : at + 4]
        r = await t.call(token, "POST", "/v1/requests/w/prepare-store", {"keys": chunk}, ns)
        assert r.status_code == 200, r.text
        body = r.json()
        for key, slot in zip(body["keys_to_store"], body["slots"], strict=True):
            data = os.urandom(BLOCK)
            pool.tensor[slot].numpy()[:] = memoryview(data)
            written[key] = data
        r = await t.call(token, "POST", "/v1/requests/w/complete-store", {"keys": chunk}, ns)
        assert r.json()["completed"] == chunk, r.text
    r = await t.call(token, "DELETE", "/v1/requests/w", None, ns)
    assert r.status_code == 200, r.text
    return written


async def admin_stats(t: Tenants, ns: str) -> dict[str, Any]:
    r = await t.admin.get("/admin/v1/stats", params={"namespace": ns})
    assert r.status_code == 200, r.text
    stats: dict[str, Any] = r.json()
    return stats


async def demoted(t: Tenants, ns: str, count: int) -> None:
    """Wait until the disk tier of ``ns`` holds ``count`` blocks."""

    async def done() -> bool:
        return bool((await admin_stats(t, ns))["tiers"]["disk"]["blocks"] == count)

    await until_async("done", done)


async def lookup(t: Tenants, token: str, ns: str, keys: list[str]) -> list[str]:
    r = await t.call(token, "PUT", "/v1/requests/r", {}, ns)
    assert r.status_code in (200, 201), r.text
    r = await t.call(token, "POST", "/v1/requests/r/lookup", {"keys": keys}, ns)
    assert r.status_code == 200, r.text
    results: list[str] = r.json()["results"]
    return results


def bytes_on_disk(root: Path, written: dict[str, bytes]) -> set[str]:
    """The keys whose block bytes some file under ``root`` holds (every file read whole)."""
    found: set[str] = set()
    for directory, _, files in os.walk(root):
        for name in files:
            path = Path(directory, name)
            if path.is_symlink() or not path.is_file():
                continue
            content = path.read_bytes()
            found.update(k for k, data in written.items() if data in content)
    return found


async def sees_nothing(t: Tenants, token: str, ns: str, written: dict[str, bytes]) -> None:
    """The caller of ``token`` finds none of ``written`` in ``ns``: every lookup a miss, a load
    refused (and nothing promoted by it), no KV event naming one, no byte of them in its pool."""
    keys = list(written)
    assert await lookup(t, token, ns, keys) == ["miss"] * len(keys)
    r = await t.call(token, "POST", "/v1/requests/r/prepare-load", {"keys": keys[:4]}, ns)
    assert r.status_code == 409, r.text

    async def settled() -> bool:  # a remote promotion is tried (pending) before it misses
        return "pending" not in await lookup(t, token, ns, keys)

    await until_async("settled", settled)
    assert await lookup(t, token, ns, keys) == ["miss"] * len(keys)
    r = await t.call(token, "POST", "/v1/requests/r/prepare-load", {"keys": keys[:4]}, ns)
    assert r.status_code == 409, r.text
    r = await t.call(token, "GET", "/v1/events", None, ns)
    named = {k for e in r.json()["events"] for k in e["block_hashes"]}
    assert not named & set(keys)
    pool = bytes(t.tenancy.spaces[ns].service.transfers().pool.tensor.numpy())
    assert not [k for k, data in written.items() if data in pool]


def records(caplog: pytest.LogCaptureFixture, message: str) -> list[dict[str, Any]]:
    return [fields_of(r) for r in caplog.records if r.getMessage() == message]


async def test_a_namespace_given_to_another_tenant_hands_over_none_of_the_old_owners_blocks(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="kvoffload.tenancy")
    keys = hexkeys(*range(1, STORED + 1))
    root = tmp_path / "disk"
    async with tenants_running(tmp_path, tenants(["a1", "a2"], ["b1"]), **disk(tmp_path)) as t:
        written = await store_blocks(t, ALICE, "a2", keys)
        await demoted(t, "a2", STORED - POOL)
        got = await lookup(t, ALICE, "a2", keys)
        assert (got.count("disk"), got.count("hit")) == (STORED - POOL, POOL)
        assert len(bytes_on_disk(root, written)) == STORED - POOL  # the check sees them

        write_tenants(t.path, tenants(["a1"], ["b1", "a2"]))
        assert await t.tenancy.reload()
        assert t.tenancy.spaces["a2"].tenant == "bob"
        await sees_nothing(t, BOB, "a2", written)
        # The bytes are gone, not only out of reach.
        assert not bytes_on_disk(root, written)
        (line,) = records(caplog, "namespace removed; its blocks are dropped")
        assert (line["namespace"], line["tenant"]) == ("a2", "alice")
        assert (line["pool_blocks"], line["disk_blocks"]) == (POOL, STORED - POOL)
        assert line["disk_bytes_deleted"] >= (STORED - POOL) * BLOCK
        # bob's blocks in a2 are his own, on disk too.
        mine = await store_blocks(t, BOB, "a2", hexkeys(*range(100, 100 + 2 * POOL)))
        await demoted(t, "a2", POOL)
        assert len(bytes_on_disk(root, mine)) == POOL
    # Across a restart with the same file: still nothing of alice's, bob's kept.
    async with tenants_running(tmp_path, tenants(["a1"], ["b1", "a2"]), **disk(tmp_path)) as t:
        await sees_nothing(t, BOB, "a2", written)
        got = await lookup(t, BOB, "a2", list(mine))
        assert got.count("disk") == POOL


async def test_a_namespace_removed_and_added_back_starts_empty_for_its_own_tenant(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="kvoffload.tenancy")
    keys = hexkeys(*range(1, STORED + 1))
    root = tmp_path / "disk"
    async with tenants_running(tmp_path, tenants(["a1", "a2"], ["b1"]), **disk(tmp_path)) as t:
        written = await store_blocks(t, ALICE, "a2", keys)
        await demoted(t, "a2", STORED - POOL)
        write_tenants(t.path, tenants(["a1"], ["b1"]))
        assert await t.tenancy.reload()
        assert "a2" not in t.tenancy.spaces
        assert not bytes_on_disk(root, written)
        (line,) = records(caplog, "namespace removed; its blocks are dropped")
        assert line["disk_blocks"] == STORED - POOL
        assert line["disk_files_deleted"] >= 1

        write_tenants(t.path, tenants(["a1", "a2"], ["b1"]))
        assert await t.tenancy.reload()
        await sees_nothing(t, ALICE, "a2", written)
        stats = (await admin_stats(t, "a2"))["tiers"]["disk"]
        assert (stats["blocks"], stats["restored"]) == (0, 0)


async def test_a_namespace_given_away_while_the_service_was_down_is_deleted_at_start(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="kvoffload.tenancy")
    keys = hexkeys(*range(1, STORED + 1))
    root = tmp_path / "disk"
    async with tenants_running(tmp_path, tenants(["a1", "a2"], ["b1"]), **disk(tmp_path)) as t:
        written = await store_blocks(t, ALICE, "a2", keys)
        await demoted(t, "a2", STORED - POOL)
    caplog.clear()
    async with tenants_running(tmp_path, tenants(["a1"], ["b1", "a2"]), **disk(tmp_path)) as t:
        await sees_nothing(t, BOB, "a2", written)
        assert not bytes_on_disk(root, written)
        (line,) = records(caplog, "blocks of namespaces no longer served deleted from a tier")
        assert line["tier"] == "disk"
        assert line["deleted"] == ["a2@alice"]
        assert line["bytes"] >= (STORED - POOL) * BLOCK


def make_dirs(root: Path) -> None:
    """A disk directory after many runs, and things the service never made beside them."""
    root.mkdir()
    for name in ("a1@alice", "a2@alice", "gone@carol", "default", "legacy", "photos"):
        # As a disk store makes them (the store refuses to open anything looser).
        (root / name).mkdir(mode=0o700)
        (root / name).chmod(0o700)
        (root / name / "blocks").write_bytes(b"x" * BLOCK)
        (root / name / "blocks").chmod(0o600)
    for name in ("a1@alice", "a2@alice", "gone@carol", "default", "legacy"):
        (root / name / "lock").touch(mode=0o600)  # what a disk store leaves (not ``photos``)
        (root / name / "lock").chmod(0o600)
    (root / "lost+found").mkdir()
    (root / "notes.txt").write_text("an operator's file")
    (root / "elsewhere").mkdir()
    (root / "elsewhere" / "keep").write_text("not the service's")
    (root / "b9@bob").symlink_to(root / "elsewhere")
    (root / "c9@carol").write_text("a file named like an identity")


@contextlib.asynccontextmanager
async def single_running(settings: Settings) -> AsyncIterator[Tenancy]:
    """A tenancy without tenants (the one ``default`` namespace), running."""
    tenancy = Tenancy(settings)
    async with tenancy.running():
        yield tenancy


@pytest.mark.parametrize("with_tenants", [True, False])
async def test_the_start_sweep_deletes_only_directories_of_namespaces_no_longer_served(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, with_tenants: bool
) -> None:
    caplog.set_level(logging.INFO, logger="kvoffload.tenancy")
    root = tmp_path / "disk"
    make_dirs(root)
    before = set(os.listdir(root))
    runner: contextlib.AbstractAsyncContextManager[object]
    if with_tenants:
        runner = tenants_running(tmp_path, tenants(["a1"], ["b1"]), **disk(tmp_path))
    else:
        runner = single_running(make_settings(**disk(tmp_path)))
    async with runner:
        left = set(os.listdir(root))
    left.discard(".key")  # the disk stores' own file beside the directories, if they keep one
    # Served (a1@alice, b1@bob or default), and never a name the service did not make: not an
    # identity (lost+found, notes.txt), a symbolic link or a file named like one.
    kept = {"a1@alice", "default", "photos", "lost+found", "notes.txt", "elsewhere", "b9@bob"}
    kept |= {"c9@carol"}
    if with_tenants:
        # alice's a2 and carol's namespace are gone from the file; ``legacy`` is the layout
        # before identities (its owner never recorded): deleted. ``photos`` is no disk store.
        assert left == kept | {"b1@bob"}
        (line,) = records(caplog, "blocks of namespaces no longer served deleted from a tier")
        assert line["tier"] == "disk"
        assert line["deleted"] == ["a2@alice", "gone@carol", "legacy"]
        assert set(line["kept"]) == {"default", "photos", "elsewhere"}
    else:
        # Without tenants the owners are unknown here: nothing deleted, the names logged.
        assert left == before
        (line,) = records(caplog, "blocks of namespaces not served here kept on a tier")
        assert line["tier"] == "disk"
        assert line["deleted"] == []
        assert set(line["kept"]) == {
            "a1@alice",
            "a2@alice",
            "gone@carol",
            "legacy",
            "photos",
            "elsewhere",
        }
    assert (root / "elsewhere" / "keep").read_text() == "not the service's"


async def test_the_directory_of_an_open_disk_store_is_never_deleted(tmp_path: Path) -> None:
    from app.core.storage import NotDropped, drop_disk_dir

    pool = HostPool.create(4, BLOCK)
    try:
        # The store as the service opens it: ``<disk_dir>/<identity>``.
        settings = make_settings(disk_dir=tmp_path, disk_bytes=disk_bytes_for(4, BLOCK))
        store, _ = open_disk(settings, pool, "a2@alice")
        try:
            with pytest.raises(NotDropped, match="in use"):
                drop_disk_dir(tmp_path, "a2@alice")
            assert (tmp_path / "a2@alice").is_dir()
        finally:
            store.close()
        dropped = drop_disk_dir(tmp_path, "a2@alice")
        assert dropped is not None
        assert dropped.files >= 2
        assert not (tmp_path / "a2@alice").exists()
        assert drop_disk_dir(tmp_path, "a2@alice") is None
    finally:
        pool.close()
    (tmp_path / "photos").mkdir()
    for name in ("../photos", "photos/x", "a2@", "@alice", "a2@alice@x", ".hidden"):
        with pytest.raises(NotDropped, match="not a storage identity"):
            drop_disk_dir(tmp_path, name)
    with pytest.raises(NotDropped, match="holds no disk store"):
        drop_disk_dir(tmp_path, "photos", only_store=True)
    assert (tmp_path / "photos").is_dir()


def test_the_storage_identity_names_the_owner_and_the_remote_prefix_carries_it() -> None:
    from app.core.remote import remote_namespace
    from app.core.storage import parse_identity, storage_identity

    assert storage_identity("a2", "alice") == "a2@alice"
    assert storage_identity("a2", "bob") != storage_identity("a2", "alice")
    assert storage_identity("default", None) == "default"  # a service without tenants: as before
    assert parse_identity("a2@alice") == ("a2", "alice")
    assert parse_identity("default") == ("default", None)
    longest = storage_identity("n" * 63, "t" * 63)
    assert parse_identity(longest) == ("n" * 63, "t" * 63)
    assert len(longest.encode()) <= 255  # a file name
    assert remote_namespace(storage_identity("a2", "alice"), 4096) == "kvoffload/a2@alice/4096"
    assert remote_namespace("default", 4096) == "kvoffload/default/4096"


async def test_the_remote_tier_of_a_namespace_given_to_another_tenant_is_another_prefix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real ``build_tier`` (the Mooncake client swapped for a store in memory): the store
    keeps alice's objects (other nodes may serve them to her), under a prefix bob's tier never
    asks about."""
    import transfer.mooncake

    store = MemoryStore()
    tiers: list[MemoryTier] = []

    def mooncake(pool: HostPool, namespace: str, config: object) -> MemoryTier:
        tier = MemoryTier(store, pool, namespace)
        tiers.append(tier)
        return tier

    monkeypatch.setattr(transfer.mooncake, "MooncakeTier", mooncake)
    remote = {
        "remote_tier": "mooncake",
        "mooncake_master": "store:1",
        "mooncake_metadata": "http://store/metadata",
        "remote_lookup_timeout_s": 1.0,
        "remote_removal_confirm_s": 0.0,
    }
    keys = hexkeys(*range(1, 5))
    async with tenants_running(tmp_path, tenants(["a1", "a2"], ["b1"]), **remote) as t:
        written = await store_blocks(t, ALICE, "a2", keys)

        async def put() -> bool:
            return len(store.blocks) == len(keys)

        await until_async("put", put)
        write_tenants(t.path, tenants(["a1"], ["b1", "a2"]))
        assert await t.tenancy.reload()
        await sees_nothing(t, BOB, "a2", written)
        # Alice's objects are still in the shared store, under her identity only.
        assert all(name.startswith("kvoffload/a2@alice/4096/") for name in store.blocks)
        assert len(store.blocks) == len(keys)
        stats = (await admin_stats(t, "a2"))["tiers"]["remote"]
        assert stats["namespace"] == "kvoffload/a2@bob/4096"
    # One tier per identity opened: a2's second owner got a prefix of its own.
    assert sorted(tier.namespace for tier in tiers) == [
        "kvoffload/a1@alice/4096",
        "kvoffload/a2@alice/4096",
        "kvoffload/a2@bob/4096",
        "kvoffload/b1@bob/4096",
    ]
