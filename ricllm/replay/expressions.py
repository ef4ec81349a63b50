"""The threshold-expression language: ``RRU.PrbUsedDl / RRU.PrbAvailDl > 0.8`` over one row's KPIs.

A threshold is parsed with ``ast`` into a small closure tree over KPI names, numbers, ``+ - * /``,
comparisons and ``and``/``or``/``not``; nothing is ever passed to ``eval``. KPI names may hold
dots and dashes (``L1M.DL-SS-RSRP``), so the names the trace declares, and any name in
`backticks`, are swapped for identifiers before ``ast`` sees the text.

Invariant: a comparison that reads a KPI the row lacks (or divides by zero) is false, never an
error, so a gap in a trace silences a trigger instead of stopping the replay. ``missing(KPI)`` is
true exactly when the row lacks that KPI, so a rule can say what a gap means
(``missing(RRU.PrbUsedDl) or RRU.PrbUsedDl > 90``). This module stands
alone (no scenario, no pydantic): it knows expressions and KPI mappings only.
"""

from __future__ import annotations

import ast
import operator
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any


class _Missing(Exception):
    """A KPI the row does not have: the comparison that reads it is false."""


_COMPARE = {ast.Lt: operator.lt, ast.LtE: operator.le, ast.Gt: operator.gt, ast.GtE: operator.ge,
            ast.Eq: operator.eq, ast.NotEq: operator.ne}
_ARITH = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
_PLACEHOLDER = "__kpi{}__"
KpiFn = Callable[[Mapping[str, float | None]], Any]


