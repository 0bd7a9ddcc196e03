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

Before and after a change to ``manager/``, on one machine: ``--against DIR`` runs the bench of
another checkout ``DIR`` (say ``git archive HEAD | tar -x -C /tmp/base``) and this one's, each in
its own process with this interpreter, alternating for ``--rounds`` rounds (the first to run
alternates too, so a drift of the machine falls on both), then prints every figure's median
over the rounds on each side and their ratio (this / ``DIR``), flags the figures below
``--threshold`` and writes the record to ``--out`` (default ``manager_ops_against.json``)::

    .venv/bin/python bench/manager_ops.py --against /tmp/base --rounds 3

Each child takes the options given here (``--keys``, ``--req-len``, ``--repeats``, ``--quick``,
``--policies``); without ``--policies`` each runs its own policies and the common ones are
compared. Noise is real on a shared machine: on two shared cores, two processes of the same code
differ by up to 30% on a figure, so a flagged figure says little by itself.

``--against DIR --lockstep`` measures finer: both checkouts' ``manager`` packages in this
process, a fresh manager of each per policy and capacity, and every request's timed calls run on
both back to back (which goes first alternates), with the garbage collector off while timing. A
slow spell of the machine then falls on both sides alike: identical code (``--against`` this
checkout itself) reads a median ratio of 1.00 and every figure within about 5%. Its rates are
below a plain run's (a timer read per call, two managers in memory): read its ratios only. A
round is one such pass of every policy and capacity (``--repeats`` is unused)::

    .venv/bin/python bench/manager_ops.py --against /tmp/base --lockstep --rounds 5
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

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


Figure = tuple[str, float, str]  # (policy, capacity factor, op)


