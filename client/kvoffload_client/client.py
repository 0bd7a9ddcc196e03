"""Typed HTTP clients for kvoffload: the engine API (sync and async) and the admin API.

``KVOffloadClient`` / ``AsyncKVOffloadClient`` cover every engine route. Keys are ``bytes``
(hex on the wire; anything else, a hex ``str`` included, raises ``TypeError`` before a request is
sent). They talk TCP (``base_url``) or a Unix socket (``uds=``). A call the service refuses
raises ``KVOffloadError`` with the HTTP ``status`` and the error's ``code`` and ``message``;
transport failures raise ``httpx.TransportError``: when nothing answers at the address,
``KVOffloadConnectError`` (an ``httpx.ConnectError``) naming the URL or socket and the likely fix.

Credentials: a service with tenants wants a bearer token on every engine call (``token=`` or,
better, ``token_file=``: a token never belongs on a command line) and serves the namespace named
by ``namespace=`` (header ``NAMESPACE_HEADER``; without it, the tenant's only namespace). The
token is sent as ``Authorization: Bearer`` and never shows in a ``repr``, a log line or an
error message. Rotation: after a 401 ``unknown_token`` or ``revoked_token`` the token file is read
again, and when it holds another token the call is sent once more with it (a 401 did nothing);
that token then goes with every call and over the pool socket (``current_token``).

Errors, by status (the ``code`` strings may change, the classes do not)::

    KVOffloadError                any refusal: status, code, message
    ├── KVOffloadAuthError        401: no, malformed, unknown or revoked token
    ├── KVOffloadPermissionError  403: not allowed (a namespace that is not the tenant's)
    └── KVOffloadQuotaError       429 / 507: a quota or the pool's room is exhausted (``quota``)

Each call is described once (``_Call``: method, path, JSON body, how to read the answer) and both
clients execute the same descriptions, so they cannot drift apart.

``Batch`` builds the ops of ``POST /v1/batch``; ``batch()`` returns one ``OpResult`` per op (an
op that failed carries its ``KVOffloadError``; the others still ran).

Cache control (both clients, and ``Batch`` for the four request-scoped verbs): ``retain`` keeps
keys in the pool against eviction for a TTL under a retention name (``retentions``,
``retention``, ``renew_retention``, ``release_retention`` manage them by name); ``prefetch``
brings keys below the pool into it and holds them until a load pins them or its deadline passes
(``prefetch_state``, ``cancel_prefetch`` by id); ``demote`` and ``drop`` move keys out of the
pool now (to the tiers below, or away).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import stat
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Generic, Literal, Self, TypeVar
from urllib.parse import quote

import httpx

from kvoffload_client.pool_socket import POOL_HEADER, default_pool_socket
from kvoffload_client.pool_socket import register_kv_cache as _register_over_socket

T = TypeVar("T")
JobState = Literal["running", "done", "failed"]
PrefetchState = Literal["promoting", "held", "done", "cancelled"]
_UDS_BASE = "http://kvoffload"
_JSON_HEADERS = {"content-type": "application/json"}
NAMESPACE_HEADER = "X-KVOffload-Namespace"
"""Request header naming the namespace an engine call works in (tenants only)."""


class KVOffloadError(Exception):
    """The service answered with an error: HTTP ``status``, stable ``code``, ``message``."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status = status
        self.code = code
        self.message = message


class KVOffloadAuthError(KVOffloadError):
    """401: the service did not accept the client's credentials (none, malformed, unknown or
    revoked token; ``message`` says which)."""


class KVOffloadPermissionError(KVOffloadError):
    """403: the credentials are known but not allowed this call (e.g. a namespace that is not
    the tenant's, or none named by a tenant of several)."""


class KVOffloadQuotaError(KVOffloadError):
    """429 (a tenant's pins or live requests, a namespace's retained blocks, retentions or
    prefetching keys) or 507 (no room among the namespace's blocks): nothing was done. ``quota``
    is the quota the answer names (``pins``, ``requests``, ``blocks``, ``retained_blocks``,
    ``retentions``, ``prefetch_keys``), None when it names none."""

    def __init__(self, status: int, code: str, message: str, quota: str | None = None) -> None:
        super().__init__(status, code, message)
        self.quota = quota


class KVOffloadConnectError(httpx.ConnectError):
    """Nothing answered at the service's address (refused, no such socket, not allowed to
    open it): ``where`` (the base URL, or ``Unix socket PATH``) and the likely fix are in the
    message; the httpx error is ``__cause__``. An ``httpx.ConnectError``, not a
    ``KVOffloadError``: the service said nothing, and code that tells transport failures from
    refusals (the vLLM tier's) keeps doing so."""

    def __init__(self, where: str, fix: str, cause: httpx.ConnectError) -> None:
        request = None
        with contextlib.suppress(RuntimeError):  # a cause raised before it had a request
            request = cause.request
        super().__init__(
            f"cannot connect to the kvoffload service at {where} ({cause}): {fix}",
            request=request,
        )
        self.where = where


def _address(url: str, uds: str | None) -> tuple[str, str]:
    """Where a client connects, in words, and the likely fix when nothing answers there."""
    if uds is not None:
        return (
            f"Unix socket {uds}",
            f"is the service running (`kvoffload serve --uds {uds}`), and may this user open "
            "the socket (`--uds-mode 0660 --uds-group GROUP` on the service)?",
        )
    return url, "is the service running (`kvoffload serve`) and listening there (--host, --port)?"


@contextlib.contextmanager
def _connecting(address: tuple[str, str]) -> Iterator[None]:
    """Raise a failed connection as ``KVOffloadConnectError`` naming ``address``."""
    try:
        yield
    except httpx.ConnectError as exc:
        _close_unix_socket_left_open(exc)
        raise KVOffloadConnectError(*address, exc) from exc


def _close_unix_socket_left_open(exc: BaseException) -> None:
    """Close the socket of a failed Unix-socket connect that the HTTP library left open.

    httpcore's sync backend (1.0.x) creates the socket and lets the connect's ``OSError``
    through without closing it: every failed try would hold a descriptor until a garbage
    collection (then a ``ResourceWarning``), while the error, which keeps it alive through its
    traceback, is held or retried by the engine. Only that function's frame is touched."""
    seen: set[int] = set()
    err: BaseException | None = exc
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        tb = err.__traceback__
        while tb is not None:
            frame = tb.tb_frame
            if frame.f_code.co_name == "connect_unix_socket":
                sock = frame.f_locals.get("sock")
                if isinstance(sock, socket.socket):
                    sock.close()
            tb = tb.tb_next
        err = err.__cause__ or err.__context__


def _error(status: int, body: Any, fallback: str) -> KVOffloadError:
    """The typed error of an error answer (``body``: its ``error`` object, if readable)."""
    code, message, quota = "http_error", fallback, None
    if isinstance(body, Mapping):
        code = str(body.get("code", code))
        message = str(body.get("message", message))
        quota = body.get("quota")
    if status == 401:
        return KVOffloadAuthError(status, code, message)
    if status == 403:
        return KVOffloadPermissionError(status, code, message)
    if status in (429, 507):
        return KVOffloadQuotaError(status, code, message, None if quota is None else str(quota))
    return KVOffloadError(status, code, message)


# --------------------------------------------------------------------------- credentials


class TokenFileError(ValueError):
    """A token file that cannot serve: ``path``, ``kind`` (``mode``, ``unreadable``,
    ``encoding``, ``empty``, ``not_a_token``) and ``problem`` in words; never its content."""

    def __init__(self, path: Path | str, kind: str, problem: str) -> None:
        super().__init__(f"token file {path}: {problem}")
        self.path = path
        self.kind = kind
        self.problem = problem


