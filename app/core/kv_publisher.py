"""KV events for routers: the pull feed's events, pushed over ZMQ in vLLM 0.33's framing.

A KV-aware router (Dynamo's, llm-d's) learns where blocks are from vLLM's KV events: a ZMQ PUB
socket sends three frames per batch, the topic, an 8-byte big-endian sequence number counting
up by one (vLLM's from 0; kvoffload's, see Restart), and a msgpack ``KVEventBatch`` ``[ts,
[events], data_parallel_rank]``; a ROUTER socket
answers a replay request ``["", start_seq]`` with every batch still kept whose number is at
least ``start_seq`` (each ``["", topic, seq, payload]``), then the end marker ``["", "", -1, ""]``.
``KVEventPublisher`` is that publisher for the whole process (``--kv-events-endpoint``,
``--kv-events-replay-endpoint``): each namespace's service hands it the events it drains
(``Service.drain_events``, the same events ``GET /v1/events`` serves) through the sink
``sink(namespace, meta)`` returns, one topic per namespace (``--kv-events-topic``).

Contract:

- **Never waits, and out of the engine's calls.** A namespace's sink runs on the event loop
  and puts the batch, as the pull feed's events, on a bounded queue; a full queue drops the
  batch and counts its events (``counts().dropped``). The first batch of a window sets a timer
  (``COALESCE_S``); when it fires, between the engine's calls, the loop converts the window
  (``wire_events``: the hashes, the engine's metadata), encodes it and sends it without
  blocking (``NOBLOCK``: a slow or absent subscriber loses only its own messages, ZMQ's
  high-water mark drops them), at most ``FLUSH_KEYS`` keys a turn of the loop. It is on the
  loop rather than a thread of its own because the conversion is Python either way: on a
  thread it held the same interpreter lock, and each window added a wake-up and two lock
  hand-offs, which cost the engine calls more than the conversion did (``bench/router.py``
  part b). Replay requests are answered on a thread of its own, which blocks on the replay
  socket. A batch from another thread is handed to the loop ``start`` ran on; with no loop
  at all (a caller that is not the service), it goes out at once. Before ``start`` batches
  queue; ``close`` sends what is queued.
- **Media routers index.** ``ROUTER_MEDIA``: the pool is ``CPU``, the disk tier ``DISK``, the
  remote tier ``REMOTE``, the object tier ``STORAGE`` (the pull feed's ``OBJECT``, a name no
  router indexes).
- **Hashes as vLLM sends them.** A block's hash is the low 64 bits of its key read as a
  big-endian integer (``hash64``), as vLLM's ``maybe_convert_block_hash`` does.
- **Metadata when the engine gave it.** An engine may pass a store's ``token_ids``,
  ``block_size`` and ``parent_block_hash`` (``BlockMetadata.note``); a ``BlockStored`` about
  those keys, on any medium, carries them. The keys of one pull-feed event are split into runs
  that are chains (each key's parent the key before it), one ``BlockStored`` per run. Keys no
  engine described go out with ``token_ids`` empty and ``block_size`` 0.
- **Restart.** Each namespace's stream starts with ``AllBlocksCleared`` (``Service.start``):
  a restarted kvoffload has an empty pool. Sequence numbers count up by one from the
  publisher's start time in microseconds (``first_seq``), not from 0: a subscriber that tracks
  them (Dynamo's) drops a number lower than one it has seen, so a restarted publisher counting
  from 0 would go unheard; counting from above every earlier process's numbers, it is heard as
  a gap, which the subscriber fills by replay, from the new stream's first batch, its clear.
- **A namespace a tenants reload adds** opens without that clear (``sink``): nothing of it was
  published by this process, and a router that reads the node's namespaces as one instance
  (Dynamo) would forget all of them at it. One this process served before, removed or moved
  and added again, keeps its clear.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import itertools
import os
import socket
import struct
import threading
import time
from array import array
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from operator import itemgetter
from pathlib import Path
from typing import Any, NamedTuple, cast

from app.settings import Settings, config_error
from app.telemetry.logging import get_logger
from manager import AllBlocksCleared, BlockKey, BlockRemoved, BlockStored, KVEvent

log = get_logger("kv_events")

#: The optional dependencies the publisher needs, as a user installs them.
EXTRA = "kvoffload[events]"
#: The pull feed's media as the events name them: names routers index (Dynamo counts CPU as
#: cpu, and DISK, REMOTE and STORAGE as disk; it drops an OBJECT medium it does not know).
ROUTER_MEDIA = {"CPU": "CPU", "DISK": "DISK", "REMOTE": "REMOTE", "OBJECT": "STORAGE"}
#: The replay answer's last message: sequence number -1.
END_SEQ = (-1).to_bytes(8, "big", signed=True)
_MASK64 = (1 << 64) - 1
# How long the replay thread waits on its socket before it looks at whether it must stop.
_POLL_S = 0.1
# How long closing the PUB socket lets ZMQ deliver what the last flush sent.
_CLOSE_LINGER_MS = 200
#: How long the batches after a window's first wait for the next calls' batches: each topic's
#: go out as one message, one conversion and send per window rather than per engine call.
#: Routers hear of a block this much later (a flood's window, ``FLUSH_KEYS`` a loop turn,
#: a few turns more).
COALESCE_S = 0.02
#: The most keys one turn of the loop converts and sends; a window with more (a flood of the
#: largest batches) goes on in the next turns, so that no turn holds the loop long.
FLUSH_KEYS = 4096

EventSink = Callable[[Sequence[KVEvent]], None]
# One event as it goes out, before its format (map or array) is chosen: the type, then the
# values of vLLM's fields in their order (BlockStored: block_hashes, parent_block_hash,
# token_ids, block_size, lora_id, medium, lora_name; BlockRemoved: block_hashes, medium).
WireEvent = tuple[Any, ...]
_FIELDS = {
    "BlockStored": (
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
    ),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}


def hash64(key: BlockKey) -> int:
    """The block hash routers see for ``key``: its low 64 bits, big-endian, as vLLM sends it."""
    return int.from_bytes(key, "big") & _MASK64


def router_medium(medium: str) -> str:
    """The name routers index for one of the pull feed's media (``ROUTER_MEDIA``)."""
    return ROUTER_MEDIA.get(medium, medium)


