"""Fault phases in a scenario: the ``faults`` field is checked with the field and line of a mistake;
the reaction window (requests admitted before the slowdown detector reacted) is found from the
records and the detector's verdicts alone; a schedule's hogs never outlive it; and a tiny replay
with a phase runs end to end, its report saying when the hog ran and which requests were in the window."""

from __future__ import annotations

import asyncio
import json
import textwrap
import time
from pathlib import Path

import pytest

from ricllm.cli import main
from ricllm.replay.fault_phases import FaultSchedule, fault_section, mark_windows, reaction_windows
from ricllm.replay.loading import ScenarioError, load_scenario
from ricllm.replay.schema import FaultPhase
from ricllm.report.aggregate import aggregate, evaluate_targets
from ricllm.report.records import RequestRecord
from tests.replay.test_replay import parse_html, scenario_file
from tests.test_faults import alive, wait_gone

BASE = textwrap.dedent("""\
    name: unit
    trace:
      generator: {cells: 2, duration_s: 30, interval_s: 1.0, seed: 2}
    triggers:
      - every_row
    classes:
      near_rt: {deadline_ms: 300, max_tokens: 8}
    faults:
      - {kind: cpu_hog, start_s: 10, stop_s: 20, duty: 0.3}
    targets:
      overall: ["met_of_admitted_outside_window >= 0.99", "window_missed <= 2"]
    """)
PHASE = "- {kind: cpu_hog, start_s: 10, stop_s: 20, duty: 0.3}"


def problem(tmp_path: Path, text: str, overrides=()) -> str:
    path = tmp_path / "scenario.yaml"
    path.write_text(text)
    with pytest.raises(ScenarioError) as info:
        load_scenario(path, overrides)
    return str(info.value)


def test_a_fault_phase_loads(tmp_path):
    path = tmp_path / "scenario.yaml"
    path.write_text(BASE)
    phase = load_scenario(path).faults[0]
    assert phase == FaultPhase(kind="cpu_hog", start_s=10, stop_s=20, duty=0.3)
    assert phase.period_ms == 10.0 and phase.label(0) == "cpu_hog 0"


@pytest.mark.parametrize("new, field, words", [
    ("- {kind: cpu_hog, start_s: 20, stop_s: 10, duty: 0.3}", "faults[0]", "stop_s (10) must be after start_s (20)"),
    ("- {kind: cpu_hog, start_s: 10, stop_s: 20, duty: 0}", "faults[0].duty", "greater than 0"),
    ("- {kind: cpu_hog, start_s: 10, stop_s: 20, duty: 1.5}", "faults[0].duty", "less than or equal to 1"),
    ("- {kind: cpu_hogg, start_s: 10, stop_s: 20, duty: 0.3}", "faults[0].kind", "'cpu_hog'"),
    ("- {kind: cpu_hog, start_s: 10, stop_s: 20}", "faults[0].duty", "Field required"),
    ("- {kind: cpu_hog, start_s: 10, stop_s: 20, duty: 0.3, dutty: 1}", "faults[0].dutty", "unknown field"),
    ("- {kind: cpu_hog, start_s: 10, stop_s: 45, duty: 0.3}", "faults[0].stop_s",
     "stops at 45 s, after the replayed trace ends (30 s of trace time)"),
    (f"{PHASE}\n  - {{kind: cpu_hog, start_s: 15, stop_s: 25, duty: 0.5}}", "faults[1].start_s",
     "overlaps faults[0] (10-20 s)"),
])
def test_fault_mistakes_name_the_field_and_the_line(tmp_path, new, field, words):
    text = BASE.replace(PHASE, new)
    message = problem(tmp_path, text)
    line = next(i for i, row in enumerate(text.splitlines(), 1) if new.splitlines()[-1].strip() in row)
    assert f"scenario.yaml: line {line}, {field}: " in message, message
    assert words in message, message


def test_a_phase_before_the_replayed_window_is_refused(tmp_path):
    message = problem(tmp_path, BASE + "pacing: {start_s: 12}\n")
    assert "faults[0].start_s: starts at 10 s, before the replay does (pacing.start_s 12 s" in message
    message = problem(tmp_path, BASE + "pacing: {duration_s: 15}\n")
    assert "faults[0].stop_s: stops at 20 s, after the replayed trace ends (15 s of trace time)" in message


# ------------------------------------------------------------------------------- the window

def record(i: int, sent: float, done: float | None, met: bool | None = True, admitted: bool = True,
           e2e: float | None = None, cls: str = "near_rt", deadline_ms: float | None = 300) -> RequestRecord:
    r = RequestRecord(f"r{i}", "cell0", sent, i, "t", cls, None, deadline_ms, 8, sent, sent_s=sent)
    if not admitted:
        r.finish("rejected", admitted=False, rejection_code="DEADLINE_INFEASIBLE", done_s=sent)
        return r
    r.finish("completed", admitted=True, finish_reason="stop", done_s=done, met=met,
             server_e2e_s=e2e if e2e is not None else (done - sent))
    return r


PHASES = [{"index": 0, "name": "hog", "kind": "cpu_hog", "duty": 0.3, "started_s": 10.0, "stopped_s": 20.0}]


