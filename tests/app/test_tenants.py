"""``app.core.tenants``: the tenants file or directory (every refusal one line naming the file
and tenant, never a token), the tokens' check (every reason; the deciding equality in constant
time; any header either refused with a reason or mapped to its token's tenant), and reloading
(added, removed and rotated tokens, revoked ones remembered, a broken file keeping the old
table, ``changed`` following the files, a Kubernetes secret volume's link swap included)."""

from __future__ import annotations

import hmac
import os
import textwrap
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import app.core.tenants as tenants_module
from app.core.errors import AuthenticationError
from app.core.tenants import (
    Credentials,
    NamespaceConfig,
    TenantConfig,
    TenantsConfigError,
    load_tenants,
    token_digest,
)
from app.settings import ConfigError

TOKEN_A = "team-a-token-0001-aaaaaaaaaaaa"
TOKEN_A2 = "team-a-token-0002-aaaaaaaaaaaa"
TOKEN_B = "team-b-token-0001-bbbbbbbbbbbb"
ODD_TOKENS = ("short-token", "two words in it!", "ünïcödé-tökén-0001")
TWO_TENANTS = f"""
[tenants.team-a]
tokens = ["{TOKEN_A}"]
namespaces = {{ llama-70b = 20000, qwen-7b = 4000 }}
max_pins = 4096
max_requests = 256

[tenants.team-b]
tokens = ["{TOKEN_B}"]
namespaces = ["shared.model_1"]
"""


def write(path: Path, text: str, mode: int = 0o600) -> Path:
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    path.chmod(mode)
    return path


def refusal(path: Path) -> str:
    """The one line ``load_tenants`` refuses ``path`` with; it holds no token of the file."""
    with pytest.raises(TenantsConfigError) as info:
        load_tenants(path)
    line = str(info.value)
    assert isinstance(info.value, ConfigError)
    assert "\n" not in line
    assert line.startswith(f"--tenants / KVOFFLOAD_TENANTS = {str(path)!r}: ")
    for token in (TOKEN_A, TOKEN_A2, TOKEN_B, *ODD_TOKENS):
        assert token not in line
    return line


# --------------------------------------------------------------------------- loading


def test_a_file_of_tenants(tmp_path: Path) -> None:
    table, names = load_tenants(write(tmp_path / "tenants.toml", TWO_TENANTS))
    assert table.tenants == {
        "team-a": TenantConfig(
            "team-a",
            (NamespaceConfig("llama-70b", 20000), NamespaceConfig("qwen-7b", 4000)),
            max_pins=4096,
            max_requests=256,
        ),
        "team-b": TenantConfig("team-b", (NamespaceConfig("shared.model_1", None),)),
    }
    assert names == {token_digest(TOKEN_A): "team-a", token_digest(TOKEN_B): "team-b"}
    assert list(table.namespaces()) == ["llama-70b", "qwen-7b", "shared.model_1"]
    assert table.owner("qwen-7b") == "team-a"
    assert table.owner("shared.model_1") == "team-b"
    assert table.owner("nobody") is None
    assert table.tenants["team-a"].namespace("qwen-7b") == NamespaceConfig("qwen-7b", 4000)
    assert table.tenants["team-a"].namespace("shared.model_1") is None
    assert TOKEN_A not in repr(table)


def test_a_namespace_may_have_its_own_disk_budget(tmp_path: Path) -> None:
    text = f"""
    [tenants.team-a]
    tokens = ["{TOKEN_A}"]
    namespaces = {{ big = {{ blocks = 100, disk_bytes = 1000000 }}, small = 8, d = {{}} }}
    """
    table, _ = load_tenants(write(tmp_path / "tenants.toml", text))
    assert table.tenants["team-a"].namespaces == (
        NamespaceConfig("big", 100, 1000000),
        NamespaceConfig("small", 8, None),
        NamespaceConfig("d", None, None),
    )


