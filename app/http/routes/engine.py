"""Engine API routes (public listener): request-scoped ops, batch, jobs, events, caches, pool.

Routes with a JSON body are ``RawRoute``s: the endpoint reads the raw body and validates it with
the body model's ``validate_json`` (strict, hex keys decoded in pydantic-core), without FastAPI's
per-call parameter machinery. That keeps the hot routes (``lookup``, ``batch``) near the cost of
the framework's own floor, while ``app.http.openapi`` documents the same models.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Awaitable, Callable, Generator
from typing import Annotated, Any

from fastapi import Path, Query, Request
from fastapi.responses import Response
from fastapi.routing import APIRoute

from app.core.events import event_json
from app.core.handles import check_registration
from app.core.slices import Slices, stepper
from app.http import schemas as s
from app.http.deps import service_of, tenancy_of
from app.http.errors import (
    BODY_ERRORS,
    APIError,
    error_for,
    responses,
    too_many,
)
from app.http.limits import batch_exceeds_ops, transfer_params_error
from app.http.middleware import call_info
from app.http.openapi import KVOffloadAPI
from app.http.operations import (
    BY_NAME,
    OPERATIONS,
    Operation,
    job_json,
    prefetch_json,
    retention_json,
    retentions_json,
)
from app.http.routes.raw import RawRoute, body_parser, check_path_param, read_body
from app.http.steps import OpParser, long_lists, value_at
from app.settings import Settings
from app.telemetry.logging import get_logger
from transfer import RegisteredCache

log = get_logger("engine")
JSON = "application/json"
ReqIdPath = Annotated[str, Path(min_length=1, max_length=256, description="engine request id")]
Endpoint = Callable[..., Awaitable[Response]]


def json_response(text: str | bytes, status: int = 200) -> Response:
    """A JSON answer from already-encoded text."""
    return Response(text, status, media_type=JSON)


def _op_endpoint(op: Operation) -> Endpoint:
    parse = body_parser(op.body)
    in_steps = OpParser(op.body).body_steps
    name = op.name

    async def endpoint(request: Request, req_id: ReqIdPath) -> Response:
        info = call_info(request.scope)
        if info is not None:
            info.op = name
            info.req_id = req_id
        check_path_param("req_id", req_id)
        service = service_of(request)
        raw = await read_body(request)
        if len(raw) <= SPLIT_ABOVE_BYTES:
            body = parse(raw)
        else:
            body = await Slices().run(in_steps(raw))
        if op.steps(body):
            status, text = await op.in_steps(service, req_id, body, Slices())
        else:
            status, text = await op.call(service, req_id, body)
        return json_response(text, status)

    return endpoint


def _finish_endpoint(op: Operation) -> Endpoint:
    async def endpoint(
        req_id: ReqIdPath,
        request: Request,
        abort: Annotated[bool, Query(description="release pins and pending stores now")] = False,
    ) -> Response:
        info = call_info(request.scope)
        if info is not None:
            info.op = op.name
            info.req_id = req_id
        status, text = await op.call(service_of(request), req_id, s.FinishRequestBody(abort=abort))
        return json_response(text, status)

    return endpoint


def _add_op_route(app: KVOffloadAPI, op: Operation) -> None:
    extra: dict[str, Any] | None = None
    errors: tuple[int, ...] = (422,)
    route_class: type[APIRoute] = APIRoute
    if op.name == "finish_request":
        endpoint = _finish_endpoint(op)
    else:
        required = op.name != "start_request"
        endpoint = _op_endpoint(op)
        extra, errors = app.json_body(op.body, required=required), BODY_ERRORS
        route_class = RawRoute
    documented = responses(errors, op.errors)
    for status, meaning in op.other_ok:
        documented[status] = {"model": op.answer, "description": meaning}
    app.router.add_api_route(
        op.path,
        endpoint,
        methods=[op.method],
        name=op.name,
        operation_id=op.name,
        summary=op.summary,
        tags=["requests"],
        status_code=op.status,
        response_model=op.answer,
        responses=documented,
        openapi_extra=extra,
        route_class_override=route_class,
    )


#: A batch body larger than this is validated op by op, giving way to the loop between them
#: (a 6 MB body validated whole holds the loop for tens of ms); a smaller one in one step.
SPLIT_ABOVE_BYTES = 256 << 10
#: The largest batch body whose refusal may cost its whole validation in one step: a larger one
#: that is not one object holding only ``ops`` is refused as it is read, without it.
WHOLE_AT_MOST_BYTES = 256 << 10


#: A batch's answer is handed to the server in messages of about this size, giving way between
#: them: joined and encoded whole, the answer of 12 ops of 8,192 keys (6.7 MB) held the loop up to
#: 14 ms (copies of the whole text, each as long as the answer).
ANSWER_PIECE_BYTES = 256 << 10


class PiecesResponse(Response):
    """A JSON answer sent as it was made, its ``pieces`` (UTF-8 bytes whose concatenation is
    the answer: a batch's are its ops' results) grouped into messages of at least
    ``ANSWER_PIECE_BYTES``, the loop given way between them once sending held it
    ``YIELD_AFTER_S``, with its ``content-length``: no copy of the whole answer is ever made."""

    def __init__(self, pieces: list[bytes], status: int = 200) -> None:
        self.pieces = pieces
        self.status_code = status
        self.background = None
        self.raw_headers = [
            (b"content-length", str(sum(map(len, pieces))).encode()),
            (b"content-type", JSON.encode()),
        ]

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await send(
            {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        )
        group: list[bytes] = []
        size = 0
        slices = Slices()
        for piece in self.pieces:
            group.append(piece)
            size += len(piece)
            if size >= ANSWER_PIECE_BYTES:
                await send(
                    {"type": "http.response.body", "body": b"".join(group), "more_body": True}
                )
                group, size = [], 0
                await slices.pause()
        await send({"type": "http.response.body", "body": b"".join(group), "more_body": False})


_OPS_START = re.compile(rb'\s*\{\s*"ops"\s*:\s*\[')
_SPACE = re.compile(rb"\s*")


class _BatchRunner:
    """``POST /v1/batch``: validate every op first (all or nothing), then run each on its own.

    No large batch holds the event loop for long (``app.http.steps``): a body above
    ``SPLIT_ABOVE_BYTES`` is read one op at a time (finding an op's end, then checking it, an
    op's long lists in steps of their own), and ops run giving way to the loop between them
    (``Slices``). A batch's ops already interleave with other calls wherever one awaits (tiers
    below the pool), so giving way between ops promises nothing less."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.parse = body_parser(s.BatchBody)
        self.op = OpParser(s.BatchOp, tag="op")

    def validated(self, raw: bytes | bytearray) -> list[Any]:
        """The ops, if the whole batch is valid; else the one error for the call.

        Schema errors (422, naming ``ops.N``) and limits (413: too many ops, too many keys in
        one op, ``kv_transfer_params`` too large in one op) refuse the whole call before any op
        runs. Too many ops is found before the body is parsed when the count can tell
        (``batch_exceeds_ops``), so a body of a million ops costs a scan of its first ones.
        """
        settings = self.settings
        if batch_exceeds_ops(raw, settings.max_batch_ops):
            raise too_many("ops", None, settings.max_batch_ops)
        return self._checked(list(self.parse(raw).ops))

    async def validated_yielding(self, raw: bytes | bytearray) -> list[Any]:
        """``validated``, for a large body in steps, giving way to the loop between them: the
        same ops, and a body with one error is refused with the same error."""
        if len(raw) <= SPLIT_ABOVE_BYTES:
            return self.validated(raw)
        return self._checked(await Slices().run(self._walk(raw)))

    def _odd(self, raw: bytes | bytearray) -> list[Any]:
        """A body that is not ``{"ops": [...]}`` alone: refused as its whole validation refuses
        it when that is cheap enough, else refused as it is."""
        if len(raw) <= WHOLE_AT_MOST_BYTES:
            return self.validated(raw)
        raise APIError(
            422,
            "invalid_field",
            f'body: a batch of more than {WHOLE_AT_MOST_BYTES} bytes must be {{"ops": [...]}} '
            "alone",
        )

    def _walk(self, raw: bytes | bytearray) -> Generator[None, None, list[Any]]:
        """The ops of ``raw``, each found (the C decoder) and checked in steps of its own."""
        max_ops = self.settings.max_batch_ops
        # No ``batch_exceeds_ops`` scan here (two counts of a 6 MB body hold the loop 8 ms):
        # the walk refuses at op ``max_batch_ops + 1`` itself, and validates no more.
        start = _OPS_START.match(raw)
        if start is None:
            return self._odd(raw)
        ops: list[Any] = []
        pos = start.end()
        while True:
            pos = _SPACE.match(raw, pos).end()  # type: ignore[union-attr]
            if raw.startswith(b"]", pos) and not ops:
                return self._odd(raw)  # no ops: the whole body's own refusal
            value, text, end = yield from value_at(raw, pos)
            yield
            where = ("ops", len(ops))
            lists = long_lists(value)
            if lists:
                ops.append((yield from self.op.steps(value, lists, where)))
            else:
                ops.append(self.op.whole(text, where))
            if len(ops) > max_ops:
                raise too_many("ops", None, max_ops)
            pos = _SPACE.match(raw, end).end()  # type: ignore[union-attr]
            sep = raw[pos : pos + 1]
            pos += 1
            if sep == b"]":
                break
            if sep != b",":
                return self._odd(raw)
            yield
        if raw[pos:].strip() != b"}":
            return self._odd(raw)
        return ops

    def _checked(self, ops: list[Any]) -> list[Any]:
        """The ops, if none breaks a count limit (413 naming ``ops.N``)."""
        settings = self.settings
        if len(ops) > settings.max_batch_ops:
            raise too_many("ops", len(ops), settings.max_batch_ops)
        for i, op in enumerate(ops):
            keys = getattr(op, "keys", ())
            err: APIError | None = None
            if len(keys) > settings.max_keys_per_call:
                err = too_many("keys", len(keys), settings.max_keys_per_call)
            elif op.op == "start_request":
                err = transfer_params_error(
                    op.kv_transfer_params, settings.max_transfer_params_bytes
                )
            if err is not None:
                raise APIError(err.status, err.code, f"ops.{i}: {err.message}")
        return ops

    async def __call__(self, request: Request) -> Response:
        info = call_info(request.scope)
        if info is not None:
            info.op = "batch"
        service = service_of(request)  # credentials first: a stranger learns nothing
        ops = await self.validated_yielding(await read_body(request))
        outcomes: list[tuple[str, int]] = []
        # The answer's pieces, encoded as each op ends: '{"results":[', then the ops' results
        # separated by commas, then ']}'.
        parts: list[bytes] = [b'{"results":[']
        errors: Counter[tuple[int, str]] = Counter()
        traced = False
        tiers = bool(service.tiers)
        slices = Slices()
        for i, op in enumerate(ops):
            sep = "," if i else ""
            if i:
                await slices.pause()  # let other calls run in between
            try:
                operation = BY_NAME[op.op]
                run = operation.sync_run(tiers)
                if operation.steps(op):  # thousands of keys: in steps
                    status, text = await operation.in_steps(service, op.req_id, op, slices)
                elif run is not None:  # most ops: no coroutine per op
                    status, text = run(service, op.req_id, op)
                else:
                    status, text = await operation.call(service, op.req_id, op)
            except Exception as exc:  # one op's failure must not abort the others
                err = error_for(exc)
                # A refusal (4xx, 503, 507) is expected and counted on the call's one line; only
                # a bug (500) is traced, once per call: a batch of 1,024 ops must not write
                # 1,024 tracebacks.
                if err.status == 500 and not traced:
                    traced = True
                    log.error("batch op failed", exc_info=exc, extra={"fields": {"op": op.op}})
                errors[err.status, err.code] += 1
                outcomes.append((op.op, err.status))
                parts.append(f"{sep}{_op_error(err)}".encode())
                continue
            outcomes.append((op.op, status))
            parts.append(f'{sep}{{"ok":true,"status":{status},"result":{text}}}'.encode())
        if info is not None:
            info.ops = outcomes
            info.batch_req_ids = list(dict.fromkeys(op.req_id for op in ops))
            info.op_errors = dict(errors) if errors else None
        parts.append(b"]}")
        return PiecesResponse(parts)


