"""The KV-event publisher (app/core/kv_publisher.py): router events from the pull feed's,
vLLM 0.33's framing on real ZMQ sockets on 127.0.0.1, replay, drops, and its settings."""

from __future__ import annotations

import asyncio
import importlib
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq

from app.core.kv_publisher import (
    END_SEQ,
    BlockInfo,
    BlockMetadata,
    KVEventPublisher,
    hash64,
    wire_events,
)
from app.settings import ConfigError, Settings, load_settings
from manager import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from testsupport.ports import free_port
from testsupport.server import ROOT

K = [bytes([i]) * 32 for i in range(1, 7)]
RECV_MS = 5000


def test_hash_is_the_low_64_bits_big_endian_as_vllm_sends_it():
    key = bytes(range(32))
    assert hash64(key) == int.from_bytes(key, "big") & (2**64 - 1)
    assert hash64(b"\x01") == 1
    assert hash64(b"\xff" * 64) == 2**64 - 1


@pytest.mark.parametrize("sizes", [[16] * 5, [32] * 3, [8, 8], [12] * 4, [16, 32, 16], [1]])
def test_hashes_of_keys_of_any_length_are_their_low_64_bits(sizes):
    keys = [bytes((i * 37 + j) % 256 for j in range(n)) for i, n in enumerate(sizes)]
    (event,) = wire_events([BlockRemoved(1, keys)], None)
    assert event[1] == [hash64(k) for k in keys]


def test_media_map_to_names_routers_index():
    events: list[KVEvent] = [
        BlockStored(1, [K[0]], "CPU"),
        BlockStored(2, [K[0]], "DISK"),
        BlockStored(3, [K[0]], "REMOTE"),
        BlockRemoved(4, [K[0]], "OBJECT"),
        AllBlocksCleared(5),
    ]
    out = wire_events(events, None)
    assert [e[0] for e in out] == ["BlockStored"] * 3 + ["BlockRemoved", "AllBlocksCleared"]
    assert [out[0][6], out[1][6], out[2][6], out[3][2]] == ["CPU", "DISK", "REMOTE", "STORAGE"]


def test_keys_no_engine_described_go_out_as_one_event_with_hashes_only():
    (event,) = wire_events([BlockStored(1, K[:3])], BlockMetadata(8))
    assert event == ("BlockStored", [hash64(k) for k in K[:3]], None, [], 0, None, "CPU", None)


def test_metadata_gives_tokens_and_parent_and_splits_runs_that_are_not_chains():
    meta = BlockMetadata(16)
    meta.note(K[:2], [1, 2, 3, 4], 2, None)  # K0 <- K1
    meta.note(K[3:5], [7, 8, 9, 10], 2, K[2])  # K2 <- K3 <- K4 (K2 undescribed)
    out = wire_events([BlockStored(1, [K[0], K[1], K[3], K[4], K[5]])], meta)
    assert out == [
        ("BlockStored", [hash64(K[0]), hash64(K[1])], None, [1, 2, 3, 4], 2, None, "CPU", None),
        (
            "BlockStored",
            [hash64(K[3]), hash64(K[4])],
            hash64(K[2]),
            [7, 8, 9, 10],
            2,
            None,
            "CPU",
            None,
        ),
        ("BlockStored", [hash64(K[5])], None, [], 0, None, "CPU", None),
    ]
    # A tier's event about the same keys carries the same metadata.
    (disk,) = wire_events([BlockStored(2, K[:2], "DISK")], meta)
    assert disk[3] == [1, 2, 3, 4]
    assert disk[6] == "DISK"