def test_a_directory_of_tenant_files_skips_everything_else(tmp_path: Path) -> None:
    write(tmp_path / "team-a.toml", f'tokens = ["{TOKEN_A}"]\nnamespaces = ["a"]\n')
    write(tmp_path / "team-b.toml", f'tokens = ["{TOKEN_B}"]\nnamespaces = {{ b = 8 }}\n')
    write(tmp_path / ".hidden.toml", "not toml at all [", mode=0o644)
    write(tmp_path / "README.md", "not toml either [", mode=0o644)
    (tmp_path / "dir.toml").mkdir()
    (tmp_path / "..data").symlink_to(tmp_path / "dir.toml")
    (tmp_path / "loop.toml").symlink_to(".")
    (tmp_path / "dangling.toml").symlink_to("nowhere")
    table, names = load_tenants(tmp_path)
    assert not Credentials(tmp_path).changed()
    assert sorted(table.tenants) == ["team-a", "team-b"]
    assert table.namespaces() == {"a": NamespaceConfig("a", None), "b": NamespaceConfig("b", 8)}
    assert sorted(names.values()) == ["team-a", "team-b"]


def kubernetes_secret(volume: Path, version: str, files: dict[str, str]) -> None:
    """Lay out ``files`` the way the kubelet updates a secret volume: the data in a fresh
    ``..VERSION`` directory, the ``..data`` link swapped to it in one rename, and each file a
    link through ``..data``."""
    data = volume / f"..{version}"
    data.mkdir(mode=0o755)
    for name, text in files.items():
        write(data / name, text, mode=0o440)
    (volume / "..data_tmp").symlink_to(data.name)
    os.replace(volume / "..data_tmp", volume / "..data")
    for name in files:
        if not (volume / name).is_symlink():
            (volume / name).symlink_to(f"..data/{name}")


def test_a_kubernetes_secret_volume_and_its_update(tmp_path: Path) -> None:
    kubernetes_secret(
        tmp_path,
        "2026_12_01_06_00_00.1",
        {"team-a.toml": f'tokens = ["{TOKEN_A}"]\nnamespaces = ["a"]\n'},
    )
    creds = Credentials(tmp_path)
    assert creds.authenticate(f"Bearer {TOKEN_A}").name == "team-a"
    assert not creds.changed()
    kubernetes_secret(
        tmp_path,
        "2026_12_01_07_00_00.2",
        {"team-a.toml": f'tokens = ["{TOKEN_A2}"]\nnamespaces = ["a"]\n'},
    )
    assert creds.changed()  # the links are the same; what they lead to is not
    report = creds.reload()
    assert (report.tokens_added, report.tokens_revoked) == (1, 1)
    assert creds.authenticate(f"Bearer {TOKEN_A2}").name == "team-a"
    with pytest.raises(AuthenticationError, match="revoked_token"):
        creds.authenticate(f"Bearer {TOKEN_A}")


def tenant(body: str, name: str = "team-a") -> str:
    return f"[tenants.{name}]\n{textwrap.dedent(body)}"


def ok_tenant(name: str, token: str, namespaces: str = '["ns-NAME"]') -> str:
    return tenant(f'tokens = ["{token}"]\nnamespaces = {namespaces.replace("NAME", name)}\n', name)


