"""The remote tier's deployment (docker-compose.remote.yml, k8s/remote/, the image): a Mooncake
master the nodes point at (its RPC port and metadata URL), each node named where the others reach
it, the tenants the engine listener needs off loopback, settings the service accepts, memory that
holds the pools and the nodes' shares of the store, and network policies that let the nodes reach
the master and each other."""

from __future__ import annotations

import os
import re
import tomllib
import urllib.parse
from pathlib import Path
from typing import Any

import pytest

from app.settings import Settings
from tests.deploy.helpers import (
    DEPLOY,
    DOCKERFILE,
    K8S,
    KUBECTL,
    TIERS_DOC,
    compose_default,
    dockerfile_instructions,
    kustomize_with,
    load_yaml,
    load_yaml_all,
    parse_bytes,
    write_secret_volume,
)
from transfer.mooncake import master_problem, metadata_problem

REMOTE_COMPOSE = DEPLOY / "docker-compose.remote.yml"
REMOTE_PROMETHEUS = DEPLOY / "prometheus" / "prometheus.remote.yml"
K8S_REMOTE = K8S / "remote"
NODES = ("kvoffload-a", "kvoffload-b")
MASTER = "mooncake-master"
DEBIAN_LIBRARIES = ("libibverbs1", "librdmacm1", "libnuma1", "libcurl4")


def _flags(argv: list[str]) -> dict[str, str]:
    """``--name=value`` arguments of a command line, by name."""
    return dict(a.removeprefix("--").split("=", 1) for a in argv if a.startswith("--"))


def _master_endpoints(flags: dict[str, str]) -> tuple[int, int]:
    """(RPC port, metadata port) a master started with ``flags`` listens on."""
    assert flags["enable_http_metadata_server"] == "true", "the nodes need its metadata server"
    return int(flags["rpc_port"]), int(flags["http_metadata_server_port"])


def _check_points_at_master(env: dict[str, str], host: str, rpc: int, metadata: int) -> None:
    assert env["KVOFFLOAD_REMOTE_TIER"] == "mooncake"
    assert env["KVOFFLOAD_MOONCAKE_MASTER"] == f"{host}:{rpc}"
    url = urllib.parse.urlsplit(env["KVOFFLOAD_MOONCAKE_METADATA"])
    assert (url.scheme, url.hostname, url.port, url.path) == ("http", host, metadata, "/metadata")


def _seconds(value: str) -> float:
    """A compose duration (``45s``) or a number of seconds."""
    return float(str(value).removesuffix("s"))


def _check_stops_in_time(settings: Settings, grace_s: float) -> None:
    """The runtime's grace covers the drain and closing the tier with its master gone (its
    probe, its calls and its client's teardown, each bounded by ``remote_timeout_s``)."""
    needed = settings.shutdown_delay_s + settings.shutdown_grace_s + 3 * settings.remote_timeout_s
    assert grace_s > needed, f"{grace_s} s to stop; draining and closing take up to {needed} s"


def _settings(env: dict[str, str], tenants: Path, monkeypatch: pytest.MonkeyPatch) -> Settings:
    """The settings a node starts with from ``env`` (its tenants directory at ``tenants``)."""
    for name in [n for n in os.environ if n.startswith("KVOFFLOAD_")]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        if name.startswith("KVOFFLOAD_"):
            monkeypatch.setenv(name, value)
    monkeypatch.setenv("KVOFFLOAD_TENANTS", str(tenants))
    monkeypatch.setenv("KVOFFLOAD_ADMIN_TOKEN", "t" * 32)
    monkeypatch.delenv("KVOFFLOAD_ADMIN_TOKEN_FILE", raising=False)
    monkeypatch.setenv("KVOFFLOAD_METRICS_TOKEN", "m" * 32)  # its file is a mounted secret
    monkeypatch.delenv("KVOFFLOAD_METRICS_TOKEN_FILE", raising=False)
    return Settings(host="0.0.0.0")  # the image's entrypoint; refused without tenants