def test_a_parent_alone_links_the_run_and_noting_again_replaces():
    meta = BlockMetadata(8)
    meta.note(K[:2], None, None, K[5])
    (event,) = wire_events([BlockStored(1, K[:2])], meta)
    assert event == (
        "BlockStored",
        [hash64(K[0]), hash64(K[1])],
        hash64(K[5]),
        [],
        0,
        None,
        "CPU",
        None,
    )
    meta.note(K[1:2], [9, 9], 2, None)  # K1 again, now the head of its own prompt
    first, second = wire_events([BlockStored(2, K[:2])], meta)
    assert first[1:5] == ([hash64(K[0])], hash64(K[5]), [], 0)
    assert second[1:5] == ([hash64(K[1])], None, [9, 9], 2)


def test_only_the_keys_a_call_stores_are_noted_with_parents_from_the_whole_chain():
    meta = BlockMetadata(8)
    meta.note(K[:4], [1, 1, 2, 2, 3, 3, 4, 4], 2, K[5], stored=[K[2], K[3]])
    assert meta.get(K[0]) is None
    assert meta.get(K[1]) is None
    assert meta.get(K[2]) == BlockInfo((3, 3), 2, K[1])
    assert meta.get(K[3]) == BlockInfo((4, 4), 2, K[2])
    meta.note(K[:1], [7, 7], 2, None, stored=[])
    assert len(meta) == 2


def test_stored_keys_that_are_not_the_offers_tail_get_their_own_tokens_and_parents():
    meta = BlockMetadata(8)
    meta.note(K[:4], [1, 1, 2, 2, 3, 3, 4, 4], 2, K[5], stored=[K[3], K[0]])
    assert meta.get(K[0]) == BlockInfo((1, 1), 2, K[5])
    assert meta.get(K[3]) == BlockInfo((4, 4), 2, K[2])
    assert meta.get(K[1]) is None
    meta.note(K[:3], None, None, None, stored=[K[1]])  # one key picked, no tokens
    assert meta.get(K[1]) == BlockInfo((), 0, K[0])
    meta.note(K[4:5], None, 16, None)  # a block size without tokens says nothing of them
    assert meta.get(K[4]) == BlockInfo((), 0, None)


def test_metadata_keeps_at_least_the_newest_capacity_keys_and_at_most_twice_that():
    meta = BlockMetadata(2)
    meta.note(K[:3], None, None, K[5])  # one call over the capacity: its newest two
    assert len(meta) == 2
    assert meta.get(K[0]) is None
    info = meta.get(K[2])
    assert info is not None
    assert info.parent == K[1]
    assert info.token_ids == ()
    for i in range(3, 8):  # one key a call: the young generation fills, then turns old
        meta.note([K[i % len(K)]], [i, i], 2, None)
        newest = [K[j % len(K)] for j in (i - 1, i)]
        assert all(meta.get(k) is not None for k in newest)
        assert len(meta) <= 4
    assert meta.get(K[3]) is None  # forgotten with its generation
    with pytest.raises(ValueError, match="positive"):
        BlockMetadata(0)


def test_a_key_noted_again_in_a_later_generation_takes_its_new_word():
    meta = BlockMetadata(2)
    meta.note(K[:1], [1, 1], 2, None)
    meta.note(K[1:3], [2, 2, 3, 3], 2, K[0])  # K0's generation turns old
    meta.note(K[:1], [9, 9], 2, K[4])  # K0 again, in the young one
    assert meta.get(K[0]) == BlockInfo((9, 9), 2, K[4])
    (event,) = wire_events([BlockStored(1, K[:1])], meta)
    assert event[2:5] == (hash64(K[4]), [9, 9], 2)


def settings(tmp_path: Path, **kw: Any) -> Settings:
    return Settings(
        kv_events_endpoint=f"tcp://127.0.0.1:{free_port()}",
        kv_events_replay_endpoint=f"tcp://127.0.0.1:{free_port()}",
        kv_events_node="node-a",
        **kw,
    )


class Sockets:
    """A ZMQ context whose sockets the test closes at its end."""

    def __init__(self) -> None:
        self.context = zmq.Context()
        self.made: list[zmq.Socket[bytes]] = []

    def socket(self, kind: int) -> zmq.Socket[bytes]:
        sock = self.context.socket(kind)
        self.made.append(sock)
        return sock

    def close(self) -> None:
        for sock in self.made:
            sock.close(linger=0)
        self.context.term()


