"""The scenario file's schema: pydantic models of its sections, each field with its check.

A scenario says which trace to replay, how fast, which rows send a request, with what prompt,
under which deadline, on which engine, and what the run must achieve. The models check one field
at a time (and the fields of one section together); checks across sections (a trigger naming an
unknown class) are ``ricllm.replay.loading.cross_check``'s. Nothing here imports torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any, Literal, Union

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    PrivateAttr,
    Tag,
    field_validator,
    model_validator,
)

from ricllm.config import EngineSettings
from ricllm.replay.generator import GENERATED_KPIS, GENERATED_PASSTHROUGH
from ricllm.replay.prompts import check_template
from ricllm.sampling_params import Priority
from ricllm.replay.traces import TraceSpec
from ricllm.report.targets import parse_target
from ricllm.sampling_params import default_priority

DEFAULT_USER_PROMPT = (
    "Cell {{ entity }} at t={{ time_s | fmt(0) }} s: PRB usage {{ kpi['RRU.PrbUsedDl'] | fmt(0) }} of "
    "{{ kpi['RRU.PrbAvailDl'] | fmt(0) }}, DL throughput {{ kpi['DRB.UEThpDl'] | fmt(0) }} kbps, "
    "{{ kpi['RRC.ConnMean'] | fmt(0) }} UEs, SINR {{ kpi['L1M.DL-SS-SINR'] | fmt(1) }} dB. "
    "What should the controller do?")
SELECT_MODES = ("entity", "entity_order", "random")


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
        return None if value is None else check_template(value)

    def label(self, index: int) -> str:
        if self.name:
            return self.name
        if self.threshold:
            return f"threshold {self.threshold}"
        return "every_row" if self.every_row else f"every {self.every.seconds:g} s"


# ------------------------------------------------------------------- prompts, classes, engine

class WorkedExample(_Strict):
    """One worked example: a user turn and the answer it should get, pinned with the system prompt."""

    user: str = Field(min_length=1)
    assistant: str = Field(min_length=1)


RecipeValue = str | int | float | bool


class AdapterSpec(_Strict):
    """A template's LoRA adapter: a PEFT folder (``path``, relative to the scenario), or a ``recipe``
    by which ``ricllm adapt`` trains it from the template's policy on first use (its options, e.g.
    ``{steps: 100, rows: drawn}``; ``{}`` for the defaults), cached like converted weights. Under an
    adapter the template pins the adapter's short system prompt, not its own conversation."""

    path: str | None = Field(None, min_length=1)
    recipe: dict[Annotated[str, Field(pattern=r"^[a-z][a-z0-9_]*$")], RecipeValue] | None = None

    @model_validator(mode="after")
    def _one_source(self) -> AdapterSpec:
        if (self.path is None) == (self.recipe is None):
            raise ValueError("an adapter needs exactly one of path, recipe")
        return self


class ExpectRule(_Strict):
    """One rule of a template's reference policy: ``when`` (a threshold expression) then these answer
    fields; or, last, ``otherwise``."""

    when: str | None = None
    then: dict[str, Any] | None = Field(None, min_length=1)
    otherwise: dict[str, Any] | None = Field(None, min_length=1)

    @model_validator(mode="after")
    def _one_shape(self) -> ExpectRule:
        if self.otherwise is not None and (self.when is not None or self.then is not None):
            raise ValueError("a rule is either when + then, or otherwise alone")
        if self.otherwise is None and (self.when is None or self.then is None):
            raise ValueError("a rule needs both when and then (or, last, otherwise)")
        return self

    @property
    def fields(self) -> dict[str, Any]:
        return self.then if self.otherwise is None else self.otherwise


