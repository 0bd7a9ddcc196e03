"""Keys a service with a remote tier answers ``remote`` for, inside vLLM's real tiering code.

There is no remote tier here: a proxy in front of a real service turns lookup answers into
``"remote"`` (a ``"hit"`` once: the block another node stored, already in the pool; or every
``"miss"``: a block nobody stored) and records every batch. The tier must answer RETRY, ask
the key into the pool with a prepare-load (409 expected; a 200 pinned it and is undone by a
complete-load), look it up again, and end on HIT or, within ``PENDING_WAIT_S``, MISS, leaving
no pin in the service.
"""

from __future__ import annotations

import collections
import contextlib
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from kvoffload_client.client import KVOffloadAdminClient
from kvoffload_client.vllm import M_FAULTS, namespace_digest, service_key
from vllm.v1.kv_offload.base import OffloadKey, ReqContext

from tests.vllm.conftest import leases, serve
from tests.vllm.proxy import RemoteProxy
from testsupport.server import TOKEN, ServerProcess
from testsupport.vllm_sim import (
    BYTES_PER_BLOCK,
    SimEngine,
    chunk_bytes,
    keys_of,
    kv_transfer_config,
)

Batches = list[tuple[list[dict[str, Any]], list[dict[str, Any]]]]


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with serve(tmp_path_factory.mktemp("remote")).serving() as s:
        yield s


@contextlib.contextmanager
def remote_engine(
    srv: ServerProcess, tmp_path: Path, turn: str, once: bool, **tier: Any
) -> Iterator[tuple[SimEngine, RemoteProxy]]:
    """Engine B, whose calls go through a ``RemoteProxy`` (its pool: the service's own).
    Prefetches are off unless ``tier`` turns them on: these tests follow the promotion by
    prepare-load (``tests/vllm/test_tier_prefetch.py`` the prefetch)."""
    tier.setdefault("prefetch_deadline_s", 0)
    proxy = RemoteProxy(str(tmp_path / "proxy.sock"), str(srv.uds), turn, once)
    proxy.start()
    try:
        config = kv_transfer_config(
            f"unix://{proxy.listen}", cpu_chunks=16, pool_socket=f"{srv.uds}.pool", **tier
        )
        engine = SimEngine(f"t-remote-{turn}", config)
        try:
            yield engine, proxy
        finally:
            engine.close()
    finally:
        proxy.stop()


def store_through_tier(srv: ServerProcess, keys: Sequence[OffloadKey]) -> None:
    """Engine A computes ``keys`` and stores them in the service through its tier."""
    a = SimEngine("t-remote-a", kv_transfer_config(f"unix://{srv.uds}", cpu_chunks=16))
    try:
        assert a.run_request("remote-a", keys).hit_chunks == 0
        a.settle()
    finally:
        a.close()


def hex_keys(engine: SimEngine, keys: Sequence[OffloadKey]) -> list[str]:
    prefix = namespace_digest(None, engine.spec.config, BYTES_PER_BLOCK)
    return [service_key(prefix, k).hex() for k in keys]


def answered(engine: SimEngine, keys: Sequence[OffloadKey], ctx: ReqContext) -> list[int | None]:
    """Step and look up until the tier answers: every answer seen, the last not None."""
    seen: list[int | None] = []
    for _ in range(1000):
        engine.step()
        time.sleep(0.002)
        seen.append(engine.prefix_lookup(keys, ctx))
        if seen[-1] is not None:
            return seen
    raise AssertionError(f"the tier still answers RETRY after {len(seen)} steps")


def ops(batch: tuple[list[dict[str, Any]], list[dict[str, Any]]], name: str) -> list[Any]:
    """(keys, result) of each op ``name`` in one recorded batch."""
    return [(op["keys"], res) for op, res in zip(*batch, strict=True) if op["op"] == name]


def key_counts(batches: Batches, name: str) -> collections.Counter[str]:
    return collections.Counter(k for b in batches for keys, _ in ops(b, name) for k in keys)


def pinned(srv: ServerProcess) -> int:
    with KVOffloadAdminClient(srv.admin_url, token=TOKEN) as admin:
        return int(admin.stats()["blocks"]["pinned"])


def faults(engine: SimEngine) -> dict[str, int]:
    values = engine.tiers[0].counters.snapshot()
    return {label: n for (metric, label), n in values.items() if metric == M_FAULTS and n}


def test_remote_key_in_the_pool_is_promoted_undone_and_loaded(
    srv: ServerProcess, tmp_path: Path
) -> None:
    """A key answered ``remote`` that is already in the pool: RETRY, a prepare-load of exactly
    its service keys (200: pinned), the undoing complete-load in the next batch, then HIT and
    the right bytes; no pin left."""
    keys = keys_of(range(1000, 1006))
    store_through_tier(srv, keys)
    with remote_engine(srv, tmp_path, "hit", once=True) as (b, proxy):
        skeys = hex_keys(b, keys)
        proxy.remote = set(skeys)
        ctx = ReqContext(req_id="remote-b")
        b.start(ctx)
        assert b.prefix_lookup(keys, ctx) is None
        seen = answered(b, keys, ctx)
        assert seen[-1] == len(keys)
        assert all(s is None for s in seen[:-1])  # RETRY until then, never MISS
        batches = list(proxy.batches)
        first, promote, undo = batches[0], batches[1], batches[2]
        [(asked, first_res)] = ops(first, "lookup")
        assert asked == skeys
        assert first_res["result"]["results"] == ["remote"] * len(keys)
        # The next batch asks them into the pool and looks them up again.
        assert [op["op"] for op in promote[0]] == ["prepare_load", "lookup"]
        [(promoted, promote_res)] = ops(promote, "prepare_load")
        assert promoted == skeys
        assert promote_res["status"] == 200  # they were in the pool: it pinned them
        [(again, again_res)] = ops(promote, "lookup")
        assert again == skeys
        assert again_res["result"]["results"] == ["hit"] * len(keys)
        # ... and the next one undoes that pin before anything else.
        assert undo[0][0] == {"op": "complete_load", "req_id": "remote-b", "keys": skeys}
        assert undo[1][0]["status"] == 200
        assert b.load(keys, ctx) == {k: chunk_bytes(k, b.model) for k in keys}
        b.finish(ctx)
        b.step()
        b.settle()
        with b.manager.lock:
            assert not b.manager.has_pending_work()
        batches = list(proxy.batches)
        # Every pin (the promotion's, the load's) was given back by a complete-load.
        assert key_counts(batches, "prepare_load") == {k: 2 for k in skeys}
        assert key_counts(batches, "complete_load") == key_counts(batches, "prepare_load")
        assert faults(b) == {}
    assert leases(srv) == []
    assert pinned(srv) == 0


