"""Tenant isolation: what disjoint pools cost in hit ratio, and what scrubbing would cost instead.

kvoffload isolates tenants by giving each namespace its own host pool and manager
(``app.core.tenancy``), so no slot ever carries one tenant's bytes to another. The other way
would be one shared pool that zeroes (scrubs) a slot whenever it passes to another tenant. This
benchmark measures both sides of that choice.

1. **Capacity** (hit ratio): the shipped trace (``bench/data/mooncake_synthetic_trace.jsonl``)
   split into two tenants by a hash of each request's first block id (so a prefix family stays
   with one tenant), replayed with the real manager (``manager.replay.replay``, LRU, its
   accounting unchanged) at total capacities of 5k, 10k and 20k blocks:

   - *shared* (the baseline): one pool of N blocks; every key is prefixed with its tenant's byte,
     so the tenants' keys are as distinct as in separate namespaces but share the capacity;
   - *disjoint, by share*: two pools, N split in proportion to each tenant's traffic (block
     references);
   - *disjoint, 50/50*: two pools of N/2 (an operator who sizes tenants equally).

   Each tenant's and the total prefix hit ratio, and disjoint / shared.

2. **Scrub** (the alternative not taken): with torch on the CPU, the time to zero one slot of a
   host pool (``tensor[slot].zero_()`` on a ``transfer.host_pool.HostPool``) against copying one
   block of the same size into a slot (the store a scrub would sit beside: the baseline), for
   blocks of 64 KiB, 256 KiB, 1 MiB and 2 MiB; median over many slots in random order, with torch
   on one thread (a transfer worker's default). How often a scrub would be needed: in the shared
   replay of part 1, the slots ``prepare_store`` hands out whose previous tenant was the other
   one, per stored block. Their product is the store-time overhead a scrubbing shared pool pays.

Per-tenant figures of the shared pool come from the same ``replay`` call that gives its total:
the manager it builds is wrapped in a recorder that reads each ``lookup``'s hit prefix and each
``prepare_store``'s slots, and changes nothing.

Run: ``.venv/bin/python bench/tenant_isolation.py`` (``--quick``: first 1000 requests, smaller
pools). Prints the tables and writes ``bench/results/tenant_isolation.json``.
"""

from __future__ import annotations

import argparse
import hashlib
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import manager.replay as replay_module  # noqa: E402
from bench import harness  # noqa: E402
from manager import (  # noqa: E402
    BlockKey,
    LookupOutput,
    OffloadManager,
    PrepareStoreOutput,
    ReqContext,
    create_manager,
)
from manager.replay import replay  # noqa: E402
from transfer.host_pool import HostPool  # noqa: E402

POLICY = "lru"
TENANTS = (0, 1)
BLOCK_SIZES = (64 << 10, 256 << 10, 1 << 20, 2 << 20)
CAP_HEAD = "{:>8}  {:<18} {:<12} {:>6} {:>6} {:>6}  {}"
SCRUB_HEAD = "{:>8} {:>6} {:>8} {:>8} {:>9} {:>9} {:>10} {:>11}"


def tenant_of(keys: Sequence[BlockKey]) -> int:
    """The tenant (0 or 1) a request belongs to: a hash of its first block id, so every request
    of a prefix family goes to the same tenant; an empty request goes to tenant 0."""
    if not keys:
        return 0
    return hashlib.blake2b(keys[0], digest_size=8).digest()[0] & 1


def tagged(keys: Sequence[BlockKey], tenant: int) -> list[BlockKey]:
    """``keys`` as the tenant's own: each prefixed with the tenant's byte."""
    prefix = bytes([tenant])
    return [prefix + k for k in keys]


class _Recorder:
    """An ``OffloadManager`` seen through: each lookup's hit prefix is added to its tenant's hits,
    and each slot ``prepare_store`` hands out is checked against the slot's previous tenant. The
    tenant is the first byte of the keys (``tagged``). Everything else goes to the manager."""

    def __init__(self, inner: OffloadManager) -> None:
        self._inner = inner
        self.hits = dict.fromkeys(TENANTS, 0)
        self.stored = 0  # slots handed out for a store
        self.reused = 0  # ... that held a block before
        self.crossed = 0  # ... whose previous block was the other tenant's
        self._slot_tenant: dict[int, int] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def lookup(self, keys: Sequence[BlockKey], ctx: ReqContext) -> LookupOutput:
        out = self._inner.lookup(keys, ctx)
        if keys:
            self.hits[keys[0][0]] += out.hit_prefix
        return out

    def prepare_store(self, keys: Sequence[BlockKey], ctx: ReqContext) -> PrepareStoreOutput | None:
        out = self._inner.prepare_store(keys, ctx)
        if out is not None:
            for key, slot in zip(out.keys_to_store, out.slots, strict=True):
                tenant = key[0]
                before = self._slot_tenant.get(slot)
                self.stored += 1
                if before is not None:
                    self.reused += 1
                    self.crossed += before != tenant
                self._slot_tenant[slot] = tenant
        return out


