"""``kvoffload serve`` refusing to start: every bad setting (flag, variable, config file key),
every value the machine cannot honour (device, pool room, ports, Unix socket paths) ends with
exit status 2 and one line on stderr naming the flag and its variable (a value of the config
file: the file and its key), the value given and what is accepted; no traceback anywhere."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests import docs_blocks
from testsupport.server import ROOT


def serve(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``kvoffload serve`` on free ports (a case's own flags come last and win)."""
    return subprocess.run(
        [sys.executable, "-m", "app.cli", "serve", "--port", "0", "--admin-port", "0", *argv],
        cwd=ROOT,
        env={
            **{k: v for k, v in os.environ.items() if not k.startswith("KVOFFLOAD_")},
            **(env or {}),
        },
        capture_output=True,
        text=True,
        timeout=120,
    )


def assert_refused(run: subprocess.CompletedProcess[str], *needles: str) -> str:
    """Exit 2, one stderr line holding every needle, no traceback; the line."""
    assert run.returncode == 2, (run.returncode, run.stdout, run.stderr)
    assert "Traceback" not in run.stdout + run.stderr
    lines = run.stderr.splitlines()
    assert len(lines) == 1, run.stderr
    for needle in needles:
        assert needle in lines[0]
    return lines[0]


@pytest.fixture
def listening_port() -> Iterator[int]:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


@pytest.mark.parametrize(
    ("argv", "needles"),
    [
        (["--policy", "foo"], ["--policy / KVOFFLOAD_POLICY", "'foo'", "lru", "arc"]),
        (
            ["--policy", "slru", "--policy-param", "x=1"],
            ["--policy-param / KVOFFLOAD_POLICY_PARAMS", '{"x": 1}', "protected_ratio"],
        ),
        (["--policy-param", "p=0.5"], ["--policy-param / KVOFFLOAD_POLICY_PARAMS", "none"]),
        (["--num-blocks", "-1"], ["--num-blocks / KVOFFLOAD_NUM_BLOCKS", "'-1'", "greater than 0"]),
        (["--port", "http"], ["--port / KVOFFLOAD_PORT", "'http'", "an integer"]),
        (["--device", "gpu"], ["--device / KVOFFLOAD_DEVICE", "'gpu'", "auto, cpu"]),
        (
            ["--log-level", "loud"],
            ["--log-level / KVOFFLOAD_LOG_LEVEL", "'loud'", "accepted: debug, info"],
        ),
        (["--metrics-enabled", "maybe"], ["--metrics-enabled", "'maybe'", "true or false"]),
        (["--admin-host", "0.0.0.0"], ["--admin-host / KVOFFLOAD_ADMIN_HOST", "'0.0.0.0'"]),
        (
            ["--lease-ttl-s", "5"],
            ["--lease-ttl-s / KVOFFLOAD_LEASE_TTL_S", "5", "--job-deadline-s"],
        ),
        (["--shm-dir", "/nonexistent"], ["--shm-dir / KVOFFLOAD_SHM_DIR", "'/nonexistent'"]),
        (
            ["--num-blocks", str(1 << 40), "--block-bytes", str(1 << 20)],
            ["--num-blocks / KVOFFLOAD_NUM_BLOCKS", str(1 << 40), "at most"],
        ),
    ],
)
def test_bad_flags_are_one_line_and_exit_2(argv: list[str], needles: list[str]) -> None:
    assert_refused(serve(*argv), *needles)


def test_an_address_not_of_this_machine_is_one_line_and_exit_2(tmp_path: Path) -> None:
    # Off loopback needs a tenants file first; with one, the bind itself is what fails.
    tenants = tmp_path / "tenants.toml"
    tenants.write_text('[tenants.t]\ntokens = ["a-token-of-sixteen-chars"]\nnamespaces = ["n"]\n')
    tenants.chmod(0o600)
    run = serve("--host", "192.0.2.1", "--tenants", str(tenants))
    assert_refused(run, "--host / KVOFFLOAD_HOST", "'192.0.2.1'", "cannot listen", "127.0.0.1")


def test_a_device_the_machine_lacks_is_refused_as_device() -> None:
    missing = f"cuda:{torch.cuda.device_count()}"  # one past the last (cuda:0 without CUDA)
    line = assert_refused(serve("--device", missing), "--device / KVOFFLOAD_DEVICE", missing)
    assert "backend" not in line  # the transfer layer's parameter, never shown to the user


