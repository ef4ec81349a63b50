"""``ricllm adapt``: examples labelled by the template's policy, never the prompts the replay scores,
loss on the answer's tokens only, and an adapter PEFT writes that ricllm reads."""

from __future__ import annotations

import json
import re
import warnings

import pytest

from ricllm.cli import main
from ricllm.model.loader import open_checkpoint
from ricllm.model.lora import load_lora_adapter
from ricllm.paths import file_digest
from ricllm.replay import adapt
from ricllm.replay.loading import load_scenario, load_scenario_trace
from tests.helpers import require_module

PRB, DELAY, SINR = "RRU.PrbTotDl", "DRB.RlcSduDelayDl", "L1M.DL-SS-SINR"


@pytest.fixture(scope="module")
def scenario():
    return load_scenario("default")


@pytest.fixture(scope="module")
def trace(scenario):
    return load_scenario_trace(scenario)


@pytest.fixture(scope="module")
def congestion(scenario):
    return adapt.template_policy(scenario, "congestion")


def congestion_by_hand(kpis: dict) -> str:
    """scenarios/prompts/congestion.md's policy, written out apart from the scenario's rules."""
    if any(kpis[name] is None for name in (PRB, DELAY, SINR)) or kpis[SINR] < 0:
        return "escalate"
    if kpis[PRB] > 85 and kpis[DELAY] > 200:
        return "offload"
    return "restore" if kpis[PRB] < 30 else "hold"


def test_each_row_is_labelled_with_the_policys_answer(scenario, trace, congestion):
    examples = adapt.make_examples(scenario, trace, congestion, 200, seed=3)
    assert len(examples) == 200
    assert all(e.expected == {"action": congestion_by_hand(e.kpis)} for e in examples)
    assert all(e.answer == json.dumps(e.expected, separators=(",", ":")) for e in examples)
    counts = adapt.class_counts(examples)
    actions = ("escalate", "offload", "restore", "hold")
    assert set(counts) == {json.dumps({"action": a}, separators=(",", ":")) for a in actions}
    assert min(counts.values()) >= 184 // 4 - 16  # turns over the complete rows; a gap makes escalate
    missing = [e for e in examples if None in e.kpis.values()]
    assert len(missing) == 16 and all(e.expected == {"action": "escalate"} for e in missing)


def test_rows_are_drawn_not_taken_from_the_trace(scenario, trace, congestion):
    examples = adapt.make_examples(scenario, trace, congestion, 300, seed=0)
    trace_rows = {tuple(row.kpis.get(k) for k in congestion.kpis) for row in trace.rows}
    assert not trace_rows & {tuple(e.kpis[k] for k in congestion.kpis) for e in examples}
    held_out = adapt.make_examples(scenario, trace, congestion, 300, seed=1)
    assert not {e.user for e in examples} & {e.user for e in held_out}


def test_no_training_prompt_is_one_the_replay_scores(scenario, trace, congestion):
    scored = adapt.scored_prompts(scenario, trace, "congestion")
    assert scored and all(p.startswith("PRB usage:") for p in scored)
    raw = adapt.make_examples(scenario, trace, congestion, 300, seed=0, exclude=scored)
    assert not {e.user for e in raw} & scored
    # the replay's level-style prompt repeats the scored prompts: counted, as the check must see them
    levels = adapt.make_examples(scenario, trace, congestion, 300, seed=0, prompt="replay", exclude=scored)
    assert adapt.count_seen(levels, scored) > 0
    assert adapt.count_seen(raw, scored) == 0


def test_loss_falls_on_the_answer_tokens_only(tiny_gguf, scenario, trace, congestion):
    tokenizer = open_checkpoint(tiny_gguf).tokenizer
    example = adapt.make_examples(scenario, trace, congestion, 4, seed=0)[0]
    system = adapt.default_system_prompt(congestion)
    item = adapt.tokenize_example(tokenizer, system, example)
    prompt = adapt.request_ids(tokenizer, system, example.user)
    assert item.input_ids[:item.prompt_len] == prompt
    assert item.labels[:item.prompt_len] == [adapt.IGNORE_INDEX] * len(prompt)
    answer = item.labels[item.prompt_len:]
    assert adapt.IGNORE_INDEX not in answer and answer == item.input_ids[item.prompt_len:]
    assert tokenizer.decode(answer, skip_special_tokens=False) == example.answer + "<|im_end|>"


