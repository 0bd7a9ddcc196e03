"""The object tier's optional deploy files: the k8s Component (deploy/k8s/object) and the compose
override (docker-compose.object.yml). Off by default: the base files have no object tier; with
them, the settings load, credentials come only from AWS's standard sources (a Secret, a web
identity, the shell's environment: never a value in a file), the MAC key is mounted where the
setting points, the node's bookkeeping fits its memory, and docs/tiers.md tells the operator
about lifecycle rules."""

from __future__ import annotations

import json
import os
import re
import tomllib
from pathlib import Path
from typing import Any

import pytest

from app.core.object import ObjectBackend, s3_config
from app.settings import Settings
from tests.deploy.helpers import (
    COMPOSE,
    DEPLOY,
    DOCKERFILE,
    K8S,
    KUBECTL,
    compose_default,
    kustomize_with,
    load_yaml,
    load_yaml_all,
    parse_bytes,
)
from tests.docs_blocks import section as page_section
from transfer.s3 import MAC_BYTES

K8S_OBJECT = K8S / "object"
COMPOSE_OBJECT = DEPLOY / "docker-compose.object.yml"
# AWS's standard credential sources the deployments may pass on (never with a value in a file).
AWS_VARIABLES = {
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_PROFILE",
    "AWS_SHARED_CREDENTIALS_FILE",
    "AWS_CONFIG_FILE",
}
# What the node keeps per object under its bound (its order and its removal tracking, ~260
# bytes measured with 32-byte keys), with room to spare.
BYTES_PER_OBJECT = 400


@pytest.fixture(scope="module")
def patch() -> dict[str, Any]:
    (doc,) = load_yaml_all(K8S_OBJECT / "daemonset-object-tier.yaml")
    data: dict[str, Any] = doc
    return data


@pytest.fixture(scope="module")
def patched(patch) -> dict[str, Any]:
    """The object tier's container patch."""
    (container,) = patch["spec"]["template"]["spec"]["containers"]
    data: dict[str, Any] = container
    return data


def _values(env: list[dict[str, Any]]) -> dict[str, str]:
    return {e["name"]: str(e["value"]) for e in env if "value" in e}


def _base() -> tuple[dict[str, Any], dict[str, Any]]:
    """(the base DaemonSet, its container)."""
    (daemonset,) = [d for d in load_yaml_all(K8S / "daemonset.yaml") if d["kind"] == "DaemonSet"]
    (container,) = daemonset["spec"]["template"]["spec"]["containers"]
    return daemonset, container


def _object_settings(
    env: dict[str, str], mac_key: Path, monkeypatch: pytest.MonkeyPatch
) -> Settings:
    """The settings a node starts with from the object tier's ``env`` (its MAC key here)."""
    for name in [n for n in os.environ if n.startswith("KVOFFLOAD_")]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        if name.startswith("KVOFFLOAD_OBJECT_"):
            monkeypatch.setenv(name, value)
    monkeypatch.setenv("KVOFFLOAD_OBJECT_MAC_KEY_FILE", str(mac_key))
    return Settings()


def _tenant_namespaces() -> list[dict[str, Any]]:
    """Every namespace of the base's tenant Secrets, as a table (``blocks``, maybe
    ``object_bytes``)."""
    found = []
    for doc in load_yaml_all(K8S / "tenant-secrets.yaml"):
        for text in doc["stringData"].values():
            spaces = tomllib.loads(text)["namespaces"]
            assert isinstance(spaces, dict), "the example gives each namespace its blocks"
            for value in spaces.values():
                found.append(value if isinstance(value, dict) else {"blocks": value})
    return found


# --------------------------------------------------------------------------- base and image


def test_base_files_have_no_object_tier() -> None:
    _, container = _base()
    names = {e["name"] for e in container["env"]}
    assert not [n for n in names if n.startswith("KVOFFLOAD_OBJECT_") or n.startswith("AWS_")]
    env = load_yaml(COMPOSE)["services"]["kvoffload"]["environment"]
    assert not [n for n in env if n.startswith("KVOFFLOAD_OBJECT_") or n.startswith("AWS_")]


