"""The report's plots, drawn from report.json alone (matplotlib, Agg backend), as PNG bytes.

Three questions, one figure each: did latencies stay under their deadlines (CDFs with the
deadline marked), what did the engine do over time (KV usage, batch, admissions, rejections,
misses), and what in the trace set the requests off (the KPIs the triggers read, with every
request it triggered, coloured by outcome). Comparisons overlay two reports.
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from typing import Any

OUTCOME_COLOURS = {"met": "#2ca02c", "missed": "#ff7f0e", "rejected": "#d62728", "other": "#7f7f7f"}
MAX_ENTITY_LINES = 12


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _legend(ax, **style: Any) -> None:
    """A legend only where something is labelled (matplotlib warns about an empty one)."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(**style)


def _png(fig) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=90, bbox_inches="tight")
    _pyplot().close(fig)
    return buffer.getvalue()


def _classes(report: dict[str, Any]) -> list[str]:
    return list(report["aggregates"]["classes"])


def _deadlines(report: dict[str, Any]) -> dict[str, float | None]:
    return {name: spec.get("deadline_ms") for name, spec in report["scenario"]["spec"]["classes"].items()}


def _log_ms_axis(ax) -> None:
    """Log scale with plain numbers, and no minor labels (they overlap on a short range)."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    ax.set_xscale("log")
    ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    ax.xaxis.set_minor_formatter(NullFormatter())


def _cdf(ax, values_ms: Sequence[float], **style: Any) -> None:
    if not values_ms:
        return
    ordered = sorted(values_ms)
    n = len(ordered)
    ax.step(ordered, [(i + 1) / n for i in range(n)], where="post", **style)


def _latencies(report: dict[str, Any], cls: str, key: str) -> list[float]:
    return [r[key] * 1000 for r in report["requests"]
            if r["deadline_class"] == cls and r["status"] == "completed" and r.get(key) is not None]


def latency_cdf(report: dict[str, Any]) -> bytes:
    """TTFT and E2E CDFs per class (server clock solid, client dashed), deadline as a vertical line."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    deadlines = _deadlines(report)
    for i, cls in enumerate(_classes(report)):
        colour = f"C{i % 10}"
        for ax, metric in zip(axes, ("ttft_s", "e2e_s")):
            _cdf(ax, _latencies(report, cls, f"server_{metric}"), color=colour, label=f"{cls} (server)")
            _cdf(ax, _latencies(report, cls, f"client_{metric}"), color=colour, linestyle="--", alpha=0.6,
                 label=f"{cls} (client)")
            if deadlines.get(cls):
                ax.axvline(deadlines[cls], color=colour, linestyle=":", linewidth=1.5, label=f"{cls} deadline")
    for ax, title in zip(axes, ("time to first token", "end-to-end latency")):
        ax.set(title=f"{title}: CDF against the deadline", xlabel="ms", ylabel="share of completed requests",
               ylim=(0, 1.02))
        _log_ms_axis(ax)
        ax.grid(alpha=0.3)
        _legend(ax, fontsize=7, loc="lower right")
    return _png(fig)


def per_second(times: Sequence[float], span_s: float) -> tuple[list[float], list[float]]:
    """Events per second in bins over [0, span_s]: 1 s bins, narrower for runs under 20 s."""
    width = 1.0 if span_s >= 20 else max(span_s, 0.01) / 20
    bins = max(1, math.ceil(span_s / width))
    counts = [0] * bins
    for t in times:
        counts[min(bins - 1, max(0, int(t / width)))] += 1
    return [b * width for b in range(bins)], [c / width for c in counts]


def _events(report: dict[str, Any]) -> dict[str, list[float]]:
    requests = report["requests"]
    return {
        "admitted": [r["sent_s"] for r in requests if r.get("admitted") and r.get("sent_s") is not None],
        "rejected": [r["sent_s"] for r in requests if r["status"] == "rejected" and r.get("sent_s") is not None],
        "missed": [r["done_s"] for r in requests if r["status"] == "completed" and not r.get("met")
                   and r.get("done_s") is not None],
    }


