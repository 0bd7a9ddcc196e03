"""Tests of the remote tier against a real Mooncake Store on several test hosts.

They need Mooncake (the ``mooncake`` extra: ``make test-remote`` installs it). Without it this
directory is not collected, unless ``KVOFFLOAD_REQUIRE_MOONCAKE=1`` (set by ``make
test-remote``), where a missing Mooncake is an error, never a skip. The hosts are network
namespaces on a bridge when this runs as root, else processes on loopback; the report header
says which.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest

if importlib.util.find_spec("mooncake") is None:
    if os.environ.get("KVOFFLOAD_REQUIRE_MOONCAKE") == "1":
        raise RuntimeError(
            "KVOFFLOAD_REQUIRE_MOONCAKE=1 but mooncake is not importable: run `make "
            "test-remote`, which installs the mooncake extra (and needs Debian's libibverbs1, "
            "librdmacm1 and libnuma1)"
        )
    collect_ignore_glob = ["*"]
else:
    import mooncake.store  # noqa: F401  (a missing system library fails here, not in a test)

    from tests.remote.hosts import (
        Etcd,
        HaMaster,
        MooncakeMaster,
        Node,
        TestNet,
        netns_unavailable,
    )

    def pytest_report_header() -> str:
        reason = netns_unavailable()
        where = "network namespaces on a bridge" if reason is None else f"LOOPBACK ({reason})"
        return f"remote tier test hosts: {where}"

    class Cluster:
        """A test net, a master on its first host, and the nodes a test starts."""

        def __init__(self, net: TestNet, workdir: Path) -> None:
            self.net = net
            self.workdir = workdir
            self.master = MooncakeMaster(net.hosts["master"], workdir)
            self.nodes: list[Node] = []

        def node(self, host: str, **kwargs: object) -> Node:
            started = Node(self.net.hosts[host], self.master, self.workdir, **kwargs)  # type: ignore[arg-type]
            self.nodes.append(started)
            return started

        def close(self) -> None:
            for node in self.nodes:
                node.close()
            self.master.stop()

    C = TypeVar("C", "Cluster", "HaCluster")

    @contextlib.contextmanager
    def on_hosts(
        names: list[str], tmp_path: Path, make: Callable[[TestNet, Path], C]
    ) -> Iterator[C]:
        """A test net of ``names`` and what ``make`` builds on it; both closed after the test,
        also after a failed one."""
        net = TestNet.create(names)
        print(f"test hosts: {net.describe()}")
        made = make(net, tmp_path)
        try:
            yield made
        finally:
            try:
                made.close()
            finally:
                net.close()

    @pytest.fixture
    def cluster(tmp_path: Path) -> Iterator[Cluster]:
        """A master host and hosts a, b, c (the test starts the master and its nodes)."""
        with on_hosts(["master", "a", "b", "c"], tmp_path, Cluster) as made:
            yield made

    class HaCluster:
        """An etcd, two HA masters (``m1`` started first leads) and the nodes a test starts."""

        def __init__(self, net: TestNet, workdir: Path) -> None:
            self.net = net
            self.workdir = workdir
            self.etcd = Etcd(net.hosts["etcd"], workdir)
            self.masters = [HaMaster(net.hosts[n], self.etcd, workdir) for n in ("m1", "m2")]
            self.nodes: list[Node] = []

        def node(self, host: str, **kwargs: object) -> Node:
            started = Node(self.net.hosts[host], self.masters[0], self.workdir, **kwargs)  # type: ignore[arg-type]
            self.nodes.append(started)
            return started

        def close(self) -> None:
            # With HA masters, Mooncake's client takes about 30 s to tear down (its watch of
            # the master view in etcd), whether closed or left to the process's exit: nodes are
            # killed here, as a crash would end them, so a test does not wait on it.
            for node in self.nodes:
                node.kill()
                node.close()
            for master in self.masters:
                master.stop()
            self.etcd.stop()

    @pytest.fixture
    def ha_cluster(tmp_path: Path) -> Iterator[HaCluster]:
        """Hosts etcd, m1, m2 (masters), a, b, c (nodes); the test starts them."""
        with on_hosts(["etcd", "m1", "m2", "a", "b", "c"], tmp_path, HaCluster) as made:
            yield made
