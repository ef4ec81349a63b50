"""Which model should be the default: useful goodput over the bundled scenarios, per model.

Runs ``ricllm replay`` for every (model, scenario) pair, each in its own process, in interleaved
rounds (the models' order alternates from round to round), every model with its own adapters
(the scenarios' recipes train them on first use and cache them per base model). A *useful* answer
is valid, correct and on time; useful goodput is useful answers per second of trace. The table
gives each scenario's medians and ranges over the rounds, and the sum over the scenarios, which
decides the default: the model with the higher summed useful goodput.

The scenarios are the bundled ones that predate the models' comparison (default, templates,
overload, stress); the fresh benchmark templates (link, capacity) are bench_decisions.py's.

    python benchmarks/bench_models.py [--models smollm2-135m gemma3-270m] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT))  # last: no folder of ours shadows an installed package

from benchmarks.results import publish  # noqa: E402

SCENARIOS = ("default", "templates", "overload", "stress")
MODELS = ("smollm2-135m", "gemma3-270m")
FIELDS = ("sent", "useful", "useful_goodput_rps", "correct_of_answered", "met_of_admitted", "rejected",
          "bound_over_actual_p50", "bound_over_actual_p99")


def run_replay(model: str, scenario: str, out: Path) -> dict:
    """One replay's overall aggregates; exit 1 (a target missed) still wrote its report."""
    command = [sys.executable, "-m", "ricllm.cli", "replay", scenario, "--model", model, "--out", str(out),
               "--no-progress"]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode not in (0, 1):
        raise SystemExit(f"bench_models: {' '.join(command)} failed ({result.returncode}):\n{result.stderr[-3000:]}")
    overall = json.loads((out / "report.json").read_text())["aggregates"]["overall"]
    return {field: overall.get(field) for field in FIELDS}


def median_range(values: list[float | None], fmt: str) -> str:
    present = [v for v in values if v is not None]
    if not present:
        return "-"
    return f"{fmt.format(statistics.median(present))} [{fmt.format(min(present))}–{fmt.format(max(present))}]"


def model_order(models: list[str], round_index: int) -> list[str]:
    return models if round_index % 2 == 0 else models[::-1]


def measure(models: list[str], scenarios: list[str], rounds: int, out: Path) -> dict[tuple[str, str], list[dict]]:
    runs: dict[tuple[str, str], list[dict]] = {(m, s): [] for m in models for s in scenarios}
    for r in range(rounds):
        for model in model_order(models, r):
            for scenario in scenarios:
                folder = out / f"round{r + 1}" / model / scenario
                runs[model, scenario].append(run_replay(model, scenario, folder))
                row = runs[model, scenario][-1]
                print(f"round {r + 1}, {model}, {scenario}: useful {row['useful']} of {row['sent']}, "
                      f"goodput {row['useful_goodput_rps']}", file=sys.stderr, flush=True)
    return runs


def summed(runs: dict[tuple[str, str], list[dict]], model: str, scenarios: list[str], field: str,
           rounds: int) -> list[float]:
    """The field summed over the scenarios, one sum per round."""
    return [sum(runs[model, s][r][field] or 0 for s in scenarios) for r in range(rounds)]


def table(runs: dict[tuple[str, str], list[dict]], models: list[str], scenarios: list[str], rounds: int) -> str:
    head = ("| model | scenario | useful of sent | useful goodput (/s) | correct % answered | met % admitted "
            "| refused | bound/actual p50 | p99 |")
    lines = [head, "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for model in models:
        for scenario in scenarios:
            rows = runs[model, scenario]
            col = lambda field, fmt: median_range([row[field] for row in rows], fmt)  # noqa: E731
            lines.append(f"| {model} | {scenario} | {col('useful', '{:.0f}')} of {rows[0]['sent']} "
                         f"| {col('useful_goodput_rps', '{:.3f}')} | {col('correct_of_answered', '{:.1%}')} "
                         f"| {col('met_of_admitted', '{:.1%}')} | {col('rejected', '{:.0f}')} "
                         f"| {col('bound_over_actual_p50', '{:.2f}')} | {col('bound_over_actual_p99', '{:.2f}')} |")
        lines.append(f"| **{model}** | **sum** | {median_range(summed(runs, model, scenarios, 'useful', rounds), '{:.0f}')} "
                     f"| **{median_range(summed(runs, model, scenarios, 'useful_goodput_rps', rounds), '{:.3f}')}** "
                     "| | | | | |")
    return "\n".join(lines)


def verdict(runs: dict[tuple[str, str], list[dict]], models: list[str], scenarios: list[str], rounds: int) -> str:
    medians = {m: statistics.median(summed(runs, m, scenarios, "useful_goodput_rps", rounds)) for m in models}
    best = max(medians, key=medians.get)
    others = ", ".join(f"{m} {v:.3f}/s" for m, v in medians.items() if m != best)
    return f"Highest summed useful goodput (median of {rounds} rounds): **{best}**, {medians[best]:.3f}/s ({others})."


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(MODELS), help="installed short names or GGUF files")
    parser.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), help="bundled names or YAML files")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    parser.add_argument("--out", type=Path, help="report folders (default: a temporary folder, removed)")
    parser.add_argument("--no-publish", action="store_true", help="print the table without appending to RESULTS.md")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from ricllm.kernels.cpu_library import cpu_family

    with tempfile.TemporaryDirectory(prefix="bench-models-") as scratch:
        out = args.out or Path(scratch)
        runs = measure(args.models, args.scenarios, args.rounds, out)
    details = (f"Kernel family {cpu_family() or 'none'}; load average {os.getloadavg()[0]:.2f} at the end. "
               f"{args.rounds} interleaved rounds, medians [ranges]; each model with its own adapters. "
               + verdict(runs, args.models, args.scenarios, args.rounds))
    publish("Default model by useful goodput over the bundled scenarios", details,
            table(runs, args.models, args.scenarios, args.rounds), append=not args.no_publish)


if __name__ == "__main__":
    main()
