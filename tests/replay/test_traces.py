"""The trace loader on fixtures shaped like public RAN datasets: every repair counted exactly."""

from __future__ import annotations

import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import pytest
from pydantic import ValidationError

from ricllm.errors import RicllmError
from ricllm.replay.traces import TraceError, TraceSpec, load_trace

FIXTURES = Path(__file__).parent / "fixtures"

BS_EMULATOR = {
    "path": "bs_emulator.csv",
    "timestamp": {"column": "timestamp", "format": "epoch_ms"},
    "entity": "bs_id",
    "kpis": {
        "RRC.ConnMean": "num_ues",
        "DRB.UEThpDl": {"column": "dl_brate", "unit": "bit/s"},
        "DRB.UEThpUl": {"column": "ul_brate", "unit": "bit/s", "scale": 0.001},
    },
}
UE_SLICES = {
    "path": "ue_slices.csv",
    "timestamp": {"column": "Timestamp", "format": "epoch_ms"},
    "entity": "IMSI",
    "kpis": {
        "RRU.PrbUsedDl": "sum_granted_prbs",
        "mcs": "dl_mcs",
        "buffer_bytes": {"column": "dl_buffer [bytes]", "unit": "byte"},
        "cqi": "dl_cqi",
        "DRB.UEThpDl": {"column": "tx_brate downlink [Mbps]", "unit": "Mbps"},
    },
    "passthrough": ["slice_id"],
}
CELL_SIM = {
    "path": "cell_sim_10ms.csv",
    "timestamp": {"column": "timestamp", "format": "iso8601"},
    "entity": "cell_id",
    "kpis": {
        "RRU.PrbAvailDl": "prb_avail_dl",
        "RRU.PrbUsedDl": "prb_used_dl",
        "DRB.PdcpSduVolumeDL": {"column": "pdcp_bytes_dl", "unit": "bytes"},
    },
}
DRIVE_TEST = {
    "path": "drive_test.csv",
    "timestamp": {"column": "Timestamp", "format": "%Y.%m.%d_%H.%M.%S"},
    "kpis": {
        "L1M.DL-SS-RSRP": {"column": "RSRP", "unit": "dBm"},
        "L1M.DL-SS-SINR": {"column": "SNR", "unit": "dB"},
        "DRB.UEThpDl": {"column": "DL_bitrate", "unit": "kbps"},
        "DRB.UEThpUl": {"column": "UL_bitrate", "unit": "kbps"},
    },
    "sentinels": {"RSRP": {"valid_range": [-156, -31]}, "SNR": [2147483647]},
    "passthrough": ["NetworkMode", "CellID"],
}
DRIVE_COLUMNS = ("RSRP", "SNR", "DL_bitrate", "UL_bitrate")


def load(spec: dict, **changes):
    return load_trace(TraceSpec.model_validate({**spec, **changes}), FIXTURES)


def column_counts(**counts: int) -> dict[str, int]:
    return {column: counts.get(column, 0) for column in DRIVE_COLUMNS}


def test_bs_emulator_epoch_ms_quarter_second():
    trace = load(BS_EMULATOR)
    assert len(trace.rows) == 24 and trace.entities() == ["1", "2"]
    bs1 = [row for row in trace.rows if row.entity == "1"]
    assert [row.time_s for row in bs1] == [0.25 * k for k in range(12)]
    assert bs1[0].timestamp == 1652191800000.0  # the file's own number, in ms
    assert bs1[0].kpis == {"RRC.ConnMean": 5.0, "DRB.UEThpDl": 2500.0, "DRB.UEThpUl": 400.0}
    assert trace.rows[-1].kpis["DRB.UEThpDl"] == pytest.approx(6375.0)  # 6 375 000 bit/s
    stats = trace.stats
    assert (stats.rows_read, stats.rows_kept, stats.reordered, stats.duplicates_dropped) == (24, 24, 0, 0)
    assert sum(stats.skipped.values()) == 0 and stats.ragged_rows == 0


