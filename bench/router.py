"""Routing by kvoffload's KV events: what a KV-aware router's answer is worth, and what the
publisher costs engine calls.

Part (a), routing. The shipped trace replayed over N simulated nodes (N in ``--nodes``, by
default 2 and 4), each a real ``kvoffload serve`` (``--pool-blocks`` blocks, LRU, the KV-event
publisher on). Each request is one engine step on the node its router picks, one ``POST
/v1/batch``: start, lookup of its keys (the answer's hit prefix is its hit), prepare-store and
complete-store of every key with its tokens (the node stores what it lacks, evicting), finish.
A trace block stands for 512 tokens; its events carry 4 stand-in tokens (derived from its id),
enough for the indexer's own hashing of the prompt. Arms, on the same nodes, their pools
cleared between arms:

- ``round-robin`` (the baseline, same run): request i to node i mod N;
- ``session-hash``: the session id hashed (BLAKE2b) mod N. The trace has no session ids: a
  session is a chain of next turns as ``bench/control.py`` derives them (the first later
  request that begins with every block of this one but its tail), a request in no chain its
  own session;
- ``indexer``: Dynamo's standalone KV indexer (``make test-router`` builds ``.venv-dynamo``)
  subscribed to every node's publisher; the request goes to the node with the longest matched
  prefix, round robin among ties and when none matches. Skipped (said in the table) without
  that environment.

Per row: the prefix hit ratio (hit blocks / blocks asked), its ratio to round-robin, blocks
recomputed and their bytes at Llama-3.1-8B fp16's 128 KiB of KV per token (64 MiB a block),
in GiB.

Part (b), publisher cost: the same batch calls (the trace's first ``--cost-requests``
requests, repeated) against two nodes of ``--cost-pool`` blocks (256 by default, so that nearly
every call stores and evicts its ~30 blocks: the most events a call makes), one with the
publisher off and one with it on and a
pyzmq subscriber attached reading every batch, taking turns for ``--rounds`` rounds of
``--seconds`` each (one client, sequential calls), after a second's warm-up each. Each round
also reads its server's CPU time (``/proc``): CPU µs per call, on / off as the median of the
rounds' ratios, steadier than the rates on a noisy machine. The rounds are split among
``--pairs`` pairs of fresh server processes (4), started in the other order each pair: two
processes of the same code differed by up to 8% in calls per second on this VM (both sides
off), so one pair's ratio says as much about the pair as about the publisher; the table gives
each pair's median too. Both
servers run on one core and the client on the others, so that a side's rate is its own
server's work (unpinned, one run's rounds spread 1.5x). Twice: stores that say their tokens (as in
part (a): the service notes them for the events) and stores with hashes only (the vLLM tier's
case). Calls per second, and on / off as the median of the rounds' ratios. Target: >= 0.97.

Writes ``bench/results/router.json``. Run: ``.venv/bin/python bench/router.py`` (``make
bench-router`` builds the Dynamo environment first); ``--quick``: 300 requests, 2 nodes, 2
short rounds.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from bench import harness  # noqa: E402
from bench.control import next_turns, read_timed_trace  # noqa: E402
from testsupport.ports import free_port  # noqa: E402
from testsupport.server import TOKEN, ServerProcess  # noqa: E402

RESULTS = harness.RESULTS_DIR / "router.json"
TOKENS_PER_BLOCK = 512  # the trace's blocks
KV_BYTES_PER_TOKEN = 128 * 1024  # Llama-3.1-8B, fp16: 32 layers x 8 KV heads x 128 x 2 x 2 B
STAND_IN_TOKENS = 4  # tokens per block in the events (testsupport/router_indexer.py's block size)
COST_TARGET = 0.97
GIB = 1 << 30


@dataclass(frozen=True, slots=True)
class Request:
    """One trace request: its keys (hex), stand-in tokens and session."""

    keys: list[str]
    tokens: list[int]
    session: int


def requests_of(limit: int) -> list[Request]:
    """The trace's first ``limit`` requests (0: all), each with its session."""
    timed = read_timed_trace(harness.TRACE, limit)
    turns = next_turns(timed)
    session = list(range(len(timed)))
    for i, j in sorted(turns.items()):
        session[j] = session[i]  # the next turn joins its predecessor's session
    out = []
    for i, r in enumerate(timed):
        tokens: list[int] = []
        for key in r.keys:
            base = int.from_bytes(hashlib.blake2b(key, digest_size=4).digest(), "big") >> 1
            tokens.extend(range(base, base + STAND_IN_TOKENS))
        out.append(Request([k.hex() for k in r.keys], tokens, session[i]))
    return out


