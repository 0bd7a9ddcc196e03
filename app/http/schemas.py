"""Wire models: request bodies and answers of the engine and admin APIs.

Request bodies are strict (no ``false`` taken as ``0``, no ``"1"`` taken as ``1``, unknown fields
refused) and are validated from the raw body with ``TypeAdapter.validate_json`` so keys are
decoded from hex to ``bytes`` inside pydantic-core, without a Python loop. A key is 1..64 bytes,
written as 2..128 hex digits (either case). Answers write keys in lowercase hex.

Answer models document the responses (OpenAPI); the hot routes build their JSON by hand and a
test checks that it validates against these models.

Lists in bodies are ``fail_fast``: validation stops at the first invalid item, so a list of a
million invalid items costs one error, not a million (the message names the first either way).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationInfo,
    WithJsonSchema,
    model_validator,
)

from manager import MAX_KEY_BYTES, available_policies

HEX_KEY_PATTERN = f"^(?:[0-9a-fA-F]{{2}}){{1,{MAX_KEY_BYTES}}}$"
MAX_ID_CHARS = 256
"""Longest ``req_id`` and ``cache_id`` (characters)."""
MAX_WAIT_JOBS = 4096
"""Most job ids in one ``POST /v1/jobs/wait``."""

HexKey = Annotated[
    bytes,
    Field(min_length=1, max_length=MAX_KEY_BYTES),
    WithJsonSchema(
        {
            "type": "string",
            "pattern": HEX_KEY_PATTERN,
            "description": f"block hash: 1..{MAX_KEY_BYTES} bytes as hex",
        }
    ),
]
"""A block key on the wire: hex in, ``bytes`` after validation."""

KeyHex = Annotated[str, Field(pattern="^(?:[0-9a-f]{2})+$", description="block hash, hex")]
"""A block key in an answer (lowercase hex)."""

ReqId = Annotated[
    str,
    StringConstraints(min_length=1, max_length=MAX_ID_CHARS),
    Field(description="engine request id"),
]
BlockIndex = Annotated[int, Field(ge=0, le=2**31 - 1)]
Keys = Annotated[
    list[HexKey], Field(description="block hashes, head of the sequence first", fail_fast=True)
]


LIST_LENGTHS = "list_lengths"
"""Validation context key: the lengths of the lists a body was validated without
(``app.http.steps`` validates long lists apart, in steps)."""


def list_length(body: BaseModel, info: ValidationInfo, name: str) -> int:
    """The length of ``body``'s list ``name``: the one in the validation context when the list
    was left out to be validated apart, else its own (0 when absent)."""
    lengths = info.context.get(LIST_LENGTHS) if isinstance(info.context, dict) else None
    if lengths and name in lengths:
        return int(lengths[name])
    return len(getattr(body, name, None) or ())


class Body(BaseModel):
    """Base of request bodies: strict, closed, hex bytes, immutable."""

    model_config = ConfigDict(
        strict=True, extra="forbid", frozen=True, val_json_bytes="hex", ser_json_bytes="hex"
    )


class Answer(BaseModel):
    """Base of answers."""

    model_config = ConfigDict(extra="forbid")


# --------------------------------------------------------------------------- engine bodies


class StartRequestBody(Body):
    """``PUT /v1/requests/{req_id}``: the engine's opaque per-request parameters, held for the
    request's life: at most ``max_transfer_params_bytes`` as compact JSON (else 413)."""

    kv_transfer_params: dict[str, Any] | None = None


class FinishRequestBody(Body):
    """``DELETE /v1/requests/{req_id}?abort=``: abort releases the request's leases now."""

    abort: bool = False


class KeysBody(Body):
    """A list of block keys (lookup, prepare-load, touch, complete-load, prepare-store)."""

    keys: Keys


class CompleteStoreBody(Body):
    """``complete-store``: the keys whose copy ended, and whether it succeeded."""

    keys: Keys
    success: bool = True


Seconds = Annotated[float, Field(gt=0, allow_inf_nan=False)]
RETENTION_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@-]{0,255}$")
"""What a retention name may be: it is a path segment (``/v1/retentions/{name}``)."""
RETENTION_NAME_ACCEPTED = (
    "letters, digits, '.', '_', ':', '@', '-' (1 to 256, starting with a letter or digit)"
)
RetentionName = Annotated[
    str,
    # Checked by the op (app.http.operations), whose refusal says what is accepted.
    StringConstraints(min_length=1, max_length=MAX_ID_CHARS),
    Field(
        description="retention name (a session id; "
        f"{RETENTION_NAME_ACCEPTED}); default: the request id"
    ),
]


