"""What retentions cost in memory, and whether it comes back when they end.

An ``OffloadManager`` of 20,000 blocks with 10,000 keys stored (ready). Retentions are made as
the service's ``retain`` makes them (each call's keys are fresh ``bytes``, as decoded from a
request body), under its default bounds when the manager has them (``max_retentions`` 4096,
``max_retention_keys`` 1,048,576 key references, ``max_retained_blocks`` half the pool: 10,000);
a call past a bound is refused and counted. RSS (``/proc/self/statm``) after ``gc.collect()``:

- ``baseline``: the manager and its stored keys, no retention;
- ``same_keys``: ``--retentions`` (10,000) retentions of the same 10,000 keys (the issue's
  flood): how many were taken, the peak, the cost per taken retention;
- ``come_and_go``: 10,000 retentions of 100 keys each, 2,000 live at a time (200,000
  references) then expired; RSS at the peak and after they are all gone, against the baseline.

Before/after: run it with ``PYTHONPATH`` naming an older tree (``git worktree add /tmp/base
HEAD``; ``PYTHONPATH=/tmp/base .venv/bin/python bench/retention_memory.py --retentions 200``):
a manager without the key-reference bound takes every call. Writes
``bench/results/retention_memory.json``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from pathlib import Path

import manager as manager_pkg
from manager import OffloadManager, ReqContext, create_manager

PAGE = os.sysconf("SC_PAGE_SIZE")
MAX_RETENTIONS = 4096
MAX_REFERENCES = 1 << 20


def rss() -> int:
    gc.collect()
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def fresh(keys: list[bytes]) -> list[bytes]:
    return [bytes(bytearray(k)) for k in keys]


def retain(m: OffloadManager, keys: list[bytes], name: str, bound: bool, ttl: float) -> bool:
    """One ``retain`` as ``Control`` checks it; whether it was taken."""
    if m.num_retained + m.new_retained(name, keys) > 10_000:
        return False
    if not m.has_retention(name) and m.num_retentions >= MAX_RETENTIONS:
        return False
    if bound and m.retention_references + m.new_references(name, keys) > MAX_REFERENCES:
        return False
    m.retain(keys, ttl, name)
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--retentions", type=int, default=10_000)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    now = [0.0]
    m = create_manager(num_blocks=20_000, clock=lambda: now[0])
    bound = hasattr(m, "retention_references")
    keys = [i.to_bytes(8, "big") for i in range(10_000)]
    ctx = ReqContext("w")
    m.on_new_request(ctx)
    m.prepare_store(keys, ctx)
    m.complete_store(keys, ctx)
    m.on_request_finished(ctx)
    base = rss()
    rows: dict[str, dict[str, float]] = {}

    started = time.perf_counter()
    taken = sum(retain(m, fresh(keys), f"s{n}", bound, 10.0) for n in range(args.retentions))
    peak = rss()
    now[0] = 20.0
    m.expire_retentions()
    after = rss()
    rows["same_keys"] = {
        "attempted": args.retentions,
        "taken": taken,
        "peak_mib": (peak - base) / 2**20,
        "per_retention_kib": (peak - base) / max(1, taken) / 1024,
        "after_mib": (after - base) / 2**20,
        "seconds": time.perf_counter() - started,
    }

    started = time.perf_counter()
    base2 = rss()
    come, peak = 0, 0
    for round_ in range(5):  # 2,000 live at a time (under max_retentions), then expired
        for n in range(round_ * 2000, (round_ + 1) * 2000):
            at = (n * 100) % 10_000
            come += retain(m, fresh(keys[at : at + 100]), f"c{n}", bound, 10.0)
        peak = max(peak, rss())
        now[0] += 20.0
        m.expire_retentions()
    after = rss()
    rows["come_and_go"] = {
        "attempted": 10_000,
        "taken": come,
        "peak_mib": (peak - base2) / 2**20,
        "after_mib": (after - base2) / 2**20,
        "after_vs_baseline": after / base,
        "seconds": time.perf_counter() - started,
    }
    print(f"manager: {manager_pkg.__file__}  key-reference bound: {bound}")
    print(f"baseline RSS {base / 2**20:.1f} MiB")
    print(f"{'phase':<12} {'taken':>7} {'peak MiB':>9} {'after MiB':>9} {'KiB/ret':>8} {'s':>6}")
    for name, r in rows.items():
        per = r.get("per_retention_kib", r["peak_mib"] * 1024 / max(1, r["taken"]))
        print(
            f"{name:<12} {r['taken']:>7.0f} {r['peak_mib']:>9.1f} {r['after_mib']:>9.1f} "
            f"{per:>8.1f} {r['seconds']:>6.1f}"
        )
    out = args.out or Path(__file__).resolve().parent / "results" / "retention_memory.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {"bound": bound, "baseline_mib": base / 2**20, "rows": rows}
    out.write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()
