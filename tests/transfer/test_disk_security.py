"""``transfer.disk.DiskStore`` against a local user who could write where the tier lives.

The threat: the service runs as root (or as its own user) with ``--disk-dir D``, and someone
else on the machine could write ``D`` or a directory below it, or did before it was fixed.
Planted symbolic and hard links (``D/<ns>/{index,blocks,probe,lock}``, ``D/.key``) must never
be written through: a "victim" file outside the tier stands for ``/etc/shadow`` and must keep
its bytes and size. Directories others can write or that belong to someone else are refused,
the message naming the path and the fix. Blocks whose integrity anyone can recompute (the
unkeyed xxh3 of format 1), or made under another key, are never loaded.

Each test opens a real store in a temporary directory over a real host pool. Tests that need
another user's files (``chown`` to ``nobody``, uid 65534) run as root only (CI does).
"""

from __future__ import annotations

import os
import shutil
import stat
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
import xxhash

from transfer import HostPool
from transfer.disk import DiskStore
from transfer.disk_files import DiskError

BLOCK = 8192
NOBODY = 65534
VICTIM = b"root:$6$precious-hash:19000:0:99999:7:::\n" * 32
EVIL = b"EVIL-KV-FROM-MALLORY"
FILES = ["index", "blocks", "lock", "probe"]

needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="files of another user (chown to nobody) need root; CI runs as root"
)


@pytest.fixture
def pool(make_pool: Callable[..., HostPool]) -> HostPool:
    return make_pool(8, BLOCK)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """``--disk-dir``: the service's own, 0700."""
    path = tmp_path / "disk"
    path.mkdir()
    path.chmod(0o700)
    return path


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    """A file outside the tier that nobody may make the service write (``/etc/shadow``)."""
    path = tmp_path / "victim"
    path.write_bytes(VICTIM)
    path.chmod(0o600)
    return path


def own_dir(path: Path) -> Path:
    path.mkdir()
    path.chmod(0o700)
    return path


def untouched(victim: Path) -> None:
    assert victim.read_bytes() == VICTIM
    assert victim.stat().st_size == len(VICTIM)


def refused(directory: Path, pool: HostPool, *needles: str) -> str:
    """Opening the store in ``directory`` raises ``DiskError`` holding every needle."""
    with pytest.raises(DiskError) as caught:
        DiskStore(str(directory), pool, 4).close()
    message = str(caught.value)
    for needle in needles:
        assert needle in message, message
    return message


def write(store: DiskStore, pool: HostPool, slot: int, key: bytes, data: bytes) -> None:
    pool.tensor[0].numpy()[:] = memoryview(data)
    staged = store.stage([0])
    assert staged is not None
    try:
        assert store.write_many([(slot, key, staged[0])]) == [True]
    finally:
        store.unstage(staged)


def v1_entry(key: bytes, data: bytes, seq: int) -> bytes:
    """An index entry of format 1 (before this fix), made as anyone can: unkeyed xxh3-64 of the
    block seeded by the key's, then xxh3-64 of the entry."""
    checksum = xxhash.xxh3_64_intdigest(data, seed=xxhash.xxh3_64_intdigest(key))
    body = struct.pack("<4sHQQ64s", b"KVOE", len(key), seq, checksum, key)
    return (body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body))).ljust(128, b"\0")


def v1_header(num_slots: int) -> bytes:
    return struct.pack("<8sIQQQ", b"KVODISK1", 1, BLOCK, BLOCK, num_slots).ljust(4096, b"\0")


def private_file(path: Path, data: bytes) -> None:
    """A file as the service itself would have left it (0600, its user's)."""
    path.write_bytes(data)
    path.chmod(0o600)


# --------------------------------------------------------------------------- planted links


@pytest.mark.parametrize("name", [*FILES, ".key"])
def test_a_planted_symbolic_link_is_refused_and_its_target_untouched(
    pool: HostPool, root: Path, victim: Path, name: str
) -> None:
    ns = own_dir(root / "ns")
    link = root / name if name == ".key" else ns / name
    link.symlink_to(victim)
    refused(ns, pool, f"{link} is a symbolic link", f"rm {link}")
    untouched(victim)
    assert link.is_symlink()  # refused, not "repaired" behind the operator's back


@pytest.mark.parametrize("name", [*FILES, ".key"])
def test_a_planted_hard_link_is_refused_and_its_target_untouched(
    pool: HostPool, root: Path, victim: Path, name: str
) -> None:
    ns = own_dir(root / "ns")
    link = root / name if name == ".key" else ns / name
    os.link(victim, link)
    refused(ns, pool, f"{link} has 2 links", f"rm {link}")
    untouched(victim)


def test_a_namespace_directory_that_is_a_symbolic_link_is_refused(
    pool: HostPool, root: Path, tmp_path: Path
) -> None:
    elsewhere = own_dir(tmp_path / "elsewhere")
    (root / "ns").symlink_to(elsewhere)
    refused(root / "ns", pool, f"{root / 'ns'} is a symbolic link")
    assert list(elsewhere.iterdir()) == []