def test_image_has_the_object_extra() -> None:
    text = DOCKERFILE.read_text(encoding="utf-8")
    assert re.search(r'"kvoffload\[[a-z,]*\bobject\b[a-z,]*\]"', text)
    assert "import obstore, boto3" in text, "the build checks that the libraries load"


# --------------------------------------------------------------------------- Kubernetes


def test_k8s_component_lists_every_file() -> None:
    component = load_yaml(K8S_OBJECT / "kustomization.yaml")
    assert component["kind"] == "Component", "inside its base's directory: not an overlay"
    listed = set(component.get("resources", [])) | {p["path"] for p in component["patches"]}
    assert listed == {p.name for p in K8S_OBJECT.iterdir()} - {"kustomization.yaml"}


def test_k8s_credentials_come_only_from_a_secret_or_the_web_identity(patch, patched) -> None:
    env = patched["env"]
    aws = [e for e in env if e["name"].startswith("AWS_")]
    assert {e["name"] for e in aws} == {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"}
    for entry in aws:
        assert "value" not in entry, f"{entry['name']} written in the manifest"
        ref = entry["valueFrom"]["secretKeyRef"]
        assert ref["name"] == "kvoffload-object-credentials"
        assert ref["key"] == entry["name"]
        # Without the Secret (a web identity) the variables stay unset: keys in the
        # environment would come before the web identity in AWS's chain.
        assert ref["optional"] is True
    # No kvoffload setting carries a credential.
    credential = re.compile(r"KEY_ID|SECRET_ACCESS|SESSION_TOKEN")
    assert not [
        e["name"] for e in env if e["name"].startswith("KVOFFLOAD_") if credential.search(e["name"])
    ]
    # The Component ships no Secret: no placeholder key to deploy by mistake.
    assert not list(K8S_OBJECT.glob("*secret*"))
    # The service account's token is not mounted; a web identity projects its own.
    daemonset, _ = _base()
    assert daemonset["spec"]["template"]["spec"]["automountServiceAccountToken"] is False
    assert "automountServiceAccountToken" not in patch["spec"]["template"]["spec"]


def test_k8s_bucket_is_a_placeholder_no_one_can_own(patched) -> None:
    bucket = _values(patched["env"])["KVOFFLOAD_OBJECT_BUCKET"]
    assert "REPLACE-ME" in bucket
    # S3 bucket names are 3-63 lower-case characters: this one names no bucket.
    assert len(bucket) > 63
    assert bucket != bucket.lower()


def test_k8s_mac_key_is_mounted_where_the_setting_points(patch, patched) -> None:
    spec = patch["spec"]["template"]["spec"]
    key_file = _values(patched["env"])["KVOFFLOAD_OBJECT_MAC_KEY_FILE"]
    (mount,) = patched["volumeMounts"]
    assert mount["readOnly"] is True
    (volume,) = spec["volumes"]
    assert volume["name"] == mount["name"]
    secret = volume["secret"]
    (item,) = secret["items"]
    assert key_file == f"{mount['mountPath']}/{item['path']}"
    assert secret["secretName"] == "kvoffload-object-mac-key"
    assert not secret.get("optional"), "no node may start without the fleet's key"
    # The service's group reads it (fsGroup), nobody else.
    assert secret["defaultMode"] == 0o440
    daemonset, _ = _base()
    pod = daemonset["spec"]["template"]["spec"]["securityContext"]
    assert pod["fsGroup"] == pod["runAsGroup"]


def test_k8s_patched_settings_are_accepted(
    patch, patched, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = _values(patched["env"])
    mac_key = tmp_path / "mac-key"
    mac_key.write_text("0" * 64 + "\n")
    mac_key.chmod(0o600)
    settings = _object_settings(env, mac_key, monkeypatch)
    assert ObjectBackend().enabled(settings)
    assert settings.object_bytes == int(env["KVOFFLOAD_OBJECT_BYTES"])
    assert settings.object_prefix == env["KVOFFLOAD_OBJECT_PREFIX"]
    config = s3_config(settings)
    assert config.endpoint is None, "AWS by default: its endpoint for the region"
    assert (config.addressing, config.region) == ("virtual", env["KVOFFLOAD_OBJECT_REGION"])
    assert config.secret == b"0" * 64
    assert config.access_key_id is None, "credentials never come from the settings"
    # The grace period covers the drain and closing the tier with its endpoint gone.
    base_env = _values(_base()[1]["env"])
    needed = (
        float(base_env["KVOFFLOAD_SHUTDOWN_DELAY_S"])
        + float(base_env["KVOFFLOAD_SHUTDOWN_GRACE_S"])
        + 3 * settings.object_timeout_s
    )
    assert patch["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > needed


def test_k8s_memory_holds_pools_and_the_bound_bookkeeping(patched) -> None:
    _, container = _base()
    base_env = _values(container["env"])
    block_bytes = int(base_env["KVOFFLOAD_BLOCK_BYTES"])
    default_bytes = int(_values(patched["env"])["KVOFFLOAD_OBJECT_BYTES"])
    pools = bookkeeping = 0
    namespaces = _tenant_namespaces()
    assert len(namespaces) >= 2
    for space in namespaces:
        pools += space["blocks"] * block_bytes
        objects = space.get("object_bytes", default_bytes) // (block_bytes + MAC_BYTES)
        bookkeeping += objects * BYTES_PER_OBJECT
    assert "resources" not in patched, "the base's limit holds it (and remote's 15Gi stays)"
    limit = parse_bytes(container["resources"]["limits"]["memory"])
    assert limit >= pools + 2**30 + bookkeeping, "memory must hold pools, bound and process"


@pytest.mark.skipif(KUBECTL is None, reason="kubectl not on PATH (kubectl kustomize renders)")
def test_k8s_component_renders_with_the_base_and_the_other_tiers(tmp_path: Path) -> None:
    rendered = kustomize_with(["disk", "remote", "object"], tmp_path)
    (daemonset,) = [d for d in rendered if d["kind"] == "DaemonSet"]
    spec = daemonset["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    env = {e["name"] for e in container["env"]}
    assert {
        "KVOFFLOAD_OBJECT_BUCKET",
        "KVOFFLOAD_OBJECT_MAC_KEY_FILE",
        "AWS_ACCESS_KEY_ID",
        "KVOFFLOAD_DISK_DIR",
        "KVOFFLOAD_REMOTE_TIER",
        "KVOFFLOAD_TENANTS",
    } <= env
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert {"/run/secrets/kvoffload-object", "/var/lib/kvoffload/disk", "/dev/shm"} <= mounts
    assert {v["name"] for v in spec["volumes"]} >= {"object-mac-key", "disk", "shm", "tenants"}
    assert container["resources"]["limits"]["memory"] == "15Gi", "the remote tier's stays"
    assert daemonset["metadata"]["namespace"] == "kvoffload"


@pytest.mark.skipif(KUBECTL is None, reason="kubectl not on PATH (kubectl kustomize renders)")
def test_k8s_remote_ha_listed_last_keeps_its_grace_period(tmp_path: Path) -> None:
    rendered = kustomize_with(["object", "remote", "remote-ha"], tmp_path)
    (daemonset,) = [d for d in rendered if d["kind"] == "DaemonSet"]
    assert daemonset["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 75


# --------------------------------------------------------------------------- compose


@pytest.fixture(scope="module")
def compose_service() -> dict[str, Any]:
    service: dict[str, Any] = load_yaml(COMPOSE_OBJECT)["services"]["kvoffload"]
    return service


def test_compose_passes_credentials_through_and_writes_none(compose_service) -> None:
    env = compose_service["environment"]
    aws = {name: value for name, value in env.items() if name.startswith("AWS_")}
    assert set(aws) == AWS_VARIABLES
    # A bare name: compose passes the shell's value on, and nothing when it is unset there.
    assert all(value is None for value in aws.values()), aws
    # The bucket is the operator's to name: compose refuses to start without it.
    assert re.fullmatch(r"\$\{KVOFFLOAD_OBJECT_BUCKET:\?.+\}", env["KVOFFLOAD_OBJECT_BUCKET"])


def test_compose_mounts_the_mac_key_as_a_secret(compose_service) -> None:
    env = compose_service["environment"]
    (secret,) = compose_service["secrets"]
    assert env["KVOFFLOAD_OBJECT_MAC_KEY_FILE"] == f"/run/secrets/{secret}"
    source = load_yaml(COMPOSE_OBJECT)["secrets"][secret]["file"]
    assert source.startswith("./secrets/"), "keys stay in the gitignored secrets directory"
    assert "/secrets/" in (DEPLOY / ".gitignore").read_text(encoding="utf-8")


def test_compose_settings_are_accepted(
    compose_service, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = {
        name: compose_default(value)
        for name, value in compose_service["environment"].items()
        if name.startswith("KVOFFLOAD_OBJECT_") and name != "KVOFFLOAD_OBJECT_BUCKET"
    }
    env["KVOFFLOAD_OBJECT_BUCKET"] = "my-kv-blocks"
    env["KVOFFLOAD_OBJECT_ENDPOINT"] = ""  # its default: unset
    mac_key = tmp_path / "mac-key"
    mac_key.write_text("k" * 64 + "\n")
    mac_key.chmod(0o600)
    settings = _object_settings(env, mac_key, monkeypatch)
    assert settings.object_endpoint is None, "an empty endpoint is AWS's"
    assert settings.object_bytes == 64 << 30
    assert s3_config(settings).secret == b"k" * 64
    # The stop waits for the drain and for closing the tier with its endpoint gone.
    base = load_yaml(COMPOSE)["services"]["kvoffload"]["environment"]
    needed = (
        float(compose_default(base["KVOFFLOAD_SHUTDOWN_DELAY_S"]))
        + settings.shutdown_grace_s
        + 3 * settings.object_timeout_s
    )
    assert float(compose_service["stop_grace_period"].removesuffix("s")) > needed


# --------------------------------------------------------------------------- everywhere


def test_no_credentials_are_written_in_deploy() -> None:
    found = []
    for path in sorted(p for p in DEPLOY.rglob("*") if p.is_file()):
        text = path.read_text(encoding="utf-8", errors="replace")
        if re.search(r"\b(AKIA|ASIA)[0-9A-Z]{16}\b", text):
            found.append(f"{path.relative_to(DEPLOY)}: an AWS access key id")
        for m in re.finditer(r"^\s*-?\s*(AWS_[A-Z_]+):[ \t]*(\S.*)$", text, re.MULTILINE):
            if path.suffix in (".yml", ".yaml") and not m.group(2).startswith("#"):
                found.append(f"{path.relative_to(DEPLOY)}: {m.group(1)} has a value")
    assert not found, "\n".join(found)


def _object_tier_section() -> str:
    return page_section("tiers.md", "Deploying the object tier")


def test_the_tiers_page_tells_how_to_turn_the_object_tier_on() -> None:
    section = _object_tier_section()
    assert "-f deploy/docker-compose.object.yml" in section
    assert "components: [../../deploy/k8s/object]" in section
    for source in ("AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_ROLE_ARN", "AWS_PROFILE"):
        assert source in section, source
    for store in ("AWS S3", "MinIO", "Ceph RGW"):
        assert store in section, store


def test_the_tiers_page_gives_a_lifecycle_rule_for_the_prefix() -> None:
    section = _object_tier_section()
    assert "aws s3api put-bucket-lifecycle-configuration" in section
    blocks = [json.loads(b) for b in re.findall(r"```json\n(.*?)```", section, re.DOTALL)]
    (lifecycle,) = [b for b in blocks if "Rules" in b]
    (rule,) = lifecycle["Rules"]
    assert rule["Status"] == "Enabled"
    assert rule["Filter"]["Prefix"] == Settings().object_prefix + "/"
    assert rule["Expiration"]["Days"] > 0
    # What a node sees when the rule expires an object.
    assert "`miss`" in section
    assert "`BlockRemoved` event with medium `OBJECT`" in section
    assert "--object-sweep-s" in section
    # The credentials' policy lets the probe list and a missing object be a 404.
    (policy,) = [b for b in blocks if "Statement" in b]
    actions: set[str] = set()
    for statement in policy["Statement"]:
        action = statement["Action"]
        actions.update(action if isinstance(action, list) else [action])
    assert {"s3:GetObject", "s3:PutObject", "s3:DeleteObject", "s3:ListBucket"} <= actions
