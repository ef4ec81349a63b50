"""Scenario files: which trace to replay, how fast, which rows send a request, with what prompt,
under which deadline, on which engine, and what the run must achieve.

A scenario is YAML validated by pydantic. A mistake is reported with the field *and* the line of
the file (``default.yaml: line 14, triggers[0].threshold: unknown KPI ...``), because a scenario is
edited by hand and a bare pydantic location is hard to find in a long file. Cross-field mistakes
(a trigger naming an unknown class or template, a threshold over a KPI the trace lacks) are
checked here too, so nothing is found only minutes into a replay.

Thresholds are parsed with ``ast`` into a small closure tree over KPI names, numbers, ``+ - * /``,
comparisons and ``and``/``or``/``not``; nothing is ever passed to ``eval``.

``plan_requests`` turns a scenario and its trace into the full, seeded list of requests before
anything is sent, so a replay is open loop and reproducible. Nothing here imports torch.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.resources
import math
import operator
import random
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    PrivateAttr,
    Tag,
    ValidationError,
    field_validator,
    model_validator,
)

from ricllm.errors import RicllmError
from ricllm.replay.generator import GENERATED_KPIS, generate_trace
from ricllm.replay.traces import KpiRow, LoadedTrace, LoadStats, TraceSpec, load_trace
from ricllm.units import parse_bytes

BUNDLED_PACKAGE = "ricllm.scenarios"
DEFAULT_USER_PROMPT = (
    "Cell {{ entity }} at t={{ time_s | fmt(0) }} s: PRB usage {{ kpi['RRU.PrbUsedDl'] | fmt(0) }} of "
    "{{ kpi['RRU.PrbAvailDl'] | fmt(0) }}, DL throughput {{ kpi['DRB.UEThpDl'] | fmt(0) }} kbps, "
    "{{ kpi['RRC.ConnMean'] | fmt(0) }} UEs, SINR {{ kpi['L1M.DL-SS-SINR'] | fmt(1) }} dB. "
    "What should the controller do?")
TARGET_METRICS = ("met_of_admitted", "met_of_sent", "client_met_of_sent", "admitted_of_sent",
                  "rejected_of_sent", "goodput_rps", "prefix_cache_hit_rate",
                  "p50_ttft_s", "p95_ttft_s", "p99_ttft_s", "p50_e2e_s", "p95_e2e_s", "p99_e2e_s")
TARGET_OPS: dict[str, Callable[[float, float], bool]] = {
    ">=": operator.ge, "<=": operator.le, ">": operator.gt, "<": operator.lt, "==": operator.eq}
_TARGET = re.compile(r"^\s*([a-z0-9_]+)\s*(>=|<=|==|>|<)\s*([-+]?[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*$")
SELECT_MODES = ("entity", "entity_order", "random")


class ScenarioError(RicllmError, ValueError):
    """The scenario file is unusable; the message names each field and its line."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ------------------------------------------------------------------------------------ the trace

class GeneratorSpec(_Strict):
    """Arguments of ``generate_trace``: a seeded synthetic trace, so a scenario needs no file."""

    cells: int = Field(ge=1)
    duration_s: float = Field(gt=0)
    interval_s: float = Field(1.0, gt=0)
    seed: int = 0
    day_length_s: float = Field(86400.0, gt=0)
    bursts_per_min: float = Field(1.0, ge=0)
    outages: int = Field(1, ge=0)
    outage_mode: Literal["zero", "absent"] = "zero"
    prb_avail: list[Annotated[int, Field(ge=1)]] = Field(default_factory=lambda: [106, 273], min_length=1)
    start: datetime | None = None

    @model_validator(mode="after")
    def _interval_fits(self) -> GeneratorSpec:
        if self.interval_s > self.duration_s:
            raise ValueError(f"interval_s ({self.interval_s}) is longer than duration_s ({self.duration_s})")
        return self


class GeneratedTrace(_Strict):
    generator: GeneratorSpec


def _trace_kind(data: Any) -> str:
    if isinstance(data, Mapping):
        return "generated" if "generator" in data else "csv"
    return "generated" if isinstance(data, GeneratedTrace) else "csv"


