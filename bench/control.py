"""Cache control: what retentions and prefetches are worth, and what they cost.

Part (a), retention hit ratio: the shipped trace replayed through an ``OffloadManager`` (pure
Python, the accounting of ``manager/replay.py`` and ``policy_sweep.py``: lookup, load of the
hit prefix, store of the rest, finish), its clock a fake one set to each request's timestamp,
at the pool sizes ``policy_sweep.py`` uses (5k, 10k, 20k blocks), LRU (the service default).
After each request its keys are retained as the service's ``retain`` would, under the
service's bounds: at most ``max_retained_blocks`` distinct retained blocks (half the pool, the
service default), at most ``max_retentions`` (4096) live retentions; a call that would pass a
bound is skipped and counted, as is one naming a key the pool does not hold (the service's
404: the request's own store was refused). Retentions end when their TTL passes (expired
before the next request at or after that time is served). Rows:

- ``none`` (the baseline, same run): no retention, the plain replay (the ``lru`` row of
  ``policy_sweep.py``);
- ``ttl=T`` for T in 10, 30, 60, 120, 300 s of trace time: every request's keys retained for T
  seconds after it (a request ends when it arrives: the trace has no durations);
- ``oracle``: a request's keys retained exactly until the session's next turn arrives, then
  released (the best a caller could do). The trace has no session ids: request ``j`` is the
  next turn of request ``i`` when ``j`` is the first later request that begins with all of
  ``i``'s blocks but its last and is at least as long as ``i``. The last id of a Mooncake
  request is its own partial tail block (90% of them never recur), so no request holds another
  whole; a continuation keeps the full blocks. Requests without a next turn are not retained.

Per row: prefix hit ratio, its ratio to ``none`` at the same pool size, the hits served from
blocks retained at the time, stores refused (``prepare_store`` None: the pool was full of
retained and pinned blocks), retentions made and skipped by reason.

Part (b), prefetch load time: an in-process service (``testsupport/api_harness.py``, as
``disk_tier.py`` runs it) with a disk tier on an ext4 directory (O_DIRECT; ``--dir``, default
the system's temporary directory), a registered shm "device" cache. Sessions of ``--b-keys``
blocks of ``--b-block-kib`` KiB are stored and demoted (``POST demote``: written to disk, gone
from the pool). Each session is then resumed as an engine would: ``PUT`` the request, ``POST
onload`` of its keys and wait for the job; a 409 (the keys' promotion is in flight for a
prefetch, not for this request) is retried every ``--b-retry-ms`` ms. Timed: from the first
onload call to the job done (retries included). Arms: no prefetch (the baseline); ``POST
prefetch`` of the same keys ``lead`` ms (5, 20, 50) before the onload; and ``landed``, the
floor, a prefetch waited for (``GET /v1/prefetches/{id}?wait_s``) before the onload, so the
load finds pool hits. The arms take turns, order rotating each round; after each load the
session is demoted again (its disk copy stays, so nothing is written while timing). p50 / p99
per arm, and the speed-up: no prefetch / the arm, at p50 and at p99.

Part (c), cost of live retentions: lookup(64) calls/s through two real ``kvoffload serve``
processes over TCP (``http_bench.py``'s servers, load generator and rounds, pinned to separate
cores; the two servers' order swapped every round) with the same pool contents (4096 blocks of
4 KiB, 2048 of them stored), one of them with 1,000 retentions naming those 2048 blocks (the
lookup's 32 hits among them; half the pool, its quota) and one with none. Target: on >= 0.95x
off (calls/s at 32 connections). Then the same two states in process, with no server: the
engine app's CPU per lookup(64) called as ASGI (``http_bench.py --app-cost``'s way), each in a
fresh process; and at the manager level, ``prepare_store`` + ``complete_store`` keys per CPU
second into a full pool of 20k blocks (every store evicts), half of it retained, against none.
Ratios of (c) in process are medians of the rounds' ratios (the order swapped every round).

Writes ``bench/results/control.json``. Run: ``.venv/bin/python bench/control.py`` (about 2-3
minutes on 2 cores); ``--parts a,b,c`` for some parts; ``--quick``, a smoke run (about 10 s):
the first 1,000 requests in (a), 3 loads per arm in (b), and in (c) no servers, the app-level
cost in this process.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import gc
import hashlib
import heapq
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import harness  # noqa: E402
from manager import ReqContext, create_manager  # noqa: E402
from manager.replay import parse_trace  # noqa: E402
from testsupport import procfs  # noqa: E402
from testsupport.polling import until_async  # noqa: E402

if TYPE_CHECKING:
    from app.core.disk import DiskLink
    from testsupport.api_harness import Harness

RESULTS = harness.RESULTS_DIR / "control.json"
KIB = 1024
MIB = 1024 * KIB

# Part (a)
CAPACITIES = (5000, 10000, 20000)
TTLS = (10.0, 30.0, 60.0, 120.0, 300.0)
MAX_RETENTIONS = 4096  # the service default (max_retentions)
POLICY = "lru"  # the service default

# Part (b)
LEADS_MS = (5.0, 20.0, 50.0)

# Part (c)
COST_TARGET = 0.95
COST_RETENTIONS = 1000
COST_POOL = 4096  # http_bench.py's kvoffload pool


# ---------------------------------------------------------------------------- part (a)


@dataclass(frozen=True, slots=True)
class TimedRequest:
    """One trace request: its arrival in seconds of trace time, and its keys."""

    at: float
    keys: list[bytes]


def read_timed_trace(path: Path, limit: int = 0) -> list[TimedRequest]:
    """The trace's requests with their timestamps (ms in the file, seconds here)."""
    with path.open(encoding="utf-8") as fh:
        lines = [line for line in fh if line.strip()]
    if limit:
        lines = lines[:limit]
    keys = parse_trace(lines)
    stamps = [float(json.loads(line)["timestamp"]) / 1000.0 for line in lines]
    return [TimedRequest(at, ks) for at, ks in zip(stamps, keys, strict=True)]


