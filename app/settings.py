"""Service settings: defaults < config file < ``KVOFFLOAD_*`` environment < command-line flags.

``Settings`` is the one description of every knob. ``kvoffload serve`` builds its flags from the
fields (``--num-blocks`` for ``num_blocks``), the environment is read with the ``KVOFFLOAD_``
prefix (``KVOFFLOAD_NUM_BLOCKS``, ``KVOFFLOAD_ADMIN_TOKEN``), and ``config`` (flag ``--config``,
env ``KVOFFLOAD_CONFIG``) names a TOML or JSON file whose top-level keys are field names.
Sizes (every ``*_bytes``: ``ByteSize``) take units there as in flags and variables (``100M``,
``64KiB``: ``parse_size``). A ``KVOFFLOAD_*`` variable no one reads is told at start
(``unknown_variables``); a file holding a secret that others may read is refused.

Validation happens at construction; an invalid value or combination (an unknown policy or
policy parameter, an admin listener on a non-loopback address without a token, an engine
listener on one without a tenants file, a lease TTL shorter than a transfer deadline) raises
``ValueError`` (pydantic's ``ValidationError``) so the service refuses to start instead of
running unsafely. ``load_settings`` turns every such refusal into a ``ConfigError``: one line
naming the setting's flag and variable (``setting_names``), or for a value the config file
gave, the file and its key; the value given and what is accepted; ``kvoffload serve`` prints it
and exits 2. The rooms above raise ``ConfigError`` too
for what only starting can find out (a busy port, a device the machine lacks, an unusable
tenants file).

``AdminAuth`` holds the admin token's sources alone (``--admin-token-file``,
``KVOFFLOAD_ADMIN_TOKEN``, ``KVOFFLOAD_ADMIN_TOKEN_FILE``, the config file); ``Settings``
inherits it, and ``kvoffload admin`` reads its token through it, so both read the same sources
the same way.
"""

from __future__ import annotations

import contextlib
import difflib
import ipaddress
import json
import os
import re
import stat
import string
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar, get_args

from kvoffload_client.client import TokenFileError
from kvoffload_client.client import read_token_file as read_private_token_file
from kvoffload_client.pool_socket import default_pool_socket
from pydantic import (
    BeforeValidator,
    Field,
    SecretStr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo
from pydantic_core import ErrorDetails
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
)

from manager import PolicyError, UnknownPolicyError, available_policies
from manager.policies import canonical_policy_name, policy_class

_DEVICE = re.compile(r"auto|cpu|cuda(:[0-9]+)?")
LogLevel = Literal["debug", "info", "warning", "error"]
LogFormat = Literal["auto", "json", "console"]
ENV_PREFIX = "KVOFFLOAD_"
# Settings set without a flag of their own (a token on the command line would show in ``ps``),
# and flags not named after their field.
_NO_FLAG = frozenset({"admin_token", "metrics_token"})
_FLAG_NAMES = {"policy_params": "--policy-param"}
_HIDDEN = frozenset({"admin_token", "metrics_token"})
# File modes: written and shown in octal (0600), as chmod takes them.
OCTAL_SETTINGS = frozenset({"uds_mode"})
_OCTAL_MODE = re.compile(r"(0o)?([0-7]{1,4})")
# Unix socket modes: read and write for the owner, maybe for the group, nothing else (connecting
# needs write; execute means nothing on a socket).
_UDS_MODE_ALLOWED = 0o660
_UDS_MODE_REQUIRED = 0o600
UdsAuth = Literal["token", "file-mode"]
RemoteTierName = Literal["none", "mooncake"]
_S = TypeVar("_S", bound="AdminAuth")

# Sizes in bytes: an integer, or a number and a unit as Kubernetes writes quantities (K, M, G, T
# and P are powers of 1000; Ki, Mi, Gi, Ti and Pi powers of 1024; a B after either is allowed,
# and the case of the letters is not read): 214748364800 is 200Gi, 200GiB or 200 GiB.
_SIZE = re.compile(r"([0-9]+(?:\.[0-9]+)?)\s*(?:([kmgtp])(i)?)?b?", re.IGNORECASE)
_SIZE_PREFIXES = "kmgtp"
SIZE_ACCEPTED = (
    "accepted: a size in bytes: an integer, or a number with a unit: K, M, G, T (powers of "
    "1000) or Ki, Mi, Gi, Ti (powers of 1024), B optional (100M, 64KiB, 200GiB)"
)


def parse_size(value: Any) -> Any:
    """A size setting's value as written (``100M``, ``64KiB``, ``214748364800``) in bytes;
    ``ValueError`` saying what is accepted for one that is not a size (or not a whole number
    of bytes). Integers pass as they are: bounds are the field's."""
    if isinstance(value, bool):
        raise ValueError(SIZE_ACCEPTED)
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        text = value.strip()
        if text.lstrip("+-").isdigit():
            return value  # an integer: as pydantic reads one (a bound's refusal shows it so)
        match = _SIZE.fullmatch(text)
        if match is not None:
            number, prefix, binary = match.groups()
            scale = 1
            if prefix is not None:
                base = 1024 if binary else 1000
                scale = base ** (_SIZE_PREFIXES.index(prefix.lower()) + 1)
            whole, _, fraction = number.partition(".")
            numerator = int(whole + fraction) * scale
            denominator = 10 ** len(fraction)
            if numerator % denominator == 0:
                return numerator // denominator
    raise ValueError(SIZE_ACCEPTED)


ByteSize = Annotated[int, BeforeValidator(parse_size)]
"""A size setting (``*_bytes``): bytes, written as ``parse_size`` reads them."""


def format_size(value: int) -> str:
    """``value`` bytes as ``--help`` shows a size: with the largest unit dividing it
    (``64 KiB``, ``8 MiB``, ``100 MB``), else as an integer; ``parse_size`` reads it back."""
    for exponent in range(len(_SIZE_PREFIXES), 0, -1):
        for base, suffix in ((1024, "iB"), (1000, "B")):
            unit = base**exponent
            if value and value % unit == 0:
                return f"{value // unit} {_SIZE_PREFIXES[exponent - 1].upper()}{suffix}"
    return str(value)


def is_size(field: FieldInfo) -> bool:
    """Whether a setting is a size (``ByteSize``)."""
    return any(
        isinstance(item, BeforeValidator) and item.func is parse_size for item in field.metadata
    )


