"""What every settings model is made of: the strict base, :func:`setting`, the checked field types,
and the rules for layering settings and naming their errors."""

from __future__ import annotations

import copy
import re
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
    WithJsonSchema,
)

from ricllm.affinity import check_cpu_list_field
from ricllm.errors import ConfigError
from ricllm.units import parse_bytes

# what parse_bytes reads, as a pattern a JSON-schema validator can check without ricllm
BYTE_SIZE_PATTERN = r"^\s*[0-9]+(\.[0-9]*)?\s*([bB]|[kKmMgGtT][bB]|[kKmMgGtT][iI][bB]|[kKmMgG])?\s*$"
CPU_LIST_PATTERN = r"^\s*[0-9]+(-[0-9]+)?(\s*,\s*[0-9]+(-[0-9]+)?)*\s*$"


class SettingsError(ConfigError):
    """A setting is missing, of the wrong type or out of range; the message names the field."""


def _parses_as_bytes(value: int | str) -> int | str:
    if isinstance(value, int) and value < 1:
        raise ValueError("a byte size is at least 1")
    parse_bytes(value)
    return value


def _tuple_as_list(value: Any) -> Any:
    return list(value) if isinstance(value, (tuple, range)) else value  # EngineConfig holds a tuple


def _parses_as_cpus(value: str | list[int]) -> str | list[int]:
    return check_cpu_list_field(value)


# one check each (the parser's own message), and the schema a JSON-schema validator checks without ricllm
ByteSize = Annotated[int | str, AfterValidator(_parses_as_bytes), WithJsonSchema({"oneOf": [
    {"type": "integer", "minimum": 1}, {"type": "string", "pattern": BYTE_SIZE_PATTERN}]})]
CpuList = Annotated[str | list[int], BeforeValidator(_tuple_as_list), AfterValidator(_parses_as_cpus),
                    WithJsonSchema({"oneOf": [
                        {"type": "string", "pattern": CPU_LIST_PATTERN},
                        {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}]})]
NonEmpty = Annotated[str, StringConstraints(min_length=1)]


def setting(default: Any = None, help: str = "", *, flag: str | None = None, metavar: str | None = None,
            **rules: Any) -> Any:
    """A field with its help text (CLI ``--help`` and the descriptor schema's description) and, where
    the command line spells it differently from the field's name, its flag."""
    extra = {key: value for key, value in (("flag", flag), ("metavar", metavar)) if value}
    return Field(default, description=help, json_schema_extra=extra or None, **rules)


class StrictModel(BaseModel):
    """Settings read from files and flags: exact types, unknown fields are errors."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


# ------------------------------------------------------------------------------ layers and errors

def merge_layers(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """Settings ``top`` over ``base``, field by field, nested sections too (a profile, a file, flags).

    A new dict: neither layer is changed, nor shared with the result (profiles are module constants)."""
    merged = copy.deepcopy(base)
    for key, value in top.items():
        below = merged.get(key)
        merged[key] = merge_layers(below, value) if isinstance(value, dict) and isinstance(below, dict) \
            else copy.deepcopy(value)
    return merged


def flatten_settings(values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"admission": {"max_queue": 4}}`` -> ``{"admission.max_queue": 4}``: one entry per setting."""
    flat: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, dict):
            flat.update(flatten_settings(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


_UNION_TAG = re.compile(r"^(int|str|float|bool|none|list\[.*\]|constrained-\w+|function-\w+\[.*\])$")


def describe_errors(exc: ValidationError, source: str = "") -> str:
    """``--config x.json: field 'admission.policy': unknown admission policy 'edf'; choose one of ...``.

    A rule whose message already names its field (``engine_cpus: CPU 9 is not available ...``) is
    quoted as it is."""
    parts = [_describe_one(error) for error in exc.errors(include_url=False)[:3]]
    extra = exc.error_count() - len(parts)
    text = "; ".join(parts) + (f"; and {extra} more" if extra > 0 else "")
    return f"{source}: {text}" if source else text


def _describe_one(error: dict) -> str:
    name = ".".join(str(part) for part in error["loc"] if not _UNION_TAG.match(str(part)))
    message = error["msg"].removeprefix("Value error, ")
    if error["type"] == "extra_forbidden":
        return f"field {name!r}: unknown setting"
    if error["type"] == "literal_error":
        choices = ", ".join(re.findall(r"'([^']*)'", error["ctx"]["expected"]))
        return f"field {name!r}: unknown {name.rsplit('.', 1)[-1].replace('_', ' ')} {error['input']!r}; " \
               f"choose one of {choices}"
    if not name or message.startswith(f"{name}: "):
        return message
    if error["type"] == "missing" or isinstance(error.get("input"), dict):
        return f"field {name!r}: {message}"
    return f"field {name!r}: {message} (got {error.get('input')!r:.60})"