def _op_error(err: APIError) -> str:
    detail = json.loads(err.body())["error"]  # the same object a single call answers
    return f'{{"ok":false,"status":{err.status},"error":{json.dumps(detail)}}}'


def register_engine_routes(app: KVOffloadAPI, settings: Settings) -> None:
    """Add every engine route to ``app``; the hot ones (lookup, batch) first."""
    ops = list(OPERATIONS)
    _add_op_route(app, ops[0])  # lookup: matched first

    batch = _BatchRunner(settings)
    app.router.add_api_route(
        "/v1/batch",
        batch.__call__,
        methods=["POST"],
        name="batch",
        operation_id="batch",
        summary="Run many ops in one call",
        description=(
            "Runs the ops in order, each as if called alone (its own `req_id`, op name and "
            "fields), so an engine can do a whole scheduler step in one round trip.\n\n"
            "Validation is all or nothing: if any op is malformed (422, the message names "
            "`ops.N`), or the call holds too many ops, an op too many keys or too large "
            "`kv_transfer_params` (413), nothing runs. Execution is **not atomic**: once "
            "validated, one op's error (404, 409, 507, ...) does not abort the others and "
            "does not undo the ops before it; each op answers with its own `status` and "
            "`result` or `error`, in order."
        ),
        tags=["requests"],
        response_model=s.BatchAnswer,
        responses=responses(BODY_ERRORS),
        openapi_extra=app.json_body(s.BatchBody),
        route_class_override=RawRoute,
    )
    for op in ops[1:]:
        _add_op_route(app, op)
    _add_resource_routes(app)
    _add_control_routes(app)