def _unknown_policy(exc: UnknownPolicyError, *, named: bool = False) -> str:
    """The reason and what is accepted, for an unknown policy name in a setting (``named``:
    saying which, for a setting that lists several)."""
    which = f"unknown {exc.name}" if named else "unknown policy"
    return (
        str(exc)
        .replace(f"unknown policy {exc.name!r}", which, 1)
        .replace("; available:", "; accepted:", 1)
    )


def flag_name(field: str) -> str | None:
    """The ``kvoffload serve`` flag of a setting (``--num-blocks``); None: no flag."""
    if field in _NO_FLAG:
        return None
    return _FLAG_NAMES.get(field, "--" + field.replace("_", "-"))


def setting_names(field: str) -> str:
    """How a user sets ``field``: ``--num-blocks / KVOFFLOAD_NUM_BLOCKS`` (the variable alone
    for a setting without a flag)."""
    env = ENV_PREFIX + field.upper()
    flag = flag_name(field)
    return env if flag is None else f"{flag} / {env}"


class ConfigError(ValueError):
    """A setting the service refuses to start with. ``str()`` is the one line told the user:
    the setting's flag and variable (or, for a value the ``--config`` file gave, the file and
    its key), the value given, why not and what is accepted.

    ``field``, ``value`` and ``reason`` are the parts of a line about one setting (None for
    other lines): ``load_or_refuse`` tells such a line again as the file's when the value came
    from the file."""

    def __init__(
        self,
        message: str,
        field: str | None = None,
        value: object = None,
        reason: str | None = None,
    ) -> None:
        super().__init__(message)
        self.field = field
        self.value = value
        self.reason = reason


def config_error(field: str, value: object, reason: str) -> ConfigError:
    """The ``ConfigError`` for ``field`` set to ``value`` (never shown for a secret)."""
    return ConfigError(
        f"{setting_names(field)} = {_shown(field, value)}: {reason}", field, value, reason
    )


def _shown(field: str, value: object) -> str:
    if field in _HIDDEN:
        return "[hidden]"
    if field in OCTAL_SETTINGS and isinstance(value, int) and not isinstance(value, bool):
        return repr(f"{value:04o}")
    if isinstance(value, Path):
        return repr(str(value))
    if isinstance(value, dict | list):
        return json.dumps(value, default=str)
    return repr(value)


def policy_params_accepted(policy: str) -> str:
    """The parameters ``policy`` takes, with their defaults (``protected_ratio (default 0.8)``),
    or ``none``; the registry's own defaults name them."""
    defaults = policy_class(policy).parse_params({})
    if not defaults:
        return "none"
    return ", ".join(f"{name} (default {value!r})" for name, value in sorted(defaults.items()))


# What pydantic's type errors accept, said the way a flag's value is written.
_ACCEPTED_BY_TYPE = {
    "int_parsing": "accepted: an integer",
    "int_from_float": "accepted: an integer",
    "float_parsing": "accepted: a number",
    "bool_parsing": "accepted: true or false (also 1/0, yes/no, on/off)",
    "dict_type": "accepted: a JSON object",
}
# pydantic's bound errors: which side of the bounds the value fell.
_OUT_OF_BOUNDS = {
    "greater_than": "too small",
    "greater_than_equal": "too small",
    "less_than": "too large",
    "less_than_equal": "too large",
}


def _number(value: object) -> str:
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def accepted_range(field: FieldInfo) -> str:
    """What a bounded numeric setting accepts, from its bounds: ``an integer from 0 to 65535``,
    ``a number greater than 0 and at most 1``."""
    annotation = field.annotation
    kind = "an integer" if int in (annotation, *get_args(annotation)) else "a number"
    if is_size(field):
        kind = "a size in bytes"
    bounds: dict[str, object] = {}
    for item in field.metadata:
        for name in ("gt", "ge", "lt", "le"):
            if hasattr(item, name):
                bounds[name] = getattr(item, name)
    if bounds.keys() == {"ge", "le"}:
        return f"{kind} from {_number(bounds['ge'])} to {_number(bounds['le'])}"
    words = {"gt": "greater than", "ge": "at least", "lt": "less than", "le": "at most"}
    return f"{kind} " + " and ".join(f"{words[k]} {_number(v)}" for k, v in bounds.items())


class _FileValues:
    """Which settings the ``--config`` file gave (not set by a flag or a variable, which win
    over it) and the file's path: a refusal of one of them names the file and its key, since
    the flag and variable it would name otherwise were never set."""

    def __init__(self, overrides: dict[str, Any]) -> None:
        path = overrides.get("config", _env_value("config"))
        self.path = None if path is None or path == "" else Path(path)
        data: dict[str, Any] = {}
        if self.path is not None:
            # Read again: the refusal being told came after the file loaded once.
            with contextlib.suppress(ConfigError):
                data = load_config_file(self.path)
        self.keys = frozenset(
            key for key in data if key not in overrides and _env_value(key) is None
        )

    def where(self) -> str:
        """``--config / KVOFFLOAD_CONFIG = 'PATH'``: the file, as a refusal names it."""
        return f"{setting_names('config')} = {_shown('config', self.path)}"

    def line(self, field: str, value: object, reason: str) -> str:
        """The refusal of ``field`` = ``value`` (a key of the file), naming the file and key."""
        return f"{self.where()}: key {field} = {_shown(field, value)}: {reason}"


def _env_value(field: str) -> str | None:
    """The ``KVOFFLOAD_<FIELD>`` variable's value, named in any case (as pydantic-settings
    reads it); None when unset."""
    name = (ENV_PREFIX + field).upper()
    return next((v for k, v in os.environ.items() if k.upper() == name), None)


#: ``KVOFFLOAD_*`` variables that are not settings but that kvoffload reads (the admin
#: command's, the vLLM tier's, the CUDA backend's switches) or its tests and deployments set.
OTHER_VARIABLES = frozenset(
    {
        "KVOFFLOAD_ADMIN_URL",
        "KVOFFLOAD_ADMIN_NAMESPACE",
        "KVOFFLOAD_TOKEN_FILE",
        "KVOFFLOAD_CUDA_BATCH_MEMCPY",
        "KVOFFLOAD_CUDA_RAW_MEMCPY",
        "KVOFFLOAD_IMAGE",
        "KVOFFLOAD_BASE_IMAGE",
        "KVOFFLOAD_DEPLOY_TESTS",
        "KVOFFLOAD_REQUIRE_CEPH",
        "KVOFFLOAD_REQUIRE_MOONCAKE",
        "KVOFFLOAD_REQUIRE_VLLM",
        "KVOFFLOAD_SOAK_ENGINES",
        "KVOFFLOAD_SOAK_PROCESSES",
        "KVOFFLOAD_SOAK_SECONDS",
        "KVOFFLOAD_SOAK_SEED",
        "KVOFFLOAD_TEST_CANARY_SECRET",
    }
)