# --------------------------------------------------------------------------- image


def test_image_has_the_mooncake_extra_and_its_debian_libraries() -> None:
    instructions = dockerfile_instructions(DOCKERFILE)
    runs = [arg for word, arg in instructions if word == "RUN"]
    # The package with its extras: mooncake (this tier) and object (the object tier).
    assert any(re.search(r'"kvoffload\[[a-z,]*\bmooncake\b[a-z,]*\]"', run) for run in runs)
    # The libraries go into the runtime stage, the one that runs the service (installed there
    # from the distribution only when the base lacks them; deploy/tools/debian_base.sh has them).
    text = DOCKERFILE.read_text(encoding="utf-8")
    runtime = text[text.rindex("\nFROM ") :]
    for library in DEBIAN_LIBRARIES:
        assert library in runtime, f"the image lacks {library}"
    base = (DEPLOY / "tools" / "debian_base.sh").read_text(encoding="utf-8")
    for library in DEBIAN_LIBRARIES:
        assert library in base, f"the registry-free base lacks {library}"
    assert 'import mooncake.store"' in runtime, "the build checks that the library loads"


# --------------------------------------------------------------------------- compose


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    data: dict[str, Any] = load_yaml(REMOTE_COMPOSE)
    return data


@pytest.fixture(scope="module")
def master_ports(compose) -> tuple[int, int]:
    master = compose["services"][MASTER]
    assert master["entrypoint"] == ["mooncake_master"]
    return _master_endpoints(_flags(master["command"]))


def test_compose_master_runs_from_the_service_image(compose, master_ports) -> None:
    services = compose["services"]
    master = services[MASTER]
    assert master["image"] == services[NODES[0]]["image"], "the extra brings mooncake_master"
    assert "ports" not in master, "only the nodes reach the master"
    # The image's own HEALTHCHECK polls the service's /livez: the master needs its own.
    check = " ".join(master["healthcheck"]["test"])
    for port in master_ports:
        assert str(port) in check


def test_compose_nodes_point_at_the_master_under_their_own_names(compose, master_ports) -> None:
    services = compose["services"]
    for name in NODES:
        env = services[name]["environment"]
        _check_points_at_master(env, MASTER, *master_ports)
        assert env["KVOFFLOAD_MOONCAKE_LOCAL_HOSTNAME"] == name, "where the other node reaches it"
        assert MASTER in services[name]["depends_on"]
        build = services[name]["build"]
        assert (DEPLOY / build["context"] / build["dockerfile"]).resolve() == DOCKERFILE.resolve()


def test_compose_nodes_have_tenants_secrets_and_loopback_ports(compose) -> None:
    services = compose["services"]
    published: list[str] = []
    for name in NODES:
        node = services[name]
        env = node["environment"]
        mounts = dict(str(v).split(":")[:2] for v in node["volumes"])
        (source,) = [s for s, target in mounts.items() if target == env["KVOFFLOAD_TENANTS"]]
        assert source.startswith("./secrets/"), "tenants files hold tokens: keep them in secrets/"
        assert compose_default(node["group_add"][0]).isdigit()
        assert sorted(node["secrets"]) == ["kvoffload_admin_token", "kvoffload_metrics_token"]
        for secret in node["secrets"]:
            variable = secret.removeprefix("kvoffload_").upper()
            assert env[f"KVOFFLOAD_{variable}_FILE"] == f"/run/secrets/{secret}"
            assert "file" in compose["secrets"][secret]
        pool = int(compose_default(env["KVOFFLOAD_NUM_BLOCKS"])) * int(
            compose_default(env["KVOFFLOAD_BLOCK_BYTES"])
        )
        assert pool <= parse_bytes(compose_default(node["shm_size"]))
        ports = [str(p) for p in node["ports"]]
        assert sorted(p.rsplit(":", 1)[1] for p in ports) == ["8000", "8001"]
        published += ports
    for name, service in services.items():
        if name not in NODES:
            published += [str(p) for p in service.get("ports", [])]
    assert all(p.startswith("127.0.0.1:") for p in published), published
    host_ports = [p.split(":")[1] for p in published]
    assert len(host_ports) == len(set(host_ports)), "two services publish one host port"


