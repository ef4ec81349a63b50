"""What ``report.json`` holds for one replay: scenario, run, engine, machine, trace series,
aggregates, compliance targets, timeline and every request's record (``docs/replay.md`` lists
the fields). Built from the replay's result alone; ``ricllm.report`` renders and writes it.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from ricllm.replay.expressions import Threshold
from ricllm.replay.runner import ReplayResult

TRACE_SERIES_POINTS = 600


def build_report(scenario, overrides: list[str], trace, plan: list, result: ReplayResult, mode: str,
                 endpoint: str | None, speed: float) -> dict[str, Any]:
    """Everything ``report.json`` holds (``docs/replay.md`` lists the fields)."""
    import ricllm
    from ricllm.replay.fault_phases import fault_section
    from ricllm.report.aggregate import aggregate, evaluate_targets
    from ricllm.report.records import SCHEMA_VERSION, machine_info, records_to_json

    faults = fault_section(result.faults, result.slowdowns, result.records, result.timeline)  # marks the windows
    kv = _kv_peak(result)
    aggregates = aggregate(result.records, result.wall_s, list(scenario.classes), kv)
    targets = evaluate_targets(scenario.targets, aggregates)
    return {
        "schema_version": SCHEMA_VERSION, "kind": "ricllm-replay", "ricllm_version": ricllm.__version__,
        "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "scenario": {"name": scenario.name, "path": str(scenario.path), "overrides": overrides,
                     "spec": scenario.model_dump(mode="json"), "templates": result.templates},
        "run": {"mode": mode, "endpoint": endpoint, "speed": speed, "started_at": result.started_at,
                "planned": len(plan), "sent": len(result.records), "wall_s": result.wall_s,
                "arrival_span_s": plan[-1].send_offset_s if plan else 0.0, "interrupted": result.interrupted,
                "drain_timed_out": result.drain_timed_out, "max_send_lag_s": result.max_send_lag_s},
        "engine": {k: v for k, v in result.engine.items() if k != "model"},
        "model": result.engine.get("model"),
        "machine": machine_info(),
        "trace": _trace_section(scenario, trace),
        "faults": faults,
        "aggregates": aggregates, "targets": targets, "compliant": all(t["passed"] for t in targets),
        "timeline": result.timeline, "requests": records_to_json(result.records),
    }


def _kv_peak(result: ReplayResult) -> dict[str, Any]:
    """Peak KV blocks in use: the engine's own peak in-process, else the timeline's highest sample."""
    kv = result.engine.get("kv_cache") or {}
    samples = [s for s in result.timeline if s.get("kv_used_blocks") is not None]
    peak = kv.get("peak_used_blocks", max((s["kv_used_blocks"] for s in samples), default=None))
    total = kv.get("num_blocks") or next((s["kv_num_blocks"] for s in samples if s.get("kv_num_blocks")), None)
    return {"peak_kv_used_blocks": peak, "kv_num_blocks": total,
            "peak_kv_fraction": peak / total if peak is not None and total else None}


def _trace_section(scenario, trace) -> dict[str, Any]:
    """Trace identity and load stats, and a downsampled series per entity of what the triggers
    watch: each threshold's left side (``RRU.PrbUsedDl / RRU.PrbAvailDl``) with its threshold, or
    the KPIs a threshold reads, or PRB usage when no trigger reads any."""
    signals = _watched_signals(scenario)
    pacing = scenario.pacing
    end = float("inf") if pacing.duration_s is None else pacing.start_s + pacing.duration_s
    rows = [r for r in trace.rows if pacing.start_s <= r.time_s < end]
    series: dict[str, dict[str, list]] = {}
    for row in rows:
        entry = series.setdefault(row.entity, {"t": [], **{s["name"]: [] for s in signals}})
        entry["t"].append(row.time_s)
        for watched in signals:
            entry[watched["name"]].append(watched["read"](row.kpis))
    for entity, entry in series.items():
        step = max(1, len(entry["t"]) // TRACE_SERIES_POINTS)
        series[entity] = {k: v[::step] for k, v in entry.items()}
    return {"source": str(trace.path), "rows": len(trace.rows), "rows_replayed": len(rows),
            "entities": trace.entities(), "duration_s": trace.rows[-1].time_s if trace.rows else 0.0,
            "load_stats": trace.stats.as_dict(),
            "series": {"signals": [{"name": s["name"], "threshold": s["threshold"]} for s in signals],
                       "entities": series}}


def _watched_signals(scenario) -> list[dict[str, Any]]:
    kpis = scenario.trace_kpis()
    signals: dict[str, dict[str, Any]] = {}
    for trigger in scenario.triggers:
        if not trigger.threshold:
            continue
        threshold = Threshold(trigger.threshold, kpis)
        if threshold.signal is not None:
            signals.setdefault(threshold.signal[0], {"name": threshold.signal[0], "threshold": threshold.signal[2],
                                                     "read": threshold.signal_value})
        else:
            for name in threshold.names:
                signals.setdefault(name, {"name": name, "threshold": None, "read": _kpi_reader(name)})
    if not signals:
        name = "RRU.PrbTotDl" if "RRU.PrbTotDl" in kpis else kpis[0]
        signals[name] = {"name": name, "threshold": None, "read": _kpi_reader(name)}
    return list(signals.values())[:3]


def _kpi_reader(name: str):
    return lambda kpis: kpis.get(name)
