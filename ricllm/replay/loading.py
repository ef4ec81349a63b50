"""Loading a scenario: find the file (a path or a bundled name), read its YAML, apply ``--set``
overrides, validate, cross-check, and load or generate its trace.

A mistake is reported with the field *and* the line of the file (``default.yaml: line 14,
triggers[0].threshold: unknown KPI ...``), because a scenario is edited by hand and a bare
pydantic location is hard to find in a long file. Cross-field mistakes (a trigger naming an
unknown class or template, a threshold over a KPI the trace lacks, a prompt that does not render)
are checked here too, so nothing is found only minutes into a replay.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from ricllm.errors import RicllmError
from ricllm.paths import shipped_folder
from ricllm.replay.expressions import Threshold
from ricllm.replay.generator import GENERATED_KPIS, generate_trace
from ricllm.replay.prompts import jinja_env, prompt_context
from ricllm.replay.schema import SELECT_MODES, GeneratedTrace, Scenario, Trigger
from ricllm.replay.templates import template_problems
from ricllm.replay.traces import KpiRow, LoadedTrace, LoadStats, TraceSpec, load_trace

class ScenarioError(RicllmError, ValueError):
    """The scenario file is unusable; the message names each field and its line."""


def bundled_scenarios() -> list[str]:
    """Names of the scenarios shipped inside the package (``ricllm replay NAME``)."""
    folder = shipped_folder("scenarios")
    return sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".yaml"))


def resolve_scenario_path(name_or_path: str | Path) -> Path:
    """A file path, or the name of a bundled scenario."""
    path = Path(name_or_path).expanduser()
    if path.is_file():
        return path
    if not path.suffix and "/" not in str(name_or_path):
        candidate = shipped_folder("scenarios") / f"{name_or_path}.yaml"
        if candidate.is_file():
            return candidate
    raise ScenarioError(f"no scenario file {str(name_or_path)!r} and no bundled scenario of that name; "
                        f"bundled: {', '.join(bundled_scenarios())}")


def load_scenario(name_or_path: str | Path, overrides: Sequence[str] = ()) -> Scenario:
    """Read, validate and cross-check a scenario; every problem is reported with its line.

    ``overrides`` are ``section.field=YAML`` strings (``engine.enable_prefix_caching=false``).
    """
    path = resolve_scenario_path(name_or_path)
    text = path.read_text(encoding="utf-8")
    data, root = _parse_yaml(text, path)
    overridden = [_apply_override(data, item) for item in overrides]
    try:
        scenario = Scenario.model_validate(data)
    except ValidationError as exc:
        raise ScenarioError(_format_problems(path, root, overridden, _pydantic_problems(exc))) from None
    scenario._path = path.resolve()
    if scenario.name is None:
        scenario.name = path.stem
    problems = cross_check(scenario)
    if problems:
        raise ScenarioError(_format_problems(path, root, overridden, problems))
    return scenario


def _parse_yaml(text: str, path: Path) -> tuple[dict, yaml.Node]:
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}: " if mark is not None else ""
        raise ScenarioError(f"{path.name}: {where}not valid YAML: {getattr(exc, 'problem', None) or exc}") from None
    if not isinstance(data, dict):
        raise ScenarioError(f"{path.name}: a scenario must be a YAML mapping (trace:, triggers:, classes:, ...)")
    return data, root


def _apply_override(data: dict, item: str) -> tuple[str, ...]:
    """Set one ``a.b.c=value`` (value parsed as YAML) in the raw data; returns the path."""
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise ScenarioError(f"--set {item!r}: expected FIELD.PATH=VALUE, e.g. engine.enable_prefix_caching=false")
    parts = tuple(key.strip().split("."))
    node = data
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ScenarioError(f"--set {item!r}: {part!r} is not a section")
    node[parts[-1]] = yaml.safe_load(raw)
    return parts


# ------------------------------------------------------------------------------------ the trace

def load_scenario_trace(scenario: Scenario) -> LoadedTrace:
    """The trace rows: read the CSV through its mapping, or generate them (seeded) in memory."""
    if isinstance(scenario.trace, TraceSpec):
        trace = load_trace(scenario.trace, scenario.base_dir)
        end = trace.rows[-1].time_s if trace.rows else 0.0
        problems = fault_problems(scenario, end)
        if problems:
            where = "; ".join(f"{_field_path(loc)}: {message}" for loc, message, _ in problems)
            raise ScenarioError(f"{scenario.path.name}: {where}")
        return trace
    spec = scenario.trace.generator
    rows = generate_trace(spec.cells, spec.duration_s, spec.interval_s, spec.seed, spec.start,
                          day_length_s=spec.day_length_s, bursts_per_min=spec.bursts_per_min,
                          outages=spec.outages, outage_mode=spec.outage_mode, prb_avail=spec.prb_avail)
    stats = LoadStats(rows_read=len(rows), rows_kept=len(rows))
    stats.missing = {name: sum(1 for r in rows if r.kpis.get(name) is None) for name in GENERATED_KPIS}
    return LoadedTrace(Path("<generated>"), rows, stats)


# ------------------------------------------------------------------------ validation problems

Problem = tuple[tuple, str, str]  # (pydantic loc, message, error type)


def _pydantic_problems(exc: ValidationError) -> list[Problem]:
    problems = []
    for error in exc.errors(include_url=False):
        message = error["msg"].removeprefix("Value error, ")
        if error["type"] == "extra_forbidden":
            message = "unknown field (a typo?)"
        elif error["type"] not in ("missing", "value_error", "assertion_error") and "input" in error:
            shown = repr(error["input"])
            message += f" (got {shown[:60] + '...' if len(shown) > 60 else shown})"
        problems.append((tuple(error["loc"]), message, error["type"]))
    return problems


def cross_check(scenario: Scenario) -> list[Problem]:
    """What one field cannot know alone: names that must exist elsewhere in the scenario."""
    problems: list[Problem] = []
    classes, templates = scenario.classes, scenario.prompts.templates
    kpis = scenario.trace_kpis()
    for i, trigger in enumerate(scenario.triggers):
        problems += _trigger_problems(i, trigger, classes, templates, kpis)
    if scenario.prompts.select not in (*SELECT_MODES, *templates):
        names = ", ".join(templates) or "(none defined)"
        problems.append((("prompts", "select"), f"unknown template {scenario.prompts.select!r}; choose entity, "
                         f"entity_order, random or one of the templates: {names}", "x"))
    if sum(c.weight for c in classes.values()) <= 0:
        problems.append((("classes",), "the class weights add up to 0: no class can be drawn", "x"))
    problems += [(("targets", scope), f"unknown scope {scope!r}: use 'overall' or a class "
                  f"({', '.join(classes)})", "x") for scope in scenario.targets
                 if scope != "overall" and scope not in classes]
    for name, entry in templates.items():
        problems += template_problems(name, entry, scenario.base_dir, kpis)
    problems += _prompt_render_problems(scenario, kpis)
    problems += _engine_path_problems(scenario)
    generated = scenario.trace.generator.duration_s if isinstance(scenario.trace, GeneratedTrace) else None
    problems += fault_problems(scenario, generated)
    return problems


def fault_problems(scenario: Scenario, trace_end_s: float | None) -> list[Problem]:
    """Each fault phase inside the replayed part of the trace (``pacing.start_s`` to its end, or
    ``trace_end_s`` when the trace's end is known), and no two at once."""
    pacing = scenario.pacing
    ends = [e for e in (None if pacing.duration_s is None else pacing.start_s + pacing.duration_s, trace_end_s)
            if e is not None]
    end = min(ends) if ends else None
    problems: list[Problem] = []
    for i, phase in enumerate(scenario.faults):
        if phase.start_s < pacing.start_s:
            message = (f"starts at {phase.start_s:g} s, before the replay does "
                       f"(pacing.start_s {pacing.start_s:g} s of trace time)")
            problems.append((("faults", i, "start_s"), message, "x"))
        if end is not None and phase.stop_s > end:
            message = (f"stops at {phase.stop_s:g} s, after the replayed trace ends ({end:g} s of trace time); "
                       "a phase lies within the replay")
            problems.append((("faults", i, "stop_s"), message, "x"))
    ordered = sorted(enumerate(scenario.faults), key=lambda item: item[1].start_s)
    for (i, first), (j, second) in itertools.pairwise(ordered):
        if second.start_s < first.stop_s:
            message = f"overlaps faults[{i}] ({first.start_s:g}-{first.stop_s:g} s); one fault phase at a time"
            problems.append((("faults", j, "start_s"), message, "x"))
    return problems


def _trigger_problems(i: int, trigger: Trigger, classes: Mapping, templates: Mapping,
                      kpis: list[str]) -> list[Problem]:
    problems = []
    if trigger.deadline_class is not None and trigger.deadline_class not in classes:
        problems.append((("triggers", i, "deadline_class"), f"unknown deadline class "
                         f"{trigger.deadline_class!r}; the classes are {', '.join(classes)}", "x"))
    if trigger.template is not None and trigger.template not in templates:
        problems.append((("triggers", i, "template"), f"unknown template {trigger.template!r}; the templates "
                         f"are {', '.join(templates) or '(none defined)'}", "x"))
    if trigger.threshold is not None:
        try:
            Threshold(trigger.threshold, kpis)
        except ValueError as exc:
            problems.append((("triggers", i, "threshold"), str(exc), "x"))
    return problems


def _prompt_render_problems(scenario: Scenario, kpis: list[str]) -> list[Problem]:
    """Render each user prompt once with a sample row of this trace's KPIs and passthrough columns,
    so a typo in a variable fails now."""
    from jinja2 import TemplateError

    row = KpiRow(0.0, 0.0, "cell0", dict.fromkeys(kpis, 1.0), dict.fromkeys(scenario.trace_passthrough(), ""), 2)
    context = prompt_context(row, template=None, deadline_class="x", deadline_ms=1.0, max_tokens=1, trigger="t")
    problems = []
    sources = [(("prompts", "user_prompt"), scenario.prompts.user_prompt)]
    sources += [(("triggers", i, "user_prompt"), t.user_prompt) for i, t in enumerate(scenario.triggers)
                if t.user_prompt]
    env = jinja_env()
    for loc, source in sources:
        try:
            env.from_string(source).render(context)
        except (TemplateError, TypeError, KeyError, ValueError) as exc:
            problems.append((loc, f"the user prompt does not render with this trace's rows: {exc} "
                             f"(variables: entity, time_s, timestamp, kpi[NAME], extras[COLUMN], line, template, "
                             f"deadline_class, deadline_ms, max_tokens, trigger; KPIs: {', '.join(kpis)})", "x"))
    return problems


def _engine_path_problems(scenario: Scenario) -> list[Problem]:
    problems = []
    for field in ("model", "latency_fit"):
        value = getattr(scenario.engine, field)
        if value is not None and not Path(scenario.resolve_path(value)).exists():
            problems.append((("engine", field), f"no such file {value!r} (paths are relative to the scenario)", "x"))
    return problems


# ------------------------------------------------------------------ errors with their YAML line

def _format_problems(path: Path, root: yaml.Node, overridden: list[tuple[str, ...]],
                     problems: list[Problem]) -> str:
    lines, seen = [], set()
    for loc, message, kind in problems:
        where = _where(root, loc, kind, overridden)
        if (where, message) not in seen:
            seen.add((where, message))
            lines.append((where, message))
    lines.sort(key=lambda item: (_line_of(item[0]), item[0]))
    body = [f"{where}: {message}" for where, message in lines]
    if len(body) == 1:
        return f"{path.name}: {body[0]}"
    return f"{path.name}: {len(body)} problems:\n" + "\n".join(f"  {line}" for line in body)


def _line_of(where: str) -> int:
    match = re.match(r"line (\d+)", where)
    return int(match.group(1)) if match else 0


def _where(root: yaml.Node, loc: tuple, kind: str, overridden: list[tuple[str, ...]]) -> str:
    """'line 14, triggers[0].threshold': the deepest node of ``loc`` found in the YAML, or
    '--set engine.block_size' when the value came from an override."""
    names = tuple(str(p) for p in loc)
    for path in overridden:
        if names[:len(path)] == path:
            return f"--set {'.'.join(path)}"
    node, matched = root, []
    for part in loc:
        child = _child(node, part)
        if child is None:
            continue  # a union tag (csv, generated, str, ...) or a key the file does not have
        node, matched = child, [*matched, part]
    if kind == "missing" and loc and (not matched or matched[-1] != loc[-1]):
        matched.append(loc[-1])
    return f"line {node.start_mark.line + 1}, {_field_path(matched) or '(top level)'}"


def _child(node: yaml.Node, part: Any) -> yaml.Node | None:
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            if key.value == str(part):
                return value
    if isinstance(node, yaml.SequenceNode) and isinstance(part, int) and 0 <= part < len(node.value):
        return node.value[part]
    return None


def _field_path(parts: Sequence[Any]) -> str:
    text = ""
    for part in parts:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text
