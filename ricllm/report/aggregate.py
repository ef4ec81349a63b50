"""Aggregates of a replay, computed from its per-request records alone, and the compliance check.

Definitions (``docs/replay.md`` says the same):

- ``sent``: requests sent; ``admitted``: accepted by admission; ``rejected``: refused, by code;
  ``degraded``: admitted with a smaller ``max_tokens`` than asked (the opt-in degrade policy).
- ``met``: completed and the engine says the deadline held (a request without a deadline counts
  as met when it completes); anything not completed is not met.
- ``met_of_admitted = met / admitted``, ``met_of_sent = met / sent``; ``client_met_of_sent`` judges
  by the replay's own clock (network and queueing included).
- ``goodput_rps = met / wall_s``, wall_s being the replay's wall-clock time from its start to its
  last answer (or to the interruption).
- Percentiles are nearest-rank: the smallest value with at least q of the values at or below it.
- ``prefix_cache_hit_rate = Σ cached prompt tokens / Σ prompt tokens`` over completed requests.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

from ricllm.replay.records import RequestRecord
from ricllm.replay.targets import Target, parse_target

PERCENTILES = (50, 95, 99)
LATENCIES = ("ttft_s", "e2e_s")


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest rank: ``sorted(values)[ceil(q/100 * n) - 1]``; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def _ratio(part: int, whole: int) -> float | None:
    return part / whole if whole else None


def summarize(records: Sequence[RequestRecord], wall_s: float) -> dict[str, Any]:
    """Counts, rates and latency percentiles of one group of requests (a class, or all)."""
    statuses = Counter(r.status for r in records)
    sent, admitted = len(records), sum(1 for r in records if r.admitted)
    met = sum(1 for r in records if r.met)
    completed = [r for r in records if r.status == "completed"]
    prompt = sum(r.prompt_tokens or 0 for r in completed)
    summary: dict[str, Any] = {
        "sent": sent, "admitted": admitted, "rejected": statuses["rejected"],
        "degraded": sum(1 for r in records if r.granted_max_tokens is not None),
        "rejected_by_reason": dict(sorted(Counter(r.rejection_code for r in records
                                                  if r.status == "rejected").items())),
        "completed": len(completed), "errors": statuses["error"], "interrupted": statuses["interrupted"],
        "timeouts": statuses["timeout"], "met": met, "missed": len(completed) - sum(1 for r in completed if r.met),
        "met_of_admitted": _ratio(met, admitted), "met_of_sent": _ratio(met, sent),
        "client_met_of_sent": _ratio(sum(1 for r in records if r.client_met), sent),
        "admitted_of_sent": _ratio(admitted, sent), "rejected_of_sent": _ratio(statuses["rejected"], sent),
        "goodput_rps": met / wall_s if wall_s > 0 else None,
        "prompt_tokens": prompt, "cached_tokens": sum(r.cached_tokens or 0 for r in completed),
        "output_tokens": sum(r.output_tokens or 0 for r in completed),
    }
    summary["prefix_cache_hit_rate"] = _ratio(summary["cached_tokens"], prompt)
    for side in ("server", "client"):
        for latency in LATENCIES:
            values = [v for r in completed if (v := getattr(r, f"{side}_{latency}")) is not None]
            prefix = "" if side == "server" else "client_"
            for q in PERCENTILES:
                summary[f"{prefix}p{q}_{latency}"] = percentile(values, q)
    return summary


def aggregate(records: Sequence[RequestRecord], wall_s: float, class_names: Iterable[str],
              kv: dict[str, Any] | None = None) -> dict[str, Any]:
    """``overall`` and one summary per deadline class (in the scenario's order); KV peak in overall."""
    overall = summarize(records, wall_s)
    if kv:
        overall.update(kv)
    classes = {name: summarize([r for r in records if r.deadline_class == name], wall_s) for name in class_names}
    return {"overall": overall, "classes": classes}


def evaluate_targets(targets: dict[str, list[str]], aggregates: dict[str, Any]) -> list[dict[str, Any]]:
    """Each target with the measured value and whether it holds; a metric with no data fails."""
    results = []
    for scope, texts in targets.items():
        summary = aggregates["overall"] if scope == "overall" else aggregates["classes"].get(scope, {})
        for text in texts:
            target: Target = parse_target(text)
            value = summary.get(target.metric)
            results.append({"scope": scope, "target": str(target), "metric": target.metric,
                            "value": value, "passed": target.holds(value)})
    return results


# ---------------------------------------------------------------------------------- formatting

def fmt_pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value * 100:.1f}%"


def fmt_ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1000:.1f} ms"


def fmt_rate(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}/s"


def fmt_value(metric: str, value: Any) -> str:
    """One formatting rule per metric kind, shared by the HTML and the terminal tables."""
    if value is None:
        return "n/a"
    if metric.endswith("_s") and ("ttft" in metric or "e2e" in metric):
        return fmt_ms(value)
    if metric.endswith("_rps"):
        return fmt_rate(value)
    if isinstance(value, float) and (metric.startswith(("met_", "client_met", "admitted_of", "rejected_of"))
                                     or metric.endswith(("_rate", "_fraction"))):
        return fmt_pct(value)
    if isinstance(value, dict):
        return ", ".join(f"{k} {v}" for k, v in value.items()) or "none"
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


#: The rows of the per-class tables: (metric, label).
TABLE_METRICS = (
    ("sent", "sent"), ("admitted", "admitted"), ("degraded", "admitted with fewer tokens"),
    ("rejected", "rejected"), ("rejected_by_reason", "rejected by reason"), ("completed", "completed"),
    ("interrupted", "interrupted"), ("met", "met"), ("met_of_admitted", "met % of admitted"),
    ("met_of_sent", "met % of sent"), ("client_met_of_sent", "met % of sent (client clock)"),
    ("goodput_rps", "goodput (met per s)"), ("p50_ttft_s", "TTFT p50"), ("p95_ttft_s", "TTFT p95"),
    ("p99_ttft_s", "TTFT p99"), ("p50_e2e_s", "E2E p50"), ("p95_e2e_s", "E2E p95"), ("p99_e2e_s", "E2E p99"),
    ("client_p95_e2e_s", "E2E p95 (client)"), ("prefix_cache_hit_rate", "prefix-cache hit rate"),
)
