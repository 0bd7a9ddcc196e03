"""A one-node Ceph cluster with an S3 gateway (RADOS Gateway), brought up from nothing.

``RadosGateway(workdir).start()`` writes a ``ceph.conf`` and cephx keyrings into ``workdir``
and starts, as child processes of this one (no systemd, nothing outside ``workdir``):

- one monitor (``ceph-mon``) on a free loopback port;
- one OSD (``ceph-osd``), pools of size 1 with 8 placement groups each;
- one gateway (``radosgw``, the beast frontend on ``127.0.0.1`` and a free port), with an S3
  user of fixed keys made by ``radosgw-admin``.

No manager (``ceph-mgr``): S3 does not need one, and it would be most of the cluster's memory.
``start()`` returns once an authenticated S3 PUT has been answered (a bucket made, an object
written and both removed again), so the gateway's lazily created pools exist before a test's
first request. Clients must use path-style addressing (no DNS name is configured).

The OSD's object store is ``memstore`` by default: the OSD keeps the objects in its own memory.
The tests need objects to outlive the *gateway* (``kill_gateway`` then ``start_gateway``), and
memstore gives that: the gateway holds no data, the OSD does. What memstore cannot do is keep
objects through the death of the OSD itself, which no test needs; ``store="bluestore"`` (a
sparse file of ``bluestore_bytes`` under ``workdir``) keeps them, for a test that would. Measured
on this project's 2-core machine (Ceph 16.2.15), from nothing to the first successful PUT by a
boto3 client after ``start()``, median of 5 (alternating): memstore 1.56 s (1.45-1.70), bluestore
2.48 s (2.38-2.70); ``close()`` 0.45 s. ``timings`` holds the phases of one start.

What made the start fast, found by measuring: ``paxos propose interval`` 0.05 s (each pool the
gateway creates waits for one proposal; 1 s by default); keys written here rather than by
``ceph-authtool``, and put in the monitor's initial keyring so no ``ceph auth`` call is needed;
the OSD's mkfs run while the monitor starts; ``objecter tick interval`` 0.2 s (a client that
finds no OSD up yet asks for a new map only on that tick: 5 s by default); for bluestore,
``bdev aio poll ms`` 20 (each of the dozen opens and closes of the block file at mkfs and mount
waited 250 ms) and no fsck at mkfs.

A killed gateway's watches on its control objects outlive it until ``osd client watch
timeout`` (3 s here, 30 s by default): a metadata change (a bucket created or deleted) made
just after a ``kill_gateway`` / ``start_gateway`` can take up to that long, as RGW waits for the
dead instance to acknowledge its cache notification. Object reads and writes do not wait.

Faults, for the tests of an S3 tier: ``kill_gateway()`` (SIGKILL), ``stop_gateway()`` (SIGTERM,
waited for), ``start_gateway()`` (again on the same port, returns once it answers),
``pause_gateway()`` / ``resume_gateway()`` (SIGSTOP / SIGCONT: a hung gateway whose port still
accepts connections, so clients time out rather than being refused).

``close()`` stops the gateway, then the OSD, then the monitor (a gateway whose OSD is gone
hangs on SIGTERM) and removes ``workdir``. Each daemon logs into ``workdir``; a failed start,
and a ``close()`` that finds a daemon died on its own, raise ``RgwError`` with the tails of
the logs that matter.

By hand: ``python -m testsupport.rgw up DIR`` prints the endpoint and keys as one JSON line
and runs until SIGINT or SIGTERM, then tears down (``DIR`` must be missing or empty).

Binaries: Debian's ``ceph-mon``, ``ceph-osd``, ``radosgw`` and ``ceph-common`` (``apt-get
install --no-install-recommends ceph-mon ceph-osd radosgw ceph-common``); ``CephNotInstalled``
names them when one is missing. Needs Linux (``/proc``, ``prctl``).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import ctypes
import errno
import hashlib
import hmac
import http.client
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Literal

from testsupport.ports import free_port

#: Debian packages that hold the binaries this module runs.
DEBIAN_PACKAGES = ("ceph-mon", "ceph-osd", "radosgw", "ceph-common")
#: Each binary and the Debian package it comes from.
BINARIES: Mapping[str, str] = {
    "ceph-mon": "ceph-mon",
    "ceph-osd": "ceph-osd",
    "radosgw": "radosgw",
    "radosgw-admin": "ceph-common",
    "ceph": "ceph-common",
    # In ceph-base, which ceph-mon and ceph-osd depend on.
    "monmaptool": "ceph-base",
}

#: The S3 user's fixed keys (any client of the cluster can use them; it is a test cluster).
ACCESS_KEY = "KVOFFLOADTESTACCESS0"
SECRET_KEY = "kvoffloadTestSecretKey0000000000000000000"
#: The region clients sign with. RGW 16 accepts a signature for any region (it does not check
#: the credential scope's region), but a bucket's LocationConstraint must be empty or its zone
#: group's ``api_name``: "default" in a cluster made this way (checked: "us-east-1" there is
#: InvalidLocationConstraint). So "default" also suits clients that send the region as the
#: constraint.
REGION = "default"
USER_ID = "kvoffload"

Store = Literal["memstore", "bluestore"]

_LOG_TAIL_LINES = 25


class CephNotInstalled(RuntimeError):
    """A Ceph binary this module runs is not on PATH; the message names the Debian packages."""


class RgwError(RuntimeError):
    """The cluster failed to start, or a daemon died on its own; the message carries the tails
    of the daemons' logs."""


