"""``PUT /admin/v1/policy`` with a parameter outside the policy's declared bounds, against a
real server (uvicorn on 127.0.0.1): 422 ``invalid_policy_params`` naming the policy, the
parameter and the bound, for huge, infinite, NaN and mistyped values sent as raw JSON text; the
active policy is unchanged afterwards (name, parameters, generation, ETag). The same through
``kvoffload admin policy set``: exit 1, one line with the 422 and the bound."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from manager import available_policies
from manager.policies import policy_params_spec
from testsupport.server import ROOT, TOKEN, ServerProcess

LFU_BOUND = "lfu: history_factor must be a number in [0, 16], got "
JSON = {"content-type": "application/json"}


@pytest.fixture
def admin(server: ServerProcess) -> Iterator[httpx.Client]:
    """An admin client; the policy found at the start is put back at the end."""
    with httpx.Client(
        base_url=server.admin_url, headers={"authorization": f"Bearer {TOKEN}"}, timeout=10
    ) as client:
        before = client.get("/admin/v1/policy").json()
        yield client
        client.put(
            "/admin/v1/policy", json={"name": before["name"], "params": before["params"]}
        ).raise_for_status()


def current(admin: httpx.Client) -> tuple[dict[str, Any], str]:
    r = admin.get("/admin/v1/policy")
    assert r.status_code == 200, r.text
    body = r.json()
    return {k: body[k] for k in ("name", "params", "generation")}, r.headers["etag"]


@pytest.mark.parametrize(
    ("raw", "shown"),
    [
        ("1e308", "1e+308"),
        ("1e400", "inf"),  # beyond a double: parsed as infinity
        ("1e999", "inf"),
        ("-1e999", "-inf"),
        ("Infinity", "inf"),
        ("NaN", "nan"),
        ("1e30", "1e+30"),
        ("16.000001", "16.000001"),
        ("-0.5", "-0.5"),
        ("1" + "0" * 400, "1" + "0" * 44 + "..."),  # an int too large for a double, cut
        ("true", "True"),
        ('"2"', "'2'"),
        ("null", "None"),
    ],
)
def test_out_of_bounds_history_factor_is_422_and_changes_nothing(
    admin: httpx.Client, raw: str, shown: str
) -> None:
    r = admin.put("/admin/v1/policy", json={"name": "lfu", "params": {"history_factor": 3}})
    assert r.status_code == 200, r.text
    before, etag = current(admin)
    assert before["params"] == {"history_factor": 3.0}

    body = '{"name": "lfu", "params": {"history_factor": ' + raw + "}}"
    r = admin.put("/admin/v1/policy", content=body.encode(), headers=JSON)
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["code"] == "invalid_policy_params"
    assert error["message"] == LFU_BOUND + shown
    assert current(admin) == (before, etag)


@pytest.mark.parametrize("policy", [p for p in available_policies() if policy_params_spec(p)])
def test_every_parameter_just_past_its_upper_bound_is_422(admin: httpx.Client, policy: str) -> None:
    before, etag = current(admin)
    for spec in policy_params_spec(policy):
        assert spec.high is not None
        too_big = spec.high if spec.high_open else spec.high * 1.0001
        r = admin.put("/admin/v1/policy", json={"name": policy, "params": {spec.name: too_big}})
        assert r.status_code == 422, r.text
        assert r.json()["error"]["code"] == "invalid_policy_params"
        assert f"{policy}: {spec.name} must be {spec.accepted()}" in r.json()["error"]["message"]
        assert current(admin) == (before, etag)


def test_a_value_at_the_bound_is_accepted(admin: httpx.Client) -> None:
    r = admin.put("/admin/v1/policy", json={"name": "lfu", "params": {"history_factor": 16}})
    assert r.status_code == 200, r.text
    assert r.json()["to"]["params"] == {"history_factor": 16.0}


def test_admin_cli_names_the_bound(server: ServerProcess, admin: httpx.Client) -> None:
    before, etag = current(admin)
    for value in ("1e308", "1e30"):
        run = subprocess.run(
            [
                *(sys.executable, "-m", "app.cli", "admin", "--url", server.admin_url, "--json"),
                *("policy", "set", "lfu", "--param", f"history_factor={value}"),
            ],
            cwd=ROOT,
            env={
                **{k: v for k, v in os.environ.items() if not k.startswith("KVOFFLOAD_")},
                "KVOFFLOAD_ADMIN_TOKEN": TOKEN,
            },
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert run.returncode == 1, (run.stdout, run.stderr)
        (line,) = run.stderr.splitlines()
        assert "422 invalid_policy_params" in line
        assert LFU_BOUND + repr(float(value)) in line
        assert current(admin) == (before, etag)
