"""vLLM + kvoffload on one node (docker-compose.vllm.yml, k8s/vllm/, Dockerfile.vllm): the two
containers share the socket directory and nothing else (no /dev/shm, host IPC, PID or network),
the connector configuration has one source and names the socket kvoffload listens on, the pool
fits its memory, and the sidecar's settings are valid."""

from __future__ import annotations

import json
import os
import re
import tomllib
from pathlib import Path, PurePosixPath
from typing import Any

import pytest

from app.settings import Settings
from tests.deploy.helpers import (
    COMPOSE,
    DEPLOY,
    DEPLOY_DOC,
    K8S,
    KUBECTL,
    compose_default,
    context_sends,
    dockerfile_instructions,
    kustomize,
    load_json,
    load_yaml,
    load_yaml_all,
    parse_bytes,
    write_secret_volume,
)

VLLM_COMPOSE = DEPLOY / "docker-compose.vllm.yml"
K8S_VLLM = K8S / "vllm"
TIER_CONFIG = K8S_VLLM / "kv-transfer-config.json"
DOCKERFILE_VLLM = DEPLOY / "Dockerfile.vllm"
RUN_DIR = PurePosixPath("/run/kvoffload")


def tier_socket() -> PurePosixPath:
    """The engine socket the connector configuration points the kvoffload tier at."""
    config = load_json(TIER_CONFIG)
    extra = config["kv_connector_extra_config"]
    (tier,) = [t for t in extra["secondary_tiers"] if t["module_path"] == "kvoffload_client.vllm"]
    url: str = tier["url"]
    assert url.startswith("unix://"), url
    return PurePosixPath(url.removeprefix("unix://"))


def test_connector_configuration_names_the_kvoffload_tier() -> None:
    config = load_json(TIER_CONFIG)
    assert (config["kv_connector"], config["kv_role"]) == ("OffloadingConnector", "kv_both")
    extra = config["kv_connector_extra_config"]
    assert extra["spec_name"] == "TieringOffloadingSpec"
    assert type(extra["cpu_bytes_to_use"]) is int
    assert extra["cpu_bytes_to_use"] > 0
    (tier,) = extra["secondary_tiers"]
    assert (tier["type"], tier["module_path"]) == ("KVOffloadTier", "kvoffload_client.vllm")
    assert tier["namespace"]
    assert tier_socket().parent == RUN_DIR


# --------------------------------------------------------------------------- compose


@pytest.fixture(scope="module")
def services() -> dict[str, dict[str, Any]]:
    """The services of docker-compose.yml with docker-compose.vllm.yml merged in (maps merge,
    lists append, scalars are replaced: what compose does for the keys used here)."""
    base = load_yaml(COMPOSE)["services"]
    override = load_yaml(VLLM_COMPOSE)["services"]
    merged: dict[str, dict[str, Any]] = {}
    for name in {*base, *override}:
        service = dict(base.get(name, {}))
        for key, value in override.get(name, {}).items():
            if isinstance(value, dict) and isinstance(service.get(key), dict):
                service[key] = {**service[key], **value}
            elif isinstance(value, list) and isinstance(service.get(key), list):
                service[key] = [*service[key], *value]
            else:
                service[key] = value
        merged[name] = service
    return merged


def _compose_mounts(service: dict[str, Any]) -> dict[str, str]:
    """source -> target of a service's volumes (short syntax)."""
    mounts = {}
    for volume in service.get("volumes", []):
        source, target = str(volume).split(":")[:2]
        mounts[source] = target
    return mounts


def test_compose_shares_only_the_socket_directory(services) -> None:
    kv, vllm = services["kvoffload"], services["vllm"]
    kv_mounts, vllm_mounts = _compose_mounts(kv), _compose_mounts(vllm)
    shared = set(kv_mounts) & set(vllm_mounts)
    assert shared == {"kvoffload-run"}
    assert kv_mounts["kvoffload-run"] == vllm_mounts["kvoffload-run"] == str(RUN_DIR)
    assert "kvoffload-run" in load_yaml(COMPOSE)["volumes"], "a named volume"
    for service in (kv, vllm):
        assert "/dev/shm" not in _compose_mounts(service).values()
        for key in ("ipc", "pid", "network_mode"):
            assert key not in service, f"{key}: {service[key]} shares more than the directory"