def test_the_window_runs_from_the_phase_start_to_the_detectors_first_slow_verdict():
    events = [{"t_s": 3.0, "slow": True, "step_multiplier": 1.3}, {"t_s": 4.0, "slow": False, "step_multiplier": 1.1},
              {"t_s": 10.8, "slow": True, "slowdown": 1.48, "typical_ratio": 1.31, "step_multiplier": 1.42},
              {"t_s": 14.0, "slow": False, "step_multiplier": 1.2},
              {"t_s": 15.0, "slow": True, "step_multiplier": 1.5}]
    records = [
        record(0, 9.0, 9.5),                            # finished before the phase: outside
        record(1, 9.8, 10.2),                           # admitted before, unfinished at the start: inside
        record(2, 10.5, 10.9, met=False, e2e=0.35),     # admitted before the detector fired: inside, 50 ms late
        record(3, 10.79, 11.2, met=False, e2e=0.41),    # still before the verdict: inside, 110 ms late
        record(4, 10.81, 11.0),                         # after the verdict: outside
        record(5, 12.0, 12.4, met=False, e2e=0.4),      # after the verdict and missed: outside, a broken promise
        record(6, 10.6, None, admitted=False),          # rejected: in no window
        record(7, 10.7, 12.0, met=True, cls="bulk", deadline_ms=None),  # best effort, admitted: inside
    ]
    phases = reaction_windows(PHASES, events)
    detector = phases[0]["detector"]
    assert phases[0]["window"] == {"start_s": 10.0, "end_s": 10.8}
    assert detector["fired_s"] == 10.8 and detector["reaction_ms"] == pytest.approx(800.0)
    assert (detector["slowdown"], detector["typical_ratio"], detector["step_multiplier"]) == (1.48, 1.31, 1.42)
    assert not detector["already_slow"] and detector["measured"]
    assert [e["t_s"] for e in detector["events"]] == [10.8, 14.0, 15.0]
    section = fault_section(PHASES, events, records)
    assert [r.reaction_window for r in records] == [None, 0, 0, 0, None, None, None, 0]
    window = section["phases"][0]["window"]
    assert (window["admitted"], window["met"], window["missed"]) == (4, 2, 2)
    assert window["late_ms"] == [pytest.approx(50.0), pytest.approx(110.0)] and window["max_late_ms"] == 110.0
    aggregates = aggregate(records, 20.0, ["near_rt", "bulk"])
    overall, near_rt = aggregates["overall"], aggregates["classes"]["near_rt"]
    assert (overall["window_admitted"], overall["window_missed"], overall["window_max_late_ms"]) == (4, 2, 110.0)
    assert overall["admitted_outside_window"] == 3 and overall["missed_outside_window"] == 1
    assert overall["met_of_admitted_outside_window"] == pytest.approx(2 / 3)
    assert near_rt["window_admitted"] == 3 and aggregates["classes"]["bulk"]["window_admitted"] == 1
    targets = evaluate_targets({"overall": ["met_of_admitted_outside_window >= 0.99", "window_missed <= 2",
                                            "window_max_late_ms < 100"]}, aggregates)
    assert [t["passed"] for t in targets] == [False, True, False]


def test_without_a_verdict_the_window_is_the_whole_phase():
    records = [record(0, 15.0, 15.5, met=False, e2e=0.5), record(1, 21.0, 21.3, met=False, e2e=0.31)]
    quiet = reaction_windows(PHASES, [{"t_s": 25.0, "slow": True, "step_multiplier": 1.3}])[0]  # fired after the end
    assert quiet["window"]["end_s"] == 20.0 and quiet["detector"]["fired_s"] is None
    unmeasured = fault_section(PHASES, None, records)  # over ZeroMQ
    assert unmeasured["detector_measured"] is False and unmeasured["phases"][0]["detector"]["measured"] is False
    assert [r.reaction_window for r in records] == [0, None]
    already = reaction_windows(PHASES, [{"t_s": 5.0, "slow": True, "step_multiplier": 1.6}])[0]
    assert already["window"] == {"start_s": 10.0, "end_s": 10.0} and already["detector"]["already_slow"]
    mark_windows(records, [already])
    assert [r.reaction_window for r in records] == [None, None]
    never = reaction_windows([{**PHASES[0], "started_s": None, "stopped_s": None}], [])[0]
    assert never["window"] is None
    mark_windows(records, [never])
    assert [r.reaction_window for r in records] == [None, None]


def test_without_fault_phases_outside_the_window_is_every_admitted_request():
    records = [record(0, 1.0, 1.2), record(1, 2.0, 2.5, met=False, e2e=0.5), record(2, 3.0, None, admitted=False)]
    section = fault_section([], None, records)
    overall = aggregate(records, 5.0, ["near_rt"])["overall"]
    assert section["phases"] == [] and overall["window_admitted"] == 0 and overall["window_max_late_ms"] == 0.0
    assert overall["met_of_admitted_outside_window"] == overall["met_of_admitted"] == 0.5