def missing_binaries() -> list[str]:
    """The binaries of ``BINARIES`` that are not on PATH (empty when all are)."""
    return [name for name in BINARIES if shutil.which(name) is None]


def install_hint(missing: list[str]) -> str:
    """One sentence that names ``missing`` binaries and the Debian packages to install."""
    packages = " ".join(DEBIAN_PACKAGES)
    return (
        f"Ceph binaries not found on PATH: {', '.join(missing)}; on Debian/Ubuntu install "
        f"them with `apt-get install --no-install-recommends {packages}`"
    )


def find_binaries() -> dict[str, str]:
    """The absolute path of every binary in ``BINARIES``; ``CephNotInstalled`` when one is
    missing."""
    missing = missing_binaries()
    if missing:
        raise CephNotInstalled(install_hint(missing))
    found: dict[str, str] = {}
    for name in BINARIES:
        path = shutil.which(name)
        assert path is not None
        found[name] = path
    return found


def cephx_key() -> str:
    """A new cephx secret in the form keyrings hold: base64 of (type u16 = 1 for AES, created
    u32 seconds + u32 nanoseconds, length u16, 16 random bytes), as ``ceph-authtool
    --gen-key`` writes it. Made here to save a process start per key."""
    header = struct.pack("<HIIH", 1, int(time.time()), 0, 16)
    return base64.b64encode(header + os.urandom(16)).decode()


def proc_state(pid: int) -> str | None:
    """The state letter of ``/proc/PID/stat`` (R, S, D: alive; T: stopped; Z: exited, not yet
    reaped), or None when there is no such process. ``kill -0`` cannot tell a zombie or a
    stopped process from a running one; this can."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            # The command name (field 2) is in parentheses and may hold spaces.
            return f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None


def log_tail(path: Path, lines: int = _LOG_TAIL_LINES) -> str:
    """The last ``lines`` lines of ``path``, preceded by its last few error lines (Ceph logs
    errors at level -1) where those are older than the tail: a daemon's last lines are often
    RocksDB's statistics, not the reason it stopped. Reads at most the last 256 KiB."""
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - (256 << 10)))
            text = f.read().decode("utf-8", errors="replace")
    except FileNotFoundError:
        return f"--- {path.name}: (no such file)"
    all_lines = text.splitlines()
    tail = all_lines[-lines:]
    errors = [line for line in all_lines[:-lines] if " -1 " in line][-5:]
    head = f"--- {path.name}: last error lines before the tail:\n" + "\n".join(errors) + "\n"
    return (head if errors else "") + f"--- {path.name} (last {lines} lines):\n" + "\n".join(tail)


# PR_SET_PDEATHSIG: the kernel sends the child this signal when the thread that forked it
# exits, so daemons never outlive a test run that is killed (SIGKILL runs no cleanup).
_PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True)


def _die_with_parent() -> None:
    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def child_env() -> dict[str, str]:
    """This process's environment without the variables through which Ceph's tools would pick
    up another cluster's settings (CEPH_ARGS is added to every command line)."""
    return {k: v for k, v in os.environ.items() if k not in ("CEPH_ARGS", "CEPH_CONF")}