class RetainBody(Body):
    """``retain``: keep the keys in the pool against eviction for ``ttl_s`` seconds, as the
    retention ``name`` (the request id when omitted; a taken name gets the keys it lacks and
    its TTL restarted)."""

    keys: Keys
    ttl_s: Seconds
    name: RetentionName | None = None


class RenewBody(Body):
    """``POST /v1/retentions/{name}/renew``: the new TTL, from now."""

    ttl_s: Seconds


class PrefetchBody(Body):
    """``prefetch``: bring the keys below the pool into it, and hold them (and those the pool
    has) until a load pins them or ``deadline_s`` seconds pass."""

    keys: Keys
    deadline_s: Seconds


class WaitEvent(Body):
    """An interprocess CUDA event the engine recorded after the kernels that wrote (offload)
    or last read (onload) the blocks: ``cudaIpcGetEventHandle`` of an event made with
    ``interprocess=True``, 64 bytes as hex. The copies wait on it; CUDA caches only."""

    kind: Literal["cuda_ipc_event"]
    handle: Annotated[str, Field(pattern="^[0-9a-fA-F]{128}$")]


class TransferBody(Body):
    """``offload`` / ``onload``: move ``keys[i]`` from/to device block ``device_blocks[i]``.

    ``wait_event`` orders the copies after the engine's kernels (a CUDA cache imported over
    IPC: without it a store may copy blocks the engine's forward pass has not finished)."""

    cache_id: Annotated[str, StringConstraints(min_length=1, max_length=MAX_ID_CHARS)]
    keys: Keys
    device_blocks: Annotated[list[BlockIndex], Field(fail_fast=True)]
    wait_event: WaitEvent | None = None

    @model_validator(mode="after")
    def _same_length(self, info: ValidationInfo) -> TransferBody:
        keys, blocks = list_length(self, info, "keys"), list_length(self, info, "device_blocks")
        if keys != blocks:
            raise ValueError(
                f"keys ({keys}) and device_blocks ({blocks}) must have the same length"
            )
        return self


MAX_BLOCK_TOKENS = 4096
"""Most tokens one block may hold (``block_size`` of a store's metadata)."""
TokenId = Annotated[int, Field(ge=0, le=2**32 - 1)]


class StoreMeta(Body):
    """What a store may say of its keys for the routers' KV events (all optional, used only
    with ``--kv-events-endpoint``): ``token_ids``, ``block_size`` tokens per key in key order;
    ``parent_block_hash``, the key before the first one in its sequence (absent: the first
    key starts it)."""

    token_ids: Annotated[list[TokenId], Field(fail_fast=True)] | None = None
    block_size: Annotated[int, Field(ge=1, le=MAX_BLOCK_TOKENS)] | None = None
    parent_block_hash: HexKey | None = None

    @model_validator(mode="after")
    def _tokens_fit(self, info: ValidationInfo) -> StoreMeta:
        size = self.block_size
        if (self.token_ids is None) != (size is None):
            raise ValueError("token_ids and block_size must be given together")
        if size is not None:
            tokens, keys = list_length(self, info, "token_ids"), list_length(self, info, "keys")
            if tokens != size * keys:
                raise ValueError(
                    f"token_ids ({tokens}) must hold block_size ({size}) tokens for each of "
                    f"the {keys} keys"
                )
        return self


class OffloadBody(TransferBody, StoreMeta):
    """``offload``: a ``TransferBody`` that may carry ``StoreMeta``."""


class PrepareStoreBody(KeysBody, StoreMeta):
    """``prepare-store``: keys that may carry ``StoreMeta``."""


class WaitJobsBody(Body):
    """``POST /v1/jobs/wait``: wait until every job has ended, or ``timeout_s`` passed."""

    job_ids: Annotated[
        list[Annotated[int, Field(ge=0)]],
        Field(min_length=1, max_length=MAX_WAIT_JOBS, fail_fast=True),
    ]
    timeout_s: Annotated[float, Field(ge=0, le=3600)] = 10.0


# --------------------------------------------------------------------------- batch


