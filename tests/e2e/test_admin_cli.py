"""``kvoffload admin`` against a real server: the token from every source the server reads it
from, output as JSON in a pipe or a table, refused policy parameters listed in one line, a
closed pipe ending the command quietly; and ``kvoffload --version``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from app import package_version
from testsupport.server import ROOT, TOKEN, ServerProcess

CLI = [sys.executable, "-m", "app.cli"]


def clean_env(**extra: str) -> dict[str, str]:
    return {
        **{k: v for k, v in os.environ.items() if not k.startswith("KVOFFLOAD_")},
        **extra,
    }


def admin(
    server: ServerProcess, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, "admin", "--url", server.admin_url, *args],
        cwd=ROOT,
        env=env if env is not None else clean_env(KVOFFLOAD_ADMIN_TOKEN=TOKEN),
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "admin-token"
    path.write_text(TOKEN + "\n")
    path.chmod(0o600)
    return path


def test_the_token_comes_from_every_source_the_server_reads(
    server: ServerProcess, token_file: Path, tmp_path: Path
) -> None:
    anonymous = admin(server, "policy", "get", env=clean_env())
    assert anonymous.returncode == 1
    assert "401" in anonymous.stderr

    from_file_var = admin(
        server, "policy", "get", env=clean_env(KVOFFLOAD_ADMIN_TOKEN_FILE=str(token_file))
    )
    assert from_file_var.returncode == 0, from_file_var.stderr
    assert json.loads(from_file_var.stdout)["name"]

    config = tmp_path / "kvoffload.toml"
    config.write_text(f'admin_token_file = "{token_file}"\nnum_blocks = 64\n')
    from_config = admin(server, "stats", env=clean_env(KVOFFLOAD_CONFIG=str(config)))
    assert from_config.returncode == 0, from_config.stderr

    from_flag = admin(server, "--admin-token-file", str(token_file), "stats", env=clean_env())
    assert from_flag.returncode == 0, from_flag.stderr

    wrong = tmp_path / "wrong-token"
    wrong.write_text("nope")
    wrong.chmod(0o600)
    flag_wins = admin(
        server,
        "--admin-token-file",
        str(wrong),
        "stats",
        env=clean_env(KVOFFLOAD_ADMIN_TOKEN_FILE=str(token_file)),
    )
    assert flag_wins.returncode == 1
    assert "403" in flag_wins.stderr

    unreadable = admin(
        server, "stats", env=clean_env(KVOFFLOAD_ADMIN_TOKEN_FILE=str(tmp_path / "absent"))
    )
    assert unreadable.returncode == 2
    assert unreadable.stderr.splitlines() == [unreadable.stderr.strip()]
    assert "KVOFFLOAD_ADMIN_TOKEN_FILE" in unreadable.stderr


def test_json_in_a_pipe_a_table_when_asked(server: ServerProcess) -> None:
    piped = admin(server, "policy", "get")
    assert piped.returncode == 0, piped.stderr
    policy = json.loads(piped.stdout)
    assert admin(server, "--json", "policy", "get").stdout == piped.stdout

    table = admin(server, "--table", "policy", "get")
    assert table.returncode == 0, table.stderr
    rows = {line.split()[0]: line.split(None, 1)[1] for line in table.stdout.splitlines()}
    assert rows["name"] == policy["name"]
    assert rows["generation"] == str(policy["generation"])
    assert rows["available"] == ", ".join(policy["available"])

    shadow = admin(server, "--table", "policy", "shadow")
    assert shadow.returncode == 0, shadow.stderr
    header = next(line for line in shadow.stdout.splitlines() if line.startswith("policy "))
    assert header.split()[:2] == ["policy", "active"]


def test_unknown_policy_parameter_lists_the_valid_ones(server: ServerProcess) -> None:
    refused = admin(server, "policy", "set", "slru", "--param", "x=1")
    assert refused.returncode == 1
    (line,) = refused.stderr.splitlines()
    assert "422 invalid_policy_params" in line
    assert "protected_ratio" in line


def test_a_closed_pipe_ends_the_command_quietly(server: ServerProcess, tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"hash_ids": [1, 2, 3]}\n{"hash_ids": [1, 2, 4]}\n' * 50)
    commands = [
        [*CLI, "admin", "--url", server.admin_url, "--table", "stats"],
        [*CLI, "replay", str(trace), "--capacity", "2,4,8"],
    ]
    for argv in commands:
        proc = subprocess.Popen(
            argv,
            cwd=ROOT,
            env=clean_env(KVOFFLOAD_ADMIN_TOKEN=TOKEN),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        assert proc.stdout is not None
        proc.stdout.close()  # the reader is gone before the command writes (like `| head -0`)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 141, err
        assert err == b""


def test_version_comes_from_the_package() -> None:
    run = subprocess.run(
        [*CLI, "--version"], cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 0
    assert run.stdout.strip() == f"kvoffload {package_version()}"


def test_a_refused_token_names_where_the_cli_reads_it(server: ServerProcess) -> None:
    anonymous = admin(server, "stats", env=clean_env())
    assert anonymous.returncode == 1
    assert "401 unauthorized" in anonymous.stderr
    assert "--admin-token-file PATH" in anonymous.stderr
    assert "KVOFFLOAD_ADMIN_TOKEN" in anonymous.stderr


def test_clear_asks_first_and_without_a_terminal_needs_yes(server: ServerProcess) -> None:
    """``admin clear`` cannot be undone: in a pipe it refuses without ``--yes`` and drops
    nothing; with ``--yes`` it answers the counts. (At a terminal it asks; no test drives a
    terminal here.)"""
    import httpx

    auth = {"authorization": f"Bearer {TOKEN}"}
    httpx.put(f"{server.url}/v1/requests/cli-clear", json={}, timeout=10).raise_for_status()
    keys = {"keys": ["c1ea"]}
    for step in ("prepare-store", "complete-store"):
        r = httpx.post(f"{server.url}/v1/requests/cli-clear/{step}", json=keys, timeout=10)
        r.raise_for_status()
    refused = admin(server, "clear")
    assert refused.returncode == 2
    assert "pass --yes" in refused.stderr
    ready = httpx.get(f"{server.admin_url}/admin/v1/stats", headers=auth, timeout=10)
    assert ready.json()["blocks"]["ready"] >= 1
    done = admin(server, "clear", "--yes")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["dropped"] >= 1
    ready = httpx.get(f"{server.admin_url}/admin/v1/stats", headers=auth, timeout=10)
    assert ready.json()["blocks"]["ready"] == 0


def test_a_missing_namespace_names_the_flag() -> None:
    from types import SimpleNamespace

    from app.cli import _hint

    missing = SimpleNamespace(
        status=422,
        code="invalid_field",
        message="query: namespace: required, this service has tenants (namespaces: a1, b1)",
    )
    assert "--namespace NAME" in _hint(missing)
    assert _hint(SimpleNamespace(status=404, code="unknown_namespace", message="x")) == ""
