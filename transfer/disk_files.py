"""The disk tier's directories and files, opened safely: who may touch them, and how each is
opened and checked.

``root`` (``--disk-dir``) holds one file of its own besides the namespaces' directories:

- ``.key``: 32 random bytes made at the first start (``os.urandom``), the master key of every
  directory below (``transfer.disk_index.derive_keys`` derives a directory's keys from it).

and a namespace's directory (``<root>/<name>``, ``DiskFiles``) holds ``blocks``, ``index``,
``probe`` (one page, written afresh and freed again to tell whether writes work again after a
fault) and ``lock`` (``flock``-ed while open, so two processes never share a directory).

**Who may touch these files.** Only the service: nothing is read or written through a path
someone else could have changed. ``root`` is opened one level at a time from ``/``
(``openat``-style, ``O_NOFOLLOW``; a symbolic link on the way is followed only when it belongs
to root or the service's user), each level checked with ``fstat`` on the descriptor opened,
so the check and the use are the same object. Refused (``DiskError``, naming the path and the
fix): a level above ``root`` that belongs to someone but root and the service's user, or that
others may write without the sticky bit (``/tmp`` is fine); ``root`` itself if it belongs to
someone but root and the service's user, or if its group or others may write it (even with the
sticky bit: anyone could pre-create a namespace's directory in it); a namespace directory that
is not the service's user's or is not mode 0700; a file (``.key``, ``index``, ``blocks``,
``lock``, ``probe``) that is a symbolic link, not a regular file, not the service's user's,
not mode 0600, or has another name (a hard link count above 1: a planted link to
``/etc/shadow`` would make the service overwrite it). Files are opened relative to their
directory's descriptor with ``O_NOFOLLOW``, and created with ``O_CREAT | O_EXCL`` when absent;
a missing directory is made 0700 by the service. Both get ``fchmod`` after creation, so the
modes do not depend on the umask.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import fcntl
import os
import stat

from transfer.disk_index import PAGE
from transfer.errors import TransferError

__all__ = [
    "KEY_FILE",
    "DiskError",
    "DiskFiles",
    "DiskSpaceError",
    "open_checked_dir",
]

#: The master key's file in the root directory (a dotfile: no namespace name starts with a dot).
KEY_FILE = ".key"
_KEY_NEW = ".key.new"
_MASTER_KEY_BYTES = 32

_DIR_OPEN = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# Levels above the root: opened only to walk through (no read permission needed) and fstat.
_WALK_OPEN = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_MAX_SYMLINKS = 40  # as the kernel's own path walk
_FILE_MODE = 0o600
_DIR_MODE = 0o700


class DiskError(TransferError):
    """The disk tier cannot be opened: a directory that is not one, in use by another process,
    not writable, or that others could have planted files in (the message names the path and
    the fix)."""


class DiskSpaceError(DiskError):
    """The filesystem under the tier's directory has less free space than the store needs
    (``disk_bytes`` asks for more than there is). ``needed``: the bytes the store's files take
    at their full size; ``available``: the filesystem's free bytes plus what the store's files
    already hold (a restart keeps them). Raised at open, before the blocks file is allocated."""

    def __init__(self, message: str, *, needed: int, available: int) -> None:
        super().__init__(message)
        self.needed = needed
        self.available = available


def _human(n: int) -> str:
    """``n`` bytes in the largest binary unit that keeps it >= 1 (one decimal)."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.1f} {unit}" if unit != "B" else f"{n} B"
        size /= 1024
    raise AssertionError("unreachable")


# ---------------------------------------------------------------------------- safe opening
#
# Every check below is made with fstat on the descriptor the store then uses (or, for a
# symbolic link, lstat relative to a directory already checked), never by a path looked up
# twice: what was checked is what is used.


def _octal(mode: int) -> str:
    return f"{stat.S_IMODE(mode):04o}"


def _user() -> str:
    return f"this service's user (uid {os.geteuid()})"


_PLANT_HARM = "plant files the service would write through or KV blocks it would serve"


def open_checked_dir(path: str, *, make: bool = False, harm: str = _PLANT_HARM) -> int:
    """A read-only descriptor of directory ``path``, checked as ``--disk-dir`` is (module
    docstring): every level from ``/`` root's or the service's user's, none writable by others
    without the sticky bit, and ``path`` itself writable by nobody else, sticky or not. Also
    for other directories the service puts things in that others must not swap (the Unix
    sockets' directory). ``make``: missing levels are made 0700 (else ``FileNotFoundError``);
    ``harm``: what someone who could write ``path`` could do, for the refusal's message.
    ``DiskError`` naming the level and the fix when a level is refused."""
    return _open_root(path, make=make, harm=harm)