def read_token_file(path: Path | str, *, private: bool = False) -> str:
    """The token held in ``path``, surrounding whitespace (a trailing newline) dropped: the one
    reader of token files, the engine's and the server's own.

    Raises ``TokenFileError`` (a ``ValueError``) naming the file, never its content, when it
    cannot be read, is empty, holds something that is not one token (whitespace or control
    characters inside) or, with ``private``, may be read or written by others (its mode as
    opened, not as the path says later).
    """
    try:
        with open(path, "rb") as fh:
            mode = os.fstat(fh.fileno()).st_mode
            if private and mode & (stat.S_IROTH | stat.S_IWOTH):
                raise TokenFileError(
                    path, "mode", f"readable or writable by others (mode {stat.S_IMODE(mode):04o})"
                )
            raw = fh.read()
    except OSError as exc:
        raise TokenFileError(
            path, "unreadable", f"cannot read it ({exc.strerror or exc})"
        ) from None
    try:
        token = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise TokenFileError(path, "encoding", "not UTF-8 text") from None
    if not token:
        raise TokenFileError(path, "empty", "empty")
    if not _is_token(token):
        raise TokenFileError(path, "not_a_token", _NOT_A_TOKEN)
    return token


_NOT_A_TOKEN = "not a token (empty, or holding whitespace, control or non-ASCII characters)"


def _is_token(token: str) -> bool:
    # A bearer token is printable ASCII without spaces; anything else would be refused by the
    # HTTP library with an error that may quote the header, token included.
    return bool(token) and all("!" <= ch <= "~" for ch in token)


#: The 401 codes that a newer token in the token file may cure (a rotation); the others
#: (``missing_token``, ``malformed_authorization``) are the client's own fault.
_ROTATABLE = frozenset({"unknown_token", "revoked_token"})


class _Credentials:
    """The headers every engine call carries, and the token file they came from.

    The file is read at start; when the service refuses the token as unknown or revoked (a 401
    does nothing, so the call may be sent again) it is read once more, and a token there that
    differs from the refused one replaces it in ``headers`` (which the client's connection
    pool shares) and on the pool socket (``token``). Never shown."""

    def __init__(
        self, token: str | None, token_file: Path | str | None, namespace: str | None
    ) -> None:
        if token is not None and token_file is not None:
            raise ValueError("give token or token_file, not both")
        if token_file is not None:
            token = read_token_file(token_file)
        elif token is not None and not _is_token(token):
            raise ValueError(f"token: {_NOT_A_TOKEN}")
        self._file = token_file
        self.token = token
        self.namespace = namespace
        self.headers: dict[str, str] = {}
        if token is not None:
            self.headers["authorization"] = f"Bearer {token}"
        if namespace is not None:
            if not namespace or not all("!" <= ch <= "~" for ch in namespace):
                raise ValueError(f"namespace {namespace!r}: not a namespace name")
            self.headers[NAMESPACE_HEADER] = namespace

    def __repr__(self) -> str:
        return "_Credentials(...)"

    def rotated(self, response: httpx.Response, headers: httpx.Headers) -> bool:
        """Whether ``response`` refused a token that the token file no longer holds: then
        the file's token is in ``headers`` now, and the call should be sent once more."""
        if response.status_code != 401 or self._file is None:
            return False
        try:
            code = response.json()["error"]["code"]
        except (ValueError, KeyError, TypeError):
            return False
        if code not in _ROTATABLE:
            return False
        refused = response.request.headers.get("authorization")
        try:
            token = read_token_file(self._file)
        except ValueError:
            return False  # mid-rewrite or gone: the 401 stands
        if f"Bearer {token}" == refused:
            return False
        self.token = token
        self.headers["authorization"] = headers["authorization"] = f"Bearer {token}"
        return True


class _SocketAuth:
    """What a client needs to register over the pool socket: its credentials (the current
    token, as the headers carry it; never shown) and engine socket."""

    def __init__(self, credentials: _Credentials, uds: str | None) -> None:
        self._credentials = credentials
        self._uds = uds

    def __repr__(self) -> str:
        return "_SocketAuth(...)"

    def register(
        self, spec: Mapping[str, Any], fds: Sequence[int], pool_socket: str | None
    ) -> dict[str, Any]:
        """``kvoffload_client.pool_socket.register_kv_cache`` with this client's credentials."""
        path = pool_socket
        if path is None and self._uds is not None:
            path = default_pool_socket(self._uds)
        if path is None:
            raise ValueError("descriptors go over the pool socket: give pool_socket= (or uds=)")
        creds = self._credentials
        return _register_over_socket(
            path, dict(spec), list(fds), token=creds.token, namespace=creds.namespace
        )


# --------------------------------------------------------------------------- answers


@dataclass(frozen=True, slots=True)
class Lookup:
    """Per-key ``hit`` / ``pending`` / ``miss`` / ``disk`` / ``remote`` and the count of
    leading hits (pool hits). ``disk`` and ``remote`` keys are below the pool: ``onload`` loads
    them in one job; ``prepare_load`` raises a 409 error and brings them in (pending, then
    hit)."""

    results: list[str]
    hit_prefix: int
    #: With ``prefetch_deadline_s``: the prefetch the lookup started for keys below the pool
    #: (``prefetch_state``), None when it started none.
    prefetch_id: int | None = field(default=None, repr=False)


@dataclass(frozen=True, slots=True)
class PrepareStore:
    """Copy ``keys_to_store[i]`` to host slot ``slots[i]``, then ``complete_store``."""

    keys_to_store: list[bytes]
    slots: list[int]
    evicted_keys: list[bytes]
    skipped_keys: list[bytes]


@dataclass(frozen=True, slots=True)
class CompleteStore:
    """Per-key outcome of ``complete_store``."""

    completed: list[bytes]
    dropped: list[bytes]
    ignored: list[bytes]


@dataclass(frozen=True, slots=True)
class Released:
    """Leases released when a request finished."""

    req_id: str
    pins_released: int
    stores_dropped: int


@dataclass(frozen=True, slots=True)
class BlockTokens:
    """What a store may tell routers of its keys (``offload``, ``prepare_store``; used by a
    service publishing KV events, ignored by one that does not): ``token_ids``, ``block_size``
    tokens per key in key order, and ``parent``, the key before the first one in its sequence
    (None: the first key starts it)."""

    token_ids: Sequence[int]
    block_size: int
    parent: bytes | None = None

    def body(self) -> dict[str, Any]:
        """The fields a store's body gains."""
        out: dict[str, Any] = {"token_ids": list(self.token_ids), "block_size": self.block_size}
        if self.parent is not None:
            out["parent_block_hash"] = self.parent.hex()
        return out


def _tokens(tokens: BlockTokens | None) -> dict[str, Any]:
    return {} if tokens is None else tokens.body()


@dataclass(frozen=True, slots=True)
class TransferStarted:
    """An ``offload`` / ``onload`` answer: the job (``None``: nothing had to move)."""

    job_id: int | None
    state: JobState
    keys_to_store: list[bytes] = field(default_factory=list)
    evicted_keys: list[bytes] = field(default_factory=list)
    skipped_keys: list[bytes] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Job:
    """A transfer job."""

    job_id: int
    req_id: str
    direction: Literal["store", "load"]
    cache_id: str
    num_keys: int
    state: JobState
    bytes: int
    seconds: float
    reason: str | None


@dataclass(frozen=True, slots=True)
class JobsWaited:
    """``wait_jobs``: the jobs, and whether none is still running."""

    jobs: list[Job]
    done: bool


@dataclass(frozen=True, slots=True)
class KVEvent:
    """A KV event: ``BlockStored``, ``BlockRemoved`` or ``AllBlocksCleared``."""

    seq: int
    type: str
    block_hashes: list[bytes]
    medium: str


@dataclass(frozen=True, slots=True)
class EventsPage:
    """Events after a cursor; continue from ``next_after``; resync when ``fell_behind``."""

    events: list[KVEvent]
    next_after: int
    latest_seq: int
    fell_behind: bool
    instance: str


@dataclass(frozen=True, slots=True)
class KVCache:
    """A registered device KV cache."""

    cache_id: str
    name: str
    block_bytes: int
    num_blocks: int
    device: str


@dataclass(frozen=True, slots=True)
class Pool:
    """The host pool layout."""

    path: str
    num_blocks: int
    block_bytes: int
    pinned: bool
    max_keys_per_call: int
    pool_id: str


@dataclass(frozen=True, slots=True)
class Retention:
    """A retention: its ``name``, how many ``keys`` it names and how many of them are ready in
    the pool (``in_pool``), its ``ttl_s``, the seconds until it ends (``expires_in_s``) and
    since it was created (``age_s``)."""

    name: str
    keys: int
    in_pool: int
    ttl_s: float
    expires_in_s: float
    age_s: float


