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
- ``bound_over_actual_p50`` / ``_p99``: admission's finish bound (``predicted_e2e_s``, margin not
  included) over the engine's measured ``server_e2e_s``, over admitted requests that completed
  with both: how tight the bound is (1 exact; above 1 the room it kept). ``bound_requests`` counts
  them, ``bound_below_actual`` those that finished after their bound. ``promised_*`` say the same
  of ``promised_e2e_s``, the bound as of the last admission that counted the request: a request
  admitted later may share its steps (and was admitted only with this one on time beside it).

Decisions, over the requests whose template declares a constraint (``valid``) or a reference
policy (``correct``, ``useful``):

- ``answered``: admitted and finished with an answer (finish reason ``stop``, ``length`` or
  ``fallback``; one cut off at its deadline or cancelled has none).
- ``fallback``: answered with the template's fallback in place of a decision less confident than
  its ``min_confidence``; the fallback is judged as the answer (valid, correct, useful).
- ``valid_of_answered = valid / answered``: the answer parses and satisfies the template's
  schema, choice or regex; one that ended by length is invalid.
- ``correct_of_answered = correct / answered``: valid, and every field the policy expects for
  the request's KPI row equals the answer's.
- ``useful``: valid, correct and on time (met); ``useful_of_sent = useful / sent``,
  ``useful_goodput_rps = useful / wall_s``.
- ``confusion[template][field][expected][answered]``: answered requests counted by the expected
  and the answered value of each expected field; ``invalid`` for an invalid answer, ``(absent)``
  for a valid one without that field.

Accuracy by confidence (``confidence``), over the judged answers that carry a decision confidence,
each counted correct by the model's own answer (``model_correct``: a fallback's row by the answer
it replaced, so the table measures the model, not the fallback):

- ``reliability``: confidence bins of width 0.1 (the last one holds 1.0), each with its count,
  mean confidence and accuracy; a calibrated model's accuracy is near its bin's confidence.
- ``coverage``: keeping the most confident x% of the answers (10%, 20%, ... 100%), how many are
  kept, the lowest confidence kept and their accuracy: what a ``min_confidence`` there would leave
  to the model.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

from ricllm.report.records import MISSING, RequestRecord
from ricllm.report.targets import Target, parse_target

PERCENTILES = (50, 95, 99)
INVALID, ABSENT = "invalid", "(absent)"  # confusion-matrix columns besides the answered values
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
    summary.update(window_summary(records))
    summary.update(decision_summary(records, wall_s))
    summary.update(bound_summary(completed))
    for side in ("server", "client"):
        for latency in LATENCIES:
            values = [v for r in completed if (v := getattr(r, f"{side}_{latency}")) is not None]
            prefix = "" if side == "server" else "client_"
            for q in PERCENTILES:
                summary[f"{prefix}p{q}_{latency}"] = percentile(values, q)
    return summary


def bound_summary(completed: Sequence[RequestRecord]) -> dict[str, Any]:
    """Bound / actual over the completed requests admission promised a finish, at their arrival and
    as last promised (the definitions above)."""
    summary = {}
    for name, field in (("bound", "predicted_e2e_s"), ("promised", "promised_e2e_s")):
        ratios = [getattr(r, field) / r.server_e2e_s for r in completed
                  if r.admitted and getattr(r, field) is not None and r.server_e2e_s]
        summary.update({f"{name}_requests": len(ratios), f"{name}_below_actual": sum(1 for x in ratios if x < 1),
                        f"{name}_over_actual_p50": percentile(ratios, 50),
                        f"{name}_over_actual_p99": percentile(ratios, 99)})
    return summary


def late_ms(record: RequestRecord) -> float | None:
    """How far past its deadline a missed request finished (engine clock), ms."""
    if record.deadline_ms is None or record.met or record.server_e2e_s is None:
        return None
    return max(0.0, 1000 * record.server_e2e_s - record.deadline_ms)


def window_counts(records: Sequence[RequestRecord]) -> dict[str, Any]:
    """Admitted, met and missed requests of a window (or any group), and how late each miss was."""
    completed = [r for r in records if r.status == "completed"]
    missed = [r for r in completed if not r.met]
    late = sorted(v for r in missed if (v := late_ms(r)) is not None)
    return {"admitted": sum(1 for r in records if r.admitted), "met": sum(1 for r in records if r.met),
            "missed": len(missed), "max_late_ms": round(late[-1], 1) if late else 0.0,
            "late_ms": [round(v, 1) for v in late]}