@dataclass(frozen=True, slots=True)
class BlockInfo:
    """What an engine said of one block: its tokens (empty: not given), how many tokens a
    block holds (0: not given) and the key before it in its sequence (None: the first, or not
    given)."""

    token_ids: tuple[int, ...]
    block_size: int
    parent: BlockKey | None


# One key's entry: its tokens as unsigned 32-bit words in native order (empty: not given), the
# block size (0: not given), its parent key. A plain tuple, made in C (``zip`` over slices of
# one packed buffer): a store call notes each key it stores, and a Python step per key cost as
# much as the rest of the call's bookkeeping.
_Entry = tuple[bytes, int, BlockKey | None]
# One store call's word as ``note`` queues it: keys, the tokens packed as unsigned 32-bit
# words, the block size (0: none given), parent, the keys stored (None: all).
_Note = tuple[Sequence[BlockKey], bytes, int, BlockKey | None, Sequence[BlockKey] | None]


def _pick(picked: itemgetter[Any], items: list[Any]) -> list[Any]:
    """The ``items`` an ``itemgetter`` of positions picks, as a list (it gives one item bare)."""
    got = picked(items)
    return list(got) if isinstance(got, tuple) else [got]


def _words(packed: bytes) -> list[int]:
    """The token ids an entry's packed bytes hold."""
    return memoryview(packed).cast("I").tolist()


