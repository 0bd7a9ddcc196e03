"""What every test shares: an environment without ``KVOFFLOAD_*`` variables.

The service reads its settings from ``KVOFFLOAD_*`` variables, so a variable left in the shell
would change what a test builds or starts; each test runs with none (a test sets its own).
"""

from __future__ import annotations

import os

import pytest


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("KVOFFLOAD_"):
            monkeypatch.delenv(name)