def test_compose_kvoffload_listens_where_the_tier_connects(services) -> None:
    env = services["kvoffload"]["environment"]
    assert PurePosixPath(env["KVOFFLOAD_UDS"]) == tier_socket()
    assert "KVOFFLOAD_POOL_SOCKET" not in env, "the default (engine socket + .pool) is the tier's"
    assert env["KVOFFLOAD_DEVICE"] == "cpu"
    pool = int(compose_default(env["KVOFFLOAD_NUM_BLOCKS"])) * int(
        compose_default(env["KVOFFLOAD_BLOCK_BYTES"])
    )
    assert pool <= parse_bytes(compose_default(services["kvoffload"]["shm_size"]))


def test_compose_credentials(services) -> None:
    kv, vllm = services["kvoffload"], services["vllm"]
    # kvoffload reads vLLM's tenant from a directory of its own, bind-mounted from secrets/.
    tenants_dir = kv["environment"]["KVOFFLOAD_TENANTS"]
    sources = [s for s, target in _compose_mounts(kv).items() if target == tenants_dir]
    assert sources, f"{tenants_dir} is not mounted"
    assert all(s.startswith("./secrets/") for s in sources), "secrets/ is gitignored"
    assert kv["group_add"], "the service reads the tenants files through their group"
    # vLLM reads the token alone, where the tier's token_file points.
    (tier,) = load_json(TIER_CONFIG)["kv_connector_extra_config"]["secondary_tiers"]
    (secret,) = vllm["secrets"]
    assert secret["target"] == tier["token_file"]
    source = load_yaml(VLLM_COMPOSE)["secrets"][secret["source"]]["file"]
    assert source.startswith("./secrets/")


def test_compose_vllm_reads_the_one_configuration_file(services) -> None:
    vllm = services["vllm"]
    (target,) = [t for s, t in _compose_mounts(vllm).items() if s.endswith(".json")]
    source = next(s for s, t in _compose_mounts(vllm).items() if t == target)
    assert (DEPLOY / source).resolve() == TIER_CONFIG.resolve()
    (command,) = vllm["command"]
    assert vllm["entrypoint"] == ["/bin/sh", "-c"]
    assert f'--kv-transfer-config "$$(cat {target})"' in command
    assert command.startswith("exec vllm serve ")
    build = vllm["build"]
    assert (DEPLOY / build["context"] / build["dockerfile"]).resolve() == DOCKERFILE_VLLM
    assert vllm["depends_on"]["kvoffload"]["condition"] == "service_healthy"


def test_compose_vllm_publishes_on_loopback_beside_kvoffload(services) -> None:
    published = [str(p) for s in services.values() for p in s.get("ports", [])]
    assert all(p.startswith("127.0.0.1:") for p in published)
    host_ports = [p.split(":")[1] for p in published]
    assert len(host_ports) == len(set(host_ports)), "two services publish one host port"


# --------------------------------------------------------------------------- Kubernetes


@pytest.fixture(scope="module")
def k8s_objects() -> dict[tuple[str, str], dict[str, Any]]:
    found: dict[tuple[str, str], dict[str, Any]] = {}
    for name in load_yaml(K8S_VLLM / "kustomization.yaml")["resources"]:
        for doc in load_yaml_all(K8S_VLLM / name):
            found[(doc["kind"], doc["metadata"]["name"])] = doc
    return found


@pytest.fixture(scope="module")
def pod(k8s_objects) -> dict[str, Any]:
    spec: dict[str, Any] = k8s_objects[("Deployment", "vllm")]["spec"]["template"]["spec"]
    return spec


@pytest.fixture(scope="module")
def containers(pod) -> dict[str, dict[str, Any]]:
    """The service and vLLM (the run directory's root init container aside)."""
    every = [*pod.get("initContainers", []), *pod["containers"]]
    return {c["name"]: c for c in every if c["name"] != RUN_DIR_INIT}


RUN_DIR_INIT = "kvoffload-run-dir"


