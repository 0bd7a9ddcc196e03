"""A real ``kvoffload serve`` process on 127.0.0.1 (free ports, token in the environment).

``ServerProcess.start`` launches it with a small CPU pool and waits for ``/readyz``;
``stop`` sends SIGTERM and returns the exit status. The session fixture ``server``
(``tests/e2e/conftest.py``) is shared by the e2e tests; tests that need their own process
(shutdown) start one. The benchmarks that measure a real server start theirs with it too.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TypeVar

import httpx

from testsupport.ports import free_port

TOKEN = "e2e-admin-token"
ROOT = Path(__file__).resolve().parents[1]
T = TypeVar("T")


class ServerProcess:
    """One ``kvoffload serve`` subprocess and its addresses."""

    def __init__(
        self,
        workdir: Path,
        *extra: str,
        env: dict[str, str] | None = None,
        wrapper: Sequence[str] = (),
    ) -> None:
        """``wrapper``: a command line the service runs under (``prlimit ... --``, ``setpriv
        ...``), before its own."""
        self.port = free_port()
        self.admin_port = free_port()
        self.uds = workdir / "kv.sock"
        self.log_path = workdir / f"serve-{self.port}.log"
        self.url = f"http://127.0.0.1:{self.port}"
        self.admin_url = f"http://127.0.0.1:{self.admin_port}"
        self.argv = [
            *wrapper,
            sys.executable,
            "-m",
            "app.cli",
            "serve",
            "--port",
            str(self.port),
            "--admin-port",
            str(self.admin_port),
            "--uds",
            str(self.uds),
            "--num-blocks",
            "256",
            "--block-bytes",
            "4096",
            "--device",
            "cpu",
            "--log-level",
            "warning",
            *extra,
        ]
        self.env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("KVOFFLOAD_")},
            "KVOFFLOAD_ADMIN_TOKEN": TOKEN,
            **(env or {}),
        }
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 60.0) -> ServerProcess:
        """Launch and wait until ``/readyz`` answers 200."""
        log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            self.argv, cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT
        )
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvoffload serve exited early:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/readyz", timeout=1).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        self.kill()
        raise RuntimeError(f"kvoffload serve not ready after {timeout}s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    @contextlib.contextmanager
    def serving(self) -> Iterator[ServerProcess]:
        """Start the server, yield it, stop it; a non-zero exit fails with the server's log."""
        self.start()
        try:
            yield self
        finally:
            status = self.stop()
        assert status == 0, self.log()

    def stop(self, timeout: float = 20.0) -> int:
        """SIGTERM, then the exit status (kills and fails if it does not exit in time)."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"no exit {timeout}s after SIGTERM:\n{self.log()}") from None

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