def test_ue_slices_units_passthrough_and_truncated_last_line():
    trace = load(UE_SLICES)
    assert len(trace.rows) == 24 and len(trace.entities()) == 3
    first = trace.rows[0]
    assert first.entity == "1010123456002" and first.extras == {"slice_id": "0"}
    assert first.kpis["DRB.UEThpDl"] == pytest.approx(4520.0)  # 4.52 Mbps
    assert first.kpis["buffer_bytes"] == 45120.0  # not an E2SM-KPM name: no canonical unit, scale 1
    slices = [row.extras["slice_id"] for row in trace.rows if row.entity == "1010123456003"]
    assert slices == ["1"] * 4 + ["0"] * 4  # the UE moves slice mid-trace
    last = trace.rows[-1]
    assert (last.line, last.time_s, last.kpis["RRU.PrbUsedDl"]) == (25, 1.75, 12.0)
    assert last.kpis["mcs"] is None and last.kpis["DRB.UEThpDl"] is None
    assert trace.stats.ragged_rows == 1
    assert trace.stats.missing == {"sum_granted_prbs": 0, "dl_mcs": 1, "dl_buffer [bytes]": 1,
                                   "dl_cqi": 1, "tx_brate downlink [Mbps]": 1}


def test_cell_sim_iso8601_every_10ms():
    trace = load(CELL_SIM)
    assert len(trace.rows) == 30 and trace.entities() == ["1111", "1112"]
    times = [row.time_s for row in trace.rows if row.entity == "1112"]
    assert times == pytest.approx([0.01 * k for k in range(15)], abs=1e-9)
    first = trace.rows[0]
    assert first.timestamp == datetime(2023, 5, 4, 10, 0, tzinfo=timezone.utc)
    assert first.kpis == {"RRU.PrbAvailDl": 273.0, "RRU.PrbUsedDl": 40.0,
                          "DRB.PdcpSduVolumeDL": pytest.approx(40.0)}  # 5000 bytes = 40 kbit


def test_drive_test_keep_policy_counts_every_repair():
    trace = load(DRIVE_TEST)
    stats = trace.stats
    assert (stats.rows_read, stats.rows_kept, stats.blank_lines, stats.ragged_rows) == (29, 27, 1, 0)
    assert stats.duplicates_dropped == 2  # line 7 repeats 11.07.25, line 16 repeats line 15
    assert stats.reordered == 1  # line 10 (11.07.27) comes after line 9 (11.07.28)
    assert stats.missing == column_counts(RSRP=1, SNR=1, DL_bitrate=1)  # '-', 'NaN', ''
    assert stats.invalid == column_counts(DL_bitrate=1)  # 'ERR'
    assert stats.sentinels == column_counts(RSRP=2, SNR=1)  # 0 and -999; 2147483647
    assert sum(stats.skipped.values()) == 0 and (stats.filled, stats.unfilled) == (0, 0)
    by_line = {row.line: row for row in trace.rows}
    assert by_line[4].kpis["L1M.DL-SS-RSRP"] is None and by_line[8].kpis["L1M.DL-SS-RSRP"] is None
    assert by_line[12].kpis["L1M.DL-SS-SINR"] is None and by_line[13].kpis["DRB.UEThpDl"] is None
    assert 7 not in by_line and 16 not in by_line


def test_drive_test_out_of_order_rows_are_sorted():
    trace = load(DRIVE_TEST)
    assert [row.time_s for row in trace.rows] == [float(s) for s in range(27)]
    assert [row.line for row in trace.rows[5:8]] == [8, 10, 9]
    assert trace.rows[0].timestamp == datetime(2018, 2, 13, 11, 7, 21, tzinfo=timezone.utc)


def test_drive_test_network_mode_changes_mid_trace():
    trace = load(DRIVE_TEST)
    modes = [row.extras["NetworkMode"] for row in trace.rows]
    assert modes == ["LTE"] * 11 + ["NR"] * 16
    assert trace.rows[11].extras == {"NetworkMode": "NR", "CellID": "17"}


@pytest.mark.parametrize("duplicates, kept, dropped, rsrp_at_25", [
    ("keep_first", 27, 2, -98.0), ("keep_last", 27, 2, -99.0), ("keep_all", 29, 0, -98.0)])
def test_duplicate_modes(duplicates, kept, dropped, rsrp_at_25):
    trace = load(DRIVE_TEST, duplicates=duplicates)
    assert (trace.stats.rows_kept, trace.stats.duplicates_dropped) == (kept, dropped)
    at_25 = [row for row in trace.rows if row.time_s == 4.0]
    assert at_25[0].kpis["L1M.DL-SS-RSRP"] == rsrp_at_25
    if duplicates == "keep_all":
        assert [row.line for row in at_25] == [6, 7]  # file order kept for equal times