def test_bad_variables_and_config_keys_name_the_flag_and_variable(tmp_path: Path) -> None:
    assert_refused(
        serve(env={"KVOFFLOAD_NUM_BLOCKS": "lots"}), "--num-blocks / KVOFFLOAD_NUM_BLOCKS", "lots"
    )
    assert_refused(
        serve(env={"KVOFFLOAD_POLICY_PARAMS": "{not json"}),
        "--policy-param / KVOFFLOAD_POLICY_PARAMS",
        "{not json",
    )
    missing = tmp_path / "absent-token"
    assert_refused(
        serve(env={"KVOFFLOAD_ADMIN_TOKEN_FILE": str(missing)}),
        "--admin-token-file / KVOFFLOAD_ADMIN_TOKEN_FILE",
        str(missing),
    )
    bad_value = tmp_path / "bad-value.toml"
    bad_value.write_text('policy = "foo"\n')
    line = assert_refused(
        serve("--config", str(bad_value)),
        f"--config / KVOFFLOAD_CONFIG = '{bad_value}': key policy = 'foo': unknown policy; "
        "accepted: arc,",
    )
    assert "--policy" not in line  # the flag was never given: the file is where to look
    bad_key = tmp_path / "bad-key.toml"
    bad_key.write_text("num_blockz = 3\n")
    assert_refused(
        serve("--config", str(bad_key)),
        f"--config / KVOFFLOAD_CONFIG = '{bad_key}': unknown key 'num_blockz'; accepted:",
    )
    assert_refused(
        serve("--config", str(tmp_path / "absent.toml")),
        "--config / KVOFFLOAD_CONFIG",
        "absent.toml",
    )


def documented_refusals() -> list[str]:
    """The example refusals of docs/getting-started.md's "Command line" section, as it prints
    them."""
    section = docs_blocks.section("getting-started.md", "Command line")
    return [line for line in section.splitlines() if line.startswith("kvoffload: ")]


def test_a_bad_value_in_the_config_file_names_the_file_and_the_key(tmp_path: Path) -> None:
    """The documented example: the file and its key, never a flag that was not given; a flag or
    variable that overrides the file's value is what a refusal of it names."""
    config = tmp_path / "kv.toml"
    config.write_text("shadow_sample_rate = 1.5\nnum_blocks = 16\n")
    expected = next(line for line in documented_refusals() if "--config" in line)
    expected = expected.replace("'kv.toml'", repr(str(config)))
    assert_refused(serve("--config", str(config)), expected)
    line = assert_refused(
        serve("--config", str(config), "--shadow-sample-rate", "0"),
        "--shadow-sample-rate / KVOFFLOAD_SHADOW_SAMPLE_RATE = '0': too small;",
    )
    assert "kv.toml" not in line
    config.write_text("num_blocks = 16\n")
    line = assert_refused(
        serve(env={"KVOFFLOAD_CONFIG": str(config), "KVOFFLOAD_SHADOW_SAMPLE_RATE": "9"}),
        "--shadow-sample-rate / KVOFFLOAD_SHADOW_SAMPLE_RATE = '9': too large;",
    )
    assert "kv.toml" not in line


def test_an_out_of_range_flag_says_what_is_accepted() -> None:
    """The documented example (``--num-blocks -5``), and both sides of a two-sided range."""
    expected = next(line for line in documented_refusals() if "--num-blocks" in line)
    assert_refused(serve("--num-blocks", "-5"), expected)
    assert_refused(
        serve("--mooncake-replicas", "17"),
        "--mooncake-replicas / KVOFFLOAD_MOONCAKE_REPLICAS = '17': too large; accepted: an "
        "integer from 1 to 16",
    )


def test_busy_ports_name_the_port_and_the_listener(listening_port: int) -> None:
    engine = assert_refused(
        serve("--port", str(listening_port)), "--port / KVOFFLOAD_PORT", str(listening_port)
    )
    assert "engine listener" in engine
    assert "in use" in engine
    admin = assert_refused(
        serve("--admin-port", str(listening_port)),
        "--admin-port / KVOFFLOAD_ADMIN_PORT",
        str(listening_port),
    )
    assert "admin listener" in admin
    assert "in use" in admin


def test_unusable_unix_socket_paths_are_refused(tmp_path: Path) -> None:
    nowhere = tmp_path / "missing-dir" / "kv.sock"
    assert_refused(serve("--uds", str(nowhere)), "--uds / KVOFFLOAD_UDS", str(nowhere))
    busy = tmp_path / "busy.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.bind(str(busy))
        sock.listen()
        assert_refused(serve("--uds", str(busy)), "--uds / KVOFFLOAD_UDS", "in use")
        engine = tmp_path / "kv.sock"
        assert_refused(
            serve("--uds", str(engine), "--pool-socket", str(busy)),
            "--pool-socket / KVOFFLOAD_POOL_SOCKET",
            str(busy),
        )
        # The engine socket bound before the pool socket failed is not left behind.
        assert not engine.exists()
