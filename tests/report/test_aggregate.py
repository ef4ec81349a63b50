"""Aggregates and compliance from hand-made records: the definitions in docs/replay.md, exactly."""

from __future__ import annotations

import pytest

from ricllm.replay.decisions import AnswerCheck, judge
from ricllm.report.records import RequestRecord
from ricllm.report.targets import parse_target
from ricllm.report.aggregate import (
    aggregate,
    confusion,
    evaluate_targets,
    fmt_value,
    matrix_axes,
    percentile,
    summarize,
)
from ricllm.structured.spec import StructuredSpec


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


# ------------------------------------------------------------------------------------ decisions

CHOICE = AnswerCheck(StructuredSpec.parse({"choice": ["offload", "hold", "escalate"]}))


def decision(i: int, text: str | None, expected: str | None, cls: str = "near_rt", e2e: float = 0.1,
             finish_reason: str = "stop", status: str = "completed", check: AnswerCheck | None = CHOICE,
             template: str = "congestion") -> RequestRecord:
    """A record as the replay leaves it: finished, then judged against its template's choice."""
    r = RequestRecord(f"r{i}", "cell0", float(i), i + 2, "t", cls, template, 500.0, 8, float(i), sent_s=float(i),
                      expected=None if expected is None else {"answer": expected})
    if status == "completed":
        r.finish("completed", admitted=True, finish_reason=finish_reason, server_e2e_s=e2e, text=text,
                 num_forced_tokens=1)
    else:
        r.finish(status, admitted=False if status == "rejected" else None, rejection_code="DEADLINE_INFEASIBLE")
    judge(r, check)
    return r


def decision_records() -> list[RequestRecord]:
    return [
        decision(0, "offload", "offload"),  # valid, correct, in time: useful
        decision(1, "hold", "hold"),  # useful
        decision(2, "hold", "offload"),  # valid but wrong
        decision(3, "offlo", "offload", finish_reason="length"),  # cut by max_tokens: invalid
        decision(4, '{"action": "offload"}', "escalate"),  # not one of the choices: invalid
        decision(5, "offload", "offload", e2e=0.9),  # correct but late: not useful
        decision(6, None, "hold", status="rejected"),  # no answer: counts against useful_of_sent only
        decision(7, "escalate", "escalate", finish_reason="deadline"),  # cut off at its deadline: no answer
        decision(8, "some text", None, check=None, template="plain"),  # no constraint, no policy: not judged
    ]


def test_valid_correct_and_useful_from_records():
    s = summarize(decision_records(), wall_s=2.0)
    assert s["answered"] == 7  # 0-5 and the plain one; not the rejected one, not the one cut at its deadline
    assert (s["valid"], s["invalid"]) == (4, 2) and s["valid_of_answered"] == 4 / 6
    assert (s["correct"], s["wrong"]) == (3, 3) and s["correct_of_answered"] == 3 / 6
    assert s["useful"] == 2 and s["useful_of_sent"] == 2 / 8  # 8 requests with a policy were sent
    assert s["useful_goodput_rps"] == 2 / 2.0 and s["goodput_rps"] == s["met"] / 2.0 == 7 / 2.0  # all but 5 and 6
    assert s["forced_tokens"] == 7


def test_decision_rates_without_a_policy_are_not_numbers():
    s = summarize([decision(0, "some text", None, check=None, template="plain")], wall_s=1.0)
    assert s["answered"] == 1 and s["valid_of_answered"] is None and s["correct_of_answered"] is None
    assert s["useful_of_sent"] is None and s["useful_goodput_rps"] is None and s["confusion"] == {}


def test_confusion_matrix_counts_expected_against_answered():
    records = [*decision_records(), decision(9, "hold", "offload"), decision(10, "offload", "hold", cls="non_rt")]
    aggregates = aggregate(records, 2.0, ["near_rt", "non_rt"])
    assert aggregates["overall"]["confusion"] == {"congestion": {"answer": {
        "offload": {"offload": 2, "hold": 2, "invalid": 1},
        "hold": {"hold": 1, "offload": 1},
        "escalate": {"invalid": 1}}}}
    assert aggregates["classes"]["non_rt"]["confusion"] == {"congestion": {"answer": {"hold": {"offload": 1}}}}
    rows, columns = matrix_axes(aggregates["overall"]["confusion"]["congestion"]["answer"])
    assert rows == ["escalate", "hold", "offload"] and columns == ["escalate", "hold", "offload", "invalid"]


def test_confusion_of_json_answers_names_absent_fields_and_labels_values():
    check = AnswerCheck(StructuredSpec.parse({"json": {"type": "object", "properties": {
        "action": {"enum": ["offload", "hold"]}, "cio_delta_db": {"type": "integer"}}}}))
    r = RequestRecord("r0", "cell0", 0.0, 2, "t", "near_rt", "congestion", 500.0, 8, 0.0,
                      expected={"action": "hold", "cio_delta_db": 0})
    r.finish("completed", admitted=True, finish_reason="stop", server_e2e_s=0.1, text='{"action":"hold"}')
    judge(r, check)
    assert r.valid is True and r.correct is False
    assert confusion([r]) == {"congestion": {"action": {"hold": {"hold": 1}}, "cio_delta_db": {"0": {"(absent)": 1}}}}


def test_targets_on_the_decision_metrics():
    aggregates = aggregate(decision_records(), 2.0, ["near_rt"])
    results = evaluate_targets({"overall": ["valid_of_answered >= 0.6", "valid_of_answered >= 1.0",
                                            "correct_of_answered >= 0.5", "correct_of_answered > 0.5",
                                            "useful_of_sent >= 0.25", "useful_of_sent >= 0.3"]}, aggregates)
    assert [r["passed"] for r in results] == [True, False, True, False, True, False]
    assert results[0]["value"] == 4 / 6
    with pytest.raises(ValueError, match="unknown metric 'valid_of_sent'"):
        parse_target("valid_of_sent >= 1")
    assert fmt_value("valid_of_answered", 2 / 3) == "66.7%" and fmt_value("useful_goodput_rps", 1.0) == "1.000/s"