TraceSection = Annotated[Union[Annotated[TraceSpec, Tag("csv")], Annotated[GeneratedTrace, Tag("generated")]],
                         Discriminator(_trace_kind)]


# ------------------------------------------------------------------------- pacing and triggers

class Pacing(_Strict):
    """Open loop: request k is sent at ``(row time - start_s) / speed`` whatever came back."""

    speed: float = Field(1.0, gt=0)
    start_s: float = Field(0.0, ge=0)
    duration_s: float | None = Field(None, gt=0)
    drain_timeout_s: float = Field(60.0, gt=0)


class Every(_Strict):
    """Per entity, every ``seconds`` of trace time. ``stagger`` spreads the entities' phases over the
    period (by a stable hash of the id), so cells do not all report in the same instant."""

    seconds: float = Field(gt=0)
    stagger: bool = False


class Trigger(_Strict):
    """Exactly one condition; each firing row sends one request.

    ``every`` and ``cooldown_s`` count per entity, in trace seconds. ``mode: rising`` fires a
    threshold only when it turns true for that entity; ``level`` fires on every true row. (``mode``,
    not ``on``: YAML reads a bare ``on`` key as the boolean true.)
    """

    name: str | None = None
    every_row: bool = False
    every: Every | None = None
    threshold: str | None = None
    mode: Literal["level", "rising"] = "level"
    cooldown_s: float = Field(0.0, ge=0)
    entities: list[str] | None = None
    deadline_class: str | None = None
    template: str | None = None
    user_prompt: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, data: Any) -> Any:
        return {"every_row": True} if data == "every_row" else data

    @model_validator(mode="after")
    def _one_condition(self) -> Trigger:
        given = [n for n, v in (("every_row", self.every_row), ("every", self.every),
                                ("threshold", self.threshold)) if v]
        if len(given) != 1:
            raise ValueError("a trigger needs exactly one of every_row, every, threshold; got "
                             + (", ".join(given) or "none"))
        return self

    @field_validator("user_prompt")
    @classmethod
    def _template_parses(cls, value: str | None) -> str | None:
        return None if value is None else _check_jinja(value)

    def label(self, index: int) -> str:
        if self.name:
            return self.name
        if self.threshold:
            return f"threshold {self.threshold}"
        return "every_row" if self.every_row else f"every {self.every.seconds:g} s"


# ------------------------------------------------------------------- prompts, classes, engine

class TemplateFile(_Strict):
    file: str = Field(min_length=1)


class Prompts(_Strict):
    """RAN config-template system prompts (pinned once), the user prompt, and which template a row uses.

    ``select``: ``entity`` (a stable hash of the entity id), ``entity_order`` (the trace's i-th entity
    gets template i mod n: an even spread), ``random`` (seeded) or a template name.
    """

    templates: dict[str, Annotated[str, Field(min_length=1)] | TemplateFile] = {}
    select: str = "entity"
    user_prompt: str = DEFAULT_USER_PROMPT

    @field_validator("user_prompt")
    @classmethod
    def _template_parses(cls, value: str) -> str:
        return _check_jinja(value)


class DeadlineClass(_Strict):
    """A kind of request: its deadline (None: best effort), output length and share of the mix."""

    deadline_ms: float | None = Field(gt=0)
    max_tokens: int = Field(16, ge=1)
    weight: float = Field(1.0, ge=0)
    priority: Literal["near_rt", "non_rt", "best_effort"] | None = None
    temperature: float = Field(0.0, ge=0)
    ignore_eos: bool = False

    def resolved_priority(self) -> str:
        """As ``SamplingParams`` derives it, so the in-process and ZeroMQ paths agree."""
        if self.priority:
            return self.priority
        if self.deadline_ms is None:
            return "best_effort"
        return "near_rt" if self.deadline_ms <= 1000 else "non_rt"