class BlockMetadata:
    """One namespace's engine-given metadata by key: at least the ``capacity`` keys most
    recently noted; older ones are forgotten a generation at a time (their events then carry
    the hash alone).

    Two generations of at most ``capacity`` keys each: a call's keys go into the young one,
    which becomes the old one (the old one dropped whole) when they would not fit. So a note
    costs a dict update, with no per-key eviction, and memory holds at most ``2 * capacity``
    keys: about 200 bytes and 4 bytes a token each.

    ``note`` (inside the engine's store call) only queues what the call said; the readers
    (``get``, ``entries``: the publisher's flush) take the queued notes in first, in order. So
    the per-key work runs between the engine's calls rather than inside them. A note keeps the
    tokens packed (4 bytes each, made in C) and a call that stores nothing queues none; once
    the queued notes name ``PENDING_KEYS`` keys, the noting call takes them in itself, so that
    the queue stays bounded when nothing reads. One thread uses it (the service's loop)."""

    #: Keys the queued notes may name before the call that adds one takes them in itself.
    PENDING_KEYS = 16384

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"metadata capacity must be positive, got {capacity}")
        self.capacity = capacity
        self._young: dict[BlockKey, _Entry] = {}
        self._old: dict[BlockKey, _Entry] = {}
        self._notes: deque[_Note] = deque()
        self._noted_keys = 0  # keys the queued notes name

    def __len__(self) -> int:
        """The distinct keys held."""
        self._take_notes()
        return len(self._young.keys() | self._old.keys())

    def get(self, key: BlockKey) -> BlockInfo | None:
        """The engine's word on ``key``, if kept."""
        self._take_notes()
        entry = self._young.get(key) or self._old.get(key)
        if entry is None:
            return None
        return BlockInfo(tuple(_words(entry[0])), entry[1], entry[2])

    def note(
        self,
        keys: Sequence[BlockKey],
        token_ids: Sequence[int] | None,
        block_size: int | None,
        parent: BlockKey | None,
        stored: Sequence[BlockKey] | None = None,
    ) -> None:
        """Keep what a store call said of ``keys``, a chain (head first) whose first key
        follows ``parent``: block ``i`` holds ``token_ids[i*block_size:(i+1)*block_size]``.
        ``stored``: the keys the call stores, when not all of them (the rest are resident and
        were noted when they were stored; an engine offers a whole prompt at every step, and
        noting its hits again would cost every call). A key noted again takes its new word.
        The caller has checked that ``token_ids`` has ``block_size`` tokens per key (each
        below 2**32), and changes none of the sequences afterwards (they are kept as given
        until a reader takes the note in)."""
        if stored is not None and not stored:
            return  # every key resident: noted when it was stored
        raw = array("I", token_ids).tobytes() if token_ids and block_size else b""
        self._notes.append((keys, raw, block_size or 0, parent, stored))
        self._noted_keys += len(keys)
        if self._noted_keys >= self.PENDING_KEYS:
            self._take_notes()

    def entries(self, keys: Sequence[BlockKey]) -> list[_Entry | None]:
        """Each key's entry (None: no word on it), or an empty list when there is none at
        all (the common case of engines that pass no metadata, answered without a loop)."""
        self._take_notes()
        young, old = self._young, self._old
        if young.keys().isdisjoint(keys) and old.keys().isdisjoint(keys):
            return []
        if not old:
            return list(map(young.get, keys))
        return [young.get(k) or old.get(k) for k in keys]

    def _take_notes(self) -> None:
        """Apply the queued notes, oldest first. A note that fails is logged and skipped (its
        keys' events carry their hashes alone): the caller is another call, or a flush."""
        notes = self._notes
        self._noted_keys = 0
        while notes:
            try:
                self._apply(*notes.popleft())
            except Exception:
                log.exception("KV event metadata note skipped")

    def _apply(
        self,
        keys: Sequence[BlockKey],
        raw: bytes,
        size: int,
        parent: BlockKey | None,
        stored: Sequence[BlockKey] | None,
    ) -> None:
        """One note's entries into the young generation (``note``); ``raw``: its tokens
        packed, ``size`` per key (empty: none given)."""
        step = size * 4
        # Every list below is made in C (slices, ``map``, ``itemgetter``): no Python step per
        # key. The keys stored are most often the offer's tail (its head was resident).
        first, count = 0, len(keys)
        noted: Sequence[BlockKey] = keys
        picked: itemgetter[Any] | None = None
        if stored is not None and len(stored) < count:
            first, noted = count - len(stored), stored
            if list(keys[first:]) != list(stored):
                index = dict(zip(keys, range(count), strict=True))
                picked = itemgetter(*map(index.__getitem__, stored))
                first = 0
        if not noted:
            return
        parents: list[BlockKey | None] = [keys[first - 1] if first else parent]
        parents += keys[first : count - 1]
        tokens: Any = itertools.repeat(b"")
        if raw:
            bounds = range(first * step, len(raw) + 1, step)
            tokens = map(raw.__getitem__, map(slice, bounds, bounds[1:]))
        if picked is not None:
            tokens = _pick(picked, list(tokens)) if raw else tokens
            parents = _pick(picked, parents)
        values = zip(tokens, itertools.repeat(size if raw else 0), parents)
        entries: Iterator[tuple[BlockKey, _Entry]] = zip(noted, values, strict=True)
        cap = self.capacity
        if len(noted) > cap:  # only the newest ``cap`` of one call
            entries = itertools.islice(entries, len(noted) - cap, None)
        young = self._young
        if len(young) + min(len(noted), cap) > cap:
            self._old, self._young = young, {}
            young = self._young
        young.update(entries)


