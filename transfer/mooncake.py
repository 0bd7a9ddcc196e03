"""``MooncakeTier``: the remote tier (``transfer.remote``) on Mooncake Store.

What it adds to the contract:

- **Zero copy.** The whole host pool is registered with the Mooncake client as one buffer, so
  ``get_into`` and ``put_from`` are single batch calls (``batch_get_into``,
  ``batch_put_from``) that read into and write from the pool's slots directly.
- **Off the caller's thread, bounded.** Every Mooncake call runs on the tier's own threads; the
  caller waits at most ``timeout_s`` for it. A call that has not ended by then answers False
  for its keys, and its slots stay in ``held_slots()`` until Mooncake lets go of them.
- **Degraded, then back by itself.** A call that raises, times out, or fails for every key with
  an error (not a plain absence, a full store or a key that already exists) moves the tier to
  ``degraded``: counted, logged once per incident. While degraded, calls answer False at once
  without touching Mooncake, and a probe every ``probe_interval_s`` (health check, then one
  existence query; or the whole connection when the tier never connected) brings it back to
  ``ok``. A tier whose master is unreachable at start begins degraded and connects later.
  While ``ok`` the tier asks the master's health check every ``probe_interval_s`` too (bounded
  by that interval), so a master lost while no call flows degrades it within two intervals.
- **No torn block is reported loaded.** A key counts as read only when Mooncake reports its
  full block size for it.

Close the tier before the host pool: ``close()`` waits (up to ``timeout_s``) for calls still
reading or writing the pool, and the tier keeps the pool's memory mapped for as long as one
might (a mapping outlives ``HostPool.close()`` while a reference to it is held).

``mooncake.store`` (PyPI: ``mooncake-transfer-engine-non-cuda`` on CPU hosts, the
``mooncake`` extra) is imported when a tier is built; without it ``RemoteTierError`` says so.
"""

from __future__ import annotations

import concurrent.futures
import logging
import socket
import threading
import urllib.parse
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from transfer.errors import RemoteTierError
from transfer.health import HealthTracker
from transfer.host_pool import HostPool
from transfer.remote import (
    COUNTERS,
    RemoteHealth,
    check_blocks,
    check_slots,
    remote_name,
)

__all__ = ["MooncakeConfig", "MooncakeTier"]

log = logging.getLogger(__name__)

# Mooncake's per-key result codes (``ErrorCode`` in mooncake-store's types.h) that are answers,
# not failures of the store: a full store, an object still being written, an absent object,
# an object already stored.
_NO_AVAILABLE_HANDLE = -200
_REPLICA_IS_NOT_READY = -703
_OBJECT_NOT_FOUND = -704
_OBJECT_ALREADY_EXISTS = -705
_GET_ANSWERS = frozenset({_REPLICA_IS_NOT_READY, _OBJECT_NOT_FOUND})
_PUT_ANSWERS = frozenset({_NO_AVAILABLE_HANDLE, _OBJECT_ALREADY_EXISTS})
# Name the probe asks about: it exists nowhere, the question only has to be answered.
_PROBE_KEY = b"kvoffload-probe"