def next_turns(requests: Sequence[TimedRequest]) -> dict[int, int]:
    """Per request ``i`` with a next turn, its index ``j``: the first later request that begins
    with every block of ``i`` but its last (the partial tail) and is at least as long."""
    by_first: dict[bytes, list[int]] = collections.defaultdict(list)
    for i, r in enumerate(requests):
        if r.keys:
            by_first[r.keys[0]].append(i)
    out: dict[int, int] = {}
    for i, r in enumerate(requests):
        full = r.keys[:-1]
        if not full:
            continue
        for j in by_first[full[0]]:
            if j <= i:
                continue
            later = requests[j].keys
            if len(later) >= len(r.keys) and later[: len(full)] == full:
                out[i] = j
                break
    return out


def replay_retained(
    requests: Sequence[TimedRequest],
    capacity: int,
    mode: str,
    *,
    ttl_s: float = 0.0,
    turns: dict[int, int] | None = None,
    quota: int | None = None,
    policy: str = POLICY,
) -> dict[str, Any]:
    """Replay ``requests`` (``manager.replay``'s accounting) with retentions: ``mode`` is
    ``none``, ``ttl`` (every request's keys for ``ttl_s``) or ``oracle`` (until the next turn
    in ``turns``); ``quota``: max distinct retained blocks (default half the pool)."""
    now = [0.0]
    m = create_manager(capacity, policy, clock=lambda: now[0], enable_events=False)
    quota = capacity // 2 if quota is None else quota
    turns = turns or {}
    deadlines: list[float] = []  # expiry times of live TTL retentions (a heap)
    release_at: dict[int, list[str]] = collections.defaultdict(list)  # oracle: at request j
    skipped: collections.Counter[str] = collections.Counter()
    prefix_hits = blocks = retained_hits = made = peak = 0
    for index, req in enumerate(requests):
        keys = req.keys
        now[0] = req.at
        if deadlines and deadlines[0] <= req.at:
            m.expire_retentions()
            while deadlines and deadlines[0] <= req.at:
                heapq.heappop(deadlines)
        ctx = ReqContext(f"trace-{index}")
        m.on_new_request(ctx)
        hit = m.lookup(keys, ctx).hit_prefix
        prefix_hits += hit
        blocks += len(keys)
        if hit:
            prefix = keys[:hit]
            if m.num_retained:
                retained_hits += sum(map(m.is_retained, prefix))
            m.prepare_load(prefix, ctx)
            m.touch(prefix, ctx)
            m.complete_load(prefix, ctx)
        # The oracle's retentions end as their next turn arrives: once its load pinned them.
        for name in release_at.pop(index, ()):
            m.release_retention(name)
        rest = keys[hit:]
        if rest:
            out = m.prepare_store(rest, ctx)
            if out is not None and out.keys_to_store:
                m.complete_store(out.keys_to_store, ctx, True)
        m.on_request_finished(ctx)
        # The caller's retain, as the service decides it (control.Control.retain).
        if mode == "none" or not keys:
            continue
        if mode == "ttl":
            ttl = ttl_s
        else:
            j = turns.get(index)
            if j is None:
                continue
            ttl = max(requests[j].at - req.at, 0.0) + 1.0  # released at j, before it expires
        name = f"r{index}"
        if any(m.slot_of(k) is None for k in keys):
            skipped["unknown_keys"] += 1  # 404: the request's own store was refused
            continue
        new = m.new_retained(name, keys)
        if new and m.num_retained + new > quota:
            skipped["retained_blocks"] += 1  # 429 quota "retained_blocks"
            continue
        if m.num_retentions >= MAX_RETENTIONS:
            skipped["retentions"] += 1  # 429 quota "retentions"
            continue
        m.retain(keys, ttl, name)
        made += 1
        peak = max(peak, m.num_retained)
        if mode == "ttl":
            heapq.heappush(deadlines, req.at + ttl)
        else:
            release_at[turns[index]].append(name)
    stats = m.stats()
    return {
        "capacity": capacity,
        "mode": mode,
        "ttl_s": ttl_s if mode == "ttl" else None,
        "quota": quota,
        "requests": len(requests),
        "blocks": blocks,
        "prefix_hits": prefix_hits,
        "hit_ratio": prefix_hits / blocks if blocks else 0.0,
        "retained_hits": retained_hits,
        "stores_refused": stats.stores_refused,
        "evictions": stats.evictions,
        "retentions_made": made,
        "retentions_skipped": dict(skipped),
        "retained_peak": peak,
        "retentions_expired": stats.retentions_expired,
        "retentions_released": stats.retentions_released,
    }