_parse_wait = body_parser(s.WaitJobsBody)
_parse_cache = body_parser(s.KVCacheBody)


async def get_job(request: Request, job_id: Annotated[int, Path(ge=0)]) -> Response:
    return json_response(json.dumps(job_json(service_of(request).transfers().job(job_id))))


async def wait_jobs(request: Request) -> Response:
    body: s.WaitJobsBody = _parse_wait(await read_body(request))
    records = await service_of(request).transfers().wait(body.job_ids, body.timeout_s)
    jobs = [job_json(r) for r in records]
    done = all(j["state"] != "running" for j in jobs)
    return json_response(json.dumps({"jobs": jobs, "done": done}))


async def events(
    request: Request,
    after: Annotated[int, Query(ge=0, description="last seq seen (0: from the start)")] = 0,
    limit: Annotated[int, Query(ge=1, le=10000)] = 1000,
) -> Response:
    service = service_of(request)
    page = service.events.page(after, limit)
    return json_response(
        json.dumps(
            {
                "events": [event_json(e) for e in page.events],
                "next_after": page.next_after,
                "latest_seq": page.latest_seq,
                "fell_behind": page.fell_behind,
                "instance": service.instance,
            }
        )
    )


def _cache_json(cache: RegisteredCache) -> dict[str, Any]:
    return {
        "cache_id": cache.cache_id,
        "name": cache.name,
        "block_bytes": cache.block_bytes,
        "num_blocks": cache.num_blocks,
        "device": str(cache.device),
    }