class EngineSettings(_Strict):
    """``EngineConfig`` fields for an in-process replay; unset ones keep the engine's default.

    Over ZeroMQ the server's own settings apply and this section is only recorded.
    """

    model: str | None = None
    kv_cache_budget: int | str | None = None
    block_size: int | None = Field(None, ge=1)
    max_num_seqs: int | None = Field(None, ge=1)
    max_num_batched_tokens: int | None = Field(None, ge=1)
    max_model_len: int | None = Field(None, ge=1)
    dtype: Literal["auto", "float32", "fp32", "bfloat16", "bf16", "float16", "fp16"] | None = None
    device: Annotated[str, Field(pattern=r"^(auto|cpu|cuda(:[0-9]+)?)$")] | None = None
    attention_backend: Literal["auto", "torch", "cpu", "triton", "cuda"] | None = None
    weights: Literal["auto", "bf16", "int8", "int4"] | None = None
    enable_prefix_caching: bool | None = None
    admission: Literal["deadline", "fcfs", "off"] = "deadline"
    safety_margin: float | None = Field(None, ge=0, lt=10)
    max_queue: int | None = Field(None, ge=0)
    abort_late: bool | None = None
    pace_prefill: bool | None = None
    degrade: bool | None = None
    latency_fit: str | None = None
    tightest_deadline_ms: float | None = Field(None, gt=0)
    tightest_deadline_tokens: int | None = Field(None, ge=1)
    seed: int | None = None
    threads: int | None = Field(None, ge=1)
    engine_cpus: str | list[int] | None = None
    runtime: Literal["auto", "native", "torch"] | None = None

    @field_validator("engine_cpus")
    @classmethod
    def _cpu_list(cls, value: str | list[int] | None) -> str | list[int] | None:
        from ricllm.engine.affinity import check_cpu_list_field

        return check_cpu_list_field(value)

    @field_validator("kv_cache_budget")
    @classmethod
    def _bytes(cls, value: int | str | None) -> int | str | None:
        if value is not None:
            parse_bytes(value)
        return value

    def config_kwargs(self) -> dict[str, Any]:
        return {k: v for k, v in self.model_dump().items() if v is not None}


# ---------------------------------------------------------------------------------- scenario

def _valid_target(text: str) -> str:
    parse_target(text)
    return text


class Scenario(_Strict):
    name: str | None = None
    description: str = ""
    seed: int = 0
    trace: TraceSection
    pacing: Pacing = Pacing()
    triggers: list[Trigger] = Field(min_length=1)
    prompts: Prompts = Prompts()
    classes: dict[str, DeadlineClass] = Field(min_length=1)
    engine: EngineSettings = EngineSettings()
    targets: dict[str, list[Annotated[str, AfterValidator(_valid_target)]]] = {}
    _path: Path = PrivateAttr(default=Path("scenario.yaml"))

    @property
    def path(self) -> Path:
        return self._path

    @property
    def base_dir(self) -> Path:
        return self._path.parent

    def trace_kpis(self) -> list[str]:
        if isinstance(self.trace, GeneratedTrace):
            return list(GENERATED_KPIS)
        return list(self.trace.kpis)

    def template_texts(self) -> dict[str, str]:
        """Template name -> system prompt text, files read relative to the scenario."""
        return {name: _template_text(value, self.base_dir) for name, value in self.prompts.templates.items()}

    def resolve_path(self, value: str) -> str:
        """A path in the file is relative to the scenario's folder."""
        path = Path(value).expanduser()
        return str(path if path.is_absolute() else self.base_dir / path)


def _template_text(value: str | TemplateFile, base_dir: Path) -> str:
    if isinstance(value, str):
        return value
    return (base_dir / value.file).read_text(encoding="utf-8").strip()


# ------------------------------------------------------------------------------------- targets

@dataclass(frozen=True)
class Target:
    metric: str
    op: str
    value: float

    def holds(self, actual: float | None) -> bool:
        return actual is not None and TARGET_OPS[self.op](actual, self.value)

    def __str__(self) -> str:
        return f"{self.metric} {self.op} {self.value:g}"


