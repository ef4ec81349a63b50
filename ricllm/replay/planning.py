"""Request planning: which trace rows fire which trigger, and what request each firing sends.

``plan_requests`` turns a scenario and its trace into the full, seeded list of requests before
anything is sent (deadline class drawn by weight, template chosen by the scenario's rule, user
prompt rendered, the answer the template's reference policy expects read off the row), so a
replay is open loop and reproducible: the same scenario gives the same plan on every machine.
Nothing here imports torch.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from ricllm.replay.expressions import Threshold
from ricllm.replay.prompts import jinja_env, prompt_context
from ricllm.replay.schema import DeadlineClass, Prompts, Scenario, Trigger
from ricllm.replay.templates import scenario_policies
from ricllm.replay.traces import KpiRow, LoadedTrace

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
    expected: dict | None = None  # what the template's reference policy expects for this row


def plan_requests(scenario: Scenario, trace: LoadedTrace, speed: float | None = None) -> list[PlannedRequest]:
    """Every request in send order: rows in the pacing window, fired triggers, seeded class and template."""
    pacing = scenario.pacing
    speed = speed or pacing.speed
    end = math.inf if pacing.duration_s is None else pacing.start_s + pacing.duration_s
    rows = [row for row in trace.rows if pacing.start_s <= row.time_s < end]
    class_rng, template_rng = random.Random(scenario.seed * 2 + 1), random.Random(scenario.seed * 2 + 2)
    env = jinja_env()
    prompts = {None: env.from_string(scenario.prompts.user_prompt)}
    prompts.update({i: env.from_string(t.user_prompt) for i, t in enumerate(scenario.triggers) if t.user_prompt})
    order = {entity: i for i, entity in enumerate(trace.entities())}
    policies = scenario_policies(scenario)
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
        expected = policies[template].expected(row.kpis) if template in policies else None
        planned.append(PlannedRequest(index, f"r{index:05d}", row.time_s, (row.time_s - pacing.start_s) / speed,
                                      row.entity, row.line, trigger.label(trigger_index), cls, template, text,
                                      expected))
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
