"""report.html: one self-contained page (plots embedded as base64 PNG, no scripts, no links out),
so it can be mailed, attached to a ticket or opened on an air-gapped RIC host."""

from __future__ import annotations

import base64
import json
from html import escape
from typing import Any

from ricllm.extras import install_hint
from ricllm.report.aggregate import TABLE_METRICS, fmt_pct, fmt_value, matrix_axes

STYLE = """
body{font-family:system-ui,-apple-system,Segoe UI,sans-serif;margin:1.5em auto;max-width:1200px;color:#222}
h1{font-size:1.5em}h2{font-size:1.15em;margin-top:1.6em;border-bottom:1px solid #ddd}
table{border-collapse:collapse;font-size:.85em;margin:.5em 0}
th,td{border:1px solid #ddd;padding:3px 8px;text-align:right}th{background:#f4f4f4}
td.l,th.l{text-align:left}.pass{color:#1a7f37;font-weight:bold}.fail{color:#c62828;font-weight:bold}
.meta{color:#555;font-size:.9em}img{max-width:100%}pre{background:#f8f8f8;padding:.6em;font-size:.8em;
overflow:auto}details{margin:.6em 0}
"""


def _img(png: bytes, alt: str) -> str:
    return f'<img alt="{escape(alt)}" src="data:image/png;base64,{base64.b64encode(png).decode()}">'


def _figure(plots: dict[str, bytes], key: str, alt: str) -> str:
    """The plot, or where it would be a note saying what draws it (the plots are the report extra's)."""
    if key in plots:
        return _img(plots[key], alt)
    note = f"No {alt} plot: this install has no matplotlib. To draw it: {install_hint('report')}, then ricllm report."
    return f'<p class="meta">{escape(note)}</p>'


def _table(header: list[str], rows: list[list[str]], left: int = 1) -> str:
    """Cells are escaped here; the first ``left`` columns align left."""
    head = "".join(f'<th class="{"l" if i < left else ""}">{escape(h)}</th>' for i, h in enumerate(header))
    body = "".join("<tr>" + "".join(f'<td class="{"l" if i < left else ""}">{escape(str(c))}</td>'
                                    for i, c in enumerate(row)) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _page(title: str, body: str) -> str:
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{escape(title)}</title>'
            f"<style>{STYLE}</style></head><body>\n{body}\n</body></html>\n")


def class_table(aggregates: dict[str, Any]) -> str:
    """Rows: the metrics; columns: overall, then each deadline class."""
    scopes = {"overall": aggregates["overall"], **aggregates["classes"]}
    rows = [[label, *(fmt_value(metric, s.get(metric)) for s in scopes.values())] for metric, label in TABLE_METRICS]
    return _table(["metric", *scopes], rows)


def confusion_table(matrix: dict[str, dict[str, int]]) -> str:
    """Expected values down, answered values across (the diagonal is correct), with row totals."""
    rows, columns = matrix_axes(matrix)
    body = [[expected, *(matrix[expected].get(c, 0) for c in columns), sum(matrix[expected].values())]
            for expected in rows]
    return _table(["expected \\ answered", *columns, "total"], body)


def confusion_block(confusion: dict[str, Any]) -> str:
    """One confusion table per template and expected field."""
    return "\n".join(f"<h3>{escape(template)}: {escape(field)}</h3>{confusion_table(matrix)}"
                     for template, fields in confusion.items() for field, matrix in fields.items())


def decisions_section(report: dict[str, Any], plots: dict[str, bytes]) -> list[str]:
    """The answers judged against each template's reference policy: overall, then per class."""
    aggregates = report["aggregates"]
    if not aggregates["overall"].get("confusion"):
        note = "No template declares a reference policy (<code>expect</code>): no answer was judged correct or wrong."
        return ["<h2>Decisions</h2>", f"<p>{note}</p>"]
    classes = [f"<details><summary>class {escape(name)}</summary>{confusion_block(summary['confusion'])}</details>"
               for name, summary in aggregates["classes"].items() if summary.get("confusion")]
    return ["<h2>Decisions: expected vs answered</h2>", _figure(plots, "decisions", "confusion matrices"),
            confusion_block(aggregates["overall"]["confusion"]), *classes,
            *confidence_section(aggregates.get("confidence") or {})]