def parse_target(text: str) -> Target:
    """``"met_of_admitted >= 0.99"`` -> Target; the message lists the metrics when one is unknown."""
    match = _TARGET.match(text)
    if match is None:
        raise ValueError(f"target {text!r} is not 'METRIC OP NUMBER' (OP one of {', '.join(TARGET_OPS)})")
    metric, op, number = match.groups()
    if metric not in TARGET_METRICS:
        raise ValueError(f"target {text!r}: unknown metric {metric!r}; choose one of {', '.join(TARGET_METRICS)}")
    return Target(metric, op, float(number))


# --------------------------------------------------------------------------- jinja user prompts

def _fmt(value: Any, digits: int = 1) -> str:
    """Numbers rounded for a prompt; a missing KPI reads 'n/a' instead of 'None'."""
    if value is None:
        return "n/a"
    if isinstance(value, float) and not math.isfinite(value):
        return "n/a"
    if isinstance(value, (int, float)):
        return f"{value:.{digits}f}"
    return str(value)


def _jinja_env():
    from jinja2 import StrictUndefined
    from jinja2.sandbox import SandboxedEnvironment

    env = SandboxedEnvironment(undefined=StrictUndefined, autoescape=False, keep_trailing_newline=False)
    env.filters["fmt"] = _fmt
    return env


def _check_jinja(text: str) -> str:
    from jinja2 import TemplateSyntaxError

    try:
        _jinja_env().parse(text)
    except TemplateSyntaxError as exc:
        raise ValueError(f"jinja2 template syntax error on its line {exc.lineno}: {exc.message}") from None
    return text


def prompt_context(row: KpiRow, **extra: Any) -> dict[str, Any]:
    """What a user prompt may use: entity, time_s, timestamp, kpi[NAME], extras[COLUMN], and more."""
    stamp = row.timestamp.isoformat() if isinstance(row.timestamp, datetime) else row.timestamp
    return {"entity": row.entity, "time_s": row.time_s, "timestamp": stamp, "kpi": dict(row.kpis),
            "extras": dict(row.extras), "line": row.line, **extra}


# ---------------------------------------------------------------------------------- thresholds

class _Missing(Exception):
    """A KPI the row does not have: the comparison that reads it is false."""


_COMPARE = {ast.Lt: operator.lt, ast.LtE: operator.le, ast.Gt: operator.gt, ast.GtE: operator.ge,
            ast.Eq: operator.eq, ast.NotEq: operator.ne}
_ARITH = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
_PLACEHOLDER = "__kpi{}__"
KpiFn = Callable[[Mapping[str, float | None]], Any]


