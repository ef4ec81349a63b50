"""The synthetic trace generator: deterministic, E2SM-KPM shaped, with a day, bursts and outages."""

from __future__ import annotations

from datetime import datetime, timezone

import numpy as np
import pytest

from ricllm.replay.generator import GENERATED_KPIS, generate_trace, generated_trace_spec, write_trace_csv
from ricllm.replay.traces import KPI_UNITS, TraceError, TraceSpec, load_trace


def mean(rows, kpi="RRU.PrbTotDl"):
    return float(np.mean([row.kpis[kpi] for row in rows]))


def test_same_seed_same_rows_and_another_seed_differs():
    first = generate_trace(3, 60, 1.0, seed=11)
    assert first == generate_trace(3, 60, 1.0, seed=11)
    other = generate_trace(3, 60, 1.0, seed=12)
    assert [row.kpis for row in other] != [row.kpis for row in first]


def test_e2sm_kpm_names_units_and_ranges():
    rows = generate_trace(4, 120, 0.5, seed=3, outages=0)
    assert len(rows) == 4 * 240 and [row.entity for row in rows[:4]] == ["cell0", "cell1", "cell2", "cell3"]
    assert GENERATED_KPIS and all(name in KPI_UNITS for name in GENERATED_KPIS)
    for row in rows:
        kpis = row.kpis
        assert tuple(kpis) == GENERATED_KPIS
        assert kpis["RRU.PrbAvailDl"] == (106.0 if row.entity in ("cell0", "cell2") else 273.0)
        assert 0 <= kpis["RRU.PrbUsedDl"] <= kpis["RRU.PrbAvailDl"]
        assert kpis["RRU.PrbTotDl"] == pytest.approx(100 * kpis["RRU.PrbUsedDl"] / kpis["RRU.PrbAvailDl"], abs=0.05)
        assert 0 <= kpis["DRB.UEThpUl"] <= kpis["DRB.UEThpDl"] < 1_000_000  # kbps: below 1 Gbit/s
        assert 20 <= kpis["DRB.RlcSduDelayDl"] < 1000  # 0.1 ms units: 2 ms to 100 ms
        assert kpis["RRC.ConnMean"] >= 1 and float(kpis["RRC.ConnMean"]).is_integer()
        assert -156 <= kpis["L1M.DL-SS-RSRP"] <= -31 and -10 < kpis["L1M.DL-SS-SINR"] < 40


def test_daily_curve_peaks_in_the_afternoon_of_a_compressed_day():
    rows = generate_trace(2, 240, 1.0, seed=5, day_length_s=240, bursts_per_min=0, outages=0)
    hour = {row.time_s: row.time_s * 24 / 240 for row in rows}
    peak = [row for row in rows if 14 <= hour[row.time_s] < 18]
    trough = [row for row in rows if 2 <= hour[row.time_s] < 6]
    assert mean(peak) > mean(trough) + 30  # PRB usage in %


def test_start_sets_the_time_of_day_on_a_real_length_day():
    afternoon = generate_trace(2, 60, 1.0, seed=5, start=datetime(2024, 3, 1, 16), outages=0)
    night = generate_trace(2, 60, 1.0, seed=5, start=datetime(2024, 3, 1, 4), outages=0)
    assert afternoon[0].timestamp == datetime(2024, 3, 1, 16, tzinfo=timezone.utc)
    assert mean(afternoon) > mean(night) + 30


def test_bursts_spike_the_load():
    flat = {"start": datetime(2024, 1, 1, 10), "outages": 0}
    rows = generate_trace(3, 300, 1.0, seed=2, bursts_per_min=2.0, **flat)
    burst = [row for row in rows if row.extras["event"] == "burst"]
    calm = [row for row in rows if row.extras["event"] == ""]
    assert burst and calm and mean(burst) > mean(calm) + 20
    quiet = generate_trace(3, 300, 1.0, seed=2, bursts_per_min=0.0, **flat)
    assert {row.extras["event"] for row in quiet} == {""}


