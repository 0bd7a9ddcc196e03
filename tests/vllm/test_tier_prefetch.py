"""The tier's prefetch of keys a lookup found below the service's pool.

At the link level (a scripted client, no service): a request's first lookup carries
``prefetch_deadline_s`` (no call added), counted by outcome; a later lower-tier answer for the
same request, a lookup whose prefetch the service did not start (its bound), or
``prefetch_deadline_s`` 0 promote with a prepare-load in the next call instead; a finished
request forgets it. Inside vLLM's real tiering code against a real service with a disk
tier: a prefix pushed to disk is prefetched by its first lookup, answered RETRY then HIT, loaded
with the bytes written, and the service counts the prefetch's keys used; past the service's
bound, the keys are promoted instead. ``measure_retries`` compares the scheduler's retries with
the prefetch on and off (the report's figures; run ``python -m tests.vllm.test_tier_prefetch``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from kvoffload_client.attach import MappedPool
from kvoffload_client.client import Batch, KVOffloadAdminClient, KVOffloadClient, OpResult
from kvoffload_client.vllm import M_FAULTS, M_PREFETCHES
from kvoffload_client.vllm.copier import Copier
from kvoffload_client.vllm.link import Link
from kvoffload_client.vllm.state import Probe, Shared, Step
from kvoffload_client.vllm.tier import check_prefetch_deadline
from vllm.v1.kv_offload.base import OffloadKey, ReqContext

from tests.vllm.conftest import leases, serve
from tests.vllm.test_tier_remote import answered, faults, hex_keys, ops, remote_engine
from testsupport.server import TOKEN, ServerProcess
from testsupport.vllm_sim import SimEngine, chunk_bytes, keys_of, kv_transfer_config

PREFIX = b"\xaa" * 8

# --------------------------------------------------------------------------- link level


class Scripted:
    """A client whose ``batch`` records the ops and answers each with ``answer(op)``."""

    def __init__(self) -> None:
        self.calls: list[list[dict[str, Any]]] = []
        self.lookup_states: dict[str, str] = {}  # hex service key -> lookup answer
        self.prefetch_status = 202  # 429: the service's bound refuses the lookup's prefetch
        self.lookup_status = 200
        self.last_pool_id: str | None = "pool-1"

    def current_token(self) -> str | None:
        return None

    def batch(self, ops: Batch | Sequence[dict[str, Any]]) -> list[OpResult]:
        items = ops.ops if isinstance(ops, Batch) else list(ops)
        self.calls.append(items)
        return [self.answer(op) for op in items]

    def answer(self, op: dict[str, Any]) -> OpResult:
        kind = op["op"]
        if kind == "lookup":
            if self.lookup_status != 200:
                return OpResult(False, self.lookup_status, None, None)
            states = [self.lookup_states.get(k, "miss") for k in op["keys"]]
            answer: dict[str, Any] = {"results": states, "hit_prefix": 0}
            below = any(s not in ("hit", "miss", "pending") for s in states)
            if "prefetch_deadline_s" in op and below and self.prefetch_status == 202:
                answer["prefetch_id"] = 1  # the service started a prefetch of those keys
            return OpResult(True, 200, answer, None)
        if kind == "prepare_load":
            return OpResult(False, 409, None, None)
        return OpResult(True, 200, {}, None)

    def kinds(self, call: int) -> list[str]:
        return [op["op"] for op in self.calls[call]]


@contextlib.contextmanager
def link(prefetch_deadline_s: float = 10.0) -> Iterator[tuple[Link, Scripted]]:
    """A ``Link`` over a scripted client, its pool mapped (a one-block stand-in)."""
    client = Scripted()
    shared = Shared(
        client=client,  # type: ignore[arg-type]
        url="unix:///scripted",
        prefix=PREFIX,
        primary=np.zeros((1, 4096), dtype=np.uint8),
        block_size_bytes=4096,
        max_keys=8192,
        max_params=16384,
        retry_interval_s=0.5,
        events_enabled=False,
        events_interval_s=1.0,
        locality=None,
        pool_socket=None,
        service_namespace=None,
        prefetch_deadline_s=prefetch_deadline_s,
    )
    copier = Copier(shared)
    try:
        lk = Link(shared, copier)
        lk.pool = MappedPool("pool-1", 1, 4096, np.zeros((1, 4096), dtype=np.uint8))
        yield lk, client
    finally:
        copier.close()


def skey(key: bytes) -> str:
    return (PREFIX + key).hex()


def look(lk: Link, req_id: str, keys: Sequence[bytes]) -> list[Probe]:
    """One step that looks ``keys`` up for ``req_id`` (a new request); their probes."""
    probes = [Probe() for _ in keys]
    step = Step(
        starts={req_id: None},
        lookups={req_id: list(zip(map(OffloadKey, keys), probes, strict=True))},
    )
    lk.exchange(step)
    return probes


def counted(lk: Link, metric: str) -> dict[str, int]:
    values = lk.shared.counters.snapshot()
    return {label: n for (m, label), n in values.items() if m == metric and n}


def test_the_first_lookup_carries_the_prefetch() -> None:
    keys = [b"k1", b"k2", b"k3", b"k4"]
    with link() as (lk, client):
        client.lookup_states = {skey(b"k1"): "hit", skey(b"k2"): "disk", skey(b"k3"): "remote"}
        probes = look(lk, "r1", keys)
        assert client.kinds(0) == ["start_request", "lookup"]
        (lookup,) = [op for op in client.calls[0] if op["op"] == "lookup"]
        assert lookup["prefetch_deadline_s"] == 10.0
        assert [p.result for p in probes] == [True, None, None, False]
        assert counted(lk, M_PREFETCHES) == {"started": 1}

        # The next step asks them again, and promotes nothing: they are on their way up.
        lk.exchange(Step())
        assert client.kinds(1) == ["lookup"]
        assert "prefetch_deadline_s" not in client.calls[1][0]
        # Still below the pool on a later answer: a promotion, never a second prefetch.
        lk.exchange(Step())
        assert client.kinds(2) == ["prepare_load", "lookup"]
        assert [op["keys"] for op in client.calls[2] if op["op"] == "prepare_load"] == [
            [skey(b"k2"), skey(b"k3")]
        ]
        client.lookup_states = {k: "hit" for k in (skey(b"k2"), skey(b"k3"))}
        lk.exchange(Step())
        assert [p.result for p in probes] == [True, True, True, False]
        assert counted(lk, M_PREFETCHES) == {"started": 1}
        assert counted(lk, M_FAULTS) == {}


def test_each_request_prefetches_on_its_first_lookup_and_a_finished_one_forgets_it() -> None:
    with link() as (lk, client):
        client.lookup_states = {skey(b"a"): "disk", skey(b"b"): "disk"}
        look(lk, "r1", [b"a"])
        look(lk, "r2", [b"b"])  # also asks r1's key again, without a prefetch
        prefetching = {
            op["req_id"]: "prefetch_deadline_s" in op
            for op in client.calls[1]
            if op["op"] == "lookup"
        }
        assert prefetching == {"r1": False, "r2": True}
        assert lk.prefetched == {"r1", "r2"}
        lk.exchange(Step(finishes=["r1"]))
        assert lk.prefetched == {"r2"}
        assert counted(lk, M_PREFETCHES) == {"started": 2}


def test_a_lookup_whose_prefetch_did_not_start_promotes() -> None:
    with link() as (lk, client):
        client.lookup_states = {skey(b"a"): "disk"}
        client.prefetch_status = 429  # past the service's bound: the lookup names no prefetch
        look(lk, "r1", [b"a"])
        lk.exchange(Step())
        assert client.kinds(1) == ["prepare_load", "lookup"]
        assert counted(lk, M_PREFETCHES) == {"refused": 1}
        assert counted(lk, M_FAULTS) == {}


def test_a_failed_lookup_fails_its_prefetch() -> None:
    with link() as (lk, client):
        client.lookup_status = 422
        look(lk, "r1", [b"a"])
        assert counted(lk, M_PREFETCHES) == {"failed": 1}
        assert counted(lk, M_FAULTS) == {"lookup_422": 1}


def test_prefetches_off_promote_with_a_prepare_load() -> None:
    with link(prefetch_deadline_s=0) as (lk, client):
        client.lookup_states = {skey(b"a"): "disk"}
        look(lk, "r1", [b"a"])
        assert "prefetch_deadline_s" not in client.calls[0][-1]
        lk.exchange(Step())
        assert client.kinds(1) == ["prepare_load", "lookup"]
        assert counted(lk, M_PREFETCHES) == {}


@pytest.mark.parametrize("value", [0, 0.0, 2.5, 300])
def test_prefetch_deadline_accepts_a_finite_number_from_zero(value: float) -> None:
    assert check_prefetch_deadline(value) == float(value)


@pytest.mark.parametrize("value", [-1, float("nan"), float("inf"), "ten", None, True])
def test_prefetch_deadline_refuses_anything_else(value: Any) -> None:
    with pytest.raises(ValueError, match="prefetch_deadline_s must be a finite number >= 0"):
        check_prefetch_deadline(value)


# --------------------------------------------------------------------------- real service

POOL_BLOCKS = 16


def disk_server(workdir: Path, *extra: str) -> ServerProcess:
    """A service whose 16-block pool overflows onto a disk tier (every evicted block admitted)."""
    flags = ["--num-blocks", str(POOL_BLOCKS), "--disk-dir", str(workdir / "disk")]
    flags += ["--disk-bytes", str(8 << 20), "--disk-admit-after", "1", *extra]
    return serve(workdir, *flags)


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with disk_server(
        tmp_path_factory.mktemp("prefetch"), "--prefetch-max-keys", "64"
    ).serving() as s:
        yield s


def control_counts(srv: ServerProcess) -> dict[str, int]:
    with KVOffloadAdminClient(srv.admin_url, token=TOKEN) as admin:
        counts: dict[str, int] = admin.stats()["control"]["counts"]
    return counts


def on_disk(srv: ServerProcess, engine: SimEngine, keys: Sequence[OffloadKey]) -> None:
    """Have the service hold ``keys`` (stored before) on its disk only: demoted, and waited
    for until a lookup answers ``disk`` for every one."""
    skeys = [bytes.fromhex(k) for k in hex_keys(engine, keys)]
    with KVOffloadClient(uds=str(srv.uds)) as c:
        c.demote("test-demote", skeys)
        for _ in range(1000):
            c.start_request("test-look")
            if c.lookup("test-look", skeys).results == ["disk"] * len(skeys):
                c.finish_request("test-look")
                return
            time.sleep(0.005)
    raise AssertionError("the demoted keys never reached the disk")


def store(srv: ServerProcess, keys: Sequence[OffloadKey], name: str = "t-prefetch-a") -> None:
    a = SimEngine(name, kv_transfer_config(f"unix://{srv.uds}", cpu_chunks=16))
    try:
        assert a.run_request(f"{name}-store", keys).hit_chunks == 0
        a.settle()
    finally:
        a.close()


def test_a_disk_prefix_is_prefetched_once_then_hit_and_loaded(
    srv: ServerProcess, tmp_path: Path
) -> None:
    prefix = keys_of(range(3000, 3006))
    store(srv, prefix)
    before = control_counts(srv)
    with remote_engine(srv, tmp_path, "hit", once=True, prefetch_deadline_s=10.0) as (b, proxy):
        on_disk(srv, b, prefix)
        ctx = ReqContext(req_id="prefetch-b")
        b.start(ctx)
        assert b.prefix_lookup(prefix, ctx) is None
        seen = answered(b, prefix, ctx)
        assert seen[-1] == len(prefix)
        assert all(s is None for s in seen[:-1])  # RETRY until then, never MISS
        assert b.load(prefix, ctx) == {k: chunk_bytes(k, b.model) for k in prefix}
        b.finish(ctx)
        b.step()
        b.settle()
        skeys = hex_keys(b, prefix)
        first = proxy.batches[0]
        # The first lookup started the prefetch of the keys on disk, in the same call.
        [(looked, res)] = ops(first, "lookup")
        assert looked == skeys
        assert res["result"]["results"] == ["disk"] * 6
        assert isinstance(res["result"]["prefetch_id"], int)
        # No prefetch of its own, and no promotion: the keys were on their way up.
        assert not any(ops(batch, "prefetch") for batch in proxy.batches)
        assert not any(ops(batch, "prepare_load") for batch in proxy.batches[:2])
        counters = b.tiers[0].counters.snapshot()
        assert counters[M_PREFETCHES, "started"] == 1
        assert faults(b) == {}
    after = control_counts(srv)
    assert after["prefetch_promoted"] - before.get("prefetch_promoted", 0) == 6
    assert after["prefetch_used"] - before.get("prefetch_used", 0) == 6
    assert leases(srv) == []


def test_a_prefetch_past_the_service_bound_falls_back_to_a_promotion(tmp_path: Path) -> None:
    prefix = keys_of(range(3200, 3206))
    with disk_server(tmp_path, "--prefetch-max-keys", "2").serving() as small:
        store(small, prefix)
        b = SimEngine("t-prefetch-bound", kv_transfer_config(f"unix://{small.uds}", cpu_chunks=16))
        try:
            on_disk(small, b, prefix)
            ctx = ReqContext(req_id="prefetch-bound")
            b.start(ctx)
            assert b.prefix_lookup(prefix, ctx) is None
            seen = answered(b, prefix, ctx)
            assert seen[-1] == len(prefix)
            assert b.load(prefix, ctx) == {k: chunk_bytes(k, b.model) for k in prefix}
            counters = b.tiers[0].counters.snapshot()
            assert counters[M_PREFETCHES, "refused"] == 1
            assert faults(b) == {}
            b.finish(ctx)
            b.step()
            b.settle()
        finally:
            b.close()
        assert leases(small) == []


# --------------------------------------------------------------------------- measurement


def measure_retries(requests: int, chunks: int, step_s: float) -> dict[str, Any]:
    """Scheduler retries (steps a request's prefix lookup was deferred) for prefixes the
    service holds on its disk only, with the tier's prefetch on and off: two engines, one per
    setting, take turns on the same prefixes, each pushed back to the disk (``demote``) before
    each lookup. Per setting: retries per request (mean, p50, max), calls per request and how
    many requests loaded their whole prefix."""
    out: dict[str, Any] = {"requests": requests, "chunks": chunks, "step_s": step_s}
    with tempfile.TemporaryDirectory() as tmp:
        pool = max(64, 4 * chunks)
        flags = ["--num-blocks", str(pool), "--disk-dir", f"{tmp}/disk"]
        flags += ["--disk-bytes", str(64 << 20), "--disk-admit-after", "1"]
        flags += ["--prefetch-max-keys", str(pool), "--log-level", "warning"]
        with ServerProcess(Path(tmp), "--block-bytes", "4096", *flags).serving() as srv:
            url = f"unix://{srv.uds}"
            engines = {
                on: SimEngine(
                    f"measure-{on}",
                    kv_transfer_config(url, cpu_chunks=4 * chunks, prefetch_deadline_s=deadline),
                )
                for on, deadline in (("on", 10.0), ("off", 0.0))
            }
            steps: dict[str, list[int]] = {"on": [], "off": []}
            full: dict[str, int] = {"on": 0, "off": 0}
            calls_before = {on: _calls(e) for on, e in engines.items()}
            try:
                for n in range(requests):
                    prefix = keys_of(range(10_000 + n * chunks, 10_000 + (n + 1) * chunks))
                    store(srv, prefix, name=f"measure-writer-{n}")
                    order = ("on", "off") if n % 2 == 0 else ("off", "on")
                    for on in order:
                        engine = engines[on]
                        on_disk(srv, engine, prefix)
                        got = engine.run_request(f"m-{on}-{n}", prefix, step_s=step_s)
                        engine.settle()
                        steps[on].append(got.steps)
                        full[on] += got.hit_chunks == chunks
                for on, engine in engines.items():
                    counters = engine.tiers[0].counters.snapshot()
                    out[on] = {
                        "retries_mean": round(statistics.fmean(steps[on]), 2),
                        "retries_p50": statistics.median(steps[on]),
                        "retries_max": max(steps[on]),
                        "full_prefix_hits": full[on],
                        "calls_per_request": round(
                            (_calls(engine) - calls_before[on]) / requests, 2
                        ),
                        "prefetches": {
                            label: v for (m, label), v in counters.items() if m == M_PREFETCHES
                        },
                        "faults": {label: v for (m, label), v in counters.items() if m == M_FAULTS},
                    }
            finally:
                for engine in engines.values():
                    engine.close()
    return out


def _calls(engine: SimEngine) -> int:
    return int(sum(v for (m, _), v in engine.tiers[0].counters.snapshot().items() if "calls" in m))


def main() -> None:
    parser = argparse.ArgumentParser(description="retries with the tier's prefetch on and off")
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--chunks", type=int, default=16)
    parser.add_argument("--step-s", type=float, default=0.001)
    args = parser.parse_args()
    print(json.dumps(measure_retries(args.requests, args.chunks, args.step_s), indent=2))


if __name__ == "__main__":
    main()
