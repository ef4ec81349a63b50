"""The summary math of benchmarks/bench_admission.py on made-up outcomes: the detector window, what
counts as a miss inside and outside it, goodput ratios and the verdict. No model, no engine."""

from __future__ import annotations

import math
import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))  # last: no folder of ours shadows an installed package

import benchmarks.bench_admission as bench


def served(cls: str, arrival: float, finish: float, deadline_ms: float | None, reason: str = "length",
           tokens: int = 4) -> bench.Outcome:
    met = None if deadline_ms is None else (finish - arrival) * 1000 <= deadline_ms and reason != "deadline"
    return bench.Outcome(cls, arrival, deadline_ms, True, met, finish, reason, tokens)


def refused(cls: str, arrival: float, deadline_ms: float | None, code: str = "DEADLINE_INFEASIBLE") -> bench.Outcome:
    return bench.Outcome(cls, arrival, deadline_ms, False, None, None, "rejected", 0, code)


def test_the_detector_reaction_is_its_first_slow_verdict_after_the_slowdown_began():
    assert bench.detector_reaction(5.0, []) is None
    assert bench.detector_reaction(5.0, [(5.4, True), (6.0, False), (7.0, True)]) == 5.4
    assert bench.detector_reaction(5.0, [(1.0, True), (2.0, False), (5.2, True)]) == 5.2
    assert bench.detector_reaction(5.0, [(4.0, True)]) == 5.0  # already slow when it began
    assert bench.detector_reaction(5.0, [(4.0, True), (4.5, False)]) is None


def test_a_request_is_in_the_window_if_it_arrived_before_the_verdict_and_was_unfinished_at_the_slowdown():
    def outcome(arrival, finish):
        return served("rt300", arrival, finish, 300.0)

    assert bench.in_window(outcome(4.9, 5.1), slow_start=5.0, window_end=5.5)
    assert bench.in_window(outcome(5.2, 5.4), slow_start=5.0, window_end=5.5)
    assert not bench.in_window(outcome(4.7, 4.9), slow_start=5.0, window_end=5.5)  # done before the slowdown
    assert not bench.in_window(outcome(5.5, 5.7), slow_start=5.0, window_end=5.5)  # arrived after the verdict


def test_summary_without_slowdown_counts_every_miss_outside():
    outcomes = [served("rt100", 0.0, 0.05, 100.0), served("rt100", 1.0, 1.2, 100.0),  # met, 100 ms late
                served("rt300", 2.0, 2.31, 300.0, reason="deadline"),  # dropped late
                refused("rt1000", 3.0, 1000.0), served("bulk", 0.5, 3.0, None, tokens=100),
                refused("bulk", 0.6, None, "QUEUE_FULL")]
    s = bench.summarize(bench.Run(outcomes, start=0.0, end=5.0, seconds=4.0, slow_start=None, events=[]))
    assert (s["sent"], s["served"], s["met"]) == (4, 3, 1)
    assert s["goodput"] == 0.25
    assert s["missed_outside"] == 2 and s["in_window"] == 0 and s["missed_inside"] == 0
    assert math.isclose(s["worst_late_outside_ms"], 100.0)
    assert s["dropped"] == 1
    assert (s["bulk_sent"], s["bulk_served"]) == (2, 1)
    assert s["bulk_tokens_per_s"] == 20.0
    assert s["rejected"] == {"DEADLINE_INFEASIBLE": 1, "QUEUE_FULL": 1}
    assert s["reaction_ms"] is None


def test_summary_with_slowdown_reports_misses_inside_the_window_apart():
    outcomes = [served("rt300", 4.8, 5.2, 300.0),  # in the window, 100 ms late
                served("rt100", 5.3, 5.45, 100.0),  # arrived before the verdict at 5.5: in, 50 ms late
                served("rt100", 6.0, 6.2, 100.0),  # after the verdict: outside, 100 ms late
                served("rt1000", 1.0, 1.5, 1000.0)]  # met, long before
    run = bench.Run(outcomes, start=0.0, end=10.0, seconds=8.0, slow_start=5.0, events=[(5.5, True)])
    s = bench.summarize(run)
    assert s["in_window"] == 2 and s["missed_inside"] == 2
    assert math.isclose(s["worst_late_inside_ms"], 100.0)
    assert s["missed_outside"] == 1 and math.isclose(s["worst_late_outside_ms"], 100.0)
    assert s["misses_outside"] == [("rt100", 6.0, 100.0)]
    assert (s["met_outside"], s["served_outside"]) == (1, 2)
    assert math.isclose(s["reaction_ms"], 500.0) and s["detector_fired"]


