"""``kvoffload serve`` after a poisoned CUDA context: it exits non-zero without the
interpreter's clean-up (which would free CUDA IPC mappings the lost context cannot close)."""

from __future__ import annotations

import os
from typing import Any

import pytest

from app import cli, server


class Exited(Exception):
    def __init__(self, code: int) -> None:
        self.code = code


def test_serve_leaves_with_os_exit_after_the_backend_failed(monkeypatch, capsys) -> None:
    def failing_run(settings: Any) -> None:
        raise server.TransferBackendFailed("copy failed: cudaMemcpy2DAsync returned 700")

    def exit_now(code: int) -> None:
        raise Exited(code)

    flushed: list[bool] = []
    monkeypatch.setattr(server, "run", failing_run)
    monkeypatch.setattr(os, "_exit", exit_now)
    monkeypatch.setattr("app.telemetry.logging.flush_logs", lambda: flushed.append(True))
    with pytest.raises(Exited) as info:
        cli.main(["serve", "--log-format", "json"])
    assert info.value.code == cli.EXIT_BACKEND_FAILED != 0
    assert flushed  # the log lines are out before the process goes
    err = capsys.readouterr()
    text = err.out + err.err
    assert "transfer backend failed for good; exiting for a restart" in text
    assert "returned 700" in text
