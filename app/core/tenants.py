"""Engine credentials: the tenants file, its tokens, and who a call's bearer token names.

**The file.** ``--tenants PATH`` names a TOML file of ``[tenants.NAME]`` tables, or a directory of
``NAME.toml`` files, one per tenant, holding the same keys at their top level (only regular
``*.toml`` files count, symbolic links followed; dotfiles and the ``..data`` links of a Kubernetes
secret volume are skipped). Each tenant has ``tokens`` (one or more, each at least
``MIN_TOKEN_CHARS`` printable ASCII characters without spaces), ``namespaces`` (a table of name =
blocks, or name = { blocks = N, disk_bytes = M, object_bytes = O, max_registrations = R,
max_mapped_bytes = B, max_retained_blocks = K } to give a namespace its own disk and object tier
budgets, KV-cache registration bounds and retention bound, or a list of names whose sizes the
service chooses) and optional ``max_pins`` and ``max_requests``. Names match ``NAME``.
``load_tenants`` refuses the whole file on the first problem (an unknown key, a bad name, a short or
repeated token, a namespace of two tenants, a count that is not a positive integer, a tenant without
namespaces, a file readable or writable by others, a directory others may write to, no tenant at
all) with a ``TenantsConfigError``: one line naming the file and the tenant, never a token. A
directory writable by others (the tenants directory, or the one holding the tenants file) is
accepted only with its sticky bit (``/tmp``; a Kubernetes secret volume is mounted 1777), where
nobody can rename or remove another's file, and then every tenant file must belong to the service's
user or to root: anyone else could otherwise add a tenant of their own.

**Tokens.** Only SHA-256 digests of the tokens are kept. ``Credentials.authenticate`` digests
the presented token and looks the digest up: the time it takes depends on the digest, never on
how many leading bytes of the token are right, and the match is confirmed with
``hmac.compare_digest``. Refusals are ``app.core.errors.AuthenticationError`` with a reason code.

**Reloading.** ``Credentials.changed`` compares the files' stat signature with the one seen at
the last (re)load attempt; ``Credentials.reload`` reads them again and swaps the table and its
tokens in as one object, or raises ``TenantsConfigError`` and keeps the old ones in force.
Tokens present before and gone after a reload answer ``revoked_token`` (the last
``REVOKED_REMEMBERED`` of them) instead of ``unknown_token``. Both run on the event loop's
thread, as ``authenticate`` does; no lock is needed since a call reads the state once.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import stat
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from app.core.errors import AuthenticationError
from app.settings import ConfigError, config_error

if TYPE_CHECKING:
    from app.settings import Settings

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")
MIN_TOKEN_CHARS = 16
REVOKED_REMEMBERED = 1024
TENANT_KEYS = ("tokens", "namespaces", "max_pins", "max_requests")
# What an ``Authorization: Bearer`` header can carry as one token: visible ASCII, no spaces.
_TOKEN = re.compile(r"[\x21-\x7e]+")
_TOKEN_ACCEPTED = f"accepted: at least {MIN_TOKEN_CHARS} printable ASCII characters without spaces"
_NAME_ACCEPTED = (
    "accepted: letters, digits, '.', '_', '-' (1 to 63, starting with a letter or digit)"
)


class TenantsConfigError(ConfigError):
    """The tenants file (``--tenants``) cannot be used; ``str()`` is the one line told the user,
    naming the file and tenant, never a token."""


@dataclass(frozen=True, slots=True)
class NamespaceConfig:
    """A namespace: its name, its pool size in blocks, its disk tier's bytes, the KV-cache
    registrations it may hold and the host memory they may map, and the bytes it keeps in the
    object tier's bucket (None: the service's ``num_blocks`` / ``disk_bytes`` /
    ``max_registrations`` / ``max_mapped_bytes`` / ``object_bytes``)."""

    name: str
    blocks: int | None
    disk_bytes: int | None = None
    max_registrations: int | None = None
    max_mapped_bytes: int | None = None
    object_bytes: int | None = None
    max_retained_blocks: int | None = None


@dataclass(frozen=True, slots=True)
class TenantConfig:
    """A tenant as configured: its namespaces in the file's order (the first is its default)
    and its quotas (None: no limit). Holds no token."""

    name: str
    namespaces: tuple[NamespaceConfig, ...]
    max_pins: int | None = None
    max_requests: int | None = None

    def namespace(self, name: str) -> NamespaceConfig | None:
        """The tenant's namespace ``name``; None when it has none by that name."""
        return next((ns for ns in self.namespaces if ns.name == name), None)