def window_summary(records: Sequence[RequestRecord]) -> dict[str, Any]:
    """Admitted requests inside a fault phase's reaction window (``reaction_window`` set: admitted
    before the slowdown detector reacted) apart from the rest; without fault phases every admitted
    request is outside, so ``met_of_admitted_outside_window`` is ``met_of_admitted``."""
    inside = window_counts([r for r in records if r.admitted and r.reaction_window is not None])
    outside = [r for r in records if r.admitted and r.reaction_window is None]
    met_outside = sum(1 for r in outside if r.met)
    return {"window_admitted": inside["admitted"], "window_met": inside["met"], "window_missed": inside["missed"],
            "window_max_late_ms": inside["max_late_ms"], "admitted_outside_window": len(outside),
            "missed_outside_window": len(outside) - met_outside,
            "met_of_admitted_outside_window": _ratio(met_outside, len(outside))}


def decision_summary(records: Sequence[RequestRecord], wall_s: float) -> dict[str, Any]:
    """Valid, correct and useful answers (the definitions above); rates are None where no request
    of the group has a constraint or a policy to judge by."""
    answered = [r for r in records if r.answered]
    constrained = [r for r in answered if r.valid is not None]
    judged = [r for r in answered if r.expected is not None]
    with_policy = [r for r in records if r.expected is not None]
    valid, correct = sum(1 for r in constrained if r.valid), sum(1 for r in judged if r.correct)
    useful = sum(1 for r in with_policy if r.useful)
    return {
        "answered": len(answered), "valid": valid, "invalid": len(constrained) - valid, "correct": correct,
        "wrong": len(judged) - correct, "useful": useful,
        "valid_of_answered": _ratio(valid, len(constrained)), "correct_of_answered": _ratio(correct, len(judged)),
        "useful_of_sent": _ratio(useful, len(with_policy)),
        "useful_goodput_rps": useful / wall_s if wall_s > 0 and with_policy else None,
        "forced_tokens": sum(r.num_forced_tokens or 0 for r in answered),
        "fallback": sum(1 for r in answered if r.finish_reason == "fallback"),
        "confusion": confusion(judged),
    }


RELIABILITY_BINS = 10
COVERAGE_LEVELS = tuple(range(10, 101, 10))  # percent of the answers kept, most confident first


def confidence_summary(records: Sequence[RequestRecord]) -> dict[str, list[dict[str, Any]]]:
    """The reliability table and accuracy against coverage (the definitions above); empty lists
    when no judged answer carries a confidence."""
    scored = [(r.confidence, bool(r.model_correct)) for r in records
              if r.answered and r.expected is not None and r.confidence is not None]
    bins: dict[int, list[tuple[float, bool]]] = {}
    for confidence, correct in scored:
        bins.setdefault(min(int(confidence * RELIABILITY_BINS), RELIABILITY_BINS - 1), []).append((confidence, correct))
    reliability = [{"low": b / RELIABILITY_BINS, "high": (b + 1) / RELIABILITY_BINS, "count": len(rows),
                    "mean_confidence": sum(c for c, _ in rows) / len(rows),
                    "accuracy": sum(1 for _, ok in rows if ok) / len(rows)} for b, rows in sorted(bins.items())]
    ranked = sorted(scored, key=lambda row: -row[0])
    coverage = []
    for level in COVERAGE_LEVELS if ranked else ():
        kept = ranked[:max(1, math.ceil(level * len(ranked) / 100))]
        coverage.append({"coverage": level / 100, "kept": len(kept), "min_confidence": kept[-1][0],
                         "accuracy": sum(1 for _, ok in kept if ok) / len(kept)})
    return {"reliability": reliability, "coverage": coverage}


