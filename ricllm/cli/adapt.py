"""``ricllm adapt SCENARIO --template NAME``: train a LoRA adapter on a template's policy, judge it on
held-out rows beside the base model and the majority class, and save it in the PEFT layout.

The examples are ``ricllm.replay.adapt``'s, the training ``ricllm.replay.adapter_training``'s.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from ricllm.paths import cache_dir, file_digest

PROMPT_FORMS = ("raw", "replay")


def add_adapt_subparser(sub: argparse._SubParsersAction) -> None:
    """``ricllm adapt``: registered by ``ricllm.cli.build_parser``."""
    parser = sub.add_parser(
        "adapt", help="train a LoRA adapter that answers as a scenario template's policy",
        description="Train a LoRA adapter (PEFT format) that answers as a scenario template's policy (its `expect` "
                    "rules). KPI rows are drawn at random from the ranges of the scenario's trace (never its rows), "
                    "labelled by the policy, and rendered as the engine's chat request under a one-line system "
                    "prompt, with loss on the answer's tokens only; a row whose user prompt the replay scores is "
                    "dropped. Training runs on the CPU with HF transformers and peft. The adapter is then judged "
                    "on rows drawn with another seed: accuracy with and without it, beside always answering the "
                    "majority class. Exit status 2 for a mistake in the arguments or the scenario.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("scenario", nargs="?", default="default", help="scenario file, or a bundled scenario's name")
    parser.add_argument("--template", default=None,
                        help="the template whose policy to learn (default: the scenario's first template with one)")
    parser.add_argument("--model", default=None, help="base model, a .gguf file or an HF folder "
                        "(default: the installed SmolLM2-135M-Instruct)")
    parser.add_argument("--out", default=None, help="adapter folder (default: <cache>/adapters/<scenario>-<template>)")
    parser.add_argument("--examples", type=int, default=800, help="training rows")
    parser.add_argument("--eval-examples", type=int, default=200, help="held-out rows judged")
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps")
    parser.add_argument("--batch-size", type=int, default=8, help="rows per step")
    parser.add_argument("--learning-rate", type=float, default=1e-3, help="AdamW learning rate")
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank")
    parser.add_argument("--alpha", type=int, default=16, help="LoRA alpha (the update is scaled by alpha / rank)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the training rows and of training")
    parser.add_argument("--eval-seed", type=int, default=None, help="seed of the held-out rows (default: seed + 1)")
    parser.add_argument("--missing-share", type=float, default=0.08, help="share of rows with one KPI missing")
    parser.add_argument("--prompt", choices=PROMPT_FORMS, default="raw",
                        help="user prompt: raw, the KPIs the policy reads as numbers; replay, the scenario's own "
                             "user prompt (level-style prompts repeat the prompts the replay scores: counted)")
    parser.add_argument("--system", default=None, help="the system prompt trained under (default: one line naming "
                        "the template)")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.set_defaults(func=cmd_adapt)


def _check_args(args: argparse.Namespace) -> None:
    from ricllm.replay.adapt import AdaptError

    for name in ("examples", "eval_examples", "steps", "batch_size", "rank", "alpha", "threads"):
        if getattr(args, name) < 1:
            raise AdaptError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if not 0 <= args.missing_share < 1:
        raise AdaptError(f"--missing-share must be in [0, 1), got {args.missing_share}")


def cmd_adapt(args: argparse.Namespace) -> int:
    from ricllm.model.loader import open_checkpoint
    from ricllm.replay import adapt
    from ricllm.replay.loading import load_scenario, load_scenario_trace

    _check_args(args)
    scenario = load_scenario(args.scenario)
    template = adapt.template_policy(scenario, args.template)
    checkpoint = open_checkpoint(args.model)
    trace = load_scenario_trace(scenario)
    scored_requests = adapt.scored_requests(scenario, trace, template.name)
    scored = {request.user_prompt for request in scored_requests}
    eval_seed = args.seed + 1 if args.eval_seed is None else args.eval_seed
    draw = dict(prompt=args.prompt, missing_share=args.missing_share)
    training = adapt.make_examples(scenario, trace, template, args.examples, args.seed, exclude=scored, **draw)
    held_out = adapt.make_examples(scenario, trace, template, args.eval_examples, eval_seed,
                                   exclude=scored | {example.user for example in training}, **draw)
    if not training or not held_out:
        raise adapt.AdaptError("every drawn row's user prompt is one the replay scores; use --prompt raw")
    system = args.system or adapt.default_system_prompt(template)
    _print_data(scenario, template, training, held_out, scored, args, eval_seed, system)
    out = Path(args.out) if args.out else cache_dir() / "adapters" / f"{scenario.name}-{template.name}"
    manifest = {**_manifest(scenario, template, args, eval_seed, system, training, held_out, checkpoint.path),
                "scored_requests": len(scored_requests)}
    scored_majority = adapt.majority_share([r.expected for r in scored_requests]) if scored_requests else None
    return _train_and_judge(args, checkpoint, template, system, training, held_out, out, manifest, scored_majority)


def _train_and_judge(args, checkpoint, template, system, training, held_out, out: Path, manifest,
                     scored_majority: tuple[str, float] | None) -> int:
    import torch

    from ricllm.model.lora import load_lora_adapter
    from ricllm.replay import adapter_training as at
    from ricllm.replay.adapt import majority_share

    torch.set_num_threads(args.threads)
    settings = at.TrainingSettings(args.rank, args.alpha, args.steps, args.batch_size, args.learning_rate, args.seed)
    tokenizer, progress = checkpoint.tokenizer, not args.no_progress
    model = at.with_lora(at.load_base_model(checkpoint.path), settings)
    result = at.train(model, tokenizer, system, training, settings, progress)
    at.save_adapter(model, out, {**manifest, "final_loss": result.losses[-1]})
    adapter = load_lora_adapter(out, checkpoint.spec)
    tuned = at.accuracy(at.predict(model, tokenizer, system, template, held_out, progress=progress), held_out)
    with model.disable_adapter():
        base = at.accuracy(at.predict(model, tokenizer, system, template, held_out, progress=progress), held_out)
    label, majority = majority_share([example.expected for example in held_out])
    print(f"\nloss: {result.losses[0]:.4f} at step 1, {result.losses[-1]:.4f} at step {len(result.losses)}")
    print(f"held-out rows: {len(held_out)} (seed {manifest['held_out']['seed']})")
    print(f"{'':<28}{'correct':>10}")
    print(f"{'with the adapter':<28}{tuned:>9.1%}")
    print(f"{'base model (no adapter)':<28}{base:>9.1%}")
    print(f"{'majority class':<28}{majority:>9.1%}   (always {label})")
    if scored_majority is not None:
        print(f"(on the {manifest['scored_requests']} requests the replay scores for this template, the majority "
              f"class is {scored_majority[1]:.1%}: always {scored_majority[0]})")
    print(f"adapter: {out}, read back by ricllm: {sum(1 for _ in adapter.projections())} projections, "
          f"{adapter.num_parameters:,} parameters, {adapter.nbytes / 2**20:.2f} MiB as fp32, "
          f"content hash {adapter.content_hash[:12]}")
    return 0


def _print_data(scenario, template, training, held_out, scored, args, eval_seed, system) -> None:
    from ricllm.replay.adapt import class_counts, count_seen

    print(f"template {template.name!r} of scenario {scenario.name!r}: {len(template.answers)} answers, "
          f"policy reads {', '.join(template.kpis)}")
    print(f"trained on {len(training)} rows drawn from the trace's KPI ranges (seed {args.seed}, "
          f"{args.missing_share:.0%} with one KPI missing), {args.prompt} user prompts; rows per answer: "
          + ", ".join(f"{answer} {n}" for answer, n in class_counts(training).items()))
    print(f"held out {len(held_out)} rows (seed {eval_seed}); the replay scores {len(scored)} distinct prompts "
          f"for this template, {count_seen(training, scored)} of them seen in training")
    print(f"system prompt: {system!r}")


def _manifest(scenario, template, args, eval_seed, system, training, held_out, model_path) -> dict[str, Any]:
    from ricllm.replay.adapt import template_digest

    return {"scenario": scenario.name, "template": template.name,
            "policy": [{"when": r.when.text if r.when else None, "then": r.then} for r in template.policy.rules],
            "template_sha256": template_digest(scenario, template),
            "base_model": {"path": os.fspath(model_path), "sha256": file_digest(model_path)},
            "system_prompt": system, "prompt": args.prompt,
            "training": {"rows": len(training), "seed": args.seed, "source": "uniform over the trace's KPI ranges",
                         "missing_share": args.missing_share, "steps": args.steps, "batch_size": args.batch_size,
                         "learning_rate": args.learning_rate, "rank": args.rank, "alpha": args.alpha},
            "held_out": {"rows": len(held_out), "seed": eval_seed}}