def step(req_id: str, r: Request, tokens: bool = True) -> dict[str, Any]:
    """One engine step on a node, as one batch (``tokens``: the store says its tokens)."""
    meta = {"token_ids": r.tokens, "block_size": STAND_IN_TOKENS} if tokens else {}
    return {
        "ops": [
            {"op": "start_request", "req_id": req_id},
            {"op": "lookup", "req_id": req_id, "keys": r.keys},
            {"op": "prepare_store", "req_id": req_id, "keys": r.keys, **meta},
            {"op": "complete_store", "req_id": req_id, "keys": r.keys},
            {"op": "finish_request", "req_id": req_id},
        ]
    }


def run_step(client: httpx.Client, req_id: str, r: Request, tokens: bool = True) -> int:
    """Run one step; its hit prefix."""
    answer = client.post("/v1/batch", json=step(req_id, r, tokens))
    answer.raise_for_status()
    results = answer.json()["results"]
    failed = [res for res in results if not res["ok"]]
    if failed:
        raise RuntimeError(f"batch op failed: {failed[0]}")
    hit: int = results[1]["result"]["hit_prefix"]
    return hit


def endpoints() -> tuple[str, str]:
    return f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"


@dataclass
class Node:
    """One simulated node: its service and its publisher's addresses."""

    server: ServerProcess
    ends: tuple[str, str]
    client: httpx.Client


@contextmanager
def nodes(workdir: Path, count: int, pool_blocks: int) -> Iterator[list[Node]]:
    """``count`` kvoffload services with the publisher on, running for the block."""
    with ExitStack() as stack:
        out = []
        for n in range(count):
            ends = endpoints()
            d = workdir / f"node{n}"
            d.mkdir(parents=True, exist_ok=True)
            srv = ServerProcess(
                d,
                "--num-blocks",
                str(pool_blocks),
                "--kv-events-endpoint",
                ends[0],
                "--kv-events-replay-endpoint",
                ends[1],
            )
            stack.enter_context(srv.serving())
            client = stack.enter_context(httpx.Client(base_url=srv.url, timeout=60))
            out.append(Node(srv, ends, client))
        yield out


def clear(node: Node) -> None:
    r = httpx.post(
        f"{node.server.admin_url}/admin/v1/cache/clear",
        headers={"Authorization": f"Bearer {TOKEN}"},
        timeout=60,
    )
    r.raise_for_status()


Router = Callable[[int, Request], int]


def replay(ns: list[Node], reqs: Sequence[Request], route: Router) -> dict[str, Any]:
    """Every request on the node ``route`` picks; the arm's figures."""
    asked = hit = 0
    per_node = [0] * len(ns)
    started = time.perf_counter()
    for i, r in enumerate(reqs):
        n = route(i, r)
        per_node[n] += 1
        hit += run_step(ns[n].client, f"q{i}", r)
        asked += len(r.keys)
    missed = asked - hit
    return {
        "requests": len(reqs),
        "blocks": asked,
        "hit_blocks": hit,
        "hit_ratio": hit / asked if asked else 0.0,
        "recomputed_blocks": missed,
        "recomputed_gib": missed * TOKENS_PER_BLOCK * KV_BYTES_PER_TOKEN / GIB,
        "requests_per_node": per_node,
        "wall_s": time.perf_counter() - started,
    }


def round_robin(count: int) -> Router:
    return lambda i, _r: i % count


def session_hash(count: int) -> Router:
    def route(_: int, r: Request) -> int:
        digest = hashlib.blake2b(r.session.to_bytes(8, "big"), digest_size=8).digest()
        return int.from_bytes(digest, "big") % count

    return route


