"""Fixtures of the end-to-end tests; the server process itself is ``testsupport.server``."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from testsupport.server import ServerProcess


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with ServerProcess(tmp_path_factory.mktemp("e2e")).serving() as srv:
        yield srv