@pytest.mark.parametrize("duplicates, kept, missing_value", [("keep_first", 20, 4), ("keep_last", 21, 3)])
def test_skip_policy_drops_flagged_rows(duplicates, kept, missing_value):
    trace = load(DRIVE_TEST, policy="skip", duplicates=duplicates)
    stats = trace.stats
    assert stats.rows_kept == len(trace.rows) == kept
    assert stats.skipped == {"no_timestamp": 0, "no_entity": 0, "missing_value": missing_value,
                             "sentinel": 3}
    assert all(value is not None for row in trace.rows for value in row.kpis.values())
    assert stats.rows_read == stats.rows_kept + sum(stats.skipped.values()) + stats.duplicates_dropped


def test_fill_policy_carries_last_good_value_in_time_order():
    trace = load(DRIVE_TEST, policy="fill")
    assert (trace.stats.filled, trace.stats.unfilled, trace.stats.rows_kept) == (7, 0, 27)
    by_line = {row.line: row.kpis for row in trace.rows}
    assert by_line[4]["L1M.DL-SS-RSRP"] == -96.0  # from line 3
    assert by_line[5]["L1M.DL-SS-SINR"] == 7.0  # from line 4
    assert by_line[6]["DRB.UEThpDl"] == 1300.0  # from line 5
    assert by_line[8]["L1M.DL-SS-RSRP"] == -98.0  # line 7 was a dropped duplicate, not a source
    assert by_line[11]["L1M.DL-SS-RSRP"] == -100.0  # line 9 (11.07.28) is the latest, not line 10
    assert by_line[12]["L1M.DL-SS-SINR"] == 5.0 and by_line[13]["DRB.UEThpDl"] == 900.0


def test_fill_is_per_entity_and_counts_what_it_cannot_fill(tmp_path):
    (tmp_path / "t.csv").write_text("t,cell,thp\n0,a,\n1,b,5\n2,a,7\n3,b,NA\n4,a,-\n")
    spec = TraceSpec(path="t.csv", timestamp={"column": "t", "format": "epoch_s"}, entity="cell",
                     kpis={"DRB.UEThpDl": "thp"}, policy="fill")
    trace = load_trace(spec, tmp_path)
    assert [(row.entity, row.kpis["DRB.UEThpDl"]) for row in trace.rows] == [
        ("a", None), ("b", 5.0), ("a", 7.0), ("b", 5.0), ("a", 7.0)]
    assert (trace.stats.filled, trace.stats.unfilled) == (2, 1)


def test_rows_without_time_or_entity_are_skipped_and_counted(tmp_path):
    (tmp_path / "t.csv").write_text("t,cell,thp\n,a,1\n1,,2\n2,a,3\nnull,b,4\n")
    spec = TraceSpec(path="t.csv", timestamp={"column": "t", "format": "epoch_s"}, entity="cell",
                     kpis={"DRB.UEThpDl": "thp"})
    trace = load_trace(spec, tmp_path)
    assert [row.line for row in trace.rows] == [4]
    assert trace.stats.skipped == {"no_timestamp": 2, "no_entity": 1, "missing_value": 0, "sentinel": 0}


def test_naive_and_aware_iso_times_mix_and_header_whitespace(tmp_path):
    (tmp_path / "t.csv").write_text(" ts , v\n2024-01-01T00:00:01+00:00,1\n2024-01-01 00:00:00,2\n")
    spec = TraceSpec(path="t.csv", timestamp={"column": "ts"}, kpis={"x": "v"})
    trace = load_trace(spec, tmp_path)
    assert [(row.time_s, row.kpis["x"], row.entity) for row in trace.rows] == [(0.0, 2.0, "all"),
                                                                             (1.0, 1.0, "all")]
    assert trace.stats.reordered == 1


def test_unknown_column_names_it_and_lists_the_header():
    with pytest.raises(TraceError) as info:
        load(DRIVE_TEST, path="broken_unknown_column.csv")
    message = str(info.value)
    assert "column 'RSRP' from the trace mapping is not in the header" in message
    assert "'RSRP_dBm'" in message and "'Timestamp'" in message and "'UL_bitrate'" in message
    assert isinstance(info.value, RicllmError)


