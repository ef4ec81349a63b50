"""User prompts: the sandboxed jinja2 environment they render in and what a trace row offers them.

A prompt template is checked when the scenario is read (syntax) and rendered once per planned
request; ``fmt`` rounds numbers and writes a missing KPI as ``n/a``. The sandbox and
``StrictUndefined`` make a typo fail loudly instead of sending a prompt with a hole in it.
"""

from __future__ import annotations

import math
from datetime import datetime
from typing import TYPE_CHECKING, Any

from ricllm.replay.traces import KpiRow

if TYPE_CHECKING:  # jinja2 is imported on first use: a replay that never renders does not load it
    from jinja2.sandbox import SandboxedEnvironment


def _fmt(value: Any, digits: int = 1) -> str:
    """Numbers rounded for a prompt; a missing KPI reads 'n/a' instead of 'None'."""
    if value is None:
        return "n/a"
    if isinstance(value, float) and not math.isfinite(value):
        return "n/a"
    if isinstance(value, (int, float)):
        return f"{value:.{digits}f}"
    return str(value)


def jinja_env() -> SandboxedEnvironment:
    """Sandboxed (a scenario is user input), strict about undefined names, with the ``fmt`` filter."""
    from jinja2 import StrictUndefined
    from jinja2.sandbox import SandboxedEnvironment

    env = SandboxedEnvironment(undefined=StrictUndefined, autoescape=False, keep_trailing_newline=False)
    env.filters["fmt"] = _fmt
    return env


def check_template(text: str) -> str:
    """The template itself, if it parses; a ValueError naming its line otherwise (a field validator)."""
    from jinja2 import TemplateSyntaxError

    try:
        jinja_env().parse(text)
    except TemplateSyntaxError as exc:
        raise ValueError(f"jinja2 template syntax error on its line {exc.lineno}: {exc.message}") from None
    return text


def prompt_context(row: KpiRow, **extra: Any) -> dict[str, Any]:
    """What a user prompt may use: entity, time_s, timestamp, kpi[NAME], extras[COLUMN], and more."""
    stamp = row.timestamp.isoformat() if isinstance(row.timestamp, datetime) else row.timestamp
    return {"entity": row.entity, "time_s": row.time_s, "timestamp": stamp, "kpi": dict(row.kpis),
            "extras": dict(row.extras), "line": row.line, **extra}