@pytest.fixture
def ctx():
    sockets = Sockets()
    yield sockets
    sockets.close()


def subscriber(ctx: Sockets, endpoint: str) -> zmq.Socket[bytes]:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVTIMEO, RECV_MS)
    sub.connect(endpoint)
    return sub


def publish_until_received(pub: KVEventPublisher, sub: zmq.Socket[bytes]) -> list[bytes]:
    """Offer a marker batch until the subscriber has joined (ZMQ drops what a PUB sends before
    a subscription reaches it), then answer the first frames it got."""
    warmup = pub.sink("warmup", None)
    for _ in range(100):
        warmup([AllBlocksCleared(0)])
        if sub.poll(100):
            return sub.recv_multipart()
    raise AssertionError("the subscriber never joined")


def test_batches_go_out_in_vllm_framing_and_replay_answers_from_a_seq(tmp_path, ctx):
    before = time.time_ns() // 1000
    pub = KVEventPublisher(settings(tmp_path, kv_events_topic="kv@{node}@{namespace}"))
    pub.start()
    try:
        sub = subscriber(ctx, pub.endpoint)
        first = publish_until_received(pub, sub)
        assert first[0] == b"kv@node-a@warmup"
        meta = BlockMetadata(8)
        meta.note(K[:1], [5, 6], 2, None)
        pub.sink("llama", meta)([BlockStored(9, K[:1]), BlockRemoved(10, K[:1])])
        while True:  # skip the warm-up markers still in flight
            topic, seq, payload = sub.recv_multipart()
            if topic == b"kv@node-a@llama":
                break
        number = int.from_bytes(seq, "big")
        assert len(seq) == 8
        # Numbers count from the publisher's start in microseconds (restarts count higher).
        assert number > before
        ts, events, dp_rank = msgpack.unpackb(payload)
        assert abs(ts - time.time()) < 60
        assert dp_rank == 0
        assert events == [
            {
                "type": "BlockStored",
                "block_hashes": [hash64(K[0])],
                "parent_block_hash": None,
                "token_ids": [5, 6],
                "block_size": 2,
                "lora_id": None,
                "medium": "CPU",
                "lora_name": None,
            },
            {"type": "BlockRemoved", "block_hashes": [hash64(K[0])], "medium": "CPU"},
        ]
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.RCVTIMEO, RECV_MS)
        dealer.connect(pub.replay_endpoint)
        dealer.send_multipart([b"", number.to_bytes(8, "big")])
        replayed = []
        while True:
            frames = dealer.recv_multipart()
            if frames[2] == END_SEQ:
                assert frames == [b"", b"", END_SEQ, b""]
                break
            replayed.append(frames)
        assert replayed == [[b"", topic, seq, payload]]
        # From 0: every batch kept, in order.
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        seqs = []
        while (frames := dealer.recv_multipart())[2] != END_SEQ:
            seqs.append(int.from_bytes(frames[2], "big"))
        assert seqs == list(range(seqs[0], number + 1))
        assert seqs[0] >= before
        assert pub.counts().replays == 2
        assert pub.counts().published == len(seqs) + 1  # the last batch held two events
    finally:
        pub.close()