def confidence_section(confidence: dict[str, Any]) -> list[str]:
    """Accuracy by confidence: the reliability table and accuracy against coverage."""
    bins, coverage = confidence.get("reliability") or [], confidence.get("coverage") or []
    if not bins:
        return []
    note = ("Over the judged answers with a decision confidence, each counted by the model's own answer "
            "(a fallback's row by the answer it replaced).")
    reliability = _table(["confidence", "answers", "mean confidence", "accuracy"],
                         [[f"[{b['low']:.1f}, {b['high']:.1f})", b["count"], f"{b['mean_confidence']:.3f}",
                           fmt_pct(b["accuracy"])] for b in bins])
    kept = _table(["most confident kept", "answers", "lowest confidence kept", "accuracy"],
                  [[fmt_pct(c["coverage"]), c["kept"], f"{c['min_confidence']:.3f}", fmt_pct(c["accuracy"])]
                   for c in coverage])
    return ["<h2>Accuracy by confidence</h2>", f"<p>{note}</p>", "<h3>Reliability</h3>", reliability,
            "<h3>Accuracy against coverage</h3>", kept]


def targets_block(report: dict[str, Any]) -> str:
    targets = report.get("targets", [])
    if not targets:
        return "<p>The scenario sets no compliance targets.</p>"
    verdict = ('<p class="pass">All compliance targets met.</p>' if report["compliant"]
               else '<p class="fail">Compliance targets missed.</p>')
    rows = "".join(
        f'<tr><td class="l">{escape(t["scope"])}</td><td class="l">{escape(t["target"])}</td>'
        f'<td>{escape(fmt_value(t["metric"], t["value"]))}</td>'
        f'<td class="{"pass" if t["passed"] else "fail"}">{"pass" if t["passed"] else "FAIL"}</td></tr>'
        for t in targets)
    return (f'{verdict}<table><tr><th class="l">scope</th><th class="l">target</th><th>measured</th>'
            f"<th>result</th></tr>{rows}</table>")


WINDOW_METRICS = (
    ("window_admitted", "admitted in a reaction window"), ("window_met", "met in the window"),
    ("window_missed", "missed in the window"), ("window_max_late_ms", "latest miss in the window"),
    ("admitted_outside_window", "admitted outside the windows"), ("missed_outside_window", "not met outside"),
    ("met_of_admitted_outside_window", "met % of admitted outside"),
)


def faults_section(report: dict[str, Any]) -> list[str]:
    """Each fault phase with the detector's reaction and its window; the window counts per class."""
    from ricllm.report.terminal import detector_text

    phases = (report.get("faults") or {}).get("phases") or []
    if not phases:
        return []
    rows = []
    for p in phases:
        detector, window = p.get("detector"), p.get("window") or {}
        ran = "never ran" if p.get("started_s") is None else f'{p["started_s"]:.2f}-{p.get("stopped_s") or 0:.2f} s'
        rows.append([p["name"], f'{p["kind"]} duty {p["duty"]:g}', ",".join(map(str, p.get("cpus") or [])) or "all",
                     f'{p["start_s"]:.1f}-{p["stop_s"]:.1f} s', ran,
                     detector_text(detector) if detector else "",
                     f'{window["start_s"]:.2f}-{window["end_s"]:.2f} s' if window else "",
                     window.get("admitted", ""), window.get("met", ""), window.get("missed", ""),
                     ", ".join(f"{v:.1f}" for v in window.get("late_ms", [])) or ("none" if window else "")])
    header = ["phase", "fault", "CPUs", "planned", "ran", "slowdown detector", "reaction window", "admitted",
              "met", "missed", "late by (ms)"]
    scopes = {"overall": report["aggregates"]["overall"], **report["aggregates"]["classes"]}
    counts = [[label, *(fmt_value(metric, s.get(metric)) for s in scopes.values())] for metric, label in WINDOW_METRICS]
    note = ("A request is in a phase's reaction window when it was admitted before the slowdown detector first "
            "said slow after the phase began (the phase's end if it never did) and was still unfinished when the "
            "phase began; its misses are counted here, every other admitted request is held to its deadline.")
    return ["<h2>Fault phases</h2>", f'<p class="meta">{escape(note)}</p>', _table(header, rows, left=7),
            _table(["metric", *scopes], counts)]