class TemplateSpec(_Strict):
    """A RAN template: a system prompt (``file`` or ``system``), worked examples, the constraint every
    answer must satisfy (``schema``, ``choice`` or ``regex``) and the reference policy (``expect``).
    ``fallback`` (with ``min_confidence``) is the answer given instead of a decision less confident
    than ``min_confidence`` (``ricllm.structured.fallback``); it must satisfy the constraint, and
    ``min_confidence`` is chosen without looking at the rows the replay scores.
    The checks across its fields (an example's answer against the constraint, ``then`` fields
    against the schema, ``when`` against the trace's KPIs) are in ``ricllm.replay.templates``."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, serialize_by_alias=True)

    file: str | None = Field(None, min_length=1)
    system: str | None = Field(None, min_length=1)
    examples: list[WorkedExample] = []
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    choice: list[Annotated[str, Field(min_length=1)]] | None = Field(None, min_length=1)
    regex: str | None = Field(None, min_length=1)
    expect: list[ExpectRule] | None = Field(None, min_length=1)
    adapter: AdapterSpec | None = None
    min_confidence: float | None = Field(None, gt=0, le=1)
    fallback: str | None = Field(None, min_length=1)

    @model_validator(mode="after")
    def _one_each(self) -> TemplateSpec:
        if (self.file is None) == (self.system is None):
            raise ValueError("a template needs exactly one of file, system")
        constraints = [n for n, v in (("schema", self.json_schema), ("choice", self.choice), ("regex", self.regex))
                       if v is not None]
        if len(constraints) > 1:
            raise ValueError(f"a template takes at most one of schema, choice, regex; got {', '.join(constraints)}")
        if self.expect is not None and not constraints:
            raise ValueError("expect needs schema, choice or regex: an answer is compared field by field")
        if self.adapter is not None and self.adapter.recipe is not None and self.expect is None:
            raise ValueError("an adapter recipe trains on the template's policy: it needs expect")
        if (self.min_confidence is None) != (self.fallback is None):
            raise ValueError("min_confidence and fallback go together: "
                             f"{'fallback' if self.fallback is None else 'min_confidence'} is missing")
        if self.fallback is not None and not constraints:
            raise ValueError("fallback needs schema, choice or regex: the constraint its answer satisfies")
        return self

    @field_validator("expect")
    @classmethod
    def _ends_with_otherwise(cls, rules: list[ExpectRule] | None) -> list[ExpectRule] | None:
        otherwise = [i for i, rule in enumerate(rules or []) if rule.otherwise is not None]
        if rules is not None and otherwise != [len(rules) - 1]:
            found = f"otherwise at rule {', '.join(str(i) for i in otherwise)}" if otherwise else "no otherwise"
            raise ValueError(f"expect must end with exactly one otherwise rule (the last); found {found} "
                             f"of {len(rules)} rules")
        return rules

    @property
    def structured(self) -> dict[str, Any] | None:
        """The constraint in vLLM's ``structured_outputs`` keys (``ricllm.template.Template``'s)."""
        for kind, value in (("json", self.json_schema), ("choice", self.choice), ("regex", self.regex)):
            if value is not None:
                return {kind: value}
        return None


def _template_kind(data: Any) -> str:
    return "text" if isinstance(data, str) else "spec"


# A discriminated union, so a mistake in a template mapping is reported once, not also as "not a string".
TemplateEntry = Annotated[Annotated[Annotated[str, Field(min_length=1)], Tag("text")]
                          | Annotated[TemplateSpec, Tag("spec")], Discriminator(_template_kind)]


class Prompts(_Strict):
    """RAN config templates (pinned once), the user prompt, and which template a row uses. A template is
    a system prompt (a string, or ``{file: ...}``) or a ``TemplateSpec`` with worked examples, a
    constraint and a reference policy.

    ``select``: ``entity`` (a stable hash of the entity id), ``entity_order`` (the trace's i-th entity
    gets template i mod n: an even spread), ``random`` (seeded) or a template name.
    """

    templates: dict[str, TemplateEntry] = {}
    select: str = "entity"
    user_prompt: str = DEFAULT_USER_PROMPT

    @field_validator("user_prompt")
    @classmethod
    def _template_parses(cls, value: str) -> str:
        return check_template(value)


class DeadlineClass(_Strict):
    """A kind of request: its deadline (None: best effort), output length and share of the mix."""

    deadline_ms: float | None = Field(gt=0)
    max_tokens: int = Field(16, ge=1)
    weight: float = Field(1.0, ge=0)
    priority: Priority | None = None
    temperature: float = Field(0.0, ge=0)
    ignore_eos: bool = False
    # sink + window KV retention for this class (ricllm.kv_window); None: the engine's, 0: exact
    kv_window: int | None = Field(None, ge=0)
    kv_sinks: int | None = Field(None, ge=0)

    def resolved_priority(self) -> str:
        """As ``SamplingParams`` derives it, so the in-process and ZeroMQ paths agree."""
        return self.priority or default_priority(self.deadline_ms)


class FaultPhase(_Strict):
    """A fault from ``start_s`` to ``stop_s`` of trace time, replayed on the requests' schedule
    (``(t - pacing.start_s) / speed`` seconds after the start). ``cpu_hog``: a noisy neighbour, one
    process per CPU of the engine spinning for ``duty`` of every ``period_ms`` (``ricllm.faults.CpuHog``)."""

    kind: Literal["cpu_hog"]
    name: str | None = None
    start_s: float = Field(ge=0)
    stop_s: float = Field(gt=0)
    duty: float = Field(gt=0, le=1)
    period_ms: float = Field(10.0, gt=0)

    @model_validator(mode="after")
    def _stops_after_it_starts(self) -> FaultPhase:
        if self.stop_s <= self.start_s:
            raise ValueError(f"stop_s ({self.stop_s:g}) must be after start_s ({self.start_s:g})")
        return self

    def label(self, index: int) -> str:
        return self.name or f"{self.kind} {index}"


# An in-process replay promises deadlines, as a server does: the engine's own default (off) only refuses
# what can never fit. The scenario's engine section goes over this profile.
SCENARIO_PROFILE: dict[str, Any] = {"admission": {"policy": "deadline"}}


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
    engine: EngineSettings = Field(default_factory=EngineSettings)  # partly filled: what the file sets
    faults: list[FaultPhase] = []
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

    def trace_passthrough(self) -> list[str]:
        """The trace's columns that user prompts read as ``extras[COLUMN]``."""
        if isinstance(self.trace, GeneratedTrace):
            return list(GENERATED_PASSTHROUGH)
        return list(self.trace.passthrough)

    def resolve_path(self, value: str) -> str:
        """A path in the file is relative to the scenario's folder."""
        path = Path(value).expanduser()
        return str(path if path.is_absolute() else self.base_dir / path)