@pytest.mark.parametrize(
    ("text", "needles"),
    [
        ("", ["no tenant"]),
        ("tenants = {}\n", ["no tenant"]),
        ("tenants = 3\n", ["tenants is not a table"]),
        ("[tenants]\nteam-a = 1\n", ["tenant 'team-a'", "not a table"]),
        (f"owner = 'x'\n{ok_tenant('a', TOKEN_A)}", ["unknown key(s) 'owner'"]),
        (
            tenant(f'tokens = ["{TOKEN_A}"]\nnamespaces = ["a"]\nmax_blocks = 3\n'),
            ["tenant 'team-a'", "unknown key(s) 'max_blocks'", "max_requests"],
        ),
        (ok_tenant("bad name", TOKEN_A).replace("bad name", '"bad name"', 1), ["'bad name'"]),
        (ok_tenant("-dash", TOKEN_A).replace("-dash", '"-dash"', 1), ["tenant name '-dash'"]),
        (ok_tenant("x" * 64, TOKEN_A), ["tenant name 'xxxx"]),
        (tenant('namespaces = ["a"]\n'), ["tenant 'team-a'", "no tokens"]),
        (tenant('tokens = []\nnamespaces = ["a"]\n'), ["no tokens"]),
        (tenant(f'tokens = "{TOKEN_A}"\nnamespaces = ["a"]\n'), ["no tokens"]),
        (tenant('tokens = [""]\nnamespaces = ["a"]\n'), ["tokens[0] is empty", "16"]),
        (
            tenant(f'tokens = ["{TOKEN_A}", "short-token"]\nnamespaces = ["a"]\n'),
            ["tokens[1] is shorter than 16 characters"],
        ),
        (
            tenant('tokens = ["two words in it!"]\nnamespaces = ["a"]\n'),
            ["tokens[0] holds spaces or non-ASCII"],
        ),
        (
            tenant('tokens = ["ünïcödé-tökén-0001"]\nnamespaces = ["a"]\n'),
            ["tokens[0] holds spaces or non-ASCII"],
        ),
        (tenant('tokens = [12345678901234567]\nnamespaces = ["a"]\n'), ["not a string"]),
        (
            tenant(f'tokens = ["{TOKEN_A}", "{TOKEN_A}"]\nnamespaces = ["a"]\n'),
            ["tokens[1] is also another of its tokens"],
        ),
        (
            ok_tenant("team-a", TOKEN_A) + ok_tenant("team-b", TOKEN_A),
            ["tenant 'team-b'", "tokens[0] is also a token of tenant 'team-a'"],
        ),
        (
            ok_tenant("team-a", TOKEN_A, '["m"]') + ok_tenant("team-b", TOKEN_B, "{ m = 4 }"),
            ["tenant 'team-b'", "namespace 'm' belongs to tenant 'team-a' too"],
        ),
        (tenant(f'tokens = ["{TOKEN_A}"]\n'), ["no namespaces"]),
        (tenant(f'tokens = ["{TOKEN_A}"]\nnamespaces = []\n'), ["no namespaces"]),
        (tenant(f'tokens = ["{TOKEN_A}"]\nnamespaces = {{}}\n'), ["no namespaces"]),
        (tenant(f'tokens = ["{TOKEN_A}"]\nnamespaces = "a"\n'), ["no namespaces"]),
        (tenant(f'tokens = ["{TOKEN_A}"]\nnamespaces = [1]\n'), ["non-string"]),
        (tenant(f'tokens = ["{TOKEN_A}"]\nnamespaces = ["a", "a"]\n'), ["namespace 'a' twice"]),
        (tenant(f'tokens = ["{TOKEN_A}"]\nnamespaces = ["a/b"]\n'), ["namespace name 'a/b'"]),
        (
            tenant(f'tokens = ["{TOKEN_A}"]\nnamespaces = {{ a = 0 }}\n'),
            ["namespaces.a = 0", "a positive integer"],
        ),
        (tenant(f'tokens = ["{TOKEN_A}"]\nnamespaces = {{ a = -5 }}\n'), ["namespaces.a = -5"]),
        (tenant(f'tokens = ["{TOKEN_A}"]\nnamespaces = {{ a = 1.5 }}\n'), ["namespaces.a = 1.5"]),
        (tenant(f'tokens = ["{TOKEN_A}"]\nnamespaces = {{ a = true }}\n'), ["namespaces.a = True"]),
        (tenant(f'tokens = ["{TOKEN_A}"]\nnamespaces = {{ a = "9" }}\n'), ["namespaces.a = '9'"]),
        (
            tenant(f'tokens = ["{TOKEN_A}"]\nnamespaces = {{ a = {{ disk_bytes = 0 }} }}\n'),
            ["namespaces.a.disk_bytes = 0", "a positive integer"],
        ),
        (
            tenant(f'tokens = ["{TOKEN_A}"]\nnamespaces = {{ a = {{ disk = 5 }} }}\n'),
            ["namespaces.a has unknown key(s) 'disk'"],
        ),
        (
            tenant(f'tokens = ["{TOKEN_A}"]\nnamespaces = ["a"]\nmax_pins = 0\n'),
            ["max_pins = 0", "a positive integer"],
        ),
        (
            tenant(f'tokens = ["{TOKEN_A}"]\nnamespaces = ["a"]\nmax_requests = "many"\n'),
            ["max_requests = 'many'"],
        ),
        (
            tenant(f'tokens = ["{TOKEN_A}"]\nnamespaces = ["a"]\nmax_pins = false\n'),
            ["max_pins = False"],
        ),
        (f'[tenants.team-a]\ntokens = ["{TOKEN_A}"] x\n', ["not valid TOML", "line 2"]),
    ],
)
def test_every_problem_of_a_file_is_refused_in_one_line_without_tokens(
    tmp_path: Path, text: str, needles: list[str]
) -> None:
    line = refusal(write(tmp_path / "tenants.toml", text))
    for needle in needles:
        assert needle in line, line


