"""Compliance targets: ``"met_of_admitted >= 0.99"``, one metric of the report against a number.

A target is checked twice: when the scenario is read (an unknown metric fails at once, with the
list of metrics) and by ``ricllm.report.aggregate.evaluate_targets`` once the run is over.
Plain regular-expression parsing, no evaluator: a target is never more than ``METRIC OP NUMBER``.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Callable
from dataclasses import dataclass

TARGET_METRICS = ("met_of_admitted", "met_of_sent", "client_met_of_sent", "admitted_of_sent",
                  "rejected_of_sent", "goodput_rps", "prefix_cache_hit_rate",
                  "valid_of_answered", "correct_of_answered", "useful_of_sent", "useful_goodput_rps",
                  "p50_ttft_s", "p95_ttft_s", "p99_ttft_s", "p50_e2e_s", "p95_e2e_s", "p99_e2e_s",
                  # fault phases (docs/replay.md): requests admitted before the slowdown detector
                  # reacted are counted apart; the rest are held to their deadlines
                  "met_of_admitted_outside_window", "missed_outside_window", "window_missed", "window_max_late_ms")
TARGET_OPS: dict[str, Callable[[float, float], bool]] = {
    ">=": operator.ge, "<=": operator.le, ">": operator.gt, "<": operator.lt, "==": operator.eq}
_TARGET = re.compile(r"^\s*([a-z0-9_]+)\s*(>=|<=|==|>|<)\s*([-+]?[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*$")


@dataclass(frozen=True)
class Target:
    metric: str
    op: str
    value: float

    def holds(self, actual: float | None) -> bool:
        return actual is not None and TARGET_OPS[self.op](actual, self.value)

    def __str__(self) -> str:
        return f"{self.metric} {self.op} {self.value:g}"


def parse_target(text: str) -> Target:
    """``"met_of_admitted >= 0.99"`` -> Target; the message lists the metrics when one is unknown."""
    match = _TARGET.match(text)
    if match is None:
        raise ValueError(f"target {text!r} is not 'METRIC OP NUMBER' (OP one of {', '.join(TARGET_OPS)})")
    metric, op, number = match.groups()
    if metric not in TARGET_METRICS:
        raise ValueError(f"target {text!r}: unknown metric {metric!r}; choose one of {', '.join(TARGET_METRICS)}")
    return Target(metric, op, float(number))
