"""A compose stack of deploy/ run for real, a Prometheus on the host, and the figures a run of
``make test-deploy`` reports."""

from __future__ import annotations

import importlib.util
import json
import os
import secrets
import shutil
import subprocess
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

import httpx

from tests.e2e.prometheus import running_prometheus
from testsupport.polling import until

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
# What the run measured, printed at the end of the session and written here.
REPORT_FILE = ROOT / "build" / "test-deploy.json"
LOG_DIR = ROOT / "build" / "test-deploy-logs"
# Docker Compose v2 (the CLI plugin) and Debian's docker-compose 1.29: each stack is run by one,
# so both are shown to run the files, not only to parse them.
COMPOSE_V2 = ("docker", "compose")
COMPOSE_V1 = ("docker-compose",)
HEALTHY_WITHIN_S = 120.0
# Lines of each container's log that a failed wait shows (each line cut to LOG_LINE_CHARS: the
# Mooncake master logs a line of several KB every 10 s).
LOG_TAIL = 40
LOG_LINE_CHARS = 400
# The label Compose (v2 and 1.29) puts on every container and volume of a project.
PROJECT_LABEL = "com.docker.compose.project"
SERVICE_LABEL = "com.docker.compose.service"

T = TypeVar("T")


@dataclass
class Report:
    """Figures and answers of one run, in the order they were recorded."""

    entries: dict[str, Any] = field(default_factory=dict)

    def record(self, key: str, value: Any) -> None:
        self.entries[key] = value
        REPORT_FILE.parent.mkdir(parents=True, exist_ok=True)
        REPORT_FILE.write_text(json.dumps(self.entries, indent=2) + "\n", encoding="utf-8")


REPORT = Report()


def run(cmd: Sequence[str], *, timeout: float = 300, check: bool = True, **kw: Any) -> str:
    """``cmd``'s stdout; a failure raises with its stderr (bounded by ``timeout``)."""
    proc = subprocess.run(
        list(cmd), capture_output=True, text=True, timeout=timeout, check=False, **kw
    )
    if check and proc.returncode != 0:
        said = f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}:\n{said}")
    out: str = proc.stdout
    return out


def compose_version(compose: Sequence[str]) -> str:
    return run([*compose, "version"], timeout=30).strip().splitlines()[0]


@dataclass(frozen=True)
class Project:
    """A copy of deploy/ with fresh secrets of its own (the checkout's deploy/secrets is never
    touched): an admin, a scrape and a tenant token (tenant ``local``, namespace ``local``)."""

    dir: Path
    admin_token: str
    metrics_token: str
    engine_token: str

    @classmethod
    def make(cls, where: Path) -> Project:
        project = where / "deploy"
        shutil.copytree(DEPLOY, project, ignore=shutil.ignore_patterns("secrets", "__pycache__"))
        sec = project / "secrets"
        sec.mkdir(mode=0o750)
        tokens = {name: secrets.token_hex(32) for name in ("admin", "metrics", "engine")}
        files = {
            "kvoffload_admin_token": tokens["admin"],
            "kvoffload_metrics_token": tokens["metrics"],
            "kvoffload_engine_token": tokens["engine"],
            "grafana_admin_password": secrets.token_hex(16),
        }
        for name, value in files.items():
            _private(sec / name, value + "\n")
        (sec / "tenants").mkdir(mode=0o750)
        _private(
            sec / "tenants" / "local.toml",
            f'tokens = ["{tokens["engine"]}"]\nnamespaces = ["local"]\n',
        )
        return cls(project, tokens["admin"], tokens["metrics"], tokens["engine"])


def _private(path: Path, text: str) -> None:
    path.write_text(text, encoding="utf-8")
    path.chmod(0o640)