def unknown_variables(environ: Mapping[str, str] | None = None) -> list[tuple[str, str | None]]:
    """Each ``KVOFFLOAD_*`` variable of ``environ`` (default: this process's) that is neither
    a setting's (named in any case, as they are read) nor one of ``OTHER_VARIABLES``, with
    the setting's variable it is closest to (None: none close): a typo the service would
    otherwise ignore without a word. Names only: a value may be a secret."""
    fields = [name.upper() for name in Settings.model_fields]
    known = {*(ENV_PREFIX + field for field in fields), *OTHER_VARIABLES}
    found = []
    for name in sorted(os.environ if environ is None else environ):
        upper = name.upper()
        if upper.startswith(ENV_PREFIX) and upper not in known:
            # Matched without the prefix, which every name shares.
            close = difflib.get_close_matches(upper.removeprefix(ENV_PREFIX), fields, n=1)
            found.append((name, ENV_PREFIX + close[0] if close else None))
    return found


def _reason(cls: type[AdminAuth], field: str, err: ErrorDetails) -> str:
    """Why pydantic refused ``field`` and what it accepts, said as a flag's value is written."""
    kind = err["type"]
    if kind in _OUT_OF_BOUNDS and field in cls.model_fields:
        return f"{_OUT_OF_BOUNDS[kind]}; accepted: {accepted_range(cls.model_fields[field])}"
    if kind == "literal_error":
        expected = str(err.get("ctx", {}).get("expected", ""))
        return f"accepted: {expected.replace(chr(39), '')}"
    if kind in _ACCEPTED_BY_TYPE:
        return _ACCEPTED_BY_TYPE[kind]
    msg = err["msg"].removeprefix("Value error, ")
    return msg[:1].lower() + msg[1:]


def _error_line(cls: type[AdminAuth], err: ErrorDetails, file: _FileValues) -> str:
    cause = err.get("ctx", {}).get("error")
    if isinstance(cause, ConfigError):
        if cause.field in file.keys and cause.reason is not None:
            return file.line(cause.field, cause.value, cause.reason)
        return str(cause)
    loc = err["loc"]
    field = str(loc[0]) if loc else None
    if field is None:
        return err["msg"].removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        return (
            f"{file.where()}: unknown key {field!r}; accepted: the settings of kvoffload serve "
            "--help, written with _ (num_blocks for --num-blocks)"
        )
    reason = _reason(cls, field, err)
    if field in file.keys:
        return file.line(field, err.get("input"), reason)
    return str(config_error(field, err.get("input"), reason))


def load_settings(**overrides: Any) -> Settings:
    """``Settings(**overrides)`` (flags, then env, config file, defaults); any refusal is one
    ``ConfigError`` (several invalid settings: one line, joined with ``; ``)."""
    return load_or_refuse(Settings, **overrides)


def load_or_refuse(cls: type[_S], **overrides: Any) -> _S:
    """``cls(**overrides)`` (``Settings`` or ``AdminAuth``), refusals as one ``ConfigError``.

    Each refusal names where its value came from: the flag and its variable, or for a value
    of the ``--config`` file (one no flag or variable overrode) the file and its key. Each
    says what is accepted."""
    try:
        return cls(**overrides)
    except ValidationError as exc:
        file = _FileValues(overrides)
        lines = [_error_line(cls, err, file) for err in exc.errors(include_url=False)]
        raise ConfigError("; ".join(dict.fromkeys(lines))) from None
    except SettingsError as exc:
        # pydantic-settings could not parse a variable's value (JSON of a dict or list field).
        field = next((f for f in cls.model_fields if f'"{f}"' in str(exc)), None)
        if field is None:
            raise ConfigError(str(exc)) from None
        value = os.environ.get(ENV_PREFIX + field.upper(), "")
        raise config_error(field, value, "not valid JSON; accepted: a JSON value") from None


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
        data = load_config_file(Path(path))
        secrets = sorted(key for key in data if key in _secret_fields(self.settings_cls))
        if secrets:
            check_private_file("config", Path(path), f"a secret ({', '.join(secrets)})")
        return data


def _secret_fields(cls: type[BaseSettings]) -> frozenset[str]:
    """The settings that hold a secret themselves (a token, not a path to one)."""
    return frozenset(
        name
        for name, field in cls.model_fields.items()
        if SecretStr in (field.annotation, *get_args(field.annotation))
    )


def load_config_file(path: Path) -> dict[str, Any]:
    """Parse a TOML or JSON settings file (chosen by suffix) into a dict of field values."""
    suffix = path.suffix.lower()
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise config_error(
            "config", path, f"cannot read it ({exc.strerror}); accepted: a readable file"
        ) from None
    try:
        if suffix == ".toml":
            data: Any = tomllib.loads(text)
        elif suffix == ".json":
            data = json.loads(text)
        else:
            raise config_error("config", path, "accepted: a file ending in .toml or .json")
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as exc:
        raise config_error(
            "config", path, f"not valid {suffix[1:].upper()} ({exc}); accepted: a valid file"
        ) from None
    if not isinstance(data, dict):
        raise config_error(
            "config", path, "accepted: a table (TOML) or object (JSON) of settings at the top"
        )
    return data


#: What a KV-event endpoint may be without tenants (``kv_events_endpoint_problem``).
LOOPBACK_ENDPOINTS = "tcp://127.0.0.1:PORT, tcp://[::1]:PORT, tcp://localhost:PORT or ipc://PATH"
_TOPIC_FIELDS = ("namespace", "node")


def kv_events_endpoint_problem(endpoint: str) -> str | None:
    """Why ``endpoint`` cannot be a KV-event socket (None: it can): a ZMQ ``tcp://`` address on
    loopback with a port of its own (routers need to know it: no 0), or an absolute
    ``ipc://`` path. Off loopback ZMQ would hand the events to anyone, unauthenticated."""
    if endpoint.startswith("ipc://"):
        path = endpoint.removeprefix("ipc://")
        return None if path.startswith("/") and "\0" not in path else "not an absolute path"
    if not endpoint.startswith("tcp://"):
        return "neither tcp:// nor ipc://"
    host, sep, port = endpoint.removeprefix("tcp://").rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        return "no port 1..65535"
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not is_loopback(host):
        return "not a loopback address (off loopback any reader would get the events)"
    return None


