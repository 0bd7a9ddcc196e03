"""Native stderr as log records: glog lines parsed, Python's stderr left alone (a real child
process, its descriptor 2 captured, its stdout read as the service's log)."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap

import pytest

from app.telemetry.native_stderr import parse


@pytest.mark.parametrize(
    ("line", "level", "text", "fields"),
    [
        (
            "I1201 18:04:37.123456 12345 client.cpp:42] connected to master",
            logging.INFO,
            "connected to master",
            {"source": "mooncake", "where": "client.cpp:42", "tid": 12345},
        ),
        (
            "E20261201 18:04:37.000001  7 master_client.cpp:101] metadata not found",
            logging.ERROR,
            "metadata not found",
            {"source": "mooncake", "where": "master_client.cpp:101", "tid": 7},
        ),
        ("W1201 01:02:03.5 9 a.cc:1] ", logging.WARNING, "", None),
        ("F1201 01:02:03.5 9 a.cc:1] abort", logging.CRITICAL, "abort", None),
        ("something else\r", logging.WARNING, "something else", {"source": "stderr"}),
    ],
)
def test_lines_become_records(line: str, level: int, text: str, fields: object) -> None:
    parsed = parse(line)
    assert parsed is not None
    assert (parsed.level, parsed.text) == (level, text)
    if fields is not None:
        assert parsed.fields == fields


@pytest.mark.parametrize(
    "line", ["", "   ", "WARNING: Logging before InitGoogleLogging() is written to STDERR"]
)
def test_noise_is_dropped(line: str) -> None:
    assert parse(line) is None


def test_a_process_that_captures_logs_native_lines_as_json_and_keeps_python_stderr() -> None:
    child = textwrap.dedent(
        """
        import os, sys, time
        from app.telemetry.logging import configure_logging, flush_logs
        from app.telemetry.native_stderr import capture
        configure_logging("info", fmt="json")
        assert capture() and not capture()
        os.write(2, b"WARNING: Logging before InitGoogleLogging() is written to STDERR\\n")
        os.write(2, b"E1201 18:04:37.123456 4242 master_client.cpp:9] metadata not found\\n")
        os.write(2, b"I1201 18:04:37.2 4242 x.cpp:1] one\\nraw line")
        os.write(2, b" in two writes\\n")
        print("python's own stderr", file=sys.stderr, flush=True)
        time.sleep(0.5)
        flush_logs()
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", child], capture_output=True, text=True, timeout=60, check=True
    )
    records = [json.loads(line) for line in done.stdout.splitlines()]
    native = [r for r in records if r["logger"] == "kvoffload.native"]
    assert [(r["level"], r["event"], r["source"]) for r in native] == [
        ("error", "metadata not found", "mooncake"),
        ("info", "one", "mooncake"),
        ("warning", "raw line in two writes", "stderr"),
    ]
    assert native[0]["where"] == "master_client.cpp:9"
    assert native[0]["tid"] == 4242
    assert done.stderr == "python's own stderr\n"