class Threshold:
    """A compiled threshold: call it with a row's KPIs; a comparison over a missing KPI is false."""

    def __init__(self, text: str, known: Iterable[str]):
        self.text = text
        self.known = sorted(set(known))
        source, self._slots = _substitute_names(text, self.known)
        try:
            tree = ast.parse(source.strip(), mode="eval")
        except SyntaxError as exc:
            raise ValueError(f"threshold {text!r} is not a valid expression: {exc.msg}") from None
        if not isinstance(tree.body, (ast.Compare, ast.BoolOp, ast.Call)) and not (
                isinstance(tree.body, ast.UnaryOp) and isinstance(tree.body.op, ast.Not)):
            raise ValueError(f"threshold {text!r} must be a comparison, e.g. 'RRU.PrbUsedDl / RRU.PrbAvailDl > 0.8', "
                             "or missing(KPI)")
        self.names: list[str] = []
        self._fn = self._build(tree.body)
        self.signal = self._signal(tree.body)

    def __call__(self, kpis: Mapping[str, float | None]) -> bool:
        return bool(self._fn(kpis))

    def _signal(self, node: ast.AST) -> tuple[str, KpiFn, float] | None:
        """For ``EXPR OP NUMBER``: EXPR's text, its function and the number, so a report can plot
        the signal against its threshold; None for other shapes."""
        if not (isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.comparators[0], ast.Constant)):
            return None
        text = ast.unparse(node.left)
        for placeholder, kpi in self._slots.items():
            text = text.replace(placeholder, kpi)
        return text, self._build(node.left), float(node.comparators[0].value)

    def signal_value(self, kpis: Mapping[str, float | None]) -> float | None:
        """The left side of ``EXPR OP NUMBER`` for one row; None when a KPI is missing."""
        if self.signal is None:
            return None
        try:
            return float(self.signal[1](kpis))
        except (_Missing, ZeroDivisionError):
            return None

    def _build(self, node: ast.AST) -> KpiFn:
        builder = {ast.BoolOp: self._bool, ast.UnaryOp: self._unary, ast.BinOp: self._arith,
                   ast.Compare: self._compare, ast.Constant: self._constant, ast.Name: self._name,
                   ast.Attribute: self._unknown_name, ast.Call: self._missing}.get(type(node))
        if builder is None:
            raise ValueError(f"threshold {self.text!r}: {type(node).__name__} is not allowed; use KPI names, "
                             "numbers, + - * /, comparisons, and/or/not, missing(KPI)")
        return builder(node)

    def _bool(self, node: ast.BoolOp) -> KpiFn:
        parts = [self._build(v) for v in node.values]
        if isinstance(node.op, ast.And):
            return lambda k: all(p(k) for p in parts)
        return lambda k: any(p(k) for p in parts)

    def _unary(self, node: ast.UnaryOp) -> KpiFn:
        inner = self._build(node.operand)
        ops = {ast.Not: operator.not_, ast.USub: operator.neg, ast.UAdd: operator.pos}
        if type(node.op) not in ops:
            raise ValueError(f"threshold {self.text!r}: operator {type(node.op).__name__} is not allowed")
        op = ops[type(node.op)]
        return lambda k: op(inner(k))

    def _arith(self, node: ast.BinOp) -> KpiFn:
        if type(node.op) not in _ARITH:
            raise ValueError(f"threshold {self.text!r}: only + - * / are allowed, not {type(node.op).__name__}")
        left, right, op = self._build(node.left), self._build(node.right), _ARITH[type(node.op)]
        return lambda k: op(left(k), right(k))

    def _compare(self, node: ast.Compare) -> KpiFn:
        if any(type(op) not in _COMPARE for op in node.ops):
            raise ValueError(f"threshold {self.text!r}: only < <= > >= == != comparisons are allowed")
        terms = [self._build(node.left)] + [self._build(c) for c in node.comparators]
        ops = [_COMPARE[type(op)] for op in node.ops]

        def compare(k: Mapping[str, float | None]) -> bool:
            try:
                values = [t(k) for t in terms]
            except (_Missing, ZeroDivisionError):
                return False
            return all(op(a, b) for op, a, b in zip(ops, values, values[1:]))
        return compare

    def _constant(self, node: ast.Constant) -> KpiFn:
        if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
            raise ValueError(f"threshold {self.text!r}: only numbers are allowed as constants, not {node.value!r}")
        value = node.value
        return lambda k: value

    def _name(self, node: ast.Name) -> KpiFn:
        if node.id not in self._slots:
            return self._unknown_name(node)
        name = self._slots[node.id]
        if name not in self.names:
            self.names.append(name)

        def read(k: Mapping[str, float | None]) -> float:
            value = k.get(name)
            if value is None:
                raise _Missing(name)
            return value
        return read

    def _missing(self, node: ast.Call) -> KpiFn:
        """``missing(KPI)``: the row has no value for it (the only call the language has)."""
        if not (isinstance(node.func, ast.Name) and node.func.id == "missing" and len(node.args) == 1
                and not node.keywords and isinstance(node.args[0], (ast.Name, ast.Attribute))):
            raise ValueError(f"threshold {self.text!r}: this Call is not allowed; the only call allowed is "
                             "missing(KPI), with one KPI name")
        read = self._build(node.args[0])  # an unknown name is refused there, naming the trace's KPIs

        def missing(k: Mapping[str, float | None]) -> bool:
            try:
                read(k)
            except _Missing:
                return True
            return False
        return missing

    def _unknown_name(self, node: ast.AST) -> KpiFn:
        name = ast.unparse(node)
        for placeholder, kpi in self._slots.items():
            name = name.replace(placeholder, kpi)
        raise ValueError(f"threshold {self.text!r}: unknown KPI {name!r}; the trace has "
                         f"{', '.join(self.known)} (write other names in `backticks`)")


def _substitute_names(text: str, known: Sequence[str]) -> tuple[str, dict[str, str]]:
    """KPI names (dots, dashes: ``L1M.DL-SS-RSRP``) become identifiers before ``ast`` sees them."""
    slots: dict[str, str] = {}

    def slot(name: str) -> str:
        for placeholder, existing in slots.items():
            if existing == name:
                return placeholder
        placeholder = _PLACEHOLDER.format(len(slots))
        slots[placeholder] = name
        return placeholder

    text = re.sub(r"`([^`]+)`", lambda m: slot(m.group(1)), text)
    for name in sorted(known, key=len, reverse=True):
        pattern = rf"(?<![\w.`]){re.escape(name)}(?![\w.`])"
        text = re.sub(pattern, lambda m, n=name: slot(n), text)
    return text, slots
