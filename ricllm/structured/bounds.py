"""How long a constrained answer can be, from the constraint alone, before any token is sampled.

Neither grammar engine reports it, and for free JSON whitespace or unbounded numbers it is
infinite. Answers are generated as compact JSON (no free whitespace), so for the finite subset
(enums, const, booleans, null, bounded integers, strings with ``maxLength``, fixed objects and
bounded arrays, choices, regexes without unbounded repeats) the longest answer has a known
number of bytes, and a token is at least one byte: ``longest_bytes + 1`` (the end-of-answer token)
bounds the tokens. ``shortest_answers`` lists the shortest texts the constraint allows, so the
fewest tokens that spell one of them is the shortest complete answer in tokens.
Anything outside that subset gives ``None``: no bound, and ``max_tokens`` rules.
"""

from __future__ import annotations

import itertools
import json
import re
from typing import Any

from ricllm.structured.spec import StructuredSpec

MAX_CANDIDATES = 64  # shortest answers kept: enough for a decision schema's enums, bounded otherwise
BYTES_PER_STRING_CHAR = 6  # a control character is written \u00XX; any other character takes at most 4 bytes
_SCALARS = {"boolean": ["true", "false"], "null": ["null"]}


def longest_bytes(spec: StructuredSpec) -> int | None:
    """Bytes of the longest complete answer; None when unbounded or not known."""
    if spec.kind == "choice":
        return max(len(c.encode()) for c in spec.value)
    if spec.kind == "regex":
        width = _regex_width(spec.value)
        return None if width is None or width[1] is None else 4 * width[1]
    if spec.kind == "json":
        return _json_longest(spec.value)
    return None


def shortest_answers(spec: StructuredSpec) -> list[str] | None:
    """The shortest answer texts (up to ``MAX_CANDIDATES``); None when not known."""
    if spec.kind == "choice":
        return list(spec.value)
    if spec.kind == "json":
        return _json_shortest(spec.value)
    return None


def _dump(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


# ------------------------------------------------------------------ longest

def _fold(schema: Any, texts_of, combine, by_type: dict):
    """The one walk of a schema both bounds take: a const's or an enum's JSON texts go to
    ``texts_of``; the results of anyOf/oneOf branches, or of a list of types, are ``combine``d;
    a single type goes to its function in ``by_type``; anything else is unknown (None)."""
    if not isinstance(schema, dict):
        return None
    if "const" in schema or "enum" in schema:
        values = [schema["const"]] if "const" in schema else schema["enum"]
        return texts_of([_dump(v) for v in values]) if values else None
    branches = schema.get("anyOf", schema.get("oneOf"))
    kinds = schema.get("type")
    if branches is None and isinstance(kinds, list):
        branches = [{**schema, "type": kind} for kind in kinds]
    if branches is not None:
        return combine(_fold(branch, texts_of, combine, by_type) for branch in branches)
    return by_type.get(kinds, lambda _: None)(schema)


def _json_longest(schema: Any) -> int | None:
    return _fold(schema, lambda texts: max(len(t.encode()) for t in texts), _max_or_none, _LONGEST)


def _max_or_none(values) -> int | None:
    values = list(values)
    return None if not values or None in values else max(values)


def _longest_integer(schema: dict) -> int | None:
    low, high = schema.get("minimum"), schema.get("maximum")
    if low is None or high is None:
        return None
    return max(len(str(int(low))), len(str(int(high))))


def _longest_string(schema: dict) -> int | None:
    if "maxLength" not in schema or "pattern" in schema or "format" in schema:
        return None
    return 2 + BYTES_PER_STRING_CHAR * int(schema["maxLength"])


def _longest_object(schema: dict) -> int | None:
    if schema.get("additionalProperties", True) is not False:
        return None
    properties = schema.get("properties", {})
    members = [len(_dump(name).encode()) + 1 + _json_longest(sub) if _json_longest(sub) is not None else None
               for name, sub in properties.items()]
    if None in members:
        return None
    return 2 + sum(members) + max(len(members) - 1, 0)


def _longest_array(schema: dict) -> int | None:
    items, count = _json_longest(schema.get("items")), schema.get("maxItems")
    if count is None or (items is None and count > 0):
        return None
    return 2 + count * (items or 0) + max(count - 1, 0)


_LONGEST = {
    "boolean": lambda _: 5, "null": lambda _: 4, "integer": _longest_integer,
    "string": _longest_string, "object": _longest_object, "array": _longest_array,
}


def _regex_width(pattern: str) -> tuple[int, int | None] | None:
    """(fewest, most) characters a regex matches, as Python's parser reads it; None if it cannot."""
    try:
        import re._parser as sre_parse  # Python >= 3.11
    except ImportError:  # pragma: no cover - Python 3.10
        import sre_parse  # type: ignore[no-redef]
    try:
        low, high = sre_parse.parse(pattern).getwidth()
    except (re.error, OverflowError, RecursionError):  # read differently from the grammar engine: no bound
        return None
    return low, (None if high >= sre_parse.MAXREPEAT else high)


# ------------------------------------------------------------------ shortest

def _json_shortest(schema: Any) -> list[str] | None:
    return _fold(schema, _keep_shortest, _union, _SHORTEST)


def _union(options) -> list[str] | None:
    options = list(options)
    if not options or None in options:
        return None
    return _keep_shortest([text for option in options for text in option])


def _keep_shortest(texts: list[str]) -> list[str]:
    """The candidates for the fewest tokens: every text, shortest first, at most ``MAX_CANDIDATES``."""
    return sorted(set(texts), key=lambda t: (len(t.encode()), t))[:MAX_CANDIDATES]


def _shortest_integer(schema: dict) -> list[str]:
    low, high = schema.get("minimum"), schema.get("maximum")
    candidates = [v for v in range(-9, 10) if (low is None or v >= low) and (high is None or v <= high)]
    return [str(v) for v in candidates] or [str(int(low if low is not None else high))]


def _shortest_string(schema: dict) -> list[str]:
    return [_dump("a" * int(schema.get("minLength", 0)))]


def _shortest_object(schema: dict) -> list[str] | None:
    properties = schema.get("properties", {})
    required = [name for name in properties if name in schema.get("required", [])]
    parts = [_json_shortest(properties[name]) for name in required]
    if None in parts:
        return None
    combos = itertools.islice(itertools.product(*parts), MAX_CANDIDATES * 4)
    texts = ["{" + ",".join(f"{_dump(n)}:{v}" for n, v in zip(required, combo)) + "}" for combo in combos]
    return _keep_shortest(texts)


def _shortest_array(schema: dict) -> list[str] | None:
    count = int(schema.get("minItems", 0))
    if count == 0:
        return ["[]"]
    items = _json_shortest(schema.get("items", {}))
    return None if items is None else _keep_shortest(["[" + ",".join([text] * count) + "]" for text in items])


_SHORTEST = {"integer": _shortest_integer, "number": _shortest_integer, "string": _shortest_string,
             "object": _shortest_object, "array": _shortest_array,
             **{kind: (lambda _, texts=texts: list(texts)) for kind, texts in _SCALARS.items()}}