def test_remote_key_nobody_stored_ends_in_miss(srv: ServerProcess, tmp_path: Path) -> None:
    """A key answered ``remote`` every time but never brought in: prepare-loads answered 409
    (expected, no fault), re-asked until ``PENDING_WAIT_S`` is over, then MISS; no pin."""
    keys = keys_of(range(1100, 1104))
    with remote_engine(srv, tmp_path, "miss", once=False) as (b, proxy):
        skeys = hex_keys(b, keys)
        proxy.remote = set(skeys)
        ctx = ReqContext(req_id="remote-nobody")
        b.start(ctx)
        assert b.prefix_lookup(keys, ctx) is None
        seen = answered(b, keys, ctx)
        assert seen[-1] == 0
        assert all(s is None for s in seen[:-1])
        batches = list(proxy.batches)
        lookups = [res for batch in batches for _, res in ops(batch, "lookup")]
        promotes = [(k, res) for batch in batches for k, res in ops(batch, "prepare_load")]
        assert len(lookups) >= 2  # asked again after the first "remote"
        assert all(r["result"]["results"] == ["remote"] * len(keys) for r in lookups)
        # Each answer but the last (past PENDING_WAIT_S) asked the keys into the pool.
        assert len(promotes) == len(lookups) - 1
        assert all(k == skeys and r["status"] == 409 for k, r in promotes)
        assert all(r["error"]["code"] == "key_not_ready" for _, r in promotes)
        b.finish(ctx)
        b.step()
        b.settle()
        assert faults(b) == {}  # a 409 is what a promotion answers
        assert key_counts(list(proxy.batches), "complete_load") == {}
    assert leases(srv) == []
    assert pinned(srv) == 0


def test_request_finished_while_promoted_gives_the_pin_back(
    srv: ServerProcess, tmp_path: Path
) -> None:
    """A request that finishes right after its key answered ``remote``: the prepare-load of
    the promotion still goes (and pins: the block is in the pool), and its undo is sent without
    other work to carry it, so the engine settles and no pin is left."""
    keys = keys_of(range(1200, 1203))
    store_through_tier(srv, keys)
    with remote_engine(srv, tmp_path, "hit", once=True) as (b, proxy):
        skeys = hex_keys(b, keys)
        proxy.remote = set(skeys)
        ctx = ReqContext(req_id="remote-gone")
        b.start(ctx)
        assert b.prefix_lookup(keys, ctx) is None
        b.step()
        link = b.tiers[0]._link
        for _ in range(1000):  # until the tier has the "remote" answers
            if link.promote:
                break
            time.sleep(0.002)
        assert link.promote
        b.finish(ctx)
        b.step()
        b.settle(max_steps=200)
        with b.manager.lock:
            assert not b.manager.has_pending_work()
        batches = list(proxy.batches)
        [(promoted, promote_res)] = ops(batches[1], "prepare_load")
        assert (promoted, promote_res["status"]) == (skeys, 200)
        assert key_counts(batches, "complete_load") == {k: 1 for k in skeys}
        assert faults(b) == {}
    assert leases(srv) == []
    assert pinned(srv) == 0


def test_promotion_whose_answer_is_lost_is_aborted(srv: ServerProcess, tmp_path: Path) -> None:
    """The batch carrying a promotion runs in the service (it pins: the block is in the pool)
    but its answer is lost (503): the outcome is unknown, so the request is aborted in the
    service once it answers again, and no pin outlives it."""
    keys = keys_of(range(1300, 1303))
    store_through_tier(srv, keys)
    with remote_engine(srv, tmp_path, "hit", once=True, retry_interval_s=0.05) as (b, proxy):
        skeys = hex_keys(b, keys)
        proxy.remote = set(skeys)
        proxy.lose_answer = "prepare_load"
        ctx = ReqContext(req_id="remote-lost")
        b.start(ctx)
        assert b.prefix_lookup(keys, ctx) is None
        seen = answered(b, keys, ctx)
        assert seen[-1] == 0  # the lost batch's lookups miss
        [(promoted, promote_res)] = ops(proxy.batches[1], "prepare_load")
        assert (promoted, promote_res["status"]) == (skeys, 200)  # the service pinned them
        b.finish(ctx)
        for _ in range(1000):  # until the service answers again and hears of the abort
            b.step()
            if not leases(srv):
                break
            time.sleep(0.005)
        b.settle()
        assert faults(b) == {"http_5xx": 1}
    assert leases(srv) == []
    assert pinned(srv) == 0
