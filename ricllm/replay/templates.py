"""A scenario's templates, from the file's entries to what the replay uses: the ``Template`` to pin
(system prompt, then each worked example as a user and an assistant turn, and the constraint), the
reference ``Policy`` of its ``expect`` rules, and the checks that need more than one field.

An entry is a string (the system prompt), ``{file: path}``, or a ``TemplateSpec``. Checked at
load, each problem with its own field: a worked example's answer must satisfy the template's own
constraint (a bad example teaches the model a wrong format), so must its ``fallback`` (it is
given as the answer), every ``then`` field must be one
the answer has with a value it may take (else no answer could ever be correct), and every
``when`` must read the trace's KPIs.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ricllm.errors import InvalidRequestError
from ricllm.replay.decisions import AnswerCheck, Policy, schema_problem
from ricllm.replay.expressions import Threshold
from ricllm.replay.schema import Scenario, TemplateSpec
from ricllm.structured.spec import StructuredSpec
from ricllm.template import Template

Problem = tuple[tuple, str, str]  # (location in the scenario, message, kind), as ricllm.replay.loading reports them


def scenario_templates(scenario: Scenario) -> dict[str, Template]:
    """Template name -> the conversation to pin and its constraint; files read relative to the scenario."""
    return {name: build_template(value, scenario.base_dir) for name, value in scenario.prompts.templates.items()}


def scenario_policies(scenario: Scenario) -> dict[str, Policy]:
    """Template name -> its reference policy, for the templates that declare ``expect``."""
    kpis = scenario.trace_kpis()
    return {name: build_policy(value, kpis) for name, value in scenario.prompts.templates.items()
            if isinstance(value, TemplateSpec) and value.expect}


def system_text(entry: str | TemplateSpec, base_dir: Path) -> str:
    if isinstance(entry, str):
        return entry
    if entry.system is not None:
        return entry.system
    return (base_dir / entry.file).read_text(encoding="utf-8").strip()


def build_template(entry: str | TemplateSpec, base_dir: Path) -> Template:
    """System prompt, then the worked examples as user/assistant turns, and the constraint."""
    messages = [{"role": "system", "content": system_text(entry, base_dir)}]
    if isinstance(entry, str):
        return Template.build(messages)
    for example in entry.examples:
        messages += [{"role": "user", "content": example.user}, {"role": "assistant", "content": example.assistant}]
    return Template.build(messages, entry.structured, None, entry.min_confidence, entry.fallback)


def build_policy(entry: TemplateSpec, known_kpis: Iterable[str]) -> Policy:
    return Policy.compile([(rule.when, rule.fields) for rule in entry.expect], known_kpis)


def answer_check(entry: str | TemplateSpec) -> AnswerCheck | None:
    """How the template's answers are judged; None for a template without a constraint."""
    structured = entry.structured if isinstance(entry, TemplateSpec) else None
    return AnswerCheck(StructuredSpec.parse(structured)) if structured is not None else None


# ------------------------------------------------------------------------------------ checks

def template_problems(name: str, entry: str | TemplateSpec, base_dir: Path, kpis: list[str]) -> list[Problem]:
    """Every problem of one template entry, each located at its own field."""
    if isinstance(entry, str):
        return []
    where = ("prompts", "templates", name)
    problems = _file_problems(where, entry, base_dir)
    constraint = _constraint_problems(where, entry)
    if constraint:
        return problems + constraint  # the examples and rules cannot be judged against a broken constraint
    check = answer_check(entry)
    if check is not None:
        problems += _example_problems(where, entry, check) + _fallback_problems(where, entry, check)
    return problems + _expect_problems(where, entry, check, kpis)


def _file_problems(where: tuple, entry: TemplateSpec, base_dir: Path) -> list[Problem]:
    if entry.file is None or (base_dir / entry.file).is_file():
        return []
    return [((*where, "file"), f"no file {entry.file!r} next to the scenario ({base_dir})", "x")]


def _constraint_problems(where: tuple, entry: TemplateSpec) -> list[Problem]:
    """What is wrong with the constraint itself (the examples and rules are judged by it)."""
    if entry.structured is None:
        return []
    (kind, value), = entry.structured.items()
    problem = _shape_problem(entry.structured) or _meaning_problem(kind, value)
    return [((*where, "schema" if kind == "json" else kind), problem, "x")] if problem else []


def _shape_problem(structured: dict[str, Any]) -> str | None:
    """The engine's own check of a constraint's shape and size."""
    try:
        StructuredSpec.parse(structured)
    except InvalidRequestError as exc:
        return str(exc)
    return None


def _meaning_problem(kind: str, value: Any) -> str | None:
    if kind == "json":
        return schema_problem(value)
    if kind == "regex":
        try:
            re.compile(value)
        except re.error as exc:
            return f"not a valid regular expression: {exc}"
        return None
    return f"the choices repeat one another: {value}" if len(set(value)) != len(value) else None


def _example_problems(where: tuple, entry: TemplateSpec, check: AnswerCheck) -> list[Problem]:
    """A worked example teaches the answer's format: its answer must satisfy the template's constraint."""
    problems = []
    for i, example in enumerate(entry.examples):
        _, problem = check.parse(example.assistant)
        if problem:
            message = f"template {where[-1]!r}: worked example {i}'s answer is invalid: {problem}"
            problems.append(((*where, "examples", i, "assistant"), message, "x"))
    return problems


def _fallback_problems(where: tuple, entry: TemplateSpec, check: AnswerCheck) -> list[Problem]:
    """The fallback is given as the answer: it must satisfy the template's constraint."""
    if entry.fallback is None:
        return []
    _, problem = check.parse(entry.fallback)
    if problem is None:
        return []
    return [((*where, "fallback"), f"template {where[-1]!r}: the fallback does not satisfy the constraint: {problem}",
             "x")]


def _expect_problems(where: tuple, entry: TemplateSpec, check: AnswerCheck | None, kpis: list[str]) -> list[Problem]:
    problems = []
    for i, rule in enumerate(entry.expect or []):
        key = "otherwise" if rule.otherwise is not None else "then"
        problems += _rule_field_problems((*where, "expect", i, key), where[-1], rule.fields, check)
        if rule.when is not None:
            try:
                Threshold(rule.when, kpis)
            except ValueError as exc:
                problems.append(((*where, "expect", i, "when"), str(exc), "x"))
    return problems


def _rule_field_problems(loc: tuple, name: str, fields: dict[str, Any], check: AnswerCheck) -> list[Problem]:
    return [((*loc, field), f"template {name!r}: {problem}", "x") for field, value in fields.items()
            if (problem := check.value_problem(field, value))]