class StartRequestOp(StartRequestBody):
    """Batch op ``start_request`` (``PUT /v1/requests/{req_id}``)."""

    op: Literal["start_request"]
    req_id: ReqId


class FinishRequestOp(FinishRequestBody):
    """Batch op ``finish_request`` (``DELETE /v1/requests/{req_id}``)."""

    op: Literal["finish_request"]
    req_id: ReqId


class LookupBody(KeysBody):
    """``lookup``: the keys, and optionally ``prefetch_deadline_s``: keys a tier below the pool
    holds start coming up now, as a ``prefetch`` of them would (held until a load pins them or
    the deadline passes); the answer's ``prefetch_id`` names it."""

    prefetch_deadline_s: Seconds | None = None


class LookupOp(LookupBody):
    """Batch op ``lookup``."""

    op: Literal["lookup"]
    req_id: ReqId


class PrepareLoadOp(KeysBody):
    """Batch op ``prepare_load``."""

    op: Literal["prepare_load"]
    req_id: ReqId


class TouchOp(KeysBody):
    """Batch op ``touch``."""

    op: Literal["touch"]
    req_id: ReqId


class CompleteLoadOp(KeysBody):
    """Batch op ``complete_load``."""

    op: Literal["complete_load"]
    req_id: ReqId


class PrepareStoreOp(PrepareStoreBody):
    """Batch op ``prepare_store``."""

    op: Literal["prepare_store"]
    req_id: ReqId


class CompleteStoreOp(CompleteStoreBody):
    """Batch op ``complete_store``."""

    op: Literal["complete_store"]
    req_id: ReqId


class OffloadOp(OffloadBody):
    """Batch op ``offload``."""

    op: Literal["offload"]
    req_id: ReqId


class OnloadOp(TransferBody):
    """Batch op ``onload``."""

    op: Literal["onload"]
    req_id: ReqId


class RetainOp(RetainBody):
    """Batch op ``retain``."""

    op: Literal["retain"]
    req_id: ReqId


class PrefetchOp(PrefetchBody):
    """Batch op ``prefetch``."""

    op: Literal["prefetch"]
    req_id: ReqId


class DemoteOp(KeysBody):
    """Batch op ``demote``."""

    op: Literal["demote"]
    req_id: ReqId


class DropOp(KeysBody):
    """Batch op ``drop``."""

    op: Literal["drop"]
    req_id: ReqId


BatchOp = Annotated[
    StartRequestOp
    | FinishRequestOp
    | LookupOp
    | PrepareLoadOp
    | TouchOp
    | CompleteLoadOp
    | PrepareStoreOp
    | CompleteStoreOp
    | OffloadOp
    | OnloadOp
    | RetainOp
    | PrefetchOp
    | DemoteOp
    | DropOp,
    Field(discriminator="op"),
]


class BatchBody(Body):
    """``POST /v1/batch``: ops validated together, then run in order, each answering alone."""

    ops: Annotated[list[BatchOp], Field(min_length=1, fail_fast=True)]


# --------------------------------------------------------------------------- engine answers


class StartRequestAnswer(Answer):
    """The request is live; ``created`` is false when it already was (its lease renewed)."""

    req_id: str
    created: bool


class FinishRequestAnswer(Answer):
    """Leases released by the finish (non-zero only for an abort)."""

    req_id: str
    pins_released: int
    stores_dropped: int


class LookupAnswer(Answer):
    """Per-key state and the count of leading hits (pool hits only): ``hit``, ``pending``,
    ``miss``, or the name of the first tier below the pool that holds the key (the tiers the
    service runs, in its ``--tiers`` order: ``disk``, ``remote``, ...). An onload of such keys
    brings them in and loads them in one job; a prepare-load answers 409 and brings them in
    (pending, then hit)."""

    results: list[
        Annotated[
            str,
            Field(
                pattern=r"^[a-z][a-z0-9_]{0,15}$",
                examples=["hit", "pending", "miss", "disk", "remote"],
            ),
        ]
    ]
    hit_prefix: int
    prefetch_id: int | None = Field(
        default=None,
        description="with prefetch_deadline_s, when keys below the pool started coming up: the "
        "prefetch (GET /v1/prefetches/{id}); absent otherwise",
    )


class SlotsAnswer(Answer):
    """Host-pool slots of the pinned keys, in order."""

    slots: list[int]


