"""Decision templates in a scenario: worked examples, a constraint and a reference policy, checked at
load with the template and the field named; the policy's expected answer per KPI row; and whether
an answer is valid and correct."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from ricllm.replay.decisions import AnswerCheck, Policy, is_correct, judge
from ricllm.replay.loading import ScenarioError, load_scenario, load_scenario_trace
from ricllm.replay.planning import plan_requests
from ricllm.replay.templates import scenario_templates
from ricllm.report.records import RequestRecord
from ricllm.structured.spec import StructuredSpec

KPIS = ["RRU.PrbTotDl", "DRB.RlcSduDelayDl", "L1M.DL-SS-SINR"]

SCENARIO = textwrap.dedent("""\
    name: decisions
    trace:
      generator: {cells: 4, duration_s: 20, interval_s: 1.0, seed: 2, outages: 2, outage_mode: zero}
    triggers:
      - every_row
    classes:
      near_rt: {deadline_ms: 500, max_tokens: 12}
    prompts:
      templates:
        plain: "You are a RAN assistant."
        from_file: {file: prompts/congestion.md}
        congestion:
          file: prompts/congestion.md
          examples:
            - user: "PRB usage: high. RLC delay: high."
              assistant: '{"action":"offload"}'
            - user: "PRB usage: low. RLC delay: normal."
              assistant: '{"action":"hold","cio_delta_db":0}'
          schema:
            type: object
            properties:
              action: {enum: [offload, hold, escalate, rebalance]}
              cio_delta_db: {type: integer, minimum: -6, maximum: 6}
            required: [action]
            additionalProperties: false
          expect:
            - when: "RRU.PrbTotDl > 85 and DRB.RlcSduDelayDl > 200"
              then: {action: offload}
            - when: "missing(L1M.DL-SS-SINR)"
              then: {action: escalate}
            - otherwise: {action: hold}
        energy:
          system: "You decide whether a cell sleeps."
          examples:
            - {user: "PRB usage: low.", assistant: sleep}
          choice: [sleep, stay]
          expect:
            - when: "RRU.PrbTotDl < 10"
              then: {answer: sleep}
            - otherwise: {answer: stay}
      select: entity_order
      user_prompt: "{{ entity }} PRB {{ kpi['RRU.PrbTotDl'] | fmt(1) }}"
    targets:
      overall: ["valid_of_answered >= 1.0", "correct_of_answered >= 0.85", "useful_of_sent > 0.5"]
    """)


def write(folder: Path, text: str) -> Path:
    (folder / "prompts").mkdir(exist_ok=True)
    (folder / "prompts" / "congestion.md").write_text("You are the congestion controller of a RAN cell.\n")
    path = folder / "scenario.yaml"
    path.write_text(text)
    return path


def problem(folder: Path, text: str) -> str:
    with pytest.raises(ScenarioError) as info:
        load_scenario(write(folder, text))
    return str(info.value)


def line_of(text: str, fragment: str) -> int:
    return next(i for i, line in enumerate(text.splitlines(), 1) if fragment in line)


def test_a_decision_template_is_the_conversation_and_its_constraint(tmp_path):
    scenario = load_scenario(write(tmp_path, SCENARIO))
    templates = scenario_templates(scenario)
    congestion = templates["congestion"]
    assert [m["role"] for m in congestion.messages] == ["system", "user", "assistant", "user", "assistant"]
    assert congestion.system_prompt == "You are the congestion controller of a RAN cell."
    assert congestion.messages[2]["content"] == '{"action":"offload"}' and congestion.num_examples == 2
    assert congestion.structured.kind == "json" and congestion.structured.value["required"] == ["action"]
    assert templates["energy"].structured.to_wire() == {"choice": ["sleep", "stay"]}
    # the plain forms still work: a string, or {file: ...}; no constraint
    assert templates["plain"].message_list == [{"role": "system", "content": "You are a RAN assistant."}]
    assert templates["from_file"].system_prompt == congestion.system_prompt
    assert templates["plain"].structured is None and templates["from_file"].structured is None
    assert scenario.model_dump(mode="json")["prompts"]["templates"]["congestion"]["schema"]["type"] == "object"


def expected_action(kpis: dict) -> str:
    """The congestion policy of SCENARIO, written out again."""
    if kpis["RRU.PrbTotDl"] > 85 and kpis["DRB.RlcSduDelayDl"] > 200:
        return "offload"
    return "escalate" if kpis["L1M.DL-SS-SINR"] is None else "hold"


def test_planned_requests_carry_the_policys_expected_answer(tmp_path):
    scenario = load_scenario(write(tmp_path, SCENARIO))
    trace = load_scenario_trace(scenario)
    rows = {(r.entity, r.time_s): r.kpis for r in trace.rows}
    plan = plan_requests(scenario, trace)
    assert {p.template for p in plan} == {"plain", "from_file", "congestion", "energy"}
    for planned in plan:
        kpis = rows[(planned.entity, planned.trace_time_s)]
        if planned.template == "energy":
            assert planned.expected == {"answer": "sleep" if kpis["RRU.PrbTotDl"] < 10 else "stay"}
        elif planned.template == "congestion":
            assert planned.expected == {"action": expected_action(kpis)}
        else:
            assert planned.expected is None
    # every cell on the congestion template: the dark rows of an outage (no SINR) expect escalate
    everyone = plan_requests(load_scenario(write(tmp_path, SCENARIO), ["prompts.select=congestion"]), trace)
    actions = [p.expected["action"] for p in everyone]
    assert actions == [expected_action(rows[(p.entity, p.trace_time_s)]) for p in everyone]
    assert "escalate" in actions and "hold" in actions


@pytest.mark.parametrize("old, new, field, words", [
    ("""assistant: '{"action":"offload"}'""", """assistant: '{"action":"offlaod"}'""",
     "prompts.templates.congestion.examples[0].assistant", ("template 'congestion': worked example 0's answer is "
     "invalid: does not match the schema: action: 'offlaod' is not one of")),
    ("""assistant: '{"action":"offload"}'""", "assistant: 'offload'",
     "prompts.templates.congestion.examples[0].assistant", "worked example 0's answer is invalid: not JSON"),
    ('"cio_delta_db":0', '"cio_delta_db":9', "prompts.templates.congestion.examples[1].assistant",
     "9 is greater than the maximum of 6"),
    ("assistant: sleep", "assistant: nap", "prompts.templates.energy.examples[0].assistant",
     "template 'energy': worked example 0's answer is invalid: 'nap' is not one of ['sleep', 'stay']"),
    ("then: {action: escalate}", "then: {verdict: escalate}", "prompts.templates.congestion.expect[1].then.verdict",
     ("template 'congestion': field 'verdict' is not a property of the schema; its properties are action, "
     "cio_delta_db")),
    ("then: {action: escalate}", "then: {action: panic}", "prompts.templates.congestion.expect[1].then.action",
     "template 'congestion': 'panic' is not allowed for 'action'"),
    ("otherwise: {answer: stay}", "otherwise: {action: stay}", "prompts.templates.energy.expect[1].otherwise.action",
     "a choice template's answer has one field, 'answer'"),
    ("otherwise: {answer: stay}", "otherwise: {answer: wake}", "prompts.templates.energy.expect[1].otherwise.answer",
     "'wake' is not one of ['sleep', 'stay']"),
    ("- otherwise: {action: hold}", "- when: 'RRU.PrbTotDl > 0'\n          then: {action: hold}",
     "prompts.templates.congestion.expect", ("expect must end with exactly one otherwise rule (the last); found no "
     "otherwise of 3 rules")),
    ('- when: "RRU.PrbTotDl < 10"\n          then: {answer: sleep}', "- otherwise: {answer: sleep}",
     "prompts.templates.energy.expect", "found otherwise at rule 0, 1 of 2 rules"),
    ('when: "missing(L1M.DL-SS-SINR)"', 'when: "missing(DRB.RlcDelay)"',
     "prompts.templates.congestion.expect[1].when", "unknown KPI 'DRB.RlcDelay'"),
    ("choice: [sleep, stay]", "choice: [sleep, stay]\n      regex: 'sleep|stay'", "prompts.templates.energy",
     "a template takes at most one of schema, choice, regex; got choice, regex"),
    ("system: \"You decide whether a cell sleeps.\"", "system: x\n      file: prompts/congestion.md",
     "prompts.templates.energy", "a template needs exactly one of file, system"),
    ("{enum: [offload, hold, escalate, rebalance]}", "{type: strin}", "prompts.templates.congestion.schema",
     "not a valid JSON schema"),
    ("choice: [sleep, stay]", "regex: 'sl(eep|stay'", "prompts.templates.energy.regex",
     "not a valid regular expression"),
    ("choice: [sleep, stay]", "choice: [sleep, stay, sleep]", "prompts.templates.energy.choice",
     "the choices repeat one another"),
    ("choice: [sleep, stay]", "choice: [sleep, stay]\n      min_confidence: 0.6\n      fallback: nap",
     "prompts.templates.energy.fallback",
     "template 'energy': the fallback does not satisfy the constraint: 'nap' is not one of ['sleep', 'stay']"),
    ("choice: [sleep, stay]", "choice: [sleep, stay]\n      fallback: stay", "prompts.templates.energy",
     "min_confidence and fallback go together: min_confidence is missing"),
    ("choice: [sleep, stay]", "choice: [sleep, stay]\n      min_confidence: 1.5\n      fallback: stay",
     "prompts.templates.energy.min_confidence", "less than or equal to 1"),
])
def test_template_mistakes_name_the_template_and_the_field(tmp_path, old, new, field, words):
    assert old in SCENARIO
    text = SCENARIO.replace(old, new, 1)
    message = problem(tmp_path, text)
    assert message.startswith("scenario.yaml: line ") and f"{field}: " in message and words in message, message


def test_a_bad_worked_example_is_reported_at_its_own_line(tmp_path):
    text = SCENARIO.replace('"cio_delta_db":0', '"cio_delta_db":"zero"')
    line = line_of(text, '"cio_delta_db":"zero"')
    assert f"line {line}, prompts.templates.congestion.examples[1].assistant: " in problem(tmp_path, text)


def test_a_policy_needs_a_constraint_to_compare_with(tmp_path):
    text = SCENARIO.replace("      choice: [sleep, stay]\n", "")
    assert "prompts.templates.energy: expect needs schema, choice or regex" in problem(tmp_path, text)


# ---------------------------------------------------------------------------- the policy on rows

POLICY = Policy.compile([("RRU.PrbTotDl > 85 and DRB.RlcSduDelayDl > 200", {"action": "offload"}),
                         ("missing(DRB.RlcSduDelayDl) or missing(RRU.PrbTotDl)", {"action": "escalate"}),
                         ("L1M.DL-SS-SINR < 0", {"action": "rebalance"}),
                         (None, {"action": "hold"})], KPIS)


@pytest.mark.parametrize("kpis, action", [
    ({"RRU.PrbTotDl": 90, "DRB.RlcSduDelayDl": 250, "L1M.DL-SS-SINR": -3}, "offload"),  # the first match wins
    ({"RRU.PrbTotDl": 90, "DRB.RlcSduDelayDl": 150, "L1M.DL-SS-SINR": 5}, "hold"),
    ({"RRU.PrbTotDl": 90, "DRB.RlcSduDelayDl": None, "L1M.DL-SS-SINR": 5}, "escalate"),  # a gap has its own rule
    ({"RRU.PrbTotDl": 90, "L1M.DL-SS-SINR": 5}, "escalate"),  # a KPI the row lacks entirely
    ({"RRU.PrbTotDl": 20, "DRB.RlcSduDelayDl": 10, "L1M.DL-SS-SINR": None}, "hold"),  # comparison on a gap is false
    ({"RRU.PrbTotDl": 20, "DRB.RlcSduDelayDl": 10, "L1M.DL-SS-SINR": -1.5}, "rebalance"),
])
def test_the_first_matching_rule_gives_the_expected_answer(kpis, action):
    assert POLICY.expected(kpis) == {"action": action}


def test_a_policy_ends_with_one_otherwise():
    with pytest.raises(ValueError, match="exactly one otherwise"):
        Policy.compile([("RRU.PrbTotDl > 1", {"a": 1})], KPIS)
    with pytest.raises(ValueError, match="exactly one otherwise"):
        Policy.compile([(None, {"a": 1}), (None, {"a": 2})], KPIS)


# ------------------------------------------------------------------------------- judging answers

SCHEMA = {"type": "object", "properties": {"action": {"enum": ["offload", "hold"]}, "cio_delta_db": {"type": "integer"}},
          "required": ["action"], "additionalProperties": False}


JSON_CHECK = AnswerCheck(StructuredSpec.parse({"json": SCHEMA}))


def answered(text: str, expected: dict | None, finish_reason: str = "stop", check: AnswerCheck | None = JSON_CHECK):
    record = RequestRecord("r0", "cell0", 0.0, 2, "t", "near_rt", "congestion", 500.0, 8, 0.0, expected=expected)
    record.finish("completed", admitted=True, finish_reason=finish_reason, server_e2e_s=0.1, text=text)
    judge(record, check)
    return record


@pytest.mark.parametrize("text, finish_reason, valid, answer, correct", [
    ('{"action":"offload"}', "stop", True, {"action": "offload"}, True),
    ('{"action": "offload", "cio_delta_db": 3}', "stop", True, {"action": "offload", "cio_delta_db": 3}, True),
    ('{"action":"hold"}', "stop", True, {"action": "hold"}, False),  # valid, but not what the policy says
    ('{"action":"offl', "length", False, None, False),  # cut at max_tokens: not JSON
    ('{"action":"offload"}', "length", False, None, False),  # parses, but it ended by length: not trusted
    ('{"action":"sleep"}', "stop", False, None, False),  # JSON, outside the schema
    ('{"action":"offload","extra":1}', "stop", False, None, False),
    ("offload", "stop", False, None, False),
])
def test_valid_and_correct_answers(text, finish_reason, valid, answer, correct):
    record = answered(text, {"action": "offload"}, finish_reason)
    assert (record.valid, record.answer, record.correct) == (valid, answer, correct)


def test_choice_and_regex_answers_have_one_field():
    choice = AnswerCheck(StructuredSpec.parse({"choice": ["sleep", "stay"]}))
    assert answered("sleep", {"answer": "sleep"}, check=choice).correct is True
    assert answered(" sleep", {"answer": "sleep"}, check=choice).valid is False  # the exact text, as constrained
    regex = AnswerCheck(StructuredSpec.parse({"regex": r"cio [+-][0-6]"}))
    assert answered("cio +3", {"answer": "cio +3"}, check=regex).answer == {"answer": "cio +3"}
    assert answered("cio +3 dB", None, check=regex).valid is False  # the whole text must match
    assert answered("cio -2", None, check=regex).correct is None  # no policy: nothing to be correct about


def test_no_constraint_or_no_answer_is_not_judged():
    plain = answered("anything", None, check=None)
    assert plain.valid is None and plain.correct is None and plain.useful is None
    rejected = RequestRecord("r1", "cell0", 0.0, 2, "t", "near_rt", "congestion", 500.0, 8, 0.0,
                             expected={"action": "hold"})
    rejected.finish("rejected", admitted=False, rejection_code="DEADLINE_INFEASIBLE")
    judge(rejected, JSON_CHECK)
    assert rejected.valid is None and rejected.answered is False and rejected.useful is False


def test_correct_compares_json_values():
    assert is_correct({"cio_delta_db": 3}, {"cio_delta_db": 3.0})
    assert not is_correct({"enabled": True}, {"enabled": 1})  # true is not 1
    assert not is_correct({"action": "hold"}, {"cio_delta_db": 0})  # the expected field is absent
    assert not is_correct({"action": "hold"}, ["hold"])


def test_documented_template_example_loads(tmp_path):
    """The decision template in docs/replay.md passes every check, as a user would copy it."""
    docs = (Path(__file__).parents[2] / "docs" / "replay.md").read_text()
    block = next(b.split("```", 1)[0] for b in docs.split("```yaml\n")[1:] if b.startswith("congestion:"))
    text = SCENARIO.split("  templates:\n")[0] + "  templates:\n" + textwrap.indent(block, "    ")
    scenario = load_scenario(write(tmp_path, text + "  select: congestion\n"))
    template = scenario_templates(scenario)["congestion"]
    assert template.num_examples == 2 and template.structured.kind == "json"
    assert {p.expected["action"] for p in plan_requests(scenario, load_scenario_trace(scenario))} <= {
        "offload", "escalate", "hold"}
