"""Fixtures of the in-process API tests; the harness itself is ``testsupport.api_harness``."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from testsupport.api_harness import Harness, make_settings, running


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
async def h() -> AsyncIterator[Harness]:
    async with running(make_settings()) as harness:
        yield harness
