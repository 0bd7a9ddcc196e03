"""The disk tier's optional deploy files: the k8s Component (deploy/k8s/disk) and the compose
override (docker-compose.disk.yml). Off by default: the base files have no disk tier; with
them, the settings load, the mount is where KVOFFLOAD_DISK_DIR points, and the directory is the
service's."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from app.settings import Settings
from tests.deploy.helpers import (
    COMPOSE,
    DEPLOY,
    K8S,
    KUBECTL,
    TIERS_DOC,
    compose_default,
    kustomize_with,
    load_yaml,
    load_yaml_all,
)

K8S_DISK = K8S / "disk"
COMPOSE_DISK = DEPLOY / "docker-compose.disk.yml"
SERVICE_UID = 10001


@pytest.fixture(scope="module")
def patch() -> dict[str, Any]:
    (doc,) = load_yaml_all(K8S_DISK / "daemonset-disk-tier.yaml")
    data: dict[str, Any] = doc
    return data


def _env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: str(e["value"]) for e in container.get("env", []) if "value" in e}


def _disk_settings(
    env: dict[str, str], disk_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> Settings:
    """The settings a node starts with from the disk tier's ``env`` (its directory here)."""
    for name in [n for n in os.environ if n.startswith("KVOFFLOAD_")]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        if name.startswith("KVOFFLOAD_DISK_"):
            monkeypatch.setenv(name, value)
    monkeypatch.setenv("KVOFFLOAD_DISK_DIR", str(disk_dir))
    return Settings()


def test_base_files_have_no_disk_tier() -> None:
    (daemonset,) = [d for d in load_yaml_all(K8S / "daemonset.yaml") if d["kind"] == "DaemonSet"]
    (container,) = daemonset["spec"]["template"]["spec"]["containers"]
    assert not [n for n in _env(container) if n.startswith("KVOFFLOAD_DISK_")]
    env = load_yaml(COMPOSE)["services"]["kvoffload"]["environment"]
    assert not [n for n in env if n.startswith("KVOFFLOAD_DISK_")]


def test_k8s_component_lists_every_file() -> None:
    component = load_yaml(K8S_DISK / "kustomization.yaml")
    assert component["kind"] == "Component", "inside its base's directory: not an overlay"
    listed = set(component.get("resources", [])) | {p["path"] for p in component["patches"]}
    assert listed == {p.name for p in K8S_DISK.iterdir()} - {"kustomization.yaml"}


def test_k8s_patch_mounts_the_node_disk_where_the_tier_looks(patch) -> None:
    spec = patch["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    env = _env(container)
    (mount,) = container["volumeMounts"]
    assert mount["mountPath"] == env["KVOFFLOAD_DISK_DIR"]
    assert not mount.get("readOnly")
    (volume,) = spec["volumes"]
    assert volume["name"] == mount["name"]
    assert volume["hostPath"]["type"] == "DirectoryOrCreate"
    assert volume["hostPath"]["path"].startswith("/")


def test_k8s_init_container_hands_the_directory_to_the_service_only(patch) -> None:
    spec = patch["spec"]["template"]["spec"]
    (init,) = spec["initContainers"]
    (mount,) = init["volumeMounts"]
    (container,) = spec["containers"]
    assert mount["mountPath"] == _env(container)["KVOFFLOAD_DISK_DIR"]
    script = init["command"][-1]
    assert f"chown {SERVICE_UID}:{SERVICE_UID} {mount['mountPath']}" in script
    assert f"chmod 0750 {mount['mountPath']}" in script
    security = init["securityContext"]
    assert security["allowPrivilegeEscalation"] is False
    assert security["readOnlyRootFilesystem"] is True
    assert security["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN", "FOWNER"]}
    assert init["resources"]["limits"]["memory"]


def test_k8s_patched_settings_are_accepted(
    patch, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (container,) = patch["spec"]["template"]["spec"]["containers"]
    env = _env(container)
    settings = _disk_settings(env, tmp_path, monkeypatch)
    assert settings.disk_dir == tmp_path
    assert settings.disk_bytes == int(env["KVOFFLOAD_DISK_BYTES"])
    assert settings.disk_admit_after == int(env["KVOFFLOAD_DISK_ADMIT_AFTER"])


@pytest.mark.skipif(KUBECTL is None, reason="kubectl not on PATH (kubectl kustomize renders)")
def test_k8s_component_renders_with_the_base_and_the_remote_tier(tmp_path: Path) -> None:
    rendered = kustomize_with(["disk", "remote"], tmp_path)
    (daemonset,) = [d for d in rendered if d["kind"] == "DaemonSet"]
    spec = daemonset["spec"]["template"]["spec"]
    assert {c["name"] for c in spec["initContainers"]} == {"socket-dir", "disk-dir"}
    (container,) = spec["containers"]
    env = {e["name"] for e in container["env"]}
    assert {"KVOFFLOAD_DISK_DIR", "KVOFFLOAD_REMOTE_TIER", "KVOFFLOAD_TENANTS"} <= env
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert {"/var/lib/kvoffload/disk", "/dev/shm", "/run/kvoffload"} <= mounts
    assert {v["name"] for v in spec["volumes"]} >= {"disk", "shm", "tenants", "run"}
    assert daemonset["metadata"]["namespace"] == "kvoffload"


def test_compose_override_mounts_the_disk_where_the_tier_looks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    service = load_yaml(COMPOSE_DISK)["services"]["kvoffload"]
    env = {k: compose_default(v) for k, v in service["environment"].items()}
    (volume,) = service["volumes"]
    host, target = volume.rsplit(":", 1)
    assert target == env["KVOFFLOAD_DISK_DIR"]
    assert compose_default(host).startswith("/"), "a host directory, not a named volume"
    settings = _disk_settings(env, tmp_path, monkeypatch)
    assert settings.disk_bytes == int(env["KVOFFLOAD_DISK_BYTES"])


def test_the_tiers_page_tells_how_to_turn_the_disk_tier_on() -> None:
    page = TIERS_DOC.read_text(encoding="utf-8")
    assert "components: [../../deploy/k8s/disk]" in page
    assert "-f deploy/docker-compose.disk.yml" in page
