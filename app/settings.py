"""Service settings: defaults < config file < ``KVOFFLOAD_*`` environment < command-line flags.

``Settings`` is the one description of every knob. ``kvoffload serve`` builds its flags from the
fields (``--num-blocks`` for ``num_blocks``), the environment is read with the ``KVOFFLOAD_``
prefix (``KVOFFLOAD_NUM_BLOCKS``, ``KVOFFLOAD_ADMIN_TOKEN``), and ``config`` (flag ``--config``,
env ``KVOFFLOAD_CONFIG``) names a TOML or JSON file whose top-level keys are field names.

Validation happens at construction; an invalid combination (an admin listener on a non-loopback
address without a token, a lease TTL shorter than a transfer deadline) raises ``ValueError``
(pydantic's ``ValidationError``) so the service refuses to start instead of running unsafely.
"""

from __future__ import annotations

import ipaddress
import json
import re
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from app.pool_share import default_pool_socket

_DEVICE = re.compile(r"auto|cpu|cuda(:[0-9]+)?")
LogLevel = Literal["debug", "info", "warning", "error"]
LogFormat = Literal["auto", "json", "console"]


class ConfigFileSource(PydanticBaseSettingsSource):
    """Values from the file named by ``config`` in a higher-priority source (flag or env).

    ``.toml`` files are read with ``tomllib``, ``.json`` files with ``json``; the top level must
    be a table/object of field names. A missing or unreadable file is an error, not a silent
    fallback to defaults.
    """

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        # Not used: __call__ returns the whole file at once.
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        path = self.current_state.get("config")
        if path is None:
            return {}
        return load_config_file(Path(path))