class Stack:
    """One compose project of ``files`` (in ``project``), run by ``compose``."""

    def __init__(
        self,
        project: Project,
        name: str,
        files: Sequence[str],
        compose: Sequence[str],
        image: str,
        **env: str,
    ) -> None:
        self.project = project
        self.name = name
        self.compose = tuple(compose)
        self.args = [a for f in files for a in ("-f", str(project.dir / f))]
        self.env = {
            **os.environ,
            "IMAGE": image,
            # The tenants files are the test's (its group: root's when CI runs as root).
            "TENANTS_GID": str(os.getgid()),
            **env,
        }

    def __call__(self, *args: str, timeout: float = 300, check: bool = True) -> str:
        return run(
            [*self.compose, "-p", self.name, *self.args, *args],
            timeout=timeout,
            check=check,
            env=self.env,
            cwd=self.project.dir,
        )

    def container(self, service: str) -> str:
        (cid,) = self("ps", "-q", service).split()
        return cid

    def up(self, services: Sequence[str]) -> None:
        self("up", "-d", "--no-build", *services)

    def leftovers(self) -> list[str]:
        """This project's containers (name and status) and volumes now: none, unless a run was
        cut short before its teardown (CI's job killed, ^C twice, a reboot)."""
        label = f"label={PROJECT_LABEL}={self.name}"
        containers = run(
            ["docker", "ps", "-a", "--filter", label, "--format", "{{.Names}}: {{.Status}}"]
        ).split("\n")
        volumes = run(["docker", "volume", "ls", "-q", "--filter", label]).split()
        return [c for c in containers if c] + [f"volume {v}" for v in volumes]

    def clear(self) -> None:
        """Take down, with its volumes, whatever an earlier run left of this project, so that the
        stack starts from nothing. Compose would otherwise keep or restart the old containers:
        after an HA run cut short past its SIGKILL, ``up mooncake-master`` restarts the killed
        master while the old standby, still up, holds the leader key in etcd, and the master
        stands by for good."""
        left = self.leftovers()
        if not left:
            return
        REPORT.record(f"{self.name}: left by an earlier run, taken down first", left)
        self("down", "-v", "--remove-orphans", "-t", "5", timeout=180)
        volumes = [v.removeprefix("volume ") for v in self.leftovers() if v.startswith("volume ")]
        if volumes:
            run(["docker", "volume", "rm", "-f", *volumes], timeout=60)
        still = self.leftovers()
        assert not still, f"{self.name}: still there after taking it down: {still}"

    def describe(self, services: Sequence[str] = ()) -> str:
        """What ``services`` (all of the project's if none) say: each container's state (exit
        code, restarts, start) and the last LOG_TAIL lines of its log, with Docker's
        timestamps (a restarted container's log holds its earlier runs' lines too)."""
        label = f"label={PROJECT_LABEL}={self.name}"
        ids = run(["docker", "ps", "-aq", "--filter", label], check=False).split()
        state = (
            '{{.Name}} [{{index .Config.Labels "' + SERVICE_LABEL + '"}}] '
            "{{.State.Status}} exit={{.State.ExitCode}} restarts={{.RestartCount}} "
            "started={{.State.StartedAt}} "
            "health={{if .State.Health}}{{.State.Health.Status}}{{else}}-{{end}}"
        )
        said = []
        for cid in ids:
            head = run(["docker", "inspect", "-f", state, cid], check=False).strip()
            service = head.split("[", 1)[-1].split("]", 1)[0]
            if services and service not in services:
                continue
            proc = subprocess.run(
                ["docker", "logs", "--timestamps", "--tail", str(LOG_TAIL), cid],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                timeout=60,
                check=False,
            )
            lines = [ln[:LOG_LINE_CHARS] for ln in proc.stdout.splitlines()]
            said.append("\n".join([f"--- {head.lstrip('/')}", *lines]))
        return "\n".join(said) if said else f"(no containers of {self.name})"

    def wait_for(
        self,
        what: str,
        probe: Callable[[], T | None],
        within_s: float,
        services: Sequence[str] = (),
        also: Callable[[], str] | None = None,
    ) -> T:
        """testsupport.polling.until, whose AssertionError also shows ``describe(services)``
        and what ``also`` says, so that a failed wait explains itself."""
        try:
            return until(what, probe, within_s)
        except AssertionError as e:
            said = [_said(also)] if also is not None else []
            said.append(_said(lambda: self.describe(services)))
            raise AssertionError("\n".join([str(e), *said])) from None

    def wait_healthy(self, services: Sequence[str]) -> float:
        """Seconds from now until every service's container reports healthy."""
        started = time.monotonic()
        ids = {s: self.container(s) for s in services}

        def all_healthy() -> bool | None:
            states = {
                s: run(["docker", "inspect", "-f", "{{.State.Health.Status}}", c]).strip()
                for s, c in ids.items()
            }
            bad = {s: st for s, st in states.items() if st == "unhealthy"}
            assert not bad, f"unhealthy: {bad}\n{self.logs()}"
            return True if set(states.values()) == {"healthy"} else None

        self.wait_for(f"{', '.join(services)} healthy", all_healthy, HEALTHY_WITHIN_S)
        return time.monotonic() - started

    def engine(self, service: str, *args: str) -> dict[str, Any]:
        """``cpu-engine ARGS`` in a new container of ``service``: its one JSON line (it must
        exit 0)."""
        out = self("run", "--rm", "-T", service, *args, timeout=120)
        result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
        return result

    def volume_dir(self, volume: str) -> Path:
        """Where the named volume ``volume`` of this project lies on the host."""
        name = f"{self.name}_{volume}"
        return Path(run(["docker", "volume", "inspect", "-f", "{{.Mountpoint}}", name]).strip())

    def logs(self) -> str:
        return self("logs", "--no-color", "--tail", "200", check=False, timeout=60)

    def down(self) -> None:
        LOG_DIR.mkdir(parents=True, exist_ok=True)
        (LOG_DIR / f"{self.name}.log").write_text(self.logs(), encoding="utf-8")
        self("down", "-v", "--remove-orphans", "-t", "20", timeout=180, check=False)