@dataclass(frozen=True, slots=True)
class Retained:
    """What ``retain`` did: the retention as it is now (``name`` .. ``age_s``, as
    ``Retention``), whether this call ``created`` it, how many keys it ``added``, each asked
    key's state when retained (``results``: ``hit``, ``pending``, or the name of the tier below
    the pool it is promoted from) and how many keys are on their way up (``promoting``)."""

    name: str
    keys: int
    in_pool: int
    ttl_s: float
    expires_in_s: float
    age_s: float
    created: bool
    added: int
    results: list[str]
    promoting: int


@dataclass(frozen=True, slots=True)
class Retentions:
    """The namespace's live retentions, oldest first; the distinct blocks they retain and the
    namespace's bound on them."""

    retentions: list[Retention]
    retained_blocks: int
    max_retained_blocks: int


@dataclass(frozen=True, slots=True)
class Prefetch:
    """A prefetch: its id (for ``prefetch_state`` / ``cancel_prefetch``), the request that
    named it, its ``state`` (``promoting``: reads in flight; ``held``: landed, waiting for a
    load; ``done``; ``cancelled``), seconds until its holds end, its ``counts`` (``hit``,
    ``promoted``, ``pending``, ``miss``, ``refused``, ``landed``, ``failed``, ``used``,
    ``wasted``) and, in ``prefetch``'s answer only, each key's state when it started
    (``results``: ``hit``, ``pending``, a tier name, ``miss``, ``refused``; else None)."""

    prefetch_id: int
    req_id: str
    state: PrefetchState
    deadline_in_s: float
    counts: dict[str, int]
    results: list[str] | None = None


@dataclass(frozen=True, slots=True)
class Hint:
    """What ``demote`` or ``drop`` did: the keys it ``moved`` out of the pool, and how many of
    the others stayed and why (``kept``: ``pinned``, ``retained``, ``pending``,
    ``not_in_pool``)."""

    moved: list[bytes]
    kept: dict[str, int]


@dataclass(frozen=True, slots=True)
class OpResult:
    """One batch op: ``result`` (the op's JSON answer) when ``ok``, else ``error``."""

    ok: bool
    status: int
    result: dict[str, Any] | None
    error: KVOffloadError | None


# --------------------------------------------------------------------------- call descriptions


def _hex(keys: Sequence[bytes]) -> list[str]:
    """``keys`` on the wire (hex). ``TypeError`` naming the argument, what it got and what it
    takes, unless every key is ``bytes`` (or ``bytearray``): one key type, so that a hex
    string is never taken for the bytes it spells or the other way round."""
    if isinstance(keys, str | bytes | bytearray):
        raise TypeError(
            f"keys: expected a sequence of bytes keys (e.g. a list), got one {type(keys).__name__}"
        )
    out = []
    for i, key in enumerate(keys):
        if not isinstance(key, bytes | bytearray):
            hint = "; a hex str is not accepted: pass bytes.fromhex(key)"
            raise TypeError(
                f"keys[{i}]: expected bytes, got {type(key).__name__}"
                f"{hint if isinstance(key, str) else ''}"
            )
        out.append(key.hex())
    return out


def _unhex(keys: Sequence[str]) -> list[bytes]:
    return [bytes.fromhex(k) for k in keys]


@dataclass(frozen=True, slots=True)
class _Call(Generic[T]):
    method: str
    path: str
    body: Any
    read: Callable[[Any], T]
    params: Mapping[str, str | int | float] | None = None


def _none(_: Any) -> None:
    return None


def _job(d: Mapping[str, Any]) -> Job:
    return Job(**d)


def _started(d: Mapping[str, Any]) -> TransferStarted:
    return TransferStarted(
        job_id=d["job_id"],
        state=d["state"],
        keys_to_store=_unhex(d.get("keys_to_store", [])),
        evicted_keys=_unhex(d.get("evicted_keys", [])),
        skipped_keys=_unhex(d.get("skipped_keys", [])),
        slots=list(d.get("slots", [])),
    )


def _events(d: Mapping[str, Any]) -> EventsPage:
    return EventsPage(
        events=[
            KVEvent(e["seq"], e["type"], _unhex(e["block_hashes"]), e["medium"])
            for e in d["events"]
        ],
        next_after=d["next_after"],
        latest_seq=d["latest_seq"],
        fell_behind=d["fell_behind"],
        instance=d["instance"],
    )


#: The fields of a retention on the wire (``Retention``, and the start of ``Retained``).
_RETENTION_FIELDS = ("name", "keys", "in_pool", "ttl_s", "expires_in_s", "age_s")


def _retention(d: Mapping[str, Any]) -> Retention:
    return Retention(**{k: d[k] for k in _RETENTION_FIELDS})


def _retained(d: Mapping[str, Any]) -> Retained:
    return Retained(
        **{k: d[k] for k in _RETENTION_FIELDS},
        created=d["created"],
        added=d["added"],
        results=list(d["results"]),
        promoting=d["promoting"],
    )


def _retentions(d: Mapping[str, Any]) -> Retentions:
    return Retentions(
        retentions=[_retention(r) for r in d["retentions"]],
        retained_blocks=d["retained_blocks"],
        max_retained_blocks=d["max_retained_blocks"],
    )


def _prefetch(d: Mapping[str, Any]) -> Prefetch:
    results = d.get("results")
    return Prefetch(
        prefetch_id=d["prefetch_id"],
        req_id=d["req_id"],
        state=d["state"],
        deadline_in_s=d["deadline_in_s"],
        counts=dict(d["counts"]),
        results=None if results is None else list(results),
    )


def _hint(d: Mapping[str, Any]) -> Hint:
    return Hint(moved=_unhex(d["moved"]), kept=dict(d["kept"]))


def _batch(d: Mapping[str, Any]) -> list[OpResult]:
    out = []
    for r in d["results"]:
        err = r.get("error")
        error = None if err is None else _error(r["status"], err, "")
        out.append(OpResult(r["ok"], r["status"], r.get("result"), error))
    return out


def _segment(value: str) -> str:
    """``value`` as one path segment: every reserved character percent-encoded.

    httpx alone leaves ``?``, ``#``, ``/`` and ``%`` as they are, and resolves ``.`` and ``..``
    segments, so such an id would address another path (``"r1?x"`` is request ``r1`` with a
    query string). The service decodes the segment back to the id; an id holding ``/`` matches
    no route (404).
    """
    if value in (".", ".."):
        return "%2E" * len(value)
    return quote(value, safe="")


def _req(req_id: str, suffix: str = "") -> str:
    # req_id goes in the path, as one segment.
    return f"/v1/requests/{_segment(req_id)}{suffix}"


