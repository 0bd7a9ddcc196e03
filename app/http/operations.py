"""The request-scoped engine operations, one table shared by the single routes and the batch.

Each ``Operation`` names an op (``lookup``, ``offload``, ...: the word a batch op carries and the
``op`` label the observability layer uses), its body model, its answer model and the statuses it
can fail with, and ``run(service, req_id, body) -> (status, json_text)``. ``run`` is synchronous:
the manager calls of one op happen with no ``await`` in between.

Answers are encoded here, by hand for the hot ones (``lookup``), with ``json.dumps`` otherwise;
``tests/api`` checks every encoder against the answer models that document it.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any

from app.core.cache_hints import DEMOTE_STEP_KEYS
from app.core.control import PREFETCH_COUNTS, Hinted, Prefetch
from app.core.observed import STEP_KEYS, Bringing
from app.core.service import Service
from app.core.slices import Slices, StepRunner, all_at_once, stepper
from app.http import schemas as s
from app.http.errors import APIError, too_many
from app.http.limits import transfer_params_error
from manager import BlockKey, LookupResult, ReqContext, RetentionInfo
from transfer import JobRecord

Run = Callable[[Service, str, Any], tuple[int, str]]
RunAsync = Callable[[Service, str, Any], Awaitable[tuple[int, str]]]
RunSteps = Callable[[Service, str, Any], Generator[None, None, tuple[int, str]]]
RunSliced = Callable[[Service, str, Any, Slices], Awaitable[tuple[int, str]]]


@dataclass(frozen=True, slots=True)
class Operation:
    """One engine operation; see the module docstring."""

    name: str
    method: str
    path: str
    body: type[s.Body]
    answer: type[s.Answer]
    status: int
    errors: tuple[int, ...]
    summary: str
    # None: the op always awaits (``run_tiers``), tiers below the pool or not.
    run: Run | None
    # Other success statuses, with what they mean (documented next to ``status``).
    other_ok: tuple[tuple[int, str], ...] = ()
    # Run in place of ``run`` when the service has tiers below the pool (it awaits them).
    run_tiers: RunAsync | None = None
    # ``run`` in steps (``app.http.steps``), for a call of more than ``steps_above`` keys
    # (None: ``STEP_KEYS``).
    run_steps: RunSteps | None = None
    steps_above: int | None = None
    # ``run_tiers`` in steps, for an op that awaits the tiers between its steps: it drives its
    # steps with ``slices`` itself.
    run_sliced: RunSliced | None = None

    def steps(self, body: Any) -> bool:
        """Whether a call with ``body`` runs in steps (``in_steps``)."""
        above = STEP_KEYS if self.steps_above is None else self.steps_above
        in_steps = self.run_steps is not None or self.run_sliced is not None
        return in_steps and len(body.keys) > above

    async def in_steps(
        self, service: Service, req_id: str, body: Any, slices: Slices
    ) -> tuple[int, str]:
        """``run_steps`` (or ``run_sliced``), giving way between its steps, the namespace's
        manager suspended meanwhile (``app.core.slices``)."""
        if self.run_sliced is not None:
            return await self.run_sliced(service, req_id, body, slices)
        assert self.run_steps is not None
        return await slices.run(self.run_steps(service, req_id, body), service.pool_manager)

    def sync_run(self, tiers: bool) -> Run | None:
        """``run`` when the op runs in one synchronous step on a service with (``tiers``) or
        without tiers below the pool; None when it must be awaited (``call``)."""
        if self.run is not None and (self.run_tiers is None or not tiers):
            return self.run
        return None

    async def call(self, service: Service, req_id: str, body: Any) -> tuple[int, str]:
        """Run the op on ``service``, awaited when it has to be."""
        run = self.sync_run(bool(service.tiers))
        if run is not None:
            return run(service, req_id, body)
        assert self.run_tiers is not None
        return await self.run_tiers(service, req_id, body)


def hex_list(keys: Sequence[BlockKey]) -> str:
    """JSON array of lowercase hex keys."""
    # Hex digits need no escaping: joined, not ``json.dumps`` (0.6x the time for 8,192 keys).
    return '["' + '","'.join(map(bytes.hex, keys)) + '"]' if keys else "[]"


def hex_list_steps(keys: Sequence[BlockKey]) -> Generator[None, None, str]:
    """``hex_list`` in steps of ``STEP_KEYS`` keys."""
    if len(keys) <= STEP_KEYS:
        return hex_list(keys)
    return (yield from _plain_list_steps(keys, bytes.hex))


def _plain_list_steps(
    items: Sequence[Any], text: Callable[[Any], str] = str
) -> Generator[None, None, str]:
    """The JSON array of ``items`` as strings that need no escaping (hex digits, a state's
    or tier's name), ``text`` making each one, ``STEP_KEYS`` items a step."""
    pieces = []
    for at in range(0, len(items), STEP_KEYS):
        yield
        pieces.append('","'.join(map(text, items[at : at + STEP_KEYS])))
    return '["' + '","'.join(pieces) + '"]' if pieces else "[]"


def job_json(job: JobRecord) -> dict[str, Any]:
    """The wire form of a job record (``JobAnswer``)."""
    return {
        "job_id": job.job_id,
        "req_id": job.req_id,
        "direction": job.direction,
        "cache_id": job.cache_id,
        "num_keys": len(job.keys),
        "state": job.state,
        "bytes": job.bytes,
        "seconds": job.seconds,
        "reason": job.reason,
    }


def _limit_keys(service: Service, keys: Sequence[BlockKey]) -> None:
    limit = service.settings.max_keys_per_call
    if len(keys) > limit:
        raise too_many("keys", len(keys), limit)


_RESULT_JSON = {
    LookupResult.HIT: '"hit"',
    LookupResult.PENDING: '"pending"',
    LookupResult.MISS: '"miss"',
}
_MISS = LookupResult.MISS


def _run_start(service: Service, req_id: str, body: s.StartRequestBody) -> tuple[int, str]:
    # Checked before the manager sees the request: refused parameters change nothing.
    err = transfer_params_error(body.kv_transfer_params, service.settings.max_transfer_params_bytes)
    if err is not None:
        raise err
    created = service.manager.start_request(req_id, body.kv_transfer_params)
    answer = json.dumps({"req_id": req_id, "created": created})
    return (201 if created else 200), answer


def _run_finish(service: Service, req_id: str, body: s.FinishRequestBody) -> tuple[int, str]:
    released = service.manager.finish_request(req_id, body.abort)
    return 200, json.dumps(
        {
            "req_id": req_id,
            "pins_released": released.pins_released,
            "stores_dropped": released.stores_dropped,
        }
    )


def _run_lookup(service: Service, req_id: str, body: s.LookupBody) -> tuple[int, str]:
    keys = body.keys
    _limit_keys(service, keys)
    if body.prefetch_deadline_s is not None:  # nothing lies below the pool: checked only
        service.control.check_deadline(body.prefetch_deadline_s)
    out = service.manager.lookup(keys, ReqContext(req_id))
    return 200, _lookup_json(out.results, out.hit_prefix)


async def _run_lookup_tiers(service: Service, req_id: str, body: s.LookupBody) -> tuple[int, str]:
    """``lookup`` with tiers below the pool: the keys the pool lacks are asked of the chain
    (each tier about those the tiers before it lack), and named by the first tier that holds
    them; an all-hit lookup asks no tier. With ``prefetch_deadline_s``, the keys a tier holds
    start coming up in the same step (``Control.prefetch_found``)."""
    keys = body.keys
    _limit_keys(service, keys)
    deadline_s = body.prefetch_deadline_s
    if deadline_s is not None:
        service.control.check_deadline(deadline_s)
    out = service.manager.lookup(keys, ReqContext(req_id))
    results: list[LookupResult | str] = list(out.results)
    below: dict[BlockKey, str] = {}
    if out.hit_prefix < len(results):
        misses = [i for i, r in enumerate(results) if r is _MISS]
        if misses:
            found = await service.tiers.found([keys[i] for i in misses], req_id)
            for i, tier in zip(misses, found, strict=True):
                if tier is not None:
                    results[i] = tier
                    below[keys[i]] = tier
    text = _lookup_json(results, out.hit_prefix)
    if deadline_s is not None and below:
        p = service.control.prefetch_found(below, deadline_s, req_id)
        if p is not None:
            text = f'{text[:-1]},"prefetch_id":{p.prefetch_id}}}'
    return 200, text


def _lookup_json(results: Sequence[LookupResult | str], hit_prefix: int) -> str:
    """The lookup answer; ``results`` holds the pool's states and, for keys a lower tier
    holds, that tier's name (a registered name: no JSON escaping needed)."""
    n = len(results)
    # The common answers (all hits, all misses) are built without a per-key loop.
    if hit_prefix == n:
        text = ",".join(['"hit"'] * n)
    elif n and results.count(_MISS) == n:
        text = ",".join(['"miss"'] * n)
    else:
        text = ",".join(
            _RESULT_JSON[r] if isinstance(r, LookupResult) else f'"{r}"' for r in results
        )
    return f'{{"results":[{text}],"hit_prefix":{hit_prefix}}}'


def _run_prepare_load(service: Service, req_id: str, body: s.KeysBody) -> tuple[int, str]:
    _limit_keys(service, body.keys)
    slots = service.manager.load_or_bring_up(body.keys, ReqContext(req_id))
    if isinstance(slots, Bringing):  # the keys the pool lacks are on their way: pending
        raise slots.refusal()
    return 200, f'{{"slots":{json.dumps(slots)}}}'


def _run_touch(service: Service, req_id: str, body: s.KeysBody) -> tuple[int, str]:
    _limit_keys(service, body.keys)
    service.manager.touch(body.keys, ReqContext(req_id))
    return 200, "{}"


def _steps_touch(
    service: Service, req_id: str, body: s.KeysBody
) -> Generator[None, None, tuple[int, str]]:
    _limit_keys(service, body.keys)
    yield from service.manager.touch_steps(body.keys, ReqContext(req_id))
    return 200, "{}"


def _run_complete_load(service: Service, req_id: str, body: s.KeysBody) -> tuple[int, str]:
    _limit_keys(service, body.keys)
    service.manager.complete_load(body.keys, ReqContext(req_id), by_engine=True)
    return 200, "{}"


def _note_blocks(
    service: Service, keys: list[bytes], body: s.StoreMeta, stored: list[bytes]
) -> None:
    service.note_blocks(keys, body.token_ids, body.block_size, body.parent_block_hash, stored)


def _run_prepare_store(service: Service, req_id: str, body: s.PrepareStoreBody) -> tuple[int, str]:
    _limit_keys(service, body.keys)
    out = service.manager.prepare_store(body.keys, ReqContext(req_id))
    _note_blocks(service, body.keys, body, out.keys_to_store)
    return 200, (
        f'{{"keys_to_store":{hex_list(out.keys_to_store)},"slots":{json.dumps(out.slots)},'
        f'"evicted_keys":{hex_list(out.evicted_keys)},'
        f'"skipped_keys":{hex_list(out.skipped_keys)}}}'
    )


def _steps_prepare_store(
    service: Service, req_id: str, body: s.PrepareStoreBody
) -> Generator[None, None, tuple[int, str]]:
    _limit_keys(service, body.keys)
    out = yield from service.manager.prepare_store_steps(body.keys, ReqContext(req_id))
    _note_blocks(service, body.keys, body, out.keys_to_store)
    stored = yield from hex_list_steps(out.keys_to_store)
    yield
    slots = json.dumps(out.slots)
    evicted = yield from hex_list_steps(out.evicted_keys)
    skipped = yield from hex_list_steps(out.skipped_keys)
    return 200, (
        f'{{"keys_to_store":{stored},"slots":{slots},"evicted_keys":{evicted},'
        f'"skipped_keys":{skipped}}}'
    )


def _run_complete_store(
    service: Service, req_id: str, body: s.CompleteStoreBody
) -> tuple[int, str]:
    _limit_keys(service, body.keys)
    out = service.manager.complete_store(
        body.keys, ReqContext(req_id), body.success, by_engine=True
    )
    return 200, (
        f'{{"completed":{hex_list(out.completed)},"dropped":{hex_list(out.dropped)},'
        f'"ignored":{hex_list(out.ignored)}}}'
    )


def _steps_complete_store(
    service: Service, req_id: str, body: s.CompleteStoreBody
) -> Generator[None, None, tuple[int, str]]:
    _limit_keys(service, body.keys)
    ctx = ReqContext(req_id)
    out = yield from service.manager.complete_store_steps(body.keys, ctx, body.success)
    completed = yield from hex_list_steps(out.completed)
    dropped = yield from hex_list_steps(out.dropped)
    ignored = yield from hex_list_steps(out.ignored)
    return 200, f'{{"completed":{completed},"dropped":{dropped},"ignored":{ignored}}}'


def _event(wait_event: s.WaitEvent | None) -> bytes | None:
    return None if wait_event is None else bytes.fromhex(wait_event.handle)


def _run_offload(service: Service, req_id: str, body: s.OffloadBody) -> tuple[int, str]:
    _limit_keys(service, body.keys)
    started = service.transfers().offload(
        req_id, body.cache_id, body.keys, body.device_blocks, _event(body.wait_event)
    )
    job, spec = started.job, started.spec
    _note_blocks(service, body.keys, body, spec.keys_to_store)
    return 202, json.dumps(
        {
            "job_id": None if job is None else job.job_id,
            "state": "done" if job is None else job.state,
            "keys_to_store": [k.hex() for k in spec.keys_to_store],
            "evicted_keys": [k.hex() for k in spec.evicted_keys],
            "skipped_keys": [k.hex() for k in spec.skipped_keys],
        }
    )


def _run_onload(service: Service, req_id: str, body: s.TransferBody) -> tuple[int, str]:
    _limit_keys(service, body.keys)
    started = service.transfers().onload(
        req_id, body.cache_id, body.keys, body.device_blocks, _event(body.wait_event)
    )
    job = started.job
    return 202, json.dumps(
        {
            "job_id": None if job is None else job.job_id,
            "state": "done" if job is None else job.state,
            "slots": started.slots,
        }
    )


def retention_json(info: RetentionInfo) -> dict[str, Any]:
    """The wire form of a retention (``RetentionAnswer``)."""
    return {
        "name": info.name,
        "keys": info.keys,
        "in_pool": info.in_pool,
        "ttl_s": info.ttl_s,
        "expires_in_s": round(info.expires_in_s, 3),
        "age_s": round(info.age_s, 3),
    }


def retentions_json(service: Service) -> dict[str, Any]:
    """The namespace's retentions (``RetentionsAnswer``)."""
    control = service.control
    return {
        "retentions": [retention_json(r) for r in control.retentions()],
        "retained_blocks": service.pool_manager.num_retained,
        "max_retained_blocks": control.max_retained,
    }


def prefetch_json(p: Prefetch, now: float, results: list[str] | None = None) -> dict[str, Any]:
    """The wire form of a prefetch (``PrefetchAnswer``); ``results``: each key's state when it
    started (the starting call's answer)."""
    out: dict[str, Any] = {
        "prefetch_id": p.prefetch_id,
        "req_id": p.req_id,
        "state": p.state,
        "deadline_in_s": round(max(0.0, p.deadline_at - now), 3),
        "counts": {k: p.counts[k] for k in PREFETCH_COUNTS},
    }
    if results is not None:
        out["results"] = results
    return out


async def _run_retain(
    service: Service, req_id: str, body: s.RetainBody, run: StepRunner = all_at_once
) -> tuple[int, str]:
    _limit_keys(service, body.keys)
    name = req_id if body.name is None else body.name
    if not s.RETENTION_NAME.match(name):
        raise APIError(
            422,
            "invalid_field",
            f"name: {name!r:.80} cannot name a retention (GET /v1/retentions/{{name}}); "
            f"accepted: {s.RETENTION_NAME_ACCEPTED}"
            + ("; this request id needs an explicit name" if body.name is None else ""),
        )
    done = await service.control.retain(body.keys, body.ttl_s, name, req_id, run)
    head = json.dumps(
        {
            **retention_json(done.info),
            "created": done.created,
            "added": done.info.added,
            "promoting": done.promoting,
        }
    )
    results = await run(_plain_list_steps(done.results))
    return (201 if done.created else 200), f'{head[:-1]},"results":{results}}}'


async def _sliced_retain(
    service: Service, req_id: str, body: s.RetainBody, slices: Slices
) -> tuple[int, str]:
    return await _run_retain(service, req_id, body, stepper(service.pool_manager, slices))


async def _run_prefetch(service: Service, req_id: str, body: s.PrefetchBody) -> tuple[int, str]:
    _limit_keys(service, body.keys)
    p, results = await service.control.prefetch(body.keys, body.deadline_s, req_id)
    return 202, json.dumps(prefetch_json(p, p.started_at, results))


def _hint_json(done: Hinted) -> str:
    return f'{{"moved":{hex_list(done.done)},"kept":{json.dumps(done.kept)}}}'


def _run_demote(service: Service, req_id: str, body: s.KeysBody) -> tuple[int, str]:
    _limit_keys(service, body.keys)
    return 200, _hint_json(service.control.demote(body.keys, req_id))


def _run_drop(service: Service, req_id: str, body: s.KeysBody) -> tuple[int, str]:
    _limit_keys(service, body.keys)
    return 200, _hint_json(service.control.drop(body.keys, req_id))


def _steps_demote(
    service: Service, req_id: str, body: s.KeysBody
) -> Generator[None, None, tuple[int, str]]:
    _limit_keys(service, body.keys)
    return (yield from _hint_json_steps(service.control.demote_steps(body.keys, req_id)))


def _steps_drop(
    service: Service, req_id: str, body: s.KeysBody
) -> Generator[None, None, tuple[int, str]]:
    _limit_keys(service, body.keys)
    return (yield from _hint_json_steps(service.control.drop_steps(body.keys, req_id)))


def _hint_json_steps(hint: Generator[None, None, Hinted]) -> Generator[None, None, tuple[int, str]]:
    done = yield from hint
    moved = yield from hex_list_steps(done.done)
    return 200, f'{{"moved":{moved},"kept":{json.dumps(done.kept)}}}'


_KEYS_ERRORS = (404, 413)
OPERATIONS: tuple[Operation, ...] = (
    # The hot op first: routes are matched in order.
    Operation(
        "lookup",
        "POST",
        "/v1/requests/{req_id}/lookup",
        s.LookupBody,
        s.LookupAnswer,
        200,
        _KEYS_ERRORS,
        "Per-key state (hit, pending, miss, or the name of the first tier below the pool that "
        "holds it) and the count of leading hits",
        _run_lookup,
        run_tiers=_run_lookup_tiers,
    ),
    Operation(
        "start_request",
        "PUT",
        "/v1/requests/{req_id}",
        s.StartRequestBody,
        s.StartRequestAnswer,
        201,
        (413, 429),
        "Start a request (201), or renew a live one (200); its leases hang on it",
        _run_start,
        ((200, "The request was already live: its leases were renewed"),),
    ),
    Operation(
        "finish_request",
        "DELETE",
        "/v1/requests/{req_id}",
        s.FinishRequestBody,
        s.FinishRequestAnswer,
        200,
        (404,),
        "Finish a request; abort=true releases its pins and pending stores now",
        _run_finish,
    ),
    Operation(
        "prepare_load",
        "POST",
        "/v1/requests/{req_id}/prepare-load",
        s.KeysBody,
        s.SlotsAnswer,
        200,
        (*_KEYS_ERRORS, 409, 429),
        "Pin ready keys for a host->device copy; their host slots (all or nothing)",
        _run_prepare_load,
    ),
    Operation(
        "touch",
        "POST",
        "/v1/requests/{req_id}/touch",
        s.KeysBody,
        s.EmptyAnswer,
        200,
        _KEYS_ERRORS,
        "Mark keys recently used (policy order); unknown keys are ignored",
        _run_touch,
        run_steps=_steps_touch,
    ),
    Operation(
        "complete_load",
        "POST",
        "/v1/requests/{req_id}/complete-load",
        s.KeysBody,
        s.EmptyAnswer,
        200,
        (*_KEYS_ERRORS, 409),
        "Unpin keys pinned by prepare-load (409 and nothing changed if one is not pinned)",
        _run_complete_load,
    ),
    Operation(
        "prepare_store",
        "POST",
        "/v1/requests/{req_id}/prepare-store",
        s.PrepareStoreBody,
        s.PrepareStoreAnswer,
        200,
        (*_KEYS_ERRORS, 507),
        "Reserve host slots for the keys not yet stored, evicting if needed (all or nothing)",
        _run_prepare_store,
        run_steps=_steps_prepare_store,
    ),
    Operation(
        "complete_store",
        "POST",
        "/v1/requests/{req_id}/complete-store",
        s.CompleteStoreBody,
        s.CompleteStoreAnswer,
        200,
        _KEYS_ERRORS,
        "Finish stores: ready on success, dropped on failure; repeats are no-ops",
        _run_complete_store,
        run_steps=_steps_complete_store,
    ),
    Operation(
        "offload",
        "POST",
        "/v1/requests/{req_id}/offload",
        s.OffloadBody,
        s.OffloadAnswer,
        202,
        (*_KEYS_ERRORS, 503, 507),
        "Store device blocks under keys: prepare-store, a device->host job, complete-store",
        _run_offload,
    ),
    Operation(
        "onload",
        "POST",
        "/v1/requests/{req_id}/onload",
        s.TransferBody,
        s.OnloadAnswer,
        202,
        (*_KEYS_ERRORS, 409, 429, 503),
        "Load ready keys into device blocks: prepare-load, a host->device job, complete-load",
        _run_onload,
    ),
    # Cache control: hints from callers that know what comes next. The request need not be
    # started: its id names the call in logs and metrics (and a retention by default).
    Operation(
        "retain",
        "POST",
        "/v1/requests/{req_id}/retain",
        s.RetainBody,
        s.RetainAnswer,
        201,
        (*_KEYS_ERRORS, 429),
        "Keep keys in the pool against eviction for ttl_s, as a named retention (201 new, 200 "
        "extended and renewed); keys below the pool are promoted; keys held nowhere: 404",
        None,
        ((200, "The retention existed: the keys it lacked were added and its TTL restarted"),),
        run_tiers=_run_retain,
        run_sliced=_sliced_retain,
    ),
    Operation(
        "prefetch",
        "POST",
        "/v1/requests/{req_id}/prefetch",
        s.PrefetchBody,
        s.PrefetchAnswer,
        202,
        (*_KEYS_ERRORS, 429),
        "Bring keys below the pool up now and hold them, and those the pool has, until a load "
        "pins them or deadline_s passes; a handle to wait on or cancel",
        None,
        run_tiers=_run_prefetch,
    ),
    Operation(
        "demote",
        "POST",
        "/v1/requests/{req_id}/demote",
        s.KeysBody,
        s.HintAnswer,
        200,
        (*_KEYS_ERRORS, 409),
        "Evict these blocks now into the tiers below (not pinned, retained or pending ones)",
        _run_demote,
        run_steps=_steps_demote,
        steps_above=DEMOTE_STEP_KEYS,
    ),
    Operation(
        "drop",
        "POST",
        "/v1/requests/{req_id}/drop",
        s.KeysBody,
        s.HintAnswer,
        200,
        _KEYS_ERRORS,
        "Remove these blocks from the pool now (not pinned, retained or pending ones)",
        _run_drop,
        run_steps=_steps_drop,
    ),
)

BY_NAME: dict[str, Operation] = {op.name: op for op in OPERATIONS}