def test_unparseable_timestamp_names_column_line_and_value():
    with pytest.raises(TraceError, match=r"broken_timestamp\.csv: line 5: timestamp column 'Timestamp' "
                                         r"has value '2018-02-13 11:07:24', which format "
                                         r"'%Y\.%m\.%d_%H\.%M\.%S' cannot parse"):
        load(DRIVE_TEST, path="broken_timestamp.csv")


def test_unparseable_epoch_is_an_error_too(tmp_path):
    (tmp_path / "t.csv").write_text("t,v\n1000,1\n10O0,2\n")
    spec = TraceSpec(path="t.csv", timestamp={"column": "t", "format": "epoch_ms"}, kpis={"x": "v"})
    with pytest.raises(TraceError, match="line 3: timestamp column 't' has value '10O0'"):
        load_trace(spec, tmp_path)


def test_missing_and_empty_files_are_trace_errors(tmp_path):
    spec = TraceSpec(path="absent.csv", timestamp={"column": "t"}, kpis={"x": "v"})
    with pytest.raises(TraceError, match="cannot read trace .*absent.csv"):
        load_trace(spec, tmp_path)
    (tmp_path / "absent.csv").write_text("")
    with pytest.raises(TraceError, match="is empty: expected a header line"):
        load_trace(spec, tmp_path)


def test_header_only_file_loads_empty(tmp_path):
    (tmp_path / "t.csv").write_text("t,v\n")
    trace = load_trace(TraceSpec(path="t.csv", timestamp={"column": "t"}, kpis={"x": "v"}), tmp_path)
    assert trace.rows == [] and trace.stats.rows_read == 0


@pytest.mark.parametrize("change, message", [
    ({"timestamp": {"column": "t", "format": "yyyy-mm-dd"}}, "not a strptime format"),
    ({"sentinels": {"other": [0]}}, "sentinels name column 'other', which no KPI maps"),
    ({"kpis": {"DRB.UEThpDl": {"column": "v", "unit": "dBm"}}}, "unit 'dBm' does not convert to 'kbps'"),
    ({"sentinels": {"v": {"valid_range": [0, -1]}}}, "min > max"),
    ({"policy": "drop"}, "policy"),
    ({"colums": ["v"]}, "colums"),
])
def test_spec_mistakes_are_refused(change, message):
    base = {"path": "t.csv", "timestamp": {"column": "t"}, "kpis": {"DRB.UEThpDl": "v"}}
    with pytest.raises(ValidationError, match=message):
        TraceSpec.model_validate({**base, **change})


def test_unit_resolves_scale_and_explicit_scale_wins():
    spec = TraceSpec.model_validate({"path": "t.csv", "timestamp": {"column": "t"}, "kpis": {
        "DRB.UEThpDl": {"column": "a", "unit": "Mbit/s"},
        "DRB.RlcSduDelayDl": {"column": "b", "unit": "ms"},
        "DRB.UEThpUl": {"column": "c", "unit": "kB/s", "scale": 8.0},
        "cqi": {"column": "d", "unit": "index"}}})
    assert [k.scale for k in spec.kpis.values()] == [1000.0, 10.0, 8.0, 1.0]


def test_replay_modules_do_not_import_torch():
    code = ("import sys, ricllm.replay.traces, ricllm.replay.generator; "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parents[2]).returncode == 0


@pytest.mark.parametrize("policy", ["skip", "fill", "keep"])
@pytest.mark.parametrize("duplicates", ["keep_first", "keep_last", "keep_all"])
def test_every_row_read_is_accounted_for(policy, duplicates):
    stats = load(DRIVE_TEST, policy=policy, duplicates=duplicates).stats
    assert stats.rows_read == 29
    assert stats.rows_read == stats.rows_kept + sum(stats.skipped.values()) + stats.duplicates_dropped
    assert stats.as_dict()["rows_kept"] == stats.rows_kept


def test_documented_mappings_validate_and_load_their_fixtures():
    yaml = pytest.importorskip("yaml")
    text = (Path(__file__).parents[2] / "docs" / "traces.md").read_text()
    blocks = [block.split("```", 1)[0] for block in text.split("```yaml\n")[1:]]
    specs = [TraceSpec.model_validate(yaml.safe_load(block)["trace"]) for block in blocks]
    assert len(specs) == 5
    loaded = [load_trace(spec, FIXTURES) for spec in specs if (FIXTURES / spec.path).exists()]
    assert [len(trace.rows) for trace in loaded] == [24, 24, 30, 27]
