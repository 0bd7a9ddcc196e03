"""Admin API routes (admin listener): policy and shadow projections, stats, requests, cache
clear, log level.

Every route needs ``Authorization: Bearer <token>`` when the service has a token (401 without
one, 403 with a wrong one; compared in constant time). Without a token the service only binds
the admin listener to loopback (``Settings`` refuses anything else) and the routes are open.

``PUT /admin/v1/policy`` is a conditional, idempotent switch: the policy ``generation`` is the
ETag, ``If-Match`` (optional) must name the current one (else 412 and nothing changes), and a
PUT of the active policy with the same parameters changes nothing (``changed: false``). Every
change writes one audit line (``app.telemetry.logging.audit``).

``GET /admin/v1/policy/shadow`` lists each simulated policy's projected prefix hit ratio (over
the recent window of sampled requests, and since the evaluation started; null, with the reason,
until enough requests were sampled) beside the live ratio, with the sampler's accounting.
``GET``/``PUT /admin/v1/log-level`` read and set the process's log level live (audited).

The wire models of these two additions live here, next to their routes.

Namespaces: every route that reads or changes a service's state (policy, shadow, stats,
requests, release, clear) acts on one namespace, named by the ``namespace`` query parameter:
required when the service has tenants (422 without it, 404 for one it lacks), optional without
(the one namespace, ``default``). ``GET /admin/v1/tenants`` breaks the pool down by tenant and
namespace (quotas, pins, requests, blocks, hit ratio); ``GET /admin/v1/readiness`` is
``/readyz`` in full (which namespace is not ready and why, every namespace's degraded tiers),
what ``/readyz`` leaves out with tenants. The log level is the process's.

Every query parameter of an admin route takes one value: one given twice is refused whatever
the values (``admin_guard``), ``namespace`` with 400 ``ambiguous_credentials`` (as two
``X-KVOffload-Namespace`` headers on the engine API: which one counts is not for the service to
guess), any other with 422 ``invalid_field``; nothing changes.
"""

from __future__ import annotations

import dataclasses
import hmac
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from fastapi import Depends, FastAPI, Header, Path, Query, Request
from fastapi.responses import Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, ConfigDict, Field

from app.core.admin import Admin
from app.core.slices import stepper
from app.http import schemas as s
from app.http.auth import ambiguous
from app.http.deps import ServiceDep, tenancy_of
from app.http.errors import BODY_ERRORS, APIError, responses
from app.http.middleware import call_info
from app.http.openapi import KVOffloadAPI
from app.http.operations import retention_json, retentions_json
from app.http.routes import health
from app.http.routes.query import strict_query
from app.http.routes.raw import body_parser
from app.telemetry import logging as app_logging
from app.telemetry.logging import audit
from app.telemetry.request_ids import safe_req_id
from manager import PolicyInfo, UnknownPolicyError
from manager.policies import canonical_policy_name

JSON = "application/json"
ADMIN_REQUEST_PREFIX = "/admin/v1/requests/"
# 400 ``ambiguous_credentials``: two Authorization headers, or ``namespace`` given twice.
_AUTH_ERRORS = (400, 401, 403)
# A route acting on one namespace: 422 when the service has tenants and the call names none,
# 404 when it names one the service lacks.
_NAMESPACE_ERRORS = (404, 422)
Level = Literal["debug", "info", "warning", "error"]


class ShadowPolicyAnswer(s.Answer):
    """One simulated policy. Ratios are leading hits over keys of the sampled requests."""

    policy: str
    active: bool = Field(description="the active policy (the control of the simulation)")
    projected_hit_ratio: float | None = Field(
        description="over the recent window of sampled requests (null: not enough data, see reason)"
    )
    cumulative_hit_ratio: float | None = Field(
        description="since the evaluation started (null: not enough data)"
    )
    sampled_requests: int
    sampled_blocks: int
    window_requests: int = Field(description="sampled requests in the recent window")
    reason: str | None = Field(
        description="why the ratios are null: not enough data yet, and how much is needed"
    )