def row_label(row: dict[str, Any]) -> str:
    if row["mode"] == "ttl":
        return f"ttl={row['ttl_s']:g}s"
    return str(row["mode"])


def part_a(trace: Path, limit: int, capacities: Sequence[int]) -> dict[str, Any]:
    requests = read_timed_trace(trace, limit)
    turns = next_turns(requests)
    gaps = sorted(requests[j].at - requests[i].at for i, j in turns.items())
    started = time.perf_counter()
    rows: list[dict[str, Any]] = []
    for cap in capacities:
        base = replay_retained(requests, cap, "none")
        rows.append(base)
        for ttl in TTLS:
            rows.append(replay_retained(requests, cap, "ttl", ttl_s=ttl))
        rows.append(replay_retained(requests, cap, "oracle", turns=turns))
        for row in rows:
            if row["capacity"] == cap:
                row["vs_none"] = row["hit_ratio"] / base["hit_ratio"] if base["hit_ratio"] else 0
    elapsed = time.perf_counter() - started
    span = requests[-1].at - requests[0].at if requests else 0.0
    within = {f"{t:g}": sum(g <= t for g in gaps) for t in TTLS}
    print(
        f"\n(a) retention: {len(requests)} requests over {span:.0f} s of trace time; "
        f"{len(turns)} have a next turn (gap median "
        f"{statistics.median(gaps) if gaps else math.nan:.1f} s; within "
        + ", ".join(f"{t} s: {n}" for t, n in within.items())
        + f"); {POLICY}, quota half the pool"
    )
    header = (
        f"{'pool':>6} {'retain':<9} {'hit ratio':>9} {'vs none':>7} {'from kept':>9} "
        f"{'refused':>7} {'made':>6} {'skip quota':>10} {'skip 404':>8} {'peak kept':>9}"
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        sk = row["retentions_skipped"]
        print(
            f"{row['capacity']:>6} {row_label(row):<9} {row['hit_ratio']:>9.3f} "
            f"{row['vs_none']:>7.3f} {row['retained_hits']:>9} {row['stores_refused']:>7} "
            f"{row['retentions_made']:>6} "
            f"{sk.get('retained_blocks', 0) + sk.get('retentions', 0):>10} "
            f"{sk.get('unknown_keys', 0):>8} {row['retained_peak']:>9}"
        )
    print(f"replays took {elapsed:.1f} s")
    return {
        "requests": len(requests),
        "trace_seconds": span,
        "policy": POLICY,
        "next_turns": len(turns),
        "next_turn_gap_median_s": statistics.median(gaps) if gaps else None,
        "next_turns_within_ttl": within,
        "seconds": round(elapsed, 2),
        "rows": rows,
    }


# ---------------------------------------------------------------------------- part (b)


def hexkey(session: int, i: int) -> str:
    """Block ``i`` of session ``session`` as a hex key."""
    return hashlib.blake2b(f"s{session}-b{i}".encode(), digest_size=16).hexdigest()


def pct(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values``, nearest rank; NaN when empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


@contextlib.asynccontextmanager
async def disk_service(
    directory: str, pool_blocks: int, block: int, slots: int
) -> AsyncIterator[Harness]:
    """An in-process service (``testsupport/api_harness.py``) with a disk tier in ``directory``."""
    from testsupport.api_harness import make_settings, running
    from transfer.disk import disk_bytes_for

    settings = make_settings(
        num_blocks=pool_blocks,
        block_bytes=block,
        disk_dir=directory,
        disk_bytes=disk_bytes_for(slots, block),
        disk_admit_after=1,
        job_deadline_s=60.0,
        disk_timeout_s=60.0,
        lease_ttl_s=3600.0,
        max_keys_per_call=8192,
        max_body_bytes=4 * MIB,
    )
    async with running(settings) as h:
        yield h


class Sessions:
    """Sessions whose blocks sit on disk only, loaded back as an engine resumes them."""

    def __init__(self, h: Harness, cache_id: str, keys: int, retry_s: float) -> None:
        from app.core.disk import DiskLink

        self.h, self.cache_id, self.nkeys, self.retry_s = h, cache_id, keys, retry_s
        self.n = 0
        disk = h.service.tiers.get("disk")
        assert isinstance(disk, DiskLink), "no disk tier"
        self.disk: DiskLink = disk

    def counts(self) -> tuple[int, int]:
        """(blocks demoted to disk, admitted blocks dropped) so far."""
        c = self.disk.counts
        return int(c["demoted"]), sum(int(v) for k, v in c.items() if k.startswith("dropped_"))

    def writes(self) -> int:
        return int(self.disk.store.health().counters["writes"])

    async def demote(self, keys: list[str], written: int) -> None:
        """Demote ``keys`` (all must move) and wait until ``written`` blocks were demoted."""
        r = await self.h.post("/v1/requests/demote/demote", {"keys": keys})
        assert r.status_code == 200, r.text
        assert len(r.json()["moved"]) == len(keys), r.text
        await until_async(
            "every block written", lambda: sum(self.counts()) >= written, 60, every_s=0.002
        )
        assert self.counts()[1] == 0, dict(self.disk.counts)

    async def put_on_disk(self, sessions: int) -> None:
        """Store every session's blocks, then demote them (written to disk, out of the pool)."""
        h = self.h
        for s in range(sessions):
            keys = [hexkey(s, i) for i in range(self.nkeys)]
            req = f"store-{s}"
            await h.start(req)
            r = await h.post(f"/v1/requests/{req}/prepare-store", {"keys": keys})
            assert r.status_code == 200, r.text
            assert len(r.json()["keys_to_store"]) == len(keys), r.text
            r = await h.post(f"/v1/requests/{req}/complete-store", {"keys": keys})
            assert r.status_code == 200, r.text
            await h.client.delete(f"/v1/requests/{req}")
            await self.demote(keys, (s + 1) * self.nkeys)

    async def resume(self, session: int, arm: Arm) -> dict[str, Any]:
        """Resume ``session`` as ``arm`` says: a prefetch ``lead_s`` before the onload (or once
        its promotions settled), or none; the onload is retried on 409 every ``retry_s``.
        The load time seen by the request, its retries, and the prefetch's counts."""
        h = self.h
        self.n += 1
        req = f"resume-{self.n}"
        keys = [hexkey(session, i) for i in range(self.nkeys)]
        pid = None
        if arm.lead_s is not None:
            t0 = time.perf_counter()
            r = await h.post(f"/v1/requests/{req}/prefetch", {"keys": keys, "deadline_s": 30.0})
            assert r.status_code == 202, r.text
            pid = r.json()["prefetch_id"]
            if arm.settled:
                r = await h.client.get(f"/v1/prefetches/{pid}", params={"wait_s": 30})
                assert r.status_code == 200, r.text
                assert r.json()["state"] == "held", r.text
            await asyncio.sleep(max(0.0, arm.lead_s - (time.perf_counter() - t0)))
        await h.start(req)
        body = {"cache_id": self.cache_id, "keys": keys, "device_blocks": list(range(len(keys)))}
        retries = 0
        t = time.perf_counter()
        while True:
            r = await h.post(f"/v1/requests/{req}/onload", body)
            if r.status_code == 202:
                break
            assert r.status_code == 409, r.text
            retries += 1
            await asyncio.sleep(self.retry_s)
        job_id = r.json()["job_id"]
        state = "done" if job_id is None else (await h.wait(job_id, timeout_s=60))["state"]
        took = time.perf_counter() - t
        assert state == "done", state
        await h.client.delete(f"/v1/requests/{req}")
        out: dict[str, Any] = {"seconds": took, "retries": retries, "held_after_load": False}
        if pid is not None:
            r = await h.client.get(f"/v1/prefetches/{pid}")
            assert r.status_code == 200, r.text
            out["prefetch"] = r.json()["counts"]
            if r.json()["state"] != "done":
                # The load did not end the prefetch: it still holds (pins) the keys the load
                # used, until its deadline. Seen when the load pins the blocks after they
                # landed but before the prefetch took its holds on them. Cancelled here.
                out["held_after_load"] = True
                out["prefetch_state"] = r.json()
                r = await h.client.delete(f"/v1/prefetches/{pid}")
                assert r.status_code == 200, r.text
        # Out of the pool again; the disk keeps its copy, so nothing is written.
        r = await h.post("/v1/requests/demote/demote", {"keys": keys})
        assert r.status_code == 200, r.text
        assert len(r.json()["moved"]) == len(keys), r.text
        return out


@dataclass(frozen=True, slots=True)
class Arm:
    """How a session is resumed: ``lead_s`` None, no prefetch; else a prefetch that long
    before the onload, or (``settled``) once its promotions settled (the floor: a pool hit)."""

    label: str
    lead_s: float | None
    settled: bool = False


ARMS = (
    Arm("no prefetch", None),
    *(Arm(f"lead {ms:g} ms", ms / 1000.0) for ms in LEADS_MS),
    Arm("landed", 0.0, settled=True),
)


async def part_b_async(
    directory: str, rounds: int, sessions: int, keys: int, block: int, retry_ms: float
) -> dict[str, Any]:
    arms = list(ARMS)
    sessions = max(1, min(sessions, rounds * len(arms)))
    pool = max(4 * keys, 64)
    async with disk_service(directory, pool, block, sessions * keys + 64) as h:
        _, cache_id = await h.device(keys)
        s = Sessions(h, cache_id, keys, retry_ms / 1000.0)
        t = time.perf_counter()
        await s.put_on_disk(sessions)
        stored_s = time.perf_counter() - t
        direct = bool(s.disk.store.direct)
        writes = s.writes()
        # Warm-up: one load of each kind, not counted.
        await s.resume(0, arms[0])
        await s.resume(1 % sessions, arms[-1])
        results: dict[str, list[dict[str, Any]]] = {a.label: [] for a in arms}
        turn = 0
        for r in range(rounds):
            order = arms[r % len(arms) :] + arms[: r % len(arms)]
            for arm in order:
                results[arm.label].append(await s.resume(turn % sessions, arm))
                turn += 1
        writes_during = s.writes() - writes
    rows = []
    base = [x["seconds"] for x in results[arms[0].label]]
    for arm in arms:
        got = results[arm.label]
        secs = [x["seconds"] for x in got]
        counts: collections.Counter[str] = collections.Counter()
        for x in got:
            counts.update(x.get("prefetch", {}))
        rows.append(
            {
                "arm": arm.label,
                "lead_ms": None if arm.lead_s is None or arm.settled else arm.lead_s * 1000,
                "loads": len(secs),
                "p50_ms": statistics.median(secs) * 1e3,
                "p99_ms": pct(secs, 0.99) * 1e3,
                "mean_ms": statistics.fmean(secs) * 1e3,
                "p50_speedup": statistics.median(base) / statistics.median(secs),
                "p99_speedup": pct(base, 0.99) / pct(secs, 0.99),
                "retried_loads": sum(1 for x in got if x["retries"]),
                "held_after_load": sum(1 for x in got if x["held_after_load"]),
                "held_after_load_states": [
                    x["prefetch_state"] for x in got if x["held_after_load"]
                ],
                "retries": sum(x["retries"] for x in got),
                "prefetch_counts": dict(counts),
            }
        )
    return {
        "rounds": rounds,
        "sessions": sessions,
        "keys_per_session": keys,
        "block_bytes": block,
        "session_bytes": keys * block,
        "pool_blocks": pool,
        "retry_ms": retry_ms,
        "o_direct": direct,
        "store_and_demote_s": round(stored_s, 2),
        "writes_while_timing": writes_during,
        "rows": rows,
    }


def part_b(
    base_dir: str | None, rounds: int, sessions: int, keys: int, block: int, retry_ms: float
) -> dict[str, Any]:
    directory = tempfile.mkdtemp(prefix="kvoffload-control-", dir=base_dir)
    try:
        out = asyncio.run(part_b_async(directory, rounds, sessions, keys, block, retry_ms))
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    print(
        f"\n(b) prefetch: resume a session of {keys} blocks of {block // KIB} KiB "
        f"({keys * block / MIB:.0f} MiB) from disk (O_DIRECT {out['o_direct']}); onload to job "
        f"done, 409 retried every {retry_ms:g} ms; {rounds} loads per arm, {out['sessions']} "
        "sessions"
    )
    header = (
        f"{'arm':<12} {'p50 ms':>8} {'p99 ms':>8} {'p50 speed-up':>12} {'p99 speed-up':>12} "
        f"{'retried':>7} {'used':>6} {'wasted':>6} {'held on':>7}"
    )
    print(header)
    print("-" * len(header))
    for row in out["rows"]:
        c = row["prefetch_counts"]
        print(
            f"{row['arm']:<12} {row['p50_ms']:>8.2f} {row['p99_ms']:>8.2f} "
            f"{row['p50_speedup']:>12.2f} {row['p99_speedup']:>12.2f} {row['retried_loads']:>7} "
            f"{c.get('used', '-'):>6} {c.get('wasted', '-'):>6} {row['held_after_load']:>7}"
        )
    print(
        "used / wasted: the prefetches' keys by outcome; held on: loads after which their "
        "prefetch still held the keys (the bench cancels it)"
    )
    print(
        f"stored and demoted in {out['store_and_demote_s']} s; disk writes while timing: "
        f"{out['writes_while_timing']}"
    )
    return out


# ---------------------------------------------------------------------------- part (c)


def fill_and_retain(address: str, keys: list[bytes], retentions: int) -> int:
    """Store ``keys`` (request ``fill``, left live); with ``retentions``, retain them in that
    many retentions of near-equal size, each for an hour. The blocks retained."""
    import httpx

    hexes = [k.hex() for k in keys]
    with httpx.Client(base_url=f"http://{address}", timeout=30) as c:
        r = c.put("/v1/requests/fill")
        assert r.status_code in (200, 201), r.text
        for i in range(0, len(hexes), 512):
            part = hexes[i : i + 512]
            r = c.post("/v1/requests/fill/prepare-store", json={"keys": part})
            assert r.status_code == 200, r.text
            r = c.post("/v1/requests/fill/complete-store", json={"keys": part})
            assert r.status_code == 200, r.text
        c.delete("/v1/requests/fill")
        if not retentions:
            return 0
        per, extra = divmod(len(hexes), retentions)
        at = 0
        for n in range(retentions):
            size = per + (n < extra)
            body = {"keys": hexes[at : at + size], "ttl_s": 3600.0, "name": f"session-{n}"}
            at += size
            r = c.post(f"/v1/requests/agent-{n}/retain", json=body)
            assert r.status_code == 201, r.text
        answer = c.get("/v1/retentions").json()
        assert len(answer["retentions"]) == retentions, answer
        return int(answer["retained_blocks"])


def order(item: tuple[tuple[str, str, int], Any]) -> tuple[int, str]:
    """Rows by connections, then server name (off before on)."""
    (name, _, conns), _ = item
    return conns, name


def part_c_http(rounds: int, seconds: float) -> dict[str, Any]:
    from bench import http_bench as hb

    cores = sorted(os.sched_getaffinity(0))
    server_core, load_core = (cores[0], cores[1]) if len(cores) > 1 else (None, None)
    lookup_keys = [os.urandom(16) for _ in range(hb.NUM_KEYS)]
    # Half the pool in all: the lookup's 32 stored keys and the rest of the fill.
    filler = [os.urandom(16) for _ in range(COST_POOL // 2 - hb.NUM_KEYS // 2)]
    retained = {}
    with tempfile.TemporaryDirectory(prefix="kvbench-control-") as tmpdir:
        tmp = Path(tmpdir)
        servers = []
        try:
            off = hb.start_kvoffload(tmp, server_core, "retain-off")
            servers.append(off)
            on = hb.start_kvoffload(tmp, server_core, "retain-on")
            servers.append(on)
            body, _, _ = hb.prepare_kvoffload(off, lookup_keys)
            hb.prepare_kvoffload(on, lookup_keys)
            hits = lookup_keys[: hb.NUM_KEYS // 2]
            retained["retain-off"] = fill_and_retain(off.tcp(), filler, 0)
            # The lookup's hits are retained blocks too (in the first retentions).
            retained["retain-on"] = fill_and_retain(on.tcp(), hits + filler, COST_RETENTIONS)
            request = hb.http_request(hb.LOOKUP_PATH, body)
            # http_bench's run_rounds, with the two servers' order swapped every round.
            runs: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
            share = seconds / (seconds + min(0.3, seconds / 4))  # the warm-up is not counted
            for r in range(rounds):
                for conns in (1, 32):
                    for server in (off, on) if r % 2 == 0 else (on, off):
                        cpu = procfs.proc_cpu_seconds(server.proc.pid)
                        res = hb.load_once(server.tcp(), request, conns, seconds, load_core)
                        cpu = procfs.proc_cpu_seconds(server.proc.pid) - cpu
                        res["cpu_us_per_call"] = cpu * share / max(1, res["calls"]) * 1e6
                        runs.setdefault((server.name, "tcp", conns), []).append(res)
            table = {key: hb.median_of(value) for key, value in sorted(runs.items(), key=order)}
        finally:
            for server in servers:
                harness.stop_server(server.proc)
    hb.print_load_table(
        f"\n(c) lookup(64), {COST_RETENTIONS} retentions naming {retained['retain-on']} blocks "
        f"(half the pool) vs none; medians of {rounds} rounds of {seconds:g} s",
        table,
    )
    ratios = {}
    for conns in (1, 32):
        a, b = table[("retain-on", "tcp", conns)], table[("retain-off", "tcp", conns)]
        ratios[f"calls_on_vs_off_c{conns}"] = a["calls_per_s"] / b["calls_per_s"]
        ratios[f"cpu_off_vs_on_c{conns}"] = b["cpu_us_per_call"] / a["cpu_us_per_call"]
        pairs = zip(
            runs[("retain-on", "tcp", conns)], runs[("retain-off", "tcp", conns)], strict=True
        )
        ratios[f"calls_on_vs_off_c{conns}_paired"] = statistics.median(
            x["calls_per_s"] / y["calls_per_s"] for x, y in pairs
        )
    targets = {
        f"retentions on >= {COST_TARGET}x off (lookup calls/s, 32 conns)": (
            ratios["calls_on_vs_off_c32"] >= COST_TARGET
        ),
        "no errors": all(r["errors"] == 0 for r in table.values()),
    }
    hb.print_verdict(ratios, targets)
    return {
        "retained_blocks": retained,
        "results": hb.result_rows(table),
        "ratios": ratios,
        "targets": targets,
    }


def app_cost(retentions: int, calls: int) -> float:
    """CPU microseconds per lookup(64) of the engine app itself, called as ASGI in this process
    (no server, no sockets; ``http_bench.py --app-cost``'s way), with ``retentions`` live
    retentions naming half the pool (the lookup's 32 hits among them) or none."""
    import io

    from app.http.apps import create_app
    from app.settings import Settings
    from app.telemetry.logging import configure_logging
    from bench.http_bench import LOOKUP_PATH, NUM_KEYS

    settings = Settings(num_blocks=COST_POOL, block_bytes=4096, device="cpu", log_level="warning")
    configure_logging(settings.log_level, stream=io.StringIO(), fmt="json")
    app = create_app(settings)
    keys = [os.urandom(16).hex() for _ in range(NUM_KEYS)]
    filler = [os.urandom(16).hex() for _ in range(COST_POOL // 2 - NUM_KEYS // 2)]

    raw = harness.asgi_call(app)

    async def call(method: str, path: str, payload: Any = None) -> int:
        return await raw(method, path, b"" if payload is None else json.dumps(payload).encode())

    async def run() -> float:
        async with app.router.lifespan_context(app):
            await call("PUT", "/v1/requests/bench")
            stored = keys[: NUM_KEYS // 2] + filler
            for i in range(0, len(stored), 512):
                part = {"keys": stored[i : i + 512]}
                assert await call("POST", "/v1/requests/bench/prepare-store", part) == 200
                assert await call("POST", "/v1/requests/bench/complete-store", part) == 200
            if retentions:
                per, extra = divmod(len(stored), retentions)
                at = 0
                for n in range(retentions):
                    size = per + (n < extra)
                    body = {"keys": stored[at : at + size], "ttl_s": 3600.0}
                    at += size
                    assert await call("POST", f"/v1/requests/s{n}/retain", body) == 201
            body = {"keys": keys}
            for _ in range(calls // 10):  # warm-up
                await call("POST", LOOKUP_PATH, body)
            gc.collect()
            started = time.process_time()
            for _ in range(calls):
                assert await call("POST", LOOKUP_PATH, body) == 200
            return (time.process_time() - started) / calls * 1e6

    return asyncio.run(run())


def part_c_app(rounds: int, calls: int, fresh: bool = True) -> dict[str, Any]:
    """``app_cost`` with and without retentions, interleaved (order swapped each round), each
    in a fresh process pinned to one core (``fresh``; else in this process: a smoke run)."""
    import subprocess

    core = sorted(os.sched_getaffinity(0))[0]
    costs: dict[str, list[float]] = {"none": [], "retained": []}
    for r in range(rounds):
        order = [("none", 0), ("retained", COST_RETENTIONS)]
        for name, n in order if r % 2 == 0 else order[::-1]:
            if not fresh:
                costs[name].append(app_cost(n, calls))
                continue
            out = subprocess.run(
                [sys.executable, str(Path(__file__).resolve()), "--app-cost", str(n),
                 "--calls", str(calls)],
                cwd=ROOT, capture_output=True, check=True, timeout=300,
                preexec_fn=lambda: os.sched_setaffinity(0, {core}),
            )  # fmt: skip
            costs[name].append(float(out.stdout))
    off, on = statistics.median(costs["none"]), statistics.median(costs["retained"])
    paired = statistics.median(a / b for a, b in zip(costs["none"], costs["retained"], strict=True))
    print(
        f"\n(c) app-level CPU per lookup(64) (in process, no HTTP server; medians of {rounds}): "
        f"none {off:.1f} us, {COST_RETENTIONS} retentions {on:.1f} us: none/retained "
        f"{paired:.3f} (median of the rounds' ratios)"
    )
    return {"calls": calls, "rounds": costs, "none_us": off, "retained_us": on,
            "cpu_off_vs_on": paired}  # fmt: skip


def store_rate(capacity: int, retained: bool, new_keys: int, req_len: int = 16) -> float:
    """Keys per CPU second of ``prepare_store`` + ``complete_store`` (and the request's start
    and finish) of requests of ``req_len`` new keys into a full pool of ``capacity`` (each
    store evicts), half of it retained (``COST_RETENTIONS`` retentions) or none."""
    m = create_manager(capacity, POLICY, enable_events=False)
    ctx = ReqContext("fill")
    m.on_new_request(ctx)
    fill = [i.to_bytes(8, "big") + b"fill" for i in range(capacity)]
    for i in range(0, capacity, 1024):
        out = m.prepare_store(fill[i : i + 1024], ctx)
        assert out is not None
        m.complete_store(out.keys_to_store, ctx, True)
    m.on_request_finished(ctx)
    if retained:
        half = fill[: capacity // 2]
        per = max(1, len(half) // COST_RETENTIONS)
        for n, i in enumerate(range(0, len(half), per)):
            m.retain(half[i : i + per], 3600.0, f"s{n}")
    keys = [i.to_bytes(8, "big") + b"new" for i in range(new_keys)]
    ctxs = [ReqContext(f"r{i}") for i in range(0, new_keys, req_len)]
    gc.collect()
    prepare, complete = m.prepare_store, m.complete_store
    t = time.process_time()
    for ctx, i in zip(ctxs, range(0, new_keys, req_len), strict=True):
        m.on_new_request(ctx)
        out = prepare(keys[i : i + req_len], ctx)
        assert out is not None
        complete(out.keys_to_store, ctx, True)
        m.on_request_finished(ctx)
    return new_keys / (time.process_time() - t)


def part_c_manager(rounds: int, capacity: int, new_keys: int) -> dict[str, Any]:
    """``store_rate`` none retained and half retained, alternating (order swapped each round);
    the ratio is the median of the rounds' ratios."""
    rates: dict[str, list[float]] = {"none": [], "half retained": []}
    ratios = []
    for r in range(rounds):
        for retained in (False, True) if r % 2 == 0 else (True, False):
            rates["half retained" if retained else "none"].append(
                store_rate(capacity, retained, new_keys)
            )
        ratios.append(rates["half retained"][-1] / rates["none"][-1])
    med = {k: statistics.median(v) for k, v in rates.items()}
    ratio = statistics.median(ratios)
    print(
        f"\n(c) manager store (prepare + complete, CPU time) into a full pool of {capacity} "
        f"blocks, requests of 16 new keys, medians of {rounds}: none retained "
        f"{med['none'] / 1e3:.0f}k keys/s, half retained ({COST_RETENTIONS} retentions) "
        f"{med['half retained'] / 1e3:.0f}k keys/s: {ratio:.3f}x (median of the rounds' ratios)"
    )
    return {"capacity": capacity, "new_keys": new_keys, "rates": rates, "median": med,
            "ratios": ratios, "ratio": ratio}  # fmt: skip


# ---------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run (under 20 s)")
    parser.add_argument("--parts", default="a,b,c", help="comma-separated: a, b, c")
    parser.add_argument("--trace", type=Path, default=harness.TRACE)
    parser.add_argument("--dir", default=None, help="where part (b) puts its disk tier")
    parser.add_argument("--b-rounds", type=int, default=None, help="loads per arm (b)")
    parser.add_argument("--b-keys", type=int, default=32, help="blocks per session (b)")
    parser.add_argument("--b-block-kib", type=int, default=256, help="block size, KiB (b)")
    parser.add_argument("--b-retry-ms", type=float, default=1.0, help="409 retry period (b)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    # Internal: one app-level cost measurement in a fresh process (part (c)).
    parser.add_argument("--app-cost", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--calls", type=int, default=20000, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.app_cost is not None:
        print(app_cost(args.app_cost, args.calls))
        return 0
    parts = {p.strip() for p in args.parts.split(",") if p.strip()}
    unknown = parts - {"a", "b", "c"}
    if unknown:
        parser.error(f"unknown parts: {sorted(unknown)}")
    quick = args.quick
    record: dict[str, Any] = {
        "benchmark": "control",
        "quick": quick,
        "machine": harness.machine(affinity=sorted(os.sched_getaffinity(0))),
    }
    started = time.perf_counter()
    took: dict[str, float] = {}
    if "a" in parts:
        t = time.perf_counter()
        record["a"] = part_a(args.trace, 1000 if quick else 0, CAPACITIES)
        took["a"] = round(time.perf_counter() - t, 1)
    if "b" in parts:
        t = time.perf_counter()
        rounds = args.b_rounds or (3 if quick else 40)
        record["b"] = part_b(
            args.dir, rounds, 64, args.b_keys, args.b_block_kib * KIB, args.b_retry_ms
        )
        took["b"] = round(time.perf_counter() - t, 1)
    if "c" in parts:
        t = time.perf_counter()
        c: dict[str, Any] = {}
        if quick:
            print("\n(c) lookup calls/s through two servers: not in a --quick run")
        else:
            c["http"] = part_c_http(5, 1.5)
        c["app"] = part_c_app(1, 500, fresh=False) if quick else part_c_app(6, 10000)
        c["manager"] = part_c_manager(2 if quick else 9, 20000, 20000 if quick else 60000)
        record["c"] = c
        took["c"] = round(time.perf_counter() - t, 1)
    record["part_seconds"] = took
    record["seconds"] = round(time.perf_counter() - started, 1)
    print(
        f"\ntook {record['seconds']} s (" + ", ".join(f"{p} {s} s" for p, s in took.items()) + ")"
    )
    harness.write_results(args.out, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
