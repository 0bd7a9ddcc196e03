"""A small PromQL scanner for checking deploy/ against deploy/metrics_catalogue.json.

It is not a parser: it finds what an expression *refers to* - metric (or recording-rule) names
with their label matchers, the labels named in ``by``/``without``/``on``/``ignoring``/
``group_left``/``group_right`` clauses, and the functions called. Range and subquery brackets
(``[5m]``, ``[$__rate_interval]``, ``[1h:5m]``) are skipped; Grafana variables (``$job``,
``${datasource}``) are kept as opaque values.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

AGGREGATIONS = frozenset(
    {
        "sum",
        "min",
        "max",
        "avg",
        "group",
        "stddev",
        "stdvar",
        "count",
        "count_values",
        "bottomk",
        "topk",
        "quantile",
        "limitk",
        "limit_ratio",
    }
)
GROUPING_KEYWORDS = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right"})
OTHER_KEYWORDS = frozenset({"bool", "and", "or", "unless", "offset", "atan2", "inf", "nan"})

_TOKEN = re.compile(
    r"""
    (?P<ws>\s+)
  | (?P<comment>\#[^\n]*)
  | (?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|`[^`]*`)
  | (?P<var>\$\{[^}]*\}|\$[A-Za-z_][A-Za-z0-9_]*)
  | (?P<number>0x[0-9a-fA-F]+
      |(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?(?:(?:ms|[smhdwy])(?:[0-9]+(?:ms|[smhdwy]))*)?)
  | (?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)
  | (?P<op>=~|!~|!=|==|<=|>=|[-+*/%^<>=(){}\[\],@])
    """,
    re.VERBOSE,
)


class PromQLScanError(ValueError):
    """The expression has a character or structure the scanner does not understand."""


@dataclass(frozen=True)
class Token:
    kind: str
    text: str


@dataclass(frozen=True)
class Matcher:
    label: str
    op: str
    value: str


@dataclass
class Selector:
    """A vector selector: ``name{matchers}``; ``name`` is None for ``{__name__=~"..."}``."""

    name: str | None
    matchers: list[Matcher] = field(default_factory=list)


@dataclass
class Analysis:
    selectors: list[Selector] = field(default_factory=list)
    grouping_labels: set[str] = field(default_factory=set)
    functions: set[str] = field(default_factory=set)

    @property
    def metric_names(self) -> set[str]:
        return {s.name for s in self.selectors if s.name is not None}


def tokenize(expr: str) -> list[Token]:
    """Tokens of ``expr`` without whitespace and comments."""
    tokens = []
    pos = 0
    while pos < len(expr):
        m = _TOKEN.match(expr, pos)
        if m is None:
            raise PromQLScanError(f"cannot scan {expr[pos : pos + 20]!r} in {expr!r}")
        kind = m.lastgroup
        assert kind is not None
        if kind not in ("ws", "comment"):
            tokens.append(Token(kind, m.group()))
        pos = m.end()
    return tokens


def unquote(text: str) -> str:
    """The value of a PromQL string literal."""
    if text.startswith("`"):
        return text[1:-1]
    body = text[1:-1]
    return re.sub(r"\\(.)", lambda m: {"n": "\n", "t": "\t"}.get(m.group(1), m.group(1)), body)


def _parse_matchers(tokens: list[Token], i: int, expr: str) -> tuple[list[Matcher], int]:
    """Matchers from the ``{`` at ``tokens[i]``; returns them and the index after ``}``."""
    matchers = []
    i += 1
    while i < len(tokens) and tokens[i].text != "}":
        if tokens[i].text == ",":
            i += 1
            continue
        if i + 2 >= len(tokens):
            raise PromQLScanError(f"unterminated label matchers in {expr!r}")
        label, op, value = tokens[i], tokens[i + 1], tokens[i + 2]
        if (
            label.kind != "ident"
            or op.text not in ("=", "!=", "=~", "!~")
            or value.kind != "string"
        ):
            raise PromQLScanError(f"bad label matcher near {label.text!r} in {expr!r}")
        matchers.append(Matcher(label.text, op.text, unquote(value.text)))
        i += 3
    if i >= len(tokens):
        raise PromQLScanError(f"unterminated label matchers in {expr!r}")
    return matchers, i + 1


def analyse(expr: str) -> Analysis:
    """What ``expr`` refers to: selectors, grouping labels, functions."""
    tokens = tokenize(expr)
    out = Analysis()
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        nxt = tokens[i + 1] if i + 1 < len(tokens) else None
        if tok.text == "[":
            depth = 0
            while i < len(tokens):
                depth += {"[": 1, "]": -1}.get(tokens[i].text, 0)
                i += 1
                if depth == 0:
                    break
            else:
                raise PromQLScanError(f"unterminated range in {expr!r}")
            continue
        if tok.text == "{":
            matchers, i = _parse_matchers(tokens, i, expr)
            names = [m.value for m in matchers if m.label == "__name__" and m.op == "="]
            out.selectors.append(Selector(names[0] if names else None, matchers))
            continue
        if tok.kind != "ident":
            i += 1
            continue
        word = tok.text.lower()
        if word in GROUPING_KEYWORDS:
            i += 1
            if nxt is not None and nxt.text == "(":
                i += 1
                while i < len(tokens) and tokens[i].text != ")":
                    if tokens[i].kind == "ident":
                        out.grouping_labels.add(tokens[i].text)
                    elif tokens[i].text != ",":
                        raise PromQLScanError(f"bad label list near {tokens[i].text!r}")
                    i += 1
                i += 1
            continue
        if word in OTHER_KEYWORDS:
            i += 1
            continue
        if word in AGGREGATIONS or (nxt is not None and nxt.text == "("):
            out.functions.add(tok.text)
            i += 1
            continue
        selector = Selector(tok.text)
        i += 1
        if i < len(tokens) and tokens[i].text == "{":
            selector.matchers, i = _parse_matchers(tokens, i, expr)
        out.selectors.append(selector)
    return out


_LABEL_VALUES = re.compile(r"^\s*label_values\(\s*(?:(?P<selector>.+),\s*)?(?P<label>\w+)\s*\)\s*$")


def analyse_variable_query(query: str) -> tuple[Analysis, str | None]:
    """A Grafana Prometheus variable query: ``label_values(selector, label)`` or PromQL.

    Returns the analysis of the selector (or of the whole query) and the label asked for.
    """
    m = _LABEL_VALUES.match(query)
    if m is None:
        return analyse(query), None
    selector = m.group("selector")
    return (analyse(selector) if selector else Analysis()), m.group("label")