class ShadowAnswer(s.Answer):
    """Shadow evaluation: every simulated policy's projection beside the live ratio."""

    enabled: bool
    active: s.PolicyRef
    live_prefix_hit_ratio: float | None = Field(
        description="leading hits over keys of the recent live lookups"
    )
    since_generation: int | None = Field(description="policy generation the evaluation began at")
    restarts: int = Field(description="restarts: policy switches, sample rate halvings")
    sample_rate: float | None = Field(description="share of prefix trees simulated, now")
    shadow_capacity: int | None = Field(description="blocks of each simulated pool")
    min_sampled_requests: int | None = Field(
        description="sampled requests the window must hold before a ratio is projected"
    )
    observed: int = Field(description="finished requests offered to the sampler")
    sampled: int = Field(description="sampled requests simulated")
    queued: int = Field(description="sampled requests waiting to be simulated")
    dropped: int = Field(description="sampled requests lost to a full queue")
    policies: list[ShadowPolicyAnswer]


class LogLevelBody(BaseModel):
    """``PUT /admin/v1/log-level``."""

    model_config = ConfigDict(strict=True, extra="forbid")
    level: Level


class LogLevelAnswer(s.Answer):
    """The process's log level."""

    level: Level
    available: list[Level]


class LogLevelSwitchAnswer(s.Answer):
    """Result of a log level change; ``changed`` is false when it already was that level."""

    level: Level
    previous: Level
    changed: bool


_NOT_COUNTERS = {
    "num_blocks",
    "free",
    "pending",
    "ready",
    "pinned",
    "reserved",
    "live_requests",
    "policy",
    # Gauges of cache control: under "control".
    "retentions",
    "retained",
    "retained_ready",
}


#: Which requests the shadow evaluation samples, said with every "not enough data".
SAMPLED = "only requests that load, store or touch blocks are sampled, not lookups alone"


def etag(generation: int) -> str:
    """The ETag of a policy generation."""
    return f'"{generation}"'


def if_match_ok(header: str, generation: int) -> bool:
    """True when an ``If-Match`` value names ``generation`` (or is ``*``).

    Strong comparison: weak tags (``W/"3"``) never match. A bare number is taken as a tag.
    """
    current = str(generation)
    for tag in header.split(","):
        tag = tag.strip()
        if tag == "*":
            return True
        if tag.startswith("W/"):
            continue
        if tag.strip('"') == current:
            return True
    return False


def _policy_ref(info: PolicyInfo) -> dict[str, Any]:
    return {"name": info.name, "params": info.params, "generation": info.generation}


def _answer(body: dict[str, Any], status: int = 200, tag: str | None = None) -> Response:
    headers = {"ETag": tag} if tag is not None else None
    return Response(json.dumps(body, default=str), status, headers, media_type=JSON)


_bearer = HTTPBearer(auto_error=False, description="the admin token")
_TOKEN_STATE = "admin_token"