@contextmanager
def recording() -> Iterator[list[_Recorder]]:
    """While open, every manager ``replay`` builds is wrapped in a ``_Recorder`` (listed)."""
    made: list[_Recorder] = []

    def build(*args: Any, **kwargs: Any) -> _Recorder:
        rec = _Recorder(create_manager(*args, **kwargs))
        made.append(rec)
        return rec

    with mock.patch.object(replay_module, "create_manager", build):
        yield made


def capacity_rows(
    by_tenant: dict[int, list[list[BlockKey]]],
    merged: list[list[BlockKey]],
    capacities: Sequence[int],
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Hit-ratio rows (shared, disjoint by share, disjoint 50/50 per capacity) and the shared
    replays' slot reassignment counts."""
    refs = {t: sum(map(len, by_tenant[t])) for t in TENANTS}
    total_refs = sum(refs.values())
    rows: list[dict[str, Any]] = []
    crossings: list[dict[str, Any]] = []
    for cap in capacities:
        with recording() as made:
            shared = replay(merged, POLICY, cap)
        (rec,) = made
        if sum(rec.hits.values()) != shared.prefix_hits:  # the recorder must see every lookup
            raise RuntimeError("recorded hits do not add up to the replay's")
        base: dict[str, Any] = {
            "capacity": cap,
            "layout": "shared",
            "pools": [cap],
            "tenant_hit_ratio": [rec.hits[t] / refs[t] for t in TENANTS],
            "hit_ratio": shared.hit_ratio,
        }
        rows.append(base)
        crossings.append(
            {
                "capacity": cap,
                "stored": rec.stored,
                "reused": rec.reused,
                "crossed": rec.crossed,
                "crossed_per_store": rec.crossed / rec.stored if rec.stored else 0.0,
                "crossed_per_reuse": rec.crossed / rec.reused if rec.reused else 0.0,
            }
        )
        first = round(cap * refs[0] / total_refs)
        for layout, pools in (
            ("disjoint by share", [first, cap - first]),
            ("disjoint 50/50", [cap // 2, cap - cap // 2]),
        ):
            results = [replay(by_tenant[t], POLICY, pools[t]) for t in TENANTS]
            hit_ratio = sum(r.prefix_hits for r in results) / total_refs
            rows.append(
                {
                    "capacity": cap,
                    "layout": layout,
                    "pools": pools,
                    "tenant_hit_ratio": [r.hit_ratio for r in results],
                    "hit_ratio": hit_ratio,
                    "vs_shared": hit_ratio / base["hit_ratio"],
                    "tenant_vs_shared": [
                        r.hit_ratio / s
                        for r, s in zip(results, base["tenant_hit_ratio"], strict=True)
                    ],
                }
            )
    return rows, crossings


def _median_op_s(op: Callable[[int], object], slots: Sequence[int]) -> float:
    """Median seconds of ``op(slot)`` over ``slots``, each timed alone."""
    times = []
    for slot in slots:
        start = time.perf_counter()
        op(slot)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _time_block(block: int, pool_bytes: int, rounds: int, rng: random.Random) -> dict[str, Any]:
    """Median seconds to zero one slot of a ``pool_bytes`` pool of ``block``-byte slots, and to
    copy one block into a slot, as a row (see ``scrub_rows``)."""
    n = max(8, pool_bytes // block)
    with HostPool.create(n, block, pin=False) as pool:
        slots_t = pool.tensor
        src = torch.randint(0, 256, (n, block), dtype=torch.uint8)
        order = list(range(n))

        def zero(slot: int) -> object:
            return slots_t[slot].zero_()

        def copy(slot: int) -> object:
            return slots_t[slot].copy_(src[order[slot]])

        zero_s: list[float] = []
        copy_s: list[float] = []
        _median_op_s(copy, range(n))  # warm-up
        for _ in range(rounds):
            slots = rng.sample(range(n), n)
            rng.shuffle(order)
            zero_s.append(_median_op_s(zero, slots))
            copy_s.append(_median_op_s(copy, slots))
    z, c = statistics.median(zero_s), statistics.median(copy_s)
    return {
        "block_bytes": block,
        "slots": n,
        "rounds": rounds,
        "zero_us": z * 1e6,
        "copy_us": c * 1e6,
        "zero_gbps": block / z / 1e9,
        "copy_gbps": block / c / 1e9,
        "scrub_vs_copy": z / c,
    }


def scrub_rows(pool_bytes: int, rounds: int, seed: int = 0) -> list[dict[str, Any]]:
    """Per block size: median seconds to zero one pool slot and to copy one block into a slot.

    The pool and the source blocks are each ``pool_bytes`` (larger than the caches, so neither
    op runs on a block that is still cached); slots and sources are visited in random order,
    zero and copy alternating round by round so both see the same machine. Each time is the
    median over the pool's slots of one op timed alone; a round's medians are then medianed.
    """
    rng = random.Random(seed)
    return [_time_block(block, pool_bytes, rounds, rng) for block in BLOCK_SIZES]


def _size(b: int) -> str:
    return f"{b >> 20} MiB" if b >= 1 << 20 else f"{b >> 10} KiB"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", type=Path, default=harness.TRACE)
    parser.add_argument("--capacity", default="5000,10000,20000")
    parser.add_argument("--quick", action="store_true", help="first 1000 requests, small pools")
    parser.add_argument("--out", type=Path, default=harness.RESULTS_DIR)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    requests = harness.read_trace(args.trace, 1000 if args.quick else 0)
    capacities = [int(c) for c in args.capacity.split(",")]

    started = time.perf_counter()
    by_tenant: dict[int, list[list[BlockKey]]] = {t: [] for t in TENANTS}
    merged = []
    for keys in requests:
        t = tenant_of(keys)
        by_tenant[t].append(tagged(keys, t))
        merged.append(tagged(keys, t))
    refs = [sum(map(len, by_tenant[t])) for t in TENANTS]
    share = [r / sum(refs) for r in refs]
    rows, crossings = capacity_rows(by_tenant, merged, capacities)
    replay_s = time.perf_counter() - started

    print(
        f"prefix hit ratio, {len(requests)} requests of {args.trace.name}, {POLICY}; tenants by "
        f"hash of the first block: A {len(by_tenant[0])} requests, {share[0]:.1%} of block "
        f"references; B {len(by_tenant[1])}, {share[1]:.1%}"
    )
    print(CAP_HEAD.format("capacity", "layout", "pools", "A", "B", "total", "vs shared"))
    for r in rows:
        vs = "baseline"
        if r["layout"] != "shared":
            vs = " / ".join(f"{v:.3f}" for v in [*r["tenant_vs_shared"], r["vs_shared"]])
        pools = "+".join(str(p) for p in r["pools"])
        ratios = [f"{v:.3f}" for v in [*r["tenant_hit_ratio"], r["hit_ratio"]]]
        print(CAP_HEAD.format(r["capacity"], r["layout"], pools, *ratios, vs))
    print("\nslots handed to a store in the shared pool that last held the other tenant's block:")
    for c in crossings:
        print(
            f"{c['capacity']:>8}: {c['crossed']} of {c['stored']} stores = "
            f"{c['crossed_per_store']:.3f} per stored block "
            f"({c['crossed_per_reuse']:.3f} of the {c['reused']} reused slots)"
        )
    print(f"replays took {replay_s:.1f} s")

    pool_bytes, rounds = ((32 << 20), 3) if args.quick else ((256 << 20), 7)
    started = time.perf_counter()
    scrubs = scrub_rows(pool_bytes, rounds)
    scrub_s = time.perf_counter() - started
    # Store-time overhead of a scrubbing shared pool: scrubs per stored block x scrub / copy.
    worst = max(c["crossed_per_store"] for c in crossings)
    print(
        f"\nscrub (zero one slot) vs copy one block into a slot, torch {torch.__version__} CPU, "
        f"1 thread, {_size(pool_bytes)} pool, median over slots, median of {rounds} rounds:"
    )
    print(
        SCRUB_HEAD.format(
            "block",
            "slots",
            "zero us",
            "copy us",
            "zero GB/s",
            "copy GB/s",
            "scrub/copy",
            "+store time",
        )
    )
    for row in scrubs:
        row["store_overhead_at_worst_capacity"] = worst * row["scrub_vs_copy"]
        print(
            SCRUB_HEAD.format(
                _size(row["block_bytes"]),
                row["slots"],
                f"{row['zero_us']:.1f}",
                f"{row['copy_us']:.1f}",
                f"{row['zero_gbps']:.2f}",
                f"{row['copy_gbps']:.2f}",
                f"{row['scrub_vs_copy']:.3f}",
                f"{row['store_overhead_at_worst_capacity']:.1%}",
            )
        )
    print(
        f"(+store time: {worst:.3f} scrubs per stored block, the most at any capacity, "
        "x scrub/copy)"
    )
    print(f"scrub timings took {scrub_s:.1f} s")

    harness.write_results(
        args.out / "tenant_isolation.json",
        {
            "benchmark": "tenant_isolation",
            "machine": harness.machine(torch=torch.__version__, torch_threads=1),
            "trace": args.trace.name,
            "requests": len(requests),
            "quick": args.quick,
            "policy": POLICY,
            "tenant_rule": "blake2b(first block key, 8 bytes)[0] & 1",
            "tenant_requests": [len(by_tenant[t]) for t in TENANTS],
            "tenant_share": share,
            "capacity": rows,
            "slot_crossings": crossings,
            "scrub": scrubs,
            "seconds": {"replays": round(replay_s, 3), "scrub": round(scrub_s, 3)},
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
