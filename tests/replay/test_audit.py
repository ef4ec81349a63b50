"""``ricllm replay --audit``: every refusal is checked against a run that served everything.

The tiny model answers a 4-token request in a few milliseconds. A latency fit whose calibration
says a step after an idle gap runs 300 ms late makes deadline admission refuse the 60 ms class
whenever it arrives at an idle engine, and the admit-all run serves those in time: false
refusals, which the audit must count, each one. The 1 ms class misses however it is served:
refusing it is right."""

from __future__ import annotations

import json

import pytest

from ricllm.cli import main
from ricllm.engine.latency_model import LatencyModel
from tests.replay.test_replay import FIT, scenario_file

TIGHT = "  tight: {deadline_ms: 60, max_tokens: 4, weight: 6, ignore_eos: true}\n"
COLD_STEP_RATIO = 100.0  # what the fit's calibration says a first step after an idle gap takes, times its fit


@pytest.fixture(scope="module")
def audited(tiny_gguf, tmp_path_factory) -> tuple[int, dict]:
    folder = tmp_path_factory.mktemp("audit")
    fit = folder / "fit.json"
    LatencyModel(list(FIT), residuals={"after_idle": [COLD_STEP_RATIO]}).save(fit)
    path = scenario_file(folder, tiny_gguf, fit, duration_s=4, extra_classes=TIGHT)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RICLLM_CACHE_DIR", str(folder / "cache"))
        code = main(["replay", str(path), "--out", str(folder / "report"), "--no-progress", "--audit"])
    return code, json.loads((folder / "report" / "report.json").read_text())


def test_every_refusal_that_would_have_met_its_deadline_is_a_false_refusal(audited):
    _, report = audited
    audit = report["audit"]
    refused = {r["id"]: r for r in report["requests"] if r["status"] == "rejected"}
    assert sorted(r["id"] for r in audit["refusals"]) == sorted(refused)
    assert any(r["deadline_class"] == "tight" for r in refused.values()), "an idle arrival of the 60 ms class should be refused"
    served_in_time = sorted(r["id"] for r in audit["refusals"] if r["met_when_all_served"])
    assert served_in_time, "the admit-all run should meet some 60 ms deadlines"
    assert sorted(audit["false_refusal_ids"]) == served_in_time and audit["false_refusals"] == len(served_in_time)
    assert audit["false_refusal_rate"] == pytest.approx(len(served_in_time) / audit["sent"])
    assert audit["refused_would_have_missed"] == len(refused) - len(served_in_time)
    impossible = [r for r in audit["refusals"] if r["deadline_class"] == "impossible"]
    assert impossible and not any(r["met_when_all_served"] for r in impossible)
    for refusal in audit["refusals"]:
        numbers = refused[refusal["id"]]["rejection_numbers"]
        assert refusal["bound_ms"] == numbers["bound_ms"]
        assert refusal["slack_lacked_ms"] == pytest.approx(numbers["bound_ms"] - numbers["deadline_ms"])
        assert refusal["slack_lacked_ms"] > 0


def test_the_audit_compares_goodput_with_the_admit_all_run_and_the_baselines(audited):
    _, report = audited
    audit = report["audit"]
    assert set(audit["goodput"]) == {"deadline", "admit_all", "fcfs", "edf"}
    met_here = sum(1 for r in report["requests"] if r["deadline_ms"] is not None and r["met"])
    assert audit["goodput"]["deadline"]["met"] == met_here
    assert audit["goodput"]["admit_all"]["met"] >= audit["false_refusals"]  # each was met there
    assert audit["goodput_vs"]["admit_all"] == pytest.approx(met_here / audit["goodput"]["admit_all"]["met"])
    assert audit["met_of_admitted"]["deadline"] == 1.0


def test_an_audit_against_a_server_is_refused_naming_the_flag(tmp_path, capsys):
    assert main(["replay", "default", "--audit", "--endpoint", "tcp://127.0.0.1:9"]) == 2
    assert "--audit" in capsys.readouterr().err


def test_the_terminal_summary_states_the_audits_numbers(audited):
    from ricllm.report.terminal import audit_lines

    _, report = audited
    audit = report["audit"]
    first, goodput, _ = audit_lines(audit)
    assert f"{audit['refused']} of {audit['sent']} deadline requests refused" in first
    assert f"{audit['false_refusals']} would have met their deadline" in first
    assert f"admit_all {audit['goodput']['admit_all']['met']}" in goodput