def test_batches_of_one_window_go_out_as_one_message_per_topic_in_order(tmp_path, ctx, monkeypatch):
    """On the loop, the calls of one coalescing window cost one conversion and one message
    per topic: a topic's consecutive batches merged in order, another topic's between them
    kept apart, and metadata noted after a batch was offered still read when it is sent."""
    import app.core.kv_publisher as kv_publisher

    pub = KVEventPublisher(settings(tmp_path))
    pub.start()
    try:
        sub = subscriber(ctx, pub.endpoint)
        publish_until_received(pub, sub)
        monkeypatch.setattr(kv_publisher, "COALESCE_S", 0.3)  # the calls below fit in it
        meta = BlockMetadata(8)
        a, b = pub.sink("a", meta), pub.sink("b", None)

        async def offer() -> int:
            a([BlockStored(1, K[:1])])
            a([BlockRemoved(2, K[:1])])
            b([BlockStored(3, K[1:2])])
            a([BlockStored(4, K[2:3])])
            meta.note(K[:1], [7], 1, None)  # noted before the window ends: the event carries it
            sent = pub.counts().published  # nothing goes out before the window's end
            await asyncio.sleep(0.6)
            return sent

        before = pub.counts().published  # the warm-up markers
        assert asyncio.run(offer()) == before
        got: list[tuple[bytes, list[Any]]] = []
        tokens: list[Any] = []
        while len(got) < 3:
            topic, _, payload = sub.recv_multipart()
            if topic != b"warmup":
                events = msgpack.unpackb(payload)[1]
                got.append((topic, [(e["type"], e["block_hashes"]) for e in events]))
                tokens.append(events[0].get("token_ids"))
        assert tokens[0] == [7]
        assert got == [
            (b"a", [("BlockStored", [hash64(K[0])]), ("BlockRemoved", [hash64(K[0])])]),
            (b"b", [("BlockStored", [hash64(K[1])])]),
            (b"a", [("BlockStored", [hash64(K[2])])]),
        ]
    finally:
        pub.close()


def test_a_window_larger_than_a_turn_goes_out_over_several_turns_in_order(
    tmp_path, ctx, monkeypatch
):
    """A flood's window is sent ``FLUSH_KEYS`` keys a loop turn: other callbacks run between
    its messages, and every event still goes out once, in order."""
    import app.core.kv_publisher as kv_publisher

    monkeypatch.setattr(kv_publisher, "FLUSH_KEYS", 4)
    pub = KVEventPublisher(settings(tmp_path))
    pub.start()
    try:
        sub = subscriber(ctx, pub.endpoint)
        publish_until_received(pub, sub)
        sink = pub.sink("big", None)
        keys = [bytes([i]) * 32 for i in range(1, 13)]
        base = pub.counts().published  # the warm-up markers
        turns: list[int] = []

        async def flood() -> None:
            for i in range(0, 12, 2):
                sink([BlockStored(i, keys[i : i + 2])])
            loop = asyncio.get_running_loop()
            # A callback per turn while the window goes out: it must run between its messages.
            end = loop.time() + kv_publisher.COALESCE_S + 0.5
            while loop.time() < end:
                turns.append(pub.counts().published)
                await asyncio.sleep(0)

        asyncio.run(flood())
        hashes: list[int] = []
        while len(hashes) < 12:
            topic, _, payload = sub.recv_multipart()
            if topic == b"big":
                for event in msgpack.unpackb(payload)[1]:
                    hashes.extend(event["block_hashes"])
        assert hashes == [hash64(k) for k in keys]
        # Two batches (4 keys) a turn: the counts seen between turns went up 4 at a time,
        # never all 6 events in one turn.
        assert {base + n for n in (0, 2, 4, 6)} <= set(turns)
        sink([BlockRemoved(99, keys[:1])])  # outside a loop: at once
        assert pub.counts().published == base + 7
    finally:
        pub.close()


def test_close_sends_a_window_whose_timer_has_not_fired(tmp_path, ctx):
    pub = KVEventPublisher(settings(tmp_path))
    pub.start()
    sub = subscriber(ctx, pub.endpoint)
    publish_until_received(pub, sub)
    base = pub.counts().published

    async def offer_and_close() -> None:
        pub.sink("m", None)([BlockStored(1, K[:1])])
        assert pub.counts().published == base  # waiting for its window
        pub.close()

    asyncio.run(offer_and_close())
    assert pub.counts().published == base + 1
    while (frames := sub.recv_multipart())[0] != b"m":
        pass
    assert msgpack.unpackb(frames[2])[1][0]["block_hashes"] == [hash64(K[0])]


