"""The short terminal summary of a replay (rich tables): the numbers an operator looks at first."""

from __future__ import annotations

import json

from typing import Any

from ricllm.report.aggregate import fmt_value

SUMMARY_COLUMNS = (
    ("sent", "sent"), ("admitted", "admitted"), ("rejected", "rejected"), ("met_of_admitted", "met % adm."),
    ("met_of_sent", "met % sent"), ("goodput_rps", "goodput"), ("p95_ttft_s", "TTFT p95"),
    ("p95_e2e_s", "E2E p95"), ("prefix_cache_hit_rate", "cache hit"),
)
WINDOW_COLUMNS = (
    ("window_admitted", "in window"), ("window_met", "met"), ("window_missed", "missed"),
    ("window_max_late_ms", "latest miss"), ("admitted_outside_window", "outside"),
    ("missed_outside_window", "missed"), ("met_of_admitted_outside_window", "met % outside"),
)
DECISION_COLUMNS = (
    ("answered", "answered"), ("fallback", "fell back"), ("valid_of_answered", "valid % answ."),
    ("correct_of_answered", "correct % answ."), ("useful", "useful"), ("useful_of_sent", "useful % sent"), ("useful_goodput_rps", "useful goodput"),
)


def audit_lines(audit: dict[str, Any]) -> list[str]:
    """The refusal audit in three lines: false refusals, goodput against the other runs, E2E p95."""
    def share(x: float | None) -> str:
        return "-" if x is None else f"{x:.1%}"

    def ratio(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}x"

    goodput, e2e = audit["goodput"], audit["admitted_e2e_p95_ms"]
    return [
        f"refusal audit: {audit['refused']} of {audit['sent']} deadline requests refused; "
        f"{audit['false_refusals']} would have met their deadline when every request was served "
        f"(false refusals: {share(audit['false_refusal_rate'])} of sent)",
        "  deadlines met: " + ", ".join(f"{name} {figures['met']}" + ("" if name == "deadline" else
                                        f" ({ratio(audit['goodput_vs'][name])})") for name, figures in goodput.items())
        + f"; met % admitted {share(audit['met_of_admitted']['deadline'])}",
        "  admitted E2E p95: " + ", ".join(f"{name} {'-' if ms is None else f'{ms:.0f} ms'}" for name, ms in e2e.items()),
    ]


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
    for line in template_lines(aggregates.get("templates") or {}):
        console.print(line)
    for line in confidence_lines(aggregates.get("confidence") or {}):
        console.print(line)
    phases = (report.get("faults") or {}).get("phases") or []
    if phases:
        for line in fault_lines(report):
            console.print(line)
        console.print(_scope_table("admitted before the slowdown detector reacted (in a reaction window) "
                                   "and after", WINDOW_COLUMNS, scopes))
    overall = aggregates["overall"]
    if overall.get("rejected_by_reason"):
        console.print("rejected by reason: " + fmt_value("rejected_by_reason", overall["rejected_by_reason"]))
    if report.get("audit"):
        for line in audit_lines(report["audit"]):
            console.print(line)
    for target in report.get("targets", []):
        mark = "[green]pass[/green]" if target["passed"] else "[red]FAIL[/red]"
        console.print(f"{mark}  {target['scope']}: {target['target']} "
                      f"(measured {fmt_value(target['metric'], target['value'])})")


def template_lines(templates: dict[str, Any]) -> list[str]:
    """Each judged template: correct beside what always giving its most common expected answer scores."""
    lines = []
    for name, t in templates.items():
        served = f"adapter {t['adapter']}" if t.get("adapter") else "base model"
        lines.append(f"template {name} ({served}): correct {100 * t['correct_of_judged']:.1f}% of {t['judged']} judged; "
                     f"majority baseline {100 * t['majority_share']:.1f}% "
                     f"(always {json.dumps(t['majority_answer'], separators=(',', ':'))})")
    return lines


def confidence_lines(confidence: dict[str, Any]) -> list[str]:
    """Accuracy by confidence: the reliability bins, then accuracy at a few coverages."""
    bins, coverage = confidence.get("reliability") or [], confidence.get("coverage") or []
    if not bins:
        return []
    lines = ["accuracy by confidence (the model's own answers): "
             + "; ".join(f"[{b['low']:.1f}, {b['high']:.1f}) {b['count']} at {100 * b['accuracy']:.0f}%" for b in bins)]
    shown = [c for c in coverage if round(100 * c["coverage"]) % 20 == 0]
    lines.append("accuracy keeping the most confident: " + "; ".join(
        f"{100 * c['coverage']:.0f}% ({c['kept']}, confidence >= {c['min_confidence']:.3f}) {100 * c['accuracy']:.1f}%"
        for c in shown))
    return lines


def fault_lines(report: dict[str, Any]) -> list[str]:
    """Each fault phase: what ran when, when the detector said slow, and its reaction window."""
    faults = report.get("faults") or {}
    lines = []
    for phase in faults.get("phases") or []:
        cpus = phase.get("cpus")
        where = f" on CPUs {','.join(map(str, cpus))}" if cpus else ""
        ran = (f"ran {phase['started_s']:.1f}-{phase['stopped_s']:.1f} s" if phase.get("started_s") is not None
               and phase.get("stopped_s") is not None else "never ran")
        lines.append(f"fault {phase['name']}: {phase['kind']} duty {phase['duty']:g}{where}, "
                     f"{phase['start_s']:.1f}-{phase['stop_s']:.1f} s of the replay ({ran})")
        detector, window = phase.get("detector"), phase.get("window")
        if detector is None or window is None:
            continue
        lines.append("  detector: " + detector_text(detector))
        late = f" (latest {window['max_late_ms']:.1f} ms late)" if window["missed"] else ""
        lines.append(f"  reaction window {window['start_s']:.2f}-{window['end_s']:.2f} s: {window['admitted']} admitted, "
                     f"{window['met']} met, {window['missed']} missed{late}")
    return lines


def detector_text(detector: dict[str, Any]) -> str:
    """When the slowdown detector fired, at what step multiplier, and the timeline's view of the phase."""
    if not detector.get("measured"):
        text = "not measured (over ZeroMQ, or without admission): the reaction window is the whole phase"
    elif detector.get("already_slow"):
        text = f"already said slow when the phase began ({_ratios(detector)})"
    elif detector.get("fired_s") is None:
        text = "did not fire during the phase: the reaction window is the whole phase"
    else:
        text = f"said slow {detector['reaction_ms']:.0f} ms after the start ({_ratios(detector)})"
    extra = []
    if detector.get("peak_step_multiplier") is not None:
        extra.append(f"peak step multiplier {detector['peak_step_multiplier']:.2f}")
    if detector.get("step_slowdown") is not None:
        extra.append(f"median step {detector['step_ms_before']:.1f} -> {detector['step_ms_during']:.1f} ms "
                     f"({detector['step_slowdown']:.2f}x)")
    return text + (f"; {', '.join(extra)}" if extra else "")


def _ratios(detector: dict[str, Any]) -> str:
    slowdown, typical = detector.get("slowdown"), detector.get("typical_ratio")
    parts = [f"steps {slowdown:.2f}x the recent past's" if slowdown is not None else None,
             f"{typical:.2f}x the fit" if typical is not None else None,
             f"admission's step multiplier {detector['step_multiplier']:.2f}"
             if detector.get("step_multiplier") is not None else None]
    return ", ".join(p for p in parts if p)


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
