"""``kvoffload serve`` after a poisoned CUDA context: it exits non-zero without the
interpreter's clean-up (which would free CUDA IPC mappings the lost context cannot close)."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from app import cli, server
from app.telemetry.logging import unconfigure_logging
from transfer import cuda_worker


class Exited(Exception):
    def __init__(self, code: int, flushed: bool) -> None:
        self.code = code
        self.flushed = flushed


@pytest.fixture
def serve(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[Callable[[Any], None]], int]]:
    """``kvoffload serve`` with ``run`` replaced; ``os._exit`` raises ``Exited`` instead,
    noting whether the logs were flushed by then."""
    flushed: list[bool] = []

    def exit_now(code: int) -> None:
        raise Exited(code, bool(flushed))

    monkeypatch.setattr(os, "_exit", exit_now)
    monkeypatch.setattr("app.telemetry.logging.flush_logs", lambda: flushed.append(True))
    monkeypatch.setattr(cuda_worker, "_POISONED", threading.Event())

    def go(run: Callable[[Any], None]) -> int:
        monkeypatch.setattr(server, "run", run)
        return cli.main(["serve", "--log-format", "json"])

    yield go
    unconfigure_logging()  # the handlers write to this test's captured streams


def poison(settings: Any) -> None:
    cuda_worker._POISONED.set()


def test_a_poisoned_backend_leaves_with_os_exit_after_flushing(serve, capsys) -> None:
    def failing_run(settings: Any) -> None:
        poison(settings)
        raise server.TransferBackendFailed("copy failed: cudaMemcpy2DAsync returned 700")

    with pytest.raises(Exited) as info:
        serve(failing_run)
    assert info.value.code == cli.EXIT_BACKEND_FAILED != 0
    assert info.value.flushed  # the log lines are out before the process goes
    err = capsys.readouterr()
    text = err.out + err.err
    assert "transfer backend failed for good; exiting for a restart" in text
    assert "returned 700" in text


def test_a_poisoned_process_never_exits_zero_or_through_the_clean_up(serve) -> None:
    with pytest.raises(Exited) as info:
        serve(poison)  # e.g. stopped by a signal after the context was lost
    assert info.value.code == cli.EXIT_BACKEND_FAILED


def test_a_healthy_stop_returns_normally(serve) -> None:
    assert serve(lambda settings: None) == 0


@pytest.mark.parametrize("error", [OSError("listener failed"), KeyboardInterrupt()])
def test_every_way_out_of_a_poisoned_process_is_os_exit(serve, error: BaseException) -> None:
    def run(settings: Any) -> None:
        poison(settings)
        raise error

    with pytest.raises(Exited) as info:
        serve(run)
    assert info.value.code == 1