class Batch:
    """Ops for one ``POST /v1/batch`` call, added in the order they will run."""

    def __init__(self) -> None:
        self.ops: list[dict[str, Any]] = []

    def _add(self, op: str, req_id: str, **fields: Any) -> Batch:
        self.ops.append({"op": op, "req_id": req_id, **fields})
        return self

    def start_request(
        self, req_id: str, kv_transfer_params: Mapping[str, Any] | None = None
    ) -> Batch:
        """Add ``start_request``."""
        if kv_transfer_params is None:
            return self._add("start_request", req_id)
        return self._add("start_request", req_id, kv_transfer_params=dict(kv_transfer_params))

    def finish_request(self, req_id: str, abort: bool = False) -> Batch:
        """Add ``finish_request``."""
        return self._add("finish_request", req_id, abort=abort)

    def lookup(
        self, req_id: str, keys: Sequence[bytes], prefetch_deadline_s: float | None = None
    ) -> Batch:
        """Add ``lookup`` (with ``prefetch_deadline_s``: keys below the pool start coming up,
        held that long for a load)."""
        if prefetch_deadline_s is None:
            return self._add("lookup", req_id, keys=_hex(keys))
        return self._add("lookup", req_id, keys=_hex(keys), prefetch_deadline_s=prefetch_deadline_s)

    def prepare_load(self, req_id: str, keys: Sequence[bytes]) -> Batch:
        """Add ``prepare_load``."""
        return self._add("prepare_load", req_id, keys=_hex(keys))

    def touch(self, req_id: str, keys: Sequence[bytes]) -> Batch:
        """Add ``touch``."""
        return self._add("touch", req_id, keys=_hex(keys))

    def complete_load(self, req_id: str, keys: Sequence[bytes]) -> Batch:
        """Add ``complete_load``."""
        return self._add("complete_load", req_id, keys=_hex(keys))

    def prepare_store(
        self, req_id: str, keys: Sequence[bytes], *, tokens: BlockTokens | None = None
    ) -> Batch:
        """Add ``prepare_store`` (``tokens``: see ``BlockTokens``)."""
        return self._add("prepare_store", req_id, keys=_hex(keys), **_tokens(tokens))

    def complete_store(self, req_id: str, keys: Sequence[bytes], success: bool = True) -> Batch:
        """Add ``complete_store``."""
        return self._add("complete_store", req_id, keys=_hex(keys), success=success)

    def offload(
        self,
        req_id: str,
        cache_id: str,
        keys: Sequence[bytes],
        device_blocks: Sequence[int],
        wait_event: bytes | None = None,
        *,
        tokens: BlockTokens | None = None,
    ) -> Batch:
        """Add ``offload`` (``wait_event``: see ``KVOffloadClient.offload``; ``tokens``: see
        ``BlockTokens``)."""
        extra = {} if wait_event is None else {"wait_event": _wait_event(wait_event)}
        extra.update(_tokens(tokens))
        return self._add(
            "offload",
            req_id,
            cache_id=cache_id,
            keys=_hex(keys),
            device_blocks=list(device_blocks),
            **extra,
        )

    def onload(
        self,
        req_id: str,
        cache_id: str,
        keys: Sequence[bytes],
        device_blocks: Sequence[int],
        wait_event: bytes | None = None,
    ) -> Batch:
        """Add ``onload`` (``wait_event``: see ``KVOffloadClient.onload``)."""
        extra = {} if wait_event is None else {"wait_event": _wait_event(wait_event)}
        return self._add(
            "onload",
            req_id,
            cache_id=cache_id,
            keys=_hex(keys),
            device_blocks=list(device_blocks),
            **extra,
        )

    def retain(
        self, req_id: str, keys: Sequence[bytes], ttl_s: float, name: str | None = None
    ) -> Batch:
        """Add ``retain`` (see ``KVOffloadClient.retain``; its result is a ``RetainAnswer``)."""
        extra = {} if name is None else {"name": name}
        return self._add("retain", req_id, keys=_hex(keys), ttl_s=float(ttl_s), **extra)

    def prefetch(self, req_id: str, keys: Sequence[bytes], deadline_s: float) -> Batch:
        """Add ``prefetch`` (see ``KVOffloadClient.prefetch``; its result is a
        ``PrefetchAnswer`` with ``results``)."""
        return self._add("prefetch", req_id, keys=_hex(keys), deadline_s=float(deadline_s))

    def demote(self, req_id: str, keys: Sequence[bytes]) -> Batch:
        """Add ``demote`` (see ``KVOffloadClient.demote``)."""
        return self._add("demote", req_id, keys=_hex(keys))

    def drop(self, req_id: str, keys: Sequence[bytes]) -> Batch:
        """Add ``drop`` (see ``KVOffloadClient.drop``)."""
        return self._add("drop", req_id, keys=_hex(keys))


def _wait_event(handle: bytes) -> dict[str, str]:
    if len(handle) != 64:
        raise ValueError(f"wait_event must be a 64-byte CUDA IPC event handle, got {len(handle)}")
    return {"kind": "cuda_ipc_event", "handle": handle.hex()}


def _with_lease(spec: Mapping[str, Any], lease_s: float | None) -> dict[str, Any]:
    """A registration's body: ``spec``, with ``lease_s`` when given."""
    return dict(spec) if lease_s is None else {**spec, "lease_s": float(lease_s)}


class _Engine:
    """The engine API's calls, as descriptions both clients execute."""

    @staticmethod
    def start_request(req_id: str, kv_transfer_params: Mapping[str, Any] | None) -> _Call[bool]:
        body = {} if kv_transfer_params is None else {"kv_transfer_params": kv_transfer_params}
        return _Call("PUT", _req(req_id), body, lambda d: bool(d["created"]))

    @staticmethod
    def finish_request(req_id: str, abort: bool) -> _Call[Released]:
        return _Call(
            "DELETE",
            _req(req_id),
            None,
            lambda d: Released(**d),
            {"abort": "true" if abort else "false"},
        )

    @staticmethod
    def lookup(
        req_id: str, keys: Sequence[bytes], prefetch_deadline_s: float | None = None
    ) -> _Call[Lookup]:
        body: dict[str, Any] = {"keys": _hex(keys)}
        if prefetch_deadline_s is not None:
            body["prefetch_deadline_s"] = prefetch_deadline_s
        return _Call(
            "POST",
            _req(req_id, "/lookup"),
            body,
            lambda d: Lookup(d["results"], d["hit_prefix"], d.get("prefetch_id")),
        )

    @staticmethod
    def prepare_load(req_id: str, keys: Sequence[bytes]) -> _Call[list[int]]:
        return _Call(
            "POST", _req(req_id, "/prepare-load"), {"keys": _hex(keys)}, lambda d: d["slots"]
        )

    @staticmethod
    def touch(req_id: str, keys: Sequence[bytes]) -> _Call[None]:
        return _Call("POST", _req(req_id, "/touch"), {"keys": _hex(keys)}, _none)

    @staticmethod
    def complete_load(req_id: str, keys: Sequence[bytes]) -> _Call[None]:
        return _Call("POST", _req(req_id, "/complete-load"), {"keys": _hex(keys)}, _none)

    @staticmethod
    def prepare_store(
        req_id: str, keys: Sequence[bytes], tokens: BlockTokens | None = None
    ) -> _Call[PrepareStore]:
        return _Call(
            "POST",
            _req(req_id, "/prepare-store"),
            {"keys": _hex(keys), **_tokens(tokens)},
            lambda d: PrepareStore(
                _unhex(d["keys_to_store"]),
                d["slots"],
                _unhex(d["evicted_keys"]),
                _unhex(d["skipped_keys"]),
            ),
        )

    @staticmethod
    def complete_store(req_id: str, keys: Sequence[bytes], success: bool) -> _Call[CompleteStore]:
        return _Call(
            "POST",
            _req(req_id, "/complete-store"),
            {"keys": _hex(keys), "success": success},
            lambda d: CompleteStore(
                _unhex(d["completed"]), _unhex(d["dropped"]), _unhex(d["ignored"])
            ),
        )

    @staticmethod
    def transfer(
        op: str,
        req_id: str,
        cache_id: str,
        keys: Sequence[bytes],
        device_blocks: Sequence[int],
        wait_event: bytes | None = None,
        tokens: BlockTokens | None = None,
    ) -> _Call[TransferStarted]:
        body: dict[str, Any] = {
            "cache_id": cache_id,
            "keys": _hex(keys),
            "device_blocks": list(device_blocks),
            **_tokens(tokens),
        }
        if wait_event is not None:
            body["wait_event"] = _wait_event(wait_event)
        return _Call("POST", _req(req_id, f"/{op}"), body, _started)

    @staticmethod
    def job(job_id: int) -> _Call[Job]:
        return _Call("GET", f"/v1/jobs/{job_id}", None, _job)

    @staticmethod
    def wait_jobs(job_ids: Sequence[int], timeout_s: float) -> _Call[JobsWaited]:
        return _Call(
            "POST",
            "/v1/jobs/wait",
            {"job_ids": list(job_ids), "timeout_s": float(timeout_s)},
            lambda d: JobsWaited([_job(j) for j in d["jobs"]], d["done"]),
        )

    @staticmethod
    def batch(ops: Batch | Sequence[Mapping[str, Any]]) -> _Call[list[OpResult]]:
        items = ops.ops if isinstance(ops, Batch) else [dict(o) for o in ops]
        return _Call("POST", "/v1/batch", {"ops": items}, _batch)

    @staticmethod
    def events(after: int, limit: int) -> _Call[EventsPage]:
        return _Call("GET", "/v1/events", None, _events, {"after": after, "limit": limit})

    @staticmethod
    def register_kv_cache(spec: Mapping[str, Any], lease_s: float | None) -> _Call[KVCache]:
        body = _with_lease(spec, lease_s)
        return _Call("POST", "/v1/kv-caches", body, lambda d: KVCache(**d))

    @staticmethod
    def renew_kv_cache(cache_id: str) -> _Call[float]:
        return _Call(
            "POST", f"/v1/kv-caches/{_segment(cache_id)}/renew", None, lambda d: d["lease_s"]
        )

    @staticmethod
    def kv_caches() -> _Call[list[KVCache]]:
        return _Call("GET", "/v1/kv-caches", None, lambda d: [KVCache(**c) for c in d["kv_caches"]])

    @staticmethod
    def unregister_kv_cache(cache_id: str) -> _Call[None]:
        return _Call("DELETE", f"/v1/kv-caches/{_segment(cache_id)}", None, _none)

    @staticmethod
    def pool() -> _Call[Pool]:
        return _Call("GET", "/v1/pool", None, lambda d: Pool(**d))

    @staticmethod
    def readyz() -> _Call[bool]:
        return _Call("GET", "/readyz", None, lambda d: d["status"] == "ready")

    @staticmethod
    def retain(
        req_id: str, keys: Sequence[bytes], ttl_s: float, name: str | None
    ) -> _Call[Retained]:
        body: dict[str, Any] = {"keys": _hex(keys), "ttl_s": float(ttl_s)}
        if name is not None:
            body["name"] = name
        return _Call("POST", _req(req_id, "/retain"), body, _retained)

    @staticmethod
    def retentions() -> _Call[Retentions]:
        return _Call("GET", "/v1/retentions", None, _retentions)

    @staticmethod
    def retention(name: str) -> _Call[Retention]:
        return _Call("GET", f"/v1/retentions/{_segment(name)}", None, _retention)

    @staticmethod
    def renew_retention(name: str, ttl_s: float) -> _Call[Retention]:
        path = f"/v1/retentions/{_segment(name)}/renew"
        return _Call("POST", path, {"ttl_s": float(ttl_s)}, _retention)

    @staticmethod
    def release_retention(name: str) -> _Call[Retention]:
        return _Call("DELETE", f"/v1/retentions/{_segment(name)}", None, _retention)

    @staticmethod
    def prefetch(req_id: str, keys: Sequence[bytes], deadline_s: float) -> _Call[Prefetch]:
        body = {"keys": _hex(keys), "deadline_s": float(deadline_s)}
        return _Call("POST", _req(req_id, "/prefetch"), body, _prefetch)

    @staticmethod
    def prefetch_state(prefetch_id: int, wait_s: float) -> _Call[Prefetch]:
        params = {"wait_s": float(wait_s)} if wait_s > 0 else None
        return _Call("GET", f"/v1/prefetches/{int(prefetch_id)}", None, _prefetch, params)

    @staticmethod
    def cancel_prefetch(prefetch_id: int) -> _Call[Prefetch]:
        return _Call("DELETE", f"/v1/prefetches/{int(prefetch_id)}", None, _prefetch)

    @staticmethod
    def hint(verb: Literal["demote", "drop"], req_id: str, keys: Sequence[bytes]) -> _Call[Hint]:
        return _Call("POST", _req(req_id, f"/{verb}"), {"keys": _hex(keys)}, _hint)


