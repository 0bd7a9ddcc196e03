"""``kvoffload replay``: replay a request trace against the real manager, per policy and capacity.

Reads a Mooncake-format trace (JSON lines with ``hash_ids``), runs ``manager.replay.replay`` for
every requested policy and capacity plus Belady's MIN (the ceiling) at each capacity, and prints
a table of prefix hit ratios and their fraction of Belady's. ``--json`` prints the rows as JSON
instead; ``--plot FILE.png`` saves hit ratio against capacity per policy (needs matplotlib: the
``plot`` extra, ``pip install 'kvoffload[plot]'``).

``--policy oracle-NAME --param horizon=H`` replays the oracle-admission bound over policy NAME:
a new block is stored only if it is used again within H pool sizes of block references (H may
be ``inf``: ever used again); see ``manager.replay``.

``--disk-capacity N`` puts a disk tier of N blocks below each pool (``manager.replay``'s two
levels, decided by ``manager.tiers.DiskIndex`` as the service decides them): the rows gain the
pool and disk hit ratios, demotions (disk writes), admissions refused and disk evictions, and
print as one line per policy and capacity. Belady's rows are skipped there (MIN is a pool-only
ceiling, not one for two tiers) and a bound cannot be the policy.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from importlib.util import find_spec
from pathlib import Path
from typing import Any, TextIO

from manager import InvalidArgumentError, ManagerError, UnknownPolicyError, available_policies
from manager.policies import canonical_policy_name, policy_params_help
from manager.replay import (
    BELADY,
    ReplayResult,
    check_params,
    is_bound,
    parse_trace,
    replay,
    replay_policy_name,
)

# What ``kvoffload replay --help`` says (the module docstring, in plain text for a terminal).
HELP = """\
Replay a request trace against the real manager, per policy and capacity.

Reads a Mooncake-format trace (JSON lines with hash_ids), replays it for every requested policy
and capacity plus Belady's MIN (the ceiling: the best any policy can do) at each capacity, and
prints a table of prefix hit ratios. A cell reads "0.412 (0.87x B)": prefix hit ratio 0.412,
87% of Belady's at that capacity (B). --json prints the rows as JSON instead; --plot FILE.png
saves hit ratio against capacity per policy (needs matplotlib).

--policy oracle-NAME --param horizon=H replays the oracle-admission bound over policy NAME: a
new block is stored only if it is used again within H pool sizes of block references (H may be
inf: ever used again).

--disk-capacity N adds a disk tier of N blocks below each pool, decided as the service decides
it: a block the pool evicts is written to disk once asked for --disk-admit-after K times
(lookups, loads and stores each count; default 2), a disk hit is read back into the pool and
keeps its disk copy. Each row then shows the hit ratio (total, pool, disk), demotions (disk
writes), admissions refused and disk evictions; Belady's rows are skipped.
"""

#: ``--disk-admit-after`` when not given, as the service's ``--disk-admit-after``.
DEFAULT_ADMIT_AFTER = 2

TABLE_LEGEND = "hit ratio (N.NNx B): prefix hit ratio, and its fraction of Belady's MIN (B)"


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Register the ``replay`` subcommand on an argparse subparsers object."""
    parser: argparse.ArgumentParser = sub.add_parser(
        "replay",
        help="replay a request trace against the manager (hit ratio per policy and capacity)",
        description=HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("trace", type=Path, help="Mooncake-format JSON-lines trace")
    parser.add_argument(
        "--policy",
        default="all",
        help="policy name, comma-separated names, or 'all' (every registered policy); "
        "oracle-NAME with --param horizon=H for the oracle-admission bound",
    )
    parser.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="K=V",
        help="policy parameter (repeatable; applies to a single --policy). Accepted: "
        + "; ".join(policy_params_help().splitlines()),
    )
    parser.add_argument(
        "--capacity",
        required=True,
        help="pool capacity in blocks, or comma-separated capacities (e.g. 5000,10000,20000)",
    )
    parser.add_argument(
        "--store-threshold",
        type=int,
        default=0,
        metavar="N",
        help="admit a new block on its N-th store offer (0: at once)",
    )
    parser.add_argument(
        "--disk-capacity",
        type=int,
        metavar="N",
        help="add a disk tier of N blocks below the pool (skips the Belady rows)",
    )
    parser.add_argument(
        "--disk-admit-after",
        type=int,
        metavar="K",
        help=f"demote an evicted block once asked for K times (default {DEFAULT_ADMIT_AFTER}; "
        "needs --disk-capacity)",
    )
    parser.add_argument(
        "--disk-policy",
        metavar="NAME",
        help="the disk's eviction policy (default: the pool's; needs --disk-capacity)",
    )
    parser.add_argument("--no-belady", action="store_true", help="skip the Belady ceiling")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument(
        "--plot", type=Path, help="save hit ratio vs capacity to this PNG (kvoffload[plot])"
    )
    return parser