@dataclass(frozen=True)
class MooncakeConfig:
    """How to reach a Mooncake Store and what this node gives it.

    ``master``: the master's RPC ``host:port``, or with HA masters (``mooncake_master
    --enable_ha``) the etcd that elects them, ``etcd://host:port[;host:port...]``: the client
    follows the leader there. ``metadata_url``: the metadata service, e.g.
    ``http://host:8080/metadata`` (``mooncake_master --enable_http_metadata_server=true``) or,
    with HA masters, ``etcd://host:port[;host:port...]`` (an HTTP metadata server would die
    with the master that runs it).
    ``local_hostname``: the address other nodes reach this node's segment on. ``segment_bytes``:
    memory this node contributes to the shared store (0: a client only). ``replicas``: copies
    of each block, on distinct segments. ``timeout_s`` bounds every call the caller waits for.
    """

    master: str
    metadata_url: str
    local_hostname: str
    protocol: Literal["tcp", "rdma"] = "tcp"
    segment_bytes: int = 1 << 30
    local_buffer_bytes: int = 16 << 20
    replicas: int = 1
    rdma_devices: str = ""
    timeout_s: float = 5.0
    probe_interval_s: float = 1.0
    threads: int = 4

    def __post_init__(self) -> None:
        if self.protocol not in ("tcp", "rdma"):
            raise RemoteTierError(f"protocol must be tcp or rdma, got {self.protocol!r}")
        for problem in (master_problem(self.master), metadata_problem(self.metadata_url)):
            if problem is not None:
                raise RemoteTierError(problem)
        if not self.local_hostname:
            raise RemoteTierError("local_hostname must not be empty")
        for what, value in (
            ("segment_bytes", self.segment_bytes),
            ("local_buffer_bytes", self.local_buffer_bytes),
        ):
            if value < 0:
                raise RemoteTierError(f"{what} must be >= 0, got {value}")
        if self.replicas < 1:
            raise RemoteTierError(f"replicas must be >= 1, got {self.replicas}")
        if self.threads < 1:
            raise RemoteTierError(f"threads must be >= 1, got {self.threads}")
        if not self.timeout_s > 0 or not self.probe_interval_s > 0:
            raise RemoteTierError("timeout_s and probe_interval_s must be > 0")


def master_problem(master: str) -> str | None:
    """Why ``master`` names no master (``MooncakeConfig.master``), or None when it does."""
    found = _endpoints(master)
    if (master.startswith("etcd://") and found) or ("://" not in master and len(found) == 1):
        return None
    return f"master must be HOST:PORT or etcd://HOST:PORT[;HOST:PORT...], got {master!r}"


def metadata_problem(url: str) -> str | None:
    """Why ``url`` names no metadata service (``MooncakeConfig.metadata_url``), or None."""
    if not url.startswith(("http://", "https://", "etcd://", "redis://")):
        return f"metadata_url must be a URL, got {url!r}"
    if not _endpoints(url):
        return f"metadata_url must name HOST:PORT[;HOST:PORT...] after its scheme, got {url!r}"
    return None


def _load_store_module() -> Any:
    try:
        import mooncake.store
    except ImportError as exc:
        raise RemoteTierError(
            "Mooncake is not installed: pip install 'kvoffload[mooncake]' (the "
            "mooncake-transfer-engine-non-cuda wheel; it needs Debian's libibverbs1, "
            f"librdmacm1 and libnuma1): {exc}"
        ) from exc
    return mooncake.store


