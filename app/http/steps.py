"""Large engine calls in steps: no call holds the event loop for long (issue #42, finding 10).

Every tenant's calls share one event loop, so a call that holds it for tens of milliseconds
delays every other tenant's calls by as much. A call gives way (``app.core.slices``) once it has
held the loop 1 ms since it last gave way; a call that ends sooner never gives way.

**Reading in steps** (``value_at``). A large body is never decoded whole: each value (a
batch's op) is decoded from a window of the body that starts at it.

**Validation in steps** (``OpParser``). A body's long lists (``keys``, ``token_ids``,
``device_blocks``: more than ``STEP_ITEMS`` items; 8,192 keys cost about 4 ms validated
whole) are validated ``STEP_ITEMS`` items at a time with the same element types (hex keys
decoded in pydantic-core), the rest of the body with those lists left out and their lengths in
the validation context (``schemas.list_length``: the checks that compare lengths see the
real ones). The body is the one a whole validation gives, and a body with one error is refused
with the same error; of a body with several, the rest's are named before the lists'.

**Running in steps** (``Slices.run`` with the namespace's manager). An op of more than
``STEP_KEYS`` keys with a ``run_steps`` or ``run_sliced`` (``app.http.operations``) runs as a
generator over the manager's ``*_steps`` verbs; while it gives way the manager is suspended
(``manager.suspend``), so any other call that reaches it first finishes the op: to every other
caller it is one call.
"""

from __future__ import annotations

import json
import json.scanner
import re
from collections.abc import Callable, Generator
from typing import Any, TypeVar

from pydantic import ConfigDict, TypeAdapter, ValidationError

from app.http import schemas as s
from app.http.errors import validation_error

T = TypeVar("T")

#: Items of a long list validated in one step (about 0.2 ms for hex keys).
STEP_ITEMS = 512


_WIRE = ConfigDict(strict=True, val_json_bytes="hex")
#: The body fields that may be long lists, each with the validator of a piece of it (the
#: element type the models declare, with the bodies' wire config).
_PIECES: dict[str, Callable[[str], list[Any]]] = {
    "keys": TypeAdapter(list[s.HexKey], config=_WIRE).validate_json,
    "token_ids": TypeAdapter(list[s.TokenId], config=_WIRE).validate_json,
    "device_blocks": TypeAdapter(list[s.BlockIndex], config=_WIRE).validate_json,
}


# Like pydantic's parser, it takes NaN and Infinity (the fields refuse them).
_DECODER = json.JSONDecoder()
_SCAN = json.scanner.make_scanner(_DECODER)  # type: ignore[arg-type]
_WS = re.compile(r"[ \t\n\r]*")
# One element of a long list as plain text: a string without escapes, commas or control
# characters (a hex key), or an integer (a token id, a device block), with its whitespace.
_ITEM = r'[ \t\n\r]*(?:"[^"\\,\x00-\x1f]*"|-?(?:0|[1-9][0-9]*))[ \t\n\r]*'
_LAST = re.compile(_ITEM + r"\]")
_RUNS: dict[int, re.Pattern[str]] = {}

#: The first window of a body decoded to find one value in it (doubled until the value fits).
WINDOW_BYTES = 1 << 20


class ListText:
    """A long list member left as its JSON text, in pieces of at most ``STEP_ITEMS``
    elements: (a piece's text, its element count). Each piece is validated from its text."""

    __slots__ = ("pieces",)

    def __init__(self, pieces: list[tuple[str, int]]) -> None:
        self.pieces = pieces

    def __len__(self) -> int:
        return sum(n for _, n in self.pieces)


def value_at(raw: bytes | bytearray, pos: int) -> Generator[None, None, tuple[Any, str, int]]:
    """The JSON value that starts at byte ``pos`` of ``raw``: (the value, its text, the byte
    after it). Found by decoding a window of the body from ``pos``, doubled until it holds the
    value, never the whole body at once (decoding a body of 6.7 MB into fresh memory held the
    served process's loop about 5 ms). In an object, a member that may be a long list
    (``keys``, ``token_ids``, ``device_blocks``) of plain elements is left as its text
    (``ListText``), a piece a step: the C decoder makes no Python object per element, and no
    step reads the whole list. ``validation_error`` (400) when it is not JSON."""
    size = WINDOW_BYTES
    while True:
        stop = min(len(raw), pos + size)
        while stop < len(raw) and raw[stop] & 0xC0 == 0x80:  # not inside a character
            stop -= 1
        try:
            text = raw[pos:stop].decode()
            if text.startswith("{"):
                value, end = yield from _scan_object(text, 0)
            else:
                value, end = _DECODER.raw_decode(text)
        except UnicodeDecodeError:
            raise validation_error([{"type": "json_invalid"}]) from None
        except json.JSONDecodeError:
            if stop >= len(raw):
                raise validation_error([{"type": "json_invalid"}]) from None
            size *= 2  # the value goes on past the window
            yield
            continue
        # A str index is a byte offset when the text is ASCII (O(1) to tell).
        used = end if text.isascii() else len(text[:end].encode())
        return value, text[:end], pos + used


def _scan(text: str, pos: int) -> tuple[Any, int]:
    """The C decoder's value at ``pos`` and the index after it."""
    try:
        return _SCAN(text, pos)
    except StopIteration as gone:  # no value there (inside a generator: not to escape as such)
        raise json.JSONDecodeError("Expecting value", text, gone.value) from None