def parse_param(text: str) -> tuple[str, Any]:
    """``k=v`` -> (k, v) with v as int, float, bool or str."""
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise InvalidArgumentError(f"--param expects K=V, got {text!r}")
    value: Any = raw
    if raw.lower() in ("true", "false"):
        value = raw.lower() == "true"
    else:
        for cast in (int, float):
            try:
                value = cast(raw)
                break
            except ValueError:
                pass
    return key, value


def parse_capacities(text: str) -> list[int]:
    """``"5000,10000"`` -> ``[5000, 10000]``; every capacity must be a positive integer."""
    try:
        caps = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise InvalidArgumentError(f"--capacity expects integers, got {text!r}") from None
    if not caps or any(c <= 0 for c in caps):
        raise InvalidArgumentError(f"--capacity expects positive integers, got {text!r}")
    return caps


def sweep(
    requests: Sequence[Sequence[bytes]],
    policies: Sequence[str],
    capacities: Sequence[int],
    *,
    store_threshold: int = 0,
    params: dict[str, Any] | None = None,
    belady: bool = True,
    progress: TextIO | None = None,
    disk_capacity: int | None = None,
    disk_admit_after: int = DEFAULT_ADMIT_AFTER,
    disk_policy: str | None = None,
) -> list[dict[str, Any]]:
    """Replay every (policy, capacity); rows carry ``fraction_of_belady`` when measured.

    With ``disk_capacity`` every replay has that disk tier below its pool (rows carry
    ``disk``) and Belady's rows are skipped whatever ``belady`` says.
    """
    ceiling: dict[int, float] = {}
    rows: list[dict[str, Any]] = []
    names = ([BELADY] if belady and disk_capacity is None else []) + list(policies)
    for name in names:
        for cap in capacities:
            label = f"{name} @ {cap}"
            started = time.perf_counter()

            def report(done: int, total: int, label: str = label) -> None:
                if progress is not None:
                    width = 30
                    filled = width * done // total
                    bar = "#" * filled + "-" * (width - filled)
                    progress.write(f"\r{label:<24} [{bar}] {done}/{total}")
                    progress.flush()

            result: ReplayResult = replay(
                requests,
                name,
                cap,
                store_threshold=0 if name == BELADY else store_threshold,
                params=None if name == BELADY else params,
                progress=report if progress is not None else None,
                disk_capacity=disk_capacity,
                disk_admit_after=disk_admit_after,
                disk_policy=disk_policy,
            )
            if progress is not None:
                progress.write("\r" + " " * 72 + "\r")
            row = result.to_dict()
            row["seconds"] = round(time.perf_counter() - started, 3)
            if name == BELADY:
                ceiling[cap] = result.hit_ratio
            elif cap in ceiling and ceiling[cap] > 0:
                row["fraction_of_belady"] = result.hit_ratio / ceiling[cap]
            rows.append(row)
    return rows


def format_table(rows: Sequence[dict[str, Any]], capacities: Sequence[int]) -> str:
    """One line per policy: hit ratio (and fraction of Belady) per capacity; below, when a
    fraction of Belady is shown, the legend that says what ``B`` is."""
    by_policy: dict[str, dict[int, dict[str, Any]]] = {}
    for row in rows:
        by_policy.setdefault(row["policy"], {})[row["capacity"]] = row
    width = max([12, *(len(p) + 2 for p in by_policy)])
    head = f"{'policy':<{width}}" + "".join(f"{'cap ' + str(c):>22}" for c in capacities)
    lines = [head, "-" * len(head)]
    for policy, cells in by_policy.items():
        parts = []
        for cap in capacities:
            cell = cells.get(cap)
            if cell is None:
                parts.append(f"{'':>22}")
                continue
            frac = cell.get("fraction_of_belady")
            text = f"{cell['hit_ratio']:.3f}" + (f" ({frac:.2f}x B)" if frac is not None else "")
            parts.append(f"{text:>22}")
        lines.append(f"{policy:<{width}}" + "".join(parts))
    if any("fraction_of_belady" in row for row in rows):
        lines += ["", TABLE_LEGEND]
    return "\n".join(lines)


DISK_COLUMNS = (
    ("hit", "hit_ratio", "{:.3f}"),
    ("pool hit", "pool_hit_ratio", "{:.3f}"),
    ("disk hit", "disk_hit_ratio", "{:.3f}"),
    ("demotions", "demotions", "{:,}"),
    ("refused", "refused", "{:,}"),
    ("disk evictions", "evictions", "{:,}"),
)
DISK_LEGEND = """\
K: --disk-admit-after; hit: prefix hit ratio (pool hit + disk hit)
demotions: blocks written to disk; refused: evicted blocks not admitted to disk (asked fewer
than K times); disk evictions: disk blocks evicted to make room"""