def test_outage_zero_mode_reports_a_dark_cell():
    rows = generate_trace(3, 120, 1.0, seed=9, outages=1)
    dark = [row for row in rows if row.extras["event"] == "outage"]
    assert 6 <= len(dark) <= 18 and len({row.entity for row in dark}) == 1
    times = [row.time_s for row in dark]
    assert times == [times[0] + k for k in range(len(times))]  # one contiguous window
    for row in dark:
        assert row.kpis["RRC.ConnMean"] == row.kpis["DRB.UEThpDl"] == row.kpis["RRU.PrbUsedDl"] == 0.0
        assert row.kpis["L1M.DL-SS-RSRP"] is None and row.kpis["L1M.DL-SS-SINR"] is None
        assert row.kpis["RRU.PrbAvailDl"] in (106.0, 273.0)


def test_outage_absent_mode_drops_exactly_those_rows():
    zero = generate_trace(3, 120, 1.0, seed=9, outages=2)
    absent = generate_trace(3, 120, 1.0, seed=9, outages=2, outage_mode="absent")
    dark = {(row.entity, row.time_s) for row in zero if row.extras["event"] == "outage"}
    assert dark and len(absent) == len(zero) - len(dark)
    assert {(row.entity, row.time_s) for row in absent} == {(row.entity, row.time_s) for row in zero} - dark
    assert all(row.extras["event"] != "outage" for row in absent)
    assert not any(row.extras["event"] == "outage" for row in generate_trace(3, 120, 1.0, seed=9, outages=0))


@pytest.mark.parametrize("interval_s, cells", [(1.0, 3), (0.01, 2)])
def test_round_trip_generate_write_load(tmp_path, interval_s, cells):
    rows = generate_trace(cells, 120 * interval_s, interval_s, seed=4, day_length_s=120 * interval_s)
    path = write_trace_csv(rows, tmp_path / "trace.csv")
    assert path.stat().st_size < 40_000  # KBs, fit for a fixture
    trace = load_trace(generated_trace_spec("trace.csv"), tmp_path)
    assert len(trace.rows) == len(rows) and trace.stats.duplicates_dropped == trace.stats.reordered == 0
    for original, loaded in zip(rows, trace.rows):
        assert (loaded.entity, loaded.kpis, loaded.extras, loaded.line) == (
            original.entity, original.kpis, original.extras, original.line)
        assert loaded.timestamp == original.timestamp and loaded.time_s == pytest.approx(original.time_s)
    radio_gaps = sum(row.kpis["L1M.DL-SS-RSRP"] is None for row in rows)
    assert trace.stats.missing["L1M.DL-SS-RSRP"] == radio_gaps > 0


def test_round_trip_through_a_hand_written_mapping(tmp_path):
    rows = generate_trace(2, 30, 1.0, seed=1, outages=0)
    write_trace_csv(rows, tmp_path / "t.csv")
    spec = TraceSpec.model_validate({
        "path": "t.csv", "timestamp": {"column": "timestamp", "format": "iso8601"}, "entity": "cell_id",
        "kpis": {"thp_mbps": {"column": "DRB.UEThpDl", "scale": 0.001}, "RRU.PrbTotDl": "RRU.PrbTotDl"}})
    trace = load_trace(spec, tmp_path)
    assert [row.kpis["thp_mbps"] for row in trace.rows] == pytest.approx(
        [row.kpis["DRB.UEThpDl"] / 1000 for row in rows])
    assert [row.kpis["RRU.PrbTotDl"] for row in trace.rows] == [row.kpis["RRU.PrbTotDl"] for row in rows]


@pytest.mark.parametrize("args", [(0, 10, 1, 0), (1, 10, 0, 0), (1, 0.5, 1, 0)])
def test_bad_arguments_are_refused(args):
    with pytest.raises(TraceError, match="cannot generate a trace"):
        generate_trace(*args)
