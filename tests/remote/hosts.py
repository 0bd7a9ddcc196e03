"""Test hosts for the remote tier: network namespaces on a bridge, or loopback as a fallback.

``TestNet.create(names)`` makes, per name, a network namespace with a veth pair whose outer end
is enslaved to a bridge in the root namespace, and gives the inner end an address in a private
/24 chosen here (10.213.N.0/24, an N no interface of the root namespace uses). The bridge holds
.1, the hosts .2, .3, ... Nothing outside these addresses (and loopback) is ever targeted.
The root namespace's FORWARD chain gets one ACCEPT rule for the bridge (a host running Docker
drops forwarded traffic, bridged frames included), and ``create`` checks that one host reaches
another over TCP, failing at once with the firewall's state when it cannot.
``close()`` deletes every namespace, link, rule and the bridge it made, also after a failed
test.

Where namespaces cannot be made (not root, no ``ip``), ``TestNet.create`` returns a loopback
net: every host is 127.0.0.1 in the root namespace, processes stay separate, and
``link_down`` is unavailable (``can_cut_links`` is False). ``mode`` says which one a run got.

``MooncakeMaster`` runs a real ``mooncake_master`` (with its HTTP metadata server) on one
host; ``Node`` runs ``tests.remote.node`` (a host pool and a ``MooncakeTier``) on another and
drives it over its stdin and stdout.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from testsupport.polling import until

ROOT = Path(__file__).resolve().parents[2]
_serial = itertools.count()


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=20)


def netns_unavailable() -> str | None:
    """Why network namespaces cannot be made here, or None when they can."""
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    if os.geteuid() != 0:
        return "not root (ip netns needs CAP_SYS_ADMIN and CAP_NET_ADMIN)"
    probe = f"kvprobe{os.getpid()}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def _free_subnet() -> str:
    """``10.213.N`` for an N that no address in the root namespace uses."""
    used = _ip("-4", "-o", "addr").stdout
    start = os.getpid() % 250
    for i in range(250):
        prefix = f"10.213.{(start + i) % 250 + 1}"
        if f" {prefix}." not in used:
            return prefix
    raise RuntimeError("no free 10.213.N.0/24 subnet for the test hosts")


@dataclass
class Host:
    """One test host: its address and, on a namespaced net, its namespace and outer link."""

    name: str
    addr: str
    netns: str | None = None
    link: str | None = None

    def argv(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside this host (``ip netns exec``, which keeps the caller's pid)."""
        if self.netns is None:
            return list(argv)
        return ["ip", "netns", "exec", self.netns, *argv]