def format_disk_table(rows: Sequence[dict[str, Any]]) -> str:
    """One line per two-level replay (rows with ``disk``): pool and disk sizes, the hit ratio
    in total, from the pool and from disk, and what the disk did; the legend below."""
    width = max([8, *(len(r["policy"]) + 2 for r in rows)])
    head = f"{'policy':<{width}}{'pool':>8}{'disk':>8}{'K':>4}" + "".join(
        f"{title:>{max(10, len(title) + 2)}}" for title, _, _ in DISK_COLUMNS
    )
    lines = [head, "-" * len(head)]
    for row in rows:
        disk = row["disk"]
        cells = {**disk, "hit_ratio": row["hit_ratio"]}
        line = f"{row['policy']:<{width}}{row['capacity']:>8}{disk['capacity']:>8}"
        line += f"{disk['admit_after']:>4}"
        for title, key, fmt in DISK_COLUMNS:
            line += f"{fmt.format(cells[key]):>{max(10, len(title) + 2)}}"
        lines.append(line)
    return "\n".join([*lines, "", DISK_LEGEND])


PLOT_NEEDS_EXTRA = "--plot needs matplotlib: pip install 'kvoffload[plot]'"


def save_plot(rows: Sequence[dict[str, Any]], path: Path) -> None:
    """Hit ratio against capacity, one line per policy, bounds (Belady, oracle-*) dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    by_policy: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        by_policy.setdefault(row["policy"], []).append((row["capacity"], row["hit_ratio"]))
    for policy, points in by_policy.items():
        points.sort()
        style = "--" if is_bound(policy) else "-"
        ax.plot([c for c, _ in points], [h for _, h in points], style, marker="o", label=policy)
    ax.set_xlabel("capacity (blocks)")
    ax.set_ylabel("prefix hit ratio")
    ax.set_title("kvoffload replay: prefix hit ratio by policy")
    ax.grid(True, alpha=0.3)
    # Outside the axes: with the bound rows the legend is taller than the plot area.
    ax.legend(fontsize="small", loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args: argparse.Namespace, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    """Execute ``kvoffload replay``; returns the exit status (2 for bad input)."""
    try:
        # Before the sweep, which may run for minutes.
        if args.plot is not None and find_spec("matplotlib") is None:
            raise InvalidArgumentError(PLOT_NEEDS_EXTRA)
        capacities = parse_capacities(args.capacity)
        if args.policy == "all":
            policies = available_policies()
        else:
            # Any case and the literature's names (LRU, S3-FIFO), as serve --policy; an oracle
            # bound is valid when the policy it wraps is registered.
            policies, unknown = [], []
            for name in (p for p in args.policy.split(",") if p):
                try:
                    policies.append(replay_policy_name(name))
                except UnknownPolicyError:
                    unknown.append(name)
            if unknown:
                raise InvalidArgumentError(
                    f"unknown policy {', '.join(unknown)}; available: "
                    f"{', '.join(available_policies())} (or oracle-NAME for a bound)"
                )
        if args.disk_capacity is None:
            if args.disk_admit_after is not None or args.disk_policy is not None:
                raise InvalidArgumentError(
                    "--disk-admit-after and --disk-policy need --disk-capacity"
                )
        elif args.disk_capacity <= 0:
            raise InvalidArgumentError(
                f"--disk-capacity expects a positive integer, got {args.disk_capacity}"
            )
        else:
            bounds = [p for p in policies if is_bound(p)]
            if bounds:
                raise InvalidArgumentError(
                    f"--disk-capacity replays online policies; {', '.join(bounds)} is a "
                    "pool-only bound"
                )
        if args.disk_policy is not None:
            try:
                args.disk_policy = canonical_policy_name(args.disk_policy)
            except UnknownPolicyError:
                raise InvalidArgumentError(
                    f"unknown --disk-policy {args.disk_policy}; available: "
                    f"{', '.join(available_policies())}"
                ) from None
        params = dict(parse_param(p) for p in args.param)
        if params and len(policies) != 1:
            raise InvalidArgumentError("--param applies to a single --policy")
        for policy in policies:  # bad parameters are refused before the trace is even read
            check_params(policy, params or None)
        try:
            with args.trace.open(encoding="utf-8") as fh:
                requests = parse_trace(fh)
        except OSError as exc:
            raise InvalidArgumentError(f"cannot read trace {args.trace}: {exc}") from None
        rows = sweep(
            requests,
            policies,
            capacities,
            store_threshold=args.store_threshold,
            params=params or None,
            belady=not args.no_belady,
            progress=err if err.isatty() else None,
            disk_capacity=args.disk_capacity,
            disk_admit_after=(
                DEFAULT_ADMIT_AFTER if args.disk_admit_after is None else args.disk_admit_after
            ),
            disk_policy=args.disk_policy,
        )
    except ManagerError as exc:
        err.write(f"kvoffload replay: {exc}\n")
        return 2
    if args.json:
        out.write(json.dumps(rows, indent=2) + "\n")
    elif args.disk_capacity is not None:
        out.write(format_disk_table(rows) + "\n")
    else:
        out.write(format_table(rows, capacities) + "\n")
    if args.plot is not None:
        save_plot(rows, args.plot)
        if not args.json:
            out.write(f"plot saved to {args.plot}\n")
    return 0
