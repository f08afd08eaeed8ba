"""Every condition reason the operator can write is in status/reasons.py's REASONS, and nothing else is there.

The package is read as source (its AST), so a new reason written anywhere (a condition, a failure, a mapping
of kubelet or exit reasons, a `reason = ...` choice) fails here until REASONS lists it.
"""

import ast
from collections.abc import Iterator
from pathlib import Path

import eagle3_operator
from eagle3_operator.status import reasons
from eagle3_operator.status.conditions import CONDITION_TYPES
from eagle3_operator.status.reasons import FAILURE_PRIORITY, REASONS

PACKAGE = Path(eagle3_operator.__file__).parent
# The calls that take a condition reason, and the position of that reason among their arguments.
REASON_ARGUMENT = {"Condition": 1, "Failure": 0, "quiet": 1}
# Module-level mappings whose values are reasons (kubelet waiting reasons, server exit codes).
REASON_MAPPINGS = {"WAITING_FAILURES", "SERVER_EXIT_REASONS"}
CONSTANTS = {
    name: value for name, value in vars(reasons).items() if name.isupper() and isinstance(value, str)
}


def _called(call: ast.Call) -> str | None:
    func = call.func
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None


def _reason_expressions(tree: ast.AST) -> Iterator[ast.expr]:
    """Every expression that can become a condition's reason."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and (index := REASON_ARGUMENT.get(_called(node) or "")) is not None:
            if len(node.args) > index:
                yield node.args[index]
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name) and target.id == "reason":
                    yield node.value
                elif isinstance(target, ast.Name) and target.id in REASON_MAPPINGS:
                    assert isinstance(node.value, ast.Dict)
                    yield from (value for value in node.value.values if value is not None)
                elif isinstance(target, ast.Tuple) and any(
                    isinstance(e, ast.Name) and e.id == "reason" for e in target.elts
                ):
                    position = next(i for i, e in enumerate(target.elts) if getattr(e, "id", "") == "reason")
                    yield from _tuple_elements(node.value, position)


def _tuple_elements(value: ast.expr, position: int) -> Iterator[ast.expr]:
    if isinstance(value, ast.Tuple):
        yield value.elts[position]
    elif isinstance(value, ast.IfExp):
        yield from _tuple_elements(value.body, position)
        yield from _tuple_elements(value.orelse, position)


def _written(expression: ast.expr) -> Iterator[str]:
    """The reasons an expression can write; an expression computed elsewhere (failure.reason, a lookup in
    one of REASON_MAPPINGS) yields nothing here, its source is scanned where it is written."""
    if isinstance(expression, ast.IfExp):
        yield from _written(expression.body)
        yield from _written(expression.orelse)
    elif isinstance(expression, ast.Constant) and isinstance(expression.value, str):
        yield expression.value  # a literal: it must still be in REASONS
    elif isinstance(expression, ast.Attribute) and getattr(expression.value, "id", None) == "reasons":
        yield CONSTANTS[expression.attr]
    elif isinstance(expression, ast.Name) and expression.id in CONSTANTS:
        yield CONSTANTS[expression.id]


def _scan() -> dict[str, list[str]]:
    """Each reason the package writes, with where."""
    found: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "reasons.py":
            continue
        for expression in _reason_expressions(ast.parse(path.read_text(), str(path))):
            for reason in _written(expression):
                found.setdefault(reason, []).append(f"{path.relative_to(PACKAGE)}:{expression.lineno}")
    return found


def test_every_reason_the_package_writes_is_in_REASONS() -> None:
    unlisted = {reason: where for reason, where in _scan().items() if reason not in REASONS}
    assert not unlisted, f"add these to status/reasons.py's REASONS: {unlisted}"


def test_every_reason_in_REASONS_is_written_somewhere() -> None:
    """The scan sees the whole package: a listed reason nothing writes would be a stale entry (or a blind
    scan)."""
    assert set(REASONS) - set(_scan()) == set()


def test_reasons_are_written_as_constants_not_literals() -> None:
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "reasons.py":
            continue
        for expression in _reason_expressions(ast.parse(path.read_text(), str(path))):
            literal = isinstance(expression, ast.Constant) and isinstance(expression.value, str)
            assert not literal, f"{path.name}:{expression.lineno}: use reasons.* for {expression.value!r}"


def test_each_reason_names_condition_types_that_exist() -> None:
    for reason, types in REASONS.items():
        assert types and types <= set(CONDITION_TYPES), reason


def test_failures_can_appear_on_every_condition_and_the_rest_never_degrade() -> None:
    for reason, types in REASONS.items():
        assert (reasons.DEGRADED in types) == (reason in FAILURE_PRIORITY or reason == reasons.AS_EXPECTED)
    assert REASONS[reasons.AS_EXPECTED] == {reasons.DEGRADED}
    assert len(set(FAILURE_PRIORITY)) == len(FAILURE_PRIORITY)