def indexer_router(indexer: Any, count: int) -> Router:
    turn = itertools.count()

    def route(_: int, r: Request) -> int:
        answer = indexer.query(r.tokens)
        best = max((int(v["longest_matched"]) for v in answer.values()), default=0)
        if best == 0:
            return next(turn) % count
        tied = sorted(int(k) - 1 for k, v in answer.items() if v["longest_matched"] == best)
        return tied[next(turn) % len(tied)]

    return route


def part_a(
    workdir: Path, reqs: list[Request], counts: Sequence[int], pool: int
) -> list[dict[str, Any]]:
    from testsupport.router_indexer import Indexer, dynamo_missing

    missing = dynamo_missing()
    rows: list[dict[str, Any]] = []
    for count in counts:
        with nodes(workdir / f"n{count}", count, pool) as ns:
            arms: list[tuple[str, Router | None]] = [
                ("round-robin", round_robin(count)),
                ("session-hash", session_hash(count)),
            ]
            with ExitStack() as stack:
                indexer = None
                if missing is None:
                    indexer = Indexer(workdir, model=f"bench-{count}")
                    stack.callback(indexer.stop)
                    for k, node in enumerate(ns):
                        indexer.register(k + 1, node.server, node.ends)
                arms.append(
                    ("indexer", None if indexer is None else indexer_router(indexer, count))
                )
                base = None
                for name, route in arms:
                    if route is None:
                        rows.append({"nodes": count, "arm": name, "skipped": missing})
                        continue
                    for node in ns:
                        clear(node)
                    row = {"nodes": count, "arm": name, **replay(ns, reqs, route)}
                    if base is None:
                        base = row["hit_ratio"]
                    row["vs_round_robin"] = row["hit_ratio"] / base if base else None
                    rows.append(row)
    return rows


class Subscriber:
    """A pyzmq SUB reading every batch of a publisher on its own thread."""

    def __init__(self, endpoint: str) -> None:
        import zmq

        self.context = zmq.Context()
        self.sock = self.context.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.setsockopt(zmq.RCVTIMEO, 200)
        self.sock.connect(endpoint)
        self.batches = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import zmq

        while not self._stop.is_set():
            try:
                self.sock.recv_multipart()
            except zmq.Again:
                continue
            self.batches += 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sock.close(linger=0)
        self.context.term()


