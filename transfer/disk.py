"""The disk tier's bytes: block slots in one file, an index of what each holds, keyed MACs.

``DiskStore`` keeps blocks of the host pool's ``block_bytes`` in a directory of its own,
``<root>/<name>`` (the service: ``<--disk-dir>/<namespace>``, so keys of two namespaces never
meet). ``root`` holds one file of its own besides the namespaces' directories:

- ``.key``: 32 random bytes made at the first start (``os.urandom``), the master key of every
  directory below. A directory's keys are derived from it with BLAKE3's ``derive_key`` mode
  over (master key, block size, directory name): a block copied into another namespace's
  directory, or read back at another block size, fails its MAC like a forged one.

and the namespace's directory holds:

- ``blocks``: slot ``i`` at offset ``i x slot_bytes`` (``block_bytes`` rounded up to 4 KiB).
  Allocated to its full size when the store opens (``posix_fallocate``; ``preallocated``), after
  checking that the filesystem has room for both files (``DiskSpaceError`` otherwise, before
  anything is read or allocated). Written and read with ``O_DIRECT`` when the filesystem and
  the block size allow it (``direct``), buffered otherwise; runs of adjacent slots go in one
  ``preadv`` / ``pwritev`` (``RUN_BYTES`` at most).
- ``index``: a 4 KiB header (magic ``KVODISK1``, format version ``FORMAT_VERSION``, block and
  slot size, slot count), then one 128-byte entry per slot: magic ``KVO2``, key length, write
  sequence number, key (64 bytes, zero padded), the block's MAC (keyed BLAKE3, 32 bytes, over
  the key's length and bytes, then the block's bytes) and the entry's own MAC (keyed BLAKE3 of
  the 110 bytes before it, 16 bytes, under a second derived key). Written buffered, never read
  on the data path: the entries live in memory.
- ``probe``: one page, written afresh (and freed again) to tell whether writes work again
  after a fault.
- ``lock``: ``flock``-ed while open, so two processes never share a directory.

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

**A block is served only when its MACs hold.** Writing a block: its entry is cleared, the bytes
are written, then the entry is written. A block torn by a crash (SIGKILL, power loss) is
therefore either unlisted or listed with a MAC its bytes do not match; reads check every block
against its entry, so a torn, corrupt or forged block is reported as failed (the caller drops
it), never returned as good. The keys are readable by the service alone: someone who could
write the files but not read ``.key`` can still not make a block or an entry that passes (an
unkeyed checksum, as format 1's xxh3, anyone can recompute).

Restart: ``open`` reads the index file in one sequential pass, ``_INDEX_CHUNK`` bytes at a
time (128 bytes per slot: 512 MiB for 1 TB of 256 KiB blocks; empty entries skipped in C), and
keeps the entries whose own MAC holds; ``listed()``
returns them oldest write first. An entry that is not empty and fails its MAC (forged, torn,
written under another key or into another directory) is cleared and counted in
``checksum_failures`` and ``unauthenticated_dropped``. An index of another format version (format
1 had unkeyed checksums) is never loaded: its blocks are counted in ``format_dropped`` and both
files start afresh. A header of another block size starts the directory empty too.

Bytes under the directory never exceed ``disk_bytes``: ``slots_for(disk_bytes, block_bytes)``
sizes the slot count so that ``blocks`` (at most ``slots x slot_bytes``), ``index``
(4 KiB + 128 B per slot, rounded up to whole pages as the filesystem allocates it) and
``probe`` (4 KiB) fit. ``root/.key`` (one page) is shared by every namespace, outside their
budgets.

Faults: an ``OSError`` on a write (disk full, read-only, I/O error) or a read marks the store
``degraded`` (``health()``); the failed blocks are reported failed, nothing raises out of the
data calls. ``probe()`` tries a real write and returns the store to ``ok`` when it works.

Data calls run their blocks on a small pool of I/O threads (``io_threads``: the requests in
flight); they block the caller, so the service calls them off its event loop. The disk's side
of every request is the store's own private memory, on huge pages where the kernel gives them
(``_buffer``): blocks are copied out of the pool into staging buffers before they are written,
and read into read buffers (two per I/O thread, a run of ``READ_RUN_BYTES`` each) before they
are copied into the pool. The MACs (BLAKE3, about 4-5.5 GiB/s a core at 1 MiB blocks; it
releases the GIL) run on MAC threads (one per core, ``io_threads`` at most): a read's I/O
thread hands its buffer over, the MAC thread checks each block there and copies only the good
ones into their pool slots, and the I/O thread reads its next run into its other buffer at
once; a write's MACs are computed while its bytes are written. So no I/O thread waits on a hash
and the disk keeps ``io_threads`` requests in flight.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import fcntl
import functools
import hmac
import mmap
import os
import stat
import struct
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass
from typing import Any

import numpy as np
from blake3 import blake3

from transfer.errors import TransferError
from transfer.health import TierHealth, TierState
from transfer.host_pool import HostPool

__all__ = [
    "DISK_COUNTERS",
    "FORMAT_VERSION",
    "KEY_FILE",
    "DiskError",
    "DiskHealth",
    "DiskSpaceError",
    "DiskStore",
    "block_mac",
    "disk_bytes_for",
    "open_checked_dir",
    "slots_for",
]

PAGE = 4096
#: Bytes of contiguous slots read or written in one system call: large enough to amortize the
#: call and let the device stream, small enough to spread a batch over the I/O threads.
RUN_BYTES = 4 << 20
#: Bytes of contiguous slots a read takes in one system call. Smaller than a write's run: an
#: onload waits for its last block, and with 1 MiB reads four in flight stream as well as
#: 4 MiB ones here (2.8 GB/s) while each block's MAC check and copy overlap the reads still in
#: flight instead of all coming after them (with 4 MiB runs, a 16-block onload's four reads
#: landed together and their checks added 3-4 ms after the last one).
READ_RUN_BYTES = 1 << 20
#: Read buffers per I/O thread: one being read into while the MAC threads check the other.
READ_BUFFERS_PER_THREAD = 2
_IOV_MAX = 1024  # Linux's limit of buffers per readv/writev
ENTRY_BYTES = 128
HEADER_BYTES = PAGE
_MAGIC = b"KVODISK1"
_HEADER = struct.Struct("<8sIQQQ")  # magic, version, block_bytes, slot_bytes, num_slots
#: The on-disk format: 2 has keyed MACs (format 1's unkeyed xxh3 checksums are never loaded).
FORMAT_VERSION = 2
_ENTRY_MAGIC = b"KVO2"
_V1_ENTRY_MAGIC = b"KVOE"
# magic, key length, write sequence, key (padded), block MAC: then the entry's own MAC.
_ENTRY = struct.Struct("<4sHQ64s32s")
_ENTRY_MAC_BYTES = 16
_EMPTY = bytes(ENTRY_BYTES)
_MAX_KEY = 64
_KEY_LEN = struct.Struct("<H")
_BLOCK_BYTES = struct.Struct("<Q")

#: The master key's file in the root directory (a dotfile: no namespace name starts with a dot).
KEY_FILE = ".key"
_KEY_NEW = ".key.new"
_MASTER_KEY_BYTES = 32
# BLAKE3 derive_key contexts: fixed, application-specific, one per purpose.
_BLOCK_CONTEXT = "kvoffload disk tier format 2: block MAC key"
_ENTRY_CONTEXT = "kvoffload disk tier format 2: index entry MAC key"

_DIR_OPEN = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# Levels above the root: opened only to walk through (no read permission needed) and fstat.
_WALK_OPEN = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_MAX_SYMLINKS = 40  # as the kernel's own path walk
_FILE_MODE = 0o600
_DIR_MODE = 0o700

DiskState = TierState

DISK_COUNTERS = (
    "writes",  # blocks written whole
    "write_failures",  # blocks a write did not store (I/O error, disk full, read-only)
    "reads",  # blocks read back whole with a matching MAC
    "read_failures",  # blocks a read could not read (I/O error, short read)
    # blocks read back whose bytes did not match their MAC, and index entries that failed their
    # own MAC at open (forged, torn, another key's): dropped, never loaded
    "checksum_failures",
    "bytes_written",
    "bytes_read",
    "incidents",  # times the store went from ok to degraded
)


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


def slots_for(disk_bytes: int, block_bytes: int) -> int:
    """How many block slots fit in ``disk_bytes`` with the index, the probe page and the
    directory's own page."""
    slot = _slot_bytes(block_bytes)
    n = max(0, (disk_bytes - HEADER_BYTES - _FIXED) // (slot + ENTRY_BYTES))
    # The index takes whole pages on disk (``du``), not its 128 B per slot: at most one page
    # more than the estimate, so at most a slot or two less.
    while n > 0 and n * slot + _index_pages(n) + _FIXED > disk_bytes:
        n -= 1
    return n


#: Pages besides the blocks and the index: the probe's and the namespace directory's own.
_FIXED = 2 * PAGE


def disk_bytes_for(slots: int, block_bytes: int) -> int:
    """The smallest ``disk_bytes`` that holds ``slots`` blocks of ``block_bytes`` (the
    inverse of ``slots_for``)."""
    return slots * _slot_bytes(block_bytes) + _index_pages(slots) + _FIXED


def min_disk_bytes(block_bytes: int) -> int:
    """The smallest ``disk_bytes`` that holds one block of ``block_bytes``."""
    return disk_bytes_for(1, block_bytes)


def _human(n: int) -> str:
    """``n`` bytes in the largest binary unit that keeps it >= 1 (one decimal)."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.1f} {unit}" if unit != "B" else f"{n} B"
        size /= 1024
    raise AssertionError("unreachable")


def _index_pages(num_slots: int) -> int:
    return -(-(HEADER_BYTES + num_slots * ENTRY_BYTES) // PAGE) * PAGE


def _slot_bytes(block_bytes: int) -> int:
    return -(-block_bytes // PAGE) * PAGE


def block_mac(mac_key: bytes, key: bytes, data: bytes | bytearray | memoryview) -> bytes:
    """The MAC a block is stored with (32 bytes): keyed BLAKE3 under ``mac_key`` (a
    directory's block key, ``_Keys.block``) of the key's length (2 bytes, little endian), the
    key, then the block's bytes. Releases the GIL while it hashes ``data``."""
    h = blake3(_KEY_LEN.pack(len(key)), key=mac_key)
    h.update(key)
    h.update(data)
    return h.digest()


@dataclass(frozen=True, slots=True)
class _Keys:
    """A directory's MAC keys: blocks', and index entries' (two keys, so that an entry's MAC
    can never pass for a block's or the other way round)."""

    block: bytes
    entry: bytes


def _derive_keys(master: bytes, name: str, block_bytes: int) -> _Keys:
    """The keys of directory ``name`` for blocks of ``block_bytes`` (BLAKE3 ``derive_key``; the
    master key is 32 bytes and the block size 8, so the name after them is unambiguous)."""
    material = master + _BLOCK_BYTES.pack(block_bytes) + os.fsencode(name)
    return _Keys(
        blake3(material, derive_key_context=_BLOCK_CONTEXT).digest(),
        blake3(material, derive_key_context=_ENTRY_CONTEXT).digest(),
    )


#: The store's state and counters (at least ``DISK_COUNTERS``): ``transfer.health.TierHealth``.
DiskHealth = TierHealth


@dataclass(frozen=True, slots=True)
class _Entry:
    key: bytes
    mac: bytes
    seq: int


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


class DiskStore:
    """Block slots on disk for one namespace; see the module docstring."""

    def __init__(
        self,
        directory: str,
        pool: HostPool,
        num_slots: int,
        *,
        staging_blocks: int = 64,
        io_threads: int = 4,
        direct: bool | None = None,
    ) -> None:
        """Open (or create) the store in ``directory`` for blocks of ``pool.block_bytes``.

        ``directory`` is ``<root>/<name>``: ``root`` is opened and checked level by level (made
        0700 where missing) and holds the master key (``root/.key``, made at the first start);
        ``name``, the store's own directory, is bound into its keys. ``direct``: None tries
        ``O_DIRECT`` and falls back to buffered I/O where the filesystem or the block size does
        not allow it; False forces buffered I/O. ``staging_blocks``: aligned buffers that hold
        blocks copied out of the pool until they are written. Raises ``DiskError`` (nothing
        left open) when the directory cannot be used or is refused (module docstring).

        After opening, ``format_dropped`` counts the blocks of an index of another format
        version that were dropped, and ``unauthenticated_dropped`` the index entries that
        failed their MAC (both 0 mostly; the caller logs them).
        """
        if num_slots <= 0:
            raise DiskError(f"the disk holds no block of {pool.block_bytes} bytes")
        self.directory = directory
        self.pool = pool
        self.block_bytes = pool.block_bytes
        self.slot_bytes = _slot_bytes(self.block_bytes)
        self.num_slots = num_slots
        self._dir_fd = -1
        self._lock_fd = -1
        self._data_fd = -1
        self._index_fd = -1
        root_path, name = os.path.split(os.path.abspath(directory))
        try:
            if not name:
                raise DiskError(f"{directory}: the store needs a directory below a root")
            root = _open_root(root_path)
            try:
                master = _master_key(root, root_path)
                self._dir_fd = _open_own_dir(root, root_path, name)
            finally:
                os.close(root)
            self._keys = _derive_keys(master, name, self.block_bytes)
            self._lock_fd = _open_file(self._dir_fd, directory, "lock", os.O_RDWR)
            try:
                fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise DiskError(f"{directory} is in use by another process") from None
            self._data_fd = _open_file(self._dir_fd, directory, "blocks", os.O_RDWR)
            self._index_fd = _open_file(self._dir_fd, directory, "index", os.O_RDWR)
            self._check_probe()
            # Before anything costs time or memory per slot (the index read, the allocation):
            # a tier larger than its filesystem is refused at once.
            self._check_space()
            self.index = _IndexFile(
                self._index_fd,
                self._data_fd,
                self._keys.entry,
                self.block_bytes,
                self.slot_bytes,
                num_slots,
            )
            self.preallocated = self._preallocate()
            self.direct = self._set_direct(direct)
        except OSError as exc:
            self._close_fds()
            raise DiskError(f"cannot use {directory}: {exc.strerror or exc}") from None
        except BaseException:
            self._close_fds()
            raise
        self.format_dropped = self.index.format_dropped
        self.unauthenticated_dropped = self.index.unauthenticated
        # The disk's side of every transfer is the store's own memory, on huge pages where the
        # kernel gives them (``_buffer``): page-aligned buffers for blocks on their way from
        # the pool to the disk, and two read buffers per I/O thread (a run is read into one,
        # checked there and copied into its pool slots by a MAC thread while the I/O thread
        # reads the next run into the other: the pool is shared memory, on 4 KiB pages
        # unless its tmpfs was mounted for huge ones, and reads straight into it ran at
        # 0.6-0.7x).
        self.staging_blocks = staging_blocks
        self._staging, staging_huge = _buffer(max(1, staging_blocks) * self.slot_bytes)
        self._read_bytes = self._read_run_blocks() * self.slot_bytes
        buffers = READ_BUFFERS_PER_THREAD * io_threads
        self._reads, reads_huge = _buffer(buffers * self._read_bytes)
        self._read_rows: np.ndarray[Any, np.dtype[np.uint8]] | None = np.frombuffer(
            self._reads, dtype=np.uint8
        ).reshape(buffers, self._read_bytes)
        self._reads_free = list(range(buffers))
        # Each buffer's block views, made once: an I/O thread runs no Python it can spare
        # between two reads (it needs the GIL for it, and the disk idles meanwhile).
        bb = self.block_bytes
        self._read_views: list[list[memoryview]] = [
            [row[i * bb : (i + 1) * bb].data for i in range(self._read_bytes // self.slot_bytes)]
            for row in self._read_rows
        ]
        self._read_buffer_freed = threading.Condition(threading.Lock())
        #: Whether those buffers are on huge pages (False: each block read or written is
        #: split into more device requests; see ``_buffer``). None: unknown (no smaps), or
        #: both too small to hold one.
        said = [h for h in (staging_huge, reads_huge) if h is not None]
        self.huge_pages = all(said) if said else None
        # numpy's copy into it releases the GIL (a slice assignment into the mmap holds it
        # through each block: the I/O threads, back from their writes, waited up to the
        # interpreter's 5 ms switch interval for it, and the disk idled meanwhile).
        self._staging_rows: np.ndarray[Any, np.dtype[np.uint8]] | None = np.frombuffer(
            self._staging, dtype=np.uint8
        ).reshape(-1, self.slot_bytes)
        self._staging_free = list(range(staging_blocks - 1, -1, -1))
        self._pool = ThreadPoolExecutor(io_threads, thread_name_prefix="kvoffload-disk")
        # MAC threads: the I/O threads hand them the hashing, so that each I/O thread issues
        # its next request at once. More than the cores would only queue on them.
        self._macs = ThreadPoolExecutor(
            max(1, min(io_threads, os.cpu_count() or 1)), thread_name_prefix="kvoffload-disk-mac"
        )
        self._mutex = threading.Lock()
        self._held: dict[int, int] = {}  # pool slots a read still writes into -> count
        self._state: DiskState = "ok"
        self._since = time.time()
        self._last_error: str | None = None
        self._counters = dict.fromkeys(DISK_COUNTERS, 0)
        # Entries dropped at open were blocks that would have failed their MAC on a read.
        self._counters["checksum_failures"] = self.unauthenticated_dropped
        self._closed = False
        # Test seam: the syscalls that move bytes (a fault test swaps in failing ones).
        self.pwritev: Callable[[int, list[memoryview], int], int] = os.pwritev
        self.preadv: Callable[[int, list[memoryview], int], int] = os.preadv

    # ------------------------------------------------------------------ opening

    def _check_space(self) -> None:
        """``DiskSpaceError`` when the files at their full size (``disk_bytes_for`` the slot
        count) exceed the filesystem's free space plus what the store's files already hold (a
        restart reuses them; a fresh start frees them). ``f_bavail``: the space an unprivileged
        user may take, so root's reserve is never counted on."""
        needed = disk_bytes_for(self.num_slots, self.block_bytes)
        vfs = os.fstatvfs(self._dir_fd)
        free = vfs.f_bavail * vfs.f_frsize
        held = sum(os.fstat(fd).st_blocks * 512 for fd in (self._data_fd, self._index_fd))
        available = free + held
        if needed > available:
            raise DiskSpaceError(
                f"{self.directory}: the disk tier needs {needed} bytes ({_human(needed)}: "
                f"{self.num_slots} slots of {self.slot_bytes} bytes and their index) but its "
                f"filesystem has {available} bytes ({_human(available)}) free, this tier's "
                f"files included; fix: set disk_bytes to at most {available}, or free space "
                "on that filesystem",
                needed=needed,
                available=available,
            )

    def _preallocate(self) -> bool:
        """Allocate the blocks file to its full size now (``posix_fallocate``): its space is
        taken at start, and its extents are laid out at once rather than slot by slot as
        writes come (concurrent O_DIRECT writes into holes scatter them; ext4 also journals
        each such allocation). Whether it was done (False: the filesystem cannot; the space
        was still checked). ``DiskSpaceError`` when the filesystem filled up meanwhile.

        The index is not preallocated: 128 B per slot, it grows page by page as written, so
        a filesystem that fills up later still shows as a failed demotion and a degraded tier
        (``health``) rather than going unnoticed until the next start."""
        try:
            os.posix_fallocate(self._data_fd, 0, self.num_slots * self.slot_bytes)
        except OSError as exc:
            if exc.errno in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                return False
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                needed = disk_bytes_for(self.num_slots, self.block_bytes)
                raise DiskSpaceError(
                    f"{self.directory}: the disk tier needs {needed} bytes "
                    f"({_human(needed)}) but its filesystem filled up while they were "
                    "allocated; fix: lower disk_bytes, or free space on that filesystem",
                    needed=needed,
                    available=0,
                ) from None
            raise
        return True

    def _set_direct(self, direct: bool | None) -> bool:
        """Turn ``O_DIRECT`` on for the blocks file where asked and allowed; whether it is on.
        Set on the descriptor already checked (``F_SETFL``) rather than by opening the path
        again, which could be another file by then."""
        if direct is False or self.block_bytes % PAGE or not hasattr(os, "O_DIRECT"):
            return False
        flags = fcntl.fcntl(self._data_fd, fcntl.F_GETFL)
        try:
            fcntl.fcntl(self._data_fd, fcntl.F_SETFL, flags | os.O_DIRECT)
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
            fd = os.open("probe", flags, dir_fd=self._dir_fd)
        except FileNotFoundError:
            return
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise _not_regular(self._dir_fd, "probe", path, "file") from None
            raise
        try:
            _check_file(fd, path)
        finally:
            os.close(fd)

    def listed(self) -> list[tuple[bytes, int]]:
        """``(key, slot)`` of every block the index lists, oldest write first (a key listed
        twice, from an interrupted rewrite, keeps its newest slot)."""
        return self.index.listed()

    # ------------------------------------------------------------------ staging

    def stage(self, pool_slots: Sequence[int]) -> list[int] | None:
        """Copy pool slots into free staging buffers (on the caller's thread, before the pool
        slots are reused); their buffer ids, or None when too few are free or the store is
        closed (nothing copied).
        One thread: a second one copying half (measured) moved no more bytes a second, the
        copy being bound by the memory's bandwidth, not the core; it lets go of the GIL while
        it copies, so the I/O threads keep the disk busy meanwhile."""
        rows = self._staging_rows
        with self._mutex:
            if rows is None or len(self._staging_free) < len(pool_slots):
                return None
            ids = [self._staging_free.pop() for _ in pool_slots]
        pool = self.pool.tensor.numpy()
        bb = self.block_bytes
        for buf, slot in zip(ids, pool_slots, strict=True):
            rows[buf, :bb] = pool[slot]
        return ids

    def unstage(self, ids: Sequence[int]) -> None:
        """Give staging buffers back (their blocks are written or dropped)."""
        with self._mutex:
            self._staging_free.extend(ids)

    @property
    def staging_free(self) -> int:
        return len(self._staging_free)

    # ------------------------------------------------------------------ writes

    def write_many(self, items: Sequence[tuple[int, bytes, int]]) -> list[bool]:
        """``submit_writes(items)``, waited for."""
        return self.submit_writes(items).result()

    def submit_writes(self, items: Sequence[tuple[int, bytes, int]]) -> Future[list[bool]]:
        """Start writing staged blocks: ``(disk_slot, key, staging_id)`` each; the future says,
        per item, whether the block is whole on disk and listed. Runs of contiguous slots go
        to the I/O threads now, one system call each (``RUN_BYTES`` at most), queued behind
        the writes submitted before, so that a caller may submit a batch and stage the next
        while it is written. The staging buffers must stay untouched until the future is
        done."""
        done: Future[list[bool]] = Future()
        results = [False] * len(items)
        good = [
            i
            for i, (slot, key, _) in enumerate(items)
            if len(key) <= _MAX_KEY and 0 <= slot < self.num_slots
        ]
        runs = _runs(good, lambda i: items[i][0], self._run_blocks(self.slot_bytes))
        left = [len(runs)]
        if not runs:
            done.set_result(results)
            return done

        def ran(run: list[int], future: Future[list[bool]]) -> None:
            # A run whose task raised (a bug, not an I/O error: those are caught) counts as
            # not written, rather than leaving the caller waiting forever.
            oks = future.result() if future.exception() is None else [False] * len(run)
            with self._mutex:
                for i, ok in zip(run, oks, strict=True):
                    results[i] = ok
                left[0] -= 1
                last = not left[0]
            if last:
                done.set_result(results)

        for at, run in enumerate(runs):
            try:
                future = self._pool.submit(self._write_run, [items[i] for i in run])
            except RuntimeError:  # the store closed: this run and the rest write nothing
                with self._mutex:
                    left[0] -= len(runs) - at
                    last = not left[0]
                if last:
                    done.set_result(results)
                break
            future.add_done_callback(functools.partial(ran, run))
        return done

    def _write_run(self, run: list[tuple[int, bytes, int]]) -> list[bool]:
        """Write blocks to contiguous slots: entries cleared, bytes written in one call, then
        the entries written (see the module docstring for why this order)."""
        if self._closed:
            return [False] * len(run)
        sb, first = self.slot_bytes, run[0][0]
        staging = memoryview(self._staging)
        views = [staging[buf * sb : (buf + 1) * sb] for _, _, buf in run]
        keys = [key for _, key, _ in run]
        # The MACs are computed on a MAC thread while this one writes (the staged bytes do not
        # change meanwhile): the write's time is not followed by the hashing's.
        hashing: Future[list[bytes]] | None = None
        with contextlib.suppress(RuntimeError):  # MAC threads shut down: hashed below
            hashing = self._macs.submit(self._block_macs, keys, views)
        try:
            self.index.clear(first, len(run))
            written = self.pwritev(self._data_fd, views, first * sb)
            if written != sb * len(run):
                raise OSError(errno.EIO, f"short write ({written} of {sb * len(run)} bytes)")
            macs = self._block_macs(keys, views) if hashing is None else hashing.result()
            self.index.write(first, list(zip(keys, macs, strict=True)))
        except OSError as exc:
            self._failed("write", exc)
            self._count("write_failures", len(run))
            return [False] * len(run)
        finally:
            if hashing is not None:
                futures_wait([hashing])  # it reads the views released below
            _release(views)
            staging.release()
        self._count("writes", len(run))
        self._count("bytes_written", sb * len(run))
        return [True] * len(run)

    def _block_macs(self, keys: list[bytes], views: list[memoryview]) -> list[bytes]:
        """The MAC of each staged block (``views``: whole slots; the MAC covers the block's
        bytes only)."""
        bb = self.block_bytes
        return [block_mac(self._keys.block, k, v[:bb]) for k, v in zip(keys, views, strict=True)]

    def _run_blocks(self, block_bytes: int) -> int:
        return max(1, min(_IOV_MAX, RUN_BYTES // block_bytes))

    def _read_run_blocks(self) -> int:
        """Blocks a read run holds at most (``READ_RUN_BYTES``; one block when padded)."""
        if self.slot_bytes != self.block_bytes:
            return 1
        return max(1, min(_IOV_MAX, READ_RUN_BYTES // self.slot_bytes))

    def forget(self, slots: Sequence[int]) -> None:
        """Unlist slots whose blocks the caller dropped (evicted from the disk index or found
        corrupt), so a restart does not bring them back. Best effort: a failed write leaves an
        entry whose block the index no longer holds, found and dropped at the next restart."""
        for slot in slots:
            self.index.forget(slot)

    # ------------------------------------------------------------------ reads

    def read_many(self, items: Sequence[tuple[int, bytes, int]]) -> list[bool]:
        """``submit_reads(items)``, waited for."""
        return self.submit_reads(items).result()

    def submit_reads(self, items: Sequence[tuple[int, bytes, int]]) -> Future[list[bool]]:
        """Start reading blocks into pool slots: ``(disk_slot, key, pool_slot)``
        each; the future says, per item, True only when the whole block was read and matches
        its key and checksum (a False pool slot holds undefined bytes). Runs of contiguous
        slots go to the I/O threads now, one system call each (``RUN_BYTES`` at most), queued
        behind the reads submitted before: reads submitted in order finish roughly in order.
        The pool slots are in ``held_slots`` until the future is done."""
        done: Future[list[bool]] = Future()
        items = list(items)
        if not items:
            done.set_result([])
            return done
        with self._mutex:
            for _, _, pool_slot in items:
                self._held[pool_slot] = self._held.get(pool_slot, 0) + 1
        results = [False] * len(items)
        listed = []
        for i, (slot, key, _) in enumerate(items):
            entry = self.index.entries.get(slot)
            if entry is None or entry.key != key:
                self._count("read_failures", 1)
            else:
                listed.append(i)
        # Blocks of a run land in separate pool slots; padding between them on disk (a block
        # size that is not whole pages) keeps them one block a call.
        runs = _runs(listed, lambda i: items[i][0], self._read_run_blocks())
        left = [len(runs)]

        def settle() -> None:
            with self._mutex:
                for _, _, pool_slot in items:
                    n = self._held[pool_slot] - 1
                    if n:
                        self._held[pool_slot] = n
                    else:
                        del self._held[pool_slot]
            done.set_result(results)

        def ran(run: list[int], oks: list[bool]) -> None:
            for i, ok in zip(run, oks, strict=True):
                results[i] = ok
            with self._mutex:
                left[0] -= 1
                last = not left[0]
            if last:
                settle()

        if not runs:
            settle()
            return done
        for at, run in enumerate(runs):
            finish = _Once(functools.partial(ran, run), len(run))
            try:
                future = self._pool.submit(self._read_run, [items[i] for i in run], finish)
            except RuntimeError:  # the store closed: this run and the rest read nothing
                self._count("read_failures", sum(len(r) for r in runs[at:]))
                with self._mutex:
                    left[0] -= len(runs) - at
                    last = not left[0]
                if last:
                    settle()
                break
            # A run whose task raised (a bug, not an I/O error: those are caught) reads as
            # failed rather than leaving the load waiting forever.
            future.add_done_callback(finish.on_error)
        return done

    def _read_run(self, run: list[tuple[int, bytes, int]], finish: _Once) -> None:
        """Read contiguous slots in one call into a free read buffer (``_buffer``), then hand
        the buffer to the MAC threads, which check each block there and copy the good ones
        into their pool slots (``_check_run``), so that this I/O thread starts its next read
        at once (the disk keeps ``io_threads`` reads in flight). ``finish`` gets, per block,
        whether it was read and matches its MAC (a False slot holds bytes nobody may use)."""
        if self._closed:
            self._count("read_failures", len(run))
            finish([False] * len(run))
            return
        buf = self._take_read_buffer()
        try:
            views = self._read_views[buf][: len(run)]
            want = self.block_bytes * len(run)
            got = self.preadv(self._data_fd, views, run[0][0] * self.slot_bytes)
            if got != want:
                raise OSError(errno.EIO, f"short read ({got} of {want} bytes)")
        except OSError as exc:
            self._give_read_buffer(buf)
            self._failed("read", exc)
            self._count("read_failures", len(run))
            finish([False] * len(run))
            return
        except BaseException:
            self._give_read_buffer(buf)
            raise
        try:
            checking = self._macs.submit(self._check_run, run, buf, finish)
        except RuntimeError:  # the MAC threads are shut down (closing): check here
            self._check_run(run, buf, finish)
            return
        checking.add_done_callback(finish.on_error)

    def _take_read_buffer(self) -> int:
        """A free read buffer, waiting for the MAC threads to give one back if none is (two
        per I/O thread: the wait is the MAC threads falling behind the disk)."""
        with self._read_buffer_freed:
            while not self._reads_free:
                self._read_buffer_freed.wait()
            return self._reads_free.pop()

    def _give_read_buffer(self, buf: int) -> None:
        with self._read_buffer_freed:
            self._reads_free.append(buf)
            self._read_buffer_freed.notify()

    def _check_run(self, run: list[tuple[int, bytes, int]], buf: int, finish: _Once) -> None:
        """Check each block of the run read into read buffer ``buf`` against its entry's MAC
        (keyed BLAKE3, the GIL released while it hashes), copy the good ones into their pool
        slots (numpy's copy releases the GIL too), give the buffer back, and ``finish`` with
        the result. The MAC is of the bytes copied on, so no block reaches the pool that
        failed its check."""
        ok: list[bool] = []
        try:
            bb = self.block_bytes
            rows = self._read_rows
            assert rows is not None  # closing waits for these threads before dropping it
            views = self._read_views[buf]
            entries, mac_key = self.index.entries, self._keys.block
            pool = self.pool.tensor.numpy()
            for i, (slot, key, pool_slot) in enumerate(run):
                entry = entries.get(slot)
                good = (
                    entry is not None
                    and entry.key == key
                    and hmac.compare_digest(block_mac(mac_key, key, views[i]), entry.mac)
                )
                if good:
                    pool[pool_slot] = rows[buf, i * bb : (i + 1) * bb]
                ok.append(good)
        finally:
            self._give_read_buffer(buf)
        good_blocks = ok.count(True)
        self._count("checksum_failures", len(run) - good_blocks)
        self._count("reads", good_blocks)
        self._count("bytes_read", self.block_bytes * good_blocks)
        finish(ok)

    def held_slots(self) -> frozenset[int]:
        """Pool slots a read still writes into (a caller that gave up waiting must not reuse
        them until they leave this set)."""
        with self._mutex:
            return frozenset(self._held)

    # ------------------------------------------------------------------ health

    def health(self) -> DiskHealth:
        """State and counters; never blocks on the disk."""
        with self._mutex:
            return DiskHealth(self._state, self._since, self._last_error, dict(self._counters))

    def probe(self) -> bool:
        """Try a real write (the probe page, synced); back to ``ok`` when it works. Blocks.

        The page is a new one each time (the file is emptied after each probe): rewriting a
        page already allocated works on a full disk, so it would call a full disk ``ok``. The
        file is removed and made again with ``O_EXCL``: whatever is found under its name
        (a link planted there) is never written through."""
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink("probe", dir_fd=self._dir_fd)
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            fd = os.open("probe", flags, _FILE_MODE, dir_fd=self._dir_fd)
            try:
                os.fchmod(fd, _FILE_MODE)
                os.pwrite(fd, os.urandom(64).ljust(PAGE, b"\0"), 0)
                os.fsync(fd)
                os.ftruncate(fd, 0)
            finally:
                os.close(fd)
        except OSError as exc:
            self._failed("probe", exc)
            return False
        with self._mutex:
            if self._state != "ok":
                self._state = "ok"
                self._since = time.time()
        return True

    def disk_usage(self) -> int:
        """Bytes the store's files and directory take on disk now (allocated blocks, not
        apparent size)."""
        total = 0
        for fd in (self._dir_fd, self._data_fd, self._index_fd, self._lock_fd):
            with contextlib.suppress(OSError):
                total += os.fstat(fd).st_blocks * 512
        with contextlib.suppress(OSError):
            st = os.stat("probe", dir_fd=self._dir_fd, follow_symlinks=False)
            total += st.st_blocks * 512
        return total

    def mark_degraded(self, why: str) -> None:
        """Degrade the store for a reason seen by its caller (a read past its timeout)."""
        self._degrade(why)

    def _failed(self, what: str, exc: OSError) -> None:
        self._degrade(f"{what}: {exc.strerror or exc}")

    def _degrade(self, message: str) -> None:
        with self._mutex:
            self._last_error = message
            if self._state == "ok":
                self._state = "degraded"
                self._since = time.time()
                self._counters["incidents"] += 1

    def _count(self, name: str, n: int) -> None:
        with self._mutex:
            self._counters[name] += n

    # ------------------------------------------------------------------ closing

    def close(self) -> None:
        """Finish the I/O in flight and close the files (idempotent). The index stays on disk
        for the next start."""
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=True)  # first: its tasks hand work to the MAC threads
        self._macs.shutdown(wait=True)
        self._close_fds()
        self._staging_rows = None  # its export of the mapping ends before the mapping
        self._staging.close()
        for views in self._read_views:
            _release(views)
        self._read_views = []
        self._read_rows = None  # as the staging rows
        self._reads.close()

    def _close_fds(self) -> None:
        for name in ("_data_fd", "_index_fd", "_lock_fd", "_dir_fd"):
            fd = getattr(self, name, -1)
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
                setattr(self, name, -1)


class _IndexFile:
    """The ``index`` file: a header (format, block and slot size, slot count), then one
    128-byte entry per slot. Its entries live in memory (``entries``) and are written through,
    buffered; the file is read once, when the store opens. Thread-safe for distinct slots."""

    def __init__(
        self,
        fd: int,
        data_fd: int,
        entry_key: bytes,
        block_bytes: int,
        slot_bytes: int,
        num_slots: int,
    ) -> None:
        """Read the file and size both files for ``num_slots``: an empty, foreign or
        other-block-size one starts empty, the blocks file emptied with it; one of another
        format version too, its listed blocks counted in ``format_dropped``. Entries that
        fail their MAC under ``entry_key`` are cleared and counted in ``unauthenticated``."""
        self.fd = fd
        self.entries: dict[int, _Entry] = {}
        self.format_dropped = 0
        self.unauthenticated = 0
        self._entry_key = entry_key
        self._mutex = threading.Lock()
        size = os.fstat(fd).st_size
        header = os.pread(fd, _HEADER.size, 0) if size >= HEADER_BYTES else b""
        fresh = True
        if len(header) == _HEADER.size:
            magic, version, old_block, old_slot, _ = _HEADER.unpack(header)
            if magic == _MAGIC and version != FORMAT_VERSION:
                # Format 1's checksums are unkeyed: anyone could have made its entries. Its
                # blocks are never loaded, only counted (a later one would be just as foreign).
                self.format_dropped = _count_listed(fd, size, version)
            fresh = not (
                magic == _MAGIC
                and version == FORMAT_VERSION
                and old_block == block_bytes
                and old_slot == slot_bytes
            )
        if fresh:
            # Another format or block size: the old blocks cannot be served; start empty.
            os.ftruncate(fd, 0)
            os.ftruncate(data_fd, 0)
        else:
            bad: list[int] = []
            span = min(size - HEADER_BYTES, num_slots * ENTRY_BYTES)
            for first, raw in _index_chunks(fd, span):
                for i in _nonempty(raw):
                    entry = _parse_entry(raw[i * ENTRY_BYTES : (i + 1) * ENTRY_BYTES], entry_key)
                    if entry is None:
                        bad.append(first + i)
                    else:
                        self.entries[first + i] = entry
            # Cleared, so that the next start neither counts them again nor finds them.
            for slot in bad:
                os.pwrite(fd, _EMPTY, HEADER_BYTES + slot * ENTRY_BYTES)
            self.unauthenticated = len(bad)
        head = _HEADER.pack(_MAGIC, FORMAT_VERSION, block_bytes, slot_bytes, num_slots)
        os.pwrite(fd, head.ljust(HEADER_BYTES, b"\0"), 0)
        # A smaller disk than last time: the slots past the end are gone.
        os.ftruncate(fd, HEADER_BYTES + num_slots * ENTRY_BYTES)
        if os.fstat(data_fd).st_size > num_slots * slot_bytes:
            os.ftruncate(data_fd, num_slots * slot_bytes)
        self._seq = max((e.seq for e in self.entries.values()), default=0)

    def clear(self, first: int, count: int) -> None:
        """Unlist slots ``first .. first + count - 1`` before their bytes are rewritten."""
        slots = range(first, first + count)
        if any(s in self.entries for s in slots):
            os.pwrite(self.fd, _EMPTY * count, HEADER_BYTES + first * ENTRY_BYTES)
            for s in slots:
                self.entries.pop(s, None)

    def write(self, first: int, rows: list[tuple[bytes, bytes]]) -> None:
        """List ``(key, block MAC)`` rows at slots ``first ..``, once their bytes are whole
        on disk, with the next write sequence numbers."""
        with self._mutex:
            seqs = range(self._seq + 1, self._seq + 1 + len(rows))
            self._seq += len(rows)
        packed = b"".join(
            _pack_entry(key, mac, q, self._entry_key)
            for (key, mac), q in zip(rows, seqs, strict=True)
        )
        os.pwrite(self.fd, packed, HEADER_BYTES + first * ENTRY_BYTES)
        for i, ((key, mac), q) in enumerate(zip(rows, seqs, strict=True)):
            self.entries[first + i] = _Entry(key, mac, q)

    def forget(self, slot: int) -> None:
        """Unlist one slot (best effort: an entry left behind fails or is dropped later)."""
        if self.entries.pop(slot, None) is None:
            return
        with contextlib.suppress(OSError):
            os.pwrite(self.fd, _EMPTY, HEADER_BYTES + slot * ENTRY_BYTES)

    def listed(self) -> list[tuple[bytes, int]]:
        """``(key, slot)`` of every listed block, oldest write first; a key listed twice
        (an interrupted rewrite) keeps its newest slot, the other is unlisted."""
        by_key: dict[bytes, tuple[int, int]] = {}
        for slot, e in self.entries.items():
            old = by_key.get(e.key)
            if old is None or old[0] < e.seq:
                by_key[e.key] = (e.seq, slot)
        keep = {slot for _, slot in by_key.values()}
        for slot in [s for s in self.entries if s not in keep]:
            self.forget(slot)
        return [(key, slot) for key, (_, slot) in sorted(by_key.items(), key=lambda kv: kv[1][0])]


def _count_listed(fd: int, size: int, version: int) -> int:
    """Entries an index of another format version lists (format 1: those with its magic; a
    later one's layout is unknown: every entry that is not empty)."""
    n = 0
    for _, raw in _index_chunks(fd, max(0, size - HEADER_BYTES)):
        if version == 1:
            rows = np.frombuffer(raw, np.uint8).reshape(-1, ENTRY_BYTES)[:, :4]
            magic = np.frombuffer(_V1_ENTRY_MAGIC, np.uint8)
            n += int(np.count_nonzero((rows == magic).all(axis=1)))
        else:
            n += len(_nonempty(raw))
    return n


#: Bytes of the index read at a time at open: memory at open stays this, plus the entries
#: listed, whatever the slot count (a whole-file read took 128 B per slot at once).
_INDEX_CHUNK = 4 << 20


def _index_chunks(fd: int, nbytes: int) -> Iterator[tuple[int, bytes]]:
    """The first ``nbytes`` of the index's entries (whole entries only), ``_INDEX_CHUNK``
    bytes at a time: (slot of the chunk's first entry, its bytes)."""
    nbytes -= nbytes % ENTRY_BYTES
    done = 0
    while done < nbytes:
        raw = os.pread(fd, min(_INDEX_CHUNK, nbytes - done), HEADER_BYTES + done)
        raw = raw[: len(raw) - len(raw) % ENTRY_BYTES]
        if not raw:  # the file ended early (shrunk meanwhile): nothing more is listed
            return
        yield done // ENTRY_BYTES, raw
        done += len(raw)


def _nonempty(raw: bytes) -> list[int]:
    """Indices of the entries in ``raw`` that are not all zero bytes (in C: an index of
    millions of empty slots is scanned without a Python step per slot)."""
    if not raw or raw.count(0) == len(raw):
        return []
    rows = np.frombuffer(raw, np.uint8).reshape(-1, ENTRY_BYTES)
    return [int(i) for i in np.flatnonzero(rows.any(axis=1))]


class _Once:
    """A run's completion: calls ``done(oks)`` the first time it is called, never again (a
    run is finished by its read, its MAC check, or the error handler of whichever raised)."""

    def __init__(self, done: Callable[[list[bool]], None], n: int) -> None:
        self._done: Callable[[list[bool]], None] | None = done
        self._n = n
        self._lock = threading.Lock()

    def __call__(self, oks: list[bool]) -> None:
        with self._lock:
            done, self._done = self._done, None
        if done is not None:
            done(oks)

    def on_error(self, future: Future[None]) -> None:
        """Done callback of a task that should have finished the run: finish it as failed if
        the task raised (a no-op when it finished the run already)."""
        if future.exception() is not None:
            self([False] * self._n)


def _buffer(nbytes: int) -> tuple[mmap.mmap, bool | None]:
    """A private anonymous mapping of ``nbytes``, on huge pages where the kernel gives them
    (``MADV_HUGEPAGE``: transparent huge pages in ``madvise`` or ``always`` mode), faulted in
    now, in one pass; and whether it got huge pages (None: ``/proc/self/smaps`` unreadable, or
    ``nbytes`` too small to hold an aligned huge page).

    Why: an O_DIRECT request is split where its memory is not physically contiguous, and a
    block on scattered 4 KiB pages (256 of them in 1 MiB) exceeds a virtio disk's 254 segments
    a request, so each 1 MiB write went to the device as a request of 1016 KiB and one of
    8 KiB. Measured here (2026-12-03, 128 MiB in 4 MiB writes on 4 threads): 3.1 GB/s from
    4 KiB pages, 5.3 GB/s from huge pages; the service's demotion went from 0.55-0.69x fio's
    sequential write to 0.83-1.09x, and an onload read through these buffers from 0.84-1.03x
    fio's sequential read to 1.40-1.49x. The mapping must be private: shared anonymous memory
    (``mmap(-1, n)``'s default) is shmem, which gets huge pages only where
    ``/sys/kernel/mm/transparent_hugepage/shmem_enabled`` allows, and that is ``never`` by
    default. Faulting at open also keeps the first transfer's page faults (and the kernel's
    compaction for huge pages) off the loop."""
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(AttributeError, OSError):  # no THP: 4 KiB pages, still faulted
        buf.madvise(mmap.MADV_HUGEPAGE)
    rows = np.frombuffer(buf, dtype=np.uint8)
    if nbytes < 2 * HUGE_PAGE:  # too small to hold an aligned huge page: nothing to ask smaps
        rows[::PAGE] = 0
        return buf, None
    # The kernel merges adjacent private mappings with the same flags into one (the staging
    # and the read buffers, made one after the other): what this buffer got is the mapping's
    # huge bytes after faulting it in, less those before.
    before = _anon_huge_bytes(rows.ctypes.data)
    rows[::PAGE] = 0
    after = _anon_huge_bytes(rows.ctypes.data)
    del rows  # its export of the mapping
    if before is None or after is None:
        return buf, None  # unknown
    return buf, after > before


def _huge_page_bytes() -> int:
    """The size of a transparent huge page here (x86-64's 2 MiB where the kernel does not say)."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size", encoding="ascii") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 2 << 20


HUGE_PAGE = _huge_page_bytes()


def _anon_huge_bytes(address: int) -> int | None:
    """``AnonHugePages`` of this process's mapping that holds ``address``, in bytes (None:
    ``/proc/self/smaps`` unreadable, or no such mapping)."""
    try:
        with open("/proc/self/smaps", encoding="ascii", errors="replace") as smaps:
            inside = False
            for line in smaps:
                head = line.split(maxsplit=1)[0]
                if "-" in head and not head.endswith(":"):  # a mapping's first line
                    start, end = (int(x, 16) for x in head.split("-", 1))
                    inside = start <= address < end
                elif inside and head == "AnonHugePages:":
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return None


def _release(views: list[memoryview]) -> None:
    for v in views:
        v.release()


def _runs(order: list[int], slot_of: Callable[[int], int], cap: int) -> list[list[int]]:
    """Item indices grouped into runs of consecutive disk slots (ascending, ``cap`` at most)."""
    runs: list[list[int]] = []
    for i in sorted(order, key=slot_of):
        if runs and len(runs[-1]) < cap and slot_of(runs[-1][-1]) + 1 == slot_of(i):
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs


def _entry_mac(body: bytes, entry_key: bytes) -> bytes:
    return blake3(body, key=entry_key).digest(_ENTRY_MAC_BYTES)


def _pack_entry(key: bytes, mac: bytes, seq: int, entry_key: bytes) -> bytes:
    body = _ENTRY.pack(_ENTRY_MAGIC, len(key), seq, key, mac)
    return (body + _entry_mac(body, entry_key)).ljust(ENTRY_BYTES, b"\0")


def _parse_entry(raw: bytes, entry_key: bytes) -> _Entry | None:
    """The entry in ``raw``, or None when it fails its MAC (or is not one at all)."""
    body = raw[: _ENTRY.size]
    own = raw[_ENTRY.size : _ENTRY.size + _ENTRY_MAC_BYTES]
    if not hmac.compare_digest(_entry_mac(body, entry_key), own):
        return None
    magic, key_len, seq, key, mac = _ENTRY.unpack(body)
    if magic != _ENTRY_MAGIC or not 1 <= key_len <= _MAX_KEY:
        return None
    return _Entry(key[:key_len], mac, seq)
