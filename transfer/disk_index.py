"""The disk tier's ``index`` file and its MACs: what each block slot holds, and the keys that
vouch for it.

- ``index``: a 4 KiB header (magic ``KVODISK1``, format version ``FORMAT_VERSION``, block and
  slot size, slot count), then one 128-byte entry per slot: magic ``KVO2``, key length, write
  sequence number, key (64 bytes, zero padded), the block's MAC (keyed BLAKE3, 32 bytes, over
  the key's length and bytes, then the block's bytes) and the entry's own MAC (keyed BLAKE3 of
  the 110 bytes before it, 16 bytes, under a second derived key). Written buffered, never read
  on the data path: the entries live in memory (``IndexFile.entries``).
- A directory's keys are derived from the root's master key (``transfer.disk_files``) with
  BLAKE3's ``derive_key`` mode over (master key, block size, directory name): a block copied
  into another namespace's directory, or read back at another block size, fails its MAC like a
  forged one.

Restart: ``IndexFile`` reads the file in one sequential pass, ``_INDEX_CHUNK`` bytes at a time
(128 bytes per slot: 512 MiB for 1 TB of 256 KiB blocks; empty entries skipped in C), and keeps
the entries whose own MAC holds; ``listed()`` returns them oldest write first. An entry that is
not empty and fails its MAC (forged, torn, written under another key or into another directory)
is cleared and counted in ``unauthenticated``. An index of another format version (format 1 had
unkeyed checksums) is never loaded: its blocks are counted in ``format_dropped`` and both files
start afresh. A header of another block size starts the directory empty too.
"""

from __future__ import annotations

import contextlib
import hmac
import os
import struct
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
from blake3 import blake3

__all__ = [
    "ENTRY_BYTES",
    "FORMAT_VERSION",
    "HEADER_BYTES",
    "MAX_KEY",
    "PAGE",
    "DiskKeys",
    "IndexEntry",
    "IndexFile",
    "block_mac",
    "derive_keys",
]

#: The page the files are laid out in: the index's header, a slot's rounding, the probe's write.
PAGE = 4096
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
#: The longest key an entry holds (its key field, zero padded).
MAX_KEY = 64
_KEY_LEN = struct.Struct("<H")
_BLOCK_BYTES = struct.Struct("<Q")

# BLAKE3 derive_key contexts: fixed, application-specific, one per purpose.
_BLOCK_CONTEXT = "kvoffload disk tier format 2: block MAC key"
_ENTRY_CONTEXT = "kvoffload disk tier format 2: index entry MAC key"


def block_mac(mac_key: bytes, key: bytes, data: bytes | bytearray | memoryview) -> bytes:
    """The MAC a block is stored with (32 bytes): keyed BLAKE3 under ``mac_key`` (a
    directory's block key, ``DiskKeys.block``) of the key's length (2 bytes, little endian), the
    key, then the block's bytes. Releases the GIL while it hashes ``data``."""
    h = blake3(_KEY_LEN.pack(len(key)), key=mac_key)
    h.update(key)
    h.update(data)
    return h.digest()


@dataclass(frozen=True, slots=True)
class DiskKeys:
    """A directory's MAC keys: blocks', and index entries' (two keys, so that an entry's MAC
    can never pass for a block's or the other way round)."""

    block: bytes
    entry: bytes


def derive_keys(master: bytes, name: str, block_bytes: int) -> DiskKeys:
    """The keys of directory ``name`` for blocks of ``block_bytes`` (BLAKE3 ``derive_key``; the
    master key is 32 bytes and the block size 8, so the name after them is unambiguous)."""
    material = master + _BLOCK_BYTES.pack(block_bytes) + os.fsencode(name)
    return DiskKeys(
        blake3(material, derive_key_context=_BLOCK_CONTEXT).digest(),
        blake3(material, derive_key_context=_ENTRY_CONTEXT).digest(),
    )


@dataclass(frozen=True, slots=True)
class IndexEntry:
    """One slot's entry: the block's key, its MAC (``block_mac``), its write sequence number."""

    key: bytes
    mac: bytes
    seq: int


class IndexFile:
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
        self.entries: dict[int, IndexEntry] = {}
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
            self.entries[first + i] = IndexEntry(key, mac, q)

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


def _entry_mac(body: bytes, entry_key: bytes) -> bytes:
    return blake3(body, key=entry_key).digest(_ENTRY_MAC_BYTES)


def _pack_entry(key: bytes, mac: bytes, seq: int, entry_key: bytes) -> bytes:
    body = _ENTRY.pack(_ENTRY_MAGIC, len(key), seq, key, mac)
    return (body + _entry_mac(body, entry_key)).ljust(ENTRY_BYTES, b"\0")


def _parse_entry(raw: bytes, entry_key: bytes) -> IndexEntry | None:
    """The entry in ``raw``, or None when it fails its MAC (or is not one at all)."""
    body = raw[: _ENTRY.size]
    own = raw[_ENTRY.size : _ENTRY.size + _ENTRY_MAC_BYTES]
    if not hmac.compare_digest(_entry_mac(body, entry_key), own):
        return None
    magic, key_len, seq, key, mac = _ENTRY.unpack(body)
    if magic != _ENTRY_MAGIC or not 1 <= key_len <= MAX_KEY:
        return None
    return IndexEntry(key[:key_len], mac, seq)