def timeline(report: dict[str, Any]) -> bytes:
    """KV usage, batch (running / waiting), step time, and per-second admissions, rejections, misses."""
    plt = _pyplot()
    fig, (kv_ax, batch_ax, step_ax, event_ax) = plt.subplots(4, 1, figsize=(11, 9.5), sharex=True)
    samples = report.get("timeline", [])
    _kv_lines(kv_ax, samples, "")
    for key, style in (("running", "-"), ("waiting", "--")):
        points = [(s["t_s"], s[key]) for s in samples if s.get(key) is not None]
        if points:
            batch_ax.plot(*zip(*points), linestyle=style, label=key)
    batch_ax.set(ylabel="sequences", title="batch: running and waiting")
    steps = [(s["t_s"], s["step_ms_mean"]) for s in samples if s.get("step_ms_mean") is not None]
    if steps:
        step_ax.plot(*zip(*steps), marker=".", linestyle="none", color="C4", label="mean step time")
    step_ax.set(ylabel="ms", title="engine step time (mean over each 250 ms sample; in-process only)")
    span = report["run"]["wall_s"]
    for (name, times), colour in zip(_events(report).items(), ("#1f77b4", "#d62728", "#ff7f0e")):
        x, counts = per_second(times, span)
        event_ax.step(x, counts, where="post", color=colour, label=f"{name} per s")
    event_ax.set(xlabel="seconds since the replay started", ylabel="requests per s",
                 title="admissions (by send time), rejections, deadline misses (by finish time)")
    multipliers = {kind: [(s["t_s"], s[f"latency_{kind}_multiplier"]) for s in samples
                          if s.get(f"latency_{kind}_multiplier") is not None] for kind in ("decode", "prefill")}
    if any(multipliers.values()) and (report.get("faults") or {}).get("phases"):
        twin = step_ax.twinx()
        for (kind, points), colour in zip(multipliers.items(), ("C3", "C4")):
            if points:
                twin.plot(*zip(*points), color=colour, linewidth=1, label=f"{kind} step multiplier (right)")
        twin.set_ylabel("measured / fit")
        _legend(twin, fontsize=7, loc="upper left")
    _shade_faults((kv_ax, batch_ax, step_ax, event_ax), report)
    for ax in (kv_ax, batch_ax, step_ax, event_ax):
        ax.grid(alpha=0.3)
        _legend(ax, fontsize=7, loc="upper right")
    return _png(fig)


def _shade_faults(axes, report: dict[str, Any]) -> None:
    """Each fault phase shaded, its reaction window darker, where the detector said slow dashed."""
    for phase in (report.get("faults") or {}).get("phases") or []:
        start, stop, window = phase.get("started_s"), phase.get("stopped_s"), phase.get("window")
        if start is None:
            continue
        for i, ax in enumerate(axes):
            ax.axvspan(start, stop if stop is not None else start, color="#d62728", alpha=0.07,
                       label=f"fault {phase['name']}" if i == 0 else None)
            if window and window["end_s"] > window["start_s"]:
                ax.axvspan(window["start_s"], window["end_s"], color="#d62728", alpha=0.18,
                           label="reaction window" if i == 0 else None)
            fired = (phase.get("detector") or {}).get("fired_s")
            if fired is not None:
                ax.axvline(fired, color="#d62728", linestyle="--", linewidth=0.8,
                           label="detector: slow" if i == 0 else None)


def _kv_lines(ax, samples: list[dict[str, Any]], suffix: str, style: str = "-") -> None:
    used = [(s["t_s"], 100 * s["kv_used_blocks"] / s["kv_num_blocks"]) for s in samples
            if s.get("kv_used_blocks") is not None and s.get("kv_num_blocks")]
    pinned = [(s["t_s"], 100 * s["kv_pinned_blocks"] / s["kv_num_blocks"]) for s in samples
              if s.get("kv_pinned_blocks") is not None and s.get("kv_num_blocks")]
    if used:
        ax.plot(*zip(*used), linestyle=style, color="C0", label=f"KV blocks used{suffix}")
    if pinned:
        ax.plot(*zip(*pinned), linestyle=style, color="C2", alpha=0.7, label=f"pinned (templates){suffix}")
    ax.set(ylabel="% of KV blocks", title="KV cache usage", ylim=(0, 105))


def _outcome(request: dict[str, Any]) -> str:
    if request["status"] == "rejected":
        return "rejected"
    if request["status"] == "completed":
        return "met" if request.get("met") else "missed"
    return "other"


def trace_kpis(report: dict[str, Any]) -> bytes:
    """What the triggers watch, per entity, over trace time (threshold dashed); below, every
    request the trace triggered, coloured by outcome."""
    plt = _pyplot()
    series = report["trace"]["series"]
    signals, entities = series["signals"], series["entities"]
    fig, axes = plt.subplots(len(signals) + 1, 1, figsize=(11, 2.6 * (len(signals) + 1)), sharex=True,
                             squeeze=False)
    axes = axes[:, 0]
    many = len(entities) > MAX_ENTITY_LINES
    for ax, signal in zip(axes, signals):
        name = signal["name"]
        for i, (entity, data) in enumerate(entities.items()):
            points = [(t, v) for t, v in zip(data["t"], data[name]) if v is not None]
            if points:
                ax.plot(*zip(*points), linewidth=0.8, color="0.6" if many else f"C{i % 10}",
                        label=None if many else entity)
        if signal.get("threshold") is not None:
            ax.axhline(signal["threshold"], color="k", linestyle="--", linewidth=1, label="threshold")
        ax.set(ylabel="value", title=f"trace: {name}")
        ax.grid(alpha=0.3)
        _legend(ax, fontsize=6, ncol=4, loc="upper left")
    _request_raster(axes[-1], report, list(entities))
    return _png(fig)