class Threshold:
    """A compiled threshold: call it with a row's KPIs; a comparison over a missing KPI is false."""

    def __init__(self, text: str, known: Iterable[str]):
        self.text = text
        self.known = sorted(set(known))
        source, self._slots = _substitute_names(text, self.known)
        try:
            tree = ast.parse(source.strip(), mode="eval")
        except SyntaxError as exc:
            raise ValueError(f"threshold {text!r} is not a valid expression: {exc.msg}") from None
        if not isinstance(tree.body, (ast.Compare, ast.BoolOp)) and not (
                isinstance(tree.body, ast.UnaryOp) and isinstance(tree.body.op, ast.Not)):
            raise ValueError(f"threshold {text!r} must be a comparison, e.g. 'RRU.PrbUsedDl / RRU.PrbAvailDl > 0.8'")
        self.names: list[str] = []
        self._fn = self._build(tree.body)
        self.signal = self._signal(tree.body)

    def __call__(self, kpis: Mapping[str, float | None]) -> bool:
        return bool(self._fn(kpis))

    def _signal(self, node: ast.AST) -> tuple[str, KpiFn, float] | None:
        """For ``EXPR OP NUMBER``: EXPR's text, its function and the number, so a report can plot
        the signal against its threshold; None for other shapes."""
        if not (isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.comparators[0], ast.Constant)):
            return None
        text = ast.unparse(node.left)
        for placeholder, kpi in self._slots.items():
            text = text.replace(placeholder, kpi)
        return text, self._build(node.left), float(node.comparators[0].value)

    def signal_value(self, kpis: Mapping[str, float | None]) -> float | None:
        """The left side of ``EXPR OP NUMBER`` for one row; None when a KPI is missing."""
        if self.signal is None:
            return None
        try:
            return float(self.signal[1](kpis))
        except (_Missing, ZeroDivisionError):
            return None

    def _build(self, node: ast.AST) -> KpiFn:
        builder = {ast.BoolOp: self._bool, ast.UnaryOp: self._unary, ast.BinOp: self._arith,
                   ast.Compare: self._compare, ast.Constant: self._constant, ast.Name: self._name,
                   ast.Attribute: self._unknown_name}.get(type(node))
        if builder is None:
            raise ValueError(f"threshold {self.text!r}: {type(node).__name__} is not allowed; use KPI names, "
                             "numbers, + - * /, comparisons, and/or/not")
        return builder(node)

    def _bool(self, node: ast.BoolOp) -> KpiFn:
        parts = [self._build(v) for v in node.values]
        if isinstance(node.op, ast.And):
            return lambda k: all(p(k) for p in parts)
        return lambda k: any(p(k) for p in parts)

    def _unary(self, node: ast.UnaryOp) -> KpiFn:
        inner = self._build(node.operand)
        ops = {ast.Not: operator.not_, ast.USub: operator.neg, ast.UAdd: operator.pos}
        if type(node.op) not in ops:
            raise ValueError(f"threshold {self.text!r}: operator {type(node.op).__name__} is not allowed")
        op = ops[type(node.op)]
        return lambda k: op(inner(k))

    def _arith(self, node: ast.BinOp) -> KpiFn:
        if type(node.op) not in _ARITH:
            raise ValueError(f"threshold {self.text!r}: only + - * / are allowed, not {type(node.op).__name__}")
        left, right, op = self._build(node.left), self._build(node.right), _ARITH[type(node.op)]
        return lambda k: op(left(k), right(k))

    def _compare(self, node: ast.Compare) -> KpiFn:
        if any(type(op) not in _COMPARE for op in node.ops):
            raise ValueError(f"threshold {self.text!r}: only < <= > >= == != comparisons are allowed")
        terms = [self._build(node.left)] + [self._build(c) for c in node.comparators]
        ops = [_COMPARE[type(op)] for op in node.ops]

        def compare(k: Mapping[str, float | None]) -> bool:
            try:
                values = [t(k) for t in terms]
            except (_Missing, ZeroDivisionError):
                return False
            return all(op(a, b) for op, a, b in zip(ops, values, values[1:]))
        return compare

    def _constant(self, node: ast.Constant) -> KpiFn:
        if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
            raise ValueError(f"threshold {self.text!r}: only numbers are allowed as constants, not {node.value!r}")
        value = node.value
        return lambda k: value

    def _name(self, node: ast.Name) -> KpiFn:
        if node.id not in self._slots:
            return self._unknown_name(node)
        name = self._slots[node.id]
        if name not in self.names:
            self.names.append(name)

        def read(k: Mapping[str, float | None]) -> float:
            value = k.get(name)
            if value is None:
                raise _Missing(name)
            return value
        return read

    def _unknown_name(self, node: ast.AST) -> KpiFn:
        name = ast.unparse(node)
        for placeholder, kpi in self._slots.items():
            name = name.replace(placeholder, kpi)
        raise ValueError(f"threshold {self.text!r}: unknown KPI {name!r}; the trace has "
                         f"{', '.join(self.known)} (write other names in `backticks`)")


def _substitute_names(text: str, known: Sequence[str]) -> tuple[str, dict[str, str]]:
    """KPI names (dots, dashes: ``L1M.DL-SS-RSRP``) become identifiers before ``ast`` sees them."""
    slots: dict[str, str] = {}

    def slot(name: str) -> str:
        for placeholder, existing in slots.items():
            if existing == name:
                return placeholder
        placeholder = _PLACEHOLDER.format(len(slots))
        slots[placeholder] = name
        return placeholder

    text = re.sub(r"`([^`]+)`", lambda m: slot(m.group(1)), text)
    for name in sorted(known, key=len, reverse=True):
        pattern = rf"(?<![\w.`]){re.escape(name)}(?![\w.`])"
        text = re.sub(pattern, lambda m, n=name: slot(n), text)
    return text, slots


