"""The test cluster itself (testsupport/rgw.py): S3 semantics the object-store tier relies
on, as a real RADOS Gateway gives them, and the fault controls its tests will use."""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.object.conftest import restore_gateway
from testsupport import ports
from testsupport import rgw as rgw_module
from testsupport.rgw import RadosGateway, RgwError

ROOT = Path(__file__).resolve().parents[2]


def error_of(exc: pytest.ExceptionInfo[Exception]) -> tuple[int, str]:
    """(HTTP status, S3 error code) of a botocore ClientError."""
    response: dict[str, Any] = exc.value.response  # type: ignore[attr-defined]
    return response["ResponseMetadata"]["HTTPStatusCode"], response["Error"]["Code"]


def botocore_error(name: str) -> type[Exception]:
    """An exception class of botocore.exceptions (imported by name: botocore ships no type
    information; conftest skips these tests without it)."""
    error: type[Exception] = getattr(importlib.import_module("botocore.exceptions"), name)
    return error


def client_error() -> type[Exception]:
    return botocore_error("ClientError")


def test_round_trip(s3: Any, bucket: str) -> None:
    """PUT, GET, HEAD, list and DELETE, bytes equal both ways (an empty object, one of an odd
    size, one of several MiB)."""
    blobs = {
        "empty": b"",
        "odd/size": os.urandom(256 * 1024 + 7),
        "big": os.urandom(5 * 1024 * 1024 + 3),
    }
    for key, data in blobs.items():
        put = s3.put_object(Bucket=bucket, Key=key, Body=data)
        assert put["ETag"].strip('"') == hashlib.md5(data).hexdigest()
    for key, data in blobs.items():
        got = s3.get_object(Bucket=bucket, Key=key)
        assert got["Body"].read() == data
        assert got["ContentLength"] == len(data)
        head = s3.head_object(Bucket=bucket, Key=key)
        assert head["ContentLength"] == len(data)
        assert head["ETag"] == got["ETag"]
    ranged = s3.get_object(Bucket=bucket, Key="odd/size", Range="bytes=100-199")
    assert ranged["Body"].read() == blobs["odd/size"][100:200]

    listed = s3.list_objects_v2(Bucket=bucket)
    assert {o["Key"]: o["Size"] for o in listed["Contents"]} == {
        k: len(v) for k, v in blobs.items()
    }
    prefixed = s3.list_objects_v2(Bucket=bucket, Prefix="odd/")
    assert [o["Key"] for o in prefixed["Contents"]] == ["odd/size"]

    for key in blobs:
        s3.delete_object(Bucket=bucket, Key=key)
    assert s3.list_objects_v2(Bucket=bucket)["KeyCount"] == 0
    # S3 deletes are idempotent: deleting a missing key succeeds.
    s3.delete_object(Bucket=bucket, Key="big")


def test_overwrite_replaces_the_object(s3: Any, bucket: str) -> None:
    s3.put_object(Bucket=bucket, Key="k", Body=b"first")
    s3.put_object(Bucket=bucket, Key="k", Body=b"second, longer")
    assert s3.get_object(Bucket=bucket, Key="k")["Body"].read() == b"second, longer"


def test_missing_key_is_404(s3: Any, bucket: str) -> None:
    with pytest.raises(client_error()) as got:
        s3.get_object(Bucket=bucket, Key="never-written")
    assert error_of(got) == (404, "NoSuchKey")
    # HEAD has no body, so the code is only the status.
    with pytest.raises(client_error()) as head:
        s3.head_object(Bucket=bucket, Key="never-written")
    assert error_of(head) == (404, "404")


def test_missing_bucket_is_404_no_such_bucket(s3: Any) -> None:
    for call in (
        lambda: s3.get_object(Bucket="no-such-bucket-kvoffload", Key="k"),
        lambda: s3.put_object(Bucket="no-such-bucket-kvoffload", Key="k", Body=b"x"),
        lambda: s3.list_objects_v2(Bucket="no-such-bucket-kvoffload"),
    ):
        with pytest.raises(client_error()) as got:
            call()
        assert error_of(got) == (404, "NoSuchBucket")


