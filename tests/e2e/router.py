"""A router's side of kvoffload's KV events, as Dynamo's and vLLM's subscribers read them: a
ZMQ SUB socket on the publisher, and a DEALER on its replay socket asked for the batches the
subscriber missed (a gap in the sequence numbers, or the batches sent before it joined)."""

from __future__ import annotations

import time
from typing import Any

import msgpack
import zmq

END_SEQ = (-1).to_bytes(8, "big", signed=True)


class RouterFeed:
    """Batches of one publisher in sequence order, with no gap: ``batches(n)``."""

    def __init__(self, endpoint: str, replay_endpoint: str) -> None:
        self.context = zmq.Context()
        self.sub = self.context.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(endpoint)
        self.replay = self.context.socket(zmq.DEALER)
        self.replay.setsockopt(zmq.RCVTIMEO, 5000)
        self.replay.connect(replay_endpoint)
        self.next_seq = 0
        self.replays = 0
        # (seq, topic, [ts, events, dp_rank]) in order.
        self.seen: list[tuple[int, str, list[Any]]] = []

    def close(self) -> None:
        self.sub.close(linger=0)
        self.replay.close(linger=0)
        self.context.term()

    def __enter__(self) -> RouterFeed:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _take(self, topic: bytes, seq: bytes, payload: bytes) -> None:
        number = int.from_bytes(seq, "big")
        if number < self.next_seq:
            return  # already had it (replayed, then live)
        self.seen.append((number, topic.decode(), msgpack.unpackb(payload)))
        self.next_seq = number + 1

    def catch_up(self) -> None:
        """Ask the replay socket for every batch from ``next_seq`` on."""
        self.replays += 1
        self.replay.send_multipart([b"", self.next_seq.to_bytes(8, "big")])
        while True:
            _, topic, seq, payload = self.replay.recv_multipart()
            if seq == END_SEQ:
                return
            self._take(topic, seq, payload)

    def poll(self, timeout_ms: int = 100) -> None:
        """Read what the SUB socket has; a gap is filled from the replay socket first."""
        if not self.sub.poll(timeout_ms):
            return
        while self.sub.poll(0):
            topic, seq, payload = self.sub.recv_multipart()
            if int.from_bytes(seq, "big") > self.next_seq:
                self.catch_up()
            self._take(topic, seq, payload)

    def events(self) -> list[tuple[str, dict[str, Any] | list[Any]]]:
        """Every event seen, with its batch's topic, in order."""
        return [(topic, e) for _, topic, batch in self.seen for e in batch[1]]

    def wait_for(self, predicate: Any, within_s: float = 20.0) -> None:
        """Read until ``predicate(self)`` holds (replaying from the start first, to have what
        was sent before this subscriber joined); AssertionError after ``within_s``."""
        deadline = time.monotonic() + within_s
        self.catch_up()
        while not predicate(self):
            if time.monotonic() > deadline:
                raise AssertionError(f"not within {within_s:g} s; seen: {self.events()}")
            self.poll()
            if not predicate(self):
                self.catch_up()