async def register_kv_cache(request: Request) -> Response:
    raw = await read_body(request)
    _parse_cache(raw)  # shape and types; the transfer layer checks sizes and handles
    spec = json.loads(raw)
    tenancy = tenancy_of(request)
    # Before anything is opened: with tenants, no path or handle the caller only names.
    check_registration(spec, tenants=tenancy.enabled, trusted=tenancy.settings.registration_by_name)
    cache = service_of(request).transfers().register_cache(spec)
    return json_response(json.dumps(_cache_json(cache)), 201)


async def renew_kv_cache(
    request: Request, cache_id: Annotated[str, Path(min_length=1, max_length=256)]
) -> Response:
    lease_s = service_of(request).transfers().renew_cache(cache_id)
    return json_response(json.dumps({"cache_id": cache_id, "lease_s": lease_s}))


async def list_kv_caches(request: Request) -> Response:
    caches = service_of(request).transfers().caches()
    return json_response(json.dumps({"kv_caches": [_cache_json(c) for c in caches]}))


async def unregister_kv_cache(
    request: Request, cache_id: Annotated[str, Path(min_length=1, max_length=256)]
) -> Response:
    service_of(request).transfers().unregister_cache(cache_id)
    return Response(status_code=204)


async def pool(request: Request) -> Response:
    service = service_of(request)
    layout = service.transfers().pool_layout()
    return json_response(
        json.dumps(
            {
                "path": str(layout["path"]),
                "num_blocks": layout["num_blocks"],
                "block_bytes": layout["block_bytes"],
                "pinned": bool(layout["pinned"]),
                "max_keys_per_call": service.settings.max_keys_per_call,
                "pool_id": layout["pool_id"],
            }
        )
    )