class Daemon:
    """One Ceph daemon, run in the foreground (``-f``) as a child of this process.

    Its own log goes where ceph.conf says (``log``); what it writes on stdout/stderr (crashes,
    early config errors) is appended to ``out``. It runs in its own session, so a Ctrl-C in the
    terminal reaches this process, which stops the daemons in order, not the daemons at once.
    The daemon is killed if the thread that started it exits (``PR_SET_PDEATHSIG``): start
    daemons from a thread that outlives them (the main thread)."""

    def __init__(self, name: str, argv: list[str], log: Path, out: Path) -> None:
        self.name, self.argv, self.log, self.out = name, argv, log, out
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        """Start it (it must not be running)."""
        assert not self.running(), f"{self.name} is already running"
        with self.out.open("ab") as out:
            self.proc = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_die_with_parent,
                env=child_env(),
            )

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def running(self) -> bool:
        """Started and not exited (stopped by SIGSTOP counts as running). Reaps it if it has
        exited, so its PID is never signalled once it may have been reused."""
        return self.proc is not None and self.proc.poll() is None

    def exited_on_its_own(self) -> int | None:
        """Its exit status when it was started and has exited, else None."""
        if self.proc is None:
            return None
        return self.proc.poll()

    def state(self) -> str | None:
        """``proc_state`` of the running daemon; None when it is not running."""
        return proc_state(self.proc.pid) if self.proc is not None and self.running() else None

    def send(self, sig: int) -> None:
        """Send ``sig`` if it is running (never to a reaped PID)."""
        if self.proc is not None and self.running():
            self.proc.send_signal(sig)

    def stop(self, sig: int = signal.SIGTERM, grace_s: float = 10.0) -> bool:
        """Send ``sig`` (with SIGCONT, so a paused daemon can act on it), wait up to
        ``grace_s`` for it to exit, then SIGKILL it. Returns once it has exited and been reaped
        (a multi-threaded daemon lingers as a zombie while its other threads finish; it still
        holds its sockets until then). True when it exited without the SIGKILL."""
        if self.proc is None or not self.running():
            return True
        self.proc.send_signal(sig)
        if sig != signal.SIGKILL:
            self.send(signal.SIGCONT)
        try:
            self.proc.wait(grace_s)
            return True
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return False


@dataclass
class _Phase:
    """Seconds since ``start()`` began at which each phase of a start ended."""

    t0: float = field(default_factory=time.monotonic)
    marks: dict[str, float] = field(default_factory=dict)

    def mark(self, name: str) -> None:
        self.marks[name] = round(time.monotonic() - self.t0, 3)


