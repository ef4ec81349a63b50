"""The short terminal summary of a replay (rich tables): the numbers an operator looks at first."""

from __future__ import annotations

from typing import Any

from ricllm.report.aggregate import fmt_value

SUMMARY_COLUMNS = (
    ("sent", "sent"), ("admitted", "admitted"), ("rejected", "rejected"), ("met_of_admitted", "met % adm."),
    ("met_of_sent", "met % sent"), ("goodput_rps", "goodput"), ("p95_ttft_s", "TTFT p95"),
    ("p95_e2e_s", "E2E p95"), ("prefix_cache_hit_rate", "cache hit"),
)
DECISION_COLUMNS = (
    ("answered", "answered"), ("valid_of_answered", "valid % answ."), ("correct_of_answered", "correct % answ."),
    ("useful", "useful"), ("useful_of_sent", "useful % sent"), ("useful_goodput_rps", "useful goodput"),
)


def _console(console=None):
    from rich.console import Console

    if console is not None:
        return console
    probe = Console()
    return Console(highlight=False, width=None if probe.is_terminal else 140)


def print_summary(report: dict[str, Any], console=None) -> None:
    """One row per deadline class plus overall, the decisions' table when answers were judged, then
    each target with pass or FAIL."""
    console = _console(console)
    run = report["run"]
    title = (f"replay {report['scenario']['name']}: {run['sent']} requests in {run['wall_s']:.1f} s"
             + (" (interrupted)" if run.get("interrupted") else ""))
    aggregates = report["aggregates"]
    scopes = {**aggregates["classes"], "overall": aggregates["overall"]}
    console.print(_scope_table(title, SUMMARY_COLUMNS, scopes))
    if any(s.get("valid_of_answered") is not None for s in scopes.values()):
        console.print(_scope_table("decisions: valid, correct and useful (valid, correct, in time) answers",
                                   DECISION_COLUMNS, scopes))
    overall = aggregates["overall"]
    if overall.get("rejected_by_reason"):
        console.print("rejected by reason: " + fmt_value("rejected_by_reason", overall["rejected_by_reason"]))
    for target in report.get("targets", []):
        mark = "[green]pass[/green]" if target["passed"] else "[red]FAIL[/red]"
        console.print(f"{mark}  {target['scope']}: {target['target']} "
                      f"(measured {fmt_value(target['metric'], target['value'])})")


def _scope_table(title: str, columns: tuple[tuple[str, str], ...], scopes: dict[str, dict[str, Any]]):
    from rich.table import Table

    table = Table(title=title)
    table.add_column("class")
    for _, label in columns:
        table.add_column(label, justify="right")
    for scope, summary in scopes.items():
        table.add_row(scope, *(fmt_value(metric, summary.get(metric)) for metric, _ in columns))
    return table


def print_comparison(rows: list[list[str]], labels: tuple[str, str], console=None) -> None:
    """The comparison table: scope, metric, A, B, change."""
    from rich.table import Table

    console = _console(console)
    table = Table(title=f"{labels[0]} vs {labels[1]}")
    for name in ("scope", "metric"):
        table.add_column(name)
    for name in (*labels, "change"):
        table.add_column(name, justify="right")
    previous = None
    for scope, *rest in rows:
        table.add_row("" if scope == previous else scope, *rest)
        previous = scope
    console.print(table)
