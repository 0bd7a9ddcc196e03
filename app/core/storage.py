"""Whose blocks lie below the pool: a namespace's storage identity, and dropping its directory.

**Identity.** A namespace's *storage identity* names everything of it that outlives its
``Service``: its directory under ``--disk-dir`` (``<disk_dir>/<identity>``) and its key prefix in
the remote tier's shared store (``kvoffload/<identity>/<block_bytes>``,
``app.core.remote.remote_namespace``). With tenants it is the namespace and the tenant that owns
it, ``NAMESPACE@TENANT`` (``a2@alice``); without tenants it is the bare namespace (``default``),
the name such a directory had before identities existed, so a single-tenant disk tier keeps its
blocks across the upgrade. ``@`` is in no tenant or namespace name (``app.core.tenants.NAME``),
so ``parse_identity`` reads both parts back unambiguously, and each part is at most 63
characters: an identity (at most 127 bytes) is always a valid file name.

Why the owner is part of it: a namespace given to another tenant has another identity, so the new
owner finds nothing of the old owner's below the pool (no directory, no remote key), whatever was
or was not deleted. Deleting is the second line (the bytes are gone, not only unreachable):

**Dropping.** ``drop_disk_dir`` deletes one identity's directory with everything in it, once its
disk tier is closed, and ``leftover_dirs`` lists the identity directories under ``--disk-dir``:
they are the disk tier's ``TierBackend.drop`` and ``identities`` (``app.core.disk``), which the
tenancy calls for a namespace a reload removes or moves to another tenant, after stopping its
service, and at start for namespaces no longer served (``app.core.tenancy``). Only a directory
whose *name* parses as an identity is ever deleted (anything else under ``--disk-dir`` is not
the service's), and only a real directory (not a symbolic link) of this process's user whose
disk store is not open: its ``lock`` (``transfer.disk.DiskStore`` holds it ``flock``-ed while
open, in this process or another) is taken first and held while the directory is deleted. The
remote tier's objects are not deleted: the store is shared by nodes, which may still serve them
to the same owner, and they are out of every other identity's reach.

Everything here blocks on the filesystem: call it off the event loop.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import stat
from collections.abc import Iterator
from dataclasses import dataclass

from app.core.tenants import NAME

#: Between the namespace and its owning tenant in an identity; in no name (``NAME``).
OWNER_SEPARATOR = "@"
#: The file a ``DiskStore`` keeps ``flock``-ed while its directory is open.
DISK_LOCK_FILE = "lock"

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


def storage_identity(namespace: str, tenant: str | None) -> str:
    """The storage identity of ``namespace`` owned by ``tenant`` (None: a service without
    tenants); see the module docstring."""
    if tenant is None:
        return namespace
    return f"{namespace}{OWNER_SEPARATOR}{tenant}"


def parse_identity(name: str) -> tuple[str, str | None] | None:
    """``(namespace, tenant)`` of the identity ``name`` (tenant None for a bare namespace);
    None when ``name`` is no identity (then nothing by that name is the service's)."""
    namespace, sep, tenant = name.partition(OWNER_SEPARATOR)
    if not NAME.fullmatch(namespace):
        return None
    if not sep:
        return namespace, None
    if not NAME.fullmatch(tenant):
        return None
    return namespace, tenant


@dataclass(frozen=True, slots=True)
class Dropped:
    """What a tier deleted of one storage identity (``drop_disk_dir``: a directory): its name,
    and the files and bytes (allocated on disk, so a sparse file counts what it took) it held."""

    name: str
    files: int
    bytes: int


class NotDropped(Exception):
    """A tier refused to delete an identity's blocks (``drop_disk_dir``: its directory);
    ``str()`` says which and why."""


def leftover_dirs(disk_dir: str | os.PathLike[str]) -> list[str]:
    """The names under ``disk_dir`` that are directories (not symbolic links) named by a
    storage identity, sorted; none when ``disk_dir`` does not exist."""
    try:
        entries = list(os.scandir(disk_dir))
    except FileNotFoundError:
        return []
    return sorted(
        e.name
        for e in entries
        if parse_identity(e.name) is not None and e.is_dir(follow_symlinks=False)
    )


def drop_disk_dir(
    disk_dir: str | os.PathLike[str], name: str, *, only_store: bool = False
) -> Dropped | None:
    """Delete the directory ``name`` under ``disk_dir`` and everything in it; what it held, or
    None when there is no such entry (nothing was ever demoted, or it is gone already).

    Raises ``NotDropped`` (nothing deleted) when ``name`` is no storage identity, is not a
    directory (a symbolic link is not followed), belongs to another user, or its disk store is
    open (its lock is held), or, with ``only_store``, holds no disk store's lock file (for a
    name that is an identity by chance: a bare name could be anyone's directory);
    ``OSError`` when the filesystem refuses (some files may be gone then).
    """
    if parse_identity(name) is None:
        raise NotDropped(f"{name!r} is not a storage identity")
    try:
        parent = os.open(disk_dir, _DIR_FLAGS)
    except FileNotFoundError:
        return None
    try:
        # Everything below is relative to ``parent``: a path renamed meanwhile is not followed.
        try:
            st = os.stat(name, dir_fd=parent, follow_symlinks=False)
        except FileNotFoundError:
            return None
        if not stat.S_ISDIR(st.st_mode):
            raise NotDropped(f"{name!r} is not a directory")
        if st.st_uid != os.geteuid():
            raise NotDropped(f"{name!r} belongs to uid {st.st_uid}, not this process's")
        with _locked(parent, name, only_store):
            files, size = _usage(parent, name)
            # Deletes by descriptor, never following a link (``avoids_symlink_attacks``).
            shutil.rmtree(name, dir_fd=parent)
    finally:
        os.close(parent)
    return Dropped(name, files, size)


@contextlib.contextmanager
def _locked(parent: int, name: str, only_store: bool) -> Iterator[None]:
    """Hold the store lock of directory ``name``: ``NotDropped`` while a store has it open, or
    when it has none and ``only_store`` says it must. A directory without a lock file holds no
    open store (a store makes the file before it uses the directory)."""
    directory = os.open(name, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=parent)
    try:
        try:
            # O_NONBLOCK: a FIFO planted under the name must not hang the reload.
            flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
            lock = os.open(DISK_LOCK_FILE, flags, dir_fd=directory)
        except FileNotFoundError:
            if only_store:
                raise NotDropped(f"{name!r} holds no disk store") from None
            lock = -1
        try:
            if lock >= 0:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    raise NotDropped(f"{name!r} is in use (its disk store is open)") from None
            yield
        finally:
            if lock >= 0:
                os.close(lock)
    finally:
        os.close(directory)


def _usage(parent: int, name: str) -> tuple[int, int]:
    """Files under directory ``name`` and the bytes they take on disk (not following links)."""
    files = size = 0
    for _, _, names, fd in os.fwalk(name, dir_fd=parent):
        for file in names:
            with contextlib.suppress(FileNotFoundError):
                st = os.stat(file, dir_fd=fd, follow_symlinks=False)
                files += 1
                size += st.st_blocks * 512
    return files, size
