"""A real Prometheus (Debian's ``prometheus`` package) for end-to-end metric tests: started on a
free loopback port with a scrape config of the test's, stopped (then killed) at the end."""

from __future__ import annotations

import shutil
import signal
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from testsupport.polling import until
from testsupport.ports import free_port

PROMETHEUS = shutil.which("prometheus")


@contextmanager
def running_prometheus(workdir: Path, scrape_config: str, ready_within_s: float) -> Iterator[str]:
    """Prometheus with ``scrape_config`` (the YAML of its configuration file) and exemplar
    storage on, its data and log under ``workdir``; its base URL once it answers ready (an
    AssertionError after ``ready_within_s``)."""
    assert PROMETHEUS is not None, "no prometheus binary (apt-get install prometheus)"
    workdir.mkdir(parents=True, exist_ok=True)
    config = workdir / "prometheus.yml"
    config.write_text(scrape_config, encoding="utf-8")
    port = free_port()
    with (workdir / "prometheus.log").open("wb") as log:
        proc = subprocess.Popen(
            [
                PROMETHEUS,
                f"--config.file={config}",
                f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--enable-feature=exemplar-storage",
                "--log.level=warn",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        until(
            "Prometheus ready",
            lambda: True if httpx.get(f"{url}/-/ready", timeout=1).status_code == 200 else None,
            ready_within_s,
        )
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