def test_the_timeline_gives_the_peak_step_multiplier_and_the_step_slowdown():
    timeline = [{"t_s": t, "step_ms_mean": 10.0 if t < 10 else 15.0, "latency_decode_multiplier": 1.0 if t < 10 else 1.6,
                 "latency_prefill_multiplier": 1.0}
                for t in range(25)]
    detector = reaction_windows(PHASES, [], timeline)[0]["detector"]
    assert detector["peak_step_multiplier"] == 1.6 and detector["step_slowdown"] == pytest.approx(1.5)


# ------------------------------------------------------------------------------ the schedule

@pytest.mark.timeout(60)
def test_a_schedule_starts_and_stops_its_hog_and_leaves_nothing_behind():
    phases = [FaultPhase(kind="cpu_hog", start_s=0.4, stop_s=0.8, duty=0.2)]
    schedule = FaultSchedule(phases, speed=2.0, pacing_start_s=0.0, cpus=[0])
    seen: list[int] = []

    async def watch_and_run() -> None:
        stop = asyncio.Event()
        t0 = time.perf_counter()
        task = asyncio.create_task(schedule.run(t0, asyncio.sleep, stop))
        await asyncio.sleep(0.3)  # the phase runs 0.2-0.4 s of the replay
        seen.extend(c.pid for hog in schedule.hogs if hog for c in hog._children)
        await task

    asyncio.run(watch_and_run())
    report = schedule.report()[0]
    assert seen and wait_gone(seen, 5) == []
    assert report["start_s"] == 0.2 and report["stop_s"] == 0.4 and report["cpus"] == [0]
    assert 0.2 <= report["started_s"] < report["stopped_s"] and report["stopped_s"] >= 0.4


@pytest.mark.timeout(60)
def test_a_cancelled_schedule_stops_its_hog():
    phases = [FaultPhase(kind="cpu_hog", start_s=0.0, stop_s=30.0, duty=0.2)]
    schedule = FaultSchedule(phases, speed=1.0, pacing_start_s=0.0)

    async def cancel_midway() -> list[int]:
        task = asyncio.create_task(schedule.run(time.perf_counter(), asyncio.sleep, asyncio.Event()))
        await asyncio.sleep(0.2)
        pids = [c.pid for hog in schedule.hogs if hog for c in hog._children]
        assert pids and all(alive(p) for p in pids)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return pids

    pids = asyncio.run(cancel_midway())
    assert wait_gone(pids, 5) == []
    assert schedule.report()[0]["stopped_s"] is not None


# ----------------------------------------------------------------------------- end to end

FAULT = "faults:\n  - {kind: cpu_hog, name: neighbour, start_s: 1.0, stop_s: 3.0, duty: 0.5}\n"


@pytest.mark.timeout(300)
def test_a_tiny_replay_with_a_fault_phase_reports_it(tiny_gguf, tmp_path, monkeypatch, capsys):
    from ricllm.engine.latency_model import LatencyModel

    fit = tmp_path / "fit.json"
    LatencyModel([0.003, 2e-5, 2e-4, 1e-7, 0.0]).save(fit)
    path = scenario_file(tmp_path, tiny_gguf, fit)
    text = path.read_text().replace("targets:\n  overall:", FAULT + "targets:\n  overall:")
    text = text.replace('["met_of_admitted >= 0.5", "met_of_sent >= 0.99"]',
                        '["met_of_admitted_outside_window >= 0.5", "window_missed <= 100"]')
    text = text.replace("  impossible: {deadline_ms: 1, max_tokens: 8, weight: 1}\n", "")
    path.write_text(text)
    monkeypatch.setenv("RICLLM_CACHE_DIR", str(tmp_path / "cache"))
    code = main(["replay", str(path), "--out", str(tmp_path / "report"), "--no-progress"])
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    assert code == 0 and report["compliant"], report["targets"]
    faults = report["faults"]
    phase = faults["phases"][0]
    assert faults["detector_measured"] is True and isinstance(faults["detector_events"], list)
    assert phase["name"] == "neighbour" and phase["start_s"] == 0.25 and phase["stop_s"] == 0.75  # speed 4
    assert 0.25 <= phase["started_s"] < phase["stopped_s"] and phase["detector"]["measured"] is True
    window = phase["window"]
    assert window["start_s"] == phase["started_s"] and window["start_s"] <= window["end_s"] <= phase["stopped_s"]
    inside = [r for r in report["requests"] if r["reaction_window"] == 0]
    assert len(inside) == window["admitted"] == report["aggregates"]["overall"]["window_admitted"]
    assert all(r["admitted"] and r["sent_s"] < window["end_s"] and r["done_s"] > window["start_s"] for r in inside)
    assert all("latency_decode_multiplier" in s and "latency_after_idle_multiplier" in s for s in report["timeline"])
    out = capsys.readouterr().out
    assert "fault neighbour: cpu_hog duty 0.5" in out and "reaction window" in out
    page = " ".join(parse_html(tmp_path / "report" / "report.html").text)
    assert "Fault phases" in page and "met % of admitted outside" in page
    rerendered = main(["report", str(tmp_path / "report")])
    assert rerendered == 0 and "reaction window" in capsys.readouterr().out
