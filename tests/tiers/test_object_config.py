"""The object tier's start-up refusals, without a gateway: each names the setting and the fix,
and the service does not start (the gateway's own faults, a tier that starts degraded and
recovers, are tests/object's, on a real one)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from app.core.service import Service
from app.settings import ConfigError
from testsupport.api_harness import make_settings
from transfer import HostPool

pytestmark = pytest.mark.anyio


@pytest.fixture
def no_aws(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No AWS credentials anywhere the chain looks (and no instance metadata to ask)."""
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.delenv("AWS_WEB_IDENTITY_TOKEN_FILE", raising=False)
    monkeypatch.delenv("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", raising=False)


def object_settings(**overrides: object) -> dict[str, object]:
    # A port nothing listens on: the tier would start degraded, if it started.
    return {
        "tiers": ["object"],
        "object_bucket": "kv-cache",
        "object_endpoint": "http://127.0.0.1:9",
        **overrides,
    }


async def start(**overrides: object) -> ConfigError:
    service = Service(make_settings(**object_settings(**overrides)))
    with pytest.raises(ConfigError) as err:
        async with service.running():
            pass
    return err.value


async def test_no_credentials_stop_the_start_naming_where_they_come_from(no_aws: None) -> None:
    err = await start()
    assert err.field == "object_bucket"
    assert "AWS_ACCESS_KEY_ID" in str(err)
    assert "AWS_WEB_IDENTITY_TOKEN_FILE" in str(err)


async def test_a_bound_smaller_than_one_object_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDEXAMPLE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret-example")
    err = await start(object_bytes=100)
    assert err.field == "object_bytes"


async def test_a_mac_key_file_that_cannot_be_read_or_is_short_is_refused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDEXAMPLE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret-example")
    err = await start(object_mac_key_file=tmp_path / "missing")
    assert err.field == "object_mac_key_file"
    short = tmp_path / "short"
    short.write_bytes(b"abc")
    short.chmod(0o600)
    err = await start(object_mac_key_file=short)
    assert err.field == "object_mac_key_file"
    assert "16 bytes" in str(err)


async def test_the_keys_never_show_in_the_stats_or_the_config_repr(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDEXAMPLE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "very-secret-example-key")
    service = Service(make_settings(**object_settings(object_timeout_s=0.5)))
    async with service.running():
        tier = service.tiers.get("object")
        assert tier is not None
        assert not tier.health().ok  # nothing listens there: degraded, serving without it
        shown = repr(tier.state()) + repr(tier.store)  # type: ignore[attr-defined]
        assert "very-secret-example-key" not in shown
        assert "AKIDEXAMPLE" not in shown


def test_a_put_lets_go_of_its_slot_once_and_not_of_another_call_s_hold() -> None:
    """A GET that outlived its batch still writes into slot 3, which stays held; a PUT out of
    the same slot meanwhile releases its own hold only (a second release would let the slot
    be reused under the late GET)."""
    from transfer.s3 import S3Config, S3Tier

    gate, entered = threading.Event(), threading.Event()

    class Client:  # the library's calls the tier makes, the GET held at a gate
        def get(self, store: object, path: str) -> object:
            entered.set()
            gate.wait(10)
            raise FileNotFoundError(path)

        def put(self, store: object, path: str, body: object) -> None:
            return None

    pool = HostPool.create(8, 4096, pin=False)
    config = S3Config(
        bucket="kv-cache",
        endpoint="http://127.0.0.1:9",
        access_key_id="AKIDEXAMPLE",
        secret_access_key="secret-example",
        timeout_s=0.3,
        probe_interval_s=60,
    )
    with S3Tier(pool, "kvoffload/default/4096", config) as tier:
        tier._client = Client()
        tier._health.state = "ok"  # nothing listens at the endpoint: as if the probe had answered
        assert tier.get_into([b"k"], [3]) == [False]  # late: its batch gave up
        assert entered.is_set()
        assert tier.held_slots() == {3}
        tier._health.state = "ok"  # the late batch degraded it
        assert tier.put_from([b"k"], [3]) == [True]
        assert tier.held_slots() == {3}  # the GET's hold, still
        gate.set()
        deadline = time.monotonic() + 10
        while tier.held_slots():
            assert time.monotonic() < deadline, "the GET never let go"
            time.sleep(0.01)
    pool.close()
