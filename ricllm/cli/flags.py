"""Command-line flags generated from a settings model (:mod:`ricllm.config`), vLLM EngineArgs-style.

Each field becomes ``--field-name`` (or the ``flag`` its :func:`ricllm.config.setting` names), with
the field's description as help and its default shown; a nested section (``admission``) adds an
argument group whose fields keep their own names (``--safety-margin``). Booleans take
``--x/--no-x``; a list takes its items after one flag (``--lora-modules a=x b=y``). Every flag
defaults to SUPPRESS, so :func:`given_settings` returns only what the user typed, as nested
sections ready to validate or to merge over lower layers.
"""

from __future__ import annotations

import argparse
import json
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from ricllm.errors import InvalidRequestError

_DEST_PREFIX = "setting:"  # dests of generated flags: "setting:admission.policy"


def add_settings_flags(parser: argparse.ArgumentParser, model: type[BaseModel], title: str,
                       shown_defaults: dict[str, Any] | None = None, exclude: frozenset[str] = frozenset(),
                       only: frozenset[str] | None = None) -> None:
    """Add a flag for every field of ``model``, in a group named ``title`` (one per nested section).

    ``shown_defaults`` (nested, like a settings layer) overrides the default that ``--help`` shows,
    where a profile gives the command another one than the model; ``exclude`` leaves out top-level
    fields whose flag the command spends on something else, ``only`` keeps just those named."""
    if only is not None:
        exclude = exclude | (frozenset(model.model_fields) - only)
    _add_group(parser, model, title, (), shown_defaults or {}, exclude)


def given_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The settings the user typed, as nested sections: ``{"admission": {"policy": "fcfs"}}``."""
    nested: dict[str, Any] = {}
    for dest, value in vars(args).items():
        if dest.startswith(_DEST_PREFIX):
            *parents, name = dest.removeprefix(_DEST_PREFIX).split(".")
            target = nested
            for parent in parents:
                target = target.setdefault(parent, {})
            target[name] = value
    return nested


def _add_group(parser: argparse.ArgumentParser, model: type[BaseModel], title: str, path: tuple[str, ...],
               shown: dict[str, Any], exclude: frozenset[str] = frozenset()) -> None:
    group = parser.add_argument_group(title)
    sections = []
    for name, field in model.model_fields.items():
        if name in exclude:
            continue
        section = _section_model(field)
        if section is not None:
            sections.append((name, section))
        else:
            _add_flag(group, name, field, path, shown.get(name, field.get_default(call_default_factory=True)))
    for name, section in sections:
        _add_group(parser, section, name, (*path, name), shown.get(name, {}))


def _add_flag(group: argparse._ArgumentGroup, name: str, field: FieldInfo, path: tuple[str, ...],
              default: Any) -> None:
    extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
    flag = "--" + str(extra.get("flag") or name.replace("_", "-"))
    help_text = f"{field.description or ''} (default: {_shown(default)})".replace("%", "%%")
    kind, choices = _scalar_kind(field.annotation)
    options: dict[str, Any] = dict(dest=_DEST_PREFIX + ".".join((*path, name)), default=argparse.SUPPRESS,
                                   help=help_text)
    if _is_list(field.annotation):  # --lora-modules a=x b=y: the list as given
        options["nargs"] = "+"
    if kind is bool:
        group.add_argument(flag, action=argparse.BooleanOptionalAction, **options)
        return
    if choices:
        options["choices"] = choices
    else:
        options["metavar"] = extra.get("metavar") or name.upper()
    group.add_argument(flag, type=kind, **options)


def _is_list(annotation: Any) -> bool:
    while typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    return typing.get_origin(annotation) is list


def _section_model(field: FieldInfo) -> type[BaseModel] | None:
    annotation = field.annotation
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def _scalar_kind(annotation: Any) -> tuple[type, list[str] | None]:
    """The type argparse converts a flag's text to, and its choices: ``int | None`` -> int."""
    while typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    if typing.get_origin(annotation) is Literal:
        return str, list(typing.get_args(annotation))
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        members = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _scalar_kind(members[0]) if len(members) == 1 else (str, None)  # int | str: the text as given
    return (annotation, None) if annotation in (bool, int, float) else (str, None)


def _shown(default: Any) -> str:
    if default is None:
        return "unset"
    if isinstance(default, bool):
        return "on" if default else "off"
    if isinstance(default, list):
        return " ".join(map(str, default)) or "none"
    return str(default)


# ------------------------------------------------------------------ a request's answer constraint

def add_structured_flags(parser: argparse.ArgumentParser) -> None:
    """``--json-schema FILE | --choice a,b,c | --regex R | --grammar FILE``: what the answer must be."""
    group = parser.add_argument_group("constrained answer (one of)").add_mutually_exclusive_group()
    group.add_argument("--json-schema", metavar="FILE",
                       help="the answer is compact JSON matching this JSON schema file ('-': stdin)")
    group.add_argument("--choice", metavar="A,B,C", help="the answer is exactly one of these comma-separated strings")
    group.add_argument("--regex", metavar="R", help="the answer matches this regular expression in full")
    group.add_argument("--grammar", metavar="FILE", help="the answer follows this Lark grammar file")


def structured_from_args(args: argparse.Namespace) -> dict[str, Any] | None:
    """The ``structured`` mapping of ``SamplingParams`` the flags ask for; ``InvalidRequestError`` when a
    file cannot be read or is not JSON."""
    if args.json_schema is not None:
        return {"json": _read_json(args.json_schema, "--json-schema")}
    if args.choice is not None:
        return {"choice": [c.strip() for c in args.choice.split(",") if c.strip()]}
    if args.regex is not None:
        return {"regex": args.regex}
    if args.grammar is not None:
        return {"grammar": _read_text(args.grammar, "--grammar")}
    return None


def _read_text(path: str, flag: str) -> str:
    try:
        return sys.stdin.read() if path == "-" else Path(path).read_text()
    except OSError as exc:
        raise InvalidRequestError(f"{flag} {path}: {exc.strerror}") from None


def _read_json(path: str, flag: str) -> Any:
    try:
        return json.loads(_read_text(path, flag))
    except json.JSONDecodeError as exc:
        raise InvalidRequestError(f"{flag} {path} is not JSON: {exc}") from None
