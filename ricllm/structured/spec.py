"""What a request asks its answer to be: a JSON schema, one of a list of strings, a regex or a grammar.

The keys are vLLM's ``structured_outputs`` keys, so a request written for vLLM means the same here:
``{"json": schema}`` (``json_schema`` is accepted for it), ``{"choice": [...]}``, ``{"regex": "..."}``,
``{"grammar": "..."}`` (a Lark grammar, as llguidance reads it). Exactly one key; checked here for
shape and size, compiled (and so checked for meaning) by ``ricllm.structured.compiler``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ricllm.errors import InvalidRequestError

KINDS = ("json", "choice", "regex", "grammar")
ALIASES = {"json_schema": "json"}
MAX_SPEC_BYTES = 64 * 1024  # a decision schema is a few hundred bytes; this bounds what one request may ask to compile


@dataclass(frozen=True, eq=False)
class StructuredSpec:
    """One constraint, normalised: ``kind`` is one of ``KINDS``; ``key`` names it in the grammar cache."""

    kind: str
    value: Any  # a schema (dict), a list of strings, a regex or a grammar (str)
    key: str

    @classmethod
    def parse(cls, structured: Mapping[str, Any] | StructuredSpec) -> StructuredSpec:
        """Check a request's ``structured`` mapping; ``InvalidRequestError`` names what is wrong."""
        if isinstance(structured, StructuredSpec):
            return structured
        if not isinstance(structured, Mapping) or len(structured) != 1:
            raise InvalidRequestError(
                f"structured must be a mapping with exactly one of {', '.join(KINDS)} "
                f"(json_schema is accepted for json), got {_preview(structured)}")
        (name, value), = structured.items()
        kind = ALIASES.get(name, name)
        if kind not in KINDS:
            raise InvalidRequestError(f"unknown structured output kind {name!r}; choose one of {', '.join(KINDS)}")
        value = _check_value(kind, value)
        canonical = json.dumps([kind, value], sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        if len(canonical.encode()) > MAX_SPEC_BYTES:
            raise InvalidRequestError(
                f"structured {kind} is {len(canonical.encode())} bytes; at most {MAX_SPEC_BYTES} bytes are accepted")
        return cls(kind, value, hashlib.sha256(canonical.encode()).hexdigest()[:24])

    def to_wire(self) -> dict[str, Any]:
        """The mapping it was parsed from (with ``json`` for ``json_schema``)."""
        return {self.kind: self.value}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StructuredSpec) and other.key == self.key

    def __hash__(self) -> int:
        return hash(self.key)

    def __repr__(self) -> str:
        return f"StructuredSpec({self.kind}, key={self.key})"


def _check_value(kind: str, value: Any) -> Any:
    if kind == "json":
        if isinstance(value, str):
            value = _parse_json_text(value)
        if not isinstance(value, (dict, bool)):
            raise InvalidRequestError(f"structured json must be a JSON schema object, got {_preview(value)}")
        return value
    if kind == "choice":
        if (not isinstance(value, (list, tuple)) or not value
                or not all(isinstance(c, str) and c for c in value)):
            raise InvalidRequestError(f"structured choice must be a non-empty list of non-empty strings, "
                                      f"got {_preview(value)}")
        return list(value)
    if not isinstance(value, str) or not value:
        raise InvalidRequestError(f"structured {kind} must be a non-empty string, got {_preview(value)}")
    return value


def _parse_json_text(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidRequestError(f"structured json is not valid JSON: {exc}") from None


def _preview(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