class EmptyAnswer(Answer):
    """Nothing to report."""


class PrepareStoreAnswer(Answer):
    """Copy ``keys_to_store[i]`` into host slot ``slots[i]``, then call ``complete-store``.

    Offered keys that were already resident appear in no list; ``skipped_keys`` were not
    admitted by the reuse filter; ``evicted_keys`` were dropped to make room.
    """

    keys_to_store: list[KeyHex]
    slots: list[int]
    evicted_keys: list[KeyHex]
    skipped_keys: list[KeyHex]


class CompleteStoreAnswer(Answer):
    """Per-key outcome: became ready, dropped (failed store), or not a store in flight."""

    completed: list[KeyHex]
    dropped: list[KeyHex]
    ignored: list[KeyHex]


JobState = Literal["running", "done", "failed"]


class OffloadAnswer(Answer):
    """The store job that moves ``keys_to_store`` (``job_id`` null: nothing to move)."""

    job_id: int | None
    state: JobState
    keys_to_store: list[KeyHex]
    evicted_keys: list[KeyHex]
    skipped_keys: list[KeyHex]


class OnloadAnswer(Answer):
    """The load job that copies the keys into the device blocks."""

    job_id: int | None
    state: JobState
    slots: list[int]


class JobAnswer(Answer):
    """One transfer job."""

    job_id: int
    req_id: str
    direction: Literal["store", "load"]
    cache_id: str
    num_keys: int
    state: JobState
    bytes: int
    seconds: float
    reason: str | None


class WaitJobsAnswer(Answer):
    """The jobs, in the order asked; ``done`` is true when none is running."""

    jobs: list[JobAnswer]
    done: bool


QuotaName = Literal[
    "blocks", "pins", "requests", "retained_blocks", "retentions", "retention_keys", "prefetch_keys"
]


class RetentionAnswer(Answer):
    """One retention: how many keys it names and how many of them are ready in the pool."""

    name: str
    keys: int
    in_pool: int
    ttl_s: float
    expires_in_s: float
    age_s: float


class RetainAnswer(RetentionAnswer):
    """What ``retain`` did: the retention, the keys this call added, each key's state when
    retained (``hit``, ``pending``, or the tier below it is promoted from) and how many are
    on their way up."""

    created: bool
    added: int
    results: list[str]
    promoting: int


class RetentionsAnswer(Answer):
    """The namespace's live retentions, oldest first, and its bound."""

    retentions: list[RetentionAnswer]
    retained_blocks: int
    max_retained_blocks: int


class PrefetchAnswer(Answer):
    """A prefetch: its id (to wait on or cancel), its state, each key's state when it started
    (``hit``: in the pool, held; ``pending``: a store in flight, not held; the tier below it
    is promoted from; ``miss``: held nowhere; ``refused``: no room to bring it up) and its
    counts (``used``, ``wasted``, ``failed`` as keys end)."""

    prefetch_id: int
    req_id: str
    state: Literal["promoting", "held", "done", "cancelled"]
    results: list[str] | None = None
    deadline_in_s: float
    counts: dict[str, int]


class HintAnswer(Answer):
    """What ``demote`` or ``drop`` moved, and why the other keys stayed, counted."""

    moved: list[KeyHex] = Field(
        description="the keys moved; for demote, only blocks a tier below holds or takes"
    )
    kept: dict[str, int] = Field(
        description="pinned, retained, pending, not_in_pool; for demote also refused (no tier "
        "below holds or takes the block: it stays in the pool)"
    )


class OpError(Answer):
    """Why one batch op failed."""

    code: str
    message: str
    quota: QuotaName | None = Field(
        default=None, description="with quota_exceeded: the quota that refused the op"
    )


class OpResult(Answer):
    """One op's answer: ``result`` when ``ok``, else ``error``; ``status`` as if called alone."""

    ok: bool
    status: int
    result: dict[str, Any] | None = None
    error: OpError | None = None


class BatchAnswer(Answer):
    """One result per op, in order."""

    results: list[OpResult]


class KVEventAnswer(Answer):
    """A KV event (vLLM shape): blocks stored, removed, or everything cleared."""

    seq: int
    type: Literal["BlockStored", "BlockRemoved", "AllBlocksCleared"]
    block_hashes: list[KeyHex]
    medium: str