class RadosGateway:
    """A one-node Ceph cluster and its S3 gateway, all state and logs under ``workdir``.

    ``workdir`` must be missing or empty: ``close()`` removes it with everything in it (unless
    ``keep_dir``). ``store``: the OSD's object store (``memstore``: fast, data in the OSD's
    memory; ``bluestore``: a sparse file of ``bluestore_bytes``, survives an OSD restart).
    ``start_timeout_s`` bounds ``start()``. ``rgw_debug``: the gateway's log level (1 logs
    every request; 0 for benchmarks). ``port``: the gateway's port (default: a free one).
    ``extra_conf``: options added to ceph.conf, by section.

    Not thread-safe; call it from one thread (the one that will outlive its daemons).
    """

    def __init__(
        self,
        workdir: Path | str,
        *,
        store: Store = "memstore",
        start_timeout_s: float = 90.0,
        bluestore_bytes: int = 10 << 30,
        rgw_debug: int = 1,
        keep_dir: bool = False,
        port: int | None = None,
        extra_conf: Mapping[str, Mapping[str, str]] | None = None,
    ) -> None:
        self.workdir = Path(workdir).resolve()
        if store not in ("memstore", "bluestore"):
            raise ValueError(f"store must be memstore or bluestore, not {store!r}")
        self.store: Store = store
        self.start_timeout_s = start_timeout_s
        self.bluestore_bytes = bluestore_bytes
        self.rgw_debug = rgw_debug
        self.keep_dir = keep_dir
        self.extra_conf = extra_conf or {}
        self.access_key = ACCESS_KEY
        self.secret_key = SECRET_KEY
        self.region = REGION
        self.mon_port = 0
        # 0: a free port picked at start (another one if it is taken before the gateway
        # binds it); else this port, or a failed start.
        self._asked_port = port or 0
        self.port = self._asked_port
        #: Seconds from ``start()`` to the end of each of its phases (filled by ``start()``).
        self.timings: dict[str, float] = {}
        self._bin: dict[str, str] = {}
        self._mon: Daemon | None = None
        self._osd: Daemon | None = None
        self._gw: Daemon | None = None
        # True from a kill_gateway/stop_gateway until the next start_gateway: the gateway is
        # down on purpose, which close() must not report as a crash.
        self._gateway_down_on_purpose = False
        self._closed = False

    # ------------------------------------------------------------------------------- public

    @property
    def endpoint(self) -> str:
        """``http://127.0.0.1:PORT``, the gateway's S3 endpoint (path-style addressing)."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def conf_path(self) -> Path:
        """The cluster's ceph.conf (for ``ceph -c`` / ``radosgw-admin -c`` by hand)."""
        return self.workdir / "ceph.conf"

    def credentials(self) -> dict[str, str]:
        """What a client needs: endpoint, access_key, secret_key, region."""
        return {
            "endpoint": self.endpoint,
            "access_key": self.access_key,
            "secret_key": self.secret_key,
            "region": self.region,
        }

    def pids(self) -> dict[str, int]:
        """The running daemons' PIDs by name (``mon.a``, ``osd.0``, ``client.rgw.gw``): for
        CPU and memory readings from /proc."""
        return {
            d.name: d.pid
            for d in (self._mon, self._osd, self._gw)
            if d is not None and d.pid is not None and d.running()
        }

    def start(self) -> RadosGateway:
        """Bring the cluster up; returns self once an authenticated S3 PUT has succeeded.

        Raises ``CephNotInstalled`` (binaries missing) or ``RgwError`` (a daemon failed, or
        ``start_timeout_s`` passed; daemons already started are stopped first, and the
        message holds their log tails)."""
        self._bin = find_binaries()
        if self.workdir.exists() and any(self.workdir.iterdir()):
            raise RgwError(f"{self.workdir} is not empty; give a missing or empty directory")
        phase = _Phase()
        deadline = phase.t0 + self.start_timeout_s
        try:
            self._bootstrap(phase, deadline)
        except BaseException as exc:
            # Whatever went wrong (a timeout, Ctrl-C), no daemon may outlive the attempt.
            tails = self._tails()
            self._teardown()
            if isinstance(exc, RgwError | CephNotInstalled):
                raise RgwError(f"{exc}\n{tails}") from None
            if isinstance(exc, Exception):
                raise RgwError(f"cluster start failed: {exc!r}\n{tails}") from exc
            raise
        self.timings = phase.marks
        return self

    def kill_gateway(self) -> None:
        """SIGKILL the gateway and reap it (a crash: requests in flight are cut)."""
        gw = self._need_gw()
        self._gateway_down_on_purpose = True
        gw.stop(signal.SIGKILL)

    def stop_gateway(self, grace_s: float = 30.0) -> None:
        """SIGTERM the gateway (a paused one is resumed so it can exit) and wait until it
        has exited; SIGKILL after ``grace_s``."""
        gw = self._need_gw()
        self._gateway_down_on_purpose = True
        gw.stop(signal.SIGTERM, grace_s)

    def start_gateway(self, timeout_s: float = 30.0) -> None:
        """Start the gateway again on the same port; returns once it answers an S3 request.
        It must not be running (``RgwError`` otherwise, or when it does not answer in
        ``timeout_s``)."""
        gw = self._need_gw()
        if gw.running():
            raise RgwError("start_gateway: the gateway is still running; stop or kill it first")
        gw.start()
        self._gateway_down_on_purpose = False
        try:
            self._wait_s3(time.monotonic() + timeout_s)
        except RgwError as exc:
            tails = f"{log_tail(gw.out, 10)}\n{log_tail(gw.log)}"
            raise RgwError(f"start_gateway: {exc}\n{tails}") from None

    def pause_gateway(self) -> None:
        """SIGSTOP the gateway: its port still accepts connections (the kernel completes the
        handshake) but nothing answers, as a hung gateway. Returns once it is stopped."""
        gw = self._need_gw()
        if not gw.running():
            raise RgwError("pause_gateway: the gateway is not running")
        gw.send(signal.SIGSTOP)
        self._wait_state(gw, lambda s: s == "T", "stopped (T)")

    def resume_gateway(self) -> None:
        """SIGCONT a paused gateway; returns once it runs again."""
        gw = self._need_gw()
        gw.send(signal.SIGCONT)
        self._wait_state(gw, lambda s: s != "T", "running")

    def gateway_state(self) -> Literal["running", "paused", "down"]:
        """Whether the gateway runs, is paused (SIGSTOP), or is down (killed, stopped,
        crashed)."""
        gw = self._need_gw()
        state = gw.state()
        if state is None or state == "Z":
            return "down"
        return "paused" if state in ("T", "t") else "running"

    def ensure_gateway(self, timeout_s: float = 30.0) -> None:
        """Make the gateway run and answer again, whatever a fault left it in: resumed if
        paused, started if down."""
        state = self.gateway_state()
        if state == "paused":
            self.resume_gateway()
        elif state == "down":
            self.start_gateway(timeout_s)

    def s3_request(
        self, method: str, path: str, body: bytes = b"", timeout_s: float = 5.0
    ) -> tuple[int, bytes]:
        """One S3 request signed with the user's keys (SigV4, path-style; ``path`` such as
        ``/bucket/key``, no query string); returns (HTTP status, body). For readiness checks
        and debugging; tests use a real client."""
        return _s3_request(
            self.port, self.access_key, self.secret_key, method, path, body, timeout_s
        )

    def close(self) -> None:
        """Stop the gateway, then the OSD, then the monitor (each SIGTERM, then SIGKILL after
        10 s), and remove ``workdir``. Raises ``RgwError`` with log tails, once the teardown
        is complete, when a daemon had died on its own before or had to be killed. Safe to
        call twice."""
        if self._closed:
            return
        crashed = self._crashed()
        tails = self._tails() if crashed else ""
        forced = self._teardown()
        if crashed:
            raise RgwError(f"daemons died on their own before close(): {crashed}\n{tails}")
        if forced:
            raise RgwError(f"close(): {forced}")

    def __enter__(self) -> RadosGateway:
        return self.start() if self._mon is None else self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # ----------------------------------------------------------------------------- start

    def _bootstrap(self, phase: _Phase, deadline: float) -> None:
        d = self.workdir
        for sub in ("mon", "osd", "run", "rgw"):
            (d / sub).mkdir(parents=True, exist_ok=True)
        self.mon_port, self.port = free_port(), self._asked_port or free_port()
        fsid, osd_uuid = str(uuid.uuid4()), str(uuid.uuid4())
        self._write_conf(fsid)
        self._write_keyrings()
        conf = str(self.conf_path)
        self._run(
            [
                self._bin["monmaptool"],
                "--create",
                "--fsid",
                fsid,
                "--addv",
                "a",
                f"[v2:127.0.0.1:{self.mon_port}]",
                str(d / "monmap"),
            ],
            deadline,
        )
        self._run(
            [
                self._bin["ceph-mon"],
                "-c",
                conf,
                "-i",
                "a",
                "--mkfs",
                "--monmap",
                str(d / "monmap"),
                "--keyring",
                str(d / "mon.keyring"),
            ],
            deadline,
        )
        phase.mark("mon_mkfs")
        self._mon = Daemon(
            "mon.a",
            [self._bin["ceph-mon"], "-c", conf, "-i", "a", "-f"],
            d / "mon.a.log",
            d / "mon.a.out",
        )
        self._mon.start()
        self._wait_listening(self._mon, self.mon_port, deadline)
        phase.mark("mon_up")
        # The OSD's mkfs needs no monitor (the fsid is in ceph.conf): it runs while the
        # monitor starts and while `ceph osd new` (a Python CLI, ~0.5 s) registers the OSD.
        osd_mkfs = subprocess.Popen(
            [
                self._bin["ceph-osd"],
                "-c",
                conf,
                "-i",
                "0",
                "--mkfs",
                "--osd-uuid",
                osd_uuid,
                "--no-mon-config",
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            preexec_fn=_die_with_parent,
            env=child_env(),
        )
        try:
            self._run(
                [
                    self._bin["ceph"],
                    "-c",
                    conf,
                    "--connect-timeout",
                    "30",
                    "osd",
                    "new",
                    osd_uuid,
                    "0",
                ],
                deadline,
            )
            phase.mark("osd_registered")
            out, _ = osd_mkfs.communicate(timeout=max(1.0, deadline - time.monotonic()))
        finally:
            if osd_mkfs.poll() is None:
                osd_mkfs.kill()
                osd_mkfs.wait()
        if osd_mkfs.returncode != 0:
            raise RgwError(f"ceph-osd --mkfs failed ({osd_mkfs.returncode}):\n{out.decode()}")
        # Ceph falls back to its default for an option value it does not know: check that
        # the OSD was made with the store asked for.
        made = (d / "osd" / "type").read_text().strip()
        if made != self.store:
            raise RgwError(f"the OSD was made with {made!r}, not {self.store!r}")
        phase.mark("osd_mkfs")
        self._osd = Daemon(
            "osd.0",
            [self._bin["ceph-osd"], "-c", conf, "-i", "0", "-f"],
            d / "osd.0.log",
            d / "osd.0.out",
        )
        self._osd.start()
        # The user first, then the gateway: radosgw-admin makes the zone and its pools (it
        # waits for the OSD to come up), so the gateway starts on a cluster with its pools
        # made instead of racing radosgw-admin to make them.
        self._run(
            [
                self._bin["radosgw-admin"],
                "-c",
                conf,
                "-n",
                "client.admin",
                "user",
                "create",
                f"--uid={USER_ID}",
                f"--display-name={USER_ID}",
                f"--access-key={self.access_key}",
                f"--secret-key={self.secret_key}",
            ],
            deadline,
        )
        phase.mark("user_created")
        self._gw = Daemon(
            "client.rgw.gw",
            [self._bin["radosgw"], "-c", conf, "-n", "client.rgw.gw", "-f"],
            d / "client.rgw.gw.log",
            d / "client.rgw.gw.out",
        )
        for attempt in range(3):
            self._gw.start()
            try:
                self._wait_s3(deadline)
                break
            except RgwError:
                # The free port picked above was taken before the gateway bound it: another
                # port (ceph.conf is only read at a daemon's start).
                # radosgw exits with the errno (EADDRINUSE, 98), and does not always get to
                # log the reason before it goes.
                taken = self._gw.exited_on_its_own() == errno.EADDRINUSE or (
                    "Address already in use" in log_tail(self._gw.out)
                )
                if attempt == 2 or self._asked_port or not taken:
                    raise
                self.port = free_port()
                self._write_conf(fsid)
        phase.mark("gateway_answers")
        # A first bucket makes the gateway create its bucket index and data pools (a second
        # or two); do it here, so the first test does not pay for it, and so start() proves
        # that a signed PUT of an object works end to end.
        warm = f"/warmup-{uuid.uuid4().hex[:12]}"
        steps = [
            ("PUT", warm, b""),
            ("PUT", f"{warm}/probe", b"probe"),
            ("DELETE", f"{warm}/probe", b""),
            ("DELETE", warm, b""),
        ]
        for method, path, body in steps:
            status, reply = self._request_until(method, path, deadline, body)
            if status >= 300:
                raise RgwError(f"warm-up {method} {path}: HTTP {status}: {reply[:500]!r}")
        phase.mark("first_put")

    def _write_conf(self, fsid: str) -> None:
        d = self.workdir
        sections: dict[str, dict[str, str]] = {
            "global": {
                "fsid": fsid,
                "mon host": f"v2:127.0.0.1:{self.mon_port}",
                "public addr": "127.0.0.1",
                "cluster addr": "127.0.0.1",
                # msgr2 only: one port for the monitor, no legacy listener.
                "ms bind msgr1": "false",
                "run dir": str(d / "run"),
                "log file": str(d / "$name.log"),
                "keyring": str(d / "$name.keyring"),
                # The CLI tools (ceph, radosgw-admin) run as short-lived clients: no admin
                # socket for them (a socket path under a deep temporary directory can pass
                # the 107-byte limit); daemons get theirs below.
                "admin socket": "",
                "auth cluster required": "cephx",
                "auth service required": "cephx",
                "auth client required": "cephx",
                "auth allow insecure global id reclaim": "false",
                # One OSD: every pool has one copy, which the monitor refuses unless told,
                # and few placement groups each (the gateway makes 7 pools; the default 32
                # each would pass the per-OSD limit, which is raised anyway).
                "osd pool default size": "1",
                "osd pool default min size": "1",
                "mon allow pool size one": "true",
                "osd pool default pg num": "8",
                "osd pool default pgp num": "8",
                "osd pool default pg autoscale mode": "off",
                "mon max pg per osd": "1000",
                "osd crush chooseleaf type": "0",
                "mon warn on pool no redundancy": "false",
                "mon data avail warn": "1",
                # A killed gateway's watches on its control objects outlive it until this
                # timeout (30 s by default); until then every metadata change (a bucket
                # deleted, say) waits for the dead watcher's answer, 30 s per change. Clients
                # ping their watches on each objecter tick (0.2 s, below), so 3 s is ample.
                "osd client watch timeout": "3",
            },
            "client": {
                # A client whose first request finds no OSD up yet (the OSD still booting)
                # asks the monitor for a newer map only on this tick: 5 s by default, which
                # was most of a bluestore start.
                "objecter tick interval": "0.2",
            },
            "mon": {
                "mon data": str(d / "mon"),
                # ceph-mon --mkfs copied mon.keyring there.
                "keyring": "$mon_data/keyring",
                # Each pool creation waits for a Paxos proposal; at the default 1 s the
                # gateway's pools alone take ~10 s to make.
                "paxos propose interval": "0.05",
                "mon allow pool delete": "true",
                "admin socket": str(d / "run" / "$name.asok"),
            },
            "osd": {
                "osd data": str(d / "osd"),
                "osd objectstore": self.store,
                # memstore: a ceiling on what the OSD accepts (memory is used as data comes).
                "memstore device bytes": str(4 << 30),
                # Outside the data directory, where mkfs puts a "block" symlink to it.
                "bluestore block path": str(d / "osd-block"),
                "bluestore block create": "true",
                "bluestore block size": str(self.bluestore_bytes),
                "bluestore cache autotune": "false",
                "bluestore cache size": str(256 << 20),
                # mkfs and mount open and close the block file a dozen times, and each close
                # waits out the aio thread's poll (250 ms by default): 2 s of a start.
                "bdev aio poll ms": "20",
                "bluestore fsck on mkfs": "false",
                "admin socket": str(d / "run" / "$name.asok"),
            },
            "client.rgw.gw": {
                "rgw frontends": f"beast endpoint=127.0.0.1:{self.port}",
                "rgw data": str(d / "rgw"),
                "debug rgw": str(self.rgw_debug),
                "admin socket": str(d / "run" / "$name.asok"),
                # No bucket lifecycle processing (nothing here sets a rule). Its threads take
                # a lock per shard in RADOS: a gateway that exits at start (its port taken)
                # leaves them locked, the next one's threads retry every 5 s, and a SIGTERM
                # then waits on them past the 10 s teardown.
                "rgw enable lc threads": "false",
            },
        }
        for section, options in self.extra_conf.items():
            sections.setdefault(section, {}).update(options)
        lines: list[str] = []
        for section, options in sections.items():
            lines.append(f"[{section}]")
            lines.extend(f"{key} = {value}" for key, value in options.items())
            lines.append("")
        self.conf_path.write_text("\n".join(lines))

    def _write_keyrings(self) -> None:
        """One keyring per entity (read by that daemon or tool through ``keyring =
        $name.keyring``), and the monitor's, which holds them all: ``ceph-mon --mkfs`` seeds
        its auth database from it, so no ``ceph auth add`` is needed later."""
        entities: dict[str, dict[str, str]] = {
            "mon.": {"mon": "allow *"},
            "client.admin": {"mon": "allow *", "osd": "allow *", "mgr": "allow *"},
            "osd.0": {"mon": "allow profile osd", "osd": "allow *", "mgr": "allow profile osd"},
            "client.rgw.gw": {"mon": "allow rw", "osd": "allow rwx", "mgr": "allow rw"},
        }
        everything: list[str] = []
        for entity, caps in entities.items():
            text = f"[{entity}]\n\tkey = {cephx_key()}\n" + "".join(
                f'\tcaps {svc} = "{cap}"\n' for svc, cap in caps.items()
            )
            everything.append(text)
            name = "mon" if entity == "mon." else entity
            path = self.workdir / f"{name}.keyring"
            path.write_text(text)
            path.chmod(0o600)
        (self.workdir / "mon.keyring").write_text("".join(everything))

    def _run(self, argv: list[str], deadline: float) -> str:
        """Run a setup command to completion within the deadline; its output, or RgwError
        with it."""
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise RgwError(f"start timed out ({self.start_timeout_s} s) before {argv[0]}")
        try:
            done = subprocess.run(
                argv,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                timeout=remaining,
                check=False,
                preexec_fn=_die_with_parent,
                env=child_env(),
            )
        except subprocess.TimeoutExpired as exc:
            raise RgwError(
                f"start timed out ({self.start_timeout_s} s) in {' '.join(argv)}"
            ) from exc
        output = (done.stdout + done.stderr).decode(errors="replace")
        if done.returncode != 0:
            raise RgwError(f"{' '.join(argv)} failed ({done.returncode}):\n{output[-3000:]}")
        return output

    def _wait_listening(self, daemon: Daemon, port: int, deadline: float) -> None:
        """Wait until ``port`` accepts a TCP connection; RgwError at once if ``daemon`` exits
        first (a port taken meanwhile, a bad config), rather than a client's long timeout."""
        while True:
            self._check_daemons()
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5):
                return
            if time.monotonic() >= deadline:
                raise RgwError(f"{daemon.name} not listening on port {port} before the deadline")
            time.sleep(0.01)

    def _check_daemons(self) -> None:
        for daemon in (self._mon, self._osd, self._gw):
            if daemon is not None and daemon.exited_on_its_own() is not None:
                raise RgwError(f"{daemon.name} exited ({daemon.exited_on_its_own()})")

    def _wait_s3(self, deadline: float) -> None:
        """Poll with a signed ListBuckets until the gateway answers 200 (it then knows the
        user), failing fast if a daemon dies."""
        self._request_until("GET", "/", deadline)

    def _request_until(
        self, method: str, path: str, deadline: float, body: bytes = b""
    ) -> tuple[int, bytes]:
        """Send the request until it gets an HTTP answer other than 5xx (connection refused
        while the gateway starts, 503 while it warms up); that answer."""
        last: str = "no attempt"
        while True:
            self._check_daemons()
            timeout = max(0.1, min(5.0, deadline - time.monotonic()))
            try:
                status, reply = self.s3_request(method, path, body, timeout)
                if status < 500:
                    return status, reply
                last = f"HTTP {status}: {reply[:200]!r}"
            except OSError as exc:
                last = repr(exc)
            if time.monotonic() >= deadline:
                raise RgwError(f"no S3 answer to {method} {path} before the deadline: {last}")
            time.sleep(0.05)

    def _wait_state(
        self, daemon: Daemon, ok: Callable[[str], bool], what: str, timeout_s: float = 5.0
    ) -> None:
        # Signals are delivered asynchronously: wait until /proc shows their effect.
        end = time.monotonic() + timeout_s
        while True:
            state = daemon.state()
            if state is None:
                raise RgwError(f"{daemon.name} is gone\n{self._tails()}")
            if ok(state):
                return
            if time.monotonic() > end:
                raise RgwError(f"{daemon.name} not {what} after {timeout_s} s (state {state})")
            time.sleep(0.005)

    def _need_gw(self) -> Daemon:
        if self._gw is None or self._closed:
            raise RgwError("the cluster is not started (or already closed)")
        return self._gw

    # -------------------------------------------------------------------------- teardown

    def _crashed(self) -> list[str]:
        """Daemons that exited without being told to, as 'name (status)'."""
        out: list[str] = []
        for daemon in (self._mon, self._osd, self._gw):
            if daemon is None:
                continue
            status = daemon.exited_on_its_own()
            if status is None or (daemon is self._gw and self._gateway_down_on_purpose):
                continue
            out.append(f"{daemon.name} ({status})")
        return out

    def _tails(self) -> str:
        parts: list[str] = []
        for daemon in (self._gw, self._osd, self._mon):
            if daemon is not None:
                parts.append(log_tail(daemon.out, 10))
                parts.append(log_tail(daemon.log))
        if not parts:
            parts.append("(no daemon was started)")
        return "\n".join(parts)

    def _teardown(self) -> str:
        """Gateway, then OSD, then monitor: the gateway's SIGTERM shutdown talks to the OSD,
        and the OSD's tells the monitor it is going (~5 s wait without one). Then remove
        ``workdir``. Returns the log tails when a daemon ignored SIGTERM and was killed (read
        before the logs go), else ''."""
        self._closed = True
        forced = [
            daemon.name
            for daemon in (self._gw, self._osd, self._mon)
            if daemon is not None and not daemon.stop(signal.SIGTERM, grace_s=10.0)
        ]
        report = f"{forced} did not exit on SIGTERM within 10 s\n{self._tails()}" if forced else ""
        if not self.keep_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)
        return report