def test_collate_masks_padding_and_prompt(tiny_gguf, scenario, trace, congestion):
    require_module("torch")
    from ricllm.replay.adapter_training import collate

    tokenizer = open_checkpoint(tiny_gguf).tokenizer
    system = adapt.default_system_prompt(congestion)
    items = [adapt.tokenize_example(tokenizer, system, e)
             for e in adapt.make_examples(scenario, trace, congestion, 8, seed=0)]
    batch = collate(items, pad_id=0)
    for row, item in enumerate(items):
        kept = batch["labels"][row][batch["labels"][row] != adapt.IGNORE_INDEX].tolist()
        assert kept == item.labels[item.prompt_len:]
        assert int(batch["attention_mask"][row].sum()) == len(item.input_ids)


def test_adapt_trains_an_adapter_ricllm_reads(tiny_gguf, scenario, tmp_path, capsys):
    require_module("peft")  # the dev extra's
    out = tmp_path / "adapter"
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        code = main(["adapt", "default", "--template", "energy", "--model", str(tiny_gguf), "--out", str(out),
                     "--examples", "16", "--eval-examples", "8", "--steps", "3", "--batch-size", "4",
                     "--no-progress"])
    printed, errors = capsys.readouterr()
    assert "%|" not in errors  # --no-progress: not transformers' bars either
    assert not [w for w in shown if "is_gradient_checkpointing" in str(w.message) or "config file" in str(w.message)]
    assert code == 0
    assert (out / "adapter_config.json").is_file() and (out / "adapter_model.safetensors").is_file()
    spec = open_checkpoint(tiny_gguf).spec
    adapter = load_lora_adapter(out, spec)
    projections = list(adapter.projections())
    assert len(projections) == 7 * spec.num_layers and adapter.max_rank == 8
    assert any(abs(p.b).max() > 0 for _, _, p in projections)  # trained: PEFT starts every B at zero
    manifest = json.loads((out / "ricllm_adapt.json").read_text())
    assert manifest["template"] == "energy" and manifest["training"]["rows"] == 16
    assert manifest["base_model"]["sha256"] == file_digest(tiny_gguf)
    assert manifest["template_sha256"] == adapt.template_digest(scenario, adapt.template_policy(scenario, "energy"))
    for line in ("with the adapter", "base model (no adapter)", "majority class"):
        assert line in printed
    assert "held out 8 rows (seed 1)" in printed
    assert "requests the replay scores for this template, the majority class is" in printed


def test_the_template_digest_changes_with_the_policy(scenario, congestion):
    digest = adapt.template_digest(scenario, congestion)
    assert digest == adapt.template_digest(load_scenario("default"), adapt.template_policy(scenario, "congestion"))
    assert digest != adapt.template_digest(scenario, adapt.template_policy(scenario, "energy"))
    for override in ("prompts.templates.congestion.expect=[{otherwise: {action: hold}}]",
                     "prompts.user_prompt=PRB {{ kpi['RRU.PrbTotDl'] }}"):
        changed = load_scenario("default", [override])
        assert digest != adapt.template_digest(changed, adapt.template_policy(changed, "congestion"))


