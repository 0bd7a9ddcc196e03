"""The Unix sockets' directory and mode (issue #42, finding 9): a socket directory that others
can write is refused as a ``--disk-dir`` would be (they could swap in a socket of their own and
take the next engine's token and namespace), and the socket's mode and group are set through a
descriptor, never through a path a symbolic link could be planted at."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

import app.server as server
from app.server import bind_unix, listen_unix
from app.settings import ConfigError, Settings
from testsupport.server import ROOT


def plant_link(path: Path, target: Path) -> None:
    """Replace whatever is at ``path`` with a symbolic link to ``target``, as an attacker with
    write access to the directory would."""
    tmp = path.with_name(path.name + ".planted")
    os.symlink(target, tmp)
    os.replace(tmp, path)


@pytest.fixture
def target(tmp_path: Path) -> Path:
    victim = tmp_path / "victim.txt"
    victim.write_text("not the service's")
    os.chmod(victim, 0o644)
    return victim


def test_a_link_planted_before_chmod_runs_is_not_followed(
    tmp_path: Path, target: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The link lands between the bind and the chmod's effect (inside ``os.chmod``): the
    chmod reaches the socket it holds, never the link's target."""
    path = tmp_path / "s.sock"
    real_chmod = os.chmod

    def chmod_after_the_swap(where: object, mode: int, **kwargs: object) -> None:
        if not os.path.islink(path):
            plant_link(path, target)
        real_chmod(where, mode, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "chmod", chmod_after_the_swap)
    with bind_unix(path, 0o660):
        pass
    assert os.path.islink(path)  # the planted link is left alone, not removed
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o644
    assert target.read_text() == "not the service's"


def test_a_link_planted_in_the_socket_s_place_is_refused(
    tmp_path: Path, target: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "s.sock"
    set_mode = server._set_mode

    def swapped_first(directory: int, name: str, where: Path, mode: int, gid: int | None) -> None:
        plant_link(path, target)
        set_mode(directory, name, where, mode, gid)

    monkeypatch.setattr(server, "_set_mode", swapped_first)
    with pytest.raises(ConfigError) as info:
        listen_unix(Settings(uds_mode=0o660), path, "uds", "engine listener")
    assert "was replaced by something that is not a socket" in str(info.value)
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o644


@pytest.mark.parametrize(
    ("mode", "who"),
    [(0o777, "its group and others"), (0o1777, "its group and others"), (0o770, "its group")],
)
def test_a_socket_directory_others_can_write_is_refused(
    tmp_path: Path, mode: int, who: str
) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, mode)
    path = shared / "kv.sock"
    with pytest.raises(ConfigError) as info:
        listen_unix(Settings(), path, "uds", "engine listener")
    message = str(info.value)
    assert message.startswith(f"--uds / KVOFFLOAD_UDS = {str(path)!r}: {shared} is writable by")
    assert f"writable by {who} (mode {mode:04o})" in message
    assert "take the next engine's token and namespace" in message
    assert f"fix: chmod go-w {shared}" in message
    assert "\n" not in message
    assert not path.exists()  # nothing bound


def test_a_socket_directory_only_the_service_writes_is_taken(tmp_path: Path) -> None:
    own = tmp_path / "run"
    own.mkdir()
    os.chmod(own, 0o755)
    with listen_unix(Settings(uds_mode=0o660), own / "kv.sock", "uds", "engine listener"):
        assert stat.S_IMODE(os.stat(own / "kv.sock").st_mode) == 0o660


def test_serve_refuses_a_uds_in_a_directory_others_can_write(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    argv = ["serve", "--port", "0", "--admin-port", "0", "--device", "cpu", "--num-blocks", "16"]
    run = subprocess.run(
        [sys.executable, "-m", "app.cli", *argv, "--uds", str(shared / "kv.sock")],
        cwd=ROOT,
        env={k: v for k, v in os.environ.items() if not k.startswith("KVOFFLOAD_")},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert run.returncode == 2, (run.stdout, run.stderr)
    lines = run.stderr.splitlines()
    assert len(lines) == 1, run.stderr
    assert lines[0].startswith(
        f"kvoffload: --uds / KVOFFLOAD_UDS = '{shared}/kv.sock': {shared} is"
    )
    assert f"fix: chmod go-w {shared}" in lines[0]
    assert not (shared / "kv.sock").exists()