def _env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container["env"] if "value" in e}


def _k8s_mounts(container: dict[str, Any]) -> dict[str, str]:
    return {m["name"]: m["mountPath"] for m in container["volumeMounts"]}


def test_k8s_kustomization_lists_every_file() -> None:
    kustomization = load_yaml(K8S_VLLM / "kustomization.yaml")
    listed = set(kustomization["resources"])
    listed |= {f for gen in kustomization["configMapGenerator"] for f in gen["files"]}
    on_disk = {p.name for p in K8S_VLLM.iterdir()} - {"kustomization.yaml"}
    assert listed == on_disk


def test_k8s_the_sockets_directory_is_handed_to_the_service_first(pod, containers) -> None:
    """The kubelet makes an emptyDir writable by all, which the service refuses for --uds."""
    init = pod["initContainers"][0]
    assert init["name"] == RUN_DIR_INIT
    (mount,) = init["volumeMounts"]
    assert os.path.dirname(_env(containers["kvoffload"])["KVOFFLOAD_UDS"]) == mount["mountPath"]
    script = init["command"][-1]
    assert f"chown 10001:10001 {mount['mountPath']}" in script
    assert f"chmod 0750 {mount['mountPath']}" in script
    security = init["securityContext"]
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN", "FOWNER"]}
    assert init["resources"]["limits"]["memory"]


def test_k8s_kvoffload_is_a_native_sidecar_of_vllm(pod, containers) -> None:
    (sidecar,) = [c for c in pod["initContainers"] if c["name"] != RUN_DIR_INIT]
    assert sidecar["name"] == "kvoffload"
    assert sidecar["restartPolicy"] == "Always", "started before vLLM, stopped after it"
    assert [c["name"] for c in pod["containers"]] == ["vllm"]
    ports = {c: {p["containerPort"] for p in containers[c]["ports"]} for c in containers}
    assert not ports["kvoffload"] & ports["vllm"], "one network namespace: ports must differ"
    assert {int(_env(containers["kvoffload"])["KVOFFLOAD_PORT"])} == ports["kvoffload"]
    names = {p["name"]: p["containerPort"] for p in sidecar["ports"]}
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert sidecar[probe]["httpGet"]["port"] in names, probe


def test_k8s_containers_share_only_the_socket_directory(pod, containers) -> None:
    kv, vllm = _k8s_mounts(containers["kvoffload"]), _k8s_mounts(containers["vllm"])
    assert set(kv) & set(vllm) == {"kvoffload-run"}
    assert kv["kvoffload-run"] == vllm["kvoffload-run"] == str(RUN_DIR)
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert set(volumes["kvoffload-run"]) == {"name", "emptyDir"}
    assert kv["kvoffload-shm"] == "/dev/shm"
    assert vllm["vllm-shm"] == "/dev/shm"
    assert not any("hostPath" in v for v in volumes.values())
    for key in ("hostPID", "hostIPC", "hostNetwork", "shareProcessNamespace"):
        assert not pod.get(key), key


def test_k8s_both_containers_can_use_the_sockets_unprivileged(pod, containers) -> None:
    security = pod["securityContext"]
    assert security["runAsNonRoot"] is True
    assert security["runAsUser"] != 0
    # The sockets are 0660 for the service's user and group: vLLM needs one of the two.
    assert security["fsGroup"] == security["runAsGroup"]
    for container in containers.values():
        sc = container["securityContext"]
        assert "runAsUser" not in sc, "the pod's ids apply to both"
        assert "runAsGroup" not in sc, "the pod's ids apply to both"
        assert sc["runAsNonRoot"] is True
        assert sc["allowPrivilegeEscalation"] is False
        assert sc["capabilities"]["drop"] == ["ALL"]
    namespace = load_yaml(K8S_VLLM / "namespace.yaml")
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"