def _open_root(path: str, *, make: bool = True, harm: str = _PLANT_HARM) -> int:
    """A read-only descriptor of directory ``path`` (``--disk-dir``), walked to from ``/`` one
    level at a time (see the module docstring for the checks); missing levels are made 0700
    (``make``). ``DiskError`` naming the level and the fix when a level is refused."""
    todo = collections.deque(_parts(os.path.abspath(path)))
    fd, where, readable = os.open("/", _WALK_OPEN), "/", False
    links = 0
    try:
        _check_level(fd, where, last=not todo, harm=harm)
        while todo:
            name = todo.popleft()
            last = not todo
            child_path = os.path.normpath(os.path.join(where, name))
            try:
                child, made = _open_dir(fd, name, _DIR_OPEN if last else _WALK_OPEN, make=make)
            except _SymbolicLink:
                target = _trusted_link(fd, name, child_path)
                links += 1
                if links > _MAX_SYMLINKS:
                    raise DiskError(f"{path}: too many symbolic links on the way") from None
                if target.startswith("/"):
                    os.close(fd)
                    fd = -1
                    fd, where, readable = os.open("/", _WALK_OPEN), "/", False
                todo.extendleft(reversed(_parts(target)))
                if not todo:  # the link led to a level already walked: the root is that one
                    _check_level(fd, where, last=True, harm=harm)
                continue
            try:
                if made:
                    os.fchmod(child, _DIR_MODE)  # whatever the umask took away
                _check_level(child, child_path, last=last, harm=harm)
            except BaseException:
                os.close(child)
                raise
            os.close(fd)
            fd, where, readable = child, child_path, last or made
        if not readable:  # walked to with O_PATH: the root needs a descriptor that flock takes
            reopened = os.open(".", _DIR_OPEN, dir_fd=fd)
            os.close(fd)
            fd = reopened
    except BaseException:
        if fd >= 0:
            os.close(fd)
        raise
    return fd


def _parts(path: str) -> list[str]:
    return [p for p in path.split("/") if p not in ("", ".")]


class _SymbolicLink(Exception):
    """The name opened with ``O_NOFOLLOW`` is a symbolic link (or not a directory)."""


def _open_dir(parent: int, name: str, flags: int, *, make: bool = True) -> tuple[int, bool]:
    """Open directory ``name`` under ``parent`` (``flags``: O_NOFOLLOW), making it 0700 when
    missing (``make``; else ``FileNotFoundError``); (descriptor, whether this call made it).
    ``_SymbolicLink`` when the name is not a directory (a link, most likely: the caller
    looks)."""
    made = False
    for _ in range(3):
        try:
            # A directory this call made is opened readable (fchmod needs a real descriptor).
            return os.open(name, _DIR_OPEN if made else flags, dir_fd=parent), made
        except FileNotFoundError:
            if not make:
                raise
            try:
                os.mkdir(name, _DIR_MODE, dir_fd=parent)
                made = True
            except FileExistsError:  # made meanwhile by someone else: checked as found
                made = False
        except OSError as exc:
            if exc.errno in (errno.ENOTDIR, errno.ELOOP):
                raise _SymbolicLink from None
            raise
    raise OSError(errno.ENOENT, f"{name} vanished while opened")


def _trusted_link(parent: int, name: str, path: str) -> str:
    """The target of symbolic link ``name`` under ``parent`` (a level already checked), when
    root or the service's user made it; ``DiskError`` when it is someone else's, or no link."""
    st = os.stat(name, dir_fd=parent, follow_symlinks=False)
    if not stat.S_ISLNK(st.st_mode):
        raise DiskError(f"{path} is not a directory")
    if st.st_uid not in (0, os.geteuid()):
        raise DiskError(
            f"{path} is a symbolic link made by uid {st.st_uid}, not root or {_user()}: it "
            "could lead the service anywhere; fix: remove it, or name the directory it should "
            "lead to instead"
        )
    return os.readlink(name, dir_fd=parent)