def _s3_request(
    port: int,
    access_key: str,
    secret_key: str,
    method: str,
    path: str,
    body: bytes,
    timeout_s: float,
    region: str = REGION,
) -> tuple[int, bytes]:
    """A SigV4-signed S3 request over plain HTTP to 127.0.0.1:``port`` (the standard library
    only, so this module needs no S3 client installed)."""
    host = f"127.0.0.1:{port}"
    now = time.gmtime()
    amz_date = time.strftime("%Y%m%dT%H%M%SZ", now)
    day = amz_date[:8]
    payload_hash = hashlib.sha256(body).hexdigest()
    headers = {"host": host, "x-amz-content-sha256": payload_hash, "x-amz-date": amz_date}
    signed = ";".join(sorted(headers))
    canonical = "\n".join(
        [
            method,
            path,
            "",
            *(f"{k}:{headers[k]}" for k in sorted(headers)),
            "",
            signed,
            payload_hash,
        ]
    )
    scope = f"{day}/{region}/s3/aws4_request"
    to_sign = "\n".join(
        ["AWS4-HMAC-SHA256", amz_date, scope, hashlib.sha256(canonical.encode()).hexdigest()]
    )
    key = f"AWS4{secret_key}".encode()
    for part in (day, region, "s3", "aws4_request"):
        key = hmac.new(key, part.encode(), hashlib.sha256).digest()
    signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
    headers["authorization"] = (
        f"AWS4-HMAC-SHA256 Credential={access_key}/{scope}, SignedHeaders={signed}, "
        f"Signature={signature}"
    )
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        conn.request(method, path, body=body or None, headers=headers)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