def adapt_link_on(model, out, capsys, *args: str) -> str:
    """What ``ricllm adapt link ARGS`` prints, training a few steps of batch 4 on ``model`` into ``out``."""
    require_module("peft")
    code = main(["adapt", "link", *args, "--model", str(model), "--out", str(out), "--batch-size", "4",
                 "--no-progress"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    return printed


def test_trace_rows_mixed_with_drawn_rows_say_how_many_of_each(tiny_gguf, tmp_path, capsys):
    out = tmp_path / "adapter"
    printed = adapt_link_on(tiny_gguf, out, capsys, "--rows", "trace", "--prompt", "replay", "--drawn-share", "0.25",
                            "--examples", "16", "--eval-examples", "4", "--steps", "1")
    assert "trained on 12 of the trace's 9600 KPI reports" in printed
    assert "and 4 rows drawn from those reports' KPI ranges (seed 0), replay user prompts" in printed
    training = json.loads((out / "ricllm_adapt.json").read_text())["training"]
    assert training["rows"] == 16 and training["drawn_rows"] == 4


@pytest.mark.parametrize("argv, named", [
    (["adapt", "default", "--template", "nope"], "templates with a policy: congestion, energy"),
    (["adapt", "no-such-scenario"], "bundled:"),
    (["adapt", "--examples", "0"], "--examples must be at least 1"),
    (["adapt", "--average-last", "1.5"], "--average-last must be in [0, 1], got 1.5"),
], ids=["template", "scenario", "examples", "average-last"])
def test_a_mistake_is_refused_naming_what_exists(argv, named, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert named in err and "Traceback" not in err


def test_the_answer_logits_are_the_models_own(tiny_gguf, scenario, trace, congestion):
    """Training and judging read the head at the answer's positions only: the same numbers as the
    full model's logits there."""
    require_module("transformers")
    import torch

    from ricllm.replay.adapter_training import answer_logits, collate, load_base_model

    tokenizer = open_checkpoint(tiny_gguf).tokenizer
    system = adapt.default_system_prompt(congestion)
    items = [adapt.tokenize_example(tokenizer, system, e)
             for e in adapt.make_examples(scenario, trace, congestion, 3, seed=0)]
    batch = collate(items, pad_id=0)
    model = load_base_model(tiny_gguf).eval()
    with torch.no_grad():
        logits, targets, rows = answer_logits(model, batch)
        full = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    expected = [full[r, item.prompt_len - 1 + k] for r, item in enumerate(items)
                for k in range(len(item.input_ids) - item.prompt_len)]
    torch.testing.assert_close(logits, torch.stack(expected), rtol=1e-5, atol=1e-5)
    assert targets.tolist() == [t for item in items for t in item.labels[item.prompt_len:]]
    assert rows.tolist() == [r for r, item in enumerate(items) for _ in item.labels[item.prompt_len:]]


# --------------------------------------------------------------------- trace rows split by time

@pytest.fixture(scope="module")
def link():
    scenario = load_scenario("link")
    return scenario, load_scenario_trace(scenario), adapt.template_policy(scenario, "link")


def test_trace_rows_train_before_the_split_and_hold_out_what_the_replay_scores(link):
    scenario, trace, template = link
    split = adapt.split_by_time(scenario, trace, template)
    assert split.scored_window == (800.0, float("inf")) and split.outside == [(0.0, 800.0)]
    assert max(e.time_s for e in split.training) < 800 <= min(e.time_s for e in split.held_out)
    scored = adapt.scored_requests(scenario, trace, "link")
    assert [e.user for e in split.held_out] == [r.user_prompt for r in scored]  # exactly what the report judges
    assert [e.expected for e in split.held_out] == [r.expected for r in scored]
    before = load_scenario("link", ["pacing.start_s=0", "pacing.duration_s=800"])
    assert len(split.training) == split.reports_outside == sum(1 for row in trace.rows if row.time_s < 800)
    trained_at = {(e.time_s, e.user) for e in split.training}  # every report, each as the replay would ask it
    assert all((r.trace_time_s, r.user_prompt) in trained_at for r in adapt.scored_requests(before, trace, "link"))
    assert all(e.expected == template.policy.expected(e.kpis) for e in split.training + split.held_out)
    trained = {e.user for e in split.training}
    seen = split.seen_in_training()
    assert seen == [e for e in split.held_out if e.user in trained] and len(seen) < len(split.held_out) // 10


def test_a_scored_window_in_the_middle_trains_on_both_sides_of_it(link):
    scenario, _, _ = link
    middle = load_scenario("link", ["pacing.start_s=400", "pacing.duration_s=300"])
    split = adapt.split_by_time(middle, load_scenario_trace(middle), adapt.template_policy(middle, "link"),
                                prompt="raw")
    assert split.outside == [(0.0, 400.0), (700.0, float("inf"))]
    assert not [e for e in split.training if 400 <= e.time_s < 700]
    assert {e.time_s < 400 for e in split.training} == {True, False}
    assert all(400 <= e.time_s < 700 for e in split.held_out)
    assert all(e.user == adapt.raw_user_prompt(e.kpis) for e in split.training + split.held_out)
    sample = adapt.split_by_time(middle, load_scenario_trace(middle), adapt.template_policy(middle, "link"),
                                 limit=50, seed=3)
    assert len(sample.training) == 50 and sample.held_out == adapt.split_by_time(
        middle, load_scenario_trace(middle), adapt.template_policy(middle, "link")).held_out


def test_misses_are_counted_by_the_policys_answer_and_the_one_given():
    examples = [adapt.Example({}, f"row {i}", {"action": want}, "") for i, want in
                enumerate(["hold", "hold", "hold", "raise_mcs", "boost_power"])]
    predicted = [{"action": a} for a in ["raise_mcs", "hold", "raise_mcs", "hold", "boost_power"]]
    assert adapt.miss_counts(predicted, examples) == [(("hold", "raise_mcs"), 2), (("raise_mcs", "hold"), 1)]
    assert adapt.miss_counts([{"a": 1, "b": 2}], [adapt.Example({}, "", {"a": 1, "b": 3}, "")]) == [
        (('{"a":1,"b":3}', '{"a":1,"b":2}'), 1)]


def test_a_validation_window_before_the_split_never_reads_a_scored_row(link):
    """A recipe chosen on the validation split is chosen without the rows the replay scores: training
    reads rows before the validation window, the judgement the requests inside it, and nothing from
    the scored window on is in either, twins included."""
    scenario, trace, template = link
    validating, before = adapt.validation_split(scenario, trace, 200)
    assert adapt.scored_window(validating) == (600.0, 800.0)
    split = adapt.split_by_time(validating, before, template)
    assert split.outside == [(0.0, 600.0)] and split.reports_outside == sum(row.time_s < 600 for row in trace.rows)
    assert max(e.time_s for e in split.training) < 600 <= min(e.time_s for e in split.held_out)
    assert max(e.time_s for e in split.held_out) < 800 and len(split.held_out) > 100
    twins = adapt.counterfactual_twins(validating, before, template, 200, seed=1)
    assert len(twins) == 200 and max(e.time_s for e in twins) < 600
    with pytest.raises(adapt.AdaptError, match="must be shorter than that"):
        adapt.validation_split(scenario, trace, 800)


def test_adapt_on_trace_rows_says_what_it_trained_on_and_held_out(tiny_gguf, tmp_path, capsys):
    require_module("peft")
    out = tmp_path / "adapter"
    code = main(["adapt", "link", "--rows", "trace", "--prompt", "replay", "--model", str(tiny_gguf), "--out",
                 str(out), "--examples", "16", "--eval-examples", "8", "--steps", "2", "--batch-size", "4",
                 "--no-progress"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "trained on 16 of the trace's 9600 KPI reports outside the window the replay scores (0 s to 800 s of " \
           "trace time; a seeded sample), each rendered as the replay's request for this template" in printed
    assert "held out the 8 requests the replay scores for this template (from 800 s on of trace time)" in printed
    for line in ("with the adapter", "base model (no adapter)",
                 "base model prompted with the template (6 examples)", "majority class"):
        assert line in printed
    manifest = json.loads((out / "ricllm_adapt.json").read_text())
    assert manifest["rows"] == "trace" and manifest["training"]["rows"] == 16
    assert manifest["training"]["spans_s"] == [[0.0, 800.0]] and manifest["training"]["reports_outside"] == 9600
    assert manifest["held_out"] == {"source": "the requests the replay scores", "rows": 8, "window_s": [800.0, None],
                                    "seen_in_training": 0}


def test_counterfactual_twins_move_one_kpi_across_a_threshold_and_take_the_policys_answer(link):
    scenario, trace, template = link
    twins = adapt.counterfactual_twins(scenario, trace, template, 300, seed=1)
    assert len(twins) == 300 and all(t.time_s < 800 for t in twins)  # twins of the unscored reports only
    assert all(re.fullmatch(r"RSRP: \S+ dBm\. SINR: \S+ dB\. PRB usage: \S+ %\.", t.user) for t in twins)
    reports: dict[float, list[dict]] = {}
    for row in trace.rows:
        reports.setdefault(row.time_s, []).append({k: row.kpis.get(k) for k in template.kpis})
    cuts = {(kpi, bound) for kpi in template.kpis for bound in template.thresholds(kpi)}
    moved_labels = 0
    for twin in twins:
        assert twin.expected == template.policy.expected(twin.kpis)

        def crossed(source: dict) -> bool:
            changed = [k for k in template.kpis if source[k] != twin.kpis[k]]
            return len(changed) == 1 and source[changed[0]] is not None and any(
                kpi == changed[0] and (source[kpi] < bound) != (twin.kpis[kpi] < bound) for kpi, bound in cuts)
        sources = [source for source in reports[twin.time_s] if crossed(source)]
        assert sources, twin
        moved_labels += all(template.policy.expected(s) != twin.expected for s in sources)
    assert moved_labels >= 50  # many twins answer other than the report they were made from
    assert adapt.counterfactual_twins(scenario, trace, template, 300, seed=1) == twins


def test_twins_that_reach_the_range_go_past_the_mirror_image(link):
    """``mirror`` twins stay within the report's own distance of the number; ``range`` twins reach
    anywhere on the other side, so high-SINR reports of a low-load hour also come back loaded."""
    scenario, trace, template = link

    def loaded_raise_candidates(reach: str) -> list[float]:
        twins = adapt.counterfactual_twins(scenario, trace, template, 600, seed=2, reach=reach)
        assert all(t.expected == template.policy.expected(t.kpis) for t in twins)
        return [t.kpis["RRU.PrbTotDl"] for t in twins if t.expected == {"action": "hold"}
                and (t.kpis["L1M.DL-SS-SINR"] or 0) > 16 and t.kpis["RRU.PrbTotDl"] >= 50]

    mirror, far = loaded_raise_candidates("mirror"), loaded_raise_candidates("range")
    assert mirror and far and max(far) > 90 and sorted(far)[len(far) // 2] > sorted(mirror)[len(mirror) // 2]


def test_trace_rows_mixed_with_counterfactual_twins_say_so(tiny_gguf, tmp_path, capsys):
    out = tmp_path / "adapter"
    printed = adapt_link_on(tiny_gguf, out, capsys, "--rows", "trace", "--prompt", "replay",
                            "--counterfactual-share", "0.25", "--examples", "16", "--eval-examples", "4", "--steps",
                            "1", "--judge", "adapter")
    assert "trained on 12 of the trace's 9600 KPI reports" in printed
    assert "and 4 counterfactual twins of those reports" in printed
    assert "with the adapter" in printed and "base model (no adapter)" not in printed  # --judge adapter
    training = json.loads((out / "ricllm_adapt.json").read_text())["training"]
    assert training["rows"] == 16 and training["counterfactual_rows"] == 4 and training["drawn_rows"] == 0


def test_paired_twins_are_twins_of_the_training_reports_themselves(link):
    """Each pair is a training report and that same report with one KPI moved across a number the
    policy reads, answered otherwise; a report is twinned at most once."""
    scenario, trace, template = link
    reports = adapt.split_by_time(scenario, trace, template, "replay", limit=200, seed=3).training
    pairs = adapt.paired_twins(scenario, trace, template, reports, 150, seed=3)
    assert len(pairs) == 150 and len({index for index, _ in pairs}) == 150
    for index, twin in pairs:
        report = reports[index]
        changed = [k for k in template.kpis if report.kpis[k] != twin.kpis[k]]
        assert twin.time_s == report.time_s and len(changed) == 1 and report.kpis[changed[0]] is not None
        assert any((report.kpis[changed[0]] < bound) != (twin.kpis[changed[0]] < bound)
                   for bound in template.thresholds(changed[0]))
        assert twin.expected == template.policy.expected(twin.kpis) != report.expected
    missing = [i for i, r in enumerate(reports) if any(v is None for v in r.kpis.values())
               and template.policy.expected(r.kpis) == {"action": "escalate"}]
    everything = adapt.paired_twins(scenario, trace, template, reports, len(reports), seed=3)
    assert not {index for index, _ in everything} & set(missing)  # a missing KPI decides it: no twin


def test_twins_may_lose_a_kpi_the_policy_asks_missing_of(link):
    scenario, trace, template = link
    assert template.missing_tested() == ["L1M.DL-SS-RSRP", "L1M.DL-SS-SINR"]
    reports = adapt.split_by_time(scenario, trace, template, "replay", limit=100, seed=4).training
    pairs = adapt.paired_twins(scenario, trace, template, reports, 100, seed=4, missing_share=1.0)
    assert len(pairs) > 90
    for index, twin in pairs:
        changed = [k for k in template.kpis if reports[index].kpis[k] != twin.kpis[k]]
        assert len(changed) == 1 and twin.kpis[changed[0]] is None and changed[0] in template.missing_tested()
        assert twin.expected == {"action": "escalate"} != reports[index].expected
    assert "n/a" in pairs[0][1].user
    twins = adapt.counterfactual_twins(scenario, trace, template, 400, seed=4, missing_share=0.25)
    escalating = [t for t in twins if t.expected == {"action": "escalate"}]
    assert 50 <= len(escalating) <= 150  # about a quarter; the rest cross a number
    assert all(sum(t.kpis[k] is None for k in template.missing_tested()) == 1 for t in escalating)


@pytest.mark.parametrize("schedule", ["constant", "cosine"])
def test_the_learning_rate_schedule_runs_over_the_steps_asked(schedule):
    require_module("torch")
    import torch

    from ricllm.replay.adapter_training import TrainingSettings, learning_rate_schedule

    weight = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.AdamW([weight], lr=1e-3)
    rate = learning_rate_schedule(optimizer, TrainingSettings(steps=10, learning_rate=1e-3, schedule=schedule))
    rates = []
    for _ in range(10):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        rate.step()
    assert rates[0] == pytest.approx(1e-3)
    if schedule == "constant":
        assert rates == pytest.approx([1e-3] * 10)
    else:  # falling every step, the last one's a fortieth of the first
        assert all(a > b for a, b in zip(rates, rates[1:])) and rates[-1] < 1e-3 / 40


def test_a_judgement_without_some_answer_says_which_rule_it_cannot_judge(tiny_gguf, tmp_path, capsys):
    """``link``'s 600-800 s hold no ``raise_mcs`` row: a recipe chosen there is blind to that rule."""
    printed = adapt_link_on(tiny_gguf, tmp_path / "adapter", capsys, "--rows", "trace", "--prompt", "replay",
                            "--validation-s", "200", "--examples", "16", "--steps", "1", "--judge", "adapter")
    unjudged = next(line for line in printed.splitlines() if line.startswith("no held-out row's answer is"))
    assert '{"action":"raise_mcs"}' in unjudged and '{"action":"hold"}' not in unjudged


def test_unit_batches_keep_a_report_with_its_twin():
    from ricllm.replay.adapter_training import TrainingSettings, unit_batches

    units = [[0, 7], [1], [2, 8], [3], [4, 9], [5], [6, 10]]
    batches = unit_batches(list(range(11)), units, TrainingSettings(batch_size=4, seed=5))
    seen = [next(batches) for _ in range(12)]
    assert all(1 <= len(batch) <= 4 for batch in seen)
    for batch in seen:
        for unit in units:
            assert set(unit) <= set(batch) or not set(unit) & set(batch)
    stream = [i for batch in seen for i in batch]
    assert sorted(stream[:11]) == sorted(stream[11:22]) == list(range(11))  # each pass: every row once


def test_paired_twins_train_in_one_batch_with_their_report_and_say_so(tiny_gguf, tmp_path, capsys):
    out = tmp_path / "adapter"
    printed = adapt_link_on(tiny_gguf, out, capsys, "--rows", "trace", "--prompt", "replay",
                            "--counterfactual-share", "0.5", "--counterfactual-pairs", "--examples", "16",
                            "--eval-examples", "4", "--steps", "1", "--judge", "adapter")
    assert "trained on 8 of the trace's 9600 KPI reports" in printed
    assert "counterfactual twins of those reports" in printed and "each in one batch with its report" in printed
    training = json.loads((out / "ricllm_adapt.json").read_text())["training"]
    assert training["counterfactual_pairs"] is True and 8 < training["rows"] <= 16


@pytest.mark.parametrize("argv, named", [
    (["adapt", "default", "--rows", "trace"], "--set pacing.start_s=SECONDS"),
    (["adapt", "link", "--rows", "trace", "--set", "pacing.start_s=5000"], "nothing to hold out"),
    (["adapt", "link", "--rows", "trace", "--eval-seed", "3"], "drop --eval-seed"),
    (["adapt", "link", "--drawn-share", "0.5"], "--drawn-share mixes drawn rows into --rows trace"),
    (["adapt", "link", "--rows", "trace", "--drawn-share", "1"], "--drawn-share must be in [0, 1), got 1.0"),
    (["adapt", "link", "--counterfactual-share", "0.5"], "--counterfactual-share mixes twins of the trace's reports"),
    (["adapt", "link", "--rows", "trace", "--drawn-share", "0.5", "--counterfactual-share", "0.5"],
     "must leave some trace reports: their sum is 1"),
    (["adapt", "link", "--validation-s", "200"], "--validation-s takes a positive number of seconds, with --rows trace"),
    (["adapt", "link", "--rows", "trace", "--validation-s", "900"], "--validation-s 900 leaves no rows to train on"),
    (["adapt", "link", "--rows", "trace", "--counterfactual-pairs"], "--counterfactual-pairs pairs each twin"),
], ids=["nothing-outside", "nothing-scored", "eval-seed", "drawn-share-without-trace", "drawn-share-whole",
        "twins-without-trace", "no-reports-left", "validation-without-trace", "validation-too-long",
        "pairs-without-twins"])
def test_trace_rows_refuse_a_split_that_cannot_hold(argv, named, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert named in err and "Traceback" not in err


def test_judging_with_shared_tokens_run_once_ranks_answers_as_the_whole_request(tiny_gguf, link):
    """The template's conversation runs once and each row's request once, its answers branching
    after it: each answer's score differs from the whole request's by the same amount for every
    answer of a row (the answers' shared first tokens), so the choice is the same."""
    require_module("transformers")
    import torch

    from ricllm.replay.adapter_training import answer_log_probs, answer_scores, collate, load_base_model
    from ricllm.replay.templates import scenario_templates

    scenario, trace, template = link
    tokenizer = open_checkpoint(tiny_gguf).tokenizer
    model = load_base_model(tiny_gguf).eval()
    texts = [template.answer_text(answer) for answer in template.answers]
    held_out = adapt.split_by_time(scenario, trace, template).held_out
    by_length: dict[int, list] = {}
    for example in held_out[:40]:
        by_length.setdefault(len(adapt.request_ids(tokenizer, "", example.user)), []).append(example)
    same = max(by_length.values(), key=len)[:3]  # rows that run as one batch
    examples = same + [e for e in held_out if None in e.kpis.values()][:1]  # and a stem of another length
    assert len(same) > 1 and examples[-1] not in same
    for system, batch in ((adapt.default_system_prompt(template), 8192),
                          (scenario_templates(scenario)["link"].message_list, 64)):
        items = [adapt.tokenize_example(tokenizer, system, adapt.Example(e.kpis, e.user, {}, text))
                 for e in examples for text in texts]
        with torch.no_grad():
            whole = answer_log_probs(model, collate(items, pad_id=0))
            branched = answer_scores(model, tokenizer, system, texts, examples, progress=False, tokens_per_batch=batch)
        for row, scores in enumerate(branched):
            full = whole[row * len(texts):(row + 1) * len(texts)]
            shift = full[0] - scores[0]
            assert [s + shift for s in scores] == pytest.approx(full, abs=2e-4)


def test_training_runs_the_shared_system_prompt_once_for_the_same_loss_and_gradients(tiny_gguf, scenario, trace,
                                                                                  congestion):
    require_module("peft")
    import torch

    from ricllm.replay.adapter_training import TrainingSettings, batch_loss, load_base_model, with_lora

    tokenizer = open_checkpoint(tiny_gguf).tokenizer
    system = adapt.default_system_prompt(congestion)
    items = [adapt.tokenize_example(tokenizer, system, e)
             for e in adapt.make_examples(scenario, trace, congestion, 4, seed=0)]
    shared = len(adapt.request_ids(tokenizer, system, "")) - 8  # the system turn and more
    model = with_lora(load_base_model(tiny_gguf), TrainingSettings(seed=0))
    for p in model.parameters():  # PEFT starts B at zero: give the adapter a part in the prefix's K/V
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.05)
    results = []
    for prefix in (0, shared):
        loss = batch_loss(model, items, prefix, pad_id=0)
        loss.backward()
        grads = [p.grad.clone() for p in model.parameters() if p.requires_grad]
        model.zero_grad()
        results.append((loss.item(), grads))
    assert results[1][0] == pytest.approx(results[0][0], rel=1e-5)
    for whole, once in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(once, whole, rtol=1e-4, atol=1e-6)


def test_drawn_rows_judged_on_the_scored_requests_take_ranges_from_outside_the_window(link, tiny_gguf, tmp_path,
                                                                                      capsys):
    scenario, trace, template = link
    outside = adapt.unscored_part(scenario, trace)
    assert outside.rows and all(row.time_s < 800 for row in outside.rows)
    assert len(outside.rows) == sum(row.time_s < 800 for row in trace.rows)
    out = tmp_path / "adapter"
    printed = adapt_link_on(tiny_gguf, out, capsys, "--rows", "drawn", "--held-out", "scored", "--prompt", "replay",
                            "--examples", "16", "--eval-examples", "8", "--steps", "2")
    assert "trained on 16 rows drawn from the KPI ranges of the trace's rows outside the window the replay " \
           "scores (0 s to 800 s of trace time" in printed
    assert "held out the 8 requests the replay scores for this template (from 800 s on of trace time)" in printed
    manifest = json.loads((out / "ricllm_adapt.json").read_text())
    assert manifest["held_out"]["source"] == "the requests the replay scores" and manifest["held_out"]["rows"] == 8
    assert main(["adapt", "link", "--rows", "trace", "--held-out", "drawn"]) == 2
    assert "drop --held-out drawn" in capsys.readouterr().err


def test_adapt_on_gemma3_trains_an_adapter_the_engine_serves(tmp_path, capsys):
    """A base model without a chat template (a tiny random Gemma 3, 32-wide heads): training renders
    the engine's plain form, HF reads the file with ricllm's attention scale, and the adapter it writes
    is read back and served, moving the engine's logits."""
    require_module("peft")
    import torch

    from ricllm import LLM, LoRARequest, SamplingParams
    from ricllm.replay.adapter_training import load_base_model
    from tests.helpers import write_tiny_gemma3_gguf

    gguf = write_tiny_gemma3_gguf(tmp_path / "tiny_gemma3.gguf", seed=3)
    checkpoint = open_checkpoint(gguf)
    assert not checkpoint.tokenizer.has_chat_template
    assert load_base_model(gguf, checkpoint.spec).config.query_pre_attn_scalar == checkpoint.spec.head_dim == 32
    out = tmp_path / "adapter"
    code = main(["adapt", "default", "--template", "energy", "--model", str(gguf), "--out", str(out),
                 "--examples", "16", "--eval-examples", "8", "--steps", "3", "--batch-size", "4",
                 "--learning-rate", "0.05", "--no-progress"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "with the adapter" in printed and "base model (no adapter)" in printed
    adapter = load_lora_adapter(out, checkpoint.spec)
    assert len(list(adapter.projections())) == 7 * checkpoint.spec.num_layers

    llm = LLM(str(gguf), dtype="float32", kv_cache_budget="8MiB", weight_cache=False)
    from tests.recorder import LogitsRecorder

    recorder = LogitsRecorder(llm.engine)
    params = SamplingParams(max_tokens=1)
    base, tuned = (llm.generate([[5, 6, 7, 8]], params, lora_request=request)[0]
                   for request in (None, LoRARequest("energy", str(out))))
    moved = (recorder.stacked(tuned.request_id)[1] - recorder.stacked(base.request_id)[1]).abs().max().item()
    assert moved > 1e-3, f"the trained adapter moves the engine's logits by only {moved:g}"
    assert torch.isfinite(recorder.stacked(tuned.request_id)[1]).all()


def test_the_adapter_kept_is_the_mean_of_its_weights_over_the_last_steps(tiny_gguf, scenario, trace, congestion):
    """--average-last 0.5 of four steps keeps the mean of the weights after steps 3 and 4: the same
    seed's runs of three and four steps, averaged."""
    require_module("peft")
    import torch

    from ricllm.replay import adapter_training as at

    checkpoint = open_checkpoint(tiny_gguf)
    examples = adapt.make_examples(scenario, trace, congestion, 8, seed=0)
    system = adapt.default_system_prompt(congestion)

    def trained(steps: int, average_last: float = 0.0) -> list:
        settings = at.TrainingSettings(steps=steps, batch_size=4, average_last=average_last)
        torch.manual_seed(0)
        model = at.with_lora(at.load_base_model(checkpoint.path, checkpoint.spec, progress=False), settings)
        at.train(model, checkpoint.tokenizer, system, examples, settings, progress=False)
        return [p.detach().clone() for p in model.parameters() if p.requires_grad]

    third, fourth, averaged = trained(3), trained(4), trained(4, average_last=0.5)
    assert any(not torch.equal(a, b) for a, b in zip(third, fourth))
    for a, b, mean in zip(third, fourth, averaged):
        torch.testing.assert_close(mean, (a + b) / 2)