def refusals_section(report: dict[str, Any]) -> list[str]:
    """Every refused request with its reason and, for time, the bound and the time its deadline left."""
    refused = [r for r in report["requests"] if r.get("status") == "rejected"]
    note = ("The per-class table's finish bound / actual is admission's bound for an admitted request "
            "(predicted_e2e_s, safety margin not included) over its measured end-to-end time; the last promised "
            "bound (promised_e2e_s) is the same bound as of the last admission that counted the request, since a "
            "request admitted later may share its steps.")
    if not refused:
        return ["<h2>Refusals</h2>", f'<p class="meta">{escape(note)} No request was refused.</p>']
    rows = [[r["id"], r.get("deadline_class", ""), r.get("rejection_code") or "",
             _cell((r.get("rejection_numbers") or {}).get("bound_ms")),
             _cell((r.get("rejection_numbers") or {}).get("deadline_ms")), r.get("rejection_message") or ""]
            for r in refused]
    header = ["id", "class", "reason", "bound (ms)", "deadline left (ms)", "message"]
    return ["<h2>Refusals</h2>", f'<p class="meta">{escape(note)}</p>',
            f"<details><summary>All {len(rows)} refused requests</summary>{_table(header, rows, left=3)}</details>"]


def _meta(report: dict[str, Any]) -> str:
    run, model, machine = report["run"], report.get("model") or {}, report.get("machine", {})
    where = run["mode"] + (f' ({run["endpoint"]})' if run.get("endpoint") else "")
    parts = [f'created {report["created_at"]}', f"replay {where}, speed {run['speed']:g}",
             f'{run["sent"]} of {run["planned"]} planned requests sent in {run["wall_s"]:.1f} s',
             f'model {model.get("name") or model.get("path") or "unknown"} (sha256 {model.get("sha256") or "unknown"})',
             f'machine {machine.get("cpu", "?")}, {machine.get("cores", "?")} cores'
             + (f', torch {machine["torch"]}' if machine.get("torch") else "")]
    if run.get("interrupted"):
        parts.append("INTERRUPTED: outstanding requests are marked interrupted")
    return '<p class="meta">' + "<br>".join(escape(p) for p in parts) + "</p>"


def _dict_table(data: dict[str, Any]) -> str:
    rows = [[k, json.dumps(v) if isinstance(v, (dict, list)) else v] for k, v in data.items()]
    return _table(["field", "value"], rows, left=2)


def _requests_table(report: dict[str, Any]) -> str:
    columns = ("id", "entity", "trace_time_s", "deadline_class", "template", "status", "rejection_code",
               "server_ttft_s", "server_e2e_s", "predicted_e2e_s", "promised_e2e_s", "client_e2e_s", "prompt_tokens", "cached_tokens",
               "output_tokens", "met", "valid", "correct", "confidence", "finish_reason", "expected", "answer", "text")
    if (report.get("faults") or {}).get("phases"):
        columns = (*columns[:15], "reaction_window", *columns[15:])
    rows = [[_cell(r.get(c)) for c in columns] for r in report["requests"]]
    return (f'<details><summary>All {len(rows)} requests</summary>'
            f"{_table(list(columns), rows, left=2)}</details>")


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4f}"
    if isinstance(value, (dict, list)):
        return json.dumps(value, separators=(",", ":"))
    return str(value)