def _add_resource_routes(app: KVOffloadAPI) -> None:
    """Jobs, events, KV caches and the pool: the routes that are not request-scoped ops."""
    app.add_api_route(
        "/v1/jobs/{job_id}",
        get_job,
        methods=["GET"],
        name="get_job",
        operation_id="get_job",
        summary="A transfer job: running, done or failed, with bytes and seconds",
        tags=["jobs"],
        response_model=s.JobAnswer,
        responses=responses(404, 422, 503),
    )
    app.router.add_api_route(
        "/v1/jobs/wait",
        wait_jobs,
        methods=["POST"],
        name="wait_jobs",
        operation_id="wait_jobs",
        summary="Long-poll until none of the jobs is running (bounded by timeout_s)",
        description=(
            "Answers as soon as every listed job has ended, or when `timeout_s` (capped by the "
            "service's `job_wait_max_s`) has passed; `done` says which."
        ),
        tags=["jobs"],
        response_model=s.WaitJobsAnswer,
        responses=responses(BODY_ERRORS, 404, 503),
        openapi_extra=app.json_body(s.WaitJobsBody),
        route_class_override=RawRoute,
    )
    app.add_api_route(
        "/v1/events",
        events,
        methods=["GET"],
        name="events",
        operation_id="events",
        summary="KV events after a sequence number, for routers",
        tags=["events"],
        response_model=s.EventsAnswer,
        responses=responses(422),
    )
    app.router.add_api_route(
        "/v1/kv-caches",
        register_kv_cache,
        methods=["POST"],
        name="register_kv_cache",
        operation_id="register_kv_cache",
        summary="Register a device KV cache (shared-memory file or CUDA IPC handles)",
        tags=["kv-caches"],
        status_code=201,
        response_model=s.KVCacheAnswer,
        responses=responses(BODY_ERRORS, 503),
        description=(
            "With tenants, a handle the caller only names (an `shm` path, a `cuda_ipc` handle) "
            "is refused (403 `handle_not_held`) before anything is opened: register over the "
            "pool socket, passing the files' descriptors "
            "(`kvoffload_client.pool_socket.register_kv_cache`)."
        ),
        openapi_extra=app.json_body(s.KVCacheBody),
        route_class_override=RawRoute,
    )
    app.add_api_route(
        "/v1/kv-caches",
        list_kv_caches,
        methods=["GET"],
        name="list_kv_caches",
        operation_id="list_kv_caches",
        summary="Registered device KV caches",
        tags=["kv-caches"],
        response_model=s.KVCacheListAnswer,
        responses=responses(503),
    )
    app.add_api_route(
        "/v1/kv-caches/{cache_id}/renew",
        renew_kv_cache,
        methods=["POST"],
        name="renew_kv_cache",
        operation_id="renew_kv_cache",
        summary="Renew a registration's lease (404 once it lapsed: register again)",
        description=(
            "A registration made with `lease_s` is forgotten, its queued jobs failed and its "
            "mappings closed (the engine's GPU memory freed) unless renewed within `lease_s`. "
            "The client renews by itself."
        ),
        tags=["kv-caches"],
        response_model=s.KVCacheRenewAnswer,
        responses=responses(404, 422, 503),
    )
    app.add_api_route(
        "/v1/kv-caches/{cache_id}",
        unregister_kv_cache,
        methods=["DELETE"],
        name="unregister_kv_cache",
        operation_id="unregister_kv_cache",
        summary="Forget a device KV cache",
        tags=["kv-caches"],
        status_code=204,
        response_class=Response,
        responses=responses(404, 422, 503),
    )
    app.add_api_route(
        "/v1/pool",
        pool,
        methods=["GET"],
        name="pool",
        operation_id="pool",
        summary="Host pool layout, to map the pool from an engine",
        tags=["pool"],
        response_model=s.PoolAnswer,
        responses=responses(503),
    )


