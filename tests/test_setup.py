"""What `make run` / `make test` install, and the constraints that every install is held to.

The Makefile is exercised through `make -n` (which prints the commands and runs none) and, for
the torch fallback, with a stand-in pip and nvidia-smi: nothing is installed.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CONSTRAINTS = ROOT / "requirements" / "constraints.txt"
STAMPS = (".kvoffload-torch", ".kvoffload-serve", ".kvoffload-dev")

needs_make = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


def make(*args: str, path: str | None = None) -> str:
    # The Makefile's own variables as a plain run sees them (a PYTEST_ARGS given to the
    # make that runs this suite would show in every recipe).
    env = {k: v for k, v in os.environ.items() if k not in ("PYTEST_ARGS", "MAKEFLAGS")}
    if path is not None:
        env["PATH"] = path
    done = subprocess.run(
        ["make", "--no-print-directory", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(spec: str) -> str:
    match = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", spec)
    assert match, spec
    return normalize(match.group())


@needs_make
def test_run_installs_the_service_alone_and_test_the_dev_extra(tmp_path: Path) -> None:
    run = make("-n", "-B", "run", f"VENV={tmp_path}")
    assert "-c requirements/constraints.txt -e ./client -e .\n" in run
    assert "[dev]" not in run
    assert run.rstrip().endswith(f"{tmp_path}/bin/kvoffload serve")
    test = make("-n", "-B", "test", f"VENV={tmp_path}")
    assert "-c requirements/constraints.txt -e ./client -e '.[dev]'" in test


@needs_make
def test_a_venv_made_by_one_target_serves_the_other(tmp_path: Path) -> None:
    (tmp_path / "bin").mkdir()
    for stamp in STAMPS:
        (tmp_path / stamp).touch()
    # Set up by `make test`: `make run` installs nothing more.
    assert make("-n", "run", f"VENV={tmp_path}").splitlines() == [f"{tmp_path}/bin/kvoffload serve"]
    # Set up by `make run`: `make test` adds the dev extra, and nothing else.
    (tmp_path / ".kvoffload-dev").unlink()
    commands = make("-n", "test", f"VENV={tmp_path}")
    assert "-e '.[dev]'" in commands
    assert "torch" not in commands


@needs_make
def test_test_remote_adds_the_mooncake_extra_to_the_main_venv_and_requires_it(
    tmp_path: Path,
) -> None:
    (tmp_path / "bin").mkdir()
    for stamp in STAMPS:
        (tmp_path / stamp).touch()
    commands = make("-n", "test-remote", f"VENV={tmp_path}")
    assert "-c requirements/constraints.txt -e ./client -e '.[dev,mooncake]'" in commands
    assert "torch" not in commands
    assert f"KVOFFLOAD_REQUIRE_MOONCAKE=1 {tmp_path}/bin/python -m pytest tests/remote" in commands
    # Once installed, only the tests run.
    (tmp_path / ".kvoffload-mooncake").touch()
    again = make("-n", "test-remote", f"VENV={tmp_path}").strip().splitlines()
    assert again == [
        f"KVOFFLOAD_REQUIRE_MOONCAKE=1 {tmp_path}/bin/python -m pytest tests/remote "
        "tests/transfer/test_remote.py"
    ]


@needs_make
def test_an_unreachable_cpu_index_falls_back_to_the_pin_and_says_so(tmp_path: Path) -> None:
    venv, tools = tmp_path / "venv", tmp_path / "tools"
    (venv / "bin").mkdir(parents=True)
    tools.mkdir()
    log = tmp_path / "pip.log"
    # A "python" whose pip fails wherever an index is named, as when that index cannot be reached.
    python = venv / "bin" / "python"
    python.write_text(
        f'#!/bin/sh\necho "$*" >> {log}\ncase "$*" in *--index-url*) exit 1;; esac\n',
        encoding="utf-8",
    )
    nvidia_smi = tools / "nvidia-smi"
    nvidia_smi.write_text("#!/bin/sh\nexit 9\n", encoding="utf-8")  # no GPU here
    for tool in (python, nvidia_smi):
        tool.chmod(0o755)
    out = make(f"{venv}/.kvoffload-torch", f"VENV={venv}", path=f"{tools}:{os.environ['PATH']}")
    assert "FALLBACK: torch==2.13.0 from the default index" in out
    first, second = log.read_text(encoding="utf-8").splitlines()
    assert "--index-url https://download.pytorch.org/whl/cpu" in first
    assert "--retries 0" in first
    assert "--no-deps" in first
    assert second == "-m pip install -q -c requirements/constraints.txt torch==2.13.0"


def test_constraints_pin_every_service_dependency_but_torch() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    pins: dict[str, str] = {}
    for line in CONSTRAINTS.read_text(encoding="utf-8").splitlines():
        if line and not line.startswith("#"):
            match = re.fullmatch(r"([\w.-]+)==([\w.+]+)", line)
            assert match, f"not a pin: {line!r}"
            pins[normalize(match[1])] = match[2]
    assert not [n for n in pins if n in ("torch", "triton") or n.startswith("nvidia-")]
    # kvoffload-client is this repository's own (client/), installed from the checkout with it.
    wanted = {requirement_name(spec) for spec in project["dependencies"]} - {
        "torch",
        "kvoffload-client",
    }
    assert wanted - set(pins) == set()


def test_plotting_is_an_extra_that_dev_includes() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    extras = project["optional-dependencies"]
    assert "matplotlib" not in {requirement_name(s) for s in project["dependencies"]}
    assert {requirement_name(s) for s in extras["plot"]} == {"matplotlib"}
    assert "kvoffload[plot]" in extras["dev"]


def test_the_image_installs_under_the_same_constraints() -> None:
    # The image installs from the wheelhouse alone, which `make wheelhouse` fills under the
    # constraints: no index inside the build, so nothing unpinned can come in there.
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text(encoding="utf-8")
    assert "COPY build/wheelhouse /wheelhouse" in dockerfile
    assert "--no-index --find-links /wheelhouse" in dockerfile
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    wheel = next(line for line in makefile.splitlines() if "-m pip wheel" in line)
    assert "-c $(CONSTRAINTS)" in wheel
