"""The object tier's store: an S3 bucket (AWS S3, MinIO, Ceph RGW) behind the host pool.

``S3Tier`` keeps ``transfer.remote``'s contract (``exists``, ``get_into``, ``put_from``,
``health``, ``held_slots``, ``close``; failures answer False / None, never raise) and adds
``delete(keys)``, with which the service keeps the bytes it wrote under its bound.

- **Layout**: one object per block, at ``<namespace>/<hex key>`` (the caller's namespace is
  ``<prefix>/<storage identity>/<block bytes>``: namespaces and block sizes never share an
  object). The body is the block's bytes followed by a 32-byte MAC: keyed BLAKE3, under a key
  derived from the namespace and, when configured, a secret the fleet shares, of the key's
  length, the key and the block. Every read checks it before a byte reaches the pool: an
  object of another length, of another key or namespace, torn, corrupt or (with the secret)
  forged is refused and counted (``checksum_failures``), never loaded.
- **Calls**: every key is its own request (GET, PUT, HEAD), ``concurrency`` at a time on the
  tier's threads (the client library lets go of the GIL while it waits); a batch waits at most
  ``timeout_s`` for all its keys, and a key not answered by then is False (its slot stays in
  ``held_slots`` until its request ends; the client's own timeout ends it). A lookup's
  ``exists`` waits only for its own, shorter budget: the HEADs it has not started by then are
  dropped, never sent, and nothing is built for them meanwhile (what it holds is bounded by
  ``concurrency``, not by the keys). Deletes go in bulk (DeleteObjects).
- **Health**: a batch whose every key failed with an error (not a 404) degrades the tier: a
  gateway down, 5xx after the client's retries, a timeout, refused credentials, a missing
  bucket. A probe thread lists an empty prefix of the namespace every ``probe_interval_s``,
  while ok too (a bucket deleted, or credentials revoked, while no call flows shows within an
  interval), and brings the tier back when it answers.
- **Credentials**: given (``S3Config.access_key_id`` / ``secret_access_key``, tests) or
  botocore's standard chain: environment, shared config and credentials files (``AWS_PROFILE``),
  a web-identity token (``AWS_WEB_IDENTITY_TOKEN_FILE`` + ``AWS_ROLE_ARN``), container and
  instance metadata; refreshed as they expire. Never logged, never in a health report.

The client is ``obstore`` (Rust's ``object_store``), credentials come from ``boto3``: both from
the ``object`` extra.
"""

from __future__ import annotations

import concurrent.futures
import hmac
import logging
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal

import numpy as np
from blake3 import blake3

from transfer.errors import RemoteTierError
from transfer.health import HealthTracker
from transfer.host_pool import HostPool
from transfer.remote import COUNTERS, RemoteHealth, check_blocks, check_slots

__all__ = [
    "MAC_BYTES",
    "OBJECT_COUNTERS",
    "S3Config",
    "S3Tier",
    "object_mac",
]

log = logging.getLogger("kvoffload.transfer.s3")

#: Bytes of the MAC after each block in its object.
MAC_BYTES = 32
#: The tier's counters: the remote contract's and its own.
OBJECT_COUNTERS = (
    *COUNTERS,
    "checksum_failures",  # objects read whose length or MAC did not match: refused
    "deletes",  # objects deleted (the bound)
    "delete_failures",  # objects a delete call failed for
)
_KEY_LEN = struct.Struct("<H")
# The probe lists this prefix of the namespace, where nothing is ever written.
_PROBE_PREFIX = "kvoffload-probe/"
_MAC_CONTEXT = "kvoffload 2026-12 object tier block MAC"


def object_mac(mac_key: bytes, key: bytes, block: Any) -> bytes:
    """The MAC stored after ``block`` (any buffer): keyed BLAKE3 of the key's length (2 bytes,
    little endian), the key, then the block. Lets go of the GIL while it hashes."""
    h = blake3(_KEY_LEN.pack(len(key)), key=mac_key)
    h.update(key)
    h.update(block)
    return h.digest()


