"""What the benchmarks share: where a run's results go, and the server processes they watch.

- ``write_results(path, record)``: the run's record as indented JSON (by default a benchmark
  writes ``RESULTS_DIR / "<name>.json"``, i.e. under ``bench/results/``), and ``wrote <path>``
  on stdout; the folder is made if missing. ``machine()`` is the host description a record
  carries (CPU count, platform, Python, plus what the caller adds).
- ``free_port()``, ``stop_server(proc)``: a loopback port to start a server on, and the end of
  it (SIGTERM, then SIGKILL if it has not exited within the grace period).
- a process's memory figures and CPU time: ``testsupport.procfs`` (the tests read them too).
- ``TRACE``, ``read_trace(path, limit)``: the shipped Mooncake trace and its requests as key
  lists (``manager.replay.parse_trace``).
"""

from __future__ import annotations

import json
import os
import platform
import signal
import subprocess
from collections.abc import Awaitable, Callable, Iterator, Mapping, MutableMapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from manager.replay import parse_trace
from testsupport.ports import free_port as free_port  # the benchmarks' loopback ports

RESULTS_DIR = Path(__file__).resolve().parent / "results"
TRACE = Path(__file__).resolve().parent / "data" / "mooncake_synthetic_trace.jsonl"


def split_cores() -> tuple[set[int], set[int]]:
    """(the servers' cores, the client's): the last core for the servers, the others for the
    client; all of them for both on one core."""
    cores = sorted(os.sched_getaffinity(0))
    return ({cores[-1]}, set(cores[:-1])) if len(cores) > 1 else (set(cores), set(cores))


@contextmanager
def affinity_restored(cores: set[int]) -> Iterator[None]:
    """Run the block, then put this process back on ``cores``."""
    try:
        yield
    finally:
        os.sched_setaffinity(0, cores)


def read_trace(path: Path = TRACE, limit: int = 0) -> list[list[bytes]]:
    """The requests of the trace at ``path`` as key lists; the first ``limit`` (0: all)."""
    with path.open(encoding="utf-8") as fh:
        requests = parse_trace(fh)
    return requests[:limit] if limit else requests


def machine(**extra: Any) -> dict[str, Any]:
    """The host a run measured: ``cpus``, ``platform``, ``python``, then ``extra``."""
    return {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        **extra,
    }


def write_results(path: Path, record: Mapping[str, Any], *, quiet: bool = False) -> None:
    """Write ``record`` to ``path`` as indented JSON, making its folder if missing, and say so
    on stdout unless ``quiet`` (a run that saves partial results as it goes). Values JSON cannot
    hold are written as their ``str`` rather than failing a run at its very end."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2, default=str) + "\n")
    if not quiet:
        print(f"wrote {path}")


def stop_server(proc: subprocess.Popen[bytes], grace_s: float = 20.0) -> None:
    """End ``proc``: SIGTERM (a graceful shutdown), SIGKILL if still running after ``grace_s``;
    returns once it has exited. A process that already exited is left as it is."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def asgi_call(app: Any) -> Callable[[str, str, bytes], Awaitable[int]]:
    """``call(method, path, body)``: one request straight into the ASGI ``app`` (no socket, no
    client library: the app's own CPU), answering its status. The app's lifespan must run."""

    async def call(method: str, path: str, body: bytes = b"") -> int:
        scope = {
            "type": "http", "method": method, "path": path, "raw_path": path.encode(),
            "query_string": b"", "root_path": "", "scheme": "http", "http_version": "1.1",
            "server": ("bench", 80), "client": ("bench", 1), "app": app,
            "headers": [(b"content-type", b"application/json"),
                        (b"content-length", str(len(body)).encode())],
        }  # fmt: skip
        messages = [{"type": "http.request", "body": body, "more_body": False}]
        status = 0

        async def receive() -> MutableMapping[str, Any]:
            return messages.pop() if messages else {"type": "http.disconnect"}

        async def send(message: MutableMapping[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]

        await app(scope, receive, send)
        return status

    return call
