"""Examples that teach a template's policy to a LoRA adapter (``ricllm adapt``): KPI rows, each
labelled with the answer the template's ``expect`` rules give, rendered as the chat request the
engine sends, with loss on the answer's tokens only.

Never train on what is scored. The rows come from one of two sources:
- ``drawn``: drawn at random from the KPI ranges of the scenario's trace, not taken from it, and
  a row whose user prompt is one the scenario's replay sends for the template is dropped
  (``scored_prompts``), so the replay's report judges prompts the adapter never saw;
- ``trace``: the trace's own rows split by time (``split_by_time``): every KPI report outside
  the window the replay scores (``pacing.start_s``, ``duration_s``), rendered as the replay renders
  a request for the template, trains, and the requests inside the window, the ones its report
  scores, are held out. Training reads every report, not only the ones a trigger would ask about:
  a trigger every 30 s over reports every 2 s sends one row in fifteen, and the thresholds are
  learnt from the rows near them.
Level-style prompts (``PRB usage: high``) have only a few distinct strings, every one of which the
replay sends; ``prompt="replay"`` therefore keeps them and ``count_seen`` says how many scored
prompts training saw. Nothing here imports torch.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import random
import re
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from ricllm.engine.chat_prefix import render_chat_prefix, render_chat_request
from ricllm.errors import RicllmError
from ricllm.model.tokenizer import Tokenizer
from ricllm.replay.decisions import ANSWER_FIELD, Policy
from ricllm.replay.planning import PlannedRequest, plan_requests
from ricllm.replay.prompts import jinja_env, prompt_context
from ricllm.replay.schema import Scenario, TemplateSpec
from ricllm.replay.templates import answer_check, build_policy, system_text
from ricllm.replay.traces import KpiRow, LoadedTrace

PromptForm = Literal["raw", "replay"]
RowSource = Literal["drawn", "trace"]
IGNORE_INDEX = -100  # labels torch's cross-entropy skips: the prompt's tokens


class AdaptError(RicllmError, ValueError):
    """The adapter cannot be made as asked (an unknown template, a template without a policy)."""


@dataclass(frozen=True)
class Example:
    """One labelled row: its KPIs, the user prompt, the policy's answer and that answer as text."""

    kpis: dict[str, float | None]
    user: str
    expected: dict[str, Any]
    answer: str
    time_s: float | None = None  # the trace row's time, for rows taken from the trace

    @property
    def label(self) -> str:
        return json.dumps(self.expected, sort_keys=True)


@dataclass(frozen=True)
class TemplatePolicy:
    """The template ``name`` of a scenario, its policy and the KPIs that policy reads."""

    name: str
    spec: TemplateSpec
    policy: Policy

    @property
    def kpis(self) -> list[str]:
        return list(dict.fromkeys(name for rule in self.policy.rules if rule.when for name in rule.when.names))

    def thresholds(self, kpi: str) -> list[float]:
        """The numbers the policy compares ``kpi`` with directly (``KPI > 85``)."""
        pattern = re.compile(rf"{re.escape(kpi)}\s*(?:<=|>=|<|>|==)\s*(-?\d+(?:\.\d+)?)")
        return [float(m) for rule in self.policy.rules if rule.when for m in pattern.findall(rule.when.text)]

    def missing_tested(self) -> list[str]:
        """The KPIs the policy asks ``missing(KPI)`` of, in rule order."""
        found = (name for rule in self.policy.rules if rule.when
                 for name in re.findall(r"missing\(\s*([^\s)]+)\s*\)", rule.when.text))
        return list(dict.fromkeys(found))

    @property
    def answers(self) -> list[dict[str, Any]]:
        """Every answer the policy can give, in rule order, each once."""
        seen: dict[str, dict[str, Any]] = {}
        for rule in self.policy.rules:
            seen.setdefault(json.dumps(rule.then, sort_keys=True), rule.then)
        return list(seen.values())

    def answer_text(self, expected: Mapping[str, Any]) -> str:
        """The answer as the engine's constrained decoding writes it: compact JSON, or the bare text."""
        if answer_check(self.spec).spec.kind != "json":
            return str(expected[ANSWER_FIELD])
        return json.dumps(dict(expected), separators=(",", ":"))


def templates_with_policy(scenario: Scenario) -> list[str]:
    return [n for n, entry in scenario.prompts.templates.items() if isinstance(entry, TemplateSpec) and entry.expect]


