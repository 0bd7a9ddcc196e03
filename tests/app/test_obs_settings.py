"""Observability settings: flags, environment, validation."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from app.cli import _build_parser, settings_from_args
from app.settings import Settings


def test_defaults() -> None:
    s = Settings()
    assert (s.metrics_enabled, s.metrics_live_requests, s.shadow_enabled) == (True, False, True)
    assert s.shadow_policies is None  # every registered policy
    assert s.shadow_sample_rate == 0.25
    assert s.log_format == "auto"


def test_shadow_policies_from_a_flag_and_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    args = _build_parser().parse_args(
        ["serve", "--shadow-policies", "arc, slru", "--metrics-enabled", "false"]
    )
    s = settings_from_args(args)
    assert s.shadow_policies == ["arc", "slru"]
    assert s.metrics_enabled is False
    monkeypatch.setenv("KVOFFLOAD_SHADOW_POLICIES", '["lfu"]')
    assert Settings().shadow_policies == ["lfu"]
    monkeypatch.setenv("KVOFFLOAD_SHADOW_POLICIES", "lru,arc")
    assert Settings().shadow_policies == ["lru", "arc"]


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("shadow_policies", "lru,nope", "unknown nope"),
        ("shadow_policies", ",", "empty"),
        ("shadow_sample_rate", 0, "greater than 0"),
        ("shadow_cpu_budget", 2, "less than or equal to 1"),
        ("metrics_live_requests_max", 0, "greater than 0"),
        ("log_format", "xml", "auto"),
    ],
)
def test_invalid_values_are_refused(field: str, value: Any, message: str) -> None:
    values: dict[str, Any] = {field: value}
    with pytest.raises(ValidationError, match=message):
        Settings(**values)
