"""Scenario files: validation errors name the field and the YAML line; thresholds are parsed, never
eval'd; triggers, class mix and template choice are deterministic; the bundled scenarios load."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import pytest

from ricllm.replay.expressions import Threshold
from ricllm.replay.loading import ScenarioError, bundled_scenarios, load_scenario, load_scenario_trace
from ricllm.replay.planning import fire_triggers, plan_requests
from ricllm.replay.schema import Trigger
from ricllm.replay.templates import scenario_templates
from ricllm.replay.traces import KpiRow

ROOT = Path(__file__).parents[2]
FIXTURES = Path(__file__).parent / "fixtures"

BASE = textwrap.dedent("""\
    name: unit
    seed: 1
    trace:
      generator: {cells: 3, duration_s: 20, interval_s: 1.0, seed: 2}
    pacing:
      speed: 2.0
    triggers:
      - threshold: "RRU.PrbUsedDl / RRU.PrbAvailDl > 0.3"
        cooldown_s: 2
      - every: {seconds: 5}
        template: alpha
    classes:
      near_rt: {deadline_ms: 500, max_tokens: 12, weight: 3}
      non_rt: {deadline_ms: 4000, max_tokens: 64, weight: 1}
    prompts:
      templates:
        alpha: "You are a RAN assistant."
        beta: "You are another RAN assistant."
      user_prompt: "{{ entity }} PRB {{ kpi['RRU.PrbTotDl'] | fmt(1) }}"
    targets:
      overall: ["met_of_admitted >= 0.9"]
    """)


def write(tmp_path: Path, text: str, name: str = "scenario.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def line_of(text: str, fragment: str) -> int:
    """1-based line of the first line containing ``fragment``."""
    return next(i for i, line in enumerate(text.splitlines(), 1) if fragment in line)


def problem(tmp_path: Path, text: str, overrides=()) -> str:
    with pytest.raises(ScenarioError) as info:
        load_scenario(write(tmp_path, text), overrides)
    return str(info.value)


def test_base_scenario_loads_and_plans(tmp_path):
    scenario = load_scenario(write(tmp_path, BASE))
    assert scenario.name == "unit" and scenario.base_dir == tmp_path.resolve()
    plan = plan_requests(scenario, load_scenario_trace(scenario))
    assert plan and all(p.send_offset_s == p.trace_time_s / 2.0 for p in plan)
    assert [p.send_offset_s for p in plan] == sorted(p.send_offset_s for p in plan)
    assert {p.template for p in plan if p.trigger == "every 5 s"} == {"alpha"}


@pytest.mark.parametrize("old, new, field, words", [
    ('"RRU.PrbUsedDl / RRU.PrbAvailDl > 0.3"', '"RRU.PrbUsedDl / > 0.3"', "triggers[0].threshold",
     "not a valid expression"),
    ('"RRU.PrbUsedDl / RRU.PrbAvailDl > 0.3"', "\"__import__('os').system('true') > 0\"", "triggers[0].threshold",
     "Call is not allowed"),
    ('"RRU.PrbUsedDl / RRU.PrbAvailDl > 0.3"', '"RRU.PrbUsedUl / RRU.PrbAvailDl > 0.3"', "triggers[0].threshold",
     "unknown KPI 'RRU.PrbUsedUl'"),
    ('"RRU.PrbUsedDl / RRU.PrbAvailDl > 0.3"', '"RRU.PrbUsedDl"', "triggers[0].threshold", "must be a comparison"),
    ("template: alpha", "template: gamma", "triggers[1].template", "unknown template 'gamma'"),
    ("deadline_ms: 500", "deadline_ms: -5", "classes.near_rt.deadline_ms", "greater than 0"),
    ("speed: 2.0", "sped: 2.0", "pacing.sped", "unknown field"),
    ("cells: 3", "cells: 0", "trace.generator.cells", "greater than or equal to 1"),
    ("- every: {seconds: 5}", "- every: {seconds: 5}\n    every_row: true", "triggers[1]", "exactly one of"),
    ('"met_of_admitted >= 0.9"', '"met_of_admited >= 0.9"', "targets.overall[0]", "unknown metric 'met_of_admited'"),
    ("overall: [", "near_rtt: [", "targets.near_rtt", "unknown scope 'near_rtt'"),
    ("fmt(1) }}", "fmt(1) }} {{ kpis }}", "prompts.user_prompt", "'kpis' is undefined"),
    ("fmt(1) }}", "fmt(1) }} {% if %}", "prompts.user_prompt", "syntax error"),
])
def test_errors_name_the_field_and_the_line(tmp_path, old, new, field, words):
    assert old in BASE
    text = BASE.replace(old, new, 1)
    message = problem(tmp_path, text)
    assert f"scenario.yaml: line {line_of(text, new.splitlines()[0])}, {field}: " in message, message
    assert words in message, message


def test_missing_field_points_at_its_parent(tmp_path):
    text = BASE.replace("non_rt: {deadline_ms: 4000, max_tokens: 64, weight: 1}", "non_rt: {max_tokens: 64}")
    message = problem(tmp_path, text)
    assert f"line {line_of(text, 'non_rt:')}, classes.non_rt.deadline_ms: Field required" in message


def test_several_problems_are_listed_in_line_order(tmp_path):
    text = BASE.replace("max_tokens: 64", "max_tokens: 0").replace("speed: 2.0", "speed: -1")
    message = problem(tmp_path, text)
    assert message.startswith("scenario.yaml: 2 problems:")
    first, second = message.splitlines()[1:]
    assert f"line {line_of(text, 'speed: -1')}, pacing.speed" in first
    assert f"line {line_of(text, 'max_tokens: 0')}, classes.non_rt.max_tokens" in second
    # cross-field checks run on a scenario whose fields are each valid, and are listed the same way
    text = BASE.replace("template: alpha", "template: nope").replace("weight: 1}", "weight: 0}").replace(
        "weight: 3", "weight: 0")
    message = problem(tmp_path, text)
    assert message.startswith("scenario.yaml: 2 problems:")
    assert "triggers[1].template: unknown template 'nope'" in message and "add up to 0" in message


def test_yaml_syntax_error_has_its_line(tmp_path):
    text = BASE.replace("seed: 1", "seed: [1")
    assert "not valid YAML" in problem(tmp_path, text) and "line " in problem(tmp_path, text)


def test_override_errors_name_the_flag(tmp_path):
    message = problem(tmp_path, BASE, ["engine.block_size=0"])
    assert "--set engine.block_size: " in message and "greater than or equal to 1" in message
    scenario = load_scenario(write(tmp_path, BASE), ["engine.enable_prefix_caching=false", "pacing.speed=4"])
    assert scenario.engine.enable_prefix_caching is False and scenario.pacing.speed == 4


def test_csv_trace_thresholds_know_the_mapped_kpis(tmp_path):
    mapping = textwrap.dedent(f"""\
        trace:
          path: {FIXTURES / 'cell_sim_10ms.csv'}
          timestamp: {{column: timestamp, format: iso8601}}
          entity: cell_id
          kpis:
            RRU.PrbAvailDl: prb_avail_dl
            RRU.PrbUsedDl: prb_used_dl
        """)
    text = BASE.split("trace:")[0] + mapping + "pacing:" + BASE.split("pacing:")[1]
    text = text.replace("{{ kpi['RRU.PrbTotDl'] | fmt(1) }}", "{{ kpi['RRU.PrbUsedDl'] | fmt(0) }}")
    scenario = load_scenario(write(tmp_path, text))
    assert plan_requests(scenario, load_scenario_trace(scenario))
    bad = text.replace("RRU.PrbUsedDl / RRU.PrbAvailDl > 0.3", "DRB.UEThpDl > 1")
    message = problem(tmp_path, bad)
    assert "triggers[0].threshold" in message and "the trace has RRU.PrbAvailDl, RRU.PrbUsedDl" in message
    # a prompt that reads a KPI this trace does not map fails now, not mid-replay
    unmapped = text.replace("{{ kpi['RRU.PrbUsedDl'] | fmt(0) }}", "{{ kpi['RRU.PrbTotDl'] | fmt(0) }}")
    assert "prompts.user_prompt" in problem(tmp_path, unmapped)


def test_a_prompt_may_read_the_traces_passthrough_columns(tmp_path):
    """``extras[COLUMN]`` is documented for a CSV trace's passthrough columns: validation renders the
    prompt with those columns, so it accepts them and still refuses a column the trace does not pass."""
    mapping = textwrap.dedent(f"""\
        trace:
          path: {FIXTURES / 'drive_test.csv'}
          timestamp: {{column: Timestamp, format: "%Y.%m.%d_%H.%M.%S"}}
          entity: CellID
          kpis:
            DRB.UEThpDl: DL_bitrate
            L1M.DL-SS-SINR: SNR
          passthrough: [NetworkMode]
        """)
    text = BASE.split("trace:")[0] + mapping + "pacing:" + BASE.split("pacing:")[1]
    text = text.replace("RRU.PrbUsedDl / RRU.PrbAvailDl > 0.3", "DRB.UEThpDl > 1000")
    text = text.replace("{{ kpi['RRU.PrbTotDl'] | fmt(1) }}", "{{ extras['NetworkMode'] }} {{ kpi['DRB.UEThpDl'] }}")
    scenario = load_scenario(write(tmp_path, text))
    assert plan_requests(scenario, load_scenario_trace(scenario))
    unknown = text.replace("extras['NetworkMode']", "extras['Operator']")
    assert "prompts.user_prompt" in problem(tmp_path, unknown)


def test_cli_user_error_exits_2_without_traceback(tmp_path):
    path = write(tmp_path, BASE.replace("deadline_ms: 500", "deadline_ms: -5"))
    result = subprocess.run([sys.executable, "-m", "ricllm.cli", "replay", str(path)], capture_output=True, text=True,
                            cwd=ROOT, timeout=120)
    assert result.returncode == 2
    assert "classes.near_rt.deadline_ms" in result.stderr and "Traceback" not in result.stderr
    missing = subprocess.run([sys.executable, "-m", "ricllm.cli", "replay", "no-such-scenario"], capture_output=True,
                             text=True, cwd=ROOT, timeout=120)
    assert missing.returncode == 2 and "bundled: capacity, default, link, overload, stress, templates" in missing.stderr


# ------------------------------------------------------------------------------- thresholds

@pytest.mark.parametrize("expression, kpis, expected", [
    ("RRU.PrbUsedDl / RRU.PrbAvailDl > 0.8", {"RRU.PrbUsedDl": 90, "RRU.PrbAvailDl": 100}, True),
    ("RRU.PrbUsedDl / RRU.PrbAvailDl > 0.8", {"RRU.PrbUsedDl": 50, "RRU.PrbAvailDl": 100}, False),
    ("RRU.PrbUsedDl / RRU.PrbAvailDl > 0.8", {"RRU.PrbUsedDl": 50, "RRU.PrbAvailDl": 0}, False),
    ("RRU.PrbUsedDl / RRU.PrbAvailDl > 0.8", {"RRU.PrbUsedDl": None, "RRU.PrbAvailDl": 100}, False),
    ("L1M.DL-SS-SINR < 5 and L1M.DL-SS-RSRP > -95", {"L1M.DL-SS-SINR": 2, "L1M.DL-SS-RSRP": -90}, True),
    ("L1M.DL-SS-SINR < 5 and L1M.DL-SS-RSRP > -95", {"L1M.DL-SS-SINR": 2, "L1M.DL-SS-RSRP": -99}, False),
    ("L1M.DL-SS-SINR < 0 or RRU.PrbTotDl >= 90", {"L1M.DL-SS-SINR": None, "RRU.PrbTotDl": 95}, True),
    ("not RRU.PrbTotDl > 10", {"RRU.PrbTotDl": 5}, True),
    ("100 - RRU.PrbTotDl > 50", {"RRU.PrbTotDl": 30}, True),
    ("-RRU.PrbTotDl + 2 * 3 < 0", {"RRU.PrbTotDl": 30}, True),
    ("10 < RRU.PrbTotDl <= 20", {"RRU.PrbTotDl": 20}, True),
    ("`buffer bytes` > 1000", {"buffer bytes": 2000}, True),
    ("missing(RRU.PrbTotDl)", {"RRU.PrbTotDl": None}, True),
    ("missing(RRU.PrbTotDl)", {}, True),
    ("missing(RRU.PrbTotDl)", {"RRU.PrbTotDl": 0}, False),
    ("missing(RRU.PrbTotDl) or RRU.PrbTotDl > 90", {"RRU.PrbTotDl": None}, True),
    ("missing(RRU.PrbTotDl) or RRU.PrbTotDl > 90", {"RRU.PrbTotDl": 50}, False),
    ("not missing(`buffer bytes`) and `buffer bytes` > 1000", {"buffer bytes": 2000}, True),
])
def test_threshold_evaluation(expression, kpis, expected):
    known = ["RRU.PrbUsedDl", "RRU.PrbAvailDl", "RRU.PrbTotDl", "L1M.DL-SS-SINR", "L1M.DL-SS-RSRP", "buffer bytes"]
    assert Threshold(expression, known)(kpis) is expected


@pytest.mark.parametrize("expression, words", [
    ("RRU.PrbTotDl ** 2 > 1", "only + - * /"),
    ("RRU.PrbTotDl.__class__ > 1", "unknown KPI 'RRU.PrbTotDl.__class__'"),
    ("[RRU.PrbTotDl][0] > 1", "is not allowed"),
    ("RRU.PrbTotDl > 'x'", "only numbers"),
    ("RRU.PrbTotDl is None", "only < <= > >= == != comparisons"),
    ("lambda: 1", "must be a comparison"),
    ("print(RRU.PrbTotDl)", "the only call allowed is missing(KPI)"),
    ("missing(RRU.PrbTotDl, RRU.PrbTotDl)", "the only call allowed is missing(KPI)"),
    ("missing(RRU.PrbUsedDl)", "unknown KPI 'RRU.PrbUsedDl'"),
])
def test_threshold_refuses_everything_else(expression, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        Threshold(expression, ["RRU.PrbTotDl"])


# -------------------------------------------------------------------------------- triggers

def rows(values: list[tuple[float, str, float | None]]) -> list[KpiRow]:
    return [KpiRow(t, t, entity, {"load": v}) for t, entity, v in values]


def fired(trigger: dict, data: list[KpiRow]) -> list[tuple[float, str]]:
    firings = fire_triggers([Trigger.model_validate(trigger)], data, ["load"])
    return [(data[r].time_s, data[r].entity) for r, _ in firings]


TWO_CELLS = rows([(float(t), cell, v) for t, (a, b) in enumerate(
    [(0.1, 0.9), (0.9, 0.9), (0.95, 0.2), (0.2, 0.95), (0.9, None), (0.9, 0.9)]) for cell, v in (("a", a), ("b", b))])


def test_every_row_fires_on_each_row():
    assert len(fired({"every_row": True}, TWO_CELLS)) == len(TWO_CELLS)
    assert fired({"every_row": True, "entities": ["b"]}, TWO_CELLS) == [(float(t), "b") for t in range(6)]


def test_every_seconds_counts_per_entity():
    assert fired({"every": {"seconds": 2}}, TWO_CELLS) == [
        (0.0, "a"), (0.0, "b"), (2.0, "a"), (2.0, "b"), (4.0, "a"), (4.0, "b")]


def test_staggered_every_spreads_first_firings():
    data = rows([(float(t), f"c{i}", 1.0) for t in range(20) for i in range(8)])
    firsts = {}
    for time_s, entity in fired({"every": {"seconds": 10, "stagger": True}}, data):
        firsts.setdefault(entity, time_s)
    assert len(firsts) == 8 and len(set(firsts.values())) > 3 and all(t <= 10 for t in firsts.values())


def test_threshold_level_rising_and_cooldown():
    level = {"threshold": "load > 0.8"}
    assert fired(level, TWO_CELLS) == [(0.0, "b"), (1.0, "a"), (1.0, "b"), (2.0, "a"), (3.0, "b"), (4.0, "a"),
                                       (5.0, "a"), (5.0, "b")]
    assert fired({**level, "mode": "rising"}, TWO_CELLS) == [(0.0, "b"), (1.0, "a"), (3.0, "b"), (4.0, "a"),
                                                      (5.0, "b")]
    assert fired({**level, "cooldown_s": 3}, TWO_CELLS) == [(0.0, "b"), (1.0, "a"), (3.0, "b"), (4.0, "a")]


def test_trigger_shorthand_and_labels():
    assert Trigger.model_validate("every_row").every_row
    assert Trigger.model_validate({"threshold": "load > 1"}).label(0) == "threshold load > 1"
    assert Trigger.model_validate({"every": {"seconds": 3}, "name": "report"}).label(0) == "report"


# ------------------------------------------------------------------------------------ plans

def test_plan_is_seeded_and_follows_the_mix(tmp_path):
    text = BASE.replace("duration_s: 20", "duration_s: 400").replace("cells: 3", "cells: 5")
    scenario = load_scenario(write(tmp_path, text))
    trace = load_scenario_trace(scenario)
    first, again = plan_requests(scenario, trace), plan_requests(scenario, trace)
    assert first == again and len(first) > 300
    drawn = Counter(p.deadline_class for p in first)
    assert 0.68 < drawn["near_rt"] / len(first) < 0.82  # weights 3 : 1
    by_entity = {}
    for p in first:
        if p.trigger != "every 5 s":
            by_entity.setdefault(p.entity, set()).add(p.template)
    assert all(len(templates) == 1 for templates in by_entity.values())  # a stable hash of the entity
    reseeded = load_scenario(write(tmp_path, text.replace("seed: 1\n", "seed: 2\n", 1)))
    assert [p.deadline_class for p in plan_requests(reseeded, trace)] != [p.deadline_class for p in first]


def test_window_speed_select_and_prompt_rendering(tmp_path):
    text = BASE.replace("  speed: 2.0", "  speed: 4.0\n  start_s: 5\n  duration_s: 10").replace(
        "  user_prompt:", "  select: entity_order\n  user_prompt:")
    scenario = load_scenario(write(tmp_path, text))
    plan = plan_requests(scenario, load_scenario_trace(scenario))
    assert min(p.trace_time_s for p in plan) >= 5 and max(p.trace_time_s for p in plan) < 15
    assert all(p.send_offset_s == pytest.approx((p.trace_time_s - 5) / 4) for p in plan)
    chosen = {p.entity: p.template for p in plan if p.trigger != "every 5 s"}
    assert chosen == {"cell0": "alpha", "cell1": "beta", "cell2": "alpha"}
    assert plan[0].user_prompt.startswith(f"{plan[0].entity} PRB ")
    assert plan_requests(scenario, load_scenario_trace(scenario), speed=1.0)[-1].send_offset_s == \
        pytest.approx(plan[-1].send_offset_s * 4)


def test_missing_kpis_render_as_na(tmp_path):
    text = BASE.replace("seed: 2}", "seed: 2, outages: 2}").replace(
        "{{ kpi['RRU.PrbTotDl'] | fmt(1) }}", "{{ kpi['L1M.DL-SS-SINR'] | fmt(1) }}").replace(
        "- threshold: \"RRU.PrbUsedDl / RRU.PrbAvailDl > 0.3\"", "- threshold: \"RRU.PrbAvailDl > 0\"")
    scenario = load_scenario(write(tmp_path, text))
    prompts = [p.user_prompt for p in plan_requests(scenario, load_scenario_trace(scenario))]
    assert any(prompt.endswith("PRB n/a") for prompt in prompts)


# ---------------------------------------------------------------------------------- bundled

@pytest.mark.parametrize("name", ["default", "link", "overload", "stress", "templates"])
def test_bundled_scenarios_load_and_plan(name):
    scenario = load_scenario(name)
    plan = plan_requests(scenario, load_scenario_trace(scenario))
    assert scenario.name == name and plan and scenario.targets
    templates = scenario_templates(scenario)
    assert set(templates) == {p.template for p in plan}
    assert all(len(t.system_prompt) > 800 for t in templates.values())  # long, worth pinning


def test_bundled_list():
    """The package finds the top-level scenarios/ (installed as ricllm.scenarios, the only copy)."""
    assert bundled_scenarios() == ["capacity", "default", "link", "overload", "stress", "templates"]


def test_threshold_signal_is_its_left_side():
    threshold = Threshold("RRU.PrbUsedDl / RRU.PrbAvailDl > 0.8", ["RRU.PrbUsedDl", "RRU.PrbAvailDl"])
    assert threshold.signal[0] == "RRU.PrbUsedDl / RRU.PrbAvailDl" and threshold.signal[2] == 0.8
    assert threshold.signal_value({"RRU.PrbUsedDl": 53, "RRU.PrbAvailDl": 106}) == 0.5
    assert threshold.signal_value({"RRU.PrbUsedDl": None, "RRU.PrbAvailDl": 106}) is None
    assert Threshold("a > 1 and a < 3", ["a"]).signal is None


def test_documented_scenario_example_validates():
    import yaml

    from ricllm.replay.schema import Scenario

    text = (ROOT / "docs" / "replay.md").read_text()
    block = next(b.split("```", 1)[0] for b in text.split("```yaml\n")[1:] if b.startswith("name:"))
    scenario = Scenario.model_validate(yaml.safe_load(block))
    assert [t.label(i) for i, t in enumerate(scenario.triggers)] == ["every_row", "every 10 s", "congestion alarm"]
    assert scenario.classes["report"].resolved_priority() == "best_effort"