def template_policy(scenario: Scenario, name: str | None) -> TemplatePolicy:
    """The template ``name`` (None: the first with a policy) with its policy; an ``AdaptError``
    naming the templates that have one."""
    with_policy = templates_with_policy(scenario)
    if name is None and not with_policy:
        raise AdaptError(f"scenario {scenario.name!r} has no template with a policy (expect) to learn")
    name = with_policy[0] if name is None else name
    entry = scenario.prompts.templates.get(name)
    if not isinstance(entry, TemplateSpec) or not entry.expect:
        what = "has no template" if entry is None else "has a template without a policy (expect)"
        raise AdaptError(f"scenario {scenario.name!r} {what} {name!r}; templates with a policy: "
                         f"{', '.join(with_policy) or '(none)'}")
    return TemplatePolicy(name, entry, build_policy(entry, scenario.trace_kpis()))


def template_digest(scenario: Scenario, template: TemplatePolicy) -> str:
    """sha256 of what the template is: its entry as the scenario states it, its system prompt's text
    and the user prompt the replay renders for it. An adapter records it, so a changed policy or
    prompt can be told from the one it was trained on."""
    entry = template.spec
    stated = {"entry": entry.model_dump(mode="json", by_alias=True), "system": system_text(entry, scenario.base_dir),
              "user_prompt": _replay_prompt_text(scenario, template.name)}
    return hashlib.sha256(json.dumps(stated, sort_keys=True).encode()).hexdigest()


def default_system_prompt(template: TemplatePolicy) -> str:
    """The one-line system prompt an adapter is trained under (the policy lives in the adapter)."""
    return f"You are the {template.name} assistant of an O-RAN near-RT RIC xApp. Answer with one action as JSON."


# ------------------------------------------------------------------------------ drawing rows

def kpi_ranges(trace: LoadedTrace, template: TemplatePolicy) -> dict[str, tuple[float, float]]:
    """Each KPI the policy reads: the trace's smallest to largest value, stretched to reach a tenth of
    that span past every number the policy compares the KPI with (``SINR < 0`` on a trace whose
    SINR is always positive still gets rows on both sides)."""
    ranges = {}
    for name in template.kpis:
        values = [row.kpis[name] for row in trace.rows if row.kpis.get(name) is not None]
        if not values:
            raise AdaptError(f"the trace has no value of {name}, which the policy reads")
        lo, hi = float(min(values)), float(max(values))
        margin = 0.1 * max(hi - lo, 1.0)
        for bound in template.thresholds(name):
            lo, hi = min(lo, bound - margin), max(hi, bound + margin)
        ranges[name] = (lo, hi)
    return ranges


def draw_rows(ranges: Mapping[str, tuple[float, float]], template: TemplatePolicy, count: int, seed: int,
              missing_share: float = 0.08) -> list[dict[str, float | None]]:
    """``count`` KPI rows, uniform over ``ranges`` (one decimal). Of the complete rows the policy's
    answers take turns, so each answer the ranges reach has about as many rows; then a
    ``missing_share`` of all rows has one KPI, drawn at random, missing."""
    rng = np.random.default_rng(seed)
    names = list(ranges)
    pool: dict[str, list[dict[str, float | None]]] = {}
    for _ in range(max(20 * count, 1000)):
        kpis = {name: round(float(rng.uniform(lo, hi)), 1) for name, (lo, hi) in ranges.items()}
        pool.setdefault(json.dumps(template.policy.expected(kpis), sort_keys=True), []).append(kpis)
    queues = list(pool.values())
    drawn: list[dict[str, float | None]] = []
    while len(drawn) < count and any(queues):
        for rows in queues:
            if rows and len(drawn) < count:
                drawn.append(rows.pop())
    for i in rng.choice(len(drawn), size=round(missing_share * len(drawn)), replace=False):
        drawn[i] = {**drawn[i], names[int(rng.integers(len(names)))]: None}
    return [drawn[i] for i in rng.permutation(len(drawn))]


# ----------------------------------------------------------------------------- user prompts

def raw_user_prompt(kpis: Mapping[str, float | None]) -> str:
    """The KPIs the policy reads as raw numbers, one per line; a missing one is ``n/a``."""
    return "\n".join(f"{name}: {'n/a' if value is None else f'{value:.1f}'}" for name, value in kpis.items())


def _replay_prompt_text(scenario: Scenario, template: str) -> str:
    """The user prompt the replay sends for the template: its trigger's, else the scenario's."""
    for trigger in scenario.triggers:
        if trigger.template == template and trigger.user_prompt:
            return trigger.user_prompt
    return scenario.prompts.user_prompt