class MooncakeTier:
    """The remote tier on one Mooncake Store, over ``pool``'s slots, under ``namespace``."""

    def __init__(self, pool: HostPool, namespace: str, config: MooncakeConfig) -> None:
        if not namespace:
            raise RemoteTierError("namespace must not be empty")
        self._module = _load_store_module()
        self._pool = pool
        self._namespace = namespace
        self.config = config
        # Held while Mooncake may still touch the pool: its mapping outlives HostPool.close(),
        # so a call that ends late never writes into unmapped memory.
        self._memory: Any = pool.tensor
        self._base = pool.tensor.data_ptr()
        self._block_bytes = pool.block_bytes
        self._replicate = self._module.ReplicateConfig()
        self._replicate.replica_num = config.replicas
        self._health = HealthTracker("remote tier (mooncake)", COUNTERS, "not connected yet", log)
        self._lock = self._health.lock
        self._idle = threading.Condition(self._lock)
        self._inflight = 0
        self._store: Any = None
        self._executor = concurrent.futures.ThreadPoolExecutor(
            config.threads, thread_name_prefix="mooncake"
        )
        self._probing: concurrent.futures.Future[None] | None = None
        # The first connection is the first probe: a master that is down at start leaves the
        # tier degraded, and the probe thread keeps trying.
        self._health.started(self._probe())
        self._prober = threading.Thread(target=self._probe_loop, name="mooncake-probe", daemon=True)
        self._prober.start()

    # -- the contract ------------------------------------------------------------------------

    @property
    def namespace(self) -> str:
        return self._namespace

    def exists(self, keys: Sequence[bytes], timeout_s: float | None = None) -> list[bool | None]:
        """One ``batch_is_exist`` for ``keys``: True / False as the master answered, None for a
        key it answered an error for and for every key when the call fails or is skipped.
        ``timeout_s``: the caller's own budget (a lookup's), below the tier's: a call not
        started by then never starts, and one not answered by then is no answer (None), not a
        fault of the tier."""
        if not keys:
            return []
        names = [remote_name(self._namespace, k) for k in keys]
        codes = self._call(
            "exists", lambda s: s.batch_is_exist(names), (), len(keys), budget_s=timeout_s
        )
        if codes is None:
            return [None] * len(keys)
        found: list[bool | None] = [c == 1 if c in (0, 1) else None for c in codes]
        errors = [c for c in codes if c not in (0, 1)]
        self._health.count(exists_calls=1, hits=codes.count(1), misses=codes.count(0))
        self._judge("exists", len(errors), len(codes), errors)
        return found

    def get_into(self, keys: Sequence[bytes], slots: Sequence[int]) -> list[bool]:
        """One ``batch_get_into`` straight into the slots; True where the full block was read."""
        check_slots(keys, slots, self._pool.num_blocks)
        if not keys:
            return []
        names, ptrs, sizes = self._addresses(keys, slots)

        def get(store: Any) -> list[int]:
            return list(store.batch_get_into(names, ptrs, sizes))

        codes = self._call("get", get, slots, len(keys))
        if codes is None:
            self._health.count(get_failures=len(keys))
            return [False] * len(keys)
        read = [c == self._block_bytes for c in codes]
        bad = [c for c, ok in zip(codes, read, strict=True) if not ok and c not in _GET_ANSWERS]
        self._health.count(
            gets=sum(read),
            get_failures=len(read) - sum(read),
            bytes_read=sum(read) * self._block_bytes,
        )
        self._judge("get", len(bad), len(codes), bad)
        return read

    def put_from(self, keys: Sequence[bytes], slots: Sequence[int]) -> list[bool]:
        """One ``batch_put_from`` out of the slots, with the configured replica count."""
        check_slots(keys, slots, self._pool.num_blocks)
        if not keys:
            return []
        names, ptrs, sizes = self._addresses(keys, slots)
        cfg = self._replicate

        def put(store: Any) -> list[int]:
            return list(store.batch_put_from(names, ptrs, sizes, cfg))

        return self._stored(self._call("put", put, slots, len(keys)), len(keys))

    def put_bytes(self, keys: Sequence[bytes], blocks: Sequence[bytes]) -> list[bool]:
        """``put_from`` for blocks staged outside the pool: one ``put`` a key, through the
        client's local buffer (staged bytes are not registered memory)."""
        check_blocks(keys, blocks, self._block_bytes)
        if not keys:
            return []
        names = [remote_name(self._namespace, k) for k in keys]
        cfg = self._replicate

        def put(store: Any) -> list[int]:
            return [store.put(name, block, cfg) for name, block in zip(names, blocks, strict=True)]

        return self._stored(self._call("put", put, [], len(keys)), len(keys))

    def _stored(self, codes: list[int] | None, n: int) -> list[bool]:
        """Per key of a put, whether the store holds it now, from the call's codes (None: the
        call failed); counted, and judged for the tier's health."""
        if codes is None:
            self._health.count(put_failures=n)
            return [False] * n
        stored = [c in (0, _OBJECT_ALREADY_EXISTS) for c in codes]
        bad = [c for c, ok in zip(codes, stored, strict=True) if not ok and c not in _PUT_ANSWERS]
        self._health.count(
            puts=sum(stored),
            put_failures=len(stored) - sum(stored),
            bytes_written=codes.count(0) * self._block_bytes,
        )
        self._judge("put", len(bad), len(codes), bad)
        return stored

    def _addresses(
        self, keys: Sequence[bytes], slots: Sequence[int]
    ) -> tuple[list[str], list[int], list[int]]:
        """Remote names, pool addresses and sizes of ``keys`` in ``slots`` (a batch call's
        arguments)."""
        names = [remote_name(self._namespace, k) for k in keys]
        ptrs = [self._base + slot * self._block_bytes for slot in slots]
        return names, ptrs, [self._block_bytes] * len(keys)

    def health(self) -> RemoteHealth:
        return self._health.snapshot()

    def held_slots(self) -> frozenset[int]:
        return self._health.held_slots()

    def close(self) -> None:
        """Stop probing, wait for calls in flight (up to ``timeout_s``), close the client.

        A client that still has calls in flight, or cannot reach its master (Mooncake's
        teardown would hold the interpreter lock while it retries), is left open rather than
        torn down under them; the pool's memory then stays mapped until the process ends.
        """
        if not self._health.close():
            return
        self._prober.join(self.config.timeout_s)
        with self._idle:
            settled = self._idle.wait_for(lambda: self._inflight == 0, self.config.timeout_s)
            store, self._store = self._store, None
        if store is not None and not settled:
            log.warning("remote tier (mooncake) closed with calls in flight: client left open")
        elif store is not None and self._health.state != "ok":
            log.warning("remote tier (mooncake) closed while degraded: client left open")
        elif store is not None:
            base = self._base

            def teardown() -> None:
                store.unregister_buffer(base)
                store.close()

            try:
                self._executor.submit(teardown).result(self.config.timeout_s)
            except Exception as exc:  # a hung or failing teardown must not stop shutdown
                log.warning("mooncake client did not close cleanly: %r", exc)
        if settled:
            self._memory = None
        self._executor.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> MooncakeTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"MooncakeTier(namespace={self._namespace!r}, master={self.config.master}, "
            f"state={self._health.state})"
        )

    # -- machinery ---------------------------------------------------------------------------

    def _call(
        self,
        what: str,
        fn: Callable[[Any], list[int]],
        slots: Sequence[int],
        n: int,
        *,
        budget_s: float | None = None,
    ) -> list[int] | None:
        """Run ``fn(store)`` on the tier's threads, waiting at most ``timeout_s`` (or the
        caller's ``budget_s``, if shorter): its ``n`` per-key result codes.

        ``None`` when skipped (degraded, closed), failed, timed out, or answered with a number
        of results other than ``n``; the slots stay held until ``fn`` has returned, whenever
        that is. A call still queued when the wait ends is cancelled (it never starts) and is
        not counted against the tier; one that started and outlives the caller's budget is
        waited for up to the tier's own ``timeout_s`` (its caller already answered None) and
        counted as a timeout or error like any other call.
        """
        wait_s = self.config.timeout_s
        if budget_s is not None and budget_s < wait_s:
            wait_s = max(0.0, budget_s)
        else:
            budget_s = None
        with self._lock:
            store = self._store
            if self._health.closed or self._health.state != "ok" or store is None:
                self._health.counters["skipped"] += 1
                return None
            self._health.held.update(slots)
            self._inflight += 1

        def task() -> list[int]:
            try:
                return fn(store)
            finally:
                self._release(slots)

        try:
            future = self._executor.submit(task)
        except RuntimeError:  # shut down by close() in the meantime
            self._release(slots)
            self._health.count(skipped=1)
            return None
        try:
            try:
                codes = list(future.result(wait_s))
            except concurrent.futures.TimeoutError:
                if budget_s is None or future.cancel():
                    raise
                # Started, and only the caller's time is up: the caller has its answer (none),
                # but a call that outlives the tier's own timeout is the tier's fault, as
                # without a budget. Waited for here, on the caller's (lookup lane's) thread.
                future.result(max(0.0, self.config.timeout_s - wait_s))
                return None
            if len(codes) == n:
                return codes
            self._health.count(errors=1)
            self._health.fail(f"{what}: {len(codes)} results for {n} keys")
        except concurrent.futures.TimeoutError:
            if future.cancel():  # still queued behind hung calls: it never touched the slots
                self._release(slots)
                if budget_s is not None:  # it never started: the caller's time is up
                    return None
            self._health.count(timeouts=1)
            self._health.fail(f"{what} did not finish within {self.config.timeout_s:g} s")
        except Exception as exc:
            self._health.count(errors=1)
            self._health.fail(f"{what} raised {type(exc).__name__}: {exc}")
        return None

    def _release(self, slots: Sequence[int]) -> None:
        self._health.release(slots)
        with self._idle:
            self._inflight -= 1
            self._idle.notify_all()

    def _judge(self, what: str, bad: int, total: int, codes: list[int]) -> None:
        """Count a call's per-key errors; every key failing with one degrades the tier."""
        self._health.judge(what, bad, total, f"codes {sorted(set(codes))}")

    def _probe_loop(self) -> None:
        interval = self.config.probe_interval_s
        while True:
            closed, state = self._health.next_look(interval)  # woken: look again at once
            if closed:
                return
            if state == "ok":
                # Ok: the master's health check every interval, bounded by it, so a master
                # lost while no call flows degrades the tier within two intervals.
                if not self._probe(full=False, within=interval):
                    self._health.fail(f"master health check failed: {self._health.last_error}")
            elif self._probe():  # degraded: the whole probe now and then until it answers
                self._health.recovered()

    def _probe(self, *, full: bool = True, within: float | None = None) -> bool:
        """Connect if never connected; else ask the master for its health and (``full``) one
        key; within ``within`` seconds (default: ``timeout_s``)."""

        def probe() -> None:
            if self._store is None:
                store = self._connect()
                with self._lock:
                    self._store = store
                return
            rc = self._store.health_check()
            if rc != 0:
                raise RemoteTierError(f"health check answered {rc}")
            if not full:
                return
            codes = self._store.batch_is_exist([remote_name(self._namespace, _PROBE_KEY)])
            if list(codes) != [0]:
                raise RemoteTierError(f"existence query answered {list(codes)}")

        # One probe at a time: a connection attempt still hanging must not be joined by a
        # second one (two clients, one leaked).
        if self._probing is not None and not self._probing.done():
            self._health.note("the previous probe has not finished")
            return False
        limit = self.config.timeout_s if within is None else min(within, self.config.timeout_s)
        try:
            self._probing = self._executor.submit(probe)
            self._probing.result(limit)
        except concurrent.futures.TimeoutError:
            self._health.note(f"probe did not finish within {limit:g} s")
            return False
        except Exception as exc:
            self._health.note(f"probe: {exc}")
            return False
        return True

    def _connect(self) -> Any:
        """A set-up client with the pool registered; raises ``RemoteTierError`` otherwise."""
        cfg = self.config
        # Mooncake's setup holds the interpreter lock while it retries an absent master (about
        # 20 tries over 90 s were seen), which no timeout on this side can interrupt: it is
        # called only once the master and the metadata server accept connections.
        for what, address in (("master", cfg.master), ("metadata server", cfg.metadata_url)):
            _check_reachable(what, _endpoints(address) or [address], min(cfg.timeout_s, 2.0))
        store = self._module.MooncakeDistributedStore()
        rc = store.setup(
            cfg.local_hostname,
            cfg.metadata_url,
            cfg.segment_bytes,
            cfg.local_buffer_bytes,
            cfg.protocol,
            cfg.rdma_devices,
            cfg.master,
        )
        if rc != 0:
            store.close()
            raise RemoteTierError(f"setup with master {cfg.master} answered {rc}")
        rc = store.register_buffer(self._base, self._pool.total_bytes)
        if rc != 0:
            store.close()
            raise RemoteTierError(f"registering the host pool answered {rc}")
        return store