@dataclass(frozen=True)
class S3Config:
    """Where the bucket is and how to talk to it (see the module docstring).

    ``endpoint``: the S3 endpoint's URL (None: AWS's for ``region``); ``addressing``: ``path``
    (``endpoint/bucket/key``: MinIO, Ceph RGW) or ``virtual`` (``bucket.endpoint/key``: AWS);
    ``verify_tls``: False accepts any certificate (a test gateway with a self-signed one);
    ``secret``: bytes the fleet shares, mixed into the MAC key (None: the MAC is a checksum
    bound to the key and namespace, not a defence against someone who can write the bucket).
    """

    bucket: str
    endpoint: str | None = None
    region: str = "us-east-1"
    addressing: Literal["path", "virtual"] = "path"
    verify_tls: bool = True
    timeout_s: float = 5.0
    connect_timeout_s: float = 2.0
    max_retries: int = 2
    concurrency: int = 16
    probe_interval_s: float = 1.0
    secret: bytes | None = None
    access_key_id: str | None = None
    secret_access_key: str | None = None

    def __post_init__(self) -> None:
        if not self.bucket:
            raise RemoteTierError("the object tier needs a bucket")
        if not self.timeout_s > 0 or not self.connect_timeout_s > 0:
            raise RemoteTierError("timeout_s and connect_timeout_s must be > 0")
        if not self.probe_interval_s > 0 or self.concurrency < 1 or self.max_retries < 0:
            raise RemoteTierError("probe_interval_s > 0, concurrency >= 1, max_retries >= 0")

    def __repr__(self) -> str:  # never the keys or the secret
        return (
            f"S3Config(bucket={self.bucket!r}, endpoint={self.endpoint!r}, "
            f"region={self.region!r}, addressing={self.addressing!r})"
        )


def _load_client() -> Any:
    try:
        import obstore
    except ImportError as exc:
        raise RemoteTierError(
            f"the object tier needs the obstore package ({exc}); install the object extra: "
            "pip install 'kvoffload[object]'"
        ) from None
    return obstore


def _open_store(config: S3Config) -> Any:
    """The bucket's store: ``config``'s endpoint, addressing, TLS check, timeouts and retries,
    and its credentials (``_credentials``). Makes no request."""
    from obstore.store import S3Store

    return S3Store(
        config.bucket,
        endpoint=config.endpoint,
        region=config.region,
        virtual_hosted_style_request=config.addressing == "virtual",
        client_options={
            "allow_http": True,
            "allow_invalid_certificates": not config.verify_tls,
            "timeout": timedelta(seconds=config.timeout_s),
            "connect_timeout": timedelta(seconds=config.connect_timeout_s),
        },
        retry_config={
            "max_retries": config.max_retries,
            "retry_timeout": timedelta(seconds=config.timeout_s),
            "backoff": {
                "init_backoff": timedelta(milliseconds=20),
                "max_backoff": timedelta(seconds=1),
                "base": 2,
            },
        },
        **_credentials(config),
    )


def _credentials(config: S3Config) -> dict[str, Any]:
    """The store's credential options: the configured keys, or a provider over botocore's
    standard chain (``RemoteTierError`` when boto3 is missing)."""
    if config.access_key_id and config.secret_access_key:
        return {
            "access_key_id": config.access_key_id,
            "secret_access_key": config.secret_access_key,
        }
    try:
        import boto3
        from obstore.auth.boto3 import Boto3CredentialProvider
    except ImportError as exc:
        raise RemoteTierError(
            f"the object tier's credentials need boto3 ({exc}); install the object extra: "
            "pip install 'kvoffload[object]'"
        ) from None
    session = boto3.Session()
    if session.get_credentials() is None:
        raise RemoteTierError(
            "no S3 credentials found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, a "
            "shared credentials file (AWS_SHARED_CREDENTIALS_FILE, AWS_PROFILE), or a web "
            "identity (AWS_WEB_IDENTITY_TOKEN_FILE and AWS_ROLE_ARN)"
        )
    return {"credential_provider": Boto3CredentialProvider(session)}


