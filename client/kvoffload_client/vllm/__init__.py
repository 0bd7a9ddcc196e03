"""kvoffload as a secondary tier of vLLM's tiering offloading connector (vLLM 0.32 and 0.33).

``KVOffloadTier`` is a ``SecondaryTierManager`` that vLLM loads by ``type`` + ``module_path``
(``"type": "KVOffloadTier", "module_path": "kvoffload_client.vllm"``) from
``kv_connector_extra_config["secondary_tiers"]``; several engines on a node then share one
kvoffload service and its host pool. It imports vLLM, httpx, numpy and this distribution only
(never the server's code), so it runs in an engine's environment.

Rooms: ``keys`` (the namespace digest and service keys), ``pool`` (the mapped host pool),
``state`` (what the threads share), ``protocol`` (one batch per step, its answers), ``link``
(the link thread: connection, faults, KV events), ``copier`` (the copy thread), ``tier`` (the
facade vLLM calls), ``compat`` (what differs between the vLLM releases), ``cpu`` (the offloading
spec of a CPU engine, ``CPUTieringOffloadingSpec``: vLLM's tiering with a worker that copies on
the host; loaded by vLLM's ``spec_module_path``, not imported here).

Threads and guarantees:

- **Scheduler thread** (vLLM calls every tier method there, under its manager lock on 0.33;
  0.32 has no lock and no other thread that calls the tier): methods only read
  and write in-memory state and enqueue work; none does I/O or waits. ``lookup`` answers RETRY
  for a key it has not asked the service about yet, then HIT or MISS once the answer is in.
  ``on_schedule_end`` hands the step's work (new requests, lookups, store and load jobs, touches,
  finished requests) to the link thread as one bundle.
- **Link thread**: per bundle (bundles that queued up meanwhile are merged) at most one
  ``POST /v1/batch`` carrying every op of the step, each op under its vLLM ``req_id``: starts
  (with ``kv_transfer_params``), lookups, prepare-store, prepare-load, touches, the
  complete-store / complete-load of copies finished since the last call, and finishes. Every
  call has a connect and a read timeout.
- **Copy thread**: copies between vLLM's primary tier (``primary_kv_view[chunk]``, host memory)
  and the service's host pool, mapped into this process. Stores: prepare-store, copy,
  complete-store. Loads: prepare-load (pins), copy, complete-load. The service never touches the
  engine's memory.

Faults (service down, slow past ``timeout_s``, restarted, answering errors): the step's jobs
fail (``success=False``: a failed load is never reported loaded, and its keys answer MISS from
then on), lookups answer MISS and stores are dropped for ``retry_interval_s`` (doubling while
the fault lasts), counted, and logged once per incident. A refusal of the engine's credentials
(401, 403, or the pool socket's refusal) is such a fault, logged as an error naming the reason.
A request whose prepare ops had an unknown outcome is aborted in the service once none of its
copies is running; a dead engine's leases expire in the service by its lease TTL. A job not
copied by ``job_deadline_s`` fails.

A restarted service serves a new pool: each answer's ``X-KVOffload-Pool`` header (or, for
services without it, the identity of the pool file) is compared with the mapped pool; on a
mismatch that call's store and load jobs fail (their reservations are released in the new
service without a copy), completions meant for the old pool are dropped, and the pool is
mapped again before the next call.

Lower tiers (a service run with ``--disk-dir`` or ``--remote-tier``): a key the service answers
``disk`` or ``remote`` for is asked to be brought into the pool and looked up again like a
pending one (RETRY meanwhile), so a prefix the node's disk holds, or another node stored, becomes
a HIT here. A request's first lookup asks the service to prefetch (``prefetch_deadline_s``,
10 s): in that same call it starts bringing up the keys a tier below holds, and holds them until
the request's load pins them or the deadline passes; counted in ``M_PREFETCHES`` by outcome.
Later answers, a lookup whose prefetch the service did not start (its bound on prefetching
keys), or all with ``prefetch_deadline_s`` 0, are promoted by a prepare-load in the next call,
whose 409 is expected.

Keys: the service key of a vLLM ``OffloadKey`` is an 8-byte namespace digest followed by the key
(see ``namespace_digest``), so engines share blocks exactly when model, dtype, layout and chunk
size agree.

Tenants: with ``token_file`` (else ``$KVOFFLOAD_TOKEN_FILE``; read at start, and again when the
service refuses the token as unknown or revoked, so a rotated token needs no restart) every call
and the pool socket's request carry the token, and with ``service_namespace`` the service-side
namespace (a space of its own in the service: keys, pool, events); the ``namespace`` label above
only separates key digests inside one service namespace.
"""

from __future__ import annotations

from kvoffload_client.attach import MappedPool, map_pool
from kvoffload_client.vllm.keys import namespace_digest, service_key
from kvoffload_client.vllm.state import M_CALLS, M_FAULTS, M_PREFETCHES
from kvoffload_client.vllm.tier import KVOffloadTier

__all__ = [
    "M_CALLS",
    "M_FAULTS",
    "M_PREFETCHES",
    "KVOffloadTier",
    "MappedPool",
    "map_pool",
    "namespace_digest",
    "service_key",
]