def _endpoints(address: str) -> list[str]:
    """The ``host:port`` endpoints an address names: itself (``host:port``), each of an
    ``etcd://h:p[;h:p...]`` list (``redis://`` alike), or an HTTP(S) URL's server; [] when it
    names none."""
    if address.startswith(("http://", "https://")):
        parts = urllib.parse.urlsplit(address)
        if parts.hostname is None:
            return []
        port = parts.port or (443 if parts.scheme == "https" else 80)
        host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
        return [f"{host}:{port}"]
    _, sep, rest = address.partition("://")
    found = (rest.split("/", 1)[0] if sep else address).split(";")
    for one in found:
        host, colon, digits = one.rpartition(":")
        if not colon or not host or not digits.isdigit():
            return []
    return found


def _check_reachable(what: str, endpoints: Sequence[str], timeout_s: float) -> None:
    """Raise ``RemoteTierError`` unless a TCP connection to one of ``endpoints`` opens in
    time (an etcd cluster answers on any of its members)."""
    errors = []
    for address in endpoints:
        host, _, port = address.rpartition(":")
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout_s):
                return
        except (OSError, ValueError) as exc:
            errors.append(f"{address}: {exc}")
    raise RemoteTierError(f"{what} is not reachable ({'; '.join(errors)})")