async def require_admin(
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> str:
    """Check the bearer token against the app's; return the caller (for the audit log).

    401 without a token, 403 with a wrong one (constant-time comparison), 400
    ``ambiguous_credentials`` with two ``Authorization`` headers. An app without a token
    (loopback only) lets every caller in.
    """
    if len(request.headers.getlist("authorization")) > 1:
        raise ambiguous("Authorization")
    client = request.client
    actor = f"{client.host}:{client.port}" if client is not None else "unknown"
    expected: bytes | None = getattr(request.app.state, _TOKEN_STATE, None)
    if expected is None:
        return actor
    if credentials is None:
        raise APIError(401, "unauthorized", "bearer token required", {"WWW-Authenticate": "Bearer"})
    if not hmac.compare_digest(credentials.credentials.encode(), expected):
        raise APIError(403, "forbidden", "wrong admin token")
    return actor


Actor = Annotated[str, Depends(require_admin)]

#: Admin routes that answer without a token (they say nothing but "up").
OPEN_ADMIN_PATHS = frozenset({"/livez"})


async def admin_guard(request: Request) -> None:
    """The admin listener's app-wide dependency, in place of ``strict_query`` alone.

    The token is checked before the query string, so a caller without the token gets 401
    (403 with a wrong one) whatever it sends, and learns nothing from query validation. The
    open routes check only the query. Routes still take ``Actor`` for the audit log. A query
    parameter given twice is refused (``repeated_query``).
    """
    if request.url.path not in OPEN_ADMIN_PATHS:
        await require_admin(request, await _bearer(request))
    await strict_query(request)
    repeated_query(request)


def repeated_query(request: Request) -> None:
    """Refuse a query parameter given more than once (every admin parameter takes one value;
    the framework would take the last one): 400 ``ambiguous_credentials`` for ``namespace``,
    422 ``invalid_field`` for any other."""
    if not request.scope.get("query_string"):
        return
    params = request.query_params
    repeated = sorted({name for name in params if len(params.getlist(name)) > 1})
    if not repeated:
        return
    if "namespace" in repeated:
        raise APIError(
            400,
            "ambiguous_credentials",
            "query: namespace: given more than once; accepted: one at most",
        )
    raise APIError(
        422,
        "invalid_field",
        f"query: {', '.join(repeated[:5])}: given more than once; accepted: one at most",
    )


_parse_policy = body_parser(s.PolicyBody)
_parse_level = body_parser(LogLevelBody)


def _note(request: Request, op: str) -> None:
    info = call_info(request.scope)
    if info is not None:
        info.op = op


async def get_policy(request: Request, actor: Actor, service: ServiceDep) -> Response:
    _note(request, "admin_policy_get")
    info, available = service.admin.policy()
    return _answer({**_policy_ref(info), "available": available}, tag=etag(info.generation))


async def put_policy(
    request: Request,
    actor: Actor,
    service: ServiceDep,
    if_match: Annotated[
        str | None, Header(description="current generation (ETag); 412 if it moved")
    ] = None,
) -> Response:
    _note(request, "admin_policy_set")
    body: s.PolicyBody = _parse_policy(await request.body())
    current, available = service.admin.policy()
    try:  # an invalid body is 422 whatever If-Match says
        name = canonical_policy_name(body.name)  # ARC, LFU-DA, S3-FIFO: as serve --policy
    except UnknownPolicyError:
        raise UnknownPolicyError(body.name, available) from None
    if if_match is not None and not if_match_ok(if_match, current.generation):
        raise APIError(
            412,
            "precondition_failed",
            f"policy generation is {current.generation}, If-Match was {if_match}",
            {"ETag": etag(current.generation)},
        )
    switch = service.admin.switch_policy(name, body.params, actor)
    return _answer(
        {
            "from": _policy_ref(switch.previous),
            "to": _policy_ref(switch.current),
            "blocks_migrated": switch.blocks_migrated,
            "changed": switch.changed,
        },
        tag=etag(switch.current.generation),
    )


async def get_shadow(request: Request, actor: Actor, service: ServiceDep) -> Response:
    _note(request, "admin_shadow")
    active = service.admin.policy()[0]
    live = service.admin.live_hit_ratio()
    state = service.admin.shadow_state()
    if state is None:
        return _answer(
            {
                "enabled": False,
                "active": _policy_ref(active),
                "live_prefix_hit_ratio": live,
                "since_generation": None,
                "restarts": 0,
                "sample_rate": None,
                "shadow_capacity": None,
                "min_sampled_requests": None,
                "observed": 0,
                "sampled": 0,
                "queued": 0,
                "dropped": 0,
                "policies": [],
            }
        )
    report = state.report
    return _answer(
        {
            "enabled": True,
            "active": _policy_ref(active),
            "live_prefix_hit_ratio": live,
            "since_generation": state.since_generation,
            "restarts": state.restarts,
            "sample_rate": report.sample_rate,
            "shadow_capacity": report.shadow_capacity,
            "min_sampled_requests": report.min_requests,
            "observed": report.observed,
            "sampled": report.sampled,
            "queued": report.queued,
            "dropped": report.dropped,
            "policies": [
                {
                    "policy": r.policy,
                    "active": r.policy == active.name,
                    "projected_hit_ratio": r.window,
                    "cumulative_hit_ratio": r.cumulative,
                    "sampled_requests": r.requests,
                    "sampled_blocks": r.blocks,
                    "window_requests": r.window_requests,
                    "reason": None
                    if r.window is not None
                    else f"not enough data: {r.window_requests} of {report.min_requests} "
                    f"sampled requests ({SAMPLED})",
                }
                for r in report.ratios
            ],
        }
    )


def _any_admin(request: Request) -> Admin:
    """An ``Admin`` for process-wide operations (the log level): any namespace's will do."""
    return next(tenancy_of(request).services()).admin


async def get_log_level(request: Request, actor: Actor) -> Response:
    _note(request, "admin_log_level_get")
    level = _any_admin(request).log_level()
    return _answer({"level": level, "available": list(app_logging.LEVELS)})


async def put_log_level(request: Request, actor: Actor) -> Response:
    _note(request, "admin_log_level_set")
    body: LogLevelBody = _parse_level(await request.body())
    previous, level = _any_admin(request).set_log_level(body.level, actor)
    return _answer({"level": level, "previous": previous, "changed": previous != level})


async def stats(request: Request, actor: Actor, service: ServiceDep) -> Response:
    _note(request, "admin_stats")
    st = service.admin.stats()
    looked = st.lookup_hit + st.lookup_pending + st.lookup_miss
    running, oldest = service.admin.jobs_running()
    counters: dict[str, int] = {}
    breakdowns: dict[str, dict[str, int]] = {}
    for f in dataclasses.fields(st):
        value = getattr(st, f.name)
        if f.name in _NOT_COUNTERS:
            continue
        if isinstance(value, dict):
            breakdowns[f.name] = value
        elif isinstance(value, int):
            counters[f.name] = value
    return _answer(
        {
            "blocks": {
                "num_blocks": st.num_blocks,
                "free": st.free,
                "pending": st.pending,
                "ready": st.ready,
                "pinned": st.pinned,
            },
            "hit_ratio": st.lookup_hit / looked if looked else None,
            "live_requests": st.live_requests,
            "policy": _policy_ref(service.admin.policy()[0]),
            "counters": counters,
            "breakdowns": breakdowns,
            "jobs": {"running": running, "oldest_running_age_s": oldest},
            "events": {
                "latest_seq": service.events.latest_seq,
                "buffered": len(service.events),
                "dropped": service.events.dropped,
            },
            "kv_caches": service.admin.kv_caches(),
            "tiers": service.tiers.states(),
            "control": service.control.state(),
        }
    )


async def list_requests(
    request: Request,
    actor: Actor,
    service: ServiceDep,
    limit: Annotated[int, Query(ge=1, le=100000)] = 1000,
) -> Response:
    _note(request, "admin_requests")
    tracked = service.admin.requests()
    return _answer(
        {
            "requests": [
                {
                    "req_id": r.req_id,
                    "pins": {k.hex(): n for k, n in r.pins.items()},
                    "pending_stores": [k.hex() for k in r.pending_stores],
                    "idle_seconds": r.idle_seconds,
                    "orphaned_reservations": [k.hex() for k in r.reserved_stores],
                    "orphaned_seconds": r.reserved_seconds,
                }
                for r in tracked[:limit]
            ],
            "total": len(tracked),
        }
    )


async def release(
    request: Request,
    actor: Actor,
    service: ServiceDep,
    req_id: Annotated[str, Path(min_length=1, max_length=256)],
) -> Response:
    _note(request, "admin_release")
    released = service.admin.release_request(req_id, actor)
    return _answer(
        {
            "req_id": released.req_id,
            "pins_released": released.pins_released,
            "stores_dropped": released.stores_dropped,
        }
    )


async def clear(request: Request, actor: Actor, service: ServiceDep) -> Response:
    _note(request, "admin_clear")
    counts = service.admin.clear_cache(actor)
    return _answer(dataclasses.asdict(counts))


async def list_retentions(request: Request, actor: Actor, service: ServiceDep) -> Response:
    _note(request, "admin_retentions")
    return _answer(retentions_json(service))


async def release_retention(
    request: Request,
    actor: Actor,
    service: ServiceDep,
    name: Annotated[str, Path(min_length=1, max_length=256)],
) -> Response:
    _note(request, "admin_release_retention")
    info = await service.control.release(name, stepper(service.pool_manager))
    audit(
        "retention.release",
        actor,
        namespace=service.namespace,
        retention=safe_req_id(name),
        keys=info.keys,
    )
    return _answer(retention_json(info))


async def tenants(request: Request, actor: Actor) -> Response:
    _note(request, "admin_tenants")
    tenancy = tenancy_of(request)
    by_tenant: dict[str | None, list[dict[str, Any]]] = {}
    for space in sorted(tenancy.spaces.values(), key=lambda sp: sp.namespace):
        st = space.service.admin.stats()
        looked = st.lookup_hit + st.lookup_pending + st.lookup_miss
        by_tenant.setdefault(space.tenant, []).append(
            {
                "namespace": space.namespace,
                "num_blocks": st.num_blocks,
                "free": st.free,
                "ready": st.ready,
                "pending": st.pending,
                "pinned": st.pinned,
                "live_requests": st.live_requests,
                "hit_ratio": st.lookup_hit / looked if looked else None,
                "stores_refused": st.stores_refused,
                "evictions": st.evictions,
            }
        )
    rows = []
    for name, spaces in sorted(by_tenant.items(), key=lambda kv: kv[0] or ""):
        quota = tenancy.quotas.get(name) if name is not None else None
        rows.append(
            {
                "tenant": name,
                "max_pins": None if quota is None else quota.max_pins,
                "max_requests": None if quota is None else quota.max_requests,
                "pins": sum(sp["pinned"] for sp in spaces),
                "requests": sum(sp["live_requests"] for sp in spaces),
                "blocks": sum(sp["num_blocks"] for sp in spaces),
                "namespaces": spaces,
            }
        )
    return _answer(
        {
            "enabled": tenancy.enabled,
            "reloads": tenancy.reloads,
            "reload_failures": tenancy.reload_failures,
            "tenants": rows,
        }
    )


async def readiness(request: Request, actor: Actor) -> Response:
    _note(request, "admin_readiness")
    _status, body = health.answer(tenancy_of(request), full=True)
    return _answer(body)


@dataclass(frozen=True, slots=True)
class AdminRoute:
    """One admin route: its handler, answer model, summary and the errors it documents."""

    method: str
    path: str
    endpoint: Callable[..., Awaitable[Response]]
    answer: type[s.Answer]
    summary: str
    errors: tuple[int | tuple[int, ...], ...] = ()
    tagged: bool = False
    body: type[BaseModel] | None = None


ROUTES: tuple[AdminRoute, ...] = (
    AdminRoute(
        "GET",
        "/admin/v1/policy",
        get_policy,
        s.PolicyAnswer,
        "The active eviction policy; ETag = generation",
        _NAMESPACE_ERRORS,
        tagged=True,
    ),
    AdminRoute(
        "PUT",
        "/admin/v1/policy",
        put_policy,
        s.PolicySwitchAnswer,
        "Switch the eviction policy live (If-Match optional, idempotent)",
        (BODY_ERRORS, 412, *_NAMESPACE_ERRORS),
        tagged=True,
        body=s.PolicyBody,
    ),
    AdminRoute(
        "GET",
        "/admin/v1/policy/shadow",
        get_shadow,
        ShadowAnswer,
        "Each policy's projected prefix hit ratio (shadow evaluation) beside the live one",
        _NAMESPACE_ERRORS,
    ),
    AdminRoute(
        "GET", "/admin/v1/log-level", get_log_level, LogLevelAnswer, "The process's log level"
    ),
    AdminRoute(
        "PUT",
        "/admin/v1/log-level",
        put_log_level,
        LogLevelSwitchAnswer,
        "Set the log level live (audited)",
        (BODY_ERRORS,),
        body=LogLevelBody,
    ),
    AdminRoute(
        "GET",
        "/admin/v1/stats",
        stats,
        s.StatsAnswer,
        "Pool blocks by state, hit ratio, requests, counters, jobs",
        _NAMESPACE_ERRORS,
    ),
    AdminRoute(
        "GET",
        "/admin/v1/tenants",
        tenants,
        s.TenantsAnswer,
        "Every tenant: its quotas and use, and each namespace's blocks and hit ratio",
    ),
    AdminRoute(
        "GET",
        "/admin/v1/readiness",
        readiness,
        s.HealthAnswer,
        "/readyz in full: why a namespace is not ready, and every namespace's degraded tiers",
    ),
    AdminRoute(
        "GET",
        "/admin/v1/requests",
        list_requests,
        s.RequestsAnswer,
        "Tracked requests and the leases each holds",
        _NAMESPACE_ERRORS,
    ),
    AdminRoute(
        "POST",
        "/admin/v1/requests/{req_id}/release",
        release,
        s.ReleaseAnswer,
        "Force-release a request's leases",
        _NAMESPACE_ERRORS,
    ),
    AdminRoute(
        "POST",
        "/admin/v1/cache/clear",
        clear,
        s.ClearAnswer,
        "Drop every block not pinned, retained or pending; counts",
        _NAMESPACE_ERRORS,
    ),
    AdminRoute(
        "GET",
        "/admin/v1/retentions",
        list_retentions,
        s.RetentionsAnswer,
        "The namespace's live retentions, oldest first",
        _NAMESPACE_ERRORS,
    ),
    AdminRoute(
        "DELETE",
        "/admin/v1/retentions/{name}",
        release_retention,
        s.RetentionAnswer,
        "End a retention now (audited): its blocks are evictable again",
        (*_NAMESPACE_ERRORS, 404),
    ),
)


def register_admin_routes(app: KVOffloadAPI, token: str | None) -> None:
    """Add the admin routes (``ROUTES``) to ``app``, each behind the token check; the handlers
    find the namespace's service through ``app.state.tenancy`` (``app.http.deps``)."""
    setattr(app.state, _TOKEN_STATE, None if token is None else token.encode())
    etag_header = {"ETag": {"description": "policy generation", "schema": {"type": "string"}}}
    for route in ROUTES:
        documented = responses(_AUTH_ERRORS, *route.errors)
        if route.tagged:
            documented[200] = {"description": "OK", "headers": etag_header}
        name = route.endpoint.__name__
        app.add_api_route(
            route.path,
            route.endpoint,
            methods=[route.method],
            name=name,
            operation_id=f"admin_{name}",
            summary=route.summary,
            tags=["admin"],
            response_model=route.answer,
            responses=documented,
            openapi_extra=None if route.body is None else app.json_body(route.body),
        )


def register_admin_health(app: FastAPI) -> None:
    """``/livez`` on the admin listener (open: it says nothing but "up")."""

    async def livez() -> Response:
        return Response(b'{"status":"ok"}', media_type=JSON)

    app.add_api_route(
        "/livez",
        livez,
        methods=["GET"],
        name="admin_livez",
        operation_id="admin_livez",
        summary="Liveness",
        tags=["health"],
        response_model=s.HealthAnswer,
    )
