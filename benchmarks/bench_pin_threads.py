"""A scenario's answers with the C kernels' team pinned one CPU per thread (``pin_threads``) or not.

Where the scheduler wakes a sleeping OpenMP worker on the CPU of the thread that woke it (which
then spins at the region's barrier), the worker runs only at the next scheduler tick, so the first
step after a pause pays 4-8 ms on a 2-CPU VM; the native runtime's ``pin_threads`` (default on)
keeps each thread of the team on a CPU of its own while a step runs (``ricllm.kernels.team``).

Runs ``ricllm replay SCENARIO --set engine.pin_threads=...`` in a process of its own per run: first
one untimed run per setting (each calibrates its own latency fit, cached after), then ``--rounds``
rounds of both settings, their order alternating. Per run, of the admitted requests: the server's
E2E at the median and p95, the median time to first token, the after-idle excess the error model
ends on (the 0.9 quantile of how far first steps after a gap ran past their busy bound), and the
admission bound / actual at the median and p99. Tables give the median [min–max] over rounds, and
pinned / unpinned of the medians.

    python benchmarks/bench_pin_threads.py                       # default scenario, 3 rounds
    python benchmarks/bench_pin_threads.py --scenario templates --rounds 3 --append
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

SETTINGS = {"unpinned": "false", "pinned": "true"}
METRICS = (("E2E p50, ms", "e2e_p50"), ("E2E p95, ms", "e2e_p95"), ("TTFT p50, ms", "ttft_p50"),
           ("after-idle multiplier", "after_idle_multiplier"), ("bound / actual p50", "ratio_p50"),
           ("bound / actual p99", "ratio_p99"))


def run_replay(scenario: str, setting: str, out: Path) -> dict[str, float]:
    command = [sys.executable, "-m", "ricllm.cli", "replay", scenario, "--out", str(out), "--no-progress",
               "--set", f"engine.pin_threads={SETTINGS[setting]}"]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode not in (0, 1):  # 1: a target missed, still a report
        sys.exit(f"bench_pin_threads: {' '.join(command)} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return figures(json.loads((out / "report.json").read_text()))


def figures(report: dict) -> dict[str, float]:
    from ricllm.report.aggregate import percentile

    admitted = [r for r in report["requests"] if r.get("admitted") and r.get("server_e2e_s")]
    e2e = [1e3 * r["server_e2e_s"] for r in admitted]
    ttft = [1e3 * r["server_ttft_s"] for r in admitted if r.get("server_ttft_s")]
    ratios = [r["predicted_e2e_s"] / r["server_e2e_s"] for r in admitted if r.get("predicted_e2e_s")]
    model = report["engine"]["admission"]["latency_model"]
    return {"e2e_p50": percentile(e2e, 50), "e2e_p95": percentile(e2e, 95), "ttft_p50": percentile(ttft, 50),
            "after_idle_multiplier": model["after_idle_multiplier"], "ratio_p50": percentile(ratios, 50),
            "ratio_p99": percentile(ratios, 99)}


def stat(values: list[float]) -> str:
    return f"{statistics.median(values):.3g} [{min(values):.3g}–{max(values):.3g}]"


def table(rounds: list[dict[str, dict[str, float]]]) -> str:
    lines = ["| per run | unpinned | pinned | pinned / unpinned (medians) |", "|---|---:|---:|---:|"]
    for label, key in METRICS:
        unpinned = [r["unpinned"][key] for r in rounds]
        pinned = [r["pinned"][key] for r in rounds]
        ratio = statistics.median(pinned) / statistics.median(unpinned) if statistics.median(unpinned) else None
        lines.append(f"| {label} | {stat(unpinned)} | {stat(pinned)} | {'-' if ratio is None else f'{ratio:.2f}'} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--scenario", default="default", help="bundled scenario name or file (default: default)")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds, each running both settings (default: 3)")
    parser.add_argument("--append", action="store_true", help="append the table to benchmarks/RESULTS.md")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from benchmarks.results import machine, publish
    from ricllm.kernels.cpu_library import cpu_family

    load_start = os.getloadavg()[0]
    rounds = []
    with tempfile.TemporaryDirectory(prefix="bench-pin-") as tmp:
        for setting in SETTINGS:  # untimed: each setting's latency fit is calibrated here, cached after
            run_replay(args.scenario, setting, Path(tmp) / f"warmup-{setting}")
            print(f"  warm-up: {setting} done", file=sys.stderr, flush=True)
        for r in range(args.rounds):
            order = list(SETTINGS) if r % 2 == 0 else list(SETTINGS)[::-1]
            rounds.append({s: run_replay(args.scenario, s, Path(tmp) / f"round{r}-{s}") for s in order})
            print(f"  round {r + 1} of {args.rounds}: " + ", ".join(
                f"{s} E2E p50 {rounds[-1][s]['e2e_p50']:.1f} ms" for s in order), file=sys.stderr, flush=True)
    details = (f"`ricllm replay {args.scenario}`, native runtime, kernel family {cpu_family() or 'none'}; one untimed "
               f"run per setting (calibrating), then {args.rounds} rounds of both, alternating, each run a process "
               f"of its own: median [min–max] over rounds. Load average (1 min) {load_start:.2f} at the start, "
               f"{os.getloadavg()[0]:.2f} at the end.\n")
    body = table(rounds)
    if args.append:
        publish(f"`{args.scenario}` with the team pinned or not (bench_pin_threads.py)", details, body, append=True)
    else:
        print(f"Machine: {machine()}. {details}\n{body}")


if __name__ == "__main__":
    main()