def _request_kwargs(call: _Call[Any]) -> dict[str, Any]:
    kwargs: dict[str, Any] = {}
    if call.body is not None:
        kwargs["content"] = json.dumps(call.body).encode()
        kwargs["headers"] = _JSON_HEADERS
    if call.params is not None:
        kwargs["params"] = call.params
    return kwargs


def _read(call: _Call[T], response: httpx.Response, ok_statuses: tuple[int, ...] = ()) -> T:
    status = response.status_code
    # A redirect is an error too: the service never redirects a call it serves, and following
    # one (or reading its empty body as an answer) would report on some other path.
    if status >= 300 and status not in ok_statuses:
        try:
            err = response.json()["error"]
        except (ValueError, KeyError, TypeError):
            err = None
        raise _error(status, err, response.reason_phrase)
    if status == 204 or not response.content:
        return call.read({})
    return call.read(response.json())


def _transport_args(
    base_url: str | None, uds: str | None, transport: httpx.BaseTransport | None
) -> tuple[str, httpx.BaseTransport | None]:
    if uds is not None:
        return base_url or _UDS_BASE, transport or httpx.HTTPTransport(uds=uds)
    return base_url or "http://127.0.0.1:8000", transport


class _SyncClient:
    """The connection lifecycle both synchronous clients share: ``close()`` or ``with``."""

    _http: httpx.Client

    def close(self) -> None:
        """Close the connection pool (and stop renewing any lease)."""
        for stop in self.__dict__.pop("_renewers", {}).values():
            stop.set()
        self._http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _repr(client: KVOffloadClient | AsyncKVOffloadClient) -> str:
    http = client._http
    token = "set" if "authorization" in http.headers else None
    return (
        f"{type(client).__name__}(base_url={str(http.base_url)!r}, "
        f"namespace={client.namespace!r}, token={token})"
    )


