"""Fixtures for tests against a real Ceph RADOS Gateway (``testsupport.rgw``).

- ``rgw`` (session): one one-node cluster for the whole run, in a temporary directory, closed
  (and the directory removed) at the end. Without Ceph's binaries (Debian's ``ceph-mon
  ceph-osd radosgw ceph-common``) or boto3 the tests that use it are skipped, saying what to
  install; with ``KVOFFLOAD_REQUIRE_CEPH=1`` they fail instead.
- ``bucket``: a fresh, uniquely named bucket for one test, emptied and deleted after it.
- ``s3``: a boto3 client for the user (path-style addressing, no retries); ``make_s3(...)``
  builds one with other timeouts, retries or keys.
- Every test that uses the cluster starts with the gateway running: one that a fault test left
  killed, stopped or paused is started or resumed first (``_gateway_running``).
"""

from __future__ import annotations

import importlib
import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from testsupport.rgw import RadosGateway, install_hint, missing_binaries

# Read at import, before tests/conftest.py's autouse fixture strips KVOFFLOAD_* variables
# from each test's environment.
REQUIRE_CEPH = os.environ.get("KVOFFLOAD_REQUIRE_CEPH") == "1"


def _unavailable(reason: str) -> None:
    """Skip (or, with KVOFFLOAD_REQUIRE_CEPH=1, fail) the test for want of ``reason``."""
    if REQUIRE_CEPH:
        pytest.fail(f"KVOFFLOAD_REQUIRE_CEPH=1 but {reason}", pytrace=False)
    pytest.skip(reason)


def _boto3() -> Any:
    # Imported by name: boto3 ships no type information, and is not a dependency of the
    # project (a test run without it skips these tests).
    try:
        return importlib.import_module("boto3")
    except ImportError:
        _unavailable("boto3 is not installed (`.venv/bin/pip install boto3`)")


@pytest.fixture(scope="session")
def ceph_installed() -> None:
    """Ceph's binaries are on PATH (else the test is skipped, or fails when required)."""
    missing = missing_binaries()
    if missing:
        _unavailable(install_hint(missing))


@pytest.fixture(scope="session")
def rgw(ceph_installed: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RadosGateway]:
    """The session's cluster, up and answering S3 (see testsupport/rgw.py)."""
    _boto3()
    workdir: Path = tmp_path_factory.mktemp("rgw")
    gateway = RadosGateway(workdir).start()
    print(f"rgw: {gateway.endpoint} up in {gateway.timings['first_put']} s ({gateway.timings})")
    try:
        yield gateway
    finally:
        gateway.close()


def restore_gateway(request: Any) -> None:
    """Resume or restart the gateway an earlier test's fault left paused, stopped or killed,
    when the test about to run (``request``) uses the cluster."""
    if "rgw" in request.fixturenames:
        gateway: RadosGateway = request.getfixturevalue("rgw")
        gateway.ensure_gateway()


@pytest.fixture(autouse=True)
def _gateway_running(request: pytest.FixtureRequest) -> None:
    """Before a test that uses the cluster, ``restore_gateway`` (a test that failed midway
    included)."""
    restore_gateway(request)


@pytest.fixture
def make_s3(rgw: RadosGateway) -> Callable[..., Any]:
    """``make_s3(**config)``: a boto3 S3 client for the cluster's user. Path-style addressing
    (RGW here has no DNS name for virtual-hosted buckets); checksums only where an operation
    requires them (boto3's default adds a CRC32 of every PUT body, which RGW 16 neither
    checks nor returns); one attempt, no retries, unless ``config`` says otherwise.
    ``access_key`` / ``secret_key`` override the user's keys; other keywords go to
    ``botocore.config.Config``."""
    boto3 = _boto3()
    config_class = importlib.import_module("botocore.config").Config

    def make(access_key: str | None = None, secret_key: str | None = None, **config: Any) -> Any:
        settings: dict[str, Any] = {
            "s3": {"addressing_style": "path"},
            "retries": {"mode": "standard", "total_max_attempts": 1},
            "connect_timeout": 5,
            "read_timeout": 30,
            "request_checksum_calculation": "when_required",
            "response_checksum_validation": "when_required",
        }
        settings.update(config)
        return boto3.client(
            "s3",
            endpoint_url=rgw.endpoint,
            region_name=rgw.region,
            aws_access_key_id=access_key or rgw.access_key,
            aws_secret_access_key=secret_key or rgw.secret_key,
            config=config_class(**settings),
        )

    return make


@pytest.fixture
def s3(make_s3: Callable[..., Any]) -> Any:
    """A boto3 S3 client for the cluster's user (``make_s3()``)."""
    return make_s3()


@pytest.fixture
def bucket(rgw: RadosGateway, s3: Any) -> Iterator[str]:
    """A new bucket of its own for the test; emptied and deleted after it (with the gateway
    brought back first, should the test have left it down)."""
    name = f"t-{uuid.uuid4().hex[:16]}"
    s3.create_bucket(Bucket=name)
    yield name
    rgw.ensure_gateway()
    paginator = s3.get_paginator("list_objects_v2")
    for page in paginator.paginate(Bucket=name):
        keys = [{"Key": item["Key"]} for item in page.get("Contents", [])]
        if keys:
            s3.delete_objects(Bucket=name, Delete={"Objects": keys, "Quiet": True})
    s3.delete_bucket(Bucket=name)