def replay_user_prompt(scenario: Scenario, template: str, kpis: Mapping[str, float | None]) -> str:
    """The drawn KPIs through the replay's own user prompt (the trace's other KPIs missing)."""
    row = KpiRow(0.0, 0.0, "cell0", {name: kpis.get(name) for name in scenario.trace_kpis()},
                 {name: "" for name in scenario.trace_passthrough()}, 0)
    context = prompt_context(row, template=template, deadline_class="", deadline_ms=None, max_tokens=0, trigger="")
    return jinja_env().from_string(_replay_prompt_text(scenario, template)).render(context).strip()


def scored_requests(scenario: Scenario, trace: LoadedTrace, template: str) -> list[PlannedRequest]:
    """The requests the scenario's replay sends for the template (what its report scores)."""
    return [request for request in plan_requests(scenario, trace) if request.template == template]


def scored_prompts(scenario: Scenario, trace: LoadedTrace, template: str) -> set[str]:
    """Every user prompt the scenario's replay sends for the template."""
    return {request.user_prompt for request in scored_requests(scenario, trace, template)}


def make_examples(scenario: Scenario, trace: LoadedTrace, template: TemplatePolicy, count: int, seed: int, *,
                  prompt: PromptForm = "raw", missing_share: float = 0.08,
                  exclude: set[str] = frozenset()) -> list[Example]:
    """Labelled examples of the template's policy; with ``prompt="raw"``, none whose user prompt is in
    ``exclude`` (the scored prompts)."""
    rows = draw_rows(kpi_ranges(trace, template), template, count, seed, missing_share)
    examples = []
    for kpis in rows:
        user = raw_user_prompt(kpis) if prompt == "raw" else replay_user_prompt(scenario, template.name, kpis)
        if prompt == "raw" and user in exclude:
            continue
        expected = template.policy.expected(kpis)
        examples.append(Example(kpis, user, expected, template.answer_text(expected)))
    return examples


def count_seen(examples: Sequence[Example], scored: set[str]) -> int:
    """How many distinct scored prompts appear verbatim among the examples' user prompts."""
    return len(scored & {example.user for example in examples})


# ------------------------------------------------------------------------- trace rows by time

@dataclass(frozen=True)
class TraceSplit:
    """A template's requests over the scenario's trace, split by the window its replay scores:
    ``training`` from the rows outside ``scored_window`` (in ``outside``), ``held_out`` the
    requests the report scores, in send order. Every training row's time is outside the window
    and every held-out row's inside it."""

    training: list[Example]
    held_out: list[Example]
    scored_window: tuple[float, float]
    outside: list[tuple[float, float]]
    reports_outside: int  # the trace's rows outside the window, of which ``training`` is all or a sample

    def seen_in_training(self) -> list[Example]:
        """The held-out rows whose user prompt a training row has verbatim."""
        trained = {example.user for example in self.training}
        return [example for example in self.held_out if example.user in trained]


def unscored_part(scenario: Scenario, trace: LoadedTrace) -> LoadedTrace:
    """The trace without the rows in the window the replay scores: where drawn rows take their KPI
    ranges when the scored requests are held out."""
    start, end = scored_window(scenario)
    return dataclasses.replace(trace, rows=[row for row in trace.rows if not start <= row.time_s < end])


def scored_window(scenario: Scenario) -> tuple[float, float]:
    """The trace seconds the replay sends (and its report scores): ``[start_s, start_s + duration_s)``."""
    pacing = scenario.pacing
    return pacing.start_s, math.inf if pacing.duration_s is None else pacing.start_s + pacing.duration_s


def validation_split(scenario: Scenario, trace: LoadedTrace, seconds: float) -> tuple[Scenario, LoadedTrace]:
    """The scenario and trace for choosing a recipe without the scored rows: the trace ends where the
    scored window starts, and its last ``seconds`` become the window scored in their place. Training
    on the result reads only rows before that validation window; an ``AdaptError`` when the scored
    window leaves no room for it."""
    start, _ = scored_window(scenario)
    if seconds >= start:
        raise AdaptError(f"--validation-s {seconds:g} leaves no rows to train on: the window the replay scores starts "
                         f"at {start:g} s of trace time, so the validation window must be shorter than that")
    pacing = scenario.pacing.model_copy(update={"start_s": start - seconds, "duration_s": seconds})
    before = dataclasses.replace(trace, rows=[row for row in trace.rows if row.time_s < start])
    return scenario.model_copy(update={"pacing": pacing}), before


