"""Logging: one JSON object per line on stderr, and the audit trail of admin changes.

Code logs through the standard ``logging`` module under the ``kvoffload`` namespace, passing
structured fields as ``extra={"fields": {...}}``; ``configure_logging`` (called once by
``kvoffload serve``, never at import) renders every record, uvicorn's included, as a JSON line.
Tests read records with pytest's ``caplog`` without configuring anything.

``audit(action, actor, **fields)`` writes one line per admin change on ``kvoffload.audit``.
Callers pass what changed, never a credential.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

AUDIT_LOGGER = "kvoffload.audit"
_audit_log = logging.getLogger(AUDIT_LOGGER)


def get_logger(name: str) -> logging.Logger:
    """A logger under the ``kvoffload`` namespace (``get_logger("service")``)."""
    return logging.getLogger(f"kvoffload.{name}")


def fields_of(record: logging.LogRecord) -> dict[str, Any]:
    """The structured fields attached to ``record`` (empty when none)."""
    value = getattr(record, "fields", None)
    return value if isinstance(value, dict) else {}


class JSONFormatter(logging.Formatter):
    """Renders a record as one JSON object: ts, level, logger, event, then its fields."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "event": record.getMessage(),
        }
        line.update(fields_of(record))
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str, separators=(",", ":"))


def configure_logging(level: str = "info") -> None:
    """Route every record (kvoffload, uvicorn, root) to stderr as JSON lines at ``level``.

    Idempotent: replaces the handlers this function installed before.
    """
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JSONFormatter())
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h.formatter, JSONFormatter)]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        uv = logging.getLogger(name)
        uv.handlers.clear()
        uv.propagate = True


def audit(action: str, actor: str, **fields: Any) -> None:
    """Record one admin change: ``action`` (e.g. ``policy.switch``), who asked, what changed."""
    _audit_log.info(action, extra={"fields": {"audit": True, "actor": actor, **fields}})
