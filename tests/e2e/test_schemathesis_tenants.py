"""Schemathesis against the engine API of a server with tenants: with a tenant's token, with no
token and with a wrong one.

With ``alpha``'s token every operation answers only what the spec documents, never a 5xx, and no
answer carries anything of ``beta``'s: its token, the keys it stored, its pool id. Without a
token, or with one the server does not know, every ``/v1`` operation answers 401 and nothing
else, whatever the rest of the call (query, headers, body) is.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import schemathesis
from kvoffload_client.client import KVOffloadClient
from schemathesis import GenerationMode

from tests.e2e.test_schemathesis import MODES, run_operations, secret_values
from testsupport.server import ServerProcess

pytestmark = pytest.mark.slow
ALPHA = "alpha-schemathesis-token-0001"
BETA = "beta-schemathesis-token-00001"
BETA_KEYS = [bytes.fromhex("be7a" * 8 + f"{i:04x}") for i in range(4)]


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, list[bytes]]]:
    """A server with two tenants; beta has stored its keys. Yields it and beta's secrets."""
    work = tmp_path_factory.mktemp("st-tenants")
    tenants = work / "tenants.toml"
    tenants.write_text(
        f'[tenants.alpha]\ntokens = ["{ALPHA}"]\nnamespaces = {{ a1 = 64 }}\n'
        f"max_pins = 32\nmax_requests = 64\n\n"
        f'[tenants.beta]\ntokens = ["{BETA}"]\nnamespaces = {{ b1 = 64 }}\n'
    )
    os.chmod(tenants, 0o600)
    with ServerProcess(work, "--tenants", str(tenants)).serving() as srv:
        with KVOffloadClient(srv.url, token=BETA) as beta:
            beta.start_request("beta-request")
            beta.prepare_store("beta-request", BETA_KEYS)
            beta.complete_store("beta-request", BETA_KEYS)
            pool_id = beta.pool().pool_id
        beta_secrets = [BETA.encode(), pool_id.encode(), *(k.hex().encode() for k in BETA_KEYS)]
        yield srv, beta_secrets
        assert "Traceback" not in srv.log(), srv.log()


def engine_schema(server: ServerProcess, token: str | None) -> object:
    config = None
    if token is not None:
        auth = {"auth": {"openapi": {"EngineToken": {"bearer": token}}}}
        config = schemathesis.Config.from_dict(auth)
    return schemathesis.openapi.from_url(f"{server.url}/openapi.json", config=config)


@pytest.mark.parametrize("mode", MODES)
def test_a_tenant_gets_documented_answers_and_nothing_of_another_tenant(
    target: tuple[ServerProcess, list[bytes]], mode: GenerationMode
) -> None:
    server, beta_secrets = target
    forbidden = [*secret_values(server), *beta_secrets]
    out = run_operations(engine_schema(server, ALPHA), mode, forbidden)
    assert not out.failures, "\n\n".join(out.failures)
    assert out.leaks == []
    assert out.cases > 0
    assert not [s for s in out.statuses if s >= 500]
    if mode is GenerationMode.POSITIVE:  # it did get in (negative calls are mostly refused)
        assert out.statuses.get(200, 0) + out.statuses.get(201, 0) > 0


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("token", [None, "not-a-known-token-000000000"])
def test_without_a_good_token_every_engine_operation_is_401(
    target: tuple[ServerProcess, list[bytes]], mode: GenerationMode, token: str | None
) -> None:
    server, beta_secrets = target
    forbidden = [*secret_values(server), *beta_secrets]
    out = run_operations(
        engine_schema(server, token),
        mode,
        forbidden,
        frozenset({401}),
        strip_auth=token is None,
    )
    assert not out.failures, "\n\n".join(out.failures)
    assert out.leaks == []
    assert out.statuses.get(401, 0) > 0
    assert not [s for s in out.statuses if s >= 500]
