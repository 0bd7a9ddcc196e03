"""Safe ids for logs and exemplars."""

from __future__ import annotations

import hashlib

import pytest

from app.telemetry.request_ids import MAX_SAFE_ID, is_safe_id, safe_req_id


@pytest.mark.parametrize("value", ["r1", "cmpl-abc.0:1_x", "A" * MAX_SAFE_ID])
def test_safe_ids_are_kept(value: str) -> None:
    assert is_safe_id(value)
    assert safe_req_id(value) == value


@pytest.mark.parametrize(
    "value", ["", "a b", 'x"}', "é", "a" * (MAX_SAFE_ID + 1), "new\nline", "a/b", "{req_id}"]
)
def test_unsafe_ids_get_a_safe_hashed_form(value: str) -> None:
    assert not is_safe_id(value)
    safe = safe_req_id(value)
    assert is_safe_id(safe)
    assert len(safe) <= MAX_SAFE_ID
    digest = hashlib.blake2b(value.encode(), digest_size=8).hexdigest()
    assert safe.endswith(f":{digest}")  # computable from the raw id


def test_the_safe_form_keeps_the_readable_part_and_distinct_ids_apart() -> None:
    assert safe_req_id("req 42").startswith("req_42:")
    long = "x" * 300
    assert safe_req_id(long) != safe_req_id(long + "y")
    assert safe_req_id("a b") != safe_req_id("a_b")  # "a_b" is safe and kept as it is