def test_batches_queued_before_start_go_out_after_it_and_a_timer_of_an_ended_loop_holds_none(
    tmp_path, ctx
):
    pub = KVEventPublisher(settings(tmp_path))
    sink = pub.sink("m", None)
    sink([BlockStored(1, K[:1])])  # not started: queued
    assert pub.counts().published == 0

    async def start_and_end() -> None:
        pub.start()  # the queue's timer is set on this loop, which ends before it fires

    asyncio.run(start_and_end())
    try:
        assert pub.counts().published == 0
        sink([BlockRemoved(2, K[:1])])  # outside a loop: at once, behind the queued batch
        assert pub.counts().published == 2
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.RCVTIMEO, RECV_MS)
        dealer.connect(pub.replay_endpoint)
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        events = []
        while (frames := dealer.recv_multipart())[2] != END_SEQ:
            events += [e["type"] for e in msgpack.unpackb(frames[3])[1]]
        assert events == ["BlockStored", "BlockRemoved"]
    finally:
        pub.close()


def test_a_note_that_stores_nothing_is_not_kept_and_a_bad_note_is_skipped(caplog):
    meta = BlockMetadata(8)
    meta.note(K[:2], [1, 2], 1, None, stored=[])  # every key resident
    assert meta.get(K[0]) is None
    meta.note(K[:2], None, None, K[5])
    meta._notes.append((K[2:3], b"\x00", 4, None, None))  # tokens not a whole block: fails
    meta.note(K[3:4], [9], 1, None)
    assert meta.get(K[3]) == BlockInfo((9,), 1, None)  # the later note still applied
    assert meta.get(K[0]) == BlockInfo((), 0, K[5])
    assert meta.get(K[2]) is None
    assert "KV event metadata note skipped" in caplog.text


def test_array_format_for_llm_d(tmp_path, ctx):
    pub = KVEventPublisher(settings(tmp_path, kv_events_format="array"))
    pub.start()
    try:
        sub = subscriber(ctx, pub.endpoint)
        publish_until_received(pub, sub)
        pub.sink("m", None)([BlockStored(1, K[:1], "OBJECT")])
        while (frames := sub.recv_multipart())[0] != b"m":
            pass
        _, events, _ = msgpack.unpackb(frames[2])
        assert events == [["BlockStored", [hash64(K[0])], None, [], 0, None, "STORAGE", None]]
    finally:
        pub.close()


def test_a_namespace_a_reload_adds_opens_without_a_clear_one_served_before_with_one(tmp_path, ctx):
    pub = KVEventPublisher(settings(tmp_path))
    pub.start()
    try:
        sub = subscriber(ctx, pub.endpoint)
        publish_until_received(pub, sub)
        at_start = pub.sink("a1", None)
        pub.started()
        added = pub.sink("b1", None)  # new: its opening clear would wipe a1 in Dynamo
        again = pub.sink("a1", None)  # a1 removed and added again: routers may hold its blocks
        at_start([AllBlocksCleared(0)])
        added([AllBlocksCleared(0)])
        added([BlockStored(1, K[:1])])
        added([AllBlocksCleared(2)])  # a later clear (an operator's) goes out
        again([AllBlocksCleared(0)])
        late = pub.sink("c1", None)  # added too, its stores drained before its start's clear
        late([BlockStored(1, K[:1])])
        late([AllBlocksCleared(0)])
        pub.sink("end", None)([BlockStored(3, K[:1])])
        seen: dict[bytes, list[str]] = {}
        while True:
            topic, _seq, payload = sub.recv_multipart()
            if topic == b"end":
                break
            if topic != b"warmup":
                _ts, events, _rank = msgpack.unpackb(payload)
                seen.setdefault(topic, []).extend(e["type"] for e in events)
        assert seen == {
            b"a1": ["AllBlocksCleared", "AllBlocksCleared"],
            b"b1": ["BlockStored", "AllBlocksCleared"],
            b"c1": ["BlockStored"],
        }
    finally:
        pub.close()


