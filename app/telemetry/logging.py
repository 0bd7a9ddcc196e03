"""Logging: structlog lines on stdout, the canonical per-call line, the audit trail, live level.

Two entry points, one output:

- **Module loggers** (``get_logger("service")``) are standard ``logging`` loggers under the
  ``kvoffload`` namespace; code passes structured fields as ``extra={"fields": {...}}``. The
  records of every other library (uvicorn, asyncio, httpx, the transfer layer) take the same
  path: ``configure_logging`` puts one handler on the root logger whose formatter is structlog's
  ``ProcessorFormatter``, so each record becomes one line with the same keys.
- **The canonical call line** (``log_call``), one per HTTP call, skips ``LogRecord`` and
  structlog's logger machinery: the call only queues its fields; at the end of the event loop
  iteration the queued lines are rendered as the records are (the JSON renderer's serializer,
  or the console renderer) and written to the same stream in one write, in order with the
  records. It is the only line on the hot path, hence the shortcut.

Every line carries ``ts``, ``level``, ``logger``, ``event``, its own fields, the values bound
with ``structlog.contextvars``, and the ids of the HTTP call being served (``bind_call``: the
call middleware binds ``request_id`` and ``req_id`` for the duration of each call, one
``ContextVar`` set, cheaper than binding them one by one), in that order of precedence. A
record written while serving one listener (``bind_listener``: the server binds ``engine`` or
``admin`` in each listener's task) carries ``listener``, so the lines uvicorn writes once per
listener (startup, shutdown) say which one they are about. JSON
(one object per line) unless the stream is a terminal (``fmt="auto"``), where structlog's
console renderer is easier on the eyes. Values under keys that name credentials
(token, authorization, password, secret, cookie) are replaced by ``[redacted]``, except
integers (and booleans): those are counts and flags (``tokens_added: 2``), and no credential
here is a number (tokens, passwords and cookies are strings).

Until ``configure_logging`` runs (tests, library use) nothing is installed: records go wherever
the host application sends them (pytest's ``caplog``), the call line included (logger
``kvoffload.access``, fields in ``extra``).

``set_level`` changes the level live (the admin API's ``PUT /admin/v1/log-level``) for every
logger at once: the root logger, which uvicorn's loggers inherit from, and the call line.
Audit lines are written whatever the level.

``audit(action, actor, **fields)`` writes one line per admin change on ``kvoffload.audit``.
Callers pass what changed, never a credential.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import threading
import time
from collections.abc import Callable, Sequence
from contextvars import ContextVar, Token
from typing import Any, Literal, TextIO, cast

import structlog
from structlog.stdlib import ProcessorFormatter
from structlog.typing import EventDict, Processor, WrappedLogger

AUDIT_LOGGER = "kvoffload.audit"
ACCESS_LOGGER = "kvoffload.access"
CALL_EVENT = "http_call"
LEVELS: dict[str, int] = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}
LogFormat = Literal["auto", "json", "console"]
CallLevel = Literal["debug", "info", "warning", "error"]
_SECRET_WORDS = ("token", "authorization", "password", "secret", "cookie")
_FIRST_KEYS = ("ts", "level", "logger", "event")
_THIRD_PARTY = ("uvicorn", "uvicorn.error", "uvicorn.access", "uvicorn.asgi")

_audit_log = logging.getLogger(AUDIT_LOGGER)
_access_log = logging.getLogger(ACCESS_LOGGER)
_call_ids: ContextVar[tuple[str, str] | None] = ContextVar("kvoffload_call_ids", default=None)
_listener: ContextVar[str | None] = ContextVar("kvoffload_listener", default=None)


def bind_listener(name: str) -> None:
    """Name the listener (``engine``, ``admin``) served in this context (a listener's task,
    and what it spawns) on every record logged there."""
    _listener.set(name)


def bind_call(request_id: str, req_id: str) -> Token[tuple[str, str] | None]:
    """Bind the ids of the HTTP call being served to every line logged in this context."""
    return _call_ids.set((request_id, req_id))


def unbind_call(token: Token[tuple[str, str] | None]) -> None:
    """Undo ``bind_call``."""
    _call_ids.reset(token)


def get_logger(name: str) -> logging.Logger:
    """A logger under the ``kvoffload`` namespace (``get_logger("service")``)."""
    return logging.getLogger(f"kvoffload.{name}")


def fields_of(record: logging.LogRecord) -> dict[str, Any]:
    """The structured fields attached to ``record`` (empty when none)."""
    value = getattr(record, "fields", None)
    return value if isinstance(value, dict) else {}


# --------------------------------------------------------------------------- processors


class _Clock:
    """UTC ISO-8601 timestamps with milliseconds; the seconds part is formatted once a second."""

    def __init__(self) -> None:
        # One tuple, replaced whole: a thread reading it never sees half an update.
        self._cached = (-1, "")

    def stamp(self, now: float) -> str:
        second = int(now)
        cached_second, prefix = self._cached
        if second != cached_second:
            prefix = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
            self._cached = (second, prefix)
        return f"{prefix}.{int((now - second) * 1000):03d}Z"


_clock = _Clock()


def _timestamp(logger: WrappedLogger, name: str, event: EventDict) -> EventDict:
    """``ts`` of a stdlib record (when it was made)."""
    record = event.get("_record")
    event["ts"] = _clock.stamp(
        record.created if isinstance(record, logging.LogRecord) else time.time()
    )
    return event


def _record_fields(logger: WrappedLogger, name: str, event: EventDict) -> EventDict:
    """Logger name and level of a stdlib record, and its ``extra={"fields": ...}``."""
    record = event.get("_record")
    if isinstance(record, logging.LogRecord):
        event["logger"] = record.name
        event["level"] = record.levelname.lower()
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            for key, value in fields.items():
                event.setdefault(key, value)
    return event


def _merge_call_ids(logger: WrappedLogger, name: str, event: EventDict) -> EventDict:
    """``request_id`` and ``req_id`` of the HTTP call being served (``bind_call``), and the
    listener serving it (``bind_listener``)."""
    ids = _call_ids.get()
    if ids is not None:
        event.setdefault("request_id", ids[0])
        event.setdefault("req_id", ids[1])
    listener = _listener.get()
    if listener is not None:
        event.setdefault("listener", listener)
    return event


def _redact(logger: WrappedLogger, name: str, event: EventDict) -> EventDict:
    """Replace the value of any key that names a credential, unless it is an integer (a
    count such as ``tokens_revoked``, or a boolean): every credential is a string."""
    for key, value in event.items():
        if isinstance(value, int):
            continue
        lowered = key.lower()
        if any(word in lowered for word in _SECRET_WORDS):
            event[key] = "[redacted]"
    return event


def _ordered(logger: WrappedLogger, name: str, event: EventDict) -> EventDict:
    """ts, level, logger, event first (easier to read); structlog's own keys dropped."""
    out: dict[str, Any] = {k: event[k] for k in _FIRST_KEYS if k in event}
    for key, value in event.items():
        if key not in out and key not in ("_record", "_from_structlog"):
            out[key] = value
    return out


