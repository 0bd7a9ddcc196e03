"""The one waiting helper of the tests and benchmarks (``testsupport.polling``): what ends a
wait, what counts as "not yet", and what a failed wait says."""

from __future__ import annotations

import itertools
from typing import Any

import httpx
import pytest

from testsupport.polling import until, until_async


@pytest.mark.parametrize("answer", [0, "", {}, [], True, "value"])
def test_any_answer_but_none_or_false_ends_the_wait_and_is_returned(answer: Any) -> None:
    answers = iter([None, False, answer])
    assert until("the answer", lambda: next(answers), within_s=5) == answer


def test_a_transport_error_is_not_yet_and_a_failed_wait_names_what_and_the_last_error() -> None:
    calls = itertools.count()

    def refused() -> None:
        next(calls)
        raise httpx.ConnectError("connection refused")

    with pytest.raises(AssertionError) as failed:
        until("the server up", refused, within_s=0.05, every_s=0.01)
    assert str(failed.value).startswith("not within 0.05 s: the server up (last: ConnectError(")
    assert next(calls) > 2  # asked again after each error


def test_any_other_error_of_the_check_ends_the_wait_at_once() -> None:
    def broken() -> None:
        raise KeyError("a bug in the check")

    with pytest.raises(KeyError):
        until("never", broken, within_s=5)


@pytest.mark.anyio
async def test_the_async_wait_takes_a_coroutine_function_or_a_plain_one() -> None:
    answers = iter([None, False, 3])

    async def check() -> int | bool | None:
        return next(answers)

    assert await until_async("three", check, within_s=5) == 3
    assert await until_async("plain", lambda: "plain", within_s=5) == "plain"
    with pytest.raises(AssertionError, match=r"not within 0\.03 s: never"):
        await until_async("never", lambda: None, within_s=0.03)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"