@dataclass(frozen=True)
class TenantTable:
    """Every tenant by name; a namespace belongs to exactly one of them (``load_tenants``
    refuses a file where it does not)."""

    tenants: Mapping[str, TenantConfig]
    _owners: dict[str, str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        owners = {ns.name: t.name for t in self.tenants.values() for ns in t.namespaces}
        object.__setattr__(self, "_owners", owners)

    def namespaces(self) -> dict[str, NamespaceConfig]:
        """Every namespace of every tenant, by name."""
        return {ns.name: ns for t in self.tenants.values() for ns in t.namespaces}

    def owner(self, namespace: str) -> str | None:
        """The name of the tenant owning ``namespace``; None when nobody does."""
        return self._owners.get(namespace)


def token_digest(token: str) -> bytes:
    """The SHA-256 digest under which a token is kept (the token is ASCII: ``_TOKEN``)."""
    return hashlib.sha256(token.encode("ascii")).digest()


def load_tenants(path: Path) -> tuple[TenantTable, dict[bytes, str]]:
    """The tenants of the file or directory ``path`` and the tenant name of each token digest
    (``token_digest``); ``TenantsConfigError`` on any problem (module docstring)."""
    if path.is_dir():
        tenants = _read_directory(path, _owners_checked(path, path))
    else:
        data = _read_toml(path, path, None, _owners_checked(path, path.parent))
        unknown = sorted(set(data) - {"tenants"})
        if unknown:
            raise _refused(path, None, f"unknown key(s) {_names(unknown)}; accepted: tenants")
        table = data.get("tenants", {})
        if not isinstance(table, dict):
            raise _refused(path, None, "tenants is not a table; accepted: [tenants.NAME]")
        tenants = []
        for name, body in table.items():
            if not isinstance(body, dict):
                raise _refused(
                    path, f"tenant {name!r}", "not a table; accepted: [tenants.NAME] with keys"
                )
            tenants.append((name, f"tenant {name!r}", body))
        if not tenants:
            raise _refused(path, None, "no tenant; accepted: one or more [tenants.NAME]")
    configs: dict[str, TenantConfig] = {}
    labels: dict[str, str] = {}
    owners: dict[str, str] = {}
    digests: dict[bytes, str] = {}
    for name, label, body in tenants:
        tenant, tokens = _tenant(path, name, label, body)
        for i, token in enumerate(tokens):
            digest = token_digest(token)
            other = digests.get(digest)
            if other is not None:
                where = "another of its tokens" if other == name else f"a token of {labels[other]}"
                raise _refused(
                    path, label, f"tokens[{i}] is also {where}; accepted: each token once"
                )
            digests[digest] = name
        for ns in tenant.namespaces:
            if ns.name in owners:
                raise _refused(
                    path,
                    label,
                    f"namespace {ns.name!r} belongs to {labels[owners[ns.name]]} too; "
                    "accepted: each namespace in one tenant",
                )
            owners[ns.name] = name
        configs[name] = tenant
        labels[name] = label
    return TenantTable(configs), digests


def load_credentials(settings: Settings) -> Credentials | None:
    """The service's ``Credentials`` (``settings.tenants`` read now), or None without a tenants
    file (one namespace, no tokens). ``TenantsConfigError`` (a ``ConfigError``: ``kvoffload
    serve`` prints its one line and exits 2) when the file cannot be used."""
    return None if settings.tenants is None else Credentials(settings.tenants)


def _owners_checked(root: Path, directory: Path) -> bool:
    """Whether the files in ``directory`` must belong to the service's user or root (it is
    writable by others and sticky); refused when it is writable by others without the sticky
    bit (anyone could replace a tenant file there)."""
    try:
        mode = os.stat(directory).st_mode
    except OSError as exc:
        raise _refused(root, None, f"cannot stat {directory} ({exc.strerror})") from None
    if not mode & stat.S_IWOTH:
        return False
    if not mode & stat.S_ISVTX:
        raise _refused(
            root,
            None,
            f"{directory} is writable by others (mode {stat.S_IMODE(mode):04o}): anyone could "
            "put tenants in it; accepted: chmod o-w (or the sticky bit, +t)",
        )
    return True


def _read_directory(root: Path, owners_checked: bool) -> list[tuple[str, str, dict[str, Any]]]:
    tenants = []
    try:
        entries = sorted(os.scandir(root), key=lambda e: e.name)
    except OSError as exc:
        raise _refused(root, None, f"cannot list it ({exc.strerror})") from None
    for entry in entries:
        if not _counts(entry.name) or not entry.is_file():  # is_file follows links
            continue
        name = entry.name.removesuffix(".toml")
        data = _read_toml(root, Path(entry.path), entry.name, owners_checked)
        tenants.append((name, entry.name, data))
    if not tenants:
        raise _refused(root, None, "no NAME.toml file in the directory; accepted: one per tenant")
    return tenants


def _counts(filename: str) -> bool:
    """Whether a directory entry is a tenant's file (by its name; regular files only)."""
    return filename.endswith(".toml") and not filename.startswith(".")


def _read_toml(root: Path, path: Path, label: str | None, owners_checked: bool) -> dict[str, Any]:
    """The TOML table of the tenant file ``path``; refused unless it is a regular file that
    others can neither read (it holds tokens) nor write (they would give themselves a token),
    owned by the service's user or root when ``owners_checked`` (``_owners_checked``)."""
    try:
        # Non-blocking: a FIFO given by mistake is refused below instead of hanging the start.
        with open(os.open(path, os.O_RDONLY | os.O_NONBLOCK), "rb") as fh:
            st = os.fstat(fh.fileno())  # of what was opened, not of what the path is now
            mode = st.st_mode
            if not stat.S_ISREG(mode):
                raise _refused(root, label, "not a regular file; accepted: a TOML file")
            for bit, what, why in (
                (stat.S_IROTH, "readable", "it holds tokens"),
                (stat.S_IWOTH, "writable", "anyone could add a token"),
            ):
                if mode & bit:
                    raise _refused(
                        root,
                        label,
                        f"{what} by others (mode {stat.S_IMODE(mode):04o}); {why}: accepted: "
                        "chmod o-rwx (a Kubernetes secret: defaultMode 0440 or 0400)",
                    )
            if owners_checked and st.st_uid not in (os.geteuid(), 0):
                raise _refused(
                    root,
                    label,
                    f"owned by uid {st.st_uid} in a directory anyone may write to; accepted: a "
                    "file of the service's user or of root",
                )
            raw = fh.read()
    except OSError as exc:
        raise _refused(root, label, f"cannot read it ({exc.strerror})") from None
    try:
        return tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise _refused(root, label, "not UTF-8 text; accepted: a TOML file") from None
    except tomllib.TOMLDecodeError as exc:  # says where, never what
        raise _refused(root, label, f"not valid TOML ({exc}); accepted: a TOML file") from None


def _tenant(
    root: Path, name: str, label: str, body: dict[str, Any]
) -> tuple[TenantConfig, list[str]]:
    if not NAME.fullmatch(name):
        raise _refused(root, label, f"tenant name {name!r}; {_NAME_ACCEPTED}")
    unknown = sorted(set(body) - set(TENANT_KEYS))
    if unknown:
        raise _refused(
            root, label, f"unknown key(s) {_names(unknown)}; accepted: {', '.join(TENANT_KEYS)}"
        )
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not tokens:
        raise _refused(root, label, "no tokens; accepted: tokens = [one or more tokens]")
    for i, token in enumerate(tokens):
        if not isinstance(token, str):
            raise _refused(root, label, f"tokens[{i}] is not a string; {_TOKEN_ACCEPTED}")
        if len(token) < MIN_TOKEN_CHARS:
            what = "empty" if not token else f"shorter than {MIN_TOKEN_CHARS} characters"
            raise _refused(root, label, f"tokens[{i}] is {what}; {_TOKEN_ACCEPTED}")
        if not _TOKEN.fullmatch(token):
            raise _refused(
                root, label, f"tokens[{i}] holds spaces or non-ASCII characters; {_TOKEN_ACCEPTED}"
            )
    tenant = TenantConfig(
        name=name,
        namespaces=_namespaces(root, label, body.get("namespaces")),
        max_pins=_positive(root, label, "max_pins", body.get("max_pins")),
        max_requests=_positive(root, label, "max_requests", body.get("max_requests")),
    )
    return tenant, tokens


def _namespaces(root: Path, label: str, value: Any) -> tuple[NamespaceConfig, ...]:
    accepted = (
        "accepted: namespaces = { NAME = BLOCKS or { blocks = N, disk_bytes = M, "
        "object_bytes = O, max_registrations = R, max_mapped_bytes = B, "
        "max_retained_blocks = K }, ... } or "
        "[NAME, ...], one or more"
    )
    found: list[NamespaceConfig]
    if isinstance(value, dict):
        found = [_namespace(root, label, name, v, accepted) for name, v in value.items()]
    elif isinstance(value, list):
        if not all(isinstance(name, str) for name in value):
            raise _refused(root, label, f"namespaces holds a non-string; {accepted}")
        found = [NamespaceConfig(name, None) for name in value]
    else:
        found = []
    if not found:
        raise _refused(root, label, f"no namespaces; {accepted}")
    seen: set[str] = set()
    for ns in found:
        if not NAME.fullmatch(ns.name):
            raise _refused(root, label, f"namespace name {ns.name!r}; {_NAME_ACCEPTED}")
        if ns.name in seen:
            raise _refused(root, label, f"namespace {ns.name!r} twice; accepted: each name once")
        seen.add(ns.name)
    return tuple(found)


NAMESPACE_KEYS = (
    "blocks",
    "disk_bytes",
    "max_registrations",
    "max_mapped_bytes",
    "object_bytes",
    "max_retained_blocks",
)


def _namespace(root: Path, label: str, name: str, value: Any, accepted: str) -> NamespaceConfig:
    """One ``namespaces`` entry: a count of blocks, or a table of ``NAMESPACE_KEYS``."""
    key = f"namespaces.{name}"
    if not isinstance(value, dict):
        return NamespaceConfig(name, _positive(root, label, key, value))
    unknown = sorted(set(value) - set(NAMESPACE_KEYS))
    if unknown:
        raise _refused(root, label, f"{key} has unknown key(s) {_names(unknown)}; {accepted}")
    counts = {k: _positive(root, label, f"{key}.{k}", value.get(k)) for k in NAMESPACE_KEYS}
    return NamespaceConfig(name, **counts)


def _positive(root: Path, label: str, key: str, value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise _refused(root, label, f"{key} = {value!r}; accepted: a positive integer")
    return value


def _names(names: list[str]) -> str:
    return ", ".join(repr(n) for n in names)


def _refused(root: Path, where: str | None, reason: str) -> TenantsConfigError:
    line = config_error("tenants", root, reason if where is None else f"{where}: {reason}")
    return TenantsConfigError(str(line))


# --------------------------------------------------------------------------- credentials

Signature = tuple[object, ...]


def stat_signature(path: Path) -> Signature:
    """What changes when the tenants file or directory does: (inode, mtime, size, mode) of the
    file, or of the directory and of each of its tenant files, links followed (a Kubernetes
    secret volume swaps its ``..data`` link; the files' own links stay as they are)."""
    own = _stat(os.fspath(path))
    if not (len(own) == 4 and stat.S_ISDIR(own[3])):
        return own
    try:
        names = sorted(name for name in os.listdir(path) if _counts(name))
    except OSError as exc:
        return ("unlistable", exc.errno)
    return (own, *((name, _stat(os.path.join(path, name))) for name in names))


def _stat(where: str) -> tuple[int, ...]:
    try:
        st = os.stat(where)
    except OSError as exc:
        return (-1, exc.errno or 0)
    return (st.st_ino, st.st_mtime_ns, st.st_size, st.st_mode)


@dataclass(frozen=True, slots=True)
class ReloadReport:
    """What a reload changed, by name and count; never a token. A namespace in
    ``namespaces_changed`` has another size or another owner (a namespace given to another
    tenant must not keep its blocks: stop it and start it afresh)."""

    tenants_added: tuple[str, ...]
    tenants_removed: tuple[str, ...]
    tenants_changed: tuple[str, ...]
    tokens_added: int
    tokens_revoked: int
    namespaces_added: tuple[str, ...]
    namespaces_removed: tuple[str, ...]
    namespaces_changed: tuple[str, ...]

    @property
    def changed(self) -> bool:
        """Whether anything at all changed."""
        return any(
            (
                self.tenants_added,
                self.tenants_removed,
                self.tenants_changed,
                self.tokens_added,
                self.tokens_revoked,
            )
        )

    @property
    def took_away(self) -> bool:
        """Whether the reload took something from callers: a tenant removed, a token revoked,
        a namespace removed or changed (another owner: its blocks are dropped; another size:
        kept until a restart). What an operator should hear of; additions and quota changes
        are not."""
        return any(
            (
                self.tenants_removed,
                self.tokens_revoked,
                self.namespaces_removed,
                self.namespaces_changed,
            )
        )


@dataclass(frozen=True, slots=True)
class _State:
    table: TenantTable
    tokens: dict[bytes, tuple[bytes, TenantConfig]]  # digest -> (the same digest, its tenant)
    revoked: dict[bytes, None]  # insertion order: oldest first


def _tokens(table: TenantTable, names: dict[bytes, str]) -> dict[bytes, tuple[bytes, TenantConfig]]:
    return {digest: (digest, table.tenants[name]) for digest, name in names.items()}


class Credentials:
    """The tenants and tokens in force, read from ``path`` at once (``TenantsConfigError``
    when it cannot be used); see the module docstring."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._seen = stat_signature(path)
        table, names = load_tenants(path)
        self._state = _State(table, _tokens(table, names), {})

    @property
    def path(self) -> Path:
        """The tenants file or directory."""
        return self._path

    @property
    def table(self) -> TenantTable:
        """The tenants in force."""
        return self._state.table

    def authenticate(self, authorization: str | None) -> TenantConfig:
        """The tenant whose token ``authorization`` (an ``Authorization`` header's value:
        ``Bearer TOKEN``, the scheme in any case) carries; ``AuthenticationError`` with reason
        ``missing_token`` (no header or an empty one), ``malformed_authorization`` (another
        scheme, no token, more than one word after it, characters a token never has),
        ``revoked_token`` (removed by a reload) or ``unknown_token``."""
        if not authorization:
            raise AuthenticationError("missing_token")
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not _TOKEN.fullmatch(token):
            raise AuthenticationError("malformed_authorization")
        digest = hashlib.sha256(token.encode("ascii")).digest()
        state = self._state  # one read: a reload swaps the whole state
        entry = state.tokens.get(digest)
        # The dict found the entry by comparing digests, which tell nothing about the token's
        # bytes; the equality that lets the caller in is constant-time all the same.
        if entry is not None and hmac.compare_digest(entry[0], digest):
            return entry[1]
        if digest in state.revoked:
            raise AuthenticationError("revoked_token")
        raise AuthenticationError("unknown_token")

    def changed(self) -> bool:
        """Whether the files changed since the last load or reload attempt (a stat of each)."""
        return stat_signature(self._path) != self._seen

    def reload(self) -> ReloadReport:
        """Read the files again and put them in force; ``TenantsConfigError`` leaves the old
        tenants and tokens in force (``changed`` is False again until the files change)."""
        self._seen = stat_signature(self._path)  # first: a change while reading shows next time
        table, names = load_tenants(self._path)
        old = self._state
        tokens = _tokens(table, names)
        revoked = {d: None for d in old.revoked if d not in tokens}
        gone = [d for d in old.tokens if d not in tokens]
        for digest in gone:
            revoked.pop(digest, None)
            revoked[digest] = None
        if len(revoked) > REVOKED_REMEMBERED:
            revoked = dict.fromkeys(list(revoked)[-REVOKED_REMEMBERED:])
        self._state = _State(table, tokens, revoked)
        return _report(old, self._state, len(gone))


def _report(old: _State, new: _State, revoked: int) -> ReloadReport:
    def digests(state: _State, tenant: str) -> set[bytes]:
        return {d for d, (_, t) in state.tokens.items() if t.name == tenant}

    before, after = old.table.tenants, new.table.tenants
    kept = sorted(before.keys() & after.keys())
    old_ns, new_ns = old.table.namespaces(), new.table.namespaces()
    return ReloadReport(
        tenants_added=tuple(sorted(after.keys() - before.keys())),
        tenants_removed=tuple(sorted(before.keys() - after.keys())),
        tenants_changed=tuple(
            name
            for name in kept
            if before[name] != after[name] or digests(old, name) != digests(new, name)
        ),
        tokens_added=sum(1 for d in new.tokens if d not in old.tokens),
        tokens_revoked=revoked,
        namespaces_added=tuple(sorted(new_ns.keys() - old_ns.keys())),
        namespaces_removed=tuple(sorted(old_ns.keys() - new_ns.keys())),
        namespaces_changed=tuple(
            name
            for name in sorted(old_ns.keys() & new_ns.keys())
            if old_ns[name] != new_ns[name] or old.table.owner(name) != new.table.owner(name)
        ),
    )
