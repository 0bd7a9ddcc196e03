"""Property-based conformance of both APIs (schemathesis) against the live server.

For every operation of each spec, schemathesis generates valid (positive) and invalid
(negative) calls; each answer must be one the spec documents (status, content type, headers,
body schema), never a server error (5xx), and invalid calls must be refused. Driven through
``APIOperation.as_strategy`` with a bounded number of examples per operation.

Not checked: ``positive_data_acceptance`` (a schema-valid call must not get 422). Several
calls are valid JSON Schema-wise yet refused by design on facts the schema cannot state: a
policy's parameters, a registration whose file does not exist or does not fit the pool, keys
and device blocks of different lengths.
"""

from __future__ import annotations

from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import Case, CheckFunction, GenerationMode
from schemathesis.specs.openapi.checks import positive_data_acceptance

from tests.e2e.conftest import TOKEN, ServerProcess

pytestmark = pytest.mark.slow
EXAMPLES = 20
EXCLUDED: list[CheckFunction] = [positive_data_acceptance]


def run_operations(schema: Any, mode: GenerationMode) -> list[str]:
    """Drive every operation of ``schema``; the failures, one line each."""
    failures: list[str] = []
    for result in schema.get_all_operations():
        operation = result.ok()

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            suppress_health_check=list(HealthCheck),
            database=None,
            derandomize=True,
        )
        def check(case: Case[Any]) -> None:
            case.call_and_validate(timeout=10, excluded_checks=EXCLUDED)

        try:
            check()
        except Unsatisfiable:
            pass  # nothing to negate (e.g. GET /livez has no inputs)
        except Exception as exc:  # report every operation, not only the first failure
            failures.append(f"{operation.label} [{mode.value}]: {exc}")
    return failures


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_engine_api_conforms(server: ServerProcess, mode: GenerationMode) -> None:
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    failures = run_operations(schema, mode)
    assert not failures, "\n\n".join(failures)


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_admin_api_conforms(server: ServerProcess, mode: GenerationMode) -> None:
    # Through the spec's security scheme, so a generated call that drops the token stays one.
    config = schemathesis.Config.from_dict({"auth": {"openapi": {"HTTPBearer": {"bearer": TOKEN}}}})
    schema = schemathesis.openapi.from_url(f"{server.admin_url}/openapi.json", config=config)
    failures = run_operations(schema, mode)
    assert not failures, "\n\n".join(failures)
