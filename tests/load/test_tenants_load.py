"""Two tenants under load on one real server: quotas hold, nothing crosses, neither starves.

A ``kvoffload serve`` on 127.0.0.1 with a tenants directory of two tenants, ``alpha`` and
``beta``: one namespace each (``NAMESPACE_BLOCKS`` blocks), small ``max_requests`` and
``max_pins``. 16 engines (8 per tenant, one thread and one HTTP connection each) run request
lives (start, lookup, prepare-store, complete-store, prepare-load, complete-load, finish) on the
SAME shared key hashes in both tenants plus a private key set per tenant, at most
``LIVES_PER_ENGINE`` lives or ``RUN_SECONDS`` each, while an operator thread samples
``GET /admin/v1/tenants``.

What the run must show:
- no 5xx but 507 ``quota_exceeded`` (the namespace's blocks); every refusal is a
  ``quota_exceeded`` naming a quota (429: ``pins`` / ``requests``, 507: ``blocks``) of the
  caller's own tenant, or 409 ``key_not_ready`` (a hit evicted by the tenant's own stores before
  its load: the race every concurrent engine has, as in ``test_load``);
- a tenant never sees a hit on a key only the other tenant stores (its private keys);
- the same hash in two namespaces is two blocks: before the load, beta finds nothing of the keys
  alpha stored and stores all of them itself;
- every sample of ``/admin/v1/tenants`` shows each tenant within its quotas, and at the end
  nothing held (no pin, no live request) and both tenants progressed (completed stores, ready
  blocks), so one tenant cannot starve the other;
- a clean exit of the server.
"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from kvoffload_client.client import KVOffloadAdminClient, KVOffloadClient, KVOffloadError

from testsupport.server import TOKEN, ServerProcess

TENANTS = ("alpha", "beta")
NAMESPACE_BLOCKS = 48
MAX_PINS = 16
MAX_REQUESTS = 5
ENGINES_PER_TENANT = 8
LIVES_PER_ENGINE = 120
RUN_SECONDS = 12.0
SHARED_KEYS = [b"S" + i.to_bytes(2, "big") for i in range(24)]  # the same hashes in both
PRIVATE_KEYS = {
    t: [t[0].upper().encode() + i.to_bytes(2, "big") for i in range(48)] for t in TENANTS
}
KEYS_PER_LIFE = 8


def token_of(tenant: str) -> str:
    return f"{tenant}-load-token-{'0' * 16}"


def namespace_of(tenant: str) -> str:
    return f"{tenant}-ns"


def write_tenants(directory: Path) -> None:
    """One owner-only ``NAME.toml`` per tenant, written whole."""
    directory.mkdir()
    for tenant in TENANTS:
        path = directory / f"{tenant}.toml"
        path.write_text(
            f'tokens = ["{token_of(tenant)}"]\n'
            f"namespaces = {{ {namespace_of(tenant)} = {NAMESPACE_BLOCKS} }}\n"
            f"max_pins = {MAX_PINS}\nmax_requests = {MAX_REQUESTS}\n",
            encoding="utf-8",
        )
        os.chmod(path, 0o600)


@dataclass
class Tally:
    """What one tenant's engines saw."""

    lives: int = 0
    stored: int = 0
    loaded: int = 0
    refusals: Counter[tuple[int, str, str | None]] = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def problem(self, text: str) -> None:
        with self.lock:
            if len(self.problems) < 20:
                self.problems.append(text)


def refused(tally: Tally, tenant: str, exc: KVOffloadError) -> None:
    """Record a refusal; anything but the expected ones is a problem."""
    quota = getattr(exc, "quota", None)
    with tally.lock:
        tally.refusals[(exc.status, exc.code, quota)] += 1
    expected_quotas = {429: ("pins", "requests"), 507: ("blocks",)}
    if exc.status == 409 and exc.code == "key_not_ready":
        return
    if exc.status not in expected_quotas or exc.code != "quota_exceeded":
        tally.problem(f"{tenant}: unexpected refusal {exc.status} {exc.code}: {exc.message}")
    elif quota not in expected_quotas[exc.status]:
        tally.problem(f"{tenant}: {exc.status} names quota {quota!r}: {exc.message}")
    elif f"tenant {tenant!r}" not in exc.message:
        tally.problem(f"{tenant}: a refusal names another tenant: {exc.message}")