class _Outcome:
    """What one key's request came to."""

    OK, ABSENT, CORRUPT, ERROR = "ok", "absent", "corrupt", "error"
    # Not asked, or not answered, within the caller's budget: no answer, no fault.
    UNANSWERED = "unanswered"


class _Requests:
    """A store's calls, one per key, on its threads: each one bounded in time, its outcome
    judged for the store's health (``HealthTracker``), the pool slots it touches held until
    it ends."""

    def __init__(self, health: HealthTracker, timeout_s: float, concurrency: int) -> None:
        self.health = health
        self.timeout_s = timeout_s
        self.concurrency = concurrency
        self.executor = concurrent.futures.ThreadPoolExecutor(
            concurrency, thread_name_prefix="kvoffload-s3"
        )

    def batch(
        self,
        what: str,
        calls: list[tuple[Callable[..., str], tuple[Any, ...]]],
        slots: Sequence[int],
        *,
        released_by_call: bool = False,
    ) -> list[str]:
        """Run each call on the tier's threads and wait at most ``timeout_s`` for all of
        them: each one's outcome (``ERROR`` where skipped, failed or late). ``slots`` are held
        until their call ends; ``released_by_call``: each call releases its own slot itself,
        once (a put, as soon as it copied it), so this does not."""
        if not self.health.hold(slots):
            return [_Outcome.ERROR] * len(calls)
        pending = list(slots)

        def run(fn: Callable[..., str], args: tuple[Any, ...], slot: int | None) -> str:
            try:
                return fn(*args)
            finally:
                if slot is not None and not released_by_call:
                    self.health.release([slot])

        futures: list[concurrent.futures.Future[str] | None] = []
        for i, (fn, args) in enumerate(calls):
            slot = pending[i] if i < len(pending) else None
            try:
                futures.append(self.executor.submit(run, fn, args, slot))
            except RuntimeError:  # closed meanwhile: never started, its slot free now
                if slot is not None:
                    self.health.release([slot])
                futures.append(None)
        live = [f for f in futures if f is not None]
        done, _ = concurrent.futures.wait(live, timeout=self.timeout_s)
        outcomes: list[str] = []
        errors: list[str] = []
        late = 0
        for i, future in enumerate(futures):
            if future is None:
                outcomes.append(_Outcome.ERROR)
                continue
            if future not in done:
                if future.cancel() and i < len(pending):  # never started: its slot is free
                    self.health.release([pending[i]])
                late += 1
                outcomes.append(_Outcome.ERROR)
                continue
            exc = future.exception()
            if exc is None:
                outcomes.append(future.result())
            elif isinstance(exc, FileNotFoundError):
                outcomes.append(_Outcome.ABSENT)
            else:
                errors.append(f"{type(exc).__name__}: {_first_line(exc)}")
                outcomes.append(_Outcome.ERROR)
        self._judge(what, outcomes, errors, late)
        return outcomes

    def within(
        self, what: str, fn: Callable[[bytes], str], keys: Sequence[bytes], budget_s: float
    ) -> list[str]:
        """Slot-free calls ``fn(key)`` (HEADs), one per key, for a caller who waits
        ``budget_s`` only: at most ``concurrency`` submitted at a time, the next one as one
        ends, none after the budget; each one's outcome (``UNANSWERED`` where not asked or not
        answered in time: no fault of the tier, and nothing of the call left queued behind
        it). What it holds meanwhile is bounded by ``concurrency``, not by the keys."""
        if not self.health.hold(()):
            return [_Outcome.ERROR] * len(keys)
        deadline = time.monotonic() + budget_s
        outcomes = [_Outcome.UNANSWERED] * len(keys)
        errors: list[str] = []
        running: dict[concurrent.futures.Future[str], int] = {}
        following = 0
        while True:
            while (
                following < len(keys)
                and len(running) < self.concurrency
                and time.monotonic() < deadline
            ):
                try:
                    running[self.executor.submit(fn, keys[following])] = following
                except RuntimeError:  # closed meanwhile
                    following = len(keys)
                    break
                following += 1
            left = deadline - time.monotonic()
            if not running or left <= 0:
                break
            done, _ = concurrent.futures.wait(
                running, timeout=left, return_when=concurrent.futures.FIRST_COMPLETED
            )
            for future in done:
                i = running.pop(future)
                exc = future.exception()
                if exc is None:
                    outcomes[i] = future.result()
                elif isinstance(exc, FileNotFoundError):
                    outcomes[i] = _Outcome.ABSENT
                else:
                    errors.append(f"{type(exc).__name__}: {_first_line(exc)}")
                    outcomes[i] = _Outcome.ERROR
        for future in running:
            future.cancel()  # queued behind other calls: never sent
        answered = [o for o in outcomes if o != _Outcome.UNANSWERED]
        if answered:
            self._judge(what, answered, errors, 0)
        return outcomes

    def _judge(self, what: str, outcomes: list[str], errors: list[str], late: int) -> None:
        """Count a batch's errors and timeouts; every key failing degrades the tier."""
        bad = outcomes.count(_Outcome.ERROR)
        if late:
            self.health.count(timeouts=1)
        why = errors[0] if errors else f"no answer within {self.timeout_s:g} s"
        self.health.judge(what, bad, len(outcomes), why)