_ENCODER = json.JSONEncoder(separators=(",", ":"), default=str, ensure_ascii=False)
# The C encoder behind ``_ENCODER``, built once: ``JSONEncoder.encode`` builds a new one on every
# call, a third of the cost of a line. Without circular-reference checks (log values are flat).
_make_c_encoder: Any = getattr(json.encoder, "c_make_encoder", None)
_C_ENCODER: Callable[[Any, int], Sequence[str]] | None = (
    None
    if _make_c_encoder is None
    else _make_c_encoder(
        None, str, json.encoder.encode_basestring, None, ":", ",", False, False, True
    )
)


def _to_json(obj: Any, **_: Any) -> str:
    if _C_ENCODER is not None and type(obj) is dict:
        return "".join(_C_ENCODER(obj, 0))
    return _ENCODER.encode(obj)


# --------------------------------------------------------------------------- the call line


class _CallSink:
    """Queues call lines and writes them in batches, to the root handler's stream.

    On the event loop a line is only queued (its fields and the time); the batch is rendered
    and written in one ``write`` at the end of the loop iteration (``drain``, scheduled with
    ``call_soon``). Rendering lines back to back, away from the request code, costs a fraction
    of rendering each inside its call, and the calls an iteration served share one write. A
    stdlib record logged on the loop's thread drains the queue first (``_Handler``), so lines
    stay in order; a crash loses at most the current iteration's lines. Off a loop a line is
    written at once.
    """

    def __init__(
        self, handler: logging.StreamHandler[TextIO], render: Callable[[str, EventDict], str]
    ) -> None:
        self.handler = handler
        self.render = render
        self.threshold = logging.INFO
        self._pending: list[tuple[str, float, dict[str, Any]]] = []
        # The loop a drain is scheduled on (None: none pending) and its thread. A loop closed
        # before running it (tests run one loop per test) does not block the next loop's.
        self._drain_loop: asyncio.AbstractEventLoop | None = None
        self.owner: int | None = None

    def write(self, level: str, fields: dict[str, Any]) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self._write([(level, time.time(), fields)])
            return
        self._pending.append((level, time.time(), fields))
        if self._drain_loop is not loop:
            self._drain_loop = loop
            self.owner = threading.get_ident()
            loop.call_soon(self.drain)

    def drain(self) -> None:
        """Write every queued line now (on the thread that queued them)."""
        self._drain_loop = None
        pending, self._pending = self._pending, []
        if pending:
            self._write(pending)

    def _write(self, items: list[tuple[str, float, dict[str, Any]]]) -> None:
        render, stamp = self.render, _clock.stamp
        text = "".join(
            [
                render(
                    level,
                    {
                        "ts": stamp(now),
                        "level": level,
                        "logger": ACCESS_LOGGER,
                        "event": CALL_EVENT,
                        **fields,
                    },
                )
                + "\n"
                for level, now, fields in items
            ]
        )
        handler = self.handler
        handler.acquire()
        try:
            handler.stream.write(text)
            handler.stream.flush()
        except Exception:
            # Same contract as logging: a failing stream must not fail the service.
            handler.handleError(logging.makeLogRecord({"msg": CALL_EVENT}))
        finally:
            handler.release()