def test_a_file_that_is_not_utf8_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "tenants.toml"
    path.write_bytes(b'[tenants.a]\ntokens = ["\xff' + TOKEN_A.encode() + b'"]\n')
    path.chmod(0o600)
    assert "not UTF-8" in refusal(path)


@pytest.mark.parametrize("mode", [0o644, 0o604, 0o606])
def test_a_file_others_can_read_is_refused(tmp_path: Path, mode: int) -> None:
    path = write(tmp_path / "tenants.toml", TWO_TENANTS, mode=mode)
    assert f"readable by others (mode {mode:04o})" in refusal(path)
    path.chmod(mode & ~0o006)
    load_tenants(path)


@pytest.mark.parametrize("mode", [0o602, 0o622, 0o642])
def test_a_file_others_can_write_is_refused_at_start_and_on_reload(
    tmp_path: Path, mode: int
) -> None:
    path = write(tmp_path / "tenants.toml", TWO_TENANTS, mode=mode)
    assert f"writable by others (mode {mode:04o})" in refusal(path)
    path.chmod(0o600)
    creds = Credentials(path)
    path.chmod(mode)
    assert creds.changed()
    with pytest.raises(TenantsConfigError, match="writable by others"):
        creds.reload()


def foreign(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make ``path`` belong to someone other than the service's user and root."""
    if os.geteuid() == 0:
        os.chown(path, 4242, -1)
    else:
        monkeypatch.setattr(os, "geteuid", lambda: os.getuid() + 4242)


@pytest.mark.parametrize("layout", ["directory", "file"])
def test_a_directory_others_can_write_is_refused_unless_sticky_and_owned(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: str
) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    one = write(shared / "team-a.toml", f'tokens = ["{TOKEN_A}"]\nnamespaces = ["a"]\n')
    path = shared if layout == "directory" else one
    if layout == "file":
        write(one, TWO_TENANTS)
    shared.chmod(0o777)
    line = refusal(path)
    assert f"{shared} is writable by others (mode 0777)" in line
    with pytest.raises(TenantsConfigError, match="writable by others"):
        Credentials(path)
    # Sticky (/tmp, a Kubernetes secret volume): nobody renames or removes another's file,
    # so files of the service's user (or root) are accepted, and only those.
    shared.chmod(0o1777)
    load_tenants(path)
    foreign(one, monkeypatch)
    assert "owned by uid" in refusal(path)
    shared.chmod(0o755)
    load_tenants(path)


def test_a_kubernetes_secret_volume_mounted_1777_is_accepted(tmp_path: Path) -> None:
    kubernetes_secret(
        tmp_path,
        "2026_12_01_06_00_00.1",
        {"team-a.toml": f'tokens = ["{TOKEN_A}"]\nnamespaces = ["a"]\n'},
    )
    tmp_path.chmod(0o1777)
    try:
        assert Credentials(tmp_path).authenticate(f"Bearer {TOKEN_A}").name == "team-a"
    finally:
        tmp_path.chmod(0o700)


def test_directory_problems_name_the_file(tmp_path: Path) -> None:
    write(tmp_path / "team-a.toml", f'tokens = ["{TOKEN_A}"]\nnamespaces = ["a"]\n')
    write(tmp_path / "team-b.toml", f'tokens = ["{TOKEN_A}"]\nnamespaces = ["b"]\n')
    line = refusal(tmp_path)
    assert "team-b.toml: tokens[0] is also a token of team-a.toml" in line
    write(tmp_path / "team-b.toml", f'tokens = ["{TOKEN_B}"]\nnamespaces = ["a"]\n')
    assert "team-b.toml: namespace 'a' belongs to team-a.toml too" in refusal(tmp_path)
    write(tmp_path / "team-b.toml", f'tokens = ["{TOKEN_B}"]\nnamespaces = ["b"]\n', mode=0o644)
    assert "team-b.toml: readable by others" in refusal(tmp_path)
    write(tmp_path / "team-b.toml", f'[tenants.b]\ntokens = ["{TOKEN_B}"]\n')
    assert "team-b.toml: unknown key(s) 'tenants'" in refusal(tmp_path)
    (tmp_path / "team-b.toml").unlink()
    write(tmp_path / "bad name.toml", f'tokens = ["{TOKEN_B}"]\nnamespaces = ["b"]\n')
    assert "bad name.toml: tenant name 'bad name'" in refusal(tmp_path)


def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path: Path) -> None:
    fifo = tmp_path / "tenants.toml"
    os.mkfifo(fifo, 0o600)
    assert "not a regular file" in refusal(fifo)


