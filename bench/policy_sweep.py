"""Policy lab benchmark: prefix hit ratio per policy and capacity on the shipped trace.

Replays ``bench/data/mooncake_synthetic_trace.jsonl`` (Mooncake FAST'25 synthetic trace) with the
real manager for every registered policy at 5k, 10k and 20k blocks, next to Belady's MIN measured
in the same run (the baseline: each policy's ratio is reported as a fraction of it). Prints the
table, writes ``bench/results/policy_sweep.json`` and ``bench/results/policy_sweep.png``.

The issue's reference (vLLM 0.33.0 policies, same accounting): LRU 0.279/0.424/0.571, ARC
0.281/0.433/0.591, LRU with store threshold 2 0.294/0.425/0.490; target: the best kvoffload
policy at >= 0.75 of Belady at every capacity.

Run: ``.venv/bin/python bench/policy_sweep.py`` (``--quick``: first 1000 requests).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from app.replay import format_table, save_plot, sweep  # noqa: E402
from manager import available_policies  # noqa: E402
from manager.replay import parse_trace  # noqa: E402

TRACE = ROOT / "bench" / "data" / "mooncake_synthetic_trace.jsonl"
TARGET_FRACTION = 0.75


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument("--capacity", default="5000,10000,20000")
    parser.add_argument("--quick", action="store_true", help="first 1000 requests only")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args(argv)
    with args.trace.open(encoding="utf-8") as fh:
        requests = parse_trace(fh)
    if args.quick:
        requests = requests[:1000]
    capacities = [int(c) for c in args.capacity.split(",")]
    rows = []
    for threshold in (0, 2):
        for row in sweep(
            requests,
            available_policies(),
            capacities,
            store_threshold=threshold,
            belady=threshold == 0,
        ):
            if threshold:
                row["policy"] = f"{row['policy']}+th{threshold}"
                row["fraction_of_belady"] = None
            rows.append(row)
    ceiling = {r["capacity"]: r["hit_ratio"] for r in rows if r["policy"] == "belady"}
    for row in rows:
        if ceiling.get(row["capacity"]):
            row["fraction_of_belady"] = row["hit_ratio"] / ceiling[row["capacity"]]
    print(f"prefix hit ratio, {len(requests)} requests of {args.trace.name}")
    print(format_table(rows, capacities))
    best = {
        cap: max(
            (r for r in rows if r["capacity"] == cap and r["policy"] != "belady"),
            key=lambda r: r["hit_ratio"],
        )
        for cap in capacities
    }
    verdicts = []
    for cap, row in best.items():
        frac = row["fraction_of_belady"]
        ok = frac >= TARGET_FRACTION
        verdicts.append({"capacity": cap, "best": row["policy"], "fraction": frac, "met": ok})
        print(
            f"best at {cap}: {row['policy']} {row['hit_ratio']:.3f} = {frac:.3f}x Belady "
            f"({'meets' if ok else 'below'} the {TARGET_FRACTION}x target)"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "policy_sweep.json").write_text(
        json.dumps(
            {
                "benchmark": "policy_sweep",
                "trace": args.trace.name,
                "requests": len(requests),
                "rows": rows,
                "best": verdicts,
            },
            indent=2,
        )
    )
    save_plot(rows, args.out / "policy_sweep.png")
    print(f"wrote {args.out / 'policy_sweep.json'} and policy_sweep.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
