"""Native code's stderr as log records: glog lines (Mooncake) become JSON lines like any other.

Libraries in C++ (Mooncake's client, through glog) write straight to file descriptor 2, past
Python's logging, so their lines would land raw between the service's JSON lines wherever
stdout and stderr meet (``docker logs``, journald, a Kubernetes log file). ``capture()`` points
descriptor 2 at a pipe and starts a daemon thread that turns each line written there into a
record on the ``kvoffload.native`` logger:

- a glog line (``I1201 18:04:37.123456 12345 file.cpp:42] text``) keeps its text as the event,
  with ``source: mooncake``, the level from glog's letter (I info, W warning, E error, F
  critical), ``where`` (file:line) and ``tid``;
- glog's ``Logging before InitGoogleLogging() is written to STDERR`` notice is dropped: it says
  only that glog was not set up, which is the library's business;
- any other line is a warning with ``source: stderr``.

Python's own ``sys.stderr`` keeps writing to the real stderr (a duplicate of the original
descriptor), so a traceback that Python prints never goes through the pipe. Call it once, before
the native library is loaded, in a process whose logging goes to stdout (the service's), so a
record about a line never writes to the pipe it came from.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import threading
from dataclasses import dataclass
from typing import Any

LOGGER = "kvoffload.native"

_GLOG = re.compile(
    r"^(?P<level>[IWEF])(?P<date>\d{4}(?:\d{4})?) (?P<time>\d\d:\d\d:\d\d\.\d+)\s+"
    r"(?P<tid>\d+) (?P<where>[^\]\s]+)\] ?(?P<text>.*)$"
)
_LEVELS = {"I": logging.INFO, "W": logging.WARNING, "E": logging.ERROR, "F": logging.CRITICAL}
_DROPPED = ("WARNING: Logging before InitGoogleLogging() is written to STDERR",)


@dataclass(frozen=True, slots=True)
class NativeLine:
    """One line of native stderr as a record: its level, text and fields."""

    level: int
    text: str
    fields: dict[str, Any]


def parse(line: str) -> NativeLine | None:
    """The record of one stderr line (no trailing newline); None for a line to drop."""
    line = line.rstrip("\r")
    if not line.strip() or line.startswith(_DROPPED):
        return None
    m = _GLOG.match(line)
    if m is None:
        return NativeLine(logging.WARNING, line, {"source": "stderr"})
    fields = {"source": "mooncake", "where": m["where"], "tid": int(m["tid"])}
    return NativeLine(_LEVELS[m["level"]], m["text"], fields)


_lock = threading.Lock()
_thread: threading.Thread | None = None


def capture() -> bool:
    """Route what native code writes to descriptor 2 into log records (module docstring);
    False when it was already done. Raises ``OSError`` when the descriptors cannot be made."""
    global _thread
    with _lock:
        if _thread is not None:
            return False
        saved = os.dup(2)
        read_end, write_end = os.pipe()
        os.dup2(write_end, 2)
        os.close(write_end)
        sys.stderr.flush()
        sys.stderr = open(saved, "w", buffering=1, encoding="utf-8", errors="replace")  # noqa: SIM115
        _thread = threading.Thread(
            target=_pump, args=(read_end,), name="kvoffload-native-stderr", daemon=True
        )
        _thread.start()
        return True


def _pump(fd: int) -> None:
    log = logging.getLogger(LOGGER)
    with open(fd, "rb", buffering=0) as pipe:
        pending = b""
        while chunk := pipe.read(65536):
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for raw in lines:
                _emit(log, raw)
        if pending:
            _emit(log, pending)


def _emit(log: logging.Logger, raw: bytes) -> None:
    parsed = parse(raw.decode("utf-8", errors="replace"))
    if parsed is not None:
        log.log(parsed.level, parsed.text, extra={"fields": parsed.fields})