@contextlib.contextmanager
def running_gateway(workdir: Path | str, **kwargs: object) -> Iterator[RadosGateway]:
    """``RadosGateway(workdir, **kwargs)`` started, closed on exit."""
    gw = RadosGateway(workdir, **kwargs)  # type: ignore[arg-type]
    gw.start()
    try:
        yield gw
    finally:
        gw.close()


def main(argv: list[str] | None = None) -> int:
    """``up DIR``: start a cluster in DIR, print its endpoint and keys as one JSON line, run
    until SIGINT or SIGTERM (or until a daemon dies), then tear it down."""
    parser = argparse.ArgumentParser(
        prog="python -m testsupport.rgw",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="start a one-node cluster with an S3 gateway in DIR")
    up.add_argument("dir", type=Path, help="scratch directory (missing or empty; removed after)")
    up.add_argument("--store", choices=["memstore", "bluestore"], default="memstore")
    up.add_argument("--keep", action="store_true", help="keep DIR (logs) after the teardown")
    args = parser.parse_args(argv)

    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        stop.set()

    # Handlers, not a blocked signal mask: a mask would be inherited by the daemons.
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    gw = RadosGateway(args.dir, store=args.store, keep_dir=args.keep)
    try:
        gw.start()
    except (CephNotInstalled, RgwError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(
        json.dumps(
            {
                **gw.credentials(),
                "workdir": str(gw.workdir),
                "store": gw.store,
                "conf": str(gw.conf_path),
                "start_timings_s": gw.timings,
            }
        ),
        flush=True,
    )
    status = 0
    while not stop.wait(1.0):
        crashed = gw._crashed()
        if crashed:
            print(f"error: daemons died: {crashed}", file=sys.stderr)
            status = 1
            break
    try:
        gw.close()
    except RgwError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print("torn down", file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