class _Handler(logging.StreamHandler[TextIO]):
    """The root handler: writes the queued call lines of its thread before each record."""

    sink: _CallSink | None = None

    def emit(self, record: logging.LogRecord) -> None:
        sink = self.sink
        if sink is not None and sink.owner == threading.get_ident():
            sink.drain()
        super().emit(record)


class _State:
    def __init__(self) -> None:
        self.handler: _Handler | None = None
        self.call_sink: _CallSink | None = None


_state = _State()
_configure_lock = threading.Lock()


def log_call(level: CallLevel, fields: dict[str, Any]) -> None:
    """Write the canonical line of one HTTP call at ``level`` (``fields`` in reading order).

    Configured, the line skips ``LogRecord`` and structlog's logger machinery (it is the one
    line per call: the hot path) but is rendered as records are, to the same stream; it
    carries its ids in ``fields`` rather than from the bound context.
    """
    number = LEVELS[level]
    sink = _state.call_sink
    if sink is not None:
        if number >= sink.threshold:
            sink.write(level, fields)
    elif _access_log.isEnabledFor(number):
        _access_log.log(number, CALL_EVENT, extra={"fields": fields})


# --------------------------------------------------------------------------- configuration


def configure_logging(
    level: str = "info", *, stream: TextIO | None = None, fmt: LogFormat = "auto"
) -> None:
    """Send every record (kvoffload, uvicorn, asyncio, httpx, ...) to ``stream`` (stdout).

    ``fmt``: ``json`` lines, ``console`` (human), or ``auto`` (console on a terminal, else
    JSON). Idempotent: replaces what an earlier call installed.
    """
    out = stream if stream is not None else sys.stdout
    console = fmt == "console" or (fmt == "auto" and out.isatty())
    renderer: Processor = (
        structlog.dev.ConsoleRenderer(colors=out.isatty())
        if console
        else structlog.processors.JSONRenderer(serializer=_to_json)
    )
    formatter = ProcessorFormatter(
        # A record's own fields first: they win over the bound context (setdefault).
        foreign_pre_chain=[
            _record_fields,
            structlog.contextvars.merge_contextvars,
            _merge_call_ids,
            _timestamp,
            _redact,
        ],
        processors=[
            _ordered,
            *([] if console else [structlog.processors.format_exc_info]),
            renderer,
        ],
    )
    handler = _Handler(out)
    handler.setFormatter(formatter)
    with _configure_lock:
        unconfigure_logging()
        root = logging.getLogger()
        root.addHandler(handler)
        _state.handler = handler
        # The call line is hot and its fields are known: no contextvars merge (the ids are
        # passed explicitly), no redaction, its dict built in order at once.
        if console:
            sink = _CallSink(handler, lambda level, event: cast(str, renderer(None, level, event)))
        else:  # JSON: the renderer's own serializer, without its call overhead
            sink = _CallSink(handler, lambda level, event: _to_json(event))
        handler.sink = sink
        _state.call_sink = sink
        for name in _THIRD_PARTY:
            third = logging.getLogger(name)
            third.handlers.clear()
            third.propagate = True
            third.setLevel(logging.NOTSET)  # follow the root level, also when it changes
        # Audit lines are written whatever the level (a logger's own level wins).
        _audit_log.setLevel(logging.INFO)
        set_level(level)


def flush_logs() -> None:
    """Write the call lines still queued (at shutdown, and in tests before reading the log)."""
    if _state.call_sink is not None:
        _state.call_sink.drain()


def unconfigure_logging() -> None:
    """Remove what ``configure_logging`` installed (tests); the call line goes back to stdlib."""
    flush_logs()
    if _state.handler is not None:
        logging.getLogger().removeHandler(_state.handler)
        _state.handler = None
        _audit_log.setLevel(logging.NOTSET)
    _state.call_sink = None


def get_level() -> str:
    """The current level name (of the root logger)."""
    value = logging.getLogger().getEffectiveLevel()
    for name, number in LEVELS.items():
        if value <= number:
            return name
    return "error"


def set_level(level: str) -> str:
    """Set the level of every logger (root and the call line) live; the previous level."""
    number = LEVELS.get(level.lower())
    if number is None:
        raise ValueError(f"log level must be one of {', '.join(LEVELS)}, got {level!r}")
    previous = get_level()
    logging.getLogger().setLevel(number)
    if _state.call_sink is not None:
        _state.call_sink.threshold = number
    return previous


def audit(action: str, actor: str, **fields: Any) -> None:
    """Record one admin change: ``action`` (e.g. ``policy.switch``), who asked, what changed."""
    _audit_log.info(action, extra={"fields": {"audit": True, "actor": actor, **fields}})