def render_report(report: dict[str, Any], plots: dict[str, bytes]) -> str:
    """The whole page of one replay."""
    name = report["scenario"]["name"]
    trace = report["trace"]
    sections = [
        f"<h1>ricllm replay: {escape(name)}</h1>", _meta(report),
        "<h2>Compliance</h2>", targets_block(report),
        *faults_section(report),
        "<h2>Per deadline class</h2>", class_table(report["aggregates"]),
        *refusals_section(report),
        *decisions_section(report, plots),
        "<h2>Latency against the deadline</h2>", _figure(plots, "latency_cdf", "latency CDF"),
        "<h2>Timeline</h2>", _figure(plots, "timeline", "timeline"),
        "<h2>Trace and the requests it triggered</h2>", _figure(plots, "trace", "trace KPIs"),
        (f'<p class="meta">{escape(trace["source"])}: {trace["rows"]} rows ({trace["rows_replayed"]} in the window), '
         f'{len(trace["entities"])} entities, {trace["duration_s"]:.1f} s</p>'),
        "<details><summary>Trace load statistics</summary>", _dict_table(trace["load_stats"]), "</details>",
        "<h2>Run</h2>", _dict_table(report["run"]),
        "<h2>Engine</h2>", _dict_table(report.get("engine", {})),
        "<h2>Templates</h2>", _dict_table(report["scenario"].get("templates") or {}),
        "<h2>Scenario</h2>", f'<pre>{escape(json.dumps(report["scenario"]["spec"], indent=1))}</pre>',
        "<h2>Requests</h2>", _requests_table(report),
    ]
    return _page(f"ricllm replay: {name}", "\n".join(sections))


def comparison_rows(a: dict[str, Any], b: dict[str, Any]) -> list[list[str]]:
    """(scope, metric, A, B, change) for overall and every class either run has."""
    rows = []
    scopes = ["overall", *dict.fromkeys([*a["aggregates"]["classes"], *b["aggregates"]["classes"]])]
    for scope in scopes:
        left, right = (_scope(r, scope) for r in (a, b))
        for metric, label in TABLE_METRICS:
            x, y = left.get(metric), right.get(metric)
            rows.append([scope, label, fmt_value(metric, x), fmt_value(metric, y), _change(metric, x, y)])
    return rows


def _scope(report: dict[str, Any], scope: str) -> dict[str, Any]:
    aggregates = report["aggregates"]
    return aggregates["overall"] if scope == "overall" else aggregates["classes"].get(scope, {})


def _change(metric: str, x: Any, y: Any) -> str:
    if not isinstance(x, (int, float)) or not isinstance(y, (int, float)) or isinstance(x, bool):
        return ""
    if metric.endswith(("_of_sent", "_of_admitted", "_of_answered", "_rate")):
        return f"{(y - x) * 100:+.1f} pp"
    return f"{(y - x) / x * 100:+.1f}%" if x else ""


def render_comparison(a: dict[str, Any], b: dict[str, Any], labels: tuple[str, str],
                      plots: dict[str, bytes]) -> str:
    """Side by side: both runs' settings, every metric with its change, overlaid plots."""
    header = ["scope", "metric", labels[0], labels[1], "change (B vs A)"]
    settings = [[k, _setting(a, k), _setting(b, k)] for k in ("scenario", "mode", "speed", "kv_cache_budget",
                                                              "enable_prefix_caching", "admission", "model")]
    body = "\n".join([
        f"<h1>ricllm replay comparison: {escape(labels[0])} vs {escape(labels[1])}</h1>",
        "<h2>Settings</h2>", _table(["setting", labels[0], labels[1]], settings),
        "<h2>Metrics</h2>", _table(header, comparison_rows(a, b), left=2),
        "<h2>Latency</h2>", _figure(plots, "compare_cdf", "E2E CDF comparison"),
        "<h2>Timeline</h2>", _figure(plots, "compare_timeline", "timeline comparison"),
        "<h2>Compliance</h2>", f"<h3>{escape(labels[0])}</h3>", targets_block(a),
        f"<h3>{escape(labels[1])}</h3>", targets_block(b),
    ])
    return _page(f"ricllm replay comparison: {labels[0]} vs {labels[1]}", body)


def _setting(report: dict[str, Any], key: str) -> str:
    if key == "scenario":
        return report["scenario"]["name"] + "".join(f" --set {o}" for o in report["scenario"].get("overrides", []))
    if key in ("mode", "speed"):
        return str(report["run"].get(key))
    if key == "model":
        model = report.get("model") or {}
        return f'{model.get("name") or "?"} {str(model.get("sha256") or "")[:12]}'
    settings = report.get("engine", {}).get("settings") or {}
    return str(settings.get(key, report["scenario"]["spec"].get("engine", {}).get(key)))