def test_an_empty_directory_or_a_missing_path_is_refused(tmp_path: Path) -> None:
    write(tmp_path / ".team-a.toml", f'tokens = ["{TOKEN_A}"]\nnamespaces = ["a"]\n')
    assert "no NAME.toml file in the directory" in refusal(tmp_path)
    missing = tmp_path / "absent.toml"
    with pytest.raises(TenantsConfigError, match=r"absent\.toml'.*cannot read it"):
        load_tenants(missing)


# --------------------------------------------------------------------------- authenticate


@pytest.fixture
def creds(tmp_path: Path) -> Credentials:
    return Credentials(write(tmp_path / "tenants.toml", TWO_TENANTS))


@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER", "bEaReR"])
def test_a_bearer_token_names_its_tenant(creds: Credentials, scheme: str) -> None:
    assert creds.authenticate(f"{scheme} {TOKEN_A}") is creds.table.tenants["team-a"]
    assert creds.authenticate(f"{scheme} {TOKEN_B}").name == "team-b"


@pytest.mark.parametrize(
    ("header", "reason"),
    [
        (None, "missing_token"),
        ("", "missing_token"),
        ("Bearer", "malformed_authorization"),
        ("Bearer ", "malformed_authorization"),
        (f"Bearer  {TOKEN_A}", "malformed_authorization"),
        (f"Bearer {TOKEN_A} ", "malformed_authorization"),
        (f"Bearer {TOKEN_A} {TOKEN_B}", "malformed_authorization"),
        (f"Bearer\t{TOKEN_A}", "malformed_authorization"),
        (f"Basic {TOKEN_A}", "malformed_authorization"),
        (f"Bearer:{TOKEN_A}", "malformed_authorization"),
        (TOKEN_A, "malformed_authorization"),
        (f"Bearer {TOKEN_A}é", "malformed_authorization"),
        (f"Bearer {TOKEN_A}x", "unknown_token"),
        (f"Bearer {TOKEN_A[:-1]}", "unknown_token"),
        ("Bearer x", "unknown_token"),
    ],
)
def test_every_refusal_has_its_reason(creds: Credentials, header: str | None, reason: str) -> None:
    with pytest.raises(AuthenticationError) as info:
        creds.authenticate(header)
    assert info.value.reason == reason
    assert TOKEN_A not in str(info.value)


def test_the_deciding_comparison_is_constant_time(
    creds: Credentials, monkeypatch: pytest.MonkeyPatch
) -> None:
    compared: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", counting)
    assert creds.authenticate(f"Bearer {TOKEN_A}").name == "team-a"
    assert compared == [(token_digest(TOKEN_A), token_digest(TOKEN_A))]
    monkeypatch.setattr(hmac, "compare_digest", lambda a, b: False)
    with pytest.raises(AuthenticationError, match="unknown_token"):
        creds.authenticate(f"Bearer {TOKEN_A}")  # the constant-time check has the last word


# --------------------------------------------------------------------------- reload


