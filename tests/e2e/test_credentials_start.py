"""``kvoffload serve`` and engine credentials at start: an engine listener off loopback without
a tenants file is refused before anything is bound (exit 2, one line naming ``--tenants``), a
tenants file that cannot be used takes the same way out, and the Unix sockets get the file mode
and group asked for."""

from __future__ import annotations

import errno
import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from testsupport.server import ROOT, ServerProcess


def refused_line(run: subprocess.CompletedProcess[str]) -> str:
    """Exit 2, no traceback, one line on stderr: that line."""
    assert run.returncode == 2, (run.returncode, run.stdout, run.stderr)
    assert "Traceback" not in run.stdout + run.stderr
    lines = run.stderr.splitlines()
    assert len(lines) == 1, run.stderr
    return lines[0]


def test_an_engine_listener_off_loopback_without_tenants_is_refused_before_binding(
    tmp_path: Path,
) -> None:
    srv = ServerProcess(tmp_path, "--host", "0.0.0.0")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        # The port is busy on loopback: a server that tried to bind 0.0.0.0 there would be
        # refused as "in use" (checked here without listening), so a refusal naming --tenants
        # came before any bind.
        held.bind(("127.0.0.1", srv.port))
        held.listen()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            with pytest.raises(OSError, match="in use") as busy:
                probe.bind(("0.0.0.0", srv.port))
            assert busy.value.errno == errno.EADDRINUSE
        run = subprocess.run(
            srv.argv, cwd=ROOT, env=srv.env, capture_output=True, text=True, timeout=120
        )
    line = refused_line(run)
    assert line.startswith("kvoffload: --host / KVOFFLOAD_HOST = '0.0.0.0': ")
    assert "--tenants / KVOFFLOAD_TENANTS" in line
    assert "in use" not in line
    assert not srv.uds.exists()  # the Unix socket, bound after the TCP one, was never made


def test_an_unusable_tenants_file_inside_serve_is_one_line_and_exit_2(tmp_path: Path) -> None:
    """The lead's wiring calls ``load_credentials`` first thing in ``serve``; stand in for it
    there and check its refusal leaves the way a ``ConfigError`` does."""
    tenants = tmp_path / "tenants.toml"
    token = "a-secret-token-0000000001"
    tenants.write_text(f'[tenants.a]\ntokens = ["{token}"]\nnamespaces = ["a"]\n')
    tenants.chmod(0o644)  # readable by others: refused
    srv = ServerProcess(tmp_path, "--tenants", str(tenants))
    code = (
        "import sys, app.server\n"
        "from app.cli import main\n"
        "from app.core.tenants import load_credentials\n"
        "app.server.check_machine = load_credentials\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", code, *srv.argv[3:]],
        cwd=ROOT,
        env=srv.env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    line = refused_line(run)
    assert line.startswith(f"kvoffload: --tenants / KVOFFLOAD_TENANTS = {str(tenants)!r}: ")
    assert "readable by others" in line
    assert token not in run.stdout + run.stderr


def test_an_unknown_socket_group_is_refused(tmp_path: Path) -> None:
    srv = ServerProcess(tmp_path, "--uds-group", "no-such-group-kvoffload")
    run = subprocess.run(
        srv.argv, cwd=ROOT, env=srv.env, capture_output=True, text=True, timeout=120
    )
    line = refused_line(run)
    assert "--uds-group / KVOFFLOAD_UDS_GROUP = 'no-such-group-kvoffload'" in line
    assert not srv.uds.exists()


def another_group() -> int | None:
    """A gid the sockets would not get by themselves (None: the user has no other)."""
    if os.geteuid() == 0:
        return 4242 if os.getegid() != 4242 else 4243
    return next((g for g in os.getgroups() if g != os.getegid()), None)


@pytest.mark.parametrize("mode", ["0600", "0660"])
def test_the_unix_sockets_get_the_mode_and_group(tmp_path: Path, mode: str) -> None:
    extra = ["--uds-mode", mode]
    gid = another_group() if mode == "0660" else None
    if gid is not None:
        extra += ["--uds-group", str(gid)]
    srv = ServerProcess(tmp_path, *extra)
    with srv.serving():
        for path in (srv.uds, Path(f"{srv.uds}.pool")):
            st = path.stat()
            assert stat.S_ISSOCK(st.st_mode)
            assert f"{stat.S_IMODE(st.st_mode):04o}" == mode, path
            if gid is not None:
                assert st.st_gid == gid, path