def test_without_a_verdict_the_window_runs_to_the_end():
    outcomes = [served("rt100", 6.0, 6.2, 100.0)]
    s = bench.summarize(bench.Run(outcomes, start=0.0, end=10.0, seconds=8.0, slow_start=5.0, events=[]))
    assert s["missed_inside"] == 1 and s["missed_outside"] == 0 and not s["detector_fired"]


def test_goodput_ratios_are_over_the_best_baseline():
    assert bench.goodput_ratios({"ricllm": 12.0, "fcfs": 10.0, "edf": 8.0}) == {"ricllm": 1.2, "fcfs": 1.0, "edf": 0.8}
    assert bench.goodput_ratios({"ricllm": 3.0, "fcfs": 0.0, "edf": 0.0}) == {"ricllm": math.inf, "fcfs": 1.0, "edf": 1.0}
    assert bench.goodput_ratios({"ricllm": 3.0}) == {"ricllm": None}


def summary(goodput: float, missed_outside: int = 0) -> dict:
    return {"sent": 10, "served": 8, "goodput": goodput, "dropped": 0, "met_outside": 8 - missed_outside,
            "served_outside": 8, "missed_outside": missed_outside,
            "misses_outside": [("rt100", 3.5, 5.0)] * missed_outside, "worst_late_outside_ms": 5.0 if missed_outside
            else None, "in_window": 0, "missed_inside": 0, "worst_late_inside_ms": None, "bulk_tokens_per_s": 10.0,
            "bulk_sent": 2, "bulk_served": 2, "reaction_ms": None, "detector_fired": False,
            "decision_p99_ms": None, "ratio_before": None, "ratio_end": None}


def rows(ours: list[dict], fcfs: list[dict], edf: list[dict]) -> dict[str, dict]:
    goodputs = [{"ricllm": a["goodput"], "fcfs": b["goodput"], "edf": c["goodput"]} for a, b, c in zip(ours, fcfs, edf)]
    ratios = [bench.goodput_ratios(g) for g in goodputs]
    return {p: bench.aggregate(s, [r[p] for r in ratios]) for p, s in (("ricllm", ours), ("fcfs", fcfs), ("edf", edf))}


def test_aggregate_takes_medians_with_ranges_and_sums_the_misses():
    a = rows([summary(10.0), summary(9.0, 1), summary(11.0)], [summary(10.0)] * 3, [summary(5.0)] * 3)["ricllm"]
    assert a["goodput"] == (10.0, 9.0, 11.0) and a["ratio"] == (1.0, 0.9, 1.1)
    assert a["missed_outside"] == 1 and math.isclose(a["met_of_served_outside"], 23 / 24)


def test_verdict_at_low_and_high_load():
    three = [summary(9.8)] * 3
    ok, line = bench.verdict(1, rows(three, [summary(10.0)] * 3, [summary(9.0)] * 3))
    assert ok, line  # 0.98x the best baseline, no misses outside
    ok, _ = bench.verdict(0.5, rows(three, [summary(10.5)] * 3, [summary(9.0)] * 3))
    assert not ok  # 0.93x
    ok, line = bench.verdict(1, rows([summary(9.8, 1)] * 3, [summary(10.0)] * 3, [summary(9.0)] * 3))
    assert not ok  # misses outside the window, each named
    assert "3 admitted misses" in line and "(repeat 3, rt100, 3.5, 5)" in line and line.count("rt100, 3.5, 5)") == 3
    ok, _ = bench.verdict(2, rows(three, [summary(9.8)] * 3, [summary(0.0)] * 3))
    assert not ok  # not above every baseline
    ok, line = bench.verdict(4, rows(three, [summary(0.0)] * 3, [summary(0.0)] * 3))
    assert ok, line


def test_the_table_has_a_row_per_configuration():
    by_policy = rows([summary(9.8)] * 3, [summary(10.0)] * 3, [summary(9.0)] * 3)
    lines = bench.table([(1.0, "none", p, a) for p, a in by_policy.items()])
    assert len(lines) == 2 + 3 and all(line.count("|") == lines[0].count("|") for line in lines)
    assert "| 1x | none | ricllm |" in lines[2]
