"""app.telemetry.logging: one JSON line per record, the call line, redaction, levels, console."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest

from app.telemetry import logging as app_logging
from app.telemetry.logging import (
    ACCESS_LOGGER,
    CALL_EVENT,
    audit,
    bind_call,
    configure_logging,
    flush_logs,
    get_level,
    log_call,
    set_level,
    unbind_call,
    unconfigure_logging,
)


@pytest.fixture
def restore_root() -> Iterator[None]:
    root = logging.getLogger()
    level = root.level
    try:
        yield
    finally:
        unconfigure_logging()
        root.setLevel(level)


def read(buffer: io.StringIO) -> list[dict[str, object]]:
    flush_logs()
    return [json.loads(line) for line in buffer.getvalue().splitlines()]


@pytest.mark.usefixtures("restore_root")
def test_stdlib_records_become_json_lines_with_fields_and_ids() -> None:
    buffer = io.StringIO()
    configure_logging("info", stream=buffer, fmt="json")
    log = logging.getLogger("uvicorn.error")
    log.info("server %s", "up")
    token = bind_call("call-1", "r1")
    logging.getLogger("kvoffload.service").warning(
        "something", extra={"fields": {"req_id": "explicit", "n": 3}}
    )
    try:
        raise ValueError("boom")
    except ValueError:
        logging.getLogger("asyncio").exception("failed")
    unbind_call(token)
    logging.getLogger("kvoffload.x").debug("hidden at info")
    up, something, failed = read(buffer)
    assert list(up)[:4] == ["ts", "level", "logger", "event"]
    assert (up["logger"], up["event"], up["level"]) == ("uvicorn.error", "server up", "info")
    assert "req_id" not in up
    assert (something["req_id"], something["request_id"], something["n"]) == (
        "explicit",  # a record's own field wins over the bound ids
        "call-1",
        3,
    )
    assert failed["req_id"] == "r1"
    assert "ValueError: boom" in str(failed["exception"])
    assert str(up["ts"]).endswith("Z")


@pytest.mark.usefixtures("restore_root")
def test_credentials_are_redacted() -> None:
    buffer = io.StringIO()
    configure_logging("info", stream=buffer, fmt="json")
    logging.getLogger("kvoffload.x").info(
        "settings", extra={"fields": {"admin_token": "s3cret", "Authorization": "Bearer s3cret"}}
    )
    (line,) = read(buffer)
    assert line["admin_token"] == line["Authorization"] == "[redacted]"
    assert "s3cret" not in buffer.getvalue()


@pytest.mark.usefixtures("restore_root")
def test_counts_under_credential_names_are_kept_and_strings_are_not() -> None:
    buffer = io.StringIO()
    configure_logging("info", stream=buffer, fmt="json")
    fields = {"tokens_added": 0, "tokens_revoked": 2, "token_ok": True, "token": "1234567890"}
    logging.getLogger("kvoffload.x").info("counts", extra={"fields": fields})
    (line,) = read(buffer)
    assert (line["tokens_added"], line["tokens_revoked"], line["token_ok"]) == (0, 2, True)
    assert line["token"] == "[redacted]"  # a string of digits is still a string


@pytest.mark.usefixtures("restore_root")
def test_call_line_and_level_switch() -> None:
    buffer = io.StringIO()
    configure_logging("warning", stream=buffer, fmt="json")
    log_call("info", {"route": "/x", "req_id": "r"})
    log_call("error", {"route": "/y", "req_id": "r"})
    assert set_level("debug") == "warning"
    assert get_level() == "debug"
    log_call("debug", {"route": "/z"})
    lines = read(buffer)
    assert [line["route"] for line in lines] == ["/y", "/z"]
    assert lines[0] == {
        "ts": lines[0]["ts"],
        "level": "error",
        "logger": ACCESS_LOGGER,
        "event": CALL_EVENT,
        "route": "/y",
        "req_id": "r",
    }
    with pytest.raises(ValueError, match="log level must be one of"):
        set_level("loud")


@pytest.mark.usefixtures("restore_root")
def test_audit_lines_are_written_whatever_the_level() -> None:
    buffer = io.StringIO()
    configure_logging("error", stream=buffer, fmt="json")
    audit("cache.clear", "127.0.0.1:5", dropped=3)
    logging.getLogger("kvoffload.x").warning("not written")
    (line,) = read(buffer)
    assert (line["event"], line["audit"], line["dropped"]) == ("cache.clear", True, 3)


@pytest.mark.usefixtures("restore_root")
def test_console_format() -> None:
    buffer = io.StringIO()
    configure_logging("info", stream=buffer, fmt="console")
    logging.getLogger("kvoffload.x").info("hello", extra={"fields": {"req_id": "r1"}})
    log_call("info", {"route": "/x"})
    text = buffer.getvalue()
    assert "hello" in text
    assert "req_id" in text
    assert CALL_EVENT in text
    assert not text.lstrip().startswith("{")


def test_unconfigured_call_line_is_a_plain_record(caplog: pytest.LogCaptureFixture) -> None:
    assert app_logging._state.call_sink is None
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    log_call("info", {"route": "/x"})
    (record,) = caplog.records
    assert record.getMessage() == CALL_EVENT
    assert app_logging.fields_of(record) == {"route": "/x"}


class _Terminal(io.StringIO):
    """A stream that says it is a terminal, as stdout is when a person runs the service."""

    def isatty(self) -> bool:
        return True


@pytest.mark.usefixtures("restore_root")
def test_auto_format_is_json_off_a_terminal_and_console_on_one() -> None:
    """``--log-format auto`` (the default): what docs/getting-started.md says of logs."""
    for stream, is_json in ((io.StringIO(), True), (_Terminal(), False)):
        configure_logging("info", stream=stream, fmt="auto")
        logging.getLogger("kvoffload.x").info("hello", extra={"fields": {"req_id": "r1"}})
        log_call("info", {"route": "/x"})
        flush_logs()
        lines = stream.getvalue().splitlines()
        assert len(lines) == 2, lines
        if is_json:
            assert [json.loads(line)["event"] for line in lines] == ["hello", CALL_EVENT]
        else:
            assert not any(line.lstrip().startswith("{") for line in lines)
            assert "hello" in lines[0]
            assert CALL_EVENT in lines[1]
        unconfigure_logging()