def test_a_probe_after_opening_never_writes_through_a_link_planted_since(
    pool: HostPool, root: Path, victim: Path, stores: list[DiskStore]
) -> None:
    ns = own_dir(root / "ns")
    store = DiskStore(str(ns), pool, 4)
    stores.append(store)
    assert store.probe()
    (ns / "probe").unlink()
    (ns / "probe").symlink_to(victim)
    assert store.probe()  # the link is removed, a new file of the service's made
    untouched(victim)
    assert stat.S_ISREG((ns / "probe").lstat().st_mode)


# --------------------------------------------------------------------------- directories


@pytest.mark.parametrize("mode", [0o777, 0o1777, 0o770, 0o730])
def test_a_disk_dir_others_or_its_group_can_write_is_refused(
    pool: HostPool, root: Path, mode: int
) -> None:
    """Sticky or not: anyone who can write ``D`` can make ``D/<ns>`` before the service."""
    root.chmod(mode)
    refused(root / "ns", pool, f"{root} is writable by", f"mode {mode:04o}", f"chmod go-w {root}")
    assert list(root.iterdir()) == []  # no key, no namespace directory made in it


def test_a_disk_dir_of_mode_0750_or_0755_is_accepted(
    pool: HostPool, root: Path, stores: list[DiskStore]
) -> None:
    for mode in (0o750, 0o755):
        root.chmod(mode)
        stores.append(DiskStore(str(root / f"ns{mode:o}"), pool, 4))


@pytest.mark.parametrize("mode", [0o777, 0o755, 0o750])
def test_a_namespace_directory_not_0700_is_refused(pool: HostPool, root: Path, mode: int) -> None:
    ns = own_dir(root / "ns")
    ns.chmod(mode)
    refused(ns, pool, f"{ns} has mode {mode:04o}, not 0700", f"chmod 0700 {ns}", f"rm -r {ns}")


@needs_root
def test_a_disk_dir_of_another_user_is_refused(pool: HostPool, root: Path) -> None:
    os.chown(root, NOBODY, NOBODY)
    refused(root / "ns", pool, f"{root} belongs to uid {NOBODY}", f"chown 0 {root}")
    assert list(root.iterdir()) == []


@needs_root
def test_a_namespace_directory_another_user_made_is_refused(
    pool: HostPool, root: Path, victim: Path
) -> None:
    """Mallory made ``D/alice`` (when ``D`` was open to her) with blocks of her own in it."""
    ns = own_dir(root / "alice")
    private_file(ns / "index", v1_header(4) + v1_entry(b"alice", EVIL.ljust(BLOCK, b"!"), 1))
    private_file(ns / "blocks", EVIL.ljust(BLOCK, b"!"))
    for path in (ns, ns / "index", ns / "blocks"):
        os.chown(path, NOBODY, NOBODY)
    refused(ns, pool, f"{ns} belongs to uid {NOBODY}", f"rm -r {ns}")


@needs_root
def test_a_file_of_another_user_is_refused(pool: HostPool, root: Path) -> None:
    ns = own_dir(root / "ns")
    private_file(ns / "index", b"")
    os.chown(ns / "index", NOBODY, NOBODY)
    refused(ns, pool, f"{ns / 'index'} belongs to uid {NOBODY}")


@needs_root
def test_a_parent_of_the_disk_dir_of_another_user_is_refused(
    pool: HostPool, tmp_path: Path
) -> None:
    parent = tmp_path / "mallory"
    parent.mkdir()
    os.chown(parent, NOBODY, NOBODY)
    refused(parent / "disk" / "ns", pool, f"{parent} belongs to uid {NOBODY}")


def test_a_parent_others_can_write_without_the_sticky_bit_is_refused(
    pool: HostPool, tmp_path: Path, stores: list[DiskStore]
) -> None:
    parent = tmp_path / "shared"
    parent.mkdir()
    parent.chmod(0o777)
    refused(parent / "disk" / "ns", pool, f"{parent} is writable by others", f"chmod o-w {parent}")
    parent.chmod(0o1777)  # /tmp: others cannot rename or remove the service's directory
    stores.append(DiskStore(str(parent / "disk" / "ns"), pool, 4))


@needs_root
def test_a_symbolic_link_on_the_way_is_followed_only_when_root_or_the_service_made_it(
    pool: HostPool, root: Path, tmp_path: Path, stores: list[DiskStore]
) -> None:
    ours = tmp_path / "ours"
    ours.symlink_to(root)
    stores.append(DiskStore(str(ours / "ns"), pool, 4))
    theirs = tmp_path / "theirs"
    theirs.symlink_to(root)
    os.lchown(theirs, NOBODY, NOBODY)
    refused(theirs / "ns2", pool, f"{theirs} is a symbolic link made by uid {NOBODY}")


# --------------------------------------------------------------------------- modes