def wire_events(events: Sequence[KVEvent], meta: BlockMetadata | None) -> list[WireEvent]:
    """The router events for pull-feed ``events`` (see the module docstring)."""
    out: list[WireEvent] = []
    for event in events:
        if isinstance(event, AllBlocksCleared):
            out.append(("AllBlocksCleared",))
        elif isinstance(event, BlockRemoved):
            out.append(("BlockRemoved", _hashes(event.block_hashes), router_medium(event.medium)))
        else:
            out.extend(_stored(event, meta))
    return out


def _hashes(keys: Sequence[BlockKey]) -> list[int]:
    """``hash64`` of each key: for keys of one length, a multiple of 8 bytes (an engine's
    keys are), one ``struct`` call over them all takes every key's last 8 bytes."""
    if keys:
        size = len(keys[0])
        if size % 8 == 0 and size and len(set(map(len, keys))) == 1:
            # Skip each key's leading bytes, unpack its last 8 (``struct`` caches the format).
            skip = f"{size - 8}x" if size > 8 else ""
            return list(struct.unpack(">" + f"{skip}Q" * len(keys), b"".join(keys)))
    return [int.from_bytes(k, "big") & _MASK64 for k in keys]


def _stored(event: BlockStored, meta: BlockMetadata | None) -> list[WireEvent]:
    medium = router_medium(event.medium)
    keys = event.block_hashes
    entries = [] if meta is None else meta.entries(keys)
    if not entries:
        return [("BlockStored", _hashes(keys), None, [], 0, None, medium, None)]
    # The common case, one chain: every key described, each one's parent the key before it,
    # one block size; checked with list operations rather than key by key.
    if None not in entries:
        described = cast("list[_Entry]", entries)
        parents = [e[2] for e in described[1:]]
        if parents == list(keys[:-1]) and len({e[1] for e in described}) == 1:
            return [_run(keys, described, medium)]
    # Runs of keys that are chains (each key's parent the key before it, one block size),
    # one BlockStored each; keys without an entry form runs of their own.
    out: list[WireEvent] = []
    start = 0
    for pos in range(1, len(keys) + 1):
        if pos < len(keys):
            before, cur = entries[pos - 1], entries[pos]
            if before is None and cur is None:
                continue
            if (
                before is not None
                and cur is not None
                and cur[2] == keys[pos - 1]
                and cur[1] == before[1]
            ):
                continue
        if entries[start] is None:
            out.append(("BlockStored", _hashes(keys[start:pos]), None, [], 0, None, medium, None))
        else:
            run = cast("list[_Entry]", entries[start:pos])
            out.append(_run(keys[start:pos], run, medium))
        start = pos
    return out


def _run(keys: Sequence[BlockKey], entries: list[_Entry], medium: str) -> WireEvent:
    """One ``BlockStored`` for ``keys``, a chain every one of whose keys has its entry."""
    tokens = _words(b"".join([entry[0] for entry in entries]))
    first = entries[0]
    parent = None if first[2] is None else hash64(first[2])
    return ("BlockStored", _hashes(keys), parent, tokens, first[1], None, medium, None)


def as_map(event: WireEvent) -> dict[str, Any]:
    """vLLM's tagged-map form of one event (``type`` first, then its fields)."""
    return {"type": event[0], **dict(zip(_FIELDS[event[0]], event[1:], strict=True))}


def first_seq() -> int:
    """The sequence number of a new publisher's first batch: now, in microseconds since the
    epoch (above any earlier process's numbers unless the clock went back, or one sent a
    million batches a second)."""
    return time.time_ns() // 1000