def _report_prompt(scenario: Scenario, template: str) -> Callable[[KpiRow], str]:
    """How the replay renders a report row's user prompt for the template: the prompt, deadline
    class and trigger label of the first trigger that names it (else the first trigger's)."""
    index = next((i for i, t in enumerate(scenario.triggers) if t.template == template), 0)
    trigger = scenario.triggers[index]
    cls = trigger.deadline_class or next(iter(scenario.classes))
    spec = scenario.classes[cls]
    text = jinja_env().from_string(_replay_prompt_text(scenario, template))
    return lambda row: text.render(prompt_context(row, template=template, deadline_class=cls,
                                                  deadline_ms=spec.deadline_ms, max_tokens=spec.max_tokens,
                                                  trigger=trigger.label(index))).strip()


def _trace_example(user: str, row: KpiRow, template: TemplatePolicy, prompt: PromptForm) -> Example:
    kpis = {name: row.kpis.get(name) for name in template.kpis}
    user = user if prompt == "replay" else raw_user_prompt(kpis)
    expected = template.policy.expected(row.kpis)
    return Example(kpis, user, expected, template.answer_text(expected), row.time_s)


def split_by_time(scenario: Scenario, trace: LoadedTrace, template: TemplatePolicy, prompt: PromptForm = "replay",
                  limit: int | None = None, seed: int = 0) -> TraceSplit:
    """Every report row outside the scored window to train on (at most ``limit``, a seeded sample),
    and the template's scored requests held out; an ``AdaptError`` when either part is empty."""
    start, end = scored_window(scenario)
    after = not math.isinf(end) and any(row.time_s >= end for row in trace.rows)
    outside = ([(0.0, start)] if start > 0 else []) + ([(end, math.inf)] if after else [])
    render = _report_prompt(scenario, template.name)
    training = [_trace_example(render(row), row, template, prompt)
                for row in trace.rows if not start <= row.time_s < end]
    rows = {row.line: row for row in trace.rows}
    held_out = [_trace_example(request.user_prompt, rows[request.trace_line], template, prompt)
                for request in scored_requests(scenario, trace, template.name)]
    window = f"[{start:g}, {end:g}) s of trace time (pacing.start_s, duration_s)"
    if not held_out:
        raise AdaptError(f"scenario {scenario.name!r}'s replay sends no request for template {template.name!r} "
                         f"in the window it scores, {window}: nothing to hold out")
    if not training:
        raise AdaptError(f"scenario {scenario.name!r}'s replay scores the template's requests over the whole trace, "
                         f"{window}: no row outside it to train on; split the trace by time with "
                         "--set pacing.start_s=SECONDS (the replay then scores only the rows from there on), "
                         "or use --rows drawn")
    reports = len(training)
    if limit is not None and reports > limit:
        training = [training[i] for i in sorted(random.Random(seed).sample(range(reports), limit))]
    return TraceSplit(training, held_out, (start, end), outside, reports)


TWIN_REACHES = ("mirror", "range", "both")


def counterfactual_twins(scenario: Scenario, trace: LoadedTrace, template: TemplatePolicy, count: int, seed: int,
                         prompt: PromptForm = "replay", reach: str = "mirror",
                         missing_share: float = 0.0) -> list[Example]:
    """``count`` twins of the trace's reports outside the scored window, each labelled by the policy.
    A twin is a report with one KPI that the policy compares with a number (``PRB < 50``) moved
    across that number, such that the policy answers it otherwise than the report. How far
    (``reach``): ``mirror``, by up to the distance it had from it (``_across``), so twins sit as
    near the number as the reports do; ``range``, anywhere on the other side within the KPI's range,
    so they also reach values the reports' hours never combine with the others; ``both``, each
    twin one or the other at random. Where two KPIs go together in the trace's hours (high SINR
    with low load), such pairs tell a rule that reads both from a rule that reads one, which the
    reports alone may not, and they put rows on both sides of every number as near to it as the
    reports are. Reports with that KPI missing are not twinned. With ``missing_share``, that share
    of the twins instead lose one KPI the policy asks ``missing(KPI)`` of (``_without_one``): a
    trace's few gaps would otherwise teach that rule from a handful of rows."""
    ground = _twin_ground(scenario, trace, template)
    if ground is None:
        return []
    outside, cuts, ranges, render = ground
    rng = random.Random(seed)
    twins: list[Example] = []
    for _ in range(50 * count):
        if len(twins) == count:
            break
        row = rng.choice(outside.rows)
        if missing_share and rng.random() < missing_share:
            twin = _without_one(row, template, rng)
        else:
            twin = _twin(row, rng.choice(cuts), ranges, template, reach, rng)
        if twin is not None:
            twins.append(_trace_example(render(twin), twin, template, prompt))
    return twins