class S3Tier:
    """The object tier on one S3 bucket, over ``pool``'s slots, under ``namespace``."""

    def __init__(self, pool: HostPool, namespace: str, config: S3Config) -> None:
        """Build the client (no request yet) and start the probe, whose first answer makes
        the tier ok. ``RemoteTierError``: the library is missing or no credentials are
        found (the service refuses to start, naming the fix)."""
        if not namespace or namespace.startswith("/") or namespace.endswith("/"):
            raise RemoteTierError(f"namespace {namespace!r} must be non-empty, without edge '/'")
        self._client = _load_client()
        self.config = config
        self._pool = pool
        # Held while a request may still touch the pool: a GET that ends after close() writes
        # into memory that is still mapped (the mapping outlives HostPool.close()).
        self._memory = pool.tensor
        self._namespace = namespace
        self._block_bytes = pool.block_bytes
        self._object_bytes = pool.block_bytes + MAC_BYTES
        key_material = (config.secret or b"") + namespace.encode()
        self._mac_key = blake3(key_material, derive_key_context=_MAC_CONTEXT).digest()
        self._store = _open_store(config)
        self._health = HealthTracker("object tier", OBJECT_COUNTERS, "not checked yet", log)
        self._requests = _Requests(self._health, config.timeout_s, config.concurrency)
        self._prober_pool = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="kvoffload-s3-probe"
        )
        self._probing: concurrent.futures.Future[None] | None = None
        self._health.started(self._probe())
        self._prober = threading.Thread(target=self._probe_loop, name="s3-probe", daemon=True)
        self._prober.start()

    # -- the contract ------------------------------------------------------------------------

    @property
    def namespace(self) -> str:
        return self._namespace

    @property
    def block_bytes(self) -> int:
        return self._block_bytes

    def path(self, key: bytes) -> str:
        """The object's key in the bucket."""
        return f"{self._namespace}/{key.hex()}"

    def exists(self, keys: Sequence[bytes], timeout_s: float | None = None) -> list[bool | None]:
        """One HEAD per key: True for an object of the right length, False for none (404)
        or one of another length, None where no answer came (error, timeout, degraded).
        ``timeout_s``: the caller's own budget (a lookup's), below the tier's: a HEAD not
        started by then never starts (those queued are dropped), and a key not answered by then
        is no answer (None), not a fault of the tier."""
        if not keys:
            return []
        if timeout_s is not None and timeout_s < self.config.timeout_s:
            # Nothing built per key up front: a lookup of 8,192 keys that has time for a few
            # hundred HEADs holds no call objects for the rest (they would outlive the young
            # collections and bring on full ones, every thread of the process stopped while
            # the collector walks the heap: another namespace's lookups run out of time).
            outcomes = self._requests.within("exists", self._head, keys, max(0.0, timeout_s))
        else:
            outcomes = self._requests.batch("exists", [(self._head, (k,)) for k in keys], [])
        answers: dict[str, bool | None] = {
            _Outcome.OK: True,
            _Outcome.ABSENT: False,
            _Outcome.CORRUPT: False,  # another length: not a block of this tier, not loadable
        }
        found = [answers.get(o) for o in outcomes]
        self._health.count(
            exists_calls=1,
            hits=found.count(True),
            misses=found.count(False),
            checksum_failures=outcomes.count(_Outcome.CORRUPT),
        )
        return found

    def get_into(self, keys: Sequence[bytes], slots: Sequence[int]) -> list[bool]:
        """One GET per key into its slot; True only where the whole block was read and its MAC
        matches (a False slot holds undefined bytes)."""
        check_slots(keys, slots, self._pool.num_blocks)
        if not keys:
            return []
        calls = [(self._get, (k, s)) for k, s in zip(keys, slots, strict=True)]
        outcomes = self._requests.batch("get", calls, slots)
        read = [o == _Outcome.OK for o in outcomes]
        self._health.count(
            gets=sum(read),
            get_failures=len(read) - sum(read),
            bytes_read=sum(read) * self._block_bytes,
            checksum_failures=outcomes.count(_Outcome.CORRUPT),
        )
        return read

    def put_from(self, keys: Sequence[bytes], slots: Sequence[int]) -> list[bool]:
        """One PUT per key out of its slot (the block and its MAC); True once stored. A slot
        is read (copied) at the start of its request and released then."""
        check_slots(keys, slots, self._pool.num_blocks)
        if not keys:
            return []
        calls = [(self._put, (k, s)) for k, s in zip(keys, slots, strict=True)]
        return self._counted_puts(self._requests.batch("put", calls, slots, released_by_call=True))

    def _counted_puts(self, outcomes: list[str]) -> list[bool]:
        stored = [o == _Outcome.OK for o in outcomes]
        self._health.count(
            puts=sum(stored),
            put_failures=len(stored) - sum(stored),
            bytes_written=sum(stored) * self._object_bytes,
        )
        return stored

    def put_bytes(self, keys: Sequence[bytes], blocks: Sequence[bytes]) -> list[bool]:
        """``put_from`` for blocks staged outside the pool: the same objects (block and MAC)."""
        check_blocks(keys, blocks, self._block_bytes)
        if not keys:
            return []
        calls = [(self._put_block, (k, b)) for k, b in zip(keys, blocks, strict=True)]
        return self._counted_puts(self._requests.batch("put", calls, []))

    def delete(self, keys: Sequence[bytes]) -> bool:
        """Delete the keys' objects (one bulk call per 1000 keys; a key with no object counts
        as deleted); whether every call succeeded. Skipped (False) while degraded."""
        if not keys:
            return True
        paths = [self.path(k) for k in keys]
        ok = True
        for start in range(0, len(paths), 1000):
            part = paths[start : start + 1000]
            outcomes = self._requests.batch("delete", [(self._delete, (part,))], [])
            if outcomes == [_Outcome.OK]:
                self._health.count(deletes=len(part))
            else:
                self._health.count(delete_failures=len(part))
                ok = False
        return ok

    def health(self) -> RemoteHealth:
        return self._health.snapshot()

    def held_slots(self) -> frozenset[int]:
        return self._health.held_slots()

    def close(self) -> None:
        """Stop probing; requests in flight end on their own (bounded by the client's timeout,
        their slots held meanwhile); later calls answer as failures. Idempotent."""
        if not self._health.close():
            return
        self._prober.join(self.config.timeout_s)
        self._requests.executor.shutdown(wait=False, cancel_futures=True)
        self._prober_pool.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> S3Tier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"S3Tier(namespace={self._namespace!r}, {self.config!r}, state={self._health.state})"

    # -- one key's request (on the tier's threads) --------------------------------------------

    def _head(self, key: bytes) -> str:
        meta = self._client.head(self._store, self.path(key))
        return _Outcome.OK if meta["size"] == self._object_bytes else _Outcome.CORRUPT

    def _get(self, key: bytes, slot: int) -> str:
        body = self._client.get(self._store, self.path(key)).bytes()
        view = memoryview(body)
        if len(view) != self._object_bytes:
            return _Outcome.CORRUPT
        bb = self._block_bytes
        mac = object_mac(self._mac_key, key, view[:bb])
        if not hmac.compare_digest(mac, bytes(view[bb:])):
            return _Outcome.CORRUPT
        # numpy's copy lets go of the GIL.
        self._memory[slot].numpy()[:] = np.frombuffer(body, dtype=np.uint8, count=bb)
        return _Outcome.OK

    def _put(self, key: bytes, slot: int) -> str:
        body = np.empty(self._object_bytes, dtype=np.uint8)
        try:
            body[: self._block_bytes] = self._memory[slot].numpy()
        finally:
            self._health.release([slot])
        return self._put_object(key, body)

    def _put_block(self, key: bytes, block: bytes) -> str:
        body = np.empty(self._object_bytes, dtype=np.uint8)
        body[: self._block_bytes] = np.frombuffer(block, np.uint8)
        return self._put_object(key, body)

    def _put_object(self, key: bytes, body: np.ndarray[Any, Any]) -> str:
        """Store ``body`` (the block in its first ``block_bytes``) with the block's MAC after it."""
        bb = self._block_bytes
        body[bb:] = np.frombuffer(object_mac(self._mac_key, key, body[:bb].data), np.uint8)
        self._client.put(self._store, self.path(key), body.data)
        return _Outcome.OK

    def _delete(self, paths: list[str]) -> str:
        self._client.delete(self._store, paths)
        return _Outcome.OK

    def _probe_loop(self) -> None:
        interval = self.config.probe_interval_s
        while True:
            closed, state = self._health.next_look(interval)
            if closed:
                return
            if self._probe():
                if state != "ok":
                    self._health.recovered()
            elif state == "ok":
                self._health.fail(f"probe: {self._health.last_error}")

    def _probe(self) -> bool:
        """List an empty prefix of the namespace (bucket there, credentials accepted, gateway
        answering), within ``timeout_s``; one probe at a time."""
        if self._probing is not None and not self._probing.done():
            self._health.note("the previous probe has not finished")
            return False

        prefix = f"{self._namespace}/{_PROBE_PREFIX}"

        def probe() -> None:
            self._client.list_with_delimiter(self._store, prefix=prefix)

        try:
            self._probing = self._prober_pool.submit(probe)
            self._probing.result(self.config.timeout_s)
        except concurrent.futures.TimeoutError:
            self._health.note(f"probe did not finish within {self.config.timeout_s:g} s")
            return False
        except BaseException as exc:  # the gateway's answer, the prober shut down (closing), or
            # a panic in the client library (a BaseException: it must not end the probe loop)
            if isinstance(exc, KeyboardInterrupt | SystemExit):
                raise
            self._health.note(f"probe: {type(exc).__name__}: {_first_line(exc)}")
            return False
        return True


def _first_line(exc: BaseException) -> str:
    """An error's first line (the client's messages go on with debug dumps)."""
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else type(exc).__name__