def load_modules() -> tuple[Any, Any]:
    """``(zmq, msgpack)``; a ``ConfigError`` naming the extra when either is missing."""
    try:
        return importlib.import_module("zmq"), importlib.import_module("msgpack")
    except ImportError as exc:
        raise config_error(
            "kv_events_endpoint",
            None,
            f"needs {exc.name}, not installed; accepted: install the events extra "
            f"(pip install '{EXTRA}'), or leave KV events off",
        ) from None


class _Batch(NamedTuple):
    """One batch waiting for its window's flush: the pull feed's events, with their
    namespace's metadata."""

    topic: bytes
    ts: float
    events: Sequence[KVEvent]
    meta: BlockMetadata | None


class PublisherCounts(NamedTuple):
    """What the publisher has done, for metrics: events sent and dropped (queue full),
    replay requests answered."""

    published: int
    dropped: int
    replays: int


class KVEventPublisher:
    """The process's KV-event publisher; see the module docstring.

    ``start()`` binds both sockets (a ``ConfigError`` naming the setting when one cannot be
    bound) and starts the replay thread; ``close()`` sends what is queued, stops the thread
    and closes the sockets. ``sink(namespace)`` is what a namespace's service calls with its
    events, on the loop. Before ``start`` batches only queue.
    """

    def __init__(self, settings: Settings, *, socket_mode: int = 0o600) -> None:
        """``socket_mode``: the file mode (and with ``settings.uds_group`` the group, when it
        is not 0600) of ``ipc://`` sockets. The caller decides it from the tenants rule."""
        if settings.kv_events_endpoint is None:
            raise ValueError("KV events are off (no kv_events_endpoint)")
        self._zmq, self._msgpack = load_modules()
        self.settings = settings
        self.endpoint = settings.kv_events_endpoint
        self.replay_endpoint = settings.kv_events_replay_endpoint
        self.node = settings.kv_events_node or socket.gethostname()
        self._array = settings.kv_events_format == "array"
        self._socket_mode = socket_mode
        # The window's batches, and the loop whose timer will flush them (None: none set).
        self._pending: deque[_Batch] = deque()
        self._capacity = settings.kv_events_queue_batches
        self._flush_loop: asyncio.AbstractEventLoop | None = None
        # The loop ``start`` ran on: another thread's batches are handed to it.
        self._loop: asyncio.AbstractEventLoop | None = None
        self._replay_buffer: deque[tuple[int, bytes, bytes]] = deque(
            maxlen=settings.kv_events_replay_batches
        )
        self._pack = self._msgpack.Packer(use_bin_type=True)
        self._ctx: Any = None
        self._pub: Any = None
        self._replay: Any = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._seq = first_seq()
        # Written by the loop (replays: by the replay thread); read at scrape time. Each has
        # one writer, and an int store is atomic under the GIL.
        self._published = 0
        self._dropped = 0
        self._unsent = 0
        self._replays = 0
        # Namespaces given a sink in this process, and whether the ones of its start are in.
        self._namespaces: set[str] = set()
        self._started = False

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Bind the sockets and start sending; a ``ConfigError`` if an address is taken."""
        zmq = self._zmq
        self._ctx = zmq.Context()
        try:
            self._pub = self._ctx.socket(zmq.PUB)
            self._pub.setsockopt(zmq.LINGER, 0)
            self._bind(self._pub, "kv_events_endpoint", self.endpoint)
            if self.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                # A whole replay and its end marker fit, as vLLM sizes it.
                self._replay.setsockopt(
                    zmq.SNDHWM, 2 * (self.settings.kv_events_replay_batches + 1)
                )
                self._bind(self._replay, "kv_events_replay_endpoint", self.replay_endpoint)
        except BaseException:
            self._close_sockets()
            raise
        with contextlib.suppress(RuntimeError):
            self._loop = asyncio.get_running_loop()
        if self._pending:  # queued before the start
            self._schedule()
        if self._replay is not None:
            self._thread = threading.Thread(
                target=self._run_replays, name="kvoffload-kv-events-replay", daemon=True
            )
            self._thread.start()
        log.info(
            "KV events published",
            extra={
                "fields": {
                    "endpoint": self.endpoint,
                    "replay_endpoint": self.replay_endpoint,
                    "topic": self.settings.kv_events_topic,
                    "format": self.settings.kv_events_format,
                }
            },
        )

    def _bind(self, sock: Any, field: str, endpoint: str) -> None:
        try:
            sock.bind(endpoint)
        except self._zmq.ZMQError as exc:
            raise config_error(field, endpoint, f"cannot be bound ({exc})") from None
        if endpoint.startswith("ipc://"):
            path = Path(endpoint.removeprefix("ipc://"))
            os.chmod(path, self._socket_mode)
            group = self.settings.uds_group
            if group is not None and self._socket_mode != 0o600:
                import grp

                gid = int(group) if group.isdigit() else grp.getgrnam(group).gr_gid
                os.chown(path, -1, gid)

    def close(self) -> None:
        """Send what is still queued, stop the replay thread and close the sockets.
        Idempotent; a flush whose timer fires later finds nothing to do."""
        if self._pub is not None:
            self._flush(budget=None)
        self._dropped += sum(len(batch.events) for batch in self._pending)  # never started
        self._pending.clear()
        self._flush_loop = None
        thread, self._thread = self._thread, None
        if thread is not None:
            self._stopping.set()
            thread.join(timeout=2.0)
            if thread.is_alive():  # still using its socket: leave it to the process's end
                log.warning("KV event replay thread did not stop; its socket is left open")
                self._replay = None
        self._close_sockets()

    def _close_sockets(self) -> None:
        # The last window was just sent: let ZMQ pass it on for a moment, not wait for a
        # subscriber that reads nothing.
        for sock, linger_ms in ((self._pub, _CLOSE_LINGER_MS), (self._replay, 0)):
            if sock is not None:
                sock.close(linger=linger_ms)
        self._pub = self._replay = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    # ------------------------------------------------------------------ the loop's side

    def topic(self, namespace: str) -> bytes:
        """The topic of ``namespace``'s batches (``kv_events_topic``)."""
        return self.settings.kv_events_topic.format(namespace=namespace, node=self.node).encode()

    def sink(self, namespace: str, meta: BlockMetadata | None) -> EventSink:
        """What ``namespace``'s service calls with the events it drains; ``meta``: its
        engines' word on its blocks.

        A stream opens with the service's ``AllBlocksCleared``, except that of a namespace
        first seen after ``started`` (one a tenants reload adds): its pool is new, no router
        holds anything of it from this process, and a router that indexes the node as one
        instance (Dynamo) would forget every other namespace's blocks at that clear. A
        namespace this process served before (removed or moved, then added again) keeps its
        opening clear: routers may still hold its old blocks. The opening clear is the one
        numbered 0 (``Service.start``'s), wherever it comes: events drained before the start
        cannot let it through."""
        topic = self.topic(namespace)
        drop_opening = self._started and namespace not in self._namespaces
        self._namespaces.add(namespace)

        def offer(events: Sequence[KVEvent]) -> None:
            nonlocal drop_opening
            if drop_opening:
                kept = [e for e in events if not (isinstance(e, AllBlocksCleared) and e.seq == 0)]
                if len(kept) < len(events):
                    drop_opening = False
                    events = kept
                    if not events:
                        return
            self._put(_Batch(topic, time.time(), events, meta))

        return offer

    def started(self) -> None:
        """The namespaces of the process's start have their sinks: a namespace given one
        from now on is new to the routers (``sink``)."""
        self._started = True

    def _put(self, batch: _Batch) -> None:
        """Queue one batch for the window's flush, never waiting: a full queue drops it
        (counted). The window's first batch sets the flush's timer on the running loop.
        Outside a loop: from another thread while the loop ``start`` ran on runs, the batch
        is handed to that loop; otherwise (no loop at all) it goes out at once."""
        if not batch.events:
            return
        try:
            loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
            home = self._loop
            if home is not None and home.is_running():
                home.call_soon_threadsafe(self._put, batch)
                return
        pending = self._pending
        if len(pending) >= self._capacity:
            self._dropped += len(batch.events)
            return
        pending.append(batch)
        if self._pub is not None:
            self._schedule(loop)

    def _schedule(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """See that the queued batches go out: a timer on ``loop`` unless one is set there
        already (a timer left on a loop that has ended does not count), or at once without
        a loop."""
        if loop is None:
            with contextlib.suppress(RuntimeError):
                loop = asyncio.get_running_loop()
        if loop is None:
            self._flush(budget=None)
        elif self._flush_loop is not loop:
            self._flush_loop = loop
            loop.call_later(COALESCE_S, self._flush_turn)

    def _flush_turn(self) -> None:
        """The window's timer: send up to ``FLUSH_KEYS`` keys of it, the rest next turn."""
        self._flush_loop = None
        if self._pub is None:  # closed meanwhile: ``close`` sent the queue
            return
        self._flush(budget=FLUSH_KEYS)
        if self._pending:
            loop = asyncio.get_running_loop()
            self._flush_loop = loop
            loop.call_soon(self._flush_turn)

    def counts(self) -> PublisherCounts:
        """Events sent and dropped so far, replay requests answered."""
        return PublisherCounts(self._published, self._dropped + self._unsent, self._replays)

    # ------------------------------------------------------------------ sending

    def _flush(self, budget: int | None) -> None:
        """Convert, encode and send the queued batches, consecutive batches of one topic as
        one message (the first one's time stamp), until ``budget`` keys are sent (None: all).
        A batch that fails is lost, its events counted dropped; the next one goes on."""
        for batch in self._window(budget):
            try:
                self._send(batch.topic, batch.ts, wire_events(batch.events, batch.meta))
            except Exception:
                self._unsent += len(batch.events)
                log.exception("KV event batch not sent")

    def _window(self, budget: int | None) -> list[_Batch]:
        """The batches queued, in order, merged by topic, while their keys fit ``budget``
        (the first always taken). One list per run of one topic, extended in place."""
        pending, merged = self._pending, list[_Batch]()
        keys = 0
        while pending and (budget is None or keys < budget):
            batch = pending.popleft()
            keys += sum(len(getattr(e, "block_hashes", ())) for e in batch.events)
            last = merged[-1] if merged else None
            if last is not None and last.topic == batch.topic and last.meta is batch.meta:
                cast("list[KVEvent]", last.events).extend(batch.events)
            else:
                merged.append(batch._replace(events=list(batch.events)))
        return merged

    def _send(self, topic: bytes, ts: float, events: list[WireEvent]) -> None:
        body = [list(e) for e in events] if self._array else [as_map(e) for e in events]
        payload = self._pack.pack([ts, body, 0])
        seq = self._seq.to_bytes(8, "big")
        # Counted and kept before it is sent: a subscriber that got it finds it counted.
        self._published += len(events)
        self._replay_buffer.append((self._seq, topic, payload))
        self._seq += 1
        # NOBLOCK: PUB never blocks (past its high-water mark ZMQ drops per subscriber).
        self._pub.send_multipart((topic, seq, payload), flags=self._zmq.NOBLOCK)

    # ------------------------------------------------------------------ the replay thread

    def _run_replays(self) -> None:
        poll_ms = int(_POLL_S * 1000)
        while not self._stopping.is_set():
            try:
                if self._replay.poll(poll_ms):
                    self._serve_replays()
            except Exception:
                if self._stopping.is_set():
                    return
                log.exception("KV event replay request not answered")
                self._stopping.wait(_POLL_S)  # a socket that keeps failing: not a busy loop

    def _serve_replays(self) -> None:
        zmq = self._zmq
        while self._replay.poll(0):
            frames = self._replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                # Unanswered, as vLLM's publisher leaves it; debug only: any local process
                # may send these, and a warning each would let it flood the log.
                log.debug("malformed KV event replay request ignored")
                continue
            client, _, start = frames
            start_seq = int.from_bytes(start, "big")
            # Counted before it is answered: a client that read its end marker finds it counted.
            self._replays += 1
            with contextlib.suppress(zmq.Again):
                for seq, topic, payload in list(self._replay_buffer):
                    if seq >= start_seq:
                        self._replay.send_multipart(
                            (client, b"", topic, seq.to_bytes(8, "big"), payload),
                            flags=zmq.NOBLOCK,
                        )
                self._replay.send_multipart((client, b"", b"", END_SEQ, b""), flags=zmq.NOBLOCK)
