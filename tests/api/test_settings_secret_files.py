"""Files holding a secret are refused at start when others may read them (#42.8): the
``--config`` file holding a token, the object tier's MAC key file, as the token files are."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.cli import main
from app.settings import AdminAuth, ConfigError, load_or_refuse, load_settings


def _file(path: Path, text: str, mode: int) -> Path:
    path.write_text(text)
    path.chmod(mode)
    return path


@pytest.mark.parametrize("key", ["admin_token", "metrics_token"])
def test_a_config_file_others_can_read_holding_a_token_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], key: str
) -> None:
    config = _file(tmp_path / "kv.toml", f'{key} = "s3cret-of-the-file"\n', 0o644)
    assert main(["serve", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert f"--config / KVOFFLOAD_CONFIG = '{config}'" in err
    assert f"mode 0644); it holds a secret ({key})" in err
    assert f"accepted: chmod 600 {config}" in err
    assert "s3cret-of-the-file" not in err
    config.chmod(0o600)
    assert load_settings(config=config).model_dump()[key].get_secret_value() == (
        "s3cret-of-the-file"
    )


def test_the_admin_command_refuses_the_same_config_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = _file(tmp_path / "kv.json", '{"admin_token": "s3cret-of-the-file"}', 0o604)
    monkeypatch.setenv("KVOFFLOAD_CONFIG", str(config))
    with pytest.raises(ConfigError, match="mode 0604"):
        load_or_refuse(AdminAuth)
    config.chmod(0o640)  # a group may share it, as a token file
    assert load_or_refuse(AdminAuth).admin_token_value() == "s3cret-of-the-file"


def test_a_config_file_without_a_secret_may_be_read_by_anyone(tmp_path: Path) -> None:
    config = _file(tmp_path / "kv.toml", "num_blocks = 64\n", 0o644)
    assert load_settings(config=config).num_blocks == 64


@pytest.mark.parametrize("mode", [0o644, 0o604, 0o602])
def test_an_object_mac_key_file_others_can_read_or_write_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], mode: int
) -> None:
    key = _file(tmp_path / "mac-key", "k" * 64 + "\n", mode)
    argv = ["serve", "--object-bucket", "kv-cache", "--object-mac-key-file", str(key)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert f"--object-mac-key-file / KVOFFLOAD_OBJECT_MAC_KEY_FILE = '{key}'" in err
    assert f"(mode {mode:04o}); it holds a secret; accepted: chmod 600 {key}" in err
    assert "k" * 64 not in err
    key.chmod(0o640)
    assert (
        load_settings(object_bucket="kv-cache", object_mac_key_file=key).object_mac_key_file == key
    )


def test_a_token_file_refusal_names_the_chmod(tmp_path: Path) -> None:
    token = _file(tmp_path / "token", "t0ken-0123456789\n", 0o644)
    with pytest.raises(ConfigError, match=f"accepted: chmod 600 {token}"):
        load_settings(metrics_token_file=token)