# --------------------------------------------------------------------------- cache control

NamePath = Annotated[str, Path(min_length=1, max_length=256, description="retention name")]
_parse_renew = body_parser(s.RenewBody)


async def list_retentions(request: Request) -> Response:
    return json_response(json.dumps(retentions_json(service_of(request))))


async def get_retention(request: Request, name: NamePath) -> Response:
    check_path_param("name", name)
    return json_response(json.dumps(retention_json(service_of(request).control.get(name))))


async def renew_retention(request: Request, name: NamePath) -> Response:
    check_path_param("name", name)
    service = service_of(request)
    body: s.RenewBody = _parse_renew(await read_body(request))
    return json_response(json.dumps(retention_json(service.control.renew(name, body.ttl_s))))


async def release_retention(request: Request, name: NamePath) -> Response:
    check_path_param("name", name)
    service = service_of(request)
    info = await service.control.release(name, stepper(service.pool_manager))
    return json_response(json.dumps(retention_json(info)))


async def get_prefetch(
    request: Request,
    prefetch_id: Annotated[int, Path(ge=1)],
    wait_s: Annotated[
        float, Query(ge=0, description="wait this long for its reads to settle (capped)")
    ] = 0.0,
) -> Response:
    service = service_of(request)
    control = service.control
    if wait_s > 0:
        p = await control.wait(prefetch_id, min(wait_s, service.settings.job_wait_max_s))
    else:
        p = control.prefetch_state(prefetch_id)
    return json_response(json.dumps(prefetch_json(p, control.now())))


async def cancel_prefetch(request: Request, prefetch_id: Annotated[int, Path(ge=1)]) -> Response:
    control = service_of(request).control
    p = control.cancel(prefetch_id)
    return json_response(json.dumps(prefetch_json(p, control.now())))


def _add_control_routes(app: KVOffloadAPI) -> None:
    """Retentions and prefetches of the caller's namespace, by name and id."""
    app.add_api_route(
        "/v1/retentions",
        list_retentions,
        methods=["GET"],
        name="list_retentions",
        operation_id="list_retentions",
        summary="The namespace's live retentions, oldest first",
        tags=["cache-control"],
        response_model=s.RetentionsAnswer,
        responses=responses(503),
    )
    app.add_api_route(
        "/v1/retentions/{name}",
        get_retention,
        methods=["GET"],
        name="get_retention",
        operation_id="get_retention",
        summary="One retention",
        tags=["cache-control"],
        response_model=s.RetentionAnswer,
        responses=responses(404, 422),
    )
    app.router.add_api_route(
        "/v1/retentions/{name}/renew",
        renew_retention,
        methods=["POST"],
        name="renew_retention",
        operation_id="renew_retention",
        summary="Restart a retention's TTL from now",
        tags=["cache-control"],
        response_model=s.RetentionAnswer,
        responses=responses(BODY_ERRORS, 404),
        openapi_extra=app.json_body(s.RenewBody),
        route_class_override=RawRoute,
    )
    app.add_api_route(
        "/v1/retentions/{name}",
        release_retention,
        methods=["DELETE"],
        name="release_retention",
        operation_id="release_retention",
        summary="End a retention now: its blocks are evictable again; what it was",
        tags=["cache-control"],
        response_model=s.RetentionAnswer,
        responses=responses(404, 422),
    )
    app.add_api_route(
        "/v1/prefetches/{prefetch_id}",
        get_prefetch,
        methods=["GET"],
        name="get_prefetch",
        operation_id="get_prefetch",
        summary="A prefetch's state and counts (wait_s: long-poll until its reads settle)",
        tags=["cache-control"],
        response_model=s.PrefetchAnswer,
        responses=responses(404, 422),
    )
    app.add_api_route(
        "/v1/prefetches/{prefetch_id}",
        cancel_prefetch,
        methods=["DELETE"],
        name="cancel_prefetch",
        operation_id="cancel_prefetch",
        summary="Cancel a prefetch: its holds end now (wasted); what it was",
        tags=["cache-control"],
        response_model=s.PrefetchAnswer,
        responses=responses(404, 422),
    )