def _check_level(fd: int, path: str, *, last: bool, harm: str = _PLANT_HARM) -> None:
    """Refuse a directory on the way to the root (``last``: the root itself) that someone but
    root and the service's user could change (module docstring); ``harm``: what they could do
    to the root."""
    st = os.fstat(fd)
    if st.st_uid not in (0, os.geteuid()):
        raise DiskError(
            f"{path} belongs to uid {st.st_uid}, not root or {_user()}: its owner could "
            f"{harm if last else 'swap the directories below it'}; fix: chown "
            f"{os.geteuid()} {path}"
            + ("" if last else ", or a directory whose every parent is root's or the service's")
        )
    mode = st.st_mode
    if last and mode & (stat.S_IWGRP | stat.S_IWOTH):
        # Even with the sticky bit: anyone could make a namespace's directory before the
        # service does, with their blocks in it.
        who = (
            "its group and others"
            if mode & stat.S_IWGRP and mode & stat.S_IWOTH
            else ("its group" if mode & stat.S_IWGRP else "others")
        )
        raise DiskError(
            f"{path} is writable by {who} (mode {_octal(mode)}): anyone who can write it could "
            f"{harm}; fix: chmod go-w {path}"
        )
    if not last and mode & stat.S_IWOTH and not mode & stat.S_ISVTX:
        raise DiskError(
            f"{path} is writable by others without the sticky bit (mode {_octal(mode)}): "
            f"anyone could swap the directories below it; fix: chmod o-w {path} (or chmod +t "
            f"{path}), or a directory elsewhere"
        )


def _open_own_dir(root: int, root_path: str, name: str) -> int:
    """A read-only descriptor of the service's directory ``name`` under ``root``, made 0700 if
    missing; ``DiskError`` when it is someone else's or not 0700 (module docstring)."""
    path = os.path.join(root_path, name)
    try:
        fd, made = _open_dir(root, name, _DIR_OPEN)
    except _SymbolicLink:
        raise _not_regular(root, name, path, "directory") from None
    try:
        if made:
            os.fchmod(fd, _DIR_MODE)
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            raise DiskError(
                f"{path} belongs to uid {st.st_uid}, not {_user()}: someone else made it and "
                f"could have put blocks in it; fix: remove it (rm -r {path}: the service makes "
                "it afresh)"
            )
        if stat.S_IMODE(st.st_mode) & 0o777 != _DIR_MODE:
            raise DiskError(
                f"{path} has mode {_octal(st.st_mode)}, not 0700: the tier's directories are "
                f"the service's alone; fix: chmod 0700 {path} if you trust what is in it, "
                f"else remove it (rm -r {path})"
            )
    except BaseException:
        os.close(fd)
        raise
    return fd


def _not_regular(parent: int, name: str, path: str, what: str) -> DiskError:
    """The refusal of ``name`` under ``parent`` that ``O_NOFOLLOW`` (or ``O_DIRECTORY``)
    would not open: a symbolic link, most likely."""
    try:
        st = os.stat(name, dir_fd=parent, follow_symlinks=False)
    except OSError:
        return DiskError(f"{path} cannot be opened as a {what}; fix: remove it")
    kind = "a symbolic link" if stat.S_ISLNK(st.st_mode) else f"not a {what}"
    return DiskError(
        f"{path} is {kind}: the service follows no link in its disk tier (one planted there "
        f"would make it write elsewhere); fix: remove it (rm {path}: the service makes a "
        f"{what} afresh)"
    )


def _open_file(parent: int, dir_path: str, name: str, flags: int) -> int:
    """A descriptor of the service's file ``name`` under directory ``parent`` (``flags``:
    the access mode), made 0600 with ``O_EXCL`` when absent, opened with ``O_NOFOLLOW`` when
    present, then checked (``_check_file``)."""
    path = os.path.join(dir_path, name)
    flags |= os.O_NOFOLLOW | os.O_CLOEXEC
    for _ in range(3):
        try:
            fd = os.open(name, flags, dir_fd=parent)
        except FileNotFoundError:
            try:
                fd = os.open(name, flags | os.O_CREAT | os.O_EXCL, _FILE_MODE, dir_fd=parent)
            except FileExistsError:  # made meanwhile: opened as found, next round
                continue
            try:
                os.fchmod(fd, _FILE_MODE)  # whatever the umask took away
            except BaseException:
                os.close(fd)
                raise
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise _not_regular(parent, name, path, "file") from None
            raise
        try:
            _check_file(fd, path)
        except BaseException:
            os.close(fd)
            raise
        return fd
    raise OSError(errno.ENOENT, f"{name} vanished while opened")