def test_reload_adds_removes_and_rotates(tmp_path: Path) -> None:
    path = write(tmp_path / "tenants.toml", TWO_TENANTS)
    creds = Credentials(path)
    rotated = TWO_TENANTS.replace(f'["{TOKEN_A}"]', f'["{TOKEN_A}", "{TOKEN_A2}"]')
    write(path, rotated)
    report = creds.reload()
    assert report.tenants_changed == ("team-a",)
    assert (report.tenants_added, report.tenants_removed) == ((), ())
    assert (report.tokens_added, report.tokens_revoked) == (1, 0)
    assert report.changed
    for token in (TOKEN_A, TOKEN_A2):
        assert creds.authenticate(f"Bearer {token}").name == "team-a"

    write(path, rotated.replace(f'"{TOKEN_A}", ', "") + ok_tenant("team-c", "team-c-token-000001"))
    report = creds.reload()
    assert report.tenants_added == ("team-c",)
    assert report.namespaces_added == ("ns-team-c",)
    assert (report.tokens_added, report.tokens_revoked) == (1, 1)
    with pytest.raises(AuthenticationError, match="revoked_token"):
        creds.authenticate(f"Bearer {TOKEN_A}")
    assert creds.authenticate("Bearer team-c-token-000001").name == "team-c"

    write(path, ok_tenant("team-c", "team-c-token-000001"))
    report = creds.reload()
    assert report.tenants_removed == ("team-a", "team-b")
    assert report.namespaces_removed == ("llama-70b", "qwen-7b", "shared.model_1")
    assert report.tokens_revoked == 2
    for token in (TOKEN_A, TOKEN_A2, TOKEN_B):
        with pytest.raises(AuthenticationError, match="revoked_token"):
            creds.authenticate(f"Bearer {token}")
    assert TOKEN_B not in repr(report)

    write(path, ok_tenant("team-c", "team-c-token-000001") + ok_tenant("team-b", TOKEN_B))
    assert creds.reload().tenants_added == ("team-b",)
    assert creds.authenticate(f"Bearer {TOKEN_B}").name == "team-b"  # given back: valid again
    report = creds.reload()
    assert not report.changed


def test_a_namespace_resized_or_given_to_another_tenant_is_changed(tmp_path: Path) -> None:
    path = write(tmp_path / "tenants.toml", TWO_TENANTS)
    creds = Credentials(path)
    write(path, TWO_TENANTS.replace("qwen-7b = 4000", "qwen-7b = 5000"))
    assert creds.reload().namespaces_changed == ("qwen-7b",)
    write(
        path,
        ok_tenant("team-a", TOKEN_A, "{ llama-70b = 20000 }")
        + ok_tenant("team-b", TOKEN_B, '{ "shared.model_1" = 1, qwen-7b = 5000 }'),
    )
    report = creds.reload()
    assert report.namespaces_changed == ("qwen-7b", "shared.model_1")
    assert report.tenants_changed == ("team-a", "team-b")
    assert creds.table.owner("qwen-7b") == "team-b"


def test_the_oldest_revoked_tokens_are_forgotten(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tenants_module, "REVOKED_REMEMBERED", 2)
    path = write(tmp_path / "tenants.toml", ok_tenant("keep", TOKEN_B))
    creds = Credentials(path)
    old = [f"rotated-token-{i:04d}-xxxxxx" for i in range(3)]
    for token in old:
        write(path, ok_tenant("keep", TOKEN_B) + ok_tenant("t", token))
        creds.reload()
    write(path, ok_tenant("keep", TOKEN_B))
    creds.reload()
    reasons = []
    for token in old:
        with pytest.raises(AuthenticationError) as info:
            creds.authenticate(f"Bearer {token}")
        reasons.append(info.value.reason)
    assert reasons == ["unknown_token", "revoked_token", "revoked_token"]


def test_a_broken_file_keeps_the_old_table_in_force(tmp_path: Path) -> None:
    path = write(tmp_path / "tenants.toml", TWO_TENANTS)
    creds = Credentials(path)
    table = creds.table
    write(path, TWO_TENANTS.replace(TOKEN_B, "short-token"))
    assert creds.changed()
    with pytest.raises(TenantsConfigError, match="tokens\\[0\\] is shorter") as info:
        creds.reload()
    assert "short-token" not in str(info.value)
    assert creds.table is table
    assert creds.authenticate(f"Bearer {TOKEN_B}").name == "team-b"
    assert not creds.changed()  # the failed attempt saw these files: no retry until they change
    path.chmod(0o644)
    assert creds.changed()
    with pytest.raises(TenantsConfigError, match="readable by others"):
        creds.reload()
    write(path, TWO_TENANTS.replace(TOKEN_B, TOKEN_A2))
    assert creds.reload().tokens_revoked == 1
    with pytest.raises(AuthenticationError, match="revoked_token"):
        creds.authenticate(f"Bearer {TOKEN_B}")