class KVOffloadClient(_SyncClient):
    """Synchronous engine API client. Use as a context manager, or ``close()`` it.

    ``token`` / ``token_file`` (not both) and ``namespace`` are sent with every call (see the
    module docstring); a bad token file or token raises ``ValueError`` naming its source, never
    its value. The token file is read here, and again when the service answers 401
    ``unknown_token`` / ``revoked_token``: a new token there is sent with the same call once
    more, and with every call after it (rotation without a restart).

    ``last_pool_id`` is the ``X-KVOffload-Pool`` header of the last answer (None when the
    answer had none), so a caller that maps the pool can tell the service restarted.
    """

    def __init__(
        self,
        base_url: str | None = None,
        *,
        uds: str | None = None,
        timeout: float | httpx.Timeout = 30.0,
        transport: httpx.BaseTransport | None = None,
        token: str | None = None,
        token_file: Path | str | None = None,
        namespace: str | None = None,
    ) -> None:
        self._credentials = _Credentials(token, token_file, namespace)
        url, transport = _transport_args(base_url, uds, transport)
        self._http = httpx.Client(
            base_url=url, timeout=timeout, transport=transport, headers=self._credentials.headers
        )
        self._address = _address(url, uds)
        self._namespace = namespace
        self._socket_auth = _SocketAuth(self._credentials, uds)
        self.last_pool_id: str | None = None

    @property
    def namespace(self) -> str | None:
        """The namespace every call names (None: the service picks the tenant's only one)."""
        return self._namespace

    def current_token(self) -> str | None:
        """The token calls carry now (after any rotation); for the pool socket's request."""
        return self._credentials.token

    def __repr__(self) -> str:
        return _repr(self)

    def _call(self, call: _Call[T], ok_statuses: tuple[int, ...] = ()) -> T:
        kwargs = _request_kwargs(call)
        with _connecting(self._address):
            response = self._http.request(call.method, call.path, **kwargs)
            if self._credentials.rotated(response, self._http.headers):
                response = self._http.request(call.method, call.path, **kwargs)
        self.last_pool_id = response.headers.get(POOL_HEADER)
        return _read(call, response, ok_statuses)

    def start_request(
        self, req_id: str, kv_transfer_params: Mapping[str, Any] | None = None
    ) -> bool:
        """Start (True) or renew (False) a request."""
        return self._call(_Engine.start_request(req_id, kv_transfer_params))

    def finish_request(self, req_id: str, abort: bool = False) -> Released:
        """Finish a request; ``abort`` releases its leases now."""
        return self._call(_Engine.finish_request(req_id, abort))

    def lookup(
        self, req_id: str, keys: Sequence[bytes], prefetch_deadline_s: float | None = None
    ) -> Lookup:
        """Per-key state and ``hit_prefix``. With ``prefetch_deadline_s``, the keys a tier
        below the pool holds start coming up in the same call, held that long for a load
        (``Lookup.prefetch_id``; a service past its prefetch bound starts none)."""
        return self._call(_Engine.lookup(req_id, keys, prefetch_deadline_s))

    def prepare_load(self, req_id: str, keys: Sequence[bytes]) -> list[int]:
        """Pin ready keys; their host slots."""
        return self._call(_Engine.prepare_load(req_id, keys))

    def touch(self, req_id: str, keys: Sequence[bytes]) -> None:
        """Mark keys recently used."""
        self._call(_Engine.touch(req_id, keys))

    def complete_load(self, req_id: str, keys: Sequence[bytes]) -> None:
        """Unpin keys pinned by ``prepare_load``."""
        self._call(_Engine.complete_load(req_id, keys))

    def prepare_store(
        self, req_id: str, keys: Sequence[bytes], *, tokens: BlockTokens | None = None
    ) -> PrepareStore:
        """Reserve host slots for new keys (507 ``KVOffloadError`` when no room);
        ``tokens``: see ``BlockTokens``."""
        return self._call(_Engine.prepare_store(req_id, keys, tokens))

    def complete_store(
        self, req_id: str, keys: Sequence[bytes], success: bool = True
    ) -> CompleteStore:
        """Finish stores of ``keys``."""
        return self._call(_Engine.complete_store(req_id, keys, success))

    def offload(
        self,
        req_id: str,
        cache_id: str,
        keys: Sequence[bytes],
        device_blocks: Sequence[int],
        wait_event: bytes | None = None,
        *,
        tokens: BlockTokens | None = None,
    ) -> TransferStarted:
        """Store device blocks under keys (device->host job). ``wait_event``: the 64-byte
        ``ipc_handle()`` of an interprocess CUDA event recorded after the kernels that wrote
        the blocks; the copies wait on it (CUDA caches only). Keep the event alive until the
        job has ended: the service opens it when the job starts. ``tokens``: what routers
        learn of the keys (``BlockTokens``)."""
        call = _Engine.transfer(
            "offload", req_id, cache_id, keys, device_blocks, wait_event, tokens
        )
        return self._call(call)

    def onload(
        self,
        req_id: str,
        cache_id: str,
        keys: Sequence[bytes],
        device_blocks: Sequence[int],
        wait_event: bytes | None = None,
    ) -> TransferStarted:
        """Load ready keys into device blocks (host->device job). ``wait_event``: an event
        recorded after the kernels that last read those blocks (see ``offload``)."""
        call = _Engine.transfer("onload", req_id, cache_id, keys, device_blocks, wait_event)
        return self._call(call)

    def job(self, job_id: int) -> Job:
        """A transfer job."""
        return self._call(_Engine.job(job_id))

    def wait_jobs(self, job_ids: Sequence[int], timeout_s: float = 10.0) -> JobsWaited:
        """Long-poll until none of the jobs runs or ``timeout_s`` passed."""
        return self._call(_Engine.wait_jobs(job_ids, timeout_s))

    def batch(self, ops: Batch | Sequence[Mapping[str, Any]]) -> list[OpResult]:
        """Run many ops in one call; one result per op."""
        return self._call(_Engine.batch(ops))

    def events(self, after: int = 0, limit: int = 1000) -> EventsPage:
        """KV events with ``seq > after``."""
        return self._call(_Engine.events(after, limit))

    def register_kv_cache(
        self,
        spec: Mapping[str, Any],
        fds: Sequence[int] | None = None,
        *,
        lease_s: float | None = None,
        renew: bool = True,
        pool_socket: str | None = None,
    ) -> KVCache:
        """Register a device KV cache.

        Without ``fds``: ``POST /v1/kv-caches`` (``shm`` handles name a path: a service
        without tenants). With ``fds``: over the pool socket (``pool_socket``, else the engine
        socket's path plus ``.pool``), passing the descriptors, which ``{"kind": "shm", "fd":
        K}`` handles name by index: how a service with tenants takes them
        (``kvoffload_client.pool_socket.register_kv_cache``; its ``PoolShareError`` on a refusal).

        With ``lease_s`` the service forgets it (and closes its mappings) unless renewed within
        ``lease_s``; with ``renew`` a daemon thread renews it every ``lease_s / 3`` until
        ``unregister_kv_cache``, ``close``, or the service answering that it is gone."""
        if fds is None:
            cache = self._call(_Engine.register_kv_cache(spec, lease_s))
        else:
            full = _with_lease(spec, lease_s)
            cache = KVCache(**self._socket_auth.register(full, fds, pool_socket))
        if lease_s is not None and renew:
            self._start_renewing(cache.cache_id, lease_s / 3)
        return cache

    def renew_kv_cache(self, cache_id: str) -> float:
        """Renew a registration's lease; its ``lease_s`` (404 once it lapsed)."""
        return self._call(_Engine.renew_kv_cache(cache_id))

    def _start_renewing(self, cache_id: str, every_s: float) -> None:
        renewers = self.__dict__.setdefault("_renewers", {})
        stop = threading.Event()
        old = renewers.pop(cache_id, None)
        if old is not None:
            old.set()
        renewers[cache_id] = stop

        def loop() -> None:
            while not stop.wait(every_s):
                try:
                    self.renew_kv_cache(cache_id)
                except KVOffloadError as exc:
                    if exc.status == 404:
                        return  # lapsed or unregistered: the engine must register again
                except Exception:  # a closed client, a transient network error: retry
                    if self._http.is_closed:
                        return

        threading.Thread(target=loop, name=f"kvoffload-renew-{cache_id}", daemon=True).start()

    def _stop_renewing(self, cache_id: str | None = None) -> None:
        renewers = self.__dict__.get("_renewers", {})
        for cid in [cache_id] if cache_id is not None else list(renewers):
            stop = renewers.pop(cid, None)
            if stop is not None:
                stop.set()

    def kv_caches(self) -> list[KVCache]:
        """Registered device KV caches."""
        return self._call(_Engine.kv_caches())

    def unregister_kv_cache(self, cache_id: str) -> None:
        """Forget a device KV cache (and stop renewing its lease)."""
        self._stop_renewing(cache_id)
        self._call(_Engine.unregister_kv_cache(cache_id))

    def pool(self) -> Pool:
        """The host pool layout."""
        return self._call(_Engine.pool())

    def ready(self) -> bool:
        """True when ``/readyz`` says ready."""
        return self._call(_Engine.readyz(), ok_statuses=(503,))

    # ------------------------------------------------------------------ cache control

    def retain(
        self, req_id: str, keys: Sequence[bytes], ttl_s: float, name: str | None = None
    ) -> Retained:
        """Keep ``keys`` in the pool against eviction for ``ttl_s`` seconds as retention
        ``name`` (default: ``req_id``, which need not be a started request); keys below the pool
        are promoted and kept once they land. A name that exists gets the keys it lacks and its
        TTL restarted (``created`` False). Raises ``KVOffloadError`` 404 ``unknown_keys`` (a key
        held nowhere; nothing changes), 422 (a bad ``ttl_s`` or ``name``, a TTL over the
        service's bound) and ``KVOffloadQuotaError`` 429 (``retained_blocks``,
        ``retentions``)."""
        return self._call(_Engine.retain(req_id, keys, ttl_s, name))

    def retentions(self) -> Retentions:
        """The namespace's live retentions, oldest first."""
        return self._call(_Engine.retentions())

    def retention(self, name: str) -> Retention:
        """Retention ``name`` (``KVOffloadError`` 404 ``unknown_retention``)."""
        return self._call(_Engine.retention(name))

    def renew_retention(self, name: str, ttl_s: float) -> Retention:
        """Restart retention ``name``'s TTL as ``ttl_s`` from now (404 ``unknown_retention``)."""
        return self._call(_Engine.renew_retention(name, ttl_s))

    def release_retention(self, name: str) -> Retention:
        """End retention ``name`` now (its blocks are evictable again); what it was (404
        ``unknown_retention``)."""
        return self._call(_Engine.release_retention(name))

    def prefetch(self, req_id: str, keys: Sequence[bytes], deadline_s: float) -> Prefetch:
        """Bring the ``keys`` below the pool into it and hold them, with those the pool has,
        until a load pins them or ``deadline_s`` seconds pass; the answer has ``results``.
        ``KVOffloadQuotaError`` 429 ``prefetch_keys`` past the namespace's bound."""
        return self._call(_Engine.prefetch(req_id, keys, deadline_s))

    def prefetch_state(self, prefetch_id: int, wait_s: float = 0.0) -> Prefetch:
        """A prefetch, live or recently finished (no ``results``); with ``wait_s`` > 0 the
        service answers once its reads settled or ``wait_s`` (capped by its
        ``job_wait_max_s``) passed. 404 ``unknown_prefetch``."""
        return self._call(_Engine.prefetch_state(prefetch_id, wait_s))

    def cancel_prefetch(self, prefetch_id: int) -> Prefetch:
        """Cancel a prefetch: its holds end now (counted ``wasted``); what it is then."""
        return self._call(_Engine.cancel_prefetch(prefetch_id))

    def demote(self, req_id: str, keys: Sequence[bytes]) -> Hint:
        """Evict the movable ``keys`` from the pool now into the tiers below (not pinned,
        retained or pending ones). 409 ``no_lower_tier`` when the service has none."""
        return self._call(_Engine.hint("demote", req_id, keys))

    def drop(self, req_id: str, keys: Sequence[bytes]) -> Hint:
        """Remove the movable ``keys`` from this namespace's pool now (copies below stay)."""
        return self._call(_Engine.hint("drop", req_id, keys))