def test_wrong_credentials_are_refused(make_s3: Callable[..., Any], bucket: str) -> None:
    wrong_secret = make_s3(secret_key="not-the-secret-key-0000000000000000000000")
    with pytest.raises(client_error()) as got:
        wrong_secret.get_object(Bucket=bucket, Key="k")
    assert error_of(got) == (403, "SignatureDoesNotMatch")
    unknown_key = make_s3(access_key="NOSUCHACCESSKEY00000")
    with pytest.raises(client_error()) as got:
        unknown_key.put_object(Bucket=bucket, Key="k", Body=b"x")
    assert error_of(got) == (403, "InvalidAccessKeyId")


def test_objects_survive_a_killed_gateway(
    rgw: RadosGateway, make_s3: Callable[..., Any], s3: Any, bucket: str
) -> None:
    """Objects acknowledged before a SIGKILL of the gateway are all there, byte for byte,
    once it is started again on the same endpoint; while it is down, requests are refused."""
    EndpointConnectionError = botocore_error("EndpointConnectionError")
    blobs = {f"k{i}": os.urandom(64 * 1024 + i) for i in range(16)}
    for key, data in blobs.items():
        s3.put_object(Bucket=bucket, Key=key, Body=data)
    endpoint = rgw.endpoint

    rgw.kill_gateway()
    assert rgw.gateway_state() == "down"
    with pytest.raises(EndpointConnectionError):
        make_s3(connect_timeout=1).get_object(Bucket=bucket, Key="k0")

    rgw.start_gateway()
    assert rgw.endpoint == endpoint
    assert rgw.gateway_state() == "running"
    # A new client, and the old one (its pooled connections died with the gateway).
    for client in (make_s3(), s3):
        for key, data in blobs.items():
            assert client.get_object(Bucket=bucket, Key=key)["Body"].read() == data


def test_stopped_gateway_restarts_with_objects(rgw: RadosGateway, s3: Any, bucket: str) -> None:
    s3.put_object(Bucket=bucket, Key="k", Body=b"kept")
    started = time.monotonic()
    rgw.stop_gateway()
    stop_s = time.monotonic() - started
    assert rgw.gateway_state() == "down"
    rgw.start_gateway()
    assert s3.get_object(Bucket=bucket, Key="k")["Body"].read() == b"kept"
    assert stop_s < 10, f"SIGTERM took {stop_s:.1f} s"


def test_paused_gateway_times_out_then_answers(
    rgw: RadosGateway, make_s3: Callable[..., Any], bucket: str
) -> None:
    """A SIGSTOPped gateway still accepts TCP connections (the kernel completes them), so a
    client's request is neither refused nor answered: it ends on the client's read timeout.
    After SIGCONT the same requests are answered."""
    ReadTimeoutError = botocore_error("ReadTimeoutError")
    quick = make_s3(connect_timeout=1, read_timeout=0.5)
    quick.put_object(Bucket=bucket, Key="k", Body=b"before the pause")

    rgw.pause_gateway()
    assert rgw.gateway_state() == "paused"
    started = time.monotonic()
    with pytest.raises(ReadTimeoutError):
        quick.get_object(Bucket=bucket, Key="k")
    waited = time.monotonic() - started
    assert 0.4 < waited < 5, f"timed out after {waited:.2f} s"

    rgw.resume_gateway()
    assert rgw.gateway_state() == "running"
    assert quick.get_object(Bucket=bucket, Key="k")["Body"].read() == b"before the pause"


def test_ensure_gateway_recovers_from_each_fault(rgw: RadosGateway, s3: Any) -> None:
    for fault in (rgw.kill_gateway, rgw.stop_gateway, rgw.pause_gateway):
        fault()
        assert rgw.gateway_state() != "running"
        rgw.ensure_gateway()
        assert rgw.gateway_state() == "running"
        assert s3.list_buckets()["ResponseMetadata"]["HTTPStatusCode"] == 200


