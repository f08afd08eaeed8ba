"""PromQL read closely enough to check the names in it: the chart's dashboard and alerts query metrics by
name and label, and a typo there fails silently (an empty panel, an alert that never fires).

No maintained PromQL parser installs into the project's environment without new dependencies, so this is a
small recursive-descent reader of the PromQL subset those queries use: selectors with matchers, ranges,
function calls, aggregations with `by`/`without` (before or after their argument), binary operators with
`bool`/`on`/`ignoring`/`group_left`/`group_right`, numbers and strings; no `offset`, `@` or subqueries.
Anything else is refused, so a query outside the subset fails the check rather than passing unread.
Grafana's `$variables` may stand in strings and ranges.

`read` answers the questions the tests ask: which metric or label names in a query do not exist, given the
series a scrape exposes and the labels each carries, and which labels its result carries.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

_TOKEN = re.compile(
    r"""
    (?P<space>\s+)
    |(?P<string>"(?:\\.|[^"\\])*"|'(?:\\.|[^'\\])*'|`[^`]*`)
    |(?P<range>\[[^\]]*\])
    |(?P<number>(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?)
    |(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)
    |(?P<op>=~|!~|!=|==|>=|<=|[-+*/%^=<>(){},])
    """,
    re.VERBOSE,
)
_RANGE = re.compile(r"\[(\$\w+|(\d+(ms|s|m|h|d|w|y))+)\]")
AGGREGATIONS = frozenset(
    {"sum", "min", "max", "avg", "count", "stddev", "stdvar", "group", "topk", "bottomk", "quantile"}
)
# Functions whose result keeps the labels of their (first) vector argument.
FUNCTIONS = frozenset(
    {
        "rate", "irate", "increase", "delta", "idelta", "deriv", "changes", "resets", "abs", "ceil", "floor",
        "round", "clamp", "clamp_min", "clamp_max", "sort", "sort_desc", "timestamp", "predict_linear",
        "avg_over_time", "min_over_time", "max_over_time", "sum_over_time", "count_over_time",
        "last_over_time", "histogram_quantile", "label_replace", "absent", "absent_over_time", "vector",
    }
)  # fmt: skip
BINARY = frozenset({"+", "-", "*", "/", "%", "^", "==", "!=", ">", "<", ">=", "<=", "and", "or", "unless"})
MATCHERS = frozenset({"=", "!=", "=~", "!~"})


class PromQLError(ValueError):
    """A query outside the subset read here, or not PromQL at all."""


@dataclass(frozen=True)
class Selector:
    metric: str
    labels: tuple[str, ...]  # the label names its matchers use


@dataclass(frozen=True)
class Call:
    function: str
    args: tuple[Node, ...]


@dataclass(frozen=True)
class Aggregation:
    operator: str
    grouping: tuple[str, ...] | None  # None: no clause
    without: bool
    args: tuple[Node, ...]


@dataclass(frozen=True)
class Binary:
    operands: tuple[Node, ...]
    matching: tuple[str, ...] = ()  # labels of on/ignoring/group_left/group_right


@dataclass(frozen=True)
class Literal:
    value: str  # a number, or a string without its quotes


Node = Selector | Call | Aggregation | Binary | Literal


def tokenize(query: str) -> list[tuple[str, str]]:
    tokens, position = [], 0
    while position < len(query):
        match = _TOKEN.match(query, position)
        if match is None:
            raise PromQLError(f"cannot read {query[position : position + 20]!r} in {query!r}")
        kind = match.lastgroup or ""
        if kind == "range" and not _RANGE.fullmatch(match.group()):
            raise PromQLError(f"not a range: {match.group()!r} in {query!r}")
        if kind != "space":
            tokens.append((kind, match.group()))
        position = match.end()
    return tokens


@dataclass
class _Reader:
    query: str
    tokens: list[tuple[str, str]]
    at: int = 0
    _end: tuple[str, str] = field(default=("end", ""))

    def peek(self, offset: int = 0) -> tuple[str, str]:
        index = self.at + offset
        return self.tokens[index] if index < len(self.tokens) else self._end

    def take(self, text: str | None = None) -> tuple[str, str]:
        token = self.peek()
        if token == self._end or (text is not None and token[1] != text):
            raise PromQLError(
                f"expected {text or 'more'!r}, found {token[1] or 'the end'!r} in {self.query!r}"
            )
        self.at += 1
        return token

    def label_list(self) -> tuple[str, ...]:
        self.take("(")
        names = []
        while self.peek()[1] != ")":
            kind, name = self.take()
            if kind != "name":
                raise PromQLError(f"not a label name: {name!r} in {self.query!r}")
            names.append(name)
            if self.peek()[1] == ",":
                self.take(",")
        self.take(")")
        return tuple(names)

    def expression(self) -> Node:
        operands = [self.unary()]
        matching: list[str] = []
        while self.peek()[1] in BINARY:
            self.take()
            if self.peek()[1] == "bool":
                self.take()
            while self.peek()[1] in ("on", "ignoring", "group_left", "group_right"):
                self.take()
                if self.peek()[1] == "(":
                    matching += self.label_list()
            operands.append(self.unary())
        return operands[0] if len(operands) == 1 else Binary(tuple(operands), tuple(matching))

    def unary(self) -> Node:
        if self.peek()[1] in ("-", "+"):
            self.take()
        node = self.primary()
        if self.peek()[0] == "range":
            self.take()
        return node

    def primary(self) -> Node:
        kind, text = self.take()
        if kind == "number":
            return Literal(text)
        if kind == "string":
            return Literal(text[1:-1])
        if text == "(":
            inner = self.expression()
            self.take(")")
            return inner
        if kind != "name":
            raise PromQLError(f"unexpected {text!r} in {self.query!r}")
        if text in AGGREGATIONS:
            return self.aggregation(text)
        if self.peek()[1] == "(":
            if text not in FUNCTIONS:
                raise PromQLError(f"unknown function {text!r} in {self.query!r}")
            return Call(text, self.arguments())
        return Selector(text, self.matchers())

    def aggregation(self, operator: str) -> Aggregation:
        grouping, without = None, False
        if self.peek()[1] in ("by", "without"):
            without = self.take()[1] == "without"
            grouping = self.label_list()
        args = self.arguments()
        if self.peek()[1] in ("by", "without"):
            if grouping is not None:
                raise PromQLError(f"two grouping clauses on {operator} in {self.query!r}")
            without = self.take()[1] == "without"
            grouping = self.label_list()
        return Aggregation(operator, grouping, without, args)

    def arguments(self) -> tuple[Node, ...]:
        self.take("(")
        args = [self.expression()]
        while self.peek()[1] == ",":
            self.take(",")
            args.append(self.expression())
        self.take(")")
        return tuple(args)

    def matchers(self) -> tuple[str, ...]:
        if self.peek()[1] != "{":
            return ()
        self.take("{")
        names = []
        while self.peek()[1] != "}":
            kind, name = self.take()
            operator = self.take()[1]
            value_kind, _ = self.take()
            if kind != "name" or operator not in MATCHERS or value_kind != "string":
                raise PromQLError(f"not a label matcher at {name!r} in {self.query!r}")
            names.append(name)
            if self.peek()[1] == ",":
                self.take(",")
        self.take("}")
        return tuple(names)


def parse(query: str) -> Node:
    reader = _Reader(query, tokenize(query))
    node = reader.expression()
    if reader.peek() != reader._end:
        raise PromQLError(f"unexpected {reader.peek()[1]!r} in {query!r}")
    return node


@dataclass(frozen=True)
class Reading:
    """What a query returns, given the series: its labels (None: a scalar), and every metric or label name
    in it that the series do not have (a selector's metric and matcher labels, an aggregation's grouping,
    label_replace's source label, vector matching's labels)."""

    labels: frozenset[str] | None
    unknown: list[str]


def read(query: str, series: Mapping[str, frozenset[str]]) -> Reading:
    """`query` read against `series` (each series name a scrape exposes -> its label names)."""
    problems: list[str] = []

    def labels(node: Node) -> frozenset[str] | None:
        """The labels a node's result carries (None: a scalar, a string, or not known)."""
        if isinstance(node, Literal):
            return None
        if isinstance(node, Selector):
            if node.metric not in series:
                problems.append(f"metric {node.metric}")
                return None  # nothing more to say about the labels of a metric that is not there
            exposed = series[node.metric]
            problems.extend(f"label {name} on {node.metric}" for name in node.labels if name not in exposed)
            return exposed
        if isinstance(node, Binary):
            operands = [s for s in map(labels, node.operands) if s is not None]
            for name in node.matching:
                if not any(name in s for s in operands):
                    problems.append(f"label {name} in vector matching")
            return frozenset.intersection(*operands) if operands else None
        if isinstance(node, Call):
            vectors = [s for s in map(labels, node.args) if s is not None]
            argument = vectors[0] if vectors else None
            if node.function == "histogram_quantile" and argument is not None:
                if "le" not in argument:
                    problems.append("label le (histogram_quantile of no buckets)")
                return argument - {"le"}
            if node.function == "label_replace" and argument is not None:
                target, source = (_literal(arg) for arg in node.args[1:4:2])
                if source not in argument:
                    problems.append(f"label {source} (label_replace's source)")
                return argument | {target}
            return argument
        aggregated = [labels(arg) for arg in node.args][-1]
        grouping = node.grouping or ()
        if aggregated is None:
            return None if node.without else frozenset(grouping)
        problems.extend(f"label {name} in {node.operator} by" for name in grouping if name not in aggregated)
        if node.grouping is None:
            return frozenset()
        return aggregated - set(grouping) if node.without else frozenset(grouping)

    return Reading(labels(parse(query)), problems)


def _literal(node: Node) -> str:
    if not isinstance(node, Literal):
        raise PromQLError(f"expected a string, found {node!r}")
    return node.value
