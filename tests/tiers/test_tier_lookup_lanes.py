"""Lookups of one namespace cannot take another's (issue #42, finding 3), on the object tier
and the remote tier, without a gateway or a master.

The object tier runs its real store (``transfer.s3.S3Tier``: its threads, its batches, its
budget) over ``FakeS3``, which stands in for the client library (``obstore``): objects in a
dict, and HEADs of one namespace's keys that take as long as the test says. The remote tier runs
over ``tests.api.test_remote_tier``'s in-process store, its ``exists`` slowed down.

What is checked: while bob floods lookups of keys his store is slow to answer, alice's lookups
of keys her namespace holds still find them (each namespace asks on a lane of its own, not on
the loop's executor that every namespace shares), and a lookup whose time is up leaves no
HEADs queued behind it (the store is given the lookup's budget: what it has not started by
then is never sent), a lookup of 8,192 keys holds no object per key while its store asks (what
it held outlived the young collections: a flood of them brought on full ones, which stop every
thread of the process), and the negative cache keeps its newest answers up to its bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import threading
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest

import app.core.object
import transfer.s3
from app.core.object import ObjectLink
from app.core.remote import RemoteBackend, RemoteLink
from app.core.service import Service
from app.settings import Settings
from tests.api.test_remote_tier import MemoryStore
from tests.api.test_remote_tier import MemoryTier as RemoteMemoryTier
from testsupport.api_harness import make_settings
from transfer import HostPool
from transfer.s3 import MAC_BYTES

pytestmark = pytest.mark.anyio

SLOW_HEAD_S = 0.5  # each of bob's HEADs
FLOOD = 48  # bob's lookups at once: more than the loop's default executor has threads (32)


class FakeS3:
    """The client library's calls the store makes (``head``, ``get``, ``put``, ``delete``,
    ``list_with_delimiter``), over a dict of object sizes; HEADs of paths under ``slow`` take
    ``SLOW_HEAD_S``, and every HEAD that started is counted, by namespace."""

    def __init__(self) -> None:
        self.sizes: dict[str, int] = {}
        self.slow = "\0"  # no path starts with it
        self.lock = threading.Lock()
        self.heads_started: dict[str, int] = {}

    def head(self, store: Any, path: str) -> dict[str, Any]:
        namespace = path.rsplit("/", 1)[0]
        with self.lock:
            self.heads_started[namespace] = self.heads_started.get(namespace, 0) + 1
        if path.startswith(self.slow):
            time.sleep(SLOW_HEAD_S)
        size = self.sizes.get(path)
        if size is None:
            raise FileNotFoundError(path)
        return {"size": size}

    def list_with_delimiter(self, store: Any, prefix: str | None = None) -> dict[str, Any]:
        return {"common_prefixes": [], "objects": []}

    def get(self, store: Any, path: str) -> Any:
        raise FileNotFoundError(path)

    def put(self, store: Any, path: str, data: Any) -> None:
        self.sizes[path] = len(data)

    def delete(self, store: Any, paths: Sequence[str]) -> None:
        for path in paths:
            self.sizes.pop(path, None)


@pytest.fixture
def fake_s3(monkeypatch: pytest.MonkeyPatch) -> FakeS3:
    fake = FakeS3()
    monkeypatch.setattr(transfer.s3, "_load_client", lambda: fake)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDEXAMPLE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret-example")
    return fake


def object_settings(**overrides: Any) -> Settings:
    base: dict[str, Any] = {
        "tiers": ["object"],
        "object_bucket": "kv-cache",
        "object_endpoint": "http://127.0.0.1:9",
        "object_negative_cache_s": 0.0,  # every lookup asks the bucket
        "object_timeout_s": 5.0,
    }
    return make_settings(**{**base, **overrides})


@contextlib.asynccontextmanager
async def object_node(settings: Settings, namespace: str) -> AsyncIterator[ObjectLink]:
    service = Service(settings, namespace=namespace)
    async with service.running():
        link = service.tiers.get("object")
        assert isinstance(link, ObjectLink)
        yield link


def keys_of(tag: int, n: int) -> list[bytes]:
    return [tag.to_bytes(4, "big") + i.to_bytes(4, "big") for i in range(n)]


async def test_a_flood_of_slow_misses_in_one_namespace_leaves_another_s_hits_found(
    fake_s3: FakeS3,
) -> None:
    # Alice waits up to 2 s for HEADs that answer at once; bob's HEADs take 0.5 s each.
    alice_settings = object_settings(object_lookup_timeout_s=2.0)
    async with (
        object_node(alice_settings, "alice") as alice,
        object_node(object_settings(), "bob") as bob,
    ):
        held = keys_of(1, 8)
        object_bytes = alice_settings.block_bytes + MAC_BYTES
        for key in held:
            fake_s3.sizes[alice.store.path(key)] = object_bytes
        fake_s3.slow = bob.store.namespace + "/"
        assert await alice.found(held, "a0") == [True] * len(held)

        # Before the fix, each of these held a thread of the loop's default executor for the
        # store's whole timeout (5 s): alice's lookup queued behind them and answered miss.
        flood = [
            asyncio.create_task(bob.found(keys_of(100 + i, 256), f"b{i}")) for i in range(FLOOD)
        ]
        await asyncio.sleep(0.1)  # the flood is asking
        found = [await alice.found(held, f"a{i}") for i in range(1, 4)]
        bob_answers = await asyncio.gather(*flood)

    assert found == [[True] * len(held)] * 3
    assert all(not any(a) for a in bob_answers)  # bob's own lookups: late, so miss


async def test_a_lookup_whose_time_is_up_leaves_no_heads_queued(fake_s3: FakeS3) -> None:
    settings = object_settings(object_lookup_timeout_s=0.05, object_concurrency=2)
    async with object_node(settings, "bob") as bob:
        fake_s3.slow = bob.store.namespace + "/"
        namespace = bob.store.namespace
        assert await bob.found(keys_of(7, 200), "b1") == [False] * 200
        # The two HEADs that started within the budget end after 0.5 s; before the fix, the
        # other 198 were still queued then and went on being sent, two at a time, for the
        # store's 5 s timeout.
        await asyncio.sleep(SLOW_HEAD_S * 3)
        assert fake_s3.heads_started[namespace] <= 2 * settings.object_concurrency
        assert bob.lookups.running == 0
        health = bob.store.health()
        assert health.ok  # a lookup's budget running out is no fault of the store
        assert health.counters["timeouts"] == 0


async def test_a_lookup_of_many_keys_holds_nothing_per_key_while_its_store_asks(
    fake_s3: FakeS3,
) -> None:
    # Objects the collector tracks, alive while the first HEAD of a lookup of 8,192 keys runs.
    # Before the fix, the store built a call (two tuples and a bound method) per key up front,
    # and kept them for the lookup's whole budget: they outlived the young collections, so a
    # flood of such lookups brought on full ones, each stopping every thread of the process
    # (another namespace's HEADs, the loop) while it walked the heap.
    settings = object_settings(max_keys_per_call=8192)
    n = settings.max_keys_per_call
    async with object_node(settings, "bob") as bob:
        keys = keys_of(5, n)
        seen: list[int] = []
        head = fake_s3.head

        def counting_head(store: Any, path: str) -> dict[str, Any]:
            if not seen:
                seen.append(len(gc.get_objects()))
            return head(store, path)

        fake_s3.head = counting_head  # type: ignore[method-assign]
        before = len(gc.get_objects())
        assert await bob.found(keys, "b1") == [False] * n
    assert seen
    assert seen[0] - before < n // 8


async def test_the_negative_cache_keeps_the_newest_answers_up_to_its_bound(
    fake_s3: FakeS3, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(app.core.object, "NEGATIVE_MAX", 8)
    async with object_node(object_settings(object_negative_cache_s=60.0), "bob") as bob:
        held, older, newer = keys_of(1, 2), keys_of(2, 6), keys_of(3, 6)
        for key in held:
            fake_s3.sizes[bob.store.path(key)] = bob.store.block_bytes + MAC_BYTES
        namespace = bob.store.namespace
        assert await bob.found(older, "b1") == [False] * 6
        assert await bob.found(newer, "b2") == [False] * 6
        # 12 answers, 8 kept: the newest (older's last 2, all of newer's).
        assert list(bob._absent) == older[4:] + newer
        asked = fake_s3.heads_started[namespace]
        mixed = [newer[0], held[0], older[0], older[5], held[1], newer[5]]
        assert await bob.found(mixed, "b3") == [False, True, False, False, True, False]
        # Asked: the two held keys and older[0] (dropped from the cache), nothing else.
        assert fake_s3.heads_started[namespace] - asked == 3
        assert bob.state()["lookups"]["cached_absent"] == 3
        assert len(bob._absent) == 8
        assert older[0] in bob._absent  # answered again: the newest now


class SlowExistsTier(RemoteMemoryTier):
    """The in-process remote store, whose ``exists`` takes ``delay_s`` for one namespace
    whatever budget it is given (a store that ignores it), and counts its calls."""

    delay_s = 0.0
    calls = 0

    def exists(self, keys: Sequence[bytes], timeout_s: float | None = None) -> list[bool | None]:
        type(self).calls += 1
        time.sleep(self.delay_s)
        return super().exists(keys, timeout_s)


async def test_a_remote_namespace_flooding_lookups_queues_behind_itself_only() -> None:
    store = MemoryStore()
    tiers: dict[str, SlowExistsTier] = {}

    def factory(settings: Settings, pool: HostPool, storage: str) -> SlowExistsTier:
        tier = SlowExistsTier(store, pool, f"kvoffload/{storage}/{settings.block_bytes}")
        tiers[storage] = tier
        return tier

    settings = make_settings(
        remote_tier="mooncake",
        mooncake_master="store:1",
        mooncake_metadata="http://store/metadata",
        remote_lookup_timeout_s=2.0,
    )
    backends = {"remote": RemoteBackend(factory)}
    alice_service = Service(settings, namespace="alice", tier_backends=backends)
    bob_service = Service(settings, namespace="bob", tier_backends=backends)
    async with alice_service.running(), bob_service.running():
        alice, bob = alice_service.tiers.get("remote"), bob_service.tiers.get("remote")
        assert isinstance(alice, RemoteLink)
        assert isinstance(bob, RemoteLink)
        held = keys_of(1, 4)
        for key in held:
            store.blocks[f"{alice.tier.namespace}/{key.hex()}"] = b"x"
        tiers["bob"].delay_s = 3.0  # instance attribute: bob's store only
        flood = [asyncio.create_task(bob.found(keys_of(9, 8), f"b{i}")) for i in range(FLOOD)]
        await asyncio.sleep(0.1)
        assert await alice.found(held, "a1") == [True] * 4
        assert bob.lookups.running <= bob.lookups.width
        for task in flood:
            task.cancel()
        await asyncio.gather(*flood, return_exceptions=True)
    # Bob's lookups that found no free thread in their time never reached his store.
    assert SlowExistsTier.calls < FLOOD