class EventsAnswer(Answer):
    """Events with ``seq > after``, oldest first.

    ``fell_behind`` is true when events after ``after`` were dropped before this call (the
    buffer is bounded) or when ``after`` is ahead of the service (it restarted): resync from
    ``GET /v1/pool`` and the admin stats, then continue from ``next_after``. ``instance`` changes
    when the service restarts.
    """

    events: list[KVEventAnswer]
    next_after: int
    latest_seq: int
    fell_behind: bool
    instance: str


class TensorHandle(BaseModel):
    """Where a tensor's memory is: ``{"kind": "shm", "path"}`` or ``{"kind": "cuda_ipc", ...}``."""

    model_config = ConfigDict(strict=True, extra="allow")
    kind: Literal["shm", "cuda_ipc"]


class TensorSpecBody(BaseModel):
    """One KV tensor: its shape, dtype, which dimension indexes blocks, and its memory."""

    model_config = ConfigDict(strict=True, extra="forbid")
    shape: Annotated[
        list[Annotated[int, Field(ge=1)]], Field(min_length=1, max_length=16, fail_fast=True)
    ]
    dtype: Annotated[str, StringConstraints(min_length=1, max_length=32)]
    block_dim: Annotated[int, Field(ge=0, le=15)]
    handle: TensorHandle
    device: Annotated[str, StringConstraints(min_length=1, max_length=32)] | None = None
    device_uuid: Annotated[str, StringConstraints(min_length=1, max_length=64)] | None = None


class KVCacheBody(BaseModel):
    """``POST /v1/kv-caches``: a device KV cache; one block's bytes over all tensors must equal
    the pool's ``block_bytes``."""

    model_config = ConfigDict(strict=True, extra="forbid")
    name: Annotated[str, StringConstraints(min_length=1, max_length=256)]
    device: Annotated[str, StringConstraints(min_length=1, max_length=32)]
    tensors: Annotated[list[TensorSpecBody], Field(min_length=1, max_length=4096, fail_fast=True)]
    device_uuid: (
        Annotated[
            str,
            StringConstraints(min_length=1, max_length=64),
            Field(description="the GPU's UUID (nvidia-smi -L); preferred to a cuda:N device"),
        ]
        | None
    ) = None
    lease_s: (
        Annotated[
            float,
            Field(
                gt=0,
                le=86400,
                description="forget the cache (and close its mappings) unless renewed within this",
            ),
        ]
        | None
    ) = None


class KVCacheAnswer(Answer):
    """A registered device KV cache."""

    cache_id: str
    name: str
    block_bytes: int
    num_blocks: int
    device: str


class KVCacheRenewAnswer(Answer):
    """A renewed lease: good for ``lease_s`` seconds from now (0: the cache has no lease)."""

    cache_id: str
    lease_s: float


class KVCacheListAnswer(Answer):
    """Every registered device KV cache."""

    kv_caches: list[KVCacheAnswer]


class PoolAnswer(Answer):
    """The host pool, to map it from an engine.

    ``path`` opens only on the service's host for its user (``/proc/<pid>/fd/<n>``); from
    another container receive the pool's descriptor on the pool socket (``app.pool_share``).
    ``pool_id`` is new for every pool: compare it with the ``X-KVOffload-Pool`` header that
    every answer carries to notice a restarted service.
    """

    path: str
    num_blocks: int
    block_bytes: int
    pinned: bool
    max_keys_per_call: int
    pool_id: str


class HealthAnswer(Answer):
    """Liveness or readiness; ``reason`` says why not ready."""

    status: Literal["ok", "ready", "not_ready"]
    reason: str | None = None
    details: dict[str, str] | None = Field(
        default=None,
        description="what a ready service still wants known (a degraded remote tier: serving "
        "from the pool alone)",
    )


# --------------------------------------------------------------------------- admin


def _policy_names(schema: dict[str, Any]) -> None:
    # Read when the spec is generated, so policies registered after import are listed.
    schema["enum"] = available_policies()


class PolicyBody(BaseModel):
    """``PUT /admin/v1/policy``: switch to policy ``name`` with ``params``."""

    model_config = ConfigDict(strict=True, extra="forbid")
    name: Annotated[
        str, StringConstraints(min_length=1, max_length=64), Field(json_schema_extra=_policy_names)
    ]
    params: dict[str, Any] = Field(default_factory=dict)


