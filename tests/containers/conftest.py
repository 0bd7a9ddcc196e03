"""The image and the compose files of deploy/, run for real in Docker (``make test-deploy``).

Collected only with ``KVOFFLOAD_DEPLOY_TESTS=1`` (``make test-deploy`` sets it): they build an
image and start containers, which ``make test`` must not do behind a developer's back. With it,
a missing Docker engine, compose, wheelhouse or ``prometheus`` is an error, never a skip.

The session builds the image from the wheelhouse (``make wheelhouse``) on the base image
(``KVOFFLOAD_BASE_IMAGE``, by default the debootstrap one ``make base-image`` makes), timed, then
each module brings its stack up, runs engines against it and tears it down with its volumes.
What was measured is printed at the end and written to build/test-deploy.json.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from types import ModuleType

import pytest

from tests.containers.stack import (
    COMPOSE_V1,
    COMPOSE_V2,
    REPORT,
    REPORT_FILE,
    ROOT,
    compose_version,
    cpu_engine,
    run,
)

if os.environ.get("KVOFFLOAD_DEPLOY_TESTS") != "1":
    collect_ignore_glob = ["test_*.py"]

IMAGE = os.environ.get("KVOFFLOAD_IMAGE", "kvoffload:local")
BASE_IMAGE = os.environ.get("KVOFFLOAD_BASE_IMAGE", "kvoffload-base:bookworm")
WHEELHOUSE = ROOT / "build" / "wheelhouse"


def pytest_report_header() -> str:
    if os.environ.get("KVOFFLOAD_DEPLOY_TESTS") != "1":
        return "deploy tests in containers: off (make test-deploy runs them)"
    return f"deploy tests in containers: image {IMAGE} on {BASE_IMAGE}"


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not REPORT.entries:
        return
    terminalreporter.section("make test-deploy: what was measured")
    for key, value in REPORT.entries.items():
        terminalreporter.write_line(f"{key}: {value}")
    terminalreporter.write_line(f"(also in {REPORT_FILE.relative_to(ROOT)})")


@pytest.fixture(scope="session")
def image() -> str:
    """The service's image, built now from the wheelhouse (what ``make image`` runs), timed."""
    run(["docker", "info"], timeout=30)
    assert (WHEELHOUSE / "PYTHON").is_file(), "no wheelhouse: run `make wheelhouse` first"
    run(["docker", "image", "inspect", BASE_IMAGE], timeout=30)
    for compose in (COMPOSE_V2, COMPOSE_V1):
        REPORT.record(f"compose {' '.join(compose)}", compose_version(compose))
    REPORT.record("docker engine", run(["docker", "version", "-f", "{{.Server.Version}}"]).strip())
    started = time.monotonic()
    out = run(
        [
            "docker",
            "build",
            # Nothing inside the build may reach a registry or an index.
            "--network=none",
            "-f",
            "deploy/Dockerfile",
            "--build-arg",
            f"BASE_IMAGE={BASE_IMAGE}",
            "-t",
            IMAGE,
            ".",
        ],
        cwd=ROOT,
        timeout=600,
    )
    seconds = time.monotonic() - started
    context = next(
        (ln.split("daemon", 1)[1].strip() for ln in out.splitlines() if "build context" in ln),
        "?",
    )
    size = int(run(["docker", "image", "inspect", "-f", "{{.Size}}", IMAGE]).strip())
    REPORT.record("image build from the wheelhouse (s)", round(seconds, 1))
    REPORT.record("build context sent", context)
    REPORT.record("image size (MB)", round(size / 1e6))
    return IMAGE


@pytest.fixture(scope="session")
def engine_module() -> ModuleType:
    """deploy/tools/cpu_engine.py, for engines on the host."""
    return cpu_engine()


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("deploy")