def test_a_full_queue_drops_and_counts_without_waiting(tmp_path):
    pub = KVEventPublisher(settings(tmp_path, kv_events_queue_batches=1))  # not started
    sink = pub.sink("m", None)
    sink([BlockStored(1, K[:2])])
    sink([BlockRemoved(2, K[:2]), AllBlocksCleared(3)])  # queue full: dropped at once
    assert pub.counts().dropped == 2
    assert pub.counts().published == 0
    pub.close()


def test_an_address_in_use_is_a_config_error_naming_the_setting(tmp_path):
    first = KVEventPublisher(settings(tmp_path))
    first.start()
    try:
        s = Settings(kv_events_endpoint=first.endpoint)
        with pytest.raises(ConfigError, match=r"--kv-events-endpoint .*cannot be bound"):
            KVEventPublisher(s).start()
    finally:
        first.close()


def test_ipc_sockets_get_the_mode_asked(tmp_path, ctx):
    path = tmp_path / "events.sock"
    pub = KVEventPublisher(Settings(kv_events_endpoint=f"ipc://{path}"), socket_mode=0o600)
    pub.start()
    try:
        assert path.stat().st_mode & 0o777 == 0o600
        sub = subscriber(ctx, f"ipc://{path}")
        assert publish_until_received(pub, sub)[0] == b"warmup"
    finally:
        pub.close()


def test_missing_extra_is_refused_naming_it(monkeypatch):
    real = importlib.import_module

    def without_zmq(name: str, package: str | None = None):
        if name == "zmq":
            raise ModuleNotFoundError("No module named 'zmq'", name="zmq")
        return real(name, package)

    monkeypatch.setattr("importlib.import_module", without_zmq)
    with pytest.raises(ConfigError, match=r"needs zmq.*pip install 'kvoffload\[events\]'"):
        KVEventPublisher(Settings(kv_events_endpoint="tcp://127.0.0.1:5557"))


EP = "kv_events_endpoint"


@pytest.mark.parametrize(
    ("given", "refusal"),
    [
        ({EP: "tcp://0.0.0.0:5557"}, "--kv-events-endpoint .*not a loopback address"),
        ({EP: "tcp://10.1.2.3:5557"}, "not a loopback address"),
        ({EP: "tcp://127.0.0.1:0"}, "no port 1..65535"),
        ({EP: "udp://127.0.0.1:5"}, "neither tcp:// nor ipc://"),
        ({EP: "ipc://relative"}, "not an absolute path"),
        ({"kv_events_replay_endpoint": "tcp://127.0.0.1:5558"}, "without --kv-events-endpoint"),
        (
            {EP: "tcp://127.0.0.1:5557", "kv_events_replay_endpoint": "tcp://127.0.0.1:5557"},
            "the publisher's own address",
        ),
        ({"kv_events_topic": "kv@{pod}"}, r"unknown field \{pod\}"),
        ({"kv_events_topic": "kv@{node"}, "accepted: text with"),
        ({"kv_events_tenant": "acme"}, "without --tenants"),
        ({"kv_events_queue_batches": 0}, "kv-events-queue-batches"),
    ],
)
def test_settings_refusals(given, refusal):
    with pytest.raises(ConfigError, match=refusal):
        load_settings(**given)


def test_off_by_default_and_loopback_forms_accepted():
    assert Settings().kv_events_endpoint is None
    for endpoint in ("tcp://127.0.0.1:5557", "tcp://[::1]:5557", "tcp://localhost:1"):
        assert Settings(kv_events_endpoint=endpoint).kv_events_endpoint == endpoint


