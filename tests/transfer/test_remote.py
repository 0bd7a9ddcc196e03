"""The remote tier's shared pieces, without Mooncake: names, slot checks, health, config.

The tier against a real Mooncake Store is in ``tests/remote`` (``make test-remote``).
"""

from __future__ import annotations

import sys
from typing import ClassVar

import pytest

from transfer import HostPool, InvalidJobError, RemoteHealth, RemoteTierError, remote_name
from transfer.mooncake import MooncakeConfig, MooncakeTier
from transfer.remote import COUNTERS, check_slots


def config(**changes: object) -> MooncakeConfig:
    fields: dict[str, object] = {
        "master": "10.0.0.1:50051",
        "metadata_url": "http://10.0.0.1:8080/metadata",
        "local_hostname": "10.0.0.2",
        **changes,
    }
    return MooncakeConfig(**fields)  # type: ignore[arg-type]


def test_remote_names_keep_namespaces_apart() -> None:
    assert remote_name("llama/8b:fp16:16", b"\x00\xab") == "llama/8b:fp16:16/00ab"
    assert remote_name("a", b"\x01") != remote_name("b", b"\x01")


@pytest.mark.parametrize(
    ("keys", "slots", "message"),
    [
        ([b"a", b"b"], [0], "2 keys but 1 slots"),
        ([b"a"], [4], "outside the pool"),
        ([b"a"], [-1], "outside the pool"),
        ([b"a"], [True], "outside the pool"),
        ([b"a", b"b"], [1, 1], "named twice"),
    ],
)
def test_malformed_calls_are_refused(keys, slots, message) -> None:
    with pytest.raises(InvalidJobError, match=message):
        check_slots(keys, slots, num_blocks=4)


def test_a_well_formed_call_passes() -> None:
    check_slots([b"a", b"b"], [3, 0], num_blocks=4)
    check_slots([], [], num_blocks=4)


def test_health_as_dict_carries_state_error_and_counters() -> None:
    health = RemoteHealth("degraded", 0.0, "probe: refused", dict.fromkeys(COUNTERS, 0))
    out = health.as_dict()
    assert (out["state"], out["last_error"], health.ok) == ("degraded", "probe: refused", False)
    assert out["counters"] == health.counters == dict.fromkeys(COUNTERS, 0)
    assert out["seconds_in_state"] > 0  # type: ignore[operator]


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"protocol": "udp"}, "protocol"),
        ({"master": "10.0.0.1"}, "HOST:PORT"),
        ({"master": "etcd://10.0.0.1"}, "HOST:PORT"),
        ({"master": "etcd://10.0.0.1:2379;10.0.0.2"}, "HOST:PORT"),
        ({"master": "10.0.0.1:1;10.0.0.2:1"}, "HOST:PORT"),
        ({"master": "http://10.0.0.1:1"}, "HOST:PORT"),
        ({"metadata_url": "10.0.0.1:8080"}, "URL"),
        ({"metadata_url": "etcd://"}, "HOST:PORT"),
        ({"local_hostname": ""}, "local_hostname"),
        ({"segment_bytes": -1}, "segment_bytes"),
        ({"replicas": 0}, "replicas"),
        ({"threads": 0}, "threads"),
        ({"timeout_s": 0}, "timeout_s"),
    ],
)
def test_invalid_configurations_are_refused(changes, message) -> None:
    with pytest.raises(RemoteTierError, match=message):
        config(**changes)


def test_ha_masters_are_named_by_their_etcd_endpoints() -> None:
    cfg = config(master="etcd://10.0.0.1:2379;10.0.0.2:2379", metadata_url="etcd://10.0.0.1:2379")
    assert cfg.master.startswith("etcd://")


def test_a_tier_without_mooncake_says_how_to_install_it(monkeypatch) -> None:
    # None in sys.modules makes the import fail as if the package were absent.
    monkeypatch.setitem(sys.modules, "mooncake", None)
    monkeypatch.setitem(sys.modules, "mooncake.store", None)
    with (
        HostPool.create(2, 4096, pin=False) as pool,
        pytest.raises(RemoteTierError, match=r"kvoffload\[mooncake\]"),
    ):
        MooncakeTier(pool, "ns", config())


def test_a_tier_needs_a_namespace() -> None:
    with HostPool.create(2, 4096, pin=False) as pool, pytest.raises(RemoteTierError):
        MooncakeTier(pool, "", config())


class _AnsweringStore:
    """A stand-in for ``mooncake.store``'s client: ``batch_is_exist`` answers each name from
    ``codes`` (0 when absent), or raises ``failing`` when set."""

    codes: ClassVar[dict[str, int]] = {}
    failing: ClassVar[Exception | None] = None

    def setup(self, *args: object) -> int:
        return 0

    def register_buffer(self, base: int, size: int) -> int:
        return 0

    def health_check(self) -> int:
        return 0

    def batch_is_exist(self, names: list[str]) -> list[int]:
        if self.failing is not None:
            raise self.failing
        return [self.codes.get(n, 0) for n in names]

    def close(self) -> None:
        pass


def test_exists_answers_true_false_or_none_and_counts_only_answers(monkeypatch) -> None:
    """1 -> True, 0 -> False (the only "not held"), an error code or a failed call -> None:
    no answer, never taken for an absent block."""
    import socket
    import types

    fake = types.SimpleNamespace(
        MooncakeDistributedStore=_AnsweringStore, ReplicateConfig=types.SimpleNamespace
    )
    monkeypatch.setitem(sys.modules, "mooncake", types.SimpleNamespace(store=fake))
    monkeypatch.setitem(sys.modules, "mooncake.store", fake)
    with socket.create_server(("127.0.0.1", 0)) as listener:  # the master and metadata server
        port = listener.getsockname()[1]
        cfg = config(master=f"127.0.0.1:{port}", metadata_url=f"http://127.0.0.1:{port}/m")
        with HostPool.create(2, 4096, pin=False) as pool:
            tier = MooncakeTier(pool, "ns", cfg)
            try:
                assert tier.health().ok
                _AnsweringStore.codes = {remote_name("ns", b"a"): 1, remote_name("ns", b"c"): -1}
                assert tier.exists([b"a", b"b", b"c"]) == [True, False, None]
                counters = tier.health().counters
                assert (counters["hits"], counters["misses"], counters["errors"]) == (1, 1, 1)
                _AnsweringStore.failing = RuntimeError("master gone")
                assert tier.exists([b"a", b"b"]) == [None, None]
            finally:
                _AnsweringStore.failing = None
                _AnsweringStore.codes = {}
                tier.close()
            assert tier.exists([b"a"]) == [None]  # closed: no answer
