"""benchmarks/bench_models.py: the rounds alternate the models, the table sums each round over the
scenarios, the verdict names the higher summed useful goodput; and the machine line every benchmark
prints names AMD's generation where a VM's model name does not."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))  # last: no folder of ours shadows an installed package

import benchmarks.bench_models as bench
from benchmarks.results import cpu_name


def run(useful: int, goodput: float) -> dict:
    return {"sent": 10, "useful": useful, "useful_goodput_rps": goodput, "correct_of_answered": 0.5,
            "met_of_admitted": 1.0, "rejected": 0, "bound_over_actual_p50": 1.1, "bound_over_actual_p99": 2.0}


RUNS = {("a", "s1"): [run(5, 0.5), run(6, 0.6), run(4, 0.4)], ("a", "s2"): [run(1, 0.1), run(1, 0.1), run(9, 0.9)],
        ("b", "s1"): [run(7, 0.7), run(7, 0.7), run(7, 0.7)], ("b", "s2"): [run(0, 0.0), run(0, 0.0), run(0, 0.0)]}


def test_the_models_order_alternates_between_rounds():
    assert [bench.model_order(["a", "b"], r) for r in range(3)] == [["a", "b"], ["b", "a"], ["a", "b"]]


def test_sums_are_per_round():
    assert bench.summed(RUNS, "a", ["s1", "s2"], "useful", 3) == [6, 7, 13]
    assert bench.summed(RUNS, "b", ["s1", "s2"], "useful_goodput_rps", 3) == [0.7, 0.7, 0.7]


def test_the_verdict_names_the_model_whose_summed_median_is_higher():
    runs = dict(RUNS) | {("b", "s2"): [run(1, 0.1), run(1, 0.1), run(1, 0.1)]}
    assert "**b**, 0.800/s (a 0.700/s)" in bench.verdict(runs, ["a", "b"], ["s1", "s2"], 3)


def test_the_table_gives_medians_ranges_and_the_sum_row():
    lines = bench.table(RUNS, ["a", "b"], ["s1", "s2"], 3).splitlines()
    assert lines[2].startswith("| a | s1 | 5 [4–6] of 10 | 0.500 [0.400–0.600] | 50.0% [50.0%–50.0%] |")
    assert lines[4] == "| **a** | **sum** | 7 [6–13] | **0.700 [0.600–1.300]** | | | | | |"


def test_the_machine_line_names_amds_generation_and_keeps_intels_name():
    zen3 = {"vendor_id": "AuthenticAMD", "model name": "AMD EPYC", "cpu family": "25", "model": "1"}
    zen4 = zen3 | {"model": "17"}
    assert cpu_name(zen3) == "AMD EPYC (Zen 3, family 25 model 1)"
    assert cpu_name(zen4) == "AMD EPYC (Zen 4, family 25 model 17)"
    xeon = {"vendor_id": "GenuineIntel", "model name": "Intel(R) Xeon(R) Platinum 8481C", "cpu family": "6",
            "model": "143"}
    assert cpu_name(xeon) == "Intel(R) Xeon(R) Platinum 8481C (family 6 model 143)"