def run_child(root: Path, options: list[str], out: Path) -> dict[Figure, float]:
    """One run of ``root``'s bench in a fresh process; its rates by figure."""
    script = root / "bench" / "manager_ops.py"
    subprocess.run(
        [sys.executable, str(script), *options, "--out", str(out)],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    record = json.loads(out.read_text())
    return {
        (r["policy"], r["capacity_factor"], op): rate
        for r in record["results"]
        for op, rate in r["rates"].items()
    }


def process_rounds(other: Path, args: argparse.Namespace) -> dict[str, list[dict[Figure, float]]]:
    """``--rounds`` rounds, each one run of ``other``'s bench and one of this one's (which runs
    first alternates), every run in its own process; the rates of each run by side."""
    options = ["--keys", str(args.keys), "--req-len", str(args.req_len)]
    options += ["--repeats", str(args.repeats)]
    if args.policies is not None:
        options += ["--policies", args.policies]
    sides = {"before": other, "after": ROOT}
    runs: dict[str, list[dict[Figure, float]]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory(prefix="manager_ops_") as tmp:
        for i in range(args.rounds):
            order = ("before", "after") if i % 2 == 0 else ("after", "before")
            for side in order:
                t0 = time.perf_counter()
                out = Path(tmp) / f"{side}_{i}.json"
                runs[side].append(run_child(sides[side], options, out))
                took = time.perf_counter() - t0
                print(
                    f"round {i + 1}/{args.rounds}: {side} ({sides[side]}) {took:.0f}s", flush=True
                )
    return runs


def import_manager(root: Path) -> Any:
    """The ``manager`` package of checkout ``root``, imported beside this one's, which stays the
    one ``import manager`` finds (the package imports nothing lazily, so the two never mix)."""

    def is_ours(name: str) -> bool:
        return name == "manager" or name.startswith("manager.")

    ours = {n: m for n, m in sys.modules.items() if is_ours(n)}
    for name in ours:
        del sys.modules[name]
    sys.path.insert(0, str(root))
    try:
        theirs = importlib.import_module("manager")
    finally:
        sys.path.remove(str(root))
        for name in [n for n in sys.modules if is_ours(n)]:
            del sys.modules[name]
        sys.modules.update(ours)
    where = Path(str(theirs.__file__)).resolve().parent
    if where != root / "manager":
        raise SystemExit(f"--lockstep: imported the manager of {where}, not {root}'s")
    return theirs


def lockstep_pass(
    packages: list[Any], policy: str, keys: list[bytes], capacity: int, req_len: int
) -> list[dict[str, float]]:
    """The workload of ``run_manager`` on one fresh manager of each package, in lockstep: each
    request's timed calls run on every manager back to back (which goes first alternates), so
    a slow spell of the machine falls on all of them. The garbage collector is off while
    timing: a full collection walks every manager's objects and lands on whichever side is
    running. Rates per op, one dict per package."""
    reqs = [keys[i : i + req_len] for i in range(0, len(keys), req_len)]
    sides = []
    for pkg in packages:
        m = pkg.create_manager(num_blocks=capacity, policy=policy)
        ctxs = [pkg.ReqContext(req_id=f"r{i}") for i in range(len(reqs))]
        for ctx in ctxs:
            m.on_new_request(ctx)
        sides.append((m, ctxs))
    n = len(sides)
    orders = [list(range(n)), list(range(n - 1, -1, -1))]
    spent = {op: [0.0] * n for op in OPS}
    timer = time.perf_counter

    def store(m: Any, ks: list[bytes], ctx: Any) -> None:
        out = m.prepare_store(ks, ctx)
        if out is not None:
            m.complete_store(out.keys_to_store, ctx, True)

    def load(m: Any, ks: list[bytes], ctx: Any) -> None:
        prefix = ks[: m.lookup(ks, ctx).hit_prefix]
        if prefix:
            m.prepare_load(prefix, ctx)
            m.complete_load(prefix, ctx)

    def timed(op: str, call: Callable[[Any, int, Any], object]) -> None:
        """``call(manager, request index, its context)`` for every request on both sides, the
        side going first alternating, with the collector off while timing."""
        gc.collect()
        gc.disable()
        try:
            for i in range(len(reqs)):
                for s in orders[i & 1]:
                    m, ctxs = sides[s]
                    t0 = timer()
                    call(m, i, ctxs[i])
                    spent[op][s] += timer() - t0
        finally:
            gc.enable()

    timed("store", lambda m, i, ctx: store(m, reqs[i], ctx))
    timed("lookup", lambda m, i, ctx: m.lookup(reqs[i], ctx))
    timed("load", lambda m, i, ctx: load(m, reqs[i], ctx))
    # Each side's hit prefix of each request, found before timing the touches.
    prefixes = {
        m: [ks[: m.lookup(ks, c).hit_prefix] for ks, c in zip(reqs, ctxs, strict=True)]
        for m, ctxs in sides
    }
    timed("touch", lambda m, i, ctx: m.touch(prefixes[m][i], ctx))
    timed("finish", lambda m, i, ctx: m.on_request_finished(ctx))
    loaded = sum(map(len, prefixes[sides[0][0]]))
    counts = {"store": len(keys), "lookup": len(keys), "load": loaded, "touch": loaded}
    counts["finish"] = len(reqs)
    return [{op: counts[op] / spent[op][s] for op in OPS} for s in range(n)]


def lockstep_rounds(other: Path, args: argparse.Namespace) -> dict[str, list[dict[Figure, float]]]:
    """``--rounds`` rounds of ``lockstep_pass`` per policy and capacity, ``other``'s manager
    against this one's in this process; the rates of each round by side."""
    packages = [import_manager(other), sys.modules["manager"]]
    theirs = set(packages[0].available_policies())
    policies = args.policies.split(",") if args.policies else available_policies()
    policies = [p for p in policies if p in theirs]
    keys = make_keys(args.keys)
    runs: dict[str, list[dict[Figure, float]]] = {"before": [], "after": []}
    for i in range(args.rounds):
        t0 = time.perf_counter()
        before: dict[Figure, float] = {}
        after: dict[Figure, float] = {}
        for cap_factor in (1.0, 0.5):
            capacity = int(args.keys * cap_factor)
            for policy in policies:
                b, a = lockstep_pass(packages, policy, keys, capacity, args.req_len)
                for op in OPS:
                    before[(policy, cap_factor, op)] = b[op]
                    after[(policy, cap_factor, op)] = a[op]
        runs["before"].append(before)
        runs["after"].append(after)
        took = time.perf_counter() - t0
        print(f"round {i + 1}/{args.rounds} (lockstep) {took:.0f}s", flush=True)
    return runs


def run_against(args: argparse.Namespace) -> int:
    """``--against DIR``: ``DIR``'s manager against this one's; medians and ratios."""
    other = Path(args.against).resolve()
    if not (other / "bench" / "manager_ops.py").is_file():
        raise SystemExit(f"--against: no bench/manager_ops.py under {other}")
    runs = lockstep_rounds(other, args) if args.lockstep else process_rounds(other, args)
    common = set.intersection(*(set(r) for side in runs.values() for r in side))
    figures = sorted(common, key=lambda f: (-f[1], f[0], OPS.index(f[2])))
    each = "one lockstep pass" if args.lockstep else f"the median of {args.repeats}"
    print(
        f"manager ops, {args.keys} keys, medians of {args.rounds} rounds (each {each}); "
        f"before: {other}, after: {ROOT}"
    )
    header = f"{'policy':<12}{'cap':>4} {'op':<7}{'before':>9}{'after':>9}{'ratio':>7}"
    print(header)
    print("-" * len(header))
    rows: list[dict[str, object]] = []
    ratios: list[float] = []
    for policy, cap, op in figures:
        before = [r[(policy, cap, op)] for r in runs["before"]]
        after = [r[(policy, cap, op)] for r in runs["after"]]
        b, a = statistics.median(before), statistics.median(after)
        ratio = a / b if b else float("nan")
        ratios.append(ratio)
        flag = "  <" if ratio < args.threshold else ""
        print(f"{policy:<12}{cap:>4} {op:<7}{fmt(b):>9}{fmt(a):>9}{ratio:>7.3f}{flag}")
        rows.append(
            {
                "policy": policy,
                "capacity_factor": cap,
                "op": op,
                "before": before,
                "after": after,
                "before_median": b,
                "after_median": a,
                "ratio": ratio,
            }
        )
    below = sum(x < args.threshold for x in ratios)
    if rows:
        low = min(range(len(rows)), key=ratios.__getitem__)
        print(
            f"ratios: median {statistics.median(ratios):.3f}, lowest {ratios[low]:.3f} "
            f"({rows[low]['policy']} {rows[low]['capacity_factor']} {rows[low]['op']}); "
            f"{below} of {len(rows)} below {args.threshold}"
        )
    harness.write_results(
        Path(args.out or harness.RESULTS_DIR / "manager_ops_against.json"),
        {
            "benchmark": "manager_ops_against",
            "before": str(other),
            "after": str(ROOT),
            "rounds": args.rounds,
            "mode": "lockstep" if args.lockstep else "processes",
            "keys": args.keys,
            "req_len": args.req_len,
            "repeats": args.repeats,
            "threshold": args.threshold,
            "machine": harness.machine(),
            "figures": rows,
        },
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=100_000)
    parser.add_argument("--req-len", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--policies", help="comma-separated (default: every registered one)")
    parser.add_argument("--quick", action="store_true", help="20k keys, 3 repeats")
    parser.add_argument(
        "--out",
        help="the JSON record (default: manager_ops.json, or manager_ops_against.json with "
        "--against, under bench/results/)",
    )
    parser.add_argument(
        "--against",
        metavar="DIR",
        help="compare with the checkout DIR: alternate its bench and this one's in subprocesses",
    )
    parser.add_argument("--rounds", type=int, default=3, help="with --against (default 3)")
    parser.add_argument(
        "--lockstep",
        action="store_true",
        help="with --against: both managers in this process, each call timed on both in turn",
    )
    parser.add_argument(
        "--threshold", type=float, default=0.97, help="with --against: flag ratios below"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.keys, args.repeats = 20_000, 3
    if args.against:
        return run_against(args)
    if args.policies is None:
        args.policies = ",".join(available_policies())
    if args.out is None:
        args.out = str(harness.RESULTS_DIR / "manager_ops.json")

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