def _said(diagnose: Callable[[], str]) -> str:
    """What ``diagnose`` says, or how it failed: a diagnosis never hides the failure it is for."""
    try:
        return diagnose()
    except Exception as e:
        return f"(diagnosis failed: {e!r})"


def cpu_engine() -> ModuleType:
    """deploy/tools/cpu_engine.py as a module, for an engine on the host."""
    spec = importlib.util.spec_from_file_location("cpu_engine", DEPLOY / "tools" / "cpu_engine.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextmanager
def host_prometheus(workdir: Path, targets: Sequence[str], token: str) -> Iterator[str]:
    """Debian's Prometheus on the host, scraping ``targets`` (host:port) every second with the
    scrape token, as deploy/prometheus does in compose; its base URL."""
    workdir.mkdir(parents=True, exist_ok=True)
    token_file = workdir / "token"
    _private(token_file, token + "\n")
    listed = ", ".join(f"'{t}'" for t in targets)
    config = (
        "global: {scrape_interval: 1s, scrape_timeout: 1s}\n"
        "scrape_configs:\n"
        "  - job_name: kvoffload\n"
        f"    authorization: {{type: Bearer, credentials_file: {token_file}}}\n"
        f"    static_configs: [{{targets: [{listed}]}}]\n"
    )
    with running_prometheus(workdir, config, 30) as url:
        yield url


def promql(url: str, query: str) -> list[dict[str, Any]]:
    r = httpx.get(f"{url}/api/v1/query", params={"query": query}, timeout=5)
    r.raise_for_status()
    result: list[dict[str, Any]] = r.json()["data"]["result"]
    return result


def scraped(
    url: str, query: str, within_s: float = 30, instances: Collection[str] = ()
) -> dict[str, float]:
    """``query``'s value per instance once Prometheus has one for it (> 0), and for every one
    of ``instances`` (its targets are scraped at offsets of their own within the interval, so
    the first answer may hold only some of them), within the bound."""

    def probe() -> dict[str, float] | None:
        found = {s["metric"].get("instance", ""): float(s["value"][1]) for s in promql(url, query)}
        if not found or not all(v > 0 for v in found.values()) or not set(instances) <= set(found):
            return None
        return found

    return until(f"Prometheus to answer {query}", probe, within_s)
