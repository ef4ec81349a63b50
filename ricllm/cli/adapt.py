"""``ricllm adapt SCENARIO --template NAME``: train a LoRA adapter on a template's policy, judge it on
held-out rows beside the base model and the majority class, and save it in the PEFT layout.

The examples are ``ricllm.replay.adapt``'s, the training ``ricllm.replay.adapter_training``'s.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ricllm.paths import cache_dir, file_digest

PROMPT_FORMS = ("raw", "replay")
ROW_SOURCES = ("drawn", "trace")
HELD_OUT = ("drawn", "scored")
JUDGED = ("all", "adapter")


def add_adapt_subparser(sub: argparse._SubParsersAction) -> None:
    """``ricllm adapt``: registered by ``ricllm.cli.build_parser``."""
    parser = sub.add_parser(
        "adapt", help="train a LoRA adapter that answers as a scenario template's policy",
        description="Train a LoRA adapter (PEFT format) that answers as a scenario template's policy (its `expect` "
                    "rules). Rows labelled by the policy are rendered as the engine's chat request under a one-line "
                    "system prompt, with loss on the answer's tokens only. With --rows drawn they are drawn at random "
                    "from the ranges of the scenario's trace (never its rows; a row whose user prompt the replay "
                    "scores is dropped) and judged on rows drawn with another seed; with --rows trace they are the "
                    "trace's own rows outside the window the replay scores (pacing.start_s, duration_s), judged on "
                    "the requests the replay scores. Training runs on the CPU with HF transformers and peft. The "
                    "judgement prints the share correct with the adapter, without it, and of the model prompted with "
                    "the template itself, beside always answering the majority class. Exit status 2 for a mistake "
                    "in the arguments or the scenario.",
        formatter_class=DefaultsWhereMeaningful)
    parser.add_argument("scenario", nargs="?", default="default", help="scenario file, or a bundled scenario's name")
    parser.add_argument("--template", default=None,
                        help="the template whose policy to learn (default: the scenario's first template with one)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="FIELD=VALUE",
                        help="override a scenario field, as ricllm replay does, e.g. --set pacing.start_s=40 "
                             "(repeatable)")
    parser.add_argument("--rows", choices=ROW_SOURCES, default="drawn",
                        help="drawn: rows drawn from the trace's KPI ranges, held out by another seed; trace: the "
                             "trace's rows outside the window the replay scores train, the scored requests are "
                             "held out")
    parser.add_argument("--held-out", choices=HELD_OUT, default=None,
                        help="what is judged: drawn, rows drawn with --eval-seed; scored, the requests the replay "
                             "scores (default: drawn with --rows drawn, scored with --rows trace). --rows drawn "
                             "--held-out scored draws the training rows from the ranges of the rows outside the "
                             "scored window")
    parser.add_argument("--model", default=None, help="base model, a .gguf file or an HF folder "
                        "(default: the installed SmolLM2-135M-Instruct)")
    parser.add_argument("--out", default=None, help="adapter folder (default: <cache>/adapters/<scenario>-<template>)")
    parser.add_argument("--examples", type=int, default=800, help="training rows (with --rows trace: at most this "
                        "many, a seeded sample of the rows outside the scored window)")
    parser.add_argument("--eval-examples", type=int, default=None, help="held-out rows judged (default: 200 drawn; "
                        "with --rows trace, every scored request)")
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps")
    parser.add_argument("--batch-size", type=int, default=8, help="rows per step")
    parser.add_argument("--learning-rate", type=float, default=1e-3, help="AdamW learning rate")
    parser.add_argument("--lr-schedule", choices=("constant", "cosine"), default="constant",
                        help="the learning rate over the steps: constant, or cosine from --learning-rate down to zero "
                             "at the last step")
    parser.add_argument("--average-last", type=float, default=0.0,
                        help="keep the mean of the adapter's weights over this share of the last steps (e.g. 0.2), "
                             "not the last step's; default 0: the last step's")
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank")
    parser.add_argument("--alpha", type=int, default=16, help="LoRA alpha (the update is scaled by alpha / rank)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the training rows and of training")
    parser.add_argument("--eval-seed", type=int, default=None, help="seed of the held-out drawn rows "
                        "(default: seed + 1)")
    parser.add_argument("--missing-share", type=float, default=0.08,
                        help="share of drawn rows with one KPI missing; with --counterfactual-share, the share of "
                             "twins made by losing one KPI the policy asks missing(KPI) of")
    parser.add_argument("--drawn-share", type=float, default=0.0,
                        help="with --rows trace: this share of the training rows is drawn from the KPI ranges of the "
                             "rows outside the scored window instead (the answers taking turns), so the thresholds get "
                             "rows on both sides that the trace's own hours do not give")
    parser.add_argument("--counterfactual-share", type=float, default=0.0,
                        help="with --rows trace: this share of the training rows are twins of reports outside the "
                             "scored window, each with one KPI moved across a number the policy compares it with "
                             "(to a value that KPI takes there) and labelled by the policy, so a rule that reads two "
                             "KPIs is told from one that reads only the first")
    parser.add_argument("--counterfactual-reach", choices=("mirror", "range", "both"), default="mirror",
                        help="how far a twin's KPI moves across the number: mirror, at most as far as it was from it; "
                             "range, anywhere on the other side within the KPI's range; both, each twin one or the "
                             "other")
    parser.add_argument("--counterfactual-pairs", action="store_true",
                        help="twin the training reports themselves (at most one twin each) and train each report in "
                             "one batch with its twin, so a step sees both sides of the number with all else alike")
    parser.add_argument("--validation-s", type=float, default=None, metavar="SECONDS",
                        help="with --rows trace: choose a recipe without the scored rows. The trace is cut where the "
                             "scored window starts; training reads only rows before its last SECONDS, and the "
                             "judgement reads the requests the replay would send in those SECONDS instead of the "
                             "scored ones")
    parser.add_argument("--prompt", choices=PROMPT_FORMS, default="raw",
                        help="user prompt: raw, the KPIs the policy reads as numbers; replay, the scenario's own "
                             "user prompt (level-style prompts repeat the prompts the replay scores: counted)")
    parser.add_argument("--system", default=None, help="the system prompt trained under (default: one line naming "
                        "the template)")
    parser.add_argument("--judge", choices=JUDGED, default="all",
                        help="what the held-out rows are asked of: all, the adapter, the base model and the base model "
                             "prompted with the template; adapter, the adapter alone (a recipe's training run, whose "
                             "replay report judges the rest)")
    parser.add_argument("--train-dtype", choices=("float32", "bfloat16", "auto"), default="float32",
                        help="the type training multiplies in (the weights, the adapter and the optimizer stay fp32): "
                             "bfloat16 takes about 0.7 of fp32's step time where the CPU multiplies it in hardware "
                             "(AVX-512 BF16, AMX), and is slower than fp32 elsewhere; auto takes it only there")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.set_defaults(func=cmd_adapt)


class DefaultsWhereMeaningful(argparse.ArgumentDefaultsHelpFormatter):
    """Each option's default after its help, except where the help already says it, or it is none,
    off or empty (an unset option, a bare flag, a repeatable one: "(default: None)" says nothing)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        unset = action.default is None or action.default is False or action.default == []
        if unset or "(default:" in (action.help or ""):
            return action.help or ""
        return super()._get_help_string(action)