def _request_raster(ax, report: dict[str, Any], entities: list[str]) -> None:
    rows = {entity: i for i, entity in enumerate(entities)}
    for outcome, colour in OUTCOME_COLOURS.items():
        points = [(r["trace_time_s"], rows.get(r["entity"], -1)) for r in report["requests"] if _outcome(r) == outcome]
        if points:
            ax.scatter(*zip(*points), s=10, color=colour, label=f"{outcome} ({len(points)})", marker="|")
    ax.set(xlabel="trace time (s)", ylabel="entity", title="requests triggered, by outcome")
    if len(entities) <= 24:
        ax.set_yticks(range(len(entities)), entities, fontsize=6)
    _legend(ax, fontsize=7, loc="upper right")
    ax.grid(alpha=0.3)


def decisions(report: dict[str, Any]) -> bytes:
    """The overall confusion matrices, one heatmap per template and expected field: expected values
    down, answered across, each cell's count written in it; the diagonal is the correct answers."""
    from ricllm.report.aggregate import matrix_axes

    plt = _pyplot()
    panels = [(f"{template}: {field}", matrix) for template, fields in report["aggregates"]["overall"]["confusion"].items()
              for field, matrix in fields.items()]
    ncols = min(3, len(panels))
    nrows = math.ceil(len(panels) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols, 3.6 * nrows), squeeze=False)
    for ax, (title, matrix) in zip(axes.flat, panels):
        _heatmap(ax, matrix_axes(matrix), matrix, title)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_axis_off()
    fig.tight_layout()
    return _png(fig)


def _heatmap(ax, labels: tuple[list[str], list[str]], matrix: dict[str, dict[str, int]], title: str) -> None:
    rows, columns = labels
    counts = [[matrix[r].get(c, 0) for c in columns] for r in rows]
    ax.imshow(counts, cmap="Blues", aspect="auto")
    peak = max(max(row) for row in counts) or 1
    for i, row in enumerate(counts):
        for j, count in enumerate(row):
            ax.text(j, i, str(count), ha="center", va="center", fontsize=8,
                    color="white" if count > peak / 2 else "black")
    ax.set_xticks(range(len(columns)), columns, rotation=30, ha="right", fontsize=7)
    ax.set_yticks(range(len(rows)), rows, fontsize=7)
    ax.set(title=title, xlabel="answered", ylabel="expected")


def compare_cdf(a: dict[str, Any], b: dict[str, Any], labels: tuple[str, str]) -> bytes:
    """E2E CDFs of both runs per class: A solid, B dashed; deadlines dotted."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(11, 4.5))
    classes = list(dict.fromkeys(_classes(a) + _classes(b)))
    deadlines = {**_deadlines(b), **_deadlines(a)}
    for i, cls in enumerate(classes):
        colour = f"C{i % 10}"
        _cdf(ax, _latencies(a, cls, "server_e2e_s"), color=colour, label=f"{cls}: {labels[0]}")
        _cdf(ax, _latencies(b, cls, "server_e2e_s"), color=colour, linestyle="--", label=f"{cls}: {labels[1]}")
        if deadlines.get(cls):
            ax.axvline(deadlines[cls], color=colour, linestyle=":", linewidth=1.5)
    ax.set(title="end-to-end latency CDF (server clock); dotted: deadlines", xlabel="ms",
           ylabel="share of completed requests", ylim=(0, 1.02))
    _log_ms_axis(ax)
    ax.grid(alpha=0.3)
    _legend(ax, fontsize=7, loc="lower right")
    return _png(fig)


def compare_timeline(a: dict[str, Any], b: dict[str, Any], labels: tuple[str, str]) -> bytes:
    """KV usage and running batch of both runs on one time axis."""
    plt = _pyplot()
    fig, (kv_ax, batch_ax) = plt.subplots(2, 1, figsize=(11, 5.5), sharex=True)
    for report, label, style in ((a, labels[0], "-"), (b, labels[1], "--")):
        samples = report.get("timeline", [])
        _kv_lines(kv_ax, samples, f": {label}", style)
        points = [(s["t_s"], s["running"]) for s in samples if s.get("running") is not None]
        if points:
            batch_ax.plot(*zip(*points), linestyle=style, label=f"running: {label}")
    batch_ax.set(xlabel="seconds since the replay started", ylabel="sequences", title="running batch")
    for ax in (kv_ax, batch_ax):
        ax.grid(alpha=0.3)
        _legend(ax, fontsize=7, loc="upper right")
    return _png(fig)