def test_compose_node_settings_are_accepted(
    compose, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "local.toml").write_text('tokens = ["' + "x" * 32 + '"]\nnamespaces = ["local"]\n')
    (tmp_path / "local.toml").chmod(0o640)
    for name in NODES:
        env = {k: compose_default(v) for k, v in compose["services"][name]["environment"].items()}
        settings = _settings(env, tmp_path, monkeypatch)
        assert settings.remote_tier == "mooncake"
        assert settings.mooncake_local_hostname == name
        _check_stops_in_time(settings, _seconds(compose["services"][name]["stop_grace_period"]))


def test_compose_prometheus_scrapes_both_nodes(compose) -> None:
    prom = compose["services"]["prometheus"]
    mounts = dict(v.split(":")[:2] for v in prom["volumes"] if v.startswith("./"))
    assert (DEPLOY / "prometheus" / "prometheus.remote.yml").exists()
    assert mounts["./prometheus/prometheus.remote.yml"] == "/etc/prometheus/prometheus.yml"
    config = load_yaml(REMOTE_PROMETHEUS)
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "kvoffload"]
    (static,) = job["static_configs"]
    assert sorted(static["targets"]) == [f"{n}:8000" for n in NODES]
    grafana = compose["services"]["grafana"]
    assert "./grafana/dashboards:/var/lib/grafana/dashboards:ro" in grafana["volumes"]


# --------------------------------------------------------------------------- Kubernetes


@pytest.fixture(scope="module")
def component() -> dict[str, Any]:
    data: dict[str, Any] = load_yaml(K8S_REMOTE / "kustomization.yaml")
    return data


@pytest.fixture(scope="module")
def k8s_objects(component) -> dict[tuple[str, str], dict[str, Any]]:
    found: dict[tuple[str, str], dict[str, Any]] = {}
    for name in component["resources"]:
        for doc in load_yaml_all(K8S_REMOTE / name):
            found[(doc["kind"], doc["metadata"]["name"])] = doc
    return found


@pytest.fixture(scope="module")
def patch(component) -> dict[str, Any]:
    (entry,) = component["patches"]
    data: dict[str, Any] = load_yaml(K8S_REMOTE / entry["path"])
    return data


@pytest.fixture(scope="module")
def master_pod(k8s_objects) -> dict[str, Any]:
    pod: dict[str, Any] = k8s_objects[("Deployment", MASTER)]["spec"]["template"]["spec"]
    return pod


@pytest.fixture(scope="module")
def base_daemonset() -> dict[str, Any]:
    (doc,) = [d for d in load_yaml_all(K8S / "daemonset.yaml") if d["kind"] == "DaemonSet"]
    assert isinstance(doc, dict)
    return doc


def _patched_container(base: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    """The kvoffload container with the patch applied as a strategic merge does for these
    keys: env entries merge by name, resources are replaced."""
    (container,) = base["spec"]["template"]["spec"]["containers"]
    (change,) = patch["spec"]["template"]["spec"]["containers"]
    assert change["name"] == container["name"]
    env = {e["name"]: e for e in container["env"]}
    env.update({e["name"]: e for e in change["env"]})
    return {**container, "env": list(env.values()), "resources": change["resources"]}


def _k8s_env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container["env"] if "value" in e}


def test_k8s_component_lists_every_file(component) -> None:
    assert component["kind"] == "Component", "inside its base's directory: not an overlay"
    listed = set(component["resources"]) | {p["path"] for p in component["patches"]}
    on_disk = {p.name for p in K8S_REMOTE.iterdir()} - {"kustomization.yaml"}
    assert listed == on_disk