class AsyncKVOffloadClient:
    """Asynchronous engine API client (same calls and credentials as ``KVOffloadClient``)."""

    def __init__(
        self,
        base_url: str | None = None,
        *,
        uds: str | None = None,
        timeout: float = 30.0,
        transport: httpx.AsyncBaseTransport | None = None,
        token: str | None = None,
        token_file: Path | str | None = None,
        namespace: str | None = None,
    ) -> None:
        self._credentials = _Credentials(token, token_file, namespace)
        if uds is not None:
            url = base_url or _UDS_BASE
            transport = transport or httpx.AsyncHTTPTransport(uds=uds)
        else:
            url = base_url or "http://127.0.0.1:8000"
        self._http = httpx.AsyncClient(
            base_url=url, timeout=timeout, transport=transport, headers=self._credentials.headers
        )
        self._address = _address(url, uds)
        self._namespace = namespace
        self._socket_auth = _SocketAuth(self._credentials, uds)
        self._renewers: dict[str, asyncio.Task[None]] = {}

    @property
    def namespace(self) -> str | None:
        """The namespace every call names (None: the service picks the tenant's only one)."""
        return self._namespace

    def current_token(self) -> str | None:
        """The token calls carry now (after any rotation); for the pool socket's request."""
        return self._credentials.token

    def __repr__(self) -> str:
        return _repr(self)

    async def _call(self, call: _Call[T], ok_statuses: tuple[int, ...] = ()) -> T:
        kwargs = _request_kwargs(call)
        with _connecting(self._address):
            response = await self._http.request(call.method, call.path, **kwargs)
            if self._credentials.rotated(response, self._http.headers):
                response = await self._http.request(call.method, call.path, **kwargs)
        return _read(call, response, ok_statuses)

    async def aclose(self) -> None:
        """Close the connection pool (and stop renewing any lease)."""
        await self._stop_renewing()
        await self._http.aclose()

    async def __aenter__(self) -> AsyncKVOffloadClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def start_request(
        self, req_id: str, kv_transfer_params: Mapping[str, Any] | None = None
    ) -> bool:
        """Start (True) or renew (False) a request."""
        return await self._call(_Engine.start_request(req_id, kv_transfer_params))

    async def finish_request(self, req_id: str, abort: bool = False) -> Released:
        """Finish a request; ``abort`` releases its leases now."""
        return await self._call(_Engine.finish_request(req_id, abort))

    async def lookup(
        self, req_id: str, keys: Sequence[bytes], prefetch_deadline_s: float | None = None
    ) -> Lookup:
        """Per-key state and ``hit_prefix`` (``prefetch_deadline_s``: as the sync client's)."""
        return await self._call(_Engine.lookup(req_id, keys, prefetch_deadline_s))

    async def prepare_load(self, req_id: str, keys: Sequence[bytes]) -> list[int]:
        """Pin ready keys; their host slots."""
        return await self._call(_Engine.prepare_load(req_id, keys))

    async def touch(self, req_id: str, keys: Sequence[bytes]) -> None:
        """Mark keys recently used."""
        await self._call(_Engine.touch(req_id, keys))

    async def complete_load(self, req_id: str, keys: Sequence[bytes]) -> None:
        """Unpin keys pinned by ``prepare_load``."""
        await self._call(_Engine.complete_load(req_id, keys))

    async def prepare_store(
        self, req_id: str, keys: Sequence[bytes], *, tokens: BlockTokens | None = None
    ) -> PrepareStore:
        """Reserve host slots for new keys (507 ``KVOffloadError`` when no room);
        ``tokens``: see ``BlockTokens``."""
        return await self._call(_Engine.prepare_store(req_id, keys, tokens))

    async def complete_store(
        self, req_id: str, keys: Sequence[bytes], success: bool = True
    ) -> CompleteStore:
        """Finish stores of ``keys``."""
        return await self._call(_Engine.complete_store(req_id, keys, success))

    async def offload(
        self,
        req_id: str,
        cache_id: str,
        keys: Sequence[bytes],
        device_blocks: Sequence[int],
        wait_event: bytes | None = None,
        *,
        tokens: BlockTokens | None = None,
    ) -> TransferStarted:
        """Store device blocks under keys (device->host job). ``wait_event``: the 64-byte
        ``ipc_handle()`` of an interprocess CUDA event recorded after the kernels that wrote
        the blocks; the copies wait on it (CUDA caches only). Keep the event alive until the
        job has ended: the service opens it when the job starts. ``tokens``: what routers
        learn of the keys (``BlockTokens``)."""
        call = _Engine.transfer(
            "offload", req_id, cache_id, keys, device_blocks, wait_event, tokens
        )
        return await self._call(call)

    async def onload(
        self,
        req_id: str,
        cache_id: str,
        keys: Sequence[bytes],
        device_blocks: Sequence[int],
        wait_event: bytes | None = None,
    ) -> TransferStarted:
        """Load ready keys into device blocks (host->device job). ``wait_event``: an event
        recorded after the kernels that last read those blocks (see ``offload``)."""
        call = _Engine.transfer("onload", req_id, cache_id, keys, device_blocks, wait_event)
        return await self._call(call)

    async def job(self, job_id: int) -> Job:
        """A transfer job."""
        return await self._call(_Engine.job(job_id))

    async def wait_jobs(self, job_ids: Sequence[int], timeout_s: float = 10.0) -> JobsWaited:
        """Long-poll until none of the jobs runs or ``timeout_s`` passed."""
        return await self._call(_Engine.wait_jobs(job_ids, timeout_s))

    async def batch(self, ops: Batch | Sequence[Mapping[str, Any]]) -> list[OpResult]:
        """Run many ops in one call; one result per op."""
        return await self._call(_Engine.batch(ops))

    async def events(self, after: int = 0, limit: int = 1000) -> EventsPage:
        """KV events with ``seq > after``."""
        return await self._call(_Engine.events(after, limit))

    async def register_kv_cache(
        self,
        spec: Mapping[str, Any],
        fds: Sequence[int] | None = None,
        *,
        lease_s: float | None = None,
        renew: bool = True,
        pool_socket: str | None = None,
    ) -> KVCache:
        """Register a device KV cache (``KVOffloadClient.register_kv_cache``: by path over
        HTTP, or with ``fds`` over the pool socket in a worker thread). With ``lease_s`` the
        service forgets it (and closes its mappings) unless renewed within ``lease_s``; with
        ``renew`` a task on this event loop renews it every ``lease_s / 3`` until
        ``unregister_kv_cache``, ``aclose``, or the service answering that it is gone."""
        if fds is None:
            cache = await self._call(_Engine.register_kv_cache(spec, lease_s))
        else:
            full = _with_lease(spec, lease_s)
            answer = await asyncio.to_thread(self._socket_auth.register, full, fds, pool_socket)
            cache = KVCache(**answer)
        if lease_s is not None and renew:
            await self._stop_renewing(cache.cache_id)
            self._renewers[cache.cache_id] = asyncio.create_task(
                self._renew_loop(cache.cache_id, lease_s / 3),
                name=f"kvoffload-renew-{cache.cache_id}",
            )
        return cache

    async def _renew_loop(self, cache_id: str, every_s: float) -> None:
        while True:
            await asyncio.sleep(every_s)
            try:
                await self.renew_kv_cache(cache_id)
            except KVOffloadError as exc:
                if exc.status == 404:
                    break  # lapsed or unregistered: the engine must register again
            except asyncio.CancelledError:
                raise
            except Exception:  # a closed client, a transient network error: retry
                if self._http.is_closed:
                    break
        if self._renewers.get(cache_id) is asyncio.current_task():
            del self._renewers[cache_id]

    async def _stop_renewing(self, cache_id: str | None = None) -> None:
        ids = [cache_id] if cache_id is not None else list(self._renewers)
        for cid in ids:
            task = self._renewers.pop(cid, None)
            if task is None or task is asyncio.current_task():
                continue
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    @property
    def renewing(self) -> list[str]:
        """The registrations whose lease this client renews now."""
        return [c for c, t in self._renewers.items() if not t.done()]

    async def renew_kv_cache(self, cache_id: str) -> float:
        """Renew a registration's lease; its ``lease_s`` (404 once it lapsed)."""
        return await self._call(_Engine.renew_kv_cache(cache_id))

    async def kv_caches(self) -> list[KVCache]:
        """Registered device KV caches."""
        return await self._call(_Engine.kv_caches())

    async def unregister_kv_cache(self, cache_id: str) -> None:
        """Forget a device KV cache (and stop renewing its lease)."""
        await self._stop_renewing(cache_id)
        await self._call(_Engine.unregister_kv_cache(cache_id))

    async def pool(self) -> Pool:
        """The host pool layout."""
        return await self._call(_Engine.pool())

    async def ready(self) -> bool:
        """True when ``/readyz`` says ready."""
        return await self._call(_Engine.readyz(), ok_statuses=(503,))

    # ------------------------------------------------------------------ cache control

    async def retain(
        self, req_id: str, keys: Sequence[bytes], ttl_s: float, name: str | None = None
    ) -> Retained:
        """Retain ``keys`` for ``ttl_s`` seconds as ``name`` (``KVOffloadClient.retain``)."""
        return await self._call(_Engine.retain(req_id, keys, ttl_s, name))

    async def retentions(self) -> Retentions:
        """The namespace's live retentions, oldest first."""
        return await self._call(_Engine.retentions())

    async def retention(self, name: str) -> Retention:
        """Retention ``name`` (``KVOffloadError`` 404 ``unknown_retention``)."""
        return await self._call(_Engine.retention(name))

    async def renew_retention(self, name: str, ttl_s: float) -> Retention:
        """Restart retention ``name``'s TTL as ``ttl_s`` from now (404 ``unknown_retention``)."""
        return await self._call(_Engine.renew_retention(name, ttl_s))

    async def release_retention(self, name: str) -> Retention:
        """End retention ``name`` now; what it was (404 ``unknown_retention``)."""
        return await self._call(_Engine.release_retention(name))

    async def prefetch(self, req_id: str, keys: Sequence[bytes], deadline_s: float) -> Prefetch:
        """Prefetch ``keys`` for ``deadline_s`` seconds (``KVOffloadClient.prefetch``)."""
        return await self._call(_Engine.prefetch(req_id, keys, deadline_s))

    async def prefetch_state(self, prefetch_id: int, wait_s: float = 0.0) -> Prefetch:
        """A prefetch; with ``wait_s`` > 0 once its reads settled (``prefetch_state``)."""
        return await self._call(_Engine.prefetch_state(prefetch_id, wait_s))

    async def cancel_prefetch(self, prefetch_id: int) -> Prefetch:
        """Cancel a prefetch: its holds end now (counted ``wasted``); what it is then."""
        return await self._call(_Engine.cancel_prefetch(prefetch_id))

    async def demote(self, req_id: str, keys: Sequence[bytes]) -> Hint:
        """Evict the movable ``keys`` into the tiers below now (``KVOffloadClient.demote``)."""
        return await self._call(_Engine.hint("demote", req_id, keys))

    async def drop(self, req_id: str, keys: Sequence[bytes]) -> Hint:
        """Remove the movable ``keys`` from the pool now (``KVOffloadClient.drop``)."""
        return await self._call(_Engine.hint("drop", req_id, keys))