@dataclass
class Rows:
    """What training reads and what the judgement reads, and how to say where each came from."""

    training: list
    held_out: list
    trained_on: str
    held_out_from: str
    seen: int  # held-out rows whose user prompt a training row has verbatim
    manifest: dict[str, Any]
    units: list[list[int]] | None = None  # training rows kept in one batch (a report and its twin); None: any


def _check_args(args: argparse.Namespace) -> None:
    from ricllm.replay.adapt import AdaptError

    for name in ("examples", "eval_examples", "steps", "batch_size", "rank", "alpha", "threads"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise AdaptError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    if not 0 <= args.missing_share < 1:
        raise AdaptError(f"--missing-share must be in [0, 1), got {args.missing_share}")
    if not 0 <= args.average_last <= 1:
        raise AdaptError(f"--average-last must be in [0, 1], got {args.average_last}")
    for name in ("drawn_share", "counterfactual_share"):
        if not 0 <= getattr(args, name) < 1:
            raise AdaptError(f"--{name.replace('_', '-')} must be in [0, 1), got {getattr(args, name)}")
    if args.drawn_share + args.counterfactual_share >= 1:
        raise AdaptError("--drawn-share and --counterfactual-share together must leave some trace reports: their sum "
                         f"is {args.drawn_share + args.counterfactual_share:g}")
    if args.drawn_share and args.rows != "trace":
        raise AdaptError("--drawn-share mixes drawn rows into --rows trace; with --rows drawn every row is drawn")
    if args.counterfactual_share and args.rows != "trace":
        raise AdaptError("--counterfactual-share mixes twins of the trace's reports into --rows trace; with --rows "
                         "drawn every row is drawn")
    if args.counterfactual_pairs and not args.counterfactual_share:
        raise AdaptError("--counterfactual-pairs pairs each twin with its report: give --counterfactual-share, the "
                         "share of the training rows that are twins")
    if args.rows == "trace" and args.held_out == "drawn":
        raise AdaptError("--rows trace holds out the requests the replay scores: drop --held-out drawn")
    if args.validation_s is not None and (args.rows != "trace" or args.validation_s <= 0):
        raise AdaptError("--validation-s takes a positive number of seconds, with --rows trace (the validation window "
                         f"is the trace's last seconds before the scored window), got {args.validation_s:g}")
    if (args.rows == "trace" or args.held_out == "scored") and args.eval_seed is not None:
        raise AdaptError("--eval-seed draws held-out rows; with --rows trace the held-out rows are the requests "
                         "the replay scores: drop --eval-seed")


def cmd_adapt(args: argparse.Namespace) -> int:
    from ricllm.model.loader import open_checkpoint
    from ricllm.replay import adapt
    from ricllm.replay.loading import load_scenario, load_scenario_trace

    _check_args(args)
    scenario = load_scenario(args.scenario, args.overrides)
    template = adapt.template_policy(scenario, args.template)
    trace = load_scenario_trace(scenario)
    if args.validation_s is not None:
        scenario, trace = adapt.validation_split(scenario, trace, args.validation_s)
    if args.rows == "trace":
        rows = _trace_rows(args, scenario, trace, template)
    elif args.held_out == "scored":
        rows = _drawn_split_rows(args, scenario, trace, template)
    else:
        rows = _drawn_rows(args, scenario, trace, template)
    checkpoint = open_checkpoint(args.model)
    system = args.system or adapt.default_system_prompt(template)
    _print_data(scenario, template, rows, args, system)
    validating = "" if args.validation_s is None else f"-validation-{args.validation_s:g}s"
    out = Path(args.out) if args.out else cache_dir() / "adapters" / f"{scenario.name}-{template.name}{validating}"
    scored_requests = adapt.scored_requests(scenario, trace, template.name)
    manifest = _manifest(scenario, template, args, system, checkpoint.path, rows, len(scored_requests))
    drawn = args.rows == "drawn" and bool(scored_requests)
    scored_majority = adapt.majority_share([r.expected for r in scored_requests]) if drawn else None
    return _train_and_judge(args, checkpoint, template, system, rows, out, manifest,
                            _prompted_conversation(scenario, template.name), scored_majority)


def _drawn_rows(args: argparse.Namespace, scenario, trace, template) -> Rows:
    from ricllm.replay import adapt

    scored = adapt.scored_prompts(scenario, trace, template.name)
    eval_seed = args.seed + 1 if args.eval_seed is None else args.eval_seed
    draw = dict(prompt=args.prompt, missing_share=args.missing_share)
    training = adapt.make_examples(scenario, trace, template, args.examples, args.seed, exclude=scored, **draw)
    held_out = adapt.make_examples(scenario, trace, template, args.eval_examples or 200, eval_seed,
                                   exclude=scored | {example.user for example in training}, **draw)
    if not training or not held_out:
        raise adapt.AdaptError("every drawn row's user prompt is one the replay scores; use --prompt raw")
    trained_on = (f"trained on {len(training)} rows drawn from the trace's KPI ranges (seed {args.seed}, "
                  f"{args.missing_share:.0%} with one KPI missing), {args.prompt} user prompts")
    held_out_from = (f"held out {len(held_out)} rows (seed {eval_seed}); the replay scores {len(scored)} distinct "
                     f"prompts for this template, {adapt.count_seen(training, scored)} of them seen in training")
    manifest = {"training": {"source": "uniform over the trace's KPI ranges", "rows": len(training),
                             "seed": args.seed, "missing_share": args.missing_share},
                "held_out": {"source": "uniform over the trace's KPI ranges", "rows": len(held_out), "seed": eval_seed,
                             "scored_prompts_seen_in_training": adapt.count_seen(training, scored)}}
    return Rows(training, held_out, trained_on, held_out_from, 0, manifest)


def _drawn_split_rows(args: argparse.Namespace, scenario, trace, template) -> Rows:
    """Rows drawn from the KPI ranges of the rows outside the scored window; the scored requests held out."""
    from ricllm.replay import adapt

    split = adapt.split_by_time(scenario, trace, template, args.prompt)
    scored = {example.user for example in split.held_out}
    training = adapt.make_examples(scenario, adapt.unscored_part(scenario, trace), template, args.examples, args.seed,
                                   prompt=args.prompt, missing_share=args.missing_share, exclude=scored)
    held = _scored_held_out(split, training, args.eval_examples)
    trained_on = (f"trained on {len(training)} rows drawn from the KPI ranges of the trace's rows outside the window "
                  f"the replay scores ({held.outside} of trace time; seed {args.seed}, {args.missing_share:.0%} with "
                  f"one KPI missing), {args.prompt} user prompts")
    manifest = {"training": {"source": "uniform over the KPI ranges of the rows outside the scored window",
                             "rows": len(training), "seed": args.seed, "missing_share": args.missing_share,
                             "spans_s": held.spans},
                "held_out": held.manifest}
    return Rows(training, held.rows, trained_on, held.said, held.seen, manifest)


def _trace_rows(args: argparse.Namespace, scenario, trace, template) -> Rows:
    from ricllm.replay import adapt

    drawn_count = round(args.drawn_share * args.examples)
    twin_count = round(args.counterfactual_share * args.examples)
    split = adapt.split_by_time(scenario, trace, template, args.prompt,
                                limit=args.examples - drawn_count - twin_count, seed=args.seed)
    drawn = adapt.make_examples(scenario, adapt.unscored_part(scenario, trace), template, drawn_count, args.seed,
                                prompt=args.prompt, missing_share=args.missing_share,
                                exclude={example.user for example in split.held_out}) if drawn_count else []
    units = None
    if args.counterfactual_pairs:
        pairs = adapt.paired_twins(scenario, trace, template, split.training, twin_count, args.seed, args.prompt,
                                   args.counterfactual_reach, args.missing_share)
        twins = [twin for _, twin in pairs]
        first_twin = len(split.training) + len(drawn)
        paired = {report: first_twin + k for k, (report, _) in enumerate(pairs)}
        units = [[i, paired[i]] if i in paired else [i] for i in range(first_twin)]
    else:
        twins = adapt.counterfactual_twins(scenario, trace, template, twin_count, args.seed, args.prompt,
                                           args.counterfactual_reach, args.missing_share)
    training = split.training + drawn + twins
    held = _scored_held_out(split, training, args.eval_examples)
    trained_on = (f"trained on {len(split.training)} of the trace's {split.reports_outside} KPI reports outside the "
                  f"window the replay scores ({held.outside} of trace time; a seeded sample), each rendered as the "
                  f"replay's request for this template"
                  + (f", and {len(drawn)} rows drawn from those reports' KPI ranges (seed {args.seed})"
                     if drawn else "")
                  + (f", and {len(twins)} counterfactual twins of those reports (one KPI moved across a number the "
                     "policy compares it with, relabelled by the policy"
                     + (", each in one batch with its report)" if units else ")") if twins else "")
                  + f", {args.prompt} user prompts")
    manifest = {"training": {"source": "trace reports outside the scored window", "rows": len(training),
                             "reports_outside": split.reports_outside, "drawn_rows": len(drawn),
                             "counterfactual_rows": len(twins), "counterfactual_reach": args.counterfactual_reach,
                             "counterfactual_pairs": args.counterfactual_pairs, "spans_s": held.spans,
                             "seed": args.seed},
                "held_out": held.manifest}
    return Rows(training, held.rows, trained_on, held.said, held.seen, manifest, units)


@dataclass
class HeldOut:
    """The scored requests judged, what the run says and records of them, and where training came from."""

    rows: list
    seen: int  # held-out rows whose user prompt a training row has verbatim
    said: str
    manifest: dict[str, Any]
    outside: str  # the trace spans training came from, in words
    spans: list  # the same spans for the manifest (None: open-ended)


def _scored_held_out(split, training: list, eval_examples: int | None) -> HeldOut:
    """The split's scored requests (the first ``eval_examples`` of them), and how many training saw verbatim."""
    held_out = split.held_out[:eval_examples] if eval_examples else split.held_out
    trained = {example.user for example in training}
    seen = [example for example in held_out if example.user in trained]
    start, end = split.scored_window
    said = (f"held out the {len(held_out)} requests the replay scores for this template ({_span(start, end)} of trace "
            f"time); {len(seen)} of them ({len({e.user for e in seen})} distinct prompts) appear verbatim in training")
    manifest = {"source": "the requests the replay scores", "rows": len(held_out),
                "window_s": [start, None if end == float("inf") else end], "seen_in_training": len(seen)}
    return HeldOut(held_out, len(seen), said, manifest, " and ".join(_span(lo, hi) for lo, hi in split.outside),
                   [[lo, None if hi == float("inf") else hi] for lo, hi in split.outside])


def _span(start: float, end: float) -> str:
    return f"from {start:g} s on" if end == float("inf") else f"{start:g} s to {end:g} s"


def _prompted_conversation(scenario, name: str) -> list[dict[str, str]]:
    """The template's own conversation (its system prompt with the policy, then its worked examples)."""
    from ricllm.replay.templates import scenario_templates

    return scenario_templates(scenario)[name].message_list


def _train_and_judge(args, checkpoint, template, system, rows: Rows, out: Path, manifest, prompted,
                     scored_majority: tuple[str, float] | None) -> int:
    import torch

    from ricllm.model.lora import load_lora_adapter
    from ricllm.replay import adapter_training as at

    torch.set_num_threads(args.threads)
    bf16, why = at.bf16_training(args.train_dtype)
    settings = at.TrainingSettings(args.rank, args.alpha, args.steps, args.batch_size, args.learning_rate, args.seed,
                                   bf16, args.lr_schedule, args.average_last)
    print(f"training multiplies in {'bfloat16' if bf16 else 'float32'} ({why}), {args.threads} threads")
    manifest = {**manifest, "training": {**manifest["training"], "dtype": "bfloat16" if bf16 else "float32"}}
    tokenizer = checkpoint.tokenizer
    model = at.with_lora(at.load_base_model(checkpoint.path, checkpoint.spec, progress=not args.no_progress), settings)
    result = at.train(model, tokenizer, system, rows.training, settings, not args.no_progress, rows.units)
    at.save_adapter(model, out, {**manifest, "final_loss": result.losses[-1]})
    adapter = load_lora_adapter(out, checkpoint.spec)
    print(f"\nloss: {result.losses[0]:.4f} at step 1, {result.losses[-1]:.4f} at step {len(result.losses)}")
    print(f"adapter: {out}, read back by ricllm: {sum(1 for _ in adapter.projections())} projections, "
          f"{adapter.num_parameters:,} parameters, {adapter.nbytes / 2**20:.2f} MiB as fp32, "
          f"content hash {adapter.content_hash[:12]}")
    _judge(args, model, tokenizer, template, system, rows, prompted)
    if scored_majority is not None:
        print(f"(on the {manifest['scored_requests']} requests the replay scores for this template, the majority "
              f"class is {scored_majority[1]:.1%}: always {scored_majority[0]})")
    return 0


def _judge(args, model, tokenizer, template, system, rows: Rows, prompted) -> None:
    """The table, a line as each way of asking is judged (the adapter's first)."""
    from ricllm.replay import adapter_training as at
    from ricllm.replay.adapt import majority_share

    held_out, progress = rows.held_out, not args.no_progress
    label, majority = majority_share([example.expected for example in held_out])
    print(f"held-out rows: {len(held_out)}")
    print(f"{'':<52}{'correct':>10}")
    print(f"{'majority class':<52}{majority:>9.1%}   (always {label})", flush=True)
    tuned = at.predict(model, tokenizer, system, template, held_out, progress=progress)
    print(f"{'with the adapter':<52}{at.accuracy(tuned, held_out):>9.1%}", flush=True)
    _print_misses(tuned, held_out)
    if args.judge == "all":
        _judge_base(model, tokenizer, template, system, held_out, prompted, progress)
    if rows.seen:
        trained = {example.user for example in rows.training}
        unseen = [(a, e) for a, e in zip(tuned, held_out) if e.user not in trained]
        share = sum(a == e.expected for a, e in unseen) / len(unseen) if unseen else float("nan")
        print(f"with the adapter, on the {len(unseen)} held-out rows whose prompt training never saw: {share:.1%}")


def _print_misses(predicted: list, held_out: list, shown: int = 5) -> None:
    """The adapter's misses by (policy's answer, adapter's answer), most common first: where a rule
    was learnt otherwise than the policy states it."""
    from ricllm.replay.adapt import miss_counts

    misses = miss_counts(predicted, held_out)
    if misses:
        said = ", ".join(f"{count} {expected} answered {answered}" for (expected, answered), count in misses[:shown])
        more = f" and {len(misses) - shown} more kinds" if len(misses) > shown else ""
        print(f"{'':<4}its misses: {said}{more}")


def _judge_base(model, tokenizer, template, system, held_out: list, prompted, progress: bool) -> None:
    """The base model under the adapter's system prompt, then prompted with the template itself."""
    from ricllm.replay import adapter_training as at

    shots = sum(1 for m in prompted if m["role"] == "assistant")
    with model.disable_adapter():
        base = at.predict(model, tokenizer, system, template, held_out, progress=progress)
        print(f"{'base model (no adapter)':<52}{at.accuracy(base, held_out):>9.1%}", flush=True)
        asked = at.predict(model, tokenizer, prompted, template, held_out, progress=progress)
        print(f"{f'base model prompted with the template ({shots} examples)':<52}{at.accuracy(asked, held_out):>9.1%}")


def _print_data(scenario, template, rows: Rows, args, system) -> None:
    from ricllm.replay.adapt import class_counts

    print(f"template {template.name!r} of scenario {scenario.name!r}: {len(template.answers)} answers, "
          f"policy reads {', '.join(template.kpis)}")
    print(f"{rows.trained_on}; rows per answer: "
          + ", ".join(f"{answer} {n}" for answer, n in class_counts(rows.training).items()))
    print(f"{rows.held_out_from}; rows per answer: "
          + ", ".join(f"{answer} {n}" for answer, n in class_counts(rows.held_out).items()))
    judged = {example.label for example in rows.held_out}
    unjudged = [template.answer_text(answer) for answer in template.answers
                if json.dumps(answer, sort_keys=True) not in judged]
    if unjudged:
        print(f"no held-out row's answer is {' or '.join(unjudged)}: how often such rows are answered otherwise, "
              "this judgement cannot tell (a validation window without them leaves that rule unjudged)")
    print(f"system prompt: {system!r}")


def _manifest(scenario, template, args, system, model_path, rows: Rows, scored_requests: int) -> dict[str, Any]:
    from ricllm.replay.adapt import template_digest

    training = {"steps": args.steps, "batch_size": args.batch_size, "learning_rate": args.learning_rate,
                "lr_schedule": args.lr_schedule, "average_last": args.average_last,
                "rank": args.rank, "alpha": args.alpha, "seed": args.seed, **rows.manifest["training"]}
    return {"scenario": scenario.name, "template": template.name, "overrides": list(args.overrides),
            "policy": [{"when": r.when.text if r.when else None, "then": r.then} for r in template.policy.rules],
            "template_sha256": template_digest(scenario, template),
            "base_model": {"path": os.fspath(model_path), "sha256": file_digest(model_path)},
            "system_prompt": system, "prompt": args.prompt, "rows": args.rows, "training": training,
            "held_out": rows.manifest["held_out"], "scored_requests": scored_requests,
            "validation_s": args.validation_s}