@dataclass
class TestNet:
    """Hosts on one bridge (or loopback). Build with ``TestNet.create``, end with ``close``."""

    __test__ = False  # not a test class, whatever its name

    mode: str
    hosts: dict[str, Host]
    bridge: str | None = None
    reason: str | None = None
    _made_netns: list[str] = field(default_factory=list)
    _made_links: list[str] = field(default_factory=list)
    _made_rules: list[list[str]] = field(default_factory=list)

    @classmethod
    def create(cls, names: Sequence[str]) -> TestNet:
        reason = netns_unavailable()
        if reason is not None:
            return cls(
                mode="loopback", hosts={n: Host(n, "127.0.0.1") for n in names}, reason=reason
            )
        tag = f"{os.getpid() % 100000}x{next(_serial)}"
        bridge = f"kvb{tag}"
        net = cls(mode="netns", hosts={}, bridge=bridge)
        try:
            prefix = _free_subnet()
            _ip("link", "add", bridge, "type", "bridge")
            net._made_links.append(bridge)
            _ip("addr", "add", f"{prefix}.1/24", "dev", bridge)
            _ip("link", "set", bridge, "up")
            net._accept_on_bridge()
            for i, name in enumerate(names):
                ns, outer, inner = f"kvo{tag}-{name}", f"kv{tag}o{i}", f"kv{tag}i{i}"
                _ip("netns", "add", ns)
                net._made_netns.append(ns)
                _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
                net._made_links.append(outer)
                _ip("link", "set", inner, "netns", ns)
                _ip("link", "set", outer, "master", bridge)
                _ip("link", "set", outer, "up")
                addr = f"{prefix}.{i + 2}"
                _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", inner)
                _ip("-n", ns, "link", "set", inner, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
                net.hosts[name] = Host(name, addr, netns=ns, link=outer)
            net._check_flow()
        except BaseException:
            net.close()
            raise
        return net

    def _accept_on_bridge(self) -> None:
        """Let traffic between the hosts through the root namespace's FORWARD chain, whatever
        its policy: Docker sets it to DROP and ``net.bridge.bridge-nf-call-iptables=1``, which
        sends bridged frames through it. One rule for this bridge, removed by ``close``."""
        if shutil.which("iptables") is None:
            return
        rule = ["FORWARD", "-i", str(self.bridge), "-o", str(self.bridge), "-j", "ACCEPT"]
        added = subprocess.run(
            ["iptables", "-w", "5", "-I", *rule], capture_output=True, text=True, timeout=20
        )
        if added.returncode == 0:
            self._made_rules.append(rule)

    def _check_flow(self) -> None:
        """A TCP connection from the first host to the second, or a RuntimeError saying that
        traffic between the test hosts cannot flow (and what the host's firewall says)."""
        if len(self.hosts) < 2:
            return
        first, second = list(self.hosts.values())[:2]
        listen = (
            "import socket,sys; s=socket.socket(); s.bind((sys.argv[1], 0)); s.listen(1);"
            "print(s.getsockname()[1], flush=True); s.settimeout(10); s.accept()"
        )
        with subprocess.Popen(
            second.argv([sys.executable, "-c", listen, second.addr]),
            stdout=subprocess.PIPE,
            text=True,
        ) as server:
            assert server.stdout is not None
            port = server.stdout.readline().strip()
            connect = (
                "import socket,sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), 5)"
            )
            try:
                done = subprocess.run(
                    first.argv([sys.executable, "-c", connect, second.addr, port]),
                    capture_output=True,
                    text=True,
                    timeout=20,
                )
            finally:
                server.kill()
        if done.returncode != 0:
            policy = (
                subprocess.run(
                    ["iptables", "-w", "5", "-S", "FORWARD"], capture_output=True, text=True
                ).stdout
                if shutil.which("iptables")
                else "(no iptables)"
            )
            raise RuntimeError(
                f"the test hosts cannot reach each other over bridge {self.bridge} "
                f"({first.name} -> {second.name}:{port}: {done.stderr.strip().splitlines()[-1:]}); "
                f"the host's FORWARD chain: {policy.strip()!r}"
            )

    @property
    def can_cut_links(self) -> bool:
        return self.mode == "netns"

    def describe(self) -> str:
        if self.mode == "netns":
            hosts = ", ".join(f"{h.name}={h.addr}" for h in self.hosts.values())
            return f"network namespaces on bridge {self.bridge}: {hosts}"
        return f"LOOPBACK FALLBACK, every host 127.0.0.1 ({self.reason})"

    def link_down(self, host: Host) -> None:
        """Cut ``host`` off the bridge (its outer veth end down)."""
        assert host.link is not None, "links can be cut only between namespaces"
        _ip("link", "set", host.link, "down")

    def link_up(self, host: Host) -> None:
        assert host.link is not None, "links can be cut only between namespaces"
        _ip("link", "set", host.link, "up")

    def close(self) -> None:
        """Delete what ``create`` made; each deletion is tried even if another fails."""
        for ns in reversed(self._made_netns):
            _ip("netns", "del", ns, check=False)
        for link in reversed(self._made_links):
            _ip("link", "del", link, check=False)
        for rule in self._made_rules:
            subprocess.run(["iptables", "-w", "5", "-D", *rule], capture_output=True, timeout=20)
        self._made_netns.clear()
        self._made_links.clear()
        self._made_rules.clear()


def pick_port(host: Host, default: int) -> int:
    """``default`` inside a namespace of its own; a free loopback port otherwise."""
    if host.netns is not None:
        return default
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def sigkill(proc: subprocess.Popen[bytes] | None) -> None:
    """SIGKILL ``proc`` if it runs, and wait for it to be gone."""
    if proc is not None and proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
        proc.wait(20)


def _mooncake_master_binary() -> str:
    found = shutil.which("mooncake_master", path=str(Path(sys.executable).parent))
    found = found or shutil.which("mooncake_master")
    if found is None:
        raise RuntimeError("mooncake_master is not installed (the mooncake extra provides it)")
    return found


class MooncakeMaster:
    """A real ``mooncake_master`` on ``host``: RPC and HTTP metadata server, restartable."""

    def __init__(self, host: Host, workdir: Path, client_ttl_s: int = 3) -> None:
        self.host = host
        self.workdir = workdir
        self.rpc_port = pick_port(host, 50051)
        self.http_port = pick_port(host, 8080)
        self.metrics_port = pick_port(host, 9003)
        self.client_ttl_s = client_ttl_s
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    @property
    def address(self) -> str:
        return f"{self.host.addr}:{self.rpc_port}"

    @property
    def metadata_url(self) -> str:
        return f"http://{self.host.addr}:{self.http_port}/metadata"

    def start(self, timeout_s: float = 30.0) -> MooncakeMaster:
        argv = [
            _mooncake_master_binary(),
            f"--rpc_port={self.rpc_port}",
            f"--rpc_address={self.host.addr}",
            "--enable_http_metadata_server=true",
            f"--http_metadata_server_host={self.host.addr}",
            f"--http_metadata_server_port={self.http_port}",
            f"--metrics_port={self.metrics_port}",
            f"--client_ttl={self.client_ttl_s}",
        ]
        self.starts += 1
        log = (self.workdir / f"master-{self.starts}.log").open("wb")
        self.proc = subprocess.Popen(self.host.argv(argv), stdout=log, stderr=subprocess.STDOUT)
        log.close()
        until("mooncake_master listening", self._listening, timeout_s)
        return self

    def _listening(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            tail = (self.workdir / f"master-{self.starts}.log").read_text()[-2000:]
            raise RuntimeError(f"mooncake_master exited ({self.proc.returncode}): {tail}")
        probe = self.host.argv(
            [
                sys.executable,
                "-c",
                "import socket, sys\n"
                "for port in sys.argv[2:]: socket.create_connection((sys.argv[1], int(port)), 1)",
                self.host.addr,
                str(self.rpc_port),
                str(self.http_port),
            ]
        )
        return subprocess.run(probe, capture_output=True, timeout=20).returncode == 0

    def kill(self) -> None:
        """SIGKILL, and wait for it to be gone."""
        sigkill(self.proc)

    def stop(self) -> None:
        self.kill()


class Etcd:
    """Debian's ``etcd`` (3.4), one member on ``host``: what HA masters elect their leader in
    and keep their oplog and the metadata in."""

    def __init__(self, host: Host, workdir: Path) -> None:
        self.host = host
        self.workdir = workdir
        self.port = pick_port(host, 2379)
        self.peer_port = pick_port(host, 2380)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"{self.host.addr}:{self.port}"

    def start(self, timeout_s: float = 30.0) -> Etcd:
        binary = shutil.which("etcd")
        if binary is None:
            raise RuntimeError("etcd is not installed (Debian: apt-get install etcd-server)")
        client, peer = f"http://{self.endpoint}", f"http://{self.host.addr}:{self.peer_port}"
        argv = [
            binary,
            "--name=e0",
            f"--data-dir={self.workdir / 'etcd-data'}",
            f"--listen-client-urls={client}",
            f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=e0={peer}",
        ]
        log = (self.workdir / "etcd.log").open("wb")
        self.proc = subprocess.Popen(self.host.argv(argv), stdout=log, stderr=subprocess.STDOUT)
        log.close()
        until("etcd serving", lambda: "ready to serve client requests" in self._log(), timeout_s)
        return self

    def _log(self) -> str:
        assert self.proc is not None
        text = (self.workdir / "etcd.log").read_text(errors="replace")
        if self.proc.poll() is not None:
            raise RuntimeError(f"etcd exited ({self.proc.returncode}): {text[-2000:]}")
        return text

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(20)


class HaMaster:
    """A ``mooncake_master --enable_ha`` on ``host``, electing its leader in ``etcd`` and
    replicating the metadata through its oplog there; nodes reach the leader through etcd
    (``address`` and ``metadata_url`` name it, as ``--mooncake-master`` and
    ``--mooncake-metadata`` do for a service)."""

    def __init__(self, host: Host, etcd: Etcd, workdir: Path, client_ttl_s: int = 3) -> None:
        self.host = host
        self.etcd = etcd
        self.workdir = workdir
        self.rpc_port = pick_port(host, 50051)
        self.metrics_port = pick_port(host, 9003)
        self.client_ttl_s = client_ttl_s
        self.log_path = workdir / f"ha-master-{host.name}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"etcd://{self.etcd.endpoint}"

    @property
    def metadata_url(self) -> str:
        return f"etcd://{self.etcd.endpoint}"

    def start(self) -> HaMaster:
        argv = [
            _mooncake_master_binary(),
            "--enable_ha=true",
            f"--etcd_endpoints={self.etcd.endpoint}",
            "--enable_oplog=true",
            f"--rpc_address={self.host.addr}",
            f"--rpc_port={self.rpc_port}",
            f"--metrics_port={self.metrics_port}",
            f"--client_ttl={self.client_ttl_s}",
        ]
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(self.host.argv(argv), stdout=log, stderr=subprocess.STDOUT)
        log.close()
        return self

    def role(self) -> str | None:
        """``leader`` or ``standby`` as its log last said, None before it said either."""
        assert self.proc is not None
        text = self.log_path.read_text(errors="replace")
        if self.proc.poll() is not None:
            raise RuntimeError(f"mooncake_master exited ({self.proc.returncode}): {text[-2000:]}")
        said = [line for line in text.splitlines() if "Master runtime state -> " in line]
        if not said:
            return None
        last = said[-1]
        if "-> serving, role=leader" in last:
            return "leader"
        return "standby" if "role=standby" in last else None

    def kill(self) -> None:
        """SIGKILL, and wait for it to be gone."""
        sigkill(self.proc)

    def stop(self) -> None:
        self.kill()


class Node:
    """A ``tests.remote.node`` process on ``host``, driven by one JSON line per command."""

    def __init__(
        self,
        host: Host,
        master: MooncakeMaster | HaMaster,
        workdir: Path,
        *,
        namespace: str = "model-a",
        num_blocks: int = 16,
        block_bytes: int = 64 << 10,
        segment_bytes: int = 32 << 20,
        replicas: int = 1,
        timeout_s: float = 3.0,
    ) -> None:
        self.host = host
        self.block_bytes = block_bytes
        self.log_path = workdir / f"node-{host.name}-{next(_serial)}.log"
        argv = [
            sys.executable,
            "-m",
            "tests.remote.node",
            json.dumps(
                {
                    "master": master.address,
                    "metadata_url": master.metadata_url,
                    "local_hostname": host.addr,
                    "namespace": namespace,
                    "num_blocks": num_blocks,
                    "block_bytes": block_bytes,
                    "segment_bytes": segment_bytes,
                    "replicas": replicas,
                    "timeout_s": timeout_s,
                }
            ),
        ]
        log = self.log_path.open("wb")
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen(
            host.argv(argv),
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
        )
        log.close()
        try:
            self.ready = self._reply(timeout_s=60)
        except BaseException:
            self.kill()
            self.close()
            raise

    def _reply(self, timeout_s: float = 60.0) -> dict[str, Any]:
        assert self.proc.stdout is not None
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            if not sel.select(timeout_s):
                raise AssertionError(f"node {self.host.name}: no answer within {timeout_s} s")
        line = self.proc.stdout.readline()
        if not line:
            tail = self.log_path.read_text(errors="replace")[-3000:]
            raise AssertionError(f"node {self.host.name} exited ({self.proc.poll()}): {tail}")
        reply: dict[str, Any] = json.loads(line)
        return reply

    def ask(self, op: str, timeout_s: float = 60.0, **args: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **args}).encode() + b"\n")
        self.proc.stdin.flush()
        return self._reply(timeout_s)

    def put(
        self, keys: Sequence[bytes], slots: Sequence[int], blocks: Sequence[bytes]
    ) -> list[bool]:
        """Write ``blocks`` into ``slots`` of this node's pool, then ``put_from`` them."""
        data = [base64.b64encode(b).decode() for b in blocks]
        reply = self.ask("put", keys=[k.hex() for k in keys], slots=list(slots), data=data)
        return [bool(x) for x in reply["ok"]]

    def get(self, keys: Sequence[bytes], slots: Sequence[int]) -> list[bytes | None]:
        """``get_into`` the slots; per key its slot's bytes if reported read, else None."""
        reply = self.ask("get", keys=[k.hex() for k in keys], slots=list(slots))
        return [None if d is None else base64.b64decode(d) for d in reply["data"]]

    def exists(self, keys: Sequence[bytes]) -> list[bool | None]:
        """``exists``: True / False as the store answered, None where it gave no answer."""
        found: list[bool | None] = self.ask("exists", keys=[k.hex() for k in keys])["found"]
        return found

    def health(self) -> dict[str, Any]:
        return self.ask("health")

    def kill(self) -> None:
        sigkill(self.proc)

    def close(self) -> None:
        """Ask the node to close its tier and exit; SIGKILL if it does not within 20 s."""
        if self.proc.poll() is None:
            with contextlib.suppress(Exception):
                self.ask("close", timeout_s=20)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.kill()
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()