def paired_twins(scenario: Scenario, trace: LoadedTrace, template: TemplatePolicy, reports: Sequence[Example],
                 count: int, seed: int, prompt: PromptForm = "replay", reach: str = "mirror",
                 missing_share: float = 0.0) -> list[tuple[int, Example]]:
    """Twins of the training reports themselves, at most one each and ``count`` in all, made as
    ``counterfactual_twins`` makes them: ``(index of the report in reports, its twin)``. Training
    puts each pair in one batch, so that one step sees a number's two sides with everything else
    alike. With ``missing_share``, that share of the reports is twinned instead by losing one KPI
    the policy asks ``missing(KPI)`` of, where that changes the answer: the same report with and
    without the number. A report no cut relabels (a missing KPI decides it) has no twin."""
    ground = _twin_ground(scenario, trace, template)
    if ground is None:
        return []
    outside, cuts, ranges, render = ground
    rows = {(row.time_s, tuple(row.kpis.get(name) for name in template.kpis)): row for row in outside.rows}
    rng = random.Random(seed)
    pairs: list[tuple[int, Example]] = []
    for index in rng.sample(range(len(reports)), len(reports)):
        if len(pairs) == count:
            break
        report = reports[index]
        row = rows[(report.time_s, tuple(report.kpis.values()))]
        twin = _without_one(row, template, rng) if rng.random() < missing_share else None
        twin = twin or next(filter(None, (_twin(row, rng.choice(cuts), ranges, template, reach, rng)
                                          for _ in range(20))), None)
        if twin is not None:
            pairs.append((index, _trace_example(render(twin), twin, template, prompt)))
    return pairs


def _twin_ground(scenario: Scenario, trace: LoadedTrace, template: TemplatePolicy):
    """What twins are made from: the trace outside the scored window, the (KPI, number) cuts the
    policy reads, each KPI's range there and the replay's rendering of a report; None where the
    policy compares no KPI with a number or no report lies outside the window."""
    outside = unscored_part(scenario, trace)
    cuts = [(kpi, bound) for kpi in template.kpis for bound in dict.fromkeys(template.thresholds(kpi))]
    if not cuts or not outside.rows:
        return None
    return outside, cuts, kpi_ranges(outside, template), _report_prompt(scenario, template.name)


def _without_one(row: KpiRow, template: TemplatePolicy, rng: random.Random) -> KpiRow | None:
    """``row`` without one of the KPIs the policy asks ``missing(KPI)`` of (one it has), or None where
    there is none to drop or the policy answers the row alike without it."""
    present = [kpi for kpi in template.missing_tested() if row.kpis.get(kpi) is not None]
    if not present:
        return None
    twin = dataclasses.replace(row, kpis={**row.kpis, rng.choice(present): None})
    return twin if template.policy.expected(twin.kpis) != template.policy.expected(row.kpis) else None


def _twin(row: KpiRow, cut: tuple[str, float], ranges: Mapping[str, tuple[float, float]], template: TemplatePolicy,
          reach: str, rng: random.Random) -> KpiRow | None:
    """``row`` with the cut's KPI moved across its number (``reach`` as in ``counterfactual_twins``),
    or None where that KPI is missing or the policy answers the moved row as it answers ``row``."""
    kpi, bound = cut
    if row.kpis.get(kpi) is None:
        return None
    far = reach == "range" or (reach == "both" and rng.random() < 0.5)
    moved = (_beyond if far else _across)(row.kpis[kpi], bound, ranges[kpi], rng)
    twin = dataclasses.replace(row, kpis={**row.kpis, kpi: moved})
    return twin if template.policy.expected(twin.kpis) != template.policy.expected(row.kpis) else None


def _across(value: float, bound: float, span: tuple[float, float], rng: random.Random) -> float:
    """A value on the other side of ``bound`` from ``value`` (``value < bound`` or not), uniform between
    ``bound`` and ``value``'s mirror image in it, kept within the KPI's range ``span``; one decimal."""
    mirror = min(max(2 * bound - value, span[0]), span[1])
    moved = round(rng.uniform(min(bound, mirror), max(bound, mirror)), 1)
    if value >= bound:
        return moved if moved < bound else round(bound - 0.1, 1)
    return moved if moved >= bound else bound


