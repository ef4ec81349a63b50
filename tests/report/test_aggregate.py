"""Aggregates and compliance from hand-made records: the definitions in docs/replay.md, exactly."""

from __future__ import annotations

import pytest

from ricllm.replay.records import RequestRecord
from ricllm.report.aggregate import aggregate, evaluate_targets, fmt_value, percentile, summarize


def record(i: int, cls: str = "near_rt", status: str = "completed", e2e: float | None = 0.1,
           deadline_ms: float | None = 500.0, **values) -> RequestRecord:
    r = RequestRecord(f"r{i}", "cell0", float(i), i + 2, "t", cls, "alpha", deadline_ms, 8, float(i), sent_s=float(i))
    if status == "completed":
        r.finish("completed", admitted=True, server_e2e_s=e2e, server_ttft_s=e2e and e2e / 2,
                 client_e2e_s=e2e and e2e + 0.01, prompt_tokens=100, cached_tokens=64, output_tokens=8, **values)
    else:
        r.finish(status, admitted=False if status == "rejected" else None, **values)
    return r


def test_percentile_is_nearest_rank():
    values = [float(v) for v in range(1, 21)]  # 1 .. 20
    assert percentile(values, 50) == 10 and percentile(values, 95) == 19 and percentile(values, 99) == 20
    assert percentile([3.0], 99) == 3.0 and percentile([], 50) is None
    assert percentile([5.0, 1.0, 3.0], 50) == 3.0


def test_met_follows_the_engine_then_the_deadline():
    assert record(0, met=False).met is False  # the engine's word wins
    assert record(1, e2e=0.4).met is True and record(2, e2e=0.6).met is False  # judged from server time
    assert record(3, e2e=0.495).client_met is False  # 0.505 s on the client clock
    assert record(4, deadline_ms=None, e2e=9.0).met is True  # best effort: met when it completes
    assert record(5, status="rejected", rejection_code="QUEUE_FULL").met is False
    assert record(6, status="interrupted").met is False


def test_summary_counts_rates_and_latencies():
    records = ([record(i, e2e=0.1 * (i + 1)) for i in range(8)]  # 0.1 .. 0.8 s against 500 ms
               + [record(8, status="rejected", rejection_code="DEADLINE_INFEASIBLE"),
                  record(9, status="rejected", rejection_code="KV_BUDGET"),
                  record(10, status="rejected", rejection_code="DEADLINE_INFEASIBLE"),
                  record(11, status="interrupted")])
    s = summarize(records, wall_s=4.0)
    assert (s["sent"], s["admitted"], s["rejected"], s["completed"], s["interrupted"]) == (12, 8, 3, 8, 1)
    assert s["rejected_by_reason"] == {"DEADLINE_INFEASIBLE": 2, "KV_BUDGET": 1}
    assert s["met"] == 5 and s["missed"] == 3
    assert s["met_of_admitted"] == 5 / 8 and s["met_of_sent"] == 5 / 12 and s["goodput_rps"] == 5 / 4
    assert s["p50_e2e_s"] == pytest.approx(0.4) and s["p95_e2e_s"] == pytest.approx(0.8)
    assert s["client_p50_e2e_s"] == pytest.approx(0.41) and s["p50_ttft_s"] == pytest.approx(0.2)
    assert s["prefix_cache_hit_rate"] == 0.64 and s["output_tokens"] == 64


def test_per_class_aggregates_and_targets():
    records = [record(i, "near_rt", e2e=0.2) for i in range(4)] + [
        record(4, "non_rt", deadline_ms=4000, e2e=5.0), record(5, "non_rt", deadline_ms=4000, e2e=1.0)]
    aggregates = aggregate(records, 2.0, ["near_rt", "non_rt", "unused"], {"peak_kv_used_blocks": 7})
    assert aggregates["overall"]["peak_kv_used_blocks"] == 7 and aggregates["classes"]["unused"]["sent"] == 0
    assert aggregates["classes"]["non_rt"]["met_of_sent"] == 0.5
    results = evaluate_targets({"overall": ["met_of_admitted >= 0.8", "p95_e2e_s < 1"],
                                "non_rt": ["met_of_sent >= 0.9"], "unused": ["met_of_admitted >= 0.5"]}, aggregates)
    assert [(r["scope"], r["passed"]) for r in results] == [
        ("overall", True), ("overall", False), ("non_rt", False), ("unused", False)]
    assert results[3]["value"] is None  # no data is not a pass


def test_formatting_rules():
    assert fmt_value("met_of_admitted", 0.98765) == "98.8%"
    assert fmt_value("p95_e2e_s", 0.12345) == "123.5 ms" and fmt_value("client_p50_ttft_s", 1.0) == "1000.0 ms"
    assert fmt_value("goodput_rps", 1.23456) == "1.235/s" and fmt_value("sent", 12) == "12"
    assert fmt_value("prefix_cache_hit_rate", None) == "n/a"
    assert fmt_value("rejected_by_reason", {"KV_BUDGET": 2}) == "KV_BUDGET 2"
    assert fmt_value("rejected_by_reason", {}) == "none"