def topic_template_problem(template: str) -> str | None:
    """Why ``template`` cannot be ``kv_events_topic`` (None: it can)."""
    accepted = "accepted: text with {namespace} and {node}, e.g. kv@{node}@{namespace}"
    try:
        names = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    except ValueError as exc:
        return f"{exc}; {accepted}"
    unknown = [name for name in names if name not in _TOPIC_FIELDS]
    if unknown:
        return f"unknown field {{{unknown[0]}}}; {accepted}"
    return None


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback IP literals (127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def hosts_overlap(a: str, b: str) -> bool:
    """Whether listeners on hosts ``a`` and ``b`` and one port would take the same address: the
    same host, a wildcard (``0.0.0.0``, ``::``) and any, or ``localhost`` and a loopback."""
    wildcards = ("", "0.0.0.0", "::")
    if a == b or a in wildcards or b in wildcards:
        return True
    if "localhost" in (a, b):
        return is_loopback(a) and is_loopback(b)
    try:
        return ipaddress.ip_address(a) == ipaddress.ip_address(b)
    except ValueError:
        return False


class AdminAuth(BaseSettings):
    """The admin token and its sources: ``admin_token`` (``KVOFFLOAD_ADMIN_TOKEN``),
    ``admin_token_file`` (read once, here), from flags, env or the ``config`` file like every
    setting. ``Settings`` inherits it; ``kvoffload admin`` builds it alone (other settings in
    the environment or the file are ignored there)."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        extra="ignore",
        validate_default=True,
        # Flags and env are strings; JSON-valued fields (policy_params) are parsed from JSON.
        env_parse_none_str="",
    )

    config: Path | None = Field(default=None, description="TOML or JSON settings file")
    admin_token: SecretStr | None = Field(default=None, description="admin bearer token")
    admin_token_file: Path | None = Field(default=None, description="file with the admin token")

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

    @model_validator(mode="after")
    def _read_token(self) -> AdminAuth:
        if self.admin_token is not None and self.admin_token_file is not None:
            raise config_error(
                "admin_token_file",
                self.admin_token_file,
                f"{ENV_PREFIX}ADMIN_TOKEN is set too; accepted: one of the two",
            )
        if self.admin_token_file is not None:
            # Read once, at startup; from here on the token is held like one from the env.
            self.admin_token = SecretStr(read_token_file(self.admin_token_file))
            self.admin_token_file = None
        if self.admin_token is not None and not self.admin_token.get_secret_value():
            raise config_error("admin_token", "", "accepted: a token that is not empty")
        return self

    def admin_token_value(self) -> str | None:
        """The admin token in clear (None: the admin API is open, loopback only)."""
        return None if self.admin_token is None else self.admin_token.get_secret_value()


#: What a token file refused for each reason should be instead (``{path}``: the file's).
_TOKEN_FILE_ACCEPTED = {
    "mode": "chmod 600 {path} (or 0640 to share it with a group; a Kubernetes secret: "
    "defaultMode 0440 or 0400)",
    "unreadable": "a readable file",
    "encoding": "a file holding the token",
    "empty": "a file holding the token",
    "not_a_token": "a file holding one token",
}


def read_token_file(path: Path, field: str = "admin_token_file") -> str:
    """The token held in ``path`` for the setting ``field`` (``admin_token_file``,
    ``metrics_token_file``), read by the engine side's one reader
    (``kvoffload_client.client.read_token_file``) with ``private``: ``ConfigError`` when the
    file cannot be read, holds no token, or is readable or writable by others (as the tenants
    files: ``app.core.tenants``)."""
    try:
        return read_private_token_file(path, private=True)
    except TokenFileError as exc:
        problem = exc.problem + ("; it holds a token" if exc.kind == "mode" else "")
        accepted = _TOKEN_FILE_ACCEPTED[exc.kind].format(path=path)
        raise config_error(field, path, f"{problem}; accepted: {accepted}") from None


def check_private_file(field: str, path: Path, holds: str) -> None:
    """``ConfigError`` for the setting ``field`` when the file ``path``, which ``holds`` a
    secret (``a token``), may be read or written by others: the refusal ``read_token_file``
    gives a token file, for the files that hold a secret but not one token (the ``--config``
    file holding ``admin_token``, a MAC key). A file that cannot be looked at is left to its
    reader, which names why."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return
    if mode & (stat.S_IROTH | stat.S_IWOTH):
        accepted = _TOKEN_FILE_ACCEPTED["mode"].format(path=path)
        raise config_error(
            field,
            path,
            f"readable or writable by others (mode {stat.S_IMODE(mode):04o}); it holds {holds}; "
            f"accepted: {accepted}",
        )


class Settings(AdminAuth):
    """Every setting of the service; see the module docstring for where values come from."""

    model_config = SettingsConfigDict(extra="forbid")

    # Listeners.
    host: str = Field(default="127.0.0.1", description="engine API address")
    port: int = Field(default=8000, ge=0, le=65535, description="engine API port (0: any)")
    uds: Path | None = Field(default=None, description="also serve the engine API here")
    pool_socket: Path | None = Field(
        default=None,
        description="hand the pool to engines on this Unix socket (default with uds: UDS.pool)",
    )
    uds_mode: int = Field(
        default=0o600,
        description="file mode of the Unix sockets, octal: 0600 (owner only) or 0660 (and group)",
    )
    uds_group: str | None = Field(
        default=None, description="group (name or gid) given the Unix sockets (with uds_mode 0660)"
    )
    uds_auth: UdsAuth = Field(
        default="token",
        description="with tenants: token (Unix socket callers need a token too) or file-mode "
        "(the socket's file mode and group are the credentials)",
    )
    tenants: Path | None = Field(
        default=None,
        description="the engine API's tenants, their namespaces and tokens: a TOML file or a "
        "directory of NAME.toml files (re-read on SIGHUP or change); required off loopback",
    )
    metrics_token: SecretStr | None = Field(
        default=None, description="bearer token GET /metrics requires (a scrape credential)"
    )
    metrics_token_file: Path | None = Field(
        default=None,
        description="file with the bearer token GET /metrics requires (Prometheus: the scrape "
        "config's authorization credentials_file); with tenants, without it /metrics serves "
        "only the service-wide series (no tenant, namespace or request id)",
    )
    registration_by_name: bool = Field(
        default=False,
        description="with tenants: also register KV caches named by a /dev/shm path or CUDA IPC "
        "handle, which the service opens with its own rights (only if every caller is trusted; "
        "else pass descriptors over the pool socket)",
    )
    max_registrations: int = Field(
        default=32,
        gt=0,
        le=1 << 16,
        description="KV caches registered at once per namespace (one more: 429 quota_exceeded; "
        "a tenants file may set it per namespace)",
    )
    max_mapped_bytes: ByteSize = Field(
        default=64 << 30,
        gt=0,
        description="bytes of host memory the KV caches registered in one namespace may map (one "
        "more: 429 quota_exceeded; a tenants file may set it per namespace)",
    )
    admin_host: str = Field(default="127.0.0.1", description="admin API address")
    admin_port: int = Field(default=8001, ge=0, le=65535, description="admin port (0: any)")

    # Connection bounds of both listeners (app/http/connections.py): slow or silent clients,
    # and how many connections they may hold.
    head_timeout_s: float = Field(
        default=5.0,
        gt=0,
        description="close a connection whose request head (request line and headers) is not "
        "complete this long after the connection opened, or after the first byte of its next "
        "request (both listeners)",
    )
    body_timeout_s: float = Field(
        default=30.0,
        gt=0,
        description="close a connection whose request, body included, is not complete this "
        "long after its first byte (both listeners; at least head_timeout_s)",
    )
    max_connections: int | None = Field(
        default=None,
        gt=0,
        description="engine listener (TCP and Unix socket together): connections open at once, "
        "more are closed as they come (default: the descriptor limit RLIMIT_NOFILE less a "
        "reserve for the process and admin_max_connections)",
    )
    max_connections_per_peer: int = Field(
        default=256,
        ge=0,
        description="engine listener: connections one peer holds open at once, more are closed "
        "as they come (TCP: its IP, or an IPv6 peer's /64; Unix socket: its uid; on loopback "
        "every local TCP client is the one peer 127.0.0.1; 0: no cap)",
    )
    admin_max_connections: int = Field(
        default=64,
        gt=0,
        description="admin listener: connections open at once; past it the oldest connection "
        "still sending its request (or idle between requests) is closed for the new one, else "
        "the new one is",
    )
    admin_max_connections_per_peer: int = Field(
        default=16,
        ge=0,
        description="admin listener: connections one peer holds open at once; past it the "
        "peer's oldest connection still sending its request (or idle between requests) is "
        "closed for the new one, else the new one is (peers as for max_connections_per_peer; "
        "0: no cap)",
    )

    # Pool and policy.
    num_blocks: int = Field(default=4096, gt=0, description="host pool size in blocks")
    block_bytes: ByteSize = Field(default=65536, gt=0, description="bytes per host block")
    policy: str = Field(default="lru", description="eviction policy name")
    policy_params: dict[str, Any] = Field(
        default_factory=dict, description="policy parameters (JSON object)"
    )
    store_threshold: int = Field(default=0, ge=0, description="admit a block on its N-th offer")
    device: str = Field(default="auto", description="transfer device: auto, cpu or cuda:N")
    pin_memory: bool | None = Field(default=None, description="pin the pool (default: if CUDA)")
    allow_pageable_pool: bool = Field(
        default=False,
        description="let the cuda backend run on a pool that could not be pinned (slow)",
    )
    shm_dir: Path = Field(
        default=Path("/dev/shm"),
        description="no longer used: the pool is a sealed memfd (still checked to be a directory)",
    )
    copy_threads: int = Field(
        default=0,
        ge=0,
        le=64,
        description="threads of the cpu backend's copies between the pool and host-memory "
        "caches (0: half the cores, 1 to 4)",
    )

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
    max_body_bytes: ByteSize = Field(
        default=8 << 20,
        gt=0,
        description="larger bodies: 413 (each route's own cap, derived from the limits, may be "
        "lower: app/limits.py)",
    )
    max_transfer_params_bytes: ByteSize = Field(
        default=16 << 10,
        gt=0,
        description="larger kv_transfer_params (as compact JSON) on a request: 413",
    )
    event_buffer_size: int = Field(default=65536, gt=0, description="KV events kept")
    max_finished_jobs: int = Field(default=10000, gt=0, description="finished jobs kept")

    # Cache control: retentions and prefetches (per namespace).
    max_retained_blocks: int | None = Field(
        default=None,
        gt=0,
        description="distinct blocks retained at once per namespace, more: 429 (default: half "
        "the pool; a namespace's max_retained_blocks in the tenants file)",
    )
    max_retentions: int = Field(
        default=4096, gt=0, description="live retentions per namespace, more: 429"
    )
    max_retention_keys: int = Field(
        default=1 << 20,
        gt=0,
        description="keys named by a namespace's retentions, summed over them (a key two "
        "retentions name counts twice; 4 bytes each), more: 429",
    )
    retain_max_ttl_s: float = Field(
        default=3600.0, gt=0, description="longest retention TTL (longer: 422)"
    )
    prefetch_max_keys: int | None = Field(
        default=None,
        gt=0,
        description="keys prefetching or held by prefetches at once per namespace, more: 429 "
        "(default: a quarter of the pool)",
    )
    prefetch_max_deadline_s: float = Field(
        default=300.0, gt=0, description="longest prefetch deadline (longer: 422)"
    )

    # The tiers below the pool, in order (each one's settings follow: remote_*, object_*, disk_*).
    tiers: list[str] | None = Field(
        default=None,
        description="tiers below the pool, in order, comma-separated (e.g. disk,object): a "
        "lookup names the first that holds a key; default: each tier configured (disk, then "
        "remote, then object)",
    )

    # Remote tier: a store shared by nodes, behind the host pool (off by default).
    remote_tier: RemoteTierName = Field(
        default="none", description="remote tier behind the pool: none or mooncake"
    )
    mooncake_master: str | None = Field(
        default=None,
        description="Mooncake master's RPC address, host:port; with HA masters the etcd that "
        "elects them, etcd://host:port[;host:port...]",
    )
    mooncake_metadata: str | None = Field(
        default=None,
        description="Mooncake metadata URL, e.g. http://host:8080/metadata; with HA masters "
        "etcd://host:port[;host:port...]",
    )
    mooncake_protocol: Literal["tcp", "rdma"] = Field(
        default="tcp", description="Mooncake transfer protocol: tcp or rdma"
    )
    mooncake_segment_bytes: ByteSize = Field(
        default=1 << 30, ge=0, description="memory this node gives the shared store (0: none)"
    )
    mooncake_replicas: int = Field(default=1, ge=1, le=16, description="copies of each block")
    mooncake_local_hostname: str | None = Field(
        default=None,
        description="address other nodes reach this node's segment on (default: this host's name)",
    )
    mooncake_rdma_devices: str = Field(default="", description="RDMA devices (protocol rdma)")
    remote_timeout_s: float = Field(
        default=5.0, gt=0, description="bound on each remote get and put"
    )
    remote_lookup_timeout_s: float = Field(
        default=0.05,
        gt=0,
        description="how long a lookup waits for the remote tier before answering miss",
    )
    remote_queue_blocks: int = Field(
        default=8192, gt=0, description="write-behind queue bound, in blocks (more: dropped)"
    )
    remote_batch_blocks: int = Field(default=64, gt=0, description="blocks per remote put batch")
    remote_staging_bytes: ByteSize = Field(
        default=256 << 20,
        ge=0,
        description="queued blocks the pool evicts before their remote put are copied out, up "
        "to this many bytes at a time (more: dropped, counted staging_full; 0: none)",
    )
    remote_sweep_s: float = Field(
        default=10.0,
        ge=0,
        description="each block this node wrote to the remote tier is asked after for having "
        "been evicted at least this often (0: only lookups notice)",
    )
    remote_removal_confirm_s: float = Field(
        default=120.0,
        ge=0,
        description="a block written to the remote tier is reported removed once the store has "
        "kept answering it does not hold it this long (HA takeovers answer so for a while)",
    )
    remote_tracked_blocks: int = Field(
        default=262144,
        gt=0,
        description="blocks written to the remote tier tracked for removal (more: the one asked "
        "after longest ago is reported removed)",
    )

    # Object tier: an S3 bucket (AWS S3, MinIO, Ceph RGW) shared by nodes (off by default).
    # Credentials: AWS's standard sources (environment, shared files, web identity), never
    # settings.
    object_bucket: str | None = Field(
        default=None,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{1,253}[A-Za-z0-9]$",
        description="S3 bucket of the object tier (unset: no object tier): 3 to 255 letters, "
        "digits, '.', '_', '-'",
    )
    object_endpoint: str | None = Field(
        default=None,
        description="S3 endpoint URL, e.g. http://127.0.0.1:7480 (unset: AWS's, for the region)",
    )
    object_region: str = Field(default="us-east-1", min_length=1, description="S3 region")
    object_prefix: str = Field(
        default="kvoffload",
        description="key prefix in the bucket; objects go under "
        "<prefix>/<namespace>/<block bytes>/<key>",
    )
    object_addressing: Literal["path", "virtual"] = Field(
        default="path",
        description="S3 addressing: path (endpoint/bucket/key: MinIO, Ceph) or virtual "
        "(bucket.endpoint/key: AWS)",
    )
    object_verify_tls: bool = Field(
        default=True, description="verify the endpoint's TLS certificate (false: accept any)"
    )
    object_bytes: ByteSize = Field(
        default=64 << 30,
        gt=0,
        description="bytes of objects this node keeps in the bucket, per namespace (more: the "
        "least recently used are deleted)",
    )
    object_mac_key_file: Path | None = Field(
        default=None,
        description="file of a secret every node shares, keying the MAC each object carries "
        "(unset: a checksum, no defence against writers of the bucket)",
    )
    object_timeout_s: float = Field(
        default=5.0, gt=0, description="bound on each object tier batch (gets, puts, deletes)"
    )
    object_lookup_timeout_s: float = Field(
        default=0.05,
        gt=0,
        description="how long a lookup waits for the object tier before answering miss",
    )
    object_negative_cache_s: float = Field(
        default=1.0,
        ge=0,
        description="a key the bucket answered it does not hold is a miss without asking again "
        "for this long (0: always ask): another node's new block is found this much later at "
        "most",
    )
    object_concurrency: int = Field(
        default=16, gt=0, le=256, description="object tier requests in flight at once"
    )
    object_queue_blocks: int = Field(
        default=4096, gt=0, description="object write-behind queue bound, in blocks (more: dropped)"
    )
    object_batch_blocks: int = Field(
        default=64, gt=0, description="blocks per object write-behind batch"
    )
    object_staging_bytes: ByteSize = Field(
        default=256 << 20,
        ge=0,
        description="queued blocks the pool evicts before their object put are copied out, up "
        "to this many bytes at a time (more: dropped, counted staging_full; 0: none)",
    )
    object_sweep_s: float = Field(
        default=0.0,
        ge=0,
        description="each object this node wrote is asked after (a HEAD) at least this often, "
        "to report objects a lifecycle rule expired (0: only lookups notice)",
    )
    object_removal_confirm_s: float = Field(
        default=0.0,
        ge=0,
        description="an object is reported removed once the bucket has answered it is not "
        "there for this long",
    )

    # Disk tier: blocks the pool evicts, on a local disk below it (off by default).
    disk_dir: Path | None = Field(
        default=None,
        description="directory of the disk tier below the pool (one subdirectory per namespace)",
    )
    disk_bytes: ByteSize = Field(
        default=0, ge=0, description="bytes the disk tier may take (its index included)"
    )
    disk_admit_after: int = Field(
        default=2,
        ge=1,
        description="an evicted block goes to disk once this many requests asked for it (1: all)",
    )
    disk_policy: str = Field(default="lru", description="the disk tier's eviction policy")
    disk_io_threads: int = Field(default=4, gt=0, le=64, description="disk I/O threads")
    disk_staging_bytes: ByteSize = Field(
        default=128 << 20,
        gt=0,
        description="memory for evicted blocks on their way to disk, per namespace, taken at "
        "start (at least one block; more evicted than fits: dropped, counted)",
    )
    disk_batch_bytes: ByteSize = Field(
        default=16 << 20,
        gt=0,
        description="bytes per disk write batch, and per read chunk of a promotion at most (a "
        "promotion is at least 4 chunks, read concurrently and copied on as each lands; at "
        "least one block)",
    )
    disk_timeout_s: float = Field(
        default=10.0, gt=0, description="a disk read slower than this is a miss (tier degraded)"
    )
    disk_direct_io: bool = Field(
        default=True, description="O_DIRECT where the filesystem allows it (false: buffered)"
    )

    # KV events for routers (app/core/kv_publisher.py): the pull feed's events over ZMQ in
    # vLLM's framing (off by default; needs the events extra).
    kv_events_endpoint: str | None = Field(
        default=None,
        description="publish KV events for routers on this ZMQ PUB address, tcp://HOST:PORT on "
        "loopback or ipc://PATH (with tenants: ipc only); off when unset",
    )
    kv_events_replay_endpoint: str | None = Field(
        default=None,
        description="answer routers' replay requests (missed batches by sequence number) on "
        "this ZMQ ROUTER address, as for kv_events_endpoint",
    )
    kv_events_topic: str = Field(
        default="{namespace}",
        description="topic of each namespace's batches, with {namespace} and {node} "
        "(llm-d: kv@{node}@{namespace})",
    )
    kv_events_node: str | None = Field(
        default=None, description="what {node} is in kv_events_topic (default: the host name)"
    )
    kv_events_format: Literal["map", "array"] = Field(
        default="map",
        description="events as vLLM's tagged maps (map: Dynamo, vLLM's own subscribers) or as "
        "arrays (array: llm-d)",
    )
    kv_events_tenant: str | None = Field(
        default=None,
        description="with tenants: publish only this tenant's namespaces, its sockets with "
        "uds_mode and uds_group (unset: every namespace, sockets owner-only)",
    )
    kv_events_queue_batches: int = Field(
        default=4096,
        gt=0,
        le=1 << 20,
        description="batches waiting to be sent; more are dropped and counted, never waited for",
    )
    kv_events_replay_batches: int = Field(
        default=10000, gt=0, le=1 << 20, description="batches kept for replay"
    )
    kv_events_metadata_blocks: int = Field(
        default=1 << 16,
        gt=0,
        le=1 << 26,
        description="blocks per namespace whose token ids and parent (given on store calls) "
        "are kept for their events: at least the newest this many, up to twice as many held "
        "(about 200 bytes and 4 bytes a token each)",
    )

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

    @field_validator("device")
    @classmethod
    def _check_device(cls, value: str) -> str:
        if not _DEVICE.fullmatch(value):
            raise config_error("device", value, "accepted: auto, cpu, cuda or cuda:N")
        return value

    @field_validator("uds_mode", mode="before")
    @classmethod
    def _octal_mode(cls, value: Any) -> Any:
        # Flags, env and JSON give "0600" or "0o660"; TOML has octal integers (0o600).
        if isinstance(value, str):
            match = _OCTAL_MODE.fullmatch(value.strip().lower())
            if match is None:
                raise config_error(
                    "uds_mode", value, "accepted: an octal mode such as 0600 or 0660"
                )
            return int(match[2], 8)
        return value

    @field_validator("uds_mode")
    @classmethod
    def _check_uds_mode(cls, value: int) -> int:
        if value & ~_UDS_MODE_ALLOWED or value & _UDS_MODE_REQUIRED != _UDS_MODE_REQUIRED:
            raise config_error(
                "uds_mode",
                value,
                "accepted: 0600 (owner only) or 0660 (owner and group); read and write for the "
                "owner, nothing for others, no execute bits",
            )
        return value

    @field_validator("tenants")
    @classmethod
    def _tenants_exist(cls, value: Path | None) -> Path | None:
        # Read when the service starts (app.core.tenants); a path that is not there is a typo.
        if value is not None and not value.exists():
            raise config_error(
                "tenants",
                value,
                "no such file or directory; accepted: a TOML file of [tenants.NAME] tables or a "
                "directory of NAME.toml files",
            )
        return value

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, value: str) -> str:
        try:
            return canonical_policy_name(value)
        except UnknownPolicyError as exc:
            raise config_error("policy", value, _unknown_policy(exc)) from None

    @field_validator("log_level", mode="before")
    @classmethod
    def _lower_level(cls, value: Any) -> Any:
        return value.lower() if isinstance(value, str) else value

    @field_validator("shadow_policies", "tiers", mode="before")
    @classmethod
    def _split_names(cls, value: Any, info: ValidationInfo) -> Any:
        # Flags and env give "lru,arc"; a JSON list (env, config file) is taken as it is.
        if isinstance(value, str):
            text = value.strip()
            if text.startswith("["):
                try:
                    return json.loads(text)
                except json.JSONDecodeError:
                    raise config_error(
                        str(info.field_name), value, "accepted: names separated by , or a JSON list"
                    ) from None
            return [name.strip() for name in text.split(",") if name.strip()]
        return value

    @field_validator("shadow_policies")
    @classmethod
    def _known_policies(cls, value: list[str] | None) -> list[str] | None:
        if value is None:
            return None
        known: list[str] = []
        for name in value:
            try:
                known.append(canonical_policy_name(name))
            except UnknownPolicyError as exc:
                raise config_error(
                    "shadow_policies", ",".join(value), _unknown_policy(exc, named=True)
                ) from None
        value = known
        if not value:
            raise config_error(
                "shadow_policies",
                "",
                "empty; accepted: policy names (--shadow-enabled false turns shadows off)",
            )
        return value

    @property
    def effective_max_retained_blocks(self) -> int:
        """Distinct blocks a namespace may retain at once (default: half its pool)."""
        if self.max_retained_blocks is not None:
            return self.max_retained_blocks
        return max(1, self.num_blocks // 2)

    @property
    def effective_prefetch_max_keys(self) -> int:
        """Keys a namespace's prefetches may promote or hold at once (default: a quarter of
        its pool)."""
        if self.prefetch_max_keys is not None:
            return self.prefetch_max_keys
        return max(1, self.num_blocks // 4)

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
    def _read_metrics_token(self) -> Settings:
        if self.metrics_token is not None and self.metrics_token_file is not None:
            raise config_error(
                "metrics_token_file",
                self.metrics_token_file,
                f"{ENV_PREFIX}METRICS_TOKEN is set too; accepted: one of the two",
            )
        if self.metrics_token_file is not None:
            # Read once, at startup, as the admin token is.
            token = read_token_file(self.metrics_token_file, "metrics_token_file")
            self.metrics_token = SecretStr(token)
            self.metrics_token_file = None
        if self.metrics_token is not None and not self.metrics_token.get_secret_value():
            raise config_error("metrics_token", "", "accepted: a token that is not empty")
        return self

    @model_validator(mode="after")
    def _check_secret_files(self) -> Settings:
        # The files of a secret that is not one token (read where it is used: the object MAC
        # key) are refused at start, as the token files are (read above, with the same check).
        for field in type(self).model_fields:
            path = getattr(self, field)
            if field.endswith(("_key_file", "_token_file")) and isinstance(path, Path):
                check_private_file(field, path, "a secret")
        return self

    @model_validator(mode="after")
    def _check_connection_bounds(self) -> Settings:
        # The body's bound runs from the same first byte as the head's: a shorter one would
        # cut requests whose head the head bound let through.
        if self.body_timeout_s < self.head_timeout_s:
            raise config_error(
                "body_timeout_s",
                self.body_timeout_s,
                f"accepted: at least {setting_names('head_timeout_s')} ({self.head_timeout_s:g})",
            )
        return self

    @model_validator(mode="after")
    def _check_kv_events(self) -> Settings:
        endpoints = ("kv_events_endpoint", "kv_events_replay_endpoint")
        for field in endpoints:
            value = getattr(self, field)
            if value is None:
                continue
            problem = kv_events_endpoint_problem(value)
            if problem is None and self.tenants is not None and not value.startswith("ipc://"):
                # Anyone on the host may connect to a TCP port: with tenants a socket file, its
                # mode and group the credentials, is the only reader check ZMQ offers routers.
                problem = f"not an ipc:// path, with {setting_names('tenants')} set"
            if problem is not None:
                accepted = "ipc://PATH" if self.tenants is not None else LOOPBACK_ENDPOINTS
                raise config_error(field, value, f"{problem}; accepted: {accepted}")
        if self.kv_events_replay_endpoint is not None:
            if self.kv_events_endpoint is None:
                raise config_error(
                    "kv_events_replay_endpoint",
                    self.kv_events_replay_endpoint,
                    f"without {setting_names('kv_events_endpoint')}; accepted: both, or neither",
                )
            if self.kv_events_replay_endpoint == self.kv_events_endpoint:
                raise config_error(
                    "kv_events_replay_endpoint",
                    self.kv_events_replay_endpoint,
                    "the publisher's own address; accepted: another port or path",
                )
        problem = topic_template_problem(self.kv_events_topic)
        if problem is not None:
            raise config_error("kv_events_topic", self.kv_events_topic, problem)
        if self.kv_events_tenant is not None and self.tenants is None:
            raise config_error(
                "kv_events_tenant",
                self.kv_events_tenant,
                f"without {setting_names('tenants')}; accepted: unset",
            )
        return self

    @model_validator(mode="after")
    def _check_combination(self) -> Settings:
        if self.port and self.port == self.admin_port and hosts_overlap(self.host, self.admin_host):
            # Refused here: starting would find it only after both listeners began to bind.
            raise config_error(
                "admin_port",
                self.admin_port,
                f"the engine listener's port too ({setting_names('port')}, on {self.host}); "
                "accepted: another port, or 0 for any",
            )
        if self.uds is not None and self.effective_pool_socket == self.uds:
            raise config_error(
                "pool_socket", self.uds, "the engine socket's path (--uds); accepted: another path"
            )
        if self.admin_token is None and not is_loopback(self.admin_host):
            raise config_error(
                "admin_host",
                self.admin_host,
                "not a loopback address and no admin token; accepted: 127.0.0.1, ::1 or "
                f"localhost, or any address with {ENV_PREFIX}ADMIN_TOKEN or "
                f"{setting_names('admin_token_file')} set",
            )
        if self.tenants is None and not is_loopback(self.host):
            # Off loopback, anyone who reaches the port could use the pool: tokens are needed.
            raise config_error(
                "host",
                self.host,
                "not a loopback address and no tenants file; accepted: 127.0.0.1, ::1 or "
                f"localhost, or any address with {setting_names('tenants')} set",
            )
        if self.remote_tier == "mooncake":
            for field in ("mooncake_master", "mooncake_metadata"):
                if not getattr(self, field):
                    raise config_error(
                        field,
                        None,
                        f"required with {setting_names('remote_tier')} mooncake; accepted: "
                        + ("host:port" if field == "mooncake_master" else "a URL"),
                    )
            from transfer.mooncake import master_problem, metadata_problem

            for field, problem in (
                ("mooncake_master", master_problem(str(self.mooncake_master))),
                ("mooncake_metadata", metadata_problem(str(self.mooncake_metadata))),
            ):
                if problem is not None:
                    raise config_error(field, getattr(self, field), problem)
            if self.remote_tracked_blocks < self.remote_batch_blocks:
                # Else a batch's own keys would be reported removed as it is stored.
                raise config_error(
                    "remote_tracked_blocks",
                    self.remote_tracked_blocks,
                    f"fewer than the blocks of one put; accepted: at least "
                    f"{setting_names('remote_batch_blocks')} ({self.remote_batch_blocks})",
                )
        if self.disk_dir is not None:
            from transfer.disk import min_disk_bytes, slots_for

            if slots_for(self.disk_bytes, self.block_bytes) < 1:
                raise config_error(
                    "disk_bytes",
                    self.disk_bytes,
                    f"holds no block of {self.block_bytes} bytes with its index; accepted: at "
                    f"least {min_disk_bytes(self.block_bytes)} with {setting_names('disk_dir')}",
                )
            if self.disk_policy not in available_policies():
                raise config_error(
                    "disk_policy",
                    self.disk_policy,
                    f"unknown policy; accepted: {', '.join(available_policies())}",
                )
        if self.lease_ttl_s <= self.job_deadline_s:
            # A lease that expires while its transfer may still run would free a slot that a
            # copy is writing into.
            raise config_error(
                "lease_ttl_s",
                self.lease_ttl_s,
                f"accepted: more than {setting_names('job_deadline_s')} ({self.job_deadline_s})",
            )
        if self.fault_fail_rate + self.fault_hang_rate > 1:
            raise config_error(
                "fault_hang_rate",
                self.fault_hang_rate,
                f"accepted: at most 1 - {setting_names('fault_fail_rate')} "
                f"({1 - self.fault_fail_rate:g})",
            )
        try:
            policy_class(self.policy).parse_params(dict(self.policy_params))
        except PolicyError as exc:
            raise config_error(
                "policy_params",
                self.policy_params,
                f"{exc}; accepted for {self.policy}: {policy_params_accepted(self.policy)}",
            ) from None
        return self

    @property
    def cuda_index(self) -> int | None:
        """The GPU ``device`` names (``cuda`` is ``cuda:0``), or None for ``cpu`` and ``auto``."""
        if not self.device.startswith("cuda"):
            return None
        return int(self.device.partition(":")[2] or 0)

    @property
    def transfer_backend(self) -> str:
        """Backend name for ``transfer.create_worker`` derived from ``device``."""
        return "cuda" if self.device.startswith("cuda") else self.device

    @property
    def faults_enabled(self) -> bool:
        """True when any fault-injection knob is set."""
        return bool(self.fault_fail_rate or self.fault_delay_s or self.fault_hang_rate)