def test_k8s_sidecar_settings_are_valid_and_match_the_tier(
    k8s_objects, containers, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = _env(containers["kvoffload"])
    for name in [n for n in os.environ if n.startswith("KVOFFLOAD_")]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    # The tenants directory as the kubelet writes it, here instead of /etc/kvoffload/tenants.
    _, volume = _secret_mount(containers["kvoffload"], k8s_objects, env["KVOFFLOAD_TENANTS"])
    write_secret_volume(tmp_path, volume["files"], volume["mode"])
    monkeypatch.setenv("KVOFFLOAD_TENANTS", str(tmp_path))
    settings = Settings()  # raises on an invalid combination (e.g. admin without a token)
    assert PurePosixPath(str(settings.uds)) == tier_socket()
    assert settings.effective_pool_socket == Path(f"{tier_socket()}.pool")
    assert settings.device == "cpu"
    assert settings.admin_token_value() is None
    assert settings.admin_host == "127.0.0.1"


def _secret_mount(
    container: dict[str, Any], objects: dict[tuple[str, str], dict[str, Any]], path: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the Secret, {"files": name -> text, "mode": mode}) mounted at ``path`` in
    ``container``, read-only and limited to its ``items``."""
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == path]
    assert mount["readOnly"] is True
    pod = objects[("Deployment", "vllm")]["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    ref = volume["secret"]
    secret = objects[("Secret", ref["secretName"])]
    files = {item["path"]: secret["stringData"][item["key"]] for item in ref["items"]}
    return secret, {"files": files, "mode": ref["defaultMode"]}


def test_k8s_each_container_gets_its_part_of_the_tenant_secret(k8s_objects, containers) -> None:
    kv, vllm = containers["kvoffload"], containers["vllm"]
    tenants_dir = _env(kv)["KVOFFLOAD_TENANTS"]
    secret, tenants = _secret_mount(kv, k8s_objects, tenants_dir)
    tenant = secret["metadata"]["labels"]["kvoffload.io/tenant"]
    assert list(tenants["files"]) == [f"{tenant}.toml"], "the file stem is the tenant's name"
    # Owner and group at most (fsGroup): the service refuses a tenants file others can read.
    assert tenants["mode"] in (0o400, 0o440)
    table = tomllib.loads(tenants["files"][f"{tenant}.toml"])
    (token,) = table["tokens"]
    assert "REPLACE-ME" in token, "keep an obvious placeholder"
    # vLLM gets the token alone, where the tier's token_file points, and not the toml.
    extra = load_json(TIER_CONFIG)["kv_connector_extra_config"]
    (tier,) = extra["secondary_tiers"]
    token_file = PurePosixPath(tier["token_file"])
    same, mounted = _secret_mount(vllm, k8s_objects, str(token_file.parent))
    assert same is secret
    assert mounted["files"] == {token_file.name: token}
    assert mounted["mode"] in (0o400, 0o440)
    assert tier["service_namespace"] in table["namespaces"]
    assert tenants_dir not in _k8s_mounts(vllm).values()


def test_k8s_network_policy_admits_only_prometheus_to_kvoffload(k8s_objects, containers) -> None:
    policy = k8s_objects[("NetworkPolicy", "vllm")]["spec"]
    pod_labels = k8s_objects[("Deployment", "vllm")]["spec"]["template"]["metadata"]["labels"]
    assert policy["podSelector"]["matchLabels"].items() <= pod_labels.items()
    kv_port = int(_env(containers["kvoffload"])["KVOFFLOAD_PORT"])
    rules = [r for r in policy["ingress"] if kv_port in {p["port"] for p in r["ports"]}]
    assert rules, "Prometheus must reach kvoffload's /metrics"
    for rule in rules:
        assert rule.get("from"), "an empty `from` admits every source"
        for peer in rule["from"]:
            assert peer["namespaceSelector"]["matchLabels"], peer
            assert peer["podSelector"]["matchLabels"]["app.kubernetes.io/name"] == "prometheus"


def test_k8s_pool_fits_its_memory(pod, containers) -> None:
    sidecar = containers["kvoffload"]
    env = _env(sidecar)
    pool = int(env["KVOFFLOAD_NUM_BLOCKS"]) * int(env["KVOFFLOAD_BLOCK_BYTES"])
    volumes = {v["name"]: v for v in pod["volumes"]}
    shm = volumes["kvoffload-shm"]["emptyDir"]
    assert shm["medium"] == "Memory"
    assert pool <= parse_bytes(shm["sizeLimit"])
    resources = sidecar["resources"]
    assert parse_bytes(resources["limits"]["memory"]) >= pool + 2**30
    assert resources["requests"]["memory"] == resources["limits"]["memory"]
    vllm = containers["vllm"]["resources"]["limits"]
    cpu_tier = load_json(TIER_CONFIG)["kv_connector_extra_config"]["cpu_bytes_to_use"]
    assert parse_bytes(vllm["memory"]) > cpu_tier, "vLLM's CPU tier is vLLM's memory"
    assert "nvidia.com/gpu" in vllm
    assert "nvidia.com/gpu" not in sidecar["resources"].get("limits", {})


def test_k8s_vllm_takes_the_configuration_from_the_generated_configmap(containers) -> None:
    vllm = containers["vllm"]
    args = vllm["args"]
    value = args[args.index("--kv-transfer-config") + 1]
    m = re.fullmatch(r"\$\((\w+)\)", value)
    assert m is not None, value
    variable = m.group(1)
    (entry,) = [e for e in vllm["env"] if e["name"] == variable]
    ref = entry["valueFrom"]["configMapKeyRef"]
    (generator,) = load_yaml(K8S_VLLM / "kustomization.yaml")["configMapGenerator"]
    assert ref["name"] == generator["name"]
    assert ref["key"] == TIER_CONFIG.name
    assert generator["files"] == [TIER_CONFIG.name]
    assert vllm["command"] == ["vllm", "serve"]


@pytest.mark.skipif(KUBECTL is None, reason="kubectl not on PATH (kubectl kustomize renders)")
def test_k8s_kustomize_renders_the_pod_with_the_configuration(k8s_objects) -> None:
    rendered = kustomize(K8S_VLLM)
    (configmap,) = [d for d in rendered if d["kind"] == "ConfigMap"]
    assert json.loads(configmap["data"][TIER_CONFIG.name]) == load_json(TIER_CONFIG)
    (deployment,) = [d for d in rendered if d["kind"] == "Deployment"]
    (vllm,) = deployment["spec"]["template"]["spec"]["containers"]
    refs = [e["valueFrom"]["configMapKeyRef"]["name"] for e in vllm["env"] if "valueFrom" in e]
    assert refs == [configmap["metadata"]["name"]], "the hashed name is referenced"
    for doc in rendered:
        if doc["kind"] != "Namespace":
            assert doc["metadata"]["namespace"] == "vllm", doc["metadata"]["name"]


# --------------------------------------------------------------------------- images, the docs


def test_vllm_image_adds_the_engine_side_alone_without_touching_vllms_dependencies() -> None:
    instructions = dockerfile_instructions(DOCKERFILE_VLLM)
    copies = [arg for word, arg in instructions if word == "COPY"]
    sources = [src for arg in copies for src in arg.split()[:-1]]
    assert sources == ["build/wheelhouse/kvoffload_client-*.whl"], (
        "the engine distribution's wheel only: none of the server's packages"
    )
    assert context_sends(sources[0])
    runs = " ".join(arg for word, arg in instructions if word == "RUN")
    assert "pip install --no-cache-dir --no-index --no-deps /tmp/wheels/kvoffload_client-" in runs
    assert "import kvoffload_client.vllm" in runs, "the build checks that the tier imports"
    assert '! python3 -c "import app"' in runs, "the build checks that no server came along"


def test_service_image_owns_the_socket_directory() -> None:
    instructions = dockerfile_instructions(DEPLOY / "Dockerfile")
    runs = " ".join(arg for word, arg in instructions if word == "RUN")
    assert f"install -d -o 10001 -g 10001 -m 0750 {RUN_DIR}" in runs
    assert [arg for word, arg in instructions if word == "USER"][-1] == "10001:10001"


def test_the_deploy_page_says_what_is_shared() -> None:
    page = DEPLOY_DOC.read_text(encoding="utf-8")
    assert "/dev/shm/kvoffload" not in page, "no advice to share /dev/shm"
    assert "engine.sock.pool" in page
    assert "X-KVOffload-Pool" in page
    assert "docker-compose.vllm.yml" in page