def cpu_s(pid: int) -> float:
    """CPU seconds process ``pid`` has used (all its threads, user and system)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def calls_per_s(
    client: httpx.Client,
    reqs: Sequence[Request],
    seconds: float,
    tokens: bool,
    pid: int | None = None,
) -> tuple[float, float]:
    """Calls per second of one round, and the server's CPU µs per call (``pid``'s; 0 without)."""
    done = 0
    used = cpu_s(pid) if pid else 0.0
    start = time.perf_counter()
    for i in itertools.count():
        run_step(client, f"c{i}", reqs[i % len(reqs)], tokens)
        done += 1
        if time.perf_counter() - start >= seconds:
            break
    rate = done / (time.perf_counter() - start)
    return rate, ((cpu_s(pid) - used) / done * 1e6 if pid else 0.0)


def part_b(
    workdir: Path, reqs: list[Request], rounds: int, seconds: float, pool: int, pairs: int = 1
) -> dict[str, Any]:
    """The publisher's cost over ``pairs`` pairs of fresh server processes (their start order
    swapped from one pair to the next), ``rounds`` rounds in all, split among them."""
    # The servers on one core, this client on the others: each side's rate is then its own
    # server's work, not a share of cores the client and the other server contend for.
    server_cores, client_cores = harness.split_cores()
    pin = ("taskset", "-c", ",".join(map(str, sorted(server_cores))))
    mine = os.sched_getaffinity(0)
    os.sched_setaffinity(0, client_cores)
    kinds = (("tokens", True), ("hashes", False))
    rates = {kind: {"off": list[float](), "on": list[float]()} for kind, _ in kinds}
    cpu = {kind: {"off": list[float](), "on": list[float]()} for kind, _ in kinds}
    per_pair: dict[str, list[float]] = {kind: [] for kind, _ in kinds}
    batches = 0
    with harness.affinity_restored(mine):
        for pair in range(pairs):
            share = rounds // pairs + (pair < rounds % pairs)
            got = _pair(workdir / f"pair{pair}", reqs, share, seconds, pool, pin, pair % 2 == 1)
            for kind, _ in kinds:
                for side in ("off", "on"):
                    rates[kind][side] += got[kind]["rates"][side]
                    cpu[kind][side] += got[kind]["cpu"][side]
                pair_ratios = _ratios(got[kind]["rates"])
                if pair_ratios:
                    per_pair[kind].append(statistics.median(pair_ratios))
            batches += got["subscriber_batches"]
    out: dict[str, Any] = {
        "rounds": rounds,
        "seconds": seconds,
        "pairs": pairs,
        "target": COST_TARGET,
        "subscriber_batches": batches,
    }
    for kind, _ in kinds:
        cpu_ratios = _ratios(cpu[kind])
        out[kind] = {
            "calls_per_s": {k: statistics.median(v) for k, v in rates[kind].items()},
            "per_round": rates[kind],
            "on_vs_off": statistics.median(_ratios(rates[kind])),
            "on_vs_off_per_pair": per_pair[kind],
            # The server's CPU per call: steadier than the rate on a noisy machine.
            "cpu_us_per_call": {k: statistics.median(v) for k, v in cpu[kind].items()},
            "cpu_on_vs_off": statistics.median(cpu_ratios) if cpu_ratios else None,
        }
    return out


def _ratios(sides: dict[str, list[float]]) -> list[float]:
    """Each round's on / off (rounds where off read nothing left out)."""
    return [a / b for a, b in zip(sides["on"], sides["off"], strict=True) if b]


def _pair(
    workdir: Path,
    reqs: list[Request],
    rounds: int,
    seconds: float,
    pool: int,
    pin: Sequence[str],
    on_first: bool,
) -> dict[str, Any]:
    """One pair of servers, off and on (the on one started first when ``on_first``): each
    kind's rates and CPU per call, ``rounds`` alternating rounds after a warm-up."""
    off_dir, on_dir = workdir / "off", workdir / "on"
    off_dir.mkdir(parents=True)
    on_dir.mkdir(parents=True)
    ends = endpoints()
    pool_flags = ("--num-blocks", str(pool))
    on_flags = ("--kv-events-endpoint", ends[0], "--kv-events-replay-endpoint", ends[1])
    made = {
        "off": ServerProcess(off_dir, *pool_flags, wrapper=pin),
        "on": ServerProcess(on_dir, *pool_flags, *on_flags, wrapper=pin),
    }
    out: dict[str, Any] = {}
    with ExitStack() as stack:
        for name in ("on", "off") if on_first else ("off", "on"):
            stack.enter_context(made[name].serving())
        off, on = made["off"], made["on"]
        c_off = stack.enter_context(httpx.Client(base_url=off.url, timeout=60))
        c_on = stack.enter_context(httpx.Client(base_url=on.url, timeout=60))
        sub = Subscriber(ends[0])
        try:
            for kind, tokens in (("tokens", True), ("hashes", False)):
                rates: dict[str, list[float]] = {"off": [], "on": []}
                cpu: dict[str, list[float]] = {"off": [], "on": []}
                for client in (c_off, c_on):  # warm: not counted
                    calls_per_s(client, reqs, min(seconds, 1.0), tokens)
                for n in range(rounds):
                    order = [("off", c_off, off), ("on", c_on, on)]
                    if n % 2:
                        order.reverse()
                    for name, client, server in order:
                        pid = server.proc.pid if server.proc else None  # taskset execs it
                        rate, us = calls_per_s(client, reqs, seconds, tokens, pid)
                        rates[name].append(rate)
                        cpu[name].append(us)
                out[kind] = {"rates": rates, "cpu": cpu}
            out["subscriber_batches"] = sub.batches
        finally:
            sub.close()
    return out