def test_files_are_0600_and_directories_0700_even_with_umask_0(
    pool: HostPool, tmp_path: Path
) -> None:
    old = os.umask(0)
    try:
        store = DiskStore(str(tmp_path / "a" / "b" / "ns"), pool, 4)
        try:
            write(store, pool, 0, b"k", os.urandom(BLOCK))
            assert store.probe()
        finally:
            store.close()
    finally:
        os.umask(old)
    a = tmp_path / "a"
    for path in (a, a / "b", a / "b" / "ns"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o700, path
    for path in [a / "b" / ".key", *(a / "b" / "ns" / name for name in FILES)]:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path


@pytest.mark.parametrize(("mode", "size"), [(0o644, 32), (0o600, 31), (0o600, 0)])
def test_a_key_file_of_the_wrong_mode_or_size_is_refused(
    pool: HostPool, root: Path, mode: int, size: int
) -> None:
    key = root / ".key"
    private_file(key, os.urandom(size))
    key.chmod(mode)
    refused(root / "ns", pool, str(key), "chmod 0600" if mode != 0o600 else f"{size} bytes")


# --------------------------------------------------------------------------- forged blocks


def test_a_directory_in_the_unkeyed_format_is_never_loaded(
    pool: HostPool, root: Path, stores: list[DiskStore]
) -> None:
    """Format 1 (xxh3, no key): whoever could write the files could make every entry. Its
    blocks are dropped and counted, the files start afresh."""
    ns = own_dir(root / "alice")
    evil = EVIL.ljust(BLOCK, b"!")
    entries = v1_entry(b"alice-0", evil, 1) + v1_entry(b"alice-1", evil, 2)
    private_file(ns / "index", v1_header(4) + entries)
    private_file(ns / "blocks", evil * 2)
    store = DiskStore(str(ns), pool, 4)
    stores.append(store)
    assert store.listed() == []
    assert store.format_dropped == 2
    # Emptied, then allocated afresh at its full size: none of the old bytes is left.
    assert (ns / "blocks").read_bytes() == bytes(4 * BLOCK)
    pool.tensor[5].numpy()[:] = 0
    assert store.read_many([(0, b"alice-0", 5)]) == [False]
    assert EVIL not in bytes(pool.tensor[5].numpy())


def test_a_block_forged_with_an_unkeyed_checksum_is_never_loaded(
    pool: HostPool, root: Path, stores: list[DiskStore]
) -> None:
    """Mallory overwrites alice's block on disk and recomputes its checksum in the index the
    way format 1 had it: the entry fails its MAC at the next start, is dropped and counted."""
    ns = root / "alice"
    store = DiskStore(str(ns), pool, 4)
    write(store, pool, 0, b"alice-prefix", os.urandom(BLOCK))
    write(store, pool, 1, b"alice-other", os.urandom(BLOCK))
    store.close()
    index = (ns / "index").read_bytes()
    slot = (index.index(b"alice-prefix") - 4096) // 128
    evil = EVIL.ljust(BLOCK, b"!")
    with open(ns / "index", "r+b") as f:
        f.seek(4096 + slot * 128)
        f.write(v1_entry(b"alice-prefix", evil, 1 << 40))
    with open(ns / "blocks", "r+b") as f:
        f.seek(slot * BLOCK)
        f.write(evil)
    again = DiskStore(str(ns), pool, 4)
    stores.append(again)
    assert [k for k, _ in again.listed()] == [b"alice-other"]
    assert again.health().counters["checksum_failures"] == 1
    assert again.unauthenticated_dropped == 1
    pool.tensor[6].numpy()[:] = 0
    assert again.read_many([(slot, b"alice-prefix", 6)]) == [False]
    assert EVIL not in bytes(pool.tensor[6].numpy())
    again.close()
    # Cleared from the index: the next start neither lists nor counts it again.
    third = DiskStore(str(ns), pool, 4)
    stores.append(third)
    assert [k for k, _ in third.listed()] == [b"alice-other"]
    assert third.health().counters["checksum_failures"] == 0


def test_blocks_moved_to_another_namespace_or_under_another_key_fail_their_mac(
    pool: HostPool, tmp_path: Path, stores: list[DiskStore]
) -> None:
    """The keys bind the namespace's directory name and the root's key file: alice's files
    copied into mallory's directory, or into another disk dir (another ``.key``), list
    nothing."""
    first = own_dir(tmp_path / "first")
    store = DiskStore(str(first / "alice"), pool, 4)
    data = os.urandom(BLOCK)
    write(store, pool, 0, b"alice-prefix", data)
    store.close()
    second = own_dir(tmp_path / "second")
    for copy in (first / "mallory", second / "alice"):
        shutil.copytree(first / "alice", copy)
        moved = DiskStore(str(copy), pool, 4)
        stores.append(moved)
        assert moved.listed() == [], copy
        assert moved.health().counters["checksum_failures"] == 1
        assert moved.read_many([(0, b"alice-prefix", 5)]) == [False]
    # Where it was written, under its own key: still served.
    home = DiskStore(str(first / "alice"), pool, 4)
    stores.append(home)
    assert home.listed() == [(b"alice-prefix", 0)]
    assert home.read_many([(0, b"alice-prefix", 7)]) == [True]
    assert bytes(pool.tensor[7].numpy()) == data