class PolicyAnswer(Answer):
    """The active policy; ``generation`` (also the ETag) grows on every effective switch."""

    name: str
    params: dict[str, Any]
    generation: int
    available: list[str]


class PolicyRef(Answer):
    """A policy and its generation."""

    name: str
    params: dict[str, Any]
    generation: int


class PolicySwitchAnswer(Answer):
    """Result of a switch; ``changed`` is false for a same-policy, same-params PUT."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, serialize_by_alias=True)
    from_: PolicyRef = Field(alias="from")
    to: PolicyRef
    blocks_migrated: int
    changed: bool


class BlockCounts(Answer):
    """Pool blocks by state: ``free + pending + ready == num_blocks``; pinned ⊆ ready."""

    num_blocks: int
    free: int
    pending: int
    ready: int
    pinned: int


class JobsStats(Answer):
    """Transfer jobs now."""

    running: int
    oldest_running_age_s: float | None


class EventsStats(Answer):
    """The KV event buffer."""

    latest_seq: int
    buffered: int
    dropped: int


class StatsAnswer(Answer):
    """Service statistics: blocks, hit ratio, requests, counters, jobs, events."""

    blocks: BlockCounts
    hit_ratio: float | None
    live_requests: int
    policy: PolicyRef
    counters: dict[str, int]
    breakdowns: dict[str, dict[str, int]] = Field(
        description="counters split by a label (e.g. evictions by policy)"
    )
    jobs: JobsStats
    events: EventsStats
    kv_caches: int
    tiers: dict[str, dict[str, Any]] = Field(
        description="each tier below the pool by name, in the chain's order (empty: none). "
        "Every tier says its state (ok or degraded), since when and its last error; the disk "
        "tier adds counters, blocks and slots, demotions (written, refused, dropped by "
        "reason), evictions, promotions and corrupt blocks dropped; the remote tier adds "
        "counters, its write-behind queue, promotions and the blocks it tracks for removal"
    )
    control: dict[str, Any] = Field(
        description="cache control: retentions, retained blocks (in the pool and in all) and "
        "their bound, live prefetches and the keys they promote or hold, and counts"
    )


class RequestLeasesAnswer(Answer):
    """One tracked request: pin counts per key and keys whose store it has in flight."""

    req_id: str
    pins: dict[str, int]
    pending_stores: list[KeyHex]
    idle_seconds: float
    orphaned_reservations: list[KeyHex] = Field(
        default_factory=list,
        description="stores dropped by an abort (among pending_stores) whose slot stays "
        "reserved until the writer reports or abort_writer_deadline_s passes",
    )
    orphaned_seconds: float | None = Field(
        default=None, description="seconds since those stores were dropped (null: none)"
    )


class RequestsAnswer(Answer):
    """Tracked requests (live, or finished with leases); ``total`` counts all of them."""

    requests: list[RequestLeasesAnswer]
    total: int


class ReleaseAnswer(Answer):
    """Leases force-released from one request."""

    req_id: str
    pins_released: int
    stores_dropped: int


class ClearAnswer(Answer):
    """``cache/clear``: blocks dropped, and blocks kept because a transfer holds them."""

    dropped: int
    kept_pinned: int
    kept_pending: int
    kept_retained: int = Field(description="ready blocks kept because a retention names them")


class NamespaceUse(Answer):
    """One namespace (its own pool): blocks by state, requests, hit ratio, refusals."""

    namespace: str
    num_blocks: int
    free: int
    ready: int
    pending: int
    pinned: int
    live_requests: int
    hit_ratio: float | None
    stores_refused: int = Field(description="stores refused: no evictable room (blocks quota)")
    evictions: int


class TenantUse(Answer):
    """One tenant: its quotas (null: none), what it holds now, and its namespaces."""

    tenant: str | None = Field(description="null: the service has no tenants")
    max_pins: int | None
    max_requests: int | None
    pins: int = Field(description="blocks pinned now, over its namespaces")
    requests: int = Field(description="requests tracked now, over its namespaces")
    blocks: int = Field(description="its namespaces' pool blocks: its block quota")
    namespaces: list[NamespaceUse]


class TenantsAnswer(Answer):
    """Every tenant and namespace; ``reloads`` / ``reload_failures`` of the tenants file."""

    enabled: bool = Field(description="engine calls need credentials (a tenants file is loaded)")
    reloads: int
    reload_failures: int
    tenants: list[TenantUse]
