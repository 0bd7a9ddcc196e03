"""Size limits of request bodies: a byte cap per route derived from the settings, the table the
body guard looks caps up in, the cap on ``kv_transfer_params``, and the early op count of a
batch.

Why. The count limits (``max_keys_per_call``, ``max_batch_ops``) can only be checked on a parsed
body, and parsing costs event-loop time and memory in proportion to the body (far more for
junk than for keys: 8 MiB of small JSON values took over a second and hundreds of MiB before
it was refused). So each route refuses, while its body streams in (``BodyGuardMiddleware``), a
body larger than its largest legitimate one; the batch route, whose legitimate bodies can reach
``max_body_bytes``, also counts its ops before they are parsed (``batch_exceeds_ops``).

Caps (``body_caps(settings)``, keyed by operation id; each is at most ``max_body_bytes``; the
last column is the cap under the default settings):

=====================================  ==============================================  =========
operation                              cap                                             default
=====================================  ==============================================  =========
lookup, prepare_load, touch,           ``OP_FIXED_BYTES + max_keys_per_call *``        1.28 MiB
complete_load, complete_store,         ``KEY_ITEM_BYTES``                              (1343488)
retain, prefetch, demote, drop
prepare_store                          the same, plus ``max_keys_per_call *``          2.78 MiB
                                       ``STORE_TOKENS_PER_KEY * TOKEN_ITEM_BYTES``     (2916352)
onload                                 ``OP_FIXED_BYTES + max_keys_per_call *``        1.62 MiB
                                       ``(KEY_ITEM_BYTES + BLOCK_ITEM_BYTES)``         (1695744)
offload                                the same, plus the tokens of prepare_store      3.12 MiB
                                                                                       (3268608)
start_request                          ``OP_FIXED_BYTES + TRANSFER_PARAMS_WIRE_FACTOR  136 KiB
                                       * max_transfer_params_bytes``                   (139264)
batch                                  ``ENVELOPE_BYTES + max_batch_ops *``            8 MiB
                                       (the largest op cap above)                      (capped)
renew_retention                        ``OP_FIXED_BYTES``                              8 KiB
wait_jobs                              ``OP_FIXED_BYTES + MAX_WAIT_JOBS *``            220 KiB
                                       ``JOB_ID_ITEM_BYTES``                           (225280)
register_kv_cache                      ``OP_FIXED_BYTES + MAX_TENSORS *``              8 MiB
                                       ``TENSOR_ITEM_BYTES``                           (capped)
admin_put_policy, admin_put_log_level  ``ADMIN_BODY_BYTES``                            64 KiB
finish_request, unregister_kv_cache,   ``EMPTY_BODY_BYTES`` (they read no body)        1 KiB
admin_release, admin_clear,
release_retention, cancel_prefetch,
admin_release_retention
=====================================  ==============================================  =========

What "legitimate" allows for: every key at its longest (``MAX_KEY_BYTES``) written as plain hex,
every block index and job id at its largest, every list item on a line of its own behind up to
31 spaces of indentation (pretty printers), the string fields (``req_id``, ``cache_id``) at
their longest with every character escaped as a surrogate pair, and ``kv_transfer_params`` at
its cap written with ``\\u`` escapes and indentation (``TRANSFER_PARAMS_WIRE_FACTOR``). A body
over its route's cap is refused with 413 ``body_too_large``, the answer to a body over
``max_body_bytes``. (A key spelt with ``\\u`` escapes, six times its plain length, is not
covered: no encoder writes hex digits that way.)

A route that can take a body (any method but GET, HEAD, OPTIONS) must have a cap: building the
table for an app with such a route missing from ``body_caps`` fails, so a new route cannot fall
back to ``max_body_bytes`` unnoticed. A call that matches no route is held to
``max_body_bytes`` (the router answers 404/405 without reading its body).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from typing import Any

from starlette.routing import BaseRoute, Route

from app.http.errors import APIError
from app.http.routing import RouteEntry, RouteMatcher
from app.http.schemas import MAX_ID_CHARS, MAX_WAIT_JOBS
from app.settings import Settings
from manager import MAX_KEY_BYTES
from transfer.kv_cache import MAX_TENSORS

ITEM_SPACE_BYTES = 32
"""Before each list item: a newline and up to 31 spaces (``json.dumps(indent=4)`` indents a batch
op's keys by 16)."""

KEY_ITEM_BYTES = 2 * MAX_KEY_BYTES + len('"",') + ITEM_SPACE_BYTES
"""One key in a list: hex digits, quotes, comma, indentation (163)."""

BLOCK_ITEM_BYTES = len(str(2**31 - 1)) + len(",") + ITEM_SPACE_BYTES
"""One device block index (``BlockIndex`` is below 2**31), comma, indentation (43)."""

STORE_TOKENS_PER_KEY = 16
"""Token ids per key a store's body has room for (``StoreMeta``: vLLM's default block size);
an engine with larger blocks sends fewer keys per call."""

TOKEN_ITEM_BYTES = len(str(2**32 - 1)) + len(", ")
"""One token id in ``token_ids``, a separator (12): engines send them unindented."""

JOB_ID_ITEM_BYTES = len(str(2**64)) + len(",") + ITEM_SPACE_BYTES
"""One job id (ids count up from 1; 2**64 is out of reach), comma, indentation (53)."""

STRING_FIELD_BYTES = 2 + 12 * MAX_ID_CHARS
"""A ``req_id`` or ``cache_id`` at its longest with every character written as an escaped
surrogate pair (``\\ud83d\\ude00``: 12 bytes), quotes included (3074)."""

OP_FIXED_BYTES = 8 << 10
"""Everything of one op beside its lists: two string fields at ``STRING_FIELD_BYTES`` (a batch
op's ``req_id`` and an offload's ``cache_id``), field names, the op name, ``success``,
``timeout_s``, braces and whitespace; 2 KiB to spare."""

TRANSFER_PARAMS_WIRE_FACTOR = 8
"""``max_transfer_params_bytes`` counts compact UTF-8 JSON; on the wire the same value may be up
to 3x longer with ``\\u`` escapes (``ensure_ascii``: 6 bytes for a 2-byte character, 12 for a
4-byte one), 1.5x with ``", "`` separators, and indented besides."""

ENVELOPE_BYTES = 1 << 10
"""A batch's ``{"ops": [...]}`` around its ops, with whitespace."""

TENSOR_ITEM_BYTES = 8 << 10
"""One tensor of a registration: a shm path of up to 4096 bytes or a CUDA IPC handle (base64
handles of about a hundred bytes), a shape of up to 16 dimensions, dtype, device, field names
and whitespace."""

ADMIN_BODY_BYTES = 64 << 10
"""Admin bodies: a policy name and a handful of parameters, or a log level."""

EMPTY_BODY_BYTES = 1 << 10
"""Routes that read no body still take what a client sends out of habit (``{}``, ``null``)."""

MAX_TRANSFER_PARAMS_DEPTH = 32
"""Deepest nesting of ``kv_transfer_params`` (the top-level object is depth 1): engines send flat
objects; the manager holds the value for the request's life and serialises it again."""

_GUARDED = frozenset({"POST", "PUT", "PATCH", "DELETE"})


def body_caps(settings: Settings) -> dict[str, int]:
    """The byte cap of each route that takes a body, by operation id (see the module table)."""
    keys = settings.max_keys_per_call
    keys_op = OP_FIXED_BYTES + keys * KEY_ITEM_BYTES
    tokens = keys * STORE_TOKENS_PER_KEY * TOKEN_ITEM_BYTES
    transfer_op = OP_FIXED_BYTES + keys * (KEY_ITEM_BYTES + BLOCK_ITEM_BYTES)
    start_op = OP_FIXED_BYTES + TRANSFER_PARAMS_WIRE_FACTOR * settings.max_transfer_params_bytes
    caps = {
        "lookup": keys_op,
        "prepare_load": keys_op,
        "touch": keys_op,
        "complete_load": keys_op,
        "prepare_store": keys_op + tokens,
        "complete_store": keys_op,
        "offload": transfer_op + tokens,
        "onload": transfer_op,
        "start_request": start_op,
        "finish_request": EMPTY_BODY_BYTES,
        # Keys, a number and a name: the fixed part holds two string fields at their longest.
        "retain": keys_op,
        "prefetch": keys_op,
        "demote": keys_op,
        "drop": keys_op,
        "renew_retention": OP_FIXED_BYTES,
        "release_retention": EMPTY_BODY_BYTES,
        "cancel_prefetch": EMPTY_BODY_BYTES,
        "batch": ENVELOPE_BYTES
        + settings.max_batch_ops * max(keys_op, transfer_op + tokens, start_op),
        "wait_jobs": OP_FIXED_BYTES + MAX_WAIT_JOBS * JOB_ID_ITEM_BYTES,
        "register_kv_cache": OP_FIXED_BYTES + MAX_TENSORS * TENSOR_ITEM_BYTES,
        "unregister_kv_cache": EMPTY_BODY_BYTES,
        "renew_kv_cache": EMPTY_BODY_BYTES,
        "admin_put_policy": ADMIN_BODY_BYTES,
        "admin_put_log_level": ADMIN_BODY_BYTES,
        "admin_release": EMPTY_BODY_BYTES,
        "admin_clear": EMPTY_BODY_BYTES,
        "admin_release_retention": EMPTY_BODY_BYTES,
    }
    return {name: min(cap, settings.max_body_bytes) for name, cap in caps.items()}


class BodyLimits:
    """Where ``BodyGuardMiddleware`` looks up a call's cap: that of the route its method and
    path select (``app.http.routing``: the first match in route order, as the router picks it),
    else ``default``."""

    def __init__(self, default: int, routes: Iterable[RouteEntry[tuple[str, int]]] = ()) -> None:
        """``routes``: per route that takes a body, its methods, path and (operation id, cap)."""
        self.default = default
        self._routes = RouteMatcher(routes)

    @classmethod
    def for_routes(
        cls, routes: Iterable[BaseRoute], caps: Mapping[str, int], default: int
    ) -> BodyLimits:
        """The table for an app's ``routes``; every route that can take a body needs a cap in
        ``caps`` (by operation id, else route name), or ``ValueError``."""
        table: list[RouteEntry[tuple[str, int]]] = []
        for order, route in enumerate(routes):
            if not isinstance(route, Route) or not route.methods:
                continue
            methods = frozenset(route.methods) & _GUARDED
            if not methods:
                continue
            name = getattr(route, "operation_id", None) or route.name
            if name not in caps:
                raise ValueError(
                    f"route {name!r} ({', '.join(sorted(methods))} {route.path}) takes a body "
                    "but has no cap in app.http.limits.body_caps"
                )
            table.append(
                RouteEntry(order, methods, route.path, route.path_regex, (name, caps[name]))
            )
        return cls(default, table)

    def limit_for(self, method: str, path: str) -> tuple[int, str | None]:
        """The cap for a call and the operation id it belongs to (None: no route matched)."""
        entry = self._routes.match(method, path)
        if entry is None:
            return self.default, None
        name, limit = entry.value
        return limit, name


# --------------------------------------------------------------------------- kv_transfer_params


def transfer_params_error(params: Mapping[str, Any] | None, limit: int) -> APIError | None:
    """Why ``params`` may not be kept with a request, or None when it may.

    Its size is that of its compact JSON (``separators=(",", ":")``, UTF-8, no escapes beyond
    JSON's own), whatever the caller's spelling; over ``limit`` bytes, or nested deeper than
    ``MAX_TRANSFER_PARAMS_DEPTH``: 413 ``transfer_params_too_large``. 413 rather than 422
    because, like too many keys, it is a size limit of this service (a setting), not a value
    the schema forbids: the caller can send the same request with smaller parameters.
    """
    if not params:
        return None
    text = json.dumps(params, separators=(",", ":"), ensure_ascii=False)
    # surrogatepass: JSON may carry a lone surrogate (\ud800), which UTF-8 cannot encode.
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > limit:
        return APIError(
            413,
            "transfer_params_too_large",
            f"kv_transfer_params is {size} bytes as compact JSON; the limit is {limit} "
            "(max_transfer_params_bytes)",
        )
    # Only a value with that many brackets can be that deep (brackets inside strings only
    # make the walk happen when it need not).
    if text.count("{") + text.count("[") > MAX_TRANSFER_PARAMS_DEPTH:
        depth = _depth(params, MAX_TRANSFER_PARAMS_DEPTH)
        if depth > MAX_TRANSFER_PARAMS_DEPTH:
            return APIError(
                413,
                "transfer_params_too_large",
                f"kv_transfer_params nests more than {MAX_TRANSFER_PARAMS_DEPTH} levels deep",
            )
    return None


def _depth(value: object, limit: int) -> int:
    """Nesting depth of a JSON value (a scalar is 0), counted up to ``limit + 1``."""
    deepest = 0
    stack: list[tuple[object, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Iterable[object] = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > deepest:
            deepest = depth
            if deepest > limit:
                return deepest
        stack.extend((c, depth + 1) for c in children if isinstance(c, dict | list))
    return deepest


# --------------------------------------------------------------------------- batch op count

_WS = re.compile(r"[ \t\n\r]*")
_DECODER = json.JSONDecoder()


def batch_exceeds_ops(raw: bytes | bytearray, limit: int) -> bool:
    """True when the batch body ``raw`` holds more than ``limit`` ops, found without parsing
    the ops past the first ``limit + 1``; False when it does not, and when the count cannot
    tell (the parser then decides, and the count is checked again on the parsed ops).

    Two cheap bounds come first, so most bodies are never walked: a body shorter than
    ``limit + 1`` one-byte elements, or one with fewer than ``limit`` commas not right after a
    closing quote, cannot hold more than ``limit`` ops that are not strings (each op but the
    last is followed by a comma; one after a non-string value is not preceded by ``"``).
    Lists of keys (strings) therefore cost one count. A flood of strings passes both bounds
    and is refused by the parser at its first element (``ops`` is ``fail_fast``).

    The walk reads ``{"ops": [...]}`` (key escapes decoded, whitespace anywhere), one element
    at a time with the C JSON decoder, and stops at element ``limit + 1``. Any other shape
    (another member first, malformed JSON) gives False. Of duplicate ``ops`` members the first
    is counted.
    """
    if len(raw) < 2 * limit + len('{"ops":[]}'):
        return False
    commas = raw.count(b",")
    if commas < limit or commas - raw.count(b'",') < limit:
        return False
    # Latin-1 maps each byte to one character, so the walk sees the JSON structure unchanged
    # (UTF-8 sequences only occur inside strings) in a string one byte per character.
    return _walk_ops(raw.decode("latin-1"), limit)


def _skip_ws(text: str, pos: int) -> int:
    match = _WS.match(text, pos)
    return pos if match is None else match.end()  # the pattern matches empty: never None


def _walk_ops(text: str, limit: int) -> bool:
    ws = _skip_ws
    try:
        pos = ws(text, 0)
        if not text.startswith("{", pos):
            return False
        pos = ws(text, pos + 1)
        if not text.startswith('"', pos):
            return False
        key, pos = _DECODER.raw_decode(text, pos)  # a string: escapes decoded
        pos = ws(text, pos)
        if key != "ops" or not text.startswith(":", pos):
            return False
        pos = ws(text, pos + 1)
        if not text.startswith("[", pos):
            return False
        pos = ws(text, pos + 1)
        count = 0
        while not text.startswith("]", pos):
            _, pos = _DECODER.raw_decode(text, pos)
            count += 1
            if count > limit:
                return True
            pos = ws(text, pos)
            if text.startswith(",", pos):
                pos = ws(text, pos + 1)
            elif not text.startswith("]", pos):
                return False
        return False
    except (ValueError, RecursionError):  # malformed or absurdly deep: the parser says why
        return False
