"""``kvoffload serve`` nodes with a Mooncake remote tier, one per test host.

``ServeNode`` starts ``python -m app.cli serve`` inside a test host (``tests.remote.hosts``):
a CPU pool, ``--remote-tier mooncake`` at the given master, its segment reachable on the host's
address. The engine and admin APIs listen on 127.0.0.1 *inside the host's namespace* (no
tenants needed, nothing reachable from another host but Mooncake's own traffic), so every
engine call is made by ``tests.remote.engine``, a stand-in engine running in the same
namespace, driven over its stdin and stdout. On a loopback net (not root) every node gets free
ports instead.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tests.remote.hosts import ROOT, Host, MooncakeMaster, pick_port

ADMIN_TOKEN = "remote-e2e-admin-token"
_serial = itertools.count()


class ServeError(AssertionError):
    """The engine's call was refused (``status``, ``code``) or could not reach the node."""

    def __init__(self, error: dict[str, Any]) -> None:
        super().__init__(f"engine call failed: {error}")
        self.status: int | None = error.get("status")
        self.code: str | None = error.get("code")


class ServeNode:
    """A ``kvoffload serve`` process and its stand-in engine on one test host."""

    def __init__(
        self,
        host: Host,
        master: MooncakeMaster,
        workdir: Path,
        *,
        block_bytes: int = 64 << 10,
        num_blocks: int = 32,
        segment_bytes: int = 32 << 20,
        replicas: int = 1,
        remote_timeout_s: float = 2.0,
        extra: Sequence[str] = (),
    ) -> None:
        self.host = host
        self.block_bytes = block_bytes
        n = next(_serial)
        self.log_path = workdir / f"serve-{host.name}-{n}.log"
        self.engine_log = workdir / f"engine-{host.name}-{n}.log"
        # Short: a Unix socket's path is limited to 107 bytes.
        self._sockdir = tempfile.mkdtemp(prefix="kvr")
        port, admin_port = pick_port(host, 8000), pick_port(host, 8001)
        argv = [
            sys.executable,
            "-m",
            "app.cli",
            "serve",
            "--host=127.0.0.1",
            f"--port={port}",
            "--admin-host=127.0.0.1",
            f"--admin-port={admin_port}",
            f"--pool-socket={self._sockdir}/pool",
            "--device=cpu",
            f"--num-blocks={num_blocks}",
            f"--block-bytes={block_bytes}",
            "--log-level=info",
            "--remote-tier=mooncake",
            f"--mooncake-master={master.address}",
            f"--mooncake-metadata={master.metadata_url}",
            f"--mooncake-local-hostname={host.addr}",
            f"--mooncake-segment-bytes={segment_bytes}",
            f"--mooncake-replicas={replicas}",
            f"--remote-timeout-s={remote_timeout_s}",
            *extra,
        ]
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("KVOFFLOAD_")},
            "KVOFFLOAD_ADMIN_TOKEN": ADMIN_TOKEN,
            "PYTHONPATH": str(ROOT),
        }
        log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            host.argv(argv), cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
        )
        log.close()
        self.engine: subprocess.Popen[bytes] | None = None
        try:
            config = {
                "url": f"http://127.0.0.1:{port}",
                "admin_url": f"http://127.0.0.1:{admin_port}",
                "admin_token": ADMIN_TOKEN,
                "pool_socket": f"{self._sockdir}/pool",
                "wait_s": 90,
            }
            elog = self.engine_log.open("wb")
            self.engine = subprocess.Popen(
                host.argv([sys.executable, "-m", "tests.remote.engine", json.dumps(config)]),
                cwd=ROOT,
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=elog,
            )
            elog.close()
            self.ready = self._reply(timeout_s=120)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ the engine's calls

    def _reply(self, timeout_s: float) -> dict[str, Any]:
        assert self.engine is not None
        assert self.engine.stdout is not None
        with selectors.DefaultSelector() as sel:
            sel.register(self.engine.stdout, selectors.EVENT_READ)
            if not sel.select(timeout_s):
                raise AssertionError(f"engine on {self.host.name}: no answer in {timeout_s} s")
        line = self.engine.stdout.readline()
        if not line:
            raise AssertionError(
                f"engine on {self.host.name} exited ({self.engine.poll()}): "
                f"{self.engine_log.read_text(errors='replace')[-2000:]}\n"
                f"serve log: {self.log()[-3000:]}"
            )
        reply: dict[str, Any] = json.loads(line)
        return reply

    def ask(self, op: str, timeout_s: float = 60.0, **args: Any) -> dict[str, Any]:
        """One command to the engine; ``ServeError`` when the service refused it."""
        assert self.engine is not None
        assert self.engine.stdin is not None
        self.engine.stdin.write(json.dumps({"op": op, **args}).encode() + b"\n")
        self.engine.stdin.flush()
        reply = self._reply(timeout_s)
        if "error" in reply:
            raise ServeError(reply["error"])
        return reply

    def store(self, req: str, keys: Sequence[bytes], data: Sequence[bytes]) -> list[bytes]:
        """prepare-store, write the blocks into the planned slots, complete-store; the keys
        stored."""
        blocks = [base64.b64encode(b).decode() for b in data]
        reply = self.ask("store", req=req, keys=[k.hex() for k in keys], data=blocks)
        return [bytes.fromhex(k) for k in reply["stored"]]

    def lookup(self, req: str, keys: Sequence[bytes]) -> list[str]:
        results: list[str] = self.ask("lookup", req=req, keys=[k.hex() for k in keys])["results"]
        return results

    def prepare_load(self, req: str, keys: Sequence[bytes]) -> list[int]:
        slots: list[int] = self.ask("prepare_load", req=req, keys=[k.hex() for k in keys])["slots"]
        return slots

    def complete_load(self, req: str, keys: Sequence[bytes]) -> None:
        self.ask("complete_load", req=req, keys=[k.hex() for k in keys])

    def read(self, slots: Sequence[int]) -> list[bytes]:
        return [base64.b64decode(d) for d in self.ask("read", slots=list(slots))["data"]]

    def finish(self, req: str) -> None:
        self.ask("finish", req=req)

    def remote(self) -> dict[str, Any]:
        """The ``remote`` section of ``/admin/v1/stats``."""
        section: dict[str, Any] = self.ask("stats")["tiers"]["remote"]
        return section

    def stats(self) -> dict[str, Any]:
        return self.ask("stats")

    def live_requests(self) -> dict[str, Any]:
        """``/admin/v1/requests``'s entries by request id."""
        return {r["req_id"]: r for r in self.ask("requests")["requests"]}

    def readyz(self) -> dict[str, Any]:
        return self.ask("readyz")

    def events(self, after: int = 0) -> dict[str, Any]:
        return self.ask("events", after=after)

    # ------------------------------------------------------------------ lifecycle

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL the service (its engine stays, its calls then fail)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(20)

    def close(self) -> None:
        """End the engine, then SIGTERM the service (SIGKILL after 20 s); also after a failure."""
        engine = self.engine
        if engine is not None:
            if engine.poll() is None:
                with contextlib.suppress(Exception):
                    self.ask("close", timeout_s=10)
                try:
                    engine.wait(10)
                except subprocess.TimeoutExpired:
                    engine.kill()
                    engine.wait(10)
            for stream in (engine.stdin, engine.stdout):
                if stream is not None:
                    stream.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.kill()
        with contextlib.suppress(OSError):
            for name in os.listdir(self._sockdir):
                os.unlink(os.path.join(self._sockdir, name))
            os.rmdir(self._sockdir)
