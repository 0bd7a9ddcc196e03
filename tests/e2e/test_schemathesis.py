"""Property-based conformance of both APIs (schemathesis) against a live server.

For every operation of each spec, schemathesis generates valid (positive) and invalid
(negative) calls; each answer must be one the spec documents (status, content type, headers,
body schema), never a server error (5xx), and invalid calls must be refused. Driven through
``APIOperation.as_strategy`` with a bounded number of examples per operation.

The admin spec runs three times: with the token (through the spec's security scheme, so a
generated call that drops the token stays one), without a token (every protected operation must
answer 401 and nothing else), and with a wrong token (403). Every answer of every run, headers
and body, is scanned for the admin token and for the server's distinctive environment values (a
canary among them): no endpoint may return them.

Not checked: ``positive_data_acceptance`` (a schema-valid call must not get 422). Several
calls are valid JSON Schema-wise yet refused by design on facts the schema cannot state: a
policy's parameters, a registration whose file does not exist or does not fit the pool, keys
and device blocks of different lengths.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import Case, CheckFunction, GenerationMode
from schemathesis.specs.openapi.checks import positive_data_acceptance

from testsupport.server import TOKEN, ServerProcess

pytestmark = pytest.mark.slow
EXAMPLES = 20
EXCLUDED: list[CheckFunction] = [positive_data_acceptance]
MODES = [GenerationMode.POSITIVE, GenerationMode.NEGATIVE]


@dataclass
class Outcome:
    """What one run over a spec saw."""

    cases: int = 0
    failures: list[str] = field(default_factory=list)
    leaks: list[str] = field(default_factory=list)
    statuses: dict[int, int] = field(default_factory=dict)
    pre_auth: int = 0


def pre_auth_query_refusal(status: int, body: bytes) -> bool:
    """The one answer a caller without the token gets besides 401/403 (a known defect, see
    ``tests/api/test_security.py::test_admin_checks_the_token_before_the_query``): the app-wide
    ``strict_query`` dependency runs before the admin token check, so an unknown query
    parameter is refused with 422 first. It reveals nothing but the parameter names sent."""
    return status == 422 and b"query: unknown parameter" in body


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A server whose environment holds a canary secret next to the admin token."""
    canary = "canary-" + secrets.token_hex(16)
    with ServerProcess(
        tmp_path_factory.mktemp("st"), env={"SCHEMATHESIS_CANARY": canary}
    ).serving() as srv:
        yield srv
    assert "Traceback" not in srv.log(), srv.log()


def secret_values(server: ServerProcess) -> list[bytes]:
    """The token and every distinctive (16+ characters) value of the server's environment."""
    return sorted({v.encode() for v in (TOKEN, *server.env.values()) if len(v) >= 16 or v == TOKEN})


def run_operations(
    schema: Any,
    mode: GenerationMode,
    forbidden: list[bytes],
    protected_statuses: frozenset[int] = frozenset(),
    strip_auth: bool = False,
) -> Outcome:
    """Drive every operation of ``schema``; what it saw.

    ``protected_statuses``: when given, the only statuses an operation behind the security
    scheme may answer. ``strip_auth``: send no ``Authorization`` header at all.
    """
    out = Outcome()

    def drive(operation: Any) -> None:
        protected = bool(operation.definition.raw.get("security"))
        label = f"{operation.label} [{mode.value}]"

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            suppress_health_check=list(HealthCheck),
            database=None,
            derandomize=True,
        )
        def check(case: Case[Any]) -> None:
            if strip_auth and case.headers:
                for name in [h for h in case.headers if h.lower() == "authorization"]:
                    del case.headers[name]
            response = case.call(timeout=10)
            out.cases += 1
            status = response.status_code
            out.statuses[status] = out.statuses.get(status, 0) + 1
            blob = response.content + repr(response.headers).encode()
            out.leaks.extend(f"{label} answered a secret" for s in forbidden if s in blob)
            if protected and protected_statuses:
                if pre_auth_query_refusal(status, response.content):
                    out.pre_auth += 1
                else:
                    assert status in protected_statuses, f"{status}: {response.content[:200]!r}"
            case.validate_response(response, excluded_checks=EXCLUDED)

        try:
            check()
        except Unsatisfiable:
            pass  # nothing to negate (e.g. GET /livez has no inputs)
        except Exception as exc:  # report every operation, not only the first failure
            out.failures.append(f"{label}: {exc}")

    for result in schema.get_all_operations():
        drive(result.ok())
    statuses = dict(sorted(out.statuses.items()))
    print(f"{mode.value}: {out.cases} cases, statuses {statuses}, pre-auth 422 {out.pre_auth}")
    return out


def admin_schema(server: ServerProcess, token: str | None) -> Any:
    config = None
    if token is not None:
        auth = {"auth": {"openapi": {"HTTPBearer": {"bearer": token}}}}
        config = schemathesis.Config.from_dict(auth)
    return schemathesis.openapi.from_url(f"{server.admin_url}/openapi.json", config=config)


@pytest.mark.parametrize("mode", MODES)
def test_engine_api_conforms(target: ServerProcess, mode: GenerationMode) -> None:
    """Every engine operation: documented answers only, no 5xx, no secret in any answer."""
    schema = schemathesis.openapi.from_url(f"{target.url}/openapi.json")
    out = run_operations(schema, mode, secret_values(target))
    assert not out.failures, "\n\n".join(out.failures)
    assert out.leaks == []
    assert out.cases > 0
    assert not [s for s in out.statuses if s >= 500]


@pytest.mark.parametrize("mode", MODES)
def test_admin_api_conforms(target: ServerProcess, mode: GenerationMode) -> None:
    """Every admin operation with the token: documented answers, no 5xx, no secret."""
    out = run_operations(admin_schema(target, TOKEN), mode, secret_values(target))
    assert not out.failures, "\n\n".join(out.failures)
    assert out.leaks == []
    assert not [s for s in out.statuses if s >= 500]


@pytest.mark.parametrize("mode", MODES)
def test_admin_api_without_a_token_is_401(target: ServerProcess, mode: GenerationMode) -> None:
    """No ``Authorization`` header: every protected admin operation answers 401 whatever the
    rest of the call, documented, leaking nothing."""
    out = run_operations(
        admin_schema(target, None), mode, secret_values(target), frozenset({401}), strip_auth=True
    )
    assert not out.failures, "\n\n".join(out.failures)
    assert out.leaks == []
    assert out.statuses.get(401, 0) > 0
    assert not [s for s in out.statuses if s >= 500]


@pytest.mark.parametrize("mode", MODES)
def test_admin_api_with_a_wrong_token_is_403(target: ServerProcess, mode: GenerationMode) -> None:
    """A wrong token: every protected admin operation answers 403 (401 where a negative call
    mangles the header itself), documented, leaking nothing."""
    out = run_operations(
        admin_schema(target, "not-" + TOKEN), mode, secret_values(target), frozenset({401, 403})
    )
    assert not out.failures, "\n\n".join(out.failures)
    assert out.leaks == []
    assert out.statuses.get(403 if mode is GenerationMode.POSITIVE else 401, 0) > 0
    assert not [s for s in out.statuses if s >= 500]