# ---------------------------------------------------------------------------------- triggers

class TriggerRule:
    """One trigger's state over the rows in time order: when each entity last fired and its level."""

    def __init__(self, spec: Trigger, known_kpis: Iterable[str]):
        self.spec = spec
        self.threshold = Threshold(spec.threshold, known_kpis) if spec.threshold else None
        self._entities = set(spec.entities) if spec.entities else None
        self._last_fire: dict[str, float] = {}
        self._was_true: dict[str, bool] = {}

    def fires(self, row: KpiRow) -> bool:
        """Call once per row, in time order."""
        if self._entities is not None and row.entity not in self._entities:
            return False
        condition = self._condition(row)
        rising = condition and not self._was_true.get(row.entity, False)
        self._was_true[row.entity] = condition
        if not condition or (self.spec.mode == "rising" and self.threshold and not rising):
            return False
        last = self._last_fire.get(row.entity)
        if last is not None and row.time_s - last < self.spec.cooldown_s - 1e-9:
            return False
        self._last_fire[row.entity] = row.time_s
        return True

    def _condition(self, row: KpiRow) -> bool:
        if self.spec.every_row:
            return True
        if self.threshold is not None:
            return self.threshold(row.kpis)
        every = self.spec.every
        last = self._last_fire.get(row.entity)
        if last is not None:
            return row.time_s - last >= every.seconds - 1e-9
        return not every.stagger or row.time_s >= _phase(row.entity) * every.seconds - 1e-9


def _phase(entity: str) -> float:
    """A stable fraction in [0, 1) per entity id."""
    return int.from_bytes(hashlib.sha256(entity.encode()).digest()[:8], "big") / 2**64


def fire_triggers(triggers: Sequence[Trigger], rows: Sequence[KpiRow],
                  known_kpis: Iterable[str]) -> list[tuple[int, int]]:
    """(row index, trigger index) for every firing, in row order then trigger order."""
    known = list(known_kpis)
    rules = [TriggerRule(t, known) for t in triggers]
    return [(r, t) for r, row in enumerate(rows) for t, rule in enumerate(rules) if rule.fires(row)]


# ------------------------------------------------------------------------------ the request plan

@dataclass
class PlannedRequest:
    """One request of the replay, decided before the replay starts."""

    index: int
    request_id: str
    trace_time_s: float
    send_offset_s: float
    entity: str
    trace_line: int
    trigger: str
    deadline_class: str
    template: str | None
    user_prompt: str


def plan_requests(scenario: Scenario, trace: LoadedTrace, speed: float | None = None) -> list[PlannedRequest]:
    """Every request in send order: rows in the pacing window, fired triggers, seeded class and template."""
    pacing = scenario.pacing
    speed = speed or pacing.speed
    end = math.inf if pacing.duration_s is None else pacing.start_s + pacing.duration_s
    rows = [row for row in trace.rows if pacing.start_s <= row.time_s < end]
    class_rng, template_rng = random.Random(scenario.seed * 2 + 1), random.Random(scenario.seed * 2 + 2)
    env = _jinja_env()
    prompts = {None: env.from_string(scenario.prompts.user_prompt)}
    prompts.update({i: env.from_string(t.user_prompt) for i, t in enumerate(scenario.triggers) if t.user_prompt})
    order = {entity: i for i, entity in enumerate(trace.entities())}
    planned = []
    for row_index, trigger_index in fire_triggers(scenario.triggers, rows, scenario.trace_kpis()):
        row, trigger = rows[row_index], scenario.triggers[trigger_index]
        cls = trigger.deadline_class or _draw_class(scenario.classes, class_rng)
        template = trigger.template or _select_template(scenario.prompts, row.entity, order, template_rng)
        spec = scenario.classes[cls]
        context = prompt_context(row, template=template, deadline_class=cls, deadline_ms=spec.deadline_ms,
                                 max_tokens=spec.max_tokens, trigger=trigger.label(trigger_index))
        text = prompts.get(trigger_index, prompts[None]).render(context).strip()
        index = len(planned)
        planned.append(PlannedRequest(index, f"r{index:05d}", row.time_s, (row.time_s - pacing.start_s) / speed,
                                      row.entity, row.line, trigger.label(trigger_index), cls, template, text))
    return planned