class KVOffloadAdminClient(_SyncClient):
    """Synchronous admin API client; answers are the JSON objects the API returns."""

    def __init__(
        self,
        base_url: str = "http://127.0.0.1:8001",
        *,
        token: str | None = None,
        timeout: float = 10.0,
        transport: httpx.BaseTransport | None = None,
        namespace: str | None = None,
    ) -> None:
        """``namespace``: the one the calls that act on a namespace's state name (required by
        a service with tenants; ``tenants()`` and the log level are service-wide)."""
        headers = {} if token is None else {"authorization": f"Bearer {token}"}
        self._http = httpx.Client(
            base_url=base_url, timeout=timeout, headers=headers, transport=transport
        )
        self._scope = {} if namespace is None else {"namespace": namespace}

    def _json(self, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        call: _Call[dict[str, Any]] = _Call(method, path, kwargs.pop("body", None), dict)
        if kwargs.pop("scoped", True) and self._scope:
            kwargs["params"] = {**kwargs.get("params", {}), **self._scope}
        merged = _request_kwargs(call)
        if "headers" in kwargs:
            merged["headers"] = {**merged.get("headers", {}), **kwargs.pop("headers")}
        merged.update(kwargs)
        return _read(call, self._http.request(method, path, **merged))

    def policy(self) -> dict[str, Any]:
        """The active policy (name, params, generation, available)."""
        return self._json("GET", "/admin/v1/policy")

    def set_policy(
        self,
        name: str,
        params: Mapping[str, Any] | None = None,
        *,
        if_match: str | int | None = None,
    ) -> dict[str, Any]:
        """Switch the policy live; with ``if_match``, only from that generation (else 412)."""
        headers = {} if if_match is None else {"if-match": f'"{str(if_match).strip(chr(34))}"'}
        return self._json(
            "PUT",
            "/admin/v1/policy",
            body={"name": name, "params": dict(params or {})},
            headers=headers,
        )

    def shadow(self) -> dict[str, Any]:
        """Projected hit ratio of every policy on the live traffic, beside the live ratio."""
        return self._json("GET", "/admin/v1/policy/shadow")

    def log_level(self) -> dict[str, Any]:
        """The service's log level and the levels it accepts."""
        return self._json("GET", "/admin/v1/log-level", scoped=False)

    def set_log_level(self, level: str) -> dict[str, Any]:
        """Change the log level live (audited); answers the previous and the new level."""
        return self._json("PUT", "/admin/v1/log-level", body={"level": level}, scoped=False)

    def tenants(self) -> dict[str, Any]:
        """Every tenant: quotas, use, and each namespace's blocks and hit ratio."""
        return self._json("GET", "/admin/v1/tenants", scoped=False)

    def stats(self) -> dict[str, Any]:
        """Pool, hit ratio, counters, jobs."""
        return self._json("GET", "/admin/v1/stats")

    def requests(self, limit: int = 1000) -> dict[str, Any]:
        """Tracked requests and their leases."""
        return self._json("GET", "/admin/v1/requests", params={"limit": limit})

    def release(self, req_id: str) -> dict[str, Any]:
        """Force-release a request's leases."""
        return self._json("POST", f"/admin/v1/requests/{_segment(req_id)}/release")

    def clear_cache(self) -> dict[str, Any]:
        """Drop every block not pinned, retained or pending."""
        return self._json("POST", "/admin/v1/cache/clear")

    def retentions(self) -> dict[str, Any]:
        """The namespace's live retentions, retained blocks and their bound."""
        return self._json("GET", "/admin/v1/retentions")

    def release_retention(self, name: str) -> dict[str, Any]:
        """End retention ``name`` now (audited); the retention as it was (404
        ``unknown_retention``)."""
        return self._json("DELETE", f"/admin/v1/retentions/{_segment(name)}")
