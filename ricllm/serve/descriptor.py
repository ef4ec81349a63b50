"""``xapp_descriptor/schema.json``, generated from the serve settings model (:class:`ricllm.config.ServeSettings`).

The OSC onboarder validates a descriptor's ``controls`` with a draft-07 JSON schema and without
ricllm, so the schema is a file in the repository; this module writes it from the one settings
model, and a test fails when the file and the model disagree. Regenerate with
``python -m ricllm.serve.descriptor xapp_descriptor/schema.json``.

Pydantic writes draft 2020-12 with ``$defs``; the onboarder's form is draft-07 with every section
inline, ``"type": [T, "null"]`` for optional values, and every field required (it checks a
complete descriptor).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from ricllm.config import ServeSettings

HEADER = {
    "$schema": "http://json-schema.org/draft-07/schema#",
    "$id": "https://ricllm/xapp_descriptor/schema.json",
    "title": "ricllm xApp controls",
    "description": "Validates the controls section of config-file.json: the engine and service settings of "
                   "ricllm serve. Generated from ricllm.config.ServeSettings; do not edit by hand.",
}
_DROPPED = ("title", "default", "flag", "metavar")  # the defaults a descriptor gets are the serve profile's


def controls_schema() -> dict[str, Any]:
    generated = ServeSettings.model_json_schema(mode="validation")
    definitions = generated.pop("$defs", {})
    body = _draft7(generated, definitions)
    body.pop("description", None)
    return {**HEADER, **body}


def _draft7(node: Any, definitions: dict[str, Any]) -> Any:
    if isinstance(node, list):
        return [_draft7(item, definitions) for item in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        return _draft7(definitions[node["$ref"].rsplit("/", 1)[-1]], definitions)
    node = {key: _draft7(value, definitions) for key, value in node.items() if key not in _DROPPED}
    if "anyOf" in node:
        node = _optional(node)
    if node.get("type") == "object" and "properties" in node:
        node["required"] = list(node["properties"])
    return node


def _optional(node: dict[str, Any]) -> dict[str, Any]:
    """``anyOf: [X, null]`` -> ``X`` with ``null`` allowed, in the plainest form draft-07 has."""
    choices = [choice for choice in node["anyOf"] if choice != {"type": "null"}]
    if len(choices) != 1 or len(choices) == len(node["anyOf"]):
        return node
    rest = {key: value for key, value in node.items() if key != "anyOf"}
    (choice,) = choices
    if "oneOf" in choice:
        return {**rest, "oneOf": [{"type": "null"}, *choice["oneOf"]]}
    if "enum" in choice:  # an enum lists every value it allows: null too
        choice = {**choice, "enum": [*choice["enum"], None]}
    return {**rest, **choice, "type": [choice["type"], "null"]}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    text = json.dumps(controls_schema(), indent=2) + "\n"
    if argv:
        Path(argv[0]).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