def print_a(rows: list[dict[str, Any]]) -> None:
    print(
        f"{'nodes':>5} {'arm':<13} {'hit ratio':>9} {'vs rr':>6} "
        f"{'recomputed':>11} {'GiB':>9} {'per node':<24}"
    )
    for row in rows:
        if "skipped" in row:
            print(f"{row['nodes']:>5} {row['arm']:<13} skipped: {row['skipped']}")
            continue
        ratio = row["vs_round_robin"]
        shown = "-" if ratio is None else f"{ratio:.2f}"  # None: round robin hit nothing
        print(
            f"{row['nodes']:>5} {row['arm']:<13} {row['hit_ratio']:>9.3f} "
            f"{shown:>6} {row['recomputed_blocks']:>11} "
            f"{row['recomputed_gib']:>9.1f} {row['requests_per_node']!s:<24}"
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--limit", type=int, default=None, help="trace requests (0: all)")
    p.add_argument("--nodes", default=None, help="node counts, comma-separated (2,4)")
    p.add_argument("--pool-blocks", type=int, default=4096, help="each node's pool")
    p.add_argument("--parts", default="a,b")
    p.add_argument("--rounds", type=int, default=None, help="part (b)'s rounds in all (16)")
    p.add_argument("--pairs", type=int, default=None, help="part (b)'s pairs of fresh servers (4)")
    p.add_argument("--seconds", type=float, default=None, help="part (b)'s round (2 s)")
    p.add_argument("--cost-requests", type=int, default=200)
    p.add_argument(
        "--cost-pool", type=int, default=256, help="part (b)'s pools (256: every call evicts)"
    )
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    # --quick sets what was not given: 300 requests, 2 nodes, 2 rounds of 1 s, one pair.
    quick = (300, "2", 2, 1.0, 1) if args.quick else (0, "2,4", 16, 2.0, 4)
    names = ("limit", "nodes", "rounds", "seconds", "pairs")
    for name, value in zip(names, quick, strict=True):
        if getattr(args, name) is None:
            setattr(args, name, value)
    parts = set(args.parts.split(","))
    counts = [int(n) for n in args.nodes.split(",")]
    reqs = requests_of(args.limit)
    record: dict[str, Any] = {
        "bench": "router",
        "machine": harness.machine(),
        "requests": len(reqs),
        "pool_blocks_per_node": args.pool_blocks,
    }
    with tempfile.TemporaryDirectory(prefix="kvoffload-router-") as tmp:
        workdir = Path(tmp)
        if "a" in parts:
            rows = part_a(workdir, reqs, counts, args.pool_blocks)
            record["routing"] = rows
            print(f"(a) routing: {len(reqs)} requests, {args.pool_blocks} blocks a node")
            print_a(rows)
        if "b" in parts:
            if args.pairs < 1 or args.rounds < args.pairs:
                p.error("--pairs must be at least 1 and at most --rounds")
            cost = part_b(
                workdir,
                reqs[: args.cost_requests],
                args.rounds,
                args.seconds,
                args.cost_pool,
                args.pairs,
            )
            record["publisher_cost"] = cost
            print(
                f"(b) publisher cost, median of {cost['rounds']} rounds over {cost['pairs']} "
                f"pairs of servers (target >= {COST_TARGET})"
            )
            print(
                f"{'stores say':<11} {'off calls/s':>11} {'on calls/s':>10} {'on / off':>8} "
                f"{'CPU µs/call off':>15} {'on':>5} {'on / off':>8}"
            )
            for kind in ("tokens", "hashes"):
                row = cost[kind]
                c, u, ratio = row["calls_per_s"], row["cpu_us_per_call"], row["cpu_on_vs_off"]
                print(
                    f"{kind:<11} {c['off']:>11.0f} {c['on']:>10.0f} {row['on_vs_off']:>8.3f} "
                    f"{u['off']:>15.0f} {u['on']:>5.0f} {ratio or 0:>8.3f}"
                )
            for kind in ("tokens", "hashes"):
                pairs = " ".join(f"{r:.3f}" for r in cost[kind]["on_vs_off_per_pair"])
                print(f"{kind}: on / off per pair of servers: {pairs}")
    harness.write_results(args.out, record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
