"""Decisions: whether an answer is valid (it parses and satisfies its template's constraint), what
the scenario's reference policy expected for the request's KPI row, and whether the answer is
correct (every expected field equals the answer's).

One definition of "valid" serves the scenario check (a worked example's answer must itself be
valid) and the report (every answer the engine gave). An answer is an object of fields: a JSON
template's answer is the parsed JSON; a choice or regex template's answer has one field,
``answer``, holding the text. Nothing here imports torch; the JSON schema is checked with the
``jsonschema`` library, independently of the grammar engine that constrained the answer.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ricllm.replay.expressions import Threshold
from ricllm.report.records import MISSING
from ricllm.structured.spec import StructuredSpec

ANSWER_FIELD = "answer"  # the one field of a choice or regex template's answer


class AnswerCheck:
    """A template's constraint, ready to judge texts: the JSON schema's validator is built once."""

    def __init__(self, spec: StructuredSpec):
        if spec.kind not in ("json", "choice", "regex"):
            raise ValueError(f"answers of a {spec.kind} template cannot be checked here; use schema, choice or regex")
        self.spec = spec
        self._validator = _schema_validator(spec.value) if spec.kind == "json" else None
        self._regex = re.compile(spec.value) if spec.kind == "regex" else None

    def parse(self, text: str) -> tuple[Any, str | None]:
        """(the answer object, None) for a valid text; (None, what is wrong) otherwise."""
        if self.spec.kind == "json":
            return self._parse_json(text)
        if self.spec.kind == "choice":
            ok = text in self.spec.value
            return ({ANSWER_FIELD: text}, None) if ok else (None, f"{text!r} is not one of {self.spec.value}")
        ok = self._regex.fullmatch(text) is not None
        return ({ANSWER_FIELD: text}, None) if ok else (None, f"{text!r} does not match the regex {self.spec.value!r}")

    def _parse_json(self, text: str) -> tuple[Any, str | None]:
        try:
            answer = json.loads(text)
        except json.JSONDecodeError as exc:
            return None, f"not JSON ({exc.msg} at character {exc.pos})"
        problem = _first_error(self._validator, answer)
        return (None, f"does not match the schema: {problem}") if problem else (answer, None)

    def fields(self) -> list[str]:
        """The fields an answer has: the schema's properties, or ``answer``."""
        if self.spec.kind != "json":
            return [ANSWER_FIELD]
        properties = self.spec.value.get("properties") if isinstance(self.spec.value, dict) else None
        return list(properties or {})

    def value_problem(self, field: str, value: Any) -> str | None:
        """Why an answer's ``field`` can never be ``value`` (None when it can): an expectation's check."""
        if field not in self.fields() and self.spec.kind == "json":
            return (f"field {field!r} is not a property of the schema; its properties are "
                    f"{', '.join(self.fields()) or '(none)'}")
        if field not in self.fields():
            return f"field {field!r}: a {self.spec.kind} template's answer has one field, {ANSWER_FIELD!r}"
        if self.spec.kind != "json":
            return self.parse(value)[1] if isinstance(value, str) else f"{value!r} is not a string"
        problem = _first_error(_schema_validator(_property_schema(self.spec.value, field)), value)
        return f"{value!r} is not allowed for {field!r}: {problem}" if problem else None


def schema_problem(schema: Any) -> str | None:
    """Why a JSON schema is not one (None when it is)."""
    from jsonschema import validators
    from jsonschema.exceptions import SchemaError

    if not isinstance(schema, (dict, bool)):
        return f"a JSON schema is a mapping, got {type(schema).__name__}"
    try:
        validators.validator_for(schema).check_schema(schema)
    except SchemaError as exc:
        return f"not a valid JSON schema: {exc.message}"
    return None


def _schema_validator(schema: Any):
    from jsonschema import validators

    return validators.validator_for(schema)(schema)


def _property_schema(schema: Mapping[str, Any], field: str) -> Any:
    """One property's schema, with the root's definitions beside it so its ``$ref``s still resolve."""
    sub = schema["properties"][field]
    if not isinstance(sub, dict):
        return sub
    shared = {key: schema[key] for key in ("$defs", "definitions", "$schema") if key in schema}
    return {**shared, **sub}


def _first_error(validator, instance: Any) -> str | None:
    from jsonschema.exceptions import best_match

    error = best_match(validator.iter_errors(instance))
    if error is None:
        return None
    where = "/".join(str(p) for p in error.absolute_path)
    return f"{where}: {error.message}" if where else error.message


# ------------------------------------------------------------------------- the reference policy

@dataclass(frozen=True)
class Rule:
    """``when`` None is the ``otherwise`` rule."""

    when: Threshold | None
    then: dict[str, Any]


class Policy:
    """A template's ``expect`` rules: the first rule whose ``when`` holds on the row gives the expected fields."""

    def __init__(self, rules: Sequence[Rule]):
        if not rules or rules[-1].when is not None or any(r.when is None for r in rules[:-1]):
            raise ValueError("a policy ends with exactly one otherwise rule")
        self.rules = list(rules)

    @classmethod
    def compile(cls, rules: Iterable[tuple[str | None, Mapping[str, Any]]], known_kpis: Iterable[str]) -> Policy:
        """From (when text or None, then) pairs; a ``when`` over a KPI the trace lacks raises ValueError."""
        known = list(known_kpis)
        return cls([Rule(Threshold(when, known) if when is not None else None, dict(then)) for when, then in rules])

    def expected(self, kpis: Mapping[str, float | None]) -> dict[str, Any]:
        """The fields the policy expects for one row (a missing KPI makes a comparison false, as in triggers)."""
        return dict(next(r.then for r in self.rules if r.when is None or r.when(kpis)))


# --------------------------------------------------------------------------- judging one answer

def same_value(expected: Any, answered: Any) -> bool:
    """JSON equality: 3 equals 3.0, but true is not 1."""
    if isinstance(expected, bool) or isinstance(answered, bool):
        return type(expected) is type(answered) and expected == answered
    return expected == answered


def is_correct(expected: Mapping[str, Any], answer: Any) -> bool:
    """Every expected field equals the answer's; an answer that is not an object is not correct."""
    if not isinstance(answer, Mapping):
        return False
    return all(same_value(value, answer.get(field, MISSING)) for field, value in expected.items())


def judge(record, check: AnswerCheck | None) -> None:
    """Set ``valid``, ``answer`` and ``correct`` on a finished record; an answer that ended by
    length is invalid even if its text happens to parse (it was cut, not finished). A fallback is
    judged as the answer; ``model_correct`` judges the model's own answer, which the fallback
    replaced (the same as ``correct`` where none was), so confidence is measured against it."""
    if check is None or not record.answered:
        return
    answer, problem = check.parse(record.text or "")
    record.valid = problem is None and record.finish_reason != "length"
    record.answer = answer if record.valid else None
    if record.expected is not None:
        record.correct = record.valid and is_correct(record.expected, record.answer)
        record.model_correct = record.correct
        if record.model_text is not None:
            own, own_problem = check.parse(record.model_text)
            record.model_correct = own_problem is None and is_correct(record.expected, own)