def _scan_object(text: str, pos: int) -> Generator[None, None, tuple[dict[str, Any], int]]:
    """The object at ``pos`` (its ``{``), member by member, as ``json`` reads it (of a name
    given twice, the last), its possibly long lists as ``ListText``; the index after it."""
    obj: dict[str, Any] = {}
    pos = _WS.match(text, pos + 1).end()  # type: ignore[union-attr]
    if text.startswith("}", pos):
        return obj, pos + 1
    while True:
        if not text.startswith('"', pos):
            raise json.JSONDecodeError("Expecting property name", text, pos)
        name, pos = _scan(text, pos)
        pos = _WS.match(text, pos).end()  # type: ignore[union-attr]
        if not text.startswith(":", pos):
            raise json.JSONDecodeError("Expecting ':'", text, pos)
        pos = _WS.match(text, pos + 1).end()  # type: ignore[union-attr]
        listed = None
        if name in _PIECES and text.startswith("[", pos):
            listed = yield from _scan_list(text, pos)
        if listed is None:
            obj[name], pos = _scan(text, pos)
        else:
            obj[name], pos = listed
        pos = _WS.match(text, pos).end()  # type: ignore[union-attr]
        sep = text[pos : pos + 1]
        if sep == "}":
            return obj, pos + 1
        if sep != ",":
            raise json.JSONDecodeError("Expecting ',' delimiter", text, pos)
        pos = _WS.match(text, pos + 1).end()  # type: ignore[union-attr]


def _scan_list(text: str, pos: int) -> Generator[None, None, tuple[ListText, int] | None]:
    """The list at ``pos`` (its ``[``) as ``ListText`` and the index after it, a piece a
    step; None when an element is not plain (the caller decodes the list whole)."""
    run = _RUNS.get(STEP_ITEMS)
    if run is None:
        run = _RUNS[STEP_ITEMS] = re.compile(f"(?:{_ITEM},){{0,{STEP_ITEMS}}}")
    start = pos + 1
    after = _WS.match(text, start).end()  # type: ignore[union-attr]
    if text.startswith("]", after):
        return ListText([]), after + 1
    pieces: list[tuple[str, int]] = []
    while True:
        end = run.match(text, start).end()  # type: ignore[union-attr]
        count = text.count(",", start, end)  # one a plain element
        if count == STEP_ITEMS:
            pieces.append((text[start : end - 1], count))
            start = end
            yield
            continue
        last = _LAST.match(text, end)
        if last is None:
            return None
        pieces.append((text[start : last.end() - 1], count + 1))
        return ListText(pieces), last.end()


def long_lists(value: Any) -> list[str]:
    """The fields of a decoded body ``value`` to validate in steps: none unless some list is
    longer than ``STEP_ITEMS``; then those, and every list left as text."""
    if type(value) is not dict:
        return []
    lists = [n for n in _PIECES if isinstance(value.get(n), list | ListText)]
    if not any(len(value[n]) > STEP_ITEMS for n in lists):
        return []
    return [n for n in lists if len(value[n]) > STEP_ITEMS or type(value[n]) is ListText]


class OpParser:
    """Validate a body (a model or a union of them) whole, or in steps; see the module."""

    def __init__(self, model: Any, tag: str | None = None) -> None:
        self.validate_json = TypeAdapter(model).validate_json
        # A union of bodies told apart by the field ``tag``: its errors are named under the
        # member's tag, as pydantic names them.
        self.tag = tag

    def whole(self, raw: str | bytes | bytearray, loc: tuple[str | int, ...] = ()) -> Any:
        """The body ``raw`` validated in one step; errors are named under ``loc``."""
        try:
            return self.validate_json(raw)
        except ValidationError as exc:
            raise _named(exc, loc, 0) from None

    def body_steps(self, raw: bytes | bytearray) -> Generator[None, None, Any]:
        """The body ``raw`` (a whole request body) validated in steps when it has long lists,
        else whole."""
        start = len(raw) - len(raw.lstrip())
        value, _, end = yield from value_at(raw, start)
        if raw[end:].strip():
            raise validation_error([{"type": "json_invalid"}])
        lists = long_lists(value)
        if not lists:
            return self.whole(raw)
        yield
        return (yield from self.steps(value, lists))

    def steps(
        self, value: dict[str, Any], lists: list[str], loc: tuple[str | int, ...] = ()
    ) -> Generator[None, None, Any]:
        """Validate the decoded body ``value`` whose ``lists`` are long (``long_lists``): the
        rest first, then each list ``STEP_ITEMS`` items a step; the body."""
        rest = dict(value)
        lengths = {}
        for name in lists:
            lengths[name] = len(value[name])
            rest[name] = []
        try:
            body = self.validate_json(json.dumps(rest), context={s.LIST_LENGTHS: lengths})
        except ValidationError as exc:
            raise _named(exc, loc, 0) from None
        if self.tag is not None:
            loc = (*loc, value[self.tag])  # valid: the rest was
        done: dict[str, list[Any]] = {}
        for name in lists:
            items = value[name]
            if type(items) is ListText:  # each piece validated from its own text
                pieces = [f"[{text}]" for text, _ in items.pieces]
            else:
                pieces = [
                    json.dumps(items[i : i + STEP_ITEMS]) for i in range(0, len(items), STEP_ITEMS)
                ]
            piece = _PIECES[name]
            out: list[Any] = []
            for text in pieces:
                yield
                try:
                    out += piece(text)
                except ValidationError as exc:
                    raise _named(exc, (*loc, name), len(out)) from None
            done[name] = out
        return body.model_copy(update=done)


def _named(exc: ValidationError, loc: tuple[str | int, ...], offset: int) -> Exception:
    """``exc``'s refusal, its errors' places under ``loc`` (a list piece's indexes moved on by
    ``offset``, the piece's place in its list)."""
    errors = exc.errors(include_url=False, include_input=False)
    for e in errors:
        where = e["loc"]
        if offset and where and isinstance(where[0], int):
            where = (where[0] + offset, *where[1:])
        e["loc"] = (*loc, *where)
    return validation_error(errors)
