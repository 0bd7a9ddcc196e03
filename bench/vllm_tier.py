"""The Mooncake trace replayed through two vLLM tiering managers, with and without kvoffload.

Requests of ``bench/data/mooncake_synthetic_trace.jsonl`` alternate between two engines, each
vLLM 0.33's own ``TieringOffloadingManager`` (built by vLLM's spec factory, driven like vLLM's
scheduler: ``testsupport/vllm_sim.py``) with a small CPU primary tier. Run 1 (the baseline, same
run): primary tier alone. Run 2: primary + the kvoffload tier against a real ``kvoffload serve``
on a Unix socket, shared by both engines. Prints the prefix hit ratio of each, the scheduler-
thread time the tier's methods add per step (p50 / p99, from ``perf_counter_ns`` around each
call vLLM's manager makes into the tier) and HTTP calls per step; writes
``bench/results/vllm_tier.json``.

Needs vLLM: run it with the vLLM test environment,
``.venv-vllm/bin/python bench/vllm_tier.py [--requests N] [--primary-chunks N]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from kvoffload_client.vllm import M_CALLS  # noqa: E402

from bench import harness  # noqa: E402
from testsupport.server import ServerProcess  # noqa: E402
from testsupport.vllm_sim import SimEngine, keys_of, kv_transfer_config  # noqa: E402

RESULTS = harness.RESULTS_DIR / "vllm_tier.json"


def load_trace(limit: int) -> list[list[int]]:
    """Block hash ids of the trace's first ``limit`` requests (all of them for 0)."""
    with harness.TRACE.open() as f:
        requests = [json.loads(line)["hash_ids"] for line in f]
    return requests[:limit] if limit else requests


def replay(
    requests: list[list[int]],
    config: dict[str, Any],
    tag: str,
    after_request: Callable[[int], None] | None = None,
) -> tuple[float, list[SimEngine], int]:
    """Hit ratio over every chunk of every request, the engines, and the steps run.
    ``after_request(n)``, if given, is called after request ``n`` settled (between steps)."""
    engines = [SimEngine(f"bench-{tag}-{i}", config) for i in range(2)]
    hits = total = steps = 0
    for n, hash_ids in enumerate(requests):
        engine = engines[n % 2]
        outcome = engine.run_request(f"{tag}-{n}", keys_of(hash_ids), step_s=0.0005)
        hits += outcome.hit_chunks
        total += len(hash_ids)
        steps += outcome.steps + 1
        engine.settle(pause_s=0.0005)
        if after_request is not None:
            after_request(n)
    return hits / total, engines, steps


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=0, help="first N requests (0: all)")
    parser.add_argument("--primary-chunks", type=int, default=2000)
    parser.add_argument("--pool-blocks", type=int, default=20000)
    args = parser.parse_args()
    requests = load_trace(args.requests)

    alone_cfg = kv_transfer_config("unix:///unused", cpu_chunks=args.primary_chunks)
    alone_cfg["kv_connector_extra_config"]["secondary_tiers"] = []
    alone, engines, _ = replay(requests, alone_cfg, "alone")
    for e in engines:
        e.close()

    with tempfile.TemporaryDirectory() as tmp:
        flags = (
            *("--block-bytes", "4096", "--num-blocks", str(args.pool_blocks)),
            *("--log-level", "warning", "--shadow-enabled", "false"),
        )
        with ServerProcess(Path(tmp), *flags).serving() as srv:
            cfg = kv_transfer_config(f"unix://{srv.uds}", cpu_chunks=args.primary_chunks)
            started = time.monotonic()
            shared, engines, _ = replay(requests, cfg, "kvoffload")
            seconds = time.monotonic() - started
            step_us = [ns / 1000 for e in engines for ns in e.step_tier_ns]
            calls = sum(e.tiers[0].counters.snapshot().get((M_CALLS, "batch"), 0) for e in engines)
            # Calls made between two consecutive steps of one engine (a step's own call and
            # any idle-timer call): the bound is one.
            max_calls = max(
                b - a
                for e in engines
                for a, b in zip([0, *e.step_calls], e.step_calls, strict=False)
            )
            tier_steps = len(step_us)
            for e in engines:
                e.close()

    p50, p99 = percentile(step_us, 0.50), percentile(step_us, 0.99)
    result = {
        "machine": harness.machine(),
        "requests": len(requests),
        "primary_chunks_per_engine": args.primary_chunks,
        "kvoffload_pool_blocks": args.pool_blocks,
        "hit_ratio_primary_alone": round(alone, 4),
        "hit_ratio_primary_plus_kvoffload": round(shared, 4),
        "gain": round(shared / alone, 2) if alone else None,
        "tier_us_per_step_p50": round(p50, 1),
        "tier_us_per_step_p99": round(p99, 1),
        "tier_us_per_step_mean": round(statistics.fmean(step_us), 1),
        "steps": tier_steps,
        "batch_calls_per_step": round(calls / tier_steps, 3),
        "max_batch_calls_in_one_step": max_calls,
        "replay_seconds": round(seconds, 1),
    }
    print(f"Mooncake trace, {len(requests)} requests alternating over two vLLM engines")
    print(f"(primary tier {args.primary_chunks} chunks each; kvoffload {args.pool_blocks} blocks)")
    print()
    print("| configuration | prefix hit ratio |")
    print("|---|---|")
    print(f"| vLLM primary tier alone (baseline) | {alone:.3f} |")
    print(f"| primary + kvoffload tier (shared) | {shared:.3f} ({result['gain']}x) |")
    print()
    print("| scheduler-thread time in the tier per step | p50 | p99 | calls per step: mean, max |")
    print("|---|---|---|---|")
    print(
        f"| {tier_steps} steps | {p50:.1f} us | {p99:.1f} us | "
        f"{calls / tier_steps:.3f}, {max_calls} |"
    )
    harness.write_results(RESULTS, result)


if __name__ == "__main__":
    main()