def template_decisions(records: Sequence[RequestRecord]) -> dict[str, dict[str, Any]]:
    """Per template with a policy: correct of the answered requests it judged, beside the majority
    baseline (the share of those requests whose expected answer is the most common one: what always
    answering it would score), and the adapter its answers came from."""
    by_template: dict[str, list[RequestRecord]] = {}
    for r in records:
        if r.expected is not None and r.answered:
            by_template.setdefault(r.template, []).append(r)
    table = {}
    for name, judged in sorted(by_template.items()):
        answers = Counter(json.dumps(r.expected, sort_keys=True) for r in judged)
        majority, count = answers.most_common(1)[0]
        adapters = sorted({r.adapter for r in judged if r.adapter is not None})
        table[name] = {"judged": len(judged), "correct": sum(1 for r in judged if r.correct),
                       "correct_of_judged": sum(1 for r in judged if r.correct) / len(judged),
                       "majority_answer": json.loads(majority), "majority_share": count / len(judged),
                       "adapter": adapters[0] if len(adapters) == 1 else (adapters or None)}
    return table


def confusion(records: Iterable[RequestRecord]) -> dict[str, dict[str, dict[str, dict[str, int]]]]:
    """``[template][field][expected][answered]`` counts over answered requests with an expectation."""
    matrices: dict = {}
    for r in records:
        for field, value in r.expected.items():
            row = matrices.setdefault(r.template, {}).setdefault(field, {}).setdefault(value_label(value), {})
            column = _answered_label(r, field)
            row[column] = row.get(column, 0) + 1
    return matrices


def value_label(value: Any) -> str:
    """A field's value as a matrix label: strings as they are, anything else as JSON."""
    return value if isinstance(value, str) else json.dumps(value)


def _answered_label(record: RequestRecord, field: str) -> str:
    if not record.valid:
        return INVALID
    value = record.answer.get(field, MISSING) if isinstance(record.answer, dict) else MISSING
    return ABSENT if value is MISSING else value_label(value)


def matrix_axes(matrix: dict[str, dict[str, int]]) -> tuple[list[str], list[str]]:
    """Rows (expected values) and columns: the expected values first, so the diagonal is the correct
    answers, then other answered values, ``(absent)`` if any, and always ``invalid``."""
    rows = sorted(matrix)
    answered = {column for counts in matrix.values() for column in counts}
    others = sorted(answered - set(rows) - {ABSENT, INVALID})
    return rows, rows + others + ([ABSENT] if ABSENT in answered else []) + [INVALID]


def aggregate(records: Sequence[RequestRecord], wall_s: float, class_names: Iterable[str],
              kv: dict[str, Any] | None = None) -> dict[str, Any]:
    """``overall`` and one summary per deadline class (in the scenario's order); KV peak in overall."""
    overall = summarize(records, wall_s)
    if kv:
        overall.update(kv)
    classes = {name: summarize([r for r in records if r.deadline_class == name], wall_s) for name in class_names}
    return {"overall": overall, "classes": classes, "templates": template_decisions(records),
            "confidence": confidence_summary(records)}


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

RATE_PREFIXES = ("met_", "client_met", "admitted_of", "rejected_of", "valid_of", "correct_of", "useful_of")


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
    if metric.endswith("_ms") and isinstance(value, (int, float)):
        return f"{value:.1f} ms"
    if isinstance(value, float) and (metric.startswith(RATE_PREFIXES) or metric.endswith(("_rate", "_fraction"))):
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
    ("goodput_rps", "goodput (met per s)"), ("answered", "answered"),
    ("valid_of_answered", "valid % of answered"), ("correct_of_answered", "correct % of answered"),
    ("useful", "useful (valid, correct, met)"), ("useful_of_sent", "useful % of sent"),
    ("useful_goodput_rps", "useful goodput (per s)"), ("forced_tokens", "tokens forced by the grammar"),
    ("fallback", "answered with the fallback (below min_confidence)"),
    ("p50_ttft_s", "TTFT p50"), ("p95_ttft_s", "TTFT p95"),
    ("p99_ttft_s", "TTFT p99"), ("p50_e2e_s", "E2E p50"), ("p95_e2e_s", "E2E p95"), ("p99_e2e_s", "E2E p99"),
    ("client_p95_e2e_s", "E2E p95 (client)"), ("prefix_cache_hit_rate", "prefix-cache hit rate"),
    ("bound_over_actual_p50", "finish bound / actual, p50"), ("bound_over_actual_p99", "finish bound / actual, p99"),
    ("bound_below_actual", "finished after their bound"),
    ("promised_over_actual_p50", "last promised bound / actual, p50"),
    ("promised_over_actual_p99", "last promised bound / actual, p99"),
    ("promised_below_actual", "finished after their last promised bound"),
)
