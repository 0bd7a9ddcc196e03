"""The settings of engine credentials: ``tenants`` (must exist; required off loopback),
``uds_mode`` (octal from flags, env and files; owner only by default; nothing for others, no
execute bits), ``uds_group`` (resolved when the sockets are made) and ``uds_auth``."""

from __future__ import annotations

import grp
import json
import os
import socket
import stat
from pathlib import Path

import pytest

from app.cli import _build_parser, _flag_help, settings_from_args
from app.server import bind_unix, listen_unix, socket_group
from app.settings import ConfigError, Settings, load_settings


def parse_serve(*argv: str) -> Settings:
    return settings_from_args(_build_parser().parse_args(["serve", *argv]))


@pytest.fixture
def tenants_file(tmp_path: Path) -> Path:
    path = tmp_path / "tenants.toml"
    path.write_text('[tenants.a]\ntokens = ["a-token-0000000001"]\nnamespaces = ["a"]\n')
    path.chmod(0o600)
    return path


def test_defaults_are_owner_only_sockets_and_no_tenants() -> None:
    s = Settings()
    assert (s.tenants, s.uds_mode, s.uds_group, s.uds_auth) == (None, 0o600, None, "token")
    assert "(default: 0600)" in _flag_help("uds_mode")


@pytest.mark.parametrize("text", ["0660", "0o660", "660", " 0O660 "])
def test_uds_mode_is_octal_from_a_flag(text: str) -> None:
    assert parse_serve("--uds-mode", text).uds_mode == 0o660


def test_uds_mode_from_env_and_config_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVOFFLOAD_UDS_MODE", "0640")
    assert Settings().uds_mode == 0o640
    monkeypatch.delenv("KVOFFLOAD_UDS_MODE")
    toml = tmp_path / "kv.toml"
    toml.write_text("uds_mode = 0o660\n")  # a TOML octal integer
    assert Settings(config=toml).uds_mode == 0o660
    as_json = tmp_path / "kv.json"
    as_json.write_text(json.dumps({"uds_mode": "0660"}))
    assert Settings(config=as_json).uds_mode == 0o660


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        ("0644", "'0644'"),  # others may read
        ("0666", "'0666'"),
        ("0602", "'0602'"),
        ("0700", "'0700'"),  # execute
        ("0670", "'0670'"),
        ("1660", "'1660'"),  # sticky
        ("0060", "'0060'"),  # the owner could not connect
        ("0400", "'0400'"),
        ("0o777", "'0777'"),
        ("rw", "'rw'"),
        ("0680", "'0680'"),
        ("", "''"),
        ("0x1b0", "'0x1b0'"),
    ],
)
def test_bad_uds_modes_are_refused(value: str, shown: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(uds_mode=value)
    line = str(info.value)
    assert line.startswith(f"--uds-mode / KVOFFLOAD_UDS_MODE = {shown}: "), line
    assert "0600" in line


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "example.com"])
def test_an_engine_listener_off_loopback_needs_tenants(host: str, tenants_file: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(host=host)
    line = str(info.value)
    assert line.startswith(f"--host / KVOFFLOAD_HOST = {host!r}: not a loopback address")
    assert "--tenants / KVOFFLOAD_TENANTS" in line
    assert load_settings(host=host, tenants=tenants_file).tenants == tenants_file


@pytest.mark.parametrize("host", ["127.0.0.1", "127.9.9.9", "::1", "localhost"])
def test_loopback_needs_no_tenants(host: str) -> None:
    assert load_settings(host=host).tenants is None


def test_tenants_from_flag_env_and_file(
    tenants_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert parse_serve("--tenants", str(tenants_file)).tenants == tenants_file
    assert parse_serve("--tenants", str(tmp_path)).tenants == tmp_path  # a directory
    monkeypatch.setenv("KVOFFLOAD_TENANTS", str(tenants_file))
    assert Settings().tenants == tenants_file
    monkeypatch.delenv("KVOFFLOAD_TENANTS")
    config = tmp_path / "kv.toml"
    config.write_text(f'tenants = "{tenants_file}"\nhost = "0.0.0.0"\n')
    assert Settings(config=config).host == "0.0.0.0"


def test_a_missing_tenants_path_is_refused(tmp_path: Path) -> None:
    missing = tmp_path / "absent"
    with pytest.raises(ConfigError) as info:
        parse_serve("--tenants", str(missing))
    assert str(info.value).startswith(f"--tenants / KVOFFLOAD_TENANTS = {str(missing)!r}: ")
    assert "no such file or directory" in str(info.value)


def test_uds_auth_choices() -> None:
    assert parse_serve("--uds-auth", "file-mode").uds_auth == "file-mode"
    with pytest.raises(ConfigError, match="--uds-auth / KVOFFLOAD_UDS_AUTH = 'none'"):
        parse_serve("--uds-auth", "none")


# --------------------------------------------------------------------------- the sockets


def another_group() -> int | None:
    """A gid the sockets may be given that is not the one they get anyway (None: none)."""
    if os.geteuid() == 0:
        return 4242 if os.getegid() != 4242 else 4243
    return next((g for g in os.getgroups() if g != os.getegid()), None)


def test_socket_group_by_name_or_number() -> None:
    assert socket_group(Settings()) is None
    assert socket_group(Settings(uds_group="4242")) == 4242
    mine = grp.getgrgid(os.getegid()).gr_name
    assert socket_group(Settings(uds_group=mine)) == os.getegid()
    with pytest.raises(ConfigError) as info:
        socket_group(Settings(uds_group="no-such-group-kvoffload"))
    assert str(info.value).startswith(
        "--uds-group / KVOFFLOAD_UDS_GROUP = 'no-such-group-kvoffload': no such group"
    )


@pytest.mark.parametrize("mode", [0o600, 0o640, 0o660])
def test_a_socket_gets_its_mode(tmp_path: Path, mode: int) -> None:
    path = tmp_path / "s.sock"
    with bind_unix(path, mode):
        assert stat.S_IMODE(path.stat().st_mode) == mode


def test_a_socket_gets_its_group(tmp_path: Path) -> None:
    gid = another_group()
    if gid is None:
        pytest.skip("the user has one group only")
    path = tmp_path / "s.sock"
    settings = Settings(uds_mode=0o660, uds_group=str(gid))
    with listen_unix(settings, path, "uds", "engine listener"):
        assert (stat.S_IMODE(path.stat().st_mode), path.stat().st_gid) == (0o660, gid)


def test_a_group_that_cannot_be_given_is_refused_and_leaves_no_socket(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(path: object, uid: int, gid: int) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "chown", refuse)
    path = tmp_path / "s.sock"
    with pytest.raises(ConfigError) as info:
        listen_unix(Settings(uds_group="4242"), path, "uds", "engine listener")
    assert str(info.value).startswith("--uds-group / KVOFFLOAD_UDS_GROUP = '4242': cannot give")
    assert "Operation not permitted" in str(info.value)
    assert not path.exists()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.bind(str(path))  # the path is free again