def test_a_bad_file_at_start_is_refused(tmp_path: Path) -> None:
    path = write(tmp_path / "tenants.toml", TWO_TENANTS, mode=0o644)
    with pytest.raises(TenantsConfigError, match="readable by others"):
        Credentials(path)


def test_changed_follows_the_files(tmp_path: Path) -> None:
    path = write(tmp_path / "tenants.toml", TWO_TENANTS)
    creds = Credentials(path)
    assert not creds.changed()
    os.utime(path, ns=(1, 1))  # same size, same inode: the mtime alone
    assert creds.changed()
    creds.reload()
    assert not creds.changed()
    assert not creds.changed()


def test_changed_follows_a_directory(tmp_path: Path) -> None:
    write(tmp_path / "team-a.toml", f'tokens = ["{TOKEN_A}"]\nnamespaces = ["a"]\n')
    folder = Credentials(tmp_path)
    assert not folder.changed()
    write(tmp_path / "team-b.toml", f'tokens = ["{TOKEN_A2}"]\nnamespaces = ["b"]\n')
    assert folder.changed()
    assert folder.reload().tenants_added == ("team-b",)
    assert not folder.changed()
    (tmp_path / "team-b.toml").chmod(0o640)
    assert folder.changed()  # the mode alone: a refused file made private is read again
    folder.reload()
    (tmp_path / "team-b.toml").unlink()
    assert folder.changed()
    assert folder.reload().tenants_removed == ("team-b",)
    (tmp_path / "team-a.toml").unlink()
    assert folder.changed()
    with pytest.raises(TenantsConfigError, match=r"no NAME\.toml file"):
        folder.reload()
    assert folder.authenticate(f"Bearer {TOKEN_A}").name == "team-a"


# --------------------------------------------------------------------------- any header

TOKENS = {TOKEN_A: "team-a", TOKEN_A2: "team-a", TOKEN_B: "team-b"}
REVOKED = {"gone-token-0000000001": "team-gone"}


def expected(header: str | None) -> str:
    """The tenant (``tenant:NAME``) or refusal reason of a header, from the rules as written:
    ``Bearer`` in any case, one space, one token of visible ASCII characters."""
    if not header:
        return "missing_token"
    scheme, space, token = header.partition(" ")
    visible = token != "" and all(33 <= ord(c) <= 126 for c in token)
    if not scheme.isascii() or scheme.lower() != "bearer" or not space or not visible:
        return "malformed_authorization"
    if token in TOKENS:
        return f"tenant:{TOKENS[token]}"
    return "revoked_token" if token in REVOKED else "unknown_token"


HEADERS = st.one_of(
    st.none(),
    st.text(max_size=60),
    st.builds(
        lambda scheme, sep, token, tail: f"{scheme}{sep}{token}{tail}",
        st.sampled_from(["Bearer", "bearer", "BEARER", "BeArer", "Basic", "Bearer:", "", "Bear"]),
        st.sampled_from([" ", "  ", "\t", "", " \u00a0"]),
        st.sampled_from([*TOKENS, *REVOKED, "x" * 16, TOKEN_A.upper(), ""]),
        st.one_of(st.sampled_from(["", " ", "x", " extra", "\r\n"]), st.text(max_size=3)),
    ),
)


def test_any_header_is_refused_with_a_reason_or_names_its_tenant(tmp_path: Path) -> None:
    path = write(
        tmp_path / "tenants.toml",
        ok_tenant("team-a", TOKEN_A) + ok_tenant("team-gone", "gone-token-0000000001"),
    )
    creds = Credentials(path)
    write(
        path,
        tenant(f'tokens = ["{TOKEN_A}", "{TOKEN_A2}"]\nnamespaces = ["a"]\n')
        + ok_tenant("team-b", TOKEN_B),
    )
    creds.reload()

    @settings(max_examples=400, deadline=None, database=None, derandomize=True)
    @given(header=HEADERS)
    def check(header: str | None) -> None:
        try:
            got = f"tenant:{creds.authenticate(header).name}"
        except AuthenticationError as exc:
            got = exc.reason
        assert got == expected(header)

    check()