def test_with_tenants_only_ipc(tmp_path):
    tenants = tmp_path / "tenants.toml"
    tenants.write_text("")
    with pytest.raises(ValueError, match="not an ipc:// path, with --tenants"):
        Settings(tenants=tenants, kv_events_endpoint="tcp://127.0.0.1:5557")
    s = Settings(tenants=tenants, kv_events_endpoint=f"ipc://{tmp_path}/e.sock")
    assert s.kv_events_endpoint is not None


def test_the_service_needs_neither_package_with_events_off():
    # A fresh interpreter where importing zmq or msgpack fails, as without the extra.
    code = (
        "import sys\n"
        "sys.modules['zmq'] = None\n"
        "sys.modules['msgpack'] = None\n"
        "import app.server\n"
        "from app.settings import ConfigError, Settings\n"
        "assert app.server.kv_event_publisher(Settings(), None) is None\n"
        "try:\n"
        "    app.server.kv_event_publisher(\n"
        "        Settings(kv_events_endpoint='tcp://127.0.0.1:5557'), None)\n"
        "except ConfigError as exc:\n"
        "    print(exc)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert "pip install 'kvoffload[events]'" in out.stdout
    assert "--kv-events-endpoint" in out.stdout


def test_with_tenants_the_socket_mode_follows_the_tenant_rule(tmp_path):
    from app.core.tenants import Credentials
    from app.server import kv_event_publisher
    from tests.e2e.test_tenants import tenant_file

    tenants = tmp_path / "tenants"
    tenants.mkdir()
    tenant_file(
        tenants, "alpha", 'tokens = ["alpha-events-token-0000000001"]\nnamespaces = ["a1"]\n'
    )
    credentials = Credentials(tenants)
    modes = {}
    for tenant in (None, "alpha"):
        path = tmp_path / f"{tenant}.sock"
        s = Settings(
            tenants=tenants,
            uds_mode=0o660,
            kv_events_endpoint=f"ipc://{path}",
            kv_events_tenant=tenant,
        )
        pub = kv_event_publisher(s, credentials)
        assert pub is not None
        pub.start()
        try:
            modes[tenant] = path.stat().st_mode & 0o777
        finally:
            pub.close()
    # Every namespace (the admin's view): owner-only whatever --uds-mode says; one tenant's:
    # the engine sockets' mode, for that tenant's group.
    assert modes == {None: 0o600, "alpha": 0o660}


def test_a_namespace_of_another_tenant_gets_no_sink(tmp_path):
    from app.core.service import Service
    from app.server import attach_kv_events

    tenants = tmp_path / "t.toml"
    tenants.write_text("")
    s = Settings(
        tenants=tenants,
        kv_events_endpoint=f"ipc://{tmp_path}/e.sock",
        kv_events_tenant="alpha",
        num_blocks=8,
    )
    pub = KVEventPublisher(s)
    ours, theirs = Service(s, namespace="a1"), Service(s, namespace="b1")
    attach_kv_events(pub, s, "alpha", ours)
    attach_kv_events(pub, s, "beta", theirs)
    assert ours.on_events is not None
    assert ours.block_meta is not None
    assert theirs.on_events is None
    assert theirs.block_meta is None
    pub.close()


def test_a_publisher_that_raises_leaves_the_manager_call_whole(caplog):
    from app.core.service import Service
    from manager import ReqContext

    service = Service(Settings(num_blocks=4, metrics_enabled=False))

    def broken(events: Any) -> None:
        raise RuntimeError("publisher bug")

    service.on_events = broken
    m, ctx = service.pool_manager, ReqContext("r")
    m.on_new_request(ctx)
    m.prepare_store(K[:2], ctx)
    m.complete_store(K[:2], ctx)
    assert all(m.is_ready(k) for k in K[:2])
    assert m.stats().ready == 2
    assert [type(e) for e in service.events.page(0, 10).events] == [BlockStored]
    assert "KV events not handed to the publisher" in caplog.text