def test_a_gateway_left_paused_is_running_again_for_the_next_test_that_uses_it(
    rgw: RadosGateway, s3: Any
) -> None:
    # What the autouse fixture does before each test, on a test that uses the cluster and on
    # one that does not; the gateway is running again when this test ends.
    class Request:
        def __init__(self, names: list[str]) -> None:
            self.fixturenames = names

        def getfixturevalue(self, name: str) -> Any:
            assert name == "rgw"
            return rgw

    rgw.pause_gateway()
    try:
        restore_gateway(Request(["tmp_path"]))
        assert rgw.gateway_state() != "running"  # a test without the cluster leaves it be
    finally:
        restore_gateway(Request(["rgw", "s3"]))
    assert rgw.gateway_state() == "running"
    assert s3.list_buckets()["ResponseMetadata"]["HTTPStatusCode"] == 200


def test_start_gateway_refuses_a_running_gateway(rgw: RadosGateway) -> None:
    with pytest.raises(RgwError, match="still running"):
        rgw.start_gateway()


def test_refuses_a_directory_that_is_not_empty(tmp_path: Path) -> None:
    (tmp_path / "precious").write_text("not ours")
    with pytest.raises((RgwError, rgw_module.CephNotInstalled)):
        RadosGateway(tmp_path).start()
    assert (tmp_path / "precious").read_text() == "not ours"


def test_missing_binaries_name_the_debian_packages(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(rgw_module.CephNotInstalled) as got:
        rgw_module.find_binaries()
    for package in ("ceph-mon", "ceph-osd", "radosgw", "ceph-common"):
        assert package in str(got.value)


@pytest.mark.usefixtures("ceph_installed")
def test_failed_start_reports_log_tails(tmp_path: Path) -> None:
    """A daemon that exits during the start (here: the gateway, its port taken) fails start()
    at once, with the logs that say why, and no daemon is left."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        broken = RadosGateway(tmp_path / "c", start_timeout_s=60, port=taken.getsockname()[1])
        started = time.monotonic()
        try:
            # Exit status 98: EADDRINUSE (radosgw does not always log why before it exits).
            with pytest.raises(RgwError, match=r"client\.rgw\.gw exited \(98\)") as got:
                broken.start()
        finally:
            broken.close()
    assert time.monotonic() - started < 30
    message = str(got.value)
    for log in ("client.rgw.gw.log", "osd.0.log", "mon.a.log"):
        assert f"--- {log}" in message
    assert not (tmp_path / "c").exists()
    for daemon in (broken._mon, broken._osd, broken._gw):
        assert daemon is None or not daemon.running()


@pytest.mark.slow
@pytest.mark.usefixtures("ceph_installed")
def test_start_moves_to_another_port_when_its_pick_is_taken(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A free port picked for the gateway and taken before it binds (a race with another
    process) costs a retry on another port, not a failed start."""
    real_free_port = ports.free_port
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        # The monitor's pick, then the gateway's (the taken one), then the retry's.
        picks = iter([real_free_port(), taken.getsockname()[1]])
        monkeypatch.setattr(rgw_module, "free_port", lambda: next(picks, None) or real_free_port())
        with rgw_module.running_gateway(tmp_path / "c") as gateway:
            assert gateway.port != taken.getsockname()[1]
            assert gateway.s3_request("GET", "/")[0] == 200


def test_store_is_checked() -> None:
    with pytest.raises(ValueError, match="memstore or bluestore"):
        RadosGateway("/nonexistent", store="filestore")  # type: ignore[arg-type]


@pytest.mark.slow
@pytest.mark.usefixtures("ceph_installed")
def test_cli_up_runs_until_sigterm(tmp_path: Path) -> None:
    """``python -m testsupport.rgw up DIR``: one JSON line with the endpoint and keys, a
    working gateway, and a full teardown on SIGTERM."""
    workdir = tmp_path / "cli"
    proc = subprocess.Popen(
        [sys.executable, "-m", "testsupport.rgw", "up", str(workdir)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        info = json.loads(line)
        assert set(info) >= {"endpoint", "access_key", "secret_key", "region"}
        port = int(info["endpoint"].rsplit(":", 1)[1])
        status, _ = rgw_module._s3_request(
            port, info["access_key"], info["secret_key"], "GET", "/", b"", 5.0
        )
        assert status == 200
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        assert not workdir.exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