def engine(url: str, tenant: str, index: int, tally: Tally, deadline: float) -> None:
    """Request lives until ``LIVES_PER_ENGINE`` or ``deadline``."""
    other = next(t for t in TENANTS if t != tenant)
    own, foreign = PRIVATE_KEYS[tenant], PRIVATE_KEYS[other]
    with KVOffloadClient(url, token=token_of(tenant), namespace=namespace_of(tenant)) as kv:
        for life in range(LIVES_PER_ENGINE):
            if time.monotonic() > deadline:
                return
            req = f"{tenant}-{index}-{life}"
            start = (index * 7 + life * 5) % len(own)
            mine = [own[(start + i) % len(own)] for i in range(KEYS_PER_LIFE // 2)]
            shared = [SHARED_KEYS[(start + i) % len(SHARED_KEYS)] for i in range(2)]
            keys = shared + mine
            probe = [foreign[(start + i) % len(foreign)] for i in range(KEYS_PER_LIFE // 2)]
            try:
                kv.start_request(req)
            except KVOffloadError as exc:
                refused(tally, tenant, exc)
                time.sleep(0.005)
                continue
            try:
                one_life(kv, req, keys, probe, tenant, tally)
            finally:
                kv.finish_request(req)
            with tally.lock:
                tally.lives += 1


def one_life(
    kv: KVOffloadClient, req: str, keys: list[bytes], probe: list[bytes], tenant: str, tally: Tally
) -> None:
    """Lookup (and probe the other tenant's keys), store the misses, load the hits."""
    found = kv.lookup(req, keys + probe)
    hits = [k for k, r in zip(keys, found.results[: len(keys)], strict=True) if r == "hit"]
    misses = [k for k, r in zip(keys, found.results[: len(keys)], strict=True) if r == "miss"]
    if any(r != "miss" for r in found.results[len(keys) :]):
        tally.problem(f"{tenant} sees the other tenant's keys: {found.results[len(keys) :]}")
    if misses:
        try:
            out = kv.prepare_store(req, misses)
        except KVOffloadError as exc:
            refused(tally, tenant, exc)
        else:
            if out.keys_to_store:
                done = kv.complete_store(req, out.keys_to_store)
                with tally.lock:
                    tally.stored += len(done.completed)
    if hits:
        try:
            kv.prepare_load(req, hits)
        except KVOffloadError as exc:
            refused(tally, tenant, exc)
        else:
            kv.complete_load(req, hits)
            with tally.lock:
                tally.loaded += len(hits)


def quota_sampler(
    admin: KVOffloadAdminClient, stop: threading.Event, samples: list[dict[str, Any]]
) -> None:
    """Sample every tenant's use until ``stop``."""
    while not stop.is_set():
        samples.append(admin.tenants())
        stop.wait(0.05)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerProcess]:
    write_tenants(tmp_path / "tenants")
    srv = ServerProcess(tmp_path, "--tenants", str(tmp_path / "tenants"))
    srv.start()
    try:
        yield srv
    finally:
        srv.kill()


def test_same_hash_in_two_namespaces_is_two_blocks(server: ServerProcess) -> None:
    alpha = KVOffloadClient(server.url, token=token_of("alpha"))
    beta = KVOffloadClient(server.url, token=token_of("beta"))
    with alpha, beta:
        alpha.start_request("r")
        out = alpha.prepare_store("r", SHARED_KEYS)
        assert alpha.complete_store("r", out.keys_to_store).completed == SHARED_KEYS
        assert alpha.lookup("r", SHARED_KEYS).hit_prefix == len(SHARED_KEYS)
        beta.start_request("r")  # the same req_id: requests are per namespace too
        assert set(beta.lookup("r", SHARED_KEYS).results) == {"miss"}
        assert beta.prepare_store("r", SHARED_KEYS).keys_to_store == SHARED_KEYS
        alpha.finish_request("r")
        beta.finish_request("r", abort=True)
    assert server.stop() == 0, server.log()


@pytest.mark.slow
def test_two_tenants_under_load_stay_apart_and_within_quotas(server: ServerProcess) -> None:
    tallies = {t: Tally() for t in TENANTS}
    deadline = time.monotonic() + RUN_SECONDS
    threads = [
        threading.Thread(target=engine, args=(server.url, t, i, tallies[t], deadline))
        for i in range(ENGINES_PER_TENANT)
        for t in TENANTS
    ]
    samples: list[dict[str, Any]] = []
    stop = threading.Event()
    with KVOffloadAdminClient(server.admin_url, token=TOKEN) as admin:
        sampler = threading.Thread(target=quota_sampler, args=(admin, stop, samples))
        sampler.start()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(RUN_SECONDS + 60)
        stop.set()
        sampler.join(10)
        assert not any(t.is_alive() for t in [*threads, sampler]), "an engine hung"
        final = admin.tenants()
    status = server.stop()
    summary = {t: (v.lives, v.stored, v.loaded, dict(v.refusals)) for t, v in tallies.items()}
    print(f"tenants load: {len(samples)} samples; (lives, stored, loaded, refusals) {summary}")

    for tally in tallies.values():
        assert tally.problems == [], tally.problems
        # Progress for both: one tenant's load never starves the other.
        assert tally.lives > 0, summary
        assert tally.stored > 0, summary
        assert tally.loaded > 0, summary
    # The quotas were reached (the run tested them) and never exceeded.
    refusals = Counter(q for v in tallies.values() for (_, _, q), n in v.refusals.items())
    assert refusals["requests"] > 0, summary
    assert samples
    for sample in [*samples, final]:
        for use in sample["tenants"]:
            assert use["pins"] <= use["max_pins"] == MAX_PINS, use
            assert use["requests"] <= use["max_requests"] == MAX_REQUESTS, use
    by_tenant = {use["tenant"]: use for use in final["tenants"]}
    assert set(by_tenant) == set(TENANTS)
    for tenant, use in by_tenant.items():
        assert (use["pins"], use["requests"]) == (0, 0), use
        (space,) = use["namespaces"]
        assert space["namespace"] == namespace_of(tenant)
        assert space["num_blocks"] == use["blocks"] == NAMESPACE_BLOCKS
        assert space["ready"] > 0, use
        assert space["pinned"] == space["pending"] == 0, use
    assert status == 0, server.log()
    assert "Traceback" not in server.log()