def _check_file(fd: int, path: str) -> None:
    """Refuse an opened file that is not a regular file of the service's user, mode 0600, with
    one name."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise DiskError(f"{path} is not a regular file; fix: remove it")
    if st.st_uid != os.geteuid():
        raise DiskError(
            f"{path} belongs to uid {st.st_uid}, not {_user()}; fix: remove it (rm {path})"
        )
    if st.st_nlink != 1:
        raise DiskError(
            f"{path} has {st.st_nlink} links: it is another file under a second name too (a "
            "hard link planted there would make the service overwrite that file); fix: "
            f"remove this name (rm {path}: the other stays)"
        )
    if stat.S_IMODE(st.st_mode) != _FILE_MODE:
        raise DiskError(f"{path} has mode {_octal(st.st_mode)}, not 0600; fix: chmod 0600 {path}")


def _master_key(root: int, root_path: str) -> bytes:
    """The master key in ``root/.key``, made (32 random bytes, 0600) when absent. Made under
    a ``flock`` of the root directory, so two services starting on it at once share one key;
    written under another name and renamed, so a crash leaves no partial key file."""
    fcntl.flock(root, fcntl.LOCK_EX)
    try:
        try:
            return _read_key(root, root_path)
        except FileNotFoundError:
            pass
        with contextlib.suppress(FileNotFoundError):
            os.unlink(_KEY_NEW, dir_fd=root)  # a crash's leftover (unlink follows no link)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(_KEY_NEW, flags, _FILE_MODE, dir_fd=root)
        try:
            os.fchmod(fd, _FILE_MODE)
            key = os.urandom(_MASTER_KEY_BYTES)
            if os.write(fd, key) != len(key):
                raise OSError(errno.EIO, "short write of the key")
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(_KEY_NEW, KEY_FILE, src_dir_fd=root, dst_dir_fd=root)
        os.fsync(root)  # the name durable before any block depends on the key
        return _read_key(root, root_path)
    finally:
        fcntl.flock(root, fcntl.LOCK_UN)


def _read_key(root: int, root_path: str) -> bytes:
    """The master key (``FileNotFoundError`` when there is none yet); ``DiskError`` when the
    file is not one the service made."""
    path = os.path.join(root_path, KEY_FILE)
    try:
        # O_NONBLOCK: a FIFO in its place must not hang the start (it fails the check).
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        fd = os.open(KEY_FILE, flags, dir_fd=root)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _not_regular(root, KEY_FILE, path, "file") from None
        raise
    try:
        _check_file(fd, path)
        key = os.pread(fd, _MASTER_KEY_BYTES + 1, 0)
    finally:
        os.close(fd)
    if len(key) != _MASTER_KEY_BYTES:
        raise DiskError(
            f"{path} holds {len(key)} bytes, not a key of {_MASTER_KEY_BYTES}; fix: restore "
            f"it, or remove it (rm {path}: every block on the disk tier is then dropped)"
        )
    return key


class DiskFiles:
    """A namespace directory's files, opened and checked (module docstring): the directory
    itself, ``lock`` (held ``flock``-ed while open), ``blocks`` and ``index``; ``probe`` is made
    afresh by each ``write_probe``. ``name``: the directory's own name, and ``master_key``: the
    root's key, both of which the store binds into its MAC keys."""

    def __init__(self, directory: str) -> None:
        """Open ``directory`` (``<root>/<name>``): ``root`` opened and checked level by level
        (made 0700 where missing), its master key read (made at the first start), then the
        directory and its files, a ``probe`` left by a previous run checked. ``DiskError`` when
        refused or in use by another process, ``OSError`` when a call fails; nothing is left
        open when it raises."""
        self.directory = directory
        self.dir_fd = -1
        self.lock_fd = -1
        self.data_fd = -1
        self.index_fd = -1
        root_path, self.name = os.path.split(os.path.abspath(directory))
        try:
            if not self.name:
                raise DiskError(f"{directory}: the store needs a directory below a root")
            root = _open_root(root_path)
            try:
                self.master_key = _master_key(root, root_path)
                self.dir_fd = _open_own_dir(root, root_path, self.name)
            finally:
                os.close(root)
            self.lock_fd = _open_file(self.dir_fd, directory, "lock", os.O_RDWR)
            try:
                fcntl.flock(self.lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise DiskError(f"{directory} is in use by another process") from None
            self.data_fd = _open_file(self.dir_fd, directory, "blocks", os.O_RDWR)
            self.index_fd = _open_file(self.dir_fd, directory, "index", os.O_RDWR)
            self._check_probe()
        except BaseException:
            self.close()
            raise

    def check_space(self, needed: int, num_slots: int, slot_bytes: int) -> None:
        """``DiskSpaceError`` when ``needed`` (the files at their full size: ``num_slots``
        slots of ``slot_bytes`` and their index) exceeds the filesystem's free space plus what
        the store's files already hold (a restart reuses them; a fresh start frees them).
        ``f_bavail``: the space an unprivileged user may take, so root's reserve is never
        counted on."""
        vfs = os.fstatvfs(self.dir_fd)
        free = vfs.f_bavail * vfs.f_frsize
        held = sum(os.fstat(fd).st_blocks * 512 for fd in (self.data_fd, self.index_fd))
        available = free + held
        if needed > available:
            raise DiskSpaceError(
                f"{self.directory}: the disk tier needs {needed} bytes ({_human(needed)}: "
                f"{num_slots} slots of {slot_bytes} bytes and their index) but its "
                f"filesystem has {available} bytes ({_human(available)}) free, this tier's "
                f"files included; fix: set disk_bytes to at most {available}, or free space "
                "on that filesystem",
                needed=needed,
                available=available,
            )

    def preallocate(self, nbytes: int, needed: int) -> bool:
        """Allocate the blocks file to its full size (``nbytes``) now (``posix_fallocate``):
        its space is taken at start, and its extents are laid out at once rather than slot by
        slot as writes come (concurrent O_DIRECT writes into holes scatter them; ext4 also
        journals each such allocation). Whether it was done (False: the filesystem cannot; the
        space was still checked). ``DiskSpaceError`` (of ``needed`` bytes, the files' full
        size) when the filesystem filled up meanwhile.

        The index is not preallocated: 128 B per slot, it grows page by page as written, so
        a filesystem that fills up later still shows as a failed demotion and a degraded tier
        (``health``) rather than going unnoticed until the next start."""
        try:
            os.posix_fallocate(self.data_fd, 0, nbytes)
        except OSError as exc:
            if exc.errno in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                return False
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise DiskSpaceError(
                    f"{self.directory}: the disk tier needs {needed} bytes "
                    f"({_human(needed)}) but its filesystem filled up while they were "
                    "allocated; fix: lower disk_bytes, or free space on that filesystem",
                    needed=needed,
                    available=0,
                ) from None
            raise
        return True

    def set_direct(self, direct: bool | None, block_bytes: int) -> bool:
        """Turn ``O_DIRECT`` on for the blocks file where asked and allowed (``block_bytes``
        whole pages); whether it is on. Set on the descriptor already checked (``F_SETFL``)
        rather than by opening the path again, which could be another file by then."""
        if direct is False or block_bytes % PAGE or not hasattr(os, "O_DIRECT"):
            return False
        flags = fcntl.fcntl(self.data_fd, fcntl.F_GETFL)
        try:
            fcntl.fcntl(self.data_fd, fcntl.F_SETFL, flags | os.O_DIRECT)
        except OSError as exc:  # a filesystem without O_DIRECT refuses it
            if exc.errno != errno.EINVAL:
                raise
            return False
        return True

    def _check_probe(self) -> None:
        """Refuse a ``probe`` that is not the service's file (a link planted there) now, at
        open, rather than at the first probe (which would remove it: unlink follows no link).
        O_NONBLOCK: a FIFO under the name must not hang the start (it fails the check)."""
        path = os.path.join(self.directory, "probe")
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:
            fd = os.open("probe", flags, dir_fd=self.dir_fd)
        except FileNotFoundError:
            return
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise _not_regular(self.dir_fd, "probe", path, "file") from None
            raise
        try:
            _check_file(fd, path)
        finally:
            os.close(fd)

    def write_probe(self) -> None:
        """Write a new page to ``probe``, synced, and free it again; ``OSError`` when that fails.

        The page is a new one each time (the file is emptied after each probe): rewriting a
        page already allocated works on a full disk, so it would call a full disk writable.
        The file is removed and made again with ``O_EXCL``: whatever is found under its name
        (a link planted there) is never written through."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink("probe", dir_fd=self.dir_fd)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open("probe", flags, _FILE_MODE, dir_fd=self.dir_fd)
        try:
            os.fchmod(fd, _FILE_MODE)
            os.pwrite(fd, os.urandom(64).ljust(PAGE, b"\0"), 0)
            os.fsync(fd)
            os.ftruncate(fd, 0)
        finally:
            os.close(fd)

    def usage(self) -> int:
        """Bytes the files and the directory take on disk now (allocated blocks, not apparent
        size)."""
        total = 0
        for fd in (self.dir_fd, self.data_fd, self.index_fd, self.lock_fd):
            with contextlib.suppress(OSError):
                total += os.fstat(fd).st_blocks * 512
        with contextlib.suppress(OSError):
            st = os.stat("probe", dir_fd=self.dir_fd, follow_symlinks=False)
            total += st.st_blocks * 512
        return total

    def close(self) -> None:
        """Close every file still open (idempotent); the ``lock`` goes with its descriptor."""
        for name in ("data_fd", "index_fd", "lock_fd", "dir_fd"):
            fd = getattr(self, name, -1)
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
                setattr(self, name, -1)