def _draw_class(classes: Mapping[str, DeadlineClass], rng: random.Random) -> str:
    names = list(classes)
    return rng.choices(names, weights=[classes[n].weight for n in names])[0]


def _select_template(prompts: Prompts, entity: str, order: Mapping[str, int], rng: random.Random) -> str | None:
    names = list(prompts.templates)
    if not names:
        return None
    if prompts.select == "entity":
        return names[int(_phase(entity) * len(names))]
    if prompts.select == "entity_order":
        return names[order[entity] % len(names)]
    if prompts.select == "random":
        return rng.choice(names)
    return prompts.select


# ---------------------------------------------------------------------------------- the trace

def load_scenario_trace(scenario: Scenario) -> LoadedTrace:
    """The trace rows: read the CSV through its mapping, or generate them (seeded) in memory."""
    if isinstance(scenario.trace, TraceSpec):
        return load_trace(scenario.trace, scenario.base_dir)
    spec = scenario.trace.generator
    rows = generate_trace(spec.cells, spec.duration_s, spec.interval_s, spec.seed, spec.start,
                          day_length_s=spec.day_length_s, bursts_per_min=spec.bursts_per_min,
                          outages=spec.outages, outage_mode=spec.outage_mode, prb_avail=spec.prb_avail)
    stats = LoadStats(rows_read=len(rows), rows_kept=len(rows))
    stats.missing = {name: sum(1 for r in rows if r.kpis.get(name) is None) for name in GENERATED_KPIS}
    return LoadedTrace(Path("<generated>"), rows, stats)


# ------------------------------------------------------------------------------------ loading

def bundled_scenarios() -> list[str]:
    """Names of the scenarios shipped inside the package (``ricllm replay NAME``)."""
    folder = importlib.resources.files(BUNDLED_PACKAGE)
    return sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".yaml"))


def resolve_scenario_path(name_or_path: str | Path) -> Path:
    """A file path, or the name of a bundled scenario."""
    path = Path(name_or_path).expanduser()
    if path.is_file():
        return path
    if not path.suffix and "/" not in str(name_or_path):
        candidate = importlib.resources.files(BUNDLED_PACKAGE) / f"{name_or_path}.yaml"
        if candidate.is_file():
            return Path(str(candidate))
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
    problems += _template_file_problems(scenario)
    problems += _prompt_render_problems(scenario, kpis)
    problems += _engine_path_problems(scenario)
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


def _template_file_problems(scenario: Scenario) -> list[Problem]:
    problems = []
    for name, value in scenario.prompts.templates.items():
        if isinstance(value, TemplateFile) and not (scenario.base_dir / value.file).is_file():
            problems.append((("prompts", "templates", name, "file"),
                             f"no file {value.file!r} next to the scenario ({scenario.base_dir})", "x"))
    return problems


def _prompt_render_problems(scenario: Scenario, kpis: list[str]) -> list[Problem]:
    """Render each user prompt once with a sample row, so a typo in a variable fails now."""
    from jinja2 import TemplateError

    row = KpiRow(0.0, 0.0, "cell0", dict.fromkeys(kpis, 1.0), {"event": ""}, 2)
    context = prompt_context(row, template=None, deadline_class="x", deadline_ms=1.0, max_tokens=1, trigger="t")
    problems = []
    sources = [(("prompts", "user_prompt"), scenario.prompts.user_prompt)]
    sources += [(("triggers", i, "user_prompt"), t.user_prompt) for i, t in enumerate(scenario.triggers)
                if t.user_prompt]
    env = _jinja_env()
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