def load_config_file(path: Path) -> dict[str, Any]:
    """Parse a TOML or JSON settings file (chosen by suffix) into a dict of field values."""
    suffix = path.suffix.lower()
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"cannot read config file {path}: {exc.strerror}") from None
    try:
        if suffix == ".toml":
            data: Any = tomllib.loads(text)
        elif suffix == ".json":
            data = json.loads(text)
        else:
            raise ValueError(f"config file {path} must end in .toml or .json")
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"config file {path} is not valid {suffix[1:].upper()}: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"config file {path} must hold a table of settings at the top level")
    return data


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback IP literals (127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Settings(BaseSettings):
    """Every setting of the service; see the module docstring for where values come from."""

    model_config = SettingsConfigDict(
        env_prefix="KVOFFLOAD_",
        extra="forbid",
        validate_default=True,
        # Flags and env are strings; JSON-valued fields (policy_params) are parsed from JSON.
        env_parse_none_str="",
    )

    config: Path | None = Field(default=None, description="TOML or JSON settings file")

    # Listeners.
    host: str = Field(default="127.0.0.1", description="engine API address")
    port: int = Field(default=8000, ge=0, le=65535, description="engine API port (0: any)")
    uds: Path | None = Field(default=None, description="also serve the engine API here")
    pool_socket: Path | None = Field(
        default=None,
        description="hand the pool to engines on this Unix socket (default with uds: UDS.pool)",
    )
    admin_host: str = Field(default="127.0.0.1", description="admin API address")
    admin_port: int = Field(default=8001, ge=0, le=65535, description="admin port (0: any)")
    admin_token: SecretStr | None = Field(default=None, description="admin bearer token")
    admin_token_file: Path | None = Field(default=None, description="file with the token")

    # Pool and policy.
    num_blocks: int = Field(default=4096, gt=0, description="host pool size in blocks")
    block_bytes: int = Field(default=65536, gt=0, description="bytes per host block")
    policy: str = Field(default="lru", description="eviction policy name")
    policy_params: dict[str, Any] = Field(
        default_factory=dict, description="policy parameters (JSON object)"
    )
    store_threshold: int = Field(default=0, ge=0, description="admit a block on its N-th offer")
    device: str = Field(default="auto", description="transfer device: auto, cpu or cuda:N")
    pin_memory: bool | None = Field(default=None, description="pin the pool (default: if CUDA)")
    shm_dir: Path = Field(default=Path("/dev/shm"), description="where the pool file lives")

    # Leases, jobs, limits.
    lease_ttl_s: float = Field(default=300.0, gt=0, description="free leases silent this long")
    lease_check_interval_s: float = Field(default=1.0, gt=0, description="lease sweep period")
    request_idle_ttl_s: float | None = Field(
        default=None,
        gt=0,
        description="forget requests holding nothing silent this long (default: 4 x lease TTL)",
    )
    job_deadline_s: float = Field(default=30.0, gt=0, description="a transfer past this fails")
    abort_writer_deadline_s: float = Field(
        default=30.0,
        gt=0,
        description="free an aborted store's slot if the engine has not reported it this long",
    )
    job_wait_max_s: float = Field(default=30.0, gt=0, description="longest POST /v1/jobs/wait")
    max_keys_per_call: int = Field(default=8192, gt=0, description="more keys in one op: 413")
    max_batch_ops: int = Field(default=1024, gt=0, description="more ops in one batch: 413")
    max_body_bytes: int = Field(
        default=8 << 20,
        gt=0,
        description="larger bodies: 413 (each route's own cap, derived from the limits, may be "
        "lower: app/limits.py)",
    )
    max_transfer_params_bytes: int = Field(
        default=16 << 10,
        gt=0,
        description="larger kv_transfer_params (as compact JSON) on a request: 413",
    )
    event_buffer_size: int = Field(default=65536, gt=0, description="KV events kept")
    max_finished_jobs: int = Field(default=10000, gt=0, description="finished jobs kept")

    # Fault injection (rehearse failures): any non-zero value wraps the worker.
    fault_fail_rate: float = Field(default=0.0, ge=0, le=1, description="jobs that fail")
    fault_delay_s: float = Field(default=0.0, ge=0, description="delay added to every job")
    fault_hang_rate: float = Field(default=0.0, ge=0, le=1, description="jobs that hang")
    fault_seed: int | None = Field(default=None, description="seed of the fault injector")

    # Observability.
    metrics_enabled: bool = Field(default=True, description="serve /metrics and record metrics")
    metrics_live_requests: bool = Field(
        default=False, description="export kvoffload_request_blocks{req_id} for live requests"
    )
    metrics_live_requests_max: int = Field(
        default=500, gt=0, description="at most this many live requests in that table"
    )
    metrics_hit_window: int = Field(
        default=1000, gt=0, description="lookups in the live prefix hit ratio window"
    )
    log_level: LogLevel = Field(default="info", description="log level (live: admin API)")
    log_format: LogFormat = Field(
        default="auto", description="json, console, or auto (console on a terminal)"
    )

    # Shadow evaluation: every policy simulated on a sample of finished requests.
    shadow_enabled: bool = Field(default=True, description="project each policy's hit ratio")
    shadow_policies: list[str] | None = Field(
        default=None,
        description="policies to simulate, comma-separated (default: all; active always added)",
    )
    shadow_sample_rate: float = Field(
        default=0.25, gt=0, le=1, description="share of request prefix trees simulated"
    )
    shadow_window: int = Field(default=2000, gt=0, description="sampled requests per window")
    shadow_max_queue: int = Field(default=1000, gt=0, description="chains waiting, at most")
    shadow_drain_interval_s: float = Field(
        default=0.1, gt=0, description="the simulation runs this often"
    )
    shadow_cpu_budget: float = Field(
        default=0.05, gt=0, le=1, description="share of one core the simulation may use"
    )

    # Process.
    shutdown_grace_s: float = Field(default=10.0, ge=0, description="wait for calls on exit")
    shutdown_delay_s: float = Field(
        default=0.0, ge=0, description="on SIGTERM, stay up not-ready this long"
    )

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """Flags (init kwargs) > environment > config file > defaults; no dotenv, no secrets dir."""
        return init_settings, env_settings, ConfigFileSource(settings_cls)

    @field_validator("device")
    @classmethod
    def _check_device(cls, value: str) -> str:
        if not _DEVICE.fullmatch(value):
            raise ValueError(f"device must be auto, cpu or cuda:N, got {value!r}")
        return value

    @field_validator("log_level", mode="before")
    @classmethod
    def _lower_level(cls, value: Any) -> Any:
        return value.lower() if isinstance(value, str) else value

    @field_validator("shadow_policies", mode="before")
    @classmethod
    def _split_policies(cls, value: Any) -> Any:
        # Flags and env give "lru,arc"; a JSON list (env, config file) is taken as it is.
        if isinstance(value, str):
            text = value.strip()
            if text.startswith("["):
                return json.loads(text)
            return [name.strip() for name in text.split(",") if name.strip()]
        return value

    @field_validator("shadow_policies")
    @classmethod
    def _known_policies(cls, value: list[str] | None) -> list[str] | None:
        if value is None:
            return None
        from manager import available_policies

        known = available_policies()
        unknown = [name for name in value if name not in known]
        if unknown:
            raise ValueError(f"unknown shadow policies {unknown}; known: {', '.join(known)}")
        if not value:
            raise ValueError("shadow_policies is empty (use shadow_enabled=false to turn off)")
        return value

    @property
    def effective_request_idle_ttl_s(self) -> float:
        """Idle TTL of requests holding no lease: the setting, else four lease TTLs."""
        if self.request_idle_ttl_s is not None:
            return self.request_idle_ttl_s
        return 4 * self.lease_ttl_s

    @property
    def effective_pool_socket(self) -> Path | None:
        """Where engines receive the pool (``app.pool_share``): ``pool_socket``, else ``uds``
        plus ``.pool``, else nowhere (no Unix socket at all)."""
        if self.pool_socket is not None:
            return self.pool_socket
        if self.uds is not None:
            return Path(default_pool_socket(str(self.uds)))
        return None

    @model_validator(mode="after")
    def _check_combination(self) -> Settings:
        if self.uds is not None and self.effective_pool_socket == self.uds:
            raise ValueError(f"pool_socket and uds are the same path: {self.uds}")
        if self.admin_token is not None and self.admin_token_file is not None:
            raise ValueError("set admin_token or admin_token_file, not both")
        if self.admin_token_file is not None:
            # Read once, at startup; from here on the token is held like one from the env.
            self.admin_token = SecretStr(self._read_token_file(self.admin_token_file))
            self.admin_token_file = None
        if self.admin_token is not None and not self.admin_token.get_secret_value():
            raise ValueError("admin token is empty")
        if self.admin_token is None and not is_loopback(self.admin_host):
            raise ValueError(
                f"refusing an admin listener on non-loopback {self.admin_host!r} without a token "
                "(set KVOFFLOAD_ADMIN_TOKEN or --admin-token-file)"
            )
        if self.lease_ttl_s <= self.job_deadline_s:
            # A lease that expires while its transfer may still run would free a slot that a
            # copy is writing into.
            raise ValueError(
                f"lease_ttl_s ({self.lease_ttl_s}) must exceed job_deadline_s "
                f"({self.job_deadline_s})"
            )
        if self.fault_fail_rate + self.fault_hang_rate > 1:
            raise ValueError("fault_fail_rate + fault_hang_rate must be at most 1")
        return self

    @staticmethod
    def _read_token_file(path: Path) -> str:
        try:
            token = path.read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise ValueError(f"cannot read admin token file {path}: {exc.strerror}") from None
        if not token:
            raise ValueError(f"admin token file {path} is empty")
        return token

    def admin_token_value(self) -> str | None:
        """The admin token in clear (None: the admin API is open, loopback only)."""
        return None if self.admin_token is None else self.admin_token.get_secret_value()

    @property
    def transfer_backend(self) -> str:
        """Backend name for ``transfer.create_worker`` derived from ``device``."""
        return "cuda" if self.device.startswith("cuda") else self.device

    @property
    def faults_enabled(self) -> bool:
        """True when any fault-injection knob is set."""
        return bool(self.fault_fail_rate or self.fault_delay_s or self.fault_hang_rate)