def _beyond(value: float, bound: float, span: tuple[float, float], rng: random.Random) -> float:
    """A value on the other side of ``bound`` from ``value``, uniform over the KPI's range ``span``
    on that side; one decimal."""
    if value >= bound:
        moved = round(rng.uniform(min(span[0], bound), bound), 1)
        return moved if moved < bound else round(bound - 0.1, 1)
    moved = round(rng.uniform(bound, max(span[1], bound)), 1)
    return moved if moved >= bound else bound


def miss_counts(predicted: Sequence[Mapping[str, Any]], examples: Sequence[Example]) -> list[tuple[tuple[str, str], int]]:
    """How often each (policy's answer, predicted answer) pair that differ occurs, most common first;
    an answer of one field as its value, else as compact JSON."""
    pairs = Counter((_compact(example.expected), _compact(answer))
                    for answer, example in zip(predicted, examples) if answer != example.expected)
    return pairs.most_common()


def _compact(answer: Mapping[str, Any]) -> str:
    if len(answer) == 1:
        return str(next(iter(answer.values())))
    return json.dumps(answer, separators=(",", ":"), sort_keys=True)


def majority_share(labels: Sequence[Mapping[str, Any]]) -> tuple[str, float]:
    """The most common answer and its share (the always-answer-it baseline)."""
    label, n = Counter(json.dumps(dict(answer), sort_keys=True) for answer in labels).most_common(1)[0]
    return label, n / len(labels)


# ------------------------------------------------------------------------------ tokenising

@dataclass(frozen=True)
class TokenizedExample:
    """``input_ids`` the chat request then the answer; ``labels`` the answer's ids, ``IGNORE_INDEX``
    on the request's, so training puts loss on the answer only."""

    input_ids: list[int]
    labels: list[int]
    prompt_len: int


def prefix_messages(system: str | Sequence[Mapping[str, str]]) -> list[dict[str, str]]:
    """A one-line system prompt as its message, or the conversation a template starts with as given."""
    return [{"role": "system", "content": system}] if isinstance(system, str) else [dict(m) for m in system]


def request_ids(tokenizer: Tokenizer, system: str | Sequence[Mapping[str, str]], user: str) -> list[int]:
    """The chat request as the engine renders it: the system prompt (or a template's whole
    conversation) as a pinned prefix, then the user turn."""
    prefix = render_chat_prefix(tokenizer, prefix_messages(system))
    return render_chat_request(tokenizer, prefix, [{"role": "user", "content": user}])


def answer_ids(tokenizer: Tokenizer, system: str | Sequence[Mapping[str, str]], user: str, answer: str) -> list[int]:
    """The assistant turn's tokens after the generation prompt, through the end-of-turn token. A
    model without a chat template (a base model's plain form, ``chat_prefix.render_chat_request``)
    answers right after the request's text: the answer's own tokens, then the end of text."""
    if not tokenizer.has_chat_template:
        return tokenizer.encode(answer, add_special_tokens=False) + [tokenizer.eos_token_id]
    conversation = prefix_messages(system) + [{"role": "user", "content": user}]
    asked = tokenizer.apply_chat_template(conversation, add_generation_prompt=True)
    whole = tokenizer.apply_chat_template(conversation + [{"role": "assistant", "content": answer}],
                                          add_generation_prompt=False)
    ids = tokenizer.encode(whole[len(asked):] if whole.startswith(asked) else answer, add_special_tokens=False)
    end = next((i for i, token in enumerate(ids) if token in tokenizer.eos_token_ids), None)
    return ids[:end + 1] if end is not None else ids + [tokenizer.eos_token_id]


def tokenize_example(tokenizer: Tokenizer, system: str | Sequence[Mapping[str, str]],
                     example: Example) -> TokenizedExample:
    prompt = request_ids(tokenizer, system, example.user)
    answer = answer_ids(tokenizer, system, example.user, example.answer)
    return TokenizedExample(prompt + answer, [IGNORE_INDEX] * len(prompt) + answer, len(prompt))


def class_counts(examples: Sequence[Example]) -> dict[str, int]:
    """Rows per answer (the answer as its text), most common first."""
    return dict(Counter(example.answer for example in examples).most_common())
