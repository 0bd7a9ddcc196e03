"""Manager operation throughput: keys/s per operation, per policy and capacity.

Workload (the issue's): 100k distinct 32-byte keys, requests of 16 consecutive keys, pool
capacity 1.0x and 0.5x of the keys. Per policy and capacity, in this order over all requests:

- store:  on_new_request, then timed prepare_store + complete_store of the request's 16 keys
- lookup: timed batched lookup of each request's 16 keys
- load:   timed lookup + prepare_load + complete_load of each request's hit prefix
- touch:  timed touch of each request's hit prefix
- finish: timed on_request_finished of every request (requests that stored and touched reorder
          their blocks tail-before-head here, so this is the honest cost)

Baseline measured in the same run: the same loops over a bare ``dict`` doing the minimum a
manager must do per key (get, set, delete). Its ratio makes runs on noisy machines comparable.
The issue's reference figures (vLLM 0.33.0 ``CPUOffloadingManager``, same workload, this kind
of machine) and the 1.5x target are printed beside ours.

Run: ``.venv/bin/python bench/manager_ops.py`` (``--quick`` for a smaller run).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import harness  # noqa: E402
from manager import ReqContext, available_policies, create_manager  # noqa: E402

# vLLM 0.33.0 CPUOffloadingManager on this kind of machine (from the issue), keys/s or req/s.
VLLM_REFERENCE: dict[str, dict[str, float]] = {
    "lru": {"store": 306e3, "lookup": 2.8e6, "load": 349e3, "finish": 29e3},
    "arc": {"store": 462e3, "lookup": 3.0e6, "load": 949e3, "finish": 161e3},
}
TARGET_FACTOR = 1.5
OPS = ("store", "lookup", "load", "touch", "finish")


def make_keys(n: int, seed: int = 1234) -> list[bytes]:
    """``n`` distinct pseudo-random 32-byte keys (block hashes), reproducible."""
    import hashlib

    prefix = seed.to_bytes(8, "big")
    return [hashlib.sha256(prefix + i.to_bytes(8, "big")).digest() for i in range(n)]


def run_manager(policy: str, keys: list[bytes], capacity: int, req_len: int) -> dict[str, float]:
    """One pass of the workload on a fresh manager; returns rates per op."""
    m = create_manager(num_blocks=capacity, policy=policy)
    reqs = [keys[i : i + req_len] for i in range(0, len(keys), req_len)]
    ctxs = [ReqContext(req_id=f"r{i}") for i in range(len(reqs))]
    for ctx in ctxs:
        m.on_new_request(ctx)
    rates: dict[str, float] = {}
    timer = time.perf_counter

    gc.collect()
    prepare_store, complete_store = m.prepare_store, m.complete_store
    t0 = timer()
    for ctx, ks in zip(ctxs, reqs, strict=True):
        out = prepare_store(ks, ctx)
        if out is not None:
            complete_store(out.keys_to_store, ctx, True)
    rates["store"] = len(keys) / (timer() - t0)
    m.take_events()

    gc.collect()
    lookup = m.lookup
    t0 = timer()
    for ctx, ks in zip(ctxs, reqs, strict=True):
        lookup(ks, ctx)
    rates["lookup"] = len(keys) / (timer() - t0)

    prefixes = []
    for ctx, ks in zip(ctxs, reqs, strict=True):
        res = lookup(ks, ctx)
        prefixes.append(ks[: res.hit_prefix])
    loaded = sum(len(p) for p in prefixes)

    gc.collect()
    prepare_load, complete_load = m.prepare_load, m.complete_load
    t0 = timer()
    for ctx, ks in zip(ctxs, reqs, strict=True):
        prefix = ks[: lookup(ks, ctx).hit_prefix]
        if prefix:
            prepare_load(prefix, ctx)
            complete_load(prefix, ctx)
    rates["load"] = loaded / (timer() - t0)

    gc.collect()
    touch = m.touch
    t0 = timer()
    for ctx, prefix in zip(ctxs, prefixes, strict=True):
        touch(prefix, ctx)
    rates["touch"] = loaded / (timer() - t0)

    gc.collect()
    finish = m.on_request_finished
    t0 = timer()
    for ctx in ctxs:
        finish(ctx)
    rates["finish"] = len(ctxs) / (timer() - t0)

    stats = m.stats()
    assert stats.free + stats.pending + stats.ready == capacity
    assert stats.pinned == 0
    assert stats.live_requests == 0
    return rates


def run_baseline(keys: list[bytes], capacity: int, req_len: int) -> dict[str, float]:
    """The same loops over a bare dict: the floor of per-key Python work."""
    reqs = [keys[i : i + req_len] for i in range(0, len(keys), req_len)]
    d: dict[bytes, int] = {}
    order: list[bytes] = []
    rates: dict[str, float] = {}
    timer = time.perf_counter

    gc.collect()
    t0 = timer()
    slot = 0
    for ks in reqs:
        for k in ks:
            if len(d) >= capacity:
                del d[order[slot - capacity]]
            d[k] = slot
            order.append(k)
            slot += 1
    rates["store"] = len(keys) / (timer() - t0)

    gc.collect()
    get = d.get
    t0 = timer()
    for ks in reqs:
        [get(k) for k in ks]
    rates["lookup"] = len(keys) / (timer() - t0)

    gc.collect()
    t0 = timer()
    loaded = 0
    for ks in reqs:
        found = [get(k) for k in ks]
        if None not in found:
            pins = {k: 1 for k in ks}
            for k in ks:
                del pins[k]
            loaded += len(ks)
    rates["load"] = loaded / (timer() - t0) if loaded else 0.0
    rates["touch"] = rates["lookup"]
    t0 = timer()
    live = {f"r{i}": None for i in range(len(reqs))}
    for i in range(len(reqs)):
        live.pop(f"r{i}")
    rates["finish"] = len(reqs) / (timer() - t0)
    return rates


def median_rates(fn: Callable[[], dict[str, float]], repeats: int) -> dict[str, float]:
    runs = [fn() for _ in range(repeats)]
    return {op: statistics.median(r[op] for r in runs) for op in runs[0]}


def fmt(rate: float) -> str:
    if rate >= 1e6:
        return f"{rate / 1e6:.2f}M"
    return f"{rate / 1e3:.0f}k"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=100_000)
    parser.add_argument("--req-len", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--policies", default=",".join(available_policies()))
    parser.add_argument("--quick", action="store_true", help="20k keys, 3 repeats")
    parser.add_argument("--out", default=str(harness.RESULTS_DIR / "manager_ops.json"))
    args = parser.parse_args(argv)
    if args.quick:
        args.keys, args.repeats = 20_000, 3

    keys = make_keys(args.keys)
    results: list[dict[str, object]] = []
    header = (
        f"{'policy':<8}{'cap':>5} | "
        + " ".join(f"{op:>8}" for op in OPS)
        + " | vs 1.5x vLLM (store/lookup/load/finish) | vs dict floor"
    )
    print(f"manager ops: {args.keys} keys, requests of {args.req_len}, median of {args.repeats}")
    print(header)
    print("-" * len(header))
    for cap_factor in (1.0, 0.5):
        capacity = int(args.keys * cap_factor)
        base = median_rates(partial(run_baseline, keys, capacity, args.req_len), args.repeats)
        for policy in args.policies.split(","):
            rates = median_rates(
                partial(run_manager, policy, keys, capacity, args.req_len), args.repeats
            )
            ref = VLLM_REFERENCE.get(policy)
            vs_target = {op: rates[op] / (TARGET_FACTOR * ref[op]) for op in ref} if ref else None
            vs_floor = {op: rates[op] / base[op] for op in OPS if base[op]}
            results.append(
                {
                    "policy": policy,
                    "capacity_factor": cap_factor,
                    "capacity": capacity,
                    "rates": rates,
                    "vs_target": vs_target,
                    "vs_dict_floor": vs_floor,
                }
            )
            target_cell = (
                "/".join(f"{vs_target[op]:.2f}" for op in ("store", "lookup", "load", "finish"))
                if vs_target
                else "n/a"
            )
            floor_ops = ("store", "lookup", "load")
            floor_cell = "/".join(f"{vs_floor.get(op, 0):.2f}" for op in floor_ops)
            print(
                f"{policy:<8}{cap_factor:>5} | "
                + " ".join(f"{fmt(rates[op]):>8}" for op in OPS)
                + f" | {target_cell:<39} | {floor_cell}"
            )
        print(
            f"{'dict':<8}{cap_factor:>5} | " + " ".join(f"{fmt(base[op]):>8}" for op in OPS) + " |"
        )
    host = harness.machine()
    harness.write_results(
        Path(args.out),
        {
            "benchmark": "manager_ops",
            "keys": args.keys,
            "req_len": args.req_len,
            "repeats": args.repeats,
            "python": host["python"],
            "cpus": host["cpus"],
            "vllm_reference": VLLM_REFERENCE,
            "target_factor": TARGET_FACTOR,
            "results": results,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