def test_k8s_master_is_one_locked_down_replica_with_limits(k8s_objects, master_pod) -> None:
    deployment = k8s_objects[("Deployment", MASTER)]["spec"]
    assert deployment["replicas"] == 1, "metadata lives in one master's memory"
    assert deployment["strategy"]["type"] == "Recreate", "never two masters at once"
    (container,) = master_pod["containers"]
    assert container["command"] == ["mooncake_master"]
    resources = container["resources"]
    assert parse_bytes(resources["limits"]["memory"]) >= 2**28
    assert resources["requests"]["memory"] == resources["limits"]["memory"]
    assert "cpu" in resources["requests"]
    assert master_pod["securityContext"]["runAsNonRoot"] is True
    sc = container["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["capabilities"]["drop"] == ["ALL"]
    ports = {p["name"] for p in container["ports"]}
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert container[probe]["tcpSocket"]["port"] in ports, probe
    # Not selected by anything that selects the kvoffload pods (Services, policies, monitor).
    labels = k8s_objects[("Deployment", MASTER)]["spec"]["template"]["metadata"]["labels"]
    assert labels["app.kubernetes.io/name"] != "kvoffload"


def test_k8s_master_service_serves_its_rpc_and_metadata_ports(k8s_objects, master_pod) -> None:
    (container,) = master_pod["containers"]
    rpc, metadata = _master_endpoints(_flags(container["args"]))
    named = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert named["rpc"] == rpc
    assert named["metadata"] == metadata
    service = k8s_objects[("Service", MASTER)]["spec"]
    pod_labels = k8s_objects[("Deployment", MASTER)]["spec"]["template"]["metadata"]["labels"]
    assert service["selector"].items() <= pod_labels.items()
    by_target = {p["targetPort"]: p["port"] for p in service["ports"]}
    assert by_target["rpc"] == rpc
    assert by_target["metadata"] == metadata


def test_k8s_daemonset_patch_points_at_the_master_service(patch, master_pod) -> None:
    (container,) = master_pod["containers"]
    rpc, metadata = _master_endpoints(_flags(container["args"]))
    (change,) = patch["spec"]["template"]["spec"]["containers"]
    env = _k8s_env(change)
    _check_points_at_master(env, MASTER, rpc, metadata)
    (hostname,) = [e for e in change["env"] if e["name"] == "KVOFFLOAD_MOONCAKE_LOCAL_HOSTNAME"]
    # Other pods reach this one by its IP: a pod's host name does not resolve elsewhere.
    assert hostname["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert (patch["kind"], patch["metadata"]["name"]) == ("DaemonSet", "kvoffload")


def test_k8s_memory_holds_pools_and_the_nodes_share_of_the_store(
    base_daemonset, patch, objects_base
) -> None:
    container = _patched_container(base_daemonset, patch)
    env = _k8s_env(container)
    blocks, namespaces = 0, 0
    for (kind, _), doc in objects_base.items():
        if kind != "Secret" or "kvoffload.io/tenant" not in doc["metadata"]["labels"]:
            continue
        for text in doc["stringData"].values():
            spaces = tomllib.loads(text)["namespaces"]
            namespaces += len(spaces)
            if isinstance(spaces, dict):
                blocks += sum(spaces.values())
            else:
                blocks += len(spaces) * int(env["KVOFFLOAD_NUM_BLOCKS"])
    assert namespaces >= 2
    pools = blocks * int(env["KVOFFLOAD_BLOCK_BYTES"])
    # Every namespace's tier is a client of its own that gives the store its own segment.
    segments = namespaces * int(env["KVOFFLOAD_MOONCAKE_SEGMENT_BYTES"])
    resources = container["resources"]
    limit = parse_bytes(resources["limits"]["memory"])
    assert limit >= pools + segments + 2**30, "memory must hold pools, segments and process"
    assert resources["requests"]["memory"] == resources["limits"]["memory"]
    assert "cpu" in resources["requests"]


@pytest.fixture(scope="module")
def objects_base() -> dict[tuple[str, str], dict[str, Any]]:
    found: dict[tuple[str, str], dict[str, Any]] = {}
    for name in load_yaml(K8S / "kustomization.yaml")["resources"]:
        for doc in load_yaml_all(K8S / name):
            found[(doc["kind"], doc["metadata"]["name"])] = doc
    return found


def test_k8s_patched_node_settings_are_accepted(
    base_daemonset, patch, objects_base, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    container = _patched_container(base_daemonset, patch)
    env = _k8s_env(container)
    env["KVOFFLOAD_MOONCAKE_LOCAL_HOSTNAME"] = "10.0.0.7"  # the downward API's pod IP
    files = {
        key: text
        for (kind, _), doc in objects_base.items()
        if kind == "Secret" and "kvoffload.io/tenant" in doc["metadata"]["labels"]
        for key, text in doc["stringData"].items()
    }
    write_secret_volume(tmp_path, files, 0o440)
    settings = _settings(env, tmp_path, monkeypatch)
    assert settings.remote_tier == "mooncake"
    assert settings.mooncake_segment_bytes == int(env["KVOFFLOAD_MOONCAKE_SEGMENT_BYTES"])
    _check_stops_in_time(
        settings, patch["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    )


def _peers(rule: dict[str, Any]) -> list[dict[str, str]]:
    return [peer["podSelector"]["matchLabels"] for peer in rule["from"]]


def test_k8s_network_policies_admit_the_nodes_to_the_master_and_each_other(
    k8s_objects, patch, master_pod
) -> None:
    node = {"app.kubernetes.io/name": "kvoffload"}
    (container,) = master_pod["containers"]
    rpc, metadata = _master_endpoints(_flags(container["args"]))
    master = k8s_objects[("NetworkPolicy", MASTER)]["spec"]
    assert master["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": MASTER}
    from_nodes = [r for r in master["ingress"] if node in _peers(r)]
    (rule,) = from_nodes
    assert {p["port"] for p in rule["ports"]} == {rpc, metadata}
    for rule in master["ingress"]:
        assert rule.get("from"), "every rule names its peers"
        assert rule.get("ports"), "every rule names its ports"
    # Node to node: exactly the ports the transfer engines are told to listen on.
    peers = k8s_objects[("NetworkPolicy", "kvoffload-remote-tier")]["spec"]
    assert peers["podSelector"]["matchLabels"] == node
    (rule,) = peers["ingress"]
    assert _peers(rule) == [node]
    (ports,) = rule["ports"]
    (change,) = patch["spec"]["template"]["spec"]["containers"]
    env = _k8s_env(change)
    assert (ports["port"], ports["endPort"]) == (
        int(env["MC_MIN_RPC_PORT"]),
        int(env["MC_MAX_RPC_PORT"]),
    )


@pytest.mark.skipif(KUBECTL is None, reason="kubectl not on PATH (kubectl kustomize renders)")
def test_k8s_component_renders_with_the_base(tmp_path: Path) -> None:
    rendered = kustomize_with(["remote"], tmp_path)
    names = {(d["kind"], d["metadata"]["name"]) for d in rendered}
    assert {("Deployment", MASTER), ("Service", MASTER), ("NetworkPolicy", MASTER)} <= names
    (daemonset,) = [d for d in rendered if d["kind"] == "DaemonSet"]
    (container,) = daemonset["spec"]["template"]["spec"]["containers"]
    env = {e["name"] for e in container["env"]}
    assert {"KVOFFLOAD_REMOTE_TIER", "KVOFFLOAD_TENANTS", "KVOFFLOAD_MOONCAKE_MASTER"} <= env
    assert container["resources"]["limits"]["memory"] == "15Gi"
    for doc in rendered:
        if doc["kind"] != "Namespace":
            assert doc["metadata"]["namespace"] == "kvoffload", doc["metadata"]["name"]
        assert doc["metadata"]["labels"]["app.kubernetes.io/part-of"] == "kvoffload"


def test_the_tiers_page_tells_how_to_deploy_the_remote_tier() -> None:
    page = TIERS_DOC.read_text(encoding="utf-8")
    assert "docker-compose.remote.yml" in page
    assert "components: [../../deploy/k8s/remote]" in page


# --------------------------------------------------------------------------- HA masters

HA_COMPOSE = DEPLOY / "docker-compose.ha.yml"


def _etcd_members(statefulset: dict[str, Any], service: str) -> list[str]:
    replicas = statefulset["spec"]["replicas"]
    name = statefulset["metadata"]["name"]
    namespace = statefulset["metadata"]["namespace"]
    return [f"{name}-{i}.{service}.{namespace}.svc:2379" for i in range(replicas)]


@pytest.mark.skipif(KUBECTL is None, reason="kubectl not on PATH (kubectl kustomize renders)")
def test_k8s_ha_component_names_every_etcd_member_to_masters_and_nodes(tmp_path: Path) -> None:
    rendered = kustomize_with(["remote", "remote-ha"], tmp_path)
    by_name = {(d["kind"], d["metadata"]["name"]): d for d in rendered}
    etcd = by_name[("StatefulSet", "etcd")]
    assert etcd["spec"]["replicas"] >= 3, "a quorum must survive a lost member"
    assert by_name[("Service", "etcd")]["spec"]["clusterIP"] == "None"
    members = _etcd_members(etcd, etcd["spec"]["serviceName"])
    (etcd_container,) = etcd["spec"]["template"]["spec"]["containers"]
    cluster = next(a for a in etcd_container["args"] if a.startswith("--initial-cluster="))
    for i, member in enumerate(members):
        assert f"etcd-{i}=http://{member.replace(':2379', ':2380')}" in cluster

    master = by_name[("Deployment", MASTER)]
    assert master["spec"]["replicas"] == 2
    assert master["spec"]["strategy"]["type"] == "RollingUpdate"
    (mc,) = master["spec"]["template"]["spec"]["containers"]
    args = mc["args"]
    assert {"--enable_ha=true", "--enable_oplog=true", "--rpc_address=$(POD_IP)"} <= set(args)
    assert f"--etcd_endpoints={';'.join(members)}" in args
    assert not any(a.startswith("--enable_http_metadata_server") for a in args)
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert mc[probe]["tcpSocket"]["port"] == "metrics", "the standby serves no RPC"

    (daemonset,) = [d for d in rendered if d["kind"] == "DaemonSet"]
    (container,) = daemonset["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    wanted = "etcd://" + ";".join(members)
    assert env["KVOFFLOAD_MOONCAKE_MASTER"] == env["KVOFFLOAD_MOONCAKE_METADATA"] == wanted
    assert master_problem(wanted) is None
    assert metadata_problem(wanted) is None
    policy = by_name[("NetworkPolicy", "etcd")]
    admitted = {
        peer["podSelector"]["matchLabels"]["app.kubernetes.io/name"]
        for rule in policy["spec"]["ingress"]
        for peer in rule["from"]
    }
    assert admitted == {MASTER, "kvoffload", "etcd"}


def test_compose_ha_file_turns_the_remote_stack_into_ha_masters() -> None:
    ha = load_yaml(HA_COMPOSE)["services"]
    assert {"etcd", MASTER, f"{MASTER}-standby", *NODES} <= set(ha)
    for master in (MASTER, f"{MASTER}-standby"):
        (command,) = ha[master]["command"]
        for flag in ("--enable_ha=true", "--etcd_endpoints=etcd:2379", "--enable_oplog=true"):
            assert flag in command, (master, flag)
        assert ha[master]["depends_on"]["etcd"]["condition"] == "service_healthy"
    for node in NODES:
        env = ha[node]["environment"]
        assert env["KVOFFLOAD_MOONCAKE_MASTER"] == env["KVOFFLOAD_MOONCAKE_METADATA"]
        assert master_problem(env["KVOFFLOAD_MOONCAKE_MASTER"]) is None
    page = TIERS_DOC.read_text(encoding="utf-8")
    assert "docker-compose.ha.yml" in page
    assert "../../deploy/k8s/remote-ha" in page
