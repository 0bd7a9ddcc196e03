"""Kubernetes manifests: the DaemonSet is probed, non-root, sized for its /dev/shm pool; the
Services, NetworkPolicy and ServiceMonitor fit together; the PrometheusRule and the dashboard
ConfigMap match their sources; kustomize renders the lot."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path, PurePosixPath
from typing import Any

import pytest

from tests.deploy.helpers import (
    DASHBOARD,
    K8S,
    KUBECTL,
    KUBERNETES_DOC,
    RULES,
    SYNC_TOOL,
    kustomize,
    load_json,
    load_yaml,
    load_yaml_all,
    parse_bytes,
    write_secret_volume,
)


@pytest.fixture(scope="module")
def objects() -> dict[tuple[str, str], dict[str, Any]]:
    """(kind, name) -> object, over every manifest the kustomization lists."""
    found: dict[tuple[str, str], dict[str, Any]] = {}
    for name in load_yaml(K8S / "kustomization.yaml")["resources"]:
        for doc in load_yaml_all(K8S / name):
            key = (doc["kind"], doc["metadata"]["name"])
            assert key not in found, f"{key} defined twice"
            found[key] = doc
    return found


@pytest.fixture(scope="module")
def daemonset(objects) -> dict[str, Any]:
    ds: dict[str, Any] = objects[("DaemonSet", "kvoffload")]
    return ds


@pytest.fixture(scope="module")
def container(daemonset) -> dict[str, Any]:
    (c,) = daemonset["spec"]["template"]["spec"]["containers"]
    assert isinstance(c, dict)
    return c


def _env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container["env"] if "value" in e}


def test_kustomization_lists_every_manifest() -> None:
    listed = set(load_yaml(K8S / "kustomization.yaml")["resources"])
    on_disk = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == on_disk


def test_expected_objects(objects) -> None:
    kinds = {kind for kind, _ in objects}
    assert kinds == {
        "Namespace",
        "ServiceAccount",
        "Secret",
        "DaemonSet",
        "Service",
        "NetworkPolicy",
        "ServiceMonitor",
        "PrometheusRule",
        "ConfigMap",
    }


def test_daemonset_runs_on_gpu_nodes_and_selects_its_pods(daemonset) -> None:
    spec = daemonset["spec"]
    labels = spec["template"]["metadata"]["labels"]
    assert spec["selector"]["matchLabels"].items() <= labels.items()
    pod = spec["template"]["spec"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"])


def test_probes(container) -> None:
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": 8000, "admin": 8001}
    paths = {}
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        get = container[probe]["httpGet"]
        assert get["port"] in ports, probe
        paths[probe] = get["path"]
    assert paths == {
        "startupProbe": "/livez",
        "livenessProbe": "/livez",
        "readinessProbe": "/readyz",
    }


def test_dev_shm_is_a_sized_memory_volume_that_holds_the_pool(daemonset, container) -> None:
    pod = daemonset["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    shm = volumes[mount["name"]]["emptyDir"]
    assert shm["medium"] == "Memory"
    env = _env(container)
    pool = int(env["KVOFFLOAD_NUM_BLOCKS"]) * int(env["KVOFFLOAD_BLOCK_BYTES"])
    assert pool <= parse_bytes(shm["sizeLimit"]), "the pool does not fit in /dev/shm"
    # tmpfs pages count against the container's memory limit.
    resources = container["resources"]
    limit = parse_bytes(resources["limits"]["memory"])
    assert limit >= pool + 2**30, "memory limit must hold the pool plus the process"
    assert resources["requests"]["memory"] == resources["limits"]["memory"]
    assert "cpu" in resources["requests"]


def test_runs_as_non_root_with_a_locked_down_container(daemonset, container) -> None:
    pod = daemonset["spec"]["template"]["spec"]["securityContext"]
    assert pod["runAsNonRoot"] is True
    assert pod["runAsUser"] != 0
    assert pod["seccompProfile"]["type"] == "RuntimeDefault"
    sc = container["securityContext"]
    assert sc["runAsNonRoot"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["capabilities"]["drop"] == ["ALL"]
    spec = daemonset["spec"]["template"]["spec"]
    assert spec["automountServiceAccountToken"] is False
    assert not spec.get("hostNetwork")
    assert not spec.get("hostIPC")
    assert not spec.get("hostPID")


def test_admin_token_comes_from_the_secret(objects, daemonset, container) -> None:
    pod = daemonset["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"] if "secret" in v}
    token_file = _env(container)["KVOFFLOAD_ADMIN_TOKEN_FILE"]
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == "admin-token"]
    assert mount["readOnly"] is True
    secret_ref = volumes[mount["name"]]["secret"]
    (item,) = secret_ref["items"]
    assert token_file == f"{mount['mountPath']}/{item['path']}"
    secret = objects[("Secret", secret_ref["secretName"])]
    assert item["key"] in secret["stringData"]
    assert "REPLACE-ME" in secret["stringData"][item["key"]], "keep an obvious placeholder"
    page = KUBERNETES_DOC.read_text(encoding="utf-8")
    assert "create secret generic kvoffload-admin-token" in page
    assert _env(container)["KVOFFLOAD_ADMIN_HOST"] == "0.0.0.0"


def test_the_scrape_token_comes_from_a_secret_prometheus_sends(
    objects, daemonset, container
) -> None:
    # Issue #21: /metrics needs a bearer token; the ServiceMonitor sends the same Secret's key.
    pod = daemonset["spec"]["template"]["spec"]
    volume = next(v for v in pod["volumes"] if v["name"] == "metrics-token")["secret"]
    (item,) = volume["items"]
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == "metrics-token"]
    assert mount["readOnly"] is True
    assert volume["defaultMode"] == 0o440
    token_file = _env(container)["KVOFFLOAD_METRICS_TOKEN_FILE"]
    assert token_file == f"{mount['mountPath']}/{item['path']}"
    secret = objects[("Secret", volume["secretName"])]
    assert "REPLACE-ME" in secret["stringData"][item["key"]], "keep an obvious placeholder"
    (endpoint,) = objects[("ServiceMonitor", "kvoffload")]["spec"]["endpoints"]
    assert endpoint["authorization"] == {
        "type": "Bearer",
        "credentials": {"name": volume["secretName"], "key": item["key"]},
    }


def test_services_reach_the_pods(objects, daemonset, container) -> None:
    pod_labels = daemonset["spec"]["template"]["metadata"]["labels"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    public = objects[("Service", "kvoffload")]["spec"]
    admin = objects[("Service", "kvoffload-admin")]["spec"]
    for svc in (public, admin):
        assert svc["selector"].items() <= pod_labels.items()
        for port in svc["ports"]:
            assert port["targetPort"] in ports
    assert [(p["port"], p["targetPort"]) for p in public["ports"]] == [(8000, "http")]
    assert public["internalTrafficPolicy"] == "Local", "engines must reach their own node"
    assert [(p["port"], p["targetPort"]) for p in admin["ports"]] == [(8001, "admin")]
    assert admin["clusterIP"] == "None", "admin calls address each node's instance"


def test_network_policy_restricts_the_admin_port(objects, daemonset) -> None:
    policy = objects[("NetworkPolicy", "kvoffload")]["spec"]
    pod_labels = daemonset["spec"]["template"]["metadata"]["labels"]
    assert policy["podSelector"]["matchLabels"].items() <= pod_labels.items()
    assert "Ingress" in policy["policyTypes"]
    admin_rules = []
    for rule in policy["ingress"]:
        ports = [p["port"] for p in rule.get("ports", [])]
        assert ports, "a rule without ports opens every port"
        if 8001 in ports or "admin" in ports:
            admin_rules.append(rule)
    assert admin_rules, "nothing may reach the admin port"
    for rule in admin_rules:
        assert rule.get("from"), "the admin port is open to everyone"
        for peer in rule["from"]:
            assert peer.get("podSelector", {}).get("matchLabels") or peer.get("ipBlock"), peer


def test_service_monitor_scrapes_the_public_port(objects) -> None:
    monitor = objects[("ServiceMonitor", "kvoffload")]["spec"]
    services = [
        svc
        for (kind, _), svc in objects.items()
        if kind == "Service"
        and monitor["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    ]
    assert [s["metadata"]["name"] for s in services] == ["kvoffload"]
    (endpoint,) = monitor["endpoints"]
    assert endpoint["port"] in {p["name"] for p in services[0]["spec"]["ports"]}
    assert endpoint["path"] == "/metrics"


def test_prometheus_rule_matches_the_rules_file(objects) -> None:
    rule = objects[("PrometheusRule", "kvoffload")]
    assert rule["spec"]["groups"] == load_yaml(RULES)["groups"]


def test_dashboard_configmap_matches_the_dashboard(objects) -> None:
    configmap = objects[("ConfigMap", "kvoffload-grafana-dashboard")]
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    (key,) = configmap["data"]
    assert key == DASHBOARD.name
    assert configmap["data"][key] == DASHBOARD.read_text(encoding="utf-8")
    assert json.loads(configmap["data"][key]) == load_json(DASHBOARD)


def test_generated_files_are_up_to_date() -> None:
    proc = subprocess.run(
        [sys.executable, str(SYNC_TOOL), "--check"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr


@pytest.mark.skipif(KUBECTL is None, reason="kubectl not on PATH (kubectl kustomize renders)")
def test_kustomize_renders_everything_in_one_namespace(objects) -> None:
    rendered = kustomize(K8S)
    assert {(d["kind"], d["metadata"]["name"]) for d in rendered} == set(objects)
    for doc in rendered:
        if doc["kind"] != "Namespace":
            assert doc["metadata"]["namespace"] == "kvoffload", doc["metadata"]["name"]
        assert doc["metadata"]["labels"]["app.kubernetes.io/part-of"] == "kvoffload"


# --- credentials and tenants ------------------------------------------------------------------

ENGINE_PORTS = {8000, "http"}


def _tenant_secrets(objects) -> dict[str, dict[str, Any]]:
    """Tenant name -> its Secret (labelled kvoffload.io/tenant)."""
    return {
        doc["metadata"]["labels"]["kvoffload.io/tenant"]: doc
        for (kind, _), doc in objects.items()
        if kind == "Secret" and "kvoffload.io/tenant" in doc["metadata"]["labels"]
    }


def _tenants_volume(daemonset, container) -> tuple[str, dict[str, Any]]:
    """(mount path, volume) of the directory the tenants setting names."""
    path = _tenants_setting(container)
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == path]
    assert mount["readOnly"] is True
    volumes = {v["name"]: v for v in daemonset["spec"]["template"]["spec"]["volumes"]}
    return path, volumes[mount["name"]]


def _tenants_setting(container) -> str:
    """The tenants path the container is given, as KVOFFLOAD_TENANTS or ``--tenants``."""
    args = [*container.get("command", []), *container.get("args", [])]
    from_args = args[args.index("--tenants") + 1] if "--tenants" in args else None
    from_env = _env(container).get("KVOFFLOAD_TENANTS")
    assert (from_args is None) != (from_env is None), "the tenants path is set exactly once"
    path = from_args or from_env
    assert path
    return path


def test_engine_listener_has_tenants(container) -> None:
    # The image listens on 0.0.0.0; the service refuses that without a tenants file.
    assert _tenants_setting(container) == "/etc/kvoffload/tenants"


def test_every_tenant_secret_is_projected_into_the_tenants_directory(
    objects, daemonset, container
) -> None:
    secrets = _tenant_secrets(objects)
    assert len(secrets) >= 2, "one Secret per tenant (the example has two)"
    _, volume = _tenants_volume(daemonset, container)
    projected = volume["projected"]
    # Readable by the service's group at most: the service refuses files others can read.
    assert projected["defaultMode"] in (0o400, 0o440)
    if projected["defaultMode"] == 0o440:
        pod = daemonset["spec"]["template"]["spec"]["securityContext"]
        assert pod["fsGroup"] == pod["runAsGroup"]
    sources = {s["secret"]["name"]: s["secret"]["items"] for s in projected["sources"]}
    assert set(sources) == {s["metadata"]["name"] for s in secrets.values()}
    for tenant, secret in secrets.items():
        (key,) = secret["stringData"]
        assert key == f"{tenant}.toml", "the file stem is the tenant's name"
        assert sources[secret["metadata"]["name"]] == [{"key": key, "path": key}]


def _tenant_files(objects) -> dict[str, str]:
    return {
        f"{tenant}.toml": secret["stringData"][f"{tenant}.toml"]
        for tenant, secret in _tenant_secrets(objects).items()
    }


def test_tenant_files_hold_placeholders_and_their_pools_fit(objects, daemonset, container) -> None:
    env = _env(container)
    blocks = 0
    tokens: list[str] = []
    namespaces: list[str] = []
    for text in _tenant_files(objects).values():
        table = tomllib.loads(text)
        tokens += table["tokens"]
        spaces = table["namespaces"]
        if isinstance(spaces, dict):
            blocks += sum(spaces.values())
        else:
            blocks += len(spaces) * int(env["KVOFFLOAD_NUM_BLOCKS"])
        namespaces += list(spaces)
    assert tokens
    assert all("REPLACE-ME" in t for t in tokens), "keep obvious placeholders"
    assert len(tokens) == len(set(tokens)), "a token belongs to one tenant"
    assert len(namespaces) == len(set(namespaces)), "a namespace belongs to one tenant"
    # Every namespace is a pool of its own in /dev/shm, charged to the container.
    pool = blocks * int(env["KVOFFLOAD_BLOCK_BYTES"])
    volumes = {v["name"]: v for v in daemonset["spec"]["template"]["spec"]["volumes"]}
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    assert pool <= parse_bytes(volumes[mount["name"]]["emptyDir"]["sizeLimit"])
    assert parse_bytes(container["resources"]["limits"]["memory"]) >= pool + 2**30


def test_the_service_loads_the_projected_tenants_directory(objects, daemonset, container, tmp_path):
    tenants = pytest.importorskip("app.core.tenants")
    _, volume = _tenants_volume(daemonset, container)
    write_secret_volume(tmp_path, _tenant_files(objects), volume["projected"]["defaultMode"])
    table, _tokens = tenants.load_tenants(tmp_path)
    assert set(table.tenants) == set(_tenant_secrets(objects))


def test_network_policy_admits_only_engines_and_prometheus_to_the_engine_port(objects) -> None:
    policy = objects[("NetworkPolicy", "kvoffload")]["spec"]
    engine_rules = [
        rule
        for rule in policy["ingress"]
        if {p["port"] for p in rule.get("ports", [])} & ENGINE_PORTS
    ]
    assert engine_rules, "engines must reach the engine port"
    peers = []
    for rule in engine_rules:
        assert rule.get("from"), "an empty `from` admits every source"
        for peer in rule["from"]:
            assert "ipBlock" not in peer, "engines are pods: select them by labels"
            # A namespaceSelector {} (bare or beside a podSelector) spans the whole cluster.
            assert peer.get("namespaceSelector", {}).get("matchLabels"), peer
            assert peer.get("podSelector", {}).get("matchLabels"), peer
            peers.append(peer)
    pod_labels = [p["podSelector"]["matchLabels"] for p in peers]
    assert {"kvoffload.io/engine": "true"} in pod_labels
    assert any(labels.get("app.kubernetes.io/name") == "prometheus" for labels in pod_labels)
    for rule in policy["ingress"]:
        for peer in rule.get("from", []):
            assert peer != {"namespaceSelector": {}}, "a bare namespaceSelector {} admits all"


def test_engine_socket_is_on_a_node_local_volume_handed_to_the_service(
    daemonset, container
) -> None:
    env = _env(container)
    socket = PurePosixPath(env["KVOFFLOAD_UDS"])
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == str(socket.parent)]
    pod = daemonset["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    # Engines in other pods on the node mount the same directory.
    assert volumes[mount["name"]]["hostPath"] == {
        "path": str(socket.parent),
        "type": "DirectoryOrCreate",
    }
    # Owner and group only, the group being the service's: engines join it.
    assert env["KVOFFLOAD_UDS_MODE"] == "0660"
    assert env["KVOFFLOAD_UDS_GROUP"] == str(pod["securityContext"]["runAsGroup"])
    # The kubelet makes the directory root's: one init step, root with CHOWN/FOWNER only,
    # hands it to the service.
    (init,) = pod["initContainers"]
    assert [m["mountPath"] for m in init["volumeMounts"]] == [str(socket.parent)]
    sc = init["securityContext"]
    assert sc["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN", "FOWNER"]}
    assert sc["allowPrivilegeEscalation"] is False
    assert "10001:10001" in " ".join(init["command"])
    # hostPath is beyond `restricted`: the namespace says so instead of failing admission.
    labels = load_yaml(K8S / "namespace.yaml")["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "privileged"
    assert labels["pod-security.kubernetes.io/warn"] == "restricted"


def test_daemonset_settings_are_valid(
    objects, daemonset, container, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("app.core.tenants")  # the service side of tenants
    from app.settings import Settings

    env = _env(container)
    for name in [n for n in os.environ if n.startswith("KVOFFLOAD_")]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    # The mounted files, here instead of under /etc and /run/secrets.
    _, volume = _tenants_volume(daemonset, container)
    write_secret_volume(tmp_path / "tenants", _tenant_files(objects), 0o440)
    monkeypatch.setenv("KVOFFLOAD_TENANTS", str(tmp_path / "tenants"))
    for name in ("admin-token", "metrics-token"):  # as the secret volumes mount them
        (tmp_path / name).write_text(f"test-{name}\n")
        (tmp_path / name).chmod(0o440)
    monkeypatch.setenv("KVOFFLOAD_ADMIN_TOKEN_FILE", str(tmp_path / "admin-token"))
    monkeypatch.setenv("KVOFFLOAD_METRICS_TOKEN_FILE", str(tmp_path / "metrics-token"))
    # The image's entrypoint listens on 0.0.0.0: valid only with the tenants file.
    settings = Settings(host="0.0.0.0")
    assert settings.uds_mode == 0o660
    assert settings.uds_group == "10001"
    assert settings.uds_auth == "token", "engines on the node's socket still need their token"
    assert volume["projected"]["defaultMode"] == 0o440
