"""Every YAML/JSON file in deploy/ parses; the Dockerfile and docker-compose.yml are wired
together (ports, secrets, mounts, /dev/shm size); every KVOFFLOAD_* variable is a real setting."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.deploy.helpers import (
    COMPOSE,
    DEPLOY,
    DOCKERFILE,
    PROMETHEUS_CONFIG,
    ROOT,
    TARGET_LABELS,
    compose_default,
    context_sends,
    dockerfile_instructions,
    load_json,
    load_yaml,
    load_yaml_all,
    parse_bytes,
)

ENV_VAR = re.compile(r"\bKVOFFLOAD_([A-Z0-9_]+)\b")


def _files(*suffixes: str) -> list[Path]:
    return sorted(p for p in DEPLOY.rglob("*") if p.is_file() and p.suffix in suffixes)


@pytest.mark.parametrize("path", _files(".yml", ".yaml"), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_yaml_parses(path: Path) -> None:
    docs = load_yaml_all(path)
    assert docs, f"{path} is empty"
    assert all(isinstance(d, dict) for d in docs)


@pytest.mark.parametrize("path", _files(".json"), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_json_parses(path: Path) -> None:
    assert isinstance(load_json(path), dict)


# --- Dockerfile -------------------------------------------------------------------------------


def test_dockerfile_runs_as_non_root_and_exposes_both_ports() -> None:
    instructions = dockerfile_instructions(DOCKERFILE)
    users = [arg for word, arg in instructions if word == "USER"]
    assert users, "no USER: the image would run as root"
    assert users[-1].split(":")[0] not in ("root", "0")
    assert ("EXPOSE", "8000 8001") in instructions
    args = {arg.split("=")[0] for word, arg in instructions if word == "ARG"}
    # torch's build is the wheelhouse's choice (make wheelhouse TORCH_SPEC/TORCH_INDEX_URL).
    assert args == {"BASE_IMAGE"}


def test_dockerfile_entrypoint_healthcheck_and_install() -> None:
    instructions = dict(dockerfile_instructions(DOCKERFILE))
    assert instructions["ENTRYPOINT"] == '["kvoffload", "serve", "--host", "0.0.0.0"]'
    assert "/livez" in instructions["HEALTHCHECK"]
    text = DOCKERFILE.read_text(encoding="utf-8")
    # Both lower tiers' libraries (mooncake, object) and the KV-event publisher's (events).
    assert '--no-index --find-links /wheelhouse "kvoffload[mooncake,object,events]"' in text
    assert "PIP_NO_INDEX=1" in text, "no package index is asked inside the build"
    assert "syntax=" not in text, "a syntax directive makes BuildKit pull its frontend image"


def test_dockerfile_copies_only_the_wheelhouse_and_the_ignore_file_lets_it_through() -> None:
    copies = [
        arg
        for word, arg in dockerfile_instructions(DOCKERFILE)
        if word == "COPY" and "--from" not in arg
    ]
    sources = [src for arg in copies for src in arg.split()[:-1]]
    assert sources == ["build/wheelhouse"]
    assert context_sends("build/wheelhouse/torch-2.13.0+cpu-cp311-cp311-linux_x86_64.whl")
    # One ignore file, read by both builders (the legacy one ignores Dockerfile.dockerignore).
    assert not list(DEPLOY.glob("*.dockerignore"))
    for never in (".venv/bin/python", "app/server.py", "deploy/secrets/x", ".git/HEAD"):
        assert not context_sends(never), f"{never} would be sent to the builder"


# --- docker-compose.yml -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    data: dict[str, Any] = load_yaml(COMPOSE)
    return data


def test_compose_services_and_published_ports(compose) -> None:
    services = compose["services"]
    assert {"kvoffload", "prometheus", "grafana"} <= set(services)
    for name, service in services.items():
        for port in service.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), f"{name} publishes {port} beyond loopback"
    kv = services["kvoffload"]
    assert [p.split(":", 1)[1] for p in kv["ports"]] == ["8000:8000", "8001:8001"]
    build = kv["build"]
    assert (DEPLOY / build["context"] / build["dockerfile"]).resolve() == DOCKERFILE.resolve()


def test_compose_shm_holds_the_default_pool(compose) -> None:
    kv = compose["services"]["kvoffload"]
    env = kv["environment"]
    pool = int(compose_default(env["KVOFFLOAD_NUM_BLOCKS"])) * int(
        compose_default(env["KVOFFLOAD_BLOCK_BYTES"])
    )
    assert pool <= parse_bytes(compose_default(kv["shm_size"]))


@pytest.mark.parametrize(
    ("variable", "secret"),
    [
        ("KVOFFLOAD_ADMIN_TOKEN", "kvoffload_admin_token"),
        ("KVOFFLOAD_METRICS_TOKEN", "kvoffload_metrics_token"),
    ],
)
def test_compose_tokens_are_secrets(compose, variable: str, secret: str) -> None:
    kv = compose["services"]["kvoffload"]
    assert secret in kv["secrets"]
    assert kv["environment"][f"{variable}_FILE"] == f"/run/secrets/{secret}"
    assert "file" in compose["secrets"][secret]
    assert variable not in kv["environment"], "no token in plain env"
    gitignore = (DEPLOY / ".gitignore").read_text(encoding="utf-8")
    secret_dir = Path(compose["secrets"][secret]["file"]).parent.name
    assert f"/{secret_dir}/" in gitignore


def test_compose_prometheus_scrapes_with_the_metrics_token(compose) -> None:
    # Issue #21: with tenants, /metrics is guarded by a scrape token; Prometheus sends it.
    assert "kvoffload_metrics_token" in compose["services"]["prometheus"]["secrets"]
    config = load_yaml(DEPLOY / "prometheus" / "prometheus.yml")
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "kvoffload"]
    assert job["authorization"] == {
        "type": "Bearer",
        "credentials_file": "/run/secrets/kvoffload_metrics_token",
    }


def test_compose_engine_api_has_tenants_from_the_secrets_directory(compose) -> None:
    kv = compose["services"]["kvoffload"]
    # The image listens on 0.0.0.0; the service refuses that without a tenants file.
    tenants_dir = kv["environment"]["KVOFFLOAD_TENANTS"]
    mounts = dict(str(v).split(":")[:2] for v in kv["volumes"])
    (source,) = [s for s, target in mounts.items() if target == tenants_dir]
    assert source.startswith("./secrets/"), "tenants files hold tokens: keep them in secrets/"
    assert str(kv["volumes"][0]).endswith(":ro")
    # The files stay the user's (0640, not readable by others): the service reads them
    # through their group.
    (gid,) = kv["group_add"]
    assert compose_default(gid).isdigit()


def test_compose_prometheus_stores_exemplars_and_mounts_config_and_rules(compose) -> None:
    prom = compose["services"]["prometheus"]
    assert "--enable-feature=exemplar-storage" in prom["command"]
    mounts = dict(v.split(":")[:2] for v in prom["volumes"] if v.startswith("./"))
    assert mounts["./prometheus/prometheus.yml"] == "/etc/prometheus/prometheus.yml"
    config_dir = Path(mounts["./prometheus/prometheus.yml"]).parent
    for src in mounts:
        assert (DEPLOY / src).exists(), src
    # rule_files are relative to the config file: the rules mount must be where they point.
    config = load_yaml(PROMETHEUS_CONFIG)
    for pattern in config["rule_files"]:
        rules_dir = str(config_dir / Path(pattern).parent)
        assert rules_dir in mounts.values(), f"{pattern} is not mounted"
        assert list((DEPLOY / "prometheus").glob(pattern)), pattern


def test_prometheus_scrapes_the_compose_service(compose) -> None:
    config = load_yaml(PROMETHEUS_CONFIG)
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "kvoffload"]
    (static,) = job["static_configs"]
    assert static["targets"] == ["kvoffload:8000"]
    assert "kvoffload" in compose["services"]
    assert set(static.get("labels", {})) <= TARGET_LABELS


# Compose v2 (the Docker CLI plugin) and Debian's docker-compose 1.29: the files must hold for
# both (1.29 rejects a top-level `name:`, for one). CI installs both.
COMPOSES = {"compose-v2": ["docker", "compose"], "compose-v1": ["docker-compose"]}
COMPOSE_STACKS = {
    "single": ["docker-compose.yml"],
    "remote": ["docker-compose.remote.yml"],
    "vllm": ["docker-compose.yml", "docker-compose.vllm.yml"],
    "disk": ["docker-compose.yml", "docker-compose.disk.yml"],
    "object": ["docker-compose.yml", "docker-compose.object.yml"],
}
# What a stack needs from the shell that runs compose (the object tier's bucket is required).
COMPOSE_ENV = {"object": {"KVOFFLOAD_OBJECT_BUCKET": "kvoffload-check"}}


def test_every_compose_file_is_in_a_checked_stack() -> None:
    listed = {f for files in COMPOSE_STACKS.values() for f in files}
    # docker-compose.ha.yml overrides the remote stack: tests/containers runs the pair.
    assert {p.name for p in DEPLOY.glob("docker-compose*.yml")} - listed == {
        "docker-compose.ha.yml"
    }


def _has(command: list[str]) -> bool:
    if shutil.which(command[0]) is None:
        return False
    try:
        proc = subprocess.run([*command, "version"], capture_output=True, timeout=10, check=False)
    except subprocess.TimeoutExpired:
        return False
    return proc.returncode == 0


@pytest.mark.parametrize("stack", sorted(COMPOSE_STACKS))
@pytest.mark.parametrize("compose", sorted(COMPOSES))
def test_docker_compose_config_validates(tmp_path, compose: str, stack: str) -> None:
    command = COMPOSES[compose]
    if not _has(command):
        pytest.skip(f"{' '.join(command)} is not installed")
    # compose config needs the secret files to exist; use throwaway ones.
    project = tmp_path / "deploy"
    shutil.copytree(DEPLOY, project, ignore=shutil.ignore_patterns("secrets"))
    (project / "secrets").mkdir()
    for name in (
        "kvoffload_admin_token",
        "kvoffload_metrics_token",
        "grafana_admin_password",
        "kvoffload_engine_token",
        "vllm_token",
        "kvoffload_object_mac_key",
    ):
        (project / "secrets" / name).write_text("test\n")
    files = [arg for f in COMPOSE_STACKS[stack] for arg in ("-f", str(project / f))]
    proc = subprocess.run(
        [*command, "-p", "kvoffload-check", *files, "--profile", "engine", "config", "--quiet"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, **COMPOSE_ENV.get(stack, {})},
    )
    assert proc.returncode == 0, proc.stderr
    # Nothing compose only warns about is left unread (1.29 ignores `configs:` off a swarm).
    assert "ignored" not in proc.stderr, proc.stderr


# --- settings ---------------------------------------------------------------------------------


def test_every_kvoffload_variable_is_a_setting() -> None:
    settings = pytest.importorskip("app.settings")
    fields = set(settings.Settings.model_fields)
    used: dict[str, set[str]] = {}
    for path in _files(".yml", ".yaml", ".md", ".alloy", ""):
        for name in ENV_VAR.findall(path.read_text(encoding="utf-8")):
            used.setdefault(name.lower(), set()).add(str(path.relative_to(DEPLOY)))
    # Read by the engine side, not the service: the vLLM tier's token file.
    engine_side = {"token_file"}
    tier = (ROOT / "client" / "kvoffload_client" / "vllm" / "state.py").read_text(encoding="utf-8")
    assert '"KVOFFLOAD_TOKEN_FILE"' in tier, "the tier no longer reads KVOFFLOAD_TOKEN_FILE"
    unknown = {
        name: sorted(paths)
        for name, paths in used.items()
        if name not in fields and name not in engine_side
    }
    assert not unknown, f"KVOFFLOAD_* variables that are no setting: {unknown}"
    assert {"admin_token_file", "num_blocks", "block_bytes", "admin_host"} <= set(used)
